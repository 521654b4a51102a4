# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Writing volumes: NIfTI files written atomically with their affine in millimetres."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

__all__ = ["write_nifti"]


def write_nifti(path: str | os.PathLike, array: np.ndarray, affine: np.ndarray | None = None) -> Path:
    """Write a NIfTI file atomically (:func:`common.utils.write_atomic`: a crash or a refused write leaves the
    previous file or none, never a partial one); ``.nii.gz`` is compressed without a time stamp, so the same volume
    gives the same bytes.

    Args:
        path: destination ending in ``.nii`` or ``.nii.gz``; missing parent folders are created.
        array: the voxel data, written with its own dtype.
        affine: 4x4 voxel-to-world (RAS, mm) matrix; identity when ``None``.

    Returns:
        The written path.

    Raises:
        ValueError: when the suffix is not ``.nii``/``.nii.gz`` or the affine is not 4x4.
        common.utils.OutputWriteError: when the file system refuses the write.
    """
    import nibabel as nib

    from common.utils import write_atomic  # imported here: common.utils imports torch, this module does not

    file = Path(os.path.expanduser(os.fspath(path)))
    suffix = ".nii.gz" if file.name.endswith(".nii.gz") else ".nii" if file.name.endswith(".nii") else None
    if suffix is None:
        raise ValueError(f"write_nifti needs a .nii or .nii.gz path, got {str(file)!r}")
    affine = np.eye(4) if affine is None else np.asarray(affine, dtype=np.float64)
    if affine.shape != (4, 4):
        raise ValueError(f"affine for {str(file)!r} must be 4x4, got shape {affine.shape}")
    img = nib.Nifti1Image(np.asarray(array), affine)
    img.header.set_xyzt_units("mm")
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    payload = img.to_bytes()
    if suffix == ".nii.gz":
        payload = gzip.compress(payload, compresslevel=6, mtime=0)
    write_atomic(file, lambda handle: handle.write(payload))
    return file

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""What a file is, told from its name or first bytes without MONAI or ITK: the volume formats the collection lists,
DICOM files, a file's name without its image suffix; and the lock that serialises ITK's first use across threads.
The floor below :mod:`common.data.datalist`, :mod:`common.data.dicom` and :mod:`common.data.preflight`."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DICOM_MAGIC",
    "DICOM_MAGIC_OFFSET",
    "DICOM_SUFFIXES",
    "ITK_LOCK",
    "VOLUME_FORMATS",
    "VOLUME_SUFFIXES",
    "file_stem",
    "has_suffix",
    "is_dicom_file",
]

#: the volume file formats :func:`common.data.datalist.find_volumes` lists (name -> file suffixes); DICOM series are folders
VOLUME_FORMATS = {
    "NIfTI": (".nii", ".nii.gz"),
    "NRRD": (".nrrd", ".nhdr"),
    "MetaImage": (".mha", ".mhd"),
}
VOLUME_SUFFIXES = tuple(suffix for suffixes in VOLUME_FORMATS.values() for suffix in suffixes)
DICOM_SUFFIXES = (".dcm",)
DICOM_MAGIC_OFFSET, DICOM_MAGIC = 128, b"DICM"

#: ITK's lazily loaded Python modules are not safe to initialise from several threads at once
ITK_LOCK = threading.Lock()


def file_stem(path: Any) -> str:
    """The file name of ``path`` without its image suffix (``.nii.gz``, ``.nii``, ``.nrrd``, ``.nhdr``, ``.mha``,
    ``.mhd``, ``.dcm``); the folder name for a folder (a DICOM series)."""
    name = os.path.basename(str(path).rstrip("/\\"))
    for suffix in (*VOLUME_SUFFIXES, *DICOM_SUFFIXES):
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name


def has_suffix(name: str, suffixes: Sequence[str]) -> bool:
    """Whether ``name`` ends with one of ``suffixes`` (any case) and is more than the suffix."""
    lower = name.lower()
    return any(lower.endswith(suffix) and len(lower) > len(suffix) for suffix in suffixes)


def is_dicom_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DICOM file: a ``.dcm`` suffix, or any name that is not another volume format with the
    ``DICM`` marker at byte 128 (DICOM files are often named without a suffix, or by their UID)."""
    name = os.path.basename(os.fspath(path))
    if has_suffix(name, DICOM_SUFFIXES):
        return True
    if has_suffix(name, VOLUME_SUFFIXES):
        return False
    try:
        with open(path, "rb") as handle:
            handle.seek(DICOM_MAGIC_OFFSET)
            return handle.read(len(DICOM_MAGIC)) == DICOM_MAGIC
    except OSError:
        return False

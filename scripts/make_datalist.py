# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Build a training/validation datalist JSON from a folder of volumes (NIfTI, NRRD, MetaImage) or DICOM series: by
default every volume inference would read there (the same rule), ``--pattern`` narrowing it.

Example::

    python scripts/make_datalist.py --data_dir /data/brats --output datalist.json \\
        --pattern "*flair.nii.gz" --val_fraction 0.2 --seed 0
    python scripts/make_datalist.py --data_dir /data/ct_series --dicom
    python scripts/make_datalist.py --data_dir /data/BraTS2023-GLI-Training --brats
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

from common.data.datalist import (
    BRATS_MODALITIES,
    find_brats_cases,
    find_volumes,
    no_volumes_error,
    write_datalist,
)

__all__ = ["make_datalist", "split_items"]


def split_items(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """Shuffle ``items`` with ``seed`` and split them into training and validation.

    At least one item goes to validation when there are two or more, and at least one stays in training.

    Args:
        items: the paths (or entries) to split.
        val_fraction: the fraction for validation, in ``[0, 1)``.
        seed: seed of the shuffle.

    Returns:
        ``(training, validation)``.

    Raises:
        ValueError: when ``val_fraction`` is outside ``[0, 1)``.
    """
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    shuffled = list(items)
    random.Random(int(seed)).shuffle(shuffled)
    n_val = int(round(float(val_fraction) * len(shuffled)))
    if len(shuffled) >= 2:
        n_val = min(max(n_val, 1), len(shuffled) - 1)
    else:
        n_val = 0
    return shuffled[n_val:], shuffled[:n_val]


def make_datalist(
    data_dir: str,
    output: str | None = None,
    pattern: str | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    dicom: bool = False,
    brats: bool = False,
) -> Path:
    """Find the volumes, split them, write the datalist with paths relative to ``data_dir`` and print a summary.

    Args:
        data_dir: folder holding the volumes (searched recursively).
        output: the JSON file to write; defaults to ``<data_dir>/datalist.json``. Its paths are relative to
            ``data_dir``, so when it is written elsewhere pass ``base_dir=data_dir`` when loading it.
        pattern: ``None`` lists every volume as inference does (NIfTI, NRRD, MetaImage files and DICOM series
            folders: :func:`common.data.datalist.find_volumes`); a glob matched against the end of the path
            (``"*flair.nii.gz"``) lists only what matches; ignored with ``dicom``.
        val_fraction: fraction of volumes for validation, in ``[0, 1)``.
        seed: seed of the shuffle.
        dicom: list the DICOM series: a folder of DICOM files (``.dcm`` or the ``DICM`` marker) is one volume, and
            a folder holding several series gives one volume per series, written as the list of its files
            (:func:`common.data.datalist.find_volumes`).
        brats: list BraTS 2023 cases (``<case>/<case>-t1n|t1c|t2w|t2f[-seg].nii.gz``) as multi-modality entries
            ``{"case_id", "t1n", "t1c", "t2w", "t2f"[, "label"]}``; an incomplete case is an error naming it.

    Returns:
        The path of the written datalist.

    Raises:
        FileNotFoundError: when ``data_dir`` does not exist or nothing in it matches.
        ValueError: when ``val_fraction`` is outside ``[0, 1)``.
    """
    root = Path(os.path.expanduser(str(data_dir))).absolute()
    if not root.is_dir():
        raise FileNotFoundError(f"data_dir {str(root)!r} does not exist or is not a folder")
    if brats:
        items: list = find_brats_cases(root)
        what = "no BraTS case folders (<case>/<case>-t1n.nii.gz, ...)"
    elif dicom:
        items = find_volumes(root, dicom_only=True)
        what = "no folders holding DICOM files"
    else:
        items = find_volumes(root, pattern)
        if not items:
            raise no_volumes_error(root, pattern, options="--data_dir or --pattern")  # inference's rule and message
    if not items:
        raise FileNotFoundError(f"{what} under data_dir {str(root)!r}")
    training, validation = split_items(items, val_fraction, seed)
    sections = {"training": training}
    if validation:
        sections["validation"] = validation
    out = Path(os.path.expanduser(output)).absolute() if output else root / "datalist.json"
    keys = (*BRATS_MODALITIES, "label") if brats else ("image",)
    write_datalist(out, sections, base_dir=root, keys=keys)
    print(f"wrote {out}: {len(training)} training, {len(validation)} validation volumes (paths relative to {root})")
    if not validation:
        print("note: a single volume was found, so there is no validation section")
    if out.parent != root:
        print(f"note: {out} is not in data_dir; load it with base_dir={str(root)!r}")
    split: dict[str, list[str]] = {}
    for item in items:
        if isinstance(item.get("image"), list):
            split.setdefault(os.path.dirname(item["image"][0]), []).append(
                f"{item['case_id']} ({len(item['image'])} files)"
            )
    for folder, cases in split.items():
        print(f"note: {folder} holds {len(cases)} DICOM series, one case each: {', '.join(cases)}")
    return out


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    try:  # the command line's errors: one line, exit status 1
        fire.Fire(make_datalist, serialize=lambda _: None)
    except (OSError, ValueError) as exc:
        print(f"make_datalist: {exc}", file=sys.stderr)
        sys.exit(1)

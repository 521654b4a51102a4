# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""DICOM series: which series a folder holds, and a loader that reads one series whether it is given as its folder
or as a list of its files.

MONAI's ``ITKReader`` reads a folder as the first of the series GDCM finds in it (with a warning when there are
several) and a list of files as separate images stacked as channels, so a series given by its files cannot be
loaded. :class:`DicomSeriesReader` reads a folder only when it holds exactly one series (else the error lists the
series and how to choose one) and a list of DICOM files as one 3D series, in the slice order GDCM gives the files
of their folder, whatever the order of the list. :class:`LoadVolumed` is MONAI's ``LoadImaged`` with that reader
tried first for DICOM inputs; every other file goes to MONAI's readers as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from monai.data import ITKReader
from monai.transforms import LoadImaged
from monai.utils import ensure_tuple

from common.data.datalist import is_dicom_file
from common.data.preflight import ITK_LOCK

__all__ = [
    "DicomSeries",
    "DicomSeriesReader",
    "LoadVolumed",
    "dicom_series",
    "is_dicom_input",
    "series_files",
]


class DicomSeries(NamedTuple):
    """One series of a folder: its ``SeriesInstanceUID`` (with GDCM's series details), its files in slice order, its
    ``SeriesNumber`` and ``SeriesDescription`` (empty when the files do not carry them)."""

    uid: str
    files: list[str]
    number: str
    description: str


def _tag(file: str, tag: str) -> str:
    import itk

    io = itk.GDCMImageIO.New()
    io.SetFileName(file)
    io.ReadImageInformation()
    found, value = io.GetValueFromTag(tag, "")
    return str(value).strip() if found else ""


def dicom_series(folder: str | os.PathLike) -> list[DicomSeries]:
    """The DICOM series of ``folder`` (not its sub-folders) as MONAI's ``ITKReader`` tells them apart: GDCM with
    series details and the series date as restriction, files in slice order.

    Args:
        folder: the folder to scan; ``~`` is expanded.

    Returns:
        One :class:`DicomSeries` per series, in GDCM's order (empty when GDCM finds none).

    Raises:
        NotADirectoryError: when ``folder`` is not a folder.
    """
    import itk

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    if not os.path.isdir(folder):
        raise NotADirectoryError(f"{folder} is not a folder")
    with ITK_LOCK:
        names = itk.GDCMSeriesFileNames.New()
        names.SetUseSeriesDetails(True)
        names.AddSeriesRestriction("0008|0021")  # series date, as ITKReader
        names.SetDirectory(folder)
        found = []
        for uid in names.GetSeriesUIDs():
            files = [os.path.abspath(f) for f in names.GetFileNames(uid)]
            found.append(DicomSeries(str(uid), files, _tag(files[0], "0020|0011"), _tag(files[0], "0008|103e")))
    return found


def _describe(series: Sequence[DicomSeries]) -> str:
    parts = []
    for s in series:
        label = ", ".join(x for x in (f"number {s.number}" if s.number else "", repr(s.description)[1:-1]) if x)
        parts.append(f"{s.uid} ({len(s.files)} files{', ' + label if label else ''})")
    return "; ".join(parts)


def is_dicom_input(data: Any) -> bool:
    """Whether ``data`` is a folder or a list of two or more DICOM files (what :class:`DicomSeriesReader` reads; a
    single file, a multi-frame DICOM among others, is left to MONAI's readers)."""
    names = [os.path.expanduser(os.fspath(n)) for n in ensure_tuple(data)]
    if len(names) == 1:
        return os.path.isdir(names[0])
    return len(names) > 1 and all(os.path.isfile(n) and is_dicom_file(n) for n in names)


def series_files(data: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files of the one series that ``data`` (a folder, or a list of files of one series) names, in slice order.

    Args:
        data: a folder holding one series, or the files of one series (all in one folder, in any order).

    Returns:
        Absolute paths in GDCM's slice order (for a list: its files only, not the rest of their series).

    Raises:
        FileNotFoundError: for a folder without DICOM series, or listed files that are missing.
        ValueError: for a folder with several series, listed files of several series or folders, or listed files
            that are not slices of a series GDCM finds.
    """
    names = [os.path.abspath(os.path.expanduser(os.fspath(n))) for n in ensure_tuple(data)]
    if len(names) == 1 and os.path.isdir(names[0]):
        series = dicom_series(names[0])
        if not series:
            raise FileNotFoundError(f"{names[0]} holds no DICOM series")
        if len(series) > 1:
            raise ValueError(
                f"{names[0]} holds {len(series)} DICOM series, one is needed: {_describe(series)}. Put each series "
                "in its own folder, or list the files of one series as the image (make_datalist.py does so)"
            )
        return series[0].files
    missing = [n for n in names if not os.path.isfile(n)]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of {len(names)} series files do not exist (first: {missing[0]})")
    folders = sorted({os.path.dirname(n) for n in names})
    if len(folders) > 1:
        raise ValueError(f"the files of one DICOM series must be in one folder; they are in {len(folders)}: {folders}")
    wanted = {os.path.realpath(n) for n in names}
    holding = [s for s in dicom_series(folders[0]) if wanted & {os.path.realpath(f) for f in s.files}]
    if len(holding) > 1:
        raise ValueError(f"the listed files belong to {len(holding)} DICOM series: {_describe(holding)}")
    ordered = [f for f in holding[0].files if os.path.realpath(f) in wanted] if holding else []
    if len(ordered) != len(wanted):
        stray = sorted(wanted - {os.path.realpath(f) for f in ordered})
        raise ValueError(f"{len(stray)} listed files are not slices of a DICOM series (first: {stray[0]})")
    return ordered


class DicomSeriesReader(ITKReader):
    """MONAI's ``ITKReader`` for DICOM series given as a folder holding one series or as a list of files of one
    series (in any order): either is read as one 3D image, slices in GDCM's order (see :func:`series_files`).
    ``verify_suffix`` accepts exactly these inputs, so ``LoadImage`` auto-selection gives it nothing else."""

    def verify_suffix(self, filename: Sequence[str | os.PathLike] | str | os.PathLike) -> bool:
        return is_dicom_input(filename)

    def read(self, data: Sequence[str | os.PathLike] | str | os.PathLike, **kwargs: Any) -> Any:
        import itk

        files = series_files(data)
        return itk.imread(files[0] if len(files) == 1 else files, **{**self.kwargs, **kwargs})


class LoadVolumed(LoadImaged):
    """MONAI's ``LoadImaged`` (same arguments) whose automatic reader choice sends DICOM series - a folder, or a list
    of the files of one series - to :class:`DicomSeriesReader`; NIfTI, NRRD, MetaImage and the rest go to MONAI's
    readers as with ``LoadImaged``. With ``reader`` given, that reader is used as ``LoadImaged`` uses it."""

    def __init__(self, keys: Any, reader: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(keys, reader, *args, **kwargs)
        if reader is None:
            self._loader.register(DicomSeriesReader())

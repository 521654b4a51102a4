# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""DICOM series: which series a folder holds, and a loader that reads one series whether it is given as its folder
or as a list of its files.

MONAI's ``ITKReader`` reads a folder as the first of the series GDCM finds in it (with a warning when there are
several) and a list of files as separate images stacked as channels, so a series given by its files cannot be
loaded. :class:`DicomSeriesReader` reads a folder only when it holds exactly one series (else the error lists the
series and how to choose one) and a list of DICOM files as one 3D series, in the slice order GDCM gives the files
of their folder, whatever the order of the list. :class:`LoadVolumed` is MONAI's ``LoadImaged`` with that reader
tried first for DICOM inputs; every other file goes to MONAI's readers as before. :func:`series_problems` reads the
slice headers of a series and names what ITK would silently get wrong (a missing, duplicated or unevenly spaced
slice, or slices of another series or orientation).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from monai.data import ITKReader
from monai.transforms import LoadImaged
from monai.utils import ensure_tuple

from common.data.formats import ITK_LOCK, is_dicom_file

__all__ = [
    "DicomSeries",
    "DicomSeriesReader",
    "LoadVolumed",
    "dicom_series",
    "is_dicom_input",
    "series_files",
    "series_problems",
]

#: the header tags :func:`series_problems` reads from every slice (name -> DICOM tag)
GEOMETRY_TAGS = {
    "position": "0020|0032",  # ImagePositionPatient
    "orientation": "0020|0037",  # ImageOrientationPatient
    "series": "0020|000e",  # SeriesInstanceUID
    "rows": "0028|0010",
    "columns": "0028|0011",
}
#: direction cosines written by scanners carry 5-6 decimals; 1e-3 (0.06 degrees, 0.25 mm across a 250 mm field of
#: view) tells a rounded copy of one orientation from another orientation
ORIENTATION_TOLERANCE = 1e-3
#: a gap this many times the regular (median) spacing is a missing slice: one missing slice doubles a gap (2x),
#: so 1.5x separates that from any spacing a scanner writes with rounding
MISSING_SLICE_RATIO = 1.5
#: spacings may differ from the median by this fraction of it (1%: a 2 mm spacing may be 1.98-2.02 mm, a fiftieth
#: of a slice) ...
SPACING_RELATIVE_TOLERANCE = 0.01
#: ... and at least this much in mm: positions are decimal strings, often of 2-3 decimals, so a gap computed from
#: two of them is off by up to 0.01 mm from rounding alone
SPACING_ABSOLUTE_TOLERANCE = 0.01


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


class _Slice(NamedTuple):
    """What :func:`series_problems` reads from one file's header (``None``/empty where a tag is absent or invalid)."""

    file: str
    position: tuple[float, ...] | None
    orientation: tuple[float, ...] | None
    series: str
    size: str


def _numbers(value: str, count: int) -> tuple[float, ...] | None:
    """``count`` finite numbers from a DICOM multi-value string (``"0\\0\\2.5"``), or ``None``."""
    try:
        numbers = tuple(float(v) for v in value.split("\\"))
    except ValueError:
        return None
    return numbers if len(numbers) == count and all(math.isfinite(n) for n in numbers) else None


def _read_slice(file: str) -> _Slice:
    """The geometry tags of one file, reading its header only (not its pixel data).

    Raises:
        RuntimeError: what ITK raises for a file whose header it cannot read.
    """
    import itk

    with ITK_LOCK:
        io = itk.GDCMImageIO.New()
        io.SetFileName(file)
        io.ReadImageInformation()
        values = {}
        for name, tag in GEOMETRY_TAGS.items():
            found, value = io.GetValueFromTag(tag, "")
            values[name] = str(value).strip() if found else ""
    return _Slice(
        file,
        _numbers(values["position"], 3),
        _numbers(values["orientation"], 6),
        values["series"],
        f"{values['rows'] or '?'} rows x {values['columns'] or '?'} columns",
    )


def _series_label(files: Sequence[str], slices: Sequence[_Slice]) -> str:
    """How problem lines name a series: ``DICOM series <folder>``, with its SeriesInstanceUID when the folder holds
    other files too (a flat export of several series)."""
    folder = os.path.dirname(os.path.abspath(files[0]))
    try:
        others = len([n for n in os.listdir(folder) if not n.startswith(".")]) > len(files)
    except OSError:
        others = False
    uids = {s.series for s in slices if s.series}
    return f"DICOM series {folder}" + (f" (SeriesInstanceUID {uids.pop()})" if others and len(uids) == 1 else "")


def _first(files: Sequence[str]) -> str:
    """``<name>`` or ``<name> and <n> more`` for problem lines."""
    names = [os.path.basename(f) for f in files]
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


def _mixed(slices: Sequence[_Slice]) -> list[str]:
    """One line per header value (orientation, Rows x Columns, SeriesInstanceUID) that differs between slices."""
    problems = []
    reference = next((s.orientation for s in slices if s.orientation is not None), None)
    if reference is not None:
        turned = [
            s.file
            for s in slices
            if s.orientation is not None
            and max(abs(a - b) for a, b in zip(s.orientation, reference)) > ORIENTATION_TOLERANCE
        ]
        if turned:
            oriented = next(s.orientation for s in slices if s.file == turned[0])
            problems.append(
                f"mixed series: {len(turned)} of {len(slices)} files have another orientation (ImageOrientationPatient "
                f"{_format(oriented)} in {_first(turned)}, {_format(reference)} in the others)"
            )
    for name, what in (("size", "Rows x Columns"), ("series", "SeriesInstanceUID")):
        groups: dict[str, list[str]] = {}
        for s in slices:
            groups.setdefault(getattr(s, name) or "(none)", []).append(s.file)
        if len(groups) > 1:
            largest_first = sorted(groups.items(), key=lambda item: -len(item[1]))
            listing = ", ".join(f"{value} in {_first(group)}" for value, group in largest_first)
            problems.append(f"mixed series: its files differ in {what}: {listing}")
    return problems


def _format(values: Sequence[float]) -> str:
    return "\\".join(f"{v:g}" for v in values)


def _unplaced(slices: Sequence[_Slice]) -> list[str]:
    """One line per missing tag without which a slice cannot be placed in the volume."""
    problems = []
    for name, tag, attribute in (
        ("ImagePositionPatient", GEOMETRY_TAGS["position"], "position"),
        ("ImageOrientationPatient", GEOMETRY_TAGS["orientation"], "orientation"),
    ):
        lacking = [s.file for s in slices if getattr(s, attribute) is None]
        if lacking:
            problems.append(
                f"{len(lacking)} of {len(slices)} files have no valid {name} ({tag}), so their slice cannot be "
                f"placed: {_first(lacking)}"
            )
    return problems


def _duplicate_tolerance(positions: Sequence[float]) -> float:
    """How close two positions (ascending) along the normal are one position: a tenth of the median spacing between
    distinct positions (slices that overlap by 90% are the same slice), at least ``SPACING_ABSOLUTE_TOLERANCE``."""
    gaps = np.diff(np.asarray(positions, dtype=float))
    distinct = gaps[gaps > SPACING_ABSOLUTE_TOLERANCE]
    return max(SPACING_ABSOLUTE_TOLERANCE, 0.1 * float(np.median(distinct)) if distinct.size else 0.0)


def _duplicates(order: Sequence[tuple[float, str]], tolerance: float) -> tuple[list[str], list[float]]:
    """Problem lines for files at one position along the normal, and the distinct positions (ascending)."""
    groups: list[list[tuple[float, str]]] = []
    for item in order:
        if groups and item[0] - groups[-1][-1][0] <= tolerance:
            groups[-1].append(item)
        else:
            groups.append([item])
    problems = [
        f"duplicate slices: {len(g)} files at position {g[0][0]:.3f} mm along the slice normal: "
        + ", ".join(os.path.basename(f) for _, f in g[:4])
        + (", ..." if len(g) > 4 else "")
        for g in groups
        if len(g) > 1
    ]
    return problems, [g[0][0] for g in groups]


def _spacing_problems(positions: Sequence[float]) -> list[str]:
    """Problem lines for gaps between neighbouring slice positions (ascending, distinct): missing slices, then uneven
    spacing among the other gaps."""
    gaps = np.diff(np.asarray(positions, dtype=float))
    if gaps.size < 2:
        return []
    regular = float(np.median(gaps))
    problems = []
    missing = gaps > MISSING_SLICE_RATIO * regular
    for i in np.flatnonzero(missing):
        count = max(1, int(round(gaps[i] / regular)) - 1)
        problems.append(
            f"gap of {gaps[i]:.3f} mm between the slices at {positions[i]:.3f} mm and {positions[i + 1]:.3f} mm "
            f"along the slice normal, the regular spacing is {regular:.3f} mm: "
            + ("a missing slice?" if count == 1 else f"{count} missing slices?")
        )
    tolerance = max(SPACING_RELATIVE_TOLERANCE * regular, SPACING_ABSOLUTE_TOLERANCE)
    uneven = np.flatnonzero(~missing & (np.abs(gaps - regular) > tolerance))
    if uneven.size:
        i = int(uneven[0])
        others = gaps[~missing]
        problems.append(
            f"non-uniform slice spacing: {uneven.size} of {gaps.size} gaps differ from the regular spacing "
            f"{regular:.3f} mm by more than {tolerance:.3f} mm (gaps from {others.min():.3f} to {others.max():.3f} mm; "
            f"first {gaps[i]:.3f} mm between {positions[i]:.3f} mm and {positions[i + 1]:.3f} mm)"
        )
    return problems


def series_problems(files: Sequence[str | os.PathLike], allow_irregular: bool = False) -> list[str]:
    """What is wrong with the geometry of one DICOM series, from the headers of its files (no pixel data is read).

    ITK stacks the files of a series at a uniform spacing (first to last position over the number of files), with
    only a warning on stderr when they are not uniform, so a missing slice gives a volume of wrong geometry. The
    problems found here are: files that differ in orientation, Rows/Columns or SeriesInstanceUID (a mixed series);
    files without a valid position or orientation (their slice cannot be placed); two or more files at one position
    along the slice normal (duplicates); a gap between neighbouring slices larger than ``MISSING_SLICE_RATIO`` times
    the regular (median) spacing (missing slices); other gaps that differ from the regular spacing by more than 1% of
    it, and at least 0.01 mm (non-uniform spacing: the rounding of decimal positions stays below that). A single file
    (e.g. multi-frame) has no geometry problems and is not read.

    Args:
        files: the files of one series (what :func:`series_files` gives), in any order.
        allow_irregular: accept missing slices and non-uniform spacing, and a series none of whose files has a
            position or orientation (a secondary capture: the user accepts ITK's uniform geometry); duplicates, a
            series of which only some files can be placed and mixed series remain problems.

    Returns:
        One line per problem, each starting with ``DICOM series <folder>: ``; empty for a regular volume.
    """
    files = [os.fspath(f) for f in files]
    if len(files) < 2:
        return []
    slices, unreadable = [], []
    for file in files:
        try:
            slices.append(_read_slice(file))
        except Exception as exc:  # noqa: BLE001 - an unreadable header is a problem of the series, not a crash
            unreadable.append(f"{os.path.basename(file)} ({' '.join(str(exc).split())[:200]})")
    problems = [f"{len(unreadable)} files have no readable DICOM header: {unreadable[0]}"] if unreadable else []
    unplaced = all(s.position is None and s.orientation is None for s in slices)
    problems += _mixed(slices) + ([] if unplaced and allow_irregular else _unplaced(slices))
    if not problems and not unplaced:
        problems += _placement_problems(slices, allow_irregular)
    label = _series_label(files, slices)
    return [f"{label}: {problem}" for problem in problems]


def _placement_problems(slices: Sequence[_Slice], allow_irregular: bool) -> list[str]:
    """Duplicate slices and, unless ``allow_irregular``, missing slices and uneven spacing, of slices that share one
    orientation and all have a position."""
    orientation = np.asarray(slices[0].orientation, dtype=float)
    normal = np.cross(orientation[:3], orientation[3:])
    length = float(np.linalg.norm(normal))
    if length < 0.5:  # row and column cosines (near) parallel or not unit vectors
        return [
            f"ImageOrientationPatient {_format(slices[0].orientation)} has no slice normal (its row and column "
            "directions are parallel or zero)"
        ]
    normal /= length
    order = sorted((float(np.dot(s.position, normal)), s.file) for s in slices)
    problems, positions = _duplicates(order, _duplicate_tolerance([d for d, _ in order]))
    if not allow_irregular:
        problems += _spacing_problems(positions)
    return problems


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

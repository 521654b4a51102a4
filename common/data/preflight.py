# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Check every volume of a datalist before training starts and report all problems at once.

Example::

    python -m common.data.preflight datalist.json --patch_size "[96,96,96]"
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from common.data.datalist import (
    IN_MEMORY_SOURCE,
    DatalistError,
    MissingSectionError,
    parse_datalist_section,
    read_datalist_json,
)
from common.data.formats import ITK_LOCK
from common.errors import UserError, install_user_error_hook

__all__ = ["PreflightError", "check_volume", "main", "preflight", "screen_entries"]

NIFTI_SUFFIXES = (".nii", ".nii.gz")
SLAB_BYTES = 32 * 1024 * 1024
MAX_VOLUME_BYTES = 16 * 1024**3  # a header declaring more voxel data than this is refused as corrupt or hostile


class PreflightError(UserError, ValueError):
    """Every problem found by :func:`preflight`, one per line after a header naming the datalist.

    Args:
        problems: one line per problem, ``"<section>[<index>] <path>: <reason>"`` (with ``" (case <case_id>)"``
            after the index when the entry has a ``case_id``).
        source: the datalist the problems were found in.
    """

    def __init__(self, problems: Sequence[str], source: str) -> None:
        self.problems = list(problems)
        self.source = source
        header = f"preflight found {len(self.problems)} problem(s) in {source}:"
        super().__init__("\n".join([header] + [f"  {line}" for line in self.problems]))


def _validate_patch_size(patch_size: Sequence[int] | None) -> tuple[int, ...] | None:
    """Return ``patch_size`` as a tuple of 3 positive ints, or ``None``.

    Raises:
        ValueError: when it is not 3 positive integers.
    """
    if patch_size is None:
        return None
    if isinstance(patch_size, (str, bytes)) or not isinstance(patch_size, Sequence) or len(patch_size) != 3:
        raise ValueError(f"patch_size must be 3 positive integers, got {patch_size!r}")
    if any(isinstance(p, bool) or not float(p).is_integer() or int(p) < 1 for p in patch_size):
        raise ValueError(f"patch_size must be 3 positive integers, got {patch_size!r}")
    return tuple(int(p) for p in patch_size)


class _Inspection(NamedTuple):
    """What reading one volume found.

    Attributes:
        reason: why the volume is unusable, or ``None``.
        spatial: its spatial shape after channel-first handling, where the layout could be determined.
        channels: its number of channels after channel-first handling (1 for a volume without channel axis).
    """

    reason: str | None
    spatial: tuple[int, ...] | None = None
    channels: int | None = None


class _Reading(NamedTuple):
    """How to read a volume and what it must satisfy.

    Attributes:
        patch: the smallest spatial size (``None``: any), unless ``allow_pad``.
        allow_pad: smaller volumes are padded, so their size is no problem.
        check_values: read every voxel and count the non-finite ones.
        size_name: how problems name ``patch`` (e.g. ``volume_size`` for whole-volume models).
        header_only: read the header only (no voxel data).
        series_geometry: read the header of every slice of a DICOM series and report missing, duplicated or unevenly
            spaced slices and mixed series (:func:`common.data.dicom.series_problems`).
        allow_irregular: with ``series_geometry``, accept missing slices and uneven spacing.
    """

    patch: tuple[int, ...] | None
    allow_pad: bool
    check_values: bool = True
    size_name: str = "patch_size"
    header_only: bool = False
    series_geometry: bool = True
    allow_irregular: bool = False

    def shape_reason(self, spatial: tuple[int, ...] | None, full: tuple[int, ...]) -> str | None:
        """Why a volume of spatial shape ``spatial`` (``None``: its layout is unknown) and array shape ``full`` is
        unusable, or ``None``."""
        if spatial is None:
            return f"has shape {full}; expected (X, Y, Z), (X, Y, Z, C) channels last, or (X, Y, Z, 1, C)"
        non_singleton = sum(1 for s in spatial if s > 1)
        if len(spatial) != 3 or non_singleton < 3:
            return f"is {non_singleton}D (shape {full}); a 3D volume is required"
        if self.patch is not None and not self.allow_pad and any(s < p for s, p in zip(spatial, self.patch)):
            return f"shape {spatial} is smaller than {self.size_name} {self.patch} and padding is disabled"
        return None


def _validate_channel_count(value: Any, name: str) -> int | None:
    """Return ``value`` as a positive int, or ``None`` for ``None``.

    Raises:
        ValueError: naming ``name`` when ``value`` is not a positive whole number.
    """
    if value is None:
        return None
    if not _positive_integer(value) or isinstance(value, str):
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return int(value)


def _validate_num_channels(num_channels: int | Mapping[str, int] | None, keys: Sequence[str]) -> dict[str, int]:
    """Expected channel count per key: one count for every key, or a mapping over some of ``keys``.

    Raises:
        ValueError: when a count is not a positive integer or the mapping names a key that is not in ``keys``.
    """
    if num_channels is None:
        return {}
    if not isinstance(num_channels, Mapping):
        count = _validate_channel_count(num_channels, "num_channels")
        return {k: count for k in keys}
    expected: dict[str, int] = {}
    for key, value in num_channels.items():
        if key not in keys:
            raise ValueError(f"num_channels names key {key!r}, which is not one of the checked keys {list(keys)}")
        count = _validate_channel_count(value, f"num_channels[{key!r}]")
        if count is not None:
            expected[key] = count
    return expected


def _channel_reason(channels: int | None, expected: int | None, key: str | None = None) -> str | None:
    """Reason why a volume has the wrong number of channels, or ``None`` (also when either count is unknown)."""
    if channels is None or expected is None or channels == expected:
        return None
    where = f" for key {key!r}" if key is not None else ""
    return f"has {channels} channel{'s' if channels != 1 else ''}; {expected} expected{where}"


def _spatial_from_array_shape(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Spatial shape of a NIfTI-style array, channels last as ``EnsureChannelFirst`` reads them.

    Accepts ``(X, Y)``, ``(X, Y, Z)``, ``(X, Y, Z, C)`` and ``(X, Y, Z, 1, C)``; returns ``None`` for any other
    layout.
    """
    if len(shape) <= 3:
        return shape
    if len(shape) == 4 or (len(shape) == 5 and shape[3] == 1):
        return shape[:3]
    return None


def _channels_from_array_shape(shape: tuple[int, ...]) -> int:
    """Channel count of a NIfTI-style array whose layout :func:`_spatial_from_array_shape` accepts."""
    return int(shape[-1]) if len(shape) > 3 else 1


def _slabs(shape: tuple[int, ...], itemsize: int, max_bytes: int = SLAB_BYTES) -> Iterator[tuple[slice | int, ...]]:
    """Index tuples covering an array in Fortran (on-disk NIfTI) order, each one contiguous run of at most
    ``max_bytes`` on disk, so a compressed file is decompressed once, front to back."""
    if not shape:
        yield ()
        return
    axis = 0
    while axis + 1 < len(shape) and math.prod(shape[: axis + 1]) * itemsize <= max_bytes:
        axis += 1
    step = max(1, max_bytes // max(1, math.prod(shape[:axis]) * itemsize))
    head = tuple(slice(None) for _ in range(axis))
    for trailing in itertools.product(*(range(s) for s in reversed(shape[axis + 1 :]))):
        tail = tuple(reversed(trailing))
        for start in range(0, shape[axis], step):
            yield head + (slice(start, min(start + step, shape[axis])),) + tail


def _count_non_finite(block: np.ndarray) -> int:
    """Number of NaN/Inf values in ``block`` (0 for integer data)."""
    if not (np.issubdtype(block.dtype, np.floating) or np.issubdtype(block.dtype, np.complexfloating)):
        return 0
    return int(block.size - np.count_nonzero(np.isfinite(block)))


def _error_reason(exc: BaseException, prefix: str = "cannot be read") -> str:
    """One-line reason from an exception (reader messages, ITK's especially, span several lines)."""
    message = " ".join(str(exc).split())
    if len(message) > 400:
        message = message[:397] + "..."
    return f"{prefix}: {type(exc).__name__}: {message}"


def _non_finite_reason(count: int) -> str | None:
    return f"contains {count} non-finite voxels (NaN/Inf)" if count else None


def _declared_size_reason(shape: Sequence[int], itemsize: int) -> str | None:
    """Reason to refuse a header whose declared voxel data exceeds :data:`MAX_VOLUME_BYTES` (read before any
    voxel, so a corrupt or hostile header cannot make the check allocate it), or ``None``."""
    if any(int(s) < 0 for s in shape):
        return f"declares a negative dimension (shape {tuple(shape)}); the header is corrupt"
    declared = math.prod(int(s) for s in shape) * max(1, int(itemsize))
    if declared > MAX_VOLUME_BYTES:
        return (
            f"declares {declared / 1024**3:.1f} GiB of voxel data (shape {tuple(int(s) for s in shape)}), more than "
            f"the {MAX_VOLUME_BYTES / 1024**3:.0f} GiB limit of one volume; the header is corrupt or the volume "
            "must be resampled first"
        )
    return None


def _truncated_reason(path: str, img: Any, shape: Sequence[int], itemsize: int) -> str | None:
    """For an uncompressed NIfTI: reason when the file is shorter than its header's voxel data, or ``None``."""
    if not path.lower().endswith(".nii"):
        return None
    offset = int(img.dataobj.offset)
    needed = offset + math.prod(int(s) for s in shape) * itemsize
    size = os.path.getsize(path)
    if size < needed:
        return (
            f"is truncated: its header declares {needed} bytes (voxel data from offset {offset}), the file has {size}"
        )
    return None


def _itk_header_reason(path: str) -> str | None:
    """Read only the header of an ITK-readable file and refuse an absurd declared size (see
    :func:`_declared_size_reason`); ``None`` when fine or when ITK cannot read the header (the full read reports
    that)."""
    try:
        header = _itk_header(path)
    except Exception:  # noqa: BLE001 - the full read reports unreadable files
        return None
    return None if header is None else _declared_size_reason(header[0], header[2])


def _itk_header(path: str) -> tuple[list[int], int, int] | None:
    """``(dimensions, pixel components, bytes per voxel)`` from the header of an ITK-readable file, or ``None`` when
    no ITK reader recognises it. Raises what ITK raises for a header it recognises but cannot read."""
    import itk

    with ITK_LOCK:
        io = itk.ImageIOFactory.CreateImageIO(path, itk.CommonEnums.IOFileMode_ReadMode)
        if io is None:
            return None
        io.SetFileName(path)
        io.ReadImageInformation()
        shape = [int(io.GetDimensions(i)) for i in range(io.GetNumberOfDimensions())]
        components = max(1, int(io.GetNumberOfComponents()))
        return shape, components, int(io.GetComponentSize()) * components


def _series_header(files: list[str], reading: _Reading) -> _Inspection:
    """A DICOM series from its first file's header: its rows and columns, and one slice per file."""
    header = _itk_header(files[0])
    if header is None:
        return _Inspection(f"cannot be read: {files[0]} is not a DICOM file")
    shape, components, itemsize = header
    if len(files) > 1 or len(shape) < 3:
        shape = [*shape[:2], len(files)]
    return _header_inspection(shape, components, itemsize, reading)


def _header_inspection(shape: Sequence[int], components: int, itemsize: int, reading: _Reading) -> _Inspection:
    """What an ITK header's dimensions, pixel components and bytes per voxel say (declared size, 3D, size)."""
    full = tuple(shape) + ((components,) if components > 1 else ())
    reason = _declared_size_reason(full, itemsize) or reading.shape_reason(tuple(shape), full)
    return _Inspection(reason, tuple(shape), components)


def _check_nifti(path: str, reading: _Reading) -> _Inspection:
    """Check a NIfTI file, reading the data slab by slab so memory stays bounded (with ``reading.header_only``, not at
    all)."""
    import nibabel as nib

    try:
        img = nib.load(path, keep_file_open=True)
        full = tuple(int(s) for s in img.shape)
        spatial = _spatial_from_array_shape(full)
        itemsize = max(1, img.get_data_dtype().itemsize)
        reason = _declared_size_reason(full, itemsize) or _truncated_reason(path, img, full, itemsize)
    except Exception as exc:  # noqa: BLE001 - any reader failure is a reason, not a crash
        return _Inspection(_error_reason(exc))
    reason = reason or reading.shape_reason(spatial, full)
    if reason:
        return _Inspection(reason, spatial)
    channels = _channels_from_array_shape(full)
    if reading.header_only:
        return _Inspection(None, spatial, channels)
    non_finite = 0
    try:
        for index in _slabs(full, itemsize):
            block = np.asarray(img.dataobj[index])
            if reading.check_values:
                non_finite += _count_non_finite(block)
    except Exception as exc:  # noqa: BLE001
        return _Inspection(_error_reason(exc), spatial, channels)
    finally:
        img.uncache()
        opener = getattr(img.dataobj, "_opener", None)  # the handle kept open by keep_file_open=True
        if opener is not None and hasattr(opener, "close_if_mine"):
            opener.close_if_mine()
    return _Inspection(_non_finite_reason(non_finite), spatial, channels)


def _check_itk(path: str | list[str], reading: _Reading) -> _Inspection:
    """Check a DICOM series (a folder holding one series, or a list of the files of one series) as the bundles' loader
    (:class:`common.data.dicom.LoadVolumed`) reads it; its channels are ITK's pixel components. With ``header_only``,
    from its first file's header (:func:`_series_header`). With ``series_geometry``, the headers of all its slices
    are checked first (:func:`common.data.dicom.series_problems`: one reason line per problem)."""
    if isinstance(path, str):
        reason = _folder_reason(path)
        if reason:
            return _Inspection(reason)
    spatial: tuple[int, ...] | None = None
    components: int | None = None
    try:
        import itk

        # imported here: common.data.dicom imports MONAI, this module does not
        from common.data.dicom import series_files, series_problems

        try:  # one listed file is read as it is (LoadVolumed leaves it to MONAI's readers)
            files = list(path) if not isinstance(path, str) and len(path) == 1 else series_files(path)
        except (ValueError, FileNotFoundError) as exc:
            return _Inspection(
                str(exc).replace(f"{os.path.abspath(path)} holds", "holds", 1) if isinstance(path, str) else str(exc)
            )
        geometry = series_problems(files, reading.allow_irregular) if reading.series_geometry else []
        if geometry:
            return _Inspection("\n".join(geometry))
        if reading.header_only:
            return _series_header(files, reading)
        reason = _itk_header_reason(files[0])
        if reason:
            return _Inspection(reason)
        with ITK_LOCK:
            img = itk.imread(files[0] if len(files) == 1 else files)
        spatial = tuple(int(s) for s in img.GetLargestPossibleRegion().GetSize())
        components = int(img.GetNumberOfComponentsPerPixel())
        full = spatial + ((components,) if components > 1 else ())
        reason = reading.shape_reason(spatial, full)
        if reason or not reading.check_values:
            return _Inspection(reason, spatial, components)
        array = itk.array_view_from_image(img)
        non_finite = sum(_count_non_finite(array[z : z + 1]) for z in range(array.shape[0]))
    except Exception as exc:  # noqa: BLE001
        return _Inspection(_error_reason(exc), spatial, components)
    return _Inspection(_non_finite_reason(non_finite), spatial, components)


def _check_monai(path: str, reading: _Reading) -> _Inspection:
    """Check any other format with ``monai.transforms.LoadImage`` (its ``original_channel_dim`` metadata decides
    the layout and the channel count; without a channel axis the volume has 1 channel). With ``header_only``, from
    the header ITK reads (dimensions and pixel components)."""
    spatial: tuple[int, ...] | None = None
    channels: int | None = None
    try:
        from monai.transforms import LoadImage

        if reading.header_only:
            header = _itk_header(path)
            if header is None:
                return _Inspection("cannot be read: not a volume format (no reader recognises it)")
            return _header_inspection(*header, reading)

        reason = _itk_header_reason(path)
        if reason:
            return _Inspection(reason)
        with ITK_LOCK:
            img = LoadImage(image_only=True)(path)
        full = tuple(int(s) for s in img.shape)
        channel_dim = img.meta.get("original_channel_dim")
        if isinstance(channel_dim, (int, np.integer)) and not isinstance(channel_dim, bool) and full:
            spatial = tuple(s for axis, s in enumerate(full) if axis != int(channel_dim) % len(full))
            channels = full[int(channel_dim) % len(full)]
        else:
            spatial, channels = full, 1
        reason = reading.shape_reason(spatial, full)
        if reason or not reading.check_values:
            return _Inspection(reason, spatial, channels)
        array = img.numpy() if hasattr(img, "numpy") else np.asarray(img)
        non_finite = sum(_count_non_finite(array[i : i + 1]) for i in range(array.shape[0]))
    except Exception as exc:  # noqa: BLE001
        return _Inspection(_error_reason(exc), spatial, channels)
    return _Inspection(_non_finite_reason(non_finite), spatial, channels)


def _broken_link(path: str) -> str | None:
    """``"a broken symbolic link: its target <target> does not exist"`` (the target as an absolute path, and where a
    chain of links ends when that differs), or a link loop, for a symbolic link that leads nowhere; else ``None``."""
    if not os.path.islink(path) or os.path.exists(path):
        return None
    try:
        target = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), os.readlink(path)))
    except OSError:
        return "a broken symbolic link (its target cannot be read)"
    end = os.path.realpath(path)
    if os.path.islink(end):
        return f"a symbolic link loop (through {target})"
    via = f" (it leads to {end})" if end != target else ""
    return f"a broken symbolic link: its target {target}{via} does not exist"


def _folder_reason(folder: str) -> str | None:
    """Why a folder cannot be a DICOM series folder: it holds broken symbolic links (a slice may be lost), or no
    files; else ``None``."""
    names = sorted(os.listdir(folder))
    broken = [(name, _broken_link(os.path.join(folder, name))) for name in names if not name.startswith(".")]
    broken = [(name, reason) for name, reason in broken if reason]
    if broken:
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        return f"holds {len(broken)} broken symbolic link(s); {broken[0][0]} is {broken[0][1]}{more}"
    if not any(os.path.isfile(os.path.join(folder, name)) for name in names):
        return "is a folder without files; a DICOM series folder is required"
    return None


def _inspect(path: str | os.PathLike | Sequence[str], reading: _Reading) -> _Inspection:
    """Read one volume (see :func:`check_volume`), or with ``header_only`` its header (see :func:`screen_entries`);
    never raises for problems with the file."""
    try:
        if not isinstance(path, (str, os.PathLike)):
            files = [os.fspath(p) for p in path]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                broken = _broken_link(missing[0])
                first = missing[0] + (f", {broken}" if broken else "")
                return _Inspection(f"{len(missing)} of {len(files)} series files do not exist (first: {first})")
            return _check_itk(files, reading)
        path = os.fspath(path)
        broken = _broken_link(path)
        if broken:
            return _Inspection(f"is {broken}")
        if not os.path.exists(path):
            return _Inspection("does not exist")
        if os.path.isdir(path):
            return _check_itk(path, reading)
        if not os.path.isfile(path):
            return _Inspection("is not a regular file or a folder")
        if path.lower().endswith(NIFTI_SUFFIXES):
            return _check_nifti(path, reading)
        return _check_monai(path, reading)
    except Exception as exc:  # noqa: BLE001 - a bad file must never stop the whole check
        return _Inspection(_error_reason(exc, "cannot be checked"))


def check_volume(
    path: str | Sequence[str],
    patch_size: Sequence[int] | None = None,
    allow_pad: bool = True,
    check_values: bool = True,
    num_channels: int | None = None,
    allow_irregular_series: bool = False,
) -> str | None:
    """Check that one image can be used for 3D training.

    The checks are: the path exists (a file, or a folder holding a DICOM series; a list of paths is read as the
    files of one DICOM series); it can be read (NIfTI ``.nii``/``.nii.gz`` with nibabel, streaming the data slab
    by slab so truncated or corrupt files are caught with bounded memory; DICOM with ITK; anything else with
    ``monai.transforms.LoadImage``); it is spatially 3D after channel handling (``(X, Y, Z)``,
    ``(X, Y, Z, C)`` channels last or ``(X, Y, Z, 1, C)``) with every spatial size above 1; all values are finite;
    and, when ``patch_size`` is given with ``allow_pad=False``, every spatial size is at least the patch size
    (with padding allowed, smaller volumes are accepted as they will be padded); and, when ``num_channels`` is
    given, it has that many channels after channel-first handling (a 3D ``(X, Y, Z)`` file has 1, ``(X, Y, Z, C)``
    and ``(X, Y, Z, 1, C)`` NIfTI have ``C``, a DICOM series has ITK's number of pixel components, other formats
    have what ``LoadImage``'s ``original_channel_dim`` says). A DICOM series of several files is first checked
    slice by slice from the headers (:func:`common.data.dicom.series_problems`): a missing, duplicated or unevenly
    spaced slice, or files of another series or orientation, would be read by ITK as a volume of wrong geometry. A
    symbolic link that leads nowhere is named with its target. A volume that fails an earlier check is reported with
    that reason only.

    Args:
        path: an image file, a DICOM series folder, or a list of DICOM files.
        patch_size: the training patch size ``(X, Y, Z)``, or ``None`` to skip the size check.
        allow_pad: whether volumes smaller than ``patch_size`` will be padded (then they are accepted).
        check_values: whether to count NaN/Inf voxels (the data is read either way).
        num_channels: the number of channels the volume must have, or ``None`` to skip the channel check
            (per-key counts are a :func:`preflight` option).
        allow_irregular_series: accept DICOM series with missing slices or uneven spacing (ITK stacks them at one
            spacing); duplicated slices and mixed series are refused either way.

    Returns:
        ``None`` when the volume is usable, else a one-line reason that does not repeat the path (several problems
        of a series joined by ``"; "``).

    Raises:
        ValueError: only when ``patch_size`` or ``num_channels`` itself is invalid; problems with the file never
            raise.
    """
    patch = _validate_patch_size(patch_size)
    if isinstance(num_channels, Mapping):
        raise ValueError(
            f"check_volume checks one volume, so num_channels must be a positive integer or None, got the mapping "
            f"{dict(num_channels)!r}; per-key counts are given to preflight"
        )
    expected = _validate_channel_count(num_channels, "num_channels")
    found = _inspect(path, _Reading(patch, allow_pad, check_values, allow_irregular=bool(allow_irregular_series)))
    reason = found.reason or _channel_reason(found.channels, expected)
    return None if reason is None else "; ".join(reason.splitlines())


def _path_key(value: str | list[str]) -> str | tuple[str, ...]:
    return value if isinstance(value, str) else tuple(value)


def _display(value: str | tuple[str, ...] | list[str]) -> str:
    if isinstance(value, str):
        return value
    if len(value) == 1:
        return value[0]
    return f"[{value[0]}, ... ({len(value)} files)]"


def _where(section: str, index: int, entry: Any) -> str:
    """``"<section>[<index>]"`` for problem lines, with ``" (case <case_id>)"`` when the entry has a ``case_id``."""
    case_id = entry.get("case_id") if isinstance(entry, Mapping) else None
    if case_id is None or not str(case_id).strip():
        return f"{section}[{index}]"
    return f"{section}[{index}] (case {case_id})"


def _raw_section(datalist: str | os.PathLike | Mapping[str, Any], section: str) -> list:
    """The raw entries of a section that :func:`parse_datalist_section` has already read successfully."""
    top = datalist if isinstance(datalist, Mapping) else read_datalist_json(os.path.expanduser(os.fspath(datalist)))
    items = top.get(section)
    return items if isinstance(items, list) else []


def _positive_integer(value: Any) -> bool:
    """Whether ``value`` is a positive whole number (``3``, ``3.0``, ``"3"``; not ``True``, ``1.5`` or ``"abc"``)."""
    try:
        return not isinstance(value, bool) and float(value).is_integer() and int(value) >= 1
    except (TypeError, ValueError, OverflowError):
        return False


def _load_sections(
    datalist: str | os.PathLike | Mapping[str, Any],
    base_dir: str | None,
    sections: Sequence[str],
    required: Sequence[str],
    keys: Sequence[str],
    max_cases: int | None = None,
) -> tuple[dict[str, list[tuple[int, dict]]], list[str]]:
    """Parse every requested section; return the valid entries with their index, and the problem lines.

    ``max_cases`` keeps only the first entries of each section (a quick run on part of a cohort); the entries
    left out are neither checked nor returned. Problem lines of invalid entries name the entry's ``case_id``
    when it has one.
    """
    if max_cases is not None and not _positive_integer(max_cases):
        raise PreflightError([f"max_cases must be a positive integer or null, got {max_cases!r}"], "config")
    loaded: dict[str, list[tuple[int, dict]]] = {}
    problems: list[str] = []
    for section in sections:
        try:
            entries, entry_problems, _ = parse_datalist_section(datalist, key=section, base_dir=base_dir, keys=keys)
        except MissingSectionError as exc:
            if section in required:
                problems.append(f"{section}: {exc}")
            continue
        except DatalistError as exc:
            problems.append(f"{section}: {exc}")
            continue
        if max_cases is not None:
            entries = entries[: int(max_cases)]
            entry_problems = [(index, reason) for index, reason in entry_problems if index < int(max_cases)]
        raw = _raw_section(datalist, section) if entry_problems else []
        problems += [
            f"{_where(section, index, raw[index] if index < len(raw) else None)}: {reason}"
            for index, reason in entry_problems
        ]
        loaded[section] = [(index, entry) for index, entry in enumerate(entries) if entry is not None]
    return loaded, problems


def _sort_key(path: str | tuple[str, ...]) -> tuple[bool, str | tuple[str, ...]]:
    return isinstance(path, tuple), path


def _paths_to_read(
    loaded: Mapping[str, list[tuple[int, dict]]],
    keys: Sequence[str],
    shard: tuple[int, int] | None,
    by_entry: bool,
) -> list[str | tuple[str, ...]]:
    """The distinct paths this process reads, in a stable order.

    Without ``shard`` every path; with ``shard=(index, count)`` every ``count``-th distinct path, or, when
    ``by_entry`` (shapes are compared within entries), every path of every ``count``-th distinct entry.
    """
    groups = {tuple(_path_key(entry[k]) for k in keys) for items in loaded.values() for _, entry in items}
    unique = {path for group in groups for path in group}
    ordered = sorted(unique, key=_sort_key)
    if shard is None:
        return ordered
    index, count = int(shard[0]), int(shard[1])
    if not by_entry:
        return ordered[index::count]
    mine = sorted(groups, key=lambda group: tuple(_sort_key(p) for p in group))[index::count]
    wanted = {path for group in mine for path in group}
    return [path for path in ordered if path in wanted]


def _entry_reasons(
    entry: Mapping[str, Any],
    keys: Sequence[str],
    found: Mapping[str | tuple[str, ...], _Inspection],
    expected: Mapping[str, int],
    compare: bool,
) -> list[tuple[str | None, str]]:
    """``(key, reason)`` per problem of one entry from what reading its volumes found (volumes not read here are
    skipped); ``key`` is ``None`` for a problem of the entry as a whole."""
    problems: list[tuple[str | None, str]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    for k in keys:
        inspection = found.get(_path_key(entry[k]))
        if inspection is None:
            continue
        reason = inspection.reason or _channel_reason(inspection.channels, expected.get(k), k)
        if reason:
            problems += [(k, line) for line in reason.splitlines()]  # a DICOM series can have several
        elif inspection.spatial is not None:
            shapes[k] = inspection.spatial
    if compare and not problems and len(shapes) == len(set(keys)) and len(set(shapes.values())) > 1:
        listing = ", ".join(f"{k} {shape}" for k, shape in shapes.items())
        problems.append(
            (None, f"spatial shapes differ between keys: {listing}; modalities of a case must share one grid")
        )
    return problems


def _entry_problems(
    where: str,
    entry: Mapping[str, Any],
    keys: Sequence[str],
    found: Mapping[str | tuple[str, ...], _Inspection],
    expected: Mapping[str, int],
    compare: bool,
) -> list[str]:
    """Problem lines of one entry (:func:`_entry_reasons`), each naming ``where`` and the volume."""
    return [
        f"{where}: {reason}" if key is None else f"{where} {_display(entry[key])}: {reason}"
        for key, reason in _entry_reasons(entry, keys, found, expected, compare)
    ]


def screen_entries(
    entries: Sequence[Mapping[str, Any]],
    keys: Sequence[str] = ("image",),
    patch_size: Sequence[int] | None = None,
    allow_pad: bool = True,
    num_channels: int | Mapping[str, int] | None = None,
    same_shape: bool = True,
    num_workers: int = 4,
    size_name: str = "patch_size",
    series_geometry: bool = False,
    allow_irregular_series: bool = False,
) -> list[list[str]]:
    """Check the headers of the volumes of ``entries`` (absolute paths under ``keys``) without reading their voxels:
    the checks of :func:`check_volume` that a header answers (the file exists and its header can be read, it is 3D,
    its size, its channels, an uncompressed NIfTI holds the data its header declares, the declared size is sane, a
    symbolic link leads to a file) and, with several keys and ``same_shape``, one grid per entry. Inference screens
    its cases with it: a problem here costs one header read, a compressed file truncated in its voxel data is only
    found when it is loaded. A DICOM series is judged from its first file's header unless ``series_geometry``.

    Args:
        entries: the cases, each a mapping with absolute paths under ``keys``.
        keys: the entry keys holding image paths.
        patch_size: see :func:`check_volume`.
        allow_pad: see :func:`check_volume`.
        num_channels: channels every volume must have, or a mapping from key to count; see :func:`preflight`.
        same_shape: with several ``keys``, whether the volumes of one entry must share one spatial shape.
        num_workers: threads reading headers.
        size_name: how problems name ``patch_size``.
        series_geometry: also read the header of every slice of each DICOM series and report missing, duplicated
            or unevenly spaced slices and mixed series (:func:`common.data.dicom.series_problems`); off by default,
            as it costs one header read per slice of every series before the first case is processed.
        allow_irregular_series: with ``series_geometry``, accept missing slices and uneven spacing.

    Returns:
        One list per entry, in order, of its problems (``"<reason>"`` for one key, ``"<key> <path>: <reason>"`` with
        several keys); empty for a usable entry. Problems with the files never raise.
    """
    patch = _validate_patch_size(patch_size)
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    expected = _validate_num_channels(num_channels, keys)
    paths = list(dict.fromkeys(_path_key(entry[k]) for entry in entries for k in keys if k in entry))
    reading = _Reading(
        patch,
        allow_pad,
        check_values=False,
        size_name=size_name,
        header_only=True,
        series_geometry=bool(series_geometry),
        allow_irregular=bool(allow_irregular_series),
    )
    with ThreadPoolExecutor(max_workers=max(1, int(num_workers))) as pool:
        found = dict(zip(paths, pool.map(lambda p: _inspect(p, reading), paths)))
    compare = bool(same_shape) and len(set(keys)) > 1
    result = []
    for entry in entries:
        missing = [k for k in keys if k not in entry]
        if missing:
            result.append([f"has no {k!r}" for k in missing])
            continue
        reasons = _entry_reasons(entry, keys, found, expected, compare)
        result.append(
            [
                reason if key is None or len(keys) == 1 else f"{key} {_display(entry[key])}: {reason}"
                for key, reason in reasons
            ]
        )
    return result


def preflight(
    datalist: str | os.PathLike | Mapping[str, Any],
    base_dir: str | None = None,
    sections: Sequence[str] = ("training", "validation"),
    keys: Sequence[str] = ("image",),
    patch_size: Sequence[int] | None = None,
    allow_pad: bool = True,
    check_values: bool = True,
    num_workers: int = 2,
    required: Sequence[str] = ("training",),
    shard: tuple[int, int] | None = None,
    max_cases: int | None = None,
    num_channels: int | Mapping[str, int] | None = None,
    same_shape: bool = True,
    size_name: str = "patch_size",
    allow_irregular_series: bool = False,
) -> dict[str, list[dict]]:
    """Check a whole datalist and every volume it names, reporting all problems in one error.

    Sections in ``required`` must be present; other sections may be absent (then they are skipped), but a
    present section must be a non-empty list. Each distinct path is read once with the checks of
    :func:`check_volume`, using a thread pool. With several ``keys`` whose volumes are concatenated as channels
    (multi-modality cases), ``same_shape`` also requires all volumes of an entry to share one spatial shape;
    entries where a volume already has a problem are not compared. Problem lines name an entry's ``case_id``
    when it has one. Nothing is written anywhere.

    Args:
        datalist: a datalist JSON file or an already decoded dict.
        base_dir: folder for relative paths; defaults to the folder of the JSON file.
        sections: sections to check.
        keys: entry keys holding image paths to check.
        patch_size: training patch size; see :func:`check_volume`.
        allow_pad: whether volumes smaller than ``patch_size`` will be padded.
        size_name: how problems name ``patch_size`` (e.g. ``volume_size`` for whole-volume models).
        check_values: whether to count NaN/Inf voxels.
        num_workers: threads used to read volumes.
        required: sections that must be present.
        shard: ``(index, count)``: read only every ``count``-th distinct volume starting at ``index`` (ranks of
            a distributed job split the reading; see :func:`run_preflight`). When shapes are compared
            between keys, the ranks split the distinct entries instead and each reads all volumes of its
            entries, so every entry is compared on one rank.
        max_cases: keep only the first ``max_cases`` entries of each section (``None``: all).
        num_channels: the number of channels every volume must have after channel-first handling (see
            :func:`check_volume`), or a mapping from key to count for per-key counts (keys left out, or
            mapped to ``None``, are not checked); ``None`` skips the channel check.
        same_shape: with several ``keys``, whether the volumes of one entry must have the same spatial shape
            (they are concatenated as channels); ignored with a single key.
        allow_irregular_series: accept DICOM series with missing slices or uneven spacing; see
            :func:`check_volume` (each problem of a series is one line of the report).

    Returns:
        Section name -> the loaded entries (absolute paths), for every section that is present.

    Raises:
        PreflightError: listing every problem, one line each: ``"<where> <path>: <reason>"`` for volumes,
            ``"<where>: <reason>"`` for entries, where ``<where>`` is ``"<section>[<index>]"`` followed by
            ``" (case <case_id>)"`` when the entry has a ``case_id``.
        ValueError: when ``patch_size``, ``num_workers`` or ``num_channels`` is invalid.
    """
    patch = _validate_patch_size(patch_size)
    if isinstance(num_workers, bool) or int(num_workers) < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    sections = (sections,) if isinstance(sections, str) else tuple(sections)
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    expected = _validate_num_channels(num_channels, keys)
    compare = bool(same_shape) and len(set(keys)) > 1
    source = IN_MEMORY_SOURCE
    if not isinstance(datalist, Mapping):
        source = os.path.expanduser(os.fspath(datalist))
        try:
            read_datalist_json(source)
        except DatalistError as exc:
            raise PreflightError([str(exc)], source) from exc
    loaded, problems = _load_sections(datalist, base_dir, sections, required, keys, max_cases)
    ordered = _paths_to_read(loaded, keys, shard, by_entry=compare)
    reading = _Reading(patch, allow_pad, check_values, size_name, allow_irregular=bool(allow_irregular_series))
    with ThreadPoolExecutor(max_workers=int(num_workers)) as pool:
        found = dict(zip(ordered, pool.map(lambda p: _inspect(p, reading), ordered)))
    for section, items in loaded.items():
        for index, entry in items:
            problems += _entry_problems(_where(section, index, entry), entry, keys, found, expected, compare)
    if problems:
        raise PreflightError(problems, source)
    return {section: [entry for _, entry in items] for section, items in loaded.items()}


def load_sections(
    datalist: str | os.PathLike | Mapping[str, Any],
    base_dir: str | None = None,
    sections: Sequence[str] = ("training", "validation"),
    keys: Sequence[str] = ("image",),
    required: Sequence[str] = ("training",),
    max_cases: int | None = None,
) -> dict[str, list[dict]]:
    """Load the sections of a datalist without reading the volumes (preflight switched off).

    Raises:
        PreflightError: listing every problem of the datalist itself (missing sections, bad entries).
    """
    source = IN_MEMORY_SOURCE if isinstance(datalist, Mapping) else os.path.expanduser(os.fspath(datalist))
    sections = (sections,) if isinstance(sections, str) else tuple(sections)
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    try:
        loaded, problems = _load_sections(datalist, base_dir, sections, required, keys, max_cases)
    except DatalistError as exc:
        raise PreflightError([str(exc)], source) from exc
    if problems:
        raise PreflightError(problems, source)
    return {section: [entry for _, entry in items] for section, items in loaded.items()}


def _run_extra_check(
    check: Callable[[dict[str, list[dict]]], dict[str, list[dict]] | None],
    datalist: str | os.PathLike | Mapping[str, Any],
    base_dir: str | None,
    kwargs: Mapping[str, Any],
    error: PreflightError | None,
    loaded: dict[str, list[dict]],
) -> tuple[PreflightError | None, dict[str, list[dict]]]:
    """``check`` on the loaded sections (loaded again when the volume checks failed), its problems merged into
    ``error``; a datalist that cannot be loaded at all is already in ``error``."""
    sections = loaded
    if error is not None:
        keep = ("sections", "keys", "required", "max_cases")
        try:
            sections = load_sections(datalist, base_dir, **{k: v for k, v in kwargs.items() if k in keep})
        except (PreflightError, ValueError, OSError):
            return error, loaded
    try:
        result = check(sections)
    except PreflightError as exc:
        problems = [*(error.problems if error else []), *exc.problems]
        return PreflightError(problems, error.source if error else exc.source), loaded
    return error, (result if result is not None and error is None else loaded)


def run_preflight(
    datalist: str | os.PathLike | Mapping[str, Any],
    base_dir: str | None = None,
    patch_size: Sequence[int] | None = None,
    enabled: bool = True,
    extra_check: Callable[[dict[str, list[dict]]], dict[str, list[dict]] | None] | None = None,
    **kwargs: Any,
) -> dict[str, list[dict]]:
    """Preflight for bundle configs: every problem in one :class:`PreflightError`, raised before any work (on the
    command line it ends the command with the report and exit status 1, without a traceback).

    Under ``torch.distributed`` each rank reads a different share of the volumes and the problems of all ranks
    are gathered, so every rank raises the same report and stops.

    Args:
        datalist: datalist JSON file or decoded dict.
        base_dir: folder for relative paths.
        patch_size: training patch size (volumes must fit or will be padded).
        enabled: ``False`` only loads the datalist (still validating its structure).
        extra_check: a bundle's own check of the loaded sections (e.g. files under other keys), run even when the
            volumes have problems; it raises :class:`PreflightError` with its problems, which are reported together
            with the volumes', or returns the sections to use (e.g. with further paths resolved).
        kwargs: further arguments of :func:`preflight` (e.g. ``allow_irregular_series=True`` to accept DICOM series
            with missing slices or uneven spacing).

    Raises:
        PreflightError: listing the problems of every rank.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    error: PreflightError | None = None
    loaded: dict[str, list[dict]] = {}
    try:
        if not enabled:
            loaded = load_sections(
                datalist,
                base_dir,
                **{k: v for k, v in kwargs.items() if k in ("sections", "keys", "required", "max_cases")},
            )
        else:
            shard = (dist.get_rank(), dist.get_world_size()) if distributed else None
            loaded = preflight(datalist, base_dir=base_dir, patch_size=patch_size, shard=shard, **kwargs)
    except PreflightError as exc:
        error = exc
    if extra_check is not None:
        error, loaded = _run_extra_check(extra_check, datalist, base_dir, kwargs, error, loaded)
    if distributed:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, None if error is None else (error.problems, error.source))
        problems = list(dict.fromkeys(p for g in gathered if g for p in g[0]))
        if problems:
            error = PreflightError(problems, next(g[1] for g in gathered if g))
    if error is not None:
        raise error
    return loaded


def main(
    datalist: str,
    base_dir: str | None = None,
    patch_size: Sequence[int] | None = None,
    allow_pad: bool = True,
    check_values: bool = True,
    num_workers: int = 2,
    sections: Sequence[str] = ("training", "validation"),
    keys: Sequence[str] = ("image",),
    num_channels: int | Mapping[str, int] | None = None,
    same_shape: bool = True,
    allow_irregular_series: bool = False,
) -> None:
    """Command-line entry: check a datalist and print a one-line summary; problems are raised in one
    :class:`PreflightError` (the command ends with ``error: <report>`` and exit status 1).

    Example::

        python -m common.data.preflight datalist.json --keys "[t1n,t1c,t2w,t2f]" --num_channels 1
        python -m common.data.preflight datalist.json --keys "[image,label]" --num_channels "{image: 4, label: 1}"

    Args:
        datalist: the datalist JSON file.
        base_dir: folder for relative paths; defaults to the folder of the JSON file.
        patch_size: training patch size, for example ``"[96,96,96]"``.
        allow_pad: whether volumes smaller than ``patch_size`` will be padded.
        check_values: whether to count NaN/Inf voxels.
        num_workers: threads used to read volumes.
        sections: sections to check.
        keys: entry keys holding image paths.
        num_channels: channels every volume must have, or a mapping from key to count; see :func:`preflight`.
        same_shape: whether the volumes of an entry must share one spatial shape (with several keys).
        allow_irregular_series: accept DICOM series with missing slices or uneven spacing.
    """
    sections = (sections,) if isinstance(sections, str) else tuple(sections)
    loaded = preflight(
        datalist,
        base_dir=base_dir,
        sections=sections,
        keys=keys,
        patch_size=patch_size,
        allow_pad=allow_pad,
        check_values=check_values,
        num_workers=num_workers,
        num_channels=num_channels,
        same_shape=same_shape,
        allow_irregular_series=allow_irregular_series,
    )
    counts = ", ".join(f"{len(loaded.get(section, []))} {section}" for section in sections)
    print(f"preflight OK: {counts} volumes")


if __name__ == "__main__":
    import fire

    install_user_error_hook()
    fire.Fire(main)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Read and write MSD/Decathlon-style datalists (``{"training": [{"image": "..."}], "validation": [...]}``), list the
image volumes of a folder (NIfTI, NRRD, MetaImage files and DICOM series folders) and BraTS 2023 case folders as
multi-modality entries."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from common.data.formats import VOLUME_FORMATS, VOLUME_SUFFIXES, file_stem, has_suffix, is_dicom_file
from common.errors import MissingInputError, UserError

__all__ = [
    "BRATS_MODALITIES",
    "DatalistError",
    "MissingSectionError",
    "NoInputs",
    "found_inputs",
    "find_brats_cases",
    "find_volumes",
    "inference_entries",
    "no_volumes_error",
    "load_datalist",
    "named_section",
    "parse_datalist_section",
    "read_datalist_json",
    "require_inputs",
    "resolve_path",
    "text_size_problem",
    "write_datalist",
]

IN_MEMORY_SOURCE = "<in-memory datalist>"
MAX_TEXT_BYTES = 256 * 1024**2  # datalists and cohort tables larger than this are refused before being read
PathValue = str | list[str]
BRATS_MODALITIES = ("t1n", "t1c", "t2w", "t2f")


class DatalistError(UserError, ValueError):
    """A datalist JSON file or one of its entries is unusable; the message names the file and the problem."""


class MissingSectionError(DatalistError):
    """The requested section (for example ``"validation"``) is not present in the datalist.

    Args:
        message: the full error message.
        key: the missing section name.
        present: the section names that are present.
    """

    def __init__(self, message: str, key: str, present: Sequence[str]) -> None:
        super().__init__(message)
        self.key = key
        self.present = list(present)


def read_datalist_json(path: str | os.PathLike) -> dict[str, Any]:
    """Read a datalist JSON file and check that its top level is an object.

    Args:
        path: the JSON file; ``~`` is expanded.

    Returns:
        The decoded top-level object.

    Raises:
        DatalistError: when the file is missing, is not a regular file, cannot be decoded, is not valid JSON,
            or its top level is not an object.
    """
    file = Path(os.path.expanduser(os.fspath(path)))
    if not file.exists():
        raise DatalistError(f"datalist file {str(file)!r} does not exist")
    if not file.is_file():
        raise DatalistError(f"datalist {str(file)!r} is not a regular file (a JSON file is required)")
    reason = text_size_problem(file)
    if reason:
        raise DatalistError(f"datalist file {str(file)!r} {reason}")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatalistError(f"datalist file {str(file)!r} cannot be read: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatalistError(
            f"datalist file {str(file)!r} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from exc
    if not isinstance(data, dict):
        raise DatalistError(
            f"datalist file {str(file)!r} must contain a JSON object with sections such as 'training', "
            f"got a top-level {type(data).__name__}"
        )
    return data


def text_size_problem(path: str | os.PathLike) -> str | None:
    """Why a text input (datalist, cohort table) is too large to be read at once, or ``None``."""
    size = os.path.getsize(path)
    if size > MAX_TEXT_BYTES:
        limit = MAX_TEXT_BYTES / 1024**2
        return f"is {size / 1024**2:.0f} MiB, more than the {limit:.0f} MiB a datalist or table may have"
    return None


def _source_and_base(
    datalist: str | os.PathLike | Mapping[str, Any], base_dir: str | os.PathLike | None
) -> tuple[dict[str, Any], str, str]:
    """Return the top-level object, a name for messages and the absolute base folder for relative paths: a
    datalist file's own folder (MONAI's ``load_decathlon_datalist`` convention: its paths mean what the file says,
    wherever the command runs and whatever ``dataset_dir`` is), ``base_dir`` (default: the current folder) for a
    datalist given as a dict."""
    if isinstance(datalist, Mapping):
        base = os.getcwd() if base_dir is None else os.path.abspath(os.path.expanduser(os.fspath(base_dir)))
        return dict(datalist), IN_MEMORY_SOURCE, base
    if isinstance(datalist, (str, os.PathLike)):
        file = os.path.expanduser(os.fspath(datalist))
        return read_datalist_json(file), file, os.path.dirname(os.path.abspath(file))
    raise DatalistError(f"datalist must be a JSON file path or a dict, got {type(datalist).__name__} {datalist!r}")


def resolve_path(value: str, base_dir: str) -> str:
    """Expand ``~`` and make ``value`` absolute against the dataset root ``base_dir``.

    Absolute paths are kept: they state explicitly where a file is. A relative path must stay inside the root: one
    that leaves it through ``..`` or through a symbolic link pointing outside it is refused, so a datalist cannot
    reach files the user did not point the bundle at.

    Raises:
        ValueError: naming the path, the root and how it leaves it (the message does not repeat the datalist).
    """
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return os.path.normpath(expanded)
    root = os.path.normpath(os.path.abspath(base_dir))
    path = os.path.normpath(os.path.join(root, expanded))
    hint = "write an absolute path to read a file outside the dataset root"
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"path {value!r} leaves the dataset root {root!r} through '..'; {hint}")
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real, real_root]) != real_root:
        raise ValueError(
            f"path {value!r} leads outside the dataset root {root!r} through a symbolic link (to {real!r}); {hint}"
        )
    return path


def _resolve_value(name: str, value: Any, base_dir: str) -> PathValue:
    """Resolve one required value: a path string or a non-empty list of path strings (a DICOM file list).

    Raises:
        ValueError: with the reason (without the file name) when the value is not usable.
    """
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{name!r} is an empty string")
        try:
            return resolve_path(value, base_dir)
        except ValueError as exc:
            raise ValueError(f"{name!r} {exc}") from None
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{name!r} is an empty list")
        bad = [item for item in value if not isinstance(item, str) or not item.strip()]
        if bad:
            raise ValueError(f"{name!r} must be a list of non-empty path strings, got item {bad[0]!r}")
        try:
            return [resolve_path(item, base_dir) for item in value]
        except ValueError as exc:
            raise ValueError(f"{name!r} {exc}") from None
    raise ValueError(f"{name!r} must be a path string or a list of path strings, got {type(value).__name__} {value!r}")


def _resolve_entry(entry: Any, base_dir: str, keys: Sequence[str]) -> dict[str, Any]:
    """Turn one raw entry into a new dict whose required values are absolute paths.

    Raises:
        ValueError: with the reason (without the file name or index) when the entry is not usable.
    """
    if isinstance(entry, str):
        entry = {"image": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"entry must be an object or a path string, got {type(entry).__name__} {entry!r}")
    missing = [k for k in keys if k not in entry]
    if missing:
        raise ValueError(f"entry is missing required key {missing[0]!r} (keys present: {sorted(entry)})")
    resolved = dict(entry)
    for k in keys:
        resolved[k] = _resolve_value(k, entry[k], base_dir)
    return resolved


def parse_datalist_section(
    datalist: str | os.PathLike | Mapping[str, Any] | Sequence[Any],
    key: str = "training",
    base_dir: str | os.PathLike | None = None,
    keys: Sequence[str] = ("image",),
) -> tuple[list[dict[str, Any] | None], list[tuple[int, str]], str]:
    """Parse one section, collecting the problems of every entry instead of stopping at the first.

    Args:
        datalist: a JSON file path, an already decoded datalist dict, or the section's list of entries itself.
        key: the section to read, for example ``"training"``.
        base_dir: folder that the relative paths of a datalist given as a dict are resolved against (default: the
            current working directory); a JSON file's relative paths are resolved against its own folder.
        keys: entry keys that must be present and hold paths.

    Returns:
        ``(entries, problems, source)``: one resolved dict per entry (``None`` where the entry is invalid),
        a list of ``(index, reason)`` for invalid entries, and the name of the datalist used in messages.

    Raises:
        DatalistError: for problems of the file or the section as a whole (missing or unreadable file,
            invalid JSON, top level not an object, section missing, not a list, or empty).
        MissingSectionError: when the section is absent (a subclass of ``DatalistError``).
    """
    if isinstance(datalist, (list, tuple)):  # the entries themselves, as a section
        datalist = {key: list(datalist)}
    top, source, base = _source_and_base(datalist, base_dir)
    if key not in top:
        present = sorted(top)
        raise MissingSectionError(
            f"datalist {source!r} has no section {key!r}; sections present: {present}", key=key, present=present
        )
    items = top[key]
    if not isinstance(items, list):
        raise DatalistError(
            f"datalist {source!r}: section {key!r} must be a list of entries, got {type(items).__name__}"
        )
    if not items:
        raise DatalistError(f"datalist {source!r}: section {key!r} is empty (it must list at least one volume)")
    entries: list[dict[str, Any] | None] = []
    problems: list[tuple[int, str]] = []
    for index, item in enumerate(items):
        try:
            entries.append(_resolve_entry(item, base, keys))
        except ValueError as exc:
            entries.append(None)
            problems.append((index, str(exc)))
    return entries, problems, source


def load_datalist(
    datalist: str | os.PathLike | dict | list,
    key: str = "training",
    base_dir: str | None = None,
    keys: Sequence[str] = ("image",),
) -> list[dict]:
    """Load one section of an MSD/Decathlon-style datalist with absolute paths.

    Entries may be objects (``{"image": "imagesTr/a.nii.gz", ...}``) or plain strings, which are read as
    ``{"image": s}``. For every key in ``keys`` the value must be a path string or a list of path strings
    (the files of one DICOM series); relative paths are resolved against the JSON file's folder (against
    ``base_dir`` for a dict), absolute paths are kept and ``~`` is expanded. Other keys are copied unchanged.

    Args:
        datalist: a JSON file path, an already decoded datalist dict, or the section's list of entries itself.
        key: the section to read, for example ``"training"`` or ``"validation"``.
        base_dir: folder that the relative paths of a datalist given as a dict are resolved against (default: the
            current working directory); a JSON file's relative paths are resolved against its own folder.
        keys: entry keys that must be present and hold paths.

    Returns:
        New dicts, one per entry, whose ``keys`` values are absolute path strings (or lists of them).

    Raises:
        DatalistError: naming the datalist (and the entry index) when the file is missing or not valid JSON,
            the top level is not an object, the section is missing, not a list or empty, or an entry is not
            an object/string, lacks a required key, or holds a value that is not a path string.
    """
    entries, problems, source = parse_datalist_section(datalist, key=key, base_dir=base_dir, keys=keys)
    if problems:
        noun = "entry" if len(problems) == 1 else "entries"
        lines = [f"datalist {source!r}: section {key!r} has {len(problems)} invalid {noun}:"]
        lines += [f"  {key}[{index}]: {reason}" for index, reason in problems]
        raise DatalistError("\n".join(lines))
    return [entry for entry in entries if entry is not None]


def _relativize(value: Any, base_dir: str) -> Any:
    """Make absolute paths under ``base_dir`` relative to it; anything else is returned unchanged."""
    if isinstance(value, list):
        return [_relativize(item, base_dir) for item in value]
    if not isinstance(value, str) or not os.path.isabs(os.path.expanduser(value)):
        return value
    path = os.path.normpath(os.path.expanduser(value))
    try:
        inside = os.path.commonpath([path, base_dir]) == base_dir
    except ValueError:  # different drives on Windows
        inside = False
    return os.path.relpath(path, base_dir) if inside else path


def _check_sections(path: str, sections: Any) -> None:
    """Check the shape of the data passed to :func:`write_datalist`."""
    if not isinstance(sections, Mapping):
        raise DatalistError(f"datalist {path!r}: sections must be a dict of lists, got {type(sections).__name__}")
    for name, items in sections.items():
        if not isinstance(name, str):
            raise DatalistError(f"datalist {path!r}: section names must be strings, got {name!r}")
        if not isinstance(items, list):
            raise DatalistError(
                f"datalist {path!r}: section {name!r} must be a list of entries, got {type(items).__name__}"
            )
        for index, item in enumerate(items):
            if not isinstance(item, (dict, str)):
                raise DatalistError(
                    f"datalist {path!r}: {name}[{index}] must be an object or a path string, "
                    f"got {type(item).__name__} {item!r}"
                )


def write_datalist(
    path: str | os.PathLike,
    sections: dict[str, list[dict]],
    base_dir: str | os.PathLike | None = None,
    keys: Sequence[str] = ("image",),
) -> Path:
    """Write a datalist JSON file atomically (:func:`common.utils.write_text_atomic`).

    Args:
        path: the JSON file to write; missing parent folders are created.
        sections: section name -> list of entries (dicts, or plain path strings).
        base_dir: when given, absolute paths under this folder in ``keys`` values (and plain string entries)
            are written relative to it; paths outside it stay absolute.
        keys: entry keys whose values are paths.

    Returns:
        The path of the written file.

    Raises:
        DatalistError: when ``sections`` is not a dict of lists of dicts/strings.
    """
    file = Path(os.path.expanduser(os.fspath(path)))
    _check_sections(str(file), sections)
    out: dict[str, list[Any]] = {}
    base = None if base_dir is None else os.path.abspath(os.path.expanduser(os.fspath(base_dir)))
    for name, items in sections.items():
        out[name] = []
        for item in items:
            if base is not None and isinstance(item, str):
                item = _relativize(item, base)
            elif base is not None:
                item = {k: (_relativize(v, base) if k in keys else v) for k, v in item.items()}
            out[name].append(item)
    from common.utils import write_text_atomic  # imported here: common.utils imports torch, this module does not

    write_text_atomic(file, json.dumps(out, indent=2) + "\n")
    return file


def find_brats_cases(
    data_dir: Path, modalities: tuple[str, ...] = BRATS_MODALITIES, label: str = "seg"
) -> list[dict[str, str]]:
    """BraTS 2023 cases under ``data_dir``: folders ``<case>/`` holding ``<case>-<modality>.nii.gz`` files (a broken
    symbolic link counts as a file, so that the preflight of its case names it).

    Args:
        data_dir: the folder to search (recursively) for case folders.
        modalities: modalities every case must have.
        label: the optional segmentation suffix, added as ``"label"`` when present.

    Returns:
        One entry per case, sorted by case id: ``{"case_id": ..., "t1n": path, ..., "label": path}``.

    Raises:
        ValueError: naming every case with missing modalities (and which), all at once.
    """
    cases, problems = [], []

    def listed(path: Path) -> bool:  # a broken symbolic link too: the preflight names it, it is not lost
        return path.is_file() or path.is_symlink()

    for folder in sorted({p.parent for p in data_dir.rglob("*.nii.gz") if listed(p)}):
        case = folder.name
        files = {m: folder / f"{case}-{m}.nii.gz" for m in (*modalities, label)}
        present = [m for m in modalities if listed(files[m])]
        if not present:
            continue  # not a case folder
        missing = [m for m in modalities if m not in present]
        if missing:
            problems.append(f"case {case} ({folder}): missing {', '.join(f'{case}-{m}.nii.gz' for m in missing)}")
            continue
        entry = {"case_id": case, **{m: str(files[m].absolute()) for m in modalities}}
        if files[label].is_file():
            entry["label"] = str(files[label].absolute())
        cases.append(entry)
    if problems:
        raise ValueError(f"{len(problems)} BraTS case(s) are incomplete:\n  " + "\n  ".join(problems))
    return cases


def _file_or_broken_link(path: str) -> bool:
    """Whether ``path`` is a file, or a symbolic link whose target does not exist (kept, so that the volume it should
    lead to is reported as a broken link instead of being lost)."""
    return os.path.isfile(path) or (os.path.islink(path) and not os.path.exists(path))


def _walk(root: str) -> list[tuple[str, list[str]]]:
    """``(folder, file names)`` of ``root`` and every folder below it (symbolic links followed once, hidden entries
    skipped, broken symbolic links kept as file names), folders and names sorted."""
    found, seen = [], set()
    for folder, subfolders, files in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        names = sorted(f for f in files if not f.startswith(".") and _file_or_broken_link(os.path.join(folder, f)))
        found.append((folder, names))
    return found


def _unique_case_ids(paths: Sequence[str], root: str) -> list[str]:
    """Readable case ids: the file stem (folder name for a DICOM series); where several volumes share one, the path
    relative to ``root`` without the suffix, ``/`` replaced by ``_`` (then a counter if still not unique)."""
    stems = [file_stem(p) for p in paths]
    ids = [
        stem if stems.count(stem) == 1 else "_".join(Path(os.path.relpath(os.path.dirname(p), root)).parts + (stem,))
        for p, stem in zip(paths, stems)
    ]
    unique, used = [], set()
    for case in ids:
        candidate, n = case, 1
        while candidate in used or (candidate != case and candidate in ids):
            n += 1
            candidate = f"{case}_{n}"
        used.add(candidate)
        unique.append(candidate)
    return unique


def _series_of_folder(folder: str) -> list[tuple[str, str | list[str]]]:
    """``(name, value)`` of the DICOM series in ``folder``: ``(folder, folder)`` for one series (or none GDCM can
    read: the preflight says what is wrong), else one ``(<folder>_series<n>, files)`` per series, ``n`` the
    ``SeriesNumber`` where every series has a distinct one, else 1, 2, ... in GDCM's order."""
    from common.data.dicom import dicom_series  # imported here: it imports MONAI, only folders of DICOM files need it

    series = dicom_series(folder)
    if len(series) <= 1:
        return [(folder, folder)]
    numbers = [s.number for s in series]
    labels = numbers if all(numbers) and len(set(numbers)) == len(numbers) else [str(i + 1) for i in range(len(series))]
    return [(f"{folder}_series{label}", s.files) for label, s in zip(labels, series)]


def find_volumes(
    dataset_dir: str | os.PathLike, pattern: str | None = None, key: str = "image", dicom_only: bool = False
) -> list[dict[str, Any]]:
    """The image volumes under ``dataset_dir`` (recursively), one entry ``{"case_id": ..., key: path}`` per case.

    A case is a NIfTI (``.nii``, ``.nii.gz``), NRRD (``.nrrd``, ``.nhdr``) or MetaImage (``.mha``, ``.mhd``; not its
    ``.raw``/``.zraw`` data file) file, or a DICOM series: a folder holding DICOM files (``.dcm``, or the ``DICM``
    marker at byte 128; a ``DICOMDIR`` index does not count) is listed once, as the folder, when it holds one series;
    a folder holding several series (a flat PACS export) gives one case per series, its path the list of the series'
    files (``common.data.dicom.LoadVolumed`` reads such a list as one volume) and its case id
    ``<folder>_series<SeriesNumber>``. The files of a series folder are never listed on their own. With ``pattern``
    (a glob such as ``"*.nii.gz"`` or ``"sub/*_t1.nrrd"``, matched against the end of the path as ``Path.match``
    does), the files and series folders whose path matches it are listed instead, whatever their format. Hidden files
    and folders are skipped. A broken symbolic link whose name has a volume suffix (or matches ``pattern``) is listed
    as a case, so the check of the cases reports it instead of losing it (in a series folder it is neither a case nor
    a slice: the check of a series given as its folder reports it).

    Args:
        dataset_dir: the folder to search; ``~`` is expanded.
        pattern: ``None`` for every volume of the formats above, else a glob.
        key: the entry key of the path.
        dicom_only: list the DICOM series only.

    Returns:
        Entries sorted by path, with absolute paths and unique readable case ids: the file name without its suffix
        (the folder name for a DICOM series), the path relative to ``dataset_dir`` (``/`` as ``_``) for names that
        occur more than once.
    """
    root = os.path.abspath(os.path.expanduser(os.fspath(dataset_dir)))
    if not os.path.isdir(root):
        return []
    found: list[tuple[str, str | list[str]]] = []
    for folder, names in _walk(root):
        rel = Path(os.path.relpath(folder, root)) if folder != root else Path(os.path.basename(root))
        # a DICOMDIR (the index of a DICOM disc, next to its image folders) is not a slice of a series
        if any(name.upper() != "DICOMDIR" and is_dicom_file(os.path.join(folder, name)) for name in names):
            if pattern is None or rel.match(pattern):
                found.extend(_series_of_folder(folder))
            continue  # a series folder: its files are slices, not cases
        if dicom_only:
            continue
        for name in names:
            if pattern is None and has_suffix(name, VOLUME_SUFFIXES):
                found.append((os.path.join(folder, name),) * 2)
            elif pattern is not None and (Path(os.path.relpath(folder, root)) / name).match(pattern):
                found.append((os.path.join(folder, name),) * 2)
    found.sort(key=lambda item: item[0])
    ids = _unique_case_ids([name for name, _ in found], root)
    return [{"case_id": case, key: value} for case, (_, value) in zip(ids, found)]


def no_volumes_error(
    dataset_dir: str | os.PathLike,
    pattern: str | None = None,
    options: str = "--dataset_dir, --input_pattern or --datalist",
) -> MissingInputError:
    """The error of a command that found no volume under ``dataset_dir`` (:func:`find_volumes`): it names the folder,
    what was looked for (the formats, or ``pattern``) and the command's ``options`` that change it."""
    root = os.path.abspath(os.path.expanduser(os.fspath(dataset_dir)))
    if pattern is None:
        formats = ", ".join(f"{name} ({', '.join(suffixes)})" for name, suffixes in VOLUME_FORMATS.items())
        wanted = f"{formats} files or DICOM series folders"
    else:
        wanted = f"files or DICOM series folders matching {pattern!r}"
    missing = "" if os.path.isdir(root) else " (the folder does not exist)"
    return MissingInputError(
        f"no input volumes found under {root!r}{missing}: looked for {wanted}, recursively (set {options})."
    )


class NoInputs(list):
    """The inputs of an inference run that found none: an empty list keeping the :class:`MissingInputError` that
    says why, so the workflow can be built before its inputs exist (an application driving the bundle, or the
    model zoo's ``check_properties``, builds ``dataset`` first); the run's first step, :func:`require_inputs`,
    raises it before anything is read or written."""

    def __init__(self, error: MissingInputError):
        super().__init__()
        self.error = error


def found_inputs(find: Callable[..., list], **kwargs: Any) -> list:
    """``find(**kwargs)`` (an inference run's input finder, e.g. :func:`inference_entries`), or a :class:`NoInputs`
    holding the :class:`MissingInputError` it raised. Other errors (an invalid datalist or CSV) are raised."""
    try:
        return find(**kwargs)
    except MissingInputError as e:
        return NoInputs(e)


def named_section(sections: Mapping[str, Any], name: str) -> Any:
    """The section ``name`` (an evaluation's ``eval_section``) of the loaded datalist or cohort ``sections``.

    Raises:
        MissingInputError: naming the setting and the sections there are, when there is no such section.
    """

    def is_section(value: Any) -> bool:  # a list of entries (a cohort also holds lists of numbers)
        return isinstance(value, list) and all(isinstance(entry, Mapping) for entry in value)

    if not is_section(sections.get(name)):
        present = sorted(k for k, v in sections.items() if is_section(v))
        raise MissingInputError(
            f"'eval_section' is {name!r} but the data has no such section (it has {present}): pass --eval_section "
            "with one of them, or a datalist or cohort that has that section."
        )
    return sections[name]


def require_inputs(inputs: Sequence) -> bool:
    """The first step of an inference run: raise the :class:`MissingInputError` of a :class:`NoInputs` (or a
    plain one for another empty list); ``True`` otherwise."""
    if isinstance(inputs, NoInputs):
        raise inputs.error
    if not inputs:
        raise MissingInputError("no inference inputs: the input list is empty (set --dataset_dir or --datalist).")
    return True


def inference_entries(
    dataset_dir: str | os.PathLike,
    keys: Sequence[str],
    datalist: str | os.PathLike | dict | list | None = None,
    section: str = "testing",
    pattern: str | None = None,
) -> list[dict[str, Any]]:
    """The inputs of an inference run, one entry per case with a ``case_id`` and a path for every key.

    With ``datalist``: its ``section`` (relative paths resolved against the datalist file's folder; against
    ``dataset_dir`` for a datalist given as a dict). Otherwise, for one key:
    the volumes under ``dataset_dir`` (recursively) that :func:`find_volumes` lists (every NIfTI, NRRD, MetaImage
    file and DICOM series folder, or what matches ``pattern``); for several keys: the BraTS 2023 layout, folders
    ``<case>/<case>-<key>.nii.gz`` (see :func:`find_brats_cases`).

    Raises:
        DatalistError: for an invalid datalist or section (naming the entry).
        ValueError: naming every case folder that lacks one of ``keys``.
        MissingInputError: when no input is found.
    """
    keys = list(keys)
    if not keys:
        raise ValueError("inference needs at least one input key.")
    base = os.path.expanduser(os.fspath(dataset_dir))
    if datalist:
        entries = load_datalist(datalist, section, base_dir=base, keys=keys)
        for entry in entries:
            first = entry[keys[0]]
            # a list is the files of one DICOM series: named after their folder
            entry.setdefault("case_id", file_stem(first if isinstance(first, str) else os.path.dirname(first[0])))
    elif len(keys) == 1:
        entries = find_volumes(base, pattern, key=keys[0])
        if not entries:
            raise no_volumes_error(base, pattern)
    else:
        entries = [
            {"case_id": case["case_id"], **{k: case[k] for k in keys}}
            for case in find_brats_cases(Path(base), modalities=tuple(keys))
        ]
    if not entries:
        how = f"section {section!r} of {datalist!r}"
        if not datalist:
            how = f"case folders <case>/<case>-{{{','.join(keys)}}}.nii.gz under {base!r}"
        raise MissingInputError(f"no inference inputs: found nothing for {how} (set --dataset_dir or --datalist).")
    return entries

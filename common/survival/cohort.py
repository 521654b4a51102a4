# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The survival cohort: read the CSV (image, follow-up time, event, covariates), split it, check it, and derive
what the survival heads need (logistic-hazard cut points, covariate statistics), reporting every problem at once.

Times are converted to YEARS on reading (``time_unit`` says what the CSV holds); everything downstream works in
years. Bundle configs call :func:`load_cohort`, which also runs the image preflight and stops before anything
is written when the cohort is unusable.

Example::

    cohort = load_cohort("cohort.csv", time_unit="days", covariates=("age", "sex"), num_intervals=10)
    cohort["training"][0]  # {"case_id", "image", "time", "event", "covariates", "split", "row"}
"""

from __future__ import annotations

import csv
import dataclasses
import io
import logging
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.data.datalist import inference_entries, resolve_path, text_size_problem
from common.data.formats import file_stem
from common.data.preflight import PreflightError
from common.data.preflight import preflight as run_preflight
from common.engines.cases import PROBLEMS_KEY
from common.errors import UserError

__all__ = [
    "EVENT_VALUES",
    "SPLIT_NAMES",
    "TIME_UNITS",
    "CohortColumns",
    "CohortError",
    "check_cohort",
    "load_cohort",
    "covariate_stats",
    "cut_points_from_quantiles",
    "inference_cohort",
    "read_cohort_csv",
    "split_cohort",
]

# how many of each unit make a year
TIME_UNITS = {"days": 365.25, "months": 12.0, "years": 1.0}
# the only spellings accepted in the event column
EVENT_VALUES = {"0": 0.0, "1": 1.0, "0.0": 0.0, "1.0": 1.0}
# split column values (case-insensitive) -> section
SPLIT_NAMES = {
    "train": "training",
    "training": "training",
    "val": "validation",
    "validation": "validation",
    "test": "testing",
    "testing": "testing",
}
SECTIONS = ("training", "validation", "testing")
# the in-memory datalist section handed to the image preflight (one entry per CSV row with an image path)
_PREFLIGHT_SECTION = "cohort"
_PREFLIGHT_LINE = re.compile(rf"^{_PREFLIGHT_SECTION}\[(\d+)\] (.*)$", re.DOTALL)

logger = logging.getLogger(__name__)


class CohortError(UserError, ValueError):
    """Every problem found in a cohort, one per line after a header naming where they were found.

    Args:
        problems: one line per problem, for rows ``"row <n> (case <id>): <reason>"``.
        source: what was checked, e.g. ``"cohort CSV '/data/cohort.csv'"``.
    """

    def __init__(self, problems: Sequence[str], source: str) -> None:
        self.problems = list(problems)
        self.source = source
        header = f"{source}: {len(self.problems)} problem(s):"
        super().__init__("\n".join([header] + [f"  {line}" for line in self.problems]))


def _where(row: int, case_id: str | None) -> str:
    """``"row <n>"`` with ``" (case <id>)"`` when the case id is known."""
    return f"row {row}" if not case_id else f"row {row} (case {case_id})"


def _parse_number(value: str) -> float | None:
    """``value`` as a float, or ``None`` when it is not a number (``nan``/``inf`` are numbers here)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _number_problem(name: str, value: str) -> tuple[float | None, str | None]:
    """Parse one numeric cell; return ``(number, None)`` or ``(None, reason)``."""
    if not value:
        return None, f"{name} is empty"
    number = _parse_number(value)
    if number is None:
        return None, f"{name} {value!r} is not a number"
    if not math.isfinite(number):
        return None, f"{name} {value!r} is not finite"
    return number, None


def _read_table(path: str) -> tuple[list[str] | None, list[tuple[int, list[str]]], list[str]]:
    """The header and the ``(row number, fields)`` data rows of a CSV file, or the problems of the file itself.

    Blank lines are counted as rows (so row ``n`` is line ``n + 1`` of a file without multi-line cells) but not
    returned.
    """
    if not os.path.exists(path):
        return None, [], ["the file does not exist"]
    if os.path.isdir(path):
        return None, [], ["the path is a folder, not a CSV file"]
    too_large = text_size_problem(path)
    if too_large:
        return None, [], [f"the file {too_large}"]
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            text = handle.read()
    except UnicodeDecodeError as exc:
        return None, [], [f"the file is not a text CSV file (not UTF-8: {exc.reason} at byte {exc.start})"]
    except OSError as exc:
        return None, [], [f"the file cannot be read: {type(exc).__name__}: {exc.strerror or exc}"]
    if not text.strip():
        return None, [], ["the file is empty (a header line with the column names is required)"]
    reader = csv.reader(io.StringIO(text), strict=True)
    try:
        records = list(reader)
    except csv.Error as exc:
        return None, [], [f"the file is not a valid CSV file: {exc} (line {reader.line_num})"]
    header_index = next(i for i, fields in enumerate(records) if any(f.strip() for f in fields))
    header = [name.strip() for name in records[header_index]]
    rows = [
        (n, fields) for n, fields in enumerate(records[header_index + 1 :], start=1) if any(f.strip() for f in fields)
    ]
    return header, rows, []


def _header_problems(header: list[str], required: Mapping[str, str]) -> list[str]:
    """Problems of the header: duplicate names, a single column that looks like another delimiter, missing columns.

    Args:
        header: the column names.
        required: column name -> what asks for it (``"time_col"``, ``"covariate"``) for the messages.
    """
    problems = []
    duplicates = sorted({name for name in header if header.count(name) > 1})
    problems += [f"column {name!r} appears {header.count(name)} times in the header" for name in duplicates]
    if len(header) == 1:
        for delimiter, label in ((";", "semicolons"), ("\t", "tabs")):
            if delimiter in header[0]:
                problems.append(f"the header {header[0]!r} is separated by {label}; the file must be comma-separated")
                return problems
    missing = [f"{name!r} ({role})" for name, role in required.items() if name not in header]
    if missing:
        problems.append(f"missing required column(s) {', '.join(missing)}; columns present: {header}")
    return problems


def _positive_integer(value: Any) -> bool:
    """Whether ``value`` is a positive whole number (``3``, ``3.0``; not ``True``, ``1.5``, ``"3"`` or ``0``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer() and value >= 1


def _parse_time_unit(time_unit: Any) -> tuple[float | None, str | None]:
    """Years per unit of ``time_unit``, or ``(None, problem)``."""
    per_year = TIME_UNITS.get(time_unit.strip().lower()) if isinstance(time_unit, str) else None
    if per_year is None:
        return None, f"time_unit must be one of {', '.join(repr(u) for u in TIME_UNITS)}, got {time_unit!r}"
    return per_year, None


def _parse_outcome(
    cells: Mapping[str, str], columns: Mapping[str, str]
) -> tuple[float | None, float | None, list[str]]:
    """The time (in the CSV's unit) and event of one row, or the reasons they are unusable."""
    problems = []
    time, reason = _number_problem(f"time ({columns['time']!r})", cells[columns["time"]])
    if reason is None and time < 0:
        time, reason = None, f"time ({columns['time']!r}) {cells[columns['time']]!r} is negative"
    if reason:
        problems.append(reason)
    event_value = cells[columns["event"]]
    event = EVENT_VALUES.get(event_value)
    if event is None:
        shown = "is empty" if not event_value else f"{event_value!r} is not 0 or 1"
        problems.append(f"event ({columns['event']!r}) {shown}; it must be 0 (censored) or 1 (event)")
    return time, event, problems


def _parse_row(
    cells: Mapping[str, str],
    row: int,
    case_id: str | None,
    columns: Mapping[str, str | None],
    covariates: Sequence[str],
    per_year: float | None,
    base_dir: str,
) -> tuple[dict[str, Any] | None, str | None, list[str]]:
    """One data row: ``(entry or None, resolved image path or None, problem lines)``.

    ``columns["time"]``/``columns["event"]`` are ``None`` when the outcomes are not read (inference without them).
    """
    reasons = []
    image_value = cells[columns["image"]]
    image = None
    if not image_value:
        reasons.append(f"image path ({columns['image']!r}) is empty")
    else:
        try:
            image = resolve_path(image_value, base_dir)
        except ValueError as exc:
            reasons.append(f"image {exc}")
    outcomes = columns["time"] is not None
    time, event = None, None
    if outcomes:
        time, event, outcome_reasons = _parse_outcome(cells, columns)
        reasons += outcome_reasons
    values = []
    for name in covariates:
        value, reason = _number_problem(f"covariate {name!r}", cells[name])
        if reason:
            reasons.append(reason)
        values.append(value)
    problems = [f"{_where(row, case_id)}: {reason}" for reason in reasons]
    if problems or (outcomes and per_year is None):
        return None, image, problems
    split = cells.get(columns["split"]) if columns["split"] is not None else None
    entry: dict[str, Any] = {"case_id": case_id, "image": image}
    if outcomes:
        entry.update(time=float(time) / per_year, event=float(event))
    entry.update(covariates=[float(v) for v in values], split=split or None, row=row)
    return entry, image, problems


def _duplicate_problems(ids: Mapping[str, list[int]], from_stems: bool) -> list[str]:
    """One line per case id shared by several rows, naming every row."""
    origin = " (taken from the image file names, as there is no case id column)" if from_stems else ""
    return [
        f"rows {', '.join(str(r) for r in rows)}: duplicate case id {case_id!r}{origin}; case ids must be unique"
        for case_id, rows in ids.items()
        if len(rows) > 1
    ]


@dataclass(frozen=True)
class CohortColumns:
    """How a cohort CSV is laid out: the keyword arguments :func:`read_cohort_csv`, :func:`inference_cohort` and
    :func:`load_cohort` take for it (the configs' ids of the same names).

    Args:
        image_col: column of image paths.
        time_col: column of follow-up times (optional at inference).
        event_col: column of event indicators (optional at inference).
        id_col: column of case ids (optional column; file stems without it).
        covariates: names of numeric covariate columns (each is required).
        split_col: column assigning rows to splits (optional column).
        time_unit: unit of the time column: ``"days"``, ``"months"`` or ``"years"``.
    """

    image_col: str = "image"
    time_col: str = "time"
    event_col: str = "event"
    id_col: str | None = "case_id"
    covariates: Sequence[str] = ()
    split_col: str | None = "split"
    time_unit: str = "days"

    def __post_init__(self) -> None:
        covariates = self.covariates  # one name may be given as a string
        object.__setattr__(
            self, "covariates", (covariates,) if isinstance(covariates, str) else tuple(covariates or ())
        )


_COLUMN_FIELDS = tuple(f.name for f in dataclasses.fields(CohortColumns))


@dataclass
class _CohortRow:
    """One data row of a cohort CSV as read.

    Args:
        row: the data row number (as the problem lines name it).
        case_id: its case id, ``None`` when unknown (an empty id cell, an empty image path without an id column, a
            row whose fields do not match the header).
        entry: its entry when every cell is valid, else ``None``.
        image: its resolved image path, ``None`` when the cell is empty or not a usable path.
        split: its split cell, ``None`` when empty, without a split column or when the fields do not match the header.
        problems: the problem lines of its cells (not of its case id being shared with other rows).
    """

    row: int
    case_id: str | None
    entry: dict[str, Any] | None
    image: str | None
    split: str | None
    problems: list[str]


def _case_rows(rows: Sequence[_CohortRow]) -> dict[str, list[int]]:
    """Case id -> the numbers of the rows with that id, in file order (rows without an id left out)."""
    ids: dict[str, list[int]] = {}
    for row in rows:
        if row.case_id:
            ids.setdefault(row.case_id, []).append(row.row)
    return ids


def _read_rows(
    csv_path: str | os.PathLike,
    columns: CohortColumns,
    base_dir: str | os.PathLike | None = None,
    max_cases: int | None = None,
    require_outcomes: bool = True,
) -> tuple[list[_CohortRow], list[str], str, bool]:
    """Read the CSV into its rows, each with its own problems, and the problems of the file as a whole.

    Without ``require_outcomes`` the time and event columns may both be absent (inference on new cases); when
    either is present, both are required and checked.

    Returns:
        ``(rows, problems, source, has_ids)``: every data row read (none when the file or its header is unusable);
        the problems of the file as a whole (the arguments, the file, its header, no data rows); the source name for
        messages; whether the case ids come from the id column (else from the image file names).
    """
    path = os.path.abspath(os.path.expanduser(os.fspath(csv_path)))
    source = f"cohort CSV {path!r}"
    image_col, time_col, event_col, id_col = columns.image_col, columns.time_col, columns.event_col, columns.id_col
    split_col, covariates = columns.split_col, list(columns.covariates)
    per_year, unit_problem = _parse_time_unit(columns.time_unit)
    problems = [unit_problem] if unit_problem else []
    if max_cases is not None and not _positive_integer(max_cases):
        problems.append(f"max_cases must be a positive integer or null, got {max_cases!r}")
        max_cases = None
    header, rows, file_problems = _read_table(path)
    problems += file_problems
    if header is None:
        return [], problems, source, False
    outcomes = require_outcomes or time_col in header or event_col in header
    required = {image_col: "image_col", **({time_col: "time_col", event_col: "event_col"} if outcomes else {})}
    required.update({name: "covariate" for name in covariates if name not in required})
    header_problems = _header_problems(header, required)
    problems += header_problems
    if header_problems:
        return [], problems, source, False
    if not rows:
        return [], problems + ["the file has a header but no data rows"], source, False
    if max_cases is not None:
        rows = rows[: int(max_cases)]
    has_ids = id_col is not None and id_col in header
    columns = {
        "image": image_col,
        "time": time_col if outcomes else None,
        "event": event_col if outcomes else None,
        "split": split_col if split_col is not None and split_col in header else None,
    }
    base = os.path.dirname(path) if base_dir is None else os.path.abspath(os.path.expanduser(os.fspath(base_dir)))
    out = []
    for row, fields in rows:
        if len(fields) != len(header):
            problem = f"row {row}: has {len(fields)} fields but the header has {len(header)} columns"
            out.append(_CohortRow(row, None, None, None, None, [problem]))
            continue
        cells = {name: value.strip() for name, value in zip(header, fields)}
        case_id = cells[id_col] if has_ids else (file_stem(cells[image_col]) if cells[image_col] else None)
        row_problems = [f"row {row}: case id ({id_col!r}) is empty"] if has_ids and not case_id else []
        entry, image, cell_problems = _parse_row(cells, row, case_id, columns, covariates, per_year, base)
        split = cells[columns["split"]] if columns["split"] is not None else None
        entry = entry if case_id else None
        out.append(_CohortRow(row, case_id or None, entry, image, split or None, row_problems + cell_problems))
    return out, problems, source, has_ids


def _parse_cohort(
    csv_path: str | os.PathLike,
    columns: CohortColumns,
    base_dir: str | os.PathLike | None = None,
    max_cases: int | None = None,
    require_outcomes: bool = True,
) -> tuple[list[dict[str, Any]], list[str], list[tuple[int, str | None, str]], str]:
    """Parse the CSV, collecting every problem (of the file, of every row, then the shared case ids).

    Returns:
        ``(entries, problems, images, source)``: the entries of valid rows, the problem lines, ``(row, case_id,
        absolute image path)`` of every row with an image path (valid or not, for the image preflight), and the
        source name for messages.
    """
    rows, problems, source, has_ids = _read_rows(csv_path, columns, base_dir, max_cases, require_outcomes)
    problems += [line for row in rows for line in row.problems]
    problems += _duplicate_problems(_case_rows(rows), from_stems=not has_ids)
    entries = [row.entry for row in rows if row.entry is not None]
    images = [(row.row, row.case_id, row.image) for row in rows if row.image is not None]
    return entries, problems, images, source


def read_cohort_csv(
    csv_path: str | os.PathLike,
    base_dir: str | os.PathLike | None = None,
    max_cases: int | None = None,
    **columns: Any,
) -> list[dict[str, Any]]:
    """Read a survival cohort CSV, checking every row and reporting all problems in one error.

    Each data row becomes ``{"case_id": str, "image": absolute path, "time": years, "event": 0.0 or 1.0,
    "covariates": [float, ...] in the order of ``covariates``, "split": str or None, "row": int}``. ``row`` is the
    1-based data row number (the header is row 0; blank lines are counted but skipped), which is also what problem
    lines name. Cells are read as strings and stripped of surrounding spaces; nothing is coerced silently.

    - ``time`` must be a finite number >= 0, in ``time_unit`` (``"days"``: divided by 365.25, ``"months"``: by
      12, ``"years"``: as is).
    - ``event`` must be exactly ``0``, ``1``, ``0.0`` or ``1.0`` (1 = event, 0 = censored).
    - ``image`` must be non-empty; relative paths are resolved against ``base_dir`` (default: the CSV's folder).
      It may be a file or a DICOM series folder; whether it exists is checked by the image preflight
      (:func:`load_cohort`), not here.
    - Covariates must be finite numbers. Without an ``id_col`` column the case id is the image file name without
      its image suffix (:func:`common.data.formats.file_stem`). Case ids must be unique. The ``split_col`` column
      is optional (``split`` is ``None`` without it or for an empty cell); its values are checked by
      :func:`split_cohort`.

    Args:
        csv_path: the CSV file (comma-separated, UTF-8, with a header line).
        base_dir: folder that relative image paths are resolved against; defaults to the CSV's folder.
        max_cases: keep only the first ``max_cases`` data rows (``None``: all); the rest are not checked.
        columns: the layout of the CSV, the arguments of :class:`CohortColumns`.

    Returns:
        One entry per data row, in file order.

    Raises:
        CohortError: listing every problem, each naming the row (and case id when known): the file missing,
            unreadable, empty or not a comma-separated text file; missing columns (with the columns present);
            an empty, non-numeric, non-finite or negative time; an event other than 0/1; an empty image path; an
            empty or non-numeric covariate; duplicate case ids (naming every row sharing one); an unknown
            ``time_unit``.
        TypeError: for an argument that is not one of :class:`CohortColumns`.
    """
    entries, problems, _, source = _parse_cohort(csv_path, CohortColumns(**columns), base_dir, max_cases)
    if problems:
        raise CohortError(problems, source)
    return entries


def _failing_entry(row: _CohortRow, problems: list[str], named: bool) -> dict[str, Any]:
    """The entry of an inference row that fails its input check: ``row <N>`` unless ``named`` by its own id."""
    return {
        "case_id": row.case_id if named else f"row {row.row}",
        "image": row.image or "",
        "covariates": [],
        "split": row.split,
        "row": row.row,
        PROBLEMS_KEY: problems,
    }


def _inference_entries(rows: Sequence[_CohortRow], has_ids: bool) -> list[dict[str, Any]]:
    """One entry per row: a valid row's entry, else a failing entry with its problems (and its shared case id)."""
    shared = {case: numbers for case, numbers in _case_rows(rows).items() if len(numbers) > 1}
    entries = []
    for row in rows:
        problems = list(row.problems)
        if row.case_id in shared:
            problems += _duplicate_problems({row.case_id: shared[row.case_id]}, from_stems=not has_ids)
        if row.entry is not None and not problems:
            entries.append(row.entry)
        else:
            entries.append(_failing_entry(row, problems, named=bool(row.case_id) and row.case_id not in shared))
    return entries


def _select_split(
    entries: list[dict[str, Any]], split: Any, split_col: str | None, source: str
) -> list[dict[str, Any]]:
    """The entries whose split cell names ``split``; failing rows naming no split are left out with a warning.

    Raises:
        CohortError: for an unknown ``split``, or one that selects no row.
    """
    wanted = SPLIT_NAMES.get(str(split).strip().lower())
    if wanted is None:
        raise CohortError([f"split must be one of {'/'.join(SPLIT_NAMES)} or null, got {split!r}"], source)
    kept = [e for e in entries if SPLIT_NAMES.get(str(e["split"]).strip().lower()) == wanted]
    unknown = [str(e["row"]) for e in entries if PROBLEMS_KEY in e and e["split"] is None]
    if unknown:
        logger.warning(
            f"{source}: row(s) {', '.join(unknown)} fail their check and name no split (an empty split cell, or "
            f"fields that do not match the header): left out of split {split!r}."
        )
    if not kept:
        if all(e["split"] is None for e in entries):
            reason = f"the split column {split_col!r} is missing or empty"
        else:
            reason = f"no row of the split column {split_col!r} names it"
        raise CohortError([f"split {split!r} selects no case: {reason}"], source)
    return kept


def inference_cohort(
    csv_path: str | os.PathLike | None = None,
    dataset_dir: str | os.PathLike | None = None,
    pattern: str | None = None,
    split: str | None = None,
    **columns: Any,
) -> list[dict[str, Any]]:
    """The cases of an inference (or evaluation) run: from a cohort CSV, or every image file in a folder.

    With ``csv_path``: its rows, read like :func:`read_cohort_csv` except that the time and event columns may both
    be absent (new cases without follow-up; when either is present both are checked and returned, so metrics can
    be computed); relative image paths are resolved against the CSV's folder, whatever ``dataset_dir`` is; with
    ``split``, only the rows whose split column names that split (``train``/``training``, ``val``/``validation``,
    ``test``/``testing``). Without ``csv_path``: every volume under ``dataset_dir`` (recursively; NIfTI, NRRD,
    MetaImage files and DICOM series folders, or what matches ``pattern``), named by its file stem
    (:func:`common.data.datalist.find_volumes`); covariates then cannot be given.

    A problem of one row fails that row only (unlike :func:`read_cohort_csv`, which refuses the whole file): the
    row is returned as a failing entry carrying its problem lines under ``"case_problems"``
    (:data:`common.engines.cases.PROBLEMS_KEY`), the key by which the
    inference engine (:meth:`common.engines.cases.CaseRun.select`) records a case as failing its input check (a
    ``check`` row of failures.csv) without running it, while the other rows run. The row problems are those of
    :func:`read_cohort_csv`, with the same lines naming the row (and case) and the column: an empty, non-numeric,
    non-finite or negative time, an event other than 0/1, an empty image path, an empty or non-numeric covariate,
    an empty case id cell, a case id shared with other rows, a row whose number of fields differs from the header.

    - A failing row is named by its case id when it has one of its own; a row without one is named ``row <N>``
      (``N`` its data row number, as in the problem lines): an empty case id cell (with an id column), an empty
      image path (without one), a row whose fields do not match the header, and every row of a case id shared by
      several rows (each fails, with a line naming all the rows sharing it, so no two entries share an id). A case
      id of the CSV spelled ``row <N>`` itself may then clash with such a name; the engine refuses the clash.
    - With ``split``, a failing row is kept only when its split cell names that split; a row whose fields do not
      match the header has no readable split cell and is kept only when ``split`` is ``None`` (a warning names the
      failing rows left out for naming no split).

    Args:
        csv_path: the cohort CSV, or ``None``/empty to list image files.
        dataset_dir: the folder to search when no CSV is given.
        pattern: glob of the images to search for (no CSV); ``None`` lists every volume format.
        split: keep only this split of the CSV; ``None`` keeps every row.
        columns: the layout of the CSV, the arguments of :class:`CohortColumns` (``covariates``: those the model
            uses, required).

    Returns:
        One entry per case, in file order. A valid row: ``{"case_id", "image", ("time": years, "event": 0.0 or 1.0,)
        "covariates": [float, ...], "split": str or None, "row": int}``, the time and event when the CSV has them.
        A failing row: ``{"case_id": its id or "row <N>", "image": absolute path or "" (empty or not a path),
        "covariates": [], "split": str or None, "row": int, "case_problems": [problem line, ...]}`` (no time or
        event). Without a CSV: ``{"case_id", "image", "covariates": []}``.

    Raises:
        CohortError: for problems of the CSV as a whole (the file missing, unreadable, empty or not a
            comma-separated text file; missing columns, with the columns present; a header without data rows; an
            unknown ``time_unit``), an unknown ``split``, a ``split`` without a split column or matching rows (failing
            rows count), or covariates without a CSV.
        MissingInputError: when no CSV is given and no volume is found under ``dataset_dir`` (naming the folder and
            the formats or ``pattern`` looked for).
    """

    layout = CohortColumns(**columns)
    covariates = list(layout.covariates)
    if not csv_path:
        if covariates:
            raise CohortError(
                [f"the model uses covariates {covariates}; give them per case in a cohort CSV (csv_path)"],
                "inference cohort",
            )
        if dataset_dir is None:
            raise CohortError(["give a cohort CSV (csv_path) or a folder of images (dataset_dir)"], "inference cohort")
        entries = inference_entries(dataset_dir, keys=["image"], pattern=pattern)
        return [{"case_id": e["case_id"], "image": e["image"], "covariates": []} for e in entries]
    rows, problems, source, has_ids = _read_rows(csv_path, layout, require_outcomes=False)
    if problems:
        raise CohortError(problems, source)
    entries = _inference_entries(rows, has_ids)
    return entries if split is None else _select_split(entries, split, layout.split_col, source)


def _round_half_up(value: float) -> int:
    return int(math.floor(value + 0.5))


def _validation_counts(n_events: int, n_censored: int, val_fraction: float) -> tuple[int, int]:
    """How many events and censored cases go to validation (see :func:`split_cohort` for the guarantees)."""
    if val_fraction <= 0 or n_events + n_censored < 2:
        return 0, 0
    val_events = _round_half_up(val_fraction * n_events)
    val_censored = min(_round_half_up(val_fraction * n_censored), n_censored)
    if n_events:
        val_events = min(val_events, n_events - 1)  # at least one event stays in training
        if n_events >= 2:
            val_events = max(val_events, 1)  # and one goes to validation when there are two
    if val_events + val_censored == 0:
        if n_censored:
            val_censored = 1
        else:
            val_events = 1
    if val_events + val_censored == n_events + n_censored:  # only without events: keep one case for training
        val_censored -= 1
    return val_events, val_censored


def _random_split(entries: list[dict[str, Any]], val_fraction: float, seed: int) -> dict[str, list[dict[str, Any]]]:
    """Seeded split stratified by event; sections keep the input order."""
    events = [i for i, entry in enumerate(entries) if entry["event"] == 1]
    censored = [i for i, entry in enumerate(entries) if entry["event"] != 1]
    val_events, val_censored = _validation_counts(len(events), len(censored), val_fraction)
    rng = np.random.default_rng(seed)
    chosen = set(rng.permutation(events)[:val_events].tolist()) if events else set()
    chosen |= set(rng.permutation(censored)[:val_censored].tolist()) if censored else set()
    return {
        "training": [entry for i, entry in enumerate(entries) if i not in chosen],
        "validation": [entry for i, entry in enumerate(entries) if i in chosen],
    }


def _column_split(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Split by the entries' ``split`` values.

    Raises:
        CohortError: naming every row whose value is not a known split name.
    """
    sections: dict[str, list[dict[str, Any]]] = {"training": [], "validation": []}
    problems = []
    accepted = "/".join(SPLIT_NAMES)
    for entry in entries:
        section = SPLIT_NAMES.get(str(entry["split"]).strip().lower())
        if section is None:
            where = _where(entry.get("row", "?"), entry.get("case_id"))
            problems.append(f"{where}: split {entry['split']!r} is not one of {accepted} (case-insensitive)")
            continue
        sections.setdefault(section, []).append(entry)
    if problems:
        raise CohortError(problems, "cohort split column")
    return sections


def split_cohort(
    entries: Sequence[dict[str, Any]], val_fraction: float = 0.2, seed: int = 0, use_split_column: bool = True
) -> dict[str, list[dict[str, Any]]]:
    """Split cohort entries into ``training`` and ``validation`` (and ``testing``).

    When ``use_split_column`` is set and every entry has a ``split`` value, the values decide: ``train`` /
    ``training``, ``val`` / ``validation``, ``test`` / ``testing`` (case-insensitive); ``testing`` is present only
    when some entry has it. When no entry has a value (or ``use_split_column`` is False), the split is random,
    seeded and stratified by event: a fraction ``val_fraction`` (rounded half up) of the events and of the censored
    cases goes to validation. With ``val_fraction > 0`` and at least 2 cases, each section gets at least one
    case, training keeps at least one event when there is one, and validation gets at least one event when there
    are two or more. Sections keep the input order; the same entries and seed always give the same split.

    Args:
        entries: entries as returned by :func:`read_cohort_csv`.
        val_fraction: fraction of cases for validation in a random split, in ``[0, 1)``.
        seed: seed of the random split.
        use_split_column: whether the entries' ``split`` values decide when they are all present.

    Returns:
        ``{"training": [...], "validation": [...]}`` plus ``"testing"`` when the split column names test cases.

    Raises:
        CohortError: naming the rows whose split value is unknown, or, when only some entries have a split value,
            the rows without one (a partly filled split column is ambiguous: fill it for every row or leave it
            empty).
        ValueError: when ``val_fraction`` is not in ``[0, 1)``.
    """
    entries = list(entries)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    if use_split_column:
        missing = [entry for entry in entries if not entry.get("split")]
        if not missing and entries:
            return _column_split(entries)
        if len(missing) < len(entries):
            rows = ", ".join(str(entry.get("row", "?")) for entry in missing)
            problem = (
                f"the split column is filled for {len(entries) - len(missing)} of {len(entries)} rows but empty for "
                f"rows {rows}; fill it for every row, or leave it empty for a random split by val_fraction"
            )
            raise CohortError([problem], "cohort split column")
    return _random_split(entries, float(val_fraction), int(seed))


def _validated_horizons(horizons: Any) -> tuple[list[float], list[str]]:
    """The horizons that are positive finite numbers, and the problems of the others and of their order."""
    if horizons is None:
        return [], []
    values = [horizons] if isinstance(horizons, numbers.Real) else list(horizons)
    good, problems = [], []
    for h in values:
        number = float(h) if isinstance(h, numbers.Real) and not isinstance(h, bool) else None
        if number is None or not math.isfinite(number) or number <= 0:
            problems.append(f"horizon {h!r} is not a positive number of years")
        else:
            good.append(number)
    if any(b <= a for a, b in zip(good, good[1:])):
        problems.append(f"horizons must be strictly increasing, got {values!r}")
    return good, problems


def _cut_point_problems(cut_points: Any, max_training_time: float | None) -> list[str]:
    """Problems of explicit logistic-hazard cut points ``[0 = c_0 < c_1 < ... < c_K]``."""
    if hasattr(cut_points, "tolist"):  # numpy arrays, tensors
        cut_points = cut_points.tolist()
    if isinstance(cut_points, (str, bytes)) or not isinstance(cut_points, Sequence):
        return [f"cut_points must be a list of at least 2 numbers [0, c_1, ..., c_K] (years), got {cut_points!r}"]
    values = [float(c) if isinstance(c, numbers.Real) and not isinstance(c, bool) else None for c in cut_points]
    if len(values) < 2 or any(v is None or not math.isfinite(v) for v in values):
        return [
            f"cut_points must be a list of at least 2 finite numbers [0, c_1, ..., c_K] (years), got {cut_points!r}"
        ]
    problems = []
    if values[0] != 0:
        problems.append(f"cut_points must start at 0, got {cut_points!r}")
    if any(b <= a for a, b in zip(values, values[1:])):
        problems.append(f"cut_points must be strictly increasing, got {cut_points!r}")
    if max_training_time is not None and values[-1] > max_training_time:
        problems.append(
            f"the last cut point {values[-1]:g} years is beyond the largest follow-up time of the training split "
            f"({max_training_time:.4g} years); no training case can inform the last interval(s)"
        )
    return problems


def check_cohort(
    sections: Mapping[str, Sequence[dict[str, Any]]],
    horizons: Sequence[float] | None = (1, 3, 5),
    cut_points: Sequence[float] | None = None,
) -> None:
    """Check that a split cohort can be trained and evaluated, reporting every problem at once.

    Args:
        sections: ``{"training": [...], "validation": [...], ("testing": [...])}`` from :func:`split_cohort`.
        horizons: evaluation horizons in years: positive, strictly increasing, and each below the largest
            follow-up time of every split (IPCW metrics such as td-AUC and the Brier score are undefined at or
            beyond the end of follow-up, where the censoring survival estimate may reach 0).
        cut_points: explicit logistic-hazard cut points ``[0, c_1, ..., c_K]`` (years) to check: starting at 0,
            strictly increasing, the last one not beyond the largest training follow-up time; ``None`` skips.

    Raises:
        CohortError: listing every problem: an empty training split or one without events, an empty validation
            split or one without events, invalid horizons or horizons at or beyond follow-up (naming the horizon,
            the split and its largest time), no horizon inside the validation follow-up window, invalid cut points.
    """
    problems = []
    training = list(sections.get("training") or [])
    if not training:
        problems.append("the training split is empty")
    elif not any(entry["event"] == 1 for entry in training):
        problems.append(
            f"the training split has no events (all {len(training)} cases are censored); a survival model needs at "
            "least one event to learn from"
        )
    validation = list(sections.get("validation") or [])
    if not validation:
        problems.append(
            "the validation split is empty; set val_fraction > 0 or mark validation rows in the split column"
        )
    elif not any(entry["event"] == 1 for entry in validation):
        problems.append(
            f"the validation split has no events (all {len(validation)} cases are censored); the C-index, td-AUC "
            "and Brier scores of the validation need at least one event"
        )
    good, horizon_problems = _validated_horizons(horizons)
    problems += horizon_problems
    if validation and training and good:
        # the validation metrics use the horizons in [earliest, latest) follow-up of the validation split, cut at
        # the training split's latest time (common.survival.metrics.followup_window): none there, no metric at all
        first = min(float(entry["time"]) for entry in validation)
        last = min(max(float(entry["time"]) for entry in split) for split in (validation, training))
        if not any(first <= h < last for h in good):
            problems.append(
                f"no horizon of {[float(h) for h in good]} lies in the follow-up window of the validation split "
                f"[{first:.4g}, {last:.4g}) years (its earliest follow-up time to the largest one of the validation "
                "and training splits), so no validation metric could be computed; use horizons in that window"
            )
    max_times = {
        name: max(float(entry["time"]) for entry in sections[name])
        for name in SECTIONS
        if name in sections and sections[name]
    }
    for h in good:
        for name, max_time in max_times.items():
            if h >= max_time:
                problems.append(
                    f"horizon {h:g} years is at or beyond the largest follow-up time of the {name} split "
                    f"({max_time:.4g} years); IPCW metrics (td-AUC, Brier score) are undefined beyond follow-up, so "
                    f"use horizons below {max_time:.4g} years"
                )
    if cut_points is not None:
        problems += _cut_point_problems(cut_points, max_times.get("training"))
    if problems:
        raise CohortError(problems, "cohort check")


def _as_array(values: Any, name: str) -> np.ndarray:
    """A 1D float64 numpy array of ``values`` (lists, numpy arrays and CPU/GPU tensors)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def cut_points_from_quantiles(time: Any, event: Any, num_intervals: int) -> list[float]:
    """Logistic-hazard cut points from the training data: ``[0, q_1, ..., q_{K-1}, t_max]``.

    ``q_k`` is the ``k/K`` quantile (linear interpolation, ``numpy.quantile``'s default) of the training EVENT
    times, and the last boundary is the largest training follow-up time (event or censored), so every training
    time falls in an interval ``(c_k, c_{k+1}]``. Tied boundaries (ties in the event times, quantiles at 0 or at
    the largest time) are merged, so the boundaries are strictly increasing and the number of intervals may be
    smaller than ``num_intervals``: use the length of the returned list minus one.

    Args:
        time: training follow-up times (years), 1D.
        event: training event indicators (1 = event), 1D, same length.
        num_intervals: the number of intervals ``K`` wanted (at least 1).

    Returns:
        The boundaries ``[0 = c_0 < c_1 < ... < c_K']`` as floats, ``K' <= num_intervals``.

    Raises:
        ValueError: when there are no events, times are negative or not finite, the lengths differ, the largest
            time is 0, or ``num_intervals`` is not a positive integer.
    """
    if isinstance(num_intervals, bool) or not isinstance(num_intervals, (int, np.integer)) or num_intervals < 1:
        raise ValueError(f"num_intervals must be a positive integer, got {num_intervals!r}")
    t, e = _as_array(time, "time"), _as_array(event, "event")
    if t.shape != e.shape:
        raise ValueError(f"time and event must have the same length, got {t.shape[0]} and {e.shape[0]}")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError("time must hold finite values >= 0 to compute cut points")
    event_times = t[e == 1]
    if event_times.size == 0:
        raise ValueError(
            f"cannot compute cut points from the quantiles of the event times: none of the {t.size} training cases "
            "has an event"
        )
    t_max = float(t.max())
    if t_max <= 0:
        raise ValueError(f"cannot compute cut points: the largest follow-up time is {t_max!r}")
    inner = np.quantile(event_times, np.arange(1, num_intervals) / num_intervals) if num_intervals > 1 else []
    boundaries = [0.0]
    for value in [*map(float, inner), t_max]:  # event-time quantiles never exceed t_max
        if value > boundaries[-1]:
            boundaries.append(value)
    return boundaries


def covariate_stats(entries: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Mean and standard deviation of each covariate over ``entries`` (the training split).

    The standard deviation is the population one (``ddof=0``); a constant covariate gets 1, so standardising
    ``(x - mean) / std`` never divides by 0.

    Args:
        entries: entries with a ``"covariates"`` list each, all of the same length.

    Returns:
        ``(mean, std)``, two lists with one float per covariate (empty without covariates).

    Raises:
        ValueError: when ``entries`` is empty or the covariate lists differ in length.
    """
    entries = list(entries)
    if not entries:
        raise ValueError("covariate_stats needs at least one entry (the training split is empty)")
    lengths = {len(entry["covariates"]) for entry in entries}
    if len(lengths) > 1:
        raise ValueError(f"all entries must have the same number of covariates, got lengths {sorted(lengths)}")
    values = np.asarray([entry["covariates"] for entry in entries], dtype=np.float64).reshape(len(entries), -1)
    mean = values.mean(axis=0)
    std = values.std(axis=0)
    std = np.where(np.isfinite(std) & (std > 0), std, 1.0)
    return [float(m) for m in mean], [float(s) for s in std]


def _preflight_images(
    images: Sequence[tuple[int, str | None, str]],
    shard: tuple[int, int] | None,
    patch_size: Sequence[int] | None,
    preflight_kwargs: Mapping[str, Any],
) -> list[tuple[int, str]]:
    """Run the image preflight on every row's image; return ``(row, problem line)`` pairs naming the rows."""

    if not images:
        return []
    datalist = {_PREFLIGHT_SECTION: [{"image": image} for _, _, image in images]}
    try:
        run_preflight(
            datalist,
            sections=(_PREFLIGHT_SECTION,),
            required=(_PREFLIGHT_SECTION,),
            keys=("image",),
            patch_size=patch_size,
            shard=shard,
            **preflight_kwargs,
        )
    except PreflightError as exc:
        out = []
        for line in exc.problems:
            match = _PREFLIGHT_LINE.match(line)
            if match is None:
                out.append((0, f"image preflight: {line}"))
                continue
            row, case_id, _ = images[int(match.group(1))]
            out.append((row, f"{_where(row, case_id)}: image {match.group(2)}"))
        return out
    except ValueError as exc:  # an invalid option (patch_size, num_workers, ...)
        return [(0, f"image preflight: {exc}")]
    return []


def _cohort_problems(
    csv_path: str | os.PathLike,
    read_args: tuple[CohortColumns, str | os.PathLike | None, int | None],
    val_fraction: float,
    seed: int,
    use_split_column: bool,
    horizons: Sequence[float] | None,
    cut_points: Sequence[float] | None,
    num_intervals: int | None,
) -> tuple[dict[str, Any], list[str], list[tuple[int, str | None, str]], str]:
    """Read, split and check the cohort; return ``(result, problems, images, source)``.

    Split and cohort checks run only when every row is valid (on a partial cohort their messages would
    mislead).
    """
    entries, problems, images, source = _parse_cohort(csv_path, *read_args)
    result: dict[str, Any] = {}
    if problems:
        return result, problems, images, source
    try:
        sections = split_cohort(entries, val_fraction=val_fraction, seed=seed, use_split_column=use_split_column)
        check_cohort(sections, horizons=horizons, cut_points=cut_points)
    except CohortError as exc:
        return result, exc.problems, images, source
    except ValueError as exc:  # val_fraction
        return result, [str(exc)], images, source
    training = sections["training"]
    result.update(sections)
    if cut_points is not None:
        result["cut_points"] = [float(c) for c in cut_points]
    elif num_intervals is not None:
        try:
            result["cut_points"] = cut_points_from_quantiles(
                [e["time"] for e in training], [e["event"] for e in training], num_intervals
            )
        except ValueError as exc:
            problems.append(str(exc))
        else:
            found = len(result["cut_points"]) - 1
            if found < int(num_intervals):  # tied event times merged boundaries; the network has num_intervals
                problems.append(
                    f"'num_intervals' {num_intervals}: the training event times give only {found} distinct "
                    f"intervals (tied quantiles); use --num_intervals {found} or explicit --cut_points."
                )
    else:
        result["cut_points"] = None
    result["covariate_mean"], result["covariate_std"] = covariate_stats(training)
    return result, problems, images, source


def load_cohort(
    csv_path: str | os.PathLike,
    base_dir: str | os.PathLike | None = None,
    val_fraction: float = 0.2,
    seed: int = 0,
    use_split_column: bool = True,
    horizons: Sequence[float] | None = (1, 3, 5),
    cut_points: Sequence[float] | None = None,
    num_intervals: int | None = None,
    preflight: bool = True,
    patch_size: Sequence[int] | None = None,
    max_cases: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Read, split and check a survival cohort and preflight its images; every problem is raised in one report.

    The CSV is read with :func:`read_cohort_csv` (the first ``max_cases`` data rows only, when given), split with
    :func:`split_cohort` and checked with :func:`check_cohort` (split and cohort checks run once every row is
    valid). With ``preflight``, every row's image (also of rows with other problems) is checked with
    :func:`common.data.preflight.preflight` (exists, readable, 3D, finite). All problems are raised in one
    :class:`CohortError`, a line each naming the row and case, before anything is written (on the command line
    the command ends with the report and exit status 1). Nothing is written on success either.

    Under ``torch.distributed`` every rank reads the (small) CSV itself and checks a different share of the
    images; the problems of all ranks are gathered, so every rank raises the same report and all stop together,
    as :func:`common.data.preflight.run_preflight` does. Every rank returns the same (deterministic) result.

    Args:
        csv_path: the cohort CSV; see :func:`read_cohort_csv`.
        base_dir: folder for relative image paths; defaults to the CSV's folder.
        val_fraction: validation fraction of the random split (when the split column does not decide).
        seed: seed of the random split.
        use_split_column: whether a fully filled split column decides the split.
        horizons: evaluation horizons in years.
        cut_points: explicit logistic-hazard cut points ``[0, ..., c_K]`` in years; they take precedence over
            ``num_intervals``.
        num_intervals: number of logistic-hazard intervals whose cut points come from the training event-time
            quantiles (:func:`cut_points_from_quantiles`) when ``cut_points`` is not given.
        preflight: whether to check the images.
        patch_size: training patch size for the image preflight (see :func:`common.data.preflight.check_volume`).
        max_cases: keep only the first ``max_cases`` data rows (smoke runs, tests).
        options: the layout of the CSV (the arguments of :class:`CohortColumns`) and further options of
            :func:`common.data.preflight.preflight` (``allow_pad``, ``check_values``, ``num_workers``,
            ``num_channels``).

    Returns:
        ``{"training": [...], "validation": [...], ("testing": [...],) "cut_points": [...] or None,
        "covariate_mean": [...], "covariate_std": [...]}``, the entries as :func:`read_cohort_csv` returns them
        (times in years) and the covariate statistics of the training split.

    Raises:
        CohortError: listing every problem of every rank, rows in order.
    """
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    columns = CohortColumns(**{name: options.pop(name) for name in _COLUMN_FIELDS if name in options})
    result, problems, images, source = _cohort_problems(
        csv_path,
        (columns, base_dir, max_cases),
        val_fraction,
        seed,
        use_split_column,
        horizons,
        cut_points,
        num_intervals,
    )
    image_problems: list[tuple[int, str]] = []
    if preflight:
        shard = (dist.get_rank(), dist.get_world_size()) if distributed else None
        image_problems = _preflight_images(images, shard, patch_size, options)
    if distributed:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (problems, image_problems))
        problems = list(dict.fromkeys(p for g in gathered for p in g[0]))
        image_problems = list(dict.fromkeys(p for g in gathered for p in g[1]))
    lines = problems + [line for _, line in sorted(image_problems, key=lambda item: item[0])]
    if lines:
        raise CohortError(lines, source)
    return result

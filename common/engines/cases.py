# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Inference over a cohort: every case processed once, a bad case never stops the run, a restart skips what is
done, and the ranks of a torchrun job share the cases.

A bundle's inference config builds one :class:`CaseRun` (id ``cases``) and routes its cases through it::

    datalist -> cases.select() -> CaseDataset -> CaseLoader -> evaluator (cases attached) -> cases.finish()

- :meth:`CaseRun.select` gives each case its id, checks that the prediction folder takes files, leaves out the cases
  already written (unless ``overwrite``), deals the rest to the ranks in turn and checks the headers of this rank's
  share, listing every problem at once.
- :class:`CaseDataset` screens, reads and preprocesses a case; an error makes the item a failure record (stage
  ``check`` for a DICOM series that is not a regular volume or a volume with NaN/Inf voxels, ``read`` for a loader,
  ``transform`` for the other steps) instead of an exception, and :class:`CaseLoader` (a ``ThreadDataLoader``:
  reading overlaps the model) hands the failures to the run and never yields an empty batch. It also takes the
  fingerprint of the case's inputs (:func:`input_fingerprint`).
- :meth:`CaseRun.attach` guards the evaluator's iteration: an error in the model or the writers fails the case
  (stage ``model`` or ``write``; a batch of several cases is redone case by case so that only the culprit fails),
  the others go on; a full disk or a folder that refuses files stops the run (the next cases would fail the same
  way). Writers write into :func:`staging_dir` of ``output_dir``, each case's files named after its
  :func:`common.data.pipeline.output_stem`; after a case's iteration its files are moved (``os.replace``, atomic)
  into ``output_dir`` and a record ``.done/<case>.json`` says it is complete: its files, its values, the identity of
  the weights and settings, and the fingerprint of its inputs. A case is only ever counted as written, or skipped
  as already written, when that record, its files, the weights, the settings and the inputs all agree.
- :meth:`CaseRun.finish` gathers the ranks' failures into ``failures.csv`` and, with ``merge``, the records of
  every case into the bundle's cohort tables (rank 0, after every rank is done), prints
  ``N written, M failed: see <output_dir>/failures.csv`` and sets the exit status the bundle's ``run`` ends with
  (:data:`EXIT_ALL_WRITTEN` 0, :data:`EXIT_NONE_WRITTEN` 1, :data:`EXIT_SOME_FAILED` 2).

With ``fail_fast`` the first problem ends the run with ``error: ...`` instead (exit status 1).
"""

from __future__ import annotations

import collections
import csv
import errno
import io
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from monai.data import Dataset as MonaiDataset
from monai.data import ThreadDataLoader, decollate_batch, list_data_collate
from monai.transforms import Compose, LoadImage, LoadImaged, apply_transform

from common.data.dicom import is_dicom_input, series_files, series_problems
from common.data.formats import file_stem
from common.data.pipeline import output_stem
from common.data.preflight import PreflightError
from common.engines.identity import config_identity, digest, module_digest, runtime_identity, sha256_file
from common.errors import UserError
from common.runs import config_being_parsed
from common.utils import (
    OutputWriteError,
    describe_write_error,
    destroy_distributed,
    get_rank,
    get_world_size,
    os_error_in_chain,
    write_text_atomic,
)

__all__ = [
    "DONE_DIR",
    "EXIT_ALL_WRITTEN",
    "EXIT_NONE_WRITTEN",
    "EXIT_SOME_FAILED",
    "FAILURES_CSV",
    "INPUTS_KEY",
    "PROBLEMS_KEY",
    "STAGES",
    "CaseDataset",
    "CaseFailedError",
    "CaseFailure",
    "CaseLoader",
    "CaseRun",
    "case_collate",
    "case_id_of",
    "input_fingerprint",
    "staging_dir",
]

logger = logging.getLogger(__name__)

FAILURES_CSV = "failures.csv"
DONE_DIR = ".done"
STAGING_DIR = ".staging"
EXIT_ALL_WRITTEN, EXIT_NONE_WRITTEN, EXIT_SOME_FAILED = 0, 1, 2
#: where a case can fail: its input check, its reading, the other preprocessing, the model, writing its outputs
STAGES = ("check", "read", "transform", "model", "write")
#: the entry key of a case's own problems (a list of lines, e.g. a cohort CSV row with a bad cell): the case fails its
#: check and the others run
PROBLEMS_KEY = "case_problems"
#: the item key where :class:`CaseDataset` puts the fingerprint of the case's inputs (JSON text)
INPUTS_KEY = "case_inputs"
#: entry keys that are bookkeeping, not inputs: the case id and a table's row number
_NOT_INPUTS = ("case_id", "row", PROBLEMS_KEY, INPUTS_KEY)
#: the longest output name stem: a file name is at most 255 bytes on common file systems, with room for a postfix
MAX_STEM_BYTES = 200
#: errors of the file system that the next writes would meet too: the run stops instead of failing every case
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM})
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n'\"]*)")
_FAILURE_KEY = "__case_failure__"
_READERS = (LoadImage, LoadImaged)


class CaseFailedError(UserError):
    """A case failed and the run was asked to stop at the first failure (``fail_fast``)."""


@dataclass(frozen=True)
class CaseFailure:
    """One row of ``failures.csv``: the case, its input, the stage (one of :data:`STAGES`) and the reason."""

    case_id: str
    input: str
    stage: str
    reason: str

    def line(self) -> str:
        """The failure as one log line: the case, its input, the stage and the reason."""
        return f"case {self.case_id} ({self.input}) failed at {self.stage}: {self.reason}"


def case_id_of(entry: Any, keys: Sequence[str] = ("image",)) -> str:
    """The id of a case: its ``case_id``, else the stem of its first file under ``keys``."""
    if isinstance(entry, Mapping):
        case = entry.get("case_id")
        if case is not None and str(case).strip():
            return str(case)
        for key in keys:
            if isinstance(entry.get(key), (str, os.PathLike)):
                return file_stem(entry[key])
            if isinstance(entry.get(key), (list, tuple)) and entry[key]:  # the files of a DICOM series
                return file_stem(os.path.dirname(str(entry[key][0])))
    raise UserError(f"an inference input has neither a 'case_id' nor a file under {list(keys)}: {entry!r}")


def _input_of(entry: Any, keys: Sequence[str]) -> str:
    """The input files of a case as one string (``;`` between keys; a DICOM series by its folder)."""
    if not isinstance(entry, Mapping):
        return ""
    values = []
    for key in keys:
        value = entry.get(key)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, os.PathLike)) for v in value):
            value = os.path.dirname(str(value[0]))
        if isinstance(value, (str, os.PathLike)):
            values.append(str(value))
    return ";".join(values)


def _reason(exc: BaseException) -> str:
    """One line naming the innermost cause of ``exc`` (MONAI wraps a transform's error in ``RuntimeError``)."""
    seen: set[int] = set()
    while exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    message = " ".join(str(exc).split()) or type(exc).__name__
    message = message if len(message) <= 300 else message[:297] + "..."
    return message if isinstance(exc, UserError) else f"{type(exc).__name__}: {message}"


def _written_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` of a refused write behind ``exc``: in its chain, or - MONAI's ``SaveImage`` raises a
    ``RuntimeError`` holding its writers' tracebacks as text - named in its message."""
    found = os_error_in_chain(exc)
    seen: set[int] = set()
    current: BaseException | None = exc
    while found is None and current is not None and id(current) not in seen:
        seen.add(id(current))
        match = _ERRNO_TEXT.search(str(current))
        found = OSError(int(match.group(1)), match.group(2).strip()) if match else None
        current = current.__cause__ or current.__context__
    return found


def _write_reason(error: OSError) -> str:
    """The reason of a ``write`` failure: what the refused write means (``the disk is full (No space left on
    device)``), whatever the writer wrapped it in."""
    return f"OSError: [Errno {error.errno}] {describe_write_error(error)}"


def _is_disk_error(error: OSError | None) -> bool:
    """Whether ``error`` is one that every next case would hit too (a full disk or quota, a read-only or refusing
    folder, a file too large): the run stops instead of failing case after case."""
    return error is not None and error.errno in _DISK_ERRNOS


# -- the fingerprint of a case's inputs --------------------------------------------------------------------------------


def _data_files(path: str) -> list[str]:
    """The data files a header file names (MetaImage ``ElementDataFile``, NRRD ``data file``, an Analyze ``.img``),
    which a reader of ``path`` reads too."""
    lower = path.lower()
    folder = os.path.dirname(path)
    if lower.endswith(".hdr"):
        return [p for p in (path[:-4] + ".img", path[:-4] + ".img.gz") if os.path.isfile(p)]
    if not lower.endswith((".mhd", ".nhdr")):
        return []
    try:
        with open(path, encoding="latin-1") as handle:
            header = handle.read(1 << 16)
    except OSError:
        return []
    found = re.search(r"^(?:ElementDataFile\s*=|data file\s*:)\s*(.+?)\s*$", header, re.MULTILINE | re.IGNORECASE)
    if not found or found.group(1).upper() in ("LOCAL", "LIST"):
        return []
    data = os.path.join(folder, found.group(1))
    return [data] if os.path.isfile(data) else []


def _files_of(value: Any) -> list[str] | None:
    """The files an input value makes a reader read (a folder - a DICOM series -: its files; a header: its data
    files too), or ``None`` when ``value`` names no file."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, os.PathLike)) for v in value):
        return [os.fspath(v) for v in value]
    if not isinstance(value, (str, os.PathLike)):
        return None
    path = os.path.expanduser(os.fspath(value))
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
        return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
    return [path, *_data_files(path)]


def _file_print(path: str) -> dict[str, Any]:
    """One file of a case's fingerprint: its path, size, ``mtime_ns`` and sha256 (``missing`` when it is gone)."""
    try:
        stat = os.stat(path)
    except OSError:
        return {"path": path, "missing": True}
    return {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_file(path)}


def _row_values(entry: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The values of a datalist entry or CSV row besides its image keys and bookkeeping (a covariate, a label):
    part of what the case's output is made from."""
    return {str(k): v for k, v in entry.items() if k not in keys and k not in _NOT_INPUTS}


def input_fingerprint(entry: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """What a case's output is made from besides the weights and settings: for every file it reads (the files under
    ``keys``: a file, a header's data file, every file of a DICOM series) its path, size, modification time
    (nanoseconds) and sha256; and the hash of the entry's other values (a cohort CSV row's covariates, time and
    event), the case id and row number left out.

    Args:
        entry: the case's entry.
        keys: the entry keys holding its input files.
    """
    files = {key: [_file_print(p) for p in listed] for key in keys if (listed := _files_of(entry.get(key)))}
    return {"files": files, "values": digest(_row_values(entry, keys), files=False)}


def _same_file(path: str, recorded: Mapping[str, Any], hashed: bool = False) -> bool:
    """Whether ``path`` holds the bytes ``recorded`` (:func:`input_fingerprint`) describes: the same path, size and
    modification time (the fast path, unless ``hashed``), else the same sha256."""
    try:
        stat = os.stat(path)
    except OSError:
        return False
    if recorded.get("missing") or stat.st_size != recorded.get("size"):
        return False
    if not hashed and path == recorded.get("path") and stat.st_mtime_ns == recorded.get("mtime_ns"):
        return True
    return sha256_file(path) == recorded.get("sha256")


def _same_inputs(recorded: Any, entry: Mapping[str, Any], keys: Sequence[str], hashed: bool = False) -> bool:
    """Whether the inputs of ``entry`` are those its record's fingerprint describes (every file by its sha256 with
    ``hashed``)."""
    if not isinstance(recorded, Mapping) or recorded.get("values") != digest(_row_values(entry, keys), files=False):
        return False
    current = {key: listed for key in keys if (listed := _files_of(entry.get(key)))}
    files = recorded.get("files") or {}
    if set(current) != set(files):
        return False
    return all(
        len(current[key]) == len(files[key]) and all(_same_file(p, r, hashed) for p, r in zip(current[key], files[key]))
        for key in current
    )


def _changed_while_read(fingerprint: Mapping[str, Any]) -> str | None:
    """The first input file whose size or modification time differs from ``fingerprint`` now, or ``None``."""
    for prints in fingerprint["files"].values():
        for recorded in prints:
            try:
                stat = os.stat(recorded["path"])
            except OSError:
                return recorded["path"]
            if (stat.st_size, stat.st_mtime_ns) != (recorded.get("size"), recorded.get("mtime_ns")):
                return recorded["path"]
    return None


def _non_finite_problem(item: Mapping[str, Any], keys: Sequence[str]) -> str | None:
    """A problem line when a volume read under ``keys`` holds NaN or infinite voxels (training's preflight refuses
    them too: no output made from them would mean anything)."""
    for key in keys:
        value = item.get(key)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        nan = int(torch.isnan(value).sum())
        inf = int(torch.isinf(value).sum())
        if nan or inf:
            return (
                f"{key!r} holds {nan} NaN and {inf} infinite voxel(s) of {value.numel()}: not a valid volume "
                "(the output would be meaningless)"
            )
    return None


def _series_problems(entry: Mapping[str, Any], keys: Sequence[str], allow_irregular: bool) -> list[str]:
    """The geometry problems of the DICOM series among the inputs (missing, duplicate or unevenly spaced slices,
    mixed series: :func:`common.data.dicom.series_problems`)."""

    problems = []
    for key in keys:
        value = entry.get(key)
        if value is not None and not isinstance(value, (int, float)) and is_dicom_input(value):
            problems += series_problems(series_files(value), allow_irregular=allow_irregular)
    return problems


class CaseDataset(MonaiDataset):
    """A ``monai.data.Dataset`` whose item is a failure record instead of an exception when screening, reading or
    preprocessing a case fails; the steps of ``transform`` run one by one, so the record names the stage and the
    innermost reason:

    - ``check``: a DICOM series among the inputs is not a regular volume (missing, duplicate or unevenly spaced
      slices, mixed series; ``allow_irregular_series`` accepts uneven spacing and missing slices), or a volume
      just read holds NaN or infinite voxels;
    - ``read``: a loader (``LoadImage(d)``, or a transform with ``reads_files = True``) failed, or an input file
      changed while it was read;
    - ``transform``: another step failed.

    Every item carries its ``case_id`` (:func:`case_id_of`) and, under :data:`INPUTS_KEY`, the fingerprint of the
    inputs it was made from (:func:`input_fingerprint`, taken before reading; JSON text).

    Args:
        data: the entries (dicts).
        transform: the preprocessing (a ``Compose`` or one transform), or ``None``.
        keys: the entry keys holding the input files (case ids, fingerprints and the ``input`` column of
            ``failures.csv``).
        allow_irregular_series: accept DICOM series with missing slices or uneven spacing (read as ITK reads them:
            with the spacing of their first slices).
    """

    def __init__(
        self,
        data: Sequence,
        transform: Callable | None = None,
        keys: Sequence[str] = ("image",),
        allow_irregular_series: bool = False,
    ) -> None:
        super().__init__(data=data, transform=transform)
        self.keys = [keys] if isinstance(keys, str) else list(keys)
        self.allow_irregular_series = bool(allow_irregular_series)

    def _transform(self, index: int) -> Any:
        """Case ``index`` screened (a DICOM series), fingerprinted and passed through the transforms one step at a
        time, so that a failure names its stage (``check``, ``read`` or ``transform``); a failed case is a failure
        record instead of an exception."""
        entry = self.data[index]
        case = case_id_of(entry, self.keys)

        def failed(stage: str, reason: str) -> dict[str, CaseFailure]:
            return {_FAILURE_KEY: CaseFailure(case, _input_of(entry, self.keys), stage, reason)}

        try:
            problems = _series_problems(entry, self.keys, self.allow_irregular_series)
        except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
            return failed("check", _reason(exc))
        if problems:
            return failed("check", "; ".join(problems))
        try:
            fingerprint = input_fingerprint(entry, self.keys)
        except OSError as exc:
            return failed("read", _reason(exc))
        steps = self.transform.flatten().transforms if isinstance(self.transform, Compose) else [self.transform]
        options = {}
        if isinstance(self.transform, Compose):
            options = {"map_items": self.transform.map_items, "unpack_items": self.transform.unpack_items}
        item = dict(entry)
        for step in steps if self.transform is not None else []:
            reads = isinstance(step, _READERS) or getattr(step, "reads_files", False)
            try:
                item = apply_transform(step, item, **options)
            except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
                return failed("read" if reads else "transform", _reason(exc))
            problem = _non_finite_problem(item, self.keys) if reads and isinstance(item, Mapping) else None
            if problem:
                return failed("check", problem)
        changed = _changed_while_read(fingerprint)
        if changed is not None:
            return failed("read", f"{changed} changed while it was read; run again to read its new content")
        if isinstance(item, dict):
            item.setdefault("case_id", case)
            item[INPUTS_KEY] = json.dumps(fingerprint, sort_keys=True)
        return item


def case_collate(items: Sequence[Any]) -> tuple[Any, list[CaseFailure]]:
    """``(batch of the good items or None, failure records)`` (``list_data_collate`` of the good items)."""
    failed = [i[_FAILURE_KEY] for i in items if isinstance(i, Mapping) and _FAILURE_KEY in i]
    good = [i for i in items if not (isinstance(i, Mapping) and _FAILURE_KEY in i)]
    return (list_data_collate(good) if good else None), failed


class CaseLoader(ThreadDataLoader):
    """A ``monai.data.ThreadDataLoader`` (the next batch is read in a background thread, with ``num_workers``
    processes under it when set) of a :class:`CaseDataset` whose failed cases go to ``cases``
    (:meth:`CaseRun.fail`); a batch whose cases all failed is not yielded, and nothing more is once the run is
    stopping (``fail_fast``, a full disk).

    Args:
        dataset: a :class:`CaseDataset`.
        cases: the run the failures go to.
        buffer_size: batches read ahead.
        kwargs: the other arguments of ``ThreadDataLoader``/``DataLoader`` (``batch_size``, ``num_workers``, ...);
            ``collate_fn`` is :func:`case_collate`.
    """

    def __init__(self, dataset: CaseDataset, cases: CaseRun, buffer_size: int = 1, **kwargs: Any) -> None:
        kwargs["collate_fn"] = case_collate
        super().__init__(dataset, buffer_size=buffer_size, **kwargs)
        self.cases = cases

    def __iter__(self):
        """The batches that hold at least one good case; the failures go to ``cases`` first."""
        for batch, failed in super().__iter__():
            for failure in failed:
                self.cases.fail(failure)
            if self.cases.stopping is not None:
                return
            if batch is not None:
                yield batch


def staging_dir(output_dir: str | os.PathLike) -> str:
    """Where this rank's writers put a case's files until the case is complete (:class:`CaseRun` then moves them
    into ``output_dir``): ``<output_dir>/.staging/rank<r>``."""
    return os.path.join(os.fspath(output_dir), STAGING_DIR, f"rank{get_rank()}")


def _writable(folder: Path) -> None:
    """Make ``folder`` and check that it takes a file (written, synced and removed).

    Raises:
        OutputWriteError: naming the folder and the cause (a read-only file system, no permission, a full disk).
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".write-check.", dir=folder)
        try:
            os.write(handle, b"\0" * 4096)
            os.fsync(handle)
        finally:
            os.close(handle)
            os.unlink(probe)
    except OSError as error:
        raise OutputWriteError(
            error.errno,
            f"the prediction folder {str(folder)!r} is not writable: {describe_write_error(error)}; no case was run",
        ) from error


def _case_insensitive(folder: Path) -> bool:
    """Whether the file system of ``folder`` (which exists) treats names differing in case as one."""
    handle, probe = tempfile.mkstemp(prefix=".Case-Check.", dir=folder)
    os.close(handle)
    try:
        return os.path.exists(os.path.join(folder, os.path.basename(probe).lower()))
    finally:
        os.unlink(probe)


class CaseRun:
    """The bookkeeping of one inference run over a cohort (see the module's description).

    A case counts as written, or is skipped as already written, only when its record (``.done/<case>.json``) lists
    its files and they hold the bytes it recorded (the same size and modification time, else the same sha256), the
    record's identity is this run's (:mod:`common.engines.identity`: the whole resolved config, the weights the
    network holds, the software and the device; built outside a config, ``identity`` and the network) and its
    inputs are those the record fingerprinted (:func:`input_fingerprint`: the same size and modification time, else
    the same sha256; a CSV row's values). Any other case is redone, with one warning line counting the cases and
    saying why (the settings that differ, by id);
    a case that fails loses its earlier record and files, so the folder never holds a result it no longer vouches
    for. Two cases never share a file: names are the cases' :func:`common.data.pipeline.output_stem`, and stems that
    only differ in case are refused on a file system that does not tell them apart.

    Args:
        output_dir: the predictions folder (``failures.csv``, the ``.done`` records and the staging folder in it).
        keys: the entry keys holding a case's input files.
        check: ``entries -> one list of problems per entry``, run on this rank's cases before any is processed
            (e.g. :func:`common.data.preflight.screen_entries` as a partial); ``None`` checks nothing. An entry's own
            :data:`PROBLEMS_KEY` problems fail it too.
        fail_fast: stop at the first problem (a check lists all of them first) with ``error: ...``, exit status 1.
        overwrite: redo the cases already written.
        identity: what makes the outputs besides the config this run is built by (JSON values; a path of an
            existing file stands for its bytes): a CaseRun built outside a bundle config (in Python) names its
            settings here; inside a config the whole config is part of the identity already.
        values: ``(batch, output) -> one dict per case`` of JSON values kept in each case's record (the input of
            ``merge``); ``None`` keeps none.
        merge: ``records -> None``, run on rank 0 after every rank is done with the records (``case_id``,
            ``input``, ``outputs``, ``values``) of every case written so far, in the order of the inputs (e.g. a
            cohort's table).
        progress: show a progress bar on an interactive rank 0 (a log line per ``log_every_s`` elsewhere).
        log_every_s: seconds between progress log lines when there is no bar.
        product: what the run makes when one folder may hold several products of the same cases (an autoencoder's
            ``reconstruct`` and ``encode``): their records are kept apart, in ``.done/<product>/``.
        device: the device the model runs on: its type is part of the identity (and the thread count on the CPU).
        network: the module (or modules) that make the outputs: the weights they hold when the cases are selected
            (after the config's ``initialize`` loaded them) are part of the identity, whatever file they came from.
        verify_inputs: compare every input and output file of a written case with its record by its sha256, not by
            its size and modification time first (which miss new bytes of the same size written with the old
            modification time put back).
        windows: objects whose ``sw_batch_size`` the out-of-memory back-off may halve (sliding-window inferers,
            samplers; ``None`` entries are skipped): a case made with fewer windows per batch than configured says so
            in its record (``effective``).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        keys: Sequence[str] = ("image",),
        check: Callable[[list[dict]], list[list[str]]] | None = None,
        fail_fast: bool = False,
        overwrite: bool = False,
        identity: Any = None,
        values: Callable[[Any, Any], list[dict]] | None = None,
        merge: Callable[[list[dict]], Any] | None = None,
        progress: bool = True,
        log_every_s: float = 60.0,
        product: str | None = None,
        device: str | torch.device | None = None,
        windows: Sequence[Any] = (),
        network: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        verify_inputs: bool = False,
    ) -> None:
        flags = {"fail_fast": fail_fast, "overwrite": overwrite, "progress": progress, "verify_inputs": verify_inputs}
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise UserError(f"'{name}' must be true or false, got {flag!r}.")
        self.output_dir = Path(output_dir)
        self.keys = [keys] if isinstance(keys, str) else list(keys)
        self.check, self.values, self.merge = check, values, merge
        self.fail_fast, self.overwrite, self.progress = fail_fast, overwrite, progress
        self.verify_inputs = verify_inputs
        self.log_every_s = float(log_every_s)
        self.given_digest = digest(identity)  # files named in it are hashed once
        self.device = device
        self.networks = [] if network is None else [network] if isinstance(network, torch.nn.Module) else list(network)
        self.windows = [w for w in windows if w is not None]
        self.done_dir = self.output_dir / DONE_DIR / product if product else self.output_dir / DONE_DIR
        self.made_with: dict[str, str] = {}  # what makes the outputs, a digest per part (see :meth:`_identify`)
        self.identity = ""  # their digest, taken when the cases are selected
        self.rank, self.world = get_rank(), get_world_size()
        if self.world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise UserError(
                f"this is one of {self.world} processes (WORLD_SIZE) but no process group is set up: add "
                "configs/multi_gpu_inference.json after configs/inference.json, so that the processes share the cases."
            )
        self.staging_dir = staging_dir(self.output_dir)
        self.order: dict[str, int] = {}
        self.inputs: dict[str, str] = {}
        self.failures: list[CaseFailure] = []
        self.written = self.skipped = self.total = self.ran = 0
        self.elapsed = 0.0  # seconds from the first case read to the end of the evaluator's run
        self.exit_code = EXIT_ALL_WRITTEN  # the process's exit status after :meth:`finish` (rank 0 carries it)
        # why the run stops before its last case: fail_fast, a full disk, Ctrl-C (a KeyboardInterrupt)
        self.stopping: BaseException | None = None
        self._windows_configured: list[int] = []
        self._engine: Engine | None = None
        self._sigint: Any = None  # the SIGINT handler to put back after the run
        self._bar: Any = None
        self._started = self._last_log = time.monotonic()

    def _identify(self, items: Any = None) -> None:
        """Take the identity of the outputs (see the class description) when the cases are selected: the run's set-up
        has chosen the thread count and the config's ``initialize`` has loaded the weights. :attr:`made_with` keeps a
        digest per part - per config id, so a redo can name the settings that changed - and :attr:`identity` their
        digest."""
        parts: dict[str, Any] = {"given": self.given_digest, "weights": module_digest(self.networks)}
        parts.update({f"runtime:{k}": v for k, v in runtime_identity(self.device).items()})
        resolver = config_being_parsed()
        if resolver is not None:
            parts.update(config_identity(resolver, items))
        self.made_with = {key: digest(value, files=False) for key, value in parts.items()}
        self.identity = digest(self.made_with, files=False)

    # -- records -----------------------------------------------------------------------------------------------------

    def _record_path(self, case: str) -> Path:
        """``.done/<case>.json`` (the case id percent-encoded, so that any id is one file name)."""
        return self.done_dir / f"{urllib.parse.quote(case, safe='')}.json"

    def _record(self, case: str) -> dict | None:
        """The record of ``case``, or ``None`` when it has none or it is unreadable (the case is then redone)."""
        try:
            record = json.loads(self._record_path(case).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _state(self, case: str, entry: Mapping[str, Any]) -> tuple[str, dict | None]:
        """``done``, or why the case is to be done: ``new`` (no record), ``outputs`` (a file it lists is missing or
        no longer holds the bytes it recorded: the same size and modification time, else the same sha256),
        ``settings`` (other weights, settings or software), ``inputs`` (its inputs changed since); and its record."""
        record = self._record(case)
        if record is None:
            return "new", None
        files = record.get("output_files")
        names = record.get("outputs", [])
        if "made_with" not in record:
            return "settings", record  # written by an earlier version of the collection
        if not isinstance(files, list) or len(files) != len(names):
            return "outputs", record
        outputs = [str(self.output_dir / n) for n in names]
        if not all(_same_file(p, f, self.verify_inputs) for p, f in zip(outputs, files) if isinstance(f, Mapping)):
            return "outputs", record
        if record.get("identity") != self.identity:
            return "settings", record
        same = _same_inputs(record.get("inputs"), entry, self.keys, self.verify_inputs)
        return ("done" if same else "inputs"), record

    def _changed_settings(self, records: Sequence[dict]) -> list[str]:
        """The parts of :attr:`made_with` (config ids, ``weights``, ``torch``, ``threads``...) that differ from those
        the ``records`` were written with."""
        changed: set[str] = set()
        for record in records:
            theirs = record.get("made_with")
            if not isinstance(theirs, dict):
                changed.add("an earlier version's record")
                continue
            for key in set(theirs) | set(self.made_with):
                if theirs.get(key) != self.made_with.get(key):
                    changed.add(key.removeprefix("=").removeprefix("runtime:"))
        return sorted(changed)

    def _forget(self, case: str) -> None:
        """Remove the record of ``case`` and the files it lists (a case about to be rewritten, or that failed)."""
        record = self._record(case)
        if record is None:
            return
        self._record_path(case).unlink(missing_ok=True)
        for name in record.get("outputs", []):
            if name and os.path.basename(name) == name:
                (self.output_dir / name).unlink(missing_ok=True)

    # -- choosing the cases ------------------------------------------------------------------------------------------

    def select(self, items: Sequence[Mapping[str, Any]]) -> list[dict]:
        """This rank's cases of ``items`` still to do, after their check; see the class description.

        Raises:
            UserError: for two cases with one id (their outputs would overwrite each other), or with output names
                that only differ in case on a file system that does not tell them apart, or, with ``fail_fast``,
                for the problems of the check (all listed).
            OutputWriteError: when the prediction folder does not take files (nothing is run).
        """
        self._identify(items)  # the object the config resolved: the ids it was found with are left as written
        items = [dict(item) for item in items]
        ids = [case_id_of(item, self.keys) for item in items]
        duplicates = sorted(case for case, n in collections.Counter(ids).items() if n > 1)
        if duplicates:
            raise UserError(
                f"{len(duplicates)} case id(s) name several inputs ({', '.join(duplicates[:5])}): the outputs are "
                "named by the case id; give each input a unique 'case_id' (or a unique file name)."
            )
        self.order = {case: i for i, case in enumerate(ids)}
        self.inputs = {case: _input_of(item, self.keys) for case, item in zip(ids, items)}
        self._windows_configured = [int(w.sw_batch_size) for w in self.windows]
        done = self._done(ids, items)
        finished = set(done)
        self.skipped = len(finished)
        remaining = [(case, item) for case, item in zip(ids, items) if case not in finished]
        mine = remaining[self.rank :: self.world]
        self.total = len(mine)
        bad = self._problems(mine)  # with fail_fast they stop the run here, before anything is written
        for folder in (self.output_dir, self.done_dir) if self.rank == 0 else ():
            _writable(folder)
        shutil.rmtree(self.staging_dir, ignore_errors=True)  # what a killed run left half-written
        _writable(Path(self.staging_dir))
        self._refuse_names_one_file_system_merges(ids)
        if self.rank == 0:
            share = f", {self.total} on this rank of {self.world}" if self.world > 1 else ""
            skip = f"; {self.skipped} already written, skipped (--overwrite True redoes them)" if self.skipped else ""
            logger.info(f"{len(items)} case(s){skip}: {len(remaining)} to do{share}.")
        return self._without_failed(mine, bad)

    def _refuse_names_one_file_system_merges(self, ids: list[str]) -> None:
        """Refuse case ids whose output names differ only in upper/lower case when the prediction folder's file
        system does not tell them apart (one case's files would replace the other's)."""
        folded: dict[str, list[str]] = collections.defaultdict(list)
        for case in ids:
            folded[output_stem(case).casefold()].append(case)
        clashes = [cases for cases in folded.values() if len(cases) > 1]
        if clashes and self.rank == 0 and _case_insensitive(self.output_dir):
            listed = "; ".join(" / ".join(cases) for cases in clashes[:5])
            raise UserError(
                f"{len(clashes)} group(s) of case ids differ only in upper/lower case ({listed}), and the file system "
                f"of {str(self.output_dir)!r} does not tell such file names apart: their outputs would overwrite each "
                "other. Give them distinct case ids, or use a case-sensitive prediction folder."
            )

    def _done(self, ids: list[str], items: list[dict]) -> list[str]:
        """The cases already written (rank 0 decides, the others are told), with one warning line per reason the
        others are redone."""
        done: list[str] = []
        if self.overwrite:
            return done
        if self.rank == 0:
            states = [self._state(case, item) for case, item in zip(ids, items)]
            done = [case for case, (state, _) in zip(ids, states) if state == "done"]
            changed = self._changed_settings([record for state, record in states if state == "settings"])
            reasons = {
                "outputs": "have outputs that are missing or no longer hold the bytes written (truncated, emptied, "
                "replaced)",
                "settings": "were written by other weights or settings"
                + (f" ({', '.join(changed[:8])}{', ...' if len(changed) > 8 else ''})" if changed else ""),
                "inputs": "were written from inputs that have changed since (a file's content, or a CSV row's values)",
            }
            for state, why in reasons.items():
                cases = [case for case, (s, _) in zip(ids, states) if s == state]
                if cases:
                    listed = ", ".join(cases[:5]) + (", ..." if len(cases) > 5 else "")
                    logger.warning(f"{len(cases)} case(s) in {self.output_dir} {why}: redone ({listed}).")
        if self.world > 1:  # one view of what is done, before any rank writes
            box = [done]
            dist.broadcast_object_list(box, src=0)
            done = box[0]
        return done

    def _problems(self, mine: list[tuple[str, dict]]) -> dict[str, list[str]]:
        """The problems of the cases ``mine`` found before any runs: the check's, the entries' own
        (:data:`PROBLEMS_KEY`) and case ids too long for a file name.

        Raises:
            PreflightError: with ``fail_fast``, listing every problem.
        """
        problems = self.check([item for _, item in mine]) if self.check is not None and mine else [[] for _ in mine]
        bad = {}
        for (case, item), found in zip(mine, problems):
            found = [*(item.get(PROBLEMS_KEY) or []), *found]
            if len(output_stem(case).encode()) > MAX_STEM_BYTES:
                found.append(f"the case id is longer than a file name may be ({MAX_STEM_BYTES} bytes)")
            if found:
                bad[case] = found
        if bad and self.fail_fast:
            raise PreflightError(
                [f"case {case} ({self.inputs[case]}): {'; '.join(p)}" for case, p in bad.items()],
                "the inference inputs",
            )
        return bad

    def _without_failed(self, mine: list[tuple[str, dict]], bad: dict[str, list[str]]) -> list[dict]:
        """The cases of ``mine`` without problems; the others become ``check`` failures (their earlier records and
        files removed), with one warning listing them."""
        if bad:
            lines = [f"case {case} ({self.inputs[case]}): {'; '.join(p)}" for case, p in bad.items()]
            logger.warning(
                f"{len(bad)} of {len(mine)} case(s) fail the input check and are skipped (see "
                f"{self.output_dir / FAILURES_CSV}):\n" + "\n".join(f"  {line}" for line in lines)
            )
            for case, p in bad.items():
                self._forget(case)
                self.failures.append(CaseFailure(case, self.inputs[case], "check", "; ".join(p)))
                self._tick()
        return [dict(item, case_id=case) for case, item in mine if case not in bad]

    # -- running them ------------------------------------------------------------------------------------------------

    def fail(self, failure: CaseFailure) -> None:
        """Record a failed case (one console line; its earlier record and files are removed); with ``fail_fast``
        the run stops (:meth:`finish` raises :class:`CaseFailedError`)."""
        self._discard_staged()
        self._forget(failure.case_id)
        self.failures.append(failure)
        if failure.stage != "check":
            self.ran += 1
        if self.fail_fast:
            self._stop(CaseFailedError(failure.line()))
            return
        logger.warning(failure.line())
        self._tick()

    def _stop(self, error: BaseException) -> None:
        """Stop after this iteration (the loader yields nothing more); :meth:`finish` raises ``error``."""
        if self.stopping is None:
            self.stopping = error
        if self._engine is not None:
            self._engine.terminate()

    def attach(self, engine: Engine) -> None:
        """Guard ``engine``'s iteration (see the class description); its epoch ends when the loader runs out, since
        the loader leaves out batches of failed cases."""
        # ignite keeps the iteration function in ``_process_function``; wrapping it is the one way to guard a
        # MONAI workflow's iteration (model, postprocessing and the MODEL_COMPLETED writers) whatever its class:
        # ignite's public EXCEPTION_RAISED event runs after the epoch has already been abandoned, so a failed case
        # would end the run. tests/test_inference_cases.py pins that ignite calls the attribute it holds each
        # iteration and that MONAI's workflows keep their iteration there.
        process = engine._process_function

        def guarded(engine: Engine, batch: Any) -> Any:
            return self._run_batch(process, engine, batch)

        engine._process_function = guarded
        self._engine = engine
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.COMPLETED, self._completed)
        engine.add_event_handler(Events.TERMINATE, self._completed)

    def _epoch_started(self, engine: Engine) -> None:
        """At the start of the cases: the epoch runs until the loader is exhausted, the clock starts and Ctrl-C is
        caught."""
        engine.state.epoch_length = None  # ends when the loader runs out
        self._started = self._last_log = time.monotonic()
        self._catch_interrupts()

    def _completed(self, engine: Engine) -> None:
        """At the end of the cases (or a stop): the elapsed time is kept, the progress bar closed and Ctrl-C's
        handler put back."""
        self.elapsed = time.monotonic() - self._started
        self._close_bar()
        self._release_interrupts()

    def _catch_interrupts(self) -> None:
        """While the cases run, a first Ctrl-C (SIGINT) lets the case being processed finish and stops the run
        (:meth:`finish` then raises ``KeyboardInterrupt``: exit status 130 on the command line); a second one stops
        at once, as it would without this handler. Only the main thread can set a signal handler."""
        if threading.current_thread() is not threading.main_thread() or self._sigint is not None:
            return
        self._sigint = signal.getsignal(signal.SIGINT)

        def interrupted(signum: int, frame: Any) -> None:
            self._release_interrupts()
            logger.warning("interrupted: the run stops after the case being processed (Ctrl-C again stops at once).")
            self._stop(KeyboardInterrupt("interrupted by Ctrl-C"))

        signal.signal(signal.SIGINT, interrupted)

    def _release_interrupts(self) -> None:
        """Put back the SIGINT handler :meth:`_catch_interrupts` replaced (main thread only)."""
        if self._sigint is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._sigint)
            self._sigint = None

    def _run_batch(self, process: Callable, engine: Engine, batch: Any, alone: bool = False) -> Any:
        """One iteration of the engine's own ``process`` on ``batch``, guarded: its cases are committed when it
        succeeds; when it fails, a single case (or any case under ``fail_fast``, or a full disk) fails at stage
        ``model`` or ``write`` and a batch of several is redone case by case (``alone``), so that only the culprit
        fails. Returns the output, or ``None`` when nothing succeeded."""
        ids = [str(c) for c in (batch.get("case_id") or [])] if isinstance(batch, Mapping) else []
        try:
            output = process(engine, batch)
            values = self.values(batch, output) if self.values is not None else [{} for _ in ids]
        except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
            self._discard_staged()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            refused = _written_error(exc)
            if len(ids) == 1 or self.fail_fast or _is_disk_error(refused):
                case = ids[0] if ids else "?"
                stage, reason = ("model", _reason(exc)) if refused is None else ("write", _write_reason(refused))
                self.fail(CaseFailure(case, self.inputs.get(case, ""), stage, reason))
                if _is_disk_error(refused):
                    self._stop_for_disk(case, refused)
                return None
        else:
            self._commit(ids, values, batch, alone)
            return output
        # several cases: redone one by one (outside the handler's context), so only the culprit fails
        output = None
        for single in decollate_batch(batch, detach=False):
            if self.stopping is not None:
                break
            output = self._run_batch(process, engine, list_data_collate([single]), alone=True) or output
        return output

    def _stop_for_disk(self, case: str, error: OSError) -> None:
        """Stop the run after a write of ``case`` that every next case would repeat (see :func:`_is_disk_error`)."""
        self._stop(
            OutputWriteError(
                error.errno,
                f"could not write the outputs of case {case} into {str(self.output_dir)!r}: "
                f"{describe_write_error(error)}. The run stopped; what is written is complete. Free space (or make "
                "the folder writable) and run the same command again to go on.",
            )
        )

    def _discard_staged(self) -> None:
        """Remove whatever the writers staged for the current batch (never moved into the prediction folder)."""
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def _effective(self, ids: list[str], alone: bool) -> dict[str, Any]:
        """What this case was made with besides the configured settings: fewer windows per batch after an
        out-of-memory back-off; one case per batch after its batch was redone case by case; the cases it shared a
        batch with (kernels are chosen by batch size: its last bits may differ from those of a case run alone)."""
        effective: dict[str, Any] = {}
        current = [int(w.sw_batch_size) for w in self.windows]
        if current != self._windows_configured:
            effective["sw_batch_size"] = current
        if alone:
            effective["batch_size"] = 1
        if len(ids) > 1:
            effective["batch"] = list(ids)
        return effective

    def _owners(self, ids: list[str]) -> dict[str, list[str]]:
        """The staged files of each case of ``ids`` (named after its :func:`common.data.pipeline.output_stem`)."""
        staged = sorted(os.listdir(self.staging_dir)) if os.path.isdir(self.staging_dir) else []
        stems = {case: output_stem(case) for case in ids}
        owner: dict[str, list[str]] = {case: [] for case in ids}
        for name in staged:
            if not os.path.isfile(os.path.join(self.staging_dir, name)):
                raise RuntimeError(f"{name!r} in {self.staging_dir} is not a file: writers write one flat folder.")
            matches = [c for c in ids if name.startswith(f"{stems[c]}_") or name.startswith(f"{stems[c]}.")]
            if not matches and len(ids) == 1:
                matches = ids
            if not matches:
                raise RuntimeError(f"{name!r} in {self.staging_dir} is named after none of the cases {ids}.")
            owner[max(matches, key=lambda c: len(stems[c]))].append(name)
        return owner

    def _commit(self, ids: list[str], values: list[dict], batch: Any, alone: bool) -> None:
        """Move the staged files of the cases ``ids`` into ``output_dir`` and write their records; a refused write
        removes what this case moved and stops the run."""
        owner = self._owners(ids)
        prints = batch.get(INPUTS_KEY) if isinstance(batch, Mapping) else None
        for i, (case, record_values) in enumerate(zip(ids, values)):
            if self.stopping is not None:
                break
            moved: list[Path] = []
            try:
                self._forget(case)
                for name in owner[case]:
                    source = os.path.join(self.staging_dir, name)
                    with open(source, "rb") as handle:  # the bytes reach the disk before the name does
                        os.fsync(handle.fileno())
                    os.replace(source, self.output_dir / name)
                    moved.append(self.output_dir / name)
                record = {
                    "case_id": case,
                    "input": self.inputs.get(case, ""),
                    "outputs": owner[case],
                    "output_files": [_file_print(str(path)) for path in moved],
                    "identity": self.identity,
                    "made_with": self.made_with,
                    "inputs": json.loads(prints[i]) if prints is not None else None,
                    "values": record_values,
                }
                effective = self._effective(ids, alone)
                if effective:
                    record["effective"] = effective
                write_text_atomic(self._record_path(case), json.dumps(record, sort_keys=True, indent=1) + "\n")
            except OSError as exc:
                for path in moved:
                    path.unlink(missing_ok=True)
                error = _written_error(exc)
                reason = _reason(exc) if error is None else _write_reason(error)
                self.fail(CaseFailure(case, self.inputs.get(case, ""), "write", reason))
                if _is_disk_error(error):
                    self._stop_for_disk(case, error)
                continue
            self.written += 1
            self.ran += 1
            self._tick()
        self._discard_staged()

    # -- progress ----------------------------------------------------------------------------------------------------

    def _tick(self) -> None:
        """Report progress on rank 0: a tqdm bar on a terminal, else a log line every ``log_every_s`` seconds and at
        the last case, with the rate and the time left."""
        done = self.written + len(self.failures)
        if self.rank != 0 or not self.progress:
            return
        if self._bar is None and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit="case", desc="inference", dynamic_ncols=True)
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            self._bar.set_postfix(failed=len(self.failures), refresh=False)
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s or done == self.total:
            self._last_log = now
            elapsed = now - self._started
            if self.ran and elapsed > 0:
                rate = self.ran / elapsed
                left = (self.total - done) / rate
                logger.info(f"{done}/{self.total} case(s), {rate:.2f} case/s, about {left:.0f} s left")
            else:
                logger.info(f"{done}/{self.total} case(s)")

    def _close_bar(self) -> None:
        """Close the progress bar, if one is shown."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- the end -----------------------------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """After the evaluator's run: gather the ranks' failures, write ``failures.csv`` (removed when nothing
        failed) and, with ``merge``, the cohort tables (rank 0, after every rank is done); print the summary line and
        set :attr:`exit_code` (:data:`EXIT_NONE_WRITTEN` when no case is written and some failed,
        :data:`EXIT_SOME_FAILED` when some are written and some failed; on rank 0 only, which carries a torchrun
        job's status). On the command line a bundle's ``run`` list ends the process with it
        (its last item, :func:`common.runs.exit_on_command_line`); from Python it is returned.

        Returns:
            ``{"written", "skipped", "failed", "status"}`` (all ranks).

        Raises:
            CaseFailedError: with ``fail_fast``, for the first failed case (nothing more is written).
            OutputWriteError: when a write was refused for want of space or permission: the run stopped there
                (``failures.csv`` and the cohort tables are written first where the disk takes them).
            KeyboardInterrupt: when Ctrl-C stopped the run (after the tables and the summary line; what is written
                is complete, and the same command goes on from there).
        """
        self._close_bar()
        self._release_interrupts()
        local = (list(self.failures), self.written, self.elapsed, self.ran, self.stopping)
        if self.world > 1:
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, local)
        else:
            gathered = [local]
        failures = [f for part in gathered for f in part[0]]
        written = sum(part[1] for part in gathered)
        elapsed = max(part[2] for part in gathered)
        ran = sum(part[3] for part in gathered)
        stopping = next((part[4] for part in gathered if part[4] is not None), None)
        if self.rank == 0 and ran and elapsed > 0:
            logger.info(f"{ran} case(s) run in {elapsed:.2f} s on {self.world} process(es): {ran / elapsed:.3f} case/s")
        failures.sort(key=lambda f: self.order.get(f.case_id, len(self.order)))
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        if self.world > 1:  # every rank is done: rank 0 alone writes what gathers all cases
            destroy_distributed()
        if written + self.skipped == 0 and failures:
            status = EXIT_NONE_WRITTEN
        else:
            status = EXIT_SOME_FAILED if failures else EXIT_ALL_WRITTEN
        summary = {"written": written, "skipped": self.skipped, "failed": len(failures), "status": status}
        if isinstance(stopping, CaseFailedError):
            raise stopping
        staging = self.output_dir / STAGING_DIR
        if self.rank == 0 and staging.is_dir() and not any(staging.iterdir()):
            staging.rmdir()
        if self.rank == 0:
            try:
                csv_path = self._write_failures(failures)
                if self.merge is not None:
                    self.merge(self.records())
            except OSError:
                if stopping is None:
                    raise
                csv_path = self.output_dir / FAILURES_CSV  # the disk is full: the error below says so
            skipped = f" ({self.skipped} already written, skipped)" if self.skipped else ""
            print(f"{written} written{skipped}, {len(failures)} failed" + (f": see {csv_path}" if failures else ""))
        sys.stdout.flush()
        if stopping is not None:
            raise stopping
        self.exit_code = status if self.rank == 0 else EXIT_ALL_WRITTEN  # torchrun reports rank 0's status
        return summary

    def _write_failures(self, failures: list[CaseFailure]) -> Path:
        """``failures.csv`` of ``failures`` (removed when there is none)."""
        path = self.output_dir / FAILURES_CSV
        if not failures:
            path.unlink(missing_ok=True)
            return path
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(asdict(failures[0])), lineterminator="\n")
        writer.writeheader()
        writer.writerows(asdict(f) for f in failures)
        return write_text_atomic(path, buffer.getvalue())

    def records(self) -> list[dict]:
        """The records of the cases written with this run's identity, in the order of the inputs."""
        found = []
        for case in sorted(self.order, key=self.order.get):
            record = self._record(case)
            if record is not None and record.get("identity") == self.identity:
                found.append(record)
        return found

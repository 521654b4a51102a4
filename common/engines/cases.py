# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Inference over a cohort: every case processed once, a bad case never stops the run, a restart skips what is
done, and the ranks of a torchrun job share the cases.

A bundle's inference config builds one :class:`CaseRun` (id ``cases``) and routes its cases through it::

    datalist -> cases.select() -> CaseDataset -> CaseLoader -> evaluator (cases attached) -> cases.finish()

- :meth:`CaseRun.select` gives each case its id, leaves out the cases already written (unless ``overwrite``),
  deals the rest to the ranks in turn and checks the headers of this rank's share, listing every problem at once.
- :class:`CaseDataset` reads and preprocesses a case; an error makes the item a failure record (stage ``read`` for
  a loader, ``transform`` for the other steps) instead of an exception, and :class:`CaseLoader` (a
  ``ThreadDataLoader``: reading overlaps the model) hands the failures to the run and never yields an empty batch.
- :meth:`CaseRun.attach` guards the evaluator's iteration: an error in the model or the writers fails the case
  (stage ``model`` or ``write``; a batch of several cases is redone case by case so that only the culprit fails),
  the others go on. Writers write into :func:`staging_dir` of ``output_dir``; after a case's iteration its files
  are moved (``os.replace``, atomic) into ``output_dir`` and a record ``.done/<case>.json`` (its files, its values,
  the identity of the weights and settings) says it is complete.
- :meth:`CaseRun.finish` gathers the ranks' failures into ``failures.csv`` and, with ``merge``, the records of
  every case into the bundle's cohort tables (rank 0, after every rank is done), prints
  ``N written, M failed: see <output_dir>/failures.csv`` and sets the exit status the bundle's ``run`` ends with
  (:data:`EXIT_ALL_WRITTEN` 0, :data:`EXIT_NONE_WRITTEN` 1, :data:`EXIT_SOME_FAILED` 2).

With ``fail_fast`` the first problem ends the run with ``error: ...`` instead (exit status 1).
"""

from __future__ import annotations

import collections
import csv
import hashlib
import io
import json
import logging
import os
import shutil
import sys
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

from common.data.datalist import file_stem
from common.errors import UserError
from common.utils import destroy_distributed, get_rank, get_world_size, os_error_in_chain, write_text_atomic

__all__ = [
    "DONE_DIR",
    "EXIT_ALL_WRITTEN",
    "EXIT_NONE_WRITTEN",
    "EXIT_SOME_FAILED",
    "FAILURES_CSV",
    "STAGES",
    "CaseDataset",
    "CaseFailedError",
    "CaseFailure",
    "CaseLoader",
    "CaseRun",
    "case_collate",
    "case_id_of",
    "staging_dir",
]

logger = logging.getLogger(__name__)

FAILURES_CSV = "failures.csv"
DONE_DIR = ".done"
STAGING_DIR = ".staging"
EXIT_ALL_WRITTEN, EXIT_NONE_WRITTEN, EXIT_SOME_FAILED = 0, 1, 2
#: where a case can fail: its header check, its reading, the other preprocessing, the model, writing its outputs
STAGES = ("check", "read", "transform", "model", "write")
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


def _stage_of_write(exc: BaseException, default: str) -> str:
    """``write`` when the file system refused something, else ``default``."""
    return "write" if os_error_in_chain(exc) is not None else default


class CaseDataset(MonaiDataset):
    """A ``monai.data.Dataset`` whose item is a failure record instead of an exception when reading or preprocessing
    a case fails; the steps of ``transform`` run one by one, so the record names the stage (``read`` for a loader:
    ``LoadImage(d)``, or a transform with ``reads_files = True``; else ``transform``) and the innermost reason.
    Every item carries its ``case_id`` (:func:`case_id_of`).

    Args:
        data: the entries (dicts).
        transform: the preprocessing (a ``Compose`` or one transform), or ``None``.
        keys: the entry keys holding the input files (case ids and the ``input`` column of ``failures.csv``).
    """

    def __init__(self, data: Sequence, transform: Callable | None = None, keys: Sequence[str] = ("image",)) -> None:
        super().__init__(data=data, transform=transform)
        self.keys = [keys] if isinstance(keys, str) else list(keys)

    def _transform(self, index: int) -> Any:
        entry = self.data[index]
        case = case_id_of(entry, self.keys)
        steps = self.transform.flatten().transforms if isinstance(self.transform, Compose) else [self.transform]
        options = {}
        if isinstance(self.transform, Compose):
            options = {"map_items": self.transform.map_items, "unpack_items": self.transform.unpack_items}
        item = dict(entry)
        for step in steps if self.transform is not None else []:
            try:
                item = apply_transform(step, item, **options)
            except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
                reads = isinstance(step, _READERS) or getattr(step, "reads_files", False)
                stage = _stage_of_write(exc, "read") if reads else "transform"
                return {_FAILURE_KEY: CaseFailure(case, _input_of(entry, self.keys), stage, _reason(exc))}
        if isinstance(item, dict):
            item.setdefault("case_id", case)
        return item


def case_collate(items: Sequence[Any]) -> tuple[Any, list[CaseFailure]]:
    """``(batch of the good items or None, failure records)`` (``list_data_collate`` of the good items)."""
    failed = [i[_FAILURE_KEY] for i in items if isinstance(i, Mapping) and _FAILURE_KEY in i]
    good = [i for i in items if not (isinstance(i, Mapping) and _FAILURE_KEY in i)]
    return (list_data_collate(good) if good else None), failed


class CaseLoader(ThreadDataLoader):
    """A ``monai.data.ThreadDataLoader`` (the next batch is read in a background thread, with ``num_workers``
    processes under it when set) of a :class:`CaseDataset` whose failed cases go to ``cases``
    (:meth:`CaseRun.fail`); a batch whose cases all failed is not yielded.

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
        for batch, failed in super().__iter__():
            for failure in failed:
                self.cases.fail(failure)
            if batch is not None:
                yield batch


def staging_dir(output_dir: str | os.PathLike) -> str:
    """Where this rank's writers put a case's files until the case is complete (:class:`CaseRun` then moves them
    into ``output_dir``): ``<output_dir>/.staging/rank<r>``."""
    return os.path.join(os.fspath(output_dir), STAGING_DIR, f"rank{get_rank()}")


def _digest(value: Any) -> str:
    """A short hash of ``value`` (JSON), in which a path of an existing file stands for the hash of its bytes: the
    identity of the weights and settings that made a run's outputs."""

    def plain(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, (str, os.PathLike)) and os.path.isfile(v):
            sha = hashlib.sha256()
            with open(v, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 22), b""):
                    sha.update(block)
            return "sha256:" + sha.hexdigest()
        return v if isinstance(v, (int, float, bool, type(None))) else str(v)

    text = json.dumps(plain(value), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CaseRun:
    """The bookkeeping of one inference run over a cohort (see the module's description).

    Args:
        output_dir: the predictions folder (``failures.csv``, the ``.done`` records and the staging folder in it).
        keys: the entry keys holding a case's input files.
        check: ``entries -> one list of problems per entry``, run on this rank's cases before any is processed
            (e.g. :func:`common.data.preflight.screen_entries` as a partial); ``None`` checks nothing.
        fail_fast: stop at the first problem (a check lists all of them first) with ``error: ...``, exit status 1.
        overwrite: redo the cases already written.
        identity: what makes the outputs (weights paths - hashed by content -, settings): a case written under
            another identity is redone.
        values: ``(batch, output) -> one dict per case`` of JSON values kept in each case's record (the input of
            ``merge``); ``None`` keeps none.
        merge: ``records -> None``, run on rank 0 after every rank is done with the records (``case_id``,
            ``input``, ``outputs``, ``values``) of every case written so far, in the order of the inputs (e.g. a
            cohort's table).
        progress: show a progress bar on an interactive rank 0 (a log line per ``log_every_s`` elsewhere).
        log_every_s: seconds between progress log lines when there is no bar.
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
    ) -> None:
        for name, flag in (("fail_fast", fail_fast), ("overwrite", overwrite), ("progress", progress)):
            if not isinstance(flag, bool):
                raise UserError(f"'{name}' must be true or false, got {flag!r}.")
        self.output_dir = Path(output_dir)
        self.keys = [keys] if isinstance(keys, str) else list(keys)
        self.check, self.values, self.merge = check, values, merge
        self.fail_fast, self.overwrite, self.progress = fail_fast, overwrite, progress
        self.log_every_s = float(log_every_s)
        self.identity = _digest(identity)
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
        self.written = self.skipped = self.total = 0
        self.elapsed = 0.0  # seconds from the first case read to the end of the evaluator's run
        self.exit_code = EXIT_ALL_WRITTEN  # the process's exit status after :meth:`finish` (rank 0 carries it)
        self._bar: Any = None
        self._started = self._last_log = time.monotonic()

    # -- choosing the cases ------------------------------------------------------------------------------------------

    def _record_path(self, case: str) -> Path:
        return self.output_dir / DONE_DIR / f"{urllib.parse.quote(case, safe='')}.json"

    def _is_done(self, case: str) -> tuple[bool, bool]:
        """``(done, stale)``: the record exists with all its files, made with this run's identity or not."""
        try:
            record = json.loads(self._record_path(case).read_text())
        except (OSError, ValueError):
            return False, False
        complete = all((self.output_dir / name).is_file() for name in record.get("outputs", []))
        same = record.get("identity") == self.identity
        return complete and same, complete and not same

    def select(self, items: Sequence[Mapping[str, Any]]) -> list[dict]:
        """This rank's cases of ``items`` still to do, after their check; see the class description.

        Raises:
            UserError: for two cases with one id (their outputs would overwrite each other), or, with
                ``fail_fast``, for the problems of the check (all listed).
        """
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
        shutil.rmtree(self.staging_dir, ignore_errors=True)  # what a killed run left half-written
        done: list[str] = []
        if not self.overwrite:
            if self.rank == 0:
                states = [self._is_done(case) for case in ids]
                done = [case for case, (ok, _) in zip(ids, states) if ok]
                stale = sum(s for _, s in states)
                if stale:
                    logger.warning(
                        f"{stale} case(s) in {self.output_dir} were written by other weights or settings: redone."
                    )
            if self.world > 1:  # one view of what is done, before any rank writes
                box = [done]
                dist.broadcast_object_list(box, src=0)
                done = box[0]
        finished = set(done)
        self.skipped = len(finished)
        remaining = [(case, item) for case, item in zip(ids, items) if case not in finished]
        mine = remaining[self.rank :: self.world]
        self.total = len(mine)
        if self.rank == 0:
            share = f", {self.total} on this rank of {self.world}" if self.world > 1 else ""
            skip = f"; {self.skipped} already written, skipped (--overwrite True redoes them)" if self.skipped else ""
            logger.info(f"{len(items)} case(s){skip}: {len(remaining)} to do{share}.")
        return self._checked(mine)

    def _checked(self, mine: list[tuple[str, dict]]) -> list[dict]:
        if self.check is None or not mine:
            return [dict(item, case_id=case) for case, item in mine]
        problems = self.check([item for _, item in mine])
        bad = [(case, p) for (case, _), p in zip(mine, problems) if p]
        if bad:
            lines = [f"case {case} ({self.inputs[case]}): {'; '.join(p)}" for case, p in bad]
            if self.fail_fast:
                from common.data.preflight import PreflightError

                raise PreflightError(lines, "the inference inputs")
            logger.warning(
                f"{len(bad)} of {len(mine)} case(s) fail the input check and are skipped (see "
                f"{self.output_dir / FAILURES_CSV}):\n" + "\n".join(f"  {line}" for line in lines)
            )
            for case, p in bad:
                self.failures.append(CaseFailure(case, self.inputs[case], "check", "; ".join(p)))
                self._tick()
        failed = {case for case, _ in bad}
        return [dict(item, case_id=case) for case, item in mine if case not in failed]

    # -- running them ------------------------------------------------------------------------------------------------

    def fail(self, failure: CaseFailure) -> None:
        """Record a failed case (one console line), or raise it with ``fail_fast``.

        Raises:
            CaseFailedError: with ``fail_fast``.
        """
        self._discard_staged()
        if self.fail_fast:
            raise CaseFailedError(failure.line())
        self.failures.append(failure)
        logger.warning(failure.line())
        self._tick()

    def attach(self, engine: Engine) -> None:
        """Guard ``engine``'s iteration (see the class description); its epoch ends when the loader runs out, since
        the loader leaves out batches of failed cases."""
        # ignite keeps the iteration function in ``_process_function``; wrapping it is the one way to guard a
        # MONAI workflow's iteration (model, postprocessing and the MODEL_COMPLETED writers) whatever its class
        process = engine._process_function

        def guarded(engine: Engine, batch: Any) -> Any:
            return self._run_batch(process, engine, batch)

        engine._process_function = guarded
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.COMPLETED, self._completed)

    def _epoch_started(self, engine: Engine) -> None:
        engine.state.epoch_length = None  # ends when the loader runs out
        self._started = self._last_log = time.monotonic()

    def _completed(self, engine: Engine) -> None:
        self.elapsed = time.monotonic() - self._started
        self._close_bar()

    def _run_batch(self, process: Callable, engine: Engine, batch: Any) -> Any:
        ids = [str(c) for c in (batch.get("case_id") or [])] if isinstance(batch, Mapping) else []
        try:
            output = process(engine, batch)
            values = self.values(batch, output) if self.values is not None else [{} for _ in ids]
        except Exception as exc:  # noqa: BLE001 - the case fails, the run goes on
            self._discard_staged()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if len(ids) == 1 or self.fail_fast:
                case = ids[0] if ids else "?"
                failure = CaseFailure(case, self.inputs.get(case, ""), _stage_of_write(exc, "model"), _reason(exc))
                if self.fail_fast:
                    raise CaseFailedError(failure.line()) from exc
                self.fail(failure)
                return None
        else:
            self._commit(ids, values)
            return output
        # several cases: redone one by one (outside the handler's context), so only the culprit fails
        output = None
        for single in decollate_batch(batch, detach=False):
            output = self._run_batch(process, engine, list_data_collate([single])) or output
        return output

    def _discard_staged(self) -> None:
        shutil.rmtree(self.staging_dir, ignore_errors=True)

    def _commit(self, ids: list[str], values: list[dict]) -> None:
        """Move the staged files of the cases ``ids`` into ``output_dir`` and write their records."""
        staged = sorted(os.listdir(self.staging_dir)) if os.path.isdir(self.staging_dir) else []
        owner: dict[str, list[str]] = {case: [] for case in ids}
        for name in staged:
            matches = [c for c in ids if len(ids) == 1 or name.startswith(f"{c}_") or name.startswith(f"{c}.")]
            if not matches:
                raise RuntimeError(f"{name!r} in {self.staging_dir} is named after none of the cases {ids}.")
            owner[max(matches, key=len)].append(name)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for case, record_values in zip(ids, values):
            for name in owner[case]:
                source = os.path.join(self.staging_dir, name)
                with open(source, "rb") as handle:  # the bytes reach the disk before the name does
                    os.fsync(handle.fileno())
                os.replace(source, self.output_dir / name)
            record = {
                "case_id": case,
                "input": self.inputs.get(case, ""),
                "outputs": owner[case],
                "identity": self.identity,
                "values": record_values,
            }
            write_text_atomic(self._record_path(case), json.dumps(record, sort_keys=True, indent=1) + "\n")
            self.written += 1
            self._tick()

    # -- progress ----------------------------------------------------------------------------------------------------

    def _tick(self) -> None:
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
            rate = done / max(now - self._started, 1e-9)
            left = (self.total - done) / rate if rate > 0 else float("nan")
            logger.info(f"{done}/{self.total} case(s), {rate:.2f} case/s, about {left:.0f} s left")

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- the end -----------------------------------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """After the evaluator's run: gather the ranks' failures, write ``failures.csv`` (removed when nothing
        failed) and, with ``merge``, the cohort tables (rank 0, after every rank is done); print the summary line and
        set :attr:`exit_code` (:data:`EXIT_NONE_WRITTEN` when no case is written and some failed,
        :data:`EXIT_SOME_FAILED` when some are written and some failed; on rank 0 only, which carries a torchrun
        job's status). A bundle's ``run`` list ends the process with it (its last item).

        Returns:
            ``{"written", "skipped", "failed", "status"}`` (all ranks).
        """
        self._close_bar()
        failures, written, elapsed = list(self.failures), self.written, self.elapsed
        if self.world > 1:
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, (failures, written, elapsed))
            failures = [f for part, _, _ in gathered for f in part]
            written = sum(n for _, n, _ in gathered)
            elapsed = max(t for _, _, t in gathered)
        processed = written + len(failures)
        if self.rank == 0 and processed:
            logger.info(
                f"{processed} case(s) in {elapsed:.2f} s on {self.world} process(es): "
                f"{processed / max(elapsed, 1e-9):.3f} case/s"
            )
        failures.sort(key=lambda f: self.order.get(f.case_id, len(self.order)))
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        if self.world > 1:  # every rank is done: rank 0 alone writes what gathers all cases
            destroy_distributed()
        if written + self.skipped == 0 and failures:
            status = EXIT_NONE_WRITTEN
        else:
            status = EXIT_SOME_FAILED if failures else EXIT_ALL_WRITTEN
        summary = {"written": written, "skipped": self.skipped, "failed": len(failures), "status": status}
        staging = self.output_dir / STAGING_DIR
        if self.rank == 0 and staging.is_dir() and not any(staging.iterdir()):
            staging.rmdir()
        if self.rank == 0:
            csv_path = self._write_failures(failures)
            if self.merge is not None:
                self.merge(self.records())
            skipped = f" ({self.skipped} already written, skipped)" if self.skipped else ""
            print(f"{written} written{skipped}, {len(failures)} failed" + (f": see {csv_path}" if failures else ""))
        sys.stdout.flush()
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
        """The records of the cases written so far, in the order of the inputs."""
        found = []
        for case in sorted(self.order, key=self.order.get):
            try:
                record = json.loads(self._record_path(case).read_text())
            except (OSError, ValueError):
                continue
            if record.get("identity") == self.identity:
                found.append(record)
        return found

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Training and validation monitoring: throughput, data wait, memory, learning rates, losses and metrics.

Everything goes to three sinks: the log (every rank, tagged ``[rank N]``), TensorBoard and ``metrics.csv``
(rank 0). ``metrics.csv`` is in long format (``step,epoch,tag,value``) so loss terms that appear later (the
adversarial ones after warm-up) and validation metrics share one file; ``pandas.read_csv(...).pivot`` turns it
into a table.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from ignite.handlers import ProgressBar as _IgniteProgressBar
from monai.handlers import ValidationHandler

from common.metrics.key_metric import key_metric_mode
from common.utils import get_rank, get_world_size, rng_state, set_rng_state, write_text_atomic

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = [
    "MetricsRecorder",
    "ProgressBar",
    "StepValidationHandler",
    "TorchProfilerHandler",
    "TrainingMonitor",
    "close_writer",
    "global_step",
    "peak_memory_gib",
    "tensorboard_writer",
]

logger = logging.getLogger("common.monitor")


def tensorboard_writer(output_dir: str | os.PathLike) -> SummaryWriter | None:
    """The run's TensorBoard writer, on ``<output_dir>/tensorboard``: rank 0's; ``None`` on the other ranks (the
    handlers given it then log nothing to TensorBoard). Close it with :func:`close_writer` (a bundle's
    ``finalize``)."""
    if get_rank() != 0:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=os.path.join(os.fspath(output_dir), "tensorboard"))


def close_writer(writer: SummaryWriter | None) -> None:
    """Flush and close ``writer`` (nothing for ``None``)."""
    if writer is not None:
        writer.close()


def peak_memory_gib(device: torch.device | str) -> float:
    """Peak memory of this process: CUDA allocator peak on GPUs, peak resident set size on the CPU."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / 2**20 if sys.platform != "darwin" else rss_kib / 2**30


def global_step(engine: Engine) -> int:
    """The trainer iteration at which an evaluator runs (set by :class:`StepValidationHandler`), else its epoch."""
    return int(getattr(engine, "global_step", engine.state.epoch))


class StepValidationHandler(ValidationHandler):
    """MONAI's ``ValidationHandler`` that hands the trainer's iteration to the validator as ``global_step`` (so
    validation curves share the x-axis of the training curves) and runs validation with the global RNG states
    saved and restored, so the training trajectory does not depend on ``val_interval`` and a resumed run
    continues exactly as an uninterrupted one (a data loader draws from the torch RNG on every new iterator)."""

    def __call__(self, engine: Engine) -> None:
        if self.validator is not None:
            self.validator.global_step = engine.state.iteration
        state = rng_state()
        try:
            super().__call__(engine)
        finally:
            set_rng_state(state)


def _append_csv(path: Path, rows: list[tuple[int, int, str, float]]) -> None:
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["step", "epoch", "tag", "value"])
        writer.writerows(rows)


def _replace_csv_rows(path: Path, rows: list[tuple[int, int, str, float]]) -> None:
    """Write ``rows`` into the metrics CSV ``path`` in place of the rows of the same step and tag (an evaluation run
    again into the same folder, a resumed run validating a step again), atomically."""
    replaced = {(str(step), tag) for step, _, tag, _ in rows}
    kept: list[list[str]] = []
    if path.is_file():
        with open(path, newline="") as f:
            kept = [row for row in list(csv.reader(f))[1:] if len(row) != 4 or (row[0], row[2]) not in replaced]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerows([["step", "epoch", "tag", "value"], *kept, *rows])
    write_text_atomic(path, buffer.getvalue())


class TrainingMonitor:
    """Periodic training statistics for a MONAI/ignite trainer.

    Every ``interval`` iterations (and at the end of training) it reports, averaged over the window:
    ``samples_per_s`` and ``voxels_per_s`` summed over all ranks, ``data_wait`` (fraction of wall time this
    process spent blocked on the data loader), ``step_time_s``, ``peak_mem_gib``, the learning rate of each
    optimizer and the mean of every scalar tensor in ``engine.state.output`` (loss terms). Loss values stay on
    the device between reports, so no host synchronisation is added per iteration.

    Args:
        interval: iterations per report.
        summary_writer: TensorBoard writer (``None`` on ranks other than 0, or to disable TensorBoard).
        output_dir: folder of ``metrics.csv``, appended by rank 0 only (``None`` writes no file).
        optimizers: name -> optimizer whose learning rates are reported.
        image_key: key of the input batch in ``engine.state.output`` (for sample/voxel counts).
        tag_prefix: prefix of TensorBoard/CSV tags.
    """

    def __init__(
        self,
        interval: int = 10,
        summary_writer: Any = None,
        output_dir: str | os.PathLike | None = None,
        optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
        image_key: str = "image",
        tag_prefix: str = "train/",
    ) -> None:
        self.interval = max(int(interval), 1)
        self.writer = summary_writer
        self.csv_path = Path(output_dir) / "metrics.csv" if output_dir is not None and get_rank() == 0 else None
        self.optimizers = {k: v for k, v in (optimizers or {}).items() if v is not None}
        self.image_key = image_key
        self.tag_prefix = tag_prefix
        self.history: list[dict[str, float]] = []
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_start = time.perf_counter()
        self._wait = 0.0
        self._samples = 0
        self._voxels = 0
        self._iters = 0
        self._sums: dict[str, torch.Tensor] = {}
        self._batch_start: float | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        engine.add_event_handler(Events.GET_BATCH_STARTED, self._batch_started)
        engine.add_event_handler(Events.GET_BATCH_COMPLETED, self._batch_completed)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_completed)
        engine.add_event_handler(Events.COMPLETED, self._report)

    def _epoch_started(self, engine: Engine) -> None:
        if self._iters == 0:
            self._reset_window()

    def _batch_started(self, engine: Engine) -> None:
        self._batch_start = time.perf_counter()

    def _batch_completed(self, engine: Engine) -> None:
        if self._batch_start is not None:
            self._wait += time.perf_counter() - self._batch_start
            self._batch_start = None

    def _iteration_completed(self, engine: Engine) -> None:
        output = engine.state.output
        self._iters += 1
        if isinstance(output, Sequence) and output and isinstance(output[0], Mapping):
            # decollated: one dict per sample, scalars replicated in each
            image = output[0].get(self.image_key)
            if isinstance(image, torch.Tensor):
                self._samples += len(output)
                self._voxels += image[0].numel() * len(output)
            output = output[0]
        elif isinstance(output, Mapping):
            image = output.get(self.image_key)
            if isinstance(image, torch.Tensor):
                self._samples += image.shape[0]
                self._voxels += image[0, 0].numel() * image.shape[0]
        if isinstance(output, Mapping):
            for key, value in output.items():
                if isinstance(value, torch.Tensor) and value.numel() == 1 and key != self.image_key:
                    value = value.detach().float().reshape(())
                elif isinstance(value, (float, int)) and not isinstance(value, bool):
                    value = torch.tensor(float(value), dtype=torch.float64)
                else:
                    continue
                self._sums[key] = self._sums[key] + value if key in self._sums else value.clone()
        if engine.state.iteration % self.interval == 0:
            self._report(engine)

    def _report(self, engine: Engine) -> None:
        if self._iters == 0:
            return
        device = getattr(engine.state, "device", None) or torch.device("cpu")
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        counts = torch.tensor([self._samples, self._voxels, elapsed], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and get_world_size() > 1:
            totals = counts[:2].clone()
            dist.all_reduce(totals)
            longest = counts[2:].clone()
            dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            counts = torch.cat([totals, longest])
        samples, voxels, wall = counts.tolist()
        stats = {
            "samples_per_s": samples / wall,
            "voxels_per_s": voxels / wall,
            "data_wait": self._wait / elapsed,
            "step_time_s": elapsed / self._iters,
            "peak_mem_gib": peak_memory_gib(device),
        }
        for name, optimizer in self.optimizers.items():
            stats[f"lr_{name}"] = optimizer.param_groups[0]["lr"]
        for key, total in self._sums.items():
            stats[key] = (total / self._iters).item()
        self._emit(engine, stats)
        self._reset_window()

    def _emit(self, engine: Engine, stats: dict[str, float]) -> None:
        step, epoch = engine.state.iteration, engine.state.epoch
        self.history.append({"step": step, "epoch": epoch, **stats})
        text = " ".join(f"{k}={_fmt(v)}" for k, v in stats.items())
        logger.info(f"epoch {epoch} iter {step}/{engine.state.max_epochs * (engine.state.epoch_length or 0)} {text}")
        if self.writer is not None:
            for key, value in stats.items():
                self.writer.add_scalar(self.tag_prefix + key, value, step)
            self.writer.flush()
        if self.csv_path is not None:
            _append_csv(self.csv_path, [(step, epoch, self.tag_prefix + k, v) for k, v in stats.items()])


class MetricsRecorder:
    """Write an evaluator's ``engine.state.metrics`` to the log, TensorBoard, ``metrics.csv`` and ``metrics.json``.

    ``metrics.json`` (rewritten atomically after every validation) holds the latest values, the best value of
    ``key_metric`` with its step, and the full history. A step measured again (an evaluation run again into the same
    folder, a resumed run validating a step again) replaces that step's figures in both files instead of adding a
    second row.

    Args:
        output_dir: folder of ``metrics.json``/``metrics.csv`` (rank 0 writes; ``None`` disables files).
        summary_writer: TensorBoard writer or ``None``.
        global_step_transform: step of a validation (e.g. ``lambda e: trainer.state.iteration``).
        key_metric: metric whose best value is tracked; which way it improves follows
            :func:`common.metrics.key_metric.key_metric_mode`.
        tag_prefix: prefix of TensorBoard/CSV tags.
        json_name: file name of the JSON summary.
        per_volume: also write ``metrics_per_volume.csv`` (one row per volume, from the metric handlers'
            ``save_details``; single-process evaluation).
    """

    def __init__(
        self,
        output_dir: str | os.PathLike | None = None,
        summary_writer: Any = None,
        global_step_transform: Callable[[Engine], int] | None = None,
        key_metric: str | None = None,
        tag_prefix: str = "",
        json_name: str = "metrics.json",
        per_volume: bool = False,
    ) -> None:
        self.output_dir = Path(output_dir) if output_dir is not None and get_rank() == 0 else None
        self.writer = summary_writer
        self.global_step_transform = global_step_transform or global_step
        self.key_metric = key_metric
        self.mode = key_metric_mode(key_metric) if key_metric is not None else "max"
        self.tag_prefix = tag_prefix
        self.json_name = json_name
        self.per_volume = per_volume
        self._filenames: list[str] = []
        self.summary: dict[str, Any] = {"latest": {}, "best": {}, "history": []}
        if self.output_dir is not None and (self.output_dir / json_name).is_file():
            try:
                self.summary = json.loads((self.output_dir / json_name).read_text())
            except (OSError, ValueError):
                logger.warning(f"{self.output_dir / json_name} is unreadable; starting a new metrics history.")

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, lambda e: self._filenames.clear())
        if self.per_volume:
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._record_filenames)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def _record_filenames(self, engine: Engine) -> None:
        batch = engine.state.batch
        image = batch.get("image") if isinstance(batch, Mapping) else None
        names = getattr(image, "meta", {}).get("filename_or_obj") if image is not None else None
        count = image.shape[0] if isinstance(image, torch.Tensor) else 1
        if names is None:
            names = [f"volume_{len(self._filenames) + i}" for i in range(count)]
        self._filenames.extend([names] if isinstance(names, str) else list(names))

    def _write_per_volume(self, engine: Engine) -> None:
        details = getattr(engine.state, "metric_details", None) or {}
        columns = {
            k: torch.as_tensor(v).reshape(len(self._filenames), -1).mean(dim=1).tolist()
            for k, v in details.items()
            if torch.as_tensor(v).numel() % max(len(self._filenames), 1) == 0 and self._filenames
        }
        path = self.output_dir / "metrics_per_volume.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["filename", *columns])
            for i, name in enumerate(self._filenames):
                writer.writerow([name, *(columns[k][i] for k in columns)])

    def __call__(self, engine: Engine) -> None:
        step = int(self.global_step_transform(engine))
        metrics = {k: float(v) for k, v in engine.state.metrics.items() if isinstance(v, (int, float, torch.Tensor))}
        logger.info(f"validation at step {step}: " + " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items()))
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(self.tag_prefix + key, value, step)
            self.writer.flush()
        if self.output_dir is None:
            return
        _replace_csv_rows(
            self.output_dir / "metrics.csv",
            [(step, engine.state.epoch, self.tag_prefix + k, v) for k, v in metrics.items()],
        )
        self.summary["latest"] = {"step": step, **metrics}
        history = [h for h in self.summary["history"] if h.get("step") != step]  # a step measured again: replaced
        self.summary["history"] = [*history, {"step": step, **metrics}]
        key = self.key_metric
        scored = [h for h in self.summary["history"] if isinstance(h.get(key), float) and not math.isnan(h[key])]
        if scored:
            pick = max if self.mode == "max" else min
            self.summary["best"] = pick(scored, key=lambda h: h[key])  # the earliest of equal values
        elif self.summary.get("best", {}).get("step") == step:
            self.summary["best"] = {}
        if self.per_volume:
            self._write_per_volume(engine)
        write_text_atomic(self.output_dir / self.json_name, json.dumps(self.summary, indent=2, allow_nan=True))


class TorchProfilerHandler:
    """Record a ``torch.profiler`` trace of a few training iterations for TensorBoard's profiler plugin.

    Args:
        output_dir: the run folder; the ``*.pt.trace.json`` files go to ``<output_dir>/profiler``
            (``tensorboard --logdir`` on it).
        wait, warmup, active: the profiler schedule in iterations, started at the first iteration.
        profile_memory: record allocations.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        wait: int = 2,
        warmup: int = 2,
        active: int = 4,
        profile_memory: bool = True,
    ) -> None:
        self.output_dir = os.path.join(os.fspath(output_dir), "profiler")
        self.schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
        self.total = wait + warmup + active
        self.profile_memory = profile_memory
        self.profiler: torch.profiler.profile | None = None
        self._steps = 0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._step)
        engine.add_event_handler(Events.COMPLETED, self._stop)

    def _start(self, engine: Engine) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        worker = f"rank{get_rank()}"
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=self.schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.output_dir, worker_name=worker),
            profile_memory=self.profile_memory,
            with_stack=False,
        )
        self.profiler.start()

    def _step(self, engine: Engine) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        self._steps += 1
        if self._steps >= self.total:
            self._stop(engine)

    def _stop(self, engine: Engine) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
            logger.info(f"profiler trace written to {self.output_dir}")


class ProgressBar(_IgniteProgressBar):
    """ignite's ``ProgressBar``, attached only where someone watches: on rank 0 when standard error is a terminal
    (a batch job's log gets the periodic reports of :class:`TrainingMonitor` instead)."""

    def attach(self, engine: Engine, *args: Any, **kwargs: Any) -> None:
        if get_rank() == 0 and sys.stderr.isatty():
            super().attach(engine, *args, **kwargs)


def _fmt(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.4e}"

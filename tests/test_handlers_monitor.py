# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for monitoring: throughput, data wait, CSV/JSON sinks, step-aligned validation, profiling."""

from __future__ import annotations

import csv
import json
import resource
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ignite.engine import Engine, Events
from monai.data import DataLoader, MetaTensor
from monai.engines import SupervisedEvaluator
from torch import nn

from common.handlers import monitor as monitor_module
from common.handlers.monitor import (
    MetricsRecorder,
    ProgressBar,
    StepValidationHandler,
    TorchProfilerHandler,
    TrainingMonitor,
    close_writer,
    global_step,
    peak_memory_gib,
    tensorboard_writer,
)
from tests.helpers import shifted_seed

BATCH = 4
DELAY = 0.05
STEP = 0.01


class FakeClock:
    """The monitor's ``time.perf_counter``: it moves only when the test's loader or step "takes" time, so the
    reported times are exact whatever the machine's speed or load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


CLOCK = FakeClock()


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch):
    """The monitor module reads :data:`CLOCK` instead of the real clock."""
    monkeypatch.setattr(monitor_module, "time", SimpleNamespace(perf_counter=CLOCK.perf_counter))
    return CLOCK


class SlowLoader:
    """Yields ``n`` batches, taking ``delay`` seconds (of :data:`CLOCK`) before each (a data loader that cannot
    keep up)."""

    def __init__(self, n: int, delay: float = DELAY) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for _ in range(self.n):
            CLOCK.sleep(self.delay)
            yield {"image": torch.zeros(BATCH, 1, 8, 8, 8)}


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.flushes = 0

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, float(value), int(step)))

    def flush(self):
        self.flushes += 1


def _step(engine: Engine, batch: dict) -> dict:
    CLOCK.sleep(STEP)
    return {
        "image": batch["image"],
        "pred": batch["image"],
        "loss": torch.tensor(float(engine.state.iteration)),
        "recon_loss": torch.tensor(0.5),
    }


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


# ---------------------------------------------------------------------------------------------- training monitor
def test_training_monitor_throughput_wait_and_losses(tmp_path):
    engine = Engine(_step)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    writer = FakeWriter()
    monitor = TrainingMonitor(
        interval=5,
        summary_writer=writer,
        output_dir=tmp_path,
        optimizers={"autoencoder": optimizer, "discriminator": None},
    )
    monitor.attach(engine)
    engine.run(SlowLoader(10), max_epochs=1)

    assert [h["step"] for h in monitor.history] == [5, 10]
    for report, losses in zip(monitor.history, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])):
        # every iteration waits DELAY for its batch and computes for STEP (on the fake clock)
        assert report["data_wait"] == pytest.approx(DELAY / (DELAY + STEP), rel=1e-9)
        assert report["step_time_s"] == pytest.approx(DELAY + STEP, rel=1e-9)
        assert report["samples_per_s"] == pytest.approx(BATCH / (DELAY + STEP), rel=1e-9)
        assert report["voxels_per_s"] == pytest.approx(report["samples_per_s"] * 8**3, rel=1e-9)
        assert report["loss"] == pytest.approx(sum(losses) / 5)
        assert report["recon_loss"] == pytest.approx(0.5)
        assert report["lr_autoencoder"] == 0.01
        assert "lr_discriminator" not in report
        assert report["peak_mem_gib"] > 0
        assert "image" not in report and "pred" not in report

    rows = _read_csv(tmp_path / "metrics.csv")
    assert rows[0] == ["step", "epoch", "tag", "value"]
    tags = {row[2] for row in rows[1:]}
    assert tags == {
        "train/samples_per_s",
        "train/voxels_per_s",
        "train/data_wait",
        "train/step_time_s",
        "train/peak_mem_gib",
        "train/lr_autoencoder",
        "train/loss",
        "train/recon_loss",
    }
    assert len(rows) == 1 + 2 * len(tags)
    losses = {int(row[0]): float(row[3]) for row in rows[1:] if row[2] == "train/loss"}
    assert losses == {5: pytest.approx(3.0), 10: pytest.approx(8.0)}
    assert all(row[1] == "1" for row in rows[1:])
    assert ("train/loss", 3.0, 5) in writer.scalars and ("train/loss", 8.0, 10) in writer.scalars
    assert writer.flushes == 2


def test_training_monitor_reports_a_partial_window_at_the_end(tmp_path):
    engine = Engine(_step)
    monitor = TrainingMonitor(interval=4, output_dir=tmp_path)
    monitor.attach(engine)
    engine.run(SlowLoader(3, delay=0.0), max_epochs=2)
    steps = [h["step"] for h in monitor.history]
    assert 4 in steps and steps[-1] == 6  # every interval, and the partial window at the end
    previous = 0
    for report in monitor.history:  # each report averages the iterations since the previous one
        window = range(previous + 1, report["step"] + 1)
        assert report["loss"] == pytest.approx(sum(window) / len(window))
        assert report["samples_per_s"] * report["step_time_s"] == pytest.approx(BATCH)
        previous = report["step"]


def test_training_monitor_decollated_output():
    def step(engine, batch):
        CLOCK.sleep(STEP)
        return [{"image": torch.zeros(1, 4, 4, 4), "loss": float(engine.state.iteration)} for _ in range(3)]

    engine = Engine(step)
    monitor = TrainingMonitor(interval=2)
    monitor.attach(engine)
    engine.run([0, 1], max_epochs=1)
    report = monitor.history[0]
    assert report["loss"] == pytest.approx(1.5)
    assert report["voxels_per_s"] == pytest.approx(report["samples_per_s"] * 64)
    assert report["samples_per_s"] * report["step_time_s"] == pytest.approx(3.0)
    assert report["step_time_s"] == pytest.approx(STEP, rel=1e-9) and report["data_wait"] == 0


def test_training_monitor_only_rank0_writes_csv(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    engine = Engine(_step)
    monitor = TrainingMonitor(interval=1, output_dir=tmp_path)
    monitor.attach(engine)
    engine.run(SlowLoader(2, delay=0.0), max_epochs=1)
    assert len(monitor.history) == 2  # still logged on this rank
    assert not (tmp_path / "metrics.csv").exists()


def test_the_run_writer_is_rank_0s_on_the_tensorboard_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert tensorboard_writer(tmp_path) is None
    close_writer(None)  # the finalize step of the other ranks
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("RANK", "0")
    writer = tensorboard_writer(tmp_path)
    writer.add_scalar("train/loss", 0.5, 1)
    close_writer(writer)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


@pytest.mark.parametrize("rank, tty, attached", [("0", True, True), ("0", False, False), ("1", True, False)])
def test_progress_bar_only_on_an_interactive_rank_0(monkeypatch, rank, tty, attached):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    engine = Engine(_step)
    bar = ProgressBar(persist=False)
    before = len(engine._event_handlers[Events.ITERATION_COMPLETED])
    bar.attach(engine)
    assert (len(engine._event_handlers[Events.ITERATION_COMPLETED]) > before) is attached


# ---------------------------------------------------------------------------------------------- metrics recorder
def _evaluator(metrics: dict, step: int, epoch: int = 1) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(metrics=metrics, epoch=epoch), global_step=step)


def test_metrics_recorder_json_csv_and_best_max(tmp_path):
    writer = FakeWriter()
    recorder = MetricsRecorder(tmp_path, summary_writer=writer, key_metric="val_psnr", tag_prefix="val/")
    for step, psnr in [(10, 20.0), (20, 25.0), (30, 22.0)]:
        recorder(_evaluator({"val_psnr": psnr, "val_ssim": torch.tensor(psnr / 100), "note": "text"}, step))
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["latest"] == {"step": 30, "val_psnr": 22.0, "val_ssim": pytest.approx(0.22)}
    assert summary["best"]["step"] == 20 and summary["best"]["val_psnr"] == 25.0
    assert [h["step"] for h in summary["history"]] == [10, 20, 30]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "metrics.json"]
    rows = _read_csv(tmp_path / "metrics.csv")
    assert rows[0] == ["step", "epoch", "tag", "value"]
    assert ["20", "1", "val/val_psnr", "25.0"] in rows
    assert len(rows) == 1 + 3 * 2
    assert ("val/val_psnr", 22.0, 30) in writer.scalars

    # a new recorder (resumed run) continues the history and keeps the best
    resumed = MetricsRecorder(tmp_path, key_metric="val_psnr")
    resumed(_evaluator({"val_psnr": 24.0}, 40))
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert [h["step"] for h in summary["history"]] == [10, 20, 30, 40]
    assert summary["best"]["step"] == 20
    resumed(_evaluator({"val_psnr": 26.0}, 50))
    assert json.loads((tmp_path / "metrics.json").read_text())["best"] == {"step": 50, "val_psnr": 26.0}


def test_a_step_measured_again_replaces_its_figures(tmp_path):
    """An evaluation run again into the same folder (its step is always 0), or a resumed run validating a step
    again: that step's rows in metrics.csv and its entry in metrics.json are replaced, not repeated, and the best
    follows the figures that are kept; another tag's rows of that step (the training monitor's) stay."""
    (tmp_path / "metrics.csv").write_text("step,epoch,tag,value\n0,1,train/loss,0.5\n")
    for psnr in (30.0, 20.0):
        MetricsRecorder(tmp_path, key_metric="val_psnr", tag_prefix="val/")(_evaluator({"val_psnr": psnr}, 0))
    rows = _read_csv(tmp_path / "metrics.csv")
    assert rows == [
        ["step", "epoch", "tag", "value"],
        ["0", "1", "train/loss", "0.5"],
        ["0", "1", "val/val_psnr", "20.0"],
    ]
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["history"] == [{"step": 0, "val_psnr": 20.0}] and summary["best"] == {"step": 0, "val_psnr": 20.0}


def test_metrics_recorder_best_min_and_nan(tmp_path):
    recorder = MetricsRecorder(tmp_path, key_metric="val_loss")
    for step, value in [(1, 0.5), (2, 0.2), (3, float("nan")), (4, 0.3)]:
        recorder(_evaluator({"val_loss": value}, step))
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["best"] == {"step": 2, "val_loss": 0.2}
    assert len(summary["history"]) == 4


def test_metrics_recorder_default_step_and_unreadable_json(tmp_path):
    (tmp_path / "metrics.json").write_text("{not json")
    recorder = MetricsRecorder(tmp_path, key_metric="m")
    engine = SimpleNamespace(state=SimpleNamespace(metrics={"m": 1.0}, epoch=7))
    recorder(engine)
    summary = json.loads((tmp_path / "metrics.json").read_text())
    assert summary["latest"] == {"step": 7, "m": 1.0}
    assert global_step(engine) == 7
    engine.global_step = 123
    assert global_step(engine) == 123


def test_metrics_recorder_only_rank0_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    MetricsRecorder(tmp_path / "out", key_metric="m")(_evaluator({"m": 1.0}, 1))
    assert not (tmp_path / "out").exists()


def test_metrics_recorder_per_volume_csv(tmp_path):
    recorder = MetricsRecorder(tmp_path, key_metric="val_psnr", per_volume=True)
    names = ["/data/a.nii.gz", "/data/b.nii.gz"]
    image = MetaTensor(torch.zeros(2, 1, 2, 2, 2), meta={"filename_or_obj": names})
    engine = SimpleNamespace(
        state=SimpleNamespace(
            batch={"image": image},
            metrics={"val_psnr": 21.0},
            metric_details={"val_psnr": torch.tensor([[20.0], [22.0]])},
            epoch=1,
        ),
        global_step=5,
    )
    recorder._record_filenames(engine)
    recorder(engine)
    rows = _read_csv(tmp_path / "metrics_per_volume.csv")
    assert rows == [["filename", "val_psnr"], [names[0], "20.0"], [names[1], "22.0"]]


# ---------------------------------------------------------------------------------------------- step validation
def _validation_setup():
    gen = torch.Generator().manual_seed(0)
    data = [{"image": torch.rand(1, 4, 4, 4, generator=gen), "label": torch.rand(1, 4, 4, 4, generator=gen)}]
    evaluator = SupervisedEvaluator(
        device=torch.device("cpu"),
        val_data_loader=DataLoader(data, batch_size=1, num_workers=0),
        network=nn.Conv3d(1, 1, 1),
        decollate=False,
    )
    steps: list[int] = []
    evaluator.add_event_handler(Events.EPOCH_COMPLETED, lambda e: steps.append(global_step(e)))
    return evaluator, steps


def _trainer_drawing_random_numbers(draws: list[float]) -> Engine:
    return Engine(lambda engine, batch: draws.append(torch.rand(1).item()))


def test_step_validation_handler_passes_trainer_iteration():
    evaluator, steps = _validation_setup()
    draws: list[float] = []
    trainer = _trainer_drawing_random_numbers(draws)
    StepValidationHandler(interval=1, validator=evaluator, epoch_level=True).attach(trainer)
    trainer.run([0, 1, 2], max_epochs=2)
    assert steps == [3, 6]
    assert evaluator.global_step == 6


def test_step_validation_handler_iteration_level_interval():
    evaluator, steps = _validation_setup()
    trainer = _trainer_drawing_random_numbers([])
    StepValidationHandler(interval=2, validator=evaluator, epoch_level=False).attach(trainer)
    trainer.run([0, 1, 2], max_epochs=2)
    assert steps == [2, 4, 6]


def test_step_validation_does_not_change_the_training_random_numbers():
    torch.manual_seed(shifted_seed(0))
    reference: list[float] = []
    _trainer_drawing_random_numbers(reference).run([0, 1], max_epochs=3)

    evaluator, steps = _validation_setup()  # building it draws from (and MONAI's DataLoader re-seeds) the RNG
    torch.manual_seed(shifted_seed(0))
    draws: list[float] = []
    trainer = _trainer_drawing_random_numbers(draws)
    StepValidationHandler(interval=1, validator=evaluator, epoch_level=True).attach(trainer)
    trainer.run([0, 1], max_epochs=3)
    assert steps == [2, 4, 6]
    assert draws == reference


# ---------------------------------------------------------------------------------------------- profiler, memory
def test_torch_profiler_handler_writes_a_trace(tmp_path):
    a = torch.rand(64, 64)
    engine = Engine(lambda e, b: (a @ a).sum())
    handler = TorchProfilerHandler(tmp_path, wait=1, warmup=1, active=2, profile_memory=False)
    handler.attach(engine)
    stopped_at: list[int] = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: stopped_at.append(e.state.iteration) if handler.profiler is None else None
    )
    engine.run(list(range(6)), max_epochs=1)
    traces = list((tmp_path / "profiler").glob("*.pt.trace.json"))
    assert len(traces) == 1
    assert traces[0].name.startswith("rank0")
    trace = json.loads(traces[0].read_text())
    assert trace["traceEvents"]
    assert any("mm" in str(event.get("name", "")) for event in trace["traceEvents"])
    assert stopped_at[0] == 4  # stopped after wait + warmup + active iterations
    assert handler.profiler is None


def test_peak_memory_on_cpu_is_the_peak_resident_set_in_gib():
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, in KiB on Linux and the BSDs
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**30
    value = peak_memory_gib("cpu")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**30  # the peak never decreases
    assert 0 < before <= value <= after

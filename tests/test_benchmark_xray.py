# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the xray2ct_cascade benchmarks of scripts/benchmark.py at toy sizes: the stage-2 throughput comparison
runs both sides, the quality benchmark trains every mode for exactly its budget and evaluates every stage and the
back-projection baseline, and bad modes or overrides are refused before anything runs.

The quality benchmark's bundle commands run in this process (the same command line, parsed by ``fire`` as
``python -m monai.bundle`` parses it): a subprocess spends about 7 s importing MONAI, and the benchmark runs ten."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from scripts.harness import xray2ct as benchmark
from tests.helpers import TINY_XRAY_NETWORK, shifted_seed

NETWORK = {k: list(v) if isinstance(v, tuple) else v for k, v in TINY_XRAY_NETWORK.items()}
SIZES = {"stage_sizes": [[8, 8, 8], [16, 16, 16]], "view_size": [16, 16]}  # X-rays from the CT at 16^3


def test_stage_2_throughput_runs_both_sides(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    summary = benchmark.xray_throughput(
        stage=2,
        device="cpu",
        iterations=2,
        warmup=1,
        repeats=1,
        n_cases=4,
        num_threads=1,
        seed=shifted_seed(0),
        output=str(out),
        **SIZES,
        **NETWORK,
    )
    assert summary["plain_samples_per_s"] > 0 and summary["bundle_samples_per_s"] > 0
    assert summary["speedup"] == pytest.approx(summary["bundle_samples_per_s"] / summary["plain_samples_per_s"])
    saved = json.loads(out.read_text())
    assert (saved["stage"], saved["volume_size"], saved["previous_size"]) == (2, [16, 16, 16], [8, 8, 8])
    assert saved["batch"] == 2 and saved["amp"] == "none" and saved["compile"] is False  # train.json's stage-2 batch
    assert "| bundle / plain |" in capsys.readouterr().out


@pytest.fixture
def in_process(monkeypatch):
    """Run the benchmark's bundle commands in this process; returns the list of commands run."""
    import fire
    from monai.bundle.scripts import run

    commands = []

    def _run(cmd: list[str]) -> float:
        assert cmd[1:4] == ["-m", "monai.bundle", "run"]
        commands.append(cmd)
        threads, start = torch.get_num_threads(), time.perf_counter()
        try:
            fire.Fire({"run": run}, command=cmd[3:])
        except SystemExit as exc:  # fire ends a command line it cannot parse with SystemExit
            raise RuntimeError(f"{cmd} exited with {exc.code}") from exc
        finally:
            torch.set_num_threads(threads)
        return time.perf_counter() - start

    monkeypatch.setattr(benchmark, "_run", _run)
    return commands


def test_quality_trains_each_mode_for_its_budget_and_evaluates_every_stage(tmp_path, in_process):
    from common.demo.images import make_xray2ct_demo

    data = tmp_path / "data"
    make_xray2ct_demo(data, n_train=4, n_val=2, shape=(16, 16, 16), seed=shifted_seed(0))
    out, work = tmp_path / "quality.json", tmp_path / "work"
    extra = {"dataset_dir": str(data), "num_threads": 1, "num_grid_steps": 1, "stage_batch_size": [2, 2]}
    benchmark.xray_quality(
        device="cpu",
        iterations=3,
        output=str(out),
        work_dir=str(work),
        seed=shifted_seed(0),
        **SIZES,
        **NETWORK,
        **extra,
    )
    saved = json.loads(out.read_text())
    assert list(saved["modes"]) == ["diffusion", "direct", "backprojection"]
    assert saved["settings"]["seed"] == shifted_seed(0)
    for mode, stages in saved["modes"].items():
        assert list(stages) == ["stage1", "stage2"]
        for k, result in enumerate(stages.values(), start=1):
            assert math.isfinite(result["val_psnr"]) and result["val_proj_error"] > 0, (mode, k)
            assert result["volume_size"] == SIZES["stage_sizes"][k - 1]
            if mode == "backprojection":
                assert result["iterations"] == 0 and result["train_seconds"] is None
                assert not (work / mode / f"stage{k}" / "models").exists()
                continue
            # 3 iterations with 2 batches per epoch: the budget is exact, not rounded to epochs
            last = torch.load(work / mode / f"stage{k}" / "models" / "last.pt", weights_only=True)
            assert last["trainer"]["iteration"] == result["iterations"] == 3, (mode, k)
            assert result["train_seconds"] > 0
    # 2 modes x 2 stages x (training + evaluation) + 2 back-projection evaluations, each with every override
    assert len(in_process) == 10
    for cmd in in_process:
        assert cmd[cmd.index("--dataset_dir") + 1] == str(data)
        assert cmd[cmd.index("--num_threads") + 1] == "1"
        assert cmd[cmd.index("--seed") + 1] == str(shifted_seed(0))
        if cmd[4] == "training":
            assert cmd[cmd.index("--epoch_length") + 1] == "3" and cmd[cmd.index("--max_epochs") + 1] == "1"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"modes": ["diffusion", "gan"]}, r"modes must be a non-empty list of distinct modes out of \('diffusion', "),
        ({"modes": ["backprojection"]}, "the 'backprojection' baseline, which has nothing to train, is always"),
        ({"stage": 2}, r"xray_quality sets \['stage'\] itself"),
    ],
)
def test_quality_refuses_bad_modes_and_reserved_overrides(tmp_path, in_process, kwargs, message):
    with pytest.raises(ValueError, match=message):
        benchmark.xray_quality(device="cpu", iterations=1, output=str(tmp_path / "q.json"), **kwargs)
    assert in_process == [] and not (tmp_path / "q.json").exists()

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the fast_ddpm_3d benchmarks of scripts/benchmark.py at toy sizes: network evaluations counted per
sampler and window, fast-only runs, bad ``modes``, and one throughput comparison with its amp/compile settings."""

from __future__ import annotations

import json

import pytest

from scripts.harness import diffusion as benchmark
from tests.helpers import shifted_seed

TINY = {
    "unet_channels": [8, 16],
    "attention_levels": [False, False],
    "norm_num_groups": 4,
    "num_head_channels": 8,
    "num_grid_steps": 4,
    "num_train_timesteps": 40,
    "device": "cpu",
    "seed": shifted_seed(0),
}


def test_sampling_counts_network_evaluations_per_step_and_window(tmp_path):
    out = tmp_path / "sampling.json"
    # 24 -> 2 windows of 16 per axis at overlap 0.25 (stride 12): 8 windows, taken 4 per network call
    summary = benchmark.ddpm_sampling(
        shape=(24, 24, 24), roi_size=(16, 16, 16), sw_batch_size=4, output=str(out), **TINY
    )
    # Fast-DDPM's uniform grid for S=4 of T=40 is [0, 9, 19, 29, 39]: 5 steps; the baseline takes all 40
    assert summary["fast"]["time_steps"] == 5 and summary["baseline"]["time_steps"] == 40
    assert summary["fast"]["window_forwards"] == 5 * 8 and summary["fast"]["network_calls"] == 5 * 2
    assert summary["baseline"]["window_forwards"] == 40 * 8 and summary["baseline"]["network_calls"] == 40 * 2
    assert summary["evaluation_ratio_fast_over_baseline"] == pytest.approx(0.125)
    # the time ratio is what was measured (which sampler is faster is not asserted: timings vary between machines)
    seconds = summary["fast"]["seconds"], summary["baseline"]["seconds"]
    assert all(s > 0 for s in seconds)
    assert summary["time_ratio_fast_over_baseline"] == seconds[0] / seconds[1]
    assert json.loads(out.read_text())["sw_batch_size"] == 4


def test_sampling_of_the_fast_grid_alone(capsys):
    summary = benchmark.ddpm_sampling(shape=(16, 16, 16), modes=["fast"], **TINY)
    assert set(summary) >= {"fast"} and "baseline" not in summary
    assert "time_ratio_fast_over_baseline" not in summary
    assert summary["fast"]["window_forwards"] == 5  # the whole volume in one window per step
    assert "fast / baseline" not in capsys.readouterr().out


def test_sampling_refuses_unknown_modes():
    with pytest.raises(ValueError, match=r"modes must be a non-empty list of \('fast', 'baseline'\), got \['ddim'\]"):
        benchmark.ddpm_sampling(shape=(16, 16, 16), modes=["ddim"], **TINY)


def test_throughput_runs_both_sides_with_its_settings(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    summary = benchmark.ddpm_throughput(
        patch_size=(16, 16, 16),
        unet_channels=(8, 16),
        attention_levels=(False, False),
        norm_num_groups=4,
        num_head_channels=8,
        patches_per_volume=2,
        iterations=2,
        warmup=1,
        repeats=1,
        amp="none",
        device="cpu",
        seed=shifted_seed(0),
        output=str(out),
    )
    assert summary["plain_samples_per_s"] > 0 and summary["bundle_samples_per_s"] > 0
    assert summary["speedup"] == pytest.approx(summary["bundle_samples_per_s"] / summary["plain_samples_per_s"])
    saved = json.loads(out.read_text())
    assert saved["amp"] == "none" and saved["compile"] is False and saved["batch"] == "1x2"
    assert "| bundle / plain |" in capsys.readouterr().out

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the mace_survival benchmarks of scripts/benchmark.py at toy sizes: the throughput comparison runs both
sides with the bundle's settings, and the SmartCache benchmark measures what each dataset cached and waited."""

from __future__ import annotations

import json

import pytest

from scripts import benchmark_survival as benchmark

TINY = {"image_size": (16, 16, 16), "backbone": "resnet10", "batch_size": 4, "n_cases": 16, "device": "cpu"}


def test_throughput_runs_both_sides(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    summary = benchmark.mace_throughput(iterations=2, warmup=1, repeats=1, num_intervals=3, output=str(out), **TINY)
    assert summary["plain_samples_per_s"] > 0 and summary["bundle_samples_per_s"] > 0
    assert summary["speedup"] == pytest.approx(summary["bundle_samples_per_s"] / summary["plain_samples_per_s"])
    saved = json.loads(out.read_text())
    assert saved["amp"] == "none" and saved["batch"] == 4 and saved["image_size"] == [16, 16, 16]
    assert "| bundle / plain |" in capsys.readouterr().out


def test_smartcache_reports_the_cache_and_the_replacement_wait(tmp_path):
    summary = benchmark.mace_smartcache(
        cache_rate=0.5, replace_rates=(0.5,), epochs=2, output=str(tmp_path / "s.json"), **TINY
    )
    reference, smart = summary["runs"]
    # 16 cases, 12 in training: all cached by the CacheDataset, half by the SmartCache; batches of 4, last dropped
    assert (reference["cached_cases"], reference["iterations_per_epoch"], reference["replacement_wait_s"]) == (12, 3, 0)
    assert (smart["cached_cases"], smart["iterations_per_epoch"]) == (6, 1)
    assert smart["replacement_wait_s"] >= 0 and smart["stall_fraction"] == pytest.approx(
        smart["replacement_wait_s"] / smart["epoch_s"]
    )

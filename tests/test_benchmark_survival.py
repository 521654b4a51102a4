# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the mace_survival benchmarks of scripts/benchmark.py at toy sizes: the throughput comparison runs both
sides with the bundle's settings, and the SmartCache benchmark measures what each dataset cached and waited."""

from __future__ import annotations

import json

import pytest

from scripts.harness import survival as benchmark
from scripts.harness import tools
from tests.helpers import shifted_seed

# every case has an event (censoring "none"), so the training split always has events to place cut points at
TINY = {
    "image_size": (16, 16, 16),
    "backbone": "resnet10",
    "batch_size": 4,
    "n_cases": 16,
    "device": "cpu",
    "censoring": "none",
}


@pytest.fixture(scope="module")
def sections(tmp_path_factory) -> dict:
    """The splits of the cohort the benchmarks build (the same arguments give the same cohort)."""
    csv = benchmark._make_cohort(
        tmp_path_factory.mktemp("cohort"), TINY["n_cases"], TINY["image_size"], seed=shifted_seed(0), censoring="none"
    )
    return benchmark._sections(csv)


def _check_chosen(summary: dict, sections: dict, num_intervals: int) -> None:
    """The horizons lie inside every split's follow-up, one at least after the earliest validation time (the bundle
    would refuse others), and the intervals are at most the requested ones."""
    assert summary["horizons"] and all(h > 0 for h in summary["horizons"])
    for name, entries in sections.items():
        assert max(summary["horizons"]) < max(e["time"] for e in entries), name
    assert max(summary["horizons"]) >= min(e["time"] for e in sections["validation"])
    assert 1 <= summary["num_intervals"] <= num_intervals


def test_throughput_runs_both_sides(tmp_path, capsys, sections):
    out = tmp_path / "throughput.json"
    summary = benchmark.mace_throughput(
        iterations=2, warmup=1, repeats=1, num_intervals=3, output=str(out), seed=shifted_seed(0), **TINY
    )
    assert summary["plain_samples_per_s"] > 0 and summary["bundle_samples_per_s"] > 0
    assert summary["speedup"] == pytest.approx(summary["bundle_samples_per_s"] / summary["plain_samples_per_s"])
    _check_chosen(summary, sections, 3)
    saved = json.loads(out.read_text())
    assert saved["amp"] == "none" and saved["batch"] == 4 and saved["image_size"] == [16, 16, 16]
    assert saved["seed"] == shifted_seed(0) and saved["horizons"] == summary["horizons"]
    assert "| bundle / plain |" in capsys.readouterr().out


def test_smartcache_reports_the_cache_and_the_replacement_wait(tmp_path, sections):
    summary = benchmark.mace_smartcache(
        cache_rate=0.5, replace_rates=(0.5,), epochs=2, output=str(tmp_path / "s.json"), seed=shifted_seed(0), **TINY
    )
    reference, smart = summary["runs"]
    _check_chosen(summary, sections, tools.train_config(benchmark.BUNDLE)["num_intervals"])
    # the CacheDataset holds every training case, the SmartCache half of them; batches of 4, the last incomplete
    # one dropped
    n_train, batch = len(sections["training"]), TINY["batch_size"]
    cached = int(n_train * 0.5)
    assert (reference["cached_cases"], reference["iterations_per_epoch"], reference["replacement_wait_s"]) == (
        n_train,
        n_train // batch,
        0,
    )
    assert (smart["cached_cases"], smart["iterations_per_epoch"]) == (cached, cached // batch)
    assert smart["replacement_wait_s"] >= 0 and smart["stall_fraction"] == pytest.approx(
        smart["replacement_wait_s"] / smart["epoch_s"]
    )

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the vqgan_3d benchmarks of scripts/benchmark.py at toy sizes (window counts, memory model, the runs
of the training-memory benchmark, one throughput comparison and one reconstruction probe)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from scripts.harness import vqgan as benchmark
from tests.helpers import shifted_seed

TINY = {"n_hiddens": 4, "downsample": [4, 4, 4], "embedding_dim": 4, "n_codes": 32, "num_res_blocks": 1}


@pytest.fixture(autouse=True)
def _seeded():
    """The benchmarks draw their networks and data from the global RNGs: seed them (shifted by BUNDLE_TEST_SEED), so
    a run is reproducible and the assertions (counts, shapes, positive times and memory) hold for every draw."""
    torch.manual_seed(shifted_seed(0))
    np.random.seed(shifted_seed(0))


def test_window_count_and_volume_buffers():
    # 512 -> 5 windows of 128 at stride 96, 604 -> 6; the 4x reduced CTPA volume needs 2
    assert benchmark._n_windows([512, 512, 604], [128] * 3, 0.25) == 150
    assert benchmark._n_windows([128, 128, 151], [128] * 3, 0.25) == 2
    sizes = benchmark._volume_bytes([512, 512, 604], [128] * 3)
    assert sizes["output_buffers"] == 8 * 512 * 512 * 604
    assert sizes["total"] == 12 * 512 * 512 * 604
    padded = benchmark._volume_bytes([100, 128, 128], [128] * 3)  # padded copy of the input
    assert padded["input"] == 4 * 100 * 128 * 128 + 4 * 128**3


def test_memory_model_takes_the_largest_stage():
    def row(sw, quantizer, decoder):
        peaks = {"encoder": 1.0, "quantizer": quantizer, "decoder": decoder, "other": 0.7}
        return {"effective_sw_batch_size": sw, "peak_mem_gib": max(peaks.values()), "stage_peak_mem_gib": peaks}

    model = benchmark._memory_model([row(1, 3.6, 1.6), row(2, 3.6, 2.6)])
    assert model["overall"] == pytest.approx((3.6, 0.0))
    assert model["decoder"] == pytest.approx((0.6, 1.0))
    prediction = benchmark._predict_peak(model, 4, extra_gib=1.0)
    assert prediction["linear_fit_gib"] == pytest.approx(4.6)
    assert prediction["max_of_stages_gib"] == pytest.approx(5.6)  # the decoder overtakes the quantizer
    assert benchmark._memory_model([row(2, 3.6, 2.6), row(2, 3.6, 2.6)]) is None


def test_vqgan_network_defaults_come_from_train_json():
    network = benchmark._vqgan_network(n_codes=512)
    assert network["n_hiddens"] == 16 and network["downsample"] == [4, 4, 4] and network["n_codes"] == 512


def test_reconstruction_probe_reports_stages():
    row = benchmark.reconstruction_probe(
        [16, 16, 20], [16, 16, 16], 2, 0.25, {**TINY, "norm_num_groups": 4}, "cpu", "bf16", 0, 1, None
    )
    assert row["windows"] == 2 and row["effective_sw_batch_size"] == 2 and row["amp"] == "none"
    assert row["seconds_per_volume"] > 0 and row["peak_mem_gib"] > 0
    assert set(row["stage_time_share"]) == {"encoder", "quantizer", "decoder"}


def test_vqgan_throughput_runs_both_sides(tmp_path, capsys):
    out = tmp_path / "vqgan.json"
    summary = benchmark.vqgan_throughput(
        patch_size=(16, 16, 16),
        n_hiddens=8,
        n_codes=32,
        embedding_dim=4,
        disc_channels=8,
        disc_layers=2,
        batch_size=1,
        patches_per_volume=2,
        micro_batch_size=1,
        iterations=2,
        warmup=1,
        repeats=1,
        device="cpu",
        output=str(out),
    )
    assert summary["plain_samples_per_s"] > 0 and summary["bundle_samples_per_s"] > 0
    assert json.loads(out.read_text())["batch"] == "1x2"
    assert "| bundle / plain |" in capsys.readouterr().out


def test_vqgan_memory_runs_and_volume_shape():
    runs = benchmark._vqgan_memory_runs([[128] * 3, [64] * 3], [1, 2], extra_runs=[[[64] * 3, 1, 4], [[64] * 3, 1, 1]])
    # by patch volume, then micro-batch, then patches per step; by default a step is one micro-batch
    assert [(r["patch_size"][0], r["micro_batch_size"], r["patches_per_volume"]) for r in runs] == [
        (64, 1, 1),
        (64, 1, 4),
        (64, 2, 2),
        (128, 1, 1),
        (128, 2, 2),
    ]
    assert all(r["batch_size"] == 1 for r in runs)
    two_volumes = benchmark._vqgan_memory_runs([[32] * 3], [3], batch_size=2)
    assert two_volumes[0]["patches_per_volume"] == 2  # 2 x 2 patches hold a micro-batch of 3
    with pytest.raises(ValueError, match="smaller than its micro-batch"):
        benchmark._vqgan_memory_runs([[32] * 3], [4], patches_per_volume=2)
    # a quarter larger than the patch, rounded up to the downsampling: DivisiblePadd leaves it alone
    assert benchmark._memory_volume_shape([64, 128, 16], [4, 4, 4]) == [80, 160, 20]
    assert benchmark._memory_volume_shape([30, 30, 30], 8) == [40, 40, 40]

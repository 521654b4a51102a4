# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests of ``scripts/benchmark.py cpu_inference`` at toy sizes: the FLOPs, the shares of the peaks and the
differences it reports, the rows a machine cannot run, and one bundle's default network end to end."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from scripts.harness.cpu_inference import HEADER, cpu_inference, window_rows


@pytest.fixture(autouse=True)
def _without_openvino(monkeypatch):
    """OpenVINO is optional (CI has none): its rows are tested as skipped. Where it is installed, its runtime left a
    dangling reference to pytest's captured stderr that broke later tests' capture, so it is hidden here too."""
    monkeypatch.setitem(sys.modules, "openvino", None)


WAYS = [
    "torch fp32",
    "torch fp32 channels_last",
    "torch bf16",
    "torch bf16 channels_last",
    "onnxruntime fp32",
    "openvino fp32",
    "openvino bf16",
]


def test_window_rows_count_the_convolution_flops_and_compare_every_way_with_fp32(tmp_path):
    """One 3x3x3 convolution of 2 -> 4 channels over an 8^3 window (padding 1) is ``2 * 2 * 4 * 27 * 8^3`` FLOPs;
    fp32 ways agree with PyTorch fp32 to rounding, bf16 ways within its 8-bit mantissa; each row's GFLOP/s is the
    FLOPs over its time and its peak shares that over the peaks measured in the same call."""
    torch.manual_seed(0)
    network = nn.Conv3d(2, 4, 3, padding=1)
    x = torch.randn(1, 2, 8, 8, 8)
    result = window_rows(network, x, repeats=1, work=tmp_path)
    assert result["gflop_per_window"] == pytest.approx(2 * 2 * 4 * 27 * 8**3 / 1e9)
    assert set(result["peaks"]) == {"fp32", "bf16"} and min(result["peaks"].values()) > 0
    rows = {r["way"]: r for r in result["rows"]}
    assert list(rows) == WAYS
    assert {way: row["skipped"] for way, row in rows.items() if "skipped" in row} == {
        "openvino fp32": "openvino is not installed",
        "openvino bf16": "openvino is not installed",
    }
    for way, row in rows.items():
        if "skipped" in row:
            continue
        assert row["gflops"] == pytest.approx(result["gflop_per_window"] / row["seconds"])
        assert row["of_fp32_peak"] == pytest.approx(row["gflops"] / result["peaks"]["fp32"])
        assert row["of_bf16_peak"] == pytest.approx(row["gflops"] / result["peaks"]["bf16"])
        assert row["max_diff"] <= (2e-2 if "bf16" in way else 1e-5), row
    assert rows["torch fp32"]["max_diff"] == 0.0
    assert rows["torch bf16"]["max_diff"] > 0.0  # bf16 rounds: the price of its speed is reported, not hidden
    assert list(tmp_path.iterdir()) == []  # the exported model is removed


def test_a_bundles_default_network_in_every_way(tmp_path, capsys):
    """``cpu_inference`` builds ``inference.json``'s network (here made small) at its default window, prints one
    table row per way and writes the summary."""
    out = tmp_path / "cpu.json"
    small = {"patch_size": [16, 16, 16], "channels": [8, 16, 16], "norm_num_groups": 8}
    summary = cpu_inference("autoencoder_3d", num_threads=1, repeats=1, overrides=small, output=str(out))
    assert summary["window"] == [1, 1, 16, 16, 16] and summary["threads"] == 1
    assert [r["way"] for r in summary["rows"]] == WAYS
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0] == "| " + " | ".join(HEADER) + " |" and len(table) == 1 + len(WAYS)

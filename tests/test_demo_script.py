# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The quickstart command line (``scripts/demo.py``): its help and its refusal of an unknown bundle, before any work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "scripts" / "demo.py"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_options_and_starts_nothing(flag, tmp_path):
    result = subprocess.run([sys.executable, str(DEMO), flag], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--bundle fast_ddpm_3d" in result.stdout and "bundle override" in result.stdout
    assert "max_epochs:" in result.stdout
    assert not any(tmp_path.iterdir())


def test_unknown_bundle_is_refused_with_the_available_ones(tmp_path):
    cmd = [sys.executable, str(DEMO), "--bundle", "no_such_bundle", "--output_dir", str(tmp_path / "run")]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("error: unknown bundle 'no_such_bundle'") and "autoencoder_3d" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("bundle", "iterations", "message"),
    [
        ("xray2ct_cascade", "[4]", "error: 'stage_iterations' must be 2 positive integers (one per stage of"),
        ("xray2ct_cascade", "[4,0]", "error: 'stage_iterations' must be 2 positive integers"),
        ("autoencoder_3d", "[4,4]", "error: autoencoder_3d is not trained stage by stage"),
    ],
)
def test_stage_iterations_that_do_not_fit_are_refused_before_any_work(bundle, iterations, message, tmp_path):
    cmd = [sys.executable, str(DEMO), "--bundle", bundle, "--stage_iterations", iterations]
    result = subprocess.run(cmd + ["--output_dir", str(tmp_path / "run")], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.startswith(message), result.stderr[-2000:]
    assert not (tmp_path / "run").exists()

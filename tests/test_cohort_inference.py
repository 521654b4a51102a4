# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Inference at cohort scale, run as a user runs it (``python -m monai.bundle run`` and torchrun) on a folder of 100
volumes of which 3 are corrupt (truncated, not 3D, not an image): 97 outputs, 3 rows in ``failures.csv`` and exit
status 2; killed half-way and re-run, the same files byte for byte; two processes, the same files again with every
case done by one of them."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from tests.helpers import (
    REPO_ROOT,
    bundle_env,
    config_arg,
    overrides,
    run_bundle,
    shifted_seed,
    slowed_env,
    torchrun_cmd,
    written_tree,
)

BUNDLE = "autoencoder_3d"
TINY = dict(patch_size=[16, 16, 16], channels=[8, 16, 16], norm_num_groups=4, d_channels=8, d_num_layers=2)
N_CASES = 100
CORRUPT = {"case_013": "read", "case_047": "check", "case_081": "check"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from common.demo.images import write_phantom_dataset

    root = tmp_path_factory.mktemp("cohort")
    write_phantom_dataset(root / "phantoms", n_train=2, n_val=1, shape=(20, 20, 20), seed=shifted_seed(3))
    args = overrides(
        dataset_dir=str(root / "phantoms"),
        output_dir=str(root / "run"),
        max_epochs=1,
        val_interval=1,
        num_threads=1,
        **TINY,
    )
    run_bundle(BUNDLE, ["train.json"], args=args)
    return root / "run"


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    """100 small volumes; ``case_013`` truncated, ``case_047`` 2D, ``case_081`` a text file."""
    folder = tmp_path_factory.mktemp("cohort_in")
    rng = np.random.default_rng(shifted_seed(4))
    affine = np.diag([1.5, 1.5, 2.0, 1.0])
    for i in range(N_CASES):
        shape = tuple(int(s) for s in rng.integers(14, 22, size=3))
        nib.save(nib.Nifti1Image(rng.random(shape).astype(np.float32), affine), folder / f"case_{i:03d}.nii.gz")
    data = (folder / "case_013.nii.gz").read_bytes()
    (folder / "case_013.nii.gz").write_bytes(data[: len(data) // 2])
    nib.save(nib.Nifti1Image(rng.random((16, 16)).astype(np.float32), affine), folder / "case_047.nii.gz")
    (folder / "case_081.nii.gz").write_text("an export that is not an image")
    return folder


def _inference_cmd(trained: Path, cohort: Path, predictions: Path, *extra: str) -> list[str]:
    configs = config_arg(BUNDLE, "inference.json", *extra)
    args = overrides(dataset_dir=str(cohort), output_dir=str(trained), prediction_dir=str(predictions), num_threads=1)
    return ["-m", "monai.bundle", "run", "--config_file", configs, *args]


@pytest.fixture(scope="module")
def reference(trained, cohort, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One uninterrupted single-process run."""
    predictions = tmp_path_factory.mktemp("reference") / "predictions"
    cmd = [sys.executable, *_inference_cmd(trained, cohort, predictions)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=600)
    return result, predictions


def test_bad_cases_are_listed_and_the_others_written(reference):
    result, predictions = reference
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == f"97 written, 3 failed: see {predictions / 'failures.csv'}"
    assert len(list(predictions.glob("*_recon.nii.gz"))) == 97
    assert not any(any(predictions.glob(f"{case}_*")) for case in CORRUPT)
    with open(predictions / "failures.csv", newline="") as handle:
        rows = {row["case_id"]: row for row in csv.DictReader(handle)}
    assert {case: row["stage"] for case, row in rows.items()} == CORRUPT
    assert "EOFError" in rows["case_013"]["reason"]
    assert "a 3D volume is required" in rows["case_047"]["reason"]
    assert rows["case_081"]["reason"].startswith("cannot be read")
    assert "Traceback" not in result.stderr
    # the header problems are listed at once, before any case runs
    listing = result.stdout.index("2 of 100 case(s) fail the input check")
    assert listing < result.stdout.index("Engine run resuming")


def test_killed_half_way_and_rerun_writes_the_same_bytes(trained, cohort, reference, tmp_path):
    """kill -9 while writing, then the same command: the cases written are skipped, the rest done; the folder is
    byte-identical to an uninterrupted run's (outputs, records, failures.csv)."""
    predictions = tmp_path / "predictions"
    cmd = [sys.executable, *_inference_cmd(trained, cohort, predictions)]
    slowed = slowed_env(tmp_path / "slowed", 0.1)  # the same command, each case followed by a pause
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=slowed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while len(list((predictions / ".done" / "reconstruct").glob("*.json"))) < 30 and process.poll() is None:
        assert time.monotonic() < deadline, "the run wrote too little in 300 s"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    done = len(list((predictions / ".done" / "reconstruct").glob("*.json")))
    assert 30 <= done < 97, "the run was not killed half-way"
    rerun = subprocess.run(
        [sys.executable, *_inference_cmd(trained, cohort, predictions)],
        cwd=REPO_ROOT,
        env=bundle_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 2, rerun.stderr[-3000:]
    last = rerun.stdout.strip().splitlines()[-1]
    assert (
        last == f"{97 - done} written ({done} already written, skipped), 3 failed: see {predictions / 'failures.csv'}"
    )
    assert written_tree(predictions) == written_tree(reference[1])


def test_two_processes_share_the_cases(trained, cohort, reference, tmp_path):
    """torchrun with multi_gpu_inference.json: each rank takes every other case (50 each), the files are those of
    one process byte for byte; rank 0 reports the status (torchrun then ends with its own status 1)."""
    predictions = tmp_path / "predictions"
    cmd = torchrun_cmd(2, *_inference_cmd(trained, cohort, predictions, "multi_gpu_inference.json"))
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "exitcode: 2" in result.stderr.replace("  ", " ").replace(
        "exitcode :", "exitcode:"
    )
    assert f"97 written, 3 failed: see {predictions / 'failures.csv'}" in result.stdout
    assert "100 case(s): 100 to do, 50 on this rank of 2." in result.stdout
    assert result.stdout.count("case case_013 (") == 1  # read (and failed) by one rank only
    assert written_tree(predictions) == written_tree(reference[1])


def test_inference_benchmark_measures_each_process_count(tmp_path):
    """``scripts/benchmark.py inference``: one row per process count from the runs' own throughput lines, every
    case written in each run (no timing is asserted)."""
    from scripts.harness.autoencoder import inference

    rows = inference(cases=4, shape=(16, 16, 16), processes=(1, 2), repeats=1, work_dir=str(tmp_path))
    assert [(r["processes"], r["cases"], r["written"], r["threads"]) for r in rows] == [(1, 4, 4, 1), (2, 4, 4, 1)]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == pytest.approx(
        rows[1]["cases_per_s"] / rows[0]["cases_per_s"]
    )
    assert all(r["cases_per_s"] > 0 and r["seconds"] > 0 for r in rows)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Workflow tests of ``bundles/mace_survival``, run as users run it, on a small synthetic MACE cohort: train ->
evaluate -> inference (with and without outcomes), bad CSVs and settings refused before anything is written, the Cox
head with covariates, a 2-process torchrun job and the quick-start launcher's total batch check. Resume after
crashes: ``tests/test_reliability.py``."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import REPO_ROOT, bundle_env, config_arg, overrides, run_bundle, torchrun_cmd

BUNDLE = "mace_survival"
TINY = ["train.json", "tiny.json"]
HORIZONS = [1.0, 2.0]
LABELS = {"low", "intermediate", "high"}


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    """32 chest phantoms (24 training, 8 validation) of 24x24x20 voxels with follow-up and MACE events."""
    from common.data.survival_demo import make_mace_cohort

    return make_mace_cohort(tmp_path_factory.mktemp("cohort"), n_cases=32, shape=(24, 24, 20), spacing=(14, 14, 16))


def _args(csv_path: Path, output_dir: Path, **extra) -> list[str]:
    return overrides(csv_path=str(csv_path), output_dir=str(output_dir), horizons=HORIZONS, **extra)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def trained(cohort, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mace_run")
    run_bundle(BUNDLE, TINY, args=_args(cohort, out))
    return out


def test_training_outputs(trained, cohort):
    from common.data.survival import cut_points_from_quantiles, read_cohort_csv, split_cohort

    models = trained / "models"
    last = torch.load(models / "last.pt", weights_only=True)
    assert {"predictor", "optimizer", "lr_scheduler", "trainer", "rng"} <= set(last)
    assert last["trainer"]["iteration"] == 12  # 24 training cases / batch 4 x 2 epochs
    best = torch.load(models / "model.pt", weights_only=True)
    assert int(best["calibrated"]) == 1 and best["train_risk_quantiles"].numel() == 101
    assert torch.all(best["train_risk_quantiles"][1:] >= best["train_risk_quantiles"][:-1])
    assert best["group_thresholds"][0] <= best["group_thresholds"][1]
    # the interval boundaries are the quantiles of the training event times, recomputed independently here
    sections = split_cohort(read_cohort_csv(cohort, time_unit="days"))
    times = [e["time"] for e in sections["training"]]
    events = [e["event"] for e in sections["training"]]
    np.testing.assert_allclose(best["cut_points"].numpy(), cut_points_from_quantiles(times, events, 4), rtol=1e-6)
    assert best["cut_points"][-1] == pytest.approx(max(times), rel=1e-6)

    summary = json.loads((trained / "metrics.json").read_text())
    assert [h["step"] for h in summary["history"]] == [6, 12]
    for h in summary["history"]:
        assert 0 <= h["uno_c"] <= 1 and h["uno_c_lo"] <= h["uno_c"] <= h["uno_c_hi"]
        assert 0 <= h["harrell_c"] <= 1 and 0 <= h["ibs"] <= 1 and 0 <= h["logrank_p"] <= 1
        assert {"auc_1", "auc_2", "brier_1", "brier_2", "calibration_ici"} <= set(h)
    log = (trained / "train.log").read_text()
    assert "effective batch: 4 sample(s) per rank and iteration x 1 rank(s)" in log
    assert "calibrated on 24 training case(s)" in log
    assert "uno_c" in (trained / "metrics.csv").read_text()


@pytest.fixture(scope="module")
def evaluated(trained, cohort) -> Path:
    run_bundle(BUNDLE, [*TINY, "evaluate.json"], run_id="run", args=_args(cohort, trained))
    return trained


def test_evaluate_matches_best_validation_and_writes_the_report(evaluated):
    from sksurv.metrics import concordance_index_censored

    trained = evaluated
    evaluation = json.loads((trained / "eval" / "metrics.json").read_text())["latest"]
    best = json.loads((trained / "metrics.json").read_text())["best"]
    for key in ("uno_c", "harrell_c", "auc_mean", "ibs", "brier_2"):
        assert evaluation[key] == pytest.approx(best[key], rel=1e-6), key
    rows = _rows(trained / "eval" / "predictions.csv")
    assert len(rows) == 8 and list(rows[0]) == [
        "case_id",
        "risk_score",
        "risk_percentile",
        "p_mace_1",
        "p_mace_2",
        "risk_group",
        "time",
        "event",
    ]
    # Harrell's C of the written predictions, by scikit-survival, is the reported one
    risk = np.array([float(r["risk_score"]) for r in rows])
    time = np.array([float(r["time"]) for r in rows])
    event = np.array([r["event"] == "1" for r in rows])
    assert concordance_index_censored(event, time, risk)[0] == pytest.approx(evaluation["harrell_c"], abs=1e-6)
    report = json.loads((trained / "eval" / "report.json").read_text())
    assert report["n_cases"] == 8 and report["horizons_years"] == HORIZONS
    assert set(report["km"]) >= LABELS and "bins" in report["calibration"]
    for name in ("km_by_risk_group.png", "calibration.png"):
        assert (trained / "eval" / name).read_bytes()[:4] == b"\x89PNG"


def test_inference_without_outcomes_writes_one_row_per_case(evaluated, cohort, tmp_path):
    """New cases (no follow-up columns): risk, percentile, MACE probabilities and group, and no report."""
    rows = [r for r in _rows(cohort) if r["split"] == "validation"]
    new_csv = tmp_path / "new.csv"
    with open(new_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["case_id", "image"])
        writer.writerows([[r["case_id"], str(cohort.parent / r["image"])] for r in rows])
    pred = tmp_path / "pred"
    run_bundle(
        BUNDLE,
        ["inference.json", "tiny.json"],
        run_id="run",
        args=overrides(csv_path=str(new_csv), output_dir=str(evaluated), prediction_dir=str(pred), horizons=HORIZONS),
    )
    written = _rows(pred / "predictions.csv")
    assert list(written[0]) == ["case_id", "risk_score", "risk_percentile", "p_mace_1", "p_mace_2", "risk_group"]
    assert sorted(r["case_id"] for r in written) == sorted(r["case_id"] for r in rows)
    for r in written:
        assert 0 <= float(r["risk_percentile"]) <= 100 and r["risk_group"] in LABELS
        assert 0 <= float(r["p_mace_1"]) <= float(r["p_mace_2"]) <= 1  # survival is non-increasing
    assert not (pred / "report.json").exists()
    # the same model on the same cases gives what the evaluation wrote (the calibration travels with model.pt)
    reference = {r["case_id"]: r for r in _rows(evaluated / "eval" / "predictions.csv")}
    for r in written:
        for key in ("risk_score", "risk_percentile", "p_mace_1", "p_mace_2"):
            assert float(r[key]) == pytest.approx(float(reference[r["case_id"]][key]), rel=1e-5, abs=1e-6), key
        assert r["risk_group"] == reference[r["case_id"]]["risk_group"]


def test_bad_csv_is_reported_per_row_before_anything_is_written(cohort, tmp_path):
    rows = _rows(cohort)
    bad = tmp_path / "bad.csv"
    with open(bad, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for i, row in enumerate(rows):
            row = dict(row, image=str(cohort.parent / row["image"]))
            if i == 1:
                row["time"] = "-30"
            elif i == 2:
                row["event"] = "2"
            elif i == 3:
                row["case_id"] = rows[4]["case_id"]
            elif i == 5:
                row["image"] = str(tmp_path / "missing.nii.gz")
            writer.writerow(row)
    out = tmp_path / "out"
    result = run_bundle(BUNDLE, TINY, check=False, args=_args(bad, out))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "row 2" in result.stderr and "negative" in result.stderr
    assert "row 3" in result.stderr and "'2'" in result.stderr
    assert "duplicate case id" in result.stderr and rows[4]["case_id"] in result.stderr
    assert "missing.nii.gz" in result.stderr
    assert not out.exists()


def test_bad_settings_are_refused_before_anything_is_written(cohort, tmp_path):
    """Invalid settings, each named by its config id (horizons beyond follow-up: tests/test_data_survival.py)."""
    out = tmp_path / "out"
    result = run_bundle(
        BUNDLE,
        TINY,
        check=False,
        args=overrides(
            csv_path=str(cohort),
            output_dir=str(out),
            survival_head="weibull",
            conv1_t_stride=0,
            horizons=[3, 1],
        ),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    for expected in ("'survival_head'", "'conv1_t_stride'", "'horizons' must increase"):
        assert expected in result.stderr, expected
    assert not out.exists()


def test_cox_head_with_covariates(cohort, tmp_path):
    """Cox head: Breslow baseline hazard in model.pt; covariates standardised with the training statistics."""
    from common.data.survival import covariate_stats, read_cohort_csv, split_cohort

    out = tmp_path / "cox"
    args = _args(cohort, out, survival_head="cox", covariates=["age", "sex"], max_epochs=1)
    run_bundle(BUNDLE, TINY, args=args)
    best = torch.load(out / "models" / "model.pt", weights_only=True)
    assert int(best["calibrated"]) == 1 and best["cut_points"].numel() == 0
    cumhaz, grid = best["baseline_cumhaz"], best["baseline_grid"]
    assert torch.all(cumhaz[1:] >= cumhaz[:-1]) and cumhaz[-1] > 0 and torch.all(grid[1:] >= grid[:-1])
    entries = split_cohort(read_cohort_csv(cohort, covariates=("age", "sex"), time_unit="days"))["training"]
    mean, std = covariate_stats(entries)
    np.testing.assert_allclose(best["covariate_mean"].numpy(), mean, rtol=1e-5)
    np.testing.assert_allclose(best["covariate_std"].numpy(), std, rtol=1e-5)
    # the validation used the Cox survival (Breslow baseline) at the horizons
    latest = json.loads((out / "metrics.json").read_text())["latest"]
    assert 0 <= latest["uno_c"] <= 1 and 0 <= latest["brier_1"] <= 1 and 0 <= latest["brier_2"] <= 1


def test_torchrun_two_processes_share_the_risk_set_and_keep_identical_replicas(cohort, tmp_path):
    out = tmp_path / "ddp"
    cmd = torchrun_cmd(
        2,
        "-m",
        "monai.bundle",
        "run",
        "training",
        "--config_file",
        config_arg(BUNDLE, *TINY, "multi_gpu_train.json"),
        *_args(cohort, out, survival_head="cox", max_epochs=1, batch_size=4),
    )
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    log = (out / "train.log").read_text()
    assert "effective batch: 2 sample(s) per rank and iteration x 2 rank(s)" in log
    assert "identical on all 2 ranks" in log
    assert "calibrated on 24 training case(s)" in log  # every training case once, gathered from both ranks
    summary = json.loads((out / "metrics.json").read_text())
    assert 0 <= summary["latest"]["uno_c"] <= 1


def test_total_batch_must_divide_by_the_processes():
    from common.bundle_tools.launch import LaunchError, build_plan
    from common.engines.survival import per_rank_batch_size

    with pytest.raises(LaunchError, match="batch_size 6 is the total batch across all processes .* 4 process"):
        build_plan(BUNDLE, nproc_per_node=4, cpu=True, overrides={"csv_path": "/data/c.csv", "batch_size": 6})
    plan = build_plan(BUNDLE, nproc_per_node=4, cpu=True, overrides={"csv_path": "/data/c.csv", "batch_size": 8})
    assert (
        "torch.distributed.run" in plan.argv
        and "--csv_path" in plan.argv
        and "multi_gpu_train.json" in " ".join(plan.argv)
    )
    assert per_rank_batch_size(8, world_size=4) == 2
    with pytest.raises(ValueError, match=r"must be divisible by the number of processes \(4\).*e\.g\. 8"):
        per_rank_batch_size(6, world_size=4)

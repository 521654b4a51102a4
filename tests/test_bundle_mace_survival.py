# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Workflow tests of ``bundles/mace_survival``, run as users run it, on a small synthetic MACE cohort: train ->
evaluate -> inference (with and without outcomes), bad CSVs refused before anything is written, the Cox head with
covariates, a 2-process torchrun job and the quick-start launcher's total batch check; the transform lists declared in
the JSON against ``survival_transforms``, and the calibration and validation datasets. What every bundle does:
``tests/test_bundle_contract.py``; resume after crashes: ``tests/test_reliability.py``."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.bundle_cases import csv_rows
from tests.helpers import (
    BUNDLES,
    REPO_ROOT,
    bundle_env,
    bundle_parser,
    config_arg,
    overrides,
    run_bundle,
    same_tensor,
    shifted_seed,
    torchrun_cmd,
)

BUNDLE = "mace_survival"
TINY = ["train.json", "tiny.json"]
# inside the follow-up of every split by the design of :func:`_followup_design` (0.25 to 5.75 years, first case an
# event at 0.25 years); exact in float32, as the survival predictor holds them
HORIZONS = [1.0, 2.0]
LABELS = ["low", "intermediate", "high"]  # lowest risk first
BATCH = 4  # tiny.json: batch_size
EPOCHS = 2  # tiny.json: max_epochs (validation after every epoch: val_interval 1)
# inference runs with the suite's OMP_NUM_THREADS, the evaluation with tiny.json's 1 thread: float32 sums may differ
FLOAT32_RTOL = 1e-5


def _followup_design(csv_path: Path) -> Path:
    """The generated cohort with a fixed follow-up design, written next to it as ``design.csv``.

    Images, covariates and the split column are the generator's. Within each split, the ``k``-th of its ``m``
    cases (file order) is followed for ``0.25 + 5.5 k / (m - 1)`` years (in whole days), with an event unless
    ``k % 3 == 2``: every split then covers 0.25 to 5.75 years and starts with an event, so both :data:`HORIZONS`
    are usable in every split and the validation split has an event before the first horizon, whatever the seed.
    """
    rows = csv_rows(csv_path)
    positions: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        positions.setdefault(row["split"], []).append(i)
    for members in positions.values():
        assert len(members) >= 2, positions  # make_mace_cohort gives every split cases
        for k, i in enumerate(members):
            years = 0.25 + 5.5 * k / (len(members) - 1)
            rows[i]["time"] = str(round(years * 365.25))
            rows[i]["event"] = "0" if k % 3 == 2 else "1"
    design = csv_path.parent / "design.csv"
    with open(design, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return design


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:
    """32 chest phantoms of 24x24x20 voxels, split by the generator (stratified by its events: 24/8 or 23/9
    training/validation cases, depending on the seed), with the follow-up of :func:`_followup_design`."""
    from common.demo.survival import make_mace_cohort

    generated = make_mace_cohort(
        tmp_path_factory.mktemp("cohort"), n_cases=32, shape=(24, 24, 20), spacing=(14, 14, 16), seed=shifted_seed(0)
    )
    return _followup_design(generated)


def _args(csv_path: Path, output_dir: Path, **extra) -> list[str]:
    return overrides(csv_path=str(csv_path), output_dir=str(output_dir), horizons=HORIZONS, **extra)


def _split(cohort: Path, name: str) -> list[dict]:
    return [r for r in csv_rows(cohort) if r["split"] == name]


def _keys(prefix: str) -> list[str]:
    return [f"{prefix}_{h:g}" for h in HORIZONS]


@pytest.fixture(scope="module")
def trained(cohort, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mace_run")
    run_bundle(BUNDLE, TINY, args=_args(cohort, out))
    return out


def test_training_outputs(trained, cohort):
    from common.survival.cohort import cut_points_from_quantiles, read_cohort_csv, split_cohort

    n_train = len(_split(cohort, "training"))
    per_epoch = n_train // BATCH  # the training loader drops the last incomplete batch (train.json: drop_last)
    models = trained / "models"
    last = torch.load(models / "last.pt", weights_only=True)
    assert {"predictor", "optimizer", "lr_scheduler", "trainer", "rng"} <= set(last)
    assert last["trainer"]["iteration"] == EPOCHS * per_epoch
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
    assert [h["step"] for h in summary["history"]] == [per_epoch * (e + 1) for e in range(EPOCHS)]
    for h in summary["history"]:
        assert 0 <= h["uno_c"] <= 1 and h["uno_c_lo"] <= h["uno_c"] <= h["uno_c_hi"]
        assert 0 <= h["harrell_c"] <= 1
        assert math.isfinite(h["ibs"]) and h["ibs"] >= 0  # IPCW-weighted: no upper bound of 1
        assert math.isnan(h["logrank_p"]) or 0 <= h["logrank_p"] <= 1  # nan: fewer than 2 groups with cases
        assert {*_keys("auc"), *_keys("brier"), "calibration_ici"} <= set(h)
    log = (trained / "train.log").read_text()
    assert f"effective batch: {BATCH} sample(s) per rank and iteration x 1 rank(s)" in log
    assert f"calibrated on {n_train} training case(s)" in log
    assert "uno_c" in (trained / "metrics.csv").read_text()
    # every validation logs its risk groups, each of the three named whether or not it has cases
    lines = [line for line in log.splitlines() if "risk groups: " in line]
    assert len(lines) == EPOCHS
    for line in lines:
        assert re.search(r"risk groups: low \d+ case.*; intermediate \d+ case.*; high \d+ case.*; log-rank test", line)


@pytest.fixture(scope="module")
def evaluated(trained, cohort) -> Path:
    run_bundle(BUNDLE, [*TINY, "evaluate.json"], run_id="run", args=_args(cohort, trained))
    return trained


def _group_of(risk: str, thresholds: np.ndarray) -> str:
    """The group of a written risk: the number of thresholds at or below it, in float32 as the predictor decides
    (``.9g`` round-trips float32, so this is exact)."""
    return LABELS[int(np.sum(thresholds <= np.float32(float(risk))))]


def _check_group_table(path: Path, rows: list[dict], thresholds: np.ndarray, outcomes: bool) -> None:
    """``risk_groups.csv``: the three groups in order, their risk ranges and the cases (and events) of ``rows``."""
    table = csv_rows(path)
    columns = ["risk_group", "risk_score_from", "risk_score_to", "cases", *(["events"] if outcomes else []), "note"]
    assert list(table[0]) == columns and [t["risk_group"] for t in table] == LABELS
    bounds = [-math.inf, *thresholds.tolist(), math.inf]
    for g, t in enumerate(table):
        members = [r for r in rows if r["risk_group"] == t["risk_group"]]
        assert float(t["risk_score_from"]) == pytest.approx(bounds[g], rel=1e-5)  # written with .6g
        assert float(t["risk_score_to"]) == pytest.approx(bounds[g + 1], rel=1e-5)
        assert int(t["cases"]) == len(members) and (t["note"] != "") == (not members)
        if outcomes:
            assert int(t["events"]) == sum(r["event"] == "1" for r in members)


def test_evaluate_matches_best_validation_and_writes_the_report(evaluated, cohort):
    from sksurv.metrics import concordance_index_censored

    trained = evaluated
    evaluation = json.loads((trained / "eval" / "metrics.json").read_text())["latest"]
    best = json.loads((trained / "metrics.json").read_text())["best"]
    for key in ("uno_c", "harrell_c", "auc_mean", "ibs", _keys("brier")[-1]):
        assert evaluation[key] == pytest.approx(best[key], rel=1e-6, nan_ok=True), key
    validation = _split(cohort, "validation")
    rows = csv_rows(trained / "eval" / "predictions.csv")
    assert list(rows[0]) == [
        "case_id",
        "risk_score",
        "risk_percentile",
        *_keys("p_mace"),
        "risk_group",
        "time",
        "event",
    ]
    assert sorted(r["case_id"] for r in rows) == sorted(r["case_id"] for r in validation)
    truth = {r["case_id"]: r for r in validation}
    for r in rows:  # the outcomes are the CSV's, the time in years
        assert r["event"] == truth[r["case_id"]]["event"]
        assert float(r["time"]) == pytest.approx(int(truth[r["case_id"]]["time"]) / 365.25, rel=1e-5)
    # every case's group is the one its risk falls into between the training thresholds of model.pt
    thresholds = torch.load(trained / "models" / "model.pt", weights_only=True)["group_thresholds"].numpy()
    assert [r["risk_group"] for r in rows] == [_group_of(r["risk_score"], thresholds) for r in rows]
    # Harrell's C of the written predictions, by scikit-survival, is the reported one
    risk = np.array([float(r["risk_score"]) for r in rows])
    time = np.array([float(r["time"]) for r in rows])
    event = np.array([r["event"] == "1" for r in rows])
    assert concordance_index_censored(event, time, risk)[0] == pytest.approx(evaluation["harrell_c"], abs=1e-6)

    report = json.loads((trained / "eval" / "report.json").read_text())
    assert report["n_cases"] == len(rows) and report["n_events"] == int(event.sum())
    assert report["horizons_years"] == HORIZONS and "bins" in report["calibration"]
    # the Kaplan-Meier groups and the group table hold the cases and events of the written predictions
    km = report["km"]
    for label in LABELS:
        members = [r for r in rows if r["risk_group"] == label]
        assert km[label]["n"] == len(members), label
        assert km[label]["events"] == sum(r["event"] == "1" for r in members), label
        assert len(km[label]["times"]) == len(km[label]["survival"]) and (len(km[label]["times"]) > 0) == bool(members)
    _check_group_table(trained / "eval" / "risk_groups.csv", rows, thresholds, outcomes=True)
    with_cases = [label for label in LABELS if km[label]["n"] > 0]
    assert km["logrank_groups"] == with_cases and km["empty_groups"] == [g for g in LABELS if g not in with_cases]
    assert report["logrank_p"] == km["logrank_p"]
    if len(with_cases) < 2 or not event.any():
        assert km["logrank_p"] is None and km["logrank_statistic"] is None  # not computable: null in report.json
    else:
        assert 0 <= km["logrank_p"] <= 1 and km["logrank_statistic"] >= 0
    for name in ("km_by_risk_group.png", "calibration.png"):
        assert (trained / "eval" / name).read_bytes()[:4] == b"\x89PNG"


def _percentile_range(risk: float, quantiles: np.ndarray, rtol: float) -> float:
    """How much the percentile may move when the risk moves by ``rtol`` (relative): the stored percentiles
    interpolated linearly (as the predictor does) over ``risk (1 +- rtol)``."""
    levels = np.linspace(0.0, 100.0, quantiles.size)
    low, high = np.interp([risk - rtol * abs(risk), risk + rtol * abs(risk)], quantiles, levels)
    return float(high - low)


def test_inference_without_outcomes_writes_one_row_per_case(evaluated, cohort, tmp_path):
    """New cases (no follow-up columns): risk, percentile, MACE probabilities and group, and no report."""
    rows = _split(cohort, "validation")
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
    written = csv_rows(pred / "predictions.csv")
    assert list(written[0]) == ["case_id", "risk_score", "risk_percentile", *_keys("p_mace"), "risk_group"]
    assert sorted(r["case_id"] for r in written) == sorted(r["case_id"] for r in rows)
    model = torch.load(evaluated / "models" / "model.pt", weights_only=True)
    thresholds = model["group_thresholds"].numpy()
    quantiles = model["train_risk_quantiles"].double().numpy()
    for r in written:
        assert 0 <= float(r["risk_percentile"]) <= 100 and r["risk_group"] == _group_of(r["risk_score"], thresholds)
        p = [float(r[key]) for key in _keys("p_mace")]
        assert 0 <= p[0] and all(a <= b for a, b in zip(p, p[1:])) and p[-1] <= 1  # survival is non-increasing
    assert not (pred / "report.json").exists()
    _check_group_table(pred / "risk_groups.csv", written, thresholds, outcomes=False)
    # the same model on the same cases gives what the evaluation wrote (the calibration travels with model.pt), up
    # to float32 rounding (the two runs may use different thread counts) and the rounding of the CSV formats
    reference = {r["case_id"]: r for r in csv_rows(evaluated / "eval" / "predictions.csv")}
    for r in written:
        ref = reference[r["case_id"]]
        risk = float(ref["risk_score"])
        assert float(r["risk_score"]) == pytest.approx(risk, rel=FLOAT32_RTOL, abs=1e-6)
        # .2f on both sides (0.005 each), the percentile's move over the risk's float32 tolerance, and the float32
        # arithmetic of the percentile itself (a few ulps of 100, 8e-6 each)
        tolerance = 0.01 + _percentile_range(risk, quantiles, FLOAT32_RTOL) + 1e-4
        assert abs(float(r["risk_percentile"]) - float(ref["risk_percentile"])) <= tolerance, r["case_id"]
        for key in _keys("p_mace"):  # .6f on both sides (5e-7 each) plus float32 rounding of a probability <= 1
            assert abs(float(r[key]) - float(ref[key])) <= 1e-6 + FLOAT32_RTOL, key
        if all(abs(risk - t) > FLOAT32_RTOL * abs(t) for t in thresholds):  # not on a group boundary
            assert r["risk_group"] == ref["risk_group"], r["case_id"]


def test_inference_fails_bad_cases_only_restarts_and_shares_cases_over_two_processes(evaluated, cohort, tmp_path):
    """A cohort CSV naming a truncated and a missing volume: the other cases are scored, the two are rows of
    failures.csv (exit status 2); re-run, every case is skipped and the tables are written again, the same; two
    torchrun processes write the same tables (each merged once by rank 0 from the records of all cases)."""
    rows = _split(cohort, "validation")
    image = cohort.parent / rows[0]["image"]
    data = image.read_bytes()
    (tmp_path / "truncated.nii.gz").write_bytes(data[: len(data) // 2])
    new_csv = tmp_path / "new.csv"
    with open(new_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["case_id", "image"])
        writer.writerows([[r["case_id"], str(cohort.parent / r["image"])] for r in rows])
        writer.writerows([["zz_truncated", str(tmp_path / "truncated.nii.gz")], ["zz_missing", "gone.nii.gz"]])
    configs = ["inference.json", "tiny.json"]

    def infer(pred: Path, *extra: str, processes: int = 1) -> subprocess.CompletedProcess:
        # one case per batch: how the ranks split the cases then cannot change a batch's make-up, which on some
        # CPUs changes the last bits of a case's risk (the kernels chosen depend on the batch size)
        settings = dict(csv_path=str(new_csv), output_dir=str(evaluated), prediction_dir=str(pred), batch_size=1)
        args = overrides(**settings, horizons=HORIZONS)
        if processes == 1:
            return run_bundle(BUNDLE, configs, run_id="run", check=False, args=args)
        cmd = torchrun_cmd(
            processes, "-m", "monai.bundle", "run", "--config_file", config_arg(BUNDLE, *configs, *extra)
        )
        return subprocess.run(
            [*cmd, *args], cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=600
        )

    pred = tmp_path / "pred"
    first = infer(pred)
    assert first.returncode == 2, first.stdout[-3000:] + first.stderr[-3000:]
    assert first.stdout.strip().splitlines()[-1] == f"{len(rows)} written, 2 failed: see {pred / 'failures.csv'}"
    failed = {r["case_id"]: r for r in csv_rows(pred / "failures.csv")}
    assert failed["zz_missing"]["stage"] == "check" and failed["zz_missing"]["reason"] == "does not exist"
    assert failed["zz_truncated"]["stage"] == "read" and "EOFError" in failed["zz_truncated"]["reason"]
    assert sorted(r["case_id"] for r in csv_rows(pred / "predictions.csv")) == sorted(r["case_id"] for r in rows)
    tables = {name: (pred / name).read_bytes() for name in ("predictions.csv", "risk_groups.csv", "failures.csv")}
    again = infer(pred)
    assert f"0 written ({len(rows)} already written, skipped), 2 failed" in again.stdout
    assert {name: (pred / name).read_bytes() for name in tables} == tables
    shared = infer(tmp_path / "shared", "multi_gpu_inference.json", processes=2)
    assert f"{len(rows)} written, 2 failed" in shared.stdout, shared.stdout[-3000:] + shared.stderr[-3000:]
    assert {name: (tmp_path / "shared" / name).read_bytes() for name in tables} == tables


def test_bad_csv_is_reported_per_row_before_anything_is_written(cohort, tmp_path):
    rows = csv_rows(cohort)
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


def test_cox_head_with_covariates(cohort, tmp_path):
    """Cox head: Breslow baseline hazard in model.pt; covariates standardised with the training statistics."""
    from common.survival.cohort import covariate_stats, read_cohort_csv, split_cohort

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
    assert 0 <= latest["uno_c"] <= 1
    for key in _keys("brier"):  # IPCW-weighted: finite and >= 0, no upper bound of 1
        assert math.isfinite(latest[key]) and latest[key] >= 0, key


def test_torchrun_two_processes_share_the_risk_set_and_keep_identical_replicas(cohort, tmp_path):
    out = tmp_path / "ddp"
    configs = [*TINY, "multi_gpu_train.json"]
    args = _args(cohort, out, survival_head="cox", max_epochs=1, batch_size=BATCH)
    run_bundle(BUNDLE, configs, args=args, processes=2)
    log = (out / "train.log").read_text()
    assert f"effective batch: {BATCH // 2} sample(s) per rank and iteration x 2 rank(s)" in log
    assert "identical on all 2 ranks" in log
    n_train = len(_split(cohort, "training"))
    assert f"calibrated on {n_train} training case(s)" in log  # every training case once, gathered from both ranks
    summary = json.loads((out / "metrics.json").read_text())
    assert 0 <= summary["latest"]["uno_c"] <= 1


def test_total_batch_must_divide_by_the_processes():
    from common.bundle_tools.launch import LaunchError, build_plan
    from common.survival.engines import per_rank_batch_size

    with pytest.raises(LaunchError, match="batch_size 6 is the total batch across all processes .* 4 process"):
        build_plan(BUNDLE, nproc_per_node=4, cpu=True, overrides={"csv_path": "/data/c.csv", "batch_size": 6})
    plan = build_plan(BUNDLE, nproc_per_node=4, cpu=True, overrides={"csv_path": "/data/c.csv", "batch_size": 8})
    assert (
        "common.bundle_tools.torchrun" in plan.argv
        and "--csv_path" in plan.argv
        and "multi_gpu_train.json" in " ".join(plan.argv)
    )
    assert per_rank_batch_size(8, world_size=4) == 2
    with pytest.raises(ValueError, match=r"must be divisible by the number of processes \(4\).*e\.g\. 8"):
        per_rank_batch_size(6, world_size=4)


def _train_parser(*extra: str, **settings):
    """The bundle's train.json (with ``extra`` config files merged after it), parsed in this process on the CPU."""
    return bundle_parser(BUNDLE, ["train.json", *extra], **settings)


def _inference_parser(**settings):
    """The bundle's inference.json parsed in this process on the CPU with ``settings`` (no trained run needed)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(BUNDLES / BUNDLE / "configs" / "inference.json"))
    for key, value in {"bundle_root": str(BUNDLES / BUNDLE), "device": "cpu", **settings}.items():
        parser[key] = value
    return parser


def _same_item(a: dict, b: dict) -> None:
    """Two prepared cases hold the same keys, values, types and image metadata."""
    assert sorted(a) == sorted(b)
    for key in a:
        x, y = a[key], b[key]
        assert type(x) is type(y), key
        if isinstance(x, torch.Tensor):
            same_tensor(x, y)
        else:
            np.testing.assert_equal(x, y, err_msg=key)  # e.g. the foreground crop's box


@pytest.mark.parametrize(
    "settings",
    [
        {},  # train.json's defaults: CT window, RAS, native spacing, body crop, augmentation
        {
            "intensity": {"mode": "mri", "lower": 1.0, "upper": 99.0},
            "spacing": [1.5, 1.25, 2.0],
            "orientation": "LPS",
            "crop_foreground": False,
        },
        {"intensity": {"mode": "none"}, "spacing": [2, 2, 2], "orientation": None, "augment": False},
    ],
    ids=["defaults", "mri-spacing-no-crop", "none-native-no-augment"],
)
def test_json_pipelines_match_survival_transforms(tmp_path, settings):
    """The transform lists of train.json (training under fixed seeds, calibration, validation) and inference.json
    prepare a case as ``survival_transforms`` does: same keys (the CSV's other columns dropped), values, types and
    image metadata."""
    import nibabel as nib
    from monai.transforms import Compose

    from tests.oracles import survival_transforms

    rng = np.random.default_rng(shifted_seed(3))
    affine = np.array([[-1.2, 0.0, 0.1, 5.0], [0.0, 0.9, 0.0, -3.0], [0.0, 0.0, 1.7, 2.0], [0.0, 0.0, 0.0, 1.0]])
    volume = rng.normal(-900.0, 100.0, (16, 14, 12))
    volume[3:12, 4:11, 2:10] = rng.normal(200.0, 300.0, (9, 7, 8))  # a body inside air, for the foreground crop
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(volume.astype(np.float32), affine), str(path))
    case = {"image": str(path), "case_id": "c7", "time": 2.5, "event": 1, "covariates": [0.3, 61.0], "split": "x"}

    parser = _train_parser("tiny.json", image_size=[12, 10, 8], **settings)
    keys = ("intensity", "spacing", "orientation", "crop_foreground")
    chosen = {k: parser[k] for k in keys}
    augment = parser["augment"]
    train = parser.get_parsed_content("train#preprocessing")
    assert isinstance(train, Compose)
    names = [type(t).__name__ for t in train.transforms]
    assert names[-2:] == (["RandAffined", "RandGaussianNoised"] if augment else ["EnsureTyped", "ToDeviced"])
    assert ("CropForegroundd" in names) is chosen["crop_foreground"]
    assert ("Spacingd" in names) is (chosen["spacing"] is not None)
    assert ("Orientationd" in names) is bool(chosen["orientation"])
    expected = survival_transforms([12, 10, 8], **chosen, cache_device="cpu", augment=augment)
    for seed in range(4):
        train.set_random_state(seed), expected.set_random_state(seed)
        _same_item(train(dict(case)), expected(dict(case)))

    validate = parser.get_parsed_content("validate#preprocessing")
    item = validate(dict(case))
    _same_item(item, survival_transforms([12, 10, 8], **chosen, cache_device="cpu", train=False)(dict(case)))
    assert item["image"].meta["case_id"] == "c7" and item["image"].shape == (1, 12, 10, 8)
    calibrate = parser.get_parsed_content("calibrate#preprocessing")
    _same_item(calibrate(dict(case)), survival_transforms([12, 10, 8], **chosen, train=False)(dict(case)))

    inference = _inference_parser(image_size=[12, 10, 8], **chosen)
    prepared = inference.get_parsed_content("preprocessing")(dict(case))
    _same_item(prepared, survival_transforms([12, 10, 8], **chosen, train=False)(dict(case)))


@pytest.mark.parametrize("rates", [{}, {"cache_rate": 0.5, "replace_rate": 0.5}], ids=["default", "smartcache"])
def test_calibration_and_validation_datasets_cache_their_shares(cohort, rates):
    """``calibrate#dataset`` holds every training case in cohort order, cached at ``calibration_cache_rate`` (1);
    ``validate#dataset`` caches the ``cache_rate`` share of the validation cases."""
    from monai.data import CacheDataset

    parser = _train_parser("tiny.json", csv_path=str(cohort), horizons=HORIZONS, **rates)
    cohort_split = parser.get_parsed_content("cohort")
    calibrate = parser.get_parsed_content("calibrate#dataset")
    validate = parser.get_parsed_content("validate#dataset")
    assert type(calibrate) is CacheDataset and type(validate) is CacheDataset
    assert [d["case_id"] for d in calibrate.data] == [d["case_id"] for d in cohort_split["training"]]
    assert calibrate.cache_num == len(cohort_split["training"])
    assert validate.cache_num == int(len(cohort_split["validation"]) * parser["cache_rate"])

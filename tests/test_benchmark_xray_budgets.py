# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the budget comparison of ``xray_quality --budgets``: which runs it makes and in which order, that every
snapshot is the weights of its budget (segments of one run resumed, the residual regressor at half the budget), that
every evaluation sees the stages of its own budget, and its table and plot; then the real bundle commands once, in
this process, at toy sizes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from common.checkpoint_io import load_checkpoint, save_checkpoint
from scripts.harness import xray2ct as benchmark
from scripts.harness.tools import BundleRuns
from scripts.harness.xray_budgets import BUDGET_HEADER, budget_rows, plot_budgets, winner_rows, xray_budgets
from tests.helpers import TINY_XRAY_NETWORK, shifted_seed
from tests.test_benchmark_xray import in_process  # noqa: F401  (fixture)

NETWORK = {k: list(v) if isinstance(v, tuple) else v for k, v in TINY_XRAY_NETWORK.items()}


class FakeBundle:
    """Stands in for the bundle's commands: training writes ``last.pt`` whose EMA weight ``w`` is the iteration
    reached (and checks that a resumed segment continues where the last one stopped); evaluation checks the weights
    of every stage of the cascade it runs and writes metrics made of them."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    @staticmethod
    def command(run_id, configs, overrides):
        return run_id, list(configs), dict(overrides)

    def run(self, cmd) -> float:
        run_id, configs, o = cmd
        with self.lock:
            self.calls.append((run_id, o))
        out, stage = Path(o["output_dir"]), o["stage"]
        if run_id == "training":
            return self.train(out, stage, o)
        return self.evaluate(out, stage, o)

    def train(self, out: Path, stage: int, o: dict) -> float:
        models = out / f"stage{stage}" / "models"
        target = o["max_epochs"] * o["epoch_length"]
        start = 0
        if o["resume"]:
            start = int(load_checkpoint(models / "last.pt")["trainer"]["iteration"])
        else:
            assert not (models / "last.pt").exists(), f"a fresh run over an old one: {models}"
        assert o["init_from_previous"] is False and o["deterministic"] is True
        if stage > 1:
            assert (out / "stage1" / "models" / "model.pt").is_file(), "stage 2 needs stage-1 weights"
        if o["mode"] == "residual":
            regressor = load_checkpoint(Path(o["regressor_dir"]) / f"stage{stage}" / "models" / "model.pt")
            assert float(regressor["w"]) == target, "the regressor trained as long as the residual diffusion"
        assert target > start
        ema = {"w": torch.tensor(float(target)), "n_averaged": torch.tensor(target)}
        save_checkpoint({"ema": ema, "trainer": {"iteration": target}}, models / "last.pt")
        (out / f"stage{stage}" / "configs").mkdir(parents=True, exist_ok=True)
        (out / f"stage{stage}" / "configs" / "run.json").write_text(json.dumps({"settings": {"mode": o["mode"]}}))
        return float(target - start)

    def evaluate(self, out: Path, stage: int, o: dict) -> float:
        weights = []
        if o["mode"] != "backprojection":
            for k in range(1, stage + 1):
                weights.append(float(load_checkpoint(out / f"stage{k}" / "models" / "model.pt")["w"]))
        psnr = sum(weights) + o["guidance_scale"] + 10 * o["refine_steps"]
        metrics = {"val_psnr": psnr, "val_proj_error": 1.0 / (1 + sum(weights))}
        if o["num_samples"] > 1:
            metrics["val_sample_psnr"] = metrics["val_psnr"] - 1
        eval_dir = Path(o["eval_dir"])
        eval_dir.mkdir(parents=True)  # every evaluation has a folder of its own
        (eval_dir / "metrics.json").write_text(json.dumps({"latest": metrics, "weights": weights}))
        return 1.0


def test_budget_runs_snapshots_and_evaluations(tmp_path):
    fake = FakeBundle()
    out = tmp_path / "budgets.json"
    summary = xray_budgets(
        BundleRuns(fake.run, fake.command, {"seed": 3}),
        [8, 4, 16],
        tmp_path / "work",
        methods=["direct", "diffusion", "residual", "min_snr"],
        num_samples=4,
        guidance_scale=0.5,
        refine_steps=3,
        conditions=["noise_dose_low", "blur", "scatter"],
        parallel=2,
        output=str(out),
    )
    assert summary["budgets"] == [4, 8, 16] and summary["stage2_iterations"] == {"4": 2, "8": 4, "16": 8}
    trainings = [o for run_id, o in fake.calls if run_id == "training"]
    assert all(o["seed"] == 3 for _, o in fake.calls)

    def ends(method, stage):
        return [
            o["max_epochs"] * o["epoch_length"]
            for o in trainings
            if o["stage"] == stage and o["mode"] == method and "train" in Path(o["output_dir"]).name
        ]

    # one run per method and stage, in segments: direct also stops at half of every budget (the regressors)
    assert ends("direct", 1) == [2, 4, 8, 16] and ends("direct", 2) == [1, 2, 4, 8]
    diffusion = [o for o in trainings if "diffusion/train" in o["output_dir"].replace("\\", "/")]
    segments = [(o["stage"], o["max_epochs"] * o["epoch_length"]) for o in diffusion]
    assert segments == [(1, 4), (1, 8), (1, 16), (2, 2), (2, 4), (2, 8)]
    min_snr = [o for o in trainings if o.get("loss_weighting") == "min_snr"]
    assert [o["stage"] for o in min_snr] == [1, 1, 1]  # stage 1 only
    residual = sorted((o["stage"], o["max_epochs"] * o["epoch_length"]) for o in trainings if o["mode"] == "residual")
    assert residual == [(1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4)]  # half of each budget, on top of its regressor
    # every evaluation ran the stages of its own budget
    clean = [r for r in summary["results"] if r["condition"] == "clean"]
    rows = {(r["method"], r["stage"], r["budget"], r["guidance_scale"], r["refine_steps"]): r for r in clean}
    assert all(r["noise_tolerance"] is None for r in clean) and len(rows) == len(clean)
    for b in (4, 8, 16):
        for method in ("direct", "diffusion"):
            assert rows[(method, 1, b, 0.0, 0)]["psnr"] == b
            assert rows[(method, 2, b, 0.0, 0)]["psnr"] == b + b // 2
        assert rows[("diffusion", 1, b, 0.5, 0)]["psnr"] == b + 0.5
        assert rows[("residual", 1, b, 0.0, 0)]["psnr"] == b // 2
        assert rows[("residual", 2, b, 0.0, 0)]["psnr"] == b // 2 + b // 4
        assert rows[("min_snr", 1, b, 0.0, 0)]["num_samples"] == 4 and ("min_snr", 2, b, 0.0, 0) not in rows
        assert rows[("direct", 1, b, 0.0, 0)]["num_samples"] == 1 and ("direct", 1, b, 0.5, 0) not in rows
        assert rows[("diffusion", 1, b, 0.0, 0)]["sample_psnr"] == b - 1
        # the same physics post-processing for every method: the regressor refined, the guided samples refined
        for stage, psnr in ((1, b), (2, b + b // 2)):
            assert rows[("direct_refined", stage, b, 0.5, 3)]["psnr"] == psnr + 0.5 + 30
            assert rows[("direct_refined", stage, b, 0.5, 3)]["num_samples"] == 1
        for method in ("diffusion", "residual", "min_snr"):
            assert (method, 1, b, 0.5, 3) in rows
    assert rows[("backprojection", 1, None, 0.0, 0)]["psnr"] == 0.0 and ("backprojection", 2, None, 0.0, 0) in rows
    assert rows[("backprojection_refined", 1, None, 0.5, 3)]["psnr"] == 30.5
    evaluations = [o for run_id, o in fake.calls if run_id == "run"]
    assert len({o["eval_dir"] for o in evaluations}) == len(evaluations)  # each its own folder
    # realistic X-rays: the two largest budgets, every method and stage, each condition's overrides, and the guided
    # and refined evaluations once more with the discrepancy principle
    realistic = [r for r in summary["results"] if r["condition"] != "clean"]
    assert {r["condition"] for r in realistic} == {"noise_dose_low", "blur", "scatter"}
    assert {r["budget"] for r in realistic} == {None, 8, 16}
    for condition in ("noise_dose_low", "scatter"):
        chosen = {
            (r["method"], r["guidance_scale"], r["refine_steps"], r["noise_tolerance"])
            for r in realistic
            if r["condition"] == condition and r["stage"] == 2 and r["budget"] == 16
        }
        assert chosen == {
            ("direct", 0.0, 0, None),
            ("direct_refined", 0.5, 3, None),
            ("direct_refined", 0.5, 3, 1.5),
            *((m, g, r, t) for m in ("diffusion", "residual") for g, r, t in ((0.0, 0, None), (0.5, 0, None))),
            *((m, 0.5, r, 1.5) for m in ("diffusion", "residual") for r in (0, 3)),
            *((m, 0.5, 3, None) for m in ("diffusion", "residual")),
        }
    scatter = [o for _, o in fake.calls if "_scatter" in str(o.get("eval_dir", ""))]
    assert scatter and all(o["xray_condition"] == {"scatter": 0.05} for o in scatter)
    blur = [o for _, o in fake.calls if str(o.get("eval_dir", "")).endswith("_blur")]
    assert blur and all(o["xray_condition"] == {"blur_mm": pytest.approx(350.0 / 128)} for o in blur)
    assert summary["conditions"]["noise_dose_low"] == {"xray_condition": {"photons": 1e4}}
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(summary["results"]))
    # table and plot
    table = budget_rows(json.loads(out.read_text()))
    assert all(len(row) == len(BUDGET_HEADER) for row in table)
    assert ["clean", "residual", 2, "16 + 8"] in [row[:4] for row in table]
    winners = {tuple(row[:3]): row for row in winner_rows(summary)}
    assert set(winners) == {
        (c, stage, b) for c in ("clean", "noise_dose_low", "blur", "scatter") for stage in (1, 2) for b in (8, 16)
    }
    assert winners[("clean", 1, 16)][3].endswith(": 46.50")  # 16 iterations + guidance 0.5 + 10 x 3 refine steps
    assert winners[("clean", 1, 16)][4].endswith(f": {1 / 17:.4f}")
    png = plot_budgets(summary, tmp_path / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"methods": ["residual"]}, "list 'direct' too"),
        ({"methods": ["gan"]}, "methods must be out of"),
        ({"budgets": [4, 6], "methods": ["direct", "residual"]}, "must be positive and even"),
        ({"stages": 3}, "stages must be 1 or 2"),
        ({"conditions": ["fog"]}, "conditions must be out of"),
    ],
)
def test_budget_comparison_refuses_bad_plans(tmp_path, kwargs, message):
    fake = FakeBundle()
    arguments = {"budgets": [4, 8], "methods": ["direct", "diffusion"], **kwargs}
    with pytest.raises(ValueError, match=message):
        xray_budgets(BundleRuns(fake.run, fake.command, {}), work=tmp_path, **arguments)
    assert fake.calls == []


def test_budget_comparison_runs_the_bundle_commands(tmp_path, in_process):  # noqa: F811
    from common.demo.images import make_xray2ct_demo

    data = tmp_path / "data"
    make_xray2ct_demo(data, n_train=4, n_val=2, shape=(16, 16, 16), seed=shifted_seed(0))
    summary = benchmark.xray_quality(
        device="cpu",
        budgets=[2, 4],
        stages=1,
        methods=["direct", "residual"],
        num_samples=2,
        guidance_scale=1.0,
        refine_steps=2,
        conditions=["noise_dose_low"],
        parallel=1,
        output=str(tmp_path / "q.json"),
        work_dir=str(tmp_path / "work"),
        seed=shifted_seed(0),
        dataset_dir=str(data),
        stage_sizes=[[8, 8, 8]],
        source_size=[16, 16, 16],
        view_size=[16, 16],
        num_grid_steps=1,
        stage_batch_size=[2, 2],
        **NETWORK,
    )
    noisy = [r for r in summary["results"] if r["condition"] == "noise_dose_low"]
    by_setting = {(r["method"], r["budget"], r["refine_steps"], r["noise_tolerance"]): r for r in noisy}
    assert ("direct_refined", 4, 2, 1.5) in by_setting and ("residual", 4, 2, 1.5) in by_setting
    assert {r["budget"] for r in noisy} == {None, 2, 4}  # the two largest budgets, and the baseline
    clean = by_setting[("direct", 4, 0, None)]["proj_error"]
    same = [r for r in summary["results"] if r["condition"] == "clean" and r["method"] == "direct" and r["budget"] == 4]
    assert clean != same[0]["proj_error"]  # the noisy X-rays were made and scored
    clean_rows = [r for r in summary["results"] if r["condition"] == "clean"]
    rows = {(r["method"], r["budget"], r["guidance_scale"], r["refine_steps"]): r for r in clean_rows}
    assert set(rows) == {
        ("backprojection", None, 0.0, 0),
        ("backprojection_refined", None, 1.0, 2),
        *((method, b, 0.0, 0) for method in ("direct", "residual") for b in (2, 4)),
        *(("direct_refined", b, 1.0, 2) for b in (2, 4)),
        *(("residual", b, 1.0, refine) for b in (2, 4) for refine in (0, 2)),
    }
    for key, row in rows.items():
        for name in ("psnr", "ssim", "proj_error", "hf_ratio", "spectral_distance"):
            assert row[name] is not None and row[name] == row[name], (key, name)
        assert (row["sample_psnr"] is not None) == (key[0] == "residual"), key
    assert rows[("direct_refined", 4, 1.0, 2)]["proj_error"] < rows[("direct", 4, 0.0, 0)]["proj_error"]
    sirt = rows[("backprojection_refined", None, 1.0, 2)]["proj_error"]
    assert sirt < rows[("backprojection", None, 0.0, 0)]["proj_error"]
    # the direct snapshot at 2 iterations is the regressor of the residual model at budget 4
    direct2 = load_checkpoint(tmp_path / "work" / "direct" / "b2" / "stage1" / "models" / "model.pt")
    residual4 = load_checkpoint(tmp_path / "work" / "residual" / "b4" / "stage1" / "models" / "model.pt")
    assert all(torch.equal(v, residual4[f"regressor.{k}"]) for k, v in direct2.items())
    # guidance lowers the projection error of the residual samples
    for b in (2, 4):
        assert rows[("residual", b, 1.0, 0)]["proj_error"] < rows[("residual", b, 0.0, 0)]["proj_error"]
    training = [cmd for cmd in in_process if cmd[4] == "training"]
    assert len(training) == 3 + 2 and all(cmd[cmd.index("--num_threads") + 1] == "1" for cmd in in_process)
    # the spread of the residual snapshot: scored on held-out phantoms, calibrated on the others
    result = benchmark.xray_uncertainty(
        str(tmp_path / "q.json"),
        str(tmp_path / "work"),
        methods=["residual"],
        ks=[2],
        n_cases=4,
        output=str(tmp_path / "u.json"),
    )
    assert result["cases"] == {"calibration": 2, "held_out": 2} and result["budget"] == 4
    (row,) = result["results"]
    for name in ("raw_coverage_1std", "raw_coverage_2std", "calibrated_coverage_1std", "calibrated_coverage_2std"):
        assert 0 <= row[name] <= 1, name
    assert row["raw_coverage_1std"] <= row["raw_coverage_2std"]
    assert -1 <= row["raw_std_error_spearman"] <= 1 and -1 <= row["raw_std_error_partial_spearman"] <= 1
    assert row["uncertainty_scale"] > 0 and row["uncertainty_floor"] >= 0
    calibrated = [cmd for cmd in in_process if "uncertainty_k2_calibrated" in " ".join(cmd)]
    assert calibrated and "--uncertainty_scale" in calibrated[0]
    held_out = json.loads((tmp_path / "work" / "datalist_held_out.json").read_text())["validation"]
    fitted = json.loads((tmp_path / "work" / "datalist_calibration.json").read_text())["validation"]
    assert not {c["image"] for c in held_out} & {c["image"] for c in fitted}
    # the consistency check: fitted on the calibration phantoms, never recorded into the snapshot
    checked = benchmark.xray_consistency(
        str(tmp_path / "q.json"),
        str(tmp_path / "work"),
        methods=["direct"],
        conditions=["miscalibrated"],
        refine_steps=2,
        mismatch_tolerances=[1.1],
        n_cases=4,
        output=str(tmp_path / "c.json"),
    )
    found = {(r["condition"], r["correction"]): r for r in checked["results"]}
    variants = ("none", "corrected", "residual only 1.1", "checked 1.1")
    assert set(found) == {(c, v) for c in ("clean", "miscalibrated") for v in variants}
    assert json.loads((tmp_path / "c.json").read_text()) == checked
    (reference,) = {json.dumps(r["consistency_reference"], sort_keys=True) for r in checked["results"]}
    reference = json.loads(reference)
    assert set(reference) == {"residual", "relation"} and all(len(b) == 2 and min(b) > 0 for b in reference.values())
    for condition in ("clean", "miscalibrated"):
        none, corrected, size_only, check = (found[(condition, v)] for v in variants)
        assert none["corrected_views"] == corrected["corrected_views"] == 1.0
        assert 0.0 <= check["corrected_views"] <= size_only["corrected_views"] <= 1.0  # a bound more: fewer pass
        for checked_run in (size_only, check):
            if checked_run["corrected_views"] == 1.0:  # every view passed: the corrections as without the check
                assert checked_run["psnr"] == pytest.approx(corrected["psnr"], abs=1e-4)
            if checked_run["corrected_views"] == 0.0:  # none passed: no correction at all
                assert checked_run["psnr"] == pytest.approx(none["psnr"], abs=1e-4)
    assert found[("miscalibrated", "none")]["psnr"] != found[("clean", "none")]["psnr"]
    fit = json.loads(
        (tmp_path / "work" / "direct" / "b4" / "stage1" / "consistency_fit" / "calibration.json").read_text()
    )
    assert fit["record"] is None and fit["consistency_reference"] == reference

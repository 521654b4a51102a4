# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""How much the samples' spread of ``xray2ct_cascade`` is worth as an uncertainty, and its calibration on held-out
cases (``scripts/benchmark.py xray_uncertainty``), on the stochastic snapshots of a budget comparison
(:mod:`scripts.harness.xray_budgets`).

New validation phantoms (the training ones are not touched) are split in two: a calibration half and a held-out
half. For each method and each number of samples ``K``, the held-out half is evaluated with the samples' own
spread (coverage of ``+-1`` and ``+-2`` standard deviations, Spearman's correlation of the spread with the error
and the partial correlation given the edge map: :func:`common.xray2ct.metrics.uncertainty_scores`); the calibration
half fits ``scale * (std + floor)`` (:class:`common.xray2ct.metrics.UncertaintyCalibration`, split conformal), and
the held-out half is evaluated again with it. Every evaluation is ``evaluate.json`` through the bundle's command
line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["UNCERTAINTY_HEADER", "uncertainty_rows", "xray_uncertainty"]

SCORES = ("coverage_1std", "coverage_2std", "std_error_spearman", "std_error_partial_spearman")


def _split_datalists(datalist: Path, work: Path, fraction: float) -> dict[str, Path]:
    """Datalists whose ``validation`` section is the calibration part or the held-out part of ``datalist``'s."""
    content = json.loads(datalist.read_text())
    cases = content["validation"]
    cut = max(1, min(len(cases) - 1, round(len(cases) * float(fraction))))
    base = datalist.parent
    absolute = [{k: str((base / v).resolve()) if k == "image" else v for k, v in c.items()} for c in cases]
    parts = {"calibration": absolute[:cut], "held_out": absolute[cut:]}
    out = {}
    for name, part in parts.items():
        path = work / f"datalist_{name}.json"
        path.write_text(json.dumps({"training": part, "validation": part}, indent=2))
        out[name] = path
    return out


def xray_uncertainty(
    run: Callable[[list[str]], float],
    command: Callable[[str, Sequence[str], dict], list[str]],
    settings: dict,
    work: Path,
    datalist: Path,
    methods: Sequence[str] = ("residual", "diffusion"),
    budget: int = 0,
    stage: int = 1,
    ks: Sequence[int] = (4, 8, 16),
    guidance_scale: float = 1.0,
    calibration_fraction: float = 0.5,
    output: str | None = None,
) -> dict:
    """Score and calibrate the spread of each method's snapshot at ``budget`` (see the module docstring).

    Args:
        run: runs one command, returns its seconds.
        command: ``(run_id, configs, overrides) -> argv`` of a bundle command.
        settings: the overrides of every command (the budget comparison's: sizes, network, seed, threads).
        work: the budget comparison's folder (``<work>/<method>/b<budget>`` holds the snapshots).
        datalist: the new validation phantoms' datalist (its ``validation`` section is split).
        methods: stochastic methods of the comparison.
        budget: the snapshots' budget.
        stage: evaluate the cascade up to this stage.
        ks: the numbers of samples per case.
        guidance_scale: the projection guidance of every evaluation.
        calibration_fraction: the share of the cases the calibration is fitted on.
        output: JSON file of the results (rewritten after every method and ``K``).

    Raises:
        ValueError: for a method that is not stochastic, a ``K`` below 2 or a missing snapshot.
    """
    bad = [m for m in methods if m not in ("residual", "diffusion", "min_snr")]
    if bad or not methods:
        raise ValueError(f"methods must be stochastic methods of the comparison (residual, diffusion), got {bad}.")
    if any(int(k) < 2 for k in ks) or not ks:
        raise ValueError(f"every K must be at least 2 (a spread needs several samples), got {list(ks)}.")
    parts = _split_datalists(Path(datalist), Path(work), calibration_fraction)
    summary: dict[str, Any] = {"budget": budget, "stage": stage, "guidance_scale": float(guidance_scale), "results": []}
    summary["cases"] = {name: len(json.loads(path.read_text())["validation"]) for name, path in parts.items()}
    for method in methods:
        out = Path(work) / method / f"b{budget}"
        if not (out / f"stage{stage}" / "models" / "model.pt").is_file():
            raise ValueError(f"no stage {stage} snapshot of {method} at budget {budget} under {out}.")
        mode = "diffusion" if method == "min_snr" else method
        for k in (int(k) for k in ks):

            def evaluate(part: str, name: str, **extra: Any) -> dict:
                eval_dir = out / f"stage{stage}" / f"uncertainty_k{k}_{name}"
                overrides = {
                    **settings,
                    "stage": stage,
                    "mode": mode,
                    "output_dir": str(out),
                    "eval_dir": str(eval_dir),
                    "datalist": str(parts[part]),
                    "num_samples": k,
                    "guidance_scale": float(guidance_scale),
                    **extra,
                }
                run(command("run", ["train.json", "evaluate.json"], overrides))
                return {"dir": eval_dir, "latest": json.loads((eval_dir / "metrics.json").read_text())["latest"]}

            fit = evaluate("calibration", "fit", calibrate_uncertainty=True)
            calibration = json.loads((fit["dir"] / "uncertainty_calibration.json").read_text())
            raw = evaluate("held_out", "raw")
            calibrated = evaluate(
                "held_out",
                "calibrated",
                uncertainty_scale=calibration["uncertainty_scale"],
                uncertainty_floor=calibration["uncertainty_floor"],
            )
            row = {
                "method": method,
                "num_samples": k,
                "psnr": raw["latest"].get("val_psnr"),
                **{f"raw_{s}": raw["latest"].get(f"val_{s}") for s in SCORES},
                **{f"calibrated_{s}": calibrated["latest"].get(f"val_{s}") for s in SCORES[:2]},
                "uncertainty_scale": calibration["uncertainty_scale"],
                "uncertainty_floor": calibration["uncertainty_floor"],
            }
            summary["results"].append(row)
            if output:
                Path(output).write_text(json.dumps(summary, indent=2))
    return summary


UNCERTAINTY_HEADER = [
    "method",
    "K",
    "PSNR (dB)",
    "+-1 std (own)",
    "+-2 std (own)",
    "Spearman(std, error)",
    "partial, given edges",
    "scale",
    "floor (HU)",
    "+-1 std (calibrated)",
    "+-2 std (calibrated)",
]


def uncertainty_rows(summary: dict, hu_width: float = 2000.0) -> list[list[str]]:
    """The Markdown rows of :func:`xray_uncertainty`'s results (coverages in percent of the held-out voxels)."""

    def pct(value: Any) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    return [
        [
            r["method"],
            r["num_samples"],
            "-" if r["psnr"] is None else f"{r['psnr']:.2f}",
            pct(r["raw_coverage_1std"]),
            pct(r["raw_coverage_2std"]),
            f"{r['raw_std_error_spearman']:.3f}",
            f"{r['raw_std_error_partial_spearman']:.3f}",
            f"{r['uncertainty_scale']:.2f}",
            f"{r['uncertainty_floor'] * hu_width:.1f}",
            pct(r["calibrated_coverage_1std"]),
            pct(r["calibrated_coverage_2std"]),
        ]
        for r in summary["results"]
    ]

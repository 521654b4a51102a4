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
the held-out half is evaluated again with it.

The consistency check of the projection corrections (``scripts/benchmark.py xray_consistency``): the calibration
half fits each method's ``consistency_reference`` on clean X-rays; the held-out half is evaluated on clean X-rays
and under each realistic condition (:data:`scripts.harness.xray_budgets.CONDITIONS`) three ways: without any
correction, with guidance and refinement, and with both under the consistency check. Every evaluation is
``evaluate.json`` through the bundle's command line; the calibrations are not recorded into the snapshots.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scripts.harness.tools import BundleRuns

__all__ = [
    "UNCERTAINTY_HEADER",
    "consistency_header",
    "consistency_rows",
    "uncertainty_rows",
    "xray_consistency",
    "xray_uncertainty",
]

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


def _snapshot(work: Path, method: str, budget: int, stage: int) -> Path:
    """The run folder of ``method``'s snapshot at ``budget`` in the comparison's folder ``work``.

    Raises:
        ValueError: when its stage ``stage`` has no weights.
    """
    out = Path(work) / method / f"b{budget}"
    if not (out / f"stage{stage}" / "models" / "model.pt").is_file():
        raise ValueError(f"no stage {stage} snapshot of {method} at budget {budget} under {out}.")
    return out


def _evaluation(
    runs: BundleRuns,
    out: Path,
    stage: int,
    parts: dict[str, Path],
    prefix: str,
    **fixed: Any,
) -> Callable[..., dict]:
    """``evaluate(part, name, **overrides)``: ``evaluate.json`` of the snapshot ``out`` at ``stage`` on the datalist
    ``parts[part]`` into ``<stage folder>/<prefix><name>``, run by ``runs`` with ``fixed`` and ``overrides``;
    returns its folder (``dir``) and latest metrics (``latest``)."""

    def evaluate(part: str, name: str, **extra: Any) -> dict:
        eval_dir = out / f"stage{stage}" / f"{prefix}{name}"
        overrides = {
            "stage": stage,
            "output_dir": str(out),
            "eval_dir": str(eval_dir),
            "datalist": str(parts[part]),
            **fixed,
            **extra,
        }
        runs("run", ["train.json", "evaluate.json"], overrides)
        return {"dir": eval_dir, "latest": json.loads((eval_dir / "metrics.json").read_text())["latest"]}

    return evaluate


def xray_uncertainty(
    runs: BundleRuns,
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
        runs: runs the bundle's commands, with the budget comparison's settings (sizes, network, seed, threads).
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
        out = _snapshot(work, method, budget, stage)
        mode = "diffusion" if method == "min_snr" else method
        for k in (int(k) for k in ks):
            evaluate = _evaluation(
                runs,
                out,
                stage,
                parts,
                f"uncertainty_k{k}_",
                mode=mode,
                num_samples=k,
                guidance_scale=float(guidance_scale),
            )
            fit = evaluate("calibration", "fit", calibrate=True, record_calibration=False)
            calibration = json.loads((fit["dir"] / "calibration.json").read_text())
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


def xray_consistency(
    runs: BundleRuns,
    work: Path,
    datalist: Path,
    conditions: dict[str, dict],
    methods: Sequence[str] = ("direct", "residual"),
    budget: int = 0,
    stage: int = 1,
    num_samples: int = 4,
    guidance_scale: float = 1.0,
    refine_steps: int = 5,
    mismatch_tolerances: Sequence[float] = (1.1,),
    calibration_fraction: float = 0.5,
    output: str | None = None,
) -> dict:
    """Each method's snapshot at ``budget`` on held-out X-rays, clean and under each condition, without correction
    (``correction`` ``none``), corrected (``corrected``), and corrected under the consistency check fitted on the
    calibration part with each tolerance: with both of its statistics (``checked <tolerance>``) and with the
    residual's bound alone (``residual only <tolerance>``, the check without the relation test; see the module
    docstring).

    Args:
        runs, work, datalist, budget, stage, calibration_fraction, output: as
            :func:`xray_uncertainty`.
        conditions: name -> the ``evaluate.json`` overrides that make its X-rays.
        methods: methods of the comparison (``direct``, ``residual``, ``diffusion``).
        num_samples: samples per case of the stochastic methods.
        guidance_scale, refine_steps: the corrections (guidance only for the stochastic methods).
        mismatch_tolerances: the consistency check's factors of the reference.

    Raises:
        ValueError: for an unknown method or a missing snapshot.
    """
    bad = [m for m in methods if m not in ("direct", "residual", "diffusion")]
    if bad or not methods:
        raise ValueError(f"methods must be out of direct, residual, diffusion, got {bad}.")
    parts = _split_datalists(Path(datalist), Path(work), calibration_fraction)
    summary: dict[str, Any] = {
        "budget": budget,
        "stage": stage,
        "num_samples": int(num_samples),
        "guidance_scale": float(guidance_scale),
        "refine_steps": int(refine_steps),
        "mismatch_tolerances": [float(t) for t in mismatch_tolerances],
        "conditions": conditions,
        "results": [],
    }
    summary["cases"] = {name: len(json.loads(path.read_text())["validation"]) for name, path in parts.items()}
    for method in methods:
        out = _snapshot(work, method, budget, stage)
        k = 1 if method == "direct" else int(num_samples)
        corrected = {"guidance_scale": float(guidance_scale), "refine_steps": int(refine_steps)}
        evaluate = _evaluation(runs, out, stage, parts, "consistency_", mode=method, num_samples=k)
        fit = evaluate("calibration", "fit", calibrate=True, record_calibration=False, **corrected)
        reference = json.loads((fit["dir"] / "calibration.json").read_text())["consistency_reference"]
        variants = {"none": {"guidance_scale": 0.0, "refine_steps": 0}, "corrected": corrected}
        for tolerance in summary["mismatch_tolerances"]:
            size_only = {"consistency_reference": {"residual": reference["residual"]}, "mismatch_tolerance": tolerance}
            variants[f"residual only {tolerance:g}"] = {**corrected, **size_only}
            check = {"consistency_reference": reference, "mismatch_tolerance": tolerance}
            variants[f"checked {tolerance:g}"] = {**corrected, **check}
        for condition, condition_overrides in {"clean": {}, **conditions}.items():
            for variant, extra in variants.items():
                name = f"{condition}_{variant.replace(' ', '_')}"
                latest = evaluate("held_out", name, **condition_overrides, **extra)["latest"]
                summary["results"].append(
                    {
                        "method": method,
                        "num_samples": k,
                        "condition": condition,
                        "correction": variant,
                        "consistency_reference": reference,
                        **{m: latest.get(f"val_{m}") for m in ("psnr", "ssim", "proj_error", "corrected_views")},
                    }
                )
                if output:
                    Path(output).write_text(json.dumps(summary, indent=2))
    return summary


def _checks(summary: dict) -> list[str]:
    """The checked variants of :func:`xray_consistency`, per tolerance the residual alone, then both statistics."""
    return [f"{v} {t:g}" for t in summary["mismatch_tolerances"] for v in ("residual only", "checked")]


def consistency_header(summary: dict) -> list[str]:
    """The columns of :func:`consistency_rows`."""
    checked = [f"{v}: PSNR (views corrected)" for v in _checks(summary)]
    return ["condition", "method", "none: PSNR (dB)", "corrected", *checked]


def consistency_rows(summary: dict) -> list[list[str]]:
    """The Markdown rows of :func:`xray_consistency`'s results: per condition and method, the PSNR without
    correction, corrected, and corrected under the check at each tolerance with the share of the views it let
    correct (the best PSNR of the row in bold)."""
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for r in summary["results"]:
        cells.setdefault((r["condition"], r["method"]), {})[r["correction"]] = r
    variants = ["none", "corrected", *_checks(summary)]
    rows = []
    for (condition, method), found in cells.items():
        psnrs = {v: found[v]["psnr"] for v in variants if v in found and found[v]["psnr"] is not None}
        best = max(psnrs.values()) if psnrs else None

        def cell(v: str) -> str:
            if v not in psnrs:
                return "-"
            text = f"**{psnrs[v]:.2f}**" if psnrs[v] == best else f"{psnrs[v]:.2f}"
            share = found[v].get("corrected_views")
            return text if v in ("none", "corrected") or share is None else f"{text} ({100 * share:.0f}%)"

        rows.append([condition, method, *(cell(v) for v in variants)])
    return rows

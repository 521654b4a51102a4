# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Quality of ``xray2ct_cascade`` over training budgets (``scripts/benchmark.py xray_quality --budgets ...``):
direct regression, diffusion and residual diffusion, stage 1 and the cascade at stage 2, every method with the
same data, network, batch and seed.

A budget ``b`` is the training iterations of stage 1; stage 2 gets ``b * stage2_ratio`` (today's recipe: 300 +
150). Every run goes through the bundle's command line (one subprocess per command, ``num_threads`` threads each,
``parallel`` commands at a time) with ``deterministic`` kernels:

* ``direct`` and ``diffusion`` train each stage once, up to the largest budget, in segments that resume the same
  run (``--resume True`` with a growing ``max_epochs``: the same iterations as one uninterrupted run); after each
  segment the EMA weights of ``last.pt`` become the snapshot of that budget (``<method>/b<b>/stage<k>``).
  Stage 2 starts from random weights (``init_from_previous`` false), so that its snapshots are those of one run;
  every method is treated alike.
* ``residual`` costs what it trains: at budget ``b`` its regressor is the direct snapshot at ``b / 2`` and its
  diffusion trains ``b / 2`` iterations over it, so the pair costs ``b`` iterations, as direct regression at ``b``.
  Each of its budgets is its own run (its regressor differs).
* ``min_snr`` (optional, stage 1 only): diffusion with Min-SNR-5 loss weighting, one run in segments as
  ``diffusion``.

Every snapshot is evaluated with ``evaluate.json`` (stage ``k`` runs the cascade ``1..k``; its stage-1 snapshot is
that of the same budget) on the validation cases: the stochastic methods with ``num_samples`` samples per case,
without and with projection guidance, reporting the mean of the samples and one sample; the untrained
back-projection is the floor. Every method also gets the same physics post-processing, ``refine_steps``
data-consistency (SIRT) steps of weight ``guidance_scale`` on its output (after guidance for the stochastic
methods): the rows ``direct_refined`` (the regressor refined) and ``backprojection_refined`` (SIRT from the
back-projection), and the stochastic methods' rows with ``refine`` > 0.

Realistic X-rays (``conditions``, :data:`CONDITIONS`): at the two largest budgets every method is evaluated again
on validation X-rays made under each condition - photon noise at two doses, detector blur, a miscalibrated flat
field, a pose error, cone-beam views - with the models trained on clean parallel-beam X-rays. Its guided and refined
evaluations run twice there: with every consistency step, and with the discrepancy principle (``noise_tolerance``:
a view within that many times its noise level is left alone). Results go to ``output`` (JSON, rewritten after every evaluation), a Markdown table
and a plot of PSNR and projection error against the budget.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from common.xray2ct.metrics import UNCERTAINTY_SCORES

__all__ = [
    "BUDGET_METHODS",
    "CONDITIONS",
    "CPU_BUDGET_SETTINGS",
    "WINNER_HEADER",
    "budget_rows",
    "plot_budgets",
    "winner_rows",
    "xray_budgets",
]

#: the methods of the comparison: the trained mode and its extra training settings
BUDGET_METHODS = {
    "direct": {"mode": "direct"},
    "diffusion": {"mode": "diffusion"},
    "residual": {"mode": "residual"},
    "min_snr": {"mode": "diffusion", "loss_weighting": "min_snr"},
}
#: the sizes of CPU budget runs: small, so that three budgets of four methods fit about 90 minutes on 2 cores
CPU_BUDGET_SETTINGS = {
    "stage_sizes": [[16, 16, 16], [32, 32, 32]],
    "source_size": [32, 32, 32],
    "view_size": [32, 32],
    "vit_patch_size": 8,
}
#: the realistic X-ray conditions of the evaluations: the overrides of ``evaluate.json`` each one sets. Photon counts
#: are per X-ray pixel of the unattenuated beam at the benchmark's view size; ``blur_px`` is the detector blur's sigma
#: in X-ray pixels (turned into ``blur_mm`` for the run's field of view and view size)
CONDITIONS: dict[str, dict[str, Any]] = {
    "noise_dose_high": {"xray_condition": {"photons": 1e5}},
    "noise_dose_low": {"xray_condition": {"photons": 1e4}},
    "blur": {"xray_condition": {"blur_px": 1.0}},
    "miscalibrated": {"xray_condition": {"gain": 1.05, "offset": 0.01}},
    "pose": {"xray_condition": {"rotation_deg": [1.5, 1.5, 1.5], "shift_mm": [1.5, 1.5, 1.5]}},
    "cone": {"geometry": "cone", "source_to_isocenter_mm": 1000.0, "source_to_detector_mm": 1500.0},
}
#: the discrepancy principle's tolerance in the conditions' guided and refined evaluations
NOISE_TOLERANCE = 1.5
#: the metrics kept per evaluation (``val_`` prefix dropped)
METRICS = ("psnr", "ssim", "ms_ssim", "proj_error", "hf_ratio", "spectral_distance", *UNCERTAINTY_SCORES)


class _Work:
    """A set of commands with dependencies, run ``parallel`` at a time (each a subprocess)."""

    def __init__(self, parallel: int) -> None:
        self.parallel = max(1, int(parallel))
        self.tasks: dict[str, tuple[Callable[[], None], list[str]]] = {}

    def add(self, name: str, fn: Callable[[], None], after: Sequence[str] = ()) -> None:
        self.tasks[name] = (fn, [a for a in after if a])

    def run(self) -> None:
        done: set[str] = set()
        running: dict[Any, str] = {}
        pending = dict(self.tasks)
        with ThreadPoolExecutor(self.parallel) as pool:
            while pending or running:
                ready = [n for n, (_, deps) in pending.items() if all(d in done for d in deps)]
                for name in ready[: self.parallel - len(running)]:
                    running[pool.submit(pending.pop(name)[0])] = name
                if not running:
                    raise RuntimeError(f"tasks wait on tasks that do not exist: {sorted(pending)}")
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in finished:
                    future.result()  # a failed command ends the benchmark with its output
                    done.add(running.pop(future))


def _snapshot(run_dir: Path, stage: int, target: Path, copy_previous: Path | None = None) -> int:
    """Make ``target/stage<k>`` a trained stage: the EMA weights of ``run_dir``'s ``last.pt`` as ``model.pt`` and
    its run record; returns the iteration of ``last.pt``."""
    from common.checkpoint_io import load_checkpoint, save_checkpoint

    source = run_dir / f"stage{stage}"
    last = load_checkpoint(source / "models" / "last.pt")
    folder = target / f"stage{stage}"
    (folder / "models").mkdir(parents=True, exist_ok=True)
    (folder / "configs").mkdir(parents=True, exist_ok=True)
    save_checkpoint({k: v for k, v in last["ema"].items() if k != "n_averaged"}, folder / "models" / "model.pt")
    record = source / "configs" / "run.json"  # absent when the command ran in-process (tests)
    if folder.resolve() != source.resolve() and record.is_file():
        shutil.copy(record, folder / "configs" / "run.json")
    return int(last["trainer"]["iteration"])


def _budget_dir(root: Path, method: str, budget: int) -> Path:
    return root / method / f"b{budget}"


def xray_budgets(
    run: Callable[[list[str]], float],
    command: Callable[[str, Sequence[str], dict], list[str]],
    settings: dict,
    budgets: Sequence[int],
    work: Path,
    methods: Sequence[str] = ("direct", "diffusion", "residual"),
    stages: int = 2,
    stage2_ratio: float = 0.5,
    num_samples: int = 4,
    guidance_scale: float = 1.0,
    refine_steps: int = 5,
    conditions: Sequence[str] = tuple(CONDITIONS),
    noise_tolerance: float = NOISE_TOLERANCE,
    parallel: int = 2,
    output: str | None = None,
) -> dict:
    """Train and evaluate every method at every budget (see the module docstring).

    Args:
        run: runs one command, returns its seconds.
        command: ``(run_id, configs, overrides) -> argv`` of a bundle command.
        settings: the overrides of every command (sizes, network, data, seed, threads).
        budgets: stage-1 iterations (stage 2: ``stage2_ratio`` of each); even, with ``residual``.
        work: folder of all runs.
        methods: out of :data:`BUDGET_METHODS`; ``residual`` needs ``direct``.
        stages: 1 or 2.
        stage2_ratio: stage-2 iterations per stage-1 iteration.
        num_samples: samples per case of the stochastic methods' evaluations.
        guidance_scale: the guided evaluations' projection-guidance weight, and the weight of each refinement step.
        refine_steps: the data-consistency steps of the refined evaluations (0: none).
        conditions: names out of :data:`CONDITIONS` to evaluate the two largest budgets under.
        noise_tolerance: the discrepancy principle's tolerance in the conditions' guided and refined evaluations.
        parallel: commands at a time.
        output: JSON file of the results.

    Raises:
        ValueError: for unknown methods, ``residual`` without ``direct``, or budgets that are not multiples.
    """
    budgets = sorted(int(b) for b in budgets)
    bad = [m for m in methods if m not in BUDGET_METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be out of {sorted(BUDGET_METHODS)}, got {list(methods)!r}.")
    if "residual" in methods and "direct" not in methods:
        raise ValueError("the residual method refines the direct regressor: list 'direct' too.")
    if stages not in (1, 2):
        raise ValueError(f"stages must be 1 or 2, got {stages!r}.")
    conditions = [conditions] if isinstance(conditions, str) else list(conditions)
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        raise ValueError(f"conditions must be out of {sorted(CONDITIONS)}, got {unknown}.")
    iters2 = {b: int(round(b * stage2_ratio)) for b in budgets}
    halves = "residual" in methods  # the residual method's regressors are direct snapshots at half the budgets
    odd = [b for b in budgets if b < 1 or (halves and b % 2)]
    odd += [i for i in iters2.values() if stages > 1 and (i < 1 or (halves and i % 2))]
    if odd:
        why = " and even (the residual method trains half of each over a regressor trained the other half)"
        raise ValueError(
            f"budgets and their stage-2 shares {iters2} must be positive{why if halves else ''}, got {budgets}."
        )
    points1 = sorted({*budgets, *(b // 2 for b in budgets if halves)})
    points2 = sorted({*iters2.values(), *(i // 2 for i in iters2.values() if halves)})
    unit1, unit2 = math.gcd(*points1), math.gcd(*points2)  # every snapshot at the end of an epoch
    lock = threading.Lock()
    summary: dict[str, Any] = {
        "budgets": budgets,
        "stage2_iterations": {str(b): i for b, i in iters2.items()} if stages > 1 else None,
        "methods": list(methods),
        "num_samples": int(num_samples),
        "guidance_scale": float(guidance_scale),
        "refine_steps": int(refine_steps),
        "conditions": {name: _condition(name, settings) for name in conditions},
        "noise_tolerance": float(noise_tolerance),
        "settings": settings,
        "train_seconds": {},
        "results": [],
    }

    def save() -> None:
        if output:
            with lock:
                Path(output).write_text(json.dumps(summary, indent=2))

    def train(
        method: str, stage: int, out: Path, iterations: int, extra: dict | None = None, resume: bool = False
    ) -> float:
        epoch = unit1 if stage == 1 else unit2
        overrides = {
            **settings,
            **BUDGET_METHODS[method],
            **(extra or {}),
            "stage": stage,
            "output_dir": str(out),
            "epoch_length": epoch,
            "max_epochs": iterations // epoch,
            "resume": resume,
            "val_interval": 10**6,
            "ckpt_interval": 10**6,
            "init_from_previous": False,
            "deterministic": True,
        }
        return run(command("training", ["train.json"], overrides))

    def segments(method: str, stage: int, points: Sequence[int]) -> Callable[[], None]:
        """One run of ``method`` at ``stage`` up to the largest of ``points``, a snapshot at each."""

        def task() -> None:
            out = work / method / f"train{stage}"
            if stage > 1:  # the stage-2 config needs stage-1 weights (unused: no validation, no initialisation)
                top = _budget_dir(work, method, budgets[-1])
                _copy_stage(top, out, 1)
            seconds = 0.0
            for i, point in enumerate(sorted(points)):
                seconds += train(method, stage, out, point, resume=i > 0)
                budget = point if stage == 1 else _stage1_budget(point)
                _snapshot(out, stage, _budget_dir(work, method, budget))
                with lock:
                    summary["train_seconds"][f"{method}/stage{stage}/{point}"] = seconds
            save()

        return task

    def _stage1_budget(stage2_iterations: int) -> int:
        return int(round(stage2_iterations / stage2_ratio))

    def residual(budget: int, stage: int) -> Callable[[], None]:
        def task() -> None:
            out = _budget_dir(work, "residual", budget)
            half = budget // 2
            iterations = half if stage == 1 else iters2[budget] // 2
            regressor = _budget_dir(work, "direct", half if stage == 1 else _stage1_budget(iters2[budget] // 2))
            seconds = train("residual", stage, out, iterations, {"regressor_dir": str(regressor)})
            with lock:
                summary["train_seconds"][f"residual/stage{stage}/{budget}"] = seconds
            _snapshot(out, stage, out)
            save()

        return task

    def evaluations(stochastic: bool, condition: str) -> list[dict[str, Any]]:
        """The sampler settings of a method's evaluations: plain, guided (stochastic methods), refined; under a
        realistic condition the guided and refined ones with the discrepancy principle too."""
        g, r = float(guidance_scale), int(refine_steps) if guidance_scale else 0
        chosen = [(0.0, 0), (g, 0)] if stochastic and g else [(0.0, 0)]
        chosen += [(g, r)] if r else []
        found = [{"guidance_scale": a, "refine_steps": b, "noise_tolerance": None} for a, b in dict.fromkeys(chosen)]
        if condition != "clean":
            found += [{**e, "noise_tolerance": float(noise_tolerance)} for e in found if e["guidance_scale"]]
        return found

    def evaluate(method: str, budget: int | None, stage: int, condition: str = "clean") -> Callable[[], None]:
        def task() -> None:
            mode = "backprojection" if method == "backprojection" else BUDGET_METHODS[method]["mode"]
            out = work / "backprojection" if budget is None else _budget_dir(work, method, budget)
            stochastic = mode in ("diffusion", "residual")
            for sampler in evaluations(stochastic, condition):
                k = num_samples if stochastic else 1
                guidance, refine, tolerance = (
                    sampler[n] for n in ("guidance_scale", "refine_steps", "noise_tolerance")
                )
                name = f"eval_k{k}_g{guidance:g}" + (f"_r{refine}" if refine else "")
                name += ("" if tolerance is None else f"_t{tolerance:g}") + (
                    "" if condition == "clean" else f"_{condition}"
                )
                eval_dir = out / f"stage{stage}" / name
                overrides = {
                    **settings,
                    **summary["conditions"].get(condition, {}),
                    "stage": stage,
                    "mode": mode,
                    "output_dir": str(out),
                    "eval_dir": str(eval_dir),
                    "num_samples": int(num_samples) if stochastic else 1,
                    **sampler,
                }
                seconds = run(command("run", ["train.json", "evaluate.json"], overrides))
                latest = json.loads((eval_dir / "metrics.json").read_text())["latest"]
                row = {
                    "method": f"{method}_refined" if refine and not stochastic else method,
                    "stage": stage,
                    "budget": budget,
                    "condition": condition,
                    "num_samples": overrides["num_samples"],
                    **sampler,
                    "eval_seconds": seconds,
                    **{m: latest.get(f"val_{m}") for m in METRICS},
                    **{f"sample_{m}": latest.get(f"val_sample_{m}") for m in METRICS},
                }
                with lock:
                    summary["results"].append(row)
                save()

        return task

    jobs = _Work(parallel)
    for method in methods:
        if method == "residual":
            continue
        only_stage1 = method == "min_snr"
        jobs.add(f"{method}/train1", segments(method, 1, points1 if method == "direct" else budgets))
        if stages > 1 and not only_stage1:
            points = points2 if method == "direct" else sorted(iters2.values())
            jobs.add(f"{method}/train2", segments(method, 2, points), after=[f"{method}/train1"])
    if "residual" in methods:
        for b in budgets:
            jobs.add(f"residual/train1/{b}", residual(b, 1), after=["direct/train1"])
            if stages > 1:
                jobs.add(f"residual/train2/{b}", residual(b, 2), after=["direct/train2", f"residual/train1/{b}"])
    for stage in range(1, stages + 1):
        for condition in ["clean", *conditions]:
            tag = "" if condition == "clean" else f"/{condition}"
            jobs.add(f"backprojection/eval{stage}{tag}", evaluate("backprojection", None, stage, condition))
            for method in methods:
                if method == "min_snr" and stage > 1:
                    continue
                for b in budgets if condition == "clean" else budgets[-2:]:
                    trained = f"residual/train{stage}/{b}" if method == "residual" else f"{method}/train{stage}"
                    jobs.add(f"{method}/eval{stage}/{b}{tag}", evaluate(method, b, stage, condition), after=[trained])
    start = time.perf_counter()
    jobs.run()
    summary["wall_seconds"] = time.perf_counter() - start
    save()
    return summary


def _condition(name: str, settings: dict) -> dict[str, Any]:
    """The ``evaluate.json`` overrides of the condition ``name`` (:data:`CONDITIONS`) for the run ``settings``: a
    blur in X-ray pixels becomes ``blur_mm`` at the run's field of view and view size."""
    overrides = json.loads(json.dumps(CONDITIONS[name]))
    condition = overrides.get("xray_condition")
    if condition and "blur_px" in condition:
        fov = settings.get("fov_mm", 350.0)
        fov = min(fov) if isinstance(fov, (list, tuple)) else float(fov)
        condition["blur_mm"] = condition.pop("blur_px") * fov / max(settings.get("view_size", [128, 128]))
    return overrides


def _copy_stage(source: Path, target: Path, stage: int) -> None:
    """``source``'s trained ``stage`` folder (weights and run record) copied into the run folder ``target``."""
    folder = target / f"stage{stage}"
    if folder.exists():
        return
    shutil.copytree(source / f"stage{stage}", folder, ignore=shutil.ignore_patterns("eval_*"))


def budget_rows(summary: dict) -> list[list[str]]:
    """The Markdown rows of a budget comparison: per method, evaluation setting, stage and budget."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    rows = []
    ordered = sorted(
        summary["results"],
        key=lambda r: (
            r["stage"],
            r.get("condition", "clean") != "clean",
            r.get("condition", "clean"),
            r["method"],
            r["num_samples"],
            r["guidance_scale"],
            r.get("refine_steps", 0),
            r.get("noise_tolerance") or 0,
            r["budget"] or 0,
        ),
    )
    stage2 = {int(k): v for k, v in (summary.get("stage2_iterations") or {}).items()}
    for r in ordered:
        budget = r["budget"]
        cost = "-" if budget is None else str(budget) if r["stage"] == 1 else f"{budget} + {stage2[budget]}"
        rows.append(
            [
                r.get("condition", "clean"),
                r["method"],
                r["stage"],
                cost,
                r["num_samples"],
                f"{r['guidance_scale']:g}",
                r.get("refine_steps", 0),
                fmt(r.get("noise_tolerance"), "g"),
                fmt(r["psnr"], ".2f"),
                fmt(r["ssim"], ".3f"),
                fmt(r["proj_error"], ".4f"),
                fmt(r["hf_ratio"], ".3f"),
                fmt(r["spectral_distance"], ".3f"),
                fmt(r.get("sample_psnr"), ".2f"),
                fmt(r.get("sample_proj_error"), ".4f"),
                fmt(r.get("sample_hf_ratio"), ".3f"),
                fmt(r["eval_seconds"], ".0f"),
            ]
        )
    return rows


BUDGET_HEADER = [
    "X-rays",
    "method",
    "stage",
    "iterations",
    "K",
    "guidance",
    "refine",
    "noise tol.",
    "PSNR (dB)",
    "SSIM",
    "proj. error",
    "HF ratio",
    "log-spectral dist.",
    "1-sample PSNR",
    "1-sample proj. error",
    "1-sample HF ratio",
    "eval (s)",
]


def _setting(r: dict) -> str:
    """A row's method and evaluation setting in a few characters: ``residual K4 g1 r5 t1.5``."""
    parts = [r["method"]]
    if r["num_samples"] > 1:
        parts.append(f"K{r['num_samples']}")
    if r["guidance_scale"] and not r["method"].endswith("_refined"):
        parts.append(f"g{r['guidance_scale']:g}")
    if r.get("refine_steps") and not r["method"].endswith("_refined"):
        parts.append(f"r{r['refine_steps']}")
    if r.get("noise_tolerance") is not None:
        parts.append(f"t{r['noise_tolerance']:g}")
    return " ".join(parts)


WINNER_HEADER = ["X-rays", "stage", "iterations", "best PSNR (dB)", "best projection error", "best 1-sample HF ratio"]


def winner_rows(summary: dict, budgets: Sequence[int] | None = None) -> list[list[str]]:
    """Per condition, stage and budget (default: the two largest), the method and setting with the best PSNR, the
    lowest projection error, and the single-sample high-frequency ratio nearest 1 (texture), with their values."""
    budgets = sorted(budgets or summary["budgets"])[-2:]
    cells: dict[tuple, list[dict]] = {}
    for r in summary["results"]:
        if r["budget"] in budgets:
            cells.setdefault((r.get("condition", "clean"), r["stage"], r["budget"]), []).append(r)
    rows = []
    for (condition, stage, budget), found in sorted(cells.items(), key=lambda c: (c[0][0] != "clean", *c[0])):
        psnr = max(found, key=lambda r: r["psnr"])
        proj = min(found, key=lambda r: r["proj_error"])
        texture = {id(r): r.get("sample_hf_ratio") or r.get("hf_ratio") for r in found}  # one sample's, if any
        scored = [r for r in found if texture[id(r)] is not None]
        hf = min(scored, key=lambda r: abs(texture[id(r)] - 1)) if scored else None
        rows.append(
            [
                condition,
                stage,
                budget,
                f"{_setting(psnr)}: {psnr['psnr']:.2f}",
                f"{_setting(proj)}: {proj['proj_error']:.4f}",
                "-" if hf is None else f"{_setting(hf)}: {texture[id(hf)]:.3f}",
            ]
        )
    return rows


def plot_budgets(summary: dict, path: str | Path) -> Path:
    """PSNR and projection error against the budget, per method and evaluation setting, one column per stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["stage"] for r in summary["results"]})
    fig, axes = plt.subplots(2, len(stages), figsize=(5.5 * len(stages), 7), squeeze=False)
    for col, stage in enumerate(stages):
        curves: dict[str, list[tuple[int, float, float]]] = {}
        floors = {}  # the untrained baselines, one level each
        for r in summary["results"]:
            if r["stage"] != stage or r.get("condition", "clean") != "clean":
                continue
            if r["budget"] is None:
                floors[r["method"]] = r
                continue
            label = r["method"]
            if r["num_samples"] > 1:
                label += f" K={r['num_samples']} g={r['guidance_scale']:g}"
                label += f" r={r['refine_steps']}" if r.get("refine_steps") else ""
            curves.setdefault(label, []).append((r["budget"], r["psnr"], r["proj_error"]))
            if r["num_samples"] > 1 and r["guidance_scale"] == 0:
                single = f"{r['method']} 1 sample"
                curves.setdefault(single, []).append((r["budget"], r["sample_psnr"], r["sample_proj_error"]))
        for label, points in sorted(curves.items()):
            points.sort()
            x = [p[0] for p in points]
            style = "--" if "1 sample" in label else "-"
            axes[0][col].plot(x, [p[1] for p in points], style, marker="o", label=label)
            axes[1][col].plot(x, [p[2] for p in points], style, marker="o", label=label)
        for (name, floor), colour in zip(sorted(floors.items()), ("grey", "black")):
            label = name.replace("backprojection", "back-projection").replace("_refined", " + SIRT")
            axes[0][col].axhline(floor["psnr"], color=colour, linestyle=":", label=label)
            axes[1][col].axhline(floor["proj_error"], color=colour, linestyle=":", label=label)
        for row, name in enumerate(("PSNR (dB)", "projection error")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("stage-1 training iterations" + (" (stage 2: half)" if stage > 1 else ""))
            ax.set_ylabel(name)
            ax.set_title(f"stage {stage}" + (" (cascade)" if stage > 1 else ""))
            ax.grid(True, alpha=0.3)
        axes[1][col].set_yscale("log")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

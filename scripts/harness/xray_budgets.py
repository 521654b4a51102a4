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
field, a pose error, beam hardening, scatter - with the models trained on clean X-rays. (Cone-beam views of a
parallel-trained model are no condition: evaluation refuses a geometry other than the trained one.) Its guided and refined
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
from scripts.harness.tools import NO_VALIDATION, BundleRuns

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
    "hardening": {"xray_condition": {"hardening": 0.3}},
    "scatter": {"xray_condition": {"scatter": 0.05}},
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
    runs: BundleRuns,
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
        runs: runs the bundle's commands (and holds the overrides of every command).
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
    conditions = [conditions] if isinstance(conditions, str) else list(conditions)
    _check_budget_arguments(budgets, methods, stages, conditions, stage2_ratio)
    comparison = _BudgetRun(
        runs,
        budgets,
        work,
        methods,
        stages,
        stage2_ratio,
        num_samples,
        guidance_scale,
        refine_steps,
        conditions,
        noise_tolerance,
        output,
    )
    start = time.perf_counter()
    comparison.plan(parallel).run()
    comparison.summary["wall_seconds"] = time.perf_counter() - start
    comparison.save()
    return comparison.summary


def _stage2_iterations(budgets: Sequence[int], stage2_ratio: float) -> dict[int, int]:
    """The stage-2 iterations of each budget."""
    return {b: int(round(b * stage2_ratio)) for b in budgets}


def _check_budget_arguments(
    budgets: Sequence[int], methods: Sequence[str], stages: int, conditions: Sequence[str], stage2_ratio: float
) -> None:
    """Refuse unknown methods or conditions, ``residual`` without ``direct``, a stage count other than 1 or 2 and
    budgets (or their stage-2 shares) that are not positive, or not even with ``residual``.

    Raises:
        ValueError: naming what is wrong.
    """
    bad = [m for m in methods if m not in BUDGET_METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be out of {sorted(BUDGET_METHODS)}, got {list(methods)!r}.")
    if "residual" in methods and "direct" not in methods:
        raise ValueError("the residual method refines the direct regressor: list 'direct' too.")
    if stages not in (1, 2):
        raise ValueError(f"stages must be 1 or 2, got {stages!r}.")
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        raise ValueError(f"conditions must be out of {sorted(CONDITIONS)}, got {unknown}.")
    iters2 = _stage2_iterations(budgets, stage2_ratio)
    halves = "residual" in methods  # the residual method's regressors are direct snapshots at half the budgets
    odd = [b for b in budgets if b < 1 or (halves and b % 2)]
    odd += [i for i in iters2.values() if stages > 1 and (i < 1 or (halves and i % 2))]
    if odd:
        why = " and even (the residual method trains half of each over a regressor trained the other half)"
        raise ValueError(
            f"budgets and their stage-2 shares {iters2} must be positive{why if halves else ''}, got {budgets}."
        )


def _eval_name(k: int, guidance: float, refine: int, tolerance: float | None, condition: str) -> str:
    """The folder name of one evaluation: samples, guidance, refinement, tolerance and condition."""
    name = f"eval_k{k}_g{guidance:g}" + (f"_r{refine}" if refine else "")
    name += "" if tolerance is None else f"_t{tolerance:g}"
    return name + ("" if condition == "clean" else f"_{condition}")


class _BudgetRun:
    """One budget comparison of :func:`xray_budgets`: its settings, its ``summary`` (rewritten to ``output`` as
    results come) and the tasks that train and evaluate each method (:meth:`plan`)."""

    def __init__(
        self,
        runs: BundleRuns,
        budgets: list[int],
        work: Path,
        methods: Sequence[str],
        stages: int,
        stage2_ratio: float,
        num_samples: int,
        guidance_scale: float,
        refine_steps: int,
        conditions: list[str],
        noise_tolerance: float,
        output: str | None,
    ) -> None:
        self.runs, self.work = runs, work
        self.budgets, self.methods, self.stages, self.stage2_ratio = budgets, list(methods), stages, stage2_ratio
        self.num_samples, self.guidance_scale, self.refine_steps = int(num_samples), guidance_scale, refine_steps
        self.conditions, self.noise_tolerance, self.output = conditions, noise_tolerance, output
        self.iters2 = _stage2_iterations(budgets, stage2_ratio)
        halves = "residual" in methods
        self.points1 = sorted({*budgets, *(b // 2 for b in budgets if halves)})
        self.points2 = sorted({*self.iters2.values(), *(i // 2 for i in self.iters2.values() if halves)})
        self.unit1, self.unit2 = math.gcd(*self.points1), math.gcd(*self.points2)  # snapshots at epoch ends
        self.lock = threading.Lock()
        self.summary: dict[str, Any] = {
            "budgets": budgets,
            "stage2_iterations": {str(b): i for b, i in self.iters2.items()} if stages > 1 else None,
            "methods": list(methods),
            "num_samples": int(num_samples),
            "guidance_scale": float(guidance_scale),
            "refine_steps": int(refine_steps),
            "conditions": {name: _condition(name, runs.settings) for name in conditions},
            "noise_tolerance": float(noise_tolerance),
            "settings": runs.settings,
            "train_seconds": {},
            "results": [],
        }

    def save(self) -> None:
        """Write the summary so far to ``output``."""
        if self.output:
            with self.lock:
                Path(self.output).write_text(json.dumps(self.summary, indent=2))

    def train(
        self, method: str, stage: int, out: Path, iterations: int, extra: dict | None = None, resume: bool = False
    ) -> float:
        """Train ``method`` at ``stage`` in ``out`` up to ``iterations``; the command's seconds."""
        epoch = self.unit1 if stage == 1 else self.unit2
        overrides = {
            **BUDGET_METHODS[method],
            **(extra or {}),
            "stage": stage,
            "output_dir": str(out),
            "epoch_length": epoch,
            "max_epochs": iterations // epoch,
            "resume": resume,
            **NO_VALIDATION,
            "init_from_previous": False,
            "deterministic": True,
        }
        return self.runs("training", ["train.json"], overrides)

    def stage1_budget(self, stage2_iterations: int) -> int:
        """The budget whose stage-2 share is ``stage2_iterations``."""
        return int(round(stage2_iterations / self.stage2_ratio))

    def segments(self, method: str, stage: int, points: Sequence[int]) -> Callable[[], None]:
        """One run of ``method`` at ``stage`` up to the largest of ``points``, a snapshot at each."""

        def task() -> None:
            out = self.work / method / f"train{stage}"
            if stage > 1:  # the stage-2 config needs stage-1 weights (unused: no validation, no initialisation)
                _copy_stage(_budget_dir(self.work, method, self.budgets[-1]), out, 1)
            seconds = 0.0
            for i, point in enumerate(sorted(points)):
                seconds += self.train(method, stage, out, point, resume=i > 0)
                budget = point if stage == 1 else self.stage1_budget(point)
                _snapshot(out, stage, _budget_dir(self.work, method, budget))
                with self.lock:
                    self.summary["train_seconds"][f"{method}/stage{stage}/{point}"] = seconds
            self.save()

        return task

    def residual(self, budget: int, stage: int) -> Callable[[], None]:
        """The residual method at ``budget``: half of it over the direct snapshot at the other half."""

        def task() -> None:
            out = _budget_dir(self.work, "residual", budget)
            half = budget // 2
            iterations = half if stage == 1 else self.iters2[budget] // 2
            regressor_budget = half if stage == 1 else self.stage1_budget(self.iters2[budget] // 2)
            regressor = _budget_dir(self.work, "direct", regressor_budget)
            seconds = self.train("residual", stage, out, iterations, {"regressor_dir": str(regressor)})
            with self.lock:
                self.summary["train_seconds"][f"residual/stage{stage}/{budget}"] = seconds
            _snapshot(out, stage, out)
            self.save()

        return task

    def evaluations(self, stochastic: bool, condition: str) -> list[dict[str, Any]]:
        """The sampler settings of a method's evaluations: plain, guided (stochastic methods), refined; under a
        realistic condition the guided and refined ones with the discrepancy principle too."""
        g, r = float(self.guidance_scale), int(self.refine_steps) if self.guidance_scale else 0
        chosen = [(0.0, 0), (g, 0)] if stochastic and g else [(0.0, 0)]
        chosen += [(g, r)] if r else []
        found = [{"guidance_scale": a, "refine_steps": b, "noise_tolerance": None} for a, b in dict.fromkeys(chosen)]
        if condition != "clean":
            found += [{**e, "noise_tolerance": float(self.noise_tolerance)} for e in found if e["guidance_scale"]]
        return found

    def evaluate(self, method: str, budget: int | None, stage: int, condition: str = "clean") -> Callable[[], None]:
        """Every evaluation of ``method``'s snapshot at ``budget`` (``None``: the untrained back-projection)."""

        def task() -> None:
            mode = "backprojection" if method == "backprojection" else BUDGET_METHODS[method]["mode"]
            out = self.work / "backprojection" if budget is None else _budget_dir(self.work, method, budget)
            stochastic = mode in ("diffusion", "residual")
            for sampler in self.evaluations(stochastic, condition):
                k = self.num_samples if stochastic else 1
                refine = sampler["refine_steps"]
                name = _eval_name(k, sampler["guidance_scale"], refine, sampler["noise_tolerance"], condition)
                eval_dir = out / f"stage{stage}" / name
                overrides = {
                    **self.summary["conditions"].get(condition, {}),
                    "stage": stage,
                    "mode": mode,
                    "output_dir": str(out),
                    "eval_dir": str(eval_dir),
                    "num_samples": k,
                    **sampler,
                }
                seconds = self.runs("run", ["train.json", "evaluate.json"], overrides)
                latest = json.loads((eval_dir / "metrics.json").read_text())["latest"]
                row = {
                    "method": f"{method}_refined" if refine and not stochastic else method,
                    "stage": stage,
                    "budget": budget,
                    "condition": condition,
                    "num_samples": k,
                    **sampler,
                    "eval_seconds": seconds,
                    **{m: latest.get(f"val_{m}") for m in METRICS},
                    **{f"sample_{m}": latest.get(f"val_sample_{m}") for m in METRICS},
                }
                with self.lock:
                    self.summary["results"].append(row)
                self.save()

        return task

    def plan(self, parallel: int) -> _Work:
        """The trainings and evaluations, each after what it needs, run ``parallel`` at a time."""
        jobs = _Work(parallel)
        for method in self.methods:
            if method == "residual":
                continue
            jobs.add(f"{method}/train1", self.segments(method, 1, self.points1 if method == "direct" else self.budgets))
            if self.stages > 1 and method != "min_snr":  # min_snr: stage 1 only
                points = self.points2 if method == "direct" else sorted(self.iters2.values())
                jobs.add(f"{method}/train2", self.segments(method, 2, points), after=[f"{method}/train1"])
        if "residual" in self.methods:
            for b in self.budgets:
                jobs.add(f"residual/train1/{b}", self.residual(b, 1), after=["direct/train1"])
                if self.stages > 1:
                    after = ["direct/train2", f"residual/train1/{b}"]
                    jobs.add(f"residual/train2/{b}", self.residual(b, 2), after=after)
        for stage in range(1, self.stages + 1):
            for condition in ["clean", *self.conditions]:
                tag = "" if condition == "clean" else f"/{condition}"
                jobs.add(f"backprojection/eval{stage}{tag}", self.evaluate("backprojection", None, stage, condition))
                for method in self.methods:
                    if method == "min_snr" and stage > 1:
                        continue
                    for b in self.budgets if condition == "clean" else self.budgets[-2:]:
                        trained = f"residual/train{stage}/{b}" if method == "residual" else f"{method}/train{stage}"
                        task = self.evaluate(method, b, stage, condition)
                        jobs.add(f"{method}/eval{stage}/{b}{tag}", task, after=[trained])
        return jobs


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

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Quickstart: train a bundle briefly on the embedded demo data, evaluate it and say where everything is.

    python scripts/demo.py                      # autoencoder_3d, GPU when there is one, else the CPU
    python scripts/demo.py --max_epochs 50      # shorter
    python scripts/demo.py --output_dir /tmp/ae # somewhere else
    python scripts/demo.py --bundle vqgan_3d    # the patchwise VQ-GAN (add --no_random_restart True to compare)
    python scripts/demo.py --bundle fast_ddpm_3d                    # Fast-DDPM: MNI T1 -> grey-matter map
    python scripts/demo.py --bundle fast_ddpm_3d --preset brats     # 4 -> 1 missing-modality synthesis (phantoms)
    python scripts/demo.py --bundle fast_ddpm_3d --diffusion_mode baseline   # the 1000-step DDPM, same network
    python scripts/demo.py --bundle mace_survival               # MACE survival on synthetic chest CT phantoms
    python scripts/demo.py --bundle xray2ct_cascade             # biplanar X-ray -> CT, stage 1 then stage 2
    python scripts/demo.py --bundle xray2ct_cascade --mode direct   # the same network as a regressor (baseline)

The demo data (the real MNI152 T1 template and its GM/WM maps from the nilearn wheel, split into disjoint
superior/inferior blocks for training/validation; for ``--preset brats``, brain tumour phantoms with four MRI
contrasts) is built on first use. Each stage is the bundle's own command
(``python -m monai.bundle run ...``), printed before it runs, so it can be copied and changed.
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def _args(overrides: dict) -> list[str]:
    """``--key value`` pairs that the bundle's command line (fire) reads back to exactly ``overrides`` (booleans
    inside lists stay booleans, ``None`` stays ``None``)."""
    from common.bundle_tools.launch import format_overrides

    return format_overrides(overrides)


def _run(cmd: list[str]) -> None:
    print("\n$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    result = subprocess.run(cmd, cwd=REPO_ROOT)
    if result.returncode != 0:
        sys.exit(f"demo stage failed with exit code {result.returncode}: {' '.join(cmd[:6])} ...")


def _survival_oracle(csv_path: Path) -> dict[str, float]:
    """Harrell's and Uno's C of the demo cohort's true log-hazard on its validation cases (the ceiling a model can
    reach), with the training cases' censoring weighting Uno's C as in the bundle's evaluation."""
    from common.survival.cohort import read_cohort_csv, split_cohort
    from common.survival.metrics import harrell_c, uno_c

    sections = split_cohort(read_cohort_csv(csv_path, covariates=("true_risk",), time_unit="days"))
    val, train = sections["validation"], sections["training"]
    risk = [e["covariates"][0] for e in val]
    time, event = [e["time"] for e in val], [e["event"] for e in val]
    train_time, train_event = [e["time"] for e in train], [e["event"] for e in train]
    return {
        "harrell_c": harrell_c(risk, time, event)["c"],
        "uno_c": uno_c(risk, time, event, train_time, train_event)["c"],
    }


def main(
    bundle: str = "autoencoder_3d",
    preset: str | None = None,
    output_dir: str | None = None,
    max_epochs: int | None = None,
    device: str = "auto",
    num_threads: int | None = None,
    stage_iterations: Sequence[int] | None = None,
    **extra: Any,
) -> dict:
    """Train ``bundle`` on its demo data, evaluate the best checkpoint, print locations and metrics.

    Args:
        bundle: bundle folder name under ``bundles/``.
        preset: a demo preset of the bundle (``brats`` for ``fast_ddpm_3d``: 4 -> 1 synthesis on phantoms).
        output_dir: where outputs go (default ``bundles/<bundle>/outputs/demo``, replaced on each run; an
            existing ``output_dir`` given here is resumed from its last checkpoint instead).
        max_epochs: override the brief-run epoch count.
        device: ``auto`` (GPU when available), ``cpu`` or ``cuda``.
        num_threads: CPU threads (default: all cores).
        stage_iterations: the iterations of each stage of a bundle trained stage by stage (default: its
            description's for the device).
        extra: any other bundle override, e.g. ``--no_random_restart True`` for vqgan_3d.

    Returns:
        The evaluation metrics.
    """
    import torch

    from common.bundle_tools.registry import describe
    from common.errors import UserError
    from common.runs import run_settings

    try:
        described = describe(bundle)
        use_gpu = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
        profile = "gpu" if use_gpu else "cpu"
        extra_configs, overrides = described.demo_run(profile, preset)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    bundle = described.name
    if problem := _stage_iterations_problem(described, profile, stage_iterations):
        raise SystemExit(f"error: {problem}")
    if max_epochs is not None:
        overrides["max_epochs"] = int(max_epochs)
    overrides.update(extra)
    name = "demo" if preset is None else f"demo_{preset}"
    out = Path(output_dir or described.folder / "outputs" / name).resolve()
    if output_dir is None and out.exists():
        # the demo's own folder: start afresh (an explicit --output_dir resumes instead, like the bundle does)
        print(f"removing the previous demo run in {out}")
        shutil.rmtree(out)
    staged = described.staged
    overrides["output_dir"] = str(out)
    if device != "auto":
        overrides["device"] = device
    if num_threads or not use_gpu:
        overrides["num_threads"] = int(num_threads or os.cpu_count() or 1)

    configs = described.folder / "configs"
    base = [sys.executable, "-m", "monai.bundle", "run"]
    start = time.time()
    train_files = [str(configs / "train.json"), *(str(configs / c) for c in extra_configs)]
    config_arg = train_files[0] if len(train_files) == 1 else json.dumps(train_files)
    # evaluation reads the network and data settings from the run's configs/run.json: only where and how to run
    evaluation = {k: overrides[k] for k in ("output_dir", "device", "num_threads") if k in overrides}
    run_dir, eval_dir = out, out / "eval"
    if staged:
        iterations = described.stage_iterations[profile] if stage_iterations is None else stage_iterations
        for stage, n in enumerate(iterations, start=1):
            stage_args = {**overrides, "stage": stage, "max_epochs": 1, "epoch_length": int(n)}
            _run(base + ["training", "--config_file", config_arg, *_args(stage_args)])
        evaluation["stage"] = len(iterations)
        run_dir = out / f"stage{len(iterations)}"
        eval_dir = run_dir / f"eval_{run_settings(run_dir, described.folder, argv=[])['mode']}"  # the mode it trained
    else:
        _run(base + ["training", "--config_file", config_arg, *_args(overrides)])
    trained = time.time() - start
    _run(
        base + ["run", "--config_file", json.dumps([*train_files, str(configs / "evaluate.json")]), *_args(evaluation)]
    )
    metrics = json.loads((eval_dir / "metrics.json").read_text())["latest"]
    print(f"\n{bundle}: trained in {trained / 60:.1f} min on {'GPU' if use_gpu else 'CPU'}")
    _print_report(described, metrics, out, run_dir, eval_dir)
    return metrics


def _stage_iterations_problem(described, profile: str, stage_iterations: Sequence[int] | None) -> str | None:
    """What is wrong with ``--stage_iterations`` for the bundle (one positive integer per stage of a bundle trained
    stage by stage), or None."""
    if stage_iterations is None:
        return None
    if not described.staged:
        return f"{described.name} is not trained stage by stage: 'stage_iterations' does not apply."
    stages = len(described.stage_iterations.get(profile, ()))
    if not (
        isinstance(stage_iterations, (list, tuple))
        and len(stage_iterations) == stages
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in stage_iterations)
    ):
        return (
            f"'stage_iterations' must be {stages} positive integers (one per stage of {described.name}), got "
            f"{stage_iterations!r}."
        )
    return None


def _print_report(described, metrics: dict, out: Path, run_dir: Path, eval_dir: Path) -> None:
    """Print the demo's figures (validation during training, the best checkpoint's evaluation, the survival
    oracle) and where everything is, ending with the inference command as it is typed."""
    training = json.loads((run_dir / "metrics.json").read_text())
    keys = list(described.reported_metrics)
    if "val_codebook_usage" in metrics:
        keys.append("val_codebook_usage")
    print(f"  validation during training (step: {' / '.join(keys)}):")
    for h in training["history"]:
        print(f"    {h['step']:>6}: " + " / ".join(f"{h[k]:.4g}" for k in keys if k in h))
    print("  best checkpoint, evaluation: " + ", ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics))
    if described.family == "survival":
        oracle = _survival_oracle(described.folder / "demo_data" / "cohort.csv")
        metrics.update({f"oracle_{k}": v for k, v in oracle.items()})
        print(
            f"  oracle (the true hazard of the synthetic cohort, same validation cases): Harrell's C "
            f"{oracle['harrell_c']:.4f}, Uno's C {oracle['uno_c']:.4f}"
        )
        print(f"  report:         {out / 'eval' / 'report.json'} (plots: km_by_risk_group.png, calibration.png)")
    print(f"  outputs:        {out}")
    print(f"  best model:     {run_dir / 'models' / 'model.pt'}  (resumable state: {run_dir / 'models' / 'last.pt'})")
    per_case = "predictions.csv" if described.family == "survival" else "metrics_per_volume.csv"
    print(f"  metrics:        {run_dir / 'metrics.json'}, {run_dir / 'metrics.csv'}, {eval_dir / per_case}")
    if described.staged:
        print(f"  predictions:    {eval_dir / 'predictions'} (input vs predicted X-rays as PNG per case)")
    print(f"  TensorBoard:    tensorboard --logdir {run_dir / 'tensorboard'}")
    print(f"  training log:   {run_dir / 'train.log'}")
    inference = os.path.relpath(described.folder / "configs" / "inference.json", REPO_ROOT)
    infer = [sys.executable, "-m", "monai.bundle", "run", "--config_file", inference, "--output_dir", str(out)]
    print("  inference (the run's settings come from its configs/run.json; add --dataset_dir <folder of volumes>):")
    print("    " + " ".join(shlex.quote(c if c != sys.executable else "python") for c in infer))


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    if {"-h", "--help"} & set(sys.argv[1:]):  # main takes any --key as a bundle override: answer help here
        print(f"{__doc__}\nOptions (any other --key value is a bundle override):\n{inspect.getdoc(main)}")
        raise SystemExit(0)
    import fire

    fire.Fire(main, serialize=lambda _: None)

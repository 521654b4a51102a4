# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Quickstart: train a bundle briefly on the embedded demo data, evaluate it and say where everything is.

    python scripts/demo.py                      # autoencoder_3d, GPU when there is one, else the CPU
    python scripts/demo.py --max_epochs 50      # shorter
    python scripts/demo.py --output_dir /tmp/ae # somewhere else
    python scripts/demo.py --bundle vqgan_3d    # the patchwise VQ-GAN (add --no_random_restart True to compare)

The demo data (the real MNI152 T1 template and its GM/WM maps from the nilearn wheel, split into disjoint
superior/inferior blocks for training/validation) is built on first use. Each stage is the bundle's own command
(``python -m monai.bundle run ...``), printed before it runs, so it can be copied and changed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

# Brief-run settings per device: the CPU profile finishes in a few minutes on 2 cores; the GPU one uses the
# bundle's full-size network and patches.
PROFILES = {
    "autoencoder_3d": {
        "cpu": {
            "patch_size": [32, 32, 32],
            "channels": [16, 32, 32],
            "norm_num_groups": 8,
            "d_channels": 16,
            "num_samples": 2,
            "max_epochs": 200,
            "val_interval": 25,
            "adv_warmup_iterations": 100,
            "lr": 5e-4,
            "d_lr": 5e-4,
            "lr_warmup_iterations": 20,
            "log_interval": 50,
        },
        "gpu": {
            "patch_size": [64, 64, 64],
            "num_samples": 2,
            "max_epochs": 200,
            "val_interval": 25,
            "adv_warmup_iterations": 100,
            "lr": 2e-4,
            "d_lr": 2e-4,
            "lr_warmup_iterations": 20,
            "log_interval": 50,
        },
    },
    "vqgan_3d": {
        "cpu": {
            "patch_size": [32, 32, 32],
            "n_hiddens": 16,
            "n_codes": 1024,
            "embedding_dim": 8,
            "disc_channels": 16,
            "disc_layers": 2,
            "batch_size": 2,
            "patches_per_volume": 4,
            "micro_batch_size": 4,
            "max_epochs": 150,
            "val_interval": 25,
            "discriminator_iter_start": 150,
            "lr": 3e-4,
            "d_lr": 3e-4,
            "log_interval": 50,
        },
        "gpu": {
            "patch_size": [64, 64, 64],
            "batch_size": 2,
            "patches_per_volume": 4,
            "micro_batch_size": 4,
            "n_codes": 2048,
            "max_epochs": 200,
            "val_interval": 25,
            "discriminator_iter_start": 200,
            "log_interval": 50,
        },
    },
}

# Overrides that evaluation must repeat: everything that shapes the network or the evaluation itself.
EVAL_KEYS = (
    "output_dir",
    "patch_size",
    "channels",
    "norm_num_groups",
    "d_channels",
    "n_hiddens",
    "n_codes",
    "embedding_dim",
    "downsample",
    "no_random_restart",
    "device",
    "num_threads",
)


def _args(overrides: dict) -> list[str]:
    args = []
    for key, value in overrides.items():
        args += [
            f"--{key}",
            str(value) if isinstance(value, bool) else (value if isinstance(value, str) else json.dumps(value)),
        ]
    return args


def _run(cmd: list[str], env: dict[str, str]) -> None:
    print("\n$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env)
    if result.returncode != 0:
        sys.exit(f"demo stage failed with exit code {result.returncode}: {' '.join(cmd[:6])} ...")


def main(
    bundle: str = "autoencoder_3d",
    output_dir: str | None = None,
    max_epochs: int | None = None,
    device: str = "auto",
    num_threads: int | None = None,
    **extra: Any,
) -> dict:
    """Train ``bundle`` on its demo data, evaluate the best checkpoint, print locations and metrics.

    Args:
        bundle: bundle folder name under ``bundles/``.
        output_dir: where outputs go (default ``bundles/<bundle>/outputs/demo``, replaced on each run; an
            existing ``output_dir`` given here is resumed from its last checkpoint instead).
        max_epochs: override the brief-run epoch count.
        device: ``auto`` (GPU when available), ``cpu`` or ``cuda``.
        num_threads: CPU threads (default: all cores).
        extra: any other bundle override, e.g. ``--no_random_restart True`` for vqgan_3d.

    Returns:
        The evaluation metrics.
    """
    import torch

    if bundle not in PROFILES:
        raise SystemExit(f"no demo profile for bundle {bundle!r}; available: {sorted(PROFILES)}")
    use_gpu = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    overrides = dict(PROFILES[bundle]["gpu" if use_gpu else "cpu"])
    if max_epochs is not None:
        overrides["max_epochs"] = int(max_epochs)
    overrides.update(extra)
    out = Path(output_dir or REPO_ROOT / "bundles" / bundle / "outputs" / "demo").resolve()
    if output_dir is None and out.exists():
        # the demo's own folder: start afresh (an explicit --output_dir resumes instead, like the bundle does)
        print(f"removing the previous demo run in {out}")
        shutil.rmtree(out)
    overrides["output_dir"] = str(out)
    if device != "auto":
        overrides["device"] = device
    if num_threads or not use_gpu:
        overrides["num_threads"] = int(num_threads or os.cpu_count() or 1)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    configs = REPO_ROOT / "bundles" / bundle / "configs"
    base = [sys.executable, "-m", "monai.bundle", "run"]
    start = time.time()
    _run(base + ["training", "--config_file", str(configs / "train.json"), *_args(overrides)], env)
    trained = time.time() - start
    evaluation = {k: v for k, v in overrides.items() if k in EVAL_KEYS}
    _run(
        base
        + [
            "run",
            "--config_file",
            json.dumps([str(configs / "train.json"), str(configs / "evaluate.json")]),
            *_args(evaluation),
        ],
        env,
    )
    metrics = json.loads((out / "eval" / "metrics.json").read_text())["latest"]
    training = json.loads((out / "metrics.json").read_text())
    print(f"\n{bundle}: trained in {trained / 60:.1f} min on {'GPU' if use_gpu else 'CPU'}")
    print("  validation during training (step: PSNR dB / SSIM / MS-SSIM):")
    codebook = "val_codebook_usage" in metrics
    for h in training["history"]:
        usage = f" / usage {h['val_codebook_usage']:.3f}" if codebook else ""
        print(f"    {h['step']:>6}: {h['val_psnr']:.2f} / {h['val_ssim']:.4f} / {h['val_ms_ssim']:.4f}{usage}")
    usage = (
        f", codebook usage {metrics['val_codebook_usage']:.3f} (perplexity {metrics['val_perplexity']:.1f})"
        if codebook
        else ""
    )
    print(
        f"  best checkpoint, whole validation volumes: PSNR {metrics['val_psnr']:.2f} dB, SSIM {metrics['val_ssim']:.4f},"
        f" MS-SSIM {metrics['val_ms_ssim']:.4f}{usage}"
    )
    print(f"  outputs:        {out}")
    print(f"  best model:     {out / 'models' / 'model.pt'}  (resumable state: {out / 'models' / 'last.pt'})")
    print(f"  metrics:        {out / 'metrics.json'}, {out / 'metrics.csv'}, {out / 'eval' / 'metrics_per_volume.csv'}")
    print(f"  TensorBoard:    tensorboard --logdir {out / 'tensorboard'}")
    print(f"  training log:   {out / 'train.log'}")
    return metrics


if __name__ == "__main__":
    import fire

    fire.Fire(main, serialize=lambda _: None)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""A short training run of ``autoencoder_3d`` on the real MNI152 demo data: the loss falls and PSNR rises."""

from __future__ import annotations

import csv
import json

from tests.helpers import overrides, run_bundle


def test_mni_training_improves(tmp_path):
    from common.data.demo import make_demo_dataset

    datalist = make_demo_dataset(tmp_path / "demo")
    out = tmp_path / "run"
    args = overrides(
        dataset_dir=str(datalist.parent),
        output_dir=str(out),
        patch_size=[16, 16, 16],
        channels=[8, 16, 16],
        norm_num_groups=4,
        d_channels=8,
        d_num_layers=2,
        batch_size=2,
        num_samples=4,
        max_epochs=30,
        val_interval=30,
        adv_warmup_iterations=40,
        lr=2e-3,
        d_lr=2e-3,
        lr_warmup_iterations=5,
        log_interval=10,
        num_threads=1,
    ) + ["--train#handlers#3#exec_at_start", "True"]
    run_bundle("autoencoder_3d", ["train.json"], args=args)

    history = json.loads((out / "metrics.json").read_text())["history"]
    assert [h["step"] for h in history] == [0, 60]
    assert history[-1]["val_psnr"] > history[0]["val_psnr"] + 3.0  # dB, whole validation volumes
    assert history[-1]["val_ssim"] > history[0]["val_ssim"]

    with open(out / "metrics.csv") as f:
        recon = [float(r["value"]) for r in csv.DictReader(f) if r["tag"] == "train/recon_loss"]
    assert len(recon) == 6
    assert recon[-1] < 0.6 * recon[0]

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""A short training run of ``autoencoder_3d`` on the real MNI152 demo data (60 iterations, validation before and
after): it consumes the demo volumes, records finite losses and metrics in their ranges, keeps the best model by
the saver's rule, and the evaluation of ``model.pt`` reproduces the best validation."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from tests.helpers import overrides, run_bundle

BUNDLE = "autoencoder_3d"
TRAIN_VOLUMES = ["mni_gm_train", "mni_synth_train", "mni_t1_train", "mni_wm_train"]
VAL_VOLUMES = ["mni_synth_val", "mni_t1_val"]
METRICS = ("val_psnr", "val_ssim", "val_ms_ssim")


def _stem(path: str) -> str:
    return Path(path).name.removesuffix(".nii.gz")


def test_mni_training_run_keeps_the_best_validated_model(tmp_path):
    from common.demo.images import make_demo_dataset

    datalist = make_demo_dataset(tmp_path / "demo")
    listed = json.loads(datalist.read_text())
    assert sorted(_stem(e["image"]) for e in listed["training"]) == TRAIN_VOLUMES
    assert sorted(_stem(e["image"]) for e in listed["validation"]) == VAL_VOLUMES
    for entry in listed["training"] + listed["validation"]:
        image = nib.load(datalist.parent / entry["image"])
        assert len(image.shape) == 3 and min(image.shape) >= 32  # 2 mm MNI blocks, each axis >= 32 voxels
        np.testing.assert_allclose(np.abs(np.diag(image.affine)[:3]), 2.0, atol=1e-5)
        data = np.asarray(image.dataobj)
        assert np.isfinite(data).all() and data.max() > data.min()

    out = tmp_path / "run"
    tiny = dict(patch_size=[16, 16, 16], channels=[8, 16, 16], norm_num_groups=4, num_threads=1)
    args = overrides(
        dataset_dir=str(datalist.parent),
        output_dir=str(out),
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
        **tiny,
    ) + ["--train#handlers#3#exec_at_start", "True"]
    run_bundle(BUNDLE, ["train.json"], args=args)

    # 4 training volumes in batches of 2: 2 iterations per epoch, 60 in all
    last = torch.load(out / "models" / "last.pt", weights_only=True)
    assert last["trainer"]["iteration"] == 60 and last["trainer"]["epoch"] == 30

    # validation before training (step 0) and at the end; finite metrics in their ranges
    summary = json.loads((out / "metrics.json").read_text())
    history = summary["history"]
    assert [h["step"] for h in history] == [0, 60]
    for h in history:
        assert math.isfinite(h["val_psnr"]) and -1 <= h["val_ssim"] <= 1 and 0 <= h["val_ms_ssim"] <= 1
    # the best is the first maximum of the recorded PSNRs (a later tie does not replace it)
    psnrs = [h["val_psnr"] for h in history]
    best = history[psnrs.index(max(psnrs))]
    assert summary["best"] == best

    # the ranked checkpoints name the exact recorded values, and model.pt holds the weights of the best step
    models = out / "models"
    ranked = {int(p.stem.split("_step=")[1]): p for p in models.glob("model_val_psnr=*_step=*.pt")}
    assert sorted(ranked) == [0, 60]  # best_k = 3 keeps both validations
    for h in history:
        assert float(ranked[h["step"]].stem.split("=")[1].split("_step")[0]) == h["val_psnr"]
    model = torch.load(models / "model.pt", weights_only=True)
    best_weights = torch.load(ranked[best["step"]], weights_only=True)
    assert model.keys() == best_weights.keys()
    assert all(torch.equal(model[k], best_weights[k]) for k in model)

    # training losses are logged every 10 iterations and finite; the adversarial terms start after iteration 40
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    recon = [(int(r["step"]), float(r["value"])) for r in rows if r["tag"] == "train/recon_loss"]
    assert [step for step, _ in recon] == [10, 20, 30, 40, 50, 60]
    assert all(math.isfinite(value) and value >= 0 for _, value in recon)
    losses = [float(r["value"]) for r in rows if r["tag"] in ("train/loss", "train/kl_loss", "train/adv_loss")]
    assert losses and all(math.isfinite(value) for value in losses)
    assert {int(r["step"]) for r in rows if r["tag"] == "train/adv_loss"} == {50, 60}

    # evaluating model.pt on the two MNI validation blocks reproduces the best validation
    evaluate = overrides(dataset_dir=str(datalist.parent), output_dir=str(out), **tiny)
    run_bundle(BUNDLE, ["train.json", "evaluate.json"], run_id="run", args=evaluate)
    evaluation = json.loads((out / "eval" / "metrics.json").read_text())["latest"]
    for key in METRICS:
        assert evaluation[key] == pytest.approx(best[key], rel=1e-5), key
    with open(out / "eval" / "metrics_per_volume.csv") as f:
        per_volume = list(csv.DictReader(f))
    assert sorted(_stem(r["filename"]) for r in per_volume) == VAL_VOLUMES
    assert np.mean([float(r["val_psnr"]) for r in per_volume]) == pytest.approx(evaluation["val_psnr"], rel=1e-5)

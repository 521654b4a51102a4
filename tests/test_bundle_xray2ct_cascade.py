# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Workflow tests of ``bundles/xray2ct_cascade``, run as users run it, on chest CT phantoms: stage 1 -> stage 2
(initialised from and validated on stage 1) -> evaluate -> the back-projection baseline (its metrics recomputed) ->
pack the cascade -> inference from NIfTI and PNG radiographs; checks of data and the stage order before anything is
written; a 2-process torchrun job; the transform lists of the JSON against ``xray2ct_transforms`` and the validation
dataset against ``preprocessing``. What every bundle does: ``tests/test_bundle_contract.py``; resume after crashes:
``tests/test_reliability.py``."""

from __future__ import annotations

import csv
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from scripts.harness.xray2ct import CHEST_FOV_MM as FOV
from tests.bundle_cases import CASES
from tests.helpers import (
    BUNDLES,
    REPO_ROOT,
    bundle_env,
    bundle_parser,
    config_arg,
    overrides,
    rank_probe,
    run_bundle,
    same_seeded_outputs,
    same_tensor,
    seed_args,
)

BUNDLE = "xray2ct_cascade"
TASK = ["train.json", "tiny.json"]
RESUMABLE = {"deterministic": True, "ckpt_interval": 1}  # a checkpoint every iteration, deterministic kernels


@pytest.fixture(scope="module")
def phantoms(tmp_path_factory) -> Path:
    """The bundle's small data (4 training and 2 validation chest CT phantoms at 24^3, :mod:`tests.bundle_cases`)."""
    return Path(CASES[BUNDLE].write_data(tmp_path_factory.mktemp("chest"))["dataset_dir"])


@pytest.fixture(scope="module")
def cascade(phantoms, tmp_path_factory) -> Path:
    """``outputs`` of a trained tiny cascade: stage 1 (8^3) then stage 2 (16^3)."""
    out = tmp_path_factory.mktemp("cascade")
    for stage in (1, 2):
        args = overrides(dataset_dir=str(phantoms), output_dir=str(out), stage=stage, **RESUMABLE)
        run_bundle(BUNDLE, TASK, args=args)
    return out


def test_stages_train_in_order(cascade):
    for stage, channels in ((1, 3), (2, 4)):  # noisy CT + 2 back-projected views (+ the previous stage)
        models = cascade / f"stage{stage}" / "models"
        last = torch.load(models / "last.pt", weights_only=True)
        assert last["trainer"]["iteration"] == 4  # 4 cases x 2 epochs, batch 2
        best = torch.load(models / "model.pt", weights_only=True)
        ema = {k: v for k, v in last["ema"].items() if k != "n_averaged"}
        assert set(best) == set(ema) == set(last["network"])
        assert best["unet.conv_in.conv.weight"].shape[1] == channels
        summary = json.loads((cascade / f"stage{stage}" / "metrics.json").read_text())
        assert [h["step"] for h in summary["history"]] == [2, 4]
        for h in summary["history"]:
            assert np.isfinite(h["val_psnr"]) and -1 <= h["val_ssim"] <= 1 and h["val_proj_error"] > 0
        csv = (cascade / f"stage{stage}" / "metrics.csv").read_text()
        assert "physics_loss" in csv and "recon_loss" in csv and "val_proj_error" in csv
    log = (cascade / "stage2" / "train.log").read_text()
    assert "initialised from the previous stage: " in log and "1 partially" in log


@pytest.fixture(scope="module")
def evaluated(cascade, phantoms) -> Path:
    """``eval_diffusion`` of the cascade's stage 2: ``evaluate.json`` with the CT volumes written."""
    run_bundle(
        BUNDLE,
        [*TASK, "evaluate.json"],
        run_id="run",
        args=overrides(dataset_dir=str(phantoms), output_dir=str(cascade), stage=2, save_volumes=True),
    )
    return cascade / "stage2" / "eval_diffusion"


def test_evaluate_reproduces_validation_and_writes_outputs(cascade, evaluated, phantoms):
    folder = evaluated
    evaluation = json.loads((folder / "metrics.json").read_text())["latest"]
    best = json.loads((cascade / "stage2" / "metrics.json").read_text())["best"]
    for key in ("val_psnr", "val_ssim", "val_ms_ssim", "val_proj_error"):
        assert evaluation[key] == pytest.approx(best[key], rel=1e-5), key
    rows = (folder / "metrics_per_volume.csv").read_text().splitlines()
    assert len(rows) == 3 and "phantom_val_000" in rows[1]
    ct = nib.load(folder / "predictions" / "phantom_val_000_ct.nii.gz")
    assert ct.shape == (16, 16, 16)
    np.testing.assert_allclose(np.abs(np.diag(ct.affine)[:3]), [FOV / 16] * 3, rtol=1e-5)
    # on the input CT's grid: the same world centre (the pipeline resamples and resizes about the centre)
    (source,) = phantoms.rglob("phantom_val_000.nii.gz")
    source = nib.load(source)
    centre = source.affine @ np.array([*((np.array(source.shape[:3]) - 1) / 2), 1.0])
    spacing = np.abs(np.diag(source.affine)[:3])
    np.testing.assert_allclose(ct.affine @ np.array([7.5, 7.5, 7.5, 1.0]), centre, atol=float(spacing.max()))
    hu = ct.get_fdata()
    assert -1000 - 1e-3 <= hu.min() and hu.max() <= 1000 + 1e-3
    assert (folder / "predictions" / "phantom_val_001_views.png").is_file()


def _validation_inputs(phantoms: Path, stage: int = 2) -> tuple[object, list[tuple[str, dict]]]:
    """The projector and the preprocessed validation cases (CT at the stage's size and its X-rays) of ``tiny.json``,
    built in this process as the bundle builds them."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([config_arg(BUNDLE, "train.json"), config_arg(BUNDLE, "tiny.json")])
    parser["bundle_root"] = str(BUNDLES / BUNDLE)
    parser["device"] = "cpu"
    parser["stage"] = stage
    projector = parser.get_parsed_content("projector")
    transform = parser.get_parsed_content("preprocessing")
    datalist = json.loads((phantoms / "datalist.json").read_text())
    cases = []
    for entry in datalist["validation"]:
        case = Path(entry["image"]).name.split(".")[0]
        cases.append((case, transform({"image": str(phantoms / entry["image"])})))
    return projector, cases


def test_evaluation_in_another_mode_than_the_weights_is_refused(cascade, phantoms):
    """Diffusion weights read as a direct regressor would be scored as if they were one: evaluate.json refuses a
    ``mode`` other than the run record's (the back-projection baseline needs no weights and stays allowed)."""
    result = run_bundle(
        BUNDLE,
        [*TASK, "evaluate.json"],
        run_id="run",
        check=False,
        args=overrides(dataset_dir=str(phantoms), output_dir=str(cascade), stage=2, mode="direct"),
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "'mode' 'direct' is not the mode the trained network was trained in, 'diffusion'" in result.stderr
    assert not (cascade / "stage2" / "eval_direct").exists()


def test_backprojection_baseline_needs_no_weights(phantoms, tmp_path):
    """The untrained baseline's metrics are those of the mean back-projection of the validation X-rays, recomputed
    here from the same inputs with the bundle's metrics."""
    from common.metrics.image import image_quality_metrics
    from common.xray2ct.losses import ProjectionLoss

    run_bundle(
        BUNDLE,
        [*TASK, "evaluate.json"],
        run_id="run",
        # outputs_root: the older name of output_dir
        args=overrides(dataset_dir=str(phantoms), outputs_root=str(tmp_path), stage=1, mode="backprojection"),
    )
    summary = json.loads((tmp_path / "stage1" / "eval_backprojection" / "metrics.json").read_text())["latest"]
    projector, cases = _validation_inputs(phantoms, stage=1)
    image = torch.stack([out["image"].as_tensor() for _, out in cases])
    xray = torch.stack([out["xray"].as_tensor() for _, out in cases])
    assert image.shape == (2, 1, 8, 8, 8)
    volume = projector.backproject(xray, image.shape[2:]).mean(1, keepdim=True).clamp(-1.0, 1.0)
    pred, label = ((volume + 1) / 2).clamp(0, 1), ((image + 1) / 2).clamp(0, 1)
    for name, metric in image_quality_metrics().items():
        metric(y_pred=pred, y=label)
        assert summary[f"val_{name}"] == pytest.approx(float(metric.aggregate()), rel=1e-5), name
    proj_error = ProjectionLoss(projector)(volume, xray)
    assert summary["val_proj_error"] == pytest.approx(float(proj_error.mean()), rel=1e-5)
    assert summary["val_proj_error"] > 0  # two smeared views do not reproduce the X-rays of a phantom


def test_packed_cascade_runs_on_png_and_nifti_radiographs(cascade, evaluated, phantoms, tmp_path):
    """``run pack`` writes the combined checkpoint (into the run folder) with the settings of the highest stage, and
    the package of that file runs inference with its own configs (nothing merged); from exact NIfTI views
    (``phantom_val_000``) it gives the CT that evaluation made from the same CT; 16-bit PNG views
    (``phantom_val_001``) read back within half a quantisation step of the radiograph."""
    import zipfile

    from common.checkpoint_io import checkpoint_record
    from common.xray2ct.data import read_view, save_view_nifti, save_view_png
    from common.xray2ct.drr import DRRProjector

    work = tmp_path / "run"
    shutil.copytree(cascade, work)
    args = overrides(output_dir=str(work), stage=2)
    result = run_bundle(BUNDLE, ["inference.json", "tiny.json"], run_id="pack", args=args)
    packed = work / "models" / "model.pt"
    printed = next(line for line in result.stdout.splitlines() if line.startswith("package it: "))
    assert (
        printed == f"package it: python scripts/package_bundle.py xray2ct_cascade --ckpt {packed} --weights_inside True"
    )
    combined = torch.load(packed, weights_only=True)
    assert {key.split(".")[0] for key in combined} == {"stage1", "stage2"}
    record = checkpoint_record(packed)
    stage2 = json.loads((work / "stage2" / "configs" / "run.json").read_text())
    assert record == {**stage2, "settings": {**stage2["settings"], "stage": 2}}
    # the printed command, typed as printed from the repository root
    cmd = [sys.executable, *shlex.split(printed[len("package it: python ") :]), "--output", str(tmp_path / "dist")]
    made = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    zip_path = Path(next(line for line in made.stdout.splitlines() if line.startswith("wrote "))[len("wrote ") :])
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(tmp_path / "unzipped")
    packaged = tmp_path / "unzipped" / BUNDLE
    assert json.loads((packaged / "configs" / "train.json").read_text())["stage"] == 2

    projector, cases = _validation_inputs(phantoms)
    assert [case for case, _ in cases] == ["phantom_val_000", "phantom_val_001"]
    xrays = tmp_path / "xrays"
    for (case, out), save in zip(cases, (save_view_nifti, save_view_png)):
        for view, image in zip(projector.views, out["xray"]):
            path = save(xrays / f"{case}_{view}{'.nii.gz' if save is save_view_nifti else '.png'}", image)
            read = torch.from_numpy(read_view(path, projector.view_size))
            if save is save_view_nifti:
                assert torch.equal(read, image.as_tensor())  # float32, exactly
            else:  # 16 bit: the radiograph 2 g / 65535 - 1 is within half a step (1 / 65535) of the original
                error = DRRProjector.intensity(read) - DRRProjector.intensity(image.as_tensor())
                assert float(error.abs().max()) <= 1 / 65535 + 8 * torch.finfo(torch.float32).eps
    for view in projector.views:  # a pair whose lateral view has the wrong size: a row of failures.csv
        image = cases[0][1]["xray"][0]
        save_view_png(xrays / f"small_{view}.png", image[::2, ::2] if view == "lateral" else image)
    pred = tmp_path / "pred"
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "configs/inference.json"]
    cmd += overrides(dataset_dir=str(xrays), prediction_dir=str(pred)) + seed_args(BUNDLE, ["inference.json"])
    env = bundle_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one thread, as evaluation (tiny.json)
    env.pop("PYTHONPATH")  # the package's own common/
    result = subprocess.run(cmd, cwd=packaged, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == f"2 written, 1 failed: see {pred / 'failures.csv'}"
    with open(pred / "failures.csv", newline="") as handle:
        (failure,) = list(csv.DictReader(handle))
    assert failure["case_id"] == "small" and failure["stage"] == "check" and "xray_lateral" in failure["reason"]
    written = sorted(p.name for p in pred.iterdir() if not p.name.startswith(".") and p.name != "failures.csv")
    kinds = ("ct.nii.gz", "ct_std.nii.gz", "views.png")  # train.json samples num_samples > 1 CTs per case
    assert written == sorted(f"phantom_val_00{i}_{k}" for i in (0, 1) for k in kinds)
    for i in (0, 1):
        ct = nib.load(pred / f"phantom_val_00{i}_ct.nii.gz")
        assert ct.shape == (16, 16, 16)
        np.testing.assert_allclose(np.diag(ct.affine)[:3], [FOV / 16] * 3)
        hu = ct.get_fdata()
        assert -1000 - 1e-3 <= hu.min() and hu.max() <= 1000 + 1e-3
        std = nib.load(pred / f"phantom_val_00{i}_ct_std.nii.gz")  # the spread of the samples, in HU, same grid
        np.testing.assert_array_equal(std.affine, ct.affine)
        assert std.shape == ct.shape and 0 <= std.get_fdata().min() and std.get_fdata().max() <= 1000 + 1e-3
        assert std.get_fdata().max() > 0
    # the same X-rays, weights and per-case start noise (inference.json's seed is train.json's, both shifted alike)
    # on one thread: the same float32 computation as evaluation, up to the rounding of HU values of magnitude <= 1000
    a = nib.load(pred / "phantom_val_000_ct.nii.gz").get_fdata()
    b = nib.load(evaluated / "predictions" / "phantom_val_000_ct.nii.gz").get_fdata()
    np.testing.assert_allclose(a, b, rtol=0, atol=2000 * 16 * np.finfo(np.float32).eps)


def test_stage_2_without_stage_1_is_refused(phantoms, tmp_path):
    result = run_bundle(
        BUNDLE, TASK, check=False, args=overrides(dataset_dir=str(phantoms), output_dir=str(tmp_path), stage=2)
    )
    assert result.returncode == 1
    assert "\nerror: " in "\n" + result.stderr and "Traceback" not in result.stderr
    assert "stage 2 needs the trained weights of stage(s) 1..1" in result.stderr
    assert str(tmp_path / "stage1" / "models" / "model.pt") in result.stderr
    assert not (tmp_path / "stage2").exists()


def test_bad_data_is_reported_per_case_before_training(phantoms, tmp_path):
    """X-ray files per case (``view_files``): a missing view, a transposed and a wrongly sized one, and a CT smaller
    than the stage's volume size are all reported at once, before anything is written."""
    from common.data.io import write_nifti
    from common.xray2ct.data import save_view_nifti, save_view_png

    data = tmp_path / "data"
    shutil.copytree(phantoms, data)
    datalist = json.loads((data / "datalist.json").read_text())
    for i, entry in enumerate(datalist["training"] + datalist["validation"]):
        entry["case_id"] = f"case{i}"
        entry["xray_ap"] = f"xr/case{i}_ap.png"
        entry["xray_lateral"] = f"xr/case{i}_lateral.nii.gz"
        save_view_png(data / entry["xray_ap"], np.ones((64, 32), np.float32))
        save_view_nifti(data / entry["xray_lateral"], np.ones((64, 32), np.float32))
    train = datalist["training"]
    (data / train[0]["xray_lateral"]).unlink()
    save_view_png(data / train[1]["xray_ap"], np.ones((32, 64), np.float32))  # transposed
    save_view_nifti(data / train[2]["xray_lateral"], np.ones((20, 20), np.float32))
    write_nifti(data / train[3]["image"], np.zeros((6, 6, 6), np.float32), np.diag([20.0, 20.0, 20.0, 1.0]))
    (data / "datalist.json").write_text(json.dumps(datalist))
    out = tmp_path / "out"
    result = run_bundle(
        BUNDLE,
        TASK,
        check=False,
        args=overrides(dataset_dir=str(data), output_dir=str(out), view_files=True, view_size=[64, 32]),
    )
    assert result.returncode == 1, result.stdout[-2000:]
    text = result.stderr
    assert "Traceback" not in text
    assert "preflight found 4 problem(s)" in text, text[-3000:]
    assert "training[3] (case case3)" in text and "smaller than the volume_size of stage 1 (8, 8, 8)" in text
    assert "training[0] (case case0): xray_lateral" in text and "does not exist" in text
    assert "training[1] (case case1): xray_ap" in text and "transpose" in text
    assert "training[2] (case case2): xray_lateral" in text and "expected view_size (64, 32)" in text
    assert not (out / "stage1").exists()


def test_torchrun_two_processes_keep_identical_replicas(phantoms, tmp_path):
    out = tmp_path / "ddp"
    probe = rank_probe(
        BUNDLE,
        tmp_path / "probe.json",
        "{'network': @network.state_dict(), 'train': [str(d['image']) for d in @train#dataset.data], "
        "'iteration': @train#trainer.state.iteration}",
        folder="@stage_dir",
    )
    configs = [*TASK, "multi_gpu_train.json", str(probe)]
    args = overrides(
        dataset_dir=str(phantoms), output_dir=str(out), max_epochs=1, val_interval=1, stage_batch_size=[1, 1]
    )
    run_bundle(BUNDLE, configs, args=args, processes=2)
    r0 = torch.load(out / "stage1" / "rank0.pt", weights_only=True)
    r1 = torch.load(out / "stage1" / "rank1.pt", weights_only=True)
    assert r0["iteration"] == r1["iteration"] == 2  # 4 cases / 2 ranks, batch 1 per rank
    assert not set(r0["train"]) & set(r1["train"]), "ranks must cache different cases"
    for key in r0["network"]:
        assert torch.equal(r0["network"][key], r1["network"][key]), key
    log = (out / "stage1" / "train.log").read_text()
    assert "identical on all 2 ranks" in log and "x 2 rank(s)" in log
    assert np.isfinite(json.loads((out / "stage1" / "metrics.json").read_text())["latest"]["val_psnr"])


def _train_parser(*extra: str, **settings):
    """train.json + tiny.json (+ ``extra`` config files), parsed in this process on the CPU with ``settings``."""
    return bundle_parser(BUNDLE, ["train.json", *TASK[1:], *extra], **settings)


def _write_views(phantoms: Path, entry: dict, folder: Path, projector) -> dict:
    """``entry`` with X-ray files (NIfTI) of its CT made by ``projector`` under ``xray_<view>``."""
    from common.xray2ct.data import save_view_nifti, view_keys
    from tests.oracles import xray2ct_transforms

    volume = projector.view_size[0]
    xray = xray2ct_transforms(projector, [volume] * 3)({"image": str(phantoms / entry["image"])})["xray"]
    case = Path(entry["image"]).name.split(".")[0]
    views = {k: str(save_view_nifti(folder / f"{case}_{k}.nii.gz", x)) for k, x in zip(view_keys(projector), xray)}
    return {"image": str(phantoms / entry["image"]), "case_id": case, **views}


@pytest.mark.parametrize(
    "settings",
    [
        {"stage": 1},
        {"stage": 2, "orientation": "LPS", "source_size": [16, 16, 16], "hu_window": [-900, 600]},
        {"stage": 2, "view_files": True, "orientation": None},
    ],
    ids=["stage1-resized", "stage2-at-source", "stage2-view-files"],
)
def test_json_pipelines_match_xray2ct_transforms(phantoms, tmp_path, settings):
    """The transform lists of train.json (training under one seed, validation) and of inference.json (from the CT
    and from X-ray files) give the values, metadata and applied operations of ``xray2ct_transforms``."""
    from monai.transforms import Compose

    from common.xray2ct.data import view_keys
    from tests.oracles import xray2ct_transforms

    parser = _train_parser(dataset_dir=str(phantoms), **settings)
    projector, volume = parser.get_parsed_content("projector"), parser.get_parsed_content("volume_size")
    source, orientation = parser["source_size"], parser["orientation"]
    view_files = bool(settings.get("view_files"))
    entry = json.loads((phantoms / "datalist.json").read_text())["validation"][0]
    entry = (
        _write_views(phantoms, entry, tmp_path, projector) if view_files else {"image": str(phantoms / entry["image"])}
    )
    expected = xray2ct_transforms(projector, volume, source, view_files=view_files, orientation=orientation)
    names = [type(t).__name__ for t in expected.transforms]
    assert ("Resized" in names) is (list(volume) != list(source)) and ("DRRd" in names) is not view_files

    train, validate = (
        parser.get_parsed_content("train#preprocessing"),
        parser.get_parsed_content("validate#preprocessing"),
    )
    assert isinstance(train, Compose) and [type(t).__name__ for t in train.transforms] == [*names, "ToDeviced"]
    assert parser.get_parsed_content("preprocessing") is validate
    same_seeded_outputs(train, expected, entry, keys=("image", "xray"))
    item, expected_item = validate(dict(entry)), expected(dict(entry))
    for key in ("image", "xray"):
        same_tensor(item[key], expected_item[key])

    from monai.bundle import ConfigParser

    inference = ConfigParser()
    inference.read_config(str(BUNDLES / BUNDLE / "configs" / "inference.json"))
    plain = {k: parser[k] for k in ("stage_sizes", "stage", "source_size", "view_size", "fov_mm", "hu_window")}
    for key, value in {**plain, "device": "cpu", "orientation": orientation, "view_files": view_files}.items():
        inference[key] = value
    inference["bundle_root"] = str(BUNDLES / BUNDLE)
    inputs = {k: entry[k] for k in view_keys(projector)} if view_files else {"image": entry["image"]}
    expected = xray2ct_transforms(
        projector, volume, source, with_image=not view_files, view_files=view_files, orientation=orientation
    )
    item, expected_item = inference.get_parsed_content("preprocessing")(dict(inputs)), expected(dict(inputs))
    assert set(item) == set(expected_item) == ({"xray"} if view_files else {"image", "xray"})
    for key in item:
        same_tensor(item[key], expected_item[key])


def test_validation_dataset_holds_what_preprocessing_makes(phantoms):
    """``validate#dataset`` holds, for every validation case in order, the CT and X-rays ``preprocessing`` makes."""
    parser = _train_parser(dataset_dir=str(phantoms))
    datalists = parser.get_parsed_content("datalists")
    validate = parser.get_parsed_content("validate#dataset")
    preprocessing = parser.get_parsed_content("preprocessing")
    assert len(validate) == len(datalists["validation"]) == 2
    for i, entry in enumerate(datalists["validation"]):
        expected_item = preprocessing(dict(entry))
        for key in ("image", "xray"):
            same_tensor(validate[i][key], expected_item[key])

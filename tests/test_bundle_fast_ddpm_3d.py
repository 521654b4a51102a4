# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Workflow tests of ``bundles/fast_ddpm_3d``, run as users run it, on brain tumour phantoms in the BraTS 2023 layout:
datalist builder -> train (4 -> 1 missing-modality synthesis) -> evaluate -> inference on cases without the target
modality, the baseline (full DDPM) mode, configuration and data checks, latent diffusion on a frozen autoencoder_3d
checkpoint, unconditional generation and a 2-process torchrun job. What every bundle does:
``tests/test_bundle_contract.py``; resume after crashes: ``tests/test_reliability.py``."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from common.runs import run_settings
from tests.helpers import (
    BUNDLES,
    REPO_ROOT,
    bundle_env,
    bundle_parser,
    overrides,
    rank_probe,
    run_bundle,
    same_seeded_outputs,
    same_tensor,
    shifted_seed,
    suite_threads,
)

BUNDLE = "fast_ddpm_3d"
TASK = ["train.json", "brats.json", "tiny.json"]
SHAPE = (24, 24, 20)
MODALITIES = ("t1n", "t1c", "t2w", "t2f")
AE = str(BUNDLES / "autoencoder_3d" / "configs")
INFERENCE = ["inference.json", "brats.json", "tiny.json"]


def inference_parts(**settings):
    """The sampler (weights of ``ckpt_path`` loaded), dataset and postprocessing of an inference run of
    ``INFERENCE`` with ``settings``, built in this process (the postprocessing writes into ``prediction_dir``). The seed is the run's: ``inference.json``'s, shifted as
    ``run_bundle`` shifts it."""
    from monai.bundle import ConfigParser

    from common.checkpoint_io import load_network_weights

    parser = ConfigParser()
    parser.read_config([str(BUNDLES / BUNDLE / "configs" / name) for name in INFERENCE])
    settings = {
        "bundle_root": str(BUNDLES / BUNDLE),
        "device": "cpu",
        "seed": shifted_seed(parser["seed"]),
        "overwrite": True,
        **settings,
    }  # every case
    for key, value in settings.items():
        parser[key] = value
    if "prediction_dir" in settings:  # the writer straight into it (a run stages each case's files first)
        parser["postprocessing#output_dir"] = settings["prediction_dir"]
    sampler = parser.get_parsed_content("network")
    load_network_weights(sampler, parser.get_parsed_content("ckpt_path"))
    parts = {name: parser.get_parsed_content(name) for name in ("dataset", "postprocessing")}
    return sampler.eval(), parts["dataset"], parts["postprocessing"], settings["seed"]


def sample_in_process(sampler, batch, seed: int) -> torch.Tensor:
    """One sample per volume of ``batch`` in ``[0, 1]`` as the bundle's evaluator draws it: start noise at the
    target channels from a generator seeded by ``volume_seed`` of the case and ``seed``, then the sampler, with this
    suite's thread count (the subprocesses' too)."""
    from common.diffusion.engines import insert_target, volume_seed

    image = batch["image"].as_tensor().float()
    threads = torch.get_num_threads()
    torch.set_num_threads(int(suite_threads()))
    try:
        samples = []
        for i in range(image.shape[0]):
            generator = torch.Generator().manual_seed(volume_seed(batch, i, seed))
            noise = torch.randn((1, len(sampler.target_channels), *image.shape[2:]), generator=generator)
            x = insert_target(image[i : i + 1], noise, sampler.target_channels, sampler.in_channels)
            with torch.no_grad():
                samples.append(sampler(x, generator=generator).float())
    finally:
        torch.set_num_threads(threads)
    return ((torch.cat(samples) + 1) / 2).clamp(0, 1)


#: float32 rounding of the same operations, amplified by the first DDIM step's 1 / sqrt(alpha_bar) (about 160 at
#: t = 999 of the linear schedule): a bound on values in [0, 1] far below any change of noise or weights
SAMPLE_ATOL = 160 * 16 * float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def brats_tree(tmp_path_factory) -> Path:
    """Six phantom cases in the BraTS 2023 layout, listed by ``scripts/make_datalist.py --brats``."""
    from common.demo.images import write_brats_phantom_dataset

    root = tmp_path_factory.mktemp("brats")
    write_brats_phantom_dataset(root, n_train=4, n_val=2, shape=SHAPE, spacing=(1.5, 1.5, 2.0), seed=shifted_seed(0))
    (root / "datalist.json").unlink()
    cmd = [sys.executable, "scripts/make_datalist.py", "--data_dir", str(root), "--brats", "--val_fraction", "0.34"]
    cmd += ["--seed", str(shifted_seed(0))]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    datalist = json.loads((root / "datalist.json").read_text())
    assert len(datalist["training"]) == 4 and len(datalist["validation"]) == 2
    assert set(datalist["training"][0]) == {"case_id", *MODALITIES, "label"}
    return root


@pytest.fixture(scope="module")
def trained(brats_tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddpm_run")
    run_bundle(BUNDLE, TASK, args=overrides(dataset_dir=str(brats_tree), output_dir=str(out)))
    return out


def test_training_outputs(trained):
    models = trained / "models"
    assert (models / "last.pt").is_file() and (models / "model.pt").is_file()
    last = torch.load(models / "last.pt", weights_only=True)
    assert last["trainer"]["iteration"] == 8  # 4 cases x 2 epochs, batch 1
    assert {"unet", "ema", "optimizer", "lr_scheduler", "rng"} <= set(last)
    assert int(last["ema"]["n_averaged"]) == 8
    # the best checkpoint is the EMA of the weights (validation and export use it), not the raw network
    best = torch.load(models / "model.pt", weights_only=True)
    ema = {k: v for k, v in last["ema"].items() if k != "n_averaged"}  # checkpoints keep clean keys
    assert set(best) == set(ema) == set(last["unet"])
    assert best["conv_in.conv.weight"].shape[1] == 4  # three conditions + the noised target
    assert not torch.equal(best["out.2.conv.weight"], last["unet"]["out.2.conv.weight"])
    # the ranked checkpoint of the last validation (step 8) holds exactly the EMA weights that last.pt kept then
    (ranked_last,) = models.glob("model_val_psnr=*_step=8.pt")
    ranked = torch.load(ranked_last, weights_only=True)
    assert set(ranked) == set(ema)
    for key, value in ema.items():
        assert torch.equal(ranked[key], value), key

    summary = json.loads((trained / "metrics.json").read_text())
    assert [h["step"] for h in summary["history"]] == [4, 8]
    for h in summary["history"]:
        assert np.isfinite(h["val_psnr"]) and np.isfinite(h["val_denoise_loss"]) and h["val_denoise_loss"] > 0
        assert -1 <= h["val_ssim"] <= 1 and -1 <= h["val_ms_ssim"] <= 1
    log = (trained / "train.log").read_text()
    assert "effective batch: 2 sample(s) per rank and iteration x 1 rank(s) x 1 accumulation step(s)" in log
    csv = (trained / "metrics.csv").read_text()
    assert "timestep_mean" in csv and "val_psnr" in csv


def test_evaluate_matches_best_validation(trained, brats_tree):
    run_bundle(
        BUNDLE,
        [*TASK, "evaluate.json"],
        run_id="run",
        args=overrides(dataset_dir=str(brats_tree), output_dir=str(trained)),
    )
    evaluation = json.loads((trained / "eval" / "metrics.json").read_text())["latest"]
    best = json.loads((trained / "metrics.json").read_text())["best"]
    for key in ("val_psnr", "val_ssim", "val_ms_ssim", "val_denoise_loss"):
        assert evaluation[key] == pytest.approx(best[key], rel=1e-5), key
    rows = (trained / "eval" / "metrics_per_volume.csv").read_text().splitlines()
    assert len(rows) == 3 and "t1n" in rows[1]


def test_inference_synthesises_the_missing_modality(trained, brats_tree, tmp_path):
    """Cases without t2f (the BraTS missing-modality setting): the synthesis lands on each case's grid and is the
    sample of the saved weights from the case's seeded start noise, taken back to the case's grid."""
    from monai.data import MetaTensor, decollate_batch, list_data_collate

    cases = tmp_path / "missing"
    datalist = json.loads((brats_tree / "datalist.json").read_text())
    for entry in datalist["validation"]:
        folder = brats_tree / entry["t1n"]
        shutil.copytree(folder.parent, cases / folder.parent.name, ignore=shutil.ignore_patterns("*-t2f.*"))
    first = next(p for p in sorted(cases.iterdir()))
    broken = cases / "BraTS-BROKEN-00000-000"  # a case whose t1c export was cut short: a row of failures.csv
    broken.mkdir()
    for path in first.iterdir():
        data = path.read_bytes()
        (broken / path.name.replace(first.name, broken.name)).write_bytes(
            data[: len(data) // 2] if "-t1c" in path.name else data
        )
    pred = tmp_path / "pred"
    settings = dict(output_dir=str(trained), dataset_dir=str(cases), prediction_dir=str(pred))
    result = run_bundle(BUNDLE, INFERENCE, run_id="run", check=False, args=overrides(**settings))
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    with open(pred / "failures.csv", newline="") as handle:
        (failure,) = list(csv.DictReader(handle))
    assert failure["case_id"] == broken.name and failure["stage"] == "read" and "EOFError" in failure["reason"]
    shutil.rmtree(broken)
    written = sorted(p.name for p in pred.iterdir() if not p.name.startswith(".") and p.name != "failures.csv")
    expected = sorted(f"{Path(entry['t1n']).parent.name}_t2f.nii.gz" for entry in datalist["validation"])
    assert written == expected
    source = nib.load(next(cases.glob("*/*-t1n.nii.gz")))
    case = source.get_filename().split("/")[-2]
    out = nib.load(pred / f"{case}_t2f.nii.gz")
    assert out.shape == SHAPE
    np.testing.assert_allclose(out.affine, source.affine, atol=1e-5)
    values = out.get_fdata()
    assert values.min() >= 0 and values.max() <= 1
    # the same case sampled here and taken back to its grid by the bundle's postprocessing
    sampler, dataset, postprocessing, seed = inference_parts(**{**settings, "prediction_dir": str(tmp_path / "here")})
    (index,) = [i for i, item in enumerate(dataset.data) if item["case_id"] == case]
    batch = list_data_collate([dataset[index]])
    image = batch["image"]
    assert image.shape[1] == 3  # t1n, t1c, t2w: the target channel is the start noise
    sample = MetaTensor(
        sample_in_process(sampler, batch, seed), meta=image.meta, applied_operations=image.applied_operations
    )
    (item,) = decollate_batch({"image": image, "pred": sample})
    postprocessing(item)
    here = nib.load(tmp_path / "here" / f"{case}_t2f.nii.gz")
    np.testing.assert_allclose(here.affine, out.affine, atol=1e-5)
    np.testing.assert_allclose(values, here.get_fdata(), rtol=0, atol=SAMPLE_ATOL)


def test_bad_data_is_reported_per_case_before_training(brats_tree, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(brats_tree, data)
    datalist = json.loads((data / "datalist.json").read_text())
    train = datalist["training"]
    (data / train[0]["t2w"]).unlink()  # a missing modality
    two_channels = nib.load(data / train[1]["t1c"])
    stacked = np.stack([two_channels.get_fdata()] * 2, axis=-1).astype(np.float32)
    nib.save(nib.Nifti1Image(stacked, two_channels.affine), data / train[1]["t1c"])  # 2 channels for one modality
    cropped = nib.load(data / train[2]["t2f"])
    nib.save(nib.Nifti1Image(cropped.get_fdata()[:, :, :16].astype(np.float32), cropped.affine), data / train[2]["t2f"])
    del train[3]["t1n"]  # the datalist entry lacks a key
    (data / "datalist.json").write_text(json.dumps(datalist))
    out = tmp_path / "out"
    result = run_bundle(BUNDLE, TASK, check=False, args=overrides(dataset_dir=str(data), output_dir=str(out)))
    assert result.returncode == 1, result.stdout[-2000:]
    text = result.stderr
    assert "preflight found 4 problem(s)" in text, text[-3000:]
    case = [entry["case_id"] for entry in train]
    assert f"training[0] (case {case[0]})" in text and "does not exist" in text
    assert f"training[1] (case {case[1]})" in text and "2 channels" in text
    assert f"training[2] (case {case[2]})" in text and "spatial shapes differ" in text
    assert f"training[3] (case {case[3]})" in text and "'t1n'" in text
    assert not out.exists()


def test_baseline_mode_trains_and_samples_every_step(brats_tree, tmp_path):
    """``diffusion_mode baseline``: a standard DDPM on the same network, trained on and sampled over all steps."""
    out = tmp_path / "baseline"
    probe = tmp_path / "probe.json"
    probe.write_text(
        json.dumps(
            {
                "finalize": [
                    "$torch.save({'timesteps': @timesteps, 'sampler': @sampler.timesteps, 'loss': @sampler.loss_timesteps}, "
                    "@output_dir + '/grids.pt')"
                ]
            }
        )
    )
    run_bundle(
        BUNDLE,
        [*TASK, str(probe)],
        args=overrides(
            dataset_dir=str(brats_tree),
            output_dir=str(out),
            diffusion_mode="baseline",
            num_train_timesteps=20,
            num_grid_steps=4,
            max_epochs=1,
            max_cases=2,
        ),
    )
    grids = torch.load(out / "grids.pt", weights_only=True)
    assert grids["timesteps"].tolist() == grids["sampler"].tolist() == list(range(20))
    assert grids["loss"].tolist() == [0, 4, 9, 14, 19]  # the held-out loss is taken on the fast grid in both modes
    summary = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(summary["latest"]["val_psnr"])


@pytest.fixture(scope="module")
def autoencoder_ckpt(tmp_path_factory) -> Path:
    """Weights of the tiny autoencoder_3d network (untrained: the latent pipeline, not its quality, is tested)."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([f"{AE}/train.json", f"{AE}/tiny.json"])
    torch.manual_seed(shifted_seed(0))
    network = parser.get_parsed_content("network_def")
    path = tmp_path_factory.mktemp("ae") / "model.pt"
    torch.save(network.state_dict(), path)
    return path


def _latent_args(ckpt: Path, **extra) -> dict:
    return dict(
        latent=True,
        latent_config=[f"{AE}/train.json", f"{AE}/tiny.json"],
        latent_ckpt=str(ckpt),
        latent_channels=3,
        latent_downsample=[4, 4, 4],
        **extra,
    )


def test_latent_mode_trains_on_autoencoder_latents(brats_tree, autoencoder_ckpt, tmp_path):
    out = tmp_path / "latent"
    args = _latent_args(autoencoder_ckpt, dataset_dir=str(brats_tree), output_dir=str(out), max_epochs=1, max_cases=2)
    run_bundle(BUNDLE, TASK, args=overrides(**args))
    last = torch.load(out / "models" / "last.pt", weights_only=True)
    scale = float(last["codec"]["scale"])
    assert np.isfinite(scale) and scale > 0  # calibrated on the training latents, saved for resume
    best = torch.load(out / "models" / "model.pt", weights_only=True)
    assert float(best["latent_scale"]) == scale
    assert best["conv_in.conv.weight"].shape[1] == 4 * 3  # four modalities x 3 latent channels
    assert best["out.2.conv.weight"].shape[0] == 3  # the target's latent channels
    summary = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(summary["latest"]["val_psnr"])  # decoded samples compared in image space

    pred = tmp_path / "pred"
    cases = brats_tree  # all modalities present: only t1n, t1c, t2w are read
    run_bundle(
        BUNDLE,
        ["inference.json", "brats.json", "tiny.json"],
        run_id="run",
        args=overrides(
            **_latent_args(autoencoder_ckpt),
            output_dir=str(out),
            dataset_dir=str(cases),
            prediction_dir=str(pred),
        ),
    )
    outputs = sorted(pred.glob("*_t2f.nii.gz"))
    assert len(outputs) == 6
    source = nib.load(next(brats_tree.glob(f"{outputs[0].name[: -len('_t2f.nii.gz')]}/*-t1n.nii.gz")))
    image = nib.load(outputs[0])
    assert image.shape == SHAPE
    np.testing.assert_allclose(image.affine, source.affine, atol=1e-5)


def test_latent_checkpoint_that_does_not_fit_is_refused(brats_tree, autoencoder_ckpt, tmp_path):
    out = tmp_path / "latent"
    args = _latent_args(autoencoder_ckpt, dataset_dir=str(brats_tree), output_dir=str(out))
    args["latent_channels"] = 4
    result = run_bundle(BUNDLE, TASK, check=False, args=overrides(**args))
    assert result.returncode == 1
    assert "'latent_channels' is 4 but the autoencoder of 'latent_ckpt'" in result.stderr
    assert "encodes to 3 channel(s)" in result.stderr and "Traceback" not in result.stderr
    assert not (out / "models").exists()


def test_unconditional_generation(brats_tree, tmp_path):
    out = tmp_path / "uncond"
    args = dict(task="unconditional", image_keys=["t2f"], target_key="t2f")
    training = dict(dataset_dir=str(brats_tree), output_dir=str(out), max_epochs=2, max_cases=1)
    run_bundle(BUNDLE, TASK, args=overrides(**training, **args))
    summary = json.loads((out / "metrics.json").read_text())
    latest = summary["latest"]
    assert set(latest) == {"step", "val_sample_ms_ssim", "val_denoise_loss"}
    assert np.isfinite(latest["val_sample_ms_ssim"]) and -1 <= latest["val_sample_ms_ssim"] <= 1
    losses = {h["step"]: h["val_denoise_loss"] for h in summary["history"]}
    assert len(losses) == 2 and summary["best"]["step"] == min(losses, key=losses.get)  # lower loss is better
    pred = tmp_path / "pred"
    settings = dict(
        output_dir=str(out),
        prediction_dir=str(pred),
        num_samples=3,
        sample_shape=[16, 24, 16],
        **args,
    )
    run_bundle(BUNDLE, INFERENCE, run_id="run", args=overrides(**settings))
    written = sorted(p.name for p in pred.iterdir() if not p.name.startswith("."))  # not the case records
    assert written == ["sample_000_t2f.nii.gz", "sample_001_t2f.nii.gz", "sample_002_t2f.nii.gz"]
    volumes = [nib.load(pred / name) for name in written]
    assert all(v.shape == (16, 24, 16) for v in volumes)
    trained_spacing = run_settings(out, BUNDLES / BUNDLE)["spacing"]  # samples are on the grid trained at
    np.testing.assert_allclose(np.diag(volumes[0].affine), [*trained_spacing, 1])
    # each volume is the sample of the saved weights from the start noise seeded by its own case id
    sampler, dataset, _, seed = inference_parts(**settings)
    assert [item["case_id"] for item in dataset.data] == ["sample_000", "sample_001", "sample_002"]
    for i, volume in enumerate(volumes):
        batch = {"image": dataset[i]["image"][None], "case_id": [dataset[i]["case_id"]]}
        expected = sample_in_process(sampler, batch, seed)[0, 0].numpy()
        np.testing.assert_allclose(volume.get_fdata(), expected, rtol=0, atol=SAMPLE_ATOL)


def test_torchrun_two_processes_keep_identical_replicas(brats_tree, tmp_path):
    out = tmp_path / "ddp"
    probe = rank_probe(
        BUNDLE,
        tmp_path / "probe.json",
        "{'unet': @unet.state_dict(), 'ema': @ema.module.state_dict(), 'train': "
        "[str(d['case_id']) for d in @train#dataset.data], 'iteration': @train#trainer.state.iteration}",
    )
    configs = [*TASK, "multi_gpu_train.json", str(probe)]
    args = overrides(dataset_dir=str(brats_tree), output_dir=str(out), max_epochs=1, val_interval=1)
    run_bundle(BUNDLE, configs, args=args, processes=2)
    r0 = torch.load(out / "rank0.pt", weights_only=True)
    r1 = torch.load(out / "rank1.pt", weights_only=True)
    assert r0["iteration"] == r1["iteration"] == 2  # 4 cases / 2 ranks, batch 1
    assert not set(r0["train"]) & set(r1["train"]), "ranks must cache different cases"
    for part in ("unet", "ema"):
        for key in r0[part]:
            assert torch.equal(r0[part][key], r1[part][key]), f"{part}.{key}"
    assert "identical on all 2 ranks" in (out / "train.log").read_text()
    assert "x 2 rank(s)" in (out / "train.log").read_text()
    summary = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(summary["latest"]["val_psnr"])


def test_inference_with_weights_of_another_task_is_refused(trained, brats_tree, tmp_path):
    """The 4 -> 1 synthesis weights under the default translation config (T1 -> GM, 2 input channels): pointed at
    them with ``--ckpt_path`` from a folder without the run's settings (pointed at the run, inference takes the
    run's task from its run.json)."""
    pred = tmp_path / "pred"
    args = overrides(
        output_dir=str(tmp_path / "elsewhere"),
        ckpt_path=str(trained / "models" / "model.pt"),
        dataset_dir=str(brats_tree),
        prediction_dir=str(pred),
    )
    result = run_bundle(BUNDLE, ["inference.json", "tiny.json"], run_id="run", check=False, args=args)
    assert result.returncode == 1
    assert "\nerror: " in "\n" + result.stderr and "Traceback" not in result.stderr
    assert "takes 4 input channel(s) but this sampler is configured for 2" in result.stderr
    assert not pred.exists()


def _parser(config: str, *extra: str, **settings):
    """The bundle's ``config`` (with ``extra`` config files merged after it), parsed in this process on the CPU."""
    return bundle_parser(BUNDLE, [config, *extra], **settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"intensity": {"mode": "mri", "lower": 1, "upper": 99}, "spacing": None, "orientation": "RAS"},
        {"intensity": {"mode": "ct", "a_min": -300, "a_max": 500}, "spacing": [1.5, 1.25, 2.0], "orientation": "LPS"},
        {"intensity": {"mode": "none"}, "spacing": [2, 2, 2], "orientation": None},
        {
            "intensity": {"mode": "mri", "lower": 0.5, "upper": 99.5},
            "spacing": None,
            "orientation": "RAS",
            "latent": True,
        },
        {
            "intensity": {"mode": "mri", "lower": 1, "upper": 99},
            "spacing": None,
            "orientation": "RAS",
            "first": "image",
        },
    ],
    ids=["mri", "ct-spacing", "none-native", "latent", "image-key"],
)
def test_json_pipelines_match_diffusion_transforms(autoencoder_ckpt, tmp_path, settings):
    """The transform lists written in train.json and inference.json give the values, metadata and inverses of
    ``diffusion_transforms``: training patches under one seed (in latent space in latent mode), validation volumes
    with the target copied to ``label``, inference inputs of the sources alone and their inversion to the input
    grid. With ``image`` among the keys (``image-key``), the stacked volume replaces it and the other keys are
    dropped, as ``diffusion_transforms`` drops them."""
    from monai.transforms import Compose

    from tests.oracles import diffusion_transforms

    rng = np.random.default_rng(shifted_seed(3))
    affine = np.array([[-1.2, 0.0, 0.1, 5.0], [0.0, 0.9, 0.0, -3.0], [0.0, 0.0, 1.7, 2.0], [0.0, 0.0, 0.0, 1.0]])
    first = settings.get("first", "t1")
    entry = {"case_id": "case_7"}
    for key, (mean, std) in {first: (100.0, 400.0), "t2": (0.2, 0.4)}.items():
        entry[key] = str(tmp_path / f"{key}.nii.gz")
        nib.save(nib.Nifti1Image(rng.normal(mean, std, (14, 12, 10)).astype(np.float32), affine), entry[key])
    latent = bool(settings.get("latent", False))
    keys = {k: settings[k] for k in ("intensity", "spacing", "orientation")}
    shared = dict(
        **keys,
        image_keys=[first, "t2"],
        target_key="t2",
        patch_size=[16, 16, 8],
        unet_channels=[8, 16],
        **(_latent_args(autoencoder_ckpt) if latent else {"latent": False}),
    )
    parser = _parser("train.json", "tiny.json", **shared, patches_per_volume=2)
    codec = parser.get_parsed_content("codec")
    divisible_by = parser.get_parsed_content("divisible_by")
    assert divisible_by == ([8, 8, 8] if latent else [2, 2, 2])
    reference = dict(**keys, patch_size=[16, 16, 8], divisible_by=divisible_by, latent_codec=codec)

    train, expected = (
        parser.get_parsed_content("train#preprocessing"),
        diffusion_transforms([first, "t2"], **reference, num_samples=2),
    )
    names = [type(t).__name__ for t in train.transforms]
    assert isinstance(train, Compose) and names[-3:] == ["EnsureTyped", "ToDeviced", "RandSpatialCropSamplesd"]
    assert ("EncodeLatentd" in names) is latent
    assert ("ScaleIntensityRanged" in names) is (keys["intensity"]["mode"] != "none")
    crops = train(dict(entry))
    assert len(crops) == 2 and crops[0]["image"].shape[1:] == ((4, 4, 2) if latent else (16, 16, 8))
    same_seeded_outputs(train, expected, entry)

    validate = parser.get_parsed_content("validate#preprocessing")
    item = validate(dict(entry))
    expected_item = diffusion_transforms([first, "t2"], **reference, train=False, label_channels=[1])(dict(entry))
    assert set(item) == set(expected_item) == {"case_id", "image", "label"}
    for key in ("image", "label"):
        same_tensor(item[key], expected_item[key])
    assert item["label"].shape[0] == 1 and item["image"].shape[0] == (6 if latent else 2)

    inference = _parser(
        "inference.json",
        "tiny.json",
        **shared,
        task="translation",
        latent_sw_batch_size=1,
        prediction_dir=str(tmp_path / "pred"),
    )
    inference_pre = inference.get_parsed_content("preprocessing")
    source = {"case_id": "case_7", first: entry[first]}
    item = inference_pre(dict(source))
    expected_pre = diffusion_transforms([first], **reference, train=False)
    expected_item = expected_pre(dict(source))
    assert set(item) == set(expected_item) == {"case_id", "image"}
    same_tensor(item["image"], expected_item["image"])
    if not latent:  # a latent sample is decoded to the image grid before it is inverted
        restored, expected_restored = inference_pre.inverse(item), expected_pre.inverse(expected_item)
        same_tensor(restored["image"], expected_restored["image"])
        assert restored["image"].shape[1:] == (14, 12, 10)
        inference.get_parsed_content("postprocessing")


def test_validation_cases_stack_the_modalities_and_the_label(brats_tree):
    """``validate#dataset`` gives each case's four modalities as the channels of ``image`` and the tumour label."""
    parser = _parser("train.json", "brats.json", "tiny.json", dataset_dir=str(brats_tree))
    validate = parser.get_parsed_content("validate#dataset")
    assert validate[0]["label"].shape[0] == 1 and validate[0]["image"].shape[0] == len(MODALITIES)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Workflow tests of ``bundles/vqgan_3d``, run as users run it, on synthetic chest CT written as DICOM series: datalist
builder -> train -> evaluate -> inference (reconstruct, encode, decode), data checks, max_cases and a
2-process torchrun job with identical codebooks. What every bundle does: ``tests/test_bundle_contract.py``; resume
after crashes: ``tests/test_reliability.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

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

BUNDLE = "vqgan_3d"
TINY_JSON = "tiny.json"
ARCH = dict(n_hiddens=4, downsample=[4, 4, 4], embedding_dim=4, n_codes=32, norm_num_groups=4, patch_size=[16, 16, 16])
SHAPE = (24, 24, 22)  # 22 slices: not a multiple of the downsampling, padded to 24 everywhere


@pytest.fixture(scope="module")
def ct_series(tmp_path_factory) -> Path:
    """Six chest CT phantoms in HU as DICOM series folders, listed by ``scripts/make_datalist.py --dicom``."""
    from common.demo.images import write_phantom_dataset

    root = tmp_path_factory.mktemp("ct_dicom")
    write_phantom_dataset(
        root, n_train=4, n_val=2, shape=SHAPE, kind="ct", dicom=True, spacing=(1.5, 1.5, 2.0), seed=shifted_seed(0)
    )
    (root / "datalist.json").unlink()
    cmd = [sys.executable, "scripts/make_datalist.py", "--data_dir", str(root), "--dicom", "--val_fraction", "0.34"]
    cmd += ["--seed", str(shifted_seed(0))]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    datalist = json.loads((root / "datalist.json").read_text())
    assert len(datalist["training"]) == 4 and len(datalist["validation"]) == 2
    assert all(not Path(e["image"]).is_absolute() for e in datalist["training"])
    return root


@pytest.fixture(scope="module")
def trained(ct_series, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vq_run")
    run_bundle(BUNDLE, ["train.json", TINY_JSON], args=overrides(dataset_dir=str(ct_series), output_dir=str(out)))
    return out


def test_training_outputs(trained):
    models = trained / "models"
    assert (models / "last.pt").is_file() and (models / "model.pt").is_file()
    ranked = sorted(p.name for p in models.glob("model_val_psnr=*_step=*.pt"))
    assert 1 <= len(ranked) <= 3 and all("/" not in name for name in ranked)
    last = torch.load(models / "last.pt", weights_only=True)
    assert last["trainer"]["iteration"] == 8  # 4 volumes x 2 epochs, batch 1
    weights = last["vqgan"]
    assert {"quantizer.embeddings", "quantizer.cluster_size", "quantizer.embed_sum", "quantizer.initialized"} <= set(
        weights
    )
    assert bool(weights["quantizer.initialized"]) and weights["quantizer.embeddings"].shape == (32, 4)
    assert "quantizer.usage_counts" not in weights
    heads = {key.split(".")[0] for key in last["discriminator"]}
    assert heads == {"image", "video"}

    summary = json.loads((trained / "metrics.json").read_text())
    assert [h["step"] for h in summary["history"]] == [4, 8]
    for h in summary["history"]:
        # at least one code is used; exp(entropy) lies in [1, n_codes] (float32 rounding of the entropy aside)
        assert 0 < h["val_codebook_usage"] <= 1 and 1 - 1e-5 <= h["val_perplexity"] <= 32 * (1 + 1e-5)
        assert -1 <= h["val_ssim"] <= 1 and 0 <= h["val_ms_ssim"] <= 1 and np.isfinite(h["val_psnr"])
    assert summary["best"]["val_psnr"] == max(h["val_psnr"] for h in summary["history"])
    csv = (trained / "metrics.csv").read_text()
    for tag in ("train/perplexity", "train/codebook_usage", "train/codebook_restarts", "train/adv_loss_image"):
        assert tag in csv or tag.split("/")[1] in csv, tag


def test_evaluate_matches_best_validation(trained, ct_series):
    run_bundle(
        BUNDLE,
        ["train.json", TINY_JSON, "evaluate.json"],
        run_id="run",
        args=overrides(dataset_dir=str(ct_series), output_dir=str(trained)),
    )
    evaluation = json.loads((trained / "eval" / "metrics.json").read_text())["latest"]
    best = json.loads((trained / "metrics.json").read_text())["best"]
    for key in ("val_psnr", "val_ssim", "val_ms_ssim", "val_codebook_usage", "val_perplexity"):
        assert evaluation[key] == pytest.approx(best[key], rel=1e-5), key
    per_volume = (trained / "eval" / "metrics_per_volume.csv").read_text().splitlines()
    assert len(per_volume) == 3


def _source(ct_series: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    from monai.transforms import LoadImage

    image = LoadImage(image_only=True)(str(ct_series / "images" / name))
    return image.numpy(), image.affine.numpy()


def _reconstruction_in_hu(model_path: Path, series: Path, source: np.ndarray) -> np.ndarray:
    """``model_path``'s reconstruction of ``series``, computed here: the bundle's inference preprocessing (checked to
    be the HU window mapped to [0, 1] and zero padding to a multiple of the downsampling), the sliding windows
    ``inference.json`` sets, run with the thread count of the inference subprocess (other thread counts round
    differently, and a code near a tie could then flip), then the padding cropped and [0, 1] mapped back to the
    window in HU."""
    from monai.inferers import SlidingWindowInferer

    from common.checkpoint_io import load_network_weights
    from common.networks.wrappers import ReconstructionNetwork
    from common.vqgan.networks import VQGAN
    from tests.oracles import volume_transforms

    config = json.loads((BUNDLES / BUNDLE / "configs" / "inference.json").read_text())
    defaults = json.loads((BUNDLES / BUNDLE / "configs" / "train.json").read_text())  # inference reads them back
    window = defaults["ct_window"]
    a_min, a_max = float(window["a_min"]), float(window["a_max"])
    arch = {k: v for k, v in ARCH.items() if k != "patch_size"}
    preprocessing = volume_transforms(
        keys=["image"],
        intensity=window,
        spacing=None,
        orientation=defaults["orientation"],
        patch_size=ARCH["patch_size"],
        divisible_by=ARCH["downsample"],
        train=False,
    )
    image = preprocessing({"image": str(series)})["image"].as_tensor()
    assert image.shape == (1, 24, 24, 24)
    inside = (slice(None), slice(0, 24), slice(0, 24), slice(1, 23))  # 22 slices padded by one on each side
    windowed = (np.clip(source, a_min, a_max) - a_min) / (a_max - a_min)
    np.testing.assert_allclose(image[inside].numpy()[0], windowed, atol=1e-6)
    vqgan = load_network_weights(VQGAN(**arch), model_path).eval()
    inferer = SlidingWindowInferer(
        roi_size=ARCH["patch_size"], sw_batch_size=config["sw_batch_size"], overlap=config["overlap"], mode="gaussian"
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(int(suite_threads()))
    try:
        with torch.no_grad():
            pred = inferer(image[None], ReconstructionNetwork(vqgan))[0]
    finally:
        torch.set_num_threads(threads)
    return np.clip(pred[inside].numpy()[0], 0.0, 1.0) * (a_max - a_min) + a_min


def test_inference_reconstruct_encode_decode_round_trip(trained, ct_series, tmp_path):
    images = str(ct_series / "images")
    pred = tmp_path / "pred"
    common = dict(output_dir=str(trained), input_pattern="phantom_val_000", **ARCH)
    run_bundle(
        BUNDLE,
        ["inference.json"],
        run_id="run",
        args=overrides(dataset_dir=images, prediction_dir=str(tmp_path / "recon"), **common),
    )
    run_bundle(
        BUNDLE,
        ["inference.json"],
        run_id="run",
        args=overrides(dataset_dir=images, prediction_dir=str(pred), mode="encode", **common),
    )
    source, affine = _source(ct_series, "phantom_val_000")
    recon = nib.load(tmp_path / "recon" / "phantom_val_000_recon.nii.gz")
    assert recon.shape == SHAPE
    np.testing.assert_allclose(recon.affine, affine, atol=1e-4)
    values = recon.get_fdata()
    assert np.isfinite(values).all()
    assert values.min() >= -1000 - 1e-3 and values.max() <= 1000 + 1e-3  # back in HU, inside the window
    # the written reconstruction is model.pt's reconstruction of this series: the same operations at the same thread
    # count, up to the float32 rounding of the HU mapping (ulps of 1000 HU, 6e-5)
    expected = _reconstruction_in_hu(trained / "models" / "model.pt", ct_series / "images" / "phantom_val_000", source)
    np.testing.assert_allclose(values, expected, atol=1e-3, rtol=0)

    latent = nib.load(pred / "phantom_val_000_latent.nii.gz")
    codes = nib.load(pred / "phantom_val_000_codes.nii.gz")
    assert latent.shape == (6, 6, 6, 4) and codes.shape == (6, 6, 6)
    assert codes.get_data_dtype() == np.int32
    code_values = np.asarray(codes.dataobj)
    assert code_values.min() >= 0 and code_values.max() < 32
    np.testing.assert_allclose(np.diag(latent.affine)[:3], 4 * np.diag(affine)[:3], atol=1e-5)
    np.testing.assert_allclose(codes.affine, latent.affine, atol=1e-6)
    # every latent vector is exactly the codebook vector of its code
    book = torch.load(trained / "models" / "model.pt", weights_only=True)["quantizer.embeddings"].numpy()
    np.testing.assert_allclose(np.asarray(latent.dataobj), book[code_values], atol=1e-6)

    out = tmp_path / "decoded"  # one run decodes both the latent and the code map
    run_bundle(
        BUNDLE,
        ["inference.json"],
        run_id="run",
        args=overrides(
            dataset_dir=str(pred), prediction_dir=str(out), mode="decode", **{**common, "input_pattern": "*_000_*"}
        ),
    )
    decoded = {kind: nib.load(out / f"phantom_val_000_{kind}_decoded.nii.gz") for kind in ("latent", "codes")}
    assert decoded["latent"].shape == (24, 24, 24)  # the padded grid
    np.testing.assert_allclose(decoded["latent"].get_fdata(), decoded["codes"].get_fdata(), atol=0.01)  # HU
    # the decoded grid sits where the padded image grid was: same voxel size, origin shifted by the padding
    np.testing.assert_allclose(decoded["latent"].affine[:3, :3], affine[:3, :3], atol=1e-5)
    np.testing.assert_allclose(decoded["latent"].affine[:3, 3], affine[:3, 3] - affine[:3, :3] @ [0, 0, 1], atol=1e-4)


def test_stitched_reconstruction_equals_single_pass_when_the_volume_fits():
    from monai.inferers import SlidingWindowInferer

    from common.networks.wrappers import LatentEncoder, ReconstructionNetwork
    from common.vqgan.networks import VQGAN

    torch.manual_seed(shifted_seed(0))
    net = VQGAN(n_hiddens=4, downsample=(4, 4, 4), embedding_dim=4, n_codes=32, norm_num_groups=4)
    x = torch.rand(1, 1, 16, 16, 16)
    net.train()
    net(x)  # initialise the codebook from data
    net.eval()
    with torch.no_grad():
        for overlap in (0.25, 0.5):
            # one window: the gaussian blend multiplies by the weight and divides by it again, two roundings of the
            # output (1e-6 relative is ~8 float32 ulps) on top of the same network pass
            inferer = SlidingWindowInferer(roi_size=(16, 16, 16), sw_batch_size=2, overlap=overlap, mode="gaussian")
            expected = net.reconstruct(x)
            torch.testing.assert_close(inferer(x, ReconstructionNetwork(net)), expected, rtol=1e-6, atol=1e-6)
            latent = inferer(x, LatentEncoder(net, quantized=False))
            torch.testing.assert_close(latent, net.encode(x), rtol=1e-6, atol=1e-6)
        big = torch.rand(1, 1, 32, 24, 16)
        inferer = SlidingWindowInferer(roi_size=(16, 16, 16), sw_batch_size=2, overlap=0.25, mode="gaussian")
        stitched = inferer(big, ReconstructionNetwork(net))
        assert stitched.shape == big.shape and torch.isfinite(stitched).all()


def _parser(config: str, *extra: str, **settings):
    """The bundle's ``config`` (with ``extra`` config files merged after it), parsed in this process on the CPU."""
    return bundle_parser(BUNDLE, [config, *extra], **settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"intensity": {"mode": "ct", "a_min": -300, "a_max": 500}, "spacing": None, "orientation": "RAS"},
        {"intensity": {"mode": "mri", "lower": 1, "upper": 99}, "spacing": [1.5, 1.25, 2.0], "orientation": "LPS"},
        {"intensity": {"mode": "none"}, "spacing": [2, 2, 2], "orientation": None, "downsample": [2, 4, 8]},
    ],
    ids=["ct", "mri-spacing", "none-native-anisotropic"],
)
def test_json_pipelines_match_volume_transforms(tmp_path, settings):
    """The transform lists written in train.json and inference.json give the values, metadata and inverses of
    ``volume_transforms`` with the downsampling's ``divisible_by`` padding (training patches under one seed,
    validation volumes, inference in the three modes, decode reading a latent map without normalisation)."""
    from monai.transforms import Compose

    from tests.oracles import volume_transforms

    rng = np.random.default_rng(shifted_seed(3))
    affine = np.array([[-1.2, 0.0, 0.1, 5.0], [0.0, 0.9, 0.0, -3.0], [0.0, 0.0, 1.7, 2.0], [0.0, 0.0, 0.0, 1.0]])
    path, latent = tmp_path / "vol.nii.gz", tmp_path / "vol_latent.nii.gz"
    nib.save(nib.Nifti1Image(rng.normal(100.0, 400.0, (14, 12, 10)).astype(np.float32), affine), str(path))
    nib.save(nib.Nifti1Image(rng.normal(0.0, 1.0, (4, 3, 3, 4)).astype(np.float32), affine), str(latent))
    downsample = settings.get("downsample", [4, 4, 4])
    keys = {k: settings[k] for k in ("intensity", "spacing", "orientation")}
    patch = {"patch_size": [16, 16, 8], "divisible_by": downsample}
    parser = _parser("train.json", TINY_JSON, **settings, patch_size=patch["patch_size"], patches_per_volume=2)

    train, expected = (
        parser.get_parsed_content("train#preprocessing"),
        volume_transforms(**keys, **patch, num_samples=2),
    )
    assert isinstance(train, Compose) and [type(t).__name__ for t in train.transforms][-4:] == [
        "DivisiblePadd",
        "EnsureTyped",
        "ToDeviced",
        "RandSpatialCropSamplesd",
    ]
    assert len(train({"image": str(path)})) == 2  # num_samples crops
    same_seeded_outputs(train, expected, {"image": str(path)})

    validate = parser.get_parsed_content("validate#preprocessing")
    item = validate({"image": str(path)})["image"]
    same_tensor(item, volume_transforms(**keys, **patch, train=False)({"image": str(path)})["image"])
    assert all(s % d == 0 for s, d in zip(item.shape[1:], downsample))

    arch = {k: v for k, v in ARCH.items() if k not in ("patch_size", "downsample")}
    for mode, units in (
        ("reconstruct", "input"),
        ("reconstruct", "normalised"),
        ("encode", "input"),
        ("decode", "input"),
    ):
        inference = _parser(
            "inference.json",
            **keys,
            **arch,
            downsample=downsample,
            patch_size=patch["patch_size"],
            num_res_blocks=1,
            mode=mode,
            output_units=units,
            prediction_dir=str(tmp_path / "pred"),
        )
        inference_pre = inference.get_parsed_content("preprocessing")
        if mode == "decode":
            source = latent
            expected = volume_transforms(
                intensity={"mode": "none"}, orientation=keys["orientation"], train=False, invertible_intensity=True
            )
        else:
            source = path
            expected = volume_transforms(**keys, **patch, train=False, invertible_intensity=units == "input")
        item, expected_item = inference_pre({"image": str(source)}), expected({"image": str(source)})
        same_tensor(item["image"], expected_item["image"])
        restored, expected_restored = inference_pre.inverse(item), expected.inverse(expected_item)
        same_tensor(restored["image"], expected_restored["image"])
        inference.get_parsed_content("postprocessing")  # checks that output_units fits the preprocessing


def test_intensity_follows_demo_data(tmp_path):
    """train.json normalises the demo MRI by percentiles (``demo_intensity``) and other data by the CT window."""
    for dataset_dir, name, kind in ((None, "demo_intensity", "Percentilesd"), (tmp_path, "ct_window", "Ranged")):
        parser = _parser("train.json", **({} if dataset_dir is None else {"dataset_dir": str(dataset_dir)}))
        assert parser.get_parsed_content("intensity") == parser.get_parsed_content(name)
        step = [t for t in parser.get_parsed_content("train#deterministic") if hasattr(t, "transform")][0]
        assert type(step).__name__ == "ScaleIntensityModed" and type(step.transform).__name__.endswith(kind)


def test_bad_data_is_reported_per_case_before_training(ct_series, tmp_path):
    data = tmp_path / "data"
    (data / "empty_series").mkdir(parents=True)
    good = str(ct_series / "images" / "phantom_train_000")
    (data / "datalist.json").write_text(
        json.dumps({"training": [{"image": good}, {"image": "empty_series"}, {"image": "missing_series"}]})
    )
    out = tmp_path / "out"
    result = run_bundle(
        BUNDLE, ["train.json", TINY_JSON], check=False, args=overrides(dataset_dir=str(data), output_dir=str(out))
    )
    assert result.returncode == 1
    assert "preflight found 2 problem(s)" in result.stderr
    assert "training[1]" in result.stderr and "DICOM series folder is required" in result.stderr
    assert "training[2]" in result.stderr and "does not exist" in result.stderr
    assert not out.exists()


def test_torchrun_two_processes_keep_identical_codebooks(ct_series, tmp_path):
    out = tmp_path / "ddp"
    probe = rank_probe(
        BUNDLE,
        tmp_path / "probe.json",
        "{'weights': @vqgan.state_dict(), 'train': [str(d['image']) for d in @train#dataset.data], "
        "'iteration': @train#trainer.state.iteration}",
    )
    configs = ["train.json", TINY_JSON, "multi_gpu_train.json", str(probe)]
    args = overrides(dataset_dir=str(ct_series), output_dir=str(out), max_epochs=1, val_interval=1)
    run_bundle(BUNDLE, configs, args=args, processes=2)
    r0 = torch.load(out / "rank0.pt", weights_only=True)
    r1 = torch.load(out / "rank1.pt", weights_only=True)
    assert r0["iteration"] == r1["iteration"] == 2  # 4 volumes / 2 ranks, batch 1
    assert not set(r0["train"]) & set(r1["train"]), "ranks must cache different volumes"
    for key in ("quantizer.embeddings", "quantizer.cluster_size", "quantizer.embed_sum", "quantizer.initialized"):
        assert torch.equal(r0["weights"][key], r1["weights"][key]), key
    for key in r0["weights"]:
        assert torch.equal(r0["weights"][key], r1["weights"][key]), key
    assert "identical on all 2 ranks" in (out / "train.log").read_text()
    summary = json.loads((out / "metrics.json").read_text())
    assert 0 < summary["latest"]["val_codebook_usage"] <= 1


def test_inference_on_nrrd_metaimage_and_dicom_in_hounsfield_units(tmp_path):
    """inference.json (CT window) on a folder of tilted anisotropic LPS volumes (NRRD, MetaImage, DICOM series) with
    an identity network: one reconstruction per case on the input's grid, in HU clipped to the window."""
    from monai.bundle import ConfigParser

    from tests.helpers import check_restored_volume, write_format_cases

    array = np.round(np.random.default_rng(shifted_seed(6)).normal(-200.0, 600.0, (20, 18, 12))).astype(np.float32)
    cases = write_format_cases(tmp_path / "in", array)
    parser = ConfigParser()
    parser.read_config(str(BUNDLES / BUNDLE / "configs" / "inference.json"))
    settings = dict(dataset_dir=str(tmp_path / "in"), prediction_dir=str(tmp_path / "out"), device="cpu", **ARCH)
    settings["bundle_root"] = str(BUNDLES / BUNDLE)
    for key, value in {**settings, "network": "$torch.nn.Identity()", "ckpt_path": None}.items():
        parser[key] = value  # an identity network: no weights
    assert parser.get_parsed_content("intensity")["mode"] == "ct"
    parser.get_parsed_content("evaluator").run()
    assert parser.get_parsed_content("cases").finish()["written"] == len(cases)
    window = parser.get_parsed_content("ct_window")
    for case, path in cases.items():
        expected = np.clip(array, window["a_min"], window["a_max"])
        check_restored_volume(tmp_path / "out" / f"{case}_recon.nii.gz", path, expected)

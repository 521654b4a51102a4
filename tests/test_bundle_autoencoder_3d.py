# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Workflow tests of ``bundles/autoencoder_3d``, run as users run it: train -> evaluate -> inference, TorchScript
export, the run's record, preflight refusal, the JSON pipelines against their oracles and a 2-process torchrun job.
What every bundle does (settings refused, an edited pipeline, tracking, host reads, the model zoo's checks):
``tests/test_bundle_contract.py``; resume after crashes: ``tests/test_reliability.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from tests.bundle_cases import CASES
from tests.helpers import (
    BUNDLES,
    REPO_ROOT,
    STANDALONE_PYTHON,
    bundle_env,
    bundle_parser,
    config_arg,
    overrides,
    rank_probe,
    run_bundle,
    same_seeded_outputs,
    same_tensor,
    seed_args,
    shifted_seed,
    standalone_env,
)

BUNDLE = "autoencoder_3d"
TINY = dict(
    patch_size=[16, 16, 16],
    channels=[8, 16, 16],
    norm_num_groups=4,
    d_channels=8,
    d_num_layers=2,
    num_threads=1,
    log_interval=1,
)


def _tiny_network():
    """The autoencoder of a run with the :data:`TINY` settings (train.json's other network settings)."""
    from monai.networks.nets import AutoencoderKL

    return AutoencoderKL(
        spatial_dims=3,
        in_channels=1,
        out_channels=1,
        channels=TINY["channels"],
        latent_channels=3,
        num_res_blocks=1,
        norm_num_groups=TINY["norm_num_groups"],
        attention_levels=(False, False, True),
    )


@pytest.fixture(scope="module")
def phantoms(tmp_path_factory) -> Path:
    """The bundle's small data (4 training and 2 validation phantoms at 24^3, :mod:`tests.bundle_cases`)."""
    return Path(CASES[BUNDLE].write_data(tmp_path_factory.mktemp("phantoms"))["dataset_dir"])


@pytest.fixture(scope="module")
def trained(phantoms, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ae_run")
    args = overrides(
        dataset_dir=str(phantoms),
        output_dir=str(out),
        max_epochs=3,
        val_interval=1,
        adv_warmup_iterations=2,
        ckpt_interval=2,
        **TINY,
    )
    run_bundle(BUNDLE, ["train.json"], args=args)
    return out


def _tb_tags(log_dir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    return acc.Tags()


def test_training_outputs(trained):
    models = trained / "models"
    assert (models / "last.pt").is_file() and (models / "model.pt").is_file()
    ranked = sorted(models.glob("model_val_psnr=*_step=*.pt"))
    assert 1 <= len(ranked) <= 3
    last = torch.load(models / "last.pt", weights_only=True)
    assert last["trainer"]["iteration"] == 6 and last["trainer"]["epoch"] == 3
    assert {"autoencoder", "discriminator", "optimizer", "d_optimizer", "lr_scheduler", "rng"} <= set(last)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in last["autoencoder"])

    summary = json.loads((trained / "metrics.json").read_text())
    assert [h["step"] for h in summary["history"]] == [2, 4, 6]
    assert summary["best"]["val_psnr"] == max(h["val_psnr"] for h in summary["history"])
    for h in summary["history"]:  # the ranges of the metrics (MS-SSIM clips its negative factors to 0)
        assert np.isfinite(h["val_psnr"]) and -1 <= h["val_ssim"] <= 1 and 0 <= h["val_ms_ssim"] <= 1

    rows = (trained / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,epoch,tag,value"
    tags = {r.split(",")[2] for r in rows[1:]}
    assert {
        "train/loss",
        "train/recon_loss",
        "train/kl_loss",
        "train/samples_per_s",
        "train/data_wait",
        "train/peak_mem_gib",
        "train/lr_autoencoder",
        "val_psnr",
    } <= tags
    assert "train/d_loss" in tags and "train/adv_loss" in tags  # adversarial terms after the warm-up

    tb = _tb_tags(trained / "tensorboard")
    assert "train/loss" in tb["scalars"] and "val_psnr" in tb["scalars"]
    assert any(t.startswith("val/input_recon_error") for t in tb["images"])
    log = (trained / "train.log").read_text()
    assert "[rank 0]" in log and "saved checkpoint" in log


def test_training_records_its_settings(trained, phantoms):
    import hashlib

    record = json.loads((trained / "configs" / "run.json").read_text())
    assert record["bundle"] == BUNDLE
    assert record["version"] == json.loads((BUNDLES / BUNDLE / "configs" / "metadata.json").read_text())["version"]
    train_json = BUNDLES / BUNDLE / "configs" / "train.json"
    assert record["config_files"] == {str(train_json): "sha256:" + hashlib.sha256(train_json.read_bytes()).hexdigest()}
    settings = record["settings"]
    for key, value in TINY.items():  # every override that differs from train.json, as given
        assert settings[key] == value
    assert settings["dataset_dir"] == str(phantoms) and settings["max_epochs"] == 3
    assert "latent_channels" not in settings and "_meta_" not in settings  # defaults are not repeated
    assert record["command_line"]["channels"] == TINY["channels"]


def test_resume_with_other_network_settings_is_refused_and_keeps_the_record(trained, phantoms):
    record = (trained / "configs" / "run.json").read_bytes()
    last = (trained / "models" / "last.pt").read_bytes()
    args = overrides(output_dir=str(trained), **{**TINY, "channels": [16, 32, 32]}, dataset_dir=str(phantoms))
    result = run_bundle(BUNDLE, ["train.json"], args=args, check=False)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot restore 'autoencoder': checkpoint ")
    assert "channels: checkpoint [8, 16, 16], config [16, 32, 32]" in line and "Traceback" not in result.stderr
    assert (trained / "configs" / "run.json").read_bytes() == record  # the run's record is unchanged
    assert (trained / "models" / "last.pt").read_bytes() == last


def test_evaluate_matches_best_validation(trained, phantoms):
    # the network, the data folder and the validation settings come from the run's configs/run.json
    args = overrides(output_dir=str(trained), num_threads=1)
    run_bundle(BUNDLE, ["train.json", "evaluate.json"], run_id="run", args=args)
    evaluation = json.loads((trained / "eval" / "metrics.json").read_text())["latest"]
    best = json.loads((trained / "metrics.json").read_text())["best"]
    for key in ("val_psnr", "val_ssim", "val_ms_ssim"):
        assert evaluation[key] == pytest.approx(best[key], rel=1e-5)
    per_volume = (trained / "eval" / "metrics_per_volume.csv").read_text().splitlines()
    assert per_volume[0].split(",")[:2] == ["filename", "val_psnr"] and len(per_volume) == 3
    psnrs = [float(r.split(",")[1]) for r in per_volume[1:]]
    assert np.mean(psnrs) == pytest.approx(evaluation["val_psnr"], rel=1e-5)


def test_inference_reconstruct_and_encode(trained, phantoms):
    # no network override: the run's settings are read from its configs/run.json
    common = dict(dataset_dir=str(phantoms / "images"), output_dir=str(trained))
    run_bundle(BUNDLE, ["inference.json"], run_id="run", args=overrides(**common))
    run_bundle(BUNDLE, ["inference.json"], run_id="run", args=overrides(mode="encode", **common))
    source = nib.load(phantoms / "images" / "phantom_val_000.nii.gz")
    recon = nib.load(trained / "predictions" / "phantom_val_000_recon.nii.gz")
    latent = nib.load(trained / "predictions" / "phantom_val_000_latent.nii.gz")
    assert recon.shape == source.shape
    np.testing.assert_allclose(recon.affine, source.affine, atol=1e-5)
    assert np.isfinite(recon.get_fdata()).all()
    assert latent.shape == (6, 6, 6, 3)
    np.testing.assert_allclose(np.diag(latent.affine)[:3], 4 * np.diag(source.affine)[:3], atol=1e-5)
    assert len(list((trained / "predictions").glob("*_recon.nii.gz"))) == 6


def test_inference_without_inputs_fails_clearly(trained, tmp_path):
    result = run_bundle(
        BUNDLE,
        ["inference.json"],
        run_id="run",
        check=False,
        args=overrides(dataset_dir=str(tmp_path), output_dir=str(trained)),
    )
    assert result.returncode == 1
    # a user error: its message is the last line, without a traceback
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no input volumes found") and str(tmp_path) in last
    assert "NRRD (.nrrd, .nhdr)" in last and "DICOM series folders" in last
    assert "Traceback" not in result.stderr and "Failed to evaluate" not in result.stderr


def test_inference_with_a_network_that_does_not_fit_names_the_settings(trained, phantoms, tmp_path):
    """Against the run's record, a network override is refused before anything is built, naming both values; weights
    from elsewhere (``--ckpt_path``, no record) that do not fit the configured network are refused by the checkpoint
    check, naming the settings recorded in the checkpoint."""
    data = {"dataset_dir": str(phantoms / "images")}
    result = run_bundle(
        BUNDLE,
        ["inference.json"],
        run_id="run",
        check=False,
        args=overrides(**data, output_dir=str(trained), channels=[16, 32, 32]),
    )
    assert result.returncode == 1
    record = trained / "configs" / "run.json"
    assert f"'channels' is [16, 32, 32] here but the model was trained with [8, 16, 16] ({record})" in result.stderr
    assert "Traceback" not in result.stderr
    network = {k: TINY[k] for k in ("patch_size", "norm_num_groups")}
    elsewhere = overrides(**data, **network, output_dir=str(tmp_path), ckpt_path=str(trained / "models" / "model.pt"))
    result = run_bundle(
        BUNDLE, ["inference.json"], run_id="run", check=False, args=[*elsewhere, *overrides(channels=[16, 32, 32])]
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint ") and "does not fit the configured AutoencoderKL" in last
    assert "channels: checkpoint [8, 16, 16], config [16, 32, 32]" in last
    assert "tensors differ in shape" in last and "(the checkpoint's run: recorded in the checkpoint)" in last
    assert "size mismatch for" not in result.stderr and "Traceback" not in result.stderr


def _inference_parser(bundle: str, **settings):
    """``bundle``'s inference.json, parsed in this process with ``settings`` on the CPU."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(BUNDLES / bundle / "configs" / "inference.json"))
    for key, value in {"bundle_root": str(BUNDLES / bundle), "device": "cpu", **settings}.items():
        parser[key] = value
    return parser


def test_inference_on_nrrd_metaimage_and_dicom_keeps_geometry_and_units(tmp_path):
    """inference.json on a folder of tilted anisotropic LPS volumes (NRRD, MetaImage, DICOM series) with an identity
    network: one reconstruction per case, on the input's grid, in the input's units (clipped to its percentiles);
    with ``output_units`` ``normalised`` the same reconstruction in [0, 1]."""
    from tests.helpers import check_restored_volume, write_format_cases

    array = np.round(np.random.default_rng(shifted_seed(5)).normal(100.0, 300.0, (20, 18, 12))).astype(np.float32)
    cases = write_format_cases(tmp_path / "in", array)
    low, high = np.percentile(array, [0.5, 99.5])
    for units, expected in (
        ("input", np.clip(array, low, high)),
        ("normalised", (np.clip(array, low, high) - low) / (high - low)),
    ):
        parser = _inference_parser(
            BUNDLE,
            dataset_dir=str(tmp_path / "in"),
            prediction_dir=str(tmp_path / units),
            output_units=units,
            network="$torch.nn.Identity()",
            ckpt_path=None,  # no weights
            **{k: TINY[k] for k in ("patch_size", "channels", "norm_num_groups")},
        )
        assert parser.get_parsed_content("input_pattern") is None
        assert sorted(e["case_id"] for e in parser.get_parsed_content("inputs")) == sorted(cases)
        parser.get_parsed_content("evaluator").run()
        assert parser.get_parsed_content("cases").finish()["written"] == len(cases)
        assert sorted(p.name for p in (tmp_path / units).glob("*.nii.gz")) == sorted(f"{c}_recon.nii.gz" for c in cases)
        for case, path in cases.items():
            check_restored_volume(tmp_path / units / f"{case}_recon.nii.gz", path, expected)


def _train_parser(bundle: str, *extra: str, **settings):
    """``bundle``'s train.json (with ``extra`` config files merged after it), parsed in this process."""
    return bundle_parser(bundle, ["train.json", *extra], **settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"intensity": {"mode": "mri", "lower": 0.5, "upper": 99.5}, "spacing": None, "orientation": "RAS"},
        {"intensity": {"mode": "ct", "a_min": -300, "a_max": 500}, "spacing": [1.5, 1.25, 2.0], "orientation": "LPS"},
        {"intensity": {"mode": "none"}, "spacing": [2, 2, 2], "orientation": None},
    ],
    ids=["mri", "ct-spacing", "none-native"],
)
def test_json_pipelines_match_volume_transforms(tmp_path, settings):
    """The transform lists written in train.json and inference.json give the values, metadata and inverses of
    ``volume_transforms`` (training crops under one seed, validation and inference volumes)."""
    from monai.transforms import Compose

    from tests.oracles import volume_transforms

    rng = np.random.default_rng(shifted_seed(3))
    affine = np.array([[-1.2, 0.0, 0.1, 5.0], [0.0, 0.9, 0.0, -3.0], [0.0, 0.0, 1.7, 2.0], [0.0, 0.0, 0.0, 1.0]])
    path = tmp_path / "vol.nii.gz"
    nib.save(nib.Nifti1Image(rng.normal(100.0, 400.0, (14, 12, 10)).astype(np.float32), affine), str(path))
    patch = {"patch_size": [16, 16, 8], "num_samples": 2}
    keys = {k: settings[k] for k in ("intensity", "spacing", "orientation")}
    parser = _train_parser(BUNDLE, "tiny.json", **settings, **patch)

    train, expected = parser.get_parsed_content("train#preprocessing"), volume_transforms(**keys, **patch)
    assert isinstance(train, Compose) and [type(t).__name__ for t in train.transforms][-3:] == [
        "EnsureTyped",
        "ToDeviced",
        "RandSpatialCropSamplesd",
    ]
    assert len(train({"image": str(path)})) == 2  # num_samples crops
    same_seeded_outputs(train, expected, {"image": str(path)})

    validate = parser.get_parsed_content("validate#preprocessing")
    item = validate({"image": str(path)})["image"]
    same_tensor(item, volume_transforms(**keys, **patch, train=False)({"image": str(path)})["image"])

    for units in ("input", "normalised"):
        inference = _inference_parser(BUNDLE, output_units=units, **keys, patch_size=patch["patch_size"])
        inference_pre = inference.get_parsed_content("preprocessing")
        expected = volume_transforms(**keys, **patch, train=False, invertible_intensity=units == "input")
        item, expected_item = inference_pre({"image": str(path)}), expected({"image": str(path)})
        same_tensor(item["image"], expected_item["image"])
        restored, expected_restored = inference_pre.inverse(item), expected.inverse(expected_item)
        same_tensor(restored["image"], expected_restored["image"])
        inference.get_parsed_content("postprocessing")  # checks that output_units fits the preprocessing


def test_verify_net_in_out():
    cmd = [
        sys.executable,
        "-m",
        "monai.bundle",
        "verify_net_in_out",
        "network",
        "--meta_file",
        str(BUNDLES / BUNDLE / "configs" / "metadata.json"),
        "--config_file",
        config_arg(BUNDLE, "inference.json"),
        "--n",
        "4",
        *overrides(**{k: TINY[k] for k in ("channels", "norm_num_groups")}, device="cpu"),
    ]
    cmd += seed_args(BUNDLE, ["inference.json"], cmd)  # empty unless inference.json defines a seed
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data shape of network is verified with no error" in result.stdout + result.stderr


def test_ckpt_export_trace_matches_pytorch(trained, tmp_path):
    exported = tmp_path / "model.ts"
    cmd = [
        sys.executable,
        "-m",
        "monai.bundle",
        "ckpt_export",
        "network",
        "--filepath",
        str(exported),
        "--ckpt_file",
        str(trained / "models" / "model.pt"),
        "--meta_file",
        str(BUNDLES / BUNDLE / "configs" / "metadata.json"),
        "--config_file",
        config_arg(BUNDLE, "inference.json"),
        "--use_trace",
        "True",
        "--input_shape",
        "[1,1,16,16,16]",
        *overrides(output_dir=str(trained), device="cpu"),  # the network of the run (its configs/run.json)
    ]
    cmd += seed_args(BUNDLE, ["inference.json"], cmd)  # empty unless inference.json defines a seed
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ts = torch.jit.load(str(exported))

    from common.checkpoint_io import load_network_weights
    from common.networks.wrappers import ReconstructionNetwork

    net = ReconstructionNetwork(load_network_weights(_tiny_network(), trained / "models" / "model.pt")).eval()
    x = torch.rand(1, 1, 16, 16, 16, generator=torch.Generator().manual_seed(shifted_seed(0)))
    with torch.no_grad():
        torch.testing.assert_close(ts(x), net(x), rtol=1e-4, atol=1e-5)


def test_mlflow_tracking(phantoms, tmp_path):
    pytest.importorskip("mlflow")
    args = overrides(
        dataset_dir=str(phantoms),
        output_dir=str(tmp_path),
        max_epochs=1,
        val_interval=1,
        adv_warmup_iterations=0,
        **TINY,
    ) + ["--tracking", "mlflow"]
    run_bundle(BUNDLE, ["train.json"], args=args)
    db = tmp_path / "mlruns.db"
    assert db.is_file()
    import sqlite3

    with sqlite3.connect(db) as conn:
        keys = {row[0] for row in conn.execute("select distinct key from metrics")}
    assert "train_loss" in keys and "val_psnr" in keys


def test_preflight_refuses_bad_data_and_writes_nothing(phantoms, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    good = nib.load(phantoms / "images" / "phantom_train_000.nii.gz")
    nan = np.asarray(good.dataobj, dtype=np.float32).copy()
    nan[3, 3, 3] = np.nan
    nib.save(nib.Nifti1Image(nan, good.affine), data / "nan.nii.gz")
    nib.save(nib.Nifti1Image(np.zeros((24, 24), np.float32), np.eye(4)), data / "flat.nii.gz")
    (data / "datalist.json").write_text(
        json.dumps(
            {
                "training": [
                    {"image": str(phantoms / "images" / "phantom_train_000.nii.gz")},
                    {"image": "missing.nii.gz"},
                    {"image": "nan.nii.gz"},
                    {"image": "flat.nii.gz"},
                ],
                "validation": [{"image": str(phantoms / "images" / "phantom_val_000.nii.gz")}],
            }
        )
    )
    out = tmp_path / "out"
    result = run_bundle(
        BUNDLE, ["train.json"], check=False, args=overrides(dataset_dir=str(data), output_dir=str(out), **TINY)
    )
    assert result.returncode != 0
    text = result.stdout + result.stderr
    for name in ("missing.nii.gz", "nan.nii.gz", "flat.nii.gz"):
        assert name in text
    assert "phantom_train_000" not in text.split("preflight found")[-1]
    assert not out.exists()


def test_torchrun_two_processes(phantoms, tmp_path):
    """2-process gloo DDP: ranks train on different partitions and end with identical weights."""
    out = tmp_path / "ddp"
    probe = rank_probe(
        BUNDLE,
        tmp_path / "probe.json",
        "{'weights': @autoencoder.state_dict(), 'd_weights': @discriminator.state_dict(), "
        "'train': [d['image'] for d in @train#dataset.data], 'iteration': @train#trainer.state.iteration}",
    )
    configs = ["train.json", "multi_gpu_train.json", str(probe)]
    args = overrides(
        dataset_dir=str(phantoms),
        output_dir=str(out),
        max_epochs=2,
        val_interval=1,
        adv_warmup_iterations=1,
        ckpt_interval=1,
        **TINY,
    )
    run_bundle(BUNDLE, configs, args=args, processes=2)
    r0 = torch.load(out / "rank0.pt", weights_only=True)
    r1 = torch.load(out / "rank1.pt", weights_only=True)
    assert r0["iteration"] == r1["iteration"] == 2  # 4 volumes / 2 ranks / batch 2 = 1 step per epoch
    assert not set(r0["train"]) & set(r1["train"]), "ranks must cache different volumes"
    assert len(set(r0["train"]) | set(r1["train"])) == 4
    for key in r0["weights"]:
        assert torch.equal(r0["weights"][key], r1["weights"][key]), key
    for key in r0["d_weights"]:
        if "running" not in key and "num_batches" not in key:  # BatchNorm statistics stay per rank on CPU
            assert torch.equal(r0["d_weights"][key], r1["d_weights"][key]), key
    log = (out / "train.log.rank1").read_text()
    assert "[rank 1]" in log
    assert (out / "models" / "last.pt").is_file() and not (out / "train.log").read_text().count("[rank 1]")


def test_smartcache_training(phantoms, tmp_path):
    """cache_rate < 1 with replace_rate > 0 trains from a SmartCache whose contents rotate between epochs."""
    out = tmp_path / "smart"
    probe = tmp_path / "probe.json"
    record = (
        "$torch.save({'type': type(@train#dataset).__name__, 'cache_num': @train#dataset.cache_num, "
        "'iteration': @train#trainer.state.iteration, 'items': [str(d['image']) for d in @train#dataset.data]}, "
        "@output_dir + '/probe.pt')"
    )
    probe.write_text(json.dumps({"finalize": [record]}))
    args = overrides(
        dataset_dir=str(phantoms),
        output_dir=str(out),
        max_epochs=4,
        val_interval=4,
        cache_rate=0.5,
        replace_rate=0.5,
        adv_warmup_iterations=1,
        **TINY,
    )
    run_bundle(BUNDLE, ["train.json", str(probe)], args=args)
    probe_out = torch.load(out / "probe.pt", weights_only=True)
    assert probe_out["type"] == "SmartCacheDataset" and probe_out["cache_num"] == 2
    assert probe_out["iteration"] == 4  # an epoch is the 2 cached volumes = 1 step of batch 2
    assert len(probe_out["items"]) == 4


def test_compile_saves_clean_keys(phantoms, tmp_path):
    """``--compile True`` (torch.compile, inductor on the CPU) trains and its checkpoints load into a plain network."""
    out = tmp_path / "compiled"
    args = overrides(
        dataset_dir=str(phantoms),
        output_dir=str(out),
        max_epochs=1,
        val_interval=1,
        adv_warmup_iterations=0,
        compile=True,
        **TINY,
    )
    run_bundle(BUNDLE, ["train.json"], args=args, timeout=900)
    from common.checkpoint_io import load_network_weights

    last = torch.load(out / "models" / "last.pt", weights_only=True)
    assert not any("_orig_mod" in k or k.startswith("module.") for k in last["autoencoder"])
    load_network_weights(_tiny_network(), out / "models" / "model.pt")  # strict load of the best weights


def test_packaged_run_carries_its_settings(trained, phantoms, tmp_path):
    """The zip of a run's weights carries the run's settings in its ``train.json`` (locations left out) and its
    ``run.json``, also when the weights file was copied out of the run folder (the file carries the record);
    unzipped elsewhere, its inference runs with no network override."""
    import shutil
    import zipfile

    from common.bundle_tools.package import package_bundle
    from common.checkpoint_io import checkpoint_record

    train_defaults = json.loads((BUNDLES / BUNDLE / "configs" / "train.json").read_text())
    copied = tmp_path / "elsewhere" / "weights.pt"
    copied.parent.mkdir()
    shutil.copy(trained / "models" / "model.pt", copied)
    assert checkpoint_record(copied) == json.loads((trained / "configs" / "run.json").read_text())
    zip_path = package_bundle(BUNDLE, trained / "models" / "model.pt", tmp_path / "dist", weights_inside=True)
    from_copy = package_bundle(BUNDLE, copied, tmp_path / "dist_copy", weights_inside=True)
    with zipfile.ZipFile(zip_path) as zf, zipfile.ZipFile(from_copy) as copy_zf:
        train = json.loads(zf.read(f"{BUNDLE}/configs/train.json"))
        record = json.loads(zf.read(f"{BUNDLE}/configs/run.json"))
        for item in ("configs/train.json", "configs/run.json"):
            assert copy_zf.read(f"{BUNDLE}/{item}") == zf.read(f"{BUNDLE}/{item}"), item
        zf.extractall(tmp_path / "anywhere")
    assert record == json.loads((trained / "configs" / "run.json").read_text())
    from common.runs import LOCATION_IDS

    for key, value in TINY.items():
        assert train[key] == (train_defaults[key] if key in LOCATION_IDS else value), key
    assert train["dataset_dir"] == train_defaults["dataset_dir"]  # where this run's data was is not shipped
    bundle = tmp_path / "anywhere" / BUNDLE
    env = standalone_env()
    cmd = [*STANDALONE_PYTHON, "-m", "monai.bundle", "run", "--config_file", "configs/inference.json"]
    cmd += ["--dataset_dir", str(phantoms / "images"), "--device", "cpu"]
    result = subprocess.run(cmd, cwd=bundle, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    recon = nib.load(bundle / "outputs" / "predictions" / "phantom_val_000_recon.nii.gz")
    assert recon.shape == nib.load(phantoms / "images" / "phantom_val_000.nii.gz").shape

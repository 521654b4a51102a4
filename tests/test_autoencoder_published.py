# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Published autoencoders (``common.autoencoder.published``) against the publishers' own code path, without their
files: each network is built from the publisher's configuration with MONAI's classes, its state dict saved in the
layout of the released file, and loaded through the collection; encoding and reconstruction of a real volume (a
crop of the MNI152 T1 template, and a CT phantom in Hounsfield units) agree to 1e-6. Damaged or mismatched files
are refused with one line naming the file."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.bundle import ConfigParser, ConfigWorkflow
from monai.transforms import ScaleIntensityRange, ScaleIntensityRangePercentiles

from common.autoencoder.published import (
    PUBLISHED,
    network_problems,
    published_network,
    published_settings,
    split_problems,
)
from common.checkpoint_io import CheckpointError, load_published_weights
from common.data.intensity import intensity_transform
from common.demo.images import make_ct_phantom, mni_template_paths
from common.errors import user_error_in_chain
from tests.helpers import BUNDLES, bundle_env

# the publishers' configurations as they are written (MONAI model zoo: maisi_ct_generative configs/inference.json
# "autoencoder_def"; brats_mri_generative_diffusion configs/train_autoencoder.json "autoencoder_def", with its ids
# spatial_dims 3, image_channels 1, latent_channels 8); MAISI's norm_float16 is true there, which runs on a GPU only
PUBLISHER_CONFIGS = {
    "maisi_vae": {
        "_target_": "monai.apps.generation.maisi.networks.autoencoderkl_maisi.AutoencoderKlMaisi",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 1,
        "latent_channels": 4,
        "num_channels": [64, 128, 256],
        "num_res_blocks": [2, 2, 2],
        "norm_num_groups": 32,
        "norm_eps": 1e-06,
        "attention_levels": [False, False, False],
        "with_encoder_nonlocal_attn": False,
        "with_decoder_nonlocal_attn": False,
        "use_checkpointing": False,
        "use_convtranspose": False,
        "norm_float16": False,
        "num_splits": 1,
        "dim_split": 1,
    },
    "brats_ldm_autoencoder": {
        "_target_": "monai.networks.nets.autoencoderkl.AutoencoderKL",
        "spatial_dims": 3,
        "in_channels": 1,
        "out_channels": 1,
        "latent_channels": 8,
        "channels": [64, 128, 256],
        "num_res_blocks": 2,
        "norm_num_groups": 32,
        "norm_eps": 1e-06,
        "attention_levels": [False, False, False],
        "with_encoder_nonlocal_attn": False,
        "with_decoder_nonlocal_attn": False,
        "include_fc": False,
    },
}
SIZE = 16  # voxels per side of the test crops (the latent is 4^3)


def _publisher_network(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    parser = ConfigParser({"net": PUBLISHER_CONFIGS[name]})
    return parser.get_parsed_content("net").eval()


def _released_file(name: str, network: torch.nn.Module, path) -> None:
    """The network's weights saved as the publisher released them: MAISI a plain state dict; the BraTS
    autoencoder in MONAI Generative's key names (an up-sampling block's ``postconv`` was ``conv``)."""
    state = network.state_dict()
    if name == "brats_ldm_autoencoder":
        state = {k.replace(".postconv.", ".conv."): v for k, v in state.items()}
        assert any(".conv.conv." in k for k in state)
    torch.save(state, path)


def _real_input(name: str) -> torch.Tensor:
    """A SIZE^3 volume in the publisher's intensity convention, made with the publisher's transforms."""
    if name == "maisi_vae":
        ct = make_ct_phantom((SIZE, SIZE, SIZE), seed=3)  # Hounsfield units
        scaled = ScaleIntensityRange(a_min=-1000, a_max=1000, b_min=0.0, b_max=1.0, clip=True)(ct[None])
    else:
        t1 = np.asarray(nib.load(mni_template_paths()["t1"]).dataobj, dtype=np.float32)[::2, ::2, ::2]
        centre = [s // 2 for s in t1.shape]
        crop = t1[tuple(slice(c - SIZE // 2, c + SIZE // 2) for c in centre)]
        scaled = ScaleIntensityRangePercentiles(lower=0, upper=99.5, b_min=0, b_max=1)(crop[None])
    return torch.as_tensor(np.asarray(scaled), dtype=torch.float32)[None]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_collection_reproduces_the_publishers_code_path(name, tmp_path):
    publisher = _publisher_network(name)
    path = tmp_path / "released.pt"
    _released_file(name, publisher, path)
    theirs = _publisher_network(name, seed=1)  # their loading code, as their configs call it
    released = torch.load(path, weights_only=True)
    if name == "brats_ldm_autoencoder":
        theirs.load_old_state_dict(released)
    else:
        theirs.load_state_dict(released)
    ours = published_network(name, num_splits=1 if name == "maisi_vae" else None).eval()
    assert load_published_weights(ours, path) == len(publisher.state_dict())
    x = _real_input(name)
    with torch.no_grad():
        assert torch.allclose(ours.encode(x)[0], theirs.encode(x)[0], atol=1e-6, rtol=0)
        reconstruction = ours.reconstruct(x)
        assert torch.allclose(reconstruction, theirs.reconstruct(x), atol=1e-6, rtol=0)
    assert reconstruction.shape == x.shape
    # the collection's intensity setting of the preset is the publisher's transform
    preset = PUBLISHED[name][2]
    image = make_ct_phantom((SIZE,) * 3, seed=3)[None] if name == "maisi_vae" else 1000 * x[0].numpy() + 7
    mine = np.asarray(intensity_transform(["image"], preset)({"image": image})["image"])
    if name == "maisi_vae":
        reference = ScaleIntensityRange(a_min=-1000, a_max=1000, b_min=0.0, b_max=1.0, clip=True)(image)
    else:
        reference = ScaleIntensityRangePercentiles(lower=0, upper=99.5, b_min=0, b_max=1)(image)
    np.testing.assert_allclose(mine, np.asarray(reference), atol=1e-6)


def test_a_training_checkpoint_and_wrapped_keys_load(tmp_path):
    """A full training checkpoint (weights under ``model`` beside optimizer state) with DDP's ``module.``
    prefixes loads the same weights."""
    publisher = _publisher_network("brats_ldm_autoencoder")
    optimizer = torch.optim.Adam(publisher.parameters())
    state = {f"module.{k}": v for k, v in publisher.state_dict().items()}
    torch.save({"model": state, "optimizer": optimizer.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    ours = published_network("brats_ldm_autoencoder")
    load_published_weights(ours, tmp_path / "ckpt.pt")
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in publisher.state_dict().items())


def test_files_that_do_not_fit_are_refused_naming_the_file(tmp_path):
    network = published_network("brats_ldm_autoencoder")
    state = network.state_dict()
    # a layer missing (MONAI's load_old_state_dict would keep it random and say nothing)
    torch.save({k: v for k, v in state.items() if not k.startswith("decoder.blocks.2.")}, tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match=r"missing.pt' do not fit the AutoencoderKL: \d+ of the AutoencoderKL"):
        load_published_weights(network, tmp_path / "missing.pt")
    # another number of residual blocks per level: tensors the network does not have
    other = dict(PUBLISHER_CONFIGS["brats_ldm_autoencoder"], num_res_blocks=3)
    torch.save(ConfigParser({"n": other}).get_parsed_content("n").state_dict(), tmp_path / "levels.pt")
    with pytest.raises(CheckpointError, match=r"levels.pt' do not fit .* file tensors are not in the network"):
        load_published_weights(network, tmp_path / "levels.pt")
    # MAISI's file into the BraTS network: shapes differ (4 vs 8 latent channels)
    maisi = published_network("maisi_vae", num_splits=1)
    torch.save(maisi.state_dict(), tmp_path / "maisi.pt")
    with pytest.raises(CheckpointError, match=r"maisi.pt' do not fit .*differ in shape"):
        load_published_weights(network, tmp_path / "maisi.pt")
    # an optimizer state alone, and a truncated file
    torch.save({"optimizer": torch.optim.SGD(network.parameters(), lr=0.1).state_dict()}, tmp_path / "opt.pt")
    with pytest.raises(CheckpointError, match=r"opt.pt' hold no state dict of tensors"):
        load_published_weights(network, tmp_path / "opt.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "maisi.pt").read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"cut.pt' is unreadable"):
        load_published_weights(network, tmp_path / "cut.pt")
    assert all(torch.equal(network.state_dict()[k], v) for k, v in state.items())  # nothing was loaded


def test_published_network_settings():
    with pytest.raises(ValueError, match=r"'network' must be one of \['brats_ldm_autoencoder', 'maisi_vae'\]"):
        published_network("maisi")
    with pytest.raises(ValueError, match="'brats_ldm_autoencoder' has none"):
        published_network("brats_ldm_autoencoder", num_splits=2)
    with pytest.raises(ValueError, match="'dim_split' must be 0, 1 or 2"):
        published_network("maisi_vae", dim_split=3)
    maisi = published_network("maisi_vae")
    assert maisi.encoder.blocks[0].num_splits == 8 and not maisi.encoder.blocks[1].norm1.norm_float16  # CPU


# ------------------------------------------------------------------------------------- in the autoencoder bundle
CONFIGS = BUNDLES / "autoencoder_3d" / "configs"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_preset_file_is_the_publishers_network(name):
    """``configs/<name>.json`` holds what :func:`published_settings` derives from the publisher's configuration
    (one owner: :data:`PUBLISHED`), and those settings pass the bundle's checks."""
    assert json.loads((CONFIGS / f"{name}.json").read_text()) == published_settings(name)
    settings = published_settings(name)
    given = {k: settings[k] for k in ("channels", "latent_channels", "num_res_blocks", "norm_num_groups")}
    given.update(attention_levels=settings["attention_levels"], with_nonlocal_attn=settings["with_nonlocal_attn"])
    assert network_problems(name, **given, num_splits=None, dim_split=None) == []


def test_architecture_settings_are_checked():
    ours = {"channels": [32, 64, 64], "latent_channels": 3, "num_res_blocks": 1, "norm_num_groups": 16}
    ours.update(attention_levels=[False, False, True], with_nonlocal_attn=True)
    assert network_problems("autoencoder", **ours, num_splits=None, dim_split=None) == []
    (problem,) = network_problems("maisi_vae", **ours, num_splits=None, dim_split=None)
    assert problem.startswith("'architecture' 'maisi_vae' is the publisher's network, but 'channels' [32, 64, 64]")
    assert "merge its preset configs/maisi_vae.json" in problem
    assert network_problems("maisi", **ours, num_splits=None, dim_split=None) == [
        "'architecture' must be one of ['autoencoder', 'maisi_vae', 'brats_ldm_autoencoder'], got 'maisi'."
    ]
    assert "has none (use null)" in network_problems("autoencoder", **ours, num_splits=2, dim_split=None)[0]
    # the publisher's 8 splits along dimension 1 need a window of 96 voxels there (96 / 4 / 8 = 3)
    assert split_problems("maisi_vae", [96, 96, 96], None, None) == []
    (problem,) = split_problems("maisi_vae", [64, 64, 64], None, None)
    assert "pieces of 2 voxels at MAISI's deepest level (16)" in problem and "num_splits <= 5" in problem
    assert split_problems("maisi_vae", [64, 64, 64], 5, None) == split_problems("maisi_vae", [64, 64, 64], 8, 0)[:0]
    assert split_problems("brats_ldm_autoencoder", [16, 16, 16], None, None) == []


def test_a_training_run_starts_from_the_publishers_file(tmp_path):
    """``--architecture`` by preset file and ``--pretrained_weights`` in the publisher's layout: the training
    workflow's autoencoder holds the file's weights after ``initialize``; a file of another network is refused
    there, before any output is written."""
    publisher = _publisher_network("brats_ldm_autoencoder", seed=4)
    _released_file("brats_ldm_autoencoder", publisher, tmp_path / "model_autoencoder.pt")
    configs = [str(CONFIGS / f) for f in ("train.json", "tiny.json", "brats_ldm_autoencoder.json")]
    out = tmp_path / "run"
    workflow = ConfigWorkflow(
        config_file=configs,
        workflow_type="train",
        output_dir=str(out),
        pretrained_weights=str(tmp_path / "model_autoencoder.pt"),
    )
    workflow.initialize()
    network = workflow.parser.get_parsed_content("autoencoder")
    assert all(torch.equal(network.state_dict()[k], v) for k, v in publisher.state_dict().items())
    torch.save(published_network("maisi_vae", num_splits=1).state_dict(), tmp_path / "maisi.pt")
    other = ConfigWorkflow(
        config_file=configs,
        workflow_type="train",
        output_dir=str(tmp_path / "other"),
        pretrained_weights=str(tmp_path / "maisi.pt"),
    )
    with pytest.raises(Exception) as info:  # noqa: PT011 - MONAI wraps it
        other.initialize()
    assert "maisi.pt' do not fit the AutoencoderKL" in str(user_error_in_chain(info.value))
    assert not (tmp_path / "other").exists()


def test_zero_shot_inference_on_the_publishers_file(tmp_path):
    """``inference.json`` + the preset, ``--ckpt_path`` the publisher's file (no training run): the volume is
    reconstructed by the publisher's network with the file's weights (the MONAI Generative layout here)."""
    import subprocess
    import sys

    publisher = _publisher_network("brats_ldm_autoencoder", seed=2)
    _released_file("brats_ldm_autoencoder", publisher, tmp_path / "model_autoencoder.pt")
    (tmp_path / "in").mkdir()
    t1 = nib.load(mni_template_paths()["t1"])
    crop = np.asarray(t1.dataobj, dtype=np.float32)[80:112, 96:128, 64:96]
    nib.save(nib.Nifti1Image(crop, np.diag([1.0, 1.0, 1.0, 1.0])), tmp_path / "in" / "t1.nii.gz")
    config = json.dumps([str(CONFIGS / "inference.json"), str(CONFIGS / "brats_ldm_autoencoder.json")])
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", config, "--ckpt_path"]
    cmd += [str(tmp_path / "model_autoencoder.pt"), "--output_dir", str(tmp_path / "zero"), "--dataset_dir"]
    cmd += [str(tmp_path / "in"), "--patch_size", "[32,32,32]", "--output_units", "normalized"]
    result = subprocess.run(cmd, env=bundle_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    written = nib.load(tmp_path / "zero" / "predictions" / "t1_recon.nii.gz").get_fdata()
    x = torch.as_tensor(np.asarray(ScaleIntensityRangePercentiles(lower=0, upper=99.5, b_min=0, b_max=1)(crop[None])))
    with torch.no_grad():
        expected = publisher.reconstruct(x[None].float())[0, 0].numpy()
    assert written.shape == crop.shape
    np.testing.assert_allclose(written, expected, atol=1e-4)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_fast_ddpm_latents_are_the_publishers(name, tmp_path):
    """fast_ddpm_3d's latent mode in a published latent space: ``latent_config`` the autoencoder bundle's train.json
    with the preset (and the encoding window), ``latent_ckpt`` the publisher's file; its codec encodes to the
    publisher's posterior mean and decodes with the publisher's decoder."""
    from common.diffusion.latent import codec_from_bundle

    publisher = _publisher_network(name, seed=6)
    _released_file(name, publisher, tmp_path / "released.pt")
    window = {"patch_size": [SIZE] * 3, **({"num_splits": 1} if name == "maisi_vae" else {})}
    (tmp_path / "window.json").write_text(json.dumps(window))
    configs = [str(CONFIGS / "train.json"), str(CONFIGS / f"{name}.json"), str(tmp_path / "window.json")]
    latent_channels = published_settings(name)["latent_channels"]
    codec = codec_from_bundle(configs, str(tmp_path / "released.pt"), latent_channels, downsample=[4, 4, 4])
    x = _real_input(name)
    with torch.no_grad():
        latent = codec.encode(x * 2 - 1)  # the codec takes images in [-1, 1]
        assert torch.allclose(latent, publisher.encode(x)[0], atol=1e-5, rtol=0)
        decoded = codec.decode(latent)
        assert torch.allclose((decoded + 1) / 2, publisher.decode(latent), atol=1e-5, rtol=0)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The latent codec of latent diffusion: per-channel encoding/decoding with a frozen AutoencoderKL or VQ-GAN,
sliding windows, latent-scale calibration, and building the codec from an ``autoencoder_3d`` bundle run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Engine
from monai.bundle import ConfigParser
from torch import nn

from common.diffusion.latent import LatentCodec, LatentScaleCalibration, codec_from_bundle, load_latent_codec
from common.vqgan.networks import VQGAN
from tests.helpers import BUNDLES, tiny_autoencoder

torch.set_num_threads(1)

AE_CONFIGS = [
    str(BUNDLES / "autoencoder_3d" / "configs" / "train.json"),
    str(BUNDLES / "autoencoder_3d" / "configs" / "tiny.json"),
]


# ---------------------------------------------------------------------------------------------- helpers
def _volume(*shape: int, seed: int = 0) -> torch.Tensor:
    """A volume in [-1, 1]."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _ae_codec(**kwargs) -> LatentCodec:
    return LatentCodec(tiny_autoencoder(), roi_size=[16, 16, 16], downsample=2, latent_channels=2, **kwargs)


def _vqgan() -> VQGAN:
    torch.manual_seed(0)
    net = VQGAN(n_hiddens=4, downsample=(4, 4, 4), embedding_dim=4, n_codes=32, norm_num_groups=4)
    net.train()
    with torch.no_grad():
        net(torch.rand(2, 1, 16, 16, 16, generator=torch.Generator().manual_seed(1)))  # initialises the codebook
    assert bool(net.quantizer.initialized)
    return net.eval()


def _vq_codec() -> LatentCodec:
    return LatentCodec(_vqgan(), roi_size=[16, 16, 16], downsample=[4, 4, 4], latent_channels=4)


class _LocalAutoencoder(nn.Module):
    """A purely local 'autoencoder' (2x2x2 block means; nearest upsampling): window stitching is exact for it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.0))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.avg_pool3d(x, 2) * self.weight
        return torch.cat([pooled, pooled**2], dim=1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return F.interpolate(z[:, :1], scale_factor=2, mode="nearest")


# ---------------------------------------------------------------------------------------------- AutoencoderKL codec
def test_ae_encode_shape_and_channel_blocks():
    codec = _ae_codec()
    image = _volume(2, 3, 16, 16, 16)
    latent = codec.encode(image)
    assert latent.shape == (2, 3 * 2, 8, 8, 8)
    for c in range(3):
        alone = codec.encode(image[:, c : c + 1])
        torch.testing.assert_close(latent[:, 2 * c : 2 * c + 2], alone)
        # the posterior mean of the [0, 1] image, computed by the autoencoder itself
        z_mu = codec.autoencoder.encode((image[:, c : c + 1] + 1) / 2)[0]
        torch.testing.assert_close(latent[:, 2 * c : 2 * c + 2], z_mu)
    assert not torch.allclose(latent[:, 0:2], latent[:, 2:4])  # the channels really differ


def test_ae_encode_of_a_volume_that_fits_the_roi_is_one_pass():
    codec = LatentCodec(tiny_autoencoder(), roi_size=[16, 16, 16], downsample=2, latent_channels=2)
    image = _volume(1, 1, 16, 12, 16, seed=3)  # fits the roi: no windows
    expected = tiny_autoencoder().encode((image + 1) / 2)[0]
    torch.testing.assert_close(codec.encode(image), expected)


def test_ae_encode_larger_volume_uses_windows():
    codec = _ae_codec()
    image = _volume(1, 1, 24, 24, 16, seed=4)
    latent = codec.encode(image)
    assert latent.shape == (1, 2, 12, 12, 8)
    # the blended windows differ from one pass over the whole volume (the network sees the window borders)
    single = codec.autoencoder.encode((image + 1) / 2)[0]
    assert not torch.allclose(latent, single, atol=1e-4)


def test_sliding_windows_equal_one_pass_for_a_local_autoencoder():
    image = _volume(1, 2, 24, 32, 16, seed=5)
    windowed = LatentCodec(_LocalAutoencoder(), roi_size=[8, 8, 8], downsample=2, latent_channels=2, overlap=0.5)
    single = LatentCodec(_LocalAutoencoder(), roi_size=[32, 32, 32], downsample=2, latent_channels=2)
    latent = windowed.encode(image)
    assert latent.shape == (1, 4, 12, 16, 8)
    torch.testing.assert_close(latent, single.encode(image), atol=1e-5, rtol=1e-5)
    pooled = F.avg_pool3d((image + 1) / 2, 2)
    torch.testing.assert_close(latent[:, 2:3], pooled[:, 1:2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(windowed.decode(latent), single.decode(latent), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(17, 16, 16), (16, 16, 15)])
def test_encode_rejects_a_volume_not_divisible_by_the_downsampling(shape):
    with pytest.raises(ValueError, match="not divisible"):
        _ae_codec().encode(_volume(1, 1, *shape))


def test_ae_decode_one_channel_per_latent_block():
    codec = _ae_codec()
    latent = torch.randn(2, 4, 8, 8, 8, generator=torch.Generator().manual_seed(6))
    image = codec.decode(latent)
    assert image.shape == (2, 2, 16, 16, 16)
    for c in range(2):
        expected = codec.autoencoder.decode(latent[:, 2 * c : 2 * c + 2]) * 2 - 1  # [0, 1] -> [-1, 1]
        torch.testing.assert_close(image[:, c : c + 1], expected)
    with pytest.raises(ValueError, match="multiple of 2"):
        codec.decode(latent[:, :3])


def test_ae_round_trip_maps_back_to_minus_one_one_space():
    """Decoding the encoding gives the autoencoder's own (posterior-mean) reconstruction, shifted to [-1, 1]."""
    codec = _ae_codec()
    image = _volume(1, 1, 16, 16, 16, seed=7)
    recon = codec.decode(codec.encode(image))
    expected = codec.autoencoder.reconstruct((image + 1) / 2) * 2 - 1
    torch.testing.assert_close(recon, expected, atol=1e-5, rtol=1e-5)


def test_autoencoder_is_frozen_and_stays_in_eval_mode():
    codec = _ae_codec()
    assert all(not p.requires_grad for p in codec.autoencoder.parameters())
    codec.train()
    assert codec.training
    assert not any(m.training for m in codec.autoencoder.modules())
    codec.eval()
    codec.train(True)
    assert not codec.autoencoder.training


# ---------------------------------------------------------------------------------------------- VQ-GAN codec
def test_vqgan_encode_is_the_continuous_latent_per_channel():
    codec = _vq_codec()
    image = _volume(1, 2, 16, 16, 32, seed=8)
    latent = codec.encode(image)
    assert latent.shape == (1, 8, 4, 4, 8)
    for c in range(2):
        torch.testing.assert_close(latent[:, 4 * c : 4 * c + 4], codec.encode(image[:, c : c + 1]))
    direct = codec.autoencoder.encode((image[:, :1, :, :, :16] + 1) / 2)
    torch.testing.assert_close(codec.encode(image[:, :1, :, :, :16]), direct)


def _assert_nearest(indices: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor) -> None:
    """Every index is a nearest code of its row: its float64 squared distance is the minimum up to the float32
    rounding of ``EMAVectorQuantizer.nearest`` (``||e||^2 - 2 x.e``: about ``D + 2`` ulps of ``||x||^2 + max
    ||e||^2`` per value; 8x that), so a near-tie may go either way and nothing else may."""
    d = ((rows.double()[:, None] - codes.double()[None]) ** 2).sum(-1)
    excess = d.gather(1, indices[:, None]).squeeze(1) - d.min(1).values
    scale = (rows.double() ** 2).sum(1) + (codes.double() ** 2).sum(1).max()
    assert (excess <= 8 * (codes.shape[1] + 2) * torch.finfo(torch.float32).eps * scale).all()


def test_vqgan_decode_quantizes_first():
    codec = _vq_codec()
    net = codec.autoencoder
    z = torch.randn(1, 8, 4, 4, 4, generator=torch.Generator().manual_seed(9))
    image = codec.decode(z)
    assert image.shape == (1, 2, 16, 16, 16)
    codes = net.quantizer.embeddings
    for c in range(2):
        block = z[:, 4 * c : 4 * c + 4]
        flat = block.movedim(1, -1).reshape(-1, 4)
        nearest = net.quantizer.nearest(flat)
        _assert_nearest(nearest, flat, codes)
        quantized = codes[nearest].reshape(1, 4, 4, 4, 4).movedim(-1, 1)
        torch.testing.assert_close(image[:, c : c + 1], net.decoder(quantized) * 2 - 1)
        # quantizing first: decoding the continuous latent itself gives something else
        assert not torch.allclose(image[:, c : c + 1], net.decoder(block) * 2 - 1, atol=1e-4)


def test_vqgan_decode_snaps_small_perturbations_to_the_codes():
    """A latent made of codebook vectors decodes to the same image as a small perturbation of it. The codebook is
    built by hand (the 16 corners of {-1, 1}^4, and each doubled: codes at least 2 apart), so a perturbation of
    norm < 1e-2 cannot bring a vector nearer to another code."""
    codec = _vq_codec()
    corners = torch.cartesian_prod(*[torch.tensor([-1.0, 1.0])] * 4)
    book = torch.cat([corners, 2 * corners])
    with torch.no_grad():
        codec.autoencoder.quantizer.embeddings.copy_(book)
    quantized = book[torch.randint(0, 32, (64,), generator=torch.Generator().manual_seed(2))]
    quantized = quantized.reshape(1, 4, 4, 4, 4).movedim(-1, 1)
    noise = torch.randn(quantized.shape, generator=torch.Generator().manual_seed(3))
    nudged = quantized + 1e-3 * noise / noise.norm(dim=1, keepdim=True)  # norm 1e-3 per latent vector
    torch.testing.assert_close(codec.decode(nudged), codec.decode(quantized), atol=0, rtol=0)
    # the codes really change the image: the same latent moved to other codes decodes differently
    assert not torch.allclose(codec.decode(-quantized), codec.decode(quantized), atol=1e-4)


def test_vqgan_codebook_never_updates_through_the_codec():
    codec = _vq_codec()
    before = {k: v.clone() for k, v in codec.autoencoder.quantizer.state_dict().items()}
    codec.train()
    codec.encode(_volume(1, 1, 16, 16, 16, seed=10))
    codec.decode(torch.randn(1, 4, 4, 4, 4))
    assert not codec.autoencoder.training
    for key, value in codec.autoencoder.quantizer.state_dict().items():
        assert torch.equal(value, before[key]), key


# ---------------------------------------------------------------------------------------------- scale and state
def test_calibrate_sets_scale_to_one_over_std():
    codec = _ae_codec()
    assert torch.isnan(codec.scale)
    latents = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(11)) * 3.0 + 2.0
    value = codec.calibrate(latents)
    expected = 1.0 / latents.double().std(unbiased=False).item()
    assert value == pytest.approx(expected, rel=1e-9)
    assert codec.scale.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("value", [0.0, 0.5, -2.3])
def test_calibrate_rejects_constant_latents(value):
    codec = _ae_codec()
    with pytest.raises(ValueError, match="standard deviation"):
        codec.calibrate(torch.full((1000,), value))
    assert torch.isnan(codec.scale)


def test_calibrate_rejects_constant_latents_despite_rounding():
    codec = _ae_codec()
    with pytest.raises(ValueError, match="standard deviation"):
        codec.calibrate(torch.full((1000,), 0.1))


def test_state_dict_holds_only_the_scale_and_round_trips(tmp_path):
    codec = _ae_codec(scale=0.25)
    state = codec.state_dict()
    assert list(state) == ["scale"]
    assert state["scale"].item() == 0.25
    torch.save(state, tmp_path / "codec.pt")
    other = _ae_codec()
    assert torch.isnan(other.scale)
    result = other.load_state_dict(torch.load(tmp_path / "codec.pt", weights_only=True))
    assert other.scale.item() == 0.25
    assert not result.missing_keys and not result.unexpected_keys
    state["scale"].fill_(3.0)  # a copy: the codec is not changed through it
    assert codec.scale.item() == 0.25


def test_latent_roi_size():
    codec = LatentCodec(_LocalAutoencoder(), roi_size=[16, 8, 32], downsample=[2, 2, 4], latent_channels=2)
    assert codec.latent_roi_size == [8, 4, 8]
    assert codec.downsample == [2, 2, 4]


# ---------------------------------------------------------------------------------------------- calibration handler
class _RandomDataset:
    """Items whose latents are drawn from every global RNG (like random crops), counting reads."""

    def __init__(self, n: int = 5, crops: bool = False) -> None:
        self.n = n
        self.crops = crops
        self.reads: list[int] = []
        g = torch.Generator().manual_seed(12)
        self.latents = [torch.randn(2, 3, 3, 3, generator=g) * (i + 1) for i in range(n)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.reads.append(i)
        torch.rand(3)
        np.random.rand(3)
        random.random()
        item = {"image": self.latents[i]}
        return [item, {"image": self.latents[i] + 1.0}] if self.crops else item


def _rng_snapshot():
    return torch.get_rng_state().clone(), np.random.get_state(), random.getstate()


def _same_rng(a, b) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1][0] == b[1][0]
        and np.array_equal(a[1][1], b[1][1])
        and a[1][2:] == b[1][2:]
        and a[2] == b[2]
    )


def test_scale_calibration_uses_the_first_items_and_keeps_the_rng_states():
    codec = _ae_codec()
    dataset = _RandomDataset(5)
    torch.manual_seed(13)
    np.random.seed(13)
    random.seed(13)
    before = _rng_snapshot()
    LatentScaleCalibration(codec, dataset, max_items=3)()
    assert _same_rng(before, _rng_snapshot())
    assert dataset.reads == [0, 1, 2]
    used = torch.cat([dataset.latents[i].flatten() for i in range(3)]).double()
    assert codec.scale.item() == pytest.approx(1.0 / used.std(unbiased=False).item(), rel=1e-6)


def test_scale_calibration_reads_lists_of_crops_on_engine_start():
    codec = _ae_codec()
    dataset = _RandomDataset(2, crops=True)
    engine = Engine(lambda e, b: None)
    LatentScaleCalibration(codec, dataset, max_items=8).attach(engine)
    engine.run([0], max_epochs=1)
    assert dataset.reads == [0, 1]
    used = torch.cat([torch.cat([x.flatten(), (x + 1.0).flatten()]) for x in dataset.latents]).double()
    assert codec.scale.item() == pytest.approx(1.0 / used.std(unbiased=False).item(), rel=1e-6)


def test_scale_calibration_does_nothing_when_the_scale_is_set():
    codec = _ae_codec(scale=0.5)
    dataset = _RandomDataset(3)
    before = _rng_snapshot()
    LatentScaleCalibration(codec, dataset)()
    assert dataset.reads == []
    assert codec.scale.item() == 0.5
    assert _same_rng(before, _rng_snapshot())


# ---------------------------------------------------------------------------------------------- from a bundle run
def _bundle_network() -> nn.Module:
    parser = ConfigParser()
    parser.read_config(AE_CONFIGS)
    return parser.get_parsed_content("network_def")


@pytest.fixture(scope="module")
def ae_checkpoint(tmp_path_factory):
    torch.manual_seed(14)
    net = _bundle_network()
    path = tmp_path_factory.mktemp("ae") / "model.pt"
    torch.save(net.state_dict(), path)
    return path, net.eval()


def test_codec_from_bundle_builds_a_working_codec(ae_checkpoint):
    path, net = ae_checkpoint
    codec = codec_from_bundle(AE_CONFIGS, str(path), latent_channels=3, downsample=[4, 4, 4], scale=0.5)
    assert codec.roi_size == [16, 16, 16]  # tiny.json's patch_size
    assert codec.downsample == [4, 4, 4]
    assert codec.latent_channels == 3
    assert codec.scale.item() == 0.5
    assert all(not p.requires_grad for p in codec.autoencoder.parameters())
    image = _volume(1, 2, 16, 16, 16, seed=15)
    latent = codec.encode(image)
    assert latent.shape == (1, 6, 4, 4, 4)
    # the checkpoint's weights are loaded: same latents as the saved network
    for c in range(2):
        torch.testing.assert_close(latent[:, 3 * c : 3 * c + 3], net.encode((image[:, c : c + 1] + 1) / 2)[0])
    assert codec.decode(latent).shape == (1, 2, 16, 16, 16)
    large = codec.encode(_volume(1, 1, 16, 24, 32, seed=16))  # sliding windows of the patch size
    assert large.shape == (1, 3, 4, 6, 8)
    assert codec.decode(large).shape == (1, 1, 16, 24, 32)


def test_codec_from_bundle_infers_the_downsampling(ae_checkpoint):
    path, _ = ae_checkpoint
    codec = codec_from_bundle(AE_CONFIGS, str(path), latent_channels=3)
    assert codec.downsample == [4, 4, 4]
    assert torch.isnan(codec.scale)


def test_load_latent_codec_directly(ae_checkpoint):
    path, net = ae_checkpoint
    fresh = _bundle_network()
    codec = load_latent_codec(fresh, str(path), roi_size=[16, 16, 16], latent_channels=3, downsample=[4, 4, 4])
    for a, b in zip(codec.autoencoder.state_dict().values(), net.state_dict().values()):
        assert torch.equal(a, b)


def test_codec_from_bundle_reads_a_ddp_prefixed_checkpoint(ae_checkpoint, tmp_path):
    _, net = ae_checkpoint
    path = tmp_path / "ddp.pt"
    torch.save({f"module.{k}": v for k, v in net.state_dict().items()}, path)
    codec = codec_from_bundle(AE_CONFIGS, str(path), latent_channels=3)
    image = _volume(1, 1, 16, 16, 16, seed=16)
    torch.testing.assert_close(codec.encode(image), net.encode((image + 1) / 2)[0])


@pytest.mark.parametrize("config", [None, [], ""])
def test_codec_from_bundle_needs_a_config(config, ae_checkpoint):
    with pytest.raises(ValueError, match="'latent_config'"):
        codec_from_bundle(config, str(ae_checkpoint[0]), latent_channels=3)


def test_codec_from_bundle_missing_config_file(ae_checkpoint, tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="'latent_config'.*nope.json"):
        codec_from_bundle([AE_CONFIGS[0], missing], str(ae_checkpoint[0]), latent_channels=3)


def test_codec_from_bundle_config_without_network(ae_checkpoint, tmp_path):
    config = tmp_path / "bad.json"
    config.write_text('{"patch_size": [16, 16, 16]}')
    with pytest.raises(ValueError, match="'latent_config'.*network_def"):
        codec_from_bundle(str(config), str(ae_checkpoint[0]), latent_channels=3)
    config.write_text('{"patch_size": [16, 16, 16], "network_def": 3}')
    with pytest.raises(ValueError, match="'latent_config'.*not a network"):
        codec_from_bundle(str(config), str(ae_checkpoint[0]), latent_channels=3)


@pytest.mark.parametrize("ckpt", [None, ""])
def test_codec_from_bundle_needs_a_checkpoint(ckpt):
    with pytest.raises(ValueError, match="'latent_ckpt'"):
        codec_from_bundle(AE_CONFIGS, ckpt, latent_channels=3)


def test_codec_from_bundle_missing_or_corrupt_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="'latent_ckpt'.*does not exist"):
        codec_from_bundle(AE_CONFIGS, str(tmp_path / "model.pt"), latent_channels=3)
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="'latent_ckpt'.*bad.pt"):
        codec_from_bundle(AE_CONFIGS, str(tmp_path / "bad.pt"), latent_channels=3)


def test_codec_from_bundle_checkpoint_of_another_architecture(tmp_path):
    path = tmp_path / "other.pt"
    torch.save(tiny_autoencoder().state_dict(), path)
    with pytest.raises(ValueError, match="'latent_ckpt'.*does not fit.*'latent_config'"):
        codec_from_bundle(AE_CONFIGS, str(path), latent_channels=3)


def test_codec_from_bundle_wrong_latent_channels(ae_checkpoint):
    with pytest.raises(ValueError, match="'latent_channels' is 4 .* 3 channel"):
        codec_from_bundle(AE_CONFIGS, str(ae_checkpoint[0]), latent_channels=4)


@pytest.mark.parametrize("downsample", [[2, 2, 2], [4, 4, 8]])
def test_codec_from_bundle_wrong_downsample(ae_checkpoint, downsample):
    with pytest.raises(ValueError, match=r"'latent_downsample' .* downsamples by \[4, 4, 4\]"):
        codec_from_bundle(AE_CONFIGS, str(ae_checkpoint[0]), latent_channels=3, downsample=downsample)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the diffusion sampler: exact recovery with an oracle denoiser (whole input and sliding windows),
network evaluations per step, checkpoints (latent scale included), latent mode and the held-out denoising loss."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from common.diffusion.networks import DiffusionSampler
from common.diffusion.schedule import DiffusionSchedule, fast_ddpm_grid

SHAPE = (1, 1, 24, 20, 16)


def clean_volume(seed: int = 0, shape=SHAPE) -> torch.Tensor:
    """A fixed clean volume in [-1, 1] with structure (a smooth ramp plus noise)."""
    gen = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(-0.8, 0.8, shape[2]).reshape(1, 1, -1, 1, 1).expand(shape)
    return (ramp + 0.2 * (torch.rand(shape, generator=gen) * 2 - 1)).clamp(-1, 1).contiguous()


def start_noise(shape=SHAPE, seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def oracle_output(x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """The exact epsilon (or v) of ``x_t`` for the clean ``x0``, computed in float64."""
    a = DiffusionSchedule(1000).alpha_bar(t, x_t)
    x_t, x0 = x_t.double(), x0.double()
    eps = (x_t - a.sqrt() * x0) / (1 - a).sqrt()
    out = eps if prediction_type == "epsilon" else a.sqrt() * eps - (1 - a).sqrt() * x0
    return out.float()


class FixedOracle(nn.Module):
    """Knows the whole clean volume; only valid when it receives the whole input (or x0 is constant)."""

    def __init__(self, x0: torch.Tensor, prediction_type: str = "epsilon") -> None:
        super().__init__()
        self.register_buffer("x0", x0)
        self.prediction_type = prediction_type
        self.calls: list[tuple[int, ...]] = []
        self.timesteps: list[int] = []

    def forward(self, x, t):
        self.calls.append(tuple(x.shape))
        self.timesteps.append(int(t[0]))
        assert bool((t == t[0]).all())
        x0 = self.x0 if self.x0.shape[2:] == x.shape[2:] else self.x0.flatten()[0].expand_as(x)
        return oracle_output(x, x0, t, self.prediction_type)


class ConditionOracle(nn.Module):
    """Reads x0 from its condition channel 0 and x_t from channel 1: exact for any window."""

    def __init__(self, prediction_type: str = "epsilon") -> None:
        super().__init__()
        self.prediction_type = prediction_type
        self.calls: list[tuple[int, ...]] = []
        self.inputs: list[torch.Tensor] = []

    def forward(self, x, t):
        self.calls.append(tuple(x.shape))
        self.inputs.append(x.detach().clone())
        return oracle_output(x[:, 1:2], x[:, 0:1], t, self.prediction_type)


class ZeroNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def forward(self, x, t):
        self.calls.append(tuple(x.shape))
        return torch.zeros_like(x[:, -1:])


class TinyNet(nn.Module):
    def __init__(self, in_channels: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv3d(in_channels, 1, 1)
        self.norm = nn.BatchNorm3d(1)

    def forward(self, x, t):
        return self.norm(self.conv(x))


class CodecStub(nn.Module):
    """A latent codec stub: ``scale`` buffer, identity encoder and a decoder that marks its input (``3 z + 1``)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale)))

    def encode(self, x):
        return x

    def decode(self, z):
        return 3 * z + 1


def sampler(network, grid: str = "uniform", in_channels: int = 1, target_channels=(0,), **kwargs):
    kwargs.setdefault("clip_sample", False)
    return DiffusionSampler(
        network,
        target_channels=list(target_channels),
        in_channels=in_channels,
        timesteps=fast_ddpm_grid(grid, 10),
        **kwargs,
    )


def sliding_windows(shape, roi, overlap) -> int:
    """Number of windows of MONAI's dense sliding-window scan (the last window of an axis ends at the border)."""
    count = 1
    for size, r in zip(shape, roi):
        if size <= r:
            continue
        interval = max(int(r * (1 - overlap)), 1)
        starts = sorted({min(i * interval, size - r) for i in range(math.ceil(size / interval))})
        count *= len(starts)
    return count


# ---------------------------------------------------------------------------------------------- oracle recovery
@pytest.mark.parametrize("grid", ["uniform", "non_uniform"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_oracle_recovers_x0_from_the_whole_input(grid, prediction_type, eta):
    x0 = clean_volume()
    net = FixedOracle(x0, prediction_type)
    s = sampler(net, grid, prediction_type=prediction_type, eta=eta)
    out = s(start_noise(), generator=torch.Generator().manual_seed(5))
    assert out.shape == SHAPE
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    grid_points = fast_ddpm_grid(grid, 10).tolist()
    assert net.timesteps == list(reversed(grid_points))  # one evaluation per grid point, top down
    assert net.calls == [SHAPE] * len(grid_points)


@pytest.mark.parametrize("overlap", [0.25, 0.5])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_oracle_recovers_a_constant_volume_with_sliding_windows(overlap, prediction_type):
    x0 = torch.full(SHAPE, 0.3)
    net = FixedOracle(x0, prediction_type)
    s = sampler(net, "non_uniform", prediction_type=prediction_type, eta=1.0, roi_size=[16, 16, 16], overlap=overlap)
    out = s(start_noise(), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    assert set(net.calls) == {(1, 1, 16, 16, 16)}  # only windows reach the network


@pytest.mark.parametrize("overlap", [0.25, 0.5])
@pytest.mark.parametrize("eta", [0.0, 1.0])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_oracle_recovers_a_varying_volume_with_sliding_windows(overlap, eta, prediction_type):
    x0 = clean_volume(seed=3)
    net = ConditionOracle(prediction_type)
    s = sampler(
        net,
        in_channels=2,
        target_channels=[1],
        prediction_type=prediction_type,
        eta=eta,
        roi_size=[16, 16, 16],
        overlap=overlap,
        sw_batch_size=2,
    )
    image = torch.cat([x0, start_noise()], dim=1)
    out = s(image, generator=torch.Generator().manual_seed(0))
    assert out.shape == SHAPE
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    assert all(shape[1:] == (2, 16, 16, 16) for shape in net.calls)
    torch.testing.assert_close(image[:, :1], x0)  # the input is not modified


def test_sampler_is_deterministic_with_eta_0_and_uses_the_generator_with_eta_1():
    net = TinyNet(in_channels=1)
    image = start_noise()
    det = sampler(net, eta=0.0, clip_sample=True)
    torch.testing.assert_close(det(image), det(image.clone()), rtol=0, atol=0)
    anc = sampler(net, eta=1.0, clip_sample=True)
    first = anc(image, generator=torch.Generator().manual_seed(1))
    again = anc(image, generator=torch.Generator().manual_seed(1))
    other = anc(image, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.allclose(first, other)
    assert float(first.abs().max()) <= 1.0 + 1e-6  # clipped x0 estimates: the last step returns one


# ---------------------------------------------------------------------------------------------- evaluations per step
def test_one_network_evaluation_per_step_when_the_input_fits_one_window():
    for roi in (None, [24, 20, 16], [32, 32, 32]):
        net = ZeroNet()
        s = sampler(net, roi_size=roi)
        s(start_noise())
        assert len(net.calls) == len(s.timesteps) == 11
        assert set(net.calls) == {SHAPE}


@pytest.mark.parametrize(
    "roi, overlap, sw_batch_size",
    [([16, 16, 16], 0.25, 1), ([16, 16, 16], 0.5, 3), ([8, 8, 8], 0.5, 4), ([12, 12, 8], 0.25, 5)],
)
def test_network_evaluations_with_sliding_windows(roi, overlap, sw_batch_size):
    net = ZeroNet()
    s = sampler(net, roi_size=roi, overlap=overlap, sw_batch_size=sw_batch_size)
    s(start_noise())
    windows = sliding_windows(SHAPE[2:], roi, overlap)
    assert windows > 1
    steps = len(s.timesteps)
    assert len(net.calls) == steps * math.ceil(windows / sw_batch_size)
    assert sum(shape[0] for shape in net.calls) == steps * windows
    assert {shape[2:] for shape in net.calls} == {tuple(roi)}


def test_sliding_window_counts_of_a_known_layout():
    # (24, 20, 16) with 16^3 windows: 2 x 2 x 1 windows
    assert sliding_windows((24, 20, 16), (16, 16, 16), 0.25) == 4
    assert sliding_windows((24, 20, 16), (8, 8, 8), 0.5) == 5 * 4 * 3


class WindowMean(nn.Module):
    """Returns, over its whole window, the mean of channel 0 (a coordinate): one constant per window."""

    def forward(self, x, t):
        return x[:, :1].mean(dim=(1, 2, 3, 4), keepdim=True) * torch.ones_like(x[:, :1])


def test_overlapping_windows_are_blended_with_gaussian_weights():
    depth = torch.arange(24.0).reshape(1, 1, 24, 1, 1).expand(1, 1, 24, 16, 16)
    x = torch.cat([depth, torch.zeros_like(depth)], dim=1)
    s = sampler(WindowMean(), in_channels=2, target_channels=[1], roi_size=[16, 16, 16], overlap=0.5)
    out = s._denoise(x, 999)[0, 0, :, 8, 8]  # the denoiser of one time step; windows start at depth 0 and 8
    torch.testing.assert_close(out[:8], torch.full((8,), 7.5))  # first window only: its mean
    torch.testing.assert_close(out[16:], torch.full((8,), 15.5))  # second window only
    overlap = out[8:16]
    assert bool((overlap > 7.5).all() and (overlap < 15.5).all())
    assert bool((overlap[1:] > overlap[:-1]).all())  # weights follow the distance to the window centres
    assert float(overlap[0]) < 11.0 and float(overlap[-1]) > 12.0  # not a plain average (11.5)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_state_dict_is_the_clean_network_state_dict():
    net = TinyNet()
    s = sampler(nn.DataParallel(net), in_channels=2, target_channels=[1])
    state = s.state_dict()
    expected = net.state_dict()
    assert list(state) == list(expected) and not any(k.startswith("module.") for k in state)
    for key in expected:
        assert torch.equal(state[key], expected[key])
    assert "latent_scale" not in state


def test_load_state_dict_round_trip():
    source = sampler(TinyNet(seed=0), in_channels=2, target_channels=[1])
    target_net = TinyNet(seed=1)
    target = sampler(target_net, in_channels=2, target_channels=[1])
    assert not torch.equal(target_net.conv.weight, source.network.conv.weight)
    target.load_state_dict(source.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(target_net.state_dict()[key], value)
    # prefixed keys of a DDP/compiled checkpoint load as well
    other_net = TinyNet(seed=2)
    sampler(other_net, in_channels=2, target_channels=[1]).load_state_dict(
        {f"module.{k}": v for k, v in source.state_dict().items()}
    )
    assert torch.equal(other_net.conv.weight, source.network.conv.weight)
    with pytest.raises(RuntimeError, match="Missing key"):
        target.load_state_dict({"conv.weight": source.state_dict()["conv.weight"]})


def test_latent_scale_in_checkpoints():
    codec = CodecStub(0.25)
    s = sampler(TinyNet(), in_channels=2, target_channels=[1], latent_codec=codec)
    state = s.state_dict()
    assert state["latent_scale"].item() == 0.25
    assert set(state) == {"latent_scale", *TinyNet().state_dict()}
    other_codec = CodecStub(1.0)
    other = sampler(TinyNet(seed=3), in_channels=2, target_channels=[1], latent_codec=other_codec)
    other.load_state_dict(state)
    assert other_codec.scale.item() == 0.25
    assert torch.equal(other.network.conv.weight, s.network.conv.weight)
    without = {k: v for k, v in state.items() if k != "latent_scale"}
    fresh_codec = CodecStub(2.0)
    fresh = sampler(TinyNet(), in_channels=2, target_channels=[1], latent_codec=fresh_codec)
    with pytest.raises(RuntimeError, match="latent_scale"):
        fresh.load_state_dict(without)
    fresh.load_state_dict(without, strict=False)
    assert fresh_codec.scale.item() == 2.0  # kept
    # a plain sampler ignores a latent scale in the checkpoint
    plain_net = TinyNet(seed=4)
    sampler(plain_net, in_channels=2, target_channels=[1]).load_state_dict(state)
    assert torch.equal(plain_net.conv.weight, s.network.conv.weight)


def test_latent_mode_scales_the_condition_and_decodes_the_unscaled_sample():
    raw = clean_volume(seed=4) * 3  # raw latents: not in [-1, 1]
    net = ConditionOracle()
    s = sampler(net, in_channels=2, target_channels=[1], latent_codec=CodecStub(0.5), eta=1.0)
    image = torch.cat([raw, start_noise()], dim=1)
    out = s(image, generator=torch.Generator().manual_seed(0))
    # the network sees the scaled condition, so the sample is the scaled latent; forward unscales and decodes it
    torch.testing.assert_close(net.inputs[0][:, :1], 0.5 * raw)
    torch.testing.assert_close(s.sample(image, torch.Generator().manual_seed(0)), 0.5 * raw, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, 3 * raw + 1, rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------- denoising loss
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_denoising_loss_of_the_oracle_is_zero(prediction_type):
    x0 = clean_volume(seed=6)
    whole = sampler(FixedOracle(x0, prediction_type), prediction_type=prediction_type)
    loss = whole.denoising_loss(x0, torch.Generator().manual_seed(0))
    assert loss.shape == (1,) and loss.item() < 1e-9
    windowed = sampler(
        ConditionOracle(prediction_type),
        in_channels=2,
        target_channels=[1],
        prediction_type=prediction_type,
        roi_size=[8, 8, 8],
    )
    image = torch.cat([x0, x0], dim=1).repeat(2, 1, 1, 1, 1)
    loss = windowed.denoising_loss(image, torch.Generator().manual_seed(0))
    assert loss.shape == (2,) and float(loss.max()) < 1e-9


def test_denoising_loss_in_latent_mode_scales_every_channel():
    """The held-out loss sees what training sees: raw latents of every channel (the clean target too) times the
    codec's scale; the condition oracle (channel 0 = the scaled x0) then predicts the noise exactly."""
    raw = clean_volume(seed=8) * 3  # raw latents
    s = sampler(ConditionOracle(), in_channels=2, target_channels=[1], latent_codec=CodecStub(0.5))
    loss = s.denoising_loss(torch.cat([raw, raw], dim=1), torch.Generator().manual_seed(0))
    assert loss.item() < 1e-9
    unscaled = sampler(ConditionOracle(), in_channels=2, target_channels=[1])
    assert unscaled.denoising_loss(torch.cat([0.5 * raw, raw], dim=1), torch.Generator().manual_seed(0)).item() > 0.1


def test_denoising_loss_of_a_zero_network_is_the_noise_power():
    x0 = clean_volume(seed=7)
    net = ZeroNet()
    s = sampler(net)
    loss = s.denoising_loss(x0, torch.Generator().manual_seed(0))
    # exactly: the mean square of one noise draw per loss time step from the generator (the zero network's error is
    # the epsilon target itself); the same float32 squares summed by two reductions of x0.numel() terms, which agree
    # to a relative ~log2(n) eps32 (n = 7680: ~1.6e-6)
    gen = torch.Generator().manual_seed(0)
    expected = torch.stack([torch.randn(x0.shape, generator=gen).pow(2).mean() for _ in s.loss_timesteps]).mean()
    n = x0.numel()
    assert loss.item() == pytest.approx(expected.item(), rel=2 * math.log2(n) * torch.finfo(torch.float32).eps)
    assert len(net.calls) == len(s.loss_timesteps) == 11
    # custom loss time steps
    custom = sampler(ZeroNet(), loss_timesteps=[0, 500])
    assert custom.loss_timesteps.tolist() == [0, 500]
    assert len(custom.network.calls) == 0
    custom.denoising_loss(x0, torch.Generator().manual_seed(0))
    assert len(custom.network.calls) == 2


def test_denoising_loss_uses_the_centre_crop():
    x0 = clean_volume(seed=8)
    net = ConditionOracle()
    s = sampler(net, in_channels=2, target_channels=[1], roi_size=[8, 8, 8])
    image = torch.cat([x0, x0], dim=1)
    s.denoising_loss(image, torch.Generator().manual_seed(0))
    assert set(net.calls) == {(1, 2, 8, 8, 8)}
    # (24, 20, 16) -> starts (8, 6, 4)
    for x in net.inputs:
        torch.testing.assert_close(x[:, :1], x0[:, :, 8:16, 6:14, 4:12], rtol=0, atol=0)
    # an roi larger than the input on some axis keeps that axis whole
    net_big = ConditionOracle()
    sampler(net_big, in_channels=2, target_channels=[1], roi_size=[32, 8, 16]).denoising_loss(image)
    assert set(net_big.calls) == {(1, 2, 24, 8, 16)}
    torch.testing.assert_close(net_big.inputs[0][:, :1], x0[:, :, :, 6:14, :], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- input checks
def test_wrong_number_of_channels_raises():
    s = sampler(ZeroNet(), in_channels=2, target_channels=[1])
    with pytest.raises(ValueError, match=r"takes 2 channels, got input shape \(1, 3, 24, 20, 16\)"):
        s(torch.zeros(1, 3, *SHAPE[2:]))
    with pytest.raises(ValueError, match="takes 2 channels"):
        s(torch.zeros(1, 1, *SHAPE[2:]))
    assert len(s.network.calls) == 0

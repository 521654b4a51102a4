# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the X-ray -> CT networks: the per-voxel denoiser (shapes, previous-stage input, gradient
checkpointing), its samplers (oracle recovery, direct and back-projection modes, start noise), the stage cascade
(chaining, checkpoints, initialisation from the previous stage) and the checkpoint helpers of the bundle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from common.checkpoint_io import CheckpointError, save_checkpoint
from common.diffusion.schedule import DiffusionSchedule, fast_ddpm_grid
from common.xray2ct.drr import DRRProjector
from common.xray2ct.networks import (
    CheckpointedBlock,
    XrayCTCascade,
    XrayCTSampler,
    build_cascade,
    cascade_checkpoints,
    degrade_to_previous,
    init_from_previous,
    init_from_previous_stage,
    load_cascade,
    previous_stages,
    save_cascade,
    stage_checkpoint,
)
from tests.helpers import TINY_XRAY_NETWORK, randomise_zero_parameters, tiny_xray_denoiser, xray_projector

VIEW_SIZE = (16, 16)
SAMPLER = {"mode": "diffusion", "timesteps": (0, 499, 999), "beta_schedule": "cosine"}
SIZES = [(8, 8, 8), (16, 16, 16)]


def projector() -> DRRProjector:
    return xray_projector(VIEW_SIZE)


denoiser = tiny_xray_denoiser


def volume(shape=(2, 1, 8, 8, 8), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) * 2 - 1


def xrays(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return projector().xrays(volume((batch, 1, 16, 16, 16), seed))


def cascade(seed: int = 0) -> XrayCTCascade:
    torch.manual_seed(seed)
    return randomise_zero_parameters(build_cascade(projector(), SIZES, 2, TINY_XRAY_NETWORK, SAMPLER), seed)


class OracleDenoiser(nn.Module):
    """Mimics the denoiser's interface and returns the exact v (or epsilon) of ``x_t`` for a fixed clean ``x0``."""

    def __init__(self, x0: torch.Tensor, prediction_type: str = "v_prediction", with_previous: bool = False) -> None:
        super().__init__()
        self.register_buffer("x0", x0)
        self.projector = projector()
        self.with_previous = with_previous
        self.schedule = DiffusionSchedule(1000, "cosine")
        self.prediction_type = prediction_type
        self.timesteps: list[int] = []
        self.conditions: list[tuple] = []
        self.received: list[object] = []

    def condition(self, xray, spatial):
        self.conditions.append(tuple(spatial))
        return torch.zeros(xray.shape[0], 2, *spatial), torch.zeros(xray.shape[0], 4, 16)

    def forward(self, x, t, xray, previous=None, condition=None):
        self.timesteps.append(int(t[0]))
        self.received.append(condition)
        a = self.schedule.alpha_bar(t, x)
        x_t = x.double()
        x0 = self.x0.double().expand_as(x_t)
        eps = (x_t - a.sqrt() * x0) / (1 - a).sqrt()
        out = eps if self.prediction_type == "epsilon" else a.sqrt() * eps - (1 - a).sqrt() * x0
        return out.float()


class ConstantDenoiser(nn.Module):
    """Returns a fixed volume whatever the input; records its inputs."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("output", output)
        self.projector = projector()
        self.with_previous = False
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def condition(self, xray, spatial):
        return torch.zeros(xray.shape[0], 2, *spatial), None

    def forward(self, x, t, xray, previous=None, condition=None):
        self.inputs.append((x.clone(), t.clone()))
        return self.output.expand(x.shape[0], *self.output.shape[1:])


# ---------------------------------------------------------------------------------------------- denoiser
@pytest.mark.parametrize("spatial", [(8, 8, 8), (16, 16, 16), (16, 8, 16)])
def test_denoiser_predicts_at_every_voxel_of_the_stage(spatial):
    net = denoiser()
    assert net.in_channels == 3
    x = volume((2, 1, *spatial))
    out = net(x, torch.tensor([0, 500]), xrays())
    assert out.shape == (2, 1, *spatial)
    assert bool(torch.isfinite(out).all())


def test_previous_stage_input_is_required_exactly_when_configured():
    x, t, xray = volume(), torch.tensor([3, 4]), xrays()
    with_previous = denoiser(with_previous=True)
    assert with_previous.in_channels == 4
    assert with_previous(x, t, xray, previous=volume(seed=2)).shape == x.shape
    with pytest.raises(ValueError, match="needs the previous stage"):
        with_previous(x, t, xray)
    with pytest.raises(ValueError, match="takes no previous stage"):
        denoiser()(x, t, xray, previous=volume(seed=2))


def test_condition_is_the_backprojection_and_reused_when_given():
    net = denoiser().eval()
    xray, x, t = xrays(), volume(), torch.tensor([10, 20])
    backprojection, tokens = net.condition(xray, (8, 8, 8))
    torch.testing.assert_close(backprojection, net.projector.backproject(xray, (8, 8, 8)))
    assert tokens.shape == (2, 2 * (16 // 8) ** 2, 16)  # two views of 2x2 patches, hidden size 16
    with torch.no_grad():
        torch.testing.assert_close(net(x, t, xray, condition=(backprojection, tokens)), net(x, t, xray))


def test_gradient_checkpointing_changes_nothing_but_memory():
    plain, checkpointed = denoiser(seed=0), denoiser(seed=0, gradient_checkpointing=True)
    assert isinstance(checkpointed.unet.middle_block, CheckpointedBlock)
    assert all(isinstance(b, CheckpointedBlock) for b in checkpointed.unet.down_blocks)
    assert all(isinstance(b, CheckpointedBlock) for b in checkpointed.encoder.vits[0].blocks)
    assert list(plain.state_dict()) == list(checkpointed.state_dict())  # checkpoints are interchangeable
    checkpointed.load_state_dict(plain.state_dict())
    plain.train(), checkpointed.train()
    x, t, xray, target = volume(), torch.tensor([0, 700]), xrays(), volume(seed=9)
    outputs, grads = [], []
    for net in (plain, checkpointed):
        out = net(x, t, xray)
        F.mse_loss(out, target).backward()
        outputs.append(out.detach())
        named = net.named_parameters()
        grads.append({name.replace("module.", ""): p.grad.clone() for name, p in named if p.grad is not None})
    # the checkpointed blocks run the same kernels (again in backward): equal up to float32 rounding of the output
    scale = float(outputs[0].abs().max())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=8 * torch.finfo(torch.float32).eps * scale)
    assert set(grads[0]) == set(grads[1])
    unused = {name for name, _ in plain.named_parameters()} - set(grads[0])
    assert all("norm_cross_attn" in name for name in unused)  # MONAI's ViT blocks keep an unused norm
    assert all(bool(g.any()) for g in grads[0].values())  # every weight takes part
    # recomputation may accumulate a weight's gradient contributions in another order: a relative tolerance, and an
    # absolute one scaled by the tensor's largest gradient for elements that cancel to almost nothing
    for name in grads[0]:
        atol = 1e-5 * float(grads[0][name].abs().max())
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=atol, msg=name)
    checkpointed.set_gradient_checkpointing(False)
    assert not isinstance(checkpointed.unet.middle_block, CheckpointedBlock)
    plain.load_state_dict(checkpointed.state_dict())


def test_loading_another_stages_weights_names_the_input_channels():
    with pytest.raises(RuntimeError, match="input channel"):
        denoiser(with_previous=True).load_state_dict(denoiser().state_dict())
    ddp_style = {f"module.{k}": v for k, v in denoiser(seed=3).state_dict().items()}
    net = denoiser()
    net.load_state_dict(ddp_style)  # DDP prefixes are stripped
    torch.testing.assert_close(net.state_dict(), denoiser(seed=3).state_dict())


def test_v_prediction_round_trip_recovers_x0():
    schedule = DiffusionSchedule(1000, "cosine")
    x0, noise = volume((5, 1, 4, 4, 4)), torch.randn(5, 1, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0, 1, 500, 998, 999])
    x_t = schedule.add_noise(x0, noise, t)
    v = schedule.velocity(x0, noise, t)
    recovered_x0, recovered_noise = schedule.split(x_t, v, t, "v_prediction")
    torch.testing.assert_close(recovered_x0.float(), x0, rtol=0, atol=1e-6)
    torch.testing.assert_close(recovered_noise.float(), noise, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- samplers
@pytest.mark.parametrize(
    "timesteps, size",
    [
        (fast_ddpm_grid("uniform", 10), (8, 8, 8)),
        (fast_ddpm_grid("non_uniform", 10), (8, 12, 4)),
        (torch.tensor([0, 999]), (8, 8, 8)),
        (torch.tensor([0, 250, 600, 999]), (4, 4, 4)),
    ],
)
@pytest.mark.parametrize("prediction_type", ["v_prediction", "epsilon"])
def test_sampler_with_an_oracle_recovers_x0(timesteps, size, prediction_type):
    x0 = volume((2, 1, *size), seed=7)
    oracle = OracleDenoiser(x0, prediction_type)
    sampler = XrayCTSampler(
        oracle, size, "diffusion", timesteps, beta_schedule="cosine", prediction_type=prediction_type
    )
    out = sampler(xrays())
    assert out.shape == x0.shape
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)
    assert oracle.timesteps == list(reversed(timesteps.tolist()))  # one evaluation per grid point, descending
    assert oracle.conditions == [size]  # the X-ray condition is computed once
    assert all(c is not None for c in oracle.received)
    generated = sampler(xrays(), generator=torch.Generator().manual_seed(3))  # any start noise leads to x0
    torch.testing.assert_close(generated, x0, rtol=0, atol=1e-5)


def test_direct_mode_is_one_deterministic_clamped_evaluation():
    raw = torch.linspace(-3, 3, 512).reshape(1, 1, 8, 8, 8)
    stub = ConstantDenoiser(raw)
    out = XrayCTSampler(stub, (8, 8, 8), "direct")(xrays())
    assert torch.equal(out, raw.clamp(-1, 1).expand(2, 1, 8, 8, 8))
    ((x, t),) = stub.inputs
    assert torch.equal(x, torch.zeros(2, 1, 8, 8, 8)) and torch.equal(t, torch.zeros(2, dtype=torch.long))
    assert torch.equal(
        XrayCTSampler(stub, (8, 8, 8), "direct", clip_sample=False)(xrays()), raw.expand(2, -1, -1, -1, -1)
    )

    sampler = XrayCTSampler(denoiser(), (8, 8, 8), "direct")
    with torch.no_grad():
        first, second = sampler(xrays()), sampler(xrays(), generator=torch.Generator().manual_seed(5))
    assert torch.equal(first, second)
    assert float(first.min()) >= -1 and float(first.max()) <= 1


def test_backprojection_mode_is_the_mean_of_the_views():
    stub = ConstantDenoiser(torch.zeros(1, 1, 8, 12, 6))
    xray = xrays()
    out = XrayCTSampler(stub, (8, 12, 6), "backprojection")(xray)
    expected = stub.projector.backproject(xray, (8, 12, 6)).mean(1, keepdim=True).clamp(-1, 1)
    assert out.shape == (2, 1, 8, 12, 6)
    assert torch.equal(out, expected)
    assert stub.inputs == []  # no network evaluation


def test_start_noise_is_fixed_without_a_generator_and_seeded_with_one():
    sampler = XrayCTSampler(denoiser(), (8, 8, 8), **SAMPLER)
    xray = xrays()
    first, second = sampler(xray), sampler(xray)
    assert torch.equal(first, second)
    expected_noise = torch.randn((1, 1, 8, 8, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampler.start_noise, expected_noise)
    one = sampler(xray, generator=torch.Generator().manual_seed(1))
    again = sampler(xray, generator=torch.Generator().manual_seed(1))
    other = sampler(xray, generator=torch.Generator().manual_seed(2))
    assert torch.equal(one, again)
    assert not torch.allclose(one, other)
    reseeded = XrayCTSampler(sampler.network, (8, 8, 8), noise_seed=3, **SAMPLER)
    assert not torch.allclose(reseeded(xray), first)


def test_sampler_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="'gan'"):
        XrayCTSampler(denoiser(), (8, 8, 8), "gan")


# ---------------------------------------------------------------------------------------------- cascade
def test_cascade_chains_the_stages():
    model = cascade()
    xray = xrays()
    outputs = model.run(xray)
    assert [tuple(o.shape) for o in outputs] == [(2, 1, 8, 8, 8), (2, 1, 16, 16, 16)]
    assert torch.equal(model(xray), outputs[1])
    # stage 2 sees stage 1's output: replacing stage 1's weights changes stage 2's result
    with torch.no_grad():
        for p in model.stages[0].network.parameters():
            p.add_(0.05)
    assert not torch.allclose(model.run(xray)[1], outputs[1])


def test_cascade_checks_which_stages_take_a_previous_stage():
    stage1 = XrayCTSampler(denoiser(), (8, 8, 8), **SAMPLER)
    stage2 = XrayCTSampler(denoiser(with_previous=True), (16, 16, 16), **SAMPLER)
    with pytest.raises(ValueError, match="stage 1 .* must not"):
        XrayCTCascade([stage2])
    with pytest.raises(ValueError, match="stage 2 .* must take"):
        XrayCTCascade([stage1, stage1])
    with pytest.raises(ValueError, match="at least one stage"):
        XrayCTCascade([])


def stage_state(state: dict, stage: int) -> dict:
    """One stage's denoiser weights out of a flat cascade state dict (keys ``stage<k>.<name>``)."""
    prefix = f"stage{stage}."
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def test_cascade_state_dict_round_trip():
    source, target = cascade(seed=0), cascade(seed=1)
    state = source.state_dict()
    assert {key.split(".")[0] for key in state} == {"stage1", "stage2"}
    for k, stage in enumerate(source.stages, start=1):
        own = stage.network.state_dict()
        assert stage_state(state, k).keys() == own.keys()
        assert all(torch.equal(stage_state(state, k)[name], own[name]) for name in own)
    assert stage_state(state, 1)["unet.conv_in.conv.weight"].shape[1] == 3
    assert stage_state(state, 2)["unet.conv_in.conv.weight"].shape[1] == 4
    xray = xrays()
    expected = source.run(xray)
    assert not torch.allclose(target.run(xray)[1], expected[1])
    target.load_state_dict(state)
    for got, want in zip(target.run(xray), expected):
        assert torch.equal(got, want)
    stage1_only = {key: value for key, value in state.items() if key.startswith("stage1.")}
    with pytest.raises(RuntimeError, match=r"\['stage2'\]"):
        target.load_state_dict(stage1_only)
    with pytest.raises(RuntimeError, match="stage3"):
        target.load_state_dict({**state, "stage3.unet.conv_in.conv.weight": torch.zeros(1)})


def test_init_from_previous_starts_as_the_previous_stage():
    previous, net = denoiser(seed=0), denoiser(seed=1, with_previous=True)
    old = previous.state_dict()
    counts = init_from_previous(net, old)
    assert counts == {"copied": len(old) - 1, "partial": 1, "new": 0}
    weight = net.state_dict()["unet.conv_in.conv.weight"]
    assert weight.shape[1] == 4
    assert torch.equal(weight[:, :3], old["unet.conv_in.conv.weight"])
    assert torch.equal(weight[:, 3], torch.zeros_like(weight[:, 3]))
    for name, value in old.items():
        if name != "unet.conv_in.conv.weight":
            assert torch.equal(net.state_dict()[name], value), name
    previous.eval(), net.eval()
    x, t, xray = volume(), torch.tensor([0, 900]), xrays()
    # the zero weights of the new channel add exact zeros, but a 4-channel convolution may sum its 3 x 27 products
    # per output in another order (other blocking) than a 3-channel one: float32 reordering of ~100-term sums
    # (relative ~1e-6), carried through the U-Net's normalisations, stays far below rtol 1e-4 / atol 1e-5 (outputs
    # are O(1))
    with torch.no_grad():
        expected = previous(x, t, xray)
        torch.testing.assert_close(net(x, t, xray, previous=torch.zeros_like(x)), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(net(x, t, xray, previous=volume(seed=5)), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="shares no tensor"):
        init_from_previous(net, {"other.weight": torch.zeros(3)})


def test_init_from_previous_stage_uses_the_last_trained_stage():
    """The ``init_network`` component: the last stage of the trained cascade, nothing for stage 1 or when off."""
    projector, settings = xray_projector(), {**TINY_XRAY_NETWORK}
    cascade = build_cascade(projector, [[8, 8, 8], [16, 16, 16]], 2, settings, {"mode": "direct"})
    net = denoiser(seed=3, with_previous=True)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    assert init_from_previous_stage(net, None) is None
    assert init_from_previous_stage(net, cascade, enabled=False) is None
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert init_from_previous_stage(net, cascade) == {"copied": len(before), "partial": 0, "new": 0}
    last = cascade.stages[-1].network.state_dict()
    assert all(torch.equal(last[k], v) for k, v in net.state_dict().items())


def test_degrade_to_previous():
    x0 = volume((2, 1, 16, 16, 16))
    clean = degrade_to_previous(x0, (8, 8, 8))
    assert clean.shape == x0.shape
    expected = F.interpolate(F.adaptive_avg_pool3d(x0, (8, 8, 8)), size=(16, 16, 16), mode="trilinear")
    torch.testing.assert_close(clean, expected)
    torch.testing.assert_close(degrade_to_previous(x0, (8, 8, 8), noise_std=0.0), expected)
    noisy = degrade_to_previous(x0, (8, 8, 8), 0.2, torch.Generator().manual_seed(0))
    again = degrade_to_previous(x0, (8, 8, 8), 0.2, torch.Generator().manual_seed(0))
    assert torch.equal(noisy, again) and not torch.allclose(noisy, expected)
    assert float((noisy - expected).std(dim=(1, 2, 3, 4)).max()) < 0.25  # per-sample std in [0, 0.2]


def test_save_and_load_cascade_files(tmp_path):
    source, xray = cascade(seed=0), xrays()
    expected = source.run(xray)
    combined = save_cascade(source, tmp_path / "model.pt")
    loaded = load_cascade(cascade(seed=1), combined)
    for got, want in zip(loaded.run(xray), expected):
        assert torch.equal(got, want)
    files = [str(tmp_path / f"stage{k}.pt") for k in (1, 2)]
    for stage, path in zip(source.stages, files):
        save_checkpoint(stage.state_dict(), path)
    loaded = load_cascade(cascade(seed=2), files)
    for got, want in zip(loaded.run(xray), expected):
        assert torch.equal(got, want)


def test_load_cascade_errors_name_the_file(tmp_path):
    source = cascade()
    files = [str(tmp_path / f"stage{k}.pt") for k in (1, 2)]
    for stage, path in zip(source.stages, files):
        save_checkpoint(stage.state_dict(), path)
    with pytest.raises(CheckpointError, match="2 stage.* but 1 checkpoint") as info:
        load_cascade(cascade(), files[:1])
    assert files[0] in str(info.value)
    missing = str(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError) as info:
        load_cascade(cascade(), [files[0], missing])
    assert missing in str(info.value) and "does not exist" in str(info.value)
    with pytest.raises(CheckpointError) as info:
        load_cascade(cascade(), files[::-1])  # stage 2's weights offered to stage 1
    assert files[1] in str(info.value) and "input channel" in str(info.value)
    stage1_only = {key: value for key, value in source.state_dict().items() if key.startswith("stage1.")}
    partial = save_checkpoint(stage1_only, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError) as info:
        load_cascade(cascade(), partial)
    assert str(partial) in str(info.value) and "stage2" in str(info.value)


def test_previous_stages(tmp_path):
    outputs = tmp_path / "outputs"
    args = (projector(), SIZES)
    assert previous_stages(*args, 1, TINY_XRAY_NETWORK, SAMPLER, outputs) is None
    with pytest.raises(CheckpointError) as info:
        previous_stages(*args, 2, TINY_XRAY_NETWORK, SAMPLER, outputs)
    assert stage_checkpoint(outputs, 1) in str(info.value)
    source = cascade(seed=4)
    save_checkpoint(source.stages[0].state_dict(), stage_checkpoint(outputs, 1))
    loaded = previous_stages(*args, 2, TINY_XRAY_NETWORK, SAMPLER, outputs)
    assert len(loaded.stages) == 1 and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    xray = xrays()
    assert torch.equal(loaded(xray), source.stages[0](xray))


def test_cascade_checkpoints_prefers_stage_files(tmp_path):
    outputs, bundle = tmp_path / "outputs", tmp_path / "bundle"
    with pytest.raises(CheckpointError) as info:
        cascade_checkpoints(outputs, bundle, 2)
    text = str(info.value)
    assert stage_checkpoint(outputs, 1) in text and stage_checkpoint(outputs, 2) in text
    assert str(bundle / "models" / "model.pt") in text
    save_checkpoint({}, bundle / "models" / "model.pt")
    save_checkpoint({}, stage_checkpoint(outputs, 1))
    assert cascade_checkpoints(outputs, bundle, 2) == str(bundle / "models" / "model.pt")  # stage 2 missing
    save_checkpoint({}, stage_checkpoint(outputs, 2))
    assert cascade_checkpoints(outputs, bundle, 2) == [stage_checkpoint(outputs, k) for k in (1, 2)]

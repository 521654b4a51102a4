# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for what X-ray -> CT sampling does beyond one DDIM sample: several samples per case (their mean, spread and
the first sample, batched or in chunks), projection guidance (the SIRT data-consistency step of the projector, off
at 0 bit for bit), the residual mode over a frozen direct regressor (oracle recovery, loading, checkpoints), the
trainer's residual step and Min-SNR weighting, the evaluator's outputs and the standard-deviation volume."""

from __future__ import annotations

import json
import math
import shlex

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Events
from torch import nn

from common.checkpoint_io import CheckpointError, save_checkpoint
from common.diffusion.engines import volume_seed
from common.diffusion.schedule import DiffusionSchedule, fast_ddpm_grid, grid_ddim_sample
from common.handlers.images import XrayCTWriter
from common.xray2ct.engines import XrayCTEvaluator, XrayCTTrainer, snr_loss_weight, xray2ct_metric_handlers
from common.xray2ct.losses import ProjectionLoss
from common.xray2ct.metrics import uncertainty_scores
from common.xray2ct.networks import (
    XrayCTDenoiser,
    XrayCTSampler,
    build_cascade,
    load_regressor,
    warn_unchecked_corrections,
)
from common.xray2ct.settings import EVALUATION, TRAINING
from tests.helpers import BUNDLES, TINY_XRAY_NETWORK, randomise_zero_parameters, tiny_xray_denoiser, xray_projector
from tests.test_xray2ct_engines import VALID as ENGINE_SETTINGS

GRID = (0, 499, 999)
SAMPLER = {"mode": "diffusion", "timesteps": GRID, "beta_schedule": "cosine"}


def volume(shape=(2, 1, 8, 8, 8), seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) * 2 - 1


def xrays(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return xray_projector().xrays(volume((batch, 1, 16, 16, 16), seed))


def residual_denoiser(seed: int = 0, with_previous: bool = False, scale: float = 0.2) -> XrayCTDenoiser:
    return tiny_xray_denoiser(seed, with_previous=with_previous, residual=True, residual_scale=scale)


def projection_error(sample: torch.Tensor, xray: torch.Tensor) -> torch.Tensor:
    return ProjectionLoss(xray_projector())(sample, xray)


# ---------------------------------------------------------------------------------------------- projector
def test_one_consistency_step_makes_a_single_view_agree_exactly():
    projector = xray_projector()
    one_view = type(projector)(fov_mm=projector.fov_mm, views=["ap"], view_size=(16, 16))
    target = one_view.xrays(volume((2, 1, 16, 16, 16), 5))
    start = volume((2, 1, 16, 16, 16), 6)
    corrected = one_view.data_consistency(start, target)
    torch.testing.assert_close(one_view.project_native(corrected), target, rtol=0, atol=1e-5)
    assert float((one_view.project_native(start) - target).abs().mean()) > 0.05
    assert one_view.data_consistency(start, target, 0.0) is start
    # the correction is constant along each ray (a back-projection) and half a step moves half the way
    delta = corrected - start
    torch.testing.assert_close(delta, delta[:, :, :, :1].expand_as(delta), rtol=0, atol=1e-6)
    torch.testing.assert_close(one_view.data_consistency(start, target, 0.5) - start, delta / 2, rtol=0, atol=1e-6)


def test_repeated_consistency_steps_converge_on_both_views():
    projector = xray_projector()
    target = projector.xrays(volume((1, 1, 16, 16, 16), 5))
    x = volume((1, 1, 16, 16, 16), 6)
    errors = []
    for _ in range(30):
        errors.append(float(projection_error(x, target)))
        x = projector.data_consistency(x, target)
    assert errors[1] < errors[0] / 2 and errors[-1] < errors[0] / 20
    assert all(b <= a + 1e-6 for a, b in zip(errors, errors[1:]))


def test_grid_ddim_sample_applies_the_x0_transform_with_consistent_noise():
    schedule = DiffusionSchedule(1000, "cosine")
    target = volume((1, 1, 4, 4, 4), 9).double()

    def model(x, t):  # a denoiser that always predicts zero noise
        return torch.zeros_like(x)

    start = volume((1, 1, 4, 4, 4), 3)
    plain = grid_ddim_sample(model, start, torch.tensor(GRID), schedule)
    assert torch.equal(plain, grid_ddim_sample(model, start, torch.tensor(GRID), schedule, x0_transform=None))
    steps = []

    def to_target(x0, t):
        steps.append(t)
        return target

    replaced = grid_ddim_sample(model, start, torch.tensor(GRID), schedule, x0_transform=to_target)
    assert steps == [999, 499, 0]
    torch.testing.assert_close(replaced, target.float(), rtol=0, atol=1e-6)  # the last step returns its x0


# ---------------------------------------------------------------------------------------------- samples
def test_guidance_zero_is_the_unguided_ddim_sample_bit_for_bit():
    net = tiny_xray_denoiser(0)
    xray = xrays()
    sampler = XrayCTSampler(net, (8, 8, 8), guidance_scale=0.0, **SAMPLER)
    with torch.no_grad():
        out = sampler(xray, generator=torch.Generator().manual_seed(4))
        condition = net.condition(xray, (8, 8, 8))
        noise = torch.randn((2, 1, 8, 8, 8), generator=torch.Generator().manual_seed(4))
        reference = grid_ddim_sample(
            lambda x, t: net(x, t, xray, None, condition=condition).float(),
            noise,
            torch.tensor(GRID),
            DiffusionSchedule(1000, "cosine"),
            prediction_type="v_prediction",
            clip_sample=True,
        )
    assert torch.equal(out, reference)


@pytest.mark.parametrize("mode", ["diffusion", "residual"])
def test_guidance_lowers_the_projection_error_of_a_sample(mode):
    net = tiny_xray_denoiser(0) if mode == "diffusion" else residual_denoiser(0)
    xray = xrays()
    errors = {}
    for scale in (0.0, 0.5, 1.0):
        sampler = XrayCTSampler(net, (8, 8, 8), **{**SAMPLER, "mode": mode}, guidance_scale=scale)
        sample = sampler(xray, generator=torch.Generator().manual_seed(2))
        assert float(sample.min()) >= -1 and float(sample.max()) <= 1
        errors[scale] = float(projection_error(sample, xray).mean())
    assert errors[0.5] < 0.8 * errors[0.0] and errors[1.0] < 0.8 * errors[0.0], errors


@pytest.mark.parametrize("mode", ["direct", "backprojection", "diffusion"])
def test_refine_steps_are_consistency_steps_on_each_drawn_sample(mode):
    """``refine_steps`` R: the sample drawn without them, then R SIRT steps of weight ``guidance_scale`` against the
    case's X-rays, clipped after each; in every mode (the same physics post-processing for every method)."""
    net = tiny_xray_denoiser(0)
    projector = net.projector
    xray = xrays(seed=5)
    settings = {**SAMPLER, "mode": mode, "num_samples": 2 if mode == "diffusion" else 1}
    scale = 0.5 if mode == "diffusion" else 1.0
    # the samples drawn without refinement (guided by the same scale: refinement comes after guidance), then the steps
    plain = XrayCTSampler(net, (8, 8, 8), **settings, guidance_scale=scale).draw(
        xray, generator=torch.Generator().manual_seed(3)
    )
    sampler = XrayCTSampler(net, (8, 8, 8), **settings, guidance_scale=scale, refine_steps=3)
    refined = sampler.draw(xray, generator=torch.Generator().manual_seed(3))
    expected = plain
    per_sample = xray.repeat_interleave(plain.shape[0] // xray.shape[0], dim=0)
    for _ in range(3):
        expected = projector.data_consistency(expected, per_sample, scale).clamp(-1, 1)
    torch.testing.assert_close(refined, expected, rtol=0, atol=1e-6)
    before = float(projection_error(plain, per_sample).mean())
    assert float(projection_error(refined, per_sample).mean()) < before


@pytest.mark.parametrize("mode", ["direct", "diffusion", "backprojection"])
def test_the_consistency_check_leaves_out_the_views_whose_first_estimate_fits_worse_than_the_reference(mode):
    """With ``consistency_reference``, each sample's first estimate (before any correction) is projected; a view
    whose residual is beyond ``mismatch_tolerance`` times its reference gives no correction, in the guidance and in
    every refinement step. A reference every view meets is no check at all; one no view meets leaves the sample
    as drawn without any correction."""
    net = tiny_xray_denoiser(0)
    projector = net.projector
    xray = xrays(seed=5)
    settings = {**SAMPLER, "mode": mode, "num_samples": 2 if mode == "diffusion" else 1, "guidance_scale": 1.0}
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    free = XrayCTSampler(net, (8, 8, 8), **settings, refine_steps=2)
    unchecked = free.draw(xray, generator=gen())
    residual = free.consistency["residual"]
    assert residual.shape == (unchecked.shape[0], 2) and bool(free.consistency["corrected"].all())
    if mode != "diffusion":  # the first estimate: the output drawn without any correction
        first = XrayCTSampler(net, (8, 8, 8), **{**settings, "guidance_scale": 0.0}).draw(xray, generator=gen())
        for name, statistic in projector.mismatch(first, xray).items():
            torch.testing.assert_close(free.consistency[name], statistic)
    wide = XrayCTSampler(net, (8, 8, 8), **settings, refine_steps=2, consistency_reference=[1e3, 1e3])
    torch.testing.assert_close(wide.draw(xray, generator=gen()), unchecked, rtol=0, atol=0)
    # the first view's reference is met, the second's is not: the second view never corrects
    limit = residual.max(0).values
    half = XrayCTSampler(
        net, (8, 8, 8), **settings, refine_steps=2, consistency_reference=[float(limit[0]), float(limit[1]) / 4]
    )
    checked = half.draw(xray, generator=gen())
    assert half.consistency["corrected"][:, 0].all() and not half.consistency["corrected"][:, 1].any()
    torch.testing.assert_close(half.consistency["residual"], residual)
    # the same through the relation's bound, the residual's met: a view beyond any bound is left out
    relation = free.consistency["relation"].max(0).values
    bounds = {"residual": [1e3, 1e3], "relation": [float(relation[0]), float(relation[1]) / 4]}
    by_relation = XrayCTSampler(net, (8, 8, 8), **settings, refine_steps=2, consistency_reference=bounds)
    torch.testing.assert_close(by_relation.draw(xray, generator=gen()), checked, rtol=0, atol=0)
    assert by_relation.consistency_reference == bounds
    none = XrayCTSampler(net, (8, 8, 8), **settings, refine_steps=2, consistency_reference=[1e-9, 1e-9])
    drawn = XrayCTSampler(net, (8, 8, 8), **{**settings, "guidance_scale": 0.0}).draw(xray, generator=gen())
    torch.testing.assert_close(none.draw(xray, generator=gen()), drawn, rtol=0, atol=1e-5)
    if mode != "diffusion":
        per_sample = xray.repeat_interleave(checked.shape[0] // xray.shape[0], dim=0)
        expected, keep = drawn, torch.tensor([[1.0, 0.0]]).expand(checked.shape[0], 2)
        for _ in range(2):
            expected = projector.data_consistency(expected, per_sample, 1.0, view_weight=keep).clamp(-1, 1)
        torch.testing.assert_close(checked, expected, rtol=0, atol=1e-6)
    for bad in ([1.0], {"residual": [1.0, 1.0], "size": [1.0, 1.0]}, {"relation": [1.0, -1.0]}, {}):
        with pytest.raises(ValueError, match=r"'consistency_reference' must be null \(no check\), a mapping"):
            XrayCTSampler(net, (8, 8, 8), **settings, consistency_reference=bad)
    with pytest.raises(ValueError, match="mismatch_tolerance must be a number > 0"):
        XrayCTSampler(net, (8, 8, 8), **settings, mismatch_tolerance=0)


def test_only_the_last_stage_of_a_cascade_takes_the_consistency_reference():
    cascade = build_cascade(
        xray_projector(),
        [(8, 8, 8), (16, 16, 16)],
        2,
        TINY_XRAY_NETWORK,
        {**SAMPLER, "guidance_scale": 1.0, "consistency_reference": [0.5, 0.25]},
    )
    assert [s.consistency_reference for s in cascade.stages] == [None, {"residual": [0.5, 0.25]}]


def test_refinement_converges_to_the_x_rays_of_a_consistent_volume():
    """X-rays made by the projector from a volume (16^3: its 8^3 block means project to them exactly): SIRT steps
    (Cimmino's method on two views) converge to a volume whose projections are those X-rays, whatever the start."""
    net = tiny_xray_denoiser(0)
    truth = volume((1, 1, 16, 16, 16), 7)
    xray = net.projector.xrays(truth)
    direct = XrayCTSampler(net, (8, 8, 8), mode="direct", clip_sample=False)
    start = float(projection_error(direct.draw(xray), xray).mean())
    refined = XrayCTSampler(net, (8, 8, 8), mode="direct", clip_sample=False, guidance_scale=1.0, refine_steps=40)
    assert float(projection_error(refined.draw(xray), xray).mean()) < 1e-3 * start


def test_several_samples_share_a_pass_and_the_first_is_the_single_sample():
    net = tiny_xray_denoiser(0)
    xray = xrays()
    single = XrayCTSampler(net, (8, 8, 8), **SAMPLER)
    many = XrayCTSampler(net, (8, 8, 8), **SAMPLER, num_samples=3)
    chunked = XrayCTSampler(net, (8, 8, 8), **SAMPLER, num_samples=3, sample_chunk=2)
    one = single.draw(xray[:1], generator=torch.Generator().manual_seed(1))
    samples = many.draw(xray[:1], generator=torch.Generator().manual_seed(1))
    assert samples.shape == (3, 1, 8, 8, 8)
    torch.testing.assert_close(samples[:1], one, rtol=0, atol=1e-4)  # the same noise, another batch size
    assert not torch.allclose(samples[1], samples[2])
    split = chunked.draw(xray[:1], generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(split, samples, rtol=0, atol=1e-4)
    # without a generator: the fixed noise, sample 0 being the single-sample noise; every case gets the same K
    fixed = many.draw(xray)
    assert fixed.shape == (6, 1, 8, 8, 8)
    torch.testing.assert_close(fixed[:1], single.draw(xray[:1]), rtol=0, atol=1e-4)
    torch.testing.assert_close(many(xray), fixed.reshape(2, 3, 1, 8, 8, 8).mean(1))
    # deterministic modes give one sample whatever K
    direct = XrayCTSampler(net, (8, 8, 8), mode="direct", num_samples=4)
    assert direct.samples_per_case() == 1 and direct.draw(xray).shape == (2, 1, 8, 8, 8)


def test_cascade_samples_condition_on_the_matching_previous_sample():
    torch.manual_seed(0)
    network = {**TINY_XRAY_NETWORK}
    cascade = build_cascade(xray_projector(), [(8, 8, 8), (16, 16, 16)], 2, network, {**SAMPLER, "num_samples": 2})
    randomise_zero_parameters(cascade, 0)
    xray = xrays(1)
    stage1, stage2 = cascade.draw(xray, torch.Generator().manual_seed(3))
    assert stage1.shape == (2, 1, 8, 8, 8) and stage2.shape == (2, 1, 16, 16, 16)
    generator = torch.Generator().manual_seed(3)
    first = cascade.stages[0].draw(xray, None, generator)
    torch.testing.assert_close(first, stage1)
    torch.testing.assert_close(cascade.stages[1].draw(xray, first, generator), stage2)  # previous sample j -> j
    assert cascade.stages[1].draw(xray, first[:1], torch.Generator().manual_seed(0)).shape == (2, 1, 16, 16, 16)
    with pytest.raises(ValueError, match="previous holds 3 volumes"):
        cascade.stages[1].draw(xray, torch.zeros(3, 1, 8, 8, 8))


@pytest.mark.parametrize(
    "settings, phrase",
    [
        ({"num_samples": 0}, "'num_samples' must be an integer >= 1, got 0."),
        ({"num_samples": True}, "'num_samples' must be an integer >= 1, got True."),
        ({"sample_chunk": 0}, "'sample_chunk' must be an integer >= 1 or null, got 0."),
        ({"guidance_scale": -1}, "'guidance_scale' must be a number >= 0"),
        ({"guidance_scale": 1.0, "refine_steps": -1}, "'refine_steps' must be an integer >= 0"),
        ({"refine_steps": 2}, "'refine_steps' 2 takes data-consistency steps of weight 'guidance_scale', which is 0"),
        ({"noise_tolerance": -0.5}, "'noise_tolerance' must be null"),
    ],
)
def test_sampler_rejects_bad_sampling_settings_with_the_settings_checks_message(settings, phrase):
    """The constructor and the bundle's settings check (``sampling_problems``) refuse a value with one message."""
    from common.xray2ct.networks import sampling_problems

    given = {"num_samples": 1, "sample_chunk": None, "guidance_scale": 0.0, "refine_steps": 0, "noise_tolerance": None}
    expected = sampling_problems(**{**given, **settings})
    assert len(expected) == 1 and phrase in expected[0]
    with pytest.raises(ValueError) as info:
        XrayCTSampler(tiny_xray_denoiser(0), (8, 8, 8), **SAMPLER, **settings)
    assert str(info.value) == expected[0]


# ---------------------------------------------------------------------------------------------- residual
class ResidualOracle(nn.Module):
    """A residual denoiser that knows the clean CT: its regressor's estimate is ``estimate`` and it returns the
    exact v of the normalised residual ``(x0 - estimate) / scale``."""

    residual = True

    def __init__(self, x0: torch.Tensor, estimate: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.x0, self.mu, self.residual_scale = x0, estimate, scale
        self.projector = xray_projector()
        self.with_previous = False
        self.schedule = DiffusionSchedule(1000, "cosine")
        self.received: list[torch.Tensor] = []

    def condition(self, xray, spatial):
        return torch.zeros(xray.shape[0], 2, *spatial), torch.zeros(xray.shape[0], 4, 16)

    def estimate(self, xray, previous, size):
        return self.mu.expand(xray.shape[0], 1, *size)

    to_volume = XrayCTDenoiser.to_volume
    to_residual = XrayCTDenoiser.to_residual

    def forward(self, x, t, xray, previous=None, condition=None, estimate=None):
        self.received.append(estimate)
        a = self.schedule.alpha_bar(t, x)
        r0 = ((self.x0 - self.mu) / self.residual_scale).double().expand_as(x)
        eps = (x.double() - a.sqrt() * r0) / (1 - a).sqrt()
        return (a.sqrt() * eps - (1 - a).sqrt() * r0).float()


def test_residual_sampler_with_an_oracle_recovers_x0():
    x0, mu = volume((1, 1, 8, 8, 8), 7) * 0.9, volume((1, 1, 8, 8, 8), 8) * 0.9
    oracle = ResidualOracle(x0, mu, 0.25)
    sampler = XrayCTSampler(oracle, (8, 8, 8), **{**SAMPLER, "mode": "residual"}, num_samples=2)
    samples = sampler.draw(xrays(1), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(samples, x0.expand(2, -1, -1, -1, -1), rtol=0, atol=1e-5)
    assert all(torch.equal(e, mu.expand(2, 1, 8, 8, 8)) for e in oracle.received)  # the estimate is an input


def test_residual_denoiser_holds_a_frozen_regressor():
    net = residual_denoiser(0, scale=0.2)
    assert net.in_channels == 1 + 2 + 1 and net.regressor is not None and not net.regressor.residual
    assert not any(p.requires_grad for p in net.regressor.parameters())
    net.train()
    assert not net.regressor.training
    xray = xrays()
    direct = XrayCTSampler(net.regressor, (8, 8, 8), mode="direct")
    torch.testing.assert_close(net.estimate(xray, None, (8, 8, 8)), direct(xray))
    x = volume()
    torch.testing.assert_close(net.to_volume(net.to_residual(x, direct(xray)), direct(xray)), x)
    with pytest.raises(ValueError, match="residual_scale must be positive"):
        tiny_xray_denoiser(0, residual=True, residual_scale=0.0)
    with pytest.raises(ValueError, match="mode 'residual' needs a residual denoiser"):
        XrayCTSampler(tiny_xray_denoiser(0), (8, 8, 8), **{**SAMPLER, "mode": "residual"})
    with pytest.raises(ValueError, match="mode 'diffusion' needs a plain denoiser"):
        XrayCTSampler(net, (8, 8, 8), **SAMPLER)


def test_residual_checkpoints_carry_the_regressor_and_refuse_the_other_kind():
    net, other = residual_denoiser(0), residual_denoiser(1)
    other.load_state_dict(net.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), other.state_dict().values()))
    assert any(k.startswith("regressor.") for k in net.state_dict())
    with pytest.raises(RuntimeError, match="input channel"):
        tiny_xray_denoiser(0).load_state_dict(net.state_dict())
    with pytest.raises(RuntimeError, match="input channel"):
        net.load_state_dict(tiny_xray_denoiser(0).state_dict())


def test_load_regressor_takes_the_direct_runs_stage(tmp_path):
    root = BUNDLES / "xray2ct_cascade"
    regressor = tiny_xray_denoiser(5)
    run = tmp_path / "direct"
    save_checkpoint(regressor.state_dict(), run / "stage1" / "models" / "model.pt")
    net = residual_denoiser(0)
    assert load_regressor(net, run, 1, root, enabled=False) is None
    assert load_regressor(net, run, 1, root) == str(run / "stage1" / "models" / "model.pt")
    assert all(torch.equal(a, b) for a, b in zip(net.regressor.state_dict().values(), regressor.state_dict().values()))
    (run / "stage1" / "configs").mkdir(parents=True)
    record = run / "stage1" / "configs" / "run.json"
    record.write_text(json.dumps({"settings": {"mode": "diffusion"}}))
    with pytest.raises(CheckpointError, match="must be a '--mode direct' run"):
        load_regressor(net, run, 1, root)
    # the record of a run whose mode was the default when it was trained: diffusion before 0.3.11, direct since
    record.write_text(json.dumps({"version": "0.3.10", "settings": {}}))
    with pytest.raises(CheckpointError, match="was trained with mode 'diffusion'"):
        load_regressor(net, run, 1, root)
    record.write_text(json.dumps({"version": "0.3.11", "settings": {}}))
    assert load_regressor(net, run, 1, root) == str(run / "stage1" / "models" / "model.pt")
    with pytest.raises(CheckpointError, match="model.pt"):
        load_regressor(net, run, 2, root)
    stage2 = tiny_xray_denoiser(5, with_previous=True).state_dict()
    save_checkpoint(stage2, tmp_path / "s2" / "stage1" / "models" / "model.pt")
    with pytest.raises(CheckpointError, match="does not fit this stage's network"):
        load_regressor(net, tmp_path / "s2", 1, root)


# ---------------------------------------------------------------------------------------------- trainer
def test_residual_training_regresses_the_normalised_residual_and_keeps_the_regressor():
    net = residual_denoiser(0, scale=0.2)
    frozen = {k: v.clone() for k, v in net.regressor.state_dict().items()}
    x0 = volume((2, 1, 8, 8, 8), 3).clamp(-0.9, 0.9)
    data = {"image": x0, "xray": xray_projector().xrays(x0)}
    schedule = DiffusionSchedule(1000, "cosine")
    grid = fast_ddpm_grid("uniform", 10)
    trainer = XrayCTTrainer(
        device="cpu",
        max_epochs=1,
        train_data_loader=[data],
        network=net,
        optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
        schedule=schedule,
        timesteps=grid,
        projector=xray_projector(),
        mode="residual",
        physics_weight=0.0,
        epoch_length=1,
    )
    steps = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: torch.manual_seed(100))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: steps.append(dict(e.state.output)))
    with torch.no_grad():
        estimate = net.estimate(data["xray"], None, (8, 8, 8))
        before = {k: v.clone() for k, v in net.state_dict().items()}
    trainer.run()
    assert all(torch.equal(frozen[k], v) for k, v in net.regressor.state_dict().items())
    assert any(not torch.equal(before[k], v) for k, v in net.state_dict().items() if not k.startswith("regressor."))
    # the recorded loss is the v-MSE of the residual (recomputed with the same noise and time steps)
    t = trainer.draw_timesteps(2, 1)
    torch.manual_seed(100)
    noise = torch.randn_like(x0)
    r0 = (x0 - estimate) / 0.2
    x_t = schedule.add_noise(r0, noise, t)
    net.load_state_dict(before)
    with torch.no_grad():
        out = net(x_t, t, data["xray"], None, None, estimate)
    torch.testing.assert_close(steps[0]["recon_loss"], F.mse_loss(out, schedule.velocity(r0, noise, t)))
    with pytest.raises(ValueError, match="mode 'diffusion' needs XrayCTDenoiser\\(residual=False\\)"):
        XrayCTTrainer(
            device="cpu",
            max_epochs=1,
            train_data_loader=[data],
            network=net,
            optimizer=trainer.optimizer,
            schedule=schedule,
            timesteps=grid,
            projector=xray_projector(),
            mode="diffusion",
        )


def test_min_snr_weights():
    schedule = DiffusionSchedule(1000, "cosine")
    t = torch.tensor([0, 300, 700, 999])
    a = schedule.alpha_bar(t, torch.zeros(4)).reshape(-1)
    snr = a / (1 - a)
    torch.testing.assert_close(snr_loss_weight(a, "v_prediction", "none"), torch.ones(4))
    v = snr_loss_weight(a, "v_prediction", "min_snr", 5.0).double()
    torch.testing.assert_close(v, snr.clamp(max=5) / (snr + 1), rtol=1e-6, atol=0)
    eps = snr_loss_weight(a, "epsilon", "min_snr", 5.0).double()
    torch.testing.assert_close(eps, snr.clamp(max=5) / snr, rtol=1e-6, atol=0)
    assert float(v[0]) < 0.2 and float(v[-1]) == pytest.approx(float(snr[-1] / (snr[-1] + 1)), rel=1e-6)
    with pytest.raises(ValueError, match="loss_weighting must be one of"):
        snr_loss_weight(a, "v_prediction", "p2")


def test_written_ct_lies_on_the_input_cts_grid(tmp_path):
    """The predicted CT is written on its input CT's grid (affine after the pipeline: orientation, spacing, crop),
    rescaled about the centre when the stage's size differs; X-ray files alone give the projector's grid."""
    from types import SimpleNamespace

    from monai.data import MetaTensor
    from monai.transforms.utils import scale_affine

    oblique = torch.tensor(
        [[0.0, -2.0, 0.0, 31.5], [1.5, 0.0, 0.0, -12.0], [0.0, 0.0, 2.5, 140.25], [0.0, 0.0, 0.0, 1.0]],
        dtype=torch.float64,
    )
    second = oblique.clone()
    second[:3, 3] += torch.tensor([5.0, 6.0, 7.0], dtype=torch.float64)
    pred = torch.rand(2, 1, 8, 8, 8)
    xray = xray_projector().xrays(pred * 2 - 1)
    for size, image_affine in ((8, torch.stack([oblique, second])), (16, torch.stack([oblique, second]))):
        image = MetaTensor(torch.zeros(2, 1, size, size, size), affine=image_affine)
        image.is_batch = True
        batch = {"image": image, "case_id": ["a", "b"]}
        state = SimpleNamespace(batch=batch, output={"pred": pred, "xray": xray, "pred_xray": xray})
        XrayCTWriter(tmp_path / str(size), xray_projector())(SimpleNamespace(state=state))
        for i, name in enumerate("ab"):
            written = nib.load(tmp_path / str(size) / f"{name}_ct.nii.gz").affine
            expected = image_affine[i].numpy() @ np.asarray(scale_affine([size] * 3, [8] * 3), dtype=np.float64)
            np.testing.assert_allclose(written, expected, atol=1e-5)
            # the centre of the predicted volume is the centre of the input CT, in world coordinates
            centre = written @ np.array([3.5, 3.5, 3.5, 1.0])
            np.testing.assert_allclose(centre, image_affine[i].numpy() @ np.array([(size - 1) / 2] * 3 + [1.0]))
    state = SimpleNamespace(batch={"case_id": ["a", "b"]}, output={"pred": pred, "xray": xray, "pred_xray": xray})
    XrayCTWriter(tmp_path / "views", xray_projector())(SimpleNamespace(state=state))
    fov = xray_projector().fov_mm
    np.testing.assert_allclose(nib.load(tmp_path / "views" / "a_ct.nii.gz").affine, np.diag([*(f / 8 for f in fov), 1]))


# ---------------------------------------------------------------------------------------------- evaluation
def test_evaluator_reports_the_mean_its_spread_and_one_sample(tmp_path):
    net = tiny_xray_denoiser(0)
    sampler = XrayCTSampler(net, (8, 8, 8), **SAMPLER, num_samples=3)
    x0 = volume((2, 1, 8, 8, 8), 3)
    data = {"image": x0, "xray": xray_projector().xrays(x0), "case_id": ["a", "b"]}
    outputs = []
    evaluator = XrayCTEvaluator(device="cpu", val_data_loader=[data], network=sampler)
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(dict(e.state.output)))
    XrayCTWriter(tmp_path, xray_projector()).attach(evaluator)
    evaluator.state.batch = None
    evaluator.run()
    (out,) = outputs
    for i, name in enumerate("ab"):
        generator = torch.Generator().manual_seed(volume_seed(data, i, 0))
        samples = sampler.draw(data["xray"][i : i + 1], generator=generator)
        torch.testing.assert_close(out["pred"][i], ((samples.mean(0) + 1) / 2).clamp(0, 1))
        torch.testing.assert_close(out["pred_std"][i], samples.std(0, correction=0) / 2)
        torch.testing.assert_close(out["pred_sample"][i], ((samples[0] + 1) / 2).clamp(0, 1))
        std = nib.load(tmp_path / f"{name}_ct_std.nii.gz")
        ct = nib.load(tmp_path / f"{name}_ct.nii.gz")
        np.testing.assert_allclose(std.affine, ct.affine)
        width = xray_projector().hu_max - xray_projector().hu_min
        np.testing.assert_allclose(std.get_fdata(), out["pred_std"][i, 0].numpy() * width, rtol=1e-5, atol=1e-3)
    assert float(out["pred_std"].min()) >= 0 and float(out["pred_std"].mean()) > 0
    assert out["sample_proj_error"].shape == (2,)
    scored = []
    labelled = data
    for scale in (1.0, 2.5):
        evaluator = XrayCTEvaluator(device="cpu", val_data_loader=[labelled], network=sampler, uncertainty_scale=scale)
        evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: scored.append(dict(e.state.output)))
        evaluator.run()
    torch.testing.assert_close(scored[1]["pred_std"], scored[0]["pred_std"] * 2.5)
    expected = uncertainty_scores(scored[1]["pred"], scored[1]["pred_std"], scored[1]["label"])
    for name, value in expected.items():
        torch.testing.assert_close(scored[1][name], value)
    assert (scored[1]["coverage_1std"] >= scored[0]["coverage_1std"]).all()  # a wider spread covers more
    with pytest.raises(ValueError, match="uncertainty_scale must be positive"):
        XrayCTEvaluator(device="cpu", val_data_loader=[labelled], network=sampler, uncertainty_scale=0)
    single = XrayCTEvaluator(device="cpu", val_data_loader=[data], network=XrayCTSampler(net, (8, 8, 8), **SAMPLER))
    single.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(dict(e.state.output)))
    single.run()
    assert "pred_std" not in outputs[-1] and "pred_sample" not in outputs[-1]
    torch.testing.assert_close(outputs[-1]["pred"], out["pred_sample"], rtol=0, atol=1e-4)


def test_a_calibration_fitted_on_cases_covers_them_as_asked(tmp_path, caplog):
    """The handler fits ``scale * (std + floor)`` on an evaluation's cases; applying it, ``+-2`` calibrated spreads
    cover 95% of their voxels (split conformal on the same cases: 95% to within one voxel), and a
    refit on the calibrated evaluation gives the same calibration of the samples' own spread. The consistency
    reference is, per statistic and view, the 95% conformal bound of the cases' first estimates (of 2 cases: the
    larger, with a warning). All of it is recorded into the run's record, whose settings evaluation and inference
    read."""
    from common.runs import RUN_FILE, run_settings
    from common.xray2ct.metrics import SamplerCalibration

    net = tiny_xray_denoiser(0)
    sampler = XrayCTSampler(net, (8, 8, 8), **SAMPLER, num_samples=3, guidance_scale=0.5)
    x0 = volume((2, 1, 8, 8, 8), 3)
    data = {"image": x0, "xray": xray_projector().xrays(x0), "case_id": ["a", "b"]}
    run = tmp_path / "run"
    (run / RUN_FILE).parent.mkdir(parents=True)
    bundle = tmp_path / "bundle"
    (bundle / "configs").mkdir(parents=True)
    (bundle / "configs" / "train.json").write_text(json.dumps({"uncertainty_scale": 1.0, "lr": 0.1}))
    (bundle / "configs" / "metadata.json").write_text("{}")
    (run / RUN_FILE).write_text(json.dumps({"bundle": "bundle", "settings": {"lr": 0.2}}))
    fitted = []
    for i, applied in enumerate(((1.0, 0.0), None)):
        if applied is None:
            applied = (fitted[0]["uncertainty_scale"], fitted[0]["uncertainty_floor"])
        evaluator = XrayCTEvaluator(
            device="cpu",
            val_data_loader=[data],
            network=sampler,
            uncertainty_scale=applied[0],
            uncertainty_floor=applied[1],
        )
        outputs = []
        evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(dict(e.state.output)))
        path = tmp_path / f"calibration{i}.json"
        SamplerCalibration(
            str(path), None if i else str(run), applied_scale=applied[0], applied_floor=applied[1], num_samples=3
        ).attach(evaluator)
        evaluator.run()
        fitted.append(json.loads(path.read_text()))
    assert fitted[0]["cases"] == 2 and fitted[0]["voxels"] == 2 * 8**3 and fitted[0]["num_samples"] == 3
    assert fitted[0]["uncertainty_floor"] > 0
    for name in ("uncertainty_scale", "uncertainty_floor"):
        assert fitted[1][name] == pytest.approx(fitted[0][name], rel=1e-5)
    covered = float(outputs[0]["coverage_2std"].mean())  # equal voxel counts: the pooled fraction
    voxel = 1 / (2 * 8**3)  # the voxel at the quantile sits on the interval's edge: rounding may leave it out
    assert 0.95 - voxel - 1e-6 <= covered <= 0.95 + voxel + 1e-6
    # two cases are too few for a 95% conformal bound (19 are needed): the largest, with a warning saying so
    assert set(fitted[0]["consistency_reference"]) == {"residual", "relation"}
    for name, bounds in fitted[0]["consistency_reference"].items():
        assert outputs[0][f"consistency_{name}"].shape == (2, 2)
        assert bounds == pytest.approx(outputs[0][f"consistency_{name}"].max(0).values.tolist())
    assert "calibrate on at least 19 cases" in caplog.text and "up to 33%" in caplog.text
    assert fitted[0]["record"] == str(run / RUN_FILE) and fitted[1]["record"] is None
    record = json.loads((run / RUN_FILE).read_text())
    assert "calibrated" in record and record["settings"]["lr"] == 0.2
    settings = run_settings(run, bundle)
    for name in ("uncertainty_scale", "uncertainty_floor", "consistency_reference"):
        assert settings[name] == pytest.approx(fitted[0][name])


@pytest.mark.parametrize("n", [1, 6, 18, 19, 20, 39, 40, 200])
def test_the_consistency_bound_is_the_conformal_rank_and_warns_below_the_cases_it_needs(n, caplog):
    """Of ``n`` cases the bound is the ``ceil((n + 1) 0.95)``-th smallest per column (the split-conformal rank:
    a new exchangeable case exceeds it with probability at most 5%); from fewer than 19 cases no such rank exists,
    so the largest is taken and one warning gives the chance a clean view exceeds it and the cases needed."""
    from common.xray2ct.metrics import conformal_bound, conformal_cases

    assert conformal_cases(0.95) == 19 and conformal_cases(0.9) == 9 and conformal_cases(0.5) == 1
    values = torch.randperm(2 * n, generator=torch.Generator().manual_seed(n)).reshape(n, 2).double()
    rank = min(n, math.ceil((n + 1) * 0.95))
    expected = [float(np.sort(values[:, v].numpy())[rank - 1]) for v in range(2)]
    assert conformal_bound(values, 0.95) == expected
    assert ("calibrate on at least 19 cases" in caplog.text) == (n < 19)
    if n < 19:
        assert f"up to {100 / (n + 1):.0f}%" in caplog.text


def test_a_calibration_with_nothing_to_fit_says_so(tmp_path):
    from common.xray2ct.metrics import SamplerCalibration

    net = tiny_xray_denoiser(0)
    x0 = volume((1, 1, 8, 8, 8), 3)
    evaluator = XrayCTEvaluator(
        device="cpu",
        val_data_loader=[{"image": x0, "xray": xray_projector().xrays(x0)}],
        network=XrayCTSampler(net, (8, 8, 8), **SAMPLER),
    )
    SamplerCalibration(str(tmp_path / "c.json")).attach(evaluator)
    with pytest.raises(ValueError, match="nothing to calibrate"):
        evaluator.run()
    assert not (tmp_path / "c.json").exists()


def test_calibrated_settings_are_no_difference_when_a_run_resumes(tmp_path):
    from common.runs import record_calibration, settings_differences

    assert settings_differences({"uncertainty_scale": 1.4, "consistency_reference": [0.1, 0.2]}, {}) == []
    assert settings_differences(
        {"uncertainty_scale": 1.4, "consistency_reference": [0.1, 0.2], "guidance_scale": 1.0},
        {"uncertainty_scale": 1.0, "consistency_reference": None, "guidance_scale": 0.5},
    ) == ["guidance_scale: checkpoint 1.0, config 0.5"]
    assert record_calibration(tmp_path, {"uncertainty_scale": 2.0}) is None  # no record: nothing written
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"\['lr'\] are not calibrated settings"):
        record_calibration(tmp_path, {"lr": 2.0})


def test_metric_handlers_add_texture_and_single_sample_metrics():
    base = {"val_psnr", "val_ssim", "val_ms_ssim", "val_proj_error", "val_hf_ratio", "val_spectral_distance"}
    assert set(xray2ct_metric_handlers()) == base | {"val_corrected_views"}
    assert set(xray2ct_metric_handlers(num_samples=4, mode="direct")) == base | {"val_corrected_views"}
    with_samples = set(xray2ct_metric_handlers(num_samples=4, mode="residual"))
    uncertainty = {"val_coverage_1std", "val_coverage_2std", "val_std_error_spearman", "val_std_error_partial_spearman"}
    single = {name.replace("val_", "val_sample_") for name in base}
    assert with_samples == base | single | uncertainty | {"val_corrected_views"}


# ---------------------------------------------------------------------------------------------- settings
VALID = {**ENGINE_SETTINGS, "stage": 1, "mode": "residual"}
#: an evaluation of a run that recorded its mode (evaluate.json reads it from the run record, ``trained``)
EVALUATED = {**VALID, "trained": {"mode": "residual"}}


def test_residual_and_sampling_settings_are_checked(tmp_path):
    save_checkpoint({}, tmp_path / "stage1" / "models" / "model.pt")
    TRAINING(**{**VALID, "regressor_dir": str(tmp_path), "num_samples": 8, "sample_chunk": 2, "guidance_scale": 0.5})
    EVALUATION(**EVALUATED)  # evaluation does not need the regressor run
    with pytest.raises(ValueError) as info:
        TRAINING(
            **{
                **VALID,
                **{"num_samples": 0, "sample_chunk": 0, "guidance_scale": -1, "residual_scale": 0},
                "loss_weighting": "p2",
            }
        )
    text = str(info.value)
    for name in ("'num_samples'", "'sample_chunk'", "'guidance_scale'", "'residual_scale'", "'loss_weighting'"):
        assert name in text, text
    assert "pass --regressor_dir" in text
    for steps, why in ((-1, "must be an integer >= 0"), (1.5, "must be an integer >= 0"), (2, "which is 0")):
        with pytest.raises(ValueError, match=f"'refine_steps' .*{why}"):
            EVALUATION(**{**EVALUATED, "refine_steps": steps, "guidance_scale": 0.0})
    EVALUATION(**{**EVALUATED, "refine_steps": 5, "guidance_scale": 1.0, "noise_tolerance": 1.5})
    with pytest.raises(ValueError, match="'noise_tolerance' must be null .* got -1"):
        EVALUATION(**{**EVALUATED, "noise_tolerance": -1})
    EVALUATION(**{**EVALUATED, "consistency_reference": [0.01, 0.02], "mismatch_tolerance": 1.5})
    EVALUATION(**{**EVALUATED, "consistency_reference": {"residual": [0.01, 0.02], "relation": [0.005, 0.01]}})
    for reference in ([0.01], [0.01, 0], "0.01", [0.01, True], {"relation": [0.01]}, {"other": [0.01, 0.02]}):
        with pytest.raises(ValueError, match=r"'consistency_reference' must be null \(no check\), a mapping"):
            EVALUATION(**{**EVALUATED, "consistency_reference": reference})
    for tolerance in (0, -1, float("inf"), None):
        with pytest.raises(ValueError, match="'mismatch_tolerance' must be a number > 0"):
            EVALUATION(**{**EVALUATED, "mismatch_tolerance": tolerance})
    with pytest.raises(ValueError, match="has no trained stage 2 regressor"):
        TRAINING(**{**VALID, "stage": 2, "regressor_dir": str(tmp_path)})


def test_corrections_without_a_calibrated_check_are_warned_once(caplog):
    """Refinement, or guidance in a diffusion mode, with no consistency reference: one warning that names what
    corrects and gives the calibration command of this run; nothing to warn when nothing corrects or the check is
    calibrated."""
    root, run = "/b/xray2ct_cascade", "runs/x"
    with caplog.at_level("WARNING", logger="common.xray2ct.networks"):
        message = warn_unchecked_corrections("direct", 1.0, 5, None, root, run, 2)
    assert [r.getMessage() for r in caplog.records] == [message]
    assert message.startswith("inference corrects every view of every case towards the projector's X-rays ")
    assert "(refine_steps 5) without a consistency check" in message
    command = message.split("cases with their CT: ")[1].split("; or pass")[0]
    assert shlex.split(command) == [
        "python", "-m", "monai.bundle", "run", "--config_file",
        json.dumps([f"{root}/configs/train.json", f"{root}/configs/evaluate.json"]),
        "--output_dir", run, "--stage", "2", "--calibrate", "True",
    ]  # fmt: skip
    guided = warn_unchecked_corrections("residual", 1.0, 5, None, root, run, 1)
    assert "(refine_steps 5 and projection guidance)" in guided
    assert "(projection guidance)" in warn_unchecked_corrections("diffusion", 0.5, 0, None, root, run, 1)
    assert warn_unchecked_corrections("direct", 1.0, 0, None, root, run, 1) is None  # guidance: diffusion only
    assert warn_unchecked_corrections("diffusion", 0.0, 0, None, root, run, 1) is None
    assert warn_unchecked_corrections("direct", 1.0, 5, [0.1, 0.1], root, run, 1) is None

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the X-ray -> CT engines: the stage trainer (direct and diffusion losses recomputed exactly, the physics
term and its weighting, the previous-stage input, Adam's first step down the loss), the sampling evaluator (outputs,
per-case seeding, earlier stages) and the settings check of the bundle."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Events
from monai.data import MetaTensor
from torch import nn

from common.diffusion.schedule import DiffusionSchedule, fast_ddpm_grid
from common.xray2ct.engines import XrayCTEvaluator, XrayCTTrainer, stage_value, xray2ct_metric_handlers
from common.xray2ct.losses import ProjectionLoss
from common.xray2ct.networks import XrayCTCascade, XrayCTSampler, degrade_to_previous
from common.xray2ct.settings import EVALUATION, SWITCHES, TRAINING
from tests.helpers import tiny_xray_denoiser, xray_projector

GRID = fast_ddpm_grid("uniform", 10)


def phantom(batch: int = 2, side: int = 8) -> torch.Tensor:
    """Air with a water block and a bone core, in [-1, 1]."""
    x0 = torch.full((batch, 1, side, side, side), -1.0)
    q = side // 4
    x0[:, :, q : 3 * q, q : 3 * q, 1 : side - 1] = 0.3
    x0[:, :, q + 1 : 3 * q - 1, q + 1 : 3 * q - 1, 2 * q - 1 : 2 * q + 1] = 0.9
    for b in range(1, batch):  # different cases
        x0[b] = x0[b].roll(b, dims=1)
    return x0


def batch(x0: torch.Tensor | None = None, **extra) -> dict:
    x0 = phantom() if x0 is None else x0
    return {"image": x0, "xray": projector().xrays(x0), **extra}


denoiser = tiny_xray_denoiser
projector = xray_projector


class AffineDenoiser(nn.Module):
    """Mimics the denoiser: ``0.5 x + bias (+ 0.25 previous)`` with a learnable volume ``bias``; records calls."""

    def __init__(self, size=(8, 8, 8), with_previous: bool = False) -> None:
        super().__init__()
        self.projector = projector()
        self.with_previous = with_previous
        gen = torch.Generator().manual_seed(3)
        self.bias = nn.Parameter(torch.rand((1, 1, *size), generator=gen) * 2 - 1)
        self.calls: list[dict] = []

    def forward(self, x, t, xray, previous=None, condition=None):
        if (previous is not None) != self.with_previous:
            raise ValueError("previous mismatch")
        out = 0.5 * x + self.bias
        if previous is not None:
            out = out + 0.25 * previous
        self.calls.append({"x": x.detach().clone(), "t": t.clone(), "xray": xray.clone(), "out": out.detach().clone()})
        self.calls[-1]["previous"] = None if previous is None else previous.detach().clone()
        return out


def make_trainer(network, batches, iterations: int = 1, lr: float = 0.0, **kwargs) -> XrayCTTrainer:
    """A trainer over ``batches`` (a plain list) for ``iterations`` epochs; ``lr = 0``: weights stay fixed."""
    kwargs.setdefault("mode", "direct")
    params = network.parameters()
    return XrayCTTrainer(
        device="cpu",
        max_epochs=iterations,
        train_data_loader=batches,
        network=network,
        optimizer=torch.optim.SGD(params, lr=0.0) if lr == 0 else torch.optim.Adam(params, lr=lr),
        schedule=DiffusionSchedule(1000, "cosine"),
        timesteps=GRID,
        projector=projector(),
        epoch_length=len(batches),
        **kwargs,
    )


def record_outputs(engine) -> list[dict]:
    outputs: list[dict] = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(dict(e.state.output)))
    return outputs


# ---------------------------------------------------------------------------------------------- trainer
def test_direct_mode_takes_adams_first_step_down_the_documented_loss():
    """One direct-mode iteration with Adam: the loss is ``l1 + physics_weight * physics`` of the network at ``x_t = 0,
    t = 0`` (recomputed on a copy of the initial network, same batch), and the update is Adam's first step in closed
    form, ``-lr g / (|g| + eps)`` per element (``m_hat = g``, ``v_hat = g^2``), a descent direction of that loss."""
    net, data, lr = denoiser(), batch(), 3e-3
    reference = copy.deepcopy(net).train()
    initial = {name: p.detach().clone() for name, p in net.named_parameters()}
    trainer = make_trainer(net, [data], iterations=1, lr=lr, physics_weight=0.1)
    outputs = record_outputs(trainer)
    trainer.run()
    (output,) = outputs
    assert {"loss", "recon_loss", "physics_loss", "timestep_mean", "image"} <= set(output)
    assert float(output["timestep_mean"]) == 0.0
    assert output["physics_loss"].ndim == 0 and float(output["physics_loss"]) > 0

    x0, xray = data["image"], data["xray"]
    prediction = reference(torch.zeros_like(x0), torch.zeros(2, dtype=torch.long), xray).float()
    recon = F.l1_loss(prediction, x0)
    physics = ProjectionLoss(projector())(prediction, xray)
    loss = recon + 0.1 * physics.mean()  # alpha_bar = 1 at t = 0
    torch.testing.assert_close(output["recon_loss"], recon.detach())
    torch.testing.assert_close(output["loss"], loss.detach())
    loss.backward()
    eps = torch.optim.Adam([torch.zeros(1)]).defaults["eps"]
    descent, moved = 0.0, 0
    for name, p in reference.named_parameters():
        before, after = initial[name], net.get_parameter(name).detach()
        delta = after - before
        if p.grad is None:  # not part of the forward pass (MONAI's ViT blocks keep an unused norm): Adam skips it
            assert torch.equal(delta, torch.zeros_like(delta)), name
            continue
        g = p.grad
        expected = -lr * g / (g.abs() + eps)
        # delta is read back as (p + step) - p in float32: at most one rounding of |p| (eps32 |p|) besides the step's
        atol = torch.finfo(torch.float32).eps * float(before.abs().max() + lr)
        torch.testing.assert_close(delta, expected, rtol=1e-4, atol=atol, msg=name)
        descent += float((expected.double() * g.double()).sum())
        moved += int(g.count_nonzero())
    assert moved > 0 and descent < 0  # sum(delta * g) = -lr sum(g^2 / (|g| + eps)) < 0: the step goes down the loss


@pytest.mark.parametrize("direct_loss", ["l1", "mse"])
@pytest.mark.parametrize("weighting", ["alpha_bar", "none"])
def test_direct_losses_are_recomputed_exactly(direct_loss, weighting):
    net, data = AffineDenoiser(), batch()
    trainer = make_trainer(net, [data], physics_weight=0.3, physics_weighting=weighting, direct_loss=direct_loss)
    trainer.run()
    output = trainer.state.output
    (call,) = net.calls
    x0 = data["image"]
    assert torch.equal(call["x"], torch.zeros_like(x0)) and torch.equal(call["t"], torch.zeros(2, dtype=torch.long))
    assert torch.equal(call["xray"], data["xray"])
    loss_fn = F.l1_loss if direct_loss == "l1" else F.mse_loss
    recon = loss_fn(call["out"], x0)
    physics = ProjectionLoss(projector())(call["out"], data["xray"])  # alpha_bar = 1 at t = 0: weights are 1
    torch.testing.assert_close(output["recon_loss"], recon)
    torch.testing.assert_close(output["physics_loss"], physics.mean())
    torch.testing.assert_close(output["loss"], recon + 0.3 * physics.mean())
    assert float(output["timestep_mean"]) == 0.0


def test_physics_weight_zero_leaves_the_reconstruction_loss():
    trainer = make_trainer(AffineDenoiser(), [batch(), batch(phantom() * 0.5)], physics_weight=0.0)
    outputs = record_outputs(trainer)
    trainer.run()
    assert len(outputs) == 2
    for output in outputs:
        assert torch.equal(output["loss"], output["recon_loss"])
        assert float(output["physics_loss"]) > 0  # still reported


@pytest.mark.parametrize("weighting", ["alpha_bar", "none"])
def test_diffusion_losses_are_recomputed_exactly(weighting):
    net, data = AffineDenoiser(), batch()
    trainer = make_trainer(net, [data], mode="diffusion", physics_weight=0.5, physics_weighting=weighting)
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: torch.manual_seed(100 + e.state.iteration))
    trainer.run()
    output = trainer.state.output
    (call,) = net.calls
    x0, t, x_t, out = data["image"], call["t"], call["x"], call["out"]
    schedule = DiffusionSchedule(1000, "cosine")
    assert set(t.tolist()) <= set(GRID.tolist()) and float(output["timestep_mean"]) == float(t.float().mean())
    torch.manual_seed(101)
    noise = torch.randn_like(x0)
    torch.testing.assert_close(x_t, schedule.add_noise(x0, noise, t))
    recon = F.mse_loss(out, schedule.velocity(x0, noise, t))
    x0_hat = schedule.split(x_t, out, t, "v_prediction")[0].float()
    physics = ProjectionLoss(projector())(x0_hat, data["xray"])
    weights = schedule.alpha_bar(t, x0).reshape(-1).float() if weighting == "alpha_bar" else torch.ones(2)
    torch.testing.assert_close(output["recon_loss"], recon)
    torch.testing.assert_close(output["physics_loss"], physics.mean())
    torch.testing.assert_close(output["loss"], recon + 0.5 * (weights * physics).mean())
    assert float(output["loss"] - output["recon_loss"]) > 0


def test_stage_two_gets_the_degraded_ct_as_previous():
    net, data = AffineDenoiser(with_previous=True), batch()
    make_trainer(net, [data], previous_size=(4, 4, 4), previous_noise=0.0).run()
    (call,) = net.calls
    torch.testing.assert_close(call["previous"], degrade_to_previous(data["image"], (4, 4, 4)))
    noisy = AffineDenoiser(with_previous=True)
    make_trainer(noisy, [data], previous_size=(4, 4, 4), previous_noise=0.5).run()
    assert not torch.allclose(noisy.calls[0]["previous"], call["previous"])


def test_stage_two_trains_the_real_denoiser():
    data = batch(phantom(side=16))
    trainer = make_trainer(
        denoiser(with_previous=True), [data], iterations=2, lr=1e-3, mode="diffusion", previous_size=(8, 8, 8)
    )
    outputs = record_outputs(trainer)
    trainer.run()
    assert len(outputs) == 2 and all(bool(torch.isfinite(o["loss"])) for o in outputs)
    assert float(outputs[0]["timestep_mean"]) > 0
    with pytest.raises(ValueError, match="needs the previous stage"):
        make_trainer(denoiser(with_previous=True), [data], mode="diffusion").run()


def test_trainer_needs_the_ct():
    trainer = make_trainer(AffineDenoiser(), [{"xray": batch()["xray"]}])
    with pytest.raises(ValueError, match="needs the CT"):
        trainer.run()


@pytest.mark.parametrize(
    "kwargs, text",
    [({"mode": "gan"}, "'gan'"), ({"direct_loss": "huber"}, "'huber'"), ({"physics_weighting": "snr"}, "'snr'")],
)
def test_trainer_rejects_bad_settings(kwargs, text):
    with pytest.raises(ValueError) as info:
        make_trainer(AffineDenoiser(), [batch()], **kwargs)
    assert text in str(info.value)


# ---------------------------------------------------------------------------------------------- evaluator
def sampler(net=None, size=(8, 8, 8)) -> XrayCTSampler:
    net = denoiser() if net is None else net
    return XrayCTSampler(net, size, "diffusion", (0, 499, 999), beta_schedule="cosine")


def evaluate(evaluator) -> list[dict]:
    outputs = record_outputs(evaluator)
    evaluator.run()
    return outputs


def test_evaluator_outputs():
    data = batch(case_id=["a", "b"])
    evaluator = XrayCTEvaluator(device="cpu", val_data_loader=[data], network=sampler())
    (output,) = evaluate(evaluator)
    pred = output["pred"]
    assert pred.shape == (2, 1, 8, 8, 8)
    assert float(pred.min()) >= 0 and float(pred.max()) <= 1 and float(pred.std()) > 0
    torch.testing.assert_close(output["label"], (data["image"] + 1) / 2)
    assert output["xray"].shape == data["xray"].shape and output["pred_xray"].shape == data["xray"].shape
    volume = pred * 2 - 1
    torch.testing.assert_close(output["pred_xray"], projector().project(volume), rtol=1e-5, atol=1e-5)
    assert output["proj_error"].shape == (2,)
    expected = ProjectionLoss(projector())(volume, data["xray"])
    torch.testing.assert_close(output["proj_error"], expected, rtol=1e-5, atol=1e-5)


def test_evaluator_is_repeatable_and_seeded_per_case():
    data = batch(case_id=["a", "b"])
    swapped = {"image": data["image"].flip(0), "xray": data["xray"].flip(0), "case_id": ["b", "a"]}
    evaluator = XrayCTEvaluator(device="cpu", val_data_loader=[data], network=sampler())
    first, second = evaluate(evaluator)[0]["pred"], evaluate(evaluator)[0]["pred"]
    assert torch.equal(first, second)
    (other,) = evaluate(XrayCTEvaluator(device="cpu", val_data_loader=[swapped], network=sampler()))
    torch.testing.assert_close(other["pred"], first.flip(0), rtol=0, atol=1e-6)  # noise follows the case
    (reseeded,) = evaluate(XrayCTEvaluator(device="cpu", val_data_loader=[data], network=sampler(), seed=1))
    assert not torch.allclose(reseeded["pred"], first)


def test_evaluator_without_ct_keeps_the_xray_metadata():
    xray = MetaTensor(batch()["xray"], meta={"case_id": ["p1", "p2"]})
    (output,) = evaluate(
        XrayCTEvaluator(device="cpu", val_data_loader=[{"xray": xray, "case_id": ["p1", "p2"]}], network=sampler())
    )
    assert "label" not in output
    assert isinstance(output["pred"], MetaTensor) and output["pred"].meta["case_id"] == ["p1", "p2"]


def test_evaluator_runs_the_earlier_stages():
    stage1, stage2 = sampler(denoiser(0)), sampler(denoiser(1, with_previous=True), (16, 16, 16))
    with pytest.raises(ValueError, match="previous"):
        XrayCTEvaluator(device="cpu", val_data_loader=[batch()], network=stage2)
    data = batch(phantom(side=16), case_id=["a", "b"])
    (output,) = evaluate(
        XrayCTEvaluator(device="cpu", val_data_loader=[data], network=stage2, previous=XrayCTCascade([stage1]))
    )
    assert output["pred"].shape == (2, 1, 16, 16, 16)
    from common.diffusion.engines import volume_seed

    full = XrayCTCascade([stage1, stage2])
    with torch.no_grad():
        for i in range(2):
            generator = torch.Generator().manual_seed(volume_seed(data, i, 0))
            expected = ((full(data["xray"][i : i + 1], generator=generator) + 1) / 2).clamp(0, 1)
            torch.testing.assert_close(output["pred"][i : i + 1], expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------- settings
VALID = {
    "stage": 2,
    "stage_sizes": [[8, 8, 8], [16, 16, 16]],
    "source_size": [16, 16, 16],
    "view_size": [16, 16],
    "views": ["ap", "lateral"],
    "mode": "diffusion",
    "prediction_type": "v_prediction",
    "grid": "uniform",
    "num_grid_steps": 10,
    "num_train_timesteps": 1000,
    "unet_channels": [8, 16],
    "attention_levels": [False, True],
    "norm_num_groups": 4,
    "num_head_channels": 8,
    "vit_patch_size": 8,
    "vit_hidden_size": 16,
    "vit_heads": 2,
    "physics_weight": 0.1,
    "physics_weighting": "alpha_bar",
    "direct_loss": "l1",
    "batch_size": 2,
    "accumulation_steps": 1,
    "ema_decay": 0.999,
    "cache_rate": 1.0,
    "replace_rate": 0.1,
    "residual_scale": 0.1,
    "regressor_dir": None,
    "loss_weighting": "none",
    "min_snr_gamma": 5.0,
    "num_samples": 1,
    "sample_chunk": None,
    "guidance_scale": 0.0,
    "refine_steps": 0,
    "noise_tolerance": None,
    "uncertainty_scale": 1.0,
    "uncertainty_floor": 0.0,
    "consistency_reference": None,
    "mismatch_tolerance": 1.0,
    "hu_window": [-1000.0, 1000.0],
    "fov_mm": 350.0,
    "mu_water": 0.2,
    "geometry": "parallel",
    "source_to_isocenter_mm": 1000.0,
    "source_to_detector_mm": 1500.0,
    "xray_condition": None,
    **dict.fromkeys(SWITCHES, False),
    "save_volumes": False,
    "calibrate": False,
    "record_calibration": True,
    "amp": "none",
    "device": "cpu",
    "memory_format": "contiguous",
}


def settings_error(**changes) -> str:
    with pytest.raises(ValueError) as info:
        TRAINING(**{**VALID, **changes})
    return str(info.value)


def test_valid_settings_pass():
    TRAINING(**VALID)
    TRAINING(**{**VALID, "stage": 1, "mode": "direct"})
    EVALUATION(**{**VALID, "mode": "backprojection", "trained": {"mode": "diffusion"}})


def test_dataset_rates_are_checked():
    TRAINING(**{**VALID, "cache_rate": 0.5, "replace_rate": 0.5})
    text = settings_error(cache_rate=1.5, replace_rate=0)
    assert "'cache_rate' must be a number in [0, 1]" in text and "'replace_rate' must be a number in (0, 1]" in text


def test_every_bad_setting_is_listed_in_one_error():
    text = settings_error(
        stage=0,
        stage_sizes=[[8, 8, 8], [4, 4, 5]],
        vit_patch_size=5,
        views=["ap", "pa"],
        mode="gan",
        attention_levels=["False", True],
        physics_weight=-0.5,
    )
    for name, value in [
        ("'stage'", "got 0"),
        ("'stage_sizes[1]'", "[4, 4, 5]"),
        ("'stage_sizes' must not shrink", "[[8, 8, 8], [4, 4, 5]]"),
        ("'vit_patch_size'", "5"),
        ("'views'", "'pa'"),
        ("'mode'", "'gan'"),
        ("'attention_levels'", "'False'"),
        ("'physics_weight'", "-0.5"),
    ]:
        line = next((line for line in text.splitlines() if name in line), None)
        assert line is not None, f"{name} missing from:\n{text}"
        assert value in line, line


@pytest.mark.parametrize(
    "changes, text",
    [
        ({"mode": "backprojection"}, "nothing to train"),
        ({"source_size": [8, 8, 8]}, "raise source_size"),
        ({"stage": 3}, "'stage' must be an integer in [1, 2]"),
        ({"physics_weighting": "snr"}, "'physics_weighting'"),
        ({"direct_loss": "huber"}, "'direct_loss'"),
        ({"grid": "cosine"}, "'grid'"),
        ({"num_grid_steps": 0}, "'num_grid_steps'"),
        ({"norm_num_groups": 3}, "'norm_num_groups' 3"),
        ({"num_head_channels": 3}, "'num_head_channels' 3"),
        ({"vit_heads": 3}, "'vit_heads' 3"),
        ({"view_size": [16]}, "'view_size'"),
        ({"batch_size": 0}, "'batch_size'"),
        ({"ema_decay": 1.0}, "'ema_decay'"),
        ({"view_files": "true"}, "'view_files' must be True or False"),
    ],
)
def test_single_bad_setting_is_named(changes, text):
    assert text in settings_error(**changes)


def test_stage_value():
    assert stage_value([[8, 8, 8], [16, 16, 16]], 2, "stage_sizes") == [16, 16, 16]
    with pytest.raises(ValueError, match="'stage_sizes' must be a list with an entry for stage 3"):
        stage_value([[8, 8, 8], [16, 16, 16]], 3, "stage_sizes")
    with pytest.raises(ValueError, match="'batch_sizes'"):
        stage_value(4, 1, "batch_sizes")
    for stage in (0, True, "1"):
        with pytest.raises(ValueError, match="'stage'"):
            stage_value([1, 2], stage, "lrs")


def test_metric_handlers_include_the_projection_error():
    metrics = xray2ct_metric_handlers(prefix="test_")
    assert {"test_psnr", "test_ssim", "test_proj_error"} <= set(metrics)
    assert all(name.startswith("test_") for name in metrics)

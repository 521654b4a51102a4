# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the diffusion workflow: channel layouts, grids, seeds, the trainer's noising and time-step draws,
accumulation and clipping, the sampling evaluator, and the settings check of the diffusion bundles."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from ignite.engine import Events
from monai.data import MetaTensor
from torch import nn

import common.diffusion.engines as workflow
from common.diffusion.engines import (
    DiffusionEvaluator,
    DiffusionTrainer,
    expand_channels,
    insert_target,
    latent_roi_size,
    sampling_grid,
    target_channel_indices,
    volume_multiple,
    volume_seed,
)
from common.diffusion.networks import DiffusionSampler
from common.diffusion.schedule import DiffusionSchedule, fast_ddpm_grid
from common.diffusion.settings import TRAINING

SIDE = 8
GRID = fast_ddpm_grid("uniform", 10)  # 11 points: 0, 99, ..., 999


# ---------------------------------------------------------------------------------------------- helpers
class ScaledTarget(nn.Module):
    """A stand-in denoiser: ``w * x[:, target]`` with a learnable scalar ``w``; records its inputs."""

    def __init__(self, target_channels, w: float = 0.5) -> None:
        super().__init__()
        self.target_channels = list(target_channels)
        self.w = nn.Parameter(torch.tensor(float(w)))
        self.inputs: list[torch.Tensor] = []
        self.timesteps: list[torch.Tensor] = []

    def forward(self, x, t):
        self.inputs.append(x.detach().clone())
        self.timesteps.append(t.detach().clone())
        return self.w * x[:, self.target_channels]


class ScaleCodec(nn.Module):
    """A latent codec stub: only the ``scale`` buffer matters to the trainer."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale)))


def image_batches(k: int, batch: int = 2, channels: int = 2, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"image": torch.rand(batch, channels, SIDE, SIDE, SIDE, generator=gen) * 2 - 1} for _ in range(k)]


def make_trainer(network, batches, target_channels=(1,), optimizer=None, max_epochs: int = 1, **kwargs):
    optimizer = optimizer if optimizer is not None else torch.optim.SGD(network.parameters(), lr=0.1)
    return DiffusionTrainer(
        device=torch.device("cpu"),
        max_epochs=max_epochs,
        train_data_loader=batches,
        network=network,
        optimizer=optimizer,
        schedule=DiffusionSchedule(1000, "linear"),
        timesteps=GRID,
        target_channels=list(target_channels),
        **kwargs,
    )


def seed_each_iteration(trainer, base: int = 1000) -> None:
    """Re-seed the global RNG right before every iteration, so the noise can be drawn again afterwards."""
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: torch.manual_seed(base + e.state.iteration))


def record_outputs(engine) -> list[dict]:
    outputs: list[dict] = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(dict(e.state.output)))
    return outputs


def record_weight(trainer, net: ScaledTarget) -> list[float]:
    """The network's weight at the start of every iteration (before that iteration's optimizer step)."""
    weights: list[float] = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: weights.append(net.w.item()))
    return weights


def alpha_bar(t: torch.Tensor) -> torch.Tensor:
    """``alphas_cumprod[t]`` of the linear DDPM schedule, computed here from the betas, shaped (B, 1, 1, 1, 1)."""
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    return torch.cumprod(1 - betas, 0)[t].reshape(-1, 1, 1, 1, 1)


def grid_index(t: torch.Tensor) -> list[int]:
    values = GRID.tolist()
    return [values.index(v) for v in t.tolist()]


# ---------------------------------------------------------------------------------------------- channel layouts
def test_insert_target_replaces_target_channels_of_a_full_input():
    gen = torch.Generator().manual_seed(0)
    condition = torch.randn(2, 3, 4, 4, 4, generator=gen)
    original = condition.clone()
    target = torch.randn(2, 1, 4, 4, 4, generator=gen, dtype=torch.float64)
    out = insert_target(condition, target, [1], in_channels=3)
    assert out.shape == (2, 3, 4, 4, 4) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, 1:2], target.float())
    torch.testing.assert_close(out[:, [0, 2]], condition[:, [0, 2]])
    torch.testing.assert_close(condition, original)  # the input is not modified in place


def test_insert_target_inserts_between_condition_channels_in_order():
    condition = torch.stack([torch.full((3, 3, 3), float(v)) for v in (10, 20)])[None]  # (1, 2, 3, 3, 3)
    target = torch.stack([torch.full((3, 3, 3), float(v)) for v in (-1, -3)])[None]
    out = insert_target(condition, target, [1, 3], in_channels=4)
    assert out.shape == (1, 4, 3, 3, 3)
    assert out[0, :, 0, 0, 0].tolist() == [10.0, -1.0, 20.0, -3.0]
    assert bool((out == out[:, :, :1, :1, :1]).all())  # every voxel of a channel holds its value
    # an unconditional model: the input is the target alone
    only = insert_target(condition[:, :0], target, [0, 1], in_channels=2)
    torch.testing.assert_close(only, target)


def test_insert_target_errors():
    condition = torch.zeros(1, 2, 3, 3, 3)
    with pytest.raises(ValueError, match=r"the target has 2 channel\(s\), expected 1 \(\[1\]\)"):
        insert_target(condition, torch.zeros(1, 2, 3, 3, 3), [1], in_channels=3)
    with pytest.raises(ValueError, match=r"the input has 1 channel\(s\); the model takes 4 .* or 2 without them"):
        insert_target(torch.zeros(1, 1, 3, 3, 3), torch.zeros(1, 2, 3, 3, 3), [0, 2], in_channels=4)


def test_target_channel_indices_and_expand_channels():
    keys = ["t1", "t2", "flair"]
    assert target_channel_indices(keys, "t1") == [0]
    assert target_channel_indices(keys, "flair") == [2]
    assert target_channel_indices(keys, "t2", channels_per_key=4) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"'target_key' 'seg' must be one of 'image_keys'"):
        target_channel_indices(keys, "seg")
    assert expand_channels([0, 2], 3) == [0, 1, 2, 6, 7, 8]
    assert expand_channels([1], 1) == [1]
    assert expand_channels(target_channel_indices(keys, "t2"), 4) == target_channel_indices(keys, "t2", 4)


# ---------------------------------------------------------------------------------------------- grids and seeds
@pytest.mark.parametrize("grid", ["uniform", "non_uniform"])
def test_sampling_grid_modes(grid):
    fast = sampling_grid("fast", grid, 10, 1000)
    assert torch.equal(fast, fast_ddpm_grid(grid, 10, 1000))
    assert sampling_grid("baseline", grid, 10, 1000).tolist() == list(range(1000))
    assert sampling_grid("baseline", grid, 10, 50).tolist() == list(range(50))


def test_sampling_grid_errors():
    with pytest.raises(ValueError, match=r"diffusion_mode must be one of \('fast', 'baseline'\), got 'ddim'"):
        sampling_grid("ddim")
    with pytest.raises(ValueError, match="num_grid_steps"):  # the grid settings are validated in both modes
        sampling_grid("baseline", "uniform", 0)
    with pytest.raises(ValueError, match="'grid' must be one of"):
        sampling_grid("fast", "linear")


def test_volume_seed_depends_on_case_id_and_seed_only():
    a = volume_seed({"case_id": "case_a"}, 0, seed=0)
    assert isinstance(a, int) and 0 <= a < 2**31
    assert volume_seed({"case_id": "case_a"}, 7, seed=0) == a  # not the position in the batch
    assert volume_seed({"case_id": "case_a", "image": torch.zeros(1)}, 0, seed=0) == a
    assert volume_seed({"case_id": "case_b"}, 0, seed=0) != a
    assert volume_seed({"case_id": "case_a"}, 0, seed=1) != a
    # list-valued case ids: the one at the index
    batch = {"case_id": ["case_x", "case_a"]}
    assert volume_seed(batch, 1, seed=0) == a
    assert volume_seed({"case_id": ["case_a", "case_y", "case_z"]}, 0, seed=0) == a
    assert volume_seed(batch, 0, seed=0) == volume_seed({"case_id": "case_x"}, 3, seed=0)
    # no name: the index decides
    assert volume_seed({}, 0) != volume_seed({}, 1)
    assert volume_seed({}, 1) == volume_seed({"image": torch.zeros(1)}, 1)
    # the name of a MetaTensor image (case_id, else file name)
    image = MetaTensor(torch.zeros(2, 1, 2, 2, 2), meta={"filename_or_obj": ["f0.nii.gz", "case_a"]})
    assert volume_seed({"image": image}, 1, seed=0) == a
    tagged = MetaTensor(torch.zeros(1, 1, 2, 2, 2), meta={"case_id": "case_b", "filename_or_obj": "case_a"})
    assert volume_seed({"image": tagged}, 0, seed=0) == volume_seed({"case_id": "case_b"}, 0, seed=0)


# ---------------------------------------------------------------------------------------------- trainer
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_trainer_noises_only_the_target_and_regresses_the_right_target(prediction_type):
    batches = image_batches(3, batch=3, channels=3)
    net = ScaledTarget([2])
    trainer = make_trainer(net, batches, target_channels=[2], prediction_type=prediction_type, seed=5)
    seed_each_iteration(trainer)
    weights = record_weight(trainer, net)
    outputs = record_outputs(trainer)
    trainer.run()
    assert len(outputs) == len(net.inputs) == 3
    for it, (batch, inputs, t, out, w) in enumerate(zip(batches, net.inputs, net.timesteps, outputs, weights), start=1):
        image = batch["image"]
        torch.testing.assert_close(inputs[:, :2], image[:, :2], rtol=0, atol=0)  # the condition stays clean
        torch.manual_seed(1000 + it)
        noise = torch.randn(image[:, 2:].shape)
        a = alpha_bar(t)
        x0 = image[:, 2:].double()
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise.double()
        torch.testing.assert_close(inputs[:, 2:].double(), x_t, rtol=0, atol=1e-6)
        target = noise.double() if prediction_type == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
        prediction = out["pred"].double()
        assert out["pred"].shape == (3, 1, SIDE, SIDE, SIDE) and not out["pred"].requires_grad
        torch.testing.assert_close(prediction, w * inputs[:, 2:].double(), rtol=1e-6, atol=1e-7)
        assert out["loss"].item() == pytest.approx(F.mse_loss(prediction, target).item(), rel=1e-5)
        assert out["timestep_mean"].item() == pytest.approx(t.float().mean().item())
        assert torch.equal(t, trainer.draw_timesteps(3, it))
        torch.testing.assert_close(out["image"], image)
    # the noise really is N(0, I): the clean image cannot be read back from x_t at large t
    assert not torch.allclose(net.inputs[0][:, 2:], batches[0]["image"][:, 2:], atol=1e-2)


def test_trainer_timesteps_are_grid_points_in_antithetic_pairs(monkeypatch):
    """Each iteration's draw is ``antithetic_timesteps`` over the trainer's whole grid: ``ceil(n / 2)`` indices drawn
    uniformly from every grid point (``randint(0, len(grid))`` with that iteration's generator, so both ends are
    reachable), then their mirrors ``len - 1 - i``."""
    calls = []
    draw = workflow.antithetic_timesteps

    def recording(grid, n, generator=None):
        calls.append((grid.clone(), n, generator.get_state()))
        return draw(grid, n, generator)

    monkeypatch.setattr(workflow, "antithetic_timesteps", recording)
    trainer = make_trainer(ScaledTarget([1]), image_batches(1), seed=3)
    last = len(GRID) - 1
    for iteration in range(1, 41):
        t = trainer.draw_timesteps(5, iteration)
        assert t.shape == (5,) and t.dtype == torch.long
        idx = grid_index(t)  # raises if a value is not a grid point
        half = (5 + 1) // 2  # ceil(n / 2) draws, then their mirrors
        for i in range(5 - half):
            assert idx[i] + idx[half + i] == last
        grid, n, state = calls[-1]
        assert torch.equal(grid, GRID) and n == 5  # the whole grid is the candidate set
        replay = torch.Generator()
        replay.set_state(state)
        assert idx[:half] == torch.randint(0, len(GRID), (half,), generator=replay).tolist()
    assert len(calls) == 40


def test_even_global_batches_are_made_of_antithetic_pairs():
    trainer = make_trainer(ScaledTarget([1]), image_batches(1), seed=0)
    last = len(GRID) - 1
    for iteration in range(1, 21):
        idx = grid_index(trainer.draw_timesteps(2, iteration))
        assert idx[0] + idx[1] == last


def test_draw_timesteps_is_a_function_of_seed_and_iteration():
    first = make_trainer(ScaledTarget([1]), image_batches(1), seed=11)
    second = make_trainer(ScaledTarget([1]), image_batches(1), seed=11)
    other = make_trainer(ScaledTarget([1]), image_batches(1), seed=12)
    torch.manual_seed(0)
    draws = [first.draw_timesteps(6, i) for i in range(1, 11)]
    torch.manual_seed(123)  # the global RNG plays no part
    assert all(torch.equal(d, second.draw_timesteps(6, i)) for i, d in enumerate(draws, start=1))
    assert any(not torch.equal(d, other.draw_timesteps(6, i)) for i, d in enumerate(draws, start=1))
    assert len({tuple(d.tolist()) for d in draws}) > 1  # iterations differ


def test_resumed_run_draws_the_same_timesteps():
    batches = image_batches(2, batch=2)
    full_net = ScaledTarget([1])
    make_trainer(full_net, batches, max_epochs=2, seed=4).run()
    assert len(full_net.timesteps) == 4
    resumed_net = ScaledTarget([1])
    resumed = make_trainer(resumed_net, batches, max_epochs=2, seed=4)
    resumed.state.epoch, resumed.state.iteration = 1, 2  # as a checkpoint loader restores them
    resumed.run()
    assert len(resumed_net.timesteps) == 2
    for t_full, t_resumed in zip(full_net.timesteps[2:], resumed_net.timesteps):
        assert torch.equal(t_full, t_resumed)


def test_ranks_draw_slices_of_the_global_batch(monkeypatch):
    trainer = make_trainer(ScaledTarget([1]), image_batches(1), seed=7)
    single = [trainer.draw_timesteps(6, i) for i in (1, 2, 3)]
    monkeypatch.setattr(workflow, "get_world_size", lambda: 2)
    per_rank = {}
    for rank in (0, 1):
        monkeypatch.setattr(workflow, "get_rank", lambda rank=rank: rank)
        per_rank[rank] = [trainer.draw_timesteps(3, i) for i in (1, 2, 3)]
    for i in range(3):
        assert torch.equal(torch.cat([per_rank[0][i], per_rank[1][i]]), single[i])

    # in a run: rank 1 with 2 samples per iteration uses entries 2..3 of the global draw of 4
    monkeypatch.setattr(workflow, "get_rank", lambda: 1)
    net = ScaledTarget([1])
    make_trainer(net, image_batches(2, batch=2), seed=7).run()
    monkeypatch.setattr(workflow, "get_world_size", lambda: 1)
    monkeypatch.setattr(workflow, "get_rank", lambda: 0)
    for it, t in enumerate(net.timesteps, start=1):
        global_draw = trainer.draw_timesteps(4, it)
        assert torch.equal(t, global_draw[2:])
        # global draw [i0, i1, mirror(i0), mirror(i1)]: the partners of rank 0's steps lie on rank 1
        assert grid_index(global_draw)[0] + grid_index(t)[0] == len(GRID) - 1
        assert grid_index(global_draw)[1] + grid_index(t)[1] == len(GRID) - 1


def test_accumulation_steps_the_optimizer_every_second_iteration():
    net = ScaledTarget([1])
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    steps = []
    original_step = optimizer.step

    def counting_step(*args, **kwargs):
        steps.append(trainer.state.iteration)
        return original_step(*args, **kwargs)

    optimizer.step = counting_step
    trainer = make_trainer(net, image_batches(5), optimizer=optimizer, accumulation_steps=2)
    weights = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: weights.append(net.w.item()))
    trainer.run()
    assert steps == [2, 4, 5]  # every 2 iterations and at the end of the epoch
    assert weights[0] == 0.5 and weights[1] != 0.5  # no update before the first step
    assert weights[2] == weights[1] and weights[3] != weights[2]


def test_accumulated_gradient_is_the_mean_of_the_micro_batch_gradients():
    batches = image_batches(2, batch=2)
    net = ScaledTarget([1], w=0.3)
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    trainer = make_trainer(net, batches, optimizer=optimizer, accumulation_steps=2)
    seed_each_iteration(trainer)
    trainer.run()
    expected = 0.0
    for it, (batch, inputs) in enumerate(zip(batches, net.inputs), start=1):
        torch.manual_seed(1000 + it)
        noise = torch.randn(batch["image"][:, 1:].shape)
        x_t = inputs[:, 1:]
        expected += (2 * (0.3 * x_t - noise) * x_t).mean().item() / 2
    assert net.w.item() == pytest.approx(0.3 - expected, rel=1e-4)  # one SGD step, lr 1


def test_grad_clip_reports_the_gradient_norm():
    batches = image_batches(2)
    net = ScaledTarget([1], w=2.0)
    trainer = make_trainer(net, batches, grad_clip=1e-3)
    seed_each_iteration(trainer)
    weights = record_weight(trainer, net)
    outputs = record_outputs(trainer)
    grads = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: grads.append(net.w.grad.item()))
    trainer.run()
    for it, (batch, out, grad, w) in enumerate(zip(batches, outputs, grads, weights), start=1):
        torch.manual_seed(1000 + it)
        noise = torch.randn(batch["image"][:, 1:].shape)
        x_t = net.inputs[it - 1][:, 1:]
        analytic = (2 * (w * x_t - noise) * x_t).mean().item()
        assert "grad_norm" in out
        assert out["grad_norm"].item() == pytest.approx(abs(analytic), rel=1e-3)
        assert abs(grad) == pytest.approx(1e-3, rel=1e-3)  # clipped
    unclipped = make_trainer(ScaledTarget([1]), batches)
    outputs = record_outputs(unclipped)
    unclipped.run()
    assert all("grad_norm" not in out for out in outputs)


def test_latent_codec_scale_multiplies_the_image_before_noising():
    batches = image_batches(2, batch=2)
    net = ScaledTarget([1])
    trainer = make_trainer(net, batches, latent_codec=ScaleCodec(0.25))
    seed_each_iteration(trainer)
    outputs = record_outputs(trainer)
    trainer.run()
    for it, (batch, inputs, t, out) in enumerate(zip(batches, net.inputs, net.timesteps, outputs), start=1):
        scaled = 0.25 * batch["image"]
        torch.testing.assert_close(out["image"], scaled)
        torch.testing.assert_close(inputs[:, :1], scaled[:, :1])
        torch.manual_seed(1000 + it)
        noise = torch.randn(scaled[:, 1:].shape).double()
        a = alpha_bar(t)
        x_t = a.sqrt() * scaled[:, 1:].double() + (1 - a).sqrt() * noise
        torch.testing.assert_close(inputs[:, 1:].double(), x_t, rtol=0, atol=1e-6)


def test_trainer_argument_errors():
    with pytest.raises(ValueError, match=r"prediction_type must be one of .*'x0'"):
        make_trainer(ScaledTarget([1]), image_batches(1), prediction_type="x0")
    with pytest.raises(ValueError, match="target_channels must name at least one channel"):
        make_trainer(ScaledTarget([1]), image_batches(1), target_channels=[])


# ---------------------------------------------------------------------------------------------- evaluator
class PointwiseDenoiser(nn.Module):
    """A tiny 1x1x1 convolution ignoring the time step: every voxel is computed on its own."""

    def __init__(self, in_channels: int = 2, out_channels: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv3d(in_channels, out_channels, 1)

    def forward(self, x, t):
        return 0.5 * self.conv(x)


class ZeroDenoiser(nn.Module):
    def forward(self, x, t):
        return torch.zeros_like(x[:, -1:])


def make_sampler(network=None, **kwargs) -> DiffusionSampler:
    kwargs.setdefault("eta", 1.0)  # ancestral noise: the per-volume generator matters
    return DiffusionSampler(
        network if network is not None else PointwiseDenoiser(),
        target_channels=[1],
        in_channels=2,
        timesteps=fast_ddpm_grid("uniform", 5),
        **kwargs,
    )


def run_evaluator(batches, sampler=None, **kwargs) -> list[dict]:
    evaluator = DiffusionEvaluator(
        device=torch.device("cpu"),
        val_data_loader=batches,
        network=sampler if sampler is not None else make_sampler(),
        **kwargs,
    )
    outputs = record_outputs(evaluator)
    evaluator.run()
    return outputs


def case_batch(names: list[str], volumes: dict[str, torch.Tensor]) -> dict:
    image = torch.stack([volumes[n] for n in names])
    return {"image": image, "label": image[:, 1:].clone(), "case_id": list(names)}


def case_volumes(names, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.rand(2, SIDE, SIDE, SIDE, generator=gen) * 2 - 1 for n in names}


def test_evaluator_outputs_shapes_ranges_and_labels():
    volumes = case_volumes(["a", "b"])
    batch = case_batch(["a", "b"], volumes)
    batch["label"][0, 0, 0, 0, 0] = 1.5  # out of range: clipped
    out = run_evaluator([batch], num_samples=3)[0]
    pred = out["pred"]
    assert pred.shape == (6, 1, SIDE, SIDE, SIDE)
    assert float(pred.min()) >= 0.0 and float(pred.max()) <= 1.0
    assert float(pred.std()) > 0.01
    assert not torch.allclose(pred[0], pred[1])  # samples of one volume differ (different start noise)
    expected_label = ((batch["label"] + 1) / 2).clamp(0, 1).repeat_interleave(3, dim=0)
    torch.testing.assert_close(out["label"], expected_label)
    assert out["label"][0, 0, 0, 0, 0].item() == 1.0
    torch.testing.assert_close(out["label"][3], (volumes["b"][1:] + 1) / 2)
    assert out["image"] is batch["image"] or torch.equal(out["image"], batch["image"])
    assert "denoise_loss" not in out


def test_evaluator_samples_do_not_depend_on_batch_order_or_neighbours():
    volumes = case_volumes(["a", "b", "c"])
    first = run_evaluator([case_batch(["a", "b"], volumes)], num_samples=2, seed=3)
    second = run_evaluator([case_batch(["c"], volumes), case_batch(["b", "a"], volumes)], num_samples=2, seed=3)
    pred_first = {"a": first[0]["pred"][0:2], "b": first[0]["pred"][2:4]}
    pred_second = {"b": second[1]["pred"][0:2], "a": second[1]["pred"][2:4]}
    for name in ("a", "b"):
        torch.testing.assert_close(pred_first[name], pred_second[name], rtol=0, atol=1e-6)
    assert not torch.allclose(pred_first["a"], pred_first["b"])
    # another base seed gives other samples
    other = run_evaluator([case_batch(["a"], volumes)], num_samples=2, seed=4)
    assert not torch.allclose(other[0]["pred"], pred_first["a"])


def test_evaluator_keeps_the_metadata_of_the_input():
    affine = torch.diag(torch.tensor([2.0, 3.0, 4.0, 1.0]))
    affine[:3, 3] = torch.tensor([5.0, 6.0, 7.0])
    image = MetaTensor(torch.rand(1, 2, SIDE, SIDE, SIDE) * 2 - 1, affine=affine)
    image.meta["filename_or_obj"] = ["case_7.nii.gz"]
    out = run_evaluator([{"image": image}], num_samples=1)[0]
    assert isinstance(out["pred"], MetaTensor)
    assert out["pred"].shape == (1, 1, SIDE, SIDE, SIDE)
    torch.testing.assert_close(out["pred"].affine.float(), affine)
    assert out["pred"].meta["filename_or_obj"] == ["case_7.nii.gz"]
    assert "label" not in out


def test_evaluator_denoise_loss():
    volumes = case_volumes(["a", "b"])
    batch = case_batch(["a", "b"], volumes)
    sampler = make_sampler(ZeroDenoiser(), eta=0.0)
    out = run_evaluator([batch], sampler=sampler, compute_loss=True, seed=2)[0]
    assert out["denoise_loss"].shape == (2,)
    # a network predicting zeros has the mean squared noise as its epsilon loss; the noise comes from the
    # volume's own generator (seeded by volume_seed with seed + 1), one draw per loss time step
    for i, name in enumerate(["a", "b"]):
        gen = torch.Generator().manual_seed(volume_seed({"case_id": name}, 0, seed=3))
        squares = [torch.randn(1, 1, SIDE, SIDE, SIDE, generator=gen).pow(2).mean() for _ in sampler.loss_timesteps]
        assert out["denoise_loss"][i].item() == pytest.approx(torch.stack(squares).mean().item(), rel=1e-5)
    assert 0.8 < float(out["denoise_loss"].mean()) < 1.2


def test_evaluator_rejects_no_samples():
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        DiffusionEvaluator(device="cpu", val_data_loader=[], network=make_sampler(), num_samples=0)


# ---------------------------------------------------------------------------------------------- settings check
VALID = dict(
    task="synthesis",
    image_keys=["t1", "t2"],
    target_key="t2",
    diffusion_mode="fast",
    grid="uniform",
    num_grid_steps=10,
    num_train_timesteps=1000,
    prediction_type="epsilon",
    patch_size=[32, 32, 32],
    unet_channels=[32, 64, 64],
    norm_num_groups=16,
    eta=0.0,
    ema_decay=0.9999,
    batch_size=2,
    accumulation_steps=1,
    val_num_samples=1,
    space_downsample=None,
    attention_levels=[False, False, True],
    num_head_channels=32,
    cache_rate=1.0,
    replace_rate=0.1,
    latent=False,
    clip_sample=True,
    val_denoise_loss=True,
    ema_warmup=True,
    compile=False,
    preflight=True,
    allow_irregular_series=False,
    oom_backoff=True,
    amp="none",
    device="cpu",
    memory_format="contiguous",
)


def problems_of(**changes) -> list[str]:
    with pytest.raises(ValueError, match="invalid diffusion configuration") as info:
        TRAINING(**{**VALID, **changes})
    return str(info.value).splitlines()[1:]


def test_check_diffusion_settings_accepts_valid_settings():
    TRAINING(**VALID)
    TRAINING(**{**VALID, "task": "unconditional", "image_keys": ["t2"], "val_num_samples": 2})
    TRAINING(**{**VALID, "patch_size": [64, 64, 32], "space_downsample": [4, 4, 4]})
    TRAINING(**{**VALID, "diffusion_mode": "baseline", "grid": "non_uniform"})
    TRAINING(**{**VALID, "attention_levels": None, "num_head_channels": 24})


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"task": "segmentation"}, r"'task' must be one of .*'segmentation'"),
        ({"image_keys": "t1"}, r"'image_keys' must be a list of distinct datalist keys"),
        ({"image_keys": ["t1", "t1"], "target_key": "t1"}, r"'image_keys' must be a list of distinct"),
        ({"target_key": "flair"}, r"'target_key' 'flair' must be one of 'image_keys'"),
        ({"task": "unconditional", "val_num_samples": 2}, r"task 'unconditional' generates 'target_key' alone"),
        ({"image_keys": ["t2"]}, r"task 'synthesis' needs at least one source"),
        ({"diffusion_mode": "ddim"}, r"'diffusion_mode' must be one of"),
        ({"num_grid_steps": 0}, r"'num_grid_steps' must be in \[1, num_train_timesteps=1000\], got 0"),
        ({"num_grid_steps": 1001}, r"'num_grid_steps' must be in \[1, num_train_timesteps=1000\], got 1001"),
        ({"num_train_timesteps": 0}, r"'num_train_timesteps' must be an integer >= 1"),
        ({"grid": "linear"}, r"'grid' must be one of .*'linear'"),
        ({"prediction_type": "x0"}, r"'prediction_type' must be one of .*'x0'"),
        ({"eta": 1.5}, r"'eta' must be in \[0, 1\], got 1.5"),
        ({"eta": -0.1}, r"'eta' must be in \[0, 1\]"),
        ({"ema_decay": 1.0}, r"'ema_decay' must be in \(0, 1\), got 1.0"),
        ({"ema_decay": 0}, r"'ema_decay' must be in \(0, 1\)"),
        ({"batch_size": 0}, r"'batch_size' must be >= 1, got 0"),
        ({"accumulation_steps": 0}, r"'accumulation_steps' must be an integer >= 1"),
        ({"val_num_samples": 0}, r"'val_num_samples' must be >= 1"),
        (
            {"task": "unconditional", "image_keys": ["t2"], "val_num_samples": 1},
            r"'val_num_samples' must be >= 2 for task 'unconditional'",
        ),
        ({"norm_num_groups": 24}, r"'unet_channels' \[32, 64, 64\] must be divisible by 'norm_num_groups' 24"),
        ({"patch_size": [32, 30, 32]}, r"'patch_size' \[32, 30, 32\] must be divisible by 4"),
        (
            {"patch_size": [32, 32, 24], "space_downsample": [4, 4, 4]},
            r"'patch_size' \[32, 32, 24\] must be divisible by 4 .* downsampling \[4, 4, 4\]",
        ),
        ({"patch_size": [32, 32]}, r"'patch_size' must be 3 positive integers"),
        ({"attention_levels": ["false", "false", "true"]}, r"'attention_levels' must be a list of 3 booleans"),
        ({"attention_levels": [False, True]}, r"'attention_levels' must be a list of 3 booleans"),
        (
            {"attention_levels": [True, False, False], "num_head_channels": 24},
            r"'num_head_channels' 24 must divide the channels \[32, 64\]",
        ),
        ({"num_head_channels": 48}, r"'num_head_channels' 48 must divide the channels \[64\]"),
        ({"cache_rate": 1.5}, r"'cache_rate' must be a number in \[0, 1\]"),
        ({"replace_rate": 0.0}, r"'replace_rate' must be a number in \(0, 1\]"),
    ],
)
def test_check_diffusion_settings_reports_each_problem(changes, pattern):
    problems = problems_of(**changes)
    assert any(re.search(pattern, p) for p in problems), problems


def test_string_attention_levels_are_rejected_even_when_the_length_matches():
    problems = problems_of(unet_channels=[32, 64], attention_levels=["false", "true"], num_head_channels=32)
    assert len(problems) == 1 and "'attention_levels'" in problems[0] and "['false', 'true']" in problems[0]


def test_latent_downsample_is_part_of_the_patch_check():
    TRAINING(**{**VALID, "patch_size": [32, 32, 24]})  # 24 is divisible by the U-Net's 4 ...
    assert problems_of(patch_size=[32, 32, 24], space_downsample=[1, 1, 4])  # ... but not by 4 x 4
    # a downsampling of 1 on every axis (train.json's space_downsample without latents) names no autoencoder
    (problem,) = problems_of(patch_size=[32, 30, 32], space_downsample=[1, 1, 1])
    assert "autoencoder" not in problem and "must be divisible by 4" in problem


def test_volume_multiple_and_latent_roi_size():
    """The padding multiple of whole volumes and the crop in the U-Net's space, with and without latents."""
    assert volume_multiple([32, 64, 128, 256], [1, 1, 1]) == [8, 8, 8]
    assert volume_multiple([8, 16], [4, 4, 2]) == [8, 8, 4]
    assert latent_roi_size([64, 64, 32], [1, 1, 1]) == [64, 64, 32]
    assert latent_roi_size([64, 64, 32], [4, 4, 2]) == [16, 16, 16]


def test_check_diffusion_settings_reports_all_problems_together():
    problems = problems_of(task="segmentation", eta=2.0, ema_decay=0.0, batch_size=0, norm_num_groups=24, grid="x")
    assert len(problems) == 6
    for name in ("'task'", "'eta'", "'ema_decay'", "'batch_size'", "'norm_num_groups'", "'grid'"):
        assert sum(name in p for p in problems) == 1, (name, problems)


def test_check_diffusion_settings_rejects_a_degenerate_non_uniform_grid():
    # int(0.4 S) points below t=699 and int(0.6 S) from 699 to 999: S < 4 would leave a stage empty or never
    # reach the last step (S = 1: an empty grid; S = 2: [699])
    for steps in (1, 2, 3):
        with pytest.raises(ValueError, match="needs num_grid_steps >= 4"):
            fast_ddpm_grid("non_uniform", steps)
        problems = problems_of(grid="non_uniform", num_grid_steps=steps)
        assert len(problems) == 1 and problems[0].strip().startswith("'num_grid_steps'"), problems
    assert fast_ddpm_grid("non_uniform", 4).tolist() == [0, 699, 999]


def test_switches_must_be_booleans():
    problems = problems_of(latent="false", clip_sample=True, ema_warmup=1)
    assert len(problems) == 2
    assert "'latent' must be True or False" in problems[0] and "got 'false'" in problems[0]
    assert "'ema_warmup' must be True or False" in problems[1]
    TRAINING(**{**VALID, "latent": False, "clip_sample": True})

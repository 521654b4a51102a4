# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the autoencoder-GAN trainer: loss terms, adversarial warm-up, gradients, accumulation, clipping, AMP."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from ignite.engine import Events
from monai.data import MetaTensor
from monai.engines.utils import IterationEvents
from monai.losses import PatchAdversarialLoss
from torch import nn

from common.autoencoder.adversarial import HingeAdversarialLoss
from common.autoencoder.engines import AutoencoderGANTrainer, prepare_image_batch
from common.autoencoder.losses import kl_divergence
from common.demo.images import make_phantom
from common.errors import SettingsError
from tests.helpers import bundle_parser, tiny_autoencoder, tiny_discriminator

SIDE = 16


class ConvNet(nn.Module):
    """A deterministic stand-in generator returning a plain tensor (no posterior sampling)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv3d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.conv1(x)))


class QuantNet(ConvNet):
    """Returns ``(recon, quantization_loss)`` like a VQ-VAE."""

    def forward(self, x):
        y = super().forward(x)
        return y, (y - x).pow(2).mean() + 0.25


def phantom_batch(n: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.stack([make_phantom((SIDE,) * 3, seed=seed + i) for i in range(n)]))[:, None]


def random_batches(k: int, n: int = 2, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(n, 1, SIDE, SIDE, SIDE, generator=gen) for _ in range(k)]


def make_trainer(network, batches, optimizer=None, max_epochs: int = 1, **kwargs) -> AutoencoderGANTrainer:
    optimizer = optimizer if optimizer is not None else torch.optim.Adam(network.parameters(), lr=1e-3)
    kwargs.setdefault("decollate", False)  # batch-level dicts are easier to compare with manual computations
    return AutoencoderGANTrainer(
        device=torch.device("cpu"),
        max_epochs=max_epochs,
        train_data_loader=[{"image": b} for b in batches],
        network=network,
        optimizer=optimizer,
        **kwargs,
    )


def record_outputs(trainer) -> list[dict]:
    outputs: list[dict] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(dict(e.state.output)))
    return outputs


def record_params(trainer, module: nn.Module) -> list[list[torch.Tensor]]:
    snapshots = [[p.detach().clone() for p in module.parameters()]]
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: snapshots.append([p.detach().clone() for p in module.parameters()])
    )
    return snapshots


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- learning
def test_first_step_is_adams_closed_form_descent_step_on_the_training_loss():
    """Adam's first step is ``-lr * g / (|g| + eps)`` elementwise (bias corrections cancel the moment decays), with
    ``g`` the gradient of the trainer's loss (L1 + kl_weight * KL) at the initial weights: recomputed here on the
    same batch, with the global RNG state the trainer's forward pass drew the posterior sample from."""
    ae = tiny_autoencoder()
    reference = copy.deepcopy(ae)
    before = [p.detach().clone() for p in ae.parameters()]
    batch = phantom_batch()
    lr, eps, kl_weight = 1e-3, 1e-8, 1e-7
    trainer = make_trainer(
        ae, [batch], optimizer=torch.optim.Adam(ae.parameters(), lr=lr, eps=eps), kl_weight=kl_weight
    )
    rng_states = []
    ae.register_forward_pre_hook(lambda module, args: rng_states.append(torch.get_rng_state()))
    outputs = record_outputs(trainer)
    trainer.run()
    assert len(rng_states) == 1 and len(outputs) == 1

    torch.set_rng_state(rng_states[0])
    recon, z_mu, z_sigma = reference(batch)
    recon_loss = (recon - batch).abs().mean()
    kl = kl_divergence(z_mu, z_sigma)
    grads = torch.autograd.grad(recon_loss + kl_weight * kl, list(reference.parameters()))
    out = outputs[0]
    torch.testing.assert_close(out["pred"], recon.detach())  # the same forward pass, posterior sample included
    assert out["recon_loss"].item() == pytest.approx(recon_loss.item(), rel=1e-6)
    assert out["kl_loss"].item() == pytest.approx(kl.item(), rel=1e-6)

    descent = 0.0
    for after, start, g in zip(ae.parameters(), before, grads):
        step = after.detach().double() - start.double()
        g = g.double()
        expected = -lr * g / (g.abs() + eps)
        # float32 weights hold the step to half an ulp of the weight: atol 1e-6 x max|weight| covers it
        torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-6 * float(start.abs().max()))
        descent += float((step * g).sum())
    assert descent < 0  # a descent direction: -lr * sum(g^2 / (|g| + eps)) < 0 for any non-zero gradient
    # the reported reconstruction loss is the L1 distance of the reported reconstruction
    assert out["recon_loss"].item() == pytest.approx((out["pred"] - out["image"]).abs().mean().item(), rel=1e-5)


def test_outputs_are_detached_and_complete():
    ae = tiny_autoencoder()
    trainer = make_trainer(ae, random_batches(1), kl_weight=1e-3)
    outputs = record_outputs(trainer)
    trainer.run()
    out = outputs[0]
    assert {"image", "label", "pred", "loss", "recon_loss", "kl_loss"} <= set(out)
    assert not {"adv_loss", "d_loss", "quantization_loss", "perceptual_loss", "grad_norm"} & set(out)
    assert all(not v.requires_grad for v in out.values() if isinstance(v, torch.Tensor))
    assert out["pred"].shape == out["image"].shape == (2, 1, SIDE, SIDE, SIDE)


def test_decollated_output_has_one_dict_per_sample():
    batch = random_batches(1, n=3)[0]
    trainer = make_trainer(ConvNet(), [batch], decollate=True, grad_clip=1.0)
    outputs: list = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    trainer.run()
    samples = outputs[0]
    assert isinstance(samples, list) and len(samples) == 3
    with torch.no_grad():
        recon = ConvNet()(batch)
    loss = (recon - batch).abs().mean()
    for i, sample in enumerate(samples):
        assert torch.equal(sample["image"], batch[i])
        torch.testing.assert_close(sample["pred"], recon[i])
        assert float(sample["loss"]) == pytest.approx(loss.item(), rel=1e-6)  # scalars replicated per sample
        assert float(sample["recon_loss"]) == pytest.approx(loss.item(), rel=1e-6)
        assert "grad_norm" in sample


# ---------------------------------------------------------------------------------------------- loss terms
def test_kl_term_for_autoencoder_kl():
    ae = tiny_autoencoder()
    captured = []
    ae.register_forward_hook(lambda module, inputs, output: captured.append(output))
    trainer = make_trainer(ae, random_batches(1), kl_weight=0.5)
    outputs = record_outputs(trainer)
    trainer.run()
    out = outputs[0]
    _, z_mu, z_sigma = captured[0]
    assert out["kl_loss"].item() == pytest.approx(kl_divergence(z_mu, z_sigma).item(), rel=1e-6)
    assert out["kl_loss"].item() > 0
    assert out["loss"].item() == pytest.approx(out["recon_loss"].item() + 0.5 * out["kl_loss"].item(), rel=1e-6)


def test_quantization_term_for_vq_style_output():
    net = QuantNet()
    batch = random_batches(1)[0]
    trainer = make_trainer(net, [batch], quantization_weight=2.0)
    outputs = record_outputs(trainer)
    with torch.no_grad():
        recon, expected_q = QuantNet()(batch)
    trainer.run()
    out = outputs[0]
    assert "kl_loss" not in out
    assert out["quantization_loss"].item() == pytest.approx(expected_q.item(), rel=1e-6)
    assert out["recon_loss"].item() == pytest.approx((recon - batch).abs().mean().item(), rel=1e-6)
    assert out["loss"].item() == pytest.approx(out["recon_loss"].item() + 2.0 * expected_q.item(), rel=1e-6)


def test_perceptual_term_is_weighted_and_optional():
    batch = random_batches(1)[0]
    perceptual = nn.MSELoss()
    trainer = make_trainer(ConvNet(), [batch], perceptual_loss=perceptual, perceptual_weight=3.0)
    outputs = record_outputs(trainer)
    with torch.no_grad():
        recon = ConvNet()(batch)
    trainer.run()
    out = outputs[0]
    assert out["perceptual_loss"].item() == pytest.approx(((recon - batch) ** 2).mean().item(), rel=1e-5)
    assert out["loss"].item() == pytest.approx(out["recon_loss"].item() + 3.0 * out["perceptual_loss"].item(), rel=1e-6)

    trainer = make_trainer(ConvNet(), [batch], perceptual_loss=perceptual, perceptual_weight=0.0)
    outputs = record_outputs(trainer)
    trainer.run()
    assert "perceptual_loss" not in outputs[0]
    assert outputs[0]["loss"].item() == pytest.approx(outputs[0]["recon_loss"].item(), rel=1e-7)


# ---------------------------------------------------------------------------------------------- adversarial part
def test_adversarial_warmup():
    ae, disc = tiny_autoencoder(), tiny_discriminator()
    trainer = make_trainer(
        ae,
        random_batches(4),
        discriminator=disc,
        d_optimizer=torch.optim.Adam(disc.parameters(), lr=1e-3),
        adv_weight=0.1,
        adv_warmup_iterations=2,
        kl_weight=1e-6,
    )
    outputs = record_outputs(trainer)
    d_params = record_params(trainer, disc)
    trainer.run()
    assert [trainer.adversarial_active(i) for i in (1, 2, 3, 4)] == [False, False, True, True]
    for i in (0, 1):  # iterations 1 and 2
        assert "d_loss" not in outputs[i] and "adv_loss" not in outputs[i]
        assert same(d_params[i + 1], d_params[0])
    for i in (2, 3):  # iterations 3 and 4
        out = outputs[i]
        assert torch.isfinite(out["d_loss"]) and torch.isfinite(out["adv_loss"])
        assert not same(d_params[i + 1], d_params[i])
        expected = out["recon_loss"] + 1e-6 * out["kl_loss"] + 0.1 * out["adv_loss"]
        assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-6)


def test_no_adversarial_terms_with_zero_weight():
    disc = tiny_discriminator()
    trainer = make_trainer(
        ConvNet(),
        random_batches(2),
        discriminator=disc,
        d_optimizer=torch.optim.SGD(disc.parameters(), lr=0.1),
        adv_weight=0.0,
    )
    outputs = record_outputs(trainer)
    d_params = record_params(trainer, disc)
    trainer.run()
    assert all("d_loss" not in o and "adv_loss" not in o for o in outputs)
    assert same(d_params[-1], d_params[0])


def _manual_d_loss(disc: nn.Module, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    adv = PatchAdversarialLoss(criterion="least_squares")
    return 0.5 * (
        adv(disc(fake)[-1], target_is_real=False, for_discriminator=True)
        + adv(disc(real)[-1], target_is_real=True, for_discriminator=True)
    )


def test_discriminator_gradients_come_only_from_its_own_step():
    # with accumulation the discriminator's gradients are not zeroed between the generator step and its own
    # step, so any gradient the generator step left on it would add to what the discriminator step computes
    disc = tiny_discriminator()
    reference = copy.deepcopy(disc)
    batches = random_batches(2)
    trainer = make_trainer(
        ConvNet(),
        batches,
        discriminator=disc,
        d_optimizer=torch.optim.SGD(disc.parameters(), lr=0.0),
        adv_weight=1.0,
        adv_warmup_iterations=0,
        accumulation_steps=2,
    )
    outputs = record_outputs(trainer)
    trainer.run()

    reference.train()
    d_losses = [_manual_d_loss(reference, out["pred"], out["image"]) for out in outputs]
    for out, d_loss in zip(outputs, d_losses):
        assert out["d_loss"].item() == pytest.approx(d_loss.item(), rel=1e-5)
    # accumulated as the trainer does: one backward of d_loss / 2 per iteration, the gradients summed
    parts = [torch.autograd.grad(0.5 * d_loss, list(reference.parameters())) for d_loss in d_losses]
    expected = [a + b for a, b in zip(*parts)]
    for param, grad in zip(disc.parameters(), expected):
        torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()))
    assert all(p.requires_grad for p in disc.parameters())  # unfrozen after the generator step

    # the generator's adversarial gradient w.r.t. the discriminator is far from negligible, so a leak would show
    adv = PatchAdversarialLoss(criterion="least_squares")
    g_adv = adv(reference(outputs[1]["pred"])[-1], target_is_real=True, for_discriminator=False)
    leak = torch.autograd.grad(g_adv, list(reference.parameters()))
    assert sum(g.norm() for g in leak) > 1e-2 * sum(g.norm() for g in expected)


def test_generator_gradients_include_adversarial_term_through_discriminator():
    gen, disc = ConvNet(), tiny_discriminator()
    gen_ref, disc_ref = copy.deepcopy(gen), copy.deepcopy(disc)
    batch = random_batches(1)[0]
    trainer = make_trainer(
        gen,
        [batch],
        optimizer=torch.optim.SGD(gen.parameters(), lr=0.0),
        discriminator=disc,
        d_optimizer=torch.optim.SGD(disc.parameters(), lr=0.0),
        adv_weight=0.5,
    )
    trainer.run()
    adv = PatchAdversarialLoss(criterion="least_squares")
    recon = gen_ref(batch)
    loss = (recon - batch).abs().mean() + 0.5 * adv(disc_ref(recon)[-1], target_is_real=True, for_discriminator=False)
    expected = torch.autograd.grad(loss, list(gen_ref.parameters()))
    for param, grad in zip(gen.parameters(), expected):
        torch.testing.assert_close(param.grad, grad, rtol=1e-5, atol=1e-7)


def test_discriminator_requires_optimizer():
    with pytest.raises(ValueError, match="d_optimizer"):
        make_trainer(ConvNet(), random_batches(1), discriminator=tiny_discriminator())


# ---------------------------------------------------------------------------------------------- accumulation
def test_gradient_accumulation_steps_every_second_iteration():
    net = ConvNet()
    reference = copy.deepcopy(net)
    batches = random_batches(4)
    lr = 0.5
    trainer = make_trainer(net, batches, optimizer=torch.optim.SGD(net.parameters(), lr=lr), accumulation_steps=2)
    snapshots = record_params(trainer, net)
    trainer.run()
    assert same(snapshots[1], snapshots[0])  # iteration 1: no step
    assert not same(snapshots[2], snapshots[1])  # iteration 2: step
    assert same(snapshots[3], snapshots[2])  # iteration 3: no step
    assert not same(snapshots[4], snapshots[3])  # iteration 4: step

    # the step after two micro-batches is the step on their mean loss
    loss = 0.5 * ((reference(batches[0]) - batches[0]).abs().mean() + (reference(batches[1]) - batches[1]).abs().mean())
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    for after, before, grad in zip(snapshots[2], snapshots[0], grads):
        # a few float32 roundings of the weight and of the summed gradient: 1e-6 x the largest weight
        torch.testing.assert_close(after, before - lr * grad, rtol=1e-5, atol=1e-6 * float(before.abs().max()))


def test_gradient_accumulation_steps_at_the_end_of_an_odd_epoch():
    net = ConvNet()
    trainer = make_trainer(
        net, random_batches(3), optimizer=torch.optim.SGD(net.parameters(), lr=0.5), accumulation_steps=2, max_epochs=2
    )
    snapshots = record_params(trainer, net)
    trainer.run()
    changed = [not same(snapshots[i], snapshots[i - 1]) for i in range(1, 7)]
    assert changed == [False, True, True, False, True, True]


def test_bad_accumulation_steps():
    with pytest.raises(ValueError, match="'accumulation_steps' must be an integer >= 1 .*got 0"):
        make_trainer(ConvNet(), random_batches(1), accumulation_steps=0)


# ---------------------------------------------------------------------------------------------- clipping
def test_grad_clip_reports_norm_and_matches_clip_grad_norm():
    net = ConvNet()
    reference = copy.deepcopy(net)
    batch = random_batches(1)[0]
    lr, max_norm = 1.0, 1e-3
    trainer = make_trainer(net, [batch], optimizer=torch.optim.SGD(net.parameters(), lr=lr), grad_clip=max_norm)
    outputs = record_outputs(trainer)
    trainer.run()

    loss = (reference(batch) - batch).abs().mean()
    loss.backward()
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert outputs[0]["grad_norm"].item() == pytest.approx(total.item(), rel=1e-5)
    assert total.item() > 10 * max_norm  # clipping really happens
    torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    for got, want in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    step = torch.cat([(g - w).flatten() for g, w in zip(net.parameters(), ConvNet().parameters())])
    assert step.norm().item() == pytest.approx(lr * max_norm, rel=1e-3)


def test_grad_clip_reports_discriminator_norm():
    disc = tiny_discriminator()
    trainer = make_trainer(
        ConvNet(),
        random_batches(1),
        discriminator=disc,
        d_optimizer=torch.optim.SGD(disc.parameters(), lr=0.01),
        grad_clip=1.0,
    )
    outputs = record_outputs(trainer)
    trainer.run()
    assert outputs[0]["grad_norm"].item() > 0 and outputs[0]["d_grad_norm"].item() > 0


def test_no_grad_norm_without_clipping():
    trainer = make_trainer(ConvNet(), random_batches(1), grad_clip=0)
    outputs = record_outputs(trainer)
    trainer.run()
    assert trainer.grad_clip is None and "grad_norm" not in outputs[0]


# ---------------------------------------------------------------------------------------------- precision
def test_bf16_on_cpu_gives_finite_losses():
    """bf16 autocast on the CPU: float32 losses, finite. The discriminator's bf16 backward can overflow on random
    data now and then; the non-finite guard then skips that step instead of clipping infinities into NaN weights."""
    torch.manual_seed(0)
    ae, disc = tiny_autoencoder(), tiny_discriminator()
    trainer = make_trainer(
        ae,
        random_batches(2),
        discriminator=disc,
        d_optimizer=torch.optim.Adam(disc.parameters(), lr=1e-3),
        amp="bf16",
        grad_clip=1.0,
        nonfinite="skip",
    )
    outputs = record_outputs(trainer)
    trainer.run()
    assert trainer.scaler is None and trainer.amp_dtype is torch.bfloat16
    for out in outputs:
        for key in ("loss", "recon_loss", "kl_loss", "adv_loss", "d_loss"):
            assert torch.isfinite(out[key]).all(), key
        assert "grad_norm" not in out or torch.isfinite(out["grad_norm"])
        assert out["recon_loss"].dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in [*ae.parameters(), *disc.parameters()])


def test_fp16_creates_grad_scaler_and_steps():
    net = ConvNet()
    trainer = make_trainer(net, random_batches(2), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), amp="fp16")
    scaler = trainer.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert trainer.amp_dtype is torch.float16
    calls = {"scale": 0, "step": 0, "update": 0}
    for name in calls:
        original = getattr(scaler, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(scaler, name, spy)
    outputs = record_outputs(trainer)
    trainer.run()
    assert trainer.scaler is scaler  # running keeps the scaler (and CheckpointManager can save it)
    assert calls == {"scale": 2, "step": 2, "update": 2}
    assert all(torch.isfinite(o["loss"]) for o in outputs)
    assert outputs[0]["pred"].dtype == torch.float16


def test_fp32_is_rejected_by_name():
    with pytest.raises(ValueError, match="'fp32'"):
        make_trainer(ConvNet(), random_batches(1), amp="fp32")


# ---------------------------------------------------------------------------------------------- events, batches
def test_iteration_events_fire_once_per_iteration_in_order():
    trainer = make_trainer(tiny_autoencoder(), random_batches(3))
    fired: list[tuple[int, str]] = []
    for event in (
        IterationEvents.FORWARD_COMPLETED,
        IterationEvents.LOSS_COMPLETED,
        IterationEvents.BACKWARD_COMPLETED,
        IterationEvents.MODEL_COMPLETED,
    ):
        trainer.add_event_handler(event, lambda e, name=event.name: fired.append((e.state.iteration, name)))
    seen_loss = []
    trainer.add_event_handler(IterationEvents.LOSS_COMPLETED, lambda e: seen_loss.append(e.state.output["loss"]))
    trainer.run()
    order = ["FORWARD_COMPLETED", "LOSS_COMPLETED", "BACKWARD_COMPLETED", "MODEL_COMPLETED"]
    assert fired == [(i, name) for i in (1, 2, 3) for name in order]
    assert len(seen_loss) == 3 and all(loss.ndim == 0 for loss in seen_loss)


def test_prepare_image_batch_returns_plain_tensors():
    image = MetaTensor(torch.rand(2, 1, 4, 4, 4), affine=torch.eye(4))
    inputs, targets = prepare_image_batch({"image": image, "other": 1}, torch.device("cpu"))
    assert type(inputs) is torch.Tensor and inputs is targets
    assert torch.equal(inputs, image.as_tensor())
    plain = torch.rand(1, 1, 2, 2, 2)
    inputs, _ = prepare_image_batch(plain, "cpu", dtype=torch.float64)
    assert inputs.dtype == torch.float64 and torch.allclose(inputs, plain.double())


# ---------------------------------------------------------------- micro-batching and multi-head discriminators
def _params_after(network, batches, **kwargs) -> tuple[list[torch.Tensor], list[dict]]:
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    trainer = make_trainer(network, batches, optimizer=optimizer, **kwargs)
    outputs = record_outputs(trainer)
    trainer.run()
    return [p.detach().clone() for p in network.parameters()], outputs


def test_micro_batches_give_the_full_batch_update():
    batches = random_batches(2, n=4)
    full, out_full = _params_after(QuantNet(), batches)
    micro, out_micro = _params_after(QuantNet(), batches, micro_batch_size=1)
    uneven, _ = _params_after(QuantNet(), batches, micro_batch_size=3)  # chunks of 3 and 1
    for a, b, c in zip(full, micro, uneven):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)
    for name in ("loss", "recon_loss", "quantization_loss"):
        assert out_micro[-1][name].item() == pytest.approx(out_full[-1][name].item(), rel=1e-5)
    assert out_micro[0]["pred"].shape == batches[0].shape


def test_micro_batched_discriminator_step_equals_full_batch():
    from common.autoencoder.discriminators import SliceVolumeDiscriminator

    def run(micro):
        torch.manual_seed(3)
        disc = SliceVolumeDiscriminator(channels=4, num_layers=2, image=False, norm="INSTANCE")
        trainer = make_trainer(
            ConvNet(),
            random_batches(1, n=4),
            discriminator=disc,
            d_optimizer=torch.optim.SGD(disc.parameters(), lr=0.1),
            adv_loss=HingeAdversarialLoss(),
            adv_weight={"video": 0.5},
            micro_batch_size=micro,
        )
        outputs = record_outputs(trainer)
        trainer.run()
        return [p.detach().clone() for p in disc.parameters()], outputs[-1]

    full, out_full = run(None)
    micro, out_micro = run(2)
    for a, b in zip(full, micro):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert out_micro["d_loss"].item() == pytest.approx(out_full["d_loss"].item(), rel=1e-5)


def _vqgan_trainer(start: int, image: float = 1.0, video: float = 1.0, feat: float = 4.0, n_batches: int = 4):
    from common.autoencoder.discriminators import SliceVolumeDiscriminator
    from common.vqgan.networks import VQGAN

    torch.manual_seed(0)
    net = VQGAN(n_hiddens=4, downsample=(4, 4, 4), embedding_dim=4, n_codes=16, norm_num_groups=4)
    disc = SliceVolumeDiscriminator(channels=4, num_layers=2, image=image > 0, video=video > 0, norm="INSTANCE")
    trainer = make_trainer(
        net,
        random_batches(n_batches, n=2),
        discriminator=disc,
        d_optimizer=torch.optim.Adam(disc.parameters(), lr=1e-3),
        adv_loss=HingeAdversarialLoss(),
        adv_weight={"image": image, "video": video},
        adv_warmup_iterations=start,
        feature_matching_weight=feat,
        recon_weight=4.0,
        micro_batch_size=1,
    )
    return trainer, disc


def test_gan_terms_and_discriminator_updates_start_after_discriminator_iter_start():
    trainer, disc = _vqgan_trainer(start=2)
    outputs = record_outputs(trainer)
    d_params = record_params(trainer, disc)
    trainer.run()
    gan_keys = ("adv_loss", "feature_matching_loss", "d_loss", "adv_loss_image", "adv_loss_video")
    for i, out in enumerate(outputs):
        iteration = i + 1
        if iteration <= 2:
            assert not any(k in out for k in gan_keys), f"GAN terms at iteration {iteration}"
            assert same(d_params[i + 1], d_params[i]), f"discriminator changed at iteration {iteration}"
            expected = 4.0 * out["recon_loss"] + out["quantization_loss"]
        else:
            assert all(k in out for k in gan_keys), f"GAN terms missing at iteration {iteration}"
            assert out["adv_loss"].item() != 0 and out["feature_matching_loss"].item() > 0
            assert not same(d_params[i + 1], d_params[i]), f"discriminator unchanged at iteration {iteration}"
            assert out["adv_loss"].item() == pytest.approx(
                (out["adv_loss_image"] + out["adv_loss_video"]).item(), rel=1e-5, abs=1e-6
            )
            expected = (
                4.0 * out["recon_loss"]
                + out["quantization_loss"]
                + out["adv_loss"]
                + 4.0 * out["feature_matching_loss"]
            )
        assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
        assert 0 < out["codebook_usage"].item() <= 1 and out["perplexity"].item() >= 1
        assert "codebook_restarts" in out


def test_zero_weight_head_is_skipped():
    trainer, disc = _vqgan_trainer(start=0, video=0.0, feat=0.0, n_batches=1)
    assert disc.video is None
    outputs = record_outputs(trainer)
    trainer.run()
    out = outputs[-1]
    assert "adv_loss_image" in out and "adv_loss_video" not in out and "feature_matching_loss" not in out
    assert out["adv_loss"].item() == pytest.approx(out["adv_loss_image"].item())


def test_bad_micro_batch_and_warmup_are_rejected():
    with pytest.raises(ValueError, match="micro_batch_size"):
        make_trainer(ConvNet(), random_batches(1), micro_batch_size=0)
    with pytest.raises(ValueError, match="adv_warmup_iterations"):
        make_trainer(ConvNet(), random_batches(1), adv_warmup_iterations=-1)


# ---------------------------------------------------------------------------------------------- non-finite losses
def _poison(trainer, iteration: int) -> None:
    trainer.add_event_handler(
        Events.ITERATION_STARTED(once=iteration), lambda e: e.state.batch["image"].fill_(float("nan"))
    )


def test_nonfinite_loss_stops_before_the_step_naming_iteration_and_terms(tmp_path):
    from common.engines.trainer import NonFiniteLossError
    from common.handlers.checkpoint import CheckpointManager

    net = ConvNet()
    trainer = make_trainer(net, random_batches(4), max_epochs=1)
    manager = CheckpointManager(tmp_path, {"network": net}, interval=2)
    manager.attach(trainer)
    snapshots = record_params(trainer, net)
    _poison(trainer, 3)
    with pytest.raises(NonFiniteLossError) as info:
        trainer.run()
    message = str(info.value)
    assert "non-finite loss at iteration 3 (epoch 1)" in message
    assert "recon_loss=nan" in message and "loss=nan" in message
    assert len(snapshots) == 3  # iterations 1 and 2 completed, iteration 3 did not
    assert same([p.detach() for p in net.parameters()], snapshots[-1])  # the bad step was not applied
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    assert saved["trainer"]["iteration"] == 2  # the last good checkpoint, not overwritten at the failure
    assert all(torch.isfinite(v).all() for v in saved["network"].values())


#: fp16 loss scale of the skip test. The scaled L1 loss sends S / N (N voxels) back to every voxel, and each weight
#: gradient sums N such terms times an activation: at most S x max|relu(conv1(x))| <= S x (27 + 1) / sqrt(27) < 6 S
#: (conv2; conv1 and the biases get less) for inputs in [0, 1] and PyTorch's initial weights. With S = 2**10 that is
#: under 6200, far below fp16's 65504, so no step overflows whatever the draw (the default 2**16 could overflow, and
#: the scaler would then skip a second step silently).
FP16_SCALE = 2.0**10


@pytest.mark.parametrize("amp", ["none", "fp16"])
def test_nonfinite_loss_skip_drops_only_that_step(amp):
    net = ConvNet()
    trainer = make_trainer(net, random_batches(4), max_epochs=1, nonfinite="skip", amp=amp)
    if amp == "fp16":
        trainer.scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)
    snapshots = record_params(trainer, net)
    _poison(trainer, 2)
    trainer.run()
    assert trainer.state.iteration == 4 and trainer.state.skipped_steps == 1
    if amp == "fp16":
        # the poisoned step was dropped before the scaler saw it, and no other step overflowed
        assert trainer.scaler.get_scale() == FP16_SCALE
    assert same(snapshots[1], snapshots[2])  # iteration 2 skipped
    assert not same(snapshots[2], snapshots[3]) and not same(snapshots[0], snapshots[1])
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_nonfinite_gradient_with_finite_loss_is_caught():
    from common.engines.trainer import NonFiniteLossError

    net = ConvNet()
    net.conv2.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    trainer = make_trainer(net, random_batches(1), max_epochs=1)
    with pytest.raises(NonFiniteLossError, match="non-finite gradient at iteration 1"):
        trainer.run()


def test_unknown_nonfinite_policy_is_refused():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        make_trainer(ConvNet(), random_batches(1), nonfinite="ignore")


@pytest.mark.parametrize("configs", [["train.json"], ["train.json", "tiny.json"]])
def test_autoencoder_settings_accept_the_bundle_defaults(configs):
    from common.autoencoder.settings import TRAINING
    from common.config_checks import check_config

    check_config(TRAINING, config=bundle_parser("autoencoder_3d", configs))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"patch_size": [24, 32, 30]}, "'patch_size' [24, 32, 30] must be divisible by 4 on every axis"),
        ({"patch_size": [32, 32]}, "'patch_size' must be 3 positive integers"),
        ({"channels": [16, 0]}, "'channels' must be a list of positive integers"),
        ({"norm_num_groups": 6}, "'norm_num_groups' 6 must divide every entry of 'channels' [32, 64, 64]"),
        ({"attention_levels": [False, True]}, "'attention_levels' must have one entry per level of 'channels' (3)"),
        ({"latent_channels": 0}, "'latent_channels' must be an integer >= 1"),
        ({"num_samples": True}, "'num_samples' must be an integer >= 1"),
        ({"adv_weight": -0.1}, "'adv_weight' must be a number >= 0"),
        ({"adv_warmup_iterations": -1}, "'adv_warmup_iterations' must be an integer >= 0"),
        ({"intensity": {"mode": "ct", "a_min": 100, "a_max": 100}}, "HU window is inverted or empty"),
        ({"compile": "false"}, "'compile' must be True or False"),
        ({"cache_rate": 1.5}, "'cache_rate' must be a number in [0, 1]"),
        ({"replace_rate": 0.0}, "'replace_rate' must be a number in (0, 1]"),
    ],
)
def test_autoencoder_settings_name_the_config_id(change, message):
    from common.autoencoder.settings import TRAINING
    from common.config_checks import check_config

    with pytest.raises(SettingsError, match="invalid autoencoder configuration") as info:
        check_config(TRAINING, config=bundle_parser("autoencoder_3d", ["train.json"]), **change)
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------- out of memory
class OutOfMemoryAbove(nn.Module):
    """``module`` on a device that holds at most ``limit`` samples per call (``torch.OutOfMemoryError`` above); with
    ``training_only``, only while its parameters are trained (the discriminator's own step, not the generator
    step that calls it frozen)."""

    def __init__(self, module: nn.Module, limit: int, training_only: bool = False) -> None:
        super().__init__()
        self.module, self.limit, self.training_only = module, limit, training_only

    def forward(self, x, *args, **kwargs):
        trained = any(p.requires_grad for p in self.module.parameters())
        if x.shape[0] > self.limit and (trained or not self.training_only):
            raise torch.OutOfMemoryError(f"CUDA out of memory ({x.shape[0]} samples)")
        return self.module(x, *args, **kwargs)


@pytest.mark.parametrize("failing", ["generator", "discriminator"])
def test_out_of_memory_in_either_step_redoes_only_that_step(failing, caplog):
    """A batch of 4 whose generator (or discriminator) step fits only 2 samples: that step is redone in
    micro-batches of 2; the generator step is applied once, and both networks end where the un-failed run does."""
    from common.autoencoder.discriminators import SliceVolumeDiscriminator

    def run(limit):
        torch.manual_seed(3)
        disc = SliceVolumeDiscriminator(channels=4, num_layers=2, image=False, norm="INSTANCE")
        gen = ConvNet()
        if limit and failing == "generator":
            gen = OutOfMemoryAbove(gen, limit)
        d_net = OutOfMemoryAbove(disc, limit, training_only=True) if limit and failing == "discriminator" else disc
        trainer = make_trainer(
            gen,
            random_batches(2, n=4),
            optimizer=torch.optim.SGD(gen.parameters(), lr=0.1),
            discriminator=d_net,
            d_optimizer=torch.optim.SGD(disc.parameters(), lr=0.1),
            adv_loss=HingeAdversarialLoss(),
            adv_weight={"video": 0.5},
        )
        outputs = record_outputs(trainer)
        trainer.run()
        return trainer, [p.detach().clone() for p in [*gen.parameters(), *disc.parameters()]], outputs

    _, reference, ref_out = run(None)
    with caplog.at_level("WARNING", logger="common.engines.trainer"):
        trainer, params, out = run(2)
    assert trainer.micro_batch_size == 2
    assert f"out of GPU memory in the {failing} step of iteration 1" in caplog.text
    for a, b in zip(params, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in ("loss", "d_loss", "adv_loss"):
        assert [float(o[name]) for o in out] == pytest.approx([float(o[name]) for o in ref_out], rel=1e-5)

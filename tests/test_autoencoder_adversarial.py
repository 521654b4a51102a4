# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the patch adversarial loss with device labels, the hinge GAN loss (standard generator term) and
discriminator feature matching."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from monai.losses import PatchAdversarialLoss

from common.autoencoder.adversarial import HingeAdversarialLoss, feature_matching_loss
from common.autoencoder.adversarial import PatchAdversarialLoss as DeviceLabelAdversarialLoss

LOGITS = torch.tensor([[-2.0, -0.5, 0.0], [0.5, 1.0, 2.5]])


@pytest.mark.parametrize("criterion", ["least_squares", "bce", "hinge"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_labels_give_monais_values_and_gradients(criterion, dtype):
    """Same losses and gradients as MONAI's class for every criterion, target and term, on a tensor or a list of
    maps, with labels made by ``full_like``/``zeros_like`` (no host tensor copied to the device)."""
    torch.manual_seed(0)
    maps = [torch.randn(2, 1, 4, 4, 4, dtype=dtype), torch.randn(2, 1, 3, 3, 3, dtype=dtype)]
    ours, monai = DeviceLabelAdversarialLoss(criterion=criterion), PatchAdversarialLoss(criterion=criterion)
    for logits in (maps[0], maps):
        for real, for_d in ((True, True), (False, True), (True, False)):
            a = [m.clone().requires_grad_() for m in (logits if isinstance(logits, list) else [logits])]
            b = [m.detach().clone().requires_grad_() for m in a]
            ours_value = ours(a if isinstance(logits, list) else a[0], target_is_real=real, for_discriminator=for_d)
            monai_value = monai(b if isinstance(logits, list) else b[0], target_is_real=real, for_discriminator=for_d)
            assert ours_value.dtype == monai_value.dtype
            torch.testing.assert_close(ours_value, monai_value, rtol=0, atol=0)
            ours_value.float().backward()
            monai_value.float().backward()
            for x, y in zip(a, b):
                torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
    for real in (True, False):
        target = ours.get_target_tensor(maps[0], real)
        assert target.dtype == dtype and target.shape == maps[0].shape and not target.requires_grad
        assert torch.equal(target, monai.get_target_tensor(maps[0], real))


def test_discriminator_terms_closed_form():
    loss = HingeAdversarialLoss()
    real = loss(LOGITS, target_is_real=True, for_discriminator=True)
    fake = loss(LOGITS, target_is_real=False, for_discriminator=True)
    # relu(1 - x) = (3, 1.5, 1, 0.5, 0, 0); relu(1 + x) = (0, 0.5, 1, 1.5, 2, 3.5)
    assert real.item() == pytest.approx(6.0 / 6)
    assert fake.item() == pytest.approx(8.5 / 6)
    assert real.item() == pytest.approx(F.relu(1 - LOGITS).mean().item())
    assert fake.item() == pytest.approx(F.relu(1 + LOGITS).mean().item())


def test_discriminator_hinge_acts_on_raw_logits_and_saturates():
    """Real logits above 1 and fake logits below -1 are on the right side of the margin: no loss, no gradient."""
    loss = HingeAdversarialLoss()
    real = torch.tensor([1.01, 1.5, 4.0], requires_grad=True)
    fake = torch.tensor([-1.01, -2.0, -7.0], requires_grad=True)
    (
        loss(real, target_is_real=True, for_discriminator=True)
        + loss(fake, target_is_real=False, for_discriminator=True)
    ).backward()
    assert real.grad.abs().sum() == 0 and fake.grad.abs().sum() == 0
    assert loss(torch.tensor([3.0]), target_is_real=True, for_discriminator=True).item() == 0.0
    assert loss(torch.tensor([3.0]), target_is_real=False, for_discriminator=True).item() == 4.0


def test_generator_term_is_minus_the_mean_logit():
    loss = HingeAdversarialLoss()
    assert loss(LOGITS, target_is_real=True, for_discriminator=False).item() == pytest.approx(-1.5 / 6)


def test_generator_term_differs_from_monai_hinge_when_fakes_score_above_one():
    confident = torch.full((1, 1, 2, 2), 2.0, requires_grad=True)
    ours = HingeAdversarialLoss()(confident, target_is_real=True, for_discriminator=False)
    monai = PatchAdversarialLoss(criterion="hinge")(confident, target_is_real=True, for_discriminator=False)
    # MONAI: relu(1 - tanh(2)), nearly flat in the logits; ours: -mean(x)
    assert monai.item() == pytest.approx(1 - torch.tanh(torch.tensor(2.0)).item(), rel=1e-6)
    assert ours.item() == -2.0 and abs(ours.item() - monai.item()) > 2
    ours.backward()
    torch.testing.assert_close(confident.grad, torch.full_like(confident, -1 / 4))  # still pushes the logits up


def test_generator_term_ignores_target_flag_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = HingeAdversarialLoss()(LOGITS, target_is_real=False, for_discriminator=False)
    assert value.item() == pytest.approx(-1.5 / 6)


def test_lists_of_logit_maps_are_averaged_per_map():
    a = torch.tensor([[1.0, 3.0]])  # mean 2
    b = torch.tensor([[-1.0, -2.0, -3.0, -6.0]])  # mean -3
    loss = HingeAdversarialLoss()
    assert loss([a, b], target_is_real=True, for_discriminator=False).item() == pytest.approx((-2.0 + 3.0) / 2)
    # the discriminator terms average the per-map means as well (not the pooled elements)
    real = (F.relu(1 - a).mean() + F.relu(1 - b).mean()) / 2
    fake = (F.relu(1 + a).mean() + F.relu(1 + b).mean()) / 2
    assert loss([a, b], target_is_real=True, for_discriminator=True).item() == pytest.approx(real.item())
    assert loss([a, b], target_is_real=False, for_discriminator=True).item() == pytest.approx(fake.item())


def test_generator_term_is_float32_for_half_logits():
    value = HingeAdversarialLoss()(LOGITS.bfloat16(), target_is_real=True, for_discriminator=False)
    assert value.dtype == torch.float32


def _features(seed: int, requires_grad: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, 8, 8), (2, 8, 4, 4), (2, 1, 3, 3)]
    return [torch.randn(s, generator=gen).requires_grad_(requires_grad) for s in shapes]


def test_feature_matching_is_the_mean_l1_of_the_intermediate_maps():
    fake, real = _features(0), _features(1)
    expected = ((fake[0] - real[0]).abs().mean() + (fake[1] - real[1]).abs().mean()) / 2
    assert feature_matching_loss(fake, real).item() == pytest.approx(expected.item(), rel=1e-6)
    # the logit maps (last entries) do not count
    fake[-1] = fake[-1] + 100.0
    assert feature_matching_loss(fake, real).item() == pytest.approx(expected.item(), rel=1e-6)
    assert feature_matching_loss(real, real).item() == 0.0


def test_feature_matching_has_no_gradient_to_the_real_features():
    fake, real = _features(0, requires_grad=True), _features(1, requires_grad=True)
    feature_matching_loss(fake, real).backward()
    assert all(r.grad is None for r in real)
    torch.testing.assert_close(fake[0].grad, torch.sign(fake[0] - real[0]).detach() / fake[0].numel() / 2)
    assert fake[1].grad.abs().sum() > 0
    assert fake[-1].grad is None  # the logits are not part of the loss


def test_feature_matching_length_mismatch_and_single_map_are_errors():
    with pytest.raises(ValueError, match="feature lists differ in length: 3 fake vs 2 real"):
        feature_matching_loss(_features(0), _features(1)[:2])
    with pytest.raises(ValueError, match="at least one intermediate feature map besides the logits"):
        feature_matching_loss(_features(0)[:1], _features(1)[:1])

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the KL divergence and the optional perceptual loss factory."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Normal
from torch.distributions import kl_divergence as torch_kl

from common.autoencoder.losses import kl_divergence, make_perceptual_loss


def test_kl_of_standard_normal_is_zero():
    mu = torch.zeros(2, 3, 4, 4, 4)
    sigma = torch.ones(2, 3, 4, 4, 4)
    assert kl_divergence(mu, sigma).item() == 0.0


def test_kl_closed_form_hand_values():
    # one latent element per sample: KL = 0.5 * (mu^2 + sigma^2 - log sigma^2 - 1)
    mu = torch.tensor([[1.0], [0.0]])
    sigma = torch.tensor([[1.0], [2.0]])
    per_sample = [0.5 * 1.0, 0.5 * (4.0 - torch.log(torch.tensor(4.0)).item() - 1.0)]
    assert kl_divergence(mu, sigma).item() == pytest.approx(sum(per_sample) / 2, rel=1e-6)


def test_kl_matches_torch_distributions_sum_over_latent_mean_over_batch():
    gen = torch.Generator().manual_seed(0)
    mu = torch.randn(3, 2, 4, 4, 4, generator=gen)
    sigma = torch.rand(3, 2, 4, 4, 4, generator=gen) * 2 + 0.1
    reference = torch_kl(Normal(mu.double(), sigma.double()), Normal(0.0, 1.0)).flatten(1).sum(1).mean()
    value = kl_divergence(mu, sigma)
    assert value.dtype == torch.float32 and value.ndim == 0
    assert value.item() == pytest.approx(reference.item(), rel=1e-5)


def test_kl_scales_with_latent_size_not_batch_size():
    mu = torch.full((1, 1, 2, 2, 2), 2.0)
    sigma = torch.ones(1, 1, 2, 2, 2)
    single = kl_divergence(mu, sigma)
    assert single.item() == pytest.approx(8 * 0.5 * 4.0)
    assert kl_divergence(mu.repeat(5, 1, 1, 1, 1), sigma.repeat(5, 1, 1, 1, 1)).item() == pytest.approx(single.item())


def test_kl_is_computed_in_float32_for_half_inputs():
    mu = torch.full((2, 1, 2, 2, 2), 0.5, dtype=torch.bfloat16)
    sigma = torch.full((2, 1, 2, 2, 2), 1.5, dtype=torch.bfloat16)
    expected = 8 * 0.5 * (0.25 + 2.25 - torch.log(torch.tensor(2.25)).item() - 1.0)
    value = kl_divergence(mu, sigma)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(expected, rel=1e-6)


def test_kl_gradient_closed_form():
    mu = torch.tensor([[0.3, -0.7]], requires_grad=True)
    sigma = torch.tensor([[0.5, 2.0]], requires_grad=True)
    kl_divergence(mu, sigma).backward()
    torch.testing.assert_close(mu.grad, mu.detach())  # d/dmu = mu
    torch.testing.assert_close(sigma.grad, sigma.detach() - 1.0 / sigma.detach())  # d/dsigma = sigma - 1/sigma


@pytest.mark.parametrize("weight", [0, 0.0, None])
def test_perceptual_loss_disabled_builds_nothing(weight):
    assert make_perceptual_loss(weight) is None
    assert make_perceptual_loss(weight, "/does/not/matter.pth") is None


def test_perceptual_loss_without_weights_path_is_an_error():
    with pytest.raises(ValueError, match="perceptual_weights_path") as info:
        make_perceptual_loss(0.1, None)
    assert "None" in str(info.value) and "medicalnet_resnet10_23datasets" in str(info.value)


def test_perceptual_loss_with_missing_file_is_an_error(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(ValueError, match="perceptual_weights_path") as info:
        make_perceptual_loss(0.5, str(missing), network_type="medicalnet_resnet50_23datasets")
    assert str(missing) in str(info.value)
    assert "medicalnet_resnet50_23datasets" in str(info.value)


def test_perceptual_loss_with_a_folder_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="perceptual_weights_path"):
        make_perceptual_loss(0.5, tmp_path)

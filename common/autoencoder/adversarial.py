# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Adversarial losses: MONAI's patch adversarial loss with its labels made on the device, the hinge GAN loss with the
standard generator term, and discriminator feature matching."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from monai.losses import PatchAdversarialLoss as _MonaiPatchAdversarialLoss

__all__ = ["HingeAdversarialLoss", "PatchAdversarialLoss", "feature_matching_loss"]


class PatchAdversarialLoss(_MonaiPatchAdversarialLoss):
    """``monai.losses.PatchAdversarialLoss`` (same arguments, same values) whose target and zero labels are made on
    the logits' device and dtype. MONAI builds each label as a CPU tensor and copies it to the logits' device: on a
    GPU every call then waits for the queued work (a blocking host-to-device copy), several times per step."""

    def get_target_tensor(self, input: torch.Tensor, target_is_real: bool) -> torch.Tensor:
        return torch.full_like(input, self.real_label if target_is_real else self.fake_label)

    def get_zero_tensor(self, input: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(input)


class HingeAdversarialLoss(PatchAdversarialLoss):
    """Hinge GAN loss (Lim & Ye 2017; used by TATS / MedicalDiffusion's VQ-GAN).

    Discriminator: ``mean(relu(1 - D(real)))`` or ``mean(relu(1 + D(fake)))`` (MONAI's hinge criterion, on the raw
    logits: MONAI's ``tanh`` before the hinge is switched off, as in TATS).
    Generator: ``-mean(D(fake))``. MONAI's ``PatchAdversarialLoss(criterion="hinge")`` uses
    ``mean(relu(1 - D(fake)))`` for the generator too, whose gradient vanishes once the discriminator scores a
    fake above 1; this class keeps the standard generator term. Called like MONAI's loss:
    ``loss(logits, target_is_real, for_discriminator)``, with a tensor or a list of logit maps (averaged).
    """

    def __init__(self) -> None:
        super().__init__(criterion="hinge", reduction="mean")
        self.activation = None  # MONAI squashes hinge logits with tanh, so relu(1 - tanh(x)) never reaches 0

    def forward(
        self, input: torch.Tensor | list, target_is_real: bool, for_discriminator: bool
    ) -> torch.Tensor | list[torch.Tensor]:
        if for_discriminator:
            return super().forward(input, target_is_real=target_is_real, for_discriminator=True)
        maps = input if isinstance(input, list) else [input]
        return torch.stack([-m.float().mean() for m in maps]).mean()


def feature_matching_loss(fake: Sequence[torch.Tensor], real: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean L1 distance between a discriminator's intermediate feature maps for fake and real inputs.

    Both are lists as returned by MONAI ``PatchDiscriminator`` (the last entry, the logit map, is excluded);
    ``real`` is treated as a constant. TATS sums the layers with weight ``4 / (n_layers + 1)``; the mean used
    here differs from it only by a constant factor absorbed in ``gan_feat_weight``.

    Raises:
        ValueError: when the lists differ in length or have no intermediate layer.
    """
    if len(fake) != len(real):
        raise ValueError(f"feature lists differ in length: {len(fake)} fake vs {len(real)} real.")
    if len(fake) < 2:
        raise ValueError("feature matching needs at least one intermediate feature map besides the logits.")
    losses = [F.l1_loss(f.float(), r.detach().float()) for f, r in zip(fake[:-1], real[:-1])]
    return torch.stack(losses).mean()

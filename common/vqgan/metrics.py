# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Codebook usage and perplexity of a vector quantizer over a whole evaluation run (all ranks)."""

from __future__ import annotations

import torch.distributed as dist
from ignite.metrics import Metric
from torch import nn

__all__ = ["CodebookMetric", "codebook_metrics"]


class CodebookMetric(Metric):
    """Usage (fraction of codes assigned at least once) or perplexity of the codes used during an evaluation.

    The quantizer (:class:`common.vqgan.networks.EMAVectorQuantizer`) counts the codes it assigns in eval mode;
    this metric zeroes the histogram when the evaluation starts and, when it completes, sums it over all ranks
    (DDP) and reports ``(counts > 0).mean()`` (``"usage"``) or ``exp(entropy)`` of the code frequencies
    (``"perplexity"``; with overlapping sliding windows a voxel's code counts once per window covering it).

    Args:
        quantizer: the quantizer, or a module with a ``quantizer`` attribute (the VQ-GAN).
        statistic: ``"usage"`` or ``"perplexity"``.
    """

    def __init__(self, quantizer: nn.Module, statistic: str = "usage") -> None:
        if statistic not in ("usage", "perplexity"):
            raise ValueError(f"statistic must be 'usage' or 'perplexity', got {statistic!r}.")
        self.quantizer = getattr(quantizer, "quantizer", quantizer)
        if not hasattr(self.quantizer, "usage_counts"):
            raise TypeError(f"{type(self.quantizer).__name__} does not count code usage (no 'usage_counts').")
        self.statistic = statistic
        super().__init__(output_transform=lambda output: output)

    def reset(self) -> None:
        self.quantizer.reset_usage()

    def update(self, output) -> None:
        """Nothing to do: the quantizer counts while the evaluator runs the network."""

    def iteration_completed(self, engine) -> None:
        """Skip ignite's output parsing: this metric does not read ``engine.state.output``."""

    def compute(self) -> float:
        counts = self.quantizer.usage_counts.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        if self.statistic == "usage":
            return float((counts > 0).float().mean())
        return float(self.quantizer.perplexity(counts))


def codebook_metrics(network: nn.Module, prefix: str = "val_") -> dict[str, CodebookMetric]:
    """``{prefix + "codebook_usage": ..., prefix + "perplexity": ...}`` for an evaluator's ``additional_metrics``."""
    return {
        f"{prefix}codebook_usage": CodebookMetric(network, "usage"),
        f"{prefix}perplexity": CodebookMetric(network, "perplexity"),
    }

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Transforms of the survival family used by its configs (the configs hold the pipeline)."""

from __future__ import annotations

import torch

__all__ = ["AboveThreshold"]


class AboveThreshold:
    """``x > threshold``: a picklable foreground selector for ``CropForegroundd`` (its ``select_fn``), declared in
    a config as ``{"_target_": "common.survival.transforms.AboveThreshold", "threshold": 0.05}``.

    Args:
        threshold: the value above which a voxel is foreground.
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = float(threshold)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x > self.threshold

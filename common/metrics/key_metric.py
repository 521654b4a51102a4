# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Which way a key metric improves, for every bundle: the mode of the best-checkpoint saver and early stopping, and
the comparison an evaluator uses to mark its best epoch."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["key_metric_mode", "metric_cmp_fn"]

LOWER_IS_BETTER_SUFFIXES = ("loss", "error")  # val_loss, val_proj_error
LOWER_IS_BETTER_NAMES = ("ibs",)  # the integrated Brier score
LOWER_IS_BETTER_PREFIXES = ("brier_",)  # the Brier score at a horizon


def key_metric_mode(name: str) -> str:
    """``min`` for losses, errors and Brier scores (lower is better), else ``max`` (PSNR, SSIM, concordance, AUC).

    Args:
        name: the metric name, with or without the ``val_`` prefix.
    """
    key = str(name)
    bare = key[len("val_") :] if key.startswith("val_") else key
    lower = key.endswith(LOWER_IS_BETTER_SUFFIXES) or bare in LOWER_IS_BETTER_NAMES
    return "min" if lower or bare.startswith(LOWER_IS_BETTER_PREFIXES) else "max"


def metric_cmp_fn(name: str) -> Callable[[float, float], bool]:
    """The ``metric_cmp_fn`` of an evaluator whose key metric is ``name``: strictly better than the previous best."""
    if key_metric_mode(name) == "min":
        return lambda current, prev: current < prev
    return lambda current, prev: current > prev

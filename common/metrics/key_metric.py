# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The key metric of every bundle: which way it improves (the mode of the best-checkpoint saver and early stopping,
the comparison an evaluator uses to mark its best epoch) and its place among the validation metrics (the
evaluator's ``key_val_metric`` and ``additional_metrics`` taken from one ``validate#metrics`` dict)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from common.errors import UserError

__all__ = ["additional_metrics", "key_metric_mode", "key_val_metric", "metric_cmp_fn"]

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


def key_val_metric(metrics: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``{name: metrics[name]}``: the evaluator's ``key_val_metric`` (the metric that ranks checkpoints).

    Raises:
        UserError: ``name`` is not one of ``metrics`` (the message lists them).
    """
    if name not in metrics:
        raise UserError(f"key_metric {name!r} is not one of the validation metrics {sorted(metrics)}.")
    return {name: metrics[name]}


def additional_metrics(metrics: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The metrics other than the key metric ``name``: the evaluator's ``additional_metrics``."""
    return {k: v for k, v in metrics.items() if k != name}

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Training and evaluation engines of survival models (a 3D CT image, optional covariates -> the risk of an event
over time): a discrete-time logistic hazard head or a Cox head whose partial likelihood sees the global risk set of
all ranks.

A survival batch is a dict with ``image`` (``B, C, *spatial``), ``time`` (``B``, years), ``event`` (``B``, 0/1),
``covariates`` (``B, n``; ``n`` may be 0) and ``case_id`` (``B`` strings).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from monai.utils import CommonKeys as Keys
from torch import nn
from torch.optim import Optimizer

from common.data.pipeline import batch_case_ids
from common.engines.evaluator import StepEvaluator
from common.engines.trainer import StepTrainer
from common.survival.losses import check_cut_points, cox_loss, logistic_hazard_loss
from common.survival.networks import HEADS
from common.utils import get_world_size, plain_tensor

__all__ = [
    "SurvivalEvaluator",
    "SurvivalTrainer",
    "per_rank_batch_size",
    "prepare_survival_batch",
]


def per_rank_batch_size(batch_size: int, world_size: int | None = None) -> int:
    """The batch of one rank when ``batch_size`` is the total batch across all ranks.

    Raises:
        ValueError: when ``batch_size`` is not a positive multiple of the number of processes.
    """
    world = get_world_size() if world_size is None else int(world_size)
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise ValueError(f"'batch_size' (the total batch across all GPUs) must be >= 1, got {batch_size!r}.")
    if int(batch_size) % world:
        raise ValueError(
            f"'batch_size' {batch_size} is the total batch across all GPUs and must be divisible by the number of "
            f"processes ({world}): use a multiple of {world}, e.g. {world * -(-int(batch_size) // world)}."
        )
    return int(batch_size) // world


def prepare_survival_batch(
    batchdata: Mapping[str, Any], device: torch.device | str | None = None, non_blocking: bool = False, **kwargs
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(image, targets)``: the image as a plain tensor on ``device`` and ``{"time", "event", "covariates"}``
    as float tensors on ``device`` (``time``/``event`` are NaN when the batch has no outcomes, e.g. inference)."""
    image = plain_tensor(batchdata[Keys.IMAGE]).to(device=device, non_blocking=non_blocking, **kwargs)
    n = image.shape[0]

    def field(key: str, default: torch.Tensor) -> torch.Tensor:
        value = batchdata.get(key)
        value = default if value is None else plain_tensor(value)
        return value.to(device=device, dtype=torch.float32, non_blocking=non_blocking)

    nan = torch.full((n,), float("nan"))
    targets = {
        "time": field("time", nan).reshape(n),
        "event": field("event", nan).reshape(n),
        "covariates": field("covariates", torch.zeros(n, 0)).reshape(n, -1),
    }
    return image, targets


class SurvivalTrainer(StepTrainer):
    """Trains a survival network ``network(image, covariates)`` with a logistic hazard or a Cox loss.

    ``logistic_hazard``: the network returns K logits (one per interval of ``cut_points``); the loss is the
    discrete-time negative log-likelihood per sample (censored cases count only the intervals they survived), so
    any batch size works and DDP's gradient average is the global mean. ``cox``: the network returns one
    log-hazard; the loss is the Efron partial likelihood over the risk set of the whole global batch (all ranks'
    log-hazards gathered with autograd, see :func:`common.survival.losses.cox_loss`), so a multi-GPU step takes the
    gradient of one process on the full batch. With gradient accumulation the risk set is each (global) batch.

    Covariates are standardised with the training statistics by ``prepare_covariates`` (normally the predictor's
    ``standardize_covariates``) before they reach the network. Mixed precision, accumulation with DDP ``no_sync``
    and clipping as in :class:`common.engines.trainer.StepTrainer`; the loss is computed in float32.

    ``engine.state.output`` (not decollated) holds ``loss``, ``grad_norm`` (when clipping), ``event_rate`` (events
    per sample in this rank's batch) and ``pred`` (the network output, detached).

    Args:
        network: the survival network as called for training (may be DDP/compile-wrapped).
        optimizer: its optimizer.
        head: ``logistic_hazard`` or ``cox``.
        cut_points: the K + 1 interval boundaries in years (``logistic_hazard``).
        prepare_covariates: maps raw covariates ``(B, n)`` to network inputs (``None``: passed unchanged).
        global_risk_set: gather the risk set over all ranks (``cox``).
        settings: ``device``, ``max_epochs``, ``train_data_loader`` (of survival batches), ``amp``,
            ``accumulation_steps``, ``grad_clip`` and the other settings of :class:`common.engines.trainer.StepTrainer`;
            ``prepare_batch`` defaults to :func:`prepare_survival_batch`, ``decollate`` to False.
    """

    default_prepare_batch = staticmethod(prepare_survival_batch)
    default_decollate = False

    def __init__(
        self,
        network: nn.Module,
        optimizer: Optimizer,
        head: str = "logistic_hazard",
        cut_points: Sequence[float] | torch.Tensor | None = None,
        prepare_covariates: Callable[[torch.Tensor], torch.Tensor] | None = None,
        global_risk_set: bool = True,
        **settings: Any,
    ) -> None:
        if head not in HEADS:
            raise ValueError(f"'survival_head' must be one of {HEADS}, got {head!r}.")
        if head == "logistic_hazard" and cut_points is None:
            raise ValueError("a logistic hazard head needs cut_points (K + 1 interval boundaries in years).")
        self.head = head
        super().__init__(network=network, optimizer=optimizer, **settings)
        # checked here once, so that the loss of each step reads nothing back (check_values=False below)
        self.cut_points = None if cut_points is None else check_cut_points(cut_points).float()
        self.prepare_covariates = prepare_covariates
        self.global_risk_set = bool(global_risk_set)

    @property
    def micro_batch_exact(self) -> bool:
        """The Cox partial likelihood couples the samples of a batch (its risk set): no micro-batches."""
        return self.head != "cox"

    @property
    def loss_in_graph(self) -> bool:
        """The Cox loss gathers the risk set over ranks (sizes read back) and counts the events (torchsurv's
        special cases): it runs outside the compiled region, after the compiled network."""
        return self.head != "cox"

    def loss(self, output: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
        """The survival loss of a batch of network outputs (float32)."""
        output = output.float()
        if self.head == "cox":
            return cox_loss(output.reshape(-1), time, event, global_risk_set=self.global_risk_set)
        # The cut points were checked when the trainer was built and the batch's times and events when the cohort
        # was read: nothing is checked again on the device (no host read, no graph break).
        return logistic_hazard_loss(output, time, event, self.cut_points, check_values=False)

    def prepare_step(self, engine: SurvivalTrainer, batchdata: dict[str, Any]) -> dict[str, Any]:
        image, targets = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking, **engine.to_kwargs)
        self.log_effective_batch(image.shape[0])
        covariates = targets["covariates"]
        if self.prepare_covariates is not None:
            covariates = self.prepare_covariates(covariates)
        return {
            "args": (image, covariates if covariates.shape[1] else None),
            "output": {Keys.IMAGE: image},
            "targets": targets,
            "stats": {"event_rate": targets["event"].mean()},
        }

    def compute_loss(
        self, engine: SurvivalTrainer, step: dict[str, Any], prediction: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        targets = step["targets"]
        return self.loss(prediction, targets["time"], targets["event"]), {}


class SurvivalEvaluator(StepEvaluator):
    """Runs a :class:`common.survival.networks.SurvivalPredictor` over whole volumes for validation, evaluation and
    inference.

    ``engine.state.output`` (not decollated) holds ``case_id`` (list), ``time`` and ``event`` (NaN without
    outcomes), and the predictor's outputs: ``risk_score``, ``risk_percentile``, ``risk_group``, ``survival``
    (``B x horizons``), ``p_event`` (``1 - survival``) and ``survival_grid`` (``B x len(grid)``, the survival curve
    on ``grid`` for the integrated Brier score; only when ``grid`` is given). Metrics are computed from these by
    :class:`common.survival.handlers.SurvivalMetricsHandler` once every rank's predictions are gathered.

    Args:
        grid: times (years) at which the survival curve is also evaluated.
        settings: the arguments of :class:`common.engines.evaluator.StepEvaluator`: ``device``,
            ``val_data_loader`` (of survival batches), ``network`` (the predictor), ``amp``, ...; ``prepare_batch``
            defaults to :func:`prepare_survival_batch`.
    """

    default_prepare_batch = staticmethod(prepare_survival_batch)

    def __init__(self, *, grid: Sequence[float] | torch.Tensor | None = None, **settings: Any) -> None:
        super().__init__(**settings)
        self.grid = None if grid is None else torch.as_tensor(grid, dtype=torch.float32)

    def evaluate_step(
        self, engine: SurvivalEvaluator, batchdata: dict[str, Any], image: torch.Tensor, targets: dict
    ) -> dict:
        predictor = engine.network
        covariates = targets["covariates"]
        with self.inference():
            predicted = predictor.predict(image, covariates if covariates.shape[1] else None, times=self.grid)
        return {
            "case_id": batch_case_ids(batchdata, image.shape[0]),
            "time": targets["time"],
            "event": targets["event"],
            **{k: v.float() if v.is_floating_point() else v for k, v in predicted.items()},
        }

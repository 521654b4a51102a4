# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Exponential moving average (EMA) of a network's weights, kept by an ignite handler."""

from __future__ import annotations

from ignite.engine import Engine, Events
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from common.networks.wrappers import unwrap

__all__ = ["WeightEMA"]


class WeightEMA:
    """EMA of ``network``'s weights (``torch.optim.swa_utils.AveragedModel``), updated after training iterations.

    The first update copies the weights; later ones compute ``ema = decay * ema + (1 - decay) * weights``
    (buffers too with ``use_buffers``, e.g. normalisation statistics). ``averaged`` is an ``nn.Module``: put it in
    the checkpoint's ``save_dict`` so a resumed run continues the same average, and use ``module`` (the averaged
    copy of the network) for validation, inference and export.

    Args:
        network: the trained network (DDP/compile wrappers are removed).
        decay: EMA decay per update (e.g. 0.999-0.9999).
        update_every: update every this many iterations - set it to the gradient-accumulation steps so that
            every update follows an optimizer step.
        start_iteration: first iteration that updates (earlier ones only track the weights by copying them).
        use_buffers: average buffers as well as parameters.
    """

    def __init__(
        self,
        network: nn.Module,
        decay: float = 0.9999,
        update_every: int = 1,
        start_iteration: int = 0,
        use_buffers: bool = True,
    ) -> None:
        if not 0.0 < float(decay) < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay!r}.")
        if int(update_every) < 1:
            raise ValueError(f"update_every must be >= 1, got {update_every!r}.")
        self.network = network
        self.decay = float(decay)
        self.update_every = int(update_every)
        self.start_iteration = int(start_iteration)
        self.averaged = AveragedModel(
            unwrap(network), multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=bool(use_buffers)
        )

    @property
    def module(self) -> nn.Module:
        """The averaged network (same class and state-dict keys as the trained one)."""
        return self.averaged.module

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        iteration = engine.state.iteration
        if iteration % self.update_every:
            return
        if iteration < self.start_iteration:
            # before the start, the average follows the weights (and stays "not yet averaged")
            self.averaged.module.load_state_dict(unwrap(self.network).state_dict())
            return
        self.averaged.update_parameters(unwrap(self.network))

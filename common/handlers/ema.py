# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Exponential moving average (EMA) of a network's weights, kept by an ignite handler."""

from __future__ import annotations

import torch
from ignite.engine import Engine, Events
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from common.networks.wrappers import clean_state_dict, unwrap

__all__ = ["EMAHandler", "WeightEMA", "warmup_decay"]


def warmup_decay(decay: float, n: int) -> float:
    """The EMA warm-up of Tensorflow's ``ExponentialMovingAverage`` (``num_updates``) and of guided/latent
    diffusion: the decay of update ``n`` (the number of earlier updates) is ``min(decay, (1 + n) / (10 + n))``, so a
    short run is not dominated by its random initial weights."""
    return min(float(decay), (1.0 + n) / (10.0 + n))


class WeightEMA:
    """EMA of ``network``'s weights (``torch.optim.swa_utils.AveragedModel``), updated after training iterations.

    The first update copies the weights; later ones compute ``ema = decay * ema + (1 - decay) * weights``
    (buffers too with ``use_buffers``, e.g. normalisation statistics). Put the handler itself in the checkpoint's
    ``save_dict`` (:meth:`state_dict`: the averaged weights and the update count) so a resumed run continues the
    same average, and use ``module`` (the averaged copy of the network) for validation, inference and export.

    Args:
        network: the trained network (DDP/compile wrappers are removed).
        decay: EMA decay per update (e.g. 0.999-0.9999).
        update_every: update every this many iterations - set it to the gradient-accumulation steps so that
            every update follows an optimizer step.
        start_iteration: first iteration that updates (earlier ones only track the weights by copying them).
        use_buffers: average buffers as well as parameters.
        warmup: use the decay ``min(decay, (1 + n) / (10 + n))`` at update ``n`` (see :func:`warmup_decay`)
            instead of ``decay`` from the start.

    The update is ``torch.optim.swa_utils``' EMA (``get_ema_multi_avg_fn``: a fused lerp per device and dtype)
    with the update count kept on the host: ``AveragedModel.update_parameters`` copies its count to the device on
    every update, which on a GPU waits for the queued work.
    """

    def __init__(
        self,
        network: nn.Module,
        decay: float = 0.9999,
        update_every: int = 1,
        start_iteration: int = 0,
        use_buffers: bool = True,
        warmup: bool = False,
    ) -> None:
        if not 0.0 < float(decay) < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay!r}.")
        if int(update_every) < 1:
            raise ValueError(f"update_every must be >= 1, got {update_every!r}.")
        self.network = network
        self.decay = float(decay)
        self.update_every = int(update_every)
        self.start_iteration = int(start_iteration)
        self.warmup = bool(warmup)
        # n_averaged stays a CPU tensor (AveragedModel makes it there and nothing moves it): reading it is free
        self.averaged = AveragedModel(unwrap(network), use_buffers=bool(use_buffers))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights (the network's own keys) and ``n_averaged``: what a checkpoint keeps to continue the
        same average."""
        return {"n_averaged": self.averaged.n_averaged.detach().clone(), **self.module.state_dict()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (DDP/compile prefixes of the network keys are ignored).

        Raises:
            KeyError: when ``n_averaged`` is missing.
        """
        state = clean_state_dict(dict(state_dict))
        if "n_averaged" not in state:
            raise KeyError(f"an EMA state needs 'n_averaged'; got keys {sorted(state)[:5]}...")
        self.averaged.n_averaged.copy_(torch.as_tensor(state.pop("n_averaged")))
        self.module.load_state_dict(state)

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
        self.update()

    @torch.no_grad()
    def update(self) -> None:
        """One EMA update from the network's current weights (the first one copies them)."""
        network, averaged = unwrap(self.network), self.averaged
        mine, theirs = list(averaged.module.parameters()), list(network.parameters())
        if averaged.use_buffers:
            mine, theirs = mine + list(averaged.module.buffers()), theirs + list(network.buffers())
        else:
            for b_avg, b_net in zip(averaged.module.buffers(), network.buffers(), strict=True):
                b_avg.copy_(b_net)
        n = int(averaged.n_averaged)
        if n == 0:
            torch._foreach_copy_(mine, [p.detach() for p in theirs])
        else:
            step = get_ema_multi_avg_fn(warmup_decay(self.decay, n) if self.warmup else self.decay)
            groups: dict[tuple, tuple[list, list]] = {}
            for a, b in zip(mine, theirs, strict=True):
                group = groups.setdefault((a.device, a.dtype), ([], []))
                group[0].append(a)
                group[1].append(b.detach().to(a.device))
            for ema_params, current in groups.values():
                step(ema_params, current, n)
        averaged.n_averaged += 1


class EMAHandler:
    """Attaches a :class:`WeightEMA` defined at the top level of a config (``"ema"``, which the checkpoint and the
    sampler also use) to the trainer: the entry of ``train#handlers`` is this component,
    ``{"_target_": "common.handlers.ema.EMAHandler", "ema": "@ema"}``, rather than the bare reference ``"@ema"``,
    because MONAI's bundle property checks read every handler as a component.

    Args:
        ema: the weight average to update after every iteration.
    """

    def __init__(self, ema: WeightEMA) -> None:
        self.ema = ema

    def attach(self, engine: Engine) -> None:
        self.ema.attach(engine)

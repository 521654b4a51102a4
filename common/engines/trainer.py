# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The training loop every trainer of the collection shares, on top of ``monai.engines.Trainer``: mixed precision
with a kept GradScaler, gradient accumulation over iterations with DDP ``no_sync``, the non-finite guard agreed
across ranks, gradient-norm clipping, and (for one network and one optimizer) the whole iteration, into which a
model plugs :meth:`StepTrainer.prepare_step` and :meth:`StepTrainer.compute_loss`."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from monai.engines import Trainer
from monai.engines.utils import IterationEvents, default_metric_cmp_fn, default_prepare_batch
from monai.engines.workflow import Workflow
from monai.inferers import Inferer, SimpleInferer
from monai.transforms import Decollated
from monai.utils import CommonKeys as Keys
from torch import nn
from torch.optim import Optimizer

from common.errors import UserError
from common.utils import amp_dtype, autocast, get_world_size, make_grad_scaler

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "StepTrainer"]

NONFINITE_POLICIES = ("stop", "skip")

logger = logging.getLogger(__name__)


class NonFiniteLossError(UserError, FloatingPointError):
    """A training loss (or, without fp16 loss scaling, a gradient) became NaN/Inf; the message names the iteration
    and every loss term."""


class StepTrainer(Trainer):
    """Base of the collection's trainers: the training iteration of one network and one optimizer, and the helpers
    a trainer with several networks (:class:`common.autoencoder.engines.AutoencoderGANTrainer`) builds its own
    iteration from.

    The iteration (:meth:`_iteration`), in this order: prepare the batch and the step's inputs
    (:meth:`prepare_step`, the model's hook: data on the device, noise, time steps); train mode; zero the gradients
    when an accumulation window starts; forward under autocast and, outside DDP's all-reduce until the window's last
    iteration (``no_sync``), the loss (:meth:`compute_loss`, the model's hook) and backward; then, on the window's
    last iteration, the non-finite guard, clipping and the optimizer step; the events of
    ``monai.engines.SupervisedTrainer`` fire at the same points (forward, loss, backward, model completed).

    Helpers: ``_accumulation_flags`` says whether an iteration zeroes gradients and whether it steps the optimizers
    (every ``accumulation_steps`` iterations and at the end of an epoch); ``_sync_context`` wraps forward and
    backward passes that must not all-reduce; ``_backward`` scales a loss by its micro-batch fraction, the
    accumulation steps and the fp16 GradScaler; ``_step`` unscales, clips and steps one optimizer;
    ``_finite_or_skip`` guards every optimizer step against non-finite losses.

    Non-finite losses: before each optimizer step the loss terms (and, without an fp16 GradScaler, which handles
    overflowing gradients itself, the gradients) are checked. With ``nonfinite="stop"`` training stops at the first
    NaN/Inf with a :class:`NonFiniteLossError` naming the iteration and the loss terms; the bad step is not taken and
    no checkpoint is written after it, so the last checkpoint on disk is the last good state. With ``"skip"`` the
    step is dropped (gradients zeroed, counted in ``engine.state.skipped_steps``) and training continues. Under DDP
    the decision is agreed by all ranks, so the replicas stay identical.

    Subclasses take their own arguments and pass every setting below on as keywords (``**settings``), so a
    setting is declared here only; a subclass's default batch preparation and decollation are its class attributes
    ``default_prepare_batch`` and ``default_decollate``.

    Args:
        device: the device of this rank.
        max_epochs: number of epochs.
        train_data_loader: the training loader.
        network: the network trained by :meth:`_iteration` (may be DDP/compile-wrapped); None for trainers with
            their own iteration.
        optimizer: its optimizer.
        prepare_batch: batch -> inputs on the device (default: the class's ``default_prepare_batch``).
        amp: ``bf16``, ``fp16`` (with a GradScaler) or ``none``.
        accumulation_steps: iterations accumulated before each optimizer step.
        grad_clip: max gradient norm (``None``/0 disables clipping).
        nonfinite: ``stop`` or ``skip``: what a NaN/Inf loss does (see above).
        decollate: decollate the outputs into one dict per sample, as MONAI's handlers expect (e.g.
            ``--tracking mlflow``; default: the class's ``default_decollate``). Scalar terms stay tensors on the
            device (see :meth:`_register_decollate`).
        epoch_length, non_blocking, postprocessing, key_train_metric, additional_metrics, metric_cmp_fn,
        train_handlers, event_names, event_to_attr, to_kwargs: as in ``monai.engines.SupervisedTrainer``.
        inferer: how the network is called on a step's inputs (``inferer(args[0], network, *args[1:])``; default
            ``SimpleInferer``), as in ``monai.engines.SupervisedTrainer``.
    """

    default_prepare_batch: Callable = staticmethod(default_prepare_batch)
    default_decollate: bool = True
    # whether the iteration's output keeps the network's prediction (``pred``, detached)
    output_prediction: bool = True

    def __init__(
        self,
        device: torch.device | str,
        max_epochs: int,
        train_data_loader: Iterable,
        network: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        prepare_batch: Callable | None = None,
        amp: str = "none",
        accumulation_steps: int = 1,
        grad_clip: float | None = None,
        nonfinite: str = "stop",
        epoch_length: int | None = None,
        non_blocking: bool = False,
        postprocessing: Callable | None = None,
        key_train_metric: dict | None = None,
        additional_metrics: dict | None = None,
        metric_cmp_fn: Callable = default_metric_cmp_fn,
        train_handlers: Sequence | None = None,
        event_names: list | None = None,
        event_to_attr: dict | None = None,
        decollate: bool | None = None,
        to_kwargs: dict | None = None,
        inferer: Inferer | None = None,
    ) -> None:
        if int(accumulation_steps) < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps!r}.")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}.")
        self.amp_mode = str(amp).lower()
        self.amp_dtype = amp_dtype(self.amp_mode)  # validates the value
        super().__init__(
            device=device,
            max_epochs=max_epochs,
            data_loader=train_data_loader,
            epoch_length=epoch_length,
            non_blocking=non_blocking,
            prepare_batch=self.default_prepare_batch if prepare_batch is None else prepare_batch,
            iteration_update=None,
            postprocessing=postprocessing,
            key_metric=key_train_metric,
            additional_metrics=additional_metrics,
            metric_cmp_fn=metric_cmp_fn,
            handlers=train_handlers,
            amp=False,
            event_names=event_names,
            event_to_attr=event_to_attr,
            decollate=self.default_decollate if decollate is None else decollate,
            to_kwargs=to_kwargs,
        )
        self.network = network
        self.optimizer = optimizer
        self.inferer = SimpleInferer() if inferer is None else inferer
        self.accumulation_steps = int(accumulation_steps)
        self.grad_clip = float(grad_clip) if grad_clip else None
        self.nonfinite = nonfinite
        self.scaler = make_grad_scaler(self.state.device, self.amp_mode)
        self.state.skipped_steps = 0
        self._batch_logged = False

    def _register_decollate(self) -> None:
        """MONAI's decollation of the output after ``MODEL_COMPLETED`` (one dict per sample, scalars replicated into
        each), without MONAI's ``detach``, which reads every 0-d tensor back with ``.item()`` (on a GPU a wait for the
        device per loss term and iteration): the outputs are detached already, their scalars stay tensors on the
        device until a handler reads them. The batch stays collated (no handler of a trainer reads it per sample,
        and decollating its metadata reads each value back)."""

        @self.on(IterationEvents.MODEL_COMPLETED)
        def _decollate_data(engine: Trainer) -> None:
            if isinstance(engine.state.output, (list, dict)):
                engine.state.output = Decollated(keys=None, detach=False)(engine.state.output)

    def prepare_step(self, engine: Trainer, batchdata: dict[str, Any]) -> dict[str, Any]:
        """The model's hook: the inputs of one training step from a batch, drawn before any gradient work.

        Returns:
            A dict with ``args`` (the network's positional inputs), ``output`` (the iteration's output so far, e.g.
            ``{"image": ...}``) and anything :meth:`compute_loss` needs; ``stats`` (optional) holds per-iteration
            values added to the output after the step (e.g. the mean time step).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement prepare_step (or its own _iteration).")

    def compute_loss(
        self, engine: Trainer, step: dict[str, Any], prediction: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The model's hook: ``(loss, terms)`` of the network's ``prediction``; ``terms`` are further loss values
        put into the output (detached) before the optimizer step, so the non-finite guard checks them too."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss (or its own _iteration).")

    def _iteration(self, engine: Trainer, batchdata: dict[str, Any]) -> dict[str, Any]:
        """One training iteration of ``engine.network`` with ``engine.optimizer`` (see the class docstring)."""
        if batchdata is None:
            raise ValueError("Must provide batch data for current iteration.")
        step = self.prepare_step(engine, batchdata)
        zero_grad, do_step = self._accumulation_flags(engine)
        output: dict[str, Any] = step["output"]
        engine.state.output = output

        engine.network.train()
        if zero_grad:
            engine.optimizer.zero_grad(set_to_none=True)
        with self._sync_context(engine.network, do_step):
            with autocast(self.state.device, self.amp_mode):
                prediction = engine.inferer(step["args"][0], engine.network, *step["args"][1:])
                if self.output_prediction:
                    output[Keys.PRED] = prediction
                engine.fire_event(IterationEvents.FORWARD_COMPLETED)
            loss, terms = self.compute_loss(engine, step, prediction)
            output[Keys.LOSS] = loss
            engine.fire_event(IterationEvents.LOSS_COMPLETED)
            self._backward(loss)
        engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
        output.update({name: value.detach() for name, value in terms.items()})
        if do_step:
            self._step_and_update(engine, output)
        output[Keys.LOSS] = loss.detach()
        if self.output_prediction:
            output[Keys.PRED] = prediction.detach()
        output.update(step.get("stats", {}))
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        return engine.state.output

    def log_effective_batch(self, batch_size: int) -> None:
        """Log, once per run, the effective batch of an optimizer step: samples per rank and iteration x ranks x
        accumulation steps."""
        if self._batch_logged:
            return
        self._batch_logged = True
        world, acc = get_world_size(), self.accumulation_steps
        logger.info(
            f"effective batch: {batch_size} sample(s) per rank and iteration x {world} rank(s) x {acc} accumulation "
            f"step(s) = {batch_size * world * acc} per optimizer step"
        )

    def run(self) -> None:  # type: ignore[override]
        """Run training, keeping this trainer's GradScaler.

        ``monai.engines.Trainer.run`` replaces ``self.scaler`` according to MONAI's own ``amp`` flag (off here),
        which would silently drop the fp16 GradScaler; ``Workflow.run`` is what remains of it.
        """
        Workflow.run(self)

    def _accumulation_flags(self, engine: Trainer) -> tuple[bool, bool]:
        """``(zero_grad, do_step)`` of the current iteration."""
        acc = self.accumulation_steps
        if acc == 1:
            return True, True
        epoch_length = engine.state.epoch_length
        local_iter = (engine.state.iteration - 1) % epoch_length if epoch_length else engine.state.iteration - 1
        last = epoch_length is not None and local_iter + 1 == epoch_length
        return local_iter % acc == 0, (local_iter + 1) % acc == 0 or last

    @staticmethod
    def _sync_context(network: nn.Module, sync: bool):
        """DDP's ``no_sync`` when gradients must stay local; it must cover the forward pass as well."""
        no_sync = getattr(network, "no_sync", None)
        return contextlib.nullcontext() if sync or no_sync is None else no_sync()

    def _backward(self, loss: torch.Tensor, fraction: float = 1.0) -> None:
        scaled = loss * (fraction / self.accumulation_steps)
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()

    def _finite_or_skip(
        self, engine: Trainer, terms: Mapping[str, torch.Tensor], optimizers: Sequence[Optimizer], network: nn.Module
    ) -> bool:
        """Whether the coming optimizer step may be taken: ``terms`` (loss name -> value) and, without an fp16
        GradScaler, the gradients of ``network`` must be finite on every rank.

        Returns:
            ``True`` to step; ``False`` when the step is skipped (``nonfinite="skip"``: gradients of
            ``optimizers`` zeroed, ``engine.state.skipped_steps`` counted).

        Raises:
            NonFiniteLossError: with ``nonfinite="stop"``, naming the iteration and the loss terms.
        """
        device = torch.device(self.state.device)
        local = torch.zeros(2, device=device)  # [loss non-finite, gradient non-finite], computed without a sync
        values = [v.detach().float().reshape(-1).to(device) for v in terms.values() if isinstance(v, torch.Tensor)]
        if values:
            local[0] = (~torch.isfinite(torch.cat(values))).any().float()
        grads = [p.grad for p in network.parameters() if p.grad is not None]
        if grads and self.scaler is None:  # an fp16 GradScaler skips steps with overflowing gradients itself
            local[1] = (~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())).float()
        agreed = local.max().reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank takes the same decision
        loss_bad, grad_bad, bad = (bool(x) for x in torch.cat([local, agreed]).tolist())  # the one host sync
        if not bad:
            return True
        source = "loss" if loss_bad else "gradient" if grad_bad else "loss on another rank"
        described = ", ".join(f"{name}={_describe(value)}" for name, value in terms.items())
        where = f"iteration {engine.state.iteration} (epoch {engine.state.epoch})"
        if self.nonfinite == "stop":
            raise NonFiniteLossError(
                f"non-finite {source} at {where}: {described}. Training stopped before this step was applied; "
                "the last checkpoint written is the last good state (lower lr, enable grad_clip or amp none, "
                "or set nonfinite='skip' to drop such steps)."
            )
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        engine.state.skipped_steps = getattr(engine.state, "skipped_steps", 0) + 1
        logger.warning(
            f"skipped the optimizer step at {where}: non-finite {source} ({described}); "
            f"{engine.state.skipped_steps} step(s) skipped so far."
        )
        return False

    def _step_and_update(self, engine: Trainer, output: dict) -> None:
        """The optimizer step of a single-optimizer trainer (``engine.optimizer`` over ``engine.network``): check the
        loss terms of ``output`` (:meth:`_finite_or_skip`), unscale, clip and step (``output["grad_norm"]`` when
        clipping), then update the fp16 GradScaler."""
        terms = {k: v for k, v in output.items() if k.endswith("loss") and isinstance(v, torch.Tensor)}
        if not self._finite_or_skip(engine, terms, [engine.optimizer], engine.network):
            return
        grad_norm = self._step(engine.optimizer, engine.network)
        if grad_norm is not None:
            output["grad_norm"] = grad_norm.detach()
        if self.scaler is not None:
            self.scaler.update()

    def _step(self, optimizer: Optimizer, network: nn.Module) -> torch.Tensor | None:
        """Unscale (fp16), clip and step ``optimizer``; returns the gradient norm before clipping, if clipped."""
        grad_norm = None
        if self.grad_clip:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(network.parameters(), self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()
        return grad_norm


def _describe(value: torch.Tensor) -> str:
    """A loss term for a message: its value, or how many of its elements are non-finite."""
    value = value.detach().float()
    if value.numel() == 1:
        number = float(value)
        return f"{number:.6g}" if math.isfinite(number) else str(number)
    count = int((~torch.isfinite(value)).sum())
    return f"{count} of {value.numel()} values non-finite" if count else f"mean {float(value.mean()):.6g}"

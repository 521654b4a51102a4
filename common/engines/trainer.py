# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The training loop every trainer of the collection shares, on top of ``monai.engines.Trainer``: mixed precision
with a kept GradScaler, gradient accumulation over iterations with DDP ``no_sync``, micro-batches within an
iteration, the non-finite guard agreed across ranks, gradient-norm clipping, ``torch.compile`` of the step's
forward and loss as one graph, the memory layout of its inputs, the out-of-memory backoff, and (for one network and
one optimizer) the whole iteration, into which a model plugs :meth:`StepTrainer.prepare_step` and
:meth:`StepTrainer.compute_loss`."""

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
from common.networks.wrappers import (
    enable_gradient_checkpointing,
    redo_after_out_of_memory,
    to_memory_format,
    unwrap,
)
from common.utils import amp_dtype, autocast, get_world_size, make_grad_scaler

__all__ = [
    "NONFINITE_POLICIES",
    "NonFiniteLossError",
    "StepTrainer",
    "accumulation_problems",
    "micro_batch_problems",
    "accumulate",
    "split_step",
]

NONFINITE_POLICIES = ("stop", "skip")

logger = logging.getLogger(__name__)


class NonFiniteLossError(UserError, FloatingPointError):
    """A training loss (or, without fp16 loss scaling, a gradient) became NaN/Inf; the message names the iteration
    and every loss term."""


def split_step(step: Mapping[str, Any], size: int | None) -> list[dict[str, Any]]:
    """The micro-batches of a training step's inputs (what :meth:`StepTrainer.prepare_step` returns) of at most
    ``size`` samples each.

    The batch size is that of the first positional input (``step["args"][0]``). Every tensor whose first dimension
    is the batch size, in ``args`` and in the other entries (recursively through dicts), is per sample and split;
    other values are shared by every micro-batch. ``output`` and ``stats`` (the iteration's own outputs) are not
    split. ``size`` ``None`` or at least the batch size gives ``[step]``.
    """
    batch = step["args"][0].shape[0]
    if size is None or size >= batch:
        return [dict(step)]
    starts = range(0, batch, size)

    def part(value: Any, start: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value[start : start + size]
        if isinstance(value, Mapping):
            return {k: part(v, start) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(part(v, start) for v in value)
        return value

    return [{k: v if k in ("output", "stats") else part(v, start) for k, v in step.items()} for start in starts]


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def micro_batch_problems(micro_batch_size: int | None) -> list[str]:
    """The micro-batch a training step is split into: ``null`` (the whole batch at once) or an integer >= 1."""
    if micro_batch_size is None or _is_count(micro_batch_size):
        return []
    return [f"'micro_batch_size' must be an integer >= 1 or null (the whole batch at once), got {micro_batch_size!r}."]


def accumulation_problems(accumulation_steps: int) -> list[str]:
    """The batches whose gradients one optimizer step sums: an integer >= 1."""
    if _is_count(accumulation_steps):
        return []
    return [f"'accumulation_steps' must be an integer >= 1 (batches per optimizer step), got {accumulation_steps!r}."]


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

    Micro-batches: ``micro_batch_size`` splits each iteration's batch (:func:`split_step`) into chunks forwarded
    and back-propagated one at a time with loss weights ``len(chunk) / len(batch)``, so the update is that of the
    whole batch (exactly for networks without batch statistics and losses that are means over samples: a trainer
    whose loss couples the samples, such as the Cox partial likelihood, sets ``micro_batch_exact`` False and refuses
    micro-batches) at the memory of one chunk; under DDP only the last chunk all-reduces.

    Compilation: with ``compile`` the step's forward and loss (:meth:`forward_loss`: autocast, the network through
    the inferer, :meth:`compute_loss`) are one ``torch.compile`` graph, its backward one AOTAutograd graph. Batch
    preparation, the random draws of :meth:`prepare_step`, DDP's ``no_sync``, the non-finite guard, clipping, the
    optimizer step and the engine's events stay outside it (they hold the host reads, Python state and library
    calls that would break the graph). With a fixed patch size a run compiles once; a different last batch or a
    smaller micro-batch compiles once more.

    Memory layout: ``memory_format`` ``channels_last_3d`` puts the 5-D inputs of each step in that layout (the
    networks are converted by :func:`common.networks.wrappers.prepare_network` with the same setting).

    Out of memory: with ``oom_backoff`` (the default), a ``torch.OutOfMemoryError`` inside a step's forward or
    backward frees the step (its gradients and the networks' buffers back to their state before the iteration, so a
    BatchNorm statistic or an EMA codebook is not updated twice), halves the micro-batch (or,
    at one sample per micro-batch or for a loss that couples the batch, turns on gradient checkpointing where the
    network supports it, :func:`common.networks.wrappers.enable_gradient_checkpointing`), logs what it changed and
    redoes the same step on the same batch, so the update is the one the batch would have given (for networks without
    batch statistics: BatchNorm layers then normalise over the micro-batches, which the log line says, and keep at
    least 2 samples each). The smaller
    micro-batch is kept for the rest of the run. When nothing is left to reduce, or with ``oom_backoff`` False,
    training stops with an :class:`OutOfMemoryBackoffError` naming the step and what was tried. Under DDP every
    rank backs off on its own (the micro-batches do not change the update); an OOM inside the all-reducing backward
    of the last micro-batch leaves DDP's reducer mid-collective and cannot be redone.

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
        micro_batch_size: samples forwarded at once within an iteration (``None``: the whole batch).
        compile: compile the step's forward and loss (see above).
        compile_kwargs: extra arguments of ``torch.compile`` (e.g. ``mode``, ``backend``).
        memory_format: ``contiguous`` or ``channels_last_3d``: the layout of the step's 5-D inputs.
        oom_backoff: redo a step that ran out of GPU memory with less memory (see above).
    """

    default_prepare_batch: Callable = staticmethod(default_prepare_batch)
    default_decollate: bool = True
    # whether the iteration's output keeps the network's prediction (``pred``, detached)
    output_prediction: bool = True
    # whether the loss is a mean over samples, so that micro-batches weighted by their size give the batch's update
    micro_batch_exact: bool = True
    # whether compute_loss is inside the compiled region; False for a loss that reads values back or calls a library
    # whose code breaks graphs: it then runs eagerly after the compiled forward
    loss_in_graph: bool = True

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
        micro_batch_size: int | None = None,
        compile: bool = False,
        compile_kwargs: Mapping | None = None,
        memory_format: str = "contiguous",
        oom_backoff: bool = True,
    ) -> None:
        problems = micro_batch_problems(micro_batch_size) + accumulation_problems(accumulation_steps)
        if problems:
            raise ValueError(" ".join(problems))
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
        self.micro_batch_size = int(micro_batch_size) if micro_batch_size else None
        if self.micro_batch_size and not self.micro_batch_exact:
            raise ValueError(
                f"micro_batch_size {micro_batch_size!r}: the loss of {type(self).__name__} couples the samples of a "
                "batch, so micro-batches would change it; leave micro_batch_size null (or lower batch_size)."
            )
        to_memory_format(None, memory_format)  # validates the name
        self.memory_format = memory_format
        self.oom_backoff = bool(oom_backoff)
        self.compile = bool(compile)
        self.compile_kwargs = dict(compile_kwargs or {})
        self._compiled: dict[str, Callable] = {}

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

    def compiled(self, name: str, fn: Callable) -> Callable:
        """``fn`` compiled with ``torch.compile`` (once, kept under ``name``) when ``compile`` is on, else ``fn``."""
        if not self.compile:
            return fn
        if name not in self._compiled:
            self._compiled[name] = torch.compile(fn, **self.compile_kwargs)
        return self._compiled[name]

    def forward(self, step: dict[str, Any]) -> torch.Tensor:
        """The network's prediction on one (micro-)batch of ``step``, through the inferer under autocast."""
        with autocast(self.state.device, self.amp_mode):
            return self.inferer(step["args"][0], self.network, *step["args"][1:])

    def forward_loss(self, step: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The compiled region of a step: ``(prediction, loss, terms)`` of one (micro-)batch of ``step``
        (:meth:`forward`, then :meth:`compute_loss`)."""
        prediction = self.forward(step)
        loss, terms = self.compute_loss(self, step, prediction)
        return prediction, loss, terms

    def _compiled_step(self, step: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`forward_loss` as compiled: whole, or with ``loss_in_graph`` False the forward alone."""
        if self.loss_in_graph:
            return self.compiled("forward_loss", self.forward_loss)(step)
        prediction = self.compiled("forward", self.forward)(step)
        return (prediction, *self.compute_loss(self, step, prediction))

    def _iteration(self, engine: Trainer, batchdata: dict[str, Any]) -> dict[str, Any]:
        """One training iteration of ``engine.network`` with ``engine.optimizer`` (see the class docstring)."""
        if batchdata is None:
            raise ValueError("Must provide batch data for current iteration.")
        step = self.prepare_step(engine, batchdata)
        step["args"] = to_memory_format(tuple(step["args"]), self.memory_format)
        zero_grad, do_step = self._accumulation_flags(engine)
        output: dict[str, Any] = step["output"]
        engine.state.output = output

        prediction, terms = self.with_backoff(
            "training",
            engine.network,
            engine.optimizer,
            zero_grad,
            step["args"][0].shape[0],
            lambda size: self._forward_backward(engine, step, size, do_step),
        )
        engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
        output.update(terms)  # the batch means of the loss and its terms, detached
        if do_step:
            self._step_and_update(engine, output)
        if self.output_prediction:
            output[Keys.PRED] = prediction
        output.update(step.get("stats", {}))
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        return engine.state.output

    def _forward_backward(
        self, engine: Trainer, step: dict[str, Any], size: int | None, sync: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of ``step`` in micro-batches of ``size``: ``(prediction, terms)``, both detached,
        the terms (``loss`` included) averaged over the batch. ``FORWARD_COMPLETED`` and ``LOSS_COMPLETED`` fire
        after the last micro-batch's forward and loss, which are one compiled region."""
        output = step["output"]
        chunks = split_step(step, size)
        total = step["args"][0].shape[0]
        sums: dict[str, torch.Tensor] = {}
        predictions = []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            fraction = chunk["args"][0].shape[0] / total
            with self._sync_context(engine.network, sync and last):
                prediction, loss, terms = self._compiled_step(chunk)
                if last:
                    if self.output_prediction:
                        output[Keys.PRED] = prediction
                    engine.fire_event(IterationEvents.FORWARD_COMPLETED)
                    output[Keys.LOSS] = loss
                    engine.fire_event(IterationEvents.LOSS_COMPLETED)
                self._backward(loss, fraction)
            accumulate(sums, {**terms, Keys.LOSS: loss}, fraction)
            predictions.append(prediction.detach())
        return (torch.cat(predictions) if len(predictions) > 1 else predictions[0]), sums

    def with_backoff(
        self,
        phase: str,
        network: nn.Module,
        optimizer: Optimizer,
        fresh: bool,
        batch: int,
        run: Callable[[int | None], Any],
    ) -> Any:
        """``network`` in training mode, its gradients zeroed when ``fresh``, then ``run(micro_batch_size)``,
        redone with less memory after a ``torch.OutOfMemoryError`` (see the class docstring).

        Args:
            phase: the step's name in messages (``training``, ``generator``, ``discriminator``).
            network: the network whose gradients ``run`` accumulates (restored before a redo).
            optimizer: the optimizer of ``network`` (its gradients are zeroed when ``fresh``).
            fresh: whether this iteration starts an accumulation window (else the gradients hold earlier
                iterations of the window: a copy is kept aside to be restored, one gradient-sized buffer on the
                device while the iteration runs). The network's buffers (BatchNorm statistics, an EMA codebook),
                which a forward pass may change, are kept aside and restored the same way.
            batch: the iteration's batch size.
            run: forward and backward of the whole batch in micro-batches of the given size.

        Raises:
            OutOfMemoryBackoffError: when nothing is left to reduce, or the backoff is off.
        """
        network.train()
        if fresh:
            optimizer.zero_grad(set_to_none=True)
        params = list(network.parameters())
        buffers = list(network.buffers())
        kept, kept_buffers = None, []
        if self.oom_backoff:
            # what a forward pass may change (BatchNorm statistics, an EMA codebook), to undo a failed attempt
            kept_buffers = [b.clone() for b in buffers]
            if not fresh:
                kept = [None if p.grad is None else p.grad.clone() for p in params]

        def undo() -> None:
            for p, grad in zip(params, kept or [None] * len(params)):
                p.grad = grad if grad is None else grad.clone()
            with torch.no_grad():
                for b, value in zip(buffers, kept_buffers):
                    b.copy_(value)

        return redo_after_out_of_memory(
            lambda: run(self.micro_batch_size),
            lambda: self._reduce_memory(batch, network),
            f"the {phase} step of iteration {self.state.iteration} (epoch {self.state.epoch})",
            lambda: f"micro-batch {self.micro_batch_size or batch} of a batch of {batch}",
            "Lower patch_size or batch_size, or use a GPU with more memory.",
            self.oom_backoff,
            undo,
        )

    def _reduce_memory(self, batch: int, network: nn.Module) -> str | None:
        """Halve the micro-batch or else turn on gradient checkpointing; what was changed, or ``None``."""
        current = self.micro_batch_size or batch
        batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in network.modules())
        smallest = 2 if batch_norm else 1  # BatchNorm needs more than one value per channel in training
        if self.micro_batch_exact and current // 2 >= smallest:
            self.micro_batch_size = current // 2
            change = f"micro-batch halved from {current} to {self.micro_batch_size} sample(s)"
            if batch_norm:
                change += " (its BatchNorm layers now normalise over the micro-batches, not the whole batch)"
            return change
        if enable_gradient_checkpointing(network):
            return f"gradient checkpointing turned on in {type(unwrap(network)).__name__}"
        return None

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


def accumulate(sums: dict[str, torch.Tensor], values: Mapping[str, torch.Tensor], fraction: float) -> None:
    """Add ``fraction`` x each of ``values`` (detached, float32) to ``sums``: a batch mean from its micro-batches."""
    for name, value in values.items():
        value = value.detach().float() * fraction
        sums[name] = sums[name] + value if name in sums else value


def _describe(value: torch.Tensor) -> str:
    """A loss term for a message: its value, or how many of its elements are non-finite."""
    value = value.detach().float()
    if value.numel() == 1:
        number = float(value)
        return f"{number:.6g}" if math.isfinite(number) else str(number)
    count = int((~torch.isfinite(value)).sum())
    return f"{count} of {value.numel()} values non-finite" if count else f"mean {float(value.mean()):.6g}"

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The evaluation iteration every model-specific evaluator shares; a model supplies one hook."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from monai.engines import SupervisedEvaluator
from monai.engines.utils import IterationEvents, default_prepare_batch
from torch import nn

from common.utils import inference_autocast

__all__ = ["StepEvaluator"]


class StepEvaluator(SupervisedEvaluator):
    """A ``monai.engines.SupervisedEvaluator`` whose iteration is fixed and whose model part is a hook.

    Each iteration checks the batch, prepares it with ``prepare_batch``, calls :meth:`evaluate_step` (the model's
    forward and outputs, which opens :meth:`inference` around its network calls), stores the returned dict as
    ``engine.state.output`` and fires ``FORWARD_COMPLETED`` and ``MODEL_COMPLETED`` for the metric handlers.

    Subclasses set ``default_prepare_batch`` (used when ``prepare_batch`` is not given) and ``default_decollate``.

    Args:
        device: the device of this rank.
        val_data_loader: the evaluation data.
        network: the evaluated network (in eval mode, without gradients, inside :meth:`inference`).
        amp: ``bf16``/``fp16`` autocast of the network on CUDA, or ``none`` (see
            :func:`common.utils.inference_autocast`).
        prepare_batch: ``(batchdata, device, non_blocking, **kwargs) -> (inputs, targets)``.
        decollate: decollate the output after each iteration (default: ``default_decollate``).
        metric_cmp_fn: ``(current, previous) -> bool``; ``None`` keeps MONAI's default (higher is better).
        settings: the other arguments of ``monai.engines.SupervisedEvaluator`` (``epoch_length``, ``non_blocking``,
            ``inferer``, ``postprocessing``, ``key_val_metric``, ``additional_metrics``, ``val_handlers``, ...).
    """

    default_prepare_batch: Callable = staticmethod(default_prepare_batch)
    default_decollate: bool = False

    def __init__(
        self,
        device: torch.device | str,
        val_data_loader: Iterable,
        network: nn.Module,
        amp: str = "none",
        prepare_batch: Callable | None = None,
        decollate: bool | None = None,
        metric_cmp_fn: Callable | None = None,
        **settings: Any,
    ) -> None:
        if metric_cmp_fn is not None:
            settings["metric_cmp_fn"] = metric_cmp_fn
        super().__init__(
            device=device,
            val_data_loader=val_data_loader,
            network=network,
            prepare_batch=prepare_batch or self.default_prepare_batch,
            decollate=self.default_decollate if decollate is None else decollate,
            **settings,
        )
        self.amp_mode = str(amp).lower()

    def inference(self, *modules: nn.Module) -> contextlib.AbstractContextManager:
        """Eval mode without gradients for ``modules`` (default: the network) and the inference autocast."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.mode(*(modules or (self.network,))))
        stack.enter_context(inference_autocast(self.state.device, self.amp_mode))
        return stack

    def evaluate_step(self, engine: StepEvaluator, batchdata: dict[str, Any], inputs: Any, targets: Any) -> dict:
        """The model part of one iteration: the outputs of the prepared batch ``(inputs, targets)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement evaluate_step.")

    def _iteration(self, engine: StepEvaluator, batchdata: dict[str, Any]) -> dict:
        if batchdata is None:
            raise ValueError("Must provide batch data for current iteration.")
        inputs, targets = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking, **engine.to_kwargs)
        engine.state.output = self.evaluate_step(engine, batchdata, inputs, targets)
        engine.fire_event(IterationEvents.FORWARD_COMPLETED)
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        return engine.state.output

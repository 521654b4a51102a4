# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The shared training iteration of ``StepTrainer``: a model that supplies only ``prepare_step`` and
``compute_loss`` gets events in ``SupervisedTrainer``'s order, the closed-form first step, gradient accumulation
equal to one step on the whole batch, the non-finite guard, and its settings with the class defaults."""

from __future__ import annotations

import pytest
import torch
from monai.engines.utils import IterationEvents
from torch import nn

from common.engines.trainer import NonFiniteLossError, StepTrainer


class Regression(StepTrainer):
    """Least squares ``network(x) ~ y``; the mean target goes into the output after the step."""

    default_prepare_batch = staticmethod(lambda batch, device, non_blocking, **kw: (batch["x"], batch["y"]))
    default_decollate = False

    def prepare_step(self, engine, batchdata):
        x, y = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking)
        return {"args": (x,), "output": {"image": x}, "y": y, "stats": {"y_mean": y.mean()}}

    def compute_loss(self, engine, step, prediction):
        residual = prediction - step["y"]
        return (residual**2).mean(), {"abs_loss": residual.abs().mean()}


def _batches(n: int, size: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(size, 3, generator=g), "y": torch.randn(size, 1, generator=g)} for _ in range(n)]


def _trainer(batches, lr: float = 0.1, **settings) -> Regression:
    torch.manual_seed(0)
    network = nn.Linear(3, 1)
    return Regression(
        network=network,
        optimizer=torch.optim.SGD(network.parameters(), lr=lr),
        device="cpu",
        max_epochs=1,
        train_data_loader=batches,
        **settings,
    )


def test_events_fire_in_supervised_trainer_order_and_output_holds_the_terms():
    trainer = _trainer(_batches(1, 4))
    seen = []
    for event in (
        IterationEvents.FORWARD_COMPLETED,
        IterationEvents.LOSS_COMPLETED,
        IterationEvents.BACKWARD_COMPLETED,
        IterationEvents.MODEL_COMPLETED,
    ):
        trainer.add_event_handler(event, lambda e, name=event.name: seen.append(name))
    trainer.run()
    assert seen == ["FORWARD_COMPLETED", "LOSS_COMPLETED", "BACKWARD_COMPLETED", "MODEL_COMPLETED"]
    output = trainer.state.output
    assert isinstance(output, dict), "the class default decollate=False keeps one dict per batch"
    assert list(output) == ["image", "pred", "loss", "abs_loss", "y_mean"]
    assert not output["loss"].requires_grad and not output["pred"].requires_grad


def test_first_step_is_plain_gradient_descent():
    """One SGD step of the least-squares loss: w <- w - lr * 2/N X^T (Xw + b - y)."""
    (batch,) = batches = _batches(1, 5)
    trainer = _trainer(batches, lr=0.1)
    w0, b0 = trainer.network.weight.detach().clone(), trainer.network.bias.detach().clone()
    residual = batch["x"] @ w0.T + b0 - batch["y"]
    trainer.run()
    expected_w = w0 - 0.1 * 2 / 5 * (residual.T @ batch["x"])
    expected_b = b0 - 0.1 * 2 / 5 * residual.sum(0)
    torch.testing.assert_close(trainer.network.weight.detach(), expected_w)
    torch.testing.assert_close(trainer.network.bias.detach(), expected_b)


def test_accumulation_equals_one_step_on_the_whole_batch():
    halves = _batches(2, 3)
    whole = [{k: torch.cat([h[k] for h in halves]) for k in ("x", "y")}]
    accumulated = _trainer(halves, accumulation_steps=2)
    accumulated.run()
    single = _trainer(whole)
    single.run()
    for a, b in zip(accumulated.network.parameters(), single.network.parameters()):
        torch.testing.assert_close(a, b)


def test_a_nan_loss_stops_before_the_step_and_names_the_terms():
    batches = _batches(1, 4)
    batches[0]["y"][0, 0] = float("nan")
    trainer = _trainer(batches)
    before = [p.detach().clone() for p in trainer.network.parameters()]
    with pytest.raises(NonFiniteLossError, match=r"iteration 1 .*loss=nan, abs_loss=nan"):
        trainer.run()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.network.parameters()))


def test_a_model_without_hooks_is_told_what_to_implement():
    network = nn.Linear(3, 1)
    trainer = StepTrainer(
        network=network,
        optimizer=torch.optim.SGD(network.parameters(), lr=0.1),
        device="cpu",
        max_epochs=1,
        train_data_loader=_batches(1, 2),
    )
    with pytest.raises(NotImplementedError, match="StepTrainer must implement prepare_step"):
        trainer.run()

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The shared training iteration of ``StepTrainer``: a model that supplies only ``prepare_step`` and
``compute_loss`` gets events in ``SupervisedTrainer``'s order, the closed-form first step, gradient accumulation
equal to one step on the whole batch, the non-finite guard, its settings with the class defaults, and a step that
runs out of GPU memory redone with less memory, to the same update."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Events
from monai.engines.utils import IterationEvents
from torch import nn

from common.engines.trainer import NonFiniteLossError, StepTrainer, split_step
from common.errors import OutOfMemoryBackoffError


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


# ---------------------------------------------------------------------------------------------- out of memory
class MemoryLimited(nn.Module):
    """``network`` on a device that holds at most ``limit`` samples per forward (a ``torch.OutOfMemoryError`` above
    it), and that also fails once on call number ``fail_at`` (counted over the run) whatever its size; with
    ``use_checkpoint`` False (a network that supports gradient checkpointing) nothing fits until it is turned on."""

    def __init__(self, network: nn.Module, limit: int | None = None, fail_at: int | None = None) -> None:
        super().__init__()
        self.network, self.limit, self.fail_at, self.calls, self.sizes = network, limit, fail_at, 0, []

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at or (self.limit is not None and x.shape[0] > self.limit):
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} samples")
        if getattr(self, "use_checkpoint", True) is False:
            raise torch.OutOfMemoryError("CUDA out of memory. Activations do not fit")
        self.sizes.append(x.shape[0])
        return self.network(x)


def _limited_run(batches, limit=None, fail_at=None, network=None, **settings):
    trainer = _trainer(batches, **settings)
    if network is not None:
        trainer.optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    trainer.network = MemoryLimited(network if network is not None else trainer.network, limit, fail_at)
    outputs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(dict(e.state.output)))
    trainer.run()
    return trainer, outputs


def test_out_of_memory_halves_the_micro_batch_and_redoes_the_same_step(caplog):
    """A batch of 8 on a device that fits 2: the step is redone with micro-batches of 4, then 2, and gives the
    update and the losses of the un-failed step on the same batch (up to the summation order); the smaller
    micro-batch is kept for the next iteration."""
    batches = _batches(2, 8)
    reference, ref_out = _limited_run(batches)
    with caplog.at_level("WARNING", logger="common.engines.trainer"):
        trainer, out = _limited_run(batches, limit=2)
    assert trainer.micro_batch_size == 2
    assert trainer.network.sizes == [2, 2, 2, 2] * 2  # the second iteration did not fail again
    messages = [r.getMessage() for r in caplog.records if "out of GPU memory" in r.getMessage()]
    assert len(messages) == 2
    assert "iteration 1 (epoch 1): micro-batch halved from 8 to 4 sample(s)" in messages[0]
    assert "micro-batch halved from 4 to 2 sample(s)" in messages[1] and "Tried to allocate 4 samples" in messages[1]
    for a, b in zip(trainer.network.parameters(), reference.network.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for name in ("loss", "abs_loss"):
        assert [float(o[name]) for o in out] == pytest.approx([float(o[name]) for o in ref_out], rel=1e-6)
    assert out[-1]["pred"].shape == (8, 1)


def test_out_of_memory_within_an_accumulation_window_keeps_the_earlier_gradients():
    """Accumulation over 2 iterations in micro-batches of 4: the second iteration fails on its second micro-batch,
    after the first one's backward; the redo starts from the first iteration's gradients, so the optimizer step
    is the un-failed one."""
    batches = _batches(2, 8)
    reference, _ = _limited_run(batches, accumulation_steps=2, micro_batch_size=4)
    trainer, _ = _limited_run(batches, fail_at=4, accumulation_steps=2, micro_batch_size=4)
    assert trainer.micro_batch_size == 2 and trainer.network.sizes == [4, 4, 4, 2, 2, 2, 2]
    for a, b in zip(trainer.network.parameters(), reference.network.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_out_of_memory_turns_on_gradient_checkpointing_after_micro_batch_1(caplog):
    batches = _batches(1, 2)
    reference, _ = _limited_run(batches)
    trainer = _trainer(batches)
    trainer.network = MemoryLimited(trainer.network)
    trainer.network.use_checkpoint = False
    with caplog.at_level("WARNING", logger="common.engines.trainer"):
        trainer.run()
    assert trainer.micro_batch_size == 1 and trainer.network.use_checkpoint is True
    assert "gradient checkpointing turned on in MemoryLimited" in caplog.text
    for a, b in zip(trainer.network.parameters(), reference.network.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backoff", [True, False])
def test_out_of_memory_with_nothing_to_reduce_stops_before_the_step(backoff):
    batches = _batches(1, 2)
    trainer = _trainer(batches, oom_backoff=backoff)
    trainer.network = MemoryLimited(trainer.network, limit=0)
    before = [p.detach().clone() for p in trainer.network.parameters()]
    with pytest.raises(OutOfMemoryBackoffError) as raised:
        trainer.run()
    message = str(raised.value)
    assert "out of GPU memory in the training step of iteration 1 (epoch 1)" in message
    if backoff:
        assert "nothing is left to reduce (micro-batch 1 of a batch of 2)" in message
    else:
        assert "oom_backoff is off (micro-batch 2 of a batch of 2)" in message
    assert all(torch.equal(a, b) for a, b in zip(trainer.network.parameters(), before))
    assert all(p.grad is None for p in trainer.network.parameters())


def test_micro_batches_are_refused_for_a_loss_that_couples_the_batch():
    class Coupled(Regression):
        micro_batch_exact = False

    network = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="couples the samples of a batch"):
        Coupled(
            network=network,
            optimizer=torch.optim.SGD(network.parameters(), lr=0.1),
            device="cpu",
            max_epochs=1,
            train_data_loader=_batches(1, 4),
            micro_batch_size=2,
        )


def test_split_step_splits_the_per_sample_values_only():
    x, t, shared = torch.arange(5.0).reshape(5, 1), torch.arange(5), torch.ones(3)
    step = {"args": (x, t, None), "output": {"image": x}, "targets": {"time": t, "cuts": shared}, "stats": {"m": x}}
    chunks = split_step(step, 2)
    assert [c["args"][0].flatten().tolist() for c in chunks] == [[0.0, 1.0], [2.0, 3.0], [4.0]]
    assert [c["targets"]["time"].tolist() for c in chunks] == [[0, 1], [2, 3], [4]]
    assert all(c["targets"]["cuts"] is shared and c["args"][2] is None for c in chunks)
    assert all(c["output"] is step["output"] and c["stats"] is step["stats"] for c in chunks)
    assert split_step(step, None) == [step] and split_step(step, 5) == [step]


def test_out_of_memory_log_says_when_batchnorm_sees_smaller_batches(caplog):
    """BatchNorm in training needs more than one value per channel: its micro-batches keep 2 samples at least."""
    batches = _batches(1, 4)
    trainer = _trainer(batches)
    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    trainer.network, trainer.optimizer = MemoryLimited(network, limit=2), torch.optim.SGD(network.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="common.engines.trainer"):
        trainer.run()
    assert "micro-batch halved from 4 to 2 sample(s) (its BatchNorm layers now normalise over the micro-batches" in (
        caplog.text
    )

    with pytest.raises(OutOfMemoryBackoffError, match=r"nothing is left to reduce \(micro-batch 2 of a batch of 4\)"):
        _limited_run(_batches(1, 4), limit=1, network=network)

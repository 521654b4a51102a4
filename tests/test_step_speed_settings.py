# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The speed settings of every bundle's training step change its speed, not its arithmetic: the step (both steps
of the GANs) and the per-window predictor compile to one graph with ``torch.compile``, an epoch at a fixed patch
size compiles once, and ``memory_format`` ``channels_last_3d`` gives the contiguous step's loss and gradients.

Graph breaks are found by ``torch._dynamo.explain`` (tracing only, no code generation), compilations counted with
dynamo's ``CompileCounter`` backend, which runs each graph as traced: both cost seconds on the CPU."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ignite.engine import Events
from monai.engines.utils import IterationEvents
from torch._dynamo.testing import CompileCounter

from common.bundle_tools.registry import describe
from tests.bundle_cases import CASES
from tests.helpers import bundle_workflow

# each bundle's case (tests/bundle_cases.py), and variants: a name, its bundle and the settings it adds
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # the Cox loss reads values back: only the network is compiled (SurvivalTrainer.loss_in_graph)
    "mace_survival[cox]": ("mace_survival", {"survival_head": "cox"}),
}
BUNDLES: dict[str, tuple[str, dict[str, Any]]] = {name: (name, {}) for name in CASES} | VARIANTS


@pytest.fixture(scope="module", params=sorted(BUNDLES))
def bundle(request, tmp_path_factory) -> tuple[str, dict[str, Any]]:
    """A case's bundle and the settings of a tiny run of it on the case's generated data (every branch of the step
    taken: the case's ``host_read_settings``)."""
    name, variant = BUNDLES[request.param]
    case = CASES[name]
    data = case.write_data(tmp_path_factory.mktemp(f"{name}_data"))
    return name, {**case.host_read_settings, **variant, **data, "configs": list(case.configs)}


def _workflow(bundle: tuple[str, dict[str, Any]], work_dir: Path, iterations: int = 1, **settings: Any):
    name, data = bundle
    data = dict(data)
    configs = data.pop("configs")
    return bundle_workflow(name, configs, work_dir, iterations, **data, **settings)


def graph_breaks(fn: Callable, *args: Any) -> list[str]:
    """The graph breaks ``torch.compile`` makes in ``fn(*args)``: ``"reason (file:line)"`` each, empty for one
    graph."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    breaks = []
    for item in explained.break_reasons:
        frame = item.user_stack[-1] if item.user_stack else None
        where = f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"
        breaks.append(f"{str(item.reason).strip().splitlines()[0]} ({where})")
    assert explained.graph_count >= 1
    return breaks


def compiled_regions(trainer: Any) -> dict[str, tuple[Callable, tuple]]:
    """The regions ``compile`` puts into graphs in one training iteration of ``trainer`` on its first batch, with
    their arguments: the generator and discriminator steps of a GAN, the step's forward and loss otherwise."""
    from common.autoencoder.engines import AutoencoderGANTrainer, frozen

    batch = next(iter(trainer.data_loader))
    trainer.state.iteration = 1
    if isinstance(trainer, AutoencoderGANTrainer):
        x, y = trainer.prepare_batch(batch, trainer.state.device, False)
        views = trainer._views(trainer.discriminator, y)
        recon = trainer.generator_loss(x, y, False, {})[0].detach()

        def generator(*args):
            with frozen(trainer.discriminator):  # the trainer freezes it outside the region
                return trainer.generator_loss(*args)

        return {
            "generator": (generator, (x, y, True, views)),
            "discriminator": (trainer.discriminator_loss, (x, recon, views)),
        }
    step = trainer.prepare_step(trainer, batch)
    region = trainer.forward_loss if trainer.loss_in_graph else trainer.forward
    return {"step": (region, (step,))}


def test_training_step_is_one_graph(bundle, tmp_path):
    """``torch.compile`` of the training step makes no graph break: the break's reason and line are printed when
    one appears."""
    trainer = _workflow(bundle, tmp_path).parser.get_parsed_content("train#trainer")
    regions = compiled_regions(trainer)
    assert {name: graph_breaks(fn, *args) for name, (fn, args) in regions.items()} == dict.fromkeys(regions, [])


def test_an_epoch_compiles_once(bundle, tmp_path):
    """Three iterations of an epoch at a fixed patch size, with ``compile`` on, trace each compiled region once:
    nothing of the step changes its guards from one iteration to the next (iteration counters, random draws,
    codebook initialisation), and the trainer really runs the compiled regions."""
    counter = CompileCounter()
    trainer = _workflow(bundle, tmp_path, compile=True, max_epochs=1, epoch_length=3).parser.get_parsed_content(
        "train#trainer"
    )
    trainer.compile_kwargs = {"backend": counter}
    torch._dynamo.reset()
    trainer.run()
    assert trainer.state.iteration == 3
    assert counter.frame_count == len(trainer._compiled) >= 1, (counter.frame_count, sorted(trainer._compiled))


def _predictor(name: str, workflow: Any) -> tuple[torch.nn.Module, tuple]:
    """The network the bundle's inference applies to each window (or volume), in eval mode, with an input."""
    parser = workflow.parser
    trainer = parser.get_parsed_content("train#trainer")
    batch = next(iter(trainer.data_loader))
    kind = describe(name).family  # what the inference network is is the family's
    if kind in ("autoencoder", "vqgan"):
        if kind == "autoencoder":  # the factory builds the inference view
            parser["network_def"]["reconstructor"] = True
        else:
            parser["network_def"]["_target_"] = "common.vqgan.networks.VQGANReconstructor"
        network = parser.get_parsed_content("network_def", instantiate=True, lazy=False)
        image = trainer.prepare_batch(batch, "cpu", False)[0]
        return network.eval(), (image,)
    if kind == "survival":
        from common.survival.networks import SurvivalExportView

        image = trainer.prepare_step(trainer, batch)["args"][0]
        return SurvivalExportView(parser.get_parsed_content("predictor")), (image,)
    # the diffusion samplers call the denoiser on each window at one time step
    step = trainer.prepare_step(trainer, batch)
    return trainer.network.eval(), tuple(step["args"])


def test_predictor_is_one_graph(bundle, tmp_path):
    """What inference applies to each sliding window (the reconstruction network, the survival predictor, the
    denoiser of one sampling step) compiles without a graph break; the window loop and the sampling loop (MONAI's
    ``sliding_window_inference``, the DDIM grid with its host-side time steps) stay outside."""
    name = bundle[0]
    network, args = _predictor(name, _workflow(bundle, tmp_path))
    with torch.no_grad():
        assert graph_breaks(network, *args) == []


def _first_step(
    bundle: tuple[str, dict[str, Any]], work_dir: Path, fits: int | None = None, **settings: Any
) -> tuple[dict, list[torch.Tensor], Any]:
    """The losses of ``bundle``'s first training iteration, the gradients of its (first) network's backward and the
    trainer; with ``fits``, the network holds at most that many samples per forward (``torch.OutOfMemoryError``
    above, as a GPU out of memory)."""
    torch.manual_seed(0)
    trainer = _workflow(bundle, work_dir, **settings).parser.get_parsed_content("train#trainer")
    if fits is not None:

        def out_of_memory(module, args) -> None:
            if args[0].shape[0] > fits:
                raise torch.OutOfMemoryError(f"CUDA out of memory (a batch of {args[0].shape[0]})")

        trainer.network.register_forward_pre_hook(out_of_memory)
    kernels = [p for p in trainer.network.parameters() if p.dim() == 5 and p.shape[1] > 1 and p.shape[2:].numel() > 1]
    channels_last = settings.get("memory_format") == "channels_last_3d"
    assert kernels and all(p.is_contiguous() != channels_last for p in kernels)  # the layout asked for
    grads: list[torch.Tensor] = []

    def keep(engine) -> None:
        grads.extend(p.grad.detach().clone() for p in engine.network.parameters() if p.grad is not None)

    trainer.add_event_handler(IterationEvents.BACKWARD_COMPLETED, keep)
    losses: dict[str, float] = {}

    def read(engine) -> None:
        output = engine.state.output
        output = output[0] if isinstance(output, list) else output
        losses.update({k: float(v) for k, v in output.items() if k.endswith("loss")})

    trainer.add_event_handler(Events.ITERATION_COMPLETED, read)
    trainer.run()
    return losses, grads, trainer


def test_channels_last_step_equals_the_contiguous_step(bundle, tmp_path):
    """One training iteration with the networks and the inputs in ``channels_last_3d`` gives the losses and the
    gradients of the contiguous iteration on the same batch and random draws. The layout changes only the
    convolution kernels' summation order: float32 rounding of sums over a 3^3 x C receptive field, so agreement to
    a relative 1e-4 (and 1e-5 of the largest gradient in absolute terms) is what the arithmetic allows."""
    contiguous, grads, _ = _first_step(bundle, tmp_path / "contiguous")
    channels_last, grads_cl, _ = _first_step(bundle, tmp_path / "channels_last", memory_format="channels_last_3d")
    assert contiguous and list(channels_last) == list(contiguous)
    assert channels_last == pytest.approx(contiguous, rel=1e-4, abs=1e-7)
    assert len(grads_cl) == len(grads) > 0
    scale = max(float(g.abs().max()) for g in grads)
    for a, b in zip(grads_cl, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


def test_a_graph_break_is_reported_with_its_reason_and_line():
    """The check above can fail: a value read back inside the region is one break, named with its line."""

    def reads_back(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum())

    breaks = graph_breaks(reads_back, torch.ones(2))
    assert len(breaks) == 1 and "test_step_speed_settings.py:" in breaks[0], breaks


# families whose step gives the same update in micro-batches: the random draws are made before the forward and the
# networks have no batch statistics (not the autoencoder's posterior sample, the VQ-GAN's codebook update per
# micro-batch, mace's BatchNorm)
SAME_UPDATE_IN_MICRO_BATCHES = ("diffusion", "xray2ct")


def test_a_step_that_runs_out_of_memory_is_redone_in_smaller_micro_batches(bundle, tmp_path):
    """The trainer's network holds one sample per forward (two with BatchNorm, its smallest micro-batch): the first
    iteration runs out of memory, is redone in micro-batches of that size and completes; where micro-batches give
    the same update, its losses and gradients are the un-failed iteration's (up to the summation order)."""
    name, settings = bundle
    if settings.get("survival_head") == "cox":
        pytest.skip("the Cox loss couples the batch: no micro-batches (tests/test_engines_trainer.py checks the error)")
    kind = describe(name).family
    whole = {"micro_batch_size": None} if kind == "vqgan" else {}
    fits = 2 if kind == "survival" else 1  # BatchNorm: at least 2 samples per micro-batch
    losses, grads, trainer = _first_step(bundle, tmp_path / "limited", fits=fits, **whole)
    assert trainer.micro_batch_size == fits  # from the whole batch (None), halved until it fits
    assert losses and all(math.isfinite(v) for v in losses.values())
    if kind in SAME_UPDATE_IN_MICRO_BATCHES:
        expected, expected_grads, _ = _first_step(bundle, tmp_path / "whole")
        assert losses == pytest.approx(expected, rel=1e-5, abs=1e-7)
        scale = max(float(g.abs().max()) for g in expected_grads)
        for a, b in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Weight EMA handler: closed-form averages, torch's AveragedModel as reference, update cadence, warm start and
checkpoint round trip."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from common.handlers.ema import WeightEMA, warmup_decay


def _run(ema: WeightEMA, net: nn.Module, iterations: int, values: list[float]) -> None:
    def step(engine, _):
        with torch.no_grad():
            net.weight.fill_(values[engine.state.iteration - 1])

    engine = Engine(step)
    ema.attach(engine)
    engine.run(range(iterations), max_epochs=1)


def test_ema_matches_closed_form():
    net = nn.Linear(1, 1, bias=False)
    ema = WeightEMA(net, decay=0.9)
    values = [1.0, 2.0, 3.0, 4.0]
    _run(ema, net, 4, values)
    expected = values[0]  # the first update copies
    for v in values[1:]:
        expected = 0.9 * expected + 0.1 * v
    assert ema.module.weight.item() == pytest.approx(expected)
    assert net.weight.item() == 4.0  # the trained network is untouched
    assert int(ema.averaged.n_averaged) == 4


@pytest.mark.parametrize("use_buffers", [True, False])
@pytest.mark.parametrize("warmup", [False, True])
def test_update_equals_torchs_averaged_model(use_buffers, warmup):
    """Same weights and buffers (float and integer: BatchNorm's running stats and batch count) as
    ``AveragedModel.update_parameters`` with ``get_ema_multi_avg_fn``, update after update; the count stays on the
    host."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv3d(1, 2, 3), nn.BatchNorm3d(2), nn.Conv3d(2, 1, 1).double())

    def avg_fn(ema_params, current, n):  # the reference reads the count from its own (CPU) tensor
        get_ema_multi_avg_fn(warmup_decay(0.8, int(n)) if warmup else 0.8)(ema_params, current, n)

    reference = AveragedModel(net, multi_avg_fn=avg_fn, use_buffers=use_buffers)
    ema = WeightEMA(net, decay=0.8, use_buffers=use_buffers, warmup=warmup)
    for _ in range(4):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        net[1].train()
        net[:2](torch.randn(2, 1, 5, 5, 5))  # moves the BatchNorm statistics
        reference.update_parameters(net)
        ema.update()
        for (name, mine), theirs in zip(ema.module.state_dict().items(), reference.module.state_dict().values()):
            assert mine.dtype == theirs.dtype, name
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
    assert int(ema.averaged.n_averaged) == 4 and ema.averaged.n_averaged.device.type == "cpu"


def test_update_cadence_and_start():
    net = nn.Linear(1, 1, bias=False)
    ema = WeightEMA(net, decay=0.5, update_every=2, start_iteration=4)
    _run(ema, net, 6, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    # iteration 2 copies (before start); 4 is the first average (a copy: n_averaged was 0); 6 averages
    assert ema.module.weight.item() == pytest.approx(0.5 * 4.0 + 0.5 * 6.0)
    assert int(ema.averaged.n_averaged) == 2


def test_state_dict_round_trip_continues_the_average():
    net = nn.Linear(2, 1)
    ema = WeightEMA(net, decay=0.9)
    _run(ema, net, 3, [1.0, 2.0, 3.0])
    restored = WeightEMA(nn.Linear(2, 1), decay=0.9)
    restored.averaged.load_state_dict(ema.averaged.state_dict())
    for a, b in zip(ema.module.parameters(), restored.module.parameters()):
        assert torch.equal(a, b)
    assert int(restored.averaged.n_averaged) == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="decay"):
        WeightEMA(nn.Linear(1, 1), decay=1.0)
    with pytest.raises(ValueError, match="update_every"):
        WeightEMA(nn.Linear(1, 1), update_every=0)


def _warmup_closed_form(values: list[float], decay: float) -> float:
    expected = values[0]  # the first update copies
    for n, v in enumerate(values[1:], start=1):  # n: the number of earlier updates
        d = min(decay, (1.0 + n) / (10.0 + n))
        expected = d * expected + (1.0 - d) * v
    return expected


def test_warmup_matches_closed_form():
    # decay 0.3: updates 1 and 2 use the warm-up decays 2/11 and 3/12, from update 3 on (4/13 > 0.3) the decay
    values = [1.0, 5.0, -2.0, 4.0, 10.0, 3.0]
    net = nn.Linear(1, 1, bias=False)
    ema = WeightEMA(net, decay=0.3, warmup=True)
    _run(ema, net, len(values), values)
    expected = _warmup_closed_form(values, 0.3)
    assert ema.module.weight.item() == pytest.approx(expected, rel=1e-6)
    assert int(ema.averaged.n_averaged) == len(values)
    # without warm-up the plain decay gives another value
    plain = WeightEMA(nn.Linear(1, 1, bias=False), decay=0.3)
    _run(plain, plain.network, len(values), values)
    assert plain.module.weight.item() != pytest.approx(expected, rel=1e-3)


def test_warmup_uses_the_warmup_decay_below_the_cap():
    values = [2.0, 8.0]
    net = nn.Linear(1, 1, bias=False)
    ema = WeightEMA(net, decay=0.99, warmup=True)
    _run(ema, net, 2, values)
    assert ema.module.weight.item() == pytest.approx(2.0 / 11.0 * 2.0 + 9.0 / 11.0 * 8.0, rel=1e-6)


def test_warmup_checkpoint_round_trip_continues_the_schedule(tmp_path):
    # decay 0.6: the resumed updates 3, 4, 5 still use the warm-up decays 4/13, 5/14, 6/15
    values = [1.0, 5.0, -2.0, 4.0, 10.0, 3.0]
    net = nn.Linear(1, 1, bias=False)
    ema = WeightEMA(net, decay=0.6, warmup=True)
    _run(ema, net, 3, values[:3])
    torch.save(ema.averaged.state_dict(), tmp_path / "ema.pt")

    resumed_net = nn.Linear(1, 1, bias=False)
    resumed = WeightEMA(resumed_net, decay=0.6, warmup=True)
    resumed.averaged.load_state_dict(torch.load(tmp_path / "ema.pt", weights_only=True))
    assert int(resumed.averaged.n_averaged) == 3
    _run(resumed, resumed_net, 3, values[3:])  # a new engine: its iterations restart at 1
    assert resumed.module.weight.item() == pytest.approx(_warmup_closed_form(values, 0.6), rel=1e-6)

    uninterrupted_net = nn.Linear(1, 1, bias=False)
    uninterrupted = WeightEMA(uninterrupted_net, decay=0.6, warmup=True)
    _run(uninterrupted, uninterrupted_net, len(values), values)
    assert resumed.module.weight.item() == pytest.approx(uninterrupted.module.weight.item(), rel=1e-6)


def test_handler_state_dict_is_flat_and_resumes_the_average():
    """What the bundles checkpoint: the averaged weights under the network's own keys plus ``n_averaged``."""
    net = nn.Linear(2, 1)
    ema = WeightEMA(net, decay=0.9)
    _run(ema, net, 3, [1.0, 2.0, 3.0])
    state = ema.state_dict()
    assert set(state) == {"n_averaged", "weight", "bias"} and int(state["n_averaged"]) == 3
    net2 = nn.Linear(2, 1)
    net2.load_state_dict(net.state_dict())  # the resumed run's network: the trained weights
    restored = WeightEMA(net2, decay=0.9)
    restored.load_state_dict({f"module.{k}" if k != "n_averaged" else k: v for k, v in state.items()})
    assert torch.equal(restored.module.weight, ema.module.weight) and int(restored.averaged.n_averaged) == 3
    _run(restored, net2, 1, [4.0])
    _run(ema, net, 1, [4.0])
    assert torch.equal(restored.module.weight, ema.module.weight)
    with pytest.raises(KeyError, match="n_averaged"):
        restored.load_state_dict({"weight": state["weight"], "bias": state["bias"]})

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Weight EMA handler: closed-form averages, update cadence, warm start and checkpoint round trip."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine
from torch import nn

from common.handlers.ema import WeightEMA


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

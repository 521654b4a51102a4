# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The survival evaluation handlers on cohorts whose risk groups the test chooses: a "network" whose log-hazard is
the mean of its input puts every case exactly where the test wants it, so an empty risk group, a single non-empty
group and a risk on a group threshold are decided by the data, not by what a trained model happens to learn."""

from __future__ import annotations

import csv
import json
import logging
import math

import numpy as np
import pytest
import torch
from ignite.engine import Engine
from lifelines.statistics import multivariate_logrank_test
from matplotlib.figure import Figure

from common.survival.handlers import (
    SurvivalMetricsHandler,
    SurvivalReport,
    describe_risk_groups,
    draw_km_by_group,
    risk_group_table,
)
from common.survival.metrics import km_by_group
from common.survival.networks import SurvivalPredictor

HORIZONS = [1.0, 2.0]
LABELS = ["low", "intermediate", "high"]
TRAIN_TIME = torch.linspace(0.5, 4.0, 12, dtype=torch.float64)
TRAIN_EVENT = torch.tensor([1.0, 0.0] * 6, dtype=torch.float64)


class _MeanRisk(torch.nn.Module):
    """A Cox "network" whose log-hazard is the mean of its input image."""

    num_outputs = 1

    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None = None) -> torch.Tensor:
        return image.mean(dim=(1, 2, 3, 4)).unsqueeze(1)


def _predictor() -> SurvivalPredictor:
    """Calibrated on training log-hazards 0..3: the group thresholds are their tertiles (about 1 and 2)."""
    predictor = SurvivalPredictor(_MeanRisk(), "cox", HORIZONS, grid_size=16)
    predictor.calibrate(torch.linspace(0.0, 3.0, 12), TRAIN_TIME, TRAIN_EVENT)
    return predictor


def _evaluate(tmp_path, predictor, risks, times=None, events=None, plots=True) -> Engine:
    """Run the metrics handler and the report over one case per iteration with the given risks (and outcomes)."""
    n = len(risks)
    times = [math.nan] * n if times is None else times
    events = [math.nan] * n if events is None else events
    batches = []
    for i, risk in enumerate(risks):
        image = torch.full((1, 1, 2, 2, 2), float(risk), dtype=torch.float32)
        out = predictor.predict(image)
        batches.append(
            {
                "case_id": [f"case{i}"],
                "risk_score": out["risk_score"],
                "time": torch.tensor([times[i]], dtype=torch.float64),
                "event": torch.tensor([events[i]], dtype=torch.float64),
                "survival": out["survival"],
            }
        )
    engine = Engine(lambda engine, batch: batch)
    SurvivalMetricsHandler(predictor, train_time=TRAIN_TIME.numpy(), train_event=TRAIN_EVENT.numpy()).attach(engine)
    SurvivalReport(tmp_path, plots=plots).attach(engine)
    engine.run(batches, max_epochs=1)
    return engine


def _rows(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_an_empty_high_risk_group_is_reported_everywhere(tmp_path, caplog):
    """No case reaches the high-risk tertile: every output lists it with n = 0 and says it is empty; the log-rank
    test compares the two groups that have cases (lifelines on those cases is the reference)."""
    risks = [0.1, 0.4, 0.7, 1.2, 1.5, 1.8]  # thresholds about 1 and 2: three low, three intermediate, no high
    times = [0.6, 1.1, 1.6, 2.1, 2.6, 3.1]
    events = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    with caplog.at_level(logging.INFO, logger="common.survival.handlers"):
        _evaluate(tmp_path, _predictor(), risks, times, events)

    report = json.loads((tmp_path / "report.json").read_text())
    km = report["km"]
    assert [label for label in km if label in LABELS] == LABELS
    assert km["high"] == {"times": [], "survival": [], "n": 0, "events": 0, "note": "empty: no case is in high"}
    assert (km["low"]["n"], km["intermediate"]["n"]) == (3, 3)
    assert km["logrank_groups"] == ["low", "intermediate"] and km["empty_groups"] == ["high"]
    assert km["logrank_note"] == "log-rank test over low and intermediate; high is empty"
    reference = multivariate_logrank_test(np.array(times), ["low"] * 3 + ["intermediate"] * 3, np.array(events))
    assert report["logrank_p"] == pytest.approx(reference.p_value, rel=1e-9)
    assert km["logrank_statistic"] == pytest.approx(reference.test_statistic, rel=1e-9)

    groups = _rows(tmp_path / "risk_groups.csv")
    assert [(r["risk_group"], r["cases"], r["events"]) for r in groups] == [
        ("low", "3", "2"),
        ("intermediate", "3", "2"),
        ("high", "0", "0"),
    ]
    assert groups[0]["risk_score_from"] == "-inf" and groups[2]["risk_score_to"] == "inf"
    assert groups[2]["note"] == "empty: no case is in high" and groups[0]["note"] == ""
    assert {r["risk_group"] for r in _rows(tmp_path / "predictions.csv")} == {"low", "intermediate"}
    assert (tmp_path / "km_by_risk_group.png").read_bytes()[:4] == b"\x89PNG"
    line = next(r.message for r in caplog.records if r.message.startswith("risk groups:"))
    assert line == (
        "risk groups: low 3 case(s), 2 event(s); intermediate 3 case(s), 2 event(s); high 0 case(s), 0 event(s) "
        f"(empty); log-rank test over low and intermediate; high is empty: p = {reference.p_value:.3g}"
    )


def test_a_single_non_empty_group_makes_the_log_rank_test_not_computable(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="common.survival.handlers"):
        engine = _evaluate(tmp_path, _predictor(), [0.1, 0.3, 0.5, 0.7], [0.8, 1.4, 2.2, 3.0], [1.0, 0.0, 1.0, 0.0])
    assert math.isnan(engine.state.metrics["logrank_p"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["logrank_p"] is None and report["km"]["logrank_statistic"] is None
    note = "log-rank test not computable: only low has cases (intermediate and high are empty)"
    assert report["km"]["logrank_note"] == note
    assert [report["km"][g]["n"] for g in LABELS] == [4, 0, 0]
    assert [r["cases"] for r in _rows(tmp_path / "risk_groups.csv")] == ["4", "0", "0"]
    assert any(r.message.endswith(f"; {note}") for r in caplog.records)


def test_a_risk_on_a_threshold_is_in_the_same_group_in_every_output(tmp_path):
    """A risk equal to a group threshold goes to the higher group, in the per-case CSV and in the report alike."""
    predictor = _predictor()
    low_high, intermediate_high = predictor.group_thresholds.tolist()
    risks = [0.2, low_high, intermediate_high, 2.5]
    _evaluate(tmp_path, predictor, risks, [0.8, 1.4, 2.2, 3.0], [1.0, 1.0, 0.0, 1.0])
    assert [r["risk_group"] for r in _rows(tmp_path / "predictions.csv")] == ["low", "intermediate", "high", "high"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [report["km"][g]["n"] for g in LABELS] == [1, 1, 2]


def test_inference_without_outcomes_lists_every_group(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="common.survival.handlers"):
        _evaluate(tmp_path, _predictor(), [2.2, 2.9, 0.3])
    assert not (tmp_path / "report.json").exists()
    groups = _rows(tmp_path / "risk_groups.csv")
    assert list(groups[0]) == ["risk_group", "risk_score_from", "risk_score_to", "cases", "note"]
    assert [(r["risk_group"], r["cases"], r["note"]) for r in groups] == [
        ("low", "1", ""),
        ("intermediate", "0", "empty: no case is in intermediate"),
        ("high", "2", ""),
    ]
    assert any(
        r.message == "risk groups: low 1 case(s); intermediate 0 case(s) (empty); high 2 case(s)"
        for r in caplog.records
    )


def test_risk_group_table_and_description():
    predictions = {"risk_group": ["low", "low"], "time": [1.0, 2.0], "event": [1.0, 0.0]}
    rows = risk_group_table(predictions, LABELS, [0.5, 1.5])
    assert rows[1] == {
        "risk_group": "intermediate",
        "risk_score_from": 0.5,
        "risk_score_to": 1.5,
        "cases": 0,
        "events": 0,
        "note": "empty: no case is in intermediate",
    }
    km = km_by_group(predictions["risk_group"], predictions["time"], predictions["event"], labels=LABELS)
    assert describe_risk_groups(rows, km).endswith(
        "; log-rank test not computable: only low has cases (intermediate and high are empty)"
    )
    with pytest.raises(ValueError, match="3 risk groups .* need 2 thresholds"):
        risk_group_table(predictions, LABELS, [0.5])


def test_draw_km_by_group_names_empty_groups_without_a_curve():
    km = km_by_group(["low", "low", "high", "high"], [1.0, 2.0, 1.5, 3.0], [1, 0, 1, 1], labels=LABELS)
    ax = Figure().subplots()
    draw_km_by_group(ax, km, LABELS)
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == ["low (n=2, 1 event(s))", "intermediate (n=0: empty)", "high (n=2, 2 event(s))"]
    assert [len(line.get_xdata()) for line in ax.get_lines()] == [3, 0, 3]
    assert ax.get_title() == f"Kaplan-Meier by risk group (log-rank p = {km['logrank_p']:.3g})"
    single = km_by_group(["low"] * 3, [1.0, 2.0, 3.0], [1, 0, 1], labels=LABELS)
    ax = Figure().subplots()
    draw_km_by_group(ax, single, LABELS)
    assert ax.get_title() == "Kaplan-Meier by risk group (log-rank: not computable)"

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Survival metrics against scikit-survival and lifelines on generated cohorts with tied times, tied risks and
30-60% censoring; the Noether interval against R survcomp's algorithm and the spread of C over cohorts;
calibration on a perfectly calibrated model; and the 2-process gather of per-case predictions."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lifelines import KaplanMeierFitter
from lifelines.utils import concordance_index
from sksurv.compare import compare_survival
from sksurv.metrics import (
    brier_score,
    concordance_index_censored,
    concordance_index_ipcw,
    cumulative_dynamic_auc,
    integrated_brier_score,
)
from sksurv.nonparametric import kaplan_meier_estimator
from sksurv.util import Surv

from common.survival.metrics import (
    SurvivalPredictionCollector,
    brier_scores,
    calibration_table,
    check_horizons,
    harrell_c,
    kaplan_meier_at,
    km_by_group,
    risk_groups,
    survival_metrics,
    time_dependent_auc,
    uno_c,
)
from common.survival.metrics import integrated_brier_score as our_ibs
from tests.helpers import shifted_seed

torch.set_num_threads(1)

SEEDS = (0, 1, 2)
HORIZONS = (1.0, 3.0, 5.0)
# torchsurv's Kaplan-Meier is float32: about 2 roundings of 2**-24 (the ratio and the running product) per distinct
# time, and the generated times are whole months of at most 10 years (120 distinct); the IPCW values carry the
# relative error of the Kaplan-Meier weights. (Observed differences stay below 2e-7.)
RTOL = 2 * 120 * 2.0**-24


# ---------------------------------------------------------------------------------------------- cohorts
def _cohort(seed: int, n: int = 150, max_censor: float = 8.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(risk, time, event)``: exponential event times from a proportional-hazards model, uniform censoring.

    Times are rounded up to whole months (many ties, and events exactly at the 1/3/5-year horizons, which are
    exact in float64: 12/12, 36/12, 60/12: the first cases have their event half a month before each horizon
    below ``max_censor``, observed before censoring); risks are rounded to 0.1 (ties).
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n)
    event_time = rng.exponential(1.0 / (0.2 * np.exp(0.8 * x)))
    censor_time = rng.uniform(0.5, max_censor, size=n)
    for k, h in enumerate(h for h in HORIZONS if h < max_censor):
        event_time[k], censor_time[k] = h - 1.0 / 24.0, max(censor_time[k], h)
    time = np.ceil(np.minimum(event_time, censor_time) * 12.0) / 12.0
    event = (event_time <= censor_time).astype(np.float64)
    risk = np.round(x + rng.normal(scale=0.7, size=n), 1)
    return risk, time, event


def _surv(time: np.ndarray, event: np.ndarray) -> np.ndarray:
    return Surv.from_arrays(event.astype(bool), time)


def _model_surv(risk: np.ndarray, times: np.ndarray) -> np.ndarray:
    """A (cases x times) survival prediction decreasing in time and in risk."""
    return np.exp(-0.15 * np.outer(np.exp(0.8 * risk), np.asarray(times)))


def _train_cohort(seed: int, test_time: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A training cohort whose follow-up outlasts the test cohort's (scikit-survival needs it)."""
    _, time, event = _cohort(seed + 100, n=200, max_censor=10.0)
    assert time.max() > test_time.max()
    return time, event


@pytest.mark.parametrize("seed", SEEDS)
def test_generated_cohorts_have_ties_and_censoring(seed):
    risk, time, event = _cohort(seed)
    assert 0.3 <= 1.0 - event.mean() <= 0.6
    assert np.unique(time).size < time.size and np.unique(risk).size < risk.size
    assert all(np.any((time == h) & (event == 1)) for h in HORIZONS)  # events exactly at every horizon


# ---------------------------------------------------------------------------------------------- Harrell's C
@pytest.mark.parametrize("seed", SEEDS)
def test_harrell_c_equals_sksurv_and_lifelines(seed):
    risk, time, event = _cohort(seed)
    result = harrell_c(torch.as_tensor(risk), torch.as_tensor(time), torch.as_tensor(event))
    expected = concordance_index_censored(event.astype(bool), time, risk)[0]
    assert result["c"] == pytest.approx(expected, rel=1e-12)
    assert result["c"] == pytest.approx(concordance_index(time, -risk, event), rel=1e-12)
    assert result["lo"] < result["c"] < result["hi"]


def test_harrell_c_keeps_times_that_float32_would_merge():
    # torchsurv casts times to float32, where 1.0 and 1.0 + 1e-9 are equal (it then gives 0.714)
    time = np.array([1.0, 1.0 + 1e-9, 2.0, 3.0, 4.0])
    event = np.array([1.0, 1.0, 0.0, 1.0, 0.0])
    risk = np.array([1.0, 2.0, 3.0, 0.5, 0.0])
    assert harrell_c(risk, time, event)["c"] == pytest.approx(
        concordance_index_censored(event.astype(bool), time, risk)[0], rel=1e-12
    )
    assert harrell_c(risk, time, event)["c"] == pytest.approx(0.625)


def test_perfect_and_reversed_order():
    rng = np.random.default_rng(3)
    time = rng.permutation(np.arange(1.0, 41.0)) / 4.0
    event = (rng.random(40) < 0.6).astype(float)
    event[np.argmin(time)] = 1.0
    perfect = harrell_c(-time, time, event)
    assert perfect == {"c": 1.0, "lo": 1.0, "hi": 1.0}  # Noether's standard error is 0: the interval collapses
    assert harrell_c(time, time, event)["c"] == 0.0
    assert uno_c(-time, time, event)["c"] == pytest.approx(1.0)
    assert uno_c(time, time, event)["c"] == pytest.approx(0.0)


def _survcomp_noether_se(risk, time, event):
    """R survcomp's ``concordance.index(method="noether")`` loop (src/concordance.index.c), transcribed."""
    n = time.size
    ch, dh = np.zeros(n), np.zeros(n)
    for h in range(n):
        for j in range(n):
            if time[h] < time[j] and event[h] == 1:
                ch[h] += risk[h] > risk[j]
                dh[h] += risk[h] < risk[j]
            if time[h] > time[j] and event[j] == 1:
                ch[h] += risk[h] < risk[j]
                dh[h] += risk[h] > risk[j]
    pc, pd = ch.sum() / (n * (n - 1)), dh.sum() / (n * (n - 1))
    triple = n * (n - 1) * (n - 2)
    pcc, pdd, pcd = (ch * (ch - 1)).sum() / triple, (dh * (dh - 1)).sum() / triple, (ch * dh).sum() / triple
    var = (4 / (pc + pd) ** 4) * (pd**2 * pcc - 2 * pc * pd * pcd + pc**2 * pdd)
    return pc / (pc + pd), math.sqrt(var / n)


def test_harrell_interval_equals_survcomp_noether():
    rng = np.random.default_rng(7)  # continuous times and risks: no ties, where survcomp's pairs equal ours
    time, risk = rng.exponential(2.0, 60), rng.normal(size=60)
    event = (rng.random(60) < 0.6).astype(float)
    c, se = _survcomp_noether_se(risk, time, event)
    result = harrell_c(risk, time, event, alpha=0.05)
    assert result["c"] == pytest.approx(c, rel=1e-12)
    assert result["lo"] == pytest.approx(c - 1.959963984540054 * se, rel=1e-9)
    assert result["hi"] == pytest.approx(c + 1.959963984540054 * se, rel=1e-9)


def test_noether_standard_error_matches_spread_over_cohorts():
    """Over 300 cohorts from one model, the mean standard error is close to the standard deviation of C (torchsurv's
    own Noether interval gave about 1.8x). The ratio was 0.96 (Harrell) and 1.02 (Uno) on average over seeds; a
    standard deviation from 300 cohorts is within 1/sqrt(2 * 299) = 4.1% (one standard error) of its value, so
    the bounds are more than 5 standard errors away."""
    z = 1.959963984540054
    values = {"harrell": [], "uno": []}
    errors = {"harrell": [], "uno": []}
    rng = np.random.default_rng(shifted_seed(11))
    for _ in range(300):
        x = rng.normal(size=100)
        event_time, censor_time = rng.exponential(np.exp(-x)), rng.exponential(1.5, 100)
        time, event = np.minimum(event_time, censor_time), (event_time <= censor_time).astype(float)
        risk = x + rng.normal(size=100)
        for name, result in (("harrell", harrell_c(risk, time, event)), ("uno", uno_c(risk, time, event))):
            values[name].append(result["c"])
            errors[name].append((result["hi"] - result["lo"]) / (2 * z))
    for name in values:
        ratio = np.mean(errors[name]) / np.std(values[name])
        assert 0.75 < ratio < 1.3, (name, ratio)


def test_interval_brackets_the_estimate_and_narrows_with_more_cases():
    small, large = _cohort(5, n=100), _cohort(5, n=1000)
    for fn in (harrell_c, uno_c):
        a, b = fn(*small), fn(*large)
        assert a["lo"] < a["c"] < a["hi"] and b["lo"] < b["c"] < b["hi"]
        assert (b["hi"] - b["lo"]) < 0.5 * (a["hi"] - a["lo"])  # ~ 1 / sqrt(10)
        wide, narrow = fn(*small, alpha=0.05), fn(*small, alpha=0.2)
        assert narrow["c"] == wide["c"] and wide["lo"] < narrow["lo"] < narrow["hi"] < wide["hi"]


# ---------------------------------------------------------------------------------------------- Uno's C
def _uno_pairs(risk, time, event, weight_of_time):
    """Uno's C by brute force over pairs: weight ``weight_of_time(t_i) ** 2`` for an event at ``t_i``."""
    num = den = 0.0
    for i in np.flatnonzero(event == 1):
        w = weight_of_time(time[i]) ** 2
        for j in range(time.size):
            if time[j] > time[i] or (time[j] == time[i] and event[j] == 0):
                den += w
                num += w * (1.0 if risk[i] > risk[j] else 0.5 if risk[i] == risk[j] else 0.0)
    return num / den


@pytest.mark.parametrize("seed", SEEDS)
def test_uno_c_equals_sksurv(seed):
    risk, time, event = _cohort(seed)
    y = _surv(time, event)
    assert uno_c(risk, time, event)["c"] == pytest.approx(concordance_index_ipcw(y, y, risk)[0], rel=RTOL)
    tau = uno_c(risk, time, event, tau=3.0)
    assert tau["c"] == pytest.approx(concordance_index_ipcw(y, y, risk, tau=3.0)[0], rel=RTOL)
    assert tau["lo"] < tau["c"] < tau["hi"]
    train_time, train_event = _train_cohort(seed, time)
    ours = uno_c(risk, time, event, train_time=train_time, train_event=train_event)
    assert ours["c"] == pytest.approx(concordance_index_ipcw(_surv(train_time, train_event), y, risk)[0], rel=RTOL)


def test_uno_c_holds_the_censoring_survival_past_the_training_follow_up():
    risk, time, event = _cohort(0)
    train_time, train_event = _cohort(50, n=200, max_censor=3.0)[1:]  # follow-up ends before the test cohort's
    train_time[np.argmax(train_time)], train_event[np.argmax(train_time)] = train_time.max(), 1.0  # G > 0 at the end
    with pytest.raises(ValueError, match="largest observed time"):  # scikit-survival refuses these test times
        concordance_index_ipcw(_surv(train_time, train_event), _surv(time, event), risk)
    km = KaplanMeierFitter().fit(train_time, 1.0 - train_event)  # censoring distribution (lifelines)

    def inverse_g(t):
        return 1.0 / float(km.survival_function_at_times(min(t, train_time.max())).iloc[0])

    expected = _uno_pairs(risk, time, event, inverse_g)
    assert uno_c(risk, time, event, train_time, train_event)["c"] == pytest.approx(expected, rel=RTOL)


def test_uno_c_where_the_censoring_survival_is_zero():
    risk, time, event = _cohort(1)
    last = np.argmax(time)
    event[last] = 1.0
    time = np.append(time, time[last])  # a censored case tied with the last event: G is 0 there
    event, risk = np.append(event, 0.0), np.append(risk, 0.0)
    y = _surv(time, event)
    with pytest.raises(ValueError, match="censoring survival function is zero"):
        concordance_index_ipcw(y, y, risk)
    with pytest.raises(ValueError, match=rf"censoring survival function is 0 at the event time {time[last]:g}.*tau"):
        uno_c(risk, time, event)
    metrics = survival_metrics(risk, time, event)  # picks tau = that time
    assert metrics["uno_c_tau"] == time[last]
    assert metrics["uno_c"] == pytest.approx(concordance_index_ipcw(y, y, risk, tau=time[last])[0], rel=RTOL)


# ---------------------------------------------------------------------------------------------- AUC
@pytest.mark.parametrize("seed", SEEDS)
def test_time_dependent_auc_equals_sksurv(seed):
    risk, time, event = _cohort(seed)
    y = _surv(time, event)
    expected, expected_mean = cumulative_dynamic_auc(y, y, risk, HORIZONS)
    ours = time_dependent_auc(risk, time, event, HORIZONS)
    assert list(ours) == list(HORIZONS)
    np.testing.assert_allclose(list(ours.values()), expected, rtol=RTOL)
    assert survival_metrics(risk, time, event)["auc_mean"] == pytest.approx(expected_mean, rel=RTOL)
    # unsorted horizons and a 2-D time-dependent risk (1 - S(h)), weighted by a training cohort
    train_time, train_event = _train_cohort(seed, time)
    order = [2, 0, 1]
    risk_2d = 1.0 - _model_surv(risk, HORIZONS)
    expected, _ = cumulative_dynamic_auc(_surv(train_time, train_event), y, risk_2d, HORIZONS)
    ours = time_dependent_auc(
        torch.as_tensor(risk_2d[:, order]), time, event, [HORIZONS[k] for k in order], train_time, train_event
    )
    assert list(ours) == [HORIZONS[k] for k in order]
    np.testing.assert_allclose([ours[h] for h in HORIZONS], expected, rtol=RTOL)


def test_auc_counts_an_event_exactly_at_the_horizon():
    # torchsurv alone casts times to float32, where 0.1 > 0.1 (float64), drops the case at 0.1 and gives 1.0
    time = np.array([0.05, 0.1, 0.1, 0.3, 0.4, 0.6])
    event = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    risk = np.array([5.0, 1.5, 1.0, 3.0, 2.0, 0.0])
    y = _surv(time, event)
    expected = cumulative_dynamic_auc(y, y, risk, [0.1])[0][0]
    assert expected < 0.7
    assert time_dependent_auc(risk, time, event, [0.1])[0.1] == pytest.approx(expected, rel=RTOL)


def test_auc_without_cases_by_the_horizon_is_nan():
    time = np.array([0.5, 1.0, 2.0, 3.0, 4.0])
    event = np.array([0.0, 0.0, 1.0, 1.0, 0.0])
    assert math.isnan(time_dependent_auc(np.arange(5.0), time, event, [1.5])[1.5])


# ---------------------------------------------------------------------------------------------- Brier
@pytest.mark.parametrize("seed", SEEDS)
def test_brier_scores_and_ibs_equal_sksurv(seed):
    risk, time, event = _cohort(seed)
    y = _surv(time, event)
    surv = _model_surv(risk, HORIZONS)
    np.testing.assert_allclose(
        list(brier_scores(surv, time, event, HORIZONS).values()), brier_score(y, y, surv, HORIZONS)[1], rtol=RTOL
    )
    train_time, train_event = _train_cohort(seed, time)
    y_train = _surv(train_time, train_event)
    ours = brier_scores(torch.as_tensor(surv[:, ::-1].copy()), time, event, HORIZONS[::-1], train_time, train_event)
    np.testing.assert_allclose([ours[h] for h in HORIZONS], brier_score(y_train, y, surv, HORIZONS)[1], rtol=RTOL)
    grid = np.linspace(time.min(), 6.0, 25)
    surv_grid = _model_surv(risk, grid)
    assert our_ibs(surv_grid, grid, time, event) == pytest.approx(
        integrated_brier_score(y, y, surv_grid, grid), rel=RTOL
    )
    assert our_ibs(surv_grid, grid, time, event, train_time, train_event) == pytest.approx(
        integrated_brier_score(y_train, y, surv_grid, grid), rel=RTOL
    )


@pytest.mark.parametrize("seed", SEEDS[:1])
def test_kaplan_meier_reference_ibs_equals_sksurv(seed):
    """``ibs_km``: the training cohort's Kaplan-Meier curve predicted for everyone, scored like the model."""
    risk, time, event = _cohort(seed)
    train_time, train_event = _train_cohort(seed, time)
    grid = np.linspace(time.min(), 6.0, 25)
    at = np.concatenate([[0.0], grid, [train_time.max() + 1]])
    km_times, km_surv = kaplan_meier_estimator(train_event.astype(bool), train_time)
    reference = np.array([1.0 if t < km_times[0] else km_surv[np.searchsorted(km_times, t, "right") - 1] for t in at])
    np.testing.assert_allclose(kaplan_meier_at(train_time, train_event, at), reference, rtol=1e-6)
    metrics = survival_metrics(
        risk,
        time,
        event,
        horizons=(1, 3),
        surv_grid=_model_surv(risk, grid),
        grid=grid,
        train_time=train_time,
        train_event=train_event,
    )
    null = np.tile(reference[1:-1], (time.size, 1))
    y, y_train = _surv(time, event), _surv(train_time, train_event)
    assert metrics["ibs_km"] == pytest.approx(integrated_brier_score(y_train, y, null, grid), rel=RTOL)


def test_the_true_model_scores_better_than_the_kaplan_meier_reference():
    """The true survival minimises the expected Brier score at every time (a proper score), so its IBS is below the
    Kaplan-Meier reference's, which ignores the covariate. At 1000 cases the gap was 0.036 on average over seeds
    with a spread of 0.004 (0.018 and 0.009 at 150 cases)."""

    def cohort(seed: int, n: int, max_censor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        rate = 0.2 * np.exp(0.8 * rng.normal(size=n))
        event_time, censor_time = rng.exponential(1.0 / rate), rng.uniform(0.5, max_censor, size=n)
        return rate, np.minimum(event_time, censor_time), (event_time <= censor_time).astype(float)

    rate, time, event = cohort(shifted_seed(0), 1000, 8.0)
    _, train_time, train_event = cohort(shifted_seed(100), 2000, 10.0)
    grid = np.linspace(time.min(), 6.0, 25)
    metrics = survival_metrics(
        np.log(rate),
        time,
        event,
        horizons=(1, 3),
        surv_grid=np.exp(-np.outer(rate, grid)),  # S(t | x) = exp(-rate t)
        grid=grid,
        train_time=train_time,
        train_event=train_event,
    )
    assert metrics["ibs"] < metrics["ibs_km"]


def test_brier_of_a_perfect_prediction_without_censoring_is_zero():
    time = np.array([1.0, 2.0, 3.0, 4.0])
    event = np.ones(4)
    surv = (time[:, None] > np.array([[1.5, 2.5]])).astype(float)  # S(h) = 1 exactly when the event is after h
    assert brier_scores(surv, time, event, [1.5, 2.5]) == {1.5: 0.0, 2.5: 0.0}
    assert brier_scores(1.0 - surv, time, event, [1.5, 2.5]) == {1.5: 1.0, 2.5: 1.0}


# ---------------------------------------------------------------------------------------------- input errors
def test_horizons_at_or_beyond_follow_up_are_refused():
    risk, time, event = _cohort(0)
    last = time.max()
    for fn, args in (
        (time_dependent_auc, (risk, time, event)),
        (brier_scores, (_model_surv(risk, (1.0, last)), time, event)),
        (survival_metrics, (risk, time, event)),
    ):
        with pytest.raises(ValueError, match=rf"horizon {last:g} is at or beyond .* below {last:g}"):
            fn(*args, (1.0, last))
    train_time, train_event = _cohort(9, n=200, max_censor=4.0)[1:]
    with pytest.raises(ValueError, match=rf"horizon 5 .* of the training cohort.* below {train_time.max():g}"):
        survival_metrics(risk, time, event, horizons=(1, 5), train_time=train_time, train_event=train_event)
    with pytest.raises(ValueError, match="before the first follow-up time"):
        check_horizons([0.01], time)
    with pytest.raises(ValueError, match="grid time 0 is before"):
        our_ibs(_model_surv(risk, (0.0, 2.0)), [0.0, 2.0], time, event)


def test_cohort_without_events_is_refused():
    risk, time, _ = _cohort(0)
    for fn in (harrell_c, uno_c, survival_metrics):
        with pytest.raises(ValueError, match="has no events"):
            fn(risk, time, np.zeros_like(time))
    with pytest.raises(ValueError, match="training cohort has no events"):
        uno_c(risk, time, np.ones_like(time), train_time=time, train_event=np.zeros_like(time))


def test_malformed_input_is_named():
    risk, time, event = _cohort(0, n=20)
    with pytest.raises(ValueError, match=r"events must be 0 or 1, got \[2.0\]"):
        harrell_c(risk, time, np.where(event == 1, 2.0, 0.0))
    with pytest.raises(ValueError, match="times must be >= 0"):
        harrell_c(risk, -time, event)
    with pytest.raises(ValueError, match="risk has 19 rows but there are 20 cases"):
        harrell_c(risk[:-1], time, event)
    with pytest.raises(ValueError, match="non-finite"):
        harrell_c(np.where(np.arange(20) == 3, np.nan, risk), time, event)
    with pytest.raises(ValueError, match=r"surv must hold survival probabilities in \[0, 1\]"):
        brier_scores(np.full((20, 1), 1.5), time, event, [1.0])
    with pytest.raises(ValueError, match="horizons must not repeat"):
        time_dependent_auc(risk, time, event, [1.0, 1.0])


# ---------------------------------------------------------------------------------------------- KM and groups
def test_risk_groups_thresholds():
    groups = risk_groups([0.1, 0.49999, 0.5, 0.89999, 0.9, 2.0], [0.5, 0.9])
    # a risk equal to a threshold goes to the higher group, as in SurvivalPredictor.risk_group (checked against
    # the predictor in tests/test_survival_handlers.py)
    assert groups == ["low", "low", "intermediate", "intermediate", "high", "high"]
    assert risk_groups(torch.tensor([1.0, 3.0]), [2.0], labels=("a", "b")) == ["a", "b"]
    with pytest.raises(ValueError, match="2 thresholds need 3 labels"):
        risk_groups([1.0], [0.0, 1.0], labels=("a", "b"))
    with pytest.raises(ValueError, match="non-decreasing"):
        risk_groups([1.0], [1.0, 0.0])


@pytest.mark.parametrize("seed", SEEDS)
def test_km_by_group_equals_sksurv_and_lifelines(seed):
    risk, time, event = _cohort(seed)
    groups = risk_groups(risk, np.quantile(risk, [1 / 3, 2 / 3]))
    result = km_by_group(groups, time, event, labels=("low", "intermediate", "high"))
    assert list(result) == [
        "low",
        "intermediate",
        "high",
        "logrank_p",
        "logrank_statistic",
        "logrank_groups",
        "empty_groups",
        "logrank_note",
    ]
    assert result["logrank_groups"] == ["low", "intermediate", "high"] and result["empty_groups"] == []
    assert result["logrank_note"] == "log-rank test over low, intermediate and high"
    group_a = np.array(groups)
    for label in ("low", "intermediate", "high"):
        mask = group_a == label
        times, surv = kaplan_meier_estimator(event[mask].astype(bool), time[mask])
        curve = result[label]
        np.testing.assert_array_equal(curve["times"], times)
        np.testing.assert_allclose(curve["survival"], surv, rtol=RTOL)
        lifelines_km = KaplanMeierFitter().fit(time[mask], event[mask]).survival_function_at_times(times)
        np.testing.assert_allclose(curve["survival"], lifelines_km.to_numpy(), rtol=RTOL)
        assert np.all(np.diff(curve["survival"]) <= 0) and curve["survival"][0] <= 1.0
        assert curve["n"] == mask.sum() and curve["events"] == event[mask].sum()
    statistic, p_value = compare_survival(_surv(time, event), group_a)
    assert result["logrank_statistic"] == pytest.approx(statistic, rel=1e-9)
    assert result["logrank_p"] == pytest.approx(p_value, rel=1e-9)


def test_km_by_group_edge_cases():
    time = np.array([1.0, 2.0, 3.0, 4.0])
    one = km_by_group(["a"] * 4, time, [1, 0, 1, 0])
    assert math.isnan(one["logrank_p"]) and one["a"]["survival"] == pytest.approx([0.75, 0.75, 0.375, 0.375])
    assert one["logrank_note"] == "log-rank test not computable: only a has cases"
    no_events = km_by_group(["a", "a", "b", "b"], time, [0, 0, 0, 0])
    assert no_events["a"]["survival"] == [1.0, 1.0] and no_events["a"]["events"] == 0
    assert math.isnan(no_events["logrank_p"]) and math.isnan(no_events["logrank_statistic"])
    assert no_events["logrank_note"] == "log-rank test not computable: no event among these cases"
    with pytest.raises(ValueError, match=r"groups \['c'\] are not among labels"):
        km_by_group(["a", "a", "c", "c"], time, [1, 0, 1, 0], labels=("a", "b"))
    with pytest.raises(ValueError, match="clash"):
        km_by_group(["logrank_note"] * 4, time, [1, 0, 1, 0])


def test_km_by_group_lists_empty_groups_and_tests_the_others():
    """Every label is in the result; an empty group has n = 0, no curve and a note, and is left out of the test."""
    time = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    event = np.array([1, 0, 1, 1, 1, 0])
    groups = ["a", "a", "a", "c", "c", "c"]
    result = km_by_group(groups, time, event, labels=("a", "b", "c"))
    assert list(result)[:3] == ["a", "b", "c"]
    assert result["b"] == {"times": [], "survival": [], "n": 0, "events": 0, "note": "empty: no case is in b"}
    assert "note" not in result["a"] and result["a"]["n"] == 3
    assert result["logrank_groups"] == ["a", "c"] and result["empty_groups"] == ["b"]
    assert result["logrank_note"] == "log-rank test over a and c; b is empty"
    statistic, p_value = compare_survival(_surv(time, event), np.array(groups))
    assert result["logrank_statistic"] == pytest.approx(statistic, rel=1e-9)
    assert result["logrank_p"] == pytest.approx(p_value, rel=1e-9)
    single = km_by_group(["b"] * 6, time, event, labels=("a", "b", "c"))
    assert [single[g]["n"] for g in "abc"] == [0, 6, 0] and math.isnan(single["logrank_p"])
    assert single["logrank_note"] == "log-rank test not computable: only b has cases (a and c are empty)"
    assert km_by_group([], [], [], labels=("a",))["logrank_note"] == (
        "log-rank test not computable: no group has cases (a is empty)"
    )


# ---------------------------------------------------------------------------------------------- calibration
def _calibrated_cohort(n: int, horizon: float, seed: int = 0, scale: float = 1.0):
    """Exponential event times with known rates, censoring only after ``horizon``: ``P(T <= horizon)`` is known."""
    rng = np.random.default_rng(seed)
    rate = 0.05 * np.exp(rng.normal(size=n))
    event_time = rng.exponential(1.0 / rate)
    censor_time = rng.uniform(horizon + 0.5, 3 * horizon, size=n)
    time, event = np.minimum(event_time, censor_time), (event_time <= censor_time).astype(float)
    return scale * (1.0 - np.exp(-rate * horizon)), time, event


def _bernstein(variance: float, bound: float, delta: float) -> float:
    """``t`` with ``P(|sum_i a_i (X_i - p_i)| >= t) <= delta`` for independent Bernoulli(``p_i``) ``X_i``, by
    Bernstein's inequality: ``variance = sum a_i^2 p_i (1 - p_i)``, ``bound = max |a_i|``."""
    log_term = math.log(2.0 / delta)
    return bound * log_term / 3.0 + math.sqrt((bound * log_term / 3.0) ** 2 + 2.0 * variance * log_term)


def test_calibration_of_a_calibrated_model():
    """Nobody is censored before the horizon, so a bin's observed value is its fraction of events by then: a mean of
    independent Bernoulli(p_i) whose expectation is the bin's predicted value; the slope, linear in the observed
    values, has expectation 1. Each of these 11 values is checked against Bernstein's bound at 1e-6 / 11, so the
    test fails for fewer than 1e-6 of the seeds (whatever the draw)."""
    n, n_bins, horizon = 30000, 10, 3.0
    delta, float32_km = 1e-6 / (n_bins + 1), 1e-4  # the bins' Kaplan-Meier products are float32
    p_event, time, event = _calibrated_cohort(n, horizon=horizon, seed=shifted_seed(0))
    table = calibration_table(p_event, time, event, horizon=horizon, n_bins=n_bins)
    assert table["horizon"] == horizon and len(table["bins"]) == n_bins
    assert sum(b["n"] for b in table["bins"]) == n
    assert all(a["p_max"] <= b["p_min"] for a, b in zip(table["bins"], table["bins"][1:]))  # sorted, disjoint
    pred = np.array([b["predicted"] for b in table["bins"]])
    obs = np.array([b["observed"] for b in table["bins"]])
    bins = np.array_split(np.argsort(p_event, kind="stable"), n_bins)
    assert np.all(time[event == 0] > horizon)  # the premise: the observed values are event fractions
    bound = np.array([_bernstein(np.sum(p_event[i] * (1 - p_event[i])) / i.size**2, 1 / i.size, delta) for i in bins])
    bound += float32_km
    assert np.all(np.abs(obs - pred) <= bound), (obs - pred) / bound
    assert table["ici"] <= bound.mean()  # equal bins: the mean of the bins' absolute differences
    weight = (pred - pred.mean()) / np.sum((pred - pred.mean()) ** 2)  # slope = sum_b weight_b observed_b
    variance = sum(np.sum((w / i.size) ** 2 * p_event[i] * (1 - p_event[i])) for w, i in zip(weight, bins))
    slope_bound = _bernstein(variance, float(np.max(np.abs(weight) / [i.size for i in bins])), delta)
    assert abs(table["slope"] - 1.0) <= slope_bound + float32_km * np.sum(np.abs(weight)), table["slope"]
    # predictions too low by half: the same bins (halving keeps the order), half the predicted values, twice the
    # slope, and an ici of at least the mean over the bins of predicted / 2 minus the bound above
    half = calibration_table(0.5 * p_event, time, event, horizon=horizon)
    assert [b["observed"] for b in half["bins"]] == obs.tolist()
    np.testing.assert_allclose([b["predicted"] for b in half["bins"]], 0.5 * pred, rtol=1e-12)
    assert half["slope"] == pytest.approx(2.0 * table["slope"], rel=1e-9)
    assert half["ici"] >= np.mean(0.5 * pred - bound) > 0.05 and half["slope"] > 1.5


def test_calibration_observed_equals_lifelines_km():
    risk, time, event = _cohort(2, n=60)
    p_event = 1.0 - _model_surv(risk, [2.0])[:, 0]
    table = calibration_table(p_event, time, event, horizon=2.0, n_bins=4)
    order = np.argsort(p_event, kind="stable")
    for b, index in zip(table["bins"], np.array_split(order, 4)):
        km = KaplanMeierFitter().fit(time[index], event[index])
        assert b["observed"] == pytest.approx(1.0 - float(km.survival_function_at_times(2.0).iloc[0]), rel=RTOL)
        assert b["predicted"] == pytest.approx(p_event[index].mean())
        assert b["n"] == 15
    expected_ici = np.mean([abs(b["predicted"] - b["observed"]) for b in table["bins"]])
    assert table["ici"] == pytest.approx(expected_ici)


def test_calibration_bins_short_follow_up_and_few_cases():
    time = np.array([0.5, 1.0, 1.5, 6.0, 7.0])
    event = np.array([1.0, 1.0, 0.0, 1.0, 0.0])
    p_event = np.array([0.9, 0.8, 0.7, 0.2, 0.1])
    table = calibration_table(p_event, time, event, horizon=5.0, n_bins=10)
    assert [b["n"] for b in table["bins"]] == [1] * 5  # fewer cases than bins: one case per bin
    observed = [b["observed"] for b in table["bins"]]
    # KM held at its last value past a bin's follow-up: the case censored at 1.5 observes 0, the one with an
    # event at 0.5 observes 1 (its KM is 0 from 0.5 on); the event at 6 is after the horizon
    assert observed == [0.0, 0.0, 0.0, 1.0, 1.0]
    single = calibration_table(np.full(5, 0.3), time, event, horizon=1.0, n_bins=1)
    assert len(single["bins"]) == 1 and math.isnan(single["slope"])


# ---------------------------------------------------------------------------------------------- all at once
def test_survival_metrics_keys_and_values():
    risk, time, event = _cohort(1)
    train_time, train_event = _train_cohort(1, time)
    surv = _model_surv(risk, HORIZONS)
    grid = np.linspace(time.min(), 6.0, 13)
    out = survival_metrics(
        risk,
        time,
        event,
        surv_at_horizons=surv,
        surv_grid=_model_surv(risk, grid),
        grid=grid,
        train_time=train_time,
        train_event=train_event,
    )
    floats = {k for k, v in out.items() if isinstance(v, float)}
    expected = {
        "harrell_c",
        "harrell_c_lo",
        "harrell_c_hi",
        "uno_c",
        "uno_c_lo",
        "uno_c_hi",
        "auc_mean",
        "ibs",
        "ibs_km",
    }
    expected |= {f"{m}_{h:g}" for m in ("auc", "brier") for h in HORIZONS} | {"calibration_ici", "logrank_p"}
    assert floats == expected
    assert set(out) == expected | {"calibration", "km"}
    assert out["harrell_c"] == harrell_c(risk, time, event)["c"]
    assert out["uno_c"] == uno_c(risk, time, event, train_time, train_event)["c"]
    assert out["auc_3"] == time_dependent_auc(1.0 - surv, time, event, HORIZONS, train_time, train_event)[3.0]
    assert out["brier_5"] == brier_scores(surv, time, event, HORIZONS, train_time, train_event)[5.0]
    assert out["calibration"]["horizon"] == 3.0 and out["calibration_ici"] == out["calibration"]["ici"]
    assert sum(out["km"][g]["n"] for g in ("low", "intermediate", "high")) == risk.size
    assert out["logrank_p"] == out["km"]["logrank_p"]
    minimal = survival_metrics(risk, time, event, horizons=(2.0,), group_thresholds=[0.0, 1.0])
    assert "brier_2" not in minimal and "ibs" not in minimal and "calibration" not in minimal
    assert minimal["auc_mean"] == minimal["auc_2"]
    assert minimal["km"]["high"]["n"] == int(np.sum(risk >= 1.0))  # a risk on a threshold goes up
    given = survival_metrics(risk, time, event, horizons=(2.0,), groups=["high"] * risk.size)
    assert [given["km"][g]["n"] for g in ("low", "intermediate", "high")] == [0, 0, risk.size]
    assert math.isnan(given["logrank_p"]) and given["km"]["empty_groups"] == ["low", "intermediate"]
    with pytest.raises(ValueError, match="surv_at_horizons has 3 columns but there are 1 horizons"):
        survival_metrics(risk, time, event, horizons=(2.0,), surv_at_horizons=surv)
    with pytest.raises(ValueError, match="calibration_horizon 2 is not one of the horizons"):
        survival_metrics(risk, time, event, surv_at_horizons=surv, calibration_horizon=2.0)


# ---------------------------------------------------------------------------------------------- collector
def test_collector_local_gather_sorts_and_deduplicates():
    collector = SurvivalPredictionCollector()
    collector.add(
        ["c", "a"], torch.tensor([0.3, 0.1]), [2.0, 1.0], torch.tensor([1, 0]), surv_at_horizons=[[0.9], [0.8]]
    )
    collector.add(
        ["b", "a"], np.array([0.2, 0.1 + 1e-9]), [1.5, 1.0], [0, 0], surv_at_horizons=np.array([[0.7], [0.8]])
    )
    out = collector.gather()
    assert out["case_id"].tolist() == ["a", "b", "c"]
    np.testing.assert_allclose(out["risk"], [0.1, 0.2, 0.3])
    assert out["time"].tolist() == [1.0, 1.5, 2.0] and out["event"].tolist() == [0.0, 0.0, 1.0]
    assert out["surv_at_horizons"].shape == (3, 1) and "surv_grid" not in out
    collector.add(["a"], [0.5], [1.0], [0], surv_at_horizons=[[0.8]])
    with pytest.raises(ValueError, match="case 'a' was collected twice with different risk"):
        collector.gather()
    with pytest.raises(ValueError, match="surv_at_horizons must be given in every batch or in none"):
        collector.add(["d"], [0.5], [1.0], [0])
    with pytest.raises(ValueError, match=r"risk has shape \(1,\) but the batch has 2 case ids"):
        collector.add(["d", "e"], [0.5], [1.0, 2.0], [0, 1], surv_at_horizons=[[0.1], [0.2]])
    collector.reset()
    collector.add([], [], [], [])
    assert len(collector) == 0 and collector.gather()["case_id"].size == 0
    nan = float("nan")  # inference: no outcomes; a repeated case still counts once
    collector.add(["x", "y", "x"], [0.2, 0.1, 0.2], [nan] * 3, [nan] * 3)
    out = collector.gather()
    assert out["case_id"].tolist() == ["x", "y"] and np.isnan(out["time"]).all()


def _gather_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    """One rank of the 2-process gloo gather: rank 0 holds cases 0-4, rank 1 cases 3-7 (3 and 4 on both)."""
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        ids = [f"case{k}" for k in range(rank * 3, rank * 3 + 5)]
        index = torch.arange(rank * 3, rank * 3 + 5, dtype=torch.float64)
        collector = SurvivalPredictionCollector()
        collector.add(ids[:2], index[:2] / 10, index[:2] + 1, index[:2] % 2, surv_grid=torch.ones(2, 3) * 0.5)
        collector.add(ids[2:], index[2:] / 10, index[2:] + 1, index[2:] % 2, surv_grid=torch.ones(3, 3) * 0.5)
        result = collector.gather()
        if rank == 1:  # now a repeated case disagrees between the ranks
            collector.add(["case0"], [9.0], [1.0], [0], surv_grid=[[0.5, 0.5, 0.5]])
        try:
            collector.gather()
            error = ""
        except ValueError as exc:
            error = str(exc)
        np.savez(Path(out_dir) / f"rank{rank}.npz", error=np.array(error), **result)
    finally:
        dist.destroy_process_group()


def test_collector_distributed_gather_returns_each_case_once(tmp_path):
    # fork: the ranks start from this process's imports (spawn re-imports torchsurv, sksurv and lifelines: ~10 s)
    args = (2, str(tmp_path / "store"), str(tmp_path))
    mp.start_processes(_gather_worker, args=args, nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        out = np.load(tmp_path / f"rank{rank}.npz")
        assert out["case_id"].tolist() == [f"case{k}" for k in range(8)]
        np.testing.assert_allclose(out["risk"], np.arange(8) / 10)
        np.testing.assert_array_equal(out["time"], np.arange(8) + 1.0)
        np.testing.assert_array_equal(out["event"], np.arange(8) % 2)
        assert out["surv_grid"].shape == (8, 3)
        assert re.search(r"case 'case0' was collected twice with different risk.*rank 1", str(out["error"]))

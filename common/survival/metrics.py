# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Evaluation metrics of survival models: Harrell's and Uno's C-index with confidence intervals, cumulative/dynamic
time-dependent AUC, Brier score and integrated Brier score (IPCW), calibration by risk bin, Kaplan-Meier curves by
risk group with the log-rank test, and a collector that gathers per-case predictions from all ranks.

The values are torchsurv's (``ConcordanceIndex``, ``Auc``, ``BrierScore``, ``get_ipcw``, ``KaplanMeierEstimator``)
and lifelines' (``multivariate_logrank_test``), fed so that they equal scikit-survival's definitions
(``concordance_index_censored``, ``concordance_index_ipcw``, ``cumulative_dynamic_auc``, ``brier_score``,
``integrated_brier_score``); tests/test_survival_metrics.py checks every value against scikit-survival and
lifelines. Conventions (all of them scikit-survival's):

* Times and horizons are in years; ``risk`` is higher for more risk; ``event`` is 1 (event) or 0 (censored).
* Comparable pairs (C-index): an event at ``t_i`` is compared with every case whose time is later, and with the
  cases censored at the same time ``t_i`` (an event tied with another event is not comparable). Risks within
  ``1e-8`` of each other count as a tie (1/2 concordant).
* Uno's truncation ``tau``: only events with ``time < tau`` are weighted (they are compared with all later cases).
* IPCW: the censoring survival function ``G`` is the Kaplan-Meier estimate of the censoring times of the training
  cohort when one is given (``train_time``/``train_event``), else of the evaluated cohort. It is evaluated *at*
  ``t`` (the right-continuous step value, so a censoring tied with an event at ``t`` already counts), not at
  ``t-``: a case with an event at ``t_i`` weighs ``1 / G(t_i)`` (squared for Uno's C) and a control at horizon
  ``h`` weighs ``1 / G(h)``. Where ``G`` is 0 the weight is 0 (scikit-survival's Brier score convention).
* Beyond the training cohort's last time ``G`` is held at its last value (torchsurv's
  ``KaplanMeierEstimator.predict``); scikit-survival raises there instead. Horizons themselves must lie in
  ``[first, last)`` follow-up time of the evaluated cohort and before the training cohort's last time, so this
  only ever affects the weight of events after the last training time in Uno's C.

Two torchsurv details are worked around so the values stay exact: its input validator casts times to float32
(``torchsurv.tools.validators``), which can merge distinct times or move a time across a horizon, so times and
horizons are passed as their exact joint ranks (every metric here depends on times only through their order);
and its Kaplan-Meier estimate is computed in float32, so IPCW-weighted values agree with scikit-survival to about
1e-7 relative, not to float64 precision. (Fed float64 times directly, torchsurv's AUC and Brier score differed from
scikit-survival's by up to 3e-4 on times rounded to whole months.) The C-index intervals use Noether's standard
error as R survcomp computes it, not torchsurv's ``confidence_interval`` (see :func:`harrell_c`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lifelines.statistics import multivariate_logrank_test
from scipy.stats import norm
from torchsurv.metrics.auc import Auc
from torchsurv.metrics.brier_score import BrierScore
from torchsurv.metrics.cindex import ConcordanceIndex
from torchsurv.stats.ipcw import get_ipcw
from torchsurv.stats.kaplan_meier import KaplanMeierEstimator

__all__ = [
    "DEFAULT_GROUP_LABELS",
    "SurvivalPredictionCollector",
    "brier_scores",
    "calibration_table",
    "check_horizons",
    "followup_window",
    "harrell_c",
    "horizon_grid",
    "integrated_brier_score",
    "kaplan_meier_at",
    "km_by_group",
    "risk_groups",
    "survival_metrics",
    "time_dependent_auc",
    "uno_c",
]

DEFAULT_GROUP_LABELS = ("low", "intermediate", "high")
_LOGRANK_KEYS = ("logrank_p", "logrank_statistic", "logrank_groups", "empty_groups", "logrank_note")
TIED_TOL = 1e-8  # risks closer than this are tied (scikit-survival's and torchsurv's default)
ArrayLike = torch.Tensor | np.ndarray | Sequence[float]


def horizon_grid(horizons: Sequence[float], num_points: int = 40) -> torch.Tensor:
    """``num_points`` evenly spaced times in ``(0, max(horizons)]`` (years): the grid of the integrated Brier score.

    Args:
        horizons: evaluation horizons in years.
        num_points: grid size.
    """
    return torch.linspace(0.0, float(max(horizons)), int(num_points) + 1)[1:]


# ---------------------------------------------------------------------------------------------- input checks
def _as_array(values: Any, name: str, ndim: int = 1) -> np.ndarray:
    """``values`` (tensor, array or sequence) as a float64 numpy array with ``ndim`` dimensions."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {tuple(array.shape)}.")
    if not np.all(np.isfinite(array)):
        bad = np.flatnonzero(~np.isfinite(array.ravel()))[:5].tolist()
        raise ValueError(f"{name} must be finite, got non-finite values at flat positions {bad}.")
    return array


def _survival_data(time: ArrayLike, event: ArrayLike, cohort: str = "evaluation") -> tuple[np.ndarray, np.ndarray]:
    """Checked ``(time, event)`` of a cohort: 1-D, equal lengths, ``time >= 0``, ``event`` in {0, 1}, >= 1 event.

    Raises:
        ValueError: naming the cohort and the problem (including a cohort without events).
    """
    time_a = _as_array(time, f"{cohort} time")
    event_a = _as_array(event, f"{cohort} event")
    if time_a.shape != event_a.shape:
        raise ValueError(f"{cohort} time and event differ in length: {time_a.shape[0]} vs {event_a.shape[0]}.")
    if time_a.size < 2:
        raise ValueError(f"the {cohort} cohort needs at least 2 cases, got {time_a.size}.")
    if np.any(time_a < 0):
        raise ValueError(f"{cohort} times must be >= 0, got {time_a[time_a < 0][:5].tolist()}.")
    bad = ~np.isin(event_a, (0.0, 1.0))
    if np.any(bad):
        raise ValueError(f"{cohort} events must be 0 or 1, got {np.unique(event_a[bad])[:5].tolist()}.")
    if not np.any(event_a == 1.0):
        raise ValueError(
            f"the {cohort} cohort has no events (all {time_a.size} cases censored): survival metrics need events."
        )
    return time_a, event_a.astype(bool)


def _cases(values: ArrayLike, name: str, n: int, ndim: int = 1) -> np.ndarray:
    """``values`` with ``n`` rows (one per case)."""
    array = _as_array(values, name, ndim)
    if array.shape[0] != n:
        raise ValueError(f"{name} has {array.shape[0]} rows but there are {n} cases.")
    return array


def _train_cohort(
    time: np.ndarray, event: np.ndarray, train_time: ArrayLike | None, train_event: ArrayLike | None
) -> tuple[np.ndarray, np.ndarray]:
    """The cohort whose censoring distribution weights the metrics: the training cohort when given, else ``time``."""
    if (train_time is None) != (train_event is None):
        raise ValueError("give both train_time and train_event, or neither.")
    if train_time is None:
        return time, event
    return _survival_data(train_time, train_event, cohort="training")


def _horizon_array(horizons: ArrayLike | float, name: str = "horizons") -> np.ndarray:
    """Horizons as a 1-D float64 array: finite, not empty, no value twice."""
    array = _as_array(np.reshape(_to_numpy(horizons), -1), name)
    if array.size == 0:
        raise ValueError(f"{name} must not be empty.")
    if np.unique(array).size != array.size:
        raise ValueError(f"{name} must not repeat a value, got {array.tolist()}.")
    return array


def followup_window(time: ArrayLike, train_time: ArrayLike | None = None) -> tuple[float, float, str]:
    """``(first, last, cohort)``: IPCW metrics are defined at times ``first <= t < last``, the follow-up window of
    the evaluated cohort cut at the last follow-up of the training cohort when that cohort weights the metrics
    (``cohort`` names which cohort sets ``last``)."""
    time_a = _as_array(time, "time")
    first, last, cohort = float(time_a.min()), float(time_a.max()), "evaluated"
    if train_time is not None:
        train_last = float(_as_array(train_time, "train_time").max())
        if train_last < last:
            last, cohort = train_last, "training"
    return first, last, cohort


def check_horizons(
    horizons: ArrayLike | float,
    time: ArrayLike,
    train_time: ArrayLike | None = None,
    name: str = "horizon",
) -> np.ndarray:
    """Check that IPCW metrics are defined at every horizon and return them as an array.

    A horizon ``h`` must satisfy ``min(time) <= h < max(time)`` (scikit-survival's follow-up window: there are
    controls, ``time > h``, and the cases before it are observed) and, when a training cohort weights the metrics,
    ``h < max(train_time)`` (the censoring distribution is estimated there).

    Args:
        horizons: the horizons (years).
        time: follow-up times of the evaluated cohort.
        train_time: follow-up times of the training cohort, or ``None``.
        name: what the values are, for the error message (``"horizon"``, ``"grid time"``).

    Returns:
        The horizons, a float64 array in the order given.

    Raises:
        ValueError: naming the offending horizon and the usable range.
    """
    values = _horizon_array(horizons, f"{name}s")
    first, last, cohort = followup_window(time, train_time)
    for h in values:
        if h >= last:
            raise ValueError(
                f"{name} {h:g} is at or beyond the last follow-up time {last:g} of the {cohort} cohort, where the "
                f"IPCW estimates are undefined: the largest usable {name} must be below {last:g}."
            )
        if h < first:
            raise ValueError(
                f"{name} {h:g} is before the first follow-up time {first:g} of the evaluated cohort: usable {name}s "
                f"lie in [{first:g}, {last:g})."
            )
    return values


# ---------------------------------------------------------------------------------------------- torchsurv helpers
def _joint_ranks(*arrays: np.ndarray) -> list[torch.Tensor]:
    """Each array's values replaced by their dense rank among all arrays' values (float64 tensors).

    Ranks are exact in torchsurv's float32 (below 2**24 distinct values) and keep every order and tie.
    """
    _, inverse = np.unique(np.concatenate([a.ravel() for a in arrays]), return_inverse=True)
    out, start = [], 0
    for a in arrays:
        out.append(torch.as_tensor(inverse[start : start + a.size].reshape(a.shape), dtype=torch.float64))
        start += a.size
    return out


def _inverse_censoring(train_rank: torch.Tensor, train_event: np.ndarray, at_rank: torch.Tensor) -> torch.Tensor:
    """``1 / G(t)`` at ``at_rank`` (0 where ``G(t) = 0``), ``G`` the censoring Kaplan-Meier of the training cohort."""
    return get_ipcw(torch.as_tensor(train_event), train_rank, new_time=at_rank).double()


def _censoring_survival(train_rank: torch.Tensor, train_event: np.ndarray, at_rank: torch.Tensor) -> torch.Tensor:
    """``G(t)`` at ``at_rank``: the Kaplan-Meier estimate of the training cohort's censoring distribution."""
    km = KaplanMeierEstimator()
    km(torch.as_tensor(train_event), train_rank, censoring_dist=True)
    return km.predict(at_rank).double()


def _noether_interval(
    risk: np.ndarray, time: np.ndarray, event: np.ndarray, pair_weight: np.ndarray, c: float, alpha: float
) -> tuple[float, float]:
    """Normal ``1 - alpha`` interval of a C-index with Noether's standard error (Pencina & D'Agostino 2004).

    As R survcomp's ``concordance.index(method="noether")``: ``ch[k]``/``dh[k]`` count the concordant/discordant
    comparable pairs subject ``k`` takes part in, in *either* role (torchsurv counts only the earlier event's
    role, which gave standard errors about 1.8x the spread of C over resampled cohorts). Pairs are the
    comparable pairs of the module docstring, weighted by ``pair_weight`` of their earlier event (1 for
    Harrell's C, ``1 / G(t_i)**2`` for Uno's); tied risks count 1/2 to each side, so ``pc / (pc + pd)`` is the
    C-index itself. The IPCW weights are taken as fixed. The interval is clipped to [0, 1] and collapses to
    ``c`` when the standard error is 0 (every comparable pair concordant, or every one discordant).
    """
    n = time.size
    if n < 3:
        return math.nan, math.nan
    ch, dh = np.zeros(n), np.zeros(n)
    rows = np.flatnonzero(event & (pair_weight > 0))
    for chunk in np.array_split(rows, max(1, math.ceil(rows.size * n / 2**22))):  # bounded memory for large n
        t_i = time[chunk, None]
        comparable = (time[None, :] > t_i) | ((time[None, :] == t_i) & ~event[None, :])
        diff = risk[chunk, None] - risk[None, :]
        tie = np.abs(diff) <= TIED_TOL
        w = comparable * pair_weight[chunk, None]
        conc = np.where(tie, 0.5, diff > 0) * w
        disc = np.where(tie, 0.5, diff < 0) * w
        ch[chunk] += conc.sum(axis=1)
        dh[chunk] += disc.sum(axis=1)
        ch += conc.sum(axis=0)
        dh += disc.sum(axis=0)
    pc, pd = ch.sum() / (n * (n - 1)), dh.sum() / (n * (n - 1))
    if pc + pd <= 0:
        return math.nan, math.nan
    triple = n * (n - 1) * (n - 2)
    pcc, pdd, pcd = np.sum(ch * (ch - 1)) / triple, np.sum(dh * (dh - 1)) / triple, np.sum(ch * dh) / triple
    var = 4.0 / (pc + pd) ** 4 * (pd**2 * pcc - 2.0 * pc * pd * pcd + pc**2 * pdd)
    se = math.sqrt(max(var, 0.0) / n)
    half = float(norm.ppf(1.0 - alpha / 2.0)) * se
    return max(0.0, c - half), min(1.0, c + half)


# ---------------------------------------------------------------------------------------------- concordance
def harrell_c(risk: ArrayLike, time: ArrayLike, event: ArrayLike, alpha: float = 0.05) -> dict[str, float]:
    """Harrell's C-index with a ``1 - alpha`` confidence interval.

    Equals scikit-survival's ``concordance_index_censored`` and lifelines' ``concordance_index(time, -risk,
    event)`` (see the module docstring for comparable pairs and ties); the value is torchsurv's
    ``ConcordanceIndex``. The interval is the normal interval with Noether's standard error as in R survcomp
    (not torchsurv's ``confidence_interval``, whose standard error is too large: see :func:`_noether_interval`),
    clipped to [0, 1]; it collapses to the estimate when every comparable pair is concordant (or every one
    discordant), where that error is 0.

    Args:
        risk: risk score per case (higher = earlier event).
        time: follow-up time per case.
        event: 1 for an event, 0 for censored.
        alpha: 1 - confidence level of the interval.

    Returns:
        ``{"c", "lo", "hi"}``.

    Raises:
        ValueError: for malformed input, a cohort without events, or no comparable pair.
    """
    time_a, event_a = _survival_data(time, event)
    risk_a = _cases(risk, "risk", time_a.size)
    (time_rank,) = _joint_ranks(time_a)
    c = float(ConcordanceIndex()(torch.as_tensor(risk_a), torch.as_tensor(event_a), time_rank))
    lo, hi = _noether_interval(risk_a, time_a, event_a, np.ones(time_a.size), c, alpha)
    return {"c": c, "lo": lo, "hi": hi}


def _uno_weights(
    time_a: np.ndarray, event_a: np.ndarray, train_time: np.ndarray, train_event: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(time ranks, delta_i / G(t_i), G(t_i))`` of the evaluated cohort, ``G`` from the training cohort."""
    time_rank, train_rank = _joint_ranks(time_a, train_time)
    g = _censoring_survival(train_rank, train_event, time_rank)
    weight = torch.where(torch.as_tensor(event_a) & (g > 0), 1.0 / g.clamp_min(1e-300), torch.zeros_like(g))
    return time_rank, weight, g


def uno_c(
    risk: ArrayLike,
    time: ArrayLike,
    event: ArrayLike,
    train_time: ArrayLike | None = None,
    train_event: ArrayLike | None = None,
    tau: float | None = None,
    alpha: float = 0.05,
) -> dict[str, float]:
    """Uno's IPCW C-index, as scikit-survival's ``concordance_index_ipcw(survival_train, survival_test, risk, tau)``.

    Each comparable pair whose earlier time ``t_i`` is an event with ``t_i < tau`` weighs ``1 / G(t_i)**2``, ``G``
    the censoring Kaplan-Meier of the training cohort (else of this cohort); the value is torchsurv's
    ``ConcordanceIndex`` with these weights. The interval is Noether's (as :func:`harrell_c`) on the weighted pair
    counts, taking the weights as fixed: an approximation (Uno et al. 2011 use perturbation resampling).

    Args:
        risk: risk score per case.
        time: follow-up time per case.
        event: 1 for an event, 0 for censored.
        train_time: follow-up times of the training cohort (for ``G``), or ``None``.
        train_event: events of the training cohort, or ``None``.
        tau: truncation time: events at or after ``tau`` get no weight; ``None`` keeps all.
        alpha: 1 - confidence level of the interval.

    Returns:
        ``{"c", "lo", "hi"}``.

    Raises:
        ValueError: for malformed input, a cohort without events (before ``tau``), or an event before ``tau``
            where the censoring survival is 0 (choose a smaller ``tau``).
    """
    time_a, event_a = _survival_data(time, event)
    risk_a = _cases(risk, "risk", time_a.size)
    train_t, train_e = _train_cohort(time_a, event_a, train_time, train_event)
    time_rank, weight, g = _uno_weights(time_a, event_a, train_t, train_e)
    used = event_a if tau is None else event_a & (time_a < tau)
    if not used.any():
        raise ValueError(
            f"no event before tau={tau!r} (first event at {time_a[event_a].min():g}): Uno's C is undefined."
        )
    zero = used & (g.numpy() <= 0)
    if zero.any():
        first = float(time_a[zero].min())
        raise ValueError(
            f"the censoring survival function is 0 at the event time {first:g} (at or after the last time of the "
            f"cohort it is estimated from): pass tau <= {first:g} to Uno's C."
        )
    # the truncation of torchsurv's ``tmax`` (weight 0 from tau on), applied here in years rather than in rank space
    weight = weight * torch.as_tensor(used, dtype=torch.float64)
    c = float(ConcordanceIndex()(torch.as_tensor(risk_a), torch.as_tensor(event_a), time_rank, weight=weight))
    lo, hi = _noether_interval(risk_a, time_a, event_a, weight.numpy() ** 2, c, alpha)
    return {"c": c, "lo": lo, "hi": hi}


def _uno_default_tau(time_a: np.ndarray, event_a: np.ndarray, train_t: np.ndarray, train_e: np.ndarray) -> float | None:
    """``None``, or the first event time at which the censoring survival is 0 (Uno's C is undefined from there)."""
    _, _, g = _uno_weights(time_a, event_a, train_t, train_e)
    zero = event_a & (g.numpy() <= 0)
    return float(time_a[zero].min()) if zero.any() else None


# ---------------------------------------------------------------------------------------------- AUC and Brier
def _ipcw_setup(
    time: ArrayLike,
    event: ArrayLike,
    horizons: ArrayLike | float,
    train_time: ArrayLike | None,
    train_event: ArrayLike | None,
    name: str = "horizon",
) -> dict[str, Any]:
    """Checked inputs and the rank-space tensors torchsurv's ``Auc``/``BrierScore`` need (horizons sorted), with
    ``name``, what the horizons are called in messages."""
    time_a, event_a = _survival_data(time, event)
    train_t, train_e = _train_cohort(time_a, event_a, train_time, train_event)
    h = check_horizons(horizons, time_a, None if train_time is None else train_t, name=name)
    order = np.argsort(h, kind="stable")
    time_rank, train_rank, h_rank = _joint_ranks(time_a, train_t, h[order])
    weight = _inverse_censoring(train_rank, train_e, time_rank) * torch.as_tensor(event_a, dtype=torch.float64)
    weight_h = _inverse_censoring(train_rank, train_e, h_rank)
    return {
        "time": time_rank,
        "event": torch.as_tensor(event_a),
        "n": time_a.size,
        "horizons": h,
        "order": order,
        "new_time": h_rank,
        "weight": weight,
        "weight_new_time": weight_h,
        "name": name,
    }


def _auc(risk: ArrayLike, s: dict[str, Any]) -> tuple[dict[float, float], float]:
    """Per-horizon cumulative/dynamic AUC and its KM-weighted mean (see :func:`time_dependent_auc`) of the cohort
    and horizons of ``s`` (:func:`_ipcw_setup`)."""
    risk_a = _to_numpy(risk)
    if risk_a.ndim == 2:
        risk_a = _cases(risk_a, "risk", s["n"], ndim=2)
        if risk_a.shape[1] != s["horizons"].size:
            raise ValueError(f"2-D risk has {risk_a.shape[1]} columns but there are {s['horizons'].size} horizons.")
        estimate = torch.as_tensor(risk_a[:, s["order"]])
    else:
        estimate = torch.as_tensor(_cases(risk_a, "risk", s["n"]))
    metric = Auc()
    values = metric(
        estimate,
        s["event"],
        s["time"],
        auc_type="cumulative",
        weight=s["weight"],
        new_time=s["new_time"],
        weight_new_time=s["weight_new_time"],
    )
    by_sorted = dict(zip(s["horizons"][s["order"]].tolist(), values.tolist()))
    return {float(h): float(by_sorted[h]) for h in s["horizons"]}, float(metric.integral())


def time_dependent_auc(
    risk: ArrayLike,
    time: ArrayLike,
    event: ArrayLike,
    horizons: ArrayLike | float,
    train_time: ArrayLike | None = None,
    train_event: ArrayLike | None = None,
) -> dict[float, float]:
    """Cumulative/dynamic AUC at each horizon, as scikit-survival's ``cumulative_dynamic_auc``.

    At horizon ``h`` the cases are the events with ``time <= h``, weighted by ``1 / G(time)``, and the controls
    the cases with ``time > h`` (unweighted); tied risks form one ROC threshold. A horizon without any case gives
    ``nan`` (as scikit-survival).

    Args:
        risk: risk per case (1-D), or a 2-D (cases x horizons) time-dependent risk such as ``1 - S(h | x)``,
            columns in the order of ``horizons``.
        time: follow-up time per case.
        event: 1 for an event, 0 for censored.
        horizons: evaluation times (years), each in the follow-up window (see :func:`check_horizons`).
        train_time: follow-up times of the training cohort (for ``G``), or ``None`` for this cohort.
        train_event: events of the training cohort, or ``None``.

    Returns:
        ``{horizon: auc}`` in the order of ``horizons``.

    Raises:
        ValueError: for malformed input, a cohort without events, or a horizon outside the follow-up window.
    """
    return _auc(risk, _ipcw_setup(time, event, horizons, train_time, train_event))[0]


def _brier(surv: ArrayLike, s: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(horizons as given, Brier score at each)`` of the cohort and horizons of ``s`` (:func:`_ipcw_setup`)."""
    surv_a = _cases(surv, "surv", s["n"], ndim=2)
    if surv_a.shape[1] != s["horizons"].size:
        raise ValueError(f"surv has {surv_a.shape[1]} columns but there are {s['horizons'].size} {s['name']}s.")
    if np.any((surv_a < 0) | (surv_a > 1)):
        raise ValueError(
            f"surv must hold survival probabilities in [0, 1], got values in [{surv_a.min()}, {surv_a.max()}]."
        )
    values = BrierScore()(
        torch.as_tensor(surv_a[:, s["order"]]),
        s["event"],
        s["time"],
        new_time=s["new_time"],
        weight=s["weight"],
        weight_new_time=s["weight_new_time"],
    )
    out = np.empty(s["horizons"].size)
    out[s["order"]] = values.numpy()
    return s["horizons"], out


def brier_scores(
    surv: ArrayLike,
    time: ArrayLike,
    event: ArrayLike,
    horizons: ArrayLike | float,
    train_time: ArrayLike | None = None,
    train_event: ArrayLike | None = None,
) -> dict[float, float]:
    """IPCW Brier score at each horizon, as scikit-survival's ``brier_score`` (Graf et al. 1999).

    ``BS(h) = mean_i [S_i(h)**2 * 1{t_i <= h, event} / G(t_i) + (1 - S_i(h))**2 * 1{t_i > h} / G(h)]``; cases
    censored by ``h`` contribute 0.

    Args:
        surv: (cases x horizons) predicted survival probabilities ``S(h | x)``, columns in the order of ``horizons``.
        time, event, horizons, train_time, train_event: as for :func:`time_dependent_auc`.

    Returns:
        ``{horizon: brier}`` in the order of ``horizons``.

    Raises:
        ValueError: for malformed input, probabilities outside [0, 1], a cohort without events, or a horizon
            outside the follow-up window.
    """
    h, values = _brier(surv, _ipcw_setup(time, event, horizons, train_time, train_event))
    return {float(a): float(b) for a, b in zip(h, values)}


def integrated_brier_score(
    surv_grid: ArrayLike,
    grid: ArrayLike,
    time: ArrayLike,
    event: ArrayLike,
    train_time: ArrayLike | None = None,
    train_event: ArrayLike | None = None,
) -> float:
    """Integrated Brier score, as scikit-survival's ``integrated_brier_score``: the trapezoidal integral of the
    Brier score over ``grid`` divided by ``grid[-1] - grid[0]`` (torchsurv's ``BrierScore.integral``, computed on
    the float64 grid).

    Args:
        surv_grid: (cases x len(grid)) predicted survival probabilities on ``grid``.
        grid: strictly increasing evaluation times (years), at least 2, inside the follow-up window.
        time, event, train_time, train_event: as for :func:`time_dependent_auc`.

    Returns:
        The integrated Brier score.

    Raises:
        ValueError: for a grid that is not strictly increasing or has fewer than 2 times, or as :func:`brier_scores`.
    """
    grid_a = _as_array(grid, "grid")
    if grid_a.size < 2 or np.any(np.diff(grid_a) <= 0):
        raise ValueError(f"grid must be strictly increasing with at least 2 times, got {grid_a.tolist()}.")
    _, values = _brier(surv_grid, _ipcw_setup(time, event, grid_a, train_time, train_event, name="grid time"))
    return float(np.trapezoid(values, grid_a) / (grid_a[-1] - grid_a[0]))


# ---------------------------------------------------------------------------------------------- KM, groups, calibration
def _km_curve(time: np.ndarray, event: np.ndarray) -> tuple[np.ndarray, np.ndarray, KaplanMeierEstimator | None]:
    """Kaplan-Meier ``(unique times, survival)`` (torchsurv); without events the curve is 1 and no estimator."""
    if not event.any():  # torchsurv refuses a cohort without events; its survival is 1 throughout
        times = np.unique(time)
        return times, np.ones(times.size), None
    km = KaplanMeierEstimator()
    km(torch.as_tensor(event.astype(bool)), torch.as_tensor(time, dtype=torch.float64))
    return km.time.numpy().astype(np.float64), km.km_est.double().numpy(), km


def kaplan_meier_at(time: ArrayLike, event: ArrayLike, at: ArrayLike) -> np.ndarray:
    """The Kaplan-Meier survival of a cohort at the times ``at`` (a right-continuous step function: 1 before the
    first time, the last value after the last).

    Args:
        time: follow-up time per case.
        event: 1 for an event, 0 for censored.
        at: the times to evaluate.
    """
    time_a, event_a = _survival_data(time, event, cohort="Kaplan-Meier")
    times, survival, _ = _km_curve(time_a, event_a.astype(bool))
    at_a = np.asarray(at, dtype=np.float64).reshape(-1)
    index = np.searchsorted(times, at_a, side="right") - 1
    return np.where(index >= 0, survival[np.clip(index, 0, None)], 1.0)


def risk_groups(risk: ArrayLike, thresholds: ArrayLike, labels: Sequence[str] = DEFAULT_GROUP_LABELS) -> list[str]:
    """Risk group of each case: a case with ``risk >= thresholds[i]`` is in group ``i + 1`` or above.

    The rule of :class:`common.survival.networks.SurvivalPredictor` (group ``g`` holds risks in
    ``[thresholds[g - 1], thresholds[g])``; a risk equal to a threshold goes to the higher group), so the groups of
    a report are those of the model's predictions.

    Args:
        risk: risk score per case.
        thresholds: non-decreasing thresholds, one fewer than ``labels``.
        labels: the group names, lowest risk first.

    Returns:
        One label per case.

    Raises:
        ValueError: for decreasing thresholds or a label count that does not match.
    """
    risk_a = _as_array(risk, "risk")
    cuts = _as_array(np.reshape(_to_numpy(thresholds), -1), "thresholds")
    if len(labels) != cuts.size + 1:
        raise ValueError(f"{cuts.size} thresholds need {cuts.size + 1} labels, got {list(labels)!r}.")
    if np.any(np.diff(cuts) < 0):
        raise ValueError(f"thresholds must be non-decreasing, got {cuts.tolist()}.")
    index = np.searchsorted(cuts, risk_a, side="right")  # number of thresholds at or below the risk
    return [labels[i] for i in index]


def _join(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def km_by_group(
    groups: Sequence[str], time: ArrayLike, event: ArrayLike, labels: Sequence[str] | None = None
) -> dict[str, Any]:
    """Kaplan-Meier curve of each group and the multi-group log-rank test over the groups that have cases.

    Every label of ``labels`` is in the result, also a group without cases: it has ``n = 0``, ``events = 0``, no
    curve (empty ``times`` and ``survival``) and a ``note`` saying it is empty, so a reader never wonders whether
    a group was lost.

    Args:
        groups: group label per case (e.g. from :func:`risk_groups`).
        time: follow-up time per case.
        event: 1 for an event, 0 for censored.
        labels: every group, in the order of the result; default: the groups present, sorted.

    Returns:
        ``{label: {"times": [...], "survival": [...], "n": int, "events": int[, "note": str]}, ..., "logrank_p":
        float, "logrank_statistic": float, "logrank_groups": [...], "empty_groups": [...], "logrank_note": str}``:
        the curve is the step function's values at each distinct time of the group (right-continuous:
        ``survival[k]`` holds on ``[times[k], times[k + 1])``, 1 before ``times[0]``). The test is lifelines'
        ``multivariate_logrank_test`` (chi-square with groups - 1 degrees of freedom) over ``logrank_groups``, the
        groups with cases; ``empty_groups`` are left out of it and named in ``logrank_note``. With fewer than 2
        groups with cases, or without events, the test is not computable: ``logrank_p`` and
        ``logrank_statistic`` are ``nan`` and ``logrank_note`` says why.

    Raises:
        ValueError: for malformed input, a group label used as a result key, or a case whose group is not in
            ``labels``.
    """
    time_a = _as_array(time, "time")
    event_a = _cases(event, "event", time_a.size)
    if not np.all(np.isin(event_a, (0.0, 1.0))):
        raise ValueError(f"events must be 0 or 1, got {np.unique(event_a[~np.isin(event_a, (0.0, 1.0))]).tolist()}.")
    group_a = np.asarray([str(g) for g in groups], dtype=object)
    if group_a.size != time_a.size:
        raise ValueError(f"groups has {group_a.size} entries but there are {time_a.size} cases.")
    present = set(group_a.tolist())
    order = sorted(present) if labels is None else list(dict.fromkeys(str(label) for label in labels))
    missing = sorted(present - set(order))
    if missing:
        raise ValueError(f"groups {missing!r} are not among labels {list(labels or [])!r}.")
    clash = set(order) & set(_LOGRANK_KEYS)
    if clash:
        raise ValueError(f"group labels {sorted(clash)!r} clash with the log-rank result keys.")
    out: dict[str, Any] = {}
    for label in order:
        mask = group_a == label
        if not mask.any():
            out[label] = {"times": [], "survival": [], "n": 0, "events": 0, "note": f"empty: no case is in {label}"}
            continue
        times, surv, _ = _km_curve(time_a[mask], event_a[mask] == 1.0)
        out[label] = {
            "times": times.tolist(),
            "survival": surv.tolist(),
            "n": int(mask.sum()),
            "events": int(event_a[mask].sum()),
        }
    compared = [label for label in order if out[label]["n"] > 0]
    empty = [label for label in order if out[label]["n"] == 0]
    stat = p = math.nan
    empty_text = f"{_join(empty)} {'is' if len(empty) == 1 else 'are'} empty" if empty else ""
    if len(compared) < 2:
        note = f"not computable: {'only ' + compared[0] + ' has' if compared else 'no group has'} cases"
        note += f" ({empty_text})" if empty else ""
    elif not event_a.any():
        note = "not computable: no event among these cases"
    else:
        result = multivariate_logrank_test(time_a, group_a, event_a.astype(int))
        stat, p = float(result.test_statistic), float(result.p_value)
        note = f"over {_join(compared)}" + (f"; {empty_text}" if empty else "")
    out.update(
        {
            "logrank_p": p,
            "logrank_statistic": stat,
            "logrank_groups": compared,
            "empty_groups": empty,
            "logrank_note": f"log-rank test {note}",
        }
    )
    return out


def calibration_table(
    p_event: ArrayLike, time: ArrayLike, event: ArrayLike, horizon: float, n_bins: int = 10
) -> dict[str, Any]:
    """Calibration at ``horizon``: predicted vs Kaplan-Meier observed probability of an event, by risk bin.

    Cases are sorted by ``p_event`` (stable) and split into ``min(n_bins, n)`` bins of (nearly) equal size (the
    quantile bins; tied predictions on a boundary may fall on either side). Per bin, ``observed`` is
    ``1 - KM(horizon)`` of the bin's cases (torchsurv's ``KaplanMeierEstimator``); past the bin's last follow-up
    time the Kaplan-Meier estimate is held at its last value, and a bin without events observes 0.

    Args:
        p_event: predicted probability of an event by ``horizon`` (``1 - S(horizon | x)``) per case.
        time: follow-up time per case.
        event: 1 for an event, 0 for censored.
        horizon: the horizon (years), > 0.
        n_bins: number of bins (at most the number of cases).

    Returns:
        ``{"horizon": float, "bins": [{"n", "predicted", "observed", "p_min", "p_max"}, ...], "ici": float,
        "slope": float}``: ``ici`` is the mean absolute ``predicted - observed`` difference weighted by bin size,
        ``slope`` the least-squares slope of ``observed`` on ``predicted`` over the bins (``nan`` with fewer than
        2 bins or when all bins predict the same).

    Raises:
        ValueError: for malformed input, probabilities outside [0, 1], a horizon <= 0 or fewer than 1 bin.
    """
    time_a = _as_array(time, "time")
    event_a = _cases(event, "event", time_a.size)
    p = _cases(p_event, "p_event", time_a.size)
    if not np.all(np.isin(event_a, (0.0, 1.0))):
        raise ValueError(f"events must be 0 or 1, got {np.unique(event_a[~np.isin(event_a, (0.0, 1.0))]).tolist()}.")
    if np.any((p < 0) | (p > 1)):
        raise ValueError(f"p_event must be probabilities in [0, 1], got values in [{p.min()}, {p.max()}].")
    if not (math.isfinite(horizon) and horizon > 0):
        raise ValueError(f"the calibration horizon must be a positive number of years, got {horizon!r}.")
    if isinstance(n_bins, bool) or int(n_bins) < 1:
        raise ValueError(f"n_bins must be at least 1, got {n_bins!r}.")
    if time_a.size == 0:
        raise ValueError("calibration needs at least one case, got none.")
    bins = []
    for index in np.array_split(np.argsort(p, kind="stable"), min(int(n_bins), time_a.size)):
        _, _, km = _km_curve(time_a[index], event_a[index] == 1.0)
        surv = 1.0 if km is None else float(km.predict(torch.tensor([float(horizon)], dtype=torch.float64))[0])
        bins.append(
            {
                "n": int(index.size),
                "predicted": float(p[index].mean()),
                "observed": 1.0 - surv,
                "p_min": float(p[index].min()),
                "p_max": float(p[index].max()),
            }
        )
    n = np.array([b["n"] for b in bins], dtype=np.float64)
    pred = np.array([b["predicted"] for b in bins])
    obs = np.array([b["observed"] for b in bins])
    ici = float(np.sum(n * np.abs(pred - obs)) / n.sum())
    slope = math.nan
    if pred.size >= 2 and np.ptp(pred) > 0:
        centred = pred - pred.mean()
        slope = float(np.sum(centred * (obs - obs.mean())) / np.sum(centred**2))
    return {"horizon": float(horizon), "bins": bins, "ici": ici, "slope": slope}


# ---------------------------------------------------------------------------------------------- all at once
def survival_metrics(
    risk: ArrayLike,
    time: ArrayLike,
    event: ArrayLike,
    horizons: Sequence[float] = (1, 3, 5),
    surv_at_horizons: ArrayLike | None = None,
    surv_grid: ArrayLike | None = None,
    grid: ArrayLike | None = None,
    train_time: ArrayLike | None = None,
    train_event: ArrayLike | None = None,
    group_thresholds: ArrayLike | None = None,
    calibration_horizon: float | None = None,
    n_bins: int = 10,
    groups: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every survival metric of one evaluation.

    Args:
        risk: risk score per case.
        time: follow-up time per case (years).
        event: 1 for an event, 0 for censored.
        horizons: horizons (years) of the AUC, Brier score and risk probabilities.
        surv_at_horizons: (cases x horizons) predicted ``S(h | x)``; when given, the AUC at ``h`` ranks
            ``1 - S(h | x)`` (the model's time-dependent risk) and the Brier scores and calibration are computed.
        surv_grid: (cases x len(grid)) predicted survival on ``grid``, for the integrated Brier score.
        grid: increasing times (years) of ``surv_grid``.
        train_time: follow-up times of the training cohort (its censoring distribution weights the IPCW metrics).
        train_event: events of the training cohort.
        group_thresholds: increasing risk thresholds of the low/intermediate/high groups; default: the tertiles of
            ``risk``.
        calibration_horizon: horizon of the calibration table (one of ``horizons``); default the middle horizon.
        n_bins: calibration bins.
        groups: the risk group of each case (one of :data:`DEFAULT_GROUP_LABELS`), e.g. the model's own
            predictions; default: :func:`risk_groups` of ``risk`` by ``group_thresholds``.

    Returns:
        Floats under ``harrell_c``, ``harrell_c_lo``, ``harrell_c_hi``, ``uno_c``, ``uno_c_lo``, ``uno_c_hi``,
        ``auc_<h>`` per horizon (``f"{h:g}"``), ``auc_mean`` (scikit-survival's ``mean_auc``: the AUCs weighted
        by the Kaplan-Meier probability mass of each horizon; torchsurv leaves out horizons without mass, where
        scikit-survival gives ``nan``), ``logrank_p`` (``nan`` where the test is not computable:
        ``km["logrank_note"]`` says why); ``brier_<h>`` and ``calibration_ici`` when
        ``surv_at_horizons`` is given; ``ibs`` when ``surv_grid`` and ``grid`` are, with ``ibs_km``, the integrated
        Brier score of predicting the Kaplan-Meier curve of the training cohort (of this cohort without one) for
        every case: the reference a model must beat. Non-float entries: ``km``
        (:func:`km_by_group` of the risk groups) and ``calibration`` (:func:`calibration_table`, with
        ``surv_at_horizons``). Uno's C is untruncated unless the censoring survival reaches 0 at an event time;
        then ``tau`` is that time (``uno_c_tau`` reports it).

    Raises:
        ValueError: for a cohort without events, a horizon at or beyond the last follow-up time (the message
            names the horizon and the limit), or malformed input.
    """
    time_a, event_a = _survival_data(time, event)
    risk_a = _cases(risk, "risk", time_a.size)
    train_t, train_e = _train_cohort(time_a, event_a, train_time, train_event)
    train_kw = {"train_time": train_time, "train_event": train_event}
    h = check_horizons(horizons, time_a, None if train_time is None else train_t)
    out: dict[str, Any] = {}
    for key, value in harrell_c(risk_a, time_a, event_a).items():
        out["harrell_c" if key == "c" else f"harrell_c_{key}"] = value
    tau = _uno_default_tau(time_a, event_a, train_t, train_e)
    for key, value in uno_c(risk_a, time_a, event_a, tau=tau, **train_kw).items():
        out["uno_c" if key == "c" else f"uno_c_{key}"] = value
    if tau is not None:
        out["uno_c_tau"] = tau
    surv = None if surv_at_horizons is None else _cases(surv_at_horizons, "surv_at_horizons", time_a.size, ndim=2)
    if surv is not None and surv.shape[1] != h.size:
        raise ValueError(f"surv_at_horizons has {surv.shape[1]} columns but there are {h.size} horizons {h.tolist()}.")
    setup = _ipcw_setup(time_a, event_a, h, train_time, train_event)
    aucs, out["auc_mean"] = _auc(risk_a if surv is None else 1.0 - surv, setup)
    for horizon, value in aucs.items():
        out[f"auc_{horizon:g}"] = value
    if surv is not None:
        for horizon, value in brier_scores(surv, time_a, event_a, h, **train_kw).items():
            out[f"brier_{horizon:g}"] = value
        cal_h = float(np.sort(h)[h.size // 2]) if calibration_horizon is None else float(calibration_horizon)
        if cal_h not in h.tolist():
            raise ValueError(f"calibration_horizon {cal_h:g} is not one of the horizons {h.tolist()}.")
        column = int(np.flatnonzero(h == cal_h)[0])
        out["calibration"] = calibration_table(1.0 - surv[:, column], time_a, event_a, cal_h, n_bins=n_bins)
        out["calibration_ici"] = out["calibration"]["ici"]
    if (surv_grid is None) != (grid is None):
        raise ValueError("give both surv_grid and grid for the integrated Brier score, or neither.")
    if surv_grid is not None:
        out["ibs"] = integrated_brier_score(surv_grid, grid, time_a, event_a, **train_kw)
        # the reference of a model without images or covariates: the (training) Kaplan-Meier curve for every case
        null = kaplan_meier_at(train_t, train_e, grid)
        out["ibs_km"] = integrated_brier_score(np.tile(null, (time_a.size, 1)), grid, time_a, event_a, **train_kw)
    if groups is None:
        thresholds = np.quantile(risk_a, [1 / 3, 2 / 3]) if group_thresholds is None else group_thresholds
        groups = risk_groups(risk_a, thresholds)
    out["km"] = km_by_group(groups, time_a, event_a, labels=DEFAULT_GROUP_LABELS)
    out["logrank_p"] = out["km"]["logrank_p"]
    return out


# ---------------------------------------------------------------------------------------------- collection over ranks
class SurvivalPredictionCollector:
    """Collects per-case survival predictions over the batches of an evaluation and gathers them from all ranks.

    Under ``torch.distributed`` (an initialised process group, gloo or nccl; with nccl the caller has set the
    CUDA device) :meth:`gather` exchanges every rank's records with ``all_gather_object`` and keeps each case
    once, so a case a rank repeated to even out the partition is counted once. A repeated case must carry the
    same time and event, and predictions equal within ``rtol``/``atol`` (the same model on a different batch may
    differ in the last bits); the first copy (lowest rank, earliest batch) is kept.

    Args:
        rtol: relative tolerance between the predictions of a repeated case.
        atol: absolute tolerance between the predictions of a repeated case.
    """

    _FIELDS = ("risk", "time", "event", "surv_at_horizons", "surv_grid")

    def __init__(self, rtol: float = 1e-4, atol: float = 1e-6) -> None:
        self.rtol = float(rtol)
        self.atol = float(atol)
        self.reset()

    def reset(self) -> None:
        """Forget everything added."""
        self._records: list[tuple[str, dict[str, np.ndarray]]] = []
        self._optional: dict[str, bool] = {}

    def __len__(self) -> int:
        return len(self._records)

    def add(
        self,
        case_ids: Sequence[str],
        risk: ArrayLike,
        time: ArrayLike,
        event: ArrayLike,
        surv_at_horizons: ArrayLike | None = None,
        surv_grid: ArrayLike | None = None,
    ) -> None:
        """Add one batch of predictions.

        Args:
            case_ids: the batch's case ids.
            risk: risk score per case.
            time: follow-up time per case.
            event: 1 for an event, 0 for censored.
            surv_at_horizons: optional (cases x horizons) predicted survival; give it in every batch or none.
            surv_grid: optional (cases x grid) predicted survival; give it in every batch or none.

        ``time`` and ``event`` may be ``nan`` for cases without outcomes (inference); nothing here checks values.

        Raises:
            ValueError: for lengths that differ from ``len(case_ids)``, or an optional field given in some
                batches only.
        """
        ids = [str(c) for c in case_ids]
        n = len(ids)
        if n == 0:
            return
        fields = {"risk": _batch_field(risk, "risk", n), "time": _batch_field(time, "time", n)}
        fields["event"] = _batch_field(event, "event", n)
        for name, value in (("surv_at_horizons", surv_at_horizons), ("surv_grid", surv_grid)):
            given = value is not None
            if self._optional.setdefault(name, given) != given:
                raise ValueError(f"{name} must be given in every batch or in none (batch with case ids {ids[:3]}...).")
            if given:
                fields[name] = _batch_field(value, name, n, per_case_shape=(-1,))
        for i, case_id in enumerate(ids):
            self._records.append((case_id, {k: v[i] for k, v in fields.items()}))

    def gather(self) -> dict[str, np.ndarray]:
        """Every case once, from all ranks, sorted by case id.

        Returns:
            ``{"case_id", "risk", "time", "event"}`` (+ ``"surv_at_horizons"``, ``"surv_grid"`` when given) as
            numpy arrays (float64 values, ``case_id`` a string array).

        Raises:
            ValueError: when one case id carries different values (naming the case and the field).
        """
        records = [self._records]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, self._records)
        unique: dict[str, dict[str, np.ndarray]] = {}
        for rank, rank_records in enumerate(records):
            for case_id, values in rank_records:
                if case_id in unique:
                    self._check_same(case_id, unique[case_id], values, rank)
                else:
                    unique[case_id] = values
        ids = sorted(unique)
        fields = [f for f in self._FIELDS if all(f in unique[c] for c in ids)] if ids else ["risk", "time", "event"]
        out: dict[str, np.ndarray] = {"case_id": np.asarray(ids, dtype=str)}
        for name in fields:
            out[name] = np.asarray([unique[c][name] for c in ids], dtype=np.float64)
        return out

    def _check_same(
        self, case_id: str, first: Mapping[str, np.ndarray], other: Mapping[str, np.ndarray], rank: int
    ) -> None:
        if set(first) != set(other):
            raise ValueError(
                f"case {case_id!r} was collected with fields {sorted(first)} and {sorted(other)} (rank {rank})."
            )
        for name in first:
            a, b = np.asarray(first[name]), np.asarray(other[name])
            exact = name in ("time", "event")
            same = a.shape == b.shape and (
                np.array_equal(a, b, equal_nan=True)
                if exact
                else np.allclose(a, b, rtol=self.rtol, atol=self.atol, equal_nan=True)
            )
            if not same:
                raise ValueError(
                    f"case {case_id!r} was collected twice with different {name}: {a.tolist()} vs {b.tolist()} "
                    f"(second copy from rank {rank})."
                )


def _batch_field(values: Any, name: str, n: int, per_case_shape: tuple[int, ...] = ()) -> np.ndarray:
    """One collected field of a batch of ``n`` cases, shaped ``(n, *per_case_shape)``; values may be non-finite
    (e.g. ``nan`` time and event of inference cases without outcomes)."""
    array = _to_numpy(values)
    if array.size == 0 or array.shape[0] != n or (not per_case_shape and array.size != n):
        raise ValueError(f"{name} has shape {tuple(array.shape)} but the batch has {n} case ids.")
    return array.reshape(n, *per_case_shape)


def _to_numpy(values: Any) -> np.ndarray:
    """A tensor, array or sequence as a float64 numpy array (detached, on the CPU)."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)

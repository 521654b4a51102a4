# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Handlers of survival evaluations: calibrate the predictor on the training cohort, compute the metrics on the
predictions of all ranks, and write the per-case CSV, the report and its plots."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Engine, Events

from common.data.pipeline import batch_case_ids
from common.survival.engines import prepare_survival_batch
from common.survival.metrics import SurvivalPredictionCollector, followup_window, survival_metrics
from common.utils import autocast, get_rank, write_text_atomic

__all__ = [
    "CohortReport",
    "SurvivalCalibration",
    "SurvivalMetricsHandler",
    "SurvivalReport",
    "case_values",
    "describe_risk_groups",
    "draw_km_by_group",
    "risk_group_table",
    "usable_horizons",
]

logger = logging.getLogger(__name__)


class SurvivalCalibration:
    """Before each evaluation, set what the predictor derives from the training cohort: the Breslow baseline
    hazard (Cox), the distribution of training risk scores (risk percentiles) and the risk-group thresholds.

    The predictor's network runs in eval mode over ``data_loader`` (the training cases with the evaluation
    transforms, partitioned across ranks); the predictions of all ranks are gathered (each case once) so every rank
    sets the same values.

    Args:
        predictor: a :class:`common.survival.networks.SurvivalPredictor`.
        data_loader: the training cases (deterministic transforms).
        amp: autocast of the forward pass on CUDA.
        prepare_batch: batch preparation (see :func:`common.survival.engines.prepare_survival_batch`).
    """

    def __init__(
        self,
        predictor: torch.nn.Module,
        data_loader: Iterable,
        amp: str = "none",
        prepare_batch: Callable = prepare_survival_batch,
    ) -> None:
        self.predictor = predictor
        self.data_loader = data_loader
        self.amp = str(amp).lower()
        self.prepare_batch = prepare_batch

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self)

    @torch.no_grad()
    def __call__(self, engine: Engine) -> None:
        device = engine.state.device
        amp = self.amp if torch.device(device).type == "cuda" else "none"
        collector = SurvivalPredictionCollector()
        network = self.predictor.network
        training = network.training
        network.eval()
        try:
            for batch in self.data_loader:
                image, targets = self.prepare_batch(batch, device, True)
                covariates = self.predictor.standardize_covariates(targets["covariates"])
                with autocast(device, amp):
                    out = network(image, covariates if covariates.shape[1] else None)
                risk = self.predictor.risk_score(out.float())
                collector.add(batch_case_ids(batch, image.shape[0]), risk, targets["time"], targets["event"])
        finally:
            network.train(training)
        gathered = collector.gather()
        risk = torch.as_tensor(gathered["risk"], dtype=torch.float32)
        self.predictor.calibrate(risk, torch.as_tensor(gathered["time"]), torch.as_tensor(gathered["event"]))
        logger.info(f"calibrated on {len(risk)} training case(s)")


def usable_horizons(horizons: Sequence[float], time: np.ndarray, train_time: np.ndarray | None = None) -> list[float]:
    """The horizons at which IPCW metrics are defined (see :func:`common.survival.metrics.followup_window`)."""
    first, last, _ = followup_window(time, train_time)
    return [float(h) for h in horizons if first <= float(h) < last]


class SurvivalMetricsHandler:
    """Collect the evaluator's per-case predictions, gather them from all ranks (each case once) and, when the cases
    have outcomes, compute the survival metrics into ``engine.state.metrics``.

    Attach it before the handlers that read the metrics (recorder, best checkpoint). After each run
    ``engine.state.survival`` holds ``predictions`` (``case_id``, ``risk_score``, ``risk_percentile``,
    ``risk_group`` labels, ``p_event`` per horizon, ``time``, ``event``), ``group_labels`` and ``group_thresholds``
    (the predictor's) and, with outcomes, ``metrics`` (every value of
    :func:`common.survival.metrics.survival_metrics`, tables included, the Kaplan-Meier curves of the predicted risk
    groups among them) and ``horizons`` (those used). Rank 0 logs one line on the risk groups (every group, empty
    ones said; the log-rank test with outcomes): :func:`describe_risk_groups`.

    Float metrics: ``harrell_c`` and ``uno_c`` with ``_lo``/``_hi`` (95% CI), ``auc_<h>``, ``auc_mean``,
    ``brier_<h>``, ``ibs``, ``calibration_ici``, ``logrank_p`` (risk groups by the training thresholds).

    Args:
        predictor: the predictor (its horizons, labels and thresholds).
        train_time, train_event: the training cohort (years, 0/1), whose censoring distribution weights the IPCW
            metrics (Uno's C, td-AUC, Brier).
        grid: the times of the evaluator's ``survival_grid`` (integrated Brier score).
        calibration_horizon: horizon of the calibration table (default: the middle horizon).
        n_bins: calibration bins (risk deciles).
        compute: compute metrics (off: only gather the predictions, e.g. inference without outcomes).
    """

    def __init__(
        self,
        predictor: torch.nn.Module,
        train_time: Sequence[float] | None = None,
        train_event: Sequence[float] | None = None,
        grid: Sequence[float] | None = None,
        calibration_horizon: float | None = None,
        n_bins: int = 10,
        compute: bool = True,
    ) -> None:
        self.predictor = predictor
        self.train_time = None if train_time is None else np.asarray(train_time, dtype=float)
        self.train_event = None if train_event is None else np.asarray(train_event, dtype=float)
        self.grid = None if grid is None else np.asarray(grid, dtype=float)
        self.calibration_horizon = calibration_horizon
        self.n_bins = int(n_bins)
        self.compute = bool(compute)
        self.collector = SurvivalPredictionCollector()

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, lambda e: self.collector.reset())
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._add)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def _add(self, engine: Engine) -> None:
        out = engine.state.output
        self.collector.add(
            out["case_id"],
            out["risk_score"],
            out["time"],
            out["event"],
            surv_at_horizons=out["survival"],
            surv_grid=out.get("survival_grid"),
        )

    def __call__(self, engine: Engine) -> None:
        engine.state.survival = self.summarize(self.collector.gather())
        metrics = engine.state.survival.get("metrics") or {}
        engine.state.metrics.update(
            {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        )

    def summarize(self, g: dict[str, np.ndarray]) -> dict[str, Any]:
        """What ``engine.state.survival`` holds (see the class description) for the gathered predictions ``g``
        (:meth:`common.survival.metrics.SurvivalPredictionCollector.gather`); rank 0 logs the risk groups."""
        risk = torch.as_tensor(g["risk"], dtype=torch.float32)
        horizons = [float(h) for h in self.predictor.horizons.tolist()]
        labels = list(self.predictor.group_labels)
        groups = self.predictor.risk_group(risk).tolist()
        predictions = {
            "case_id": list(g["case_id"]),
            "risk_score": g["risk"].tolist(),
            "risk_percentile": self.predictor.risk_percentile(risk).tolist(),
            "risk_group": [labels[i] for i in groups],
            "p_event": {h: (1.0 - g["surv_at_horizons"][:, j]).tolist() for j, h in enumerate(horizons)},
            "time": g["time"].tolist(),
            "event": g["event"].tolist(),
        }
        thresholds = [float(t) for t in self.predictor.group_thresholds.tolist()]
        survival = {"predictions": predictions, "group_labels": labels, "group_thresholds": thresholds}
        has_outcomes = len(g["time"]) > 0 and np.isfinite(g["time"]).all() and np.isfinite(g["event"]).all()
        metrics, usable = (
            self._metrics(g, horizons, predictions["risk_group"]) if self.compute and has_outcomes else (None, [])
        )
        if metrics is not None:
            survival.update({"metrics": metrics, "horizons": usable})
        if get_rank() == 0:
            km = None if metrics is None else metrics["km"]
            logger.info(describe_risk_groups(risk_group_table(predictions, labels, thresholds, km), km))
        return survival

    def _metrics(self, g: dict, horizons: list[float], groups: list[str]) -> tuple[dict[str, Any] | None, list[float]]:
        """The survival metrics of the gathered cases and the usable horizons among ``horizons``; no metrics (with a
        warning) without a usable horizon or an event."""
        usable = usable_horizons(horizons, g["time"], self.train_time)
        if len(usable) < len(horizons):
            first, last, _ = followup_window(g["time"], self.train_time)
            logger.warning(
                f"horizons {[h for h in horizons if h not in usable]} are outside the follow-up window "
                f"[{first:.3g}, {last:.3g}) years of these {len(g['time'])} case(s): not evaluated there."
            )
        if not usable or not np.any(g["event"] > 0):
            logger.warning("no usable horizon or no event among these cases: no survival metrics.")
            return None, usable
        columns = [horizons.index(h) for h in usable]
        kwargs: dict[str, Any] = {}
        if self.grid is not None and g.get("surv_grid") is not None:
            first, last, _ = followup_window(g["time"], self.train_time)
            inside = (self.grid >= first) & (self.grid < last)
            if inside.sum() >= 2:
                kwargs = {"surv_grid": g["surv_grid"][:, inside], "grid": self.grid[inside]}
        middle = usable[len(usable) // 2]
        calibration_horizon = self.calibration_horizon if self.calibration_horizon in usable else middle
        metrics = survival_metrics(
            g["risk"],
            g["time"],
            g["event"],
            horizons=usable,
            surv_at_horizons=g["surv_at_horizons"][:, columns],
            train_time=self.train_time,
            train_event=self.train_event,
            calibration_horizon=calibration_horizon,
            n_bins=self.n_bins,
            groups=groups,
            **kwargs,
        )
        return metrics, usable


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (np.generic, torch.Tensor)):
        value = value.item() if getattr(value, "ndim", 0) == 0 else value.tolist()
        return _json_safe(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def risk_group_table(
    predictions: dict, labels: Sequence[str], thresholds: Sequence[float], km: dict | None = None
) -> list[dict[str, Any]]:
    """One row per risk group, lowest risk first, a group without cases included.

    Args:
        predictions: per-case ``risk_group`` labels, with ``time`` and ``event`` when the outcomes are known.
        labels: every group name, lowest risk first.
        thresholds: the ``len(labels) - 1`` risk thresholds between the groups.
        km: :func:`common.survival.metrics.km_by_group` of these cases, when computed (its notes are used).

    Returns:
        ``{"risk_group", "risk_score_from", "risk_score_to", "cases"[, "events"], "note"}`` per group: the group
        holds risk scores in ``[risk_score_from, risk_score_to)``; ``events`` only when every case has an
        outcome; ``note`` says when a group is empty.

    Raises:
        ValueError: when ``thresholds`` does not have one value fewer than ``labels``.
    """
    if len(thresholds) != len(labels) - 1:
        raise ValueError(
            f"{len(labels)} risk groups {list(labels)!r} need {len(labels) - 1} thresholds, got {thresholds!r}."
        )
    bounds = [-math.inf, *[float(t) for t in thresholds], math.inf]
    group = list(predictions["risk_group"])
    times = list(predictions.get("time") or [])
    outcomes = len(times) == len(group) > 0 and all(math.isfinite(t) for t in times)
    rows = []
    for g, label in enumerate(labels):
        members = [i for i, x in enumerate(group) if x == label]
        row: dict[str, Any] = {
            "risk_group": label,
            "risk_score_from": bounds[g],
            "risk_score_to": bounds[g + 1],
            "cases": len(members),
        }
        if outcomes:
            row["events"] = int(sum(predictions["event"][i] for i in members))
        note = (km or {}).get(label, {}).get("note", "")
        if not members and not note:
            note = f"empty: no case is in {label}"
        rows.append({**row, "note": note})
    return rows


def describe_risk_groups(rows: Sequence[dict], km: dict | None = None) -> str:
    """One line on the risk groups (every group named, empty ones said) and, with ``km``, the log-rank test."""
    parts = []
    for row in rows:
        text = f"{row['risk_group']} {row['cases']} case(s)"
        if "events" in row:
            text += f", {row['events']} event(s)"
        parts.append(text + (" (empty)" if row["cases"] == 0 else ""))
    line = "risk groups: " + "; ".join(parts)
    if km is not None:
        p = km.get("logrank_p")
        line += f"; {km['logrank_note']}" + (f": p = {p:.3g}" if p is not None and math.isfinite(p) else "")
    return line


def draw_km_by_group(ax, km: dict, labels: Sequence[str]) -> None:
    """Kaplan-Meier curves of ``km`` (:func:`common.survival.metrics.km_by_group`) on a matplotlib axis: one step
    curve per group, and for an empty group a legend entry saying so (no curve); the title gives the log-rank p or
    says why it is not computable."""
    for label in labels:
        curve = km[label]
        if curve["n"] == 0:
            ax.plot([], [], label=f"{label} (n=0: empty)")
            continue
        ax.step(
            [0.0, *curve["times"]],
            [1.0, *curve["survival"]],
            where="post",
            label=f"{label} (n={curve['n']}, {curve['events']} event(s))",
        )
    p = km.get("logrank_p")
    computable = p is not None and math.isfinite(p)
    ax.set(xlabel="years", ylabel="event-free survival", ylim=(0, 1.02))
    ax.set_title(
        "Kaplan-Meier by risk group" + (f" (log-rank p = {p:.3g})" if computable else " (log-rank: not computable)")
    )
    ax.legend(loc="lower left", fontsize=8)


class SurvivalReport:
    """Write what an evaluation or inference run produced (rank 0, after :class:`SurvivalMetricsHandler`).

    ``<output_dir>/<csv_name>``: one row per case, ``case_id, risk_score, risk_percentile, p_mace_<h>`` for each
    horizon, ``risk_group`` (and ``time, event`` when known). ``risk_groups.csv``: one row per risk group, every
    group even without cases (:func:`risk_group_table`; :class:`SurvivalMetricsHandler` logs the same line). With
    outcomes also ``report.json`` (every metric with its 95% CI, the calibration table, the Kaplan-Meier curves by
    risk group, every group listed, and the log-rank test over the groups with cases) and the plots
    ``km_by_risk_group.png`` and ``calibration.png``.

    Args:
        output_dir: destination folder (created).
        csv_name: file name of the per-case CSV.
        event_name: name of the event in column names (``p_<event_name>_<h>``).
        plots: write the PNG plots.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        csv_name: str = "predictions.csv",
        event_name: str = "mace",
        plots: bool = True,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.csv_name = csv_name
        self.event_name = event_name
        self.plots = bool(plots)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        result = getattr(engine.state, "survival", None)
        if get_rank() == 0 and result:
            self.write(result)

    def write(self, result: dict[str, Any]) -> None:
        """Write the files of ``result`` (:meth:`SurvivalMetricsHandler.summarize`)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        predictions, metrics = result["predictions"], result.get("metrics")
        self._write_csv(predictions)
        km = None if metrics is None else metrics["km"]
        groups = risk_group_table(predictions, result["group_labels"], result["group_thresholds"], km)
        self._write_groups(groups)
        if metrics is not None:
            report = {
                "horizons_years": result["horizons"],
                "n_cases": len(predictions["case_id"]),
                "n_events": int(sum(predictions["event"])),
                **metrics,
            }
            write_text_atomic(self.output_dir / "report.json", json.dumps(_json_safe(report), indent=2))
            if self.plots:
                self._plot(metrics, result["group_labels"])
        logger.info(f"survival predictions of {len(predictions['case_id'])} case(s) in {self.output_dir}")

    def _write_csv(self, predictions: dict) -> None:
        horizons = list(predictions["p_event"])
        outcomes = all(math.isfinite(t) for t in predictions["time"]) and len(predictions["time"]) > 0
        header = [
            "case_id",
            "risk_score",
            "risk_percentile",
            *[f"p_{self.event_name}_{h:g}" for h in horizons],
            "risk_group",
        ]
        if outcomes:
            header += ["time", "event"]

        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(header)
        for i, case in enumerate(predictions["case_id"]):
            row = [
                case,
                f"{predictions['risk_score'][i]:.9g}",  # float32 round trip: no ties made by formatting
                f"{predictions['risk_percentile'][i]:.2f}",
                *[f"{predictions['p_event'][h][i]:.6f}" for h in horizons],
                predictions["risk_group"][i],
            ]
            if outcomes:
                row += [f"{predictions['time'][i]:.6g}", int(predictions["event"][i])]
            writer.writerow(row)
        write_text_atomic(self.output_dir / self.csv_name, buffer.getvalue())

    def _write_groups(self, rows: list[dict]) -> None:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
        write_text_atomic(self.output_dir / "risk_groups.csv", buffer.getvalue())

    def _plot(self, metrics: dict, labels: Sequence[str]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 4))
        draw_km_by_group(ax, metrics["km"], labels)
        fig.tight_layout()
        fig.savefig(self.output_dir / "km_by_risk_group.png", dpi=120)
        plt.close(fig)

        table = metrics.get("calibration") or {}
        bins = table.get("bins") or []
        if bins:
            fig, ax = plt.subplots(figsize=(4.5, 4.5))
            predicted = [b["predicted"] for b in bins]
            observed = [b["observed"] for b in bins]
            top = max([*predicted, *observed, 0.05]) * 1.05
            ax.plot([0, top], [0, top], color="grey", lw=1, ls="--", label="ideal")
            ax.plot(predicted, observed, "o-", label="risk deciles")
            ax.set(xlabel="predicted probability", ylabel="observed (Kaplan-Meier)", xlim=(0, top), ylim=(0, top))
            horizon = table.get("horizon")
            ax.set_title(f"calibration at {horizon:g} years" if horizon is not None else "calibration")
            ax.legend(loc="upper left", fontsize=8)
            fig.tight_layout()
            fig.savefig(self.output_dir / "calibration.png", dpi=120)
            plt.close(fig)


def case_values(batch: Any, output: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-case predictions of a :class:`common.survival.engines.SurvivalEvaluator` iteration as JSON values
    (``risk``, ``time``, ``event``, ``surv_at_horizons`` and ``surv_grid`` when computed): what an inference run
    keeps of each case (:class:`common.engines.cases.CaseRun` ``values``) to build the cohort's tables
    (:class:`CohortReport`)."""
    rows = []
    for i in range(len(output["case_id"])):
        row = {
            name: float(output[key][i]) for name, key in (("risk", "risk_score"), ("time", "time"), ("event", "event"))
        }
        row["surv_at_horizons"] = [float(v) for v in output["survival"][i].tolist()]
        if output.get("survival_grid") is not None:
            row["surv_grid"] = [float(v) for v in output["survival_grid"][i].tolist()]
        rows.append(row)
    return rows


class CohortReport:
    """The cohort tables of an inference run from the records of its cases (:func:`case_values`): the predictions,
    risk groups and, with outcomes, metrics of :class:`SurvivalMetricsHandler` written by :class:`SurvivalReport`;
    the ``merge`` of :class:`common.engines.cases.CaseRun` (rank 0, after every rank is done, so cases written by
    an earlier run or another rank are in the tables).

    Args:
        metrics: computes the predictions' groups and metrics (its ``summarize``).
        report: writes them.
    """

    def __init__(self, metrics: SurvivalMetricsHandler, report: SurvivalReport) -> None:
        self.metrics = metrics
        self.report = report

    def __call__(self, records: Sequence[Mapping[str, Any]]) -> None:
        collector = SurvivalPredictionCollector()
        for record in records:
            v = record["values"]
            grid = None if v.get("surv_grid") is None else [v["surv_grid"]]
            collector.add([record["case_id"]], [v["risk"]], [v["time"]], [v["event"]], [v["surv_at_horizons"]], grid)
        if len(collector):
            self.report.write(self.metrics.summarize(collector.gather()))

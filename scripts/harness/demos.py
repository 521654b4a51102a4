# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The spread of a bundle's quickstart figures: ``scripts/demo.py`` run as a user runs it, once per seed, each in
its own process and output folder, and the evaluation metrics it reports summarised over the runs (mean, sample
standard deviation, min, max). A model card's quickstart figures are one draw of this; a run on another CPU (another
float summation order) is another draw of the same kind."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.bundle import ROOT
from common.bundle_tools.launch import format_overrides
from common.bundle_tools.registry import describe
from scripts.harness.tools import print_table

__all__ = ["demo_command", "demo_spread", "spread"]


def demo_command(bundle: str, seed: int, output_dir: str | Path, **overrides: Any) -> list[str]:
    """The quickstart command of ``bundle`` with ``seed``, writing into ``output_dir``."""
    settings = {"bundle": bundle, "seed": int(seed), "output_dir": str(output_dir), **overrides}
    return [sys.executable, str(ROOT / "scripts" / "demo.py"), *format_overrides(settings)]


def spread(runs: Mapping[int, Mapping[str, float]], keys: Sequence[str]) -> dict[str, dict[str, float]]:
    """``{metric: {"mean", "std", "min", "max", "n"}}`` of ``keys`` over ``runs`` (``{seed: metrics}``); ``std`` is
    the sample standard deviation (0 for one run)."""
    summary = {}
    for key in keys:
        values = [float(m[key]) for m in runs.values() if key in m]
        if not values:
            continue
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        summary[key] = {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values)}
        summary[key]["n"] = len(values)
    return summary


def demo_spread(
    bundle: str = "autoencoder_3d",
    seeds: Sequence[int] = (0, 1, 2),
    work_dir: str | None = None,
    output: str | None = None,
    **overrides: Any,
) -> dict:
    """Run the quickstart of ``bundle`` once per seed and report the spread of its evaluation metrics.

    Args:
        bundle: a bundle name.
        seeds: the ``seed`` of each run (every other setting is the quickstart's).
        work_dir: where each run's ``seed<k>/`` output folder goes (default: a temporary folder, removed).
        output: a JSON file receiving every run's metrics and the summary.
        overrides: passed to ``scripts/demo.py`` (``--preset brats``, ``--num_threads 2``, a bundle override).

    Returns:
        ``{"bundle", "runs": {seed: metrics}, "summary": {metric: {"mean", "std", "min", "max", "n"}}}``.
    """
    described = describe(bundle)
    keys = [*described.reported_metrics]
    with tempfile.TemporaryDirectory(prefix="demo_spread_") as tmp:
        root = Path(work_dir or tmp)
        runs: dict[int, dict[str, float]] = {}
        for seed in seeds:
            out = root / f"seed{int(seed)}"
            cmd = demo_command(described.name, seed, out, **overrides)
            print("$ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            eval_dirs = sorted(out.rglob("eval*/metrics.json"))
            if len(eval_dirs) != 1:
                raise RuntimeError(f"{out}: expected one evaluation metrics.json, found {eval_dirs}")
            latest = json.loads(eval_dirs[0].read_text())["latest"]
            runs[int(seed)] = {k: v for k, v in latest.items() if isinstance(v, (int, float))}
    summary = spread(runs, keys)
    rows = [[seed, *(f"{runs[seed].get(k, float('nan')):.4g}" for k in keys)] for seed in runs]
    for stat in ("mean", "std", "min", "max"):
        rows.append([stat, *(f"{summary[k][stat]:.4g}" if k in summary else "-" for k in keys)])
    print_table(["seed", *keys], rows)
    result = {"bundle": described.name, "overrides": overrides, "runs": runs, "summary": summary}
    if output:
        Path(output).write_text(json.dumps(result, indent=2) + "\n")
    return result

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Helpers for the bundle notebooks: matplotlib setup, config tables, slice plots, training curves, clean-up.

Figures are built with ``matplotlib.figure.Figure`` (not ``pyplot``), so they work with any backend, are shown
once when they are the last expression of a notebook cell, and can be written with ``fig.savefig(...)`` from a
plain script.

Example::

    from common.notebooks import plot_comparison, plot_training_curves, setup_matplotlib

    setup_matplotlib()
    plot_training_curves("runs/ae/metrics.csv", tags=["train/recon_loss", "val_psnr"])
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.bundle import bundle_root
from common.handlers.images import ORIENTATIONS, comparison_panel, orthogonal_slices

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from monai.bundle import ConfigParser

__all__ = [
    "config_table",
    "plot_comparison",
    "plot_orthogonal_slices",
    "plot_training_curves",
    "read_metrics_csv",
    "remove_workdir",
    "run_parser",
    "setup_matplotlib",
]

_MAX_CELL_CHARS = 80


def setup_matplotlib() -> str:
    """Select matplotlib's inline backend inside a Jupyter kernel, the headless ``Agg`` backend elsewhere.

    Returns:
        The name of the active backend.
    """
    import matplotlib

    shell = None
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        pass
    if shell is not None and getattr(shell, "kernel", None) is not None:
        shell.run_line_magic("matplotlib", "inline")
    else:
        matplotlib.use("Agg")
    return str(matplotlib.get_backend())


def _cell(value: Any) -> str:
    """One markdown table cell: compact JSON (strings unquoted), pipes escaped, long values shortened.

    Args:
        value: a raw config value or a resolved object.
    """
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    text = " ".join(text.split()).replace("|", "\\|")
    if len(text) > _MAX_CELL_CHARS:
        text = text[: _MAX_CELL_CHARS - 3] + "..."
    return f"`{text}`" if text else ""


def config_table(parser: ConfigParser, ids: Iterable[str], resolve: bool = True) -> str:
    """A markdown table of config ids: the value written in the config and, for expressions and references,
    the value it resolves to.

    Args:
        parser: a ``monai.bundle.ConfigParser`` holding the (merged) bundle config.
        ids: the ids to list, e.g. ``["patch_size", "lr", "max_epochs"]`` (nested ids use ``#``).
        resolve: evaluate ``$`` expressions and ``@`` references (this instantiates what they refer to);
            with ``False`` the resolved column is left empty.

    Raises:
        KeyError: naming the id when it is not in the config.
    """
    rows = ["| id | in the config | resolved |", "|---|---|---|"]
    for key in ids:
        if key not in parser:
            raise KeyError(f"config id {key!r} is not in the parsed config.")
        raw = parser[key]
        dynamic = isinstance(raw, str) and raw.startswith(("$", "@"))
        resolved = _cell(parser.get_parsed_content(key)) if dynamic and resolve else ""
        rows.append(f"| `{key}` | {_cell(raw)} | {resolved} |")
    return "\n".join(rows)


def _display_slices(volume: torch.Tensor | np.ndarray, index: Sequence[int] | None = None) -> list[np.ndarray]:
    """Orthogonal slices rotated like :func:`common.handlers.images.comparison_panel` (superior/anterior up).

    Args:
        volume: (C, X, Y, Z) or (X, Y, Z).
        index: the (x, y, z) voxel the slices pass through; default the centre.
    """
    return [np.rot90(s) for s in orthogonal_slices(volume, index)]


def _grey_cell(
    axes: np.ndarray, row: int, col: int, image: np.ndarray, limits: tuple, column: str, row_label: str
) -> None:
    """Draw ``image`` in grey (``limits``: the ``vmin, vmax`` of the scale) at ``axes[row, col]``, without ticks;
    a cell of the first row is titled ``column``, one of the first column labelled ``row_label``."""
    ax = axes[row, col]
    ax.imshow(image, cmap="gray", vmin=limits[0], vmax=limits[1], interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])
    if row == 0:
        ax.set_title(column)
    if col == 0:
        ax.set_ylabel(row_label)


def plot_orthogonal_slices(
    volumes: Sequence[torch.Tensor | np.ndarray] | torch.Tensor,
    titles: Sequence[str] | None = None,
    index: Sequence[int] | None = None,
    vmin: float | None = 0.0,
    vmax: float | None = 1.0,
    size: float = 2.2,
) -> Figure:
    """Plot the central sagittal, coronal and axial slices of several volumes, one volume per row.

    Slices are taken by :func:`common.handlers.images.orthogonal_slices` and rotated as in
    :func:`common.handlers.images.comparison_panel`, so for RAS volumes superior (sagittal, coronal) and
    anterior (axial) point up.

    Args:
        volumes: a batch tensor (B, C, X, Y, Z) or a sequence of (C, X, Y, Z) / (X, Y, Z) volumes.
        titles: one row label per volume; default ``"volume i"``.
        index: the (x, y, z) voxel the slices pass through; default the centre of each volume.
        vmin: lower end of the grey scale (``None``: each slice's minimum).
        vmax: upper end of the grey scale (``None``: each slice's maximum).
        size: height and width of one subplot in inches.

    Raises:
        ValueError: when there is no volume or the number of titles differs from the number of volumes.
    """
    from matplotlib.figure import Figure

    volumes = list(volumes)
    if not volumes:
        raise ValueError("plot_orthogonal_slices needs at least one volume, got none.")
    titles = [f"volume {i}" for i in range(len(volumes))] if titles is None else list(titles)
    if len(titles) != len(volumes):
        raise ValueError(f"got {len(titles)} titles for {len(volumes)} volumes.")
    fig = Figure(figsize=(3 * size, len(volumes) * size), layout="constrained")
    axes = fig.subplots(len(volumes), 3, squeeze=False)
    for row, (volume, title) in enumerate(zip(volumes, titles)):
        for col, (plane, slice_2d) in enumerate(zip(ORIENTATIONS, _display_slices(volume, index))):
            _grey_cell(axes, row, col, slice_2d, (vmin, vmax), column=plane, row_label=title)
    return fig


def plot_comparison(
    image: torch.Tensor | np.ndarray,
    recon: torch.Tensor | np.ndarray,
    error_scale: float = 1.0,
    title: str | None = None,
    width: float = 9.0,
) -> Figure:
    """Plot :func:`common.handlers.images.comparison_panel` as a 3 x 3 grid: rows sagittal, coronal and axial
    central slices; columns input, reconstruction and ``|input - reconstruction| * error_scale``, all on a
    [0, 1] grey scale.

    The panel's cells are zero-padded to a common size; here each cell is cut back to its slice, so volumes with
    very different sides (e.g. 96 x 77 x 32) keep their proportions without black margins.

    Args:
        image: the input, (C, X, Y, Z) or (X, Y, Z), intensities in [0, 1].
        recon: the reconstruction, same spatial shape.
        error_scale: multiplier of the absolute error column.
        title: figure title.
        width: figure width in inches (the height follows the slices' proportions).

    Raises:
        ValueError: when the spatial shapes differ or ``error_scale`` is negative.
    """
    from matplotlib.figure import Figure

    panel = comparison_panel(image, recon, error_scale=error_scale)
    shapes = [s.shape for s in _display_slices(image)]
    cell_h, cell_w = panel.shape[0] // 3, panel.shape[1] // 3
    heights = [h for h, _ in shapes]
    scale = width / (3 * cell_w)  # inches per voxel
    fig = Figure(figsize=(width, scale * sum(heights) + (0.9 if title else 0.5)), layout="constrained")
    axes = fig.subplots(3, 3, squeeze=False, gridspec_kw={"height_ratios": heights})
    error_label = "|error|" if error_scale == 1 else f"|error| x {error_scale:g}"
    for row, (plane, (h, w)) in enumerate(zip(ORIENTATIONS, shapes)):
        for col, label in enumerate(("input", "reconstruction", error_label)):
            cell = panel[row * cell_h : row * cell_h + h, col * cell_w : col * cell_w + w]
            _grey_cell(axes, row, col, cell, (0.0, 1.0), column=label, row_label=plane)
    if title:
        fig.suptitle(title)
    return fig


def read_metrics_csv(path: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Read a long-format ``metrics.csv`` (``step,epoch,tag,value``) into ``{tag: [(step, value), ...]}``.

    Rows keep the file order, so a resumed run's values follow the ones written before the interruption.

    Args:
        path: the CSV written by ``TrainingMonitor``/``MetricsRecorder``.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: naming the file when its header lacks ``step``, ``tag`` or ``value``.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"metrics file {str(file)!r} does not exist; run training first.")
    series: dict[str, list[tuple[int, float]]] = {}
    with open(file, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"step", "tag", "value"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{str(file)!r} is not a step,epoch,tag,value metrics file; missing {sorted(missing)}.")
        for row in reader:
            series.setdefault(row["tag"], []).append((int(row["step"]), float(row["value"])))
    return series


def plot_training_curves(
    metrics: str | os.PathLike | Mapping[str, Sequence[tuple[int, float]]],
    tags: Sequence[str] | None = None,
    ncols: int = 3,
    size: tuple[float, float] = (3.6, 2.6),
) -> Figure:
    """Plot one curve per tag of a long-format ``metrics.csv`` against the training iteration.

    Tags absent from the file (for example adversarial losses before their warm-up ends) are skipped.

    Args:
        metrics: the path of ``metrics.csv`` or what :func:`read_metrics_csv` returns.
        tags: the tags to plot, in order; default every tag in the file.
        ncols: subplots per row.
        size: width and height of one subplot in inches.

    Raises:
        ValueError: when none of the requested tags is present.
    """
    from matplotlib.figure import Figure

    series = read_metrics_csv(metrics) if isinstance(metrics, (str, os.PathLike)) else dict(metrics)
    selected = [t for t in (tags if tags is not None else sorted(series)) if t in series]
    if not selected:
        raise ValueError(f"none of the tags {list(tags or [])} is in the metrics; available: {sorted(series)}.")
    ncols = max(1, min(int(ncols), len(selected)))
    nrows = math.ceil(len(selected) / ncols)
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, tag in zip(axes, selected):
        steps, values = zip(*series[tag])
        ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3)
        ax.set_title(tag, fontsize="medium")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    for ax in axes[len(selected) :]:
        ax.set_visible(False)
    return fig


def run_parser(
    bundle: str | os.PathLike,
    output_dir: str | os.PathLike,
    config: str = "inference.json",
    overrides: Mapping[str, Any] | None = None,
) -> ConfigParser:
    """A ``ConfigParser`` of a bundle's ``config`` pointed at a trained run: ``output_dir`` is set, so the network
    and data settings come from the run's ``configs/run.json`` (see :func:`common.runs.run_settings`), and
    ``overrides`` are applied last, as on the command line. ``parser.get_parsed_content("network_def")`` then
    builds the network the run trained, and ``ckpt_path`` finds its weights.

    Args:
        bundle: a bundle name (a folder under ``bundles/``) or a bundle folder.
        output_dir: the run folder (the ``--output_dir`` of its training).
        config: the config file of the bundle to read (``inference.json``; ``evaluate.json`` is merged onto
            ``train.json``).
        overrides: config ids to set after the run's settings.
    """
    from monai.bundle import ConfigParser

    root = Path(bundle) if Path(bundle).is_dir() else Path(bundle_root(str(bundle)))
    configs = root / "configs"
    files = [configs / "train.json", configs / config] if config == "evaluate.json" else [configs / config]
    parser = ConfigParser()
    parser.read_config([str(f) for f in files])
    parser.update({"bundle_root": str(root), "output_dir": str(output_dir), **dict(overrides or {})})
    return parser


def remove_workdir(path: str | os.PathLike) -> None:
    """Delete a notebook's working folder after closing the root logger's log files inside it.

    ``common.utils.setup_logging`` mirrors the log to a file in the output folder; that handler is closed and
    removed first, so a later run in the same kernel does not keep writing to a deleted file.

    Args:
        path: the folder to delete (missing folders are ignored).
    """
    folder = Path(path).resolve()
    root = logging.getLogger()
    for handler in list(root.handlers):
        filename = getattr(handler, "baseFilename", None)
        if isinstance(handler, logging.FileHandler) and filename and Path(filename).resolve().is_relative_to(folder):
            root.removeHandler(handler)
            handler.close()
    shutil.rmtree(folder, ignore_errors=True)

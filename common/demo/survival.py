# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""A synthetic cohort for major adverse cardiovascular events (MACE) whose true risk is known.

Each case is a non-contrast chest CT phantom (:func:`make_cardiac_phantom`) with calcified coronary plaques on the
heart surface. Their number and size grow with the case's plaque burden, their density (HU) with its plaque
intensity. Event times follow a Weibull proportional-hazards model whose log-hazard is dominated by these two
image features (:func:`true_log_hazard`), with random censoring, so the ceiling a model can reach on the cohort is
known (:func:`oracle_c_index`).

Example::

    python -m common.demo.survival --out_dir demo_mace --n_cases 120
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from common.demo.images import validate_triple, write_nifti
from common.survival.cohort import SPLIT_NAMES, read_cohort_csv, split_cohort
from common.utils import write_text_atomic

__all__ = [
    "AGE_RANGE",
    "BETAS",
    "CENSORING",
    "CSV_COLUMNS",
    "PLAQUE_HU_RANGE",
    "REGION_MIN_SHAPE",
    "cardiac_region",
    "main",
    "make_cardiac_phantom",
    "make_mace_cohort",
    "oracle_c_index",
    "true_log_hazard",
]

# log-hazard coefficients per standard deviation of each factor (sex: per male, 0/1); the image features dominate
BETAS = {"burden": 1.5, "intensity": 1.0, "age": 0.4, "sex": 0.3}
AGE_RANGE = (45, 80)  # ages are drawn uniformly from these whole years (inclusive)
AGE_MEAN, AGE_SD = 62.5, 10.0  # fixed population constants standardising age in the log-hazard
UNIFORM_MEAN, UNIFORM_SD = 0.5, 1.0 / math.sqrt(12.0)  # of plaque burden and intensity, both drawn U(0, 1)
PLAQUE_HU_RANGE = (200.0, 900.0)  # peak plaque density at intensity 0 and 1 (Agatston counts voxels >= 130 HU)
MAX_PLAQUES = 8
CENSORING = ("uniform", "none")
CSV_COLUMNS = ("case_id", "image", "time", "event", "age", "sex", "true_risk", "split")
WEIBULL_SHAPE = 1.5
FOLLOWUP_HALF_WIDTH = 0.75  # administrative follow-up is U(m (1 - 0.75), m (1 + 0.75)) for median m
PHANTOM_MIN_SIZE = 16
# the cardiac region: an ellipsoid (normalised coordinates) around every heart position and size, widened by
# 3 voxels for the plaques (whose size is set in voxels); it holds no bone for shapes of at least 40 x 40 x 32
REGION_CENTER, REGION_RADII, REGION_PAD_VOXELS = (0.0, 0.1, -0.225), (0.354, 0.264, 0.422), 3.0
REGION_MIN_SHAPE = (40, 40, 32)
_CALIBRATION_SEED, _CALIBRATION_SIZE = 20240725, 20000
_FORMAT_VERSION = 1


def true_log_hazard(burden: Any, intensity: Any, age: Any, sex: Any) -> np.ndarray:
    """The true log-hazard ratio of the demo cohort.

    ``eta = 1.5 * burden_z + 1.0 * intensity_z + 0.4 * age_z + 0.3 * sex`` (``BETAS``), where the z-scores use the
    fixed population constants of the drawing distributions (burden and intensity ``U(0, 1)``: mean 0.5, standard
    deviation ``1/sqrt(12)``; age: mean 62.5, standard deviation 10 years), so a case's risk does not depend on the
    rest of the cohort. ``sex`` is 1 for male, 0 for female. The image features carry about 92% of the variance
    of ``eta``.

    Args:
        burden: plaque burden(s) in ``[0, 1]``.
        intensity: plaque intensity (intensities) in ``[0, 1]``.
        age: age(s) in years.
        sex: 0/1.

    Returns:
        ``eta`` as a float64 array (0-d for scalar inputs).
    """
    burden_z = (np.asarray(burden, dtype=np.float64) - UNIFORM_MEAN) / UNIFORM_SD
    intensity_z = (np.asarray(intensity, dtype=np.float64) - UNIFORM_MEAN) / UNIFORM_SD
    age_z = (np.asarray(age, dtype=np.float64) - AGE_MEAN) / AGE_SD
    sex = np.asarray(sex, dtype=np.float64)
    return BETAS["burden"] * burden_z + BETAS["intensity"] * intensity_z + BETAS["age"] * age_z + BETAS["sex"] * sex


def _grid(shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalised coordinates in ``[-1, 1]`` per axis, ``(X, Y, Z)`` = (left-right, posterior-anterior, I-S)."""
    return np.meshgrid(*[np.linspace(-1.0, 1.0, s, dtype=np.float32) for s in shape], indexing="ij")


def _validate_shape(shape: Sequence[int]) -> tuple[int, int, int]:
    shape = validate_triple("shape", shape, positive_int=True)
    if min(shape) < PHANTOM_MIN_SIZE:
        raise ValueError(f"shape must be at least {PHANTOM_MIN_SIZE} voxels per axis, got {shape!r}")
    return shape


def cardiac_region(shape: Sequence[int] = (48, 48, 40)) -> np.ndarray:
    """The fixed region of :func:`make_cardiac_phantom` volumes that holds the heart with all its plaques.

    It is the same for every seed: an ellipsoid around the range of heart positions and sizes, widened by 3 voxels
    for the plaques. For shapes of at least ``REGION_MIN_SHAPE`` (40 x 40 x 32) it holds every plaque voxel and no
    bone, so voxels >= 130 HU inside it are plaque: ``(hu - 130).clip(0)[cardiac_region(hu.shape)].sum()`` is a
    calcium-score-like feature. (At smaller shapes a plaque is large in normalised units and the region may reach
    bone.)

    Args:
        shape: the volume shape ``(X, Y, Z)``, at least 16 per axis.

    Returns:
        A boolean array of ``shape``.
    """
    shape = _validate_shape(shape)
    x, y, z = _grid(shape)
    cx, cy, cz = REGION_CENTER
    rx, ry, rz = (r + REGION_PAD_VOXELS * 2.0 / (s - 1) for r, s in zip(REGION_RADII, shape))
    return ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 + ((z - cz) / rz) ** 2 <= 1.0


def _validate_unit(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _add_plaques(
    hu: np.ndarray,
    rng: np.random.Generator,
    heart: tuple[np.ndarray, np.ndarray],
    burden: float,
    intensity: float,
) -> np.ndarray:
    """Paint calcified plaques on the heart surface (in place); return the mask of their full-density voxels.

    ``ceil(8 * burden)`` plaques (none at burden 0), each a ball of radius ``0.7 + burden`` voxels (+-15%) with
    a one-voxel partial-volume edge, at a random point of the upper two thirds of the heart surface (where the
    coronary arteries run in the epicardial fat); peak density ``200 + 700 * intensity`` HU (+-10%, within
    200..900 HU). Plaque centres are voxel centres, so every plaque has at least one voxel at full density.
    """
    shape = np.asarray(hu.shape)
    center, radii = heart
    mask = np.zeros(hu.shape, dtype=bool)
    lo_hu, hi_hu = PLAQUE_HU_RANGE
    for _ in range(int(math.ceil(MAX_PLAQUES * burden))):
        direction = rng.normal(size=3)
        while direction[2] / np.linalg.norm(direction) < -0.4:
            direction = rng.normal(size=3)
        direction /= np.linalg.norm(direction)
        position = center + 1.06 * radii * direction  # just outside the myocardium, in the epicardial fat
        voxel = np.round((position + 1.0) / 2.0 * (shape - 1))
        radius = (0.7 + burden) * rng.uniform(0.85, 1.15)
        peak = float(np.clip((lo_hu + (hi_hu - lo_hu) * intensity) * rng.uniform(0.9, 1.1), lo_hu, hi_hu))
        start = np.maximum(np.floor(voxel - radius - 1).astype(int), 0)
        stop = np.minimum(np.ceil(voxel + radius + 2).astype(int), shape)
        box = tuple(slice(a, b) for a, b in zip(start, stop))
        idx = np.meshgrid(*[np.arange(a, b) for a, b in zip(start, stop)], indexing="ij")
        dist = np.sqrt(sum((i - v) ** 2 for i, v in zip(idx, voxel)))
        weight = np.clip(radius + 0.5 - dist, 0.0, 1.0).astype(np.float32)
        hu[box] = hu[box] * (1.0 - weight) + np.float32(peak) * weight
        mask[box] |= weight >= 1.0
    return mask


def make_cardiac_phantom(
    shape: Sequence[int] = (48, 48, 40),
    seed: int = 0,
    plaque_burden: float = 0.0,
    plaque_intensity: float = 0.5,
    noise_hu: float = 15.0,
    return_masks: bool = False,
) -> np.ndarray | tuple[np.ndarray, dict[str, np.ndarray]]:
    """A seeded non-contrast chest CT phantom in HU with calcified coronary plaques.

    Axes are ``(X, Y, Z)`` with +Y anterior and +Z superior. Air (-1000 HU) around an elliptic body of soft tissue
    (40 HU) under a fat layer (-100 HU); two lungs (-850 HU); the heart (40 HU: without contrast, blood and
    myocardium look alike) in a shell of epicardial fat (-90 HU); a vertebra (700 HU cortex, 250 HU cancellous
    bone) and rib segments (600 HU). Edges are slightly blurred (Gaussian, sigma 0.6 voxel). Then calcified plaques
    are added on the heart surface (see below), unblurred so that even one-voxel plaques keep their density, and
    Gaussian noise of ``noise_hu``. At the demo resolution (48 x 48 x 40 voxels of about 7 x 7 x 8 mm) the
    plaques are a few voxels each, far above the noise (a 15 HU noise never reaches 130 HU from fat or soft
    tissue), and inside the CT window -1000..1000 HU.

    Plaques: ``ceil(8 * plaque_burden)`` of them (none at burden 0) of radius ``0.7 + plaque_burden`` voxels,
    so their number and volume grow with the burden; density ``200 + 700 * plaque_intensity`` HU (+-10%,
    within 200..900 HU, so noise never pushes them out of the window) with a one-voxel partial-volume edge. Each
    plaque is centred on a voxel, so even the smallest has one voxel at full density. Every plaque lies inside
    :func:`cardiac_region`, which holds no bone (for shapes of at least 40 x 40 x 32).

    Args:
        shape: spatial size ``(X, Y, Z)``, at least 16 per axis.
        seed: random seed; the same arguments give the same volume.
        plaque_burden: in ``[0, 1]``: number and size of the plaques.
        plaque_intensity: in ``[0, 1]``: density of the plaques.
        noise_hu: standard deviation of the noise in HU.
        return_masks: also return boolean masks ``{"heart", "plaques", "bone"}`` (``"plaques"``: the voxels at
            full plaque density, before noise).

    Returns:
        A float32 array of ``shape`` in HU, or ``(array, masks)`` with ``return_masks``.

    Raises:
        ValueError: for a shape that is not 3 integers of at least 16, or a burden/intensity outside ``[0, 1]``.
    """
    from scipy.ndimage import gaussian_filter

    shape = _validate_shape(shape)
    burden = _validate_unit("plaque_burden", plaque_burden)
    intensity = _validate_unit("plaque_intensity", plaque_intensity)
    rng = np.random.default_rng(seed)
    x, y, z = _grid(shape)
    hu = np.full(shape, -1000.0, dtype=np.float32)

    def inside(center: Sequence[float], radii: Sequence[float]) -> np.ndarray:
        return ((x - center[0]) / radii[0]) ** 2 + ((y - center[1]) / radii[1]) ** 2 + (
            (z - center[2]) / radii[2]
        ) ** 2 <= 1.0

    bx, by = rng.uniform(0.84, 0.92), rng.uniform(0.66, 0.72)
    body = (x / bx) ** 2 + (y / by) ** 2 <= 1.0
    hu[body] = -100.0
    hu[(x / (bx - 0.07)) ** 2 + (y / (by - 0.07)) ** 2 <= 1.0] = 40.0
    for side in (-1.0, 1.0):
        hu[inside((side * rng.uniform(0.36, 0.42), rng.uniform(-0.08, 0.02), 0.1), (0.28, 0.4, 0.95))] = -850.0
    heart_center = np.array([rng.uniform(-0.06, 0.06), rng.uniform(0.08, 0.12), rng.uniform(-0.3, -0.15)])
    heart_radii = np.array([0.24, 0.18, 0.3]) * rng.uniform(0.92, 1.04, 3)
    hu[inside(heart_center, 1.15 * heart_radii)] = -90.0  # epicardial fat
    heart = inside(heart_center, heart_radii)
    hu[heart] = 40.0
    sx = rng.uniform(-0.03, 0.03)
    spine = (x - sx) ** 2 + (y + 0.45) ** 2
    bone = spine <= 0.12**2
    hu[bone] = 700.0
    hu[spine <= 0.08**2] = 250.0
    ring = np.sqrt((x / (bx - 0.1)) ** 2 + (y / (by - 0.1)) ** 2)
    ribs = (np.abs(ring - 1.0) < 0.04) & (np.cos(np.pi * z / rng.uniform(0.25, 0.35) * 2) > 0.7) & body
    hu[ribs] = 600.0
    bone |= ribs
    hu = gaussian_filter(hu, sigma=0.6)
    plaques = _add_plaques(hu, rng, (heart_center, heart_radii), burden, intensity)
    hu += rng.normal(0.0, float(noise_hu), size=shape).astype(np.float32)
    hu = hu.astype(np.float32)
    if return_masks:
        return hu, {"heart": heart, "plaques": plaques, "bone": bone}
    return hu


def _draw_event_times(
    rng: np.random.Generator, eta: np.ndarray, scale: float, shape: float = WEIBULL_SHAPE
) -> np.ndarray:
    """Weibull proportional-hazards event times: ``S(t | eta) = exp(-(t / scale)^shape * exp(eta))``."""
    return scale * (rng.exponential(size=eta.shape) * np.exp(-eta)) ** (1.0 / shape)


def _draw_censoring(rng: np.random.Generator, n: int, median_followup: float, dropout_rate: float) -> np.ndarray:
    """Censoring times: uniform administrative follow-up (staggered accrual, common end of study) and loss to
    follow-up at ``dropout_rate`` per year."""
    low, high = median_followup * (1 - FOLLOWUP_HALF_WIDTH), median_followup * (1 + FOLLOWUP_HALF_WIDTH)
    administrative = rng.uniform(low, high, size=n)
    if dropout_rate <= 0:
        return administrative
    return np.minimum(administrative, rng.exponential(1.0 / dropout_rate, size=n))


def _draw_cases(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Plaque burden, plaque intensity, age and sex of ``n`` cases (independent draws)."""
    return {
        "burden": rng.uniform(0.0, 1.0, size=n),
        "intensity": rng.uniform(0.0, 1.0, size=n),
        "age": rng.integers(AGE_RANGE[0], AGE_RANGE[1] + 1, size=n).astype(np.float64),
        "sex": rng.integers(0, 2, size=n).astype(np.float64),
    }


def _baseline_scale(median_followup: float, dropout_rate: float, event_fraction: float) -> float:
    """Weibull scale at which the expected fraction of events within follow-up is ``event_fraction``.

    ``P(event) = E[1 - S(C | eta)]`` over the population of ``eta`` and censoring times ``C``, estimated on a fixed
    reference sample (independent of the cohort's seed) and solved for the scale.
    """
    from scipy.optimize import brentq

    rng = np.random.default_rng(_CALIBRATION_SEED)
    draws = _draw_cases(rng, _CALIBRATION_SIZE)
    eta = true_log_hazard(draws["burden"], draws["intensity"], draws["age"], draws["sex"])
    censor = _draw_censoring(rng, _CALIBRATION_SIZE, median_followup, dropout_rate)

    def excess(log_scale: float) -> float:
        return float(np.mean(1.0 - np.exp(-((censor / math.exp(log_scale)) ** WEIBULL_SHAPE) * np.exp(eta))))

    return math.exp(brentq(lambda s: excess(s) - event_fraction, -10.0, 20.0, xtol=1e-10))


def _params(**kwargs: Any) -> dict[str, Any]:
    """JSON-comparable build parameters (tuples as lists, numbers as floats where given as floats)."""
    return json.loads(json.dumps({"version": _FORMAT_VERSION, **kwargs}))


def _finished(out: Path, params: dict[str, Any]) -> bool:
    """Whether ``out`` holds a complete cohort built with ``params``: its CSV, written last, lists existing images."""
    csv_path, params_path = out / "cohort.csv", out / "cohort.json"
    if not csv_path.is_file() or not params_path.is_file():
        return False
    try:
        if json.loads(params_path.read_text()) != params:
            return False
        with open(csv_path, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, ValueError, csv.Error):
        return False
    return len(rows) == params["n_cases"] and all((out / row.get("image", "")).is_file() for row in rows)


def _validate_cohort_args(
    n_cases: int,
    censoring: str,
    median_followup_years: float,
    event_fraction: float,
    dropout_rate: float,
    val_fraction: float,
) -> None:
    if isinstance(n_cases, bool) or not isinstance(n_cases, (int, np.integer)) or n_cases < 4:
        raise ValueError(f"n_cases must be an integer of at least 4, got {n_cases!r}")
    if censoring not in CENSORING:
        raise ValueError(f"censoring must be one of {CENSORING}, got {censoring!r}")
    if not isinstance(median_followup_years, (int, float)) or not 0 < median_followup_years < 100:
        raise ValueError(f"median_followup_years must be a number in (0, 100), got {median_followup_years!r}")
    if not isinstance(event_fraction, (int, float)) or not 0.05 <= event_fraction <= 0.95:
        raise ValueError(f"event_fraction must be a number in [0.05, 0.95], got {event_fraction!r}")
    if not isinstance(dropout_rate, (int, float)) or not 0 <= dropout_rate < 10:
        raise ValueError(f"dropout_rate must be a number in [0, 10), got {dropout_rate!r}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in (0, 1), got {val_fraction!r}")


def make_mace_cohort(
    out_dir: str | os.PathLike,
    n_cases: int = 120,
    shape: Sequence[int] = (48, 48, 40),
    spacing: Sequence[float] = (7.0, 7.0, 8.0),
    seed: int = 0,
    censoring: str = "uniform",
    median_followup_years: float = 4.0,
    event_fraction: float = 0.35,
    dropout_rate: float = 0.03,
    val_fraction: float = 0.25,
    noise_hu: float = 15.0,
    overwrite: bool = False,
) -> Path:
    """Write a synthetic MACE cohort: chest CT phantoms, follow-up times and events from a known hazard model.

    Per case ``mace_<i:04d>``: plaque burden and intensity ``U(0, 1)``, age uniform over whole years 45..80,
    sex 0/1 with probability 1/2; the true log-hazard ``eta`` of :func:`true_log_hazard` (written as
    ``true_risk``); an event time from a Weibull proportional-hazards model,
    ``S(t | eta) = exp(-(t / scale)^1.5 * exp(eta))``, whose baseline ``scale`` is solved so that an expected
    ``event_fraction`` of the cases has the event within follow-up (1.5: the hazard grows with time).

    Censoring (``"uniform"``): uniform staggered accrual with a common end of study gives each case an
    administrative follow-up ``U(0.25 m, 1.75 m)`` for median ``m = median_followup_years`` (1 to 7 years by
    default, so the default horizons 1, 3 and 5 years lie within follow-up); independent loss to follow-up at
    ``dropout_rate`` per year shortens it further. The observed time is the earlier of event and censoring.
    ``"none"`` observes every event (no censoring).

    Files: ``images/<case_id>.nii.gz`` (float32 HU from :func:`make_cardiac_phantom` with the case's burden and
    intensity, affine ``diag(spacing)``) and ``cohort.csv`` with columns ``case_id, image`` (relative to
    ``out_dir``) ``, time`` (DAYS, ``round(years * 365.25)``, at least 1) ``, event, age, sex, true_risk, split``
    (a seeded ``val_fraction`` split stratified by event, :func:`common.survival.cohort.split_cohort`:
    ``training``/``validation``). The build parameters go to ``cohort.json``. Read the cohort with
    ``read_cohort_csv(csv, covariates=("age", "sex"), time_unit="days")``.

    Building is idempotent: the CSV is written last and atomically (after every image and ``cohort.json``), and a
    cohort whose ``cohort.json`` has the same parameters and whose CSV lists existing images is reused without
    writing anything; an interrupted or differently parameterised build is rebuilt.

    Args:
        out_dir: folder to write into (created when missing).
        n_cases: number of cases (at least 4).
        shape: volume size ``(X, Y, Z)``, at least 16 per axis.
        spacing: voxel size in mm, written into the affines.
        seed: random seed of the whole cohort.
        censoring: ``"uniform"`` or ``"none"``.
        median_followup_years: median administrative follow-up in years.
        event_fraction: expected fraction of cases with an observed event (with ``"uniform"`` censoring).
        dropout_rate: loss to follow-up per year (exponential; 0 for none).
        val_fraction: fraction of validation cases in the ``split`` column.
        noise_hu: image noise in HU.
        overwrite: rebuild even when a finished cohort with the same parameters is there.

    Returns:
        The path of ``cohort.csv``.

    Raises:
        ValueError: for invalid arguments.
    """
    shape = _validate_shape(shape)
    spacing = validate_triple("spacing", spacing)
    _validate_cohort_args(n_cases, censoring, median_followup_years, event_fraction, dropout_rate, val_fraction)
    params = _params(
        n_cases=int(n_cases),
        shape=list(shape),
        spacing=list(spacing),
        seed=int(seed),
        censoring=censoring,
        median_followup_years=float(median_followup_years),
        event_fraction=float(event_fraction),
        dropout_rate=float(dropout_rate),
        val_fraction=float(val_fraction),
        noise_hu=float(noise_hu),
    )
    out = Path(os.path.expanduser(os.fspath(out_dir))).absolute()
    csv_path = out / "cohort.csv"
    if not overwrite and _finished(out, params):
        return csv_path
    out.mkdir(parents=True, exist_ok=True)
    csv_path.unlink(missing_ok=True)  # an interrupted rebuild must not look finished
    cohort_seq, image_seq = np.random.SeedSequence(int(seed)).spawn(2)
    rng = np.random.default_rng(cohort_seq)
    n = int(n_cases)
    draws = _draw_cases(rng, n)
    eta = true_log_hazard(draws["burden"], draws["intensity"], draws["age"], draws["sex"])
    days, event = _outcomes(rng, eta, censoring, median_followup_years, dropout_rate, event_fraction)
    case_seeds = image_seq.generate_state(n)
    rows = [
        {"case_id": f"mace_{i:04d}", "image": f"images/mace_{i:04d}.nii.gz", "time": int(days[i])}
        | {"event": int(event[i]), "age": int(draws["age"][i]), "sex": int(draws["sex"][i])}
        | {"true_risk": f"{eta[i]:.6f}"}
        for i in range(n)
    ]
    for row, case_seed, burden, intensity in zip(rows, case_seeds, draws["burden"], draws["intensity"]):
        volume = make_cardiac_phantom(shape, int(case_seed), float(burden), float(intensity), noise_hu=noise_hu)
        write_nifti(out / row["image"], volume, np.diag([*spacing, 1.0]))
    _write_cohort_table(csv_path, rows, params)
    return csv_path


def _outcomes(
    rng: np.random.Generator,
    eta: np.ndarray,
    censoring: str,
    median_followup_years: float,
    dropout_rate: float,
    event_fraction: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The observed follow-up in days (at least 1) and the event indicators of cases of true log-hazard ``eta``
    (see :func:`make_mace_cohort`): the earlier of the Weibull event time and the censoring time."""
    scale = _baseline_scale(median_followup_years, dropout_rate, event_fraction)
    event_time = _draw_event_times(rng, eta, scale)
    n = len(eta)
    censor = _draw_censoring(rng, n, median_followup_years, dropout_rate) if censoring == "uniform" else None
    years = event_time if censor is None else np.minimum(event_time, censor)
    event = np.ones(n) if censor is None else (event_time <= censor).astype(np.float64)
    return np.maximum(np.round(years * 365.25), 1).astype(int), event


def _write_cohort_table(csv_path: Path, rows: list[dict], params: dict) -> None:
    """Give every row its ``split`` (stratified by event, ``params``' ``val_fraction`` and ``seed``), then write
    ``cohort.json`` and, last and atomically, the CSV: a cohort is finished once its CSV is there."""
    entries = [{"event": float(row["event"]), "index": i} for i, row in enumerate(rows)]
    sections = split_cohort(entries, val_fraction=params["val_fraction"], seed=params["seed"], use_split_column=False)
    for section, items in sections.items():
        for item in items:
            rows[item["index"]]["split"] = section
    write_text_atomic(csv_path.parent / "cohort.json", json.dumps(params, indent=2) + "\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(csv_path, buffer.getvalue())


def oracle_c_index(csv_path: str | os.PathLike, split: str | None = "validation") -> float:
    """Harrell's C-index of the true log-hazard (``true_risk``) on one split of a demo cohort.

    This is the ceiling a model can reach on that split (up to chance): a perfect model predicts ``true_risk``.
    Computed with scikit-survival's ``concordance_index_censored`` (ties in risk count 1/2).

    Args:
        csv_path: the ``cohort.csv`` of :func:`make_mace_cohort`.
        split: ``"training"``, ``"validation"`` (or ``train``/``val``, case-insensitive), or ``None`` for all.

    Returns:
        The C-index in ``[0, 1]``.

    Raises:
        ValueError: for an unknown split or a split without events or cases.
        common.survival.cohort.CohortError: when the CSV is invalid.
    """
    from sksurv.metrics import concordance_index_censored

    entries = read_cohort_csv(csv_path, covariates=("true_risk",), time_unit="days")
    if split is not None:
        wanted = SPLIT_NAMES.get(str(split).strip().lower())
        if wanted is None:
            raise ValueError(f"split must be one of {sorted(SPLIT_NAMES)} or None, got {split!r}")
        entries = [e for e in entries if SPLIT_NAMES.get(str(e["split"]).strip().lower()) == wanted]
    if not entries or not any(e["event"] == 1 for e in entries):
        raise ValueError(f"split {split!r} of {str(csv_path)!r} has no cases or no events; the C-index is undefined")
    event = np.asarray([e["event"] == 1 for e in entries])
    time = np.asarray([e["time"] for e in entries])
    risk = np.asarray([e["covariates"][0] for e in entries])
    return float(concordance_index_censored(event, time, risk)[0])


def main(out_dir: str, n_cases: int = 120, seed: int = 0, overwrite: bool = False) -> None:
    """Command-line entry: build the demo cohort, print the CSV path and the oracle C-index of the validation split.

    Args:
        out_dir: folder to write into.
        n_cases: number of cases.
        seed: random seed.
        overwrite: rebuild even when a finished cohort is there.
    """
    path = make_mace_cohort(out_dir, n_cases=n_cases, seed=seed, overwrite=overwrite)
    print(path)
    print(f"oracle C-index (validation): {oracle_c_index(path):.3f}")


if __name__ == "__main__":
    import fire

    fire.Fire(main)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The synthetic MACE cohort: cardiac phantoms with calcified plaques, the known hazard model, and the cohort files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from scipy.stats import spearmanr

import common.data.survival_demo as demo
from common.data.survival import check_cohort, cohort_or_exit, read_cohort_csv, split_cohort

SMALL = {"n_cases": 8, "shape": (16, 16, 16), "spacing": (20.0, 20.0, 20.0)}


def _rows(csv_path: Path) -> list[dict[str, str]]:
    with open(csv_path, newline="") as handle:
        return list(csv.DictReader(handle))


def _mtimes(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


def _calcium_score(hu: np.ndarray) -> float:
    """Agatston-like: HU above 130 summed over the cardiac region."""
    return float(np.clip(hu[demo.cardiac_region(hu.shape)] - 130.0, 0.0, None).sum())


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default cohort (120 cases of 48 x 48 x 40), built once."""
    return demo.make_mace_cohort(tmp_path_factory.mktemp("mace"))


# ------------------------------------------------------------------------------------------------ phantom


def test_cardiac_phantom_is_seeded_in_hu_and_plaque_free_at_zero_burden() -> None:
    hu = demo.make_cardiac_phantom(seed=3, plaque_burden=0.0)
    assert hu.shape == (48, 48, 40) and hu.dtype == np.float32
    np.testing.assert_array_equal(hu, demo.make_cardiac_phantom(seed=3, plaque_burden=0.0))
    assert not np.array_equal(hu, demo.make_cardiac_phantom(seed=4, plaque_burden=0.0))
    assert -1100 < hu.min() < -900 and np.median(hu[0]) == pytest.approx(-1000, abs=50)  # air at the border
    assert hu.max() > 500  # bone
    assert _calcium_score(hu) == 0.0  # nothing >= 130 HU in the cardiac region without plaques


@pytest.mark.parametrize("shape", [(40, 40, 32), (64, 64, 56)])
def test_cardiac_region_holds_every_plaque_voxel_and_no_bone(shape: tuple[int, int, int]) -> None:
    region = demo.cardiac_region(shape)
    for seed in range(8):
        plain, masks = demo.make_cardiac_phantom(shape, seed, plaque_burden=0.0, noise_hu=0.0, return_masks=True)
        plaques = demo.make_cardiac_phantom(shape, seed, plaque_burden=1.0, plaque_intensity=1.0, noise_hu=0.0)
        touched = np.abs(plaques - plain) > 1e-3  # every voxel a plaque changed, partial-volume edges included
        assert touched.any() and not (touched & ~region).any()
        assert not (masks["bone"] & region).any() and not (masks["heart"] & ~region).any()


@pytest.mark.parametrize("seed", range(6))
def test_plaques_grow_with_burden_and_intensity_inside_the_boneless_cardiac_region(seed: int) -> None:
    region = demo.cardiac_region((48, 48, 40))
    counts, peaks = [], []
    for burden, intensity in ((0.1, 0.0), (0.5, 0.0), (1.0, 0.0), (1.0, 1.0)):
        hu, masks = demo.make_cardiac_phantom(
            seed=seed, plaque_burden=burden, plaque_intensity=intensity, return_masks=True
        )
        assert masks["plaques"].any() and not (masks["plaques"] & ~region).any()
        assert not (masks["bone"] & region).any() and not (masks["heart"] & ~region).any()
        counts.append(int(masks["plaques"].sum()))
        peaks.append(float(hu[masks["plaques"]].max()))
        # plaques survive noise and the CT window -1000..1000 HU: above the 130 HU calcium threshold, below 1000
        assert np.median(hu[masks["plaques"]]) > 170 and np.mean(hu[masks["plaques"]] > 130) > 0.95
        assert hu.max() < 1000
    assert counts[0] < counts[1] < counts[2] == counts[3]  # more and larger plaques, same geometry
    assert peaks[2] < 300 and peaks[3] > 750  # intensity 0: 200 HU +-10%, intensity 1: 900 HU -10%


def test_cardiac_phantom_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"plaque_burden must be a number in \[0, 1\], got 1.5"):
        demo.make_cardiac_phantom(plaque_burden=1.5)
    with pytest.raises(ValueError, match=r"plaque_intensity must be a number in \[0, 1\], got -0.1"):
        demo.make_cardiac_phantom(plaque_intensity=-0.1)
    with pytest.raises(ValueError, match=r"shape must be at least 16 voxels per axis"):
        demo.make_cardiac_phantom(shape=(8, 48, 48))


def test_true_log_hazard_hand_computed() -> None:
    # burden 0.8: z = 0.3 * sqrt(12); intensity 0.5: z = 0; age 72.5: z = 1; male: 1
    expected = 1.5 * 0.3 * np.sqrt(12.0) + 0.0 + 0.4 * 1.0 + 0.3
    assert float(demo.true_log_hazard(0.8, 0.5, 72.5, 1)) == pytest.approx(expected, rel=1e-12)
    assert demo.true_log_hazard([0.5, 0.5], [0.5, 0.5], [62.5, 62.5], [0, 1]) == pytest.approx([0.0, 0.3])


# ------------------------------------------------------------------------------------------------ cohort


def test_cohort_files_columns_and_images(cohort: Path) -> None:
    rows = _rows(cohort)
    assert list(rows[0]) == list(demo.CSV_COLUMNS) and len(rows) == 120
    assert [r["case_id"] for r in rows] == [f"mace_{i:04d}" for i in range(120)]
    assert all(
        r["image"] == f"images/{r['case_id']}.nii.gz" and r["time"].isdigit() and int(r["time"]) >= 1 for r in rows
    )
    assert {r["event"] for r in rows} == {"0", "1"} and {r["sex"] for r in rows} == {"0", "1"}
    assert all(45 <= int(r["age"]) <= 80 for r in rows)
    img = nib.load(cohort.parent / rows[0]["image"])
    assert img.shape == (48, 48, 40) and img.get_data_dtype() == np.float32
    np.testing.assert_allclose(img.affine, np.diag([7.0, 7.0, 8.0, 1.0]))
    assert json.loads((cohort.parent / "cohort.json").read_text())["n_cases"] == 120


def test_cohort_events_split_and_follow_up(cohort: Path) -> None:
    entries = read_cohort_csv(cohort, covariates=("age", "sex"))
    events = np.asarray([e["event"] for e in entries])
    assert 0.25 <= events.mean() <= 0.45  # calibrated to 35% events within follow-up
    sections = split_cohort(entries)  # the split column decides
    assert [len(sections["training"]), len(sections["validation"])] == [90, 30]
    for items in sections.values():  # stratified by event
        assert abs(np.mean([e["event"] for e in items]) - events.mean()) < 0.05
    check_cohort(sections, horizons=(1, 3, 5))  # the default horizons lie within follow-up of both splits
    times = np.asarray([e["time"] for e in entries])
    assert times.max() < 7.0 and np.median(times[events == 0]) < 4.5  # administrative follow-up 1 to 7 years
    result = cohort_or_exit(cohort, covariates=("age", "sex"), num_intervals=5, patch_size=(32, 32, 32))
    assert len(result["cut_points"]) == 6 and result["covariate_mean"][0] == pytest.approx(62.5, abs=3)


def test_cohort_hazard_is_visible_in_the_images(cohort: Path) -> None:
    rows = _rows(cohort)
    score = np.asarray([_calcium_score(np.asarray(nib.load(cohort.parent / r["image"]).dataobj)) for r in rows])
    risk = np.asarray([float(r["true_risk"]) for r in rows])
    age, sex = np.asarray([float(r["age"]) for r in rows]), np.asarray([float(r["sex"]) for r in rows])
    image_part = risk - demo.BETAS["age"] * (age - 62.5) / 10.0 - demo.BETAS["sex"] * sex
    assert spearmanr(score, image_part).statistic > 0.9  # the image features are what the calcium score sees
    assert spearmanr(score, risk).statistic > 0.8


def test_cohort_times_follow_the_proportional_hazards_model(cohort: Path) -> None:
    """A Cox fit (lifelines) of the observed times on ``true_risk`` recovers a log-hazard ratio of about 1."""
    from lifelines import CoxPHFitter
    from lifelines.utils import concordance_index

    entries = read_cohort_csv(cohort, covariates=("true_risk",))
    data = {
        "time": [e["time"] for e in entries],
        "event": [e["event"] for e in entries],
        "risk": [e["covariates"][0] for e in entries],
    }
    import pandas as pd

    fit = CoxPHFitter().fit(pd.DataFrame(data), duration_col="time", event_col="event")
    assert 0.7 < fit.params_["risk"] < 1.3
    # the oracle C-index (scikit-survival) equals lifelines' on the same split (lifelines expects -risk)
    for split in ("training", "validation"):
        part = [e for e in entries if e["split"] == split]
        expected = concordance_index(
            [e["time"] for e in part], [-e["covariates"][0] for e in part], [e["event"] for e in part]
        )
        assert demo.oracle_c_index(cohort, split) == pytest.approx(expected, abs=1e-12)
    assert demo.oracle_c_index(cohort, "val") > 0.75  # far above chance: the task is learnable
    assert demo.oracle_c_index(cohort, None) > 0.75
    with pytest.raises(ValueError, match=r"split must be one of"):
        demo.oracle_c_index(cohort, "holdout")


def test_uncensored_cohort_observes_every_event(tmp_path: Path) -> None:
    path = demo.make_mace_cohort(tmp_path, censoring="none", **SMALL)
    assert {r["event"] for r in _rows(path)} == {"1"}
    with pytest.raises(ValueError, match=r"censoring must be one of \('uniform', 'none'\), got 'random'"):
        demo.make_mace_cohort(tmp_path, censoring="random", **SMALL)


def test_cohort_is_deterministic_per_seed(tmp_path: Path) -> None:
    first = demo.make_mace_cohort(tmp_path / "a", seed=5, **SMALL)
    second = demo.make_mace_cohort(tmp_path / "b", seed=5, **SMALL)
    other = demo.make_mace_cohort(tmp_path / "c", seed=6, **SMALL)
    assert first.read_text() == second.read_text() != other.read_text()
    for row in _rows(first):
        a = np.asarray(nib.load(first.parent / row["image"]).dataobj)
        np.testing.assert_array_equal(a, np.asarray(nib.load(second.parent / row["image"]).dataobj))


def test_finished_cohort_is_reused_and_unfinished_or_changed_ones_rebuilt(tmp_path: Path) -> None:
    path = demo.make_mace_cohort(tmp_path, **SMALL)
    before = _mtimes(tmp_path)
    assert demo.make_mace_cohort(tmp_path, **SMALL) == path
    assert _mtimes(tmp_path) == before  # nothing written
    (tmp_path / "images" / "mace_0003.nii.gz").unlink()  # a missing image
    demo.make_mace_cohort(tmp_path, **SMALL)
    assert (tmp_path / "images" / "mace_0003.nii.gz").is_file()
    path.unlink()  # an interrupted build: images written, CSV not yet
    demo.make_mace_cohort(tmp_path, **SMALL)
    assert path.is_file()
    text = path.read_text()
    demo.make_mace_cohort(tmp_path, **{**SMALL, "seed": 1})  # other parameters: rebuilt
    assert path.read_text() != text
    assert json.loads((tmp_path / "cohort.json").read_text())["seed"] == 1
    stamp = path.stat().st_mtime_ns
    demo.make_mace_cohort(tmp_path, overwrite=True, **{**SMALL, "seed": 1})
    assert path.stat().st_mtime_ns != stamp and path.read_text() != text


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_cases": 2}, r"n_cases must be an integer of at least 4, got 2"),
        ({"median_followup_years": 0}, r"median_followup_years must be a number in \(0, 100\)"),
        ({"event_fraction": 0.99}, r"event_fraction must be a number in \[0.05, 0.95\]"),
        ({"val_fraction": 0}, r"val_fraction must be a number in \(0, 1\)"),
        ({"spacing": (1, 1)}, r"spacing must be 3 positive numbers"),
    ],
)
def test_cohort_rejects_bad_arguments(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        demo.make_mace_cohort(tmp_path, **{**SMALL, **kwargs})
    assert not any(tmp_path.iterdir())

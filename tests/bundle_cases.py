# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""One test case per bundle, for the contract every bundle must satisfy (``tests/test_bundle_contract.py``): the small
data it trains on, its tiny profile, and what is particular to it in the contract (invalid settings and what the
error names, what an edited pipeline gives). A new bundle adds its case here."""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import shifted_seed

# inside the follow-up of every split by the design of :func:`followup_design` (0.25 to 5.75 years, first case an
# event at 0.25 years); exact in float32, as the survival predictor holds them
HORIZONS = [1.0, 2.0]
CHEST_FOV_MM = 350.0  # the field of view of the X-ray -> CT case's chest phantoms


def write_phantoms(root: Path) -> dict[str, Any]:
    """Four training and two validation brain phantoms at 24^3 with their datalist."""
    from common.demo.images import write_phantom_dataset

    write_phantom_dataset(root, n_train=4, n_val=2, shape=(24, 24, 24), seed=shifted_seed(0))
    return {"dataset_dir": str(root)}


def write_ct_phantoms(root: Path) -> dict[str, Any]:
    """Four training and two validation chest CT phantoms in HU (NIfTI; 22 slices: not a multiple of the VQ-GAN's
    downsampling) with their datalist."""
    from common.demo.images import write_phantom_dataset

    write_phantom_dataset(
        root, n_train=4, n_val=2, shape=(24, 24, 22), kind="ct", spacing=(1.5, 1.5, 2.0), seed=shifted_seed(0)
    )
    return {"dataset_dir": str(root)}


def write_brats_phantoms(root: Path) -> dict[str, Any]:
    """Four training and two validation brain tumour phantoms in the BraTS 2023 layout with their datalist."""
    from common.demo.images import write_brats_phantom_dataset

    write_brats_phantom_dataset(
        root, n_train=4, n_val=2, shape=(24, 24, 20), spacing=(1.5, 1.5, 2.0), seed=shifted_seed(0)
    )
    return {"dataset_dir": str(root)}


def csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def followup_design(csv_path: Path) -> Path:
    """The generated cohort with a fixed follow-up design, written next to it as ``design.csv``.

    Images, covariates and the split column are the generator's. Within each split, the ``k``-th of its ``m``
    cases (file order) is followed for ``0.25 + 5.5 k / (m - 1)`` years (in whole days), with an event unless
    ``k % 3 == 2``: every split then covers 0.25 to 5.75 years and starts with an event, so both :data:`HORIZONS`
    are usable in every split and the validation split has an event before the first horizon, whatever the seed.
    """
    rows = csv_rows(csv_path)
    positions: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        positions.setdefault(row["split"], []).append(i)
    for members in positions.values():
        assert len(members) >= 2, positions  # make_mace_cohort gives every split cases
        for k, i in enumerate(members):
            years = 0.25 + 5.5 * k / (len(members) - 1)
            rows[i]["time"] = str(round(years * 365.25))
            rows[i]["event"] = "0" if k % 3 == 2 else "1"
    design = csv_path.parent / "design.csv"
    with open(design, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return design


def write_cohort(root: Path) -> dict[str, Any]:
    """32 chest phantoms of 24x24x20 voxels, split by the generator (stratified by its events: 24/8 or 23/9
    training/validation cases, depending on the seed), with the follow-up of :func:`followup_design`."""
    from common.demo.survival import make_mace_cohort

    generated = make_mace_cohort(root, n_cases=32, shape=(24, 24, 20), spacing=(14, 14, 16), seed=shifted_seed(0))
    return {"csv_path": str(followup_design(generated)), "horizons": HORIZONS}


def write_chest_phantoms(root: Path) -> dict[str, Any]:
    """Four training and two validation chest CT phantoms at 24^3 in a :data:`CHEST_FOV_MM` field of view (resampled
    to the tiny 16^3 source grid)."""
    from common.demo.images import make_xray2ct_demo

    make_xray2ct_demo(root, n_train=4, n_val=2, shape=(24, 24, 24), fov_mm=CHEST_FOV_MM, seed=shifted_seed(0))
    return {"dataset_dir": str(root)}


@dataclass(frozen=True)
class PipelineEdit:
    """What a training run with ``RandGaussianNoised`` appended to ``train#augmentation`` and a ``CacheDataset``
    (``tests.helpers.edited_pipeline_configs``) gives.

    Args:
        iterations: the iterations of its one epoch, from the data settings.
        transforms: the last transforms of the dataset's chain (the noise last).
        shape: the shape of the sample taken from the dataset.
        clean_range: the range of the pipeline's values without the noise.
        keys: the keys the noise is added to; sample: where the sample is in the dataset.
        settings: more settings of the run; absent: transforms the chain must not hold.
    """

    iterations: Callable[[dict[str, Any]], int]
    transforms: tuple[str, ...]
    shape: tuple[int, ...]
    clean_range: tuple[float, float]
    keys: tuple[str, ...] = ("image",)
    sample: str = "[0][0]['image']"
    settings: dict[str, Any] = field(default_factory=dict)
    absent: tuple[str, ...] = ()


@dataclass(frozen=True)
class BundleCase:
    """A bundle's test case.

    Args:
        bundle: the bundle's folder name.
        configs: its tiny profile, the config files merged after ``train.json``.
        write_data: writes the data under a folder and returns the settings that point the configs at it.
        bad_settings: invalid settings (config id -> value, given on the command line).
        refused: what the error must name.
        pipeline_edit: what an edited pipeline gives.
        host_read_settings: settings of the host-read count (so that every branch of a step is taken).
        splits: the config id of the parsed training and validation lists.
        case_key: the key that names a case in those lists.
    """

    bundle: str
    configs: tuple[str, ...]
    write_data: Callable[[Path], dict[str, Any]]
    bad_settings: dict[str, Any]
    refused: tuple[str, ...]
    pipeline_edit: PipelineEdit
    host_read_settings: dict[str, Any] = field(default_factory=dict)
    splits: str = "datalists"
    case_key: str = "image"

    def __str__(self) -> str:
        return self.bundle


def _training_cases(batch_size: int) -> Callable[[dict[str, Any]], int]:
    """The iterations of an epoch over the cohort's training split (the incomplete last batch is dropped)."""
    return lambda data: sum(row["split"] == "training" for row in csv_rows(Path(data["csv_path"]))) // batch_size


CASES = {
    case.bundle: case
    for case in (
        BundleCase(
            "autoencoder_3d",
            ("tiny.json",),
            write_phantoms,
            bad_settings={
                "patch_size": [18, 16, 16],
                "norm_num_groups": 3,
                "kl_weight": -1.0,
                "intensity": {"mode": "ct", "a_min": 400, "a_max": -1000},
            },
            refused=(
                "'patch_size' [18, 16, 16]",
                "'norm_num_groups' 3",
                "'kl_weight'",
                "'intensity' HU window is inverted",
            ),
            pipeline_edit=PipelineEdit(  # 4 volumes, batch 2
                lambda data: 2, ("RandSpatialCropSamplesd", "RandGaussianNoised"), (1, 16, 16, 16), (0.0, 1.0)
            ),
            host_read_settings={"adv_warmup_iterations": 0},
        ),
        BundleCase(
            "vqgan_3d",
            ("tiny.json",),
            write_ct_phantoms,
            bad_settings={
                "patch_size": [18, 16, 16],
                "n_codes": 1,
                "discriminator_iter_start": -5,
                "ct_window": {"mode": "ct", "a_min": 400, "a_max": -1000},
            },
            refused=("'patch_size'", "'n_codes'", "'discriminator_iter_start'", "'intensity' HU window is inverted"),
            pipeline_edit=PipelineEdit(  # 4 volumes, batch 1
                lambda data: 4, ("RandSpatialCropSamplesd", "RandGaussianNoised"), (1, 16, 16, 16), (0.0, 1.0)
            ),
            host_read_settings={"discriminator_iter_start": 0},
        ),
        BundleCase(
            "fast_ddpm_3d",
            ("brats.json", "tiny.json"),
            write_brats_phantoms,
            bad_settings={"num_grid_steps": 0, "target_key": "seg", "attention_levels": ["false", "true"]},
            refused=(
                "'num_grid_steps' must be in [1, num_train_timesteps=1000]",
                "'target_key' 'seg'",
                "'attention_levels'",
            ),
            pipeline_edit=PipelineEdit(  # 4 cases, batch 1; the four modalities stacked, percentiles in [-1, 1]
                lambda data: 4,
                ("RandSpatialCropSamplesd", "RandGaussianNoised"),
                (4, 16, 16, 16),
                (-1.0, 1.0),
                sample="[0][0]['image']",
            ),
            case_key="case_id",
        ),
        BundleCase(
            "mace_survival",
            ("tiny.json",),
            write_cohort,
            bad_settings={
                "survival_head": "weibull",
                "conv1_t_stride": 0,
                "horizons": [3, 1],
                "replace_rate": 0.0,
                "calibration_cache_rate": 1.5,
            },
            refused=(
                "'survival_head'",
                "'conv1_t_stride'",
                "'horizons' must increase",
                "'replace_rate'",
                "'calibration_cache_rate' must be a number in [0, 1]",
            ),
            pipeline_edit=PipelineEdit(  # with augment off the noise can only come from the edit
                _training_cases(batch_size=4),  # tiny.json: batch_size
                ("EnsureTyped", "ToDeviced", "RandGaussianNoised"),
                (1, 16, 16, 16),
                (0.0, 1.0),
                sample="[0]['image']",
                settings={"augment": False},
                absent=("RandAffined",),
            ),
            splits="cohort",
            case_key="case_id",
        ),
        BundleCase(
            "xray2ct_cascade",
            ("tiny.json",),
            write_chest_phantoms,
            bad_settings={
                "mode": "gan",
                "vit_patch_size": 5,
                "stage_sizes": [[8, 8, 8], [12, 12, 12], [8, 8, 8]],
                "source_size": [4, 4, 4],
            },
            refused=(
                "'mode' must be one of",
                "'vit_patch_size' 5 must divide",
                "'stage_sizes' must not shrink",
                "larger than 'source_size'",
            ),
            pipeline_edit=PipelineEdit(  # stage 1: 4 cases, batch 2; the CT in [-1, 1], area-averaged
                lambda data: 2,
                ("EnsureTyped", "ToDeviced", "RandGaussianNoised"),
                (1, 8, 8, 8),
                (-1.0, 1.0),
                sample="[0]['image']",
            ),
        ),
    )
}

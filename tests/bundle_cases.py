# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""One test case per bundle, for the contract every bundle must satisfy (``tests/test_bundle_contract.py``): its tiny
profile and what is particular to it in the contract (invalid settings and what the error names, what an edited
pipeline gives). Its small data is that of the bundle's fault-test job (``fault_case`` of its harness module, see
:func:`scripts.harness.faults.make_case`). A new bundle adds its case here."""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers import shifted_seed


def csv_rows(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


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
        bad_settings: invalid settings (config id -> value, given on the command line).
        refused: what the error must name.
        bad_inference_settings: settings inference (``inference.json`` on a run of the tiny profile) must refuse
            before it reads any case (config id -> value, given on the command line), a size the trained network
            cannot take among them.
        inference_refused: what inference's error must name.
        pipeline_edit: what an edited pipeline gives.
        host_read_settings: settings of the host-read count (so that every branch of a step is taken).
        splits: the config id of the parsed training and validation lists.
        case_key: the key that names a case in those lists.
        gpu_brief: the settings of a brief run of the CPU demo on a GPU (``tests/test_gpu.py``: a few epochs,
            validated twice, the adversarial terms switched on early).
        optimizer_steps: the optimizer steps of one training iteration (a GAN steps its generator and its
            discriminator).
        faults: the faults ``tests/test_reliability.py`` injects in turn into the bundle's fault-test job
            (``scripts/reliability.py report`` runs every fault on every bundle).
        inference_inputs: how ``tests/test_inference_faults.py`` writes the bundle's inference cases (the keywords
            of its ``Inputs``: ``kind`` of phantom, ``shape``, ``spacing``, whether it reads DICOM series); their
            layout is the family's (a folder of volumes, the BraTS modalities, a cohort CSV).
        byte_setting: a setting the bundle's inference outputs depend on, and another value of it (a case
            inferred with it is redone).
        gpu_resume: whether ``tests/test_gpu.py`` kills its reliability job on CUDA and resumes it, expecting the
            weights of the uninterrupted run bit for bit (bf16).
    """

    bundle: str
    configs: tuple[str, ...]
    bad_settings: dict[str, Any]
    refused: tuple[str, ...]
    bad_inference_settings: dict[str, Any]
    inference_refused: tuple[str, ...]
    pipeline_edit: PipelineEdit
    host_read_settings: dict[str, Any] = field(default_factory=dict)
    splits: str = "datalists"
    case_key: str = "image"
    gpu_brief: dict[str, Any] = field(default_factory=lambda: {"max_epochs": 4, "val_interval": 2, "log_interval": 1})
    optimizer_steps: int = 1
    faults: tuple[str, ...] = ("kill",)
    inference_inputs: dict[str, Any] = field(default_factory=dict)
    byte_setting: tuple[str, Any] = ("sw_batch_size", 1)
    gpu_resume: bool = False

    def __str__(self) -> str:
        return self.bundle

    def write_data(self, root: Path) -> dict[str, Any]:
        """Write the small data of the bundle's fault-test job under ``root`` (seeded by the suite's seed); the settings
        that point the configs at it."""
        from scripts.harness.faults import make_case

        job = make_case(self.bundle, root, shifted_seed(0))
        return {name: job.args[name] for name in job.data}


def _training_cases(batch_size: int) -> Callable[[dict[str, Any]], int]:
    """The iterations of an epoch over the cohort's training split (the incomplete last batch is dropped)."""
    return lambda data: sum(row["split"] == "training" for row in csv_rows(Path(data["csv_path"]))) // batch_size


CASES = {
    case.bundle: case
    for case in (
        BundleCase(
            "autoencoder_3d",
            ("tiny.json",),
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
            bad_inference_settings={"patch_size": [15, 15, 15], "overlap": 1.0},
            inference_refused=(
                "'patch_size' [15, 15, 15] must be divisible by 4 on every axis",
                "'overlap' must be a number in [0, 1)",
            ),
            pipeline_edit=PipelineEdit(  # 4 volumes, batch 2
                lambda data: 2, ("RandSpatialCropSamplesd", "RandGaussianNoised"), (1, 16, 16, 16), (0.0, 1.0)
            ),
            host_read_settings={"adv_warmup_iterations": 0},
            gpu_brief={"max_epochs": 4, "val_interval": 2, "adv_warmup_iterations": 2, "log_interval": 1},
            optimizer_steps=2,
            faults=("disk", "nan", "kill_while_saving", "kill"),
            gpu_resume=True,
        ),
        BundleCase(
            "vqgan_3d",
            ("tiny.json",),
            bad_settings={
                "patch_size": [18, 16, 16],
                "n_codes": 1,
                "discriminator_iter_start": -5,
                "ct_window": {"mode": "ct", "a_min": 400, "a_max": -1000},
            },
            refused=("'patch_size'", "'n_codes'", "'discriminator_iter_start'", "'intensity' HU window is inverted"),
            bad_inference_settings={"patch_size": [15, 15, 15], "sw_batch_size": 0},
            inference_refused=(
                "'patch_size' [15, 15, 15] must be divisible by the total downsampling 'downsample' [4, 4, 4]",
                "'sw_batch_size' must be an integer >= 1",
            ),
            pipeline_edit=PipelineEdit(  # 4 volumes, batch 1
                lambda data: 4, ("RandSpatialCropSamplesd", "RandGaussianNoised"), (1, 16, 16, 16), (0.0, 1.0)
            ),
            host_read_settings={"discriminator_iter_start": 0},
            gpu_brief={"max_epochs": 4, "val_interval": 2, "discriminator_iter_start": 2, "log_interval": 1},
            optimizer_steps=2,
            faults=("nan",),
            inference_inputs={"kind": "ct", "shape": (24, 24, 22)},
        ),
        BundleCase(
            "fast_ddpm_3d",
            ("brats.json", "tiny.json"),
            bad_settings={"num_grid_steps": 0, "target_key": "seg", "attention_levels": ["false", "true"]},
            refused=(
                "'num_grid_steps' must be in [1, num_train_timesteps=1000]",
                "'target_key' 'seg'",
                "'attention_levels'",
            ),
            bad_inference_settings={"patch_size": [15, 15, 15], "num_workers": -1},  # tiny: the U-Net halves once
            inference_refused=(
                "'patch_size' [15, 15, 15] must be divisible by 2 (the U-Net halves it 1 times)",
                "'num_workers' must be an integer >= 0",
            ),
            pipeline_edit=PipelineEdit(  # 4 cases, batch 1; the four modalities stacked, percentiles in [-1, 1]
                lambda data: 4,
                ("RandSpatialCropSamplesd", "RandGaussianNoised"),
                (4, 16, 16, 16),
                (-1.0, 1.0),
            ),
            case_key="case_id",
            gpu_brief={"max_epochs": 6, "val_interval": 3, "log_interval": 1},
            faults=("kill_while_saving",),
            gpu_resume=True,
            # 1 mm voxels (the bundle's spacing) and one 16^3 window: the sampler's 2 steps stay cheap
            inference_inputs={"shape": (16, 16, 16), "spacing": (1.0, 1.0, 1.0), "dicom": False},
        ),
        BundleCase(
            "mace_survival",
            ("tiny.json",),
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
            bad_inference_settings={"image_size": [16, 16], "batch_size": 0},
            inference_refused=(
                "'image_size' must be 3 positive integers, got [16, 16]",
                "'batch_size' must be a positive integer",
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
            inference_inputs={"kind": "ct", "shape": (20, 20, 16)},
            byte_setting=("batch_size", 4),
        ),
        BundleCase(
            "xray2ct_cascade",
            ("tiny.json",),
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
            bad_inference_settings={"view_size": [32, 32], "num_threads": 0},  # tiny: trained on [64, 64] views
            inference_refused=(
                "'view_size' [32, 32] is not the view size the trained network was built for, [64, 64]",
                "'num_threads' must be null (torch's default) or an integer >= 1",
            ),
            pipeline_edit=PipelineEdit(  # stage 1: 4 cases, batch 2; the CT in [-1, 1], area-averaged
                lambda data: 2,
                ("EnsureTyped", "ToDeviced", "RandGaussianNoised"),
                (1, 8, 8, 8),
                (-1.0, 1.0),
                sample="[0]['image']",
            ),
            gpu_brief={"stage_iterations": [4, 4], "val_interval": 1, "log_interval": 1},
            faults=("disk",),
            inference_inputs={"kind": "ct"},
            byte_setting=("seed", 7),
        ),
    )
}

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""What every bundle must satisfy: its metadata for every folder under ``bundles/`` (a new bundle is checked without an
edit here), and, on each bundle's test case (``tests/bundle_cases.py``: small data and a tiny profile), the model
zoo's property checks, settings refused before anything is written, a pipeline edited by a merged config file, the
values a training step reads back from the device and what tracking logs. Each ``tests/test_bundle_<name>.py``
keeps what is specific to its bundle; export, packaging and resume are parametrised over the bundles in
``test_export.py``, ``test_package*.py`` and ``test_reliability.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.bundle import BUNDLES_DIR, bundle_names
from common.bundle_tools.registry import check_description, describe
from tests.bundle_cases import CASES, BundleCase
from tests.helpers import (
    SCHEMA,
    bundle_parser,
    check_json_training_dataset,
    check_tracked_training_loss,
    edited_pipeline_configs,
    model_zoo_train_properties,
    overrides,
    run_bundle,
    undocumented_host_syncs,
)


@pytest.mark.parametrize("name", bundle_names())
def test_metadata_is_valid_and_describes_the_bundle(name: str) -> None:
    """The MONAI metadata schema, the version in the changelog, the network's ``image`` input and ``pred`` output
    (MONAI's conventions), and the collection's description of the bundle."""
    jsonschema = pytest.importorskip("jsonschema")
    meta = json.loads((BUNDLES_DIR / name / "configs" / "metadata.json").read_text())
    jsonschema.validate(meta, json.loads(SCHEMA.read_text()))
    assert meta["version"] in meta["changelog"] and meta["name"]
    assert set(meta["network_data_format"]["inputs"]) == {"image"}
    assert set(meta["network_data_format"]["outputs"]) == {"pred"}
    assert check_description(BUNDLES_DIR / name) == []
    assert describe(name).folder == BUNDLES_DIR / name


def test_every_bundle_has_a_case() -> None:
    assert sorted(CASES) == bundle_names()


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> tuple[BundleCase, dict[str, Any]]:
    """A bundle's case and the settings pointing its configs at the case's data, written once per module."""
    bundle_case = CASES[request.param]
    return bundle_case, bundle_case.write_data(tmp_path_factory.mktemp(f"{request.param}_data"))


def test_model_zoo_train_properties(case, tmp_path: Path) -> None:
    """MONAI's ``verify_metadata`` and the train workflow's ``check_properties()``, as the model zoo's CI runs them."""
    bundle_case, data = case
    lines = model_zoo_train_properties(bundle_case.bundle, list(bundle_case.configs), data, tmp_path)
    assert lines == ["metadata verified", "train properties verified"]


def test_bad_settings_are_refused_before_anything_is_written(case, tmp_path: Path) -> None:
    """Invalid settings end the command with one ``error:`` message naming each of them, exit status 1 and no
    traceback, before the output folder is made."""
    bundle_case, data = case
    out = tmp_path / "out"
    args = overrides(**{**data, "output_dir": str(out), **bundle_case.bad_settings})
    result = run_bundle(bundle_case.bundle, ["train.json", *bundle_case.configs], check=False, args=args)
    assert result.returncode == 1, result.stderr[-3000:]
    text = result.stderr
    assert "\nerror: " in "\n" + text and "Traceback" not in text, text[-3000:]
    missing = [name for name in bundle_case.refused if name not in text]
    assert not missing, f"{missing} not named in:\n{text[-3000:]}"
    assert not out.exists()


def test_pipeline_edited_in_json(case, tmp_path: Path) -> None:
    """A user's config file merged after train.json appends ``RandGaussianNoised`` to ``train#augmentation`` (MONAI's
    ``+`` merge of lists) and replaces the SmartCacheDataset with a CacheDataset: training uses both."""
    bundle_case, data = case
    expected = bundle_case.pipeline_edit
    out = tmp_path / "edited"
    edit, probe = edited_pipeline_configs(tmp_path, keys=expected.keys, sample=expected.sample)
    args = overrides(**{**data, "output_dir": str(out), "max_epochs": 1, "val_interval": 1, **expected.settings})
    run_bundle(bundle_case.bundle, ["train.json", *bundle_case.configs, str(edit), str(probe)], args=args)
    result = torch.load(out / "probe.pt", weights_only=True)
    assert result["type"] == "CacheDataset" and result["iteration"] == expected.iterations(data)
    assert tuple(result["transforms"][-len(expected.transforms) :]) == expected.transforms
    assert not set(expected.absent) & set(result["transforms"])
    sample = np.asarray(result["sample"])
    assert sample.shape == expected.shape
    low, high = expected.clean_range  # the pipeline's values stay in this range: only the noise leaves it
    assert sample.min() < low or sample.max() > high


def test_training_step_reads_back_only_the_documented_values(case, tmp_path: Path) -> None:
    """On a GPU a training step waits at each value read back from the device: only the documented ones
    (tests.helpers.DOCUMENTED_HOST_READS) are read, counted on the CPU where they are called."""
    bundle_case, data = case
    settings = {**data, **bundle_case.host_read_settings}
    assert undocumented_host_syncs(bundle_case.bundle, list(bundle_case.configs), tmp_path, **settings) == {}


def test_tracking_logs_a_number_per_training_iteration(case, tmp_path: Path) -> None:
    bundle_case, data = case
    check_tracked_training_loss(bundle_case.bundle, list(bundle_case.configs), tmp_path, **data)


@pytest.mark.parametrize("rates", [{}, {"cache_rate": 0.5, "replace_rate": 0.5}], ids=["default", "smart-cache"])
def test_json_datasets_hold_the_cases_of_make_dataset(case, rates) -> None:
    """``train#dataset`` caches the cases the oracle ``make_dataset`` caches, in its order (the loader's epoch order
    and seeded augmentation follow the dataset's positions): all of them in the split's order by default, a seeded
    random subset that the SmartCacheHandler swaps with ``cache_rate`` < 1; ``validate#dataset`` every validation
    case, in order."""
    from monai.data import CacheDataset

    bundle_case, data = case
    parser = bundle_parser(bundle_case.bundle, ["train.json", *bundle_case.configs], **data, **rates)
    splits = parser.get_parsed_content(bundle_case.splits)
    check_json_training_dataset(parser, splits["training"], rates, key=bundle_case.case_key)
    validate = parser.get_parsed_content("validate#dataset")
    assert type(validate) is CacheDataset
    key = bundle_case.case_key
    assert [d[key] for d in validate.data] == [d[key] for d in splits["validation"]] and len(validate.data) >= 2

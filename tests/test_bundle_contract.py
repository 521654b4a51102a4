# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""What every bundle must satisfy, for every folder under ``bundles/`` (a new bundle is checked without an edit
here); each ``tests/test_bundle_<name>.py`` keeps what is specific to its bundle."""

from __future__ import annotations

import json

import pytest

from common.bundle import BUNDLES_DIR, bundle_names
from common.bundle_tools.registry import check_description, describe
from tests.helpers import SCHEMA


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

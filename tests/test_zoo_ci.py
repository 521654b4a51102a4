# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``scripts/zoo_ci.py`` against a stand-in for the model zoo's ``ci/`` folder (the real one is not here): every
check runs in its own process, a failure does not hide the checks after it, the zoo's exclusion lists and the
bundle's declared exclusions are reported as such."""

from __future__ import annotations

import json
import textwrap
import zipfile
from pathlib import Path

from scripts.zoo_ci import CHECKS, run_checks

FAKE_VERIFY = textwrap.dedent(
    """
    def _get_net_id(bundle):
        return "network_def"

    def _find_bundle_file(root, name):
        return name + ".json"

    def _get_weights_names(bundle):
        return "model.pt", "model.ts"

    def verify_bundle_directory(models, bundle, mode):
        assert mode == "full"

    def verify_version_changes(models, bundle):
        pass

    def verify_metadata_format(path):
        pass

    def verify_bundle_properties(models, bundle):
        pass

    def verify_data_shape(path, net_id, config_file):
        raise ValueError("shape boom: " + net_id + " " + config_file)

    def verify_torchscript(path, net_id, config_file, model_name, ts_name):
        raise RuntimeError("script boom")
    """
)


def _package(folder: Path, name: str, exclusions: dict) -> Path:
    path = folder / f"{name}.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/configs/metadata.json", json.dumps({"model_zoo_ci_exclusions": exclusions}))
        zf.writestr(f"{name}/configs/inference.json", "{}")
    return path


def test_every_check_is_reported_with_exclusions(tmp_path):
    zoo = tmp_path / "zoo"
    (zoo / "ci").mkdir(parents=True)
    (zoo / "ci" / "verify_bundle.py").write_text(FAKE_VERIFY)
    (zoo / "ci" / "bundle_custom_data.py").write_text(
        'exclude_verify_shape_list = ["listed"]\nexclude_verify_torchscript_list = []\n'
    )
    packages = [
        _package(tmp_path, "plain", {}),
        _package(tmp_path, "declared", {"verify_torchscript": "MONAI's attention does not script"}),
        _package(tmp_path, "listed", {}),
    ]
    results = run_checks(zoo, [str(p) for p in packages], tmp_path / "work", trace=False)
    assert list(results) == ["plain", "declared", "listed"]
    plain = results["plain"]
    assert [plain[c][0] for c in CHECKS[:4]] == ["passed"] * 4 and all(plain[c][1] == "" for c in CHECKS[:4])
    assert plain["data_shape"] == ("failed", f"ValueError: shape boom: network_def {Path('configs', 'inference.json')}")
    assert plain["torchscript"] == ("failed", "RuntimeError: script boom")  # reached after the failure before it
    assert results["declared"]["torchscript"] == (
        "excluded (declared; it failed)",
        "MONAI's attention does not script",
    )
    assert results["declared"]["data_shape"][0] == "failed"
    assert results["listed"]["data_shape"] == ("excluded", "in the zoo's exclusion list")
    assert "ckpt_export (trace)" not in plain

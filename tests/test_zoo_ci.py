# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``scripts/zoo_ci.py`` against a stand-in for the model zoo's ``ci/`` folder (the real one is not here): every
check runs in its own process, a failure does not hide the checks after it, the zoo's exclusion lists and the
bundle's declared exclusions are reported as such."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from scripts.zoo_ci import CHECKS, run_checks
from tests.bundle_cases import CASES
from tests.helpers import BUNDLES, REPO_ROOT, bundle_env

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


_SCRIPT_NETWORK = textwrap.dedent(
    """
    import json, re, sys
    import torch
    from monai.bundle import ConfigParser
    parser = ConfigParser()
    parser.read_config(json.loads(sys.argv[1]))
    parser.update({"device": "cpu"})
    try:
        torch.jit.script(parser.get_parsed_content("network_def"))
        print(json.dumps(None))
    except Exception as exc:  # TorchScript's frontend raises several kinds
        print(json.dumps([path.replace("\\\\", "/") for path in re.findall(r'File "([^"]+)", line', str(exc))][:1]))
    """
)


@pytest.mark.parametrize("bundle", sorted(CASES))
def test_a_declared_torchscript_exclusion_names_the_real_first_error(bundle):
    """``model_zoo_ci_exclusions.verify_torchscript`` is declared exactly when the inference network does not script
    (MONAI's ``torch.jit.script`` of ``network_def``, as the zoo's ``verify_torchscript``), and its reason names the
    file where TorchScript stops first."""
    configs = [str(BUNDLES / bundle / "configs" / name) for name in ("inference.json", *CASES[bundle].configs)]
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT_NETWORK, json.dumps(configs)],
        env=bundle_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    first = json.loads(result.stdout.strip().splitlines()[-1])
    declared = json.loads((BUNDLES / bundle / "configs" / "metadata.json").read_text())["model_zoo_ci_exclusions"]
    reason = declared.get("verify_torchscript")
    if first is None:
        assert reason is None, f"{bundle} scripts, but its metadata declares: {reason}"
        return
    assert first, f"{bundle}: TorchScript failed without naming a file:\n{result.stdout[-2000:]}"
    where = first[0].split("site-packages/")[-1].replace(str(REPO_ROOT).replace("\\", "/") + "/", "")
    assert reason is not None and where in reason, f"{bundle}: TorchScript stops first in {where}; declared: {reason}"

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``scripts/zoo_ci.py`` against a stand-in for the model zoo's ``ci/verify_bundle.py`` (the real one is not here;
``docs/model_zoo.md`` has its results on the real one): the script is run as the zoo runs it, as the zoo's lists are
and with the submission's lines, each declared exclusion is checked against the real first error, and what the
zoo's script did not reach is reported as such."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from common.errors import UserError
from scripts.zoo_ci import CHECKS, SCHEMA, report, run_checks, submission_lines, with_entries
from tests.bundle_cases import CASES
from tests.helpers import BUNDLES, REPO_ROOT, bundle_env

# a stand-in for the zoo's ci/verify_bundle.py: its command line, its lists, what it prints and where it stops
FAKE_VERIFY = textwrap.dedent(
    """
    import argparse
    from bundle_custom_data import exclude_verify_shape_list, exclude_verify_torchscript_list

    parser = argparse.ArgumentParser()
    parser.add_argument("-b", "--b")
    parser.add_argument("-p", "--p", default="models")
    parser.add_argument("-m", "--mode", default="full")
    bundle = parser.parse_args().b
    print(f"start verifying {bundle}:")
    print("directory is verified correctly.")
    print("version and changelog are verified correctly.")
    print("metadata format is verified correctly.")
    print("all properties: ", [])
    print("properties are verified correctly.")
    if bundle in exclude_verify_shape_list:
        print(f"skip verifying the data shape of bundle: {bundle}.")
    elif bundle.startswith("unet"):
        raise TypeError("DiffusionModelUNet.forward() missing 1 required positional argument: 'timesteps'")
    else:
        print("data shape is verified correctly.")
    if bundle in exclude_verify_torchscript_list:
        print(f"bundle: {bundle} does not support torchscript, skip verifying.")
    elif bundle.startswith(("unet", "attention")):
        raise RuntimeError("cannot statically infer the expected size of a list (monai/networks/blocks/attn.py)")
    else:
        print("export weights into TorchScript module successfully.")
    """
)
CUSTOM_DATA = 'exclude_verify_shape_list = [\n    "other",\n]\n\nexclude_verify_torchscript_list = [\n]\n'
SHAPE = "needs the time steps (`missing 1 required positional argument: 'timesteps'`)"
SCRIPT = "MONAI's attention (`monai/networks/blocks/attn.py`) does not script"


def _zoo(folder: Path) -> Path:
    zoo = folder / "zoo"
    (zoo / "ci").mkdir(parents=True)
    (zoo / "models").mkdir()
    (zoo / "ci" / "verify_bundle.py").write_text(FAKE_VERIFY)
    (zoo / "ci" / "bundle_custom_data.py").write_text(CUSTOM_DATA)
    (zoo / "models" / "model_info.json").write_text("{}")
    return zoo


def _package(folder: Path, name: str, exclusions: dict, schema: str = SCHEMA.name) -> Path:
    path = folder / f"{name}.zip"
    meta = {"schema": f"https://example.org/{schema}", "model_zoo_ci_exclusions": exclusions}
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/configs/metadata.json", json.dumps(meta))
        zf.writestr(f"{name}/configs/inference.json", "{}")
    return path


def test_the_zoo_script_is_run_as_is_and_with_the_submission_lines(tmp_path):
    zoo = _zoo(tmp_path)
    packages = [
        _package(tmp_path, "plain", {}),
        _package(tmp_path, "unet", {"verify_data_shape": SHAPE, "verify_torchscript": SCRIPT}),
        _package(tmp_path, "attention", {"verify_torchscript": "it does not script (`some other file.py`)"}),
        _package(tmp_path, "stale", {"verify_data_shape": SHAPE}),
        _package(tmp_path, "attention_undeclared", {}),
    ]
    results = run_checks(zoo, [str(p) for p in packages], tmp_path / "work", extra=False)
    assert list(results) == ["plain", "unet", "attention", "stale", "attention_undeclared"]
    plain = results["plain"]
    assert plain["as_is"] == plain["submission"]
    assert [plain["as_is"][c][0] for c in CHECKS] == ["passed"] * 6
    assert plain["as_is"]["properties"][1].startswith("checked nothing")  # the zoo printed "all properties:  []"
    unet = results["unet"]
    assert [unet["as_is"][c][0] for c in CHECKS[4:]] == ["failed", "not reached"]  # the zoo stops at the first
    headline = "TypeError: DiffusionModelUNet.forward() missing 1 required positional argument: 'timesteps'"
    assert unet["as_is"]["data_shape"][1].startswith(headline + " (")
    line = next(i for i, text in enumerate(FAKE_VERIFY.splitlines(), 1) if "raise TypeError" in text)
    assert unet["as_is"]["data_shape"][1].endswith(f"(ci/verify_bundle.py:{line})")  # the deepest frame
    assert [unet["submission"][c] for c in CHECKS[4:]] == [("skipped", "in the zoo's list")] * 2
    # each reason is checked with the bundle's other exclusions applied, so the torchscript check is reached
    assert unet["declared"] == {
        "verify_data_shape": {"reason": SHAPE, "problem": ""},
        "verify_torchscript": {"reason": SCRIPT, "problem": ""},
    }
    assert (
        "not found in the real error: RuntimeError: cannot statically"
        in (results["attention"]["declared"]["verify_torchscript"]["problem"])
    )
    assert results["stale"]["declared"]["verify_data_shape"]["problem"] == (
        "declared excluded, but with the other exclusions the zoo's data_shape check is passed"
    )
    assert results["attention_undeclared"]["submission"]["torchscript"][0] == "failed"
    lines, ok = report({"plain": plain, "unet": unet})
    assert ok and "| unet | passed | passed | passed | passed | skipped | skipped |" in lines
    assert "| unet | passed | passed | passed | passed | failed | not reached |" in lines
    for broken in ("attention", "stale", "attention_undeclared"):
        lines, ok = report({"plain": plain, broken: results[broken]})
        assert not ok, broken
    # the zoo's own files are left as they were
    assert (tmp_path / "work" / "ci" / "bundle_custom_data.py").read_text() == CUSTOM_DATA


def test_submission_lines_edit_the_zoo_lists_in_place():
    declared = {
        "unet": {"verify_data_shape": SHAPE, "verify_torchscript": SCRIPT},
        "attention": {"verify_torchscript": SCRIPT},
    }
    assert submission_lines(declared) == {
        "exclude_verify_shape_list": ['    "unet",'],
        "exclude_verify_torchscript_list": ['    "unet",', '    "attention",'],
    }
    entries = {"exclude_verify_shape_list": ["unet"], "exclude_verify_torchscript_list": ["unet", "attention"]}
    edited = with_entries(CUSTOM_DATA, entries)
    assert edited == (
        'exclude_verify_shape_list = [\n    "unet",\n    "other",\n]\n\n'
        'exclude_verify_torchscript_list = [\n    "unet",\n    "attention",\n]\n'
    )
    lists = {}
    exec(edited, lists)  # still the zoo's Python
    assert lists["exclude_verify_torchscript_list"] == ["unet", "attention"]
    with pytest.raises(UserError, match=r"ci/bundle_custom_data.py: no list literal 'exclude_verify_shape_list = \['"):
        with_entries("exclude_verify_shape_list = []\n", {"exclude_verify_shape_list": ["unet"]})


def test_bad_packages_and_zoo_folders_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"no ci/verify_bundle.py; --zoo takes a checkout of Project-MONAI/model-zoo"):
        run_checks(tmp_path, [], tmp_path / "work")
    zoo = _zoo(tmp_path)
    typo = _package(tmp_path, "typo", {"verify_torchscipt": SCRIPT})
    with pytest.raises(
        UserError, match=r"typo/configs/metadata.json: model_zoo_ci_exclusions has \['verify_torchscipt'\]"
    ):
        run_checks(zoo, [str(typo)], tmp_path / "work", extra=False)
    schema = _package(tmp_path, "schema", {}, schema="meta_schema_20990101.json")
    with pytest.raises(UserError, match=r"schema.zip: metadata 'schema' is .*meta_schema_20990101.json'; only"):
        run_checks(zoo, [str(schema)], tmp_path / "work", extra=False)


_SCRIPT_NETWORK = textwrap.dedent(
    """
    import json, re, sys
    import torch
    from monai.bundle import ConfigParser
    parser = ConfigParser()
    parser.read_config(json.loads(sys.argv[1]))
    parser.update({"bundle_root": sys.argv[2], "device": "cpu"})
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
        [sys.executable, "-c", _SCRIPT_NETWORK, json.dumps(configs), str(BUNDLES / bundle)],
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

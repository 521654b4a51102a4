# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``scripts/new_bundle.py``: a new bundle of an existing family, made in a temporary folder, passes
``scripts/verify_bundle.py`` and trains its tiny profile with the command it prints; bad requests write nothing."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from monai.bundle import ConfigParser, ConfigWorkflow

from common.bundle import BUNDLES_DIR
from common.bundle_tools.scaffold import new_bundle
from common.errors import BundleNotFoundError, UserError, user_error_in_chain
from common.runs import command_config_files
from tests.helpers import REPO_ROOT, bundle_env

SCRIPT = REPO_ROOT / "scripts" / "new_bundle.py"


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=bundle_env(), capture_output=True, text=True, timeout=900)


def test_new_bundle_verifies_and_trains_as_printed(tmp_path) -> None:
    result = _run(
        [sys.executable, str(SCRIPT), "ct_autoencoder", "--family", "autoencoder", "--bundles_dir", "new"], tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "made new/ct_autoencoder"
    folder = tmp_path / "new" / "ct_autoencoder"
    metadata = json.loads((folder / "configs" / "metadata.json").read_text())
    assert (metadata["name"], metadata["version"], list(metadata["changelog"])) == (
        "ct_autoencoder",
        "0.1.0",
        ["0.1.0"],
    )
    assert metadata["collection"]["family"] == "autoencoder"
    # the configs are the template's, byte for byte: none names its bundle (config_bundle_root finds the folder)
    for config in (BUNDLES_DIR / "autoencoder_3d" / "configs").glob("*.json"):
        if config.name != "metadata.json":
            assert (folder / "configs" / config.name).read_bytes() == config.read_bytes(), config.name
    card = (folder / "docs" / "README.md").read_text()
    assert card.startswith("# ct_autoencoder\n")
    # the card's training command, as the printed one, needs no --bundle_root outside bundles/
    assert "run training --config_file new/ct_autoencoder/configs/train.json --dataset_dir <your data>\n" in card
    assert not list((tmp_path / "new").glob(".*"))  # no staging folder left

    verify, train = (shlex.split(line.split(": ", 1)[1]) for line in lines[1:3])
    assert lines[1].startswith("verify it: ") and lines[2].startswith("train its tiny profile on its demo data: ")
    result = _run([sys.executable, *verify[1:]], tmp_path)  # the printed commands, with this interpreter
    assert result.returncode == 0 and result.stdout.strip() == "OK: ct_autoencoder", result.stdout + result.stderr
    result = _run([sys.executable, *train[1:], "--num_threads", "1"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = folder / "outputs" / "tiny"
    assert (run / "models" / "model.pt").is_file() and json.loads((run / "metrics.json").read_text())["history"]
    assert json.loads((run / "configs" / "run.json").read_text())["bundle"] == "ct_autoencoder"


@pytest.mark.parametrize(
    "name, family, message",
    [
        ("Bad-Name", "autoencoder", "bundle name 'Bad-Name' must match"),
        ("ok_name", "segmentation", "unknown family 'segmentation'; the families are ['autoencoder', "),
        ("autoencoder_3d", "autoencoder", "'autoencoder_3d' is already a bundle"),
    ],
)
def test_bad_requests_write_nothing(tmp_path, name, family, message) -> None:
    with pytest.raises(UserError, match=message.replace("[", "\\[").replace("(", "\\(")):
        new_bundle(name, family, tmp_path)
    assert not list(tmp_path.iterdir())
    result = _run([sys.executable, str(SCRIPT), name, "--family", family, "--bundles_dir", str(tmp_path)], tmp_path)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and message in result.stderr
    assert result.stdout == "" and not list(tmp_path.iterdir())


# --- a config finds its bundle from its own folder (common.bundle.config_bundle_root)


def _toy_bundle(folder: Path, **items: Any) -> Path:
    """A minimal bundle folder: metadata and a train.json whose ``bundle_root`` is found, plus ``items``."""
    (folder / "configs").mkdir(parents=True)
    (folder / "configs" / "metadata.json").write_text(json.dumps({"name": folder.name, "version": "0.1.0"}))
    config = {
        "imports": ["$import common", "$import common.bundle"],
        "bundle_root": "$common.bundle.config_bundle_root()",
        "output_dir": "$@bundle_root + '/outputs'",
    }
    (folder / "configs" / "train.json").write_text(json.dumps({**config, **items}))
    return folder / "configs" / "train.json"


def bare_bundle_root(config_file: str) -> str:
    """The ``bundle_root`` a bare ``ConfigParser`` of ``config_file`` resolves (called from a config: a parser
    inside another bundle's workflow), or the class of the error it raises."""
    parser = ConfigParser()
    parser.read_config(config_file)
    try:
        return parser.get_parsed_content("bundle_root")
    except RuntimeError as exc:  # MONAI wraps what an expression raises
        return type(user_error_in_chain(exc)).__name__


def test_a_copied_bundle_is_its_own_bundle(tmp_path) -> None:
    """``cp -r`` of a bundle: its configs (which name no bundle) run the copy, not the original."""
    copy = tmp_path / "my_autoencoder"
    shutil.copytree(BUNDLES_DIR / "autoencoder_3d" / "configs", copy / "configs")
    config = str(copy / "configs" / "train.json")
    workflow = ConfigWorkflow(config_file=config, workflow_type="train", init_id="dataset_dir", logging_file=False)
    assert workflow.initialize() == [str(copy.resolve() / "demo_data")]  # resolved by the running workflow
    assert workflow.parser.get_parsed_content("output_dir") == str(copy.resolve() / "outputs")  # and kept
    # --bundle_root still wins
    other = ConfigWorkflow(config_file=config, init_id="output_dir", logging_file=False, bundle_root=str(tmp_path))
    assert other.initialize() == [str(tmp_path / "outputs")]


def test_a_config_parsed_outside_a_workflow_is_told_to_name_its_bundle(tmp_path) -> None:
    """A bare ``ConfigParser`` does not know its files: ``bundle_root`` is an error that says how to set it, also
    for a parser made inside another bundle's workflow (whose folder is not that parser's)."""
    parser = ConfigParser()
    parser.read_config(str(BUNDLES_DIR / "autoencoder_3d" / "configs" / "train.json"))
    with pytest.raises(RuntimeError) as info:
        parser.get_parsed_content("output_dir")
    error = user_error_in_chain(info.value)
    assert isinstance(error, BundleNotFoundError)
    assert "bare monai.bundle.ConfigParser" in str(error) and "parser['bundle_root'] = '<bundle folder>'" in str(error)
    assert "or call workflow.initialize() first" in str(error)
    parser["bundle_root"] = str(tmp_path)
    assert parser.get_parsed_content("output_dir") == str(tmp_path / "outputs")

    inner = str(BUNDLES_DIR / "autoencoder_3d" / "configs" / "train.json")
    outer = _toy_bundle(tmp_path / "outer", inner={"_target_": f"{__name__}.bare_bundle_root", "config_file": inner})
    workflow = ConfigWorkflow(config_file=str(outer), init_id="inner", logging_file=False)
    assert workflow.initialize() == ["BundleNotFoundError"]
    assert ConfigWorkflow(config_file=str(outer), init_id="bundle_root", logging_file=False).initialize() == [
        str((tmp_path / "outer").resolve())
    ]


def test_a_first_config_outside_a_bundle_is_refused(tmp_path) -> None:
    """MONAI reads ``metadata.json`` beside the first config file; a first file elsewhere names that folder."""
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "metadata.json").write_text(json.dumps({"name": "x", "version": "0.1.0"}))
    config = {
        "imports": ["$import common", "$import common.bundle"],
        "bundle_root": "$common.bundle.config_bundle_root()",
    }
    (loose / "extra.json").write_text(json.dumps(config))
    workflow = ConfigWorkflow(config_file=str(loose / "extra.json"), init_id="bundle_root", logging_file=False)
    with pytest.raises(RuntimeError) as info:
        workflow.initialize()
    message = str(user_error_in_chain(info.value))
    assert f"the first config file is in {str(loose)!r}, which is not the configs/ folder of a bundle" in message
    assert "pass --bundle_root <bundle folder>" in message


def test_monai_commands_other_than_run_give_their_config_files() -> None:
    """``python -m monai.bundle ckpt_export`` / ``verify_net_in_out`` parse a bare ``ConfigParser``: their first
    ``--config_file`` names the bundle; any other process gives nothing to go by."""
    main = "/env/lib/monai/bundle/__main__.py"
    files = ["/b/x/configs/inference.json", "/b/x/configs/tiny.json"]
    assert command_config_files([main, "verify_net_in_out", "network", "--config_file", json.dumps(files)]) == files
    assert command_config_files([main, "ckpt_export", f"--config_file={files[0]}", "--n", "4"]) == files[:1]
    assert command_config_files(["notebook.py", "--config_file", files[0]]) == []
    assert command_config_files([main, "ckpt_export", "--filepath", "m.ts"]) == []

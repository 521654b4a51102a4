# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``scripts/new_bundle.py``: a new bundle of an existing family, made in a temporary folder, passes
``scripts/verify_bundle.py`` and trains its tiny profile with the command it prints; bad requests write nothing."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from common.bundle_tools.scaffold import new_bundle
from common.errors import UserError
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
    assert "bundle_root('ct_autoencoder')" in (folder / "configs" / "train.json").read_text()
    card = (folder / "docs" / "README.md").read_text()
    assert card.startswith("# ct_autoencoder\n")
    # the card's training command, as the printed one, finds a bundle outside bundles/ by --bundle_root
    assert "run training --config_file new/ct_autoencoder/configs/train.json --bundle_root new/ct_autoencoder" in card
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

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The record of a training run (``common/runs.py``), the settings-naming checkpoint error and the user-error hook
(``common/errors.py``). The bundle workflow tests cover the same through the command line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.checkpoint_io import CheckpointError, load_network_weights, save_checkpoint
from common.errors import MissingInputError, UserError, user_error_in_chain
from common.runs import (
    RUN_FILE,
    RunRecordError,
    make_record,
    read_record,
    run_dir_of,
    run_settings,
    settings_differences,
)
from tests.helpers import BUNDLES, REPO_ROOT, tiny_autoencoder

AE = BUNDLES / "autoencoder_3d"
TRAIN, TINY = AE / "configs" / "train.json", AE / "configs" / "tiny.json"


def _argv(*args: str) -> list[str]:
    return ["/x/site-packages/monai/bundle/__main__.py", "run", "training", *args]


def test_record_holds_what_differs_from_train_json(tmp_path):
    argv = _argv(
        "--config_file",
        json.dumps([str(TRAIN), str(TINY)]),
        "--output_dir",
        str(tmp_path),
        "--channels",
        "[8,16,32]",
        "--lr",
        "1e-4",  # the default: not a difference
        "--train#trainer#grad_clip",
        "0.5",
        "--run_id",
        "x",
    )
    record = make_record(tmp_path, AE, argv=argv)
    tiny, train = json.loads(TINY.read_text()), json.loads(TRAIN.read_text())
    changed = {k: v for k, v in tiny.items() if train.get(k) != v}
    assert changed != tiny  # tiny.json repeats some defaults (batch_size), which are not differences
    expected = {**changed, "channels": [8, 16, 32], "output_dir": str(tmp_path), "train#trainer#grad_clip": 0.5}
    assert record.settings == expected
    assert record.write() == tmp_path / RUN_FILE
    content = read_record(tmp_path)
    assert content["bundle"] == "autoencoder_3d" and content["settings"] == expected
    assert content["config_files"] == {
        str(f.resolve()): "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest() for f in (TRAIN, TINY)
    }
    assert "run_id" not in content["command_line"] and content["command_line"]["lr"] == 1e-4
    # read back: train.json's plain defaults updated with the run's settings (nested ids stay out)
    settings = run_settings(tmp_path, AE)
    assert settings["channels"] == [8, 16, 32] and settings["patch_size"] == tiny["patch_size"]
    assert settings["latent_channels"] == train["latent_channels"]
    assert "train#trainer#grad_clip" not in settings


def test_no_record_outside_a_bundle_command(tmp_path):
    assert make_record(tmp_path, AE, argv=["pytest"]) is None
    assert read_record(tmp_path) is None
    assert run_settings(tmp_path, AE) == run_settings(tmp_path / "elsewhere", AE)  # the defaults


def test_resolved_values_are_recorded(tmp_path):
    argv = _argv("--config_file", str(TRAIN))
    record = make_record(tmp_path, AE, resolved={"intensity": {"mode": "ct", "a_min": -1000, "a_max": 1000}}, argv=argv)
    assert record.settings == {"intensity": {"mode": "ct", "a_min": -1000, "a_max": 1000}}


def test_bad_records_are_named(tmp_path):
    path = tmp_path / RUN_FILE
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(RunRecordError, match="run.json' cannot be read as JSON"):
        run_settings(tmp_path, AE)
    path.write_text(json.dumps({"bundle": "vqgan_3d", "name": "Patchwise 3D VQ-GAN", "settings": {}}))
    with pytest.raises(
        RunRecordError, match=r"records a run of bundle 'Patchwise 3D VQ-GAN' \(vqgan_3d\), not '3D auto"
    ):
        run_settings(tmp_path, AE)
    path.write_text(json.dumps({"bundle": "autoencoder_3d"}))
    with pytest.raises(RunRecordError, match="no 'settings' object"):
        read_record(tmp_path)
    assert isinstance(RunRecordError("x"), UserError)


def test_settings_differences_leave_out_locations_and_optimisation():
    recorded = {"channels": [8, 16], "lr": 1e-3, "dataset_dir": "/a", "norm_num_groups": 4, "only_here": 1}
    current = {"channels": [16, 32], "lr": 1e-4, "dataset_dir": "/b", "norm_num_groups": 4, "expr": "$1"}
    assert settings_differences(recorded, current) == ["channels: checkpoint [8, 16], config [16, 32]"]


def _fake_run(root: Path, channels: list[int], record: bool = True) -> Path:
    """A run folder with ``models/model.pt`` of a tiny AutoencoderKL with ``channels`` (and its ``run.json``)."""
    save_checkpoint(tiny_autoencoder(channels=channels).state_dict(), root / "models" / "model.pt")
    if record:
        argv = _argv("--config_file", str(TRAIN), "--channels", json.dumps(channels), "--latent_channels", "2")
        make_record(root, AE, argv=argv).write()
    return root / "models" / "model.pt"


def test_checkpoint_that_does_not_fit_names_the_settings(tmp_path):
    ckpt = _fake_run(tmp_path, [8, 16])
    assert run_dir_of(ckpt) == tmp_path.resolve()
    current = {**run_settings(tmp_path, AE), "channels": [8, 32]}
    network = tiny_autoencoder(seed=None)  # channels (8, 16) ... but the config says [8, 32]
    load_network_weights(network, ckpt, settings=current)  # fits: the weights decide, the settings only explain
    with pytest.raises(CheckpointError) as info:
        load_network_weights(tiny_autoencoder(seed=None, channels=(8, 32)), ckpt, settings=current)
    message = str(info.value)
    assert "does not fit the configured AutoencoderKL" in message
    assert "settings that differ - channels: checkpoint [8, 16], config [8, 32]" in message
    assert str(tmp_path.resolve() / RUN_FILE) in message and "tensors differ in shape" in message
    assert "\n" not in message and "size mismatch for" not in message


def test_checkpoint_without_record_says_so(tmp_path):
    ckpt = _fake_run(tmp_path, [8, 16], record=False)
    assert run_dir_of(ckpt) is None
    with pytest.raises(CheckpointError, match="recorded no settings"):
        load_network_weights(tiny_autoencoder(seed=None, channels=(8, 32)), ckpt)


def test_user_error_found_through_monai_wrapping():
    try:
        try:
            raise MissingInputError("no input volumes")
        except MissingInputError as e:
            raise RuntimeError("Failed to evaluate ConfigExpression") from e
    except RuntimeError as wrapped:
        assert str(user_error_in_chain(wrapped)) == "no input volumes"
    assert user_error_in_chain(RuntimeError("a bug")) is None


@pytest.mark.parametrize("user_error", [True, False])
def test_user_error_hook_prints_the_message_last(user_error):
    raised = "MissingInputError('no input volumes under /data')" if user_error else "KeyError('a bug')"
    code = (
        "from common.errors import MissingInputError, install_user_error_hook\n"
        "install_user_error_hook()\n"
        "try:\n"
        f"    raise {raised}\n"
        "except Exception as e:\n"
        "    raise RuntimeError('Failed to evaluate ConfigExpression') from e\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    if user_error:
        assert lines == ["error: no input volumes under /data"]
    else:  # a bug keeps its traceback
        assert lines[0].startswith("Traceback") and "KeyError: 'a bug'" in result.stderr


def _bundle_with_former_defaults(folder: Path, former: Any) -> Path:
    (folder / "configs").mkdir(parents=True)
    metadata = {"name": "toy", "version": "0.4.0", "collection": {"former_defaults": former}}
    (folder / "configs" / "metadata.json").write_text(json.dumps(metadata))
    (folder / "configs" / "train.json").write_text(json.dumps({"mode": "direct", "steps": 5, "lr": 0.1}))
    return folder


def test_a_record_reads_the_defaults_of_the_version_that_wrote_it(tmp_path):
    """A record keeps only what differs from train.json: a run of an older version reads the defaults it was trained
    under where they have changed since (the earliest change after its version wins), a newer run today's."""
    from common.bundle_tools.registry import former_defaults_problems
    from common.runs import former_defaults

    former = {"0.3.0": {"mode": "gan", "steps": 1}, "0.4.0": {"mode": "diffusion"}}
    root = _bundle_with_former_defaults(tmp_path / "toy", former)
    assert former_defaults(root, "0.2.9") == {"mode": "gan", "steps": 1}
    assert former_defaults(root, "0.3.5") == {"mode": "diffusion"}
    assert former_defaults(root, "0.4.0") == former_defaults(root, None) == {}
    run = tmp_path / "run"
    (run / "configs").mkdir(parents=True)
    (run / RUN_FILE).write_text(json.dumps({"name": "toy", "version": "0.3.5", "settings": {"lr": 0.2}}))
    assert run_settings(run, root, argv=[]) == {"mode": "diffusion", "steps": 5, "lr": 0.2}
    (run / RUN_FILE).write_text(json.dumps({"name": "toy", "version": "0.4.0", "settings": {"lr": 0.2}}))
    assert run_settings(run, root, argv=[]) == {"mode": "direct", "steps": 5, "lr": 0.2}
    problems = former_defaults_problems(root, {"0.5.0": {"mode": "x"}, "0.1.0": {"nope": 1}}, {"mode", "steps"})
    assert problems == [
        "configs/metadata.json: 'collection.former_defaults': '0.5.0' must be a version (dotted integers) up to the "
        "bundle's",
        "configs/metadata.json: 'collection.former_defaults.0.1.0': 'nope' is not an id of configs/train.json",
    ]

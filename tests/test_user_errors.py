# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""A user error in library and workflow use is an exception the caller can catch (a ``UserError``, which is a
``ValueError``), never the end of the process: ``ConfigWorkflow(...).initialize()`` and ``create_workflow(...)``
on a bad setting raise it (MONAI raises it as the cause of its ``RuntimeError``) with the message the command line
prints as ``error: ...`` (exit status 1), and nothing is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from monai.bundle import ConfigWorkflow, create_workflow

from common.errors import SettingsError, UserError, user_error_in_chain
from tests.bundle_cases import CASES
from tests.helpers import BUNDLES, REPO_ROOT, bundle_env, overrides


def _train_config(bundle: str) -> str:
    return str(BUNDLES / bundle / "configs" / "train.json")


def _settings_error(exc: BaseException) -> UserError:
    error = user_error_in_chain(exc)
    assert isinstance(error, SettingsError) and isinstance(error, ValueError), repr(exc)
    return error


def test_user_error_is_a_value_error() -> None:
    assert issubclass(UserError, ValueError) and issubclass(SettingsError, UserError)


@pytest.mark.parametrize("bundle", sorted(CASES))
def test_config_workflow_and_create_workflow_raise_the_settings_error(bundle: str, tmp_path: Path) -> None:
    """The invalid settings of the bundle's case (tests/bundle_cases.py) given to ``ConfigWorkflow`` and
    ``create_workflow``: one settings error naming each of them, the same from both, before anything is written."""
    case = CASES[bundle]
    settings = {**case.write_data(tmp_path / "data"), **case.bad_settings}  # the case's data: every check applies
    files = [_train_config(bundle), *(str(BUNDLES / bundle / "configs" / name) for name in case.configs)]
    out = tmp_path / "out"
    workflow = ConfigWorkflow(config_file=files, workflow_type="train", output_dir=str(out), **settings)
    with pytest.raises(Exception) as info:  # noqa: PT011 - MONAI wraps it; the cause is checked below
        workflow.initialize()
    error = _settings_error(info.value)
    missing = [phrase for phrase in case.refused if phrase not in str(error)]
    assert not missing, f"the error does not name {missing}: {error}"
    with pytest.raises(Exception) as again:  # noqa: PT011
        create_workflow(config_file=files, workflow_type="train", output_dir=str(out), **settings)
    assert str(_settings_error(again.value)) == str(error)
    assert not out.exists()  # refused before anything was written


def test_command_line_prints_the_same_message_and_exits_1(tmp_path: Path) -> None:
    bad = CASES["autoencoder_3d"].bad_settings
    out = tmp_path / "out"
    with pytest.raises(Exception) as info:  # noqa: PT011
        ConfigWorkflow(
            config_file=_train_config("autoencoder_3d"), workflow_type="train", output_dir=str(out), **bad
        ).initialize()
    message = str(_settings_error(info.value))
    cmd = [sys.executable, "-m", "monai.bundle", "run", "training", "--config_file", _train_config("autoencoder_3d")]
    cmd += overrides(output_dir=str(out), **bad)
    result = subprocess.run(cmd, cwd=tmp_path, env=bundle_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.endswith(f"error: {message}\n"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_library_code_does_not_end_the_process() -> None:
    """No module of the shared library calls ``sys.exit`` or raises ``SystemExit`` (nor does any bundle config):
    only the command-line entry points (``scripts/``, ``__main__`` blocks) turn a ``UserError`` into an exit status,
    and ``common.runs.exit_on_command_line`` gives ``python -m monai.bundle`` its status (tested below)."""
    offenders = []
    for path in sorted((REPO_ROOT / "common").rglob("*.py")):
        text = path.read_text()
        body = text.split('\nif __name__ == "__main__":')[0]
        function = ""
        for number, line in enumerate(body.splitlines(), 1):
            if line.startswith("def "):
                function = line.split("(")[0][4:]
            code = line.split("#")[0]
            if "sys.exit(" in code or "raise SystemExit" in code:
                if (path.name, function) != ("runs.py", "exit_on_command_line"):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    for path in sorted(BUNDLES.glob("*/configs/*.json")):
        if "sys.exit" in path.read_text() or "SystemExit" in path.read_text():
            offenders.append(str(path.relative_to(REPO_ROOT)))
    assert not offenders, offenders


def test_only_the_bundle_command_line_ends_the_process_with_a_run_status() -> None:
    """An inference ``run`` list's last item: exit status 1 or 2 on ``python -m monai.bundle`` (also under torchrun),
    the status returned anywhere else (a notebook, ``ConfigWorkflow(...).run()``, ``monai.bundle.run``)."""
    from common.runs import exit_on_command_line

    cli = ["/env/lib/python3.11/site-packages/monai/bundle/__main__.py", "run", "--config_file", "inference.json"]
    for status in (1, 2):
        with pytest.raises(SystemExit) as ended:
            exit_on_command_line(status, argv=cli)
        assert ended.value.code == status
        assert exit_on_command_line(status, argv=["/env/bin/ipykernel_launcher.py", "-f", "kernel.json"]) == status
        assert exit_on_command_line(status, argv=["/env/bin/pytest"]) == status
    assert exit_on_command_line(0, argv=cli) == 0
    assert exit_on_command_line(2) == 2  # this process is pytest

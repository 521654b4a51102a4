# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The check of a run's overrides against its bundle's config files, the same whichever way they came: a
``python -m monai.bundle run`` command line (:func:`check_command_line`) or Python (``ConfigWorkflow(..., id=value)``,
``create_workflow``, ``parser.update``: :func:`check_parsed_overrides`). A misspelt id is refused with the closest
known ids, a value replacing a plain default must be of its kind. A config's preamble
(:func:`common.config_checks.check_config`) runs it first."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import SettingsError
from common.runs import RUN_ARGUMENTS, command_line, config_being_parsed, config_file_list, is_plain, parsed_config

__all__ = ["check_command_line", "check_parsed_overrides"]


def _kind_problem(name: str, default: Any, value: Any) -> str | None:
    """Why ``value`` cannot replace the plain default ``default`` of config id ``name`` (as the user wrote it:
    ``--max_epochs`` or ``'max_epochs'``), or ``None``."""
    if value is None or default is None or (isinstance(value, str) and value[:1] in ("$", "@", "%")):
        return None
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, (list, tuple)):
        ok, kind = isinstance(value, (list, tuple)), "a list"
    elif isinstance(default, dict):
        ok, kind = isinstance(value, dict), "a dict"
    else:
        return None  # strings take many forms (paths, "auto", modes) and are checked where they are used
    if ok:
        return None
    return f"{name} must be {kind} like its default {default!r}, got {value!r} ({type(value).__name__})."


def _unknown_id_problem(name: str, config_id: str, known: Sequence[str], where: str) -> str:
    """The line refusing an override of ``config_id`` (written ``name``) that no config of ``where`` has."""
    close = difflib.get_close_matches(config_id, list(known), n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    return f"{name} is not an id of {where}{hint}."


def _lookup(parser: Any, config_id: str) -> Any:
    """The raw config at ``config_id``, or ``None`` when there is none."""
    try:
        return parser[config_id]
    except (KeyError, IndexError, ValueError, TypeError):
        return None


def check_command_line(argv: Sequence[str] | None = None) -> list[str]:
    """Check the overrides of a ``python -m monai.bundle run`` command line against its config files: every
    ``--id`` must exist in the merged configs (a misspelt id would otherwise silently add a new, unused one) and a
    value replacing a plain boolean, number, list or dict must be of the same kind. A nested id may add a new key
    to an existing component (a new argument), but its parent must exist.

    Args:
        argv: the command line (default ``sys.argv``); nothing is checked outside ``monai.bundle run``.

    Returns:
        The ids checked.

    Raises:
        ValueError: naming every unknown id (with the closest known ids) and every value of the wrong kind.
    """
    from monai.bundle import ConfigParser

    overrides = command_line(argv)
    if not overrides or "config_file" not in overrides:
        return []
    parser = ConfigParser()
    parser.read_config(config_file_list(overrides["config_file"]))
    known = [k for k in parser.get() if isinstance(k, str)]
    problems = []
    checked = [k for k in overrides if k not in RUN_ARGUMENTS]
    for name in checked:
        try:
            default = parser[name]
        except (KeyError, IndexError, ValueError, TypeError):
            parent = name.rpartition("#")[0]
            if parent and isinstance(_lookup(parser, parent), dict):
                continue  # a new argument of an existing component (``--train#handlers#3#exec_at_start``)
            problems.append(
                _unknown_id_problem(f"--{name}", name, known, str(config_file_list(overrides["config_file"])))
            )
            continue
        problem = _kind_problem(f"--{name}", default, overrides[name])
        if problem:
            problems.append(problem)
    if problems:
        raise SettingsError("the command line has problems:\n  " + "\n  ".join(problems))
    return checked


_REFERENCE = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)")


def _references(value: Any, found: set[str]) -> set[str]:
    """The top-level ids that ``@`` references inside ``value`` name (in references and expressions)."""
    if isinstance(value, str):
        found.update(_REFERENCE.findall(value))
    elif isinstance(value, dict):
        for item in value.values():
            _references(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _references(item, found)
    return found


def check_parsed_overrides(config: Any = None) -> list[str]:
    """The check of :func:`check_command_line` for a workflow built in Python (``ConfigWorkflow(..., id=value)``,
    ``create_workflow``, ``monai.bundle.run`` called in-process, ``parser.update`` in a notebook), whose overrides
    MONAI merges without keeping them apart: a top-level id that none of the bundle's config files has and nothing
    in the config reads (a misspelt ``max_epoch=5`` would otherwise be ignored) is refused with the closest known
    ids, and a plain value replacing the bundle files' plain values must be of their kind.

    Args:
        config: the ``ConfigParser`` (or its resolver) to check; default: the config being parsed.

    Returns:
        The top-level ids checked.

    Raises:
        SettingsError: naming every unknown id (with the closest known ids) and every value of the wrong kind.
    """
    resolver = getattr(config, "ref_resolver", config) if config is not None else config_being_parsed()
    merged = parsed_config(resolver)
    if merged is None or "bundle_root" not in merged:
        return []
    root = Path(resolver.get_resolved_content("bundle_root"))
    defaults: dict[str, list[Any]] = {}
    for path in sorted((root / "configs").glob("*.json")):
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # not a config this workflow merged (it would have failed to parse): it names no known id
        if isinstance(content, dict):
            for key, value in content.items():
                defaults.setdefault(str(key).lstrip("+"), []).append(value)
    read = _references(merged, set())
    problems, checked = [], []
    for name, value in merged.items():
        if not isinstance(name, str) or name in ("_meta_", "imports"):
            continue
        checked.append(name)
        if name not in defaults:
            if name not in read:
                problems.append(_unknown_id_problem(repr(name), name, list(defaults), f"the configs of {str(root)!r}"))
            continue
        kinds = [_kind_problem(repr(name), default, value) for default in defaults[name] if is_plain(default)]
        if kinds and all(kinds):
            problems.append(kinds[0])
    if problems:
        raise SettingsError("the overrides have problems:\n  " + "\n  ".join(problems))
    return checked

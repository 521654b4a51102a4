# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Locating a bundle's folder from its configs, in the repository and in a packaged (standalone) bundle, and the
checks every bundle's settings share."""

from __future__ import annotations

import difflib
import importlib
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.errors import BundleNotFoundError, MissingInputError, SettingsError, UserError, install_user_error_hook
from common.networks.wrappers import MEMORY_FORMATS
from common.runs import RUN_ARGUMENTS, command_line, config_being_parsed, config_file_list, is_plain, parsed_config
from common.utils import check_amp

__all__ = [
    "BUNDLES_DIR",
    "METADATA",
    "ROOT",
    "bundle_names",
    "bundle_root",
    "check_command_line",
    "check_run",
    "check_parsed_overrides",
    "check_settings",
    "checkout_problem",
    "demo_generator",
    "find_checkpoint",
    "is_bundle",
    "make_demo_data",
    "resolve_bundle",
]


ROOT = Path(__file__).resolve().parent.parent
"""The folder holding ``common/``: the repository, or a packaged bundle's folder (``common/`` beside ``configs/``)."""
BUNDLES_DIR = ROOT / "bundles"
"""The repository's bundles, one folder each (absent in a packaged bundle)."""
METADATA = Path("configs") / "metadata.json"


def checkout_problem(script: str | os.PathLike) -> str | None:
    """Why the script at ``script`` (its ``__file__``) would run another checkout's code, or ``None``.

    ``python scripts/<x>.py`` puts ``scripts/``, not the repository, on ``sys.path``, so ``common`` (and every
    folder it finds: ``ROOT``, the bundles, the harness) comes from wherever the environment installed it - with
    one environment shared by two clones, the first one's. A script's entry point stops with this line instead.
    """
    theirs = Path(script).resolve().parent.parent
    if theirs == ROOT or not (theirs / "common").is_dir():
        return None
    return (
        f"{Path(script).name} is in the checkout {str(theirs)!r} but this Python imports the collection from "
        f"{str(ROOT)!r}; run it there, or make this environment use this checkout: pip install -e {str(theirs)!r}"
    )


def is_bundle(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a bundle folder: it holds ``configs/metadata.json``."""
    return (Path(folder) / METADATA).is_file()


def bundle_names(bundles_dir: str | os.PathLike | None = None) -> list[str]:
    """The names of the bundle folders directly under ``bundles_dir``, sorted.

    Args:
        bundles_dir: the folder holding one sub-folder per bundle; default: :data:`BUNDLES_DIR`.
    """
    root = Path(bundles_dir) if bundles_dir is not None else BUNDLES_DIR
    return sorted(p.parent.parent.name for p in root.glob(f"*/{METADATA.as_posix()}") if p.is_file())


def resolve_bundle(target: str | os.PathLike, bundles_dir: str | os.PathLike | None = None) -> Path:
    """The folder of the bundle meant by ``target``, absolute: a bundle name under ``bundles_dir``, the path of a
    bundle folder, or, inside a packaged bundle (``common/`` copied beside ``configs/``), that bundle's own name.

    Args:
        target: a bundle name (``autoencoder_3d``) or a folder path (``/tmp/copy/autoencoder_3d``).
        bundles_dir: where names are looked up; default: :data:`BUNDLES_DIR`.

    Raises:
        BundleNotFoundError: naming ``target`` and the bundles there are.
    """
    root = Path(bundles_dir) if bundles_dir is not None else BUNDLES_DIR
    name = str(target)
    candidates = [root / name, Path(name).expanduser()]
    if bundles_dir is None and is_bundle(ROOT):
        candidates.append(ROOT)  # a packaged bundle: the folder holding common/ is the bundle
    for candidate in candidates:
        if is_bundle(candidate):
            return candidate.resolve()
    names = bundle_names(root)
    raise BundleNotFoundError(
        f"unknown bundle {name!r}: neither a bundle in {str(root)!r} nor a folder with {METADATA.as_posix()}; "
        f"available: {', '.join(names) or '(none)'}."
    )


def bundle_root(name: str) -> str:
    """The folder of bundle ``name`` (:func:`resolve_bundle`), as a config's ``bundle_root`` reads it."""
    return str(resolve_bundle(name))


def demo_generator(path: str) -> Callable[..., Any]:
    """The demo-data generator at the dotted ``path`` (``common.demo.<module>.<function>``), imported when a config
    asks for demo data: the generators live in ``common/demo``, which a packaged bundle does not carry.

    Raises:
        MissingInputError: when ``common.demo`` is not there (a packaged bundle): the message says to point
            ``dataset_dir`` at the data to use.
        AttributeError: when the module has no such function.
    """
    module, _, name = str(path).rpartition(".")
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise
        raise MissingInputError(
            f"demo data was requested ('dataset_dir' is the bundle's demo_data folder) but {module} is not here: a "
            "packaged bundle carries no demo-data generators. Pass --dataset_dir with your own data (a folder with "
            "datalist.json, see the model card), or run the demo from the repository."
        ) from e
    return getattr(found, name)


def make_demo_data(generator: str, enabled: bool = True, **kwargs: Any) -> Any:
    """Call the demo-data generator at the dotted path ``generator`` (see :func:`demo_generator`) with ``kwargs``
    when ``enabled`` (a config's ``demo_data``); nothing is done (``None``) otherwise, and nothing is imported.

    Args:
        generator: ``common.demo.<module>.<function>``.
        enabled: write the demo data.
        kwargs: the generator's arguments.
    """
    return demo_generator(generator)(**kwargs) if enabled else None


def find_checkpoint(output_dir: str, bundle_root: str, name: str = "model.pt") -> str:
    """The weights an evaluation/inference config loads by default.

    ``<output_dir>/models/<name>`` (what training wrote) when it exists, else ``<bundle_root>/models/<name>``
    (where a packaged or downloaded bundle keeps its weights).

    Raises:
        MissingInputError: naming both places when neither exists.
    """
    candidates = [Path(output_dir) / "models" / name, Path(bundle_root) / "models" / name]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise MissingInputError(
        f"no trained weights: looked for {[str(c) for c in candidates]}; train first or pass --ckpt_path."
    )


def check_settings(check: Callable[..., Any], **settings: Any) -> Any:
    """Run a check or a builder of a config whose failure is a configuration error, before anything is written: a
    ``ValueError``/``TypeError`` it raises (whose message names the config ids) becomes a :class:`SettingsError`
    with the same message; a :class:`UserError` (e.g. ``CheckpointError``) passes as it is.

    Configs use it for the run's own checks (:func:`check_run`), checks of computed values (the training split's
    size) and builders (loading a frozen autoencoder for latent diffusion, or weights that must fit the configured
    network): their result is returned. A family's settings are checked by
    :func:`common.config_checks.check_config`, which reads the ids itself. On the command line
    the error ends the command with ``error: <message>`` and exit status 1 (:func:`check_run` installs the hook);
    in a notebook or ``ConfigWorkflow`` it can be caught (MONAI raises it as the cause of a ``RuntimeError``).

    Args:
        check: a function raising ``ValueError`` for invalid settings, e.g.
            ``common.survival.settings.check_training_size``.
        settings: the config values, passed to ``check`` by name.

    Returns:
        What ``check`` returns.

    Raises:
        SettingsError: with the message of the check's error.
    """
    try:
        return check(**settings)
    except UserError:
        raise
    except (ValueError, TypeError) as exc:
        raise SettingsError(str(exc)) from exc


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


def check_run(
    amp: str | None = None, device: Any = None, argv: Sequence[str] | None = None, memory_format: str | None = None
) -> None:
    """The checks every bundle runs first in ``initialize``: the command line (:func:`check_command_line`), or from
    Python the overrides merged into the config being parsed (:func:`check_parsed_overrides`), the
    mixed precision against the device (:func:`common.utils.check_amp`) and, for training, the memory layout
    (:data:`common.networks.wrappers.MEMORY_FORMATS`).

    Raises:
        ValueError: listing every problem.
    """

    install_user_error_hook()
    problems = []
    try:
        if command_line(argv) is None:
            check_parsed_overrides()
        else:
            check_command_line(argv)
    except ValueError as exc:
        problems.append(str(exc))
    try:
        if amp is not None:
            check_amp(amp, device)
    except ValueError as exc:
        problems.append(str(exc))
    if memory_format is not None and memory_format not in MEMORY_FORMATS:
        problems.append(f"'memory_format' must be one of {MEMORY_FORMATS}, got {memory_format!r}.")
    if problems:
        raise SettingsError("\n".join(problems))

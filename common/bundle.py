# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Locating a bundle's folder from its configs, in the repository and in a packaged (standalone) bundle, its demo
data and checkpoints, and the wrapper that makes a config builder's failure a settings error."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.errors import BundleNotFoundError, MissingInputError, SettingsError, UserError
from common.runs import METADATA, bundle_of_config, command_config_files, workflow_being_run

__all__ = [
    "BUNDLES_DIR",
    "METADATA",
    "ROOT",
    "bundle_names",
    "bundle_root",
    "call_with_settings",
    "checkout_problem",
    "config_bundle_root",
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
    """The folder of bundle ``name`` (:func:`resolve_bundle`), as a string."""
    return str(resolve_bundle(name))


def config_bundle_root() -> str:
    """A config's ``bundle_root``: the folder of the bundle whose configs are being run, so that no config names its
    own bundle and a copied bundle folder is its own bundle.

    It is the folder of the first config file of the ``monai.bundle.ConfigWorkflow`` running the config
    (:func:`common.runs.workflow_being_run`; ``python -m monai.bundle run`` is one), as MONAI reads
    ``metadata.json`` beside it; for MONAI's other commands (``python -m monai.bundle ckpt_export`` or
    ``verify_net_in_out``) the folder of their first ``--config_file``
    (:func:`common.runs.command_config_files`); inside a packaged bundle (``common/`` beside ``configs/``) that
    bundle. Resolved once by the workflow's ``initialize`` (its settings checks read ``dataset_dir`` or
    ``output_dir``), the value stays in the parser's cache, so ``workflow.parser.get_parsed_content(...)``
    afterwards sees it too.

    Raises:
        BundleNotFoundError: when the workflow's first config file is not in a bundle's ``configs/`` folder, or the
            config is parsed by a bare ``ConfigParser`` (which does not know its files) outside a packaged
            bundle; the message says how to give ``bundle_root``.
    """
    workflow = workflow_being_run()
    if workflow is not None:
        found = bundle_of_config(workflow.config_root_path)
        if found is None:
            raise BundleNotFoundError(
                f"bundle_root: the first config file is in {str(workflow.config_root_path)!r}, which is not the "
                f"configs/ folder of a bundle (a folder with {METADATA.as_posix()}); list the bundle's train.json "
                "first, or pass --bundle_root <bundle folder>."
            )
        return str(found)
    files = command_config_files()  # MONAI's other commands (ckpt_export, verify_net_in_out) parse bare
    found = bundle_of_config(Path(files[0]).parent) if files else None
    if found is not None:
        return str(found)
    if is_bundle(ROOT):
        return str(ROOT)  # a packaged bundle: the folder holding common/ is the bundle
    raise BundleNotFoundError(
        "bundle_root: this config is parsed by a bare monai.bundle.ConfigParser (or a ConfigWorkflow's parser before "
        "its initialize()), which does not know the folder of its files; set it before parsing "
        "(parser['bundle_root'] = '<bundle folder>'), or call workflow.initialize() first."
    )


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


def call_with_settings(check: Callable[..., Any], **settings: Any) -> Any:
    """Run a check or a builder of a config whose failure is a configuration error, before anything is written: a
    ``ValueError``/``TypeError`` it raises (whose message names the config ids) becomes a :class:`SettingsError`
    with the same message; a :class:`UserError` (e.g. ``CheckpointError``) passes as it is.

    Configs use it for checks of computed values (the training split's size) and builders (loading a frozen
    autoencoder for latent diffusion, or weights that must fit the configured network): their result is returned.
    A config's settings are checked by its preamble, :func:`common.config_checks.check_config`, which reads the ids
    itself and installs the hook that makes the error, on the command line, end the command with
    ``error: <message>`` and exit status 1; in a notebook or ``ConfigWorkflow`` it can be caught (MONAI raises it as
    the cause of a ``RuntimeError``).

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

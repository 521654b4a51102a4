# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Locating a bundle's folder from its configs, in the repository and in a packaged (standalone) bundle, and the
checks every bundle's settings share."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["bundle_root", "check_settings_or_exit", "find_checkpoint", "flag_problems"]


def bundle_root(name: str) -> str:
    """The folder of bundle ``name``.

    In the repository, ``common/`` sits beside ``bundles/`` and the bundle is ``bundles/<name>``; in a packaged
    bundle, ``common/`` is copied into the bundle folder itself (beside ``configs/``).

    Raises:
        FileNotFoundError: when neither layout is found.
    """
    parent = Path(__file__).resolve().parent.parent
    candidates = [parent / "bundles" / name, parent]
    for candidate in candidates:
        if (candidate / "configs" / "metadata.json").is_file():
            return str(candidate)
    raise FileNotFoundError(f"bundle {name!r} not found; looked in {[str(c) for c in candidates]}.")


def find_checkpoint(output_dir: str, bundle_root: str, name: str = "model.pt") -> str:
    """The weights an evaluation/inference config loads by default.

    ``<output_dir>/models/<name>`` (what training wrote) when it exists, else ``<bundle_root>/models/<name>``
    (where a packaged or downloaded bundle keeps its weights).

    Raises:
        FileNotFoundError: naming both places when neither exists.
    """
    candidates = [Path(output_dir) / "models" / name, Path(bundle_root) / "models" / name]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"no trained weights: looked for {[str(c) for c in candidates]}; train first or pass --ckpt_path."
    )


def check_settings_or_exit(check: Callable[..., Any], **settings: Any) -> Any:
    """Run a bundle's hyperparameter check first thing in ``initialize``: on ``ValueError``/``TypeError`` print
    its message (which names the config ids) and exit with status 1, before anything is built or written.

    It also guards builders whose failure is a configuration error (e.g. loading a frozen autoencoder for latent
    diffusion, or weights that do not fit the configured network: ``CheckpointError``): their result is returned.

    Args:
        check: a function raising ``ValueError`` for invalid settings, e.g.
            ``common.networks.vqgan.check_vqgan_settings``.
        settings: the config values, passed to ``check`` by name.

    Returns:
        What ``check`` returns.
    """
    from common.handlers.checkpoint import CheckpointError

    try:
        return check(**settings)
    except (ValueError, TypeError, CheckpointError) as exc:
        print(f"configuration error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def flag_problems(flags: Mapping[str, Any] | None) -> list[str]:
    """A problem line for every on/off config id in ``flags`` (id -> value) whose value is not a boolean: the
    command line reads ``true``/``false`` as strings, and the string ``"false"`` is true."""
    return [
        f"{name!r} must be True or False (write True/False on the command line), got {value!r}."
        for name, value in (flags or {}).items()
        if not isinstance(value, bool)
    ]

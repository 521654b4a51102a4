# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Locating a bundle's folder from its configs, in the repository and in a packaged (standalone) bundle."""

from __future__ import annotations

from pathlib import Path

__all__ = ["bundle_root", "find_checkpoint"]


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

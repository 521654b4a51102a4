# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The one table of the harness: the module of ``scripts/harness`` that holds each bundle's benchmarks
(``BENCHMARKS``, commands of ``scripts/benchmark.py``) and its small fault-test job (``fault_case``, used by
``scripts/reliability.py``). A new bundle adds one row here and one module beside the others."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

__all__ = ["BUNDLES", "FAMILY_MODULES", "benchmarks", "family"]

FAMILY_MODULES = {
    "autoencoder_3d": "scripts.harness.autoencoder",
    "vqgan_3d": "scripts.harness.vqgan",
    "fast_ddpm_3d": "scripts.harness.diffusion",
    "mace_survival": "scripts.harness.survival",
    "xray2ct_cascade": "scripts.harness.xray2ct",
}
BUNDLES = tuple(FAMILY_MODULES)


def family(bundle: str) -> ModuleType:
    """The harness module of ``bundle`` (imported on first use).

    Raises:
        ValueError: for a bundle that is not in :data:`FAMILY_MODULES`.
    """
    if bundle not in FAMILY_MODULES:
        raise ValueError(f"unknown bundle {bundle!r}; expected one of {BUNDLES}.")
    return importlib.import_module(FAMILY_MODULES[bundle])


def benchmarks() -> dict[str, Callable]:
    """Every benchmark command by name: the ``BENCHMARKS`` of each bundle's module, and ``campaign``.

    Raises:
        RuntimeError: when two modules name a benchmark alike.
    """
    from scripts.harness.campaign import campaign

    found: dict[str, Callable] = {"campaign": campaign}
    for bundle in BUNDLES:
        for name, function in family(bundle).BENCHMARKS.items():
            if name in found:
                raise RuntimeError(f"benchmark {name!r} of {bundle} is also defined elsewhere.")
            found[name] = function
    return found

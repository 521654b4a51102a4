# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Each bundle's module of ``scripts/harness``: ``scripts.harness.<family>``, the family named by the bundle's
description (the ``collection`` section of its metadata, :mod:`common.bundle_tools.registry`). The module holds the
bundle's benchmarks (``BENCHMARKS``, commands of ``scripts/benchmark.py``: :mod:`scripts.harness.commands`), its rows of the campaign's throughput
table (``THROUGHPUT``) and its small fault-test job (``fault_case``, used by ``scripts/reliability.py``). A new
family adds one module beside the others; a second bundle of a family shares its module (the module's ``BUNDLE`` is
the bundle its benchmarks and fault-test job run)."""

from __future__ import annotations

import importlib
from types import ModuleType

from common.bundle import bundle_names
from common.bundle_tools.registry import describe

__all__ = ["BUNDLES", "FAMILY_MODULES", "family", "modules"]

BUNDLES = tuple(bundle_names())
FAMILY_MODULES = {bundle: describe(bundle).harness for bundle in BUNDLES}


def family(bundle: str) -> ModuleType:
    """The harness module of ``bundle`` (imported on first use).

    Raises:
        BundleNotFoundError: for a bundle that is not in the repository (the message lists those that are).
    """
    return importlib.import_module(describe(bundle).harness)


def modules() -> list[ModuleType]:
    """The harness modules, once each (several bundles of one family share theirs), in bundle-name order."""
    return [importlib.import_module(name) for name in dict.fromkeys(FAMILY_MODULES.values())]

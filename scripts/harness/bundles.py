# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Each bundle's module of ``scripts/harness``: ``scripts.harness.<family>``, the family named by the bundle's
description (the ``collection`` section of its metadata, :mod:`common.bundle_tools.registry`). The module holds the
bundle's benchmarks (``BENCHMARKS``, commands of ``scripts/benchmark.py``), its rows of the campaign's throughput
table (``THROUGHPUT``) and its small fault-test job (``fault_case``, used by ``scripts/reliability.py``). A new
family adds one module beside the others; a second bundle of a family shares its module (the module's ``BUNDLE`` is
the bundle its benchmarks and fault-test job run)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType

from common.bundle import bundle_names
from common.bundle_tools.registry import describe

__all__ = ["BUNDLES", "FAMILY_MODULES", "benchmark_command", "benchmarks", "family", "modules"]

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


def benchmarks() -> dict[str, Callable]:
    """Every benchmark command by name: the ``BENCHMARKS`` of each bundle's module, ``campaign`` and
    ``demo_spread`` (any bundle's quickstart, once per seed).

    Raises:
        RuntimeError: when two modules name a benchmark alike.
    """
    from scripts.harness.campaign import campaign
    from scripts.harness.demos import demo_spread

    found: dict[str, Callable] = {"campaign": campaign, "demo_spread": demo_spread}
    for module in modules():
        for name, function in module.BENCHMARKS.items():
            if name in found:
                raise RuntimeError(f"benchmark {name!r} of {module.__name__} is also defined elsewhere.")
            found[name] = function
    return found


def benchmark_command(argv: Sequence[str]) -> list[str]:
    """The ``fire`` command of ``scripts/benchmark.py``'s arguments ``argv``: ``<command> --help`` (or ``-h``) asks
    for the command's help, which a command taking extra ``--key value`` settings (``**overrides``) would otherwise
    take as one of them and run."""
    argv = list(argv)
    asks_help = bool({"-h", "--help"} & set(argv[: argv.index("--")] if "--" in argv else argv))
    if asks_help and argv and not argv[0].startswith("-"):
        return [argv[0], "--", "--help"]
    return argv

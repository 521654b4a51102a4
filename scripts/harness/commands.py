# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The commands of ``scripts/benchmark.py``: each bundle family's ``BENCHMARKS`` (:mod:`scripts.harness.bundles`),
``campaign`` (which runs them) and ``demo_spread``. The top floor of the harness: nothing in it imports this."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scripts.harness.bundles import modules
from scripts.harness.campaign import campaign
from scripts.harness.cpu_inference import cpu_inference
from scripts.harness.demos import demo_spread

__all__ = ["benchmark_command", "benchmarks"]


def benchmarks() -> dict[str, Callable]:
    """Every benchmark command by name: the ``BENCHMARKS`` of each bundle's module, ``campaign``,
    ``cpu_inference`` (any bundle's network on the CPU) and ``demo_spread`` (any bundle's quickstart, once per
    seed).

    Raises:
        RuntimeError: when two modules name a benchmark alike.
    """
    found: dict[str, Callable] = {"campaign": campaign, "cpu_inference": cpu_inference, "demo_spread": demo_spread}
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

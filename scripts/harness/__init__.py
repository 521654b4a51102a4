# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The benchmark and fault-injection harness behind ``scripts/benchmark.py`` and ``scripts/reliability.py``: shared
tools (``tools``, ``campaign``, ``faults``), one module per model family with its bundle's benchmarks and fault-test
job, and the table that maps bundles to those modules (``bundles``). Import it with the repository root on the path
(the command lines, the tests and ``python -m`` from the root do)."""

from __future__ import annotations

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Command lines of the collection (run from the repository root, e.g. ``python scripts/demo.py``); the benchmark and
fault-injection harness they share is the package :mod:`scripts.harness`."""

from __future__ import annotations

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Shared pytest setup: one thread per process (or `OMP_NUM_THREADS`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per process unless the suite is started with more
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """Remove root-logger handlers a test added (in-process bundle runs call ``setup_logging``, whose stream
    handler would otherwise outlive the test's captured stdout) and restore the level."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)

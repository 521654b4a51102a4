# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Checkpoint files: atomic writes, ``weights_only`` reads that explain their failures, and network weights loaded
from a checkpoint. The checkpoint handlers, the networks that ship with their own weights and the bundle tools all
read and write checkpoints through this module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from common.networks.wrappers import clean_state_dict, unwrap
from common.utils import write_atomic

__all__ = ["CheckpointError", "load_checkpoint", "load_network_weights", "save_checkpoint"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the objects it should restore."""


def save_checkpoint(obj: Any, path: str | os.PathLike) -> Path:
    """Write ``obj`` with ``torch.save`` atomically (:func:`common.utils.write_atomic`): a crash, a full disk or a
    read-only file system during the write leaves the previous file at ``path`` untouched.

    Raises:
        OutputWriteError: when the file system refuses the write, naming the file and the cause.
    """
    return write_atomic(path, lambda handle: torch.save(obj, handle))


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a checkpoint with ``weights_only=True`` and explain failures.

    Raises:
        CheckpointError: when the file is missing, truncated/corrupt, or holds pickled Python objects (which are
            refused because unpickling can execute code).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        text = str(e)
        if "Unsupported global" in text:  # a real pickle of Python objects (not a corrupt file: "Unsupported operand")
            detail = next((line.strip() for line in text.splitlines() if "Unsupported global" in line), text)
            raise CheckpointError(
                f"checkpoint {str(path)!r} contains pickled Python objects, which are refused (weights_only=True); "
                f"only tensors and plain containers are loaded. Detail: {detail}"
            ) from e
        raise CheckpointError(f"checkpoint {str(path)!r} is unreadable (truncated or corrupt): {e}") from e


def load_network_weights(
    network: torch.nn.Module, path: str | os.PathLike, key: str | None = None, strict: bool = True
) -> torch.nn.Module:
    """Load a state dict (optionally ``checkpoint[key]``) into ``network``, stripping DDP/compile prefixes."""
    checkpoint = load_checkpoint(path)
    if key is not None:
        if key not in checkpoint:
            raise CheckpointError(f"checkpoint {str(path)!r} has no key {key!r}; keys: {sorted(checkpoint)}.")
        checkpoint = checkpoint[key]
    try:
        unwrap(network).load_state_dict(clean_state_dict(checkpoint), strict=strict)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {str(path)!r} does not match {type(unwrap(network)).__name__}: {e}") from e
    return network

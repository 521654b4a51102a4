# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Checkpoint files: atomic writes, ``weights_only`` reads that explain their failures, and network weights loaded
from a checkpoint. The checkpoint handlers, the networks that ship with their own weights and the bundle tools all
read and write checkpoints through this module."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.errors import UserError
from common.networks.wrappers import clean_state_dict, unwrap
from common.runs import (
    RUN_FILE,
    command_line,
    default_settings,
    read_record,
    recorded_settings,
    run_dir_of,
    settings_differences,
)
from common.utils import write_atomic

__all__ = [
    "RECORD_KEY",
    "CheckpointError",
    "checkpoint_record",
    "load_checkpoint",
    "load_network_weights",
    "load_published_weights",
    "mismatch_error",
    "published_state",
    "save_checkpoint",
    "save_weights",
    "state_dict_mismatch",
    "with_record",
]

# the entry of a state dict's ``_metadata`` (torch's own per-module version record, saved and loaded with the
# tensors, ignored by ``load_state_dict`` for names that are no module) holding the training run's record
RECORD_KEY = "@run"


class CheckpointError(UserError, RuntimeError):
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


def with_record(state: Mapping[str, Any], record: Mapping[str, Any] | None) -> OrderedDict:
    """``state`` (a state dict) carrying ``record`` - the content of a training run's ``configs/run.json``: its
    bundle, version and the settings the weights were trained with - in its ``_metadata`` under
    :data:`RECORD_KEY`. The file stays a plain state dict: ``load_state_dict``, ``torch.load(weights_only=True)``
    and MONAI's ``ckpt_export`` read it as before, and the settings travel with the weights wherever the file is
    copied (:func:`checkpoint_record` reads them back). ``None`` returns ``state`` unchanged."""
    result = OrderedDict(state)
    metadata = OrderedDict(getattr(state, "_metadata", None) or {})
    if record is not None:
        metadata[RECORD_KEY] = dict(record)
    if metadata:
        result._metadata = metadata  # type: ignore[attr-defined]
    return result


def save_weights(state: Mapping[str, Any], path: str | os.PathLike, record: Mapping[str, Any] | None = None) -> Path:
    """Write a network's state dict (what inference loads) with the record of the run that trained it
    (:func:`with_record`): ``record``, or by default the ``configs/run.json`` of the run folder whose ``models/``
    receives ``path``, when there is one. Written atomically (:func:`save_checkpoint`).

    Raises:
        OutputWriteError: when the file system refuses the write.
    """
    if record is None:
        record = read_record(Path(path).resolve().parent.parent)
    return save_checkpoint(with_record(state, record), path)


def checkpoint_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The record of the run that trained the weights in ``path``: the one the file carries (:func:`with_record`),
    else the ``configs/run.json`` of the run folder whose ``models/`` holds it, else ``None``.

    Raises:
        CheckpointError: when the file cannot be read.
        common.runs.RunRecordError: when the run folder's record is unreadable.
    """
    return _record_and_source(path)[0]


def _record_and_source(path: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """:func:`checkpoint_record` and where it was found (``"recorded in the checkpoint"`` or the run's file)."""
    content = load_checkpoint(path)
    record = (getattr(content, "_metadata", None) or {}).get(RECORD_KEY)
    if isinstance(record, Mapping) and isinstance(record.get("settings"), Mapping):
        return dict(record), "recorded in the checkpoint"
    run_dir = run_dir_of(path)
    if run_dir is None:
        return None, None
    return read_record(run_dir), str(run_dir / RUN_FILE)


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def state_dict_mismatch(network: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> str | None:
    """One sentence on how ``state`` does not fit ``network``: how many tensors differ in shape (with the first
    one), are missing or unexpected; ``None`` when it fits."""
    own = unwrap(network).state_dict()
    shapes = [(k, _shape(state[k]), tuple(v.shape)) for k, v in own.items() if k in state]
    shapes = [item for item in shapes if item[1] is not None and item[1] != item[2]]
    missing = [k for k in own if k not in state] if strict else []
    unexpected = [k for k in state if k not in own] if strict else []
    parts = []
    if shapes:
        name, theirs, ours = shapes[0]
        parts.append(
            f"{len(shapes)} of {len(own)} tensors differ in shape (e.g. {name}: checkpoint {list(theirs)}, "
            f"network {list(ours)})"
        )
    if missing:
        parts.append(f"{len(missing)} tensors of the network are not in the checkpoint (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensors of the checkpoint are not in the network (e.g. {unexpected[0]})")
    return "; ".join(parts) or None


def _recorded_settings(path: Path) -> tuple[dict[str, Any] | None, str]:
    """The full settings of the run that trained the weights in ``path`` (its ``train.json`` defaults updated with
    its record, :func:`checkpoint_record`) and where the record was found; ``None`` when there is none."""
    record_path = path.resolve().parent.parent / RUN_FILE
    try:
        record, source = _record_and_source(path)
    except UserError:
        return None, f"{str(record_path)!r} is unreadable"
    if record is None:
        return None, f"{str(record_path)!r} is missing and the checkpoint carries no record"
    settings: dict[str, Any] = {}
    train_json = next(iter(record.get("config_files") or {}), None)
    roots = [record.get("bundle_root"), Path(train_json).parent.parent if train_json else None]
    root = next((Path(r) for r in roots if r and (Path(r) / "configs" / "train.json").is_file()), None)
    if root is not None:  # the defaults the record's settings differ from
        settings.update(default_settings(root))
        settings.update(recorded_settings(record, root))
    else:
        settings.update(record["settings"])
    return settings, str(source)


def mismatch_error(
    network: torch.nn.Module,
    state: Mapping[str, Any],
    path: str | os.PathLike,
    settings: Mapping[str, Any] | None = None,
    strict: bool = True,
    detail: str | None = None,
) -> CheckpointError | None:
    """The error for weights ``state`` (read from ``path``) that do not fit ``network``, or ``None`` when they fit.

    It names the settings that differ between the run that wrote the checkpoint (its ``configs/run.json``) and
    this config (``settings`` - the values the network was built from - updated with the command-line
    overrides), e.g. ``channels: checkpoint [16, 32, 32], config [32, 64, 64]``, then summarises the tensors in
    one sentence (never the whole list), or gives ``detail``: the network's own explanation of why it refused the
    weights (a module with its own ``load_state_dict`` check), which is then reported even when the tensors fit."""
    tensors = state_dict_mismatch(network, state, strict=strict)
    if detail is not None and not detail.startswith("Error(s) in loading state_dict"):
        tensors = detail.rstrip(".")
    if tensors is None:
        return None
    path = Path(path)
    recorded, where = _recorded_settings(path)
    current = {**(settings or {}), **(command_line() or {})}
    if recorded is None:
        hint = (
            f"the run that wrote it recorded no settings ({where}): pass the network settings it was trained with "
            "on the command line"
        )
    else:
        differences = settings_differences(recorded, current)
        hint = (
            "settings that differ - " + "; ".join(differences) if differences else "no recorded setting differs"
        ) + f" (the checkpoint's run: {where})"
    return CheckpointError(
        f"checkpoint {str(path)!r} does not fit the configured {type(unwrap(network)).__name__}: {hint}. {tensors}."
    )


def load_network_weights(
    network: torch.nn.Module,
    path: str | os.PathLike,
    key: str | None = None,
    strict: bool = True,
    settings: Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """Load a state dict (optionally ``checkpoint[key]``) into ``network``, stripping DDP/compile prefixes.

    Args:
        network: the network to fill.
        path: the checkpoint.
        key: the entry of the checkpoint that holds the state dict (``None``: the whole file).
        strict: every tensor must match.
        settings: the settings the network was built from (a config's ``@trained``), to name the ones that
            differ from the checkpoint's run when the weights do not fit (:func:`mismatch_error`).

    Raises:
        CheckpointError: unreadable file, missing ``key``, or weights that do not fit the network.
    """
    checkpoint = load_checkpoint(path)
    if key is not None:
        if key not in checkpoint:
            raise CheckpointError(f"checkpoint {str(path)!r} has no key {key!r}; keys: {sorted(checkpoint)}.")
        checkpoint = checkpoint[key]
    state = clean_state_dict(checkpoint)
    try:
        unwrap(network).load_state_dict(state, strict=strict)
    except (RuntimeError, ValueError) as e:
        error = mismatch_error(network, state, path, settings, strict=strict, detail=str(e))
        if error is None:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit {type(unwrap(network)).__name__}: {e}") from e
        raise error from None
    return network


# keys of a training checkpoint that hold the network's state dict, in the order they are tried
_WRAPPERS = ("state_dict", "model", "autoencoder", "network", "gnetwork", "model_state_dict")


def _tensor_dict(checkpoint: Any, path: str) -> dict[str, torch.Tensor]:
    """The state dict inside a weights file: the file itself, or under one of the usual keys of a training
    checkpoint (optimizer and scheduler states beside it are ignored)."""
    if isinstance(checkpoint, Mapping) and checkpoint and all(torch.is_tensor(v) for v in checkpoint.values()):
        return dict(checkpoint)
    if isinstance(checkpoint, Mapping):
        for key in _WRAPPERS:
            inner = checkpoint.get(key)
            if isinstance(inner, Mapping) and inner and all(torch.is_tensor(v) for v in inner.values()):
                return dict(inner)
        kinds = {k: type(v).__name__ for k, v in list(checkpoint.items())[:8]}
        raise CheckpointError(
            f"pretrained weights {path!r} hold no state dict of tensors at the top or under {list(_WRAPPERS)}; "
            f"found {kinds}."
        )
    raise CheckpointError(
        f"pretrained weights {path!r} must be a state dict of tensors, got {type(checkpoint).__name__}."
    )


def _from_generative_layout(state: dict[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys of MONAI Generative's ``AutoencoderKL`` renamed to MONAI's (what ``load_old_state_dict`` renames: an
    up-sampling block's ``conv`` is ``postconv``; an attention block's ``to_q/k/v`` sit under ``attn.`` and
    ``proj_attn`` is ``attn.out_proj``); keys already in MONAI's layout stay."""
    renamed = {}
    for key, value in state.items():
        new = key
        if new not in own:
            for old, current in ((".conv.conv.", ".postconv.conv."), (".proj_attn.", ".attn.out_proj.")):
                if old in new and new.replace(old, current) in own:
                    new = new.replace(old, current)
            for part in ("to_q", "to_k", "to_v"):
                candidate = new.replace(f".{part}.", f".attn.{part}.")
                if candidate != new and candidate in own:
                    new = candidate
        renamed[new] = value
    return renamed


def published_state(network: nn.Module, path: str) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict of the weights file ``path`` in ``network``'s key names, and why it does not fit (``""``)."""
    state = clean_state_dict(_tensor_dict(load_checkpoint(path), path))
    own = network.state_dict()
    state = _from_generative_layout(state, own)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [
        f"{k}: file {tuple(v.shape)} vs network {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    if not (missing or unexpected or wrong):
        return state, ""
    name = type(network).__name__
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the {name}'s {len(own)} tensors are not in the file (e.g. {missing[:3]})")
    if unexpected:
        parts.append(f"{len(unexpected)} file tensors are not in the network (e.g. {unexpected[:3]})")
    if wrong:
        parts.append(f"{len(wrong)} tensors differ in shape ({'; '.join(wrong[:3])})")
    return state, (
        f"pretrained weights {path!r} do not fit the {name}: {'; '.join(parts)}. Is it the file of this network "
        "(the publisher's channels, levels and latent channels)?"
    )


def load_published_weights(network: nn.Module, path: str | os.PathLike) -> int:
    """Load a publisher's weights file into ``network`` (e.g. :func:`common.autoencoder.published.published_network`), all of it or
    nothing.

    Accepted as distributed: a plain state dict (MAISI's ``autoencoder_epoch273.pt``), one under ``state_dict``,
    ``model``, ``autoencoder``, ... (a training checkpoint; its optimizer state is ignored), DDP's ``module.`` and
    ``torch.compile``'s ``_orig_mod.`` prefixes, and MONAI Generative's key names (the zoo's BraTS
    ``model_autoencoder.pt``). Unlike MONAI's ``load_old_state_dict``, a tensor the network has and the file lacks
    is an error, not a silently random layer.

    Returns:
        The number of tensors loaded (all of the network's).

    Raises:
        CheckpointError: one line naming the file and what does not fit: unreadable, no state dict, missing or
            unexpected tensors (a few named, with their count), or shapes that differ (e.g. another channel count
            or number of levels).
    """
    state, problem = published_state(network, str(path))
    if problem:
        raise CheckpointError(problem)
    network.load_state_dict(state, strict=True)
    return len(state)

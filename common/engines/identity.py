# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The identity of an inference run's outputs, derived from everything that makes them.

A case written by :class:`common.engines.cases.CaseRun` is only ever skipped as already written when its record
carries the identity of the run at hand. That identity is not a list of settings someone chose (a list is always one
entry short); it is computed (:func:`config_identity`) from:

- every top-level id of the merged config as written - its files, the config files merged after them and every
  override, ``$`` expressions and ``_target_`` components included - so that any edit of a setting or of the
  pipeline, and any id added later, makes every case redo;
- the resolved value of every top-level ``$`` expression or ``@`` reference that is built from settings alone (no
  component on its way): what a run record, the data or the machine made of it (``"$@trained['spacing']"``, the
  checkpoint a search found, the device). A value naming an existing file stands for the sha256 of its bytes (a
  checkpoint replaced in place is other weights), except the values the cohort's input list is read with (a CSV, a
  datalist): every case carries the fingerprint of its own row and files, so that one edited row redoes one case;
- the weights the network holds once loaded (:func:`module_digest`), whatever files they came from;
- the software and hardware that compute: torch's and MONAI's versions, the device type (and, on the CPU, the thread
  count): they change an output's last bits.

Only the ids of :data:`NOT_IN_IDENTITY` are left out; each is shown not to change an output byte
(``tests/test_inference_faults.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import monai
import torch
from monai.bundle.reference_resolver import ReferenceResolver

from common.runs import is_plain

__all__ = ["NOT_IN_IDENTITY", "config_identity", "digest", "module_digest", "runtime_identity", "sha256_file"]

#: top-level ids that change how a run goes, never what a case's outputs are (each proven byte-identical by
#: ``tests/test_inference_faults.py``); every other id of a config is part of its cases' identity
NOT_IN_IDENTITY = {
    "progress": "a progress bar or log lines",
    "num_workers": "data-loading processes: the same items reach the model in the same order",
    "fail_fast": "what the run does after a failed case",
    "overwrite": "whether cases already written are redone (they are redone the same)",
    "verify_inputs": "how a written case's files are compared with its record (by sha256 only, or size and time first)",
    "distributed": "whether several processes share the cases (each case runs whole in one of them)",
    "dist_timeout": "how long a process waits for the others",
    "prediction_dir": "the folder itself: its records say what it holds",
}
#: the workflow's lists of actions (run in turn, never a value of a case)
_ACTIONS = ("imports", "initialize", "run", "finalize")


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of the bytes of ``path``, read in 4 MiB blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def _plain(value: Any, files: bool) -> Any:
    """``value`` as JSON data; with ``files``, a path of an existing file stands for the sha256 of its bytes."""
    if isinstance(value, Mapping):
        return {str(k): _plain(x, files) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(x, files) for x in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if files and isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
        return "sha256:" + sha256_file(value)
    return value if isinstance(value, (int, float, bool, type(None))) else str(value)


def digest(value: Any, files: bool = True) -> str:
    """A short hash of ``value`` (JSON), in which, with ``files``, a path of an existing file stands for the hash of
    its bytes."""
    text = json.dumps(_plain(value, files), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def module_digest(modules: Iterable[torch.nn.Module]) -> str:
    """The hash of the weights ``modules`` hold: every tensor of their state dicts, by name, dtype, shape and bytes.

    Raises:
        TypeError: for an item that is not a ``torch.nn.Module``.
    """
    sha = hashlib.sha256()
    for module in modules:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"the network of a case run must be a torch.nn.Module, got {type(module).__name__}.")
        for name, tensor in module.state_dict().items():
            data = tensor.detach().cpu().contiguous().reshape(-1)
            sha.update(f"{name}:{data.dtype}:{tuple(tensor.shape)};".encode())
            sha.update(data.view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()[:16]


def _top(ref: str) -> str:
    """The top-level id of a reference (``cases#output_dir`` -> ``cases``)."""
    return ReferenceResolver.split_id(ReferenceResolver.normalize_id(ref))[0] if ref else ref


def _refs(config: Mapping[str, Any], key: str) -> set[str]:
    """The top-level ids the raw value of ``key`` refers to."""
    return {_top(ref) for ref in ReferenceResolver.find_refs_in_config(config[key], key)} - {key, ""}


def _from_settings(config: Mapping[str, Any]) -> set[str]:
    """The top-level ids whose value is built from settings alone: a ``$`` expression or ``@`` reference whose
    references are plain values or such ids in turn (none a component, a list of actions or a structure holding
    one); resolving them builds nothing."""
    found: dict[str, bool] = {}

    def settles(key: str, seen: frozenset[str]) -> bool:
        if key in found:
            return found[key]
        value = config.get(key)
        if key in seen or key in _ACTIONS or key not in config:
            return False
        if isinstance(value, str) and value[:1] in ("$", "@"):
            ok = all(settles(ref, seen | {key}) for ref in _refs(config, key))
        else:  # plain data settles; a component or a structure of expressions is built, not read
            ok = is_plain(value)
        found[key] = ok
        return ok

    return {key for key, value in config.items() if isinstance(value, str) and settles(key, frozenset())}


def config_identity(resolver: ReferenceResolver, inputs: Any = None) -> dict[str, Any]:
    """What the config ``resolver`` resolves makes its outputs with (see the module's description): ``{id: value}``
    for every top-level id but those of :data:`NOT_IN_IDENTITY`, as written, and ``{"=" + id: value}`` for the
    resolved value of every id built from settings alone; JSON data.

    Args:
        resolver: the ``monai.bundle.ReferenceResolver`` of the config (its root item holds the merged content).
        inputs: the cohort's input list the config resolved (the argument of ``CaseRun.select``): the ids read to
            find it keep their values as written (its cases are fingerprinted one by one).
    """
    root = resolver.items.get("")
    config = root.get_config() if root is not None else {}
    config = {k: v for k, v in config.items() if isinstance(k, str) and k not in NOT_IN_IDENTITY}
    listing = {key for key in config if inputs is not None and resolver.resolved_content.get(key) is inputs}
    by_path = set().union(*(_refs(config, key) for key in listing)) if listing else set()
    found = _plain(config, files=False)
    for key in sorted(_from_settings(config)):
        found["=" + key] = _plain(resolver.get_resolved_content(key), files=key not in by_path)
    return found


def runtime_identity(device: Any = None) -> dict[str, Any]:
    """The software and hardware that compute a case: torch's and MONAI's versions, the device type, and the thread
    count on the CPU (or the GPU's name)."""
    runtime: dict[str, Any] = {"torch": torch.__version__, "monai": monai.__version__}
    if device is not None:
        runtime["device"] = torch.device(device).type
        if runtime["device"] == "cpu":
            runtime["threads"] = torch.get_num_threads()
        elif runtime["device"] == "cuda":
            runtime["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return runtime

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Static and quick dynamic checks of a bundle folder: required files, parseable configs, metadata against the
MONAI schema, the config ids MONAI tooling relies on, and (with the bundle's ``configs/tiny.json`` sizes) that the
networks instantiate and the inference network honours the input/output format declared in the metadata.

Every problem is one line ``<bundle folder>: <file>: <problem>``; a clean bundle gives no line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonschema.exceptions import ValidationError
from jsonschema.validators import validator_for
from monai.bundle import ConfigParser
from monai.bundle.scripts import _get_fake_spatial_shape
from monai.utils import get_equivalent_dtype

from common.bundle import BUNDLES_DIR, ROOT, bundle_names, resolve_bundle
from common.bundle_tools.package import MODEL_FILE, PackageError, check_package_weights
from common.bundle_tools.registry import check_description
from common.errors import BundleNotFoundError

__all__ = [
    "DEFAULT_SCHEMA",
    "INFERENCE_IDS",
    "LARGE_FILE_KEYS",
    "REQUIRED_FILES",
    "TRAIN_IDS",
    "check_config_ids",
    "check_files",
    "check_instantiation",
    "check_large_files",
    "check_metadata",
    "check_net_in_out",
    "check_package",
    "display_name",
    "load_json_configs",
    "verify_bundle",
    "verify_bundles",
]

REQUIRED_FILES = (
    "configs/metadata.json",
    "configs/train.json",
    "configs/multi_gpu_train.json",
    "configs/evaluate.json",
    "configs/inference.json",
    "configs/logging.conf",
    "configs/tiny.json",
    "LICENSE",
    "docs/README.md",
    "large_files.yml",
)
JSON_CONFIGS = ("metadata.json", "train.json", "multi_gpu_train.json", "evaluate.json", "inference.json", "tiny.json")
TRAIN_IDS = (
    "bundle_root",
    "device",
    "dataset_dir",
    "output_dir",
    "training",
    "run",
    "train#trainer",
    "train#trainer#max_epochs",
    "train#dataset",
    "train#handlers",
    "validate#evaluator",
    "validate#handlers",
    "initialize",
    "finalize",
)
MULTI_GPU_IDS = ("initialize", "finalize", "distributed")
EVALUATE_IDS = ("run",)
INFERENCE_IDS = (
    "bundle_root",
    "device",
    "network_def",
    "network",
    "inferer",
    "run",
    "ckpt_path",
    "load_weights",
    "dataset_dir",
    "output_dir",
)
LARGE_FILE_KEYS = ("path", "url", "hash_val", "hash_type")
DEFAULT_SCHEMA = ROOT / "tests" / "data" / "meta_schema_20240725.json"
_MAX_MESSAGE = 300


def display_name(bundle_dir: str | Path) -> str:
    """How a bundle folder is named in problem lines: relative to the working directory when inside it.

    Args:
        bundle_dir: the bundle folder.
    """
    path = Path(os.path.abspath(bundle_dir))
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(path)


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def _error_summary(exc: BaseException) -> str:
    """``Type: last line`` of the innermost cause of ``exc`` (MONAI wraps the real error in a RuntimeError)."""
    root = exc
    seen = {id(root)}
    while True:
        nxt = root.__cause__ or (None if root.__suppress_context__ else root.__context__)
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        root = nxt
    lines = [line for line in str(root).strip().splitlines() if line.strip()]
    return f"{type(root).__name__}: {_shorten(lines[-1])}" if lines else type(root).__name__


def check_files(bundle_dir: Path) -> list[str]:
    """``<file>: required file is missing`` for each of :data:`REQUIRED_FILES` absent from ``bundle_dir``.

    Args:
        bundle_dir: the bundle folder.
    """
    return [f"{name}: required file is missing" for name in REQUIRED_FILES if not (bundle_dir / name).is_file()]


def load_json_configs(bundle_dir: Path) -> tuple[dict[str, dict], list[str]]:
    """Parse the JSON configs of ``bundle_dir`` that exist.

    Args:
        bundle_dir: the bundle folder.

    Returns:
        The parsed configs by file name (only those that parse to a JSON object) and the problems found.
    """
    configs: dict[str, dict] = {}
    problems = []
    for name in JSON_CONFIGS:
        path = bundle_dir / "configs" / name
        if not path.is_file():
            continue
        rel = f"configs/{name}"
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            problems.append(f"{rel}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}")
            continue
        except UnicodeDecodeError as e:
            problems.append(f"{rel}: not UTF-8 text: {e}")
            continue
        if not isinstance(content, dict):
            problems.append(f"{rel}: the top level must be a JSON object, got {type(content).__name__}")
            continue
        configs[name] = content
    return configs, problems


def check_large_files(bundle_dir: Path) -> list[str]:
    """Check that ``large_files.yml`` is YAML holding a ``large_files`` list of complete download entries.

    Args:
        bundle_dir: the bundle folder (a missing file is reported by :func:`check_files`).
    """
    path = bundle_dir / "large_files.yml"
    if not path.is_file():
        return []
    rel = "large_files.yml"
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return [f"{rel}: invalid YAML{where}: {_shorten(getattr(e, 'problem', None) or str(e))}"]
    if not isinstance(content, dict) or "large_files" not in content:
        return [f"{rel}: must be a mapping with a 'large_files' list, got {_shorten(repr(content))}"]
    entries = content["large_files"]
    if not isinstance(entries, list):
        return [f"{rel}: 'large_files' must be a list, got {type(entries).__name__}"]
    problems = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            problems.append(f"{rel}: large_files[{i}] must be a mapping, got {_shorten(repr(entry))}")
            continue
        missing = [key for key in LARGE_FILE_KEYS if key not in entry]
        if missing:
            problems.append(f"{rel}: large_files[{i}] lacks {', '.join(repr(k) for k in missing)}")
    return problems


def _specific(error: ValidationError) -> ValidationError:
    """The most specific sub-error of an ``anyOf``/``oneOf`` schema error (the one deepest in the instance)."""
    while error.context:
        error = max(error.context, key=lambda e: (len(e.absolute_path), -len(e.absolute_schema_path)))
    return error


def check_metadata(meta: dict, schema_file: str | Path = DEFAULT_SCHEMA) -> list[str]:
    """Validate ``metadata.json`` against the MONAI schema and the collection's conventions.

    Args:
        meta: the parsed metadata.
        schema_file: a local copy of the MONAI metadata schema.
    """
    rel = "configs/metadata.json"
    problems = []
    schema_path = Path(schema_file)
    if not schema_path.is_file():
        problems.append(f"{rel}: cannot validate, the schema copy {str(schema_path)!r} does not exist")
    else:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
        validator = validator_for(schema)(schema)
        for error in sorted(validator.iter_errors(meta), key=lambda e: list(map(str, e.absolute_path))):
            error = _specific(error)
            line = f"{rel}: schema violation at {error.json_path}: {_shorten(error.message)}"
            if line not in problems:
                problems.append(line)
    version, changelog = meta.get("version"), meta.get("changelog")
    if not isinstance(changelog, dict):
        problems.append(f"{rel}: 'changelog' must be a mapping of version to notes, got {_shorten(repr(changelog))}")
    elif version not in changelog:
        problems.append(f"{rel}: version {version!r} is not in changelog (has {', '.join(map(repr, changelog))})")
    problems += _check_io_names(meta, rel)
    return problems


def _check_io_names(meta: dict, rel: str) -> list[str]:
    fmt = meta.get("network_data_format")
    if not isinstance(fmt, dict):
        return []  # reported by the schema
    problems = []
    for section, name in (("inputs", "image"), ("outputs", "pred")):
        entries = fmt.get(section)
        if isinstance(entries, dict) and name not in entries:
            found = ", ".join(map(repr, entries)) or "nothing"
            problems.append(f"{rel}: network_data_format.{section} has no {name!r} (has {found})")
    return problems


def _parser(bundle_dir: Path, names: Sequence[str], overrides: dict[str, Any] | None = None) -> ConfigParser:
    """A ``ConfigParser`` of ``names`` (files in ``configs/``) merged in order, then ``overrides`` applied."""
    parser = ConfigParser()
    parser.read_config([str(bundle_dir / "configs" / name) for name in names])
    for key, value in {"bundle_root": str(bundle_dir), **(overrides or {})}.items():
        parser[key] = value
    return parser


def _label(names: Sequence[str]) -> str:
    return " + ".join(f"configs/{name}" for name in names)


def _missing_ids(parser: ConfigParser, ids: Iterable[str]) -> list[str]:
    """The ids absent from ``parser``; an id under one already missing is not listed again."""
    missing: list[str] = []
    for id_ in ids:
        if any(id_.startswith(parent + "#") for parent in missing):
            continue
        if id_ not in parser:
            missing.append(id_)
    return missing


def check_config_ids(bundle_dir: Path, configs: dict[str, dict]) -> list[str]:
    """Check the ids that ``monai.bundle run``, ``--tracking mlflow`` and the collection's tools rely on.

    Args:
        bundle_dir: the bundle folder.
        configs: the configs that parsed (see :func:`load_json_configs`); combinations with a missing or
            invalid file are skipped (that file is already reported).
    """
    problems = []
    for names, ids in (
        (("train.json",), TRAIN_IDS),
        (("train.json", "multi_gpu_train.json"), MULTI_GPU_IDS),
        (("train.json", "evaluate.json"), EVALUATE_IDS),
        (("inference.json",), INFERENCE_IDS),
    ):
        if not all(name in configs for name in names):
            continue
        label = _label(names)
        try:
            parser = _parser(bundle_dir, names)
        except Exception as e:
            problems.append(f"{label}: cannot be merged: {_error_summary(e)}")
            continue
        problems += [f"{label}: missing required id {id_!r}" for id_ in _missing_ids(parser, ids)]
        if "distributed" in ids and "distributed" in parser and parser["distributed"] is not True:
            problems.append(f"{label}: 'distributed' must be true, got {parser['distributed']!r}")
    return problems


def _instantiate(parser: ConfigParser, id_: str, label: str) -> tuple[Any, list[str]]:
    try:
        return parser.get_parsed_content(id_), []
    except Exception as e:
        return None, [f"{label}: cannot instantiate {id_!r}: {_error_summary(e)}"]


def check_instantiation(bundle_dir: Path, configs: dict[str, dict], device: str = "cpu") -> tuple[Any, list[str]]:
    """Instantiate ``network_def`` of train.json and ``network`` + ``inferer`` of inference.json, each with the
    bundle's ``configs/tiny.json`` merged on top (nothing is trained or loaded).

    Args:
        bundle_dir: the bundle folder.
        configs: the configs that parsed (see :func:`load_json_configs`).
        device: the value given to the ``device`` id.

    Returns:
        The inference ``network`` (``None`` when it could not be built) and the problems found.
    """
    if "tiny.json" not in configs:
        return None, []
    overrides = {"bundle_root": str(Path(os.path.abspath(bundle_dir))), "device": device}
    problems: list[str] = []
    network = None
    for config, ids in (("train.json", ("network_def",)), ("inference.json", ("network", "inferer"))):
        if config not in configs:
            continue
        names = (config, "tiny.json")
        label = _label(names)
        try:
            parser = _parser(bundle_dir, names, overrides)
        except Exception as e:
            problems.append(f"{label}: cannot be merged: {_error_summary(e)}")
            continue
        for id_ in ids:
            if id_ not in parser:
                continue  # reported by check_config_ids
            obj, found = _instantiate(parser, id_, label)
            problems += found
            if id_ == "network" and not found:
                network = obj
    return network, problems


def _tensor_format(meta: dict, section: str, name: str) -> dict | None:
    entry = (meta.get("network_data_format") or {}).get(section, {})
    fmt = entry.get(name) if isinstance(entry, dict) else None
    return fmt if isinstance(fmt, dict) else None


def _resolve_shape(shape: Sequence[str | int], n: int, p: int, any_size: int) -> tuple[int, ...]:
    return tuple(_get_fake_spatial_shape(shape, p=p, n=n, any=any_size))


def check_package(
    bundle_dir: Path, meta: dict, device: str = "cpu", n: int = 4, p: int = 1, any_size: int = 16
) -> list[str]:
    """For a bundle that ships weights (``models/model.pt``: a package): its own ``configs/inference.json``, with
    nothing merged, builds the network and loads the weights with the bundle's loader (``load_weights``, see
    :func:`common.bundle_tools.package.check_package_weights`), and that network with those weights runs on a small
    generated input checked against the metadata (:func:`check_net_in_out`). Nothing for a bundle without weights.
    """

    if not (bundle_dir / MODEL_FILE).is_file():
        return []
    label = f"{MODEL_FILE} with configs/inference.json"
    try:
        parser = check_package_weights(Path(os.path.abspath(bundle_dir)), device=device)
    except PackageError as e:
        return [f"{label}: {_shorten(str(e))}"]
    network, problems = _instantiate(parser, "network", label)
    if network is not None:
        problems += check_net_in_out(network, meta, device=device, n=n, p=p, any_size=any_size, label=label)
    return problems


def check_net_in_out(
    network: Any,
    meta: dict,
    device: str = "cpu",
    n: int = 4,
    p: int = 1,
    any_size: int = 16,
    label: str | None = None,
) -> list[str]:
    """Run ``network`` once on a random input shaped as ``network_data_format.inputs.image`` declares and
    compare the output with ``network_data_format.outputs.pred`` (channels, spatial shape, dtype), like
    ``monai.bundle verify_net_in_out`` but also checking the spatial shape.

    Args:
        network: the instantiated inference network.
        meta: the parsed metadata.
        device: where the forward pass runs.
        n: value of ``n`` in spatial shape expressions such as ``"4*n"``.
        p: value of ``p`` in spatial shape expressions such as ``"2**p"``.
        any_size: size used for ``"*"`` dimensions of the input.
        label: what the problems are prefixed with (default: the configs the network was built from).
    """
    label = label or _label(("inference.json", "tiny.json"))
    in_fmt, out_fmt = _tensor_format(meta, "inputs", "image"), _tensor_format(meta, "outputs", "pred")
    if in_fmt is None or out_fmt is None:
        return []  # reported by check_metadata
    if not isinstance(network, torch.nn.Module):
        return [f"{label}: 'network' is a {type(network).__name__}, expected a torch.nn.Module"]
    meta_rel = "configs/metadata.json: network_data_format"
    try:
        in_shape = _resolve_shape(in_fmt.get("spatial_shape", []), n, p, any_size)
        in_dtype = get_equivalent_dtype(in_fmt.get("dtype", "float32"), torch.Tensor)
        out_shape = _resolve_shape(out_fmt.get("spatial_shape", []), n, p, any_size)
        out_dtype = get_equivalent_dtype(out_fmt.get("dtype", "float32"), torch.Tensor)
    except Exception as e:
        return [f"{meta_rel} cannot be turned into a test input/output: {_error_summary(e)}"]
    shape = (1, int(in_fmt.get("num_channels", 1)), *in_shape)
    network = network.to(device).eval()
    try:
        with torch.no_grad():
            output = network(torch.rand(*shape, device=device).to(in_dtype))
    except Exception as e:
        return [
            f"{label}: 'network' forward of a {shape} {in_fmt.get('dtype', 'float32')} input failed: "
            f"{_error_summary(e)}"
        ]
    if not isinstance(output, torch.Tensor):
        return [f"{label}: 'network' output is a {type(output).__name__}, expected a tensor"]
    return _compare_output(output, out_fmt, out_shape, out_dtype, label, n, p)


def _compare_output(
    output: torch.Tensor,
    out_fmt: dict,
    out_shape: tuple[int, ...],
    out_dtype: torch.dtype,
    label: str,
    n: int,
    p: int,
) -> list[str]:
    problems = []
    channels = out_fmt.get("num_channels")
    if channels is not None and (output.ndim < 2 or output.shape[1] != channels):
        got = output.shape[1] if output.ndim >= 2 else "no channel dimension"
        problems.append(
            f"{label}: 'network' output has {got} channels, metadata outputs.pred.num_channels is {channels}"
        )
    declared = list(out_fmt.get("spatial_shape", []))
    got_shape = tuple(output.shape[2:])
    if len(got_shape) != len(out_shape) or any(d != "*" and g != e for d, g, e in zip(declared, got_shape, out_shape)):
        problems.append(
            f"{label}: 'network' output spatial shape {got_shape} does not match {out_shape}, "
            f"metadata outputs.pred.spatial_shape {declared} with n={n}, p={p}"
        )
    if output.dtype != out_dtype:
        problems.append(
            f"{label}: 'network' output dtype {output.dtype} does not match metadata outputs.pred.dtype "
            f"{out_fmt.get('dtype', 'float32')!r}"
        )
    return problems


def verify_bundle(
    bundle_dir: str | Path,
    quick: bool = False,
    device: str = "cpu",
    n: int = 4,
    p: int = 1,
    any_size: int = 16,
    schema_file: str | Path = DEFAULT_SCHEMA,
) -> list[str]:
    """All problems of one bundle folder, one line each, prefixed with :func:`display_name` of the folder.

    Checks required files, JSON/YAML syntax, metadata (schema, version in changelog, ``image``/``pred`` names,
    the collection's description of the bundle: :func:`common.bundle_tools.registry.check_description`) and required
    config ids; unless ``quick``, also instantiates the networks with ``configs/tiny.json`` merged
    and runs the inference network once on a tiny input checked against the metadata, and, for a bundle that ships
    weights (a package), checks them with its own configs (:func:`check_package`).

    Args:
        bundle_dir: the bundle folder.
        quick: skip the instantiation and forward checks.
        device: device for the instantiation and forward checks.
        n: value of ``n`` in metadata spatial shapes (``"4*n"`` is 16 with the default 4).
        p: value of ``p`` in metadata spatial shapes.
        any_size: size of ``"*"`` input dimensions.
        schema_file: local copy of the MONAI metadata schema.
    """
    bundle_dir = Path(bundle_dir)
    prefix = display_name(bundle_dir)
    if not bundle_dir.is_dir():
        return [f"{prefix}: not a folder"]
    problems = check_files(bundle_dir)
    configs, found = load_json_configs(bundle_dir)
    problems += found + check_large_files(bundle_dir)
    meta = configs.get("metadata.json")
    if meta is not None:
        problems += check_metadata(meta, schema_file)
    problems += check_config_ids(bundle_dir, configs)
    problems += check_description(bundle_dir)
    if not quick:
        network, found = check_instantiation(bundle_dir, configs, device=device)
        problems += found
        if network is not None and meta is not None:
            problems += check_net_in_out(network, meta, device=device, n=n, p=p, any_size=any_size)
        if meta is not None:
            problems += check_package(bundle_dir, meta, device=device, n=n, p=p, any_size=any_size)
    return [f"{prefix}: {problem}" for problem in problems]


def verify_bundles(
    targets: Sequence[str | Path], bundles_dir: str | Path | None = None, quick: bool = False, **kwargs: Any
) -> tuple[list[str], int]:
    """Verify the bundles named by ``targets`` (all bundles under ``bundles_dir`` when empty).

    Args:
        targets: bundle names under ``bundles_dir`` or paths to bundle folders.
        bundles_dir: the folder holding the bundles; default: :data:`common.bundle.BUNDLES_DIR`.
        quick: skip the instantiation and forward checks.
        kwargs: further arguments of :func:`verify_bundle`.

    Returns:
        The lines to print (a line per unknown target, then per bundle in order its problem lines, or
        ``OK: <folder name>`` when it has none) and the exit status (1 when any problem was found or nothing
        could be verified, else 0).
    """
    if targets:
        folders: list[Path] = []
        lines: list[str] = []
        for target in targets:
            try:
                folders.append(resolve_bundle(target, bundles_dir))
            except BundleNotFoundError as e:
                lines.append(str(e))
    else:
        root = Path(bundles_dir) if bundles_dir is not None else BUNDLES_DIR
        folders = [root / name for name in bundle_names(root)]
        lines = [] if folders else [f"{root}: no bundles found (no */configs/metadata.json)"]
    status = 1 if lines else 0
    for folder in folders:
        problems = verify_bundle(folder, quick=quick, **kwargs)
        lines += problems or [f"OK: {Path(os.path.abspath(folder)).name}"]
        status = 1 if problems else status
    return lines, status

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Export a bundle's inference network to TorchScript and ONNX, each checked against PyTorch before it is kept.

The network is the ``net_id`` component (default ``network``) of the bundle's ``configs/inference.json``, with
optional overrides, loaded with the weights of a checkpoint (``weights_only=True``). The example input shape is
given explicitly or derived from ``metadata.json`` (see :func:`default_input_shape`). Every export is written to a
temporary file, loaded back, run on a fresh random input and compared with the PyTorch network; only an export
that matches is moved to its destination, so a failed export never leaves a file behind.

TorchScript: ``torch.jit.script`` is tried first and ``torch.jit.trace`` is the fallback (MONAI's AutoencoderKL,
VQVAE and DiffusionModelUNet cannot be scripted). The file carries ``metadata.json`` (the bundle's metadata plus
MONAI/PyTorch versions, as ``monai.bundle ckpt_export`` writes it), ``inference.json`` (the config as used) and
``export.json`` (method, input shape, checkpoint) as TorchScript extra files.

ONNX: the ``torch.export``-based exporter (``dynamo=True``, the default of PyTorch >= 2.9) is tried first and the
TorchScript-based exporter (``dynamo=False``) is the fallback. The batch dimension is dynamic (named ``batch``);
spatial dimensions are static unless ``dynamic_spatial`` is set (then they are verified on a second size). The
model is checked with ``onnx.checker`` and run with onnxruntime's ``CPUExecutionProvider``; ``metadata.json`` and
``export.json`` are stored as ONNX ``metadata_props``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import logging
import operator
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.bundle import resolve_bundle
from common.checkpoint_io import load_network_weights
from common.runs import run_dir_of

__all__ = [
    "EXPORT_FORMATS",
    "ExportError",
    "ExportResult",
    "build_network",
    "compare_outputs",
    "default_input_shape",
    "export_all",
    "export_module_onnx",
    "export_module_torchscript",
    "format_results",
    "random_input",
    "run_export",
]

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("torchscript", "onnx")
DEFAULT_SIDE = 64
"""Smallest side chosen for a symbolic spatial dimension when the config has no ``patch_size``."""
_MAX_N = 1024
_MAX_P = 16
_ONNX_EXTERNAL_DATA_BYTES = 1_500_000_000
_JIT_DEPRECATION = r"`torch\.jit\.\w+` is deprecated"
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


class ExportError(RuntimeError):
    """An export that failed, or whose output differs from the PyTorch network's."""


@dataclasses.dataclass
class ExportResult:
    """What one export produced.

    Args:
        format: ``torchscript`` or ``onnx``.
        path: the exported file.
        method: ``script`` or ``trace`` (TorchScript); ``dynamo`` or ``legacy`` (ONNX).
        input_shape: the example input shape the network was exported with.
        max_abs_diff: largest absolute difference to the PyTorch output on the verification input.
        output_scale: largest absolute PyTorch output value on the verification input.
        seconds: wall time of conversion, saving and verification.
        opset: the ONNX opset (``None`` for TorchScript).
        files: every file written (the ONNX external data file, when there is one, besides ``path``).
        notes: why earlier methods were not used, and warnings worth knowing (e.g. tracer warnings).
    """

    format: str
    path: Path
    method: str
    input_shape: list[int]
    max_abs_diff: float
    output_scale: float
    seconds: float
    opset: int | None = None
    files: list[Path] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        """Total size of the written files."""
        return sum(f.stat().st_size for f in (self.files or [self.path]) if f.is_file())

    def summary(self) -> str:
        """One line describing the export."""
        opset = f", opset {self.opset}" if self.opset is not None else ""
        return (
            f"{self.format} ({self.method}{opset}) -> {self.path} [{self.size_bytes / 2**20:.2f} MiB], "
            f"input {self.input_shape}, max |diff| vs PyTorch {self.max_abs_diff:.3g} "
            f"(output scale {self.output_scale:.3g}), {self.seconds:.1f} s"
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(path)!r} does not exist.") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e


def _parse_overrides(overrides: Any) -> list[Any]:
    """Overrides as a list of dicts and config file paths (a dict, a path, a JSON/Python literal or a list)."""
    if overrides is None:
        return []
    if isinstance(overrides, (Mapping, os.PathLike)):
        return [overrides]
    if isinstance(overrides, str):
        text = overrides.strip()
        if text.startswith(("{", "[")):
            try:
                return _parse_overrides(json.loads(text))
            except json.JSONDecodeError:
                try:
                    return _parse_overrides(ast.literal_eval(text))
                except (ValueError, SyntaxError) as e:
                    raise ValueError(f"overrides {overrides!r} is neither JSON nor a Python literal: {e}") from e
        return [text]
    if isinstance(overrides, (list, tuple)):
        return [item for o in overrides for item in _parse_overrides(o)]
    raise ValueError(f"overrides must be a dict, a config file path or a list of them, got {overrides!r}.")


def _make_parser(bundle_dir: Path, overrides: Any = None, device: str | None = "cpu"):
    """A ``ConfigParser`` of ``inference.json`` with overrides (dicts and/or config files) applied in order; its
    ``bundle_root`` is ``bundle_dir`` (whichever copy of ``common`` this process imported)."""
    from monai.bundle import ConfigParser

    config_file = bundle_dir / "configs" / "inference.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"bundle {str(bundle_dir)!r} has no configs/inference.json.")
    parser = ConfigParser()
    parser.read_config(str(config_file))
    parser["bundle_root"] = str(Path(os.path.abspath(bundle_dir)))
    user_keys: set[str] = set()
    for item in _parse_overrides(overrides):
        if isinstance(item, Mapping):
            for key, value in item.items():
                parser[str(key)] = value
                user_keys.add(str(key))
        else:
            path = Path(item)
            if not path.is_file():
                raise FileNotFoundError(f"override file {str(path)!r} does not exist.")
            content = ConfigParser.load_config_file(str(path))
            for key, value in content.items():
                parser[str(key)] = value
                user_keys.add(str(key))
    if device is not None and "device" in parser.get() and "device" not in user_keys:
        parser["device"] = str(device)
    return parser


def build_network(
    bundle_dir: str | os.PathLike,
    net_id: str = "network",
    overrides: Any = None,
    device: str | None = "cpu",
) -> tuple[nn.Module, Any]:
    """Instantiate ``net_id`` from the bundle's ``inference.json`` (random weights, eval mode).

    Args:
        bundle_dir: the bundle folder, or a bundle name under ``bundles/``.
        net_id: id of the network in ``inference.json``.
        overrides: a dict of config ids to values, a config file (e.g. the bundle's ``tiny.json``), or a list
            of them, applied in order; a string holding a JSON/Python dict is parsed.
        device: value given to the config's top-level ``device`` (when it has one and no override sets it);
            ``None`` keeps the config's own choice.

    Returns:
        ``(network, parser)``: the module (moved to ``device``) and the ``ConfigParser`` it came from.

    Raises:
        KeyError: when ``inference.json`` has no ``net_id``.
        TypeError: when ``net_id`` is not a ``torch.nn.Module``.
    """
    bundle_dir = resolve_bundle(bundle_dir)
    parser = _make_parser(bundle_dir, overrides, device)
    if net_id not in parser:
        raise KeyError(f"{str(bundle_dir / 'configs' / 'inference.json')!r} has no id {net_id!r}.")
    network = parser.get_parsed_content(net_id)
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"id {net_id!r} of {str(bundle_dir / 'configs' / 'inference.json')!r} is a {type(network).__name__}, "
            "not a torch.nn.Module."
        )
    if device is not None:
        network = network.to(device)
    return network.eval(), parser


# ------------------------------------------------------------------------------------------------ input shape
def _eval_expression(tree: ast.AST, variables: Mapping[str, int]) -> int | float:
    """Evaluate a parsed shape expression such as ``"4*n"`` or ``"2**p"`` (numbers, n, p, + - * / // **).

    Raises:
        ValueError: for any other element (names, calls, attributes...).
        OverflowError: for a power with an exponent above 64 or a result above 2**40.
    """
    if isinstance(tree, ast.Expression):
        return _eval_expression(tree.body, variables)
    if isinstance(tree, ast.Constant) and isinstance(tree.value, (int, float)) and not isinstance(tree.value, bool):
        return tree.value
    if isinstance(tree, ast.Name) and tree.id in variables:
        return variables[tree.id]
    if isinstance(tree, ast.UnaryOp) and isinstance(tree.op, ast.USub):
        return -_eval_expression(tree.operand, variables)
    if isinstance(tree, ast.BinOp) and type(tree.op) in _OPERATORS:
        left, right = _eval_expression(tree.left, variables), _eval_expression(tree.right, variables)
        if isinstance(tree.op, ast.Pow) and abs(right) > 64:
            raise OverflowError(f"exponent {right} is too large")
        value = _OPERATORS[type(tree.op)](left, right)
        if abs(value) > 2**40:
            raise OverflowError(f"value {value} is too large")
        return value
    raise ValueError(f"unsupported element {ast.dump(tree)!r}")


def _candidate_sides(expr: str | int, where: str) -> Callable[[int], bool] | list[int]:
    """The sides a ``spatial_shape`` element allows: a predicate for ``"*"``, else the sorted list of values.

    Expressions are evaluated for ``n`` in 1..1024 and ``p`` in 1..16 (for the variables they use).
    """
    if isinstance(expr, bool) or not isinstance(expr, (int, str)):
        raise ValueError(f"{where}: spatial shape elements must be int or str, got {expr!r}.")
    if isinstance(expr, int):
        return [expr]
    text = expr.strip()
    if text == "*":
        return lambda side: side > 0
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"{where}: cannot parse spatial shape expression {expr!r}: {e}") from e
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    if names - {"n", "p"}:
        raise ValueError(f"{where}: spatial shape expression {expr!r} uses {sorted(names - {'n', 'p'})}; only n, p.")
    values: set[int] = set()
    for n in range(1, _MAX_N + 1) if "n" in names else [1]:
        for p in range(1, _MAX_P + 1) if "p" in names else [1]:
            try:
                value = _eval_expression(tree, {"n": n, "p": p})
            except (OverflowError, ZeroDivisionError):
                continue
            except ValueError as e:
                raise ValueError(f"{where}: cannot evaluate spatial shape expression {expr!r}: {e}") from e
            if float(value).is_integer() and value > 0:
                values.add(int(value))
    if not values:
        raise ValueError(f"{where}: spatial shape expression {expr!r} gives no positive integer side.")
    return sorted(values)


def _input_spec(metadata: Mapping, meta_file: Path) -> tuple[str, dict]:
    inputs = metadata.get("network_data_format", {}).get("inputs", {})
    if "image" in inputs:
        return "image", inputs["image"]
    if len(inputs) == 1:
        return next(iter(inputs.items()))
    raise ValueError(
        f"{str(meta_file)!r}: network_data_format.inputs must have an 'image' entry or exactly one input to derive "
        f"the export input shape, got {sorted(inputs)}; pass input_shape explicitly."
    )


def _patch_size(parser: Any, ndim: int, config_file: Path) -> list[int] | None:
    if parser is None or "patch_size" not in parser:
        return None
    value = parser.get_parsed_content("patch_size")
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value] * ndim
    if not isinstance(value, (list, tuple)) or len(value) != ndim or not all(isinstance(v, int) for v in value):
        raise ValueError(
            f"{str(config_file)!r}: patch_size must be an int or {ndim} ints to match the metadata spatial shape, "
            f"got {value!r}."
        )
    return [int(v) for v in value]


def default_input_shape(bundle_dir: str | os.PathLike, overrides: Any = None, parser: Any = None) -> list[int]:
    """The example input shape of a bundle's network: ``[1, num_channels, *spatial]`` from ``metadata.json``.

    The input is ``network_data_format.inputs.image`` (or the only input). Each element of its ``spatial_shape``
    is an int, ``"*"`` (any size) or an expression in ``n``/``p`` such as ``"4*n"`` or ``"2**p"``:

    - when ``inference.json`` (with overrides) defines ``patch_size``, each side is the patch side, which must be
      a value the expression can take (so the export sees the shape inference runs on);
    - otherwise each side is the smallest value of the expression that is at least ``DEFAULT_SIDE`` (64), or
      the largest value below it when the expression cannot reach 64; ``"*"`` becomes 64.

    Args:
        bundle_dir: the bundle folder, or a bundle name under ``bundles/``.
        overrides: as for :func:`build_network` (they may change ``patch_size``).
        parser: an already built ``ConfigParser`` of ``inference.json`` (then ``overrides`` is not used).

    Raises:
        ValueError: naming the metadata or config file when the metadata has no usable input description or
            ``patch_size`` is not a value the metadata allows.
    """
    bundle_dir = resolve_bundle(bundle_dir)
    meta_file = bundle_dir / "configs" / "metadata.json"
    config_file = bundle_dir / "configs" / "inference.json"
    name, spec = _input_spec(_read_json(meta_file), meta_file)
    where = f"{str(meta_file)!r} network_data_format.inputs.{name}"
    channels = spec.get("num_channels")
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"{where}.num_channels must be a positive int, got {channels!r}.")
    spatial = spec.get("spatial_shape")
    if not isinstance(spatial, (list, tuple)) or not spatial:
        raise ValueError(f"{where}.spatial_shape must be a non-empty list, got {spatial!r}.")
    if parser is None and config_file.is_file():
        parser = _make_parser(bundle_dir, overrides)
    patch = _patch_size(parser, len(spatial), config_file)
    sides = []
    for i, expr in enumerate(spatial):
        allowed = _candidate_sides(expr, f"{where}.spatial_shape[{i}]")
        if patch is not None:
            ok = allowed(patch[i]) if callable(allowed) else patch[i] in allowed
            if not ok:
                raise ValueError(
                    f"{str(config_file)!r}: patch_size[{i}]={patch[i]} is not a side allowed by "
                    f"{where}.spatial_shape[{i}]={expr!r}; fix patch_size or pass input_shape explicitly."
                )
            sides.append(patch[i])
        elif callable(allowed):
            sides.append(DEFAULT_SIDE)
        else:
            big = [v for v in allowed if v >= DEFAULT_SIDE]
            sides.append(big[0] if big else allowed[-1])
    return [1, channels, *sides]


def _input_description(bundle_dir: Path) -> tuple[str, torch.dtype, tuple[float, float]]:
    """Name, dtype and value range of the bundle's main input, from ``metadata.json`` (defaults when absent)."""
    meta_file = bundle_dir / "configs" / "metadata.json"
    metadata = _read_json(meta_file)
    try:
        name, spec = _input_spec(metadata, meta_file)
    except ValueError:
        return "image", torch.float32, (0.0, 1.0)
    dtype_name = str(spec.get("dtype", "float32")).replace("torch.", "")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{str(meta_file)!r} network_data_format.inputs.{name}.dtype {dtype_name!r} is not a dtype.")
    value_range = spec.get("value_range") or [0, 1]
    if len(value_range) != 2:
        value_range = [0, 1]
    return name, dtype, (float(value_range[0]), float(value_range[1]))


def _next_allowed_shape(bundle_dir: Path, shape: Sequence[int]) -> list[int]:
    """``shape`` with every spatial side replaced by the next larger side its metadata expression allows.

    Used to verify an export with dynamic spatial dimensions on a second, valid size (``"4*n"``: 16 -> 20;
    a fixed int stays; ``"*"``: side + 1). Sides without a metadata description are increased by one.
    """
    meta_file = bundle_dir / "configs" / "metadata.json"
    try:
        name, spec = _input_spec(_read_json(meta_file), meta_file)
        spatial = list(spec.get("spatial_shape") or [])
    except ValueError:
        name, spatial = "image", []
    sides = []
    for i, side in enumerate(shape[2:]):
        if i >= len(spatial) or len(spatial) != len(shape) - 2:
            sides.append(side + 1)
            continue
        allowed = _candidate_sides(spatial[i], f"{str(meta_file)!r} network_data_format.inputs.{name}")
        larger = [side + 1] if callable(allowed) else [v for v in allowed if v > side] or [side]
        sides.append(larger[0])
    return [*shape[:2], *sides]


def _output_names(bundle_dir: Path) -> list[str]:
    """The output keys of ``network_data_format`` in ``metadata.json`` (ONNX output names when they fit)."""
    metadata = _read_json(bundle_dir / "configs" / "metadata.json")
    return list(metadata.get("network_data_format", {}).get("outputs", {}))


def _normalise_shape(input_shape: Any) -> list[int]:
    if isinstance(input_shape, str):
        try:
            input_shape = json.loads(input_shape)
        except json.JSONDecodeError as e:
            raise ValueError(f"input_shape {input_shape!r} is not a JSON list of ints: {e}") from e
    if (
        not isinstance(input_shape, (list, tuple))
        or len(input_shape) < 2
        or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in input_shape)
    ):
        raise ValueError(
            f"input_shape must be a list of positive ints [batch, channels, *spatial], got {input_shape!r}."
        )
    return [int(s) for s in input_shape]


# ---------------------------------------------------------------------------------------------- verification
def random_input(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    value_range: tuple[float, float] = (0.0, 1.0),
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A reproducible random tensor: uniform in ``value_range`` (floats) or integers in it (inclusive)."""
    generator = torch.Generator().manual_seed(int(seed))
    low, high = value_range
    if dtype.is_floating_point:
        x = torch.rand(tuple(shape), generator=generator) * (high - low) + low
    else:
        x = torch.randint(int(low), int(high) + 1, tuple(shape), generator=generator)
    return x.to(dtype=dtype, device=device)


def _flatten(output: Any, what: str) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for v in output.values() for t in _flatten(v, what)]
    if isinstance(output, (list, tuple)):
        return [t for v in output for t in _flatten(v, what)]
    raise ExportError(f"{what} returned a {type(output).__name__}; only tensors, tuples, lists and dicts are exported.")


def compare_outputs(
    expected: Sequence[torch.Tensor],
    actual: Sequence[torch.Tensor],
    what: str,
    rtol: float = 0.0,
    atol: float = 1e-4,
    relative_to_scale: bool = False,
) -> tuple[float, float]:
    """Compare exported outputs with the PyTorch ones; raise ``ExportError`` when they differ.

    An element passes when ``|a - e| <= atol_eff + rtol * |e|``, with ``atol_eff = atol`` or, when
    ``relative_to_scale``, ``atol * max(1, max|e|)`` (the tolerance follows the output's scale).

    Args:
        expected: PyTorch outputs.
        actual: exported outputs, in the same order.
        what: the export, named in the error.
        rtol: relative tolerance per element.
        atol: absolute tolerance.
        relative_to_scale: scale ``atol`` by the largest absolute expected value (when above 1).

    Returns:
        ``(max_abs_diff, output_scale)`` over all outputs.

    Raises:
        ExportError: on a different number of outputs, a shape mismatch, non-finite values or values out of
            tolerance; the message gives the worst difference and the tolerance.
    """
    if len(expected) != len(actual):
        raise ExportError(f"{what}: {len(actual)} outputs, PyTorch gives {len(expected)}.")
    worst, scale = 0.0, 0.0
    for i, (e, a) in enumerate(zip(expected, actual)):
        e = e.detach().to("cpu", torch.float64)
        a = torch.as_tensor(a).detach().to("cpu", torch.float64)
        if tuple(e.shape) != tuple(a.shape):
            raise ExportError(f"{what}: output {i} has shape {tuple(a.shape)}, PyTorch gives {tuple(e.shape)}.")
        if not torch.isfinite(a).all() or not torch.isfinite(e).all():
            raise ExportError(f"{what}: output {i} has non-finite values (exported or PyTorch).")
        diff = (a - e).abs()
        out_scale = float(e.abs().max()) if e.numel() else 0.0
        tol_abs = atol * max(1.0, out_scale) if relative_to_scale else atol
        excess = diff - (tol_abs + rtol * e.abs())
        max_diff = float(diff.max()) if diff.numel() else 0.0
        if diff.numel() and float(excess.max()) > 0:
            raise ExportError(
                f"{what}: output {i} differs from PyTorch: max |diff| {max_diff:.3g} at output scale {out_scale:.3g} "
                f"exceeds the tolerance (atol {tol_abs:.3g}, rtol {rtol:g}); "
                f"{int((excess > 0).sum())} of {diff.numel()} values out of tolerance."
            )
        worst, scale = max(worst, max_diff), max(scale, out_scale)
    return worst, scale


@contextlib.contextmanager
def _quiet(records: list[str]):
    """Record warnings and silence the exporters' progress prints and log lines while converting."""
    names = ("torch.onnx", "torch._dynamo", "torch.export", "torch._export", "onnxscript", "onnx_ir")
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(sink):
            warnings.simplefilter("always")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        quiet = (DeprecationWarning, FutureWarning)
        records.extend(str(w.message).splitlines()[0] for w in caught if not issubclass(w.category, quiet))


def _tracer_note(records: list[str]) -> list[str]:
    relevant = sorted({r for r in records if "might cause the trace to be incorrect" in r or "TracerWarning" in r})
    if not relevant:
        return []
    return [f"{len(relevant)} distinct tracer warning(s), e.g. {relevant[0][:160]!r}"]


def _first_line(error: BaseException) -> str:
    """``Type: first line of the message`` plus the first source location it names (TorchScript errors)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0][:240] if lines else ''}"
    match = re.search(r'File "([^"]+)", line (\d+)', str(error))
    if match:
        parts = Path(match.group(1)).parts
        text += f" (at {'/'.join(parts[-3:])}:{match.group(2)})"
    return text


def _reference(network: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return _flatten(network(x), type(network).__name__)


# ---------------------------------------------------------------------------------------------- TorchScript
def _to_torchscript(network: nn.Module, example: torch.Tensor, method: str, notes: list[str]) -> Any:
    """``torch.jit.script`` or ``torch.jit.trace`` of ``network``; tracer warnings are added to ``notes``."""
    records: list[str] = []
    with _quiet(records), torch.no_grad():
        if method == "script":
            return torch.jit.script(network)
        module = torch.jit.trace(network, example, check_trace=False, strict=False)
    notes.extend(_tracer_note(records))
    return module


def export_module_torchscript(
    network: nn.Module,
    output: str | os.PathLike,
    input_shape: Sequence[int],
    method: str = "auto",
    dtype: torch.dtype = torch.float32,
    value_range: tuple[float, float] = (0.0, 1.0),
    metadata: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, Any] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
) -> ExportResult:
    """Convert a module to TorchScript, save it with metadata, load it back and check it against PyTorch.

    With ``method="auto"``, ``torch.jit.script`` is tried first; when it fails, or its result does not match
    PyTorch, ``torch.jit.trace`` is used. A traced module replays the operations recorded on the example input:
    Python control flow is frozen, and other spatial sizes may fail or give wrong results.

    Args:
        network: the module (evaluated in eval mode).
        output: destination file (``.ts`` conventionally); written only when the check passes.
        input_shape: example input shape ``[batch, channels, *spatial]``.
        method: ``auto``, ``script`` or ``trace``.
        dtype: example input dtype.
        value_range: range of the random example and verification inputs.
        metadata: stored as the ``metadata.json`` extra file (with MONAI/PyTorch/NumPy versions and a timestamp,
            as ``monai.bundle ckpt_export`` does).
        extra_files: more extra files, name -> JSON-serialisable object (or bytes/str).
        rtol: relative tolerance of the check.
        atol: absolute tolerance of the check.
        seed: seed of the example input; the verification input uses ``seed + 1``.

    Raises:
        ExportError: when no method converts the module or no conversion matches PyTorch; the message gives
            the reason for every method tried.
    """
    from monai.data import save_net_with_metadata

    order = {"auto": ["script", "trace"], "script": ["script"], "trace": ["trace"]}.get(method)
    if order is None:
        raise ValueError(f"method must be 'auto', 'script' or 'trace', got {method!r}.")
    start = time.perf_counter()
    output = Path(output)
    shape = _normalise_shape(input_shape)
    network = network.eval()
    device = next(iter(network.parameters()), torch.empty(0)).device
    example = random_input(shape, dtype, value_range, seed=seed, device=device)
    check = random_input(shape, dtype, value_range, seed=seed + 1, device=device)
    expected = _reference(network, check)
    files = {
        k: v if isinstance(v, bytes) else (v if isinstance(v, str) else json.dumps(v, default=str)).encode()
        for k, v in (extra_files or {}).items()
    }
    base_info = json.loads(files.get("export.json", b"{}"))
    output.parent.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    for candidate in order:
        try:
            module = _to_torchscript(network, example, candidate, notes)
        except Exception as e:  # scripting raises many kinds of errors; each means "try the next method"
            notes.append(f"torch.jit.{candidate} failed: {_first_line(e)}")
            continue
        info = {**base_info, "method": candidate, "input_shape": shape, "dtype": str(dtype).replace("torch.", "")}
        files["export.json"] = json.dumps(info).encode()
        with (
            tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as tmp,
            warnings.catch_warnings(),
        ):
            warnings.filterwarnings("ignore", message=_JIT_DEPRECATION)  # documented in docs/export.md
            saved = Path(tmp) / output.name
            with open(saved, "wb") as stream:
                save_net_with_metadata(module, stream, meta_values=dict(metadata or {}), more_extra_files=files)
            loaded = torch.jit.load(str(saved), map_location=device)
            try:
                with torch.no_grad():
                    actual = _flatten(loaded(check), f"TorchScript ({candidate})")
                max_diff, scale = compare_outputs(
                    expected, actual, f"TorchScript ({candidate}) of {output.name}", rtol=rtol, atol=atol
                )
            except ExportError as e:
                notes.append(str(e))
                continue
            except Exception as e:  # the reloaded module cannot run the verification input
                notes.append(f"TorchScript ({candidate}) of {output.name} cannot run a new input: {_first_line(e)}")
                continue
            os.replace(saved, output)
        result = ExportResult(
            "torchscript", output, candidate, shape, max_diff, scale, time.perf_counter() - start, None, [output], notes
        )
        logger.info(result.summary())
        return result
    raise ExportError(f"TorchScript export of {output.name} failed: " + " ; ".join(notes))


# --------------------------------------------------------------------------------------------------- ONNX
def _name_dimensions(model: Any, input_name: str, names: Mapping[int, str]) -> None:
    """Give the symbolic input dimensions readable names everywhere they appear.

    The ``torch.export``-based exporter calls them ``s0``, ``s77``...; dimension ``i`` of the input becomes
    ``names[i]`` in the inputs, outputs and intermediate shapes (also inside expressions such as ``4*(s53//4)``).
    """
    inputs = [i for i in model.graph.input if i.name == input_name]
    if not inputs:
        return
    dims = inputs[0].type.tensor_type.shape.dim
    renames = {dims[i].dim_param: name for i, name in names.items() if i < len(dims) and dims[i].dim_param}
    renames = {old: new for old, new in renames.items() if old != new}
    if not renames:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in renames) + r")\b")
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if value.type.HasField("tensor_type"):
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param:
                    dim.dim_param = pattern.sub(lambda m: renames[m.group(1)], dim.dim_param)


def _ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def export_module_onnx(
    network: nn.Module,
    output: str | os.PathLike,
    input_shape: Sequence[int],
    opset: int | None = None,
    dynamic_batch: bool = True,
    exporter: str = "auto",
    dtype: torch.dtype = torch.float32,
    value_range: tuple[float, float] = (0.0, 1.0),
    input_name: str = "image",
    output_names: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    extra_metadata: Mapping[str, Any] | None = None,
    atol: float = 1e-4,
    seed: int = 0,
    external_data: bool | None = None,
    dynamic_spatial: bool = False,
    check_shapes: Sequence[Sequence[int]] = (),
) -> ExportResult:
    """Export a module to ONNX, check the model and compare onnxruntime (CPU) with PyTorch.

    With ``exporter="auto"`` the ``torch.export``-based exporter (``dynamo``) is tried first and the
    TorchScript-based one (``legacy``) when it fails or its model does not match. The verification input has a
    batch of ``input_shape[0] + 1`` when ``dynamic_batch`` (so a dynamic batch is really checked), and every
    shape in ``check_shapes`` is checked too. An output matches when
    ``max|diff| <= atol * max(1, max|pytorch output|)``.

    Args:
        network: the module (evaluated in eval mode, on the CPU for the check).
        output: destination ``.onnx`` file; written only when the check passes.
        input_shape: example input shape ``[batch, channels, *spatial]``.
        opset: ONNX opset; ``None`` uses the exporter's default.
        dynamic_batch: make dimension 0 symbolic (``batch``).
        exporter: ``auto``, ``dynamo`` or ``legacy``.
        dtype: example input dtype.
        value_range: range of the random example and verification inputs.
        input_name: name of the graph input (the bundle's metadata input key).
        output_names: names of the graph outputs, used when there is one per output tensor; otherwise ``pred``
            (``pred_<i>`` for several).
        metadata: stored as the ``metadata.json`` model property (JSON).
        extra_metadata: more model properties, name -> JSON-serialisable object.
        atol: tolerance relative to the output scale.
        seed: seed of the example input; the verification inputs use ``seed + 1``, ``seed + 2``...
        external_data: store weights in ``<output>.data``; default: only when they exceed 1.5 GB (protobuf
            cannot hold more than 2 GB).
        dynamic_spatial: make the spatial dimensions symbolic too (``spatial_0``...); give ``check_shapes``
            with other spatial sizes so that this is verified.
        check_shapes: more input shapes to verify the model on.

    Raises:
        ExportError: when no exporter produces a valid model that matches PyTorch on every verification input.
    """
    start = time.perf_counter()
    output = Path(output)
    shape = _normalise_shape(input_shape)
    order = {"auto": ["dynamo", "legacy"], "dynamo": ["dynamo"], "legacy": ["legacy"]}.get(exporter)
    if order is None:
        raise ValueError(f"exporter must be 'auto', 'dynamo' or 'legacy', got {exporter!r}.")
    network = network.eval()
    device = next(iter(network.parameters()), torch.empty(0)).device
    example = random_input(shape, dtype, value_range, seed=seed, device=device)
    shapes = [[shape[0] + 1, *shape[1:]] if dynamic_batch else shape, *(_normalise_shape(c) for c in check_shapes)]
    checks = [random_input(c, dtype, value_range, seed=seed + 1 + i, device=device) for i, c in enumerate(shapes)]
    expected = [_reference(network, c) for c in checks]
    names = _graph_output_names(output_names, len(expected[0]))
    dynamic = ({0: "batch"} if dynamic_batch else {}) | (
        {i: f"spatial_{i - 2}" for i in range(2, len(shape))} if dynamic_spatial else {}
    )
    weight_bytes = sum(t.numel() * t.element_size() for t in network.state_dict().values())
    external_data = weight_bytes > _ONNX_EXTERNAL_DATA_BYTES if external_data is None else external_data
    properties = {"metadata.json": dict(metadata or {}), **dict(extra_metadata or {})}
    output.parent.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for candidate in order:
        info = {**properties.get("export.json", {}), "exporter": candidate, "input_shape": shape}
        info.update(dynamic_axes={str(k): v for k, v in dynamic.items()}, verified_shapes=shapes)
        graph = (candidate, opset, dynamic, input_name, names, {**properties, "export.json": info}, external_data)
        with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as tmp:
            try:
                model_file, opset_used, notes = _onnx_candidate(network, example, Path(tmp), output.name, *graph)
                what = f"ONNX ({candidate}) of {output.name} in onnxruntime"
                max_diff, scale = _onnx_parity(model_file, input_name, checks, expected, what, atol)
            except ExportError as e:
                errors.append(str(e))
                continue
            except Exception as e:  # onnxruntime cannot load the model or run a verification input
                errors.append(f"{candidate} exporter: onnxruntime cannot run the model: {_first_line(e)}")
                continue
            written = _move_onnx(model_file, output, external_data)
        elapsed = time.perf_counter() - start
        result = ExportResult(
            "onnx", output, candidate, shape, max_diff, scale, elapsed, opset_used, written, errors + notes
        )
        logger.info(result.summary())
        return result
    raise ExportError(f"ONNX export of {output.name} failed: " + " ; ".join(errors))


def _move_onnx(model_file: Path, output: Path, external_data: bool) -> list[Path]:
    """Move a verified model (and its external weights, ``<name>.data`` beside it) to ``output``; the files
    written."""
    os.replace(model_file, output)
    if not external_data:
        return [output]
    data = output.parent / f"{output.name}.data"
    os.replace(model_file.parent / data.name, data)
    return [output, data]


def _graph_output_names(given: Sequence[str] | None, count: int) -> list[str]:
    """The graph's output names: ``given`` when it names each of the ``count`` outputs (metadata outputs may not
    describe every tensor returned), else ``pred`` (``pred_<i>`` for several)."""
    names = list(given or [])
    if len(names) == count:
        return names
    return ["pred"] if count == 1 else [f"pred_{i}" for i in range(count)]


def _onnx_parity(
    model_file: Path,
    input_name: str,
    checks: Sequence[torch.Tensor],
    expected: Sequence[Sequence[torch.Tensor]],
    what: str,
    atol: float,
) -> tuple[float, float]:
    """Run ``model_file`` in onnxruntime on each verification input and compare with PyTorch's outputs
    (:func:`compare_outputs`): the largest difference and output scale over the inputs.

    Raises:
        ExportError: when an output does not match.
    """
    session = _ort_session(model_file)
    max_diff = scale = 0.0
    for check, reference in zip(checks, expected):
        actual = [torch.from_numpy(a) for a in session.run(None, {input_name: check.detach().cpu().numpy()})]
        diff, out_scale = compare_outputs(reference, actual, f"{what}, input {list(check.shape)}", 0.0, atol, True)
        max_diff, scale = max(max_diff, diff), max(scale, out_scale)
    return max_diff, scale


def _onnx_candidate(
    network: nn.Module,
    example: torch.Tensor,
    folder: Path,
    filename: str,
    exporter: str,
    opset: int | None,
    dynamic: Mapping[int, str],
    input_name: str,
    output_names: list[str],
    properties: Mapping[str, Any],
    external_data: bool,
) -> tuple[Path, int | None, list[str]]:
    """Export with one exporter into ``folder``, name the dynamic dimensions, add properties, check the model.

    Returns:
        ``(model file, opset, notes)``.

    Raises:
        ExportError: when the exporter fails or ``onnx.checker`` rejects the model.
    """
    import onnx

    records: list[str] = []
    raw = folder / "raw" / filename
    raw.parent.mkdir()
    kwargs: dict[str, Any] = dict(input_names=[input_name], output_names=output_names, opset_version=opset)
    try:
        with _quiet(records), torch.no_grad():
            if exporter == "dynamo":
                if dynamic:
                    kwargs["dynamic_shapes"] = ({i: torch.export.Dim.DYNAMIC for i in dynamic},)
                torch.onnx.export(
                    network, (example,), str(raw), dynamo=True, external_data=external_data, verbose=False, **kwargs
                )
            else:
                if dynamic:
                    axes = {name: {0: "batch"} for name in output_names} if 0 in dynamic else {}
                    kwargs["dynamic_axes"] = {input_name: dict(dynamic), **axes}
                torch.onnx.export(network, (example,), str(raw), dynamo=False, **kwargs)
        model = onnx.load(str(raw))
    except Exception as e:  # exporters raise many kinds of errors; each means "try the next exporter"
        raise ExportError(f"{exporter} exporter failed: {_first_line(e)}") from e
    _name_dimensions(model, input_name, dynamic)
    for key, value in properties.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value if isinstance(value, str) else json.dumps(value, default=str)
    final = folder / filename
    onnx.save_model(model, str(final), save_as_external_data=external_data, location=f"{filename}.data")
    try:
        onnx.checker.check_model(str(final), full_check=True)
    except Exception as e:  # onnx.checker.ValidationError and shape-inference errors
        raise ExportError(f"{exporter} exporter: onnx.checker rejects the model: {_first_line(e)}") from e
    opset_used = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return final, opset_used, _tracer_note(records) if exporter == "legacy" else []


# ------------------------------------------------------------------------------------------- bundle exports
def run_export(
    format: str,
    bundle_dir: str | os.PathLike,
    ckpt: str | os.PathLike,
    output: str | os.PathLike,
    net_id: str = "network",
    input_shape: Sequence[int] | str | None = None,
    overrides: Any = None,
    ckpt_key: str | None = None,
    device: str = "cpu",
    **kwargs: Any,
) -> ExportResult:
    """Build a bundle's network, load a checkpoint and export it in ``format``.

    Args:
        format: ``torchscript`` or ``onnx``.
        bundle_dir: the bundle folder, or a bundle name under ``bundles/``.
        ckpt: checkpoint with the network's state dict (loaded with ``weights_only=True``); when it lies in a
            training run's ``models/`` folder, the network is built with that run's settings
            (``configs/run.json``), and ``overrides`` still win.
        output: destination file.
        net_id: id of the network in ``inference.json``.
        input_shape: example input shape; default :func:`default_input_shape`.
        overrides: config overrides, as for :func:`build_network`.
        ckpt_key: key of the state dict inside a nested checkpoint (e.g. ``autoencoder`` in ``last.pt``).
        device: where the network is built and exported (the ONNX check always runs on the CPU).
        kwargs: passed to :func:`export_module_torchscript` or :func:`export_module_onnx`.

    Raises:
        CheckpointError: naming the checkpoint when it is missing, unreadable or does not fit the network.
        ExportError: when the export fails or does not match PyTorch.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {format!r}.")
    bundle = resolve_bundle(bundle_dir)
    if format == "onnx":
        device = "cpu"
    run_dir = run_dir_of(ckpt)
    if run_dir is not None:  # the network of the run that wrote the checkpoint (its configs/run.json)
        overrides = [{"output_dir": str(run_dir)}, *_parse_overrides(overrides)]
    network, parser = build_network(bundle, net_id, overrides, device)
    settings = parser.get_parsed_content("trained") if "trained" in parser else None
    load_network_weights(network, ckpt, key=ckpt_key, settings=settings)
    network.eval()
    shape = _normalise_shape(input_shape) if input_shape is not None else default_input_shape(bundle, parser=parser)
    input_name, dtype, value_range = _input_description(bundle)
    metadata = _read_json(bundle / "configs" / "metadata.json")
    export_info = {"bundle": bundle.name, "net_id": net_id, "checkpoint": Path(ckpt).name, "ckpt_key": ckpt_key}
    kwargs = {"dtype": dtype, "value_range": value_range, "metadata": metadata, **kwargs}
    if format == "torchscript":
        extra = {"inference.json": parser.get(), "export.json": export_info, **kwargs.pop("extra_files", {})}
        return export_module_torchscript(network, output, shape, extra_files=extra, **kwargs)
    kwargs.setdefault("output_names", _output_names(bundle))
    kwargs.setdefault("input_name", input_name)
    if kwargs.get("dynamic_spatial") and not kwargs.get("check_shapes"):
        kwargs["check_shapes"] = [_next_allowed_shape(bundle, shape)]
    extra = {"export.json": export_info, **kwargs.pop("extra_metadata", {})}
    return export_module_onnx(network, output, shape, extra_metadata=extra, **kwargs)


def export_all(
    bundle_dir: str | os.PathLike,
    ckpt: str | os.PathLike,
    output_dir: str | os.PathLike,
    net_id: str = "network",
    input_shape: Sequence[int] | str | None = None,
    overrides: Any = None,
    formats: Sequence[str] = EXPORT_FORMATS,
    ckpt_key: str | None = None,
    opset: int | None = None,
    dynamic_batch: bool = True,
    dynamic_spatial: bool = False,
) -> list[ExportResult]:
    """Export a bundle's network in every format to ``output_dir`` (``model.ts``, ``model.onnx``).

    Args:
        bundle_dir: the bundle folder, or a bundle name under ``bundles/``.
        ckpt: checkpoint with the network's state dict.
        output_dir: destination folder.
        net_id: id of the network in ``inference.json``.
        input_shape: example input shape; default :func:`default_input_shape`.
        overrides: config overrides (dict, config file or a list of them).
        formats: subset of ``("torchscript", "onnx")``.
        ckpt_key: key of the state dict inside a nested checkpoint.
        opset: ONNX opset.
        dynamic_batch: symbolic ONNX batch dimension.
        dynamic_spatial: symbolic ONNX spatial dimensions.

    Returns:
        One :class:`ExportResult` per format, in order.
    """
    output_dir = Path(output_dir)
    suffix = {"torchscript": ".ts", "onnx": ".onnx"}
    stem = "model" if net_id == "network" else net_id.replace("#", "_")
    results = []
    for fmt in formats:
        if fmt not in EXPORT_FORMATS:
            raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}.")
        kwargs = {}
        if fmt == "onnx":
            kwargs = {"opset": opset, "dynamic_batch": dynamic_batch, "dynamic_spatial": dynamic_spatial}
        results.append(
            run_export(
                fmt,
                bundle_dir,
                ckpt,
                output_dir / f"{stem}{suffix[fmt]}",
                net_id,
                input_shape,
                overrides,
                ckpt_key,
                **kwargs,
            )
        )
    return results


def format_results(results: Sequence[ExportResult]) -> str:
    """A Markdown table of exports: format, method, file, size, parity with PyTorch and time."""
    rows = [
        "| format | method | file | size (MiB) | input shape | max abs diff vs PyTorch | output scale | time (s) |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    for r in results:
        method = r.method + (f" (opset {r.opset})" if r.opset is not None else "")
        rows.append(
            f"| {r.format} | {method} | {r.path} | {r.size_bytes / 2**20:.2f} | {r.input_shape} | "
            f"{r.max_abs_diff:.2e} | {r.output_scale:.3g} | {r.seconds:.1f} |"
        )
    notes = [f"- {r.format}: {n}" for r in results for n in r.notes]
    return "\n".join(rows + ([""] + notes if notes else []))

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Export a bundle's inference network to TorchScript and/or ONNX, each checked against PyTorch.

Example::

    python scripts/export_bundle.py torchscript --bundle autoencoder_3d --ckpt runs/ae/models/model.pt \\
        --output model.ts
    python scripts/export_bundle.py onnx --bundle autoencoder_3d --ckpt runs/ae/models/model.pt \\
        --output model.onnx --input_shape "[1,1,64,64,64]"
    python scripts/export_bundle.py all --bundle autoencoder_3d --ckpt runs/ae/models/model.pt --output_dir export/
    python scripts/export_bundle.py shape --bundle autoencoder_3d
    python scripts/export_bundle.py bundles

Every command takes ``--net_id`` (default ``network``), ``--input_shape`` (default: derived from the bundle's
metadata and ``patch_size``), ``--overrides`` (a dict such as ``"{'mode': 'encode'}"``, a config file such as
``bundles/<name>/configs/tiny.json``, or a list of them) and ``--ckpt_key`` (for a nested checkpoint such as
``last.pt``: ``--ckpt_key autoencoder``). See ``docs/export.md``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from common.bundle import bundle_names
from common.bundle_tools.export import (
    EXPORT_FORMATS,
    ExportError,
    default_input_shape,
    export_all,
    format_results,
    run_export,
)
from common.checkpoint_io import CheckpointError

__all__ = ["all_formats", "bundles", "main", "onnx", "shape", "torchscript"]

_MAX_ERROR_LINES = 8


def _setup() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def torchscript(
    bundle: str,
    ckpt: str,
    output: str,
    net_id: str = "network",
    input_shape: Any = None,
    overrides: Any = None,
    method: str = "auto",
    ckpt_key: str | None = None,
) -> None:
    """Export to TorchScript (``torch.jit.script``, else ``torch.jit.trace``) and print the parity check.

    Args:
        bundle: bundle name (a folder under ``bundles/``) or bundle folder.
        ckpt: checkpoint with the network's state dict.
        output: destination ``.ts`` file.
        net_id: id of the network in ``inference.json``.
        input_shape: example input shape, e.g. ``"[1,1,64,64,64]"``.
        overrides: config overrides: a dict, a config file or a list of them.
        method: ``auto``, ``script`` or ``trace``.
        ckpt_key: key of the state dict inside a nested checkpoint.
    """
    _setup()
    result = run_export("torchscript", bundle, ckpt, output, net_id, input_shape, overrides, ckpt_key, method=method)
    print(format_results([result]))


def onnx(
    bundle: str,
    ckpt: str,
    output: str,
    net_id: str = "network",
    input_shape: Any = None,
    overrides: Any = None,
    opset: int | None = None,
    dynamic_batch: bool = True,
    exporter: str = "auto",
    ckpt_key: str | None = None,
    dynamic_spatial: bool = False,
    atol: float = 1e-4,
) -> None:
    """Export to ONNX (``torch.export``-based exporter, else the TorchScript-based one), checked in onnxruntime.

    Args:
        output: destination ``.onnx`` file.
        bundle, ckpt, net_id, input_shape, overrides, ckpt_key: as for :func:`torchscript`.
        opset: ONNX opset (default: the exporter's).
        dynamic_batch: symbolic batch dimension.
        exporter: ``auto``, ``dynamo`` or ``legacy``.
        dynamic_spatial: symbolic spatial dimensions (verified on a second, larger size).
        atol: parity tolerance relative to the output scale (``atol * max(1, max|output|)``).
    """
    _setup()
    result = run_export(
        "onnx",
        bundle,
        ckpt,
        output,
        net_id,
        input_shape,
        overrides,
        ckpt_key,
        opset=opset,
        dynamic_batch=dynamic_batch,
        exporter=exporter,
        dynamic_spatial=dynamic_spatial,
        atol=atol,
    )
    print(format_results([result]))


def all_formats(
    bundle: str,
    ckpt: str,
    output_dir: str,
    net_id: str = "network",
    input_shape: Any = None,
    overrides: Any = None,
    formats: Any = EXPORT_FORMATS,
    opset: int | None = None,
    dynamic_batch: bool = True,
    ckpt_key: str | None = None,
    dynamic_spatial: bool = False,
) -> None:
    """Export to every format (``model.ts``, ``model.onnx`` in ``output_dir``) and print a table.

    Args:
        output_dir: destination folder.
        bundle, ckpt, net_id, input_shape, overrides, ckpt_key: as for :func:`torchscript`.
        formats: a subset of ``torchscript``, ``onnx``.
        opset, dynamic_batch, dynamic_spatial: as for :func:`onnx`.
    """
    _setup()
    formats = [formats] if isinstance(formats, str) else list(formats)
    results = export_all(
        bundle,
        ckpt,
        output_dir,
        net_id,
        input_shape,
        overrides,
        formats,
        ckpt_key,
        opset,
        dynamic_batch,
        dynamic_spatial,
    )
    print(format_results(results))


def shape(bundle: str, overrides: Any = None) -> None:
    """Print the default export input shape of a bundle (from its metadata and ``patch_size``).

    Args:
        bundle, overrides: as for :func:`torchscript`.
    """
    print(default_input_shape(bundle, overrides))


def bundles() -> None:
    """Print the bundles that can be exported."""
    print("\n".join(bundle_names()))


def main() -> None:
    """Command line entry point; export and checkpoint errors are printed without a traceback (exit status 1)."""
    import fire

    commands = {"torchscript": torchscript, "onnx": onnx, "all": all_formats, "shape": shape, "bundles": bundles}
    try:
        fire.Fire(commands)
    except (CheckpointError, ExportError, FileNotFoundError) as e:
        lines = str(e).splitlines()
        more = f"\n  ... ({len(lines) - _MAX_ERROR_LINES} more lines)" if len(lines) > _MAX_ERROR_LINES else ""
        print("export failed: " + "\n".join(lines[:_MAX_ERROR_LINES]) + more, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    main()

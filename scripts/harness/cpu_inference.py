# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Inference on a CPU server at the hardware's limit (``scripts/benchmark.py cpu_inference``): a bundle's default
network (``inference.json``'s ``network`` at the bundle's defaults, random weights) on one window of its default
input, in every way a CPU can run it, against the matrix-product peaks measured in the same process.

Rows (each skipped with its reason where the machine cannot run it):

* ``torch fp32`` (how the bundles run today) and ``torch fp32 channels_last`` (the module and input in
  ``channels_last_3d``);
* ``torch bf16`` and ``torch bf16 channels_last``: CPU autocast to bfloat16 (oneDNN's bf16 kernels: AMX or
  AVX512-BF16 where the CPU has them);
* ``onnxruntime fp32``: the network exported by the bundle tools' ONNX exporter
  (:func:`common.bundle_tools.export.export_module_onnx`, which checks it against PyTorch), run by ONNX Runtime's
  CPU provider;
* ``openvino fp32`` and ``openvino bf16``: the same ONNX model compiled by OpenVINO for the CPU with that inference
  precision hint (when the ``openvino`` package is installed).

Each row gives the seconds per window (the best of ``repeats`` after a warm-up), the achieved GFLOP/s of the
network's FLOPs (:func:`scripts.harness.tools.count_flops`: convolutions, matrix products and attention, 2 per
multiply-add) and that as a share of the fp32 and bf16 peaks of a ``matmul_size``-squared matrix product in the
same process, and the largest difference from ``torch fp32`` relative to the output's scale (bf16 keeps 8 bits of
mantissa: its difference is the price of its speed, to be judged on trained weights).
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common.networks.wrappers import to_memory_format
from scripts.harness import tools

__all__ = ["cpu_inference", "matmul_peaks", "window_rows"]

HEADER = ["way", "s per window", "GFLOP/s", "of fp32 peak", "of bf16 peak", "max diff (of output scale)"]


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(max(1, int(repeats))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_peaks(size: int = 2048, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of a ``size``-squared matrix product in fp32 and in bf16 on the CPU, at the current thread count:
    the peaks a network's GFLOP/s are compared with."""
    peaks = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        peaks[name] = 2 * size**3 / _best_seconds(lambda a=a, b=b: a @ b, repeats) / 1e9
    return peaks


def _torch_way(network: torch.nn.Module, x: torch.Tensor, bf16: bool, channels_last: bool) -> Callable[[], Any]:
    layout = "channels_last_3d" if channels_last else "contiguous"
    net = to_memory_format(copy.deepcopy(network), layout)  # a copy: a module is converted in place
    x = to_memory_format(x, layout)

    def run() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return net(x)

    return run


def _onnx_ways(network: torch.nn.Module, x: torch.Tensor, work: Path) -> dict[str, Callable[[], Any] | str]:
    """The ONNX Runtime and OpenVINO rows: a callable each, or the reason it cannot run."""
    from common.bundle_tools.export import export_module_onnx

    ways: dict[str, Callable[[], Any] | str] = {}
    model = work / "network.onnx"
    try:
        export_module_onnx(network, model, list(x.shape))
    except Exception as e:  # the exporter's own check failed: say why in the row
        reason = f"not exported: {' '.join(str(e).split())}"
        return {"onnxruntime fp32": reason, "openvino fp32": reason, "openvino bf16": reason}
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    name, array = session.get_inputs()[0].name, x.numpy()
    ways["onnxruntime fp32"] = lambda: torch.from_numpy(session.run(None, {name: array})[0])
    try:
        import openvino as ov
    except ImportError:
        return {**ways, "openvino fp32": "openvino is not installed", "openvino bf16": "openvino is not installed"}
    core = ov.Core()
    for precision in ("f32", "bf16"):
        compiled = core.compile_model(
            str(model),
            "CPU",
            {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": torch.get_num_threads()},
        )
        ways[f"openvino {'fp32' if precision == 'f32' else precision}"] = lambda c=compiled: torch.from_numpy(
            c([array])[c.output(0)]
        )
    return ways


def _first_tensor(output: Any) -> torch.Tensor:
    while isinstance(output, (tuple, list)):
        output = output[0]
    return output.float()


def window_rows(network: torch.nn.Module, x: torch.Tensor, repeats: int = 2, work: Path | None = None) -> dict:
    """Every way of running ``network`` on the window ``x`` (see the module docstring), against the matmul peaks:
    ``{"peaks", "gflop_per_window", "rows": [{"way", "seconds", "gflops", "of_fp32_peak", "of_bf16_peak",
    "max_diff"} or {"way", "skipped"}]}``."""
    network = network.eval()
    peaks = matmul_peaks()
    with torch.no_grad():
        flops = tools.count_flops(lambda: network(x))
        reference = _first_tensor(network(x))
    scale = max(1.0, float(reference.abs().max()))
    ways: dict[str, Callable[[], Any] | str] = {
        f"torch {p}{' channels_last' if cl else ''}": _torch_way(network, x, p == "bf16", cl)
        for p in ("fp32", "bf16")
        for cl in (False, True)
    }
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        ways.update(_onnx_ways(network, x, Path(tmp)))
        rows = []
        for way, run in ways.items():
            if isinstance(run, str):
                rows.append({"way": way, "skipped": run})
                continue
            seconds = _best_seconds(run, repeats)
            gflops = flops / seconds / 1e9
            rows.append(
                {
                    "way": way,
                    "seconds": seconds,
                    "gflops": gflops,
                    "of_fp32_peak": gflops / peaks["fp32"],
                    "of_bf16_peak": gflops / peaks["bf16"],
                    "max_diff": float((_first_tensor(run()) - reference).abs().max()) / scale,
                }
            )
    return {"peaks": peaks, "gflop_per_window": flops / 1e9, "rows": rows}


def cpu_inference(
    bundle: str = "autoencoder_3d",
    num_threads: int | None = None,
    repeats: int = 2,
    overrides: dict | None = None,
    output: str | None = None,
) -> dict:
    """``bundle``'s default network on one window of its default input (``inference.json``'s ``network``, random
    weights), in every way of the module docstring, on the CPU.

    Args:
        bundle: a bundle name or folder.
        num_threads: intra-op threads (default: torch's, the cores of the machine).
        repeats: timed calls per row (the fastest is reported).
        overrides: config overrides of the network (a smaller one for a quick look: ``"{'channels': [8, 16, 16]}"``).
        output: JSON file of the results.
    """
    from common.bundle_tools.export import build_network, default_input_shape

    if num_threads:
        torch.set_num_threads(int(num_threads))
    network, _ = build_network(bundle, overrides=overrides)
    shape = default_input_shape(bundle, overrides=overrides)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    result = window_rows(network, x, repeats)
    summary = {
        "bundle": bundle,
        "window": shape,
        "parameters_m": sum(p.numel() for p in network.parameters()) / 1e6,
        "threads": torch.get_num_threads(),
        "native_bf16": {
            "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
            "amx": torch.cpu._is_amx_tile_supported(),
        },
        **result,
    }
    print(
        f"{bundle}: {summary['parameters_m']:.2f} M parameters, {result['gflop_per_window']:.1f} GFLOP per "
        f"{tools.shape_label(shape[2:])} window, {summary['threads']} threads; matmul peaks "
        f"{result['peaks']['fp32']:.0f} (fp32) / {result['peaks']['bf16']:.0f} (bf16) GFLOP/s"
    )
    tools.print_table(
        HEADER,
        [
            [r["way"], f"skipped: {r['skipped'][:150]}", "", "", "", ""]
            if "skipped" in r
            else [
                r["way"],
                f"{r['seconds']:.3f}",
                f"{r['gflops']:.0f}",
                f"{r['of_fp32_peak']:.0%}",
                f"{r['of_bf16_peak']:.0%}",
                f"{r['max_diff']:.2e}",
            ]
            for r in result["rows"]
        ],
    )
    return tools.save_summary(summary, output)

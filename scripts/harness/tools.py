# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""What every benchmark of ``scripts/benchmark.py`` shares: device names and synchronisation, Markdown tables, the
bundle's own trainer built from its ``train.json``, timed plain loops, the alternating bundle-vs-plain-loop
throughput comparison, and model FLOPs utilisation (FLOPs counted by ``torch.utils.flop_counter``, divided by the
step time and the device's dense bf16 peak from :data:`PEAK_BF16_TFLOPS`)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.bundle import ROOT as REPO_ROOT
from common.bundle import resolve_bundle

__all__ = [
    "GIB",
    "KERNEL_KINDS",
    "NO_VALIDATION",
    "PEAK_BF16_TFLOPS",
    "REPO_ROOT",
    "alternate",
    "bundle_command",
    "bundle_trainer",
    "config_file",
    "count_flops",
    "device_name",
    "kernel_kind",
    "kernel_profile",
    "peak_bf16_tflops",
    "plain_loader",
    "print_table",
    "print_throughput",
    "run_probe",
    "run_command",
    "save_summary",
    "setup",
    "shape_label",
    "step_flops",
    "sync",
    "time_engine",
    "timed_loop",
    "train_config",
]

GIB = 2**30
#: what turns validation and periodic checkpoints off in a timed training run (its final weights are evaluated once)
NO_VALIDATION = {"val_interval": 10**6, "ckpt_interval": 10**6}

# Dense (no sparsity) bf16 tensor-core peak in TFLOP/s from the vendors' data sheets, matched in order against the
# CUDA device name; the first key contained in the name wins, so the specific variants come first.
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.4,  # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    "GH200": 989.4,
    "H200": 989.4,
    "H800": 989.4,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.1,
    "L40": 181.0,
    "L4": 121.0,
}


def config_file(bundle: str, name: str = "train.json") -> Path:
    """The config file ``name`` of ``bundle`` (a name or a folder, :func:`common.bundle.resolve_bundle`)."""
    return resolve_bundle(bundle) / "configs" / name


def train_config(bundle: str) -> dict:
    """The raw ``configs/train.json`` of ``bundle`` (its literal defaults: widths, loss weights, optimizer)."""
    return json.loads(config_file(bundle).read_text())


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def peak_bf16_tflops(device: torch.device | str) -> float | None:
    """The dense bf16 peak (TFLOP/s) of a CUDA ``device`` (or a device name such as ``"NVIDIA H100 PCIe"``) from
    :data:`PEAK_BF16_TFLOPS`, or None for CPUs and GPUs not in the table."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        device = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in device), None)


def count_flops(fn: Callable[[], Any]) -> int:
    """Model FLOPs of calling ``fn`` (forward and backward passes alike): matrix products, convolutions and
    attention as :class:`torch.utils.flop_counter.FlopCounterMode` counts them (2 per multiply-add); element-wise
    work (normalisation, activations, optimizer updates) is not counted, as in the usual MFU definition."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def step_flops(s: dict, bundle: str, overrides: dict, output_dir: str) -> int:
    """Model FLOPs of one training iteration of ``bundle``'s trainer at the run's settings: a fresh trainer
    (``compile`` off, so the count sees every operation) runs two iterations and the second one is counted, from
    ``ITERATION_STARTED`` to ``ITERATION_COMPLETED`` (the loading of the batch, which does no model FLOPs, is left
    out)."""
    from ignite.engine import Events
    from torch.utils.flop_counter import FlopCounterMode

    trainer, _ = bundle_trainer(s, 2, output_dir, {**overrides, "compile": False}, bundle)
    counter = FlopCounterMode(display=False)
    trainer.add_event_handler(Events.ITERATION_STARTED(once=2), lambda _: counter.__enter__())
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda _: counter.__exit__(None, None, None))
    trainer.run()
    return int(counter.get_total_flops())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_table(header: Sequence[str], rows: Sequence[Sequence]) -> None:
    """Print a Markdown table."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def save_summary(summary: dict, output: str | None) -> dict:
    """Write a benchmark's result as JSON to ``output`` (when given) and return it."""
    if output:
        Path(output).write_text(json.dumps(summary, indent=2))
    return summary


def shape_label(shape: Sequence[int]) -> str:
    """A volume or patch size as it is printed in the tables: ``64x64x64``."""
    return "x".join(str(int(v)) for v in shape)


def _fixed(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_throughput(summary: dict, leading: dict[str, Any]) -> None:
    """Print a throughput comparison as a Markdown table: the ``leading`` columns describing the run, then the
    plain loop's and the bundle's samples/s, their ratio, the bundle's data-wait fraction and peak memory."""
    results = {
        "plain loop (samples/s)": _fixed(summary["plain_samples_per_s"], ".2f"),
        "bundle (samples/s)": f"{summary['bundle_samples_per_s']:.2f}",
        "bundle / plain": _fixed(summary["speedup"], ".3f"),
        "data wait": f"{summary['bundle_data_wait']:.1%}",
        "peak mem (GiB)": f"{summary['bundle_peak_mem_gib']:.2f}",
        "step TFLOP": f"{summary['step_flops'] / 1e12:.3f}",
        "bundle TFLOP/s": f"{summary['bundle_tflops']:.2f}",
        "MFU (bf16 peak)": "n/a" if summary["mfu"] is None else f"{summary['mfu']:.1%}",
    }
    print_table([*leading, *results], [[*leading.values(), *results.values()]])


def bundle_trainer(
    s: dict, iterations: int, output_dir: str, extra: dict | None = None, bundle: str = "autoencoder_3d"
):
    """``train#trainer`` of ``bundle`` built from its ``train.json`` with every handler on, for ``iterations``
    steps at the run's settings, and its ``TrainingMonitor`` (validation and checkpoint intervals pushed out of
    reach). ``extra`` holds the bundle's own overrides (network widths, batch, ...), applied last."""
    from monai.bundle import ConfigWorkflow

    overrides = {
        "output_dir": output_dir,
        "max_epochs": 1,
        "epoch_length": iterations,
        **NO_VALIDATION,
        "log_interval": 10**6,
        "resume": False,
        "device": str(s["device"]),
        "amp": s["amp"],
        "num_threads": torch.get_num_threads(),
        "cache_device": str(s["device"]),
        **(extra or {}),
    }
    workflow = ConfigWorkflow(config_file=str(config_file(bundle)), workflow_type="train", **overrides)
    workflow.initialize()
    trainer = workflow.parser.get_parsed_content("train#trainer")
    monitor = next(
        h for h in workflow.parser.get_parsed_content("train#handlers") if type(h).__name__ == "TrainingMonitor"
    )
    return trainer, monitor


# what a kernel (or, on a CPU, an operator) does, from its name: the first pattern found in the lower-case name wins
KERNEL_KINDS = (
    ("layout/copy", ("nchwtonhwc", "nhwctonchw", "memcpy", "memset", "direct_copy")),  # cuDNN's layout conversions
    ("attention", ("flash", "fmha", "attention", "softmax", "sdpa")),
    ("matmul/conv", ("gemm", "conv", "cudnn", "xmma", "cutlass", "wgmma", "matmul", "addmm", "mm_", "aten::mm", "bmm")),
    ("normalisation", ("norm", "welford", "moments", "computefusedparams")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "lerp")),
    ("layout/copy", ("copy", "memcpy", "memset", "cat", "transpose", "permute", "contiguous", "nchw", "nhwc", "fill")),
    ("reduction", ("reduce", "triton_red", "sum", "mean", "max", "min", "argmin")),
    (
        "elementwise",
        ("elementwise", "vectorized", "unrolled", "triton_poi", "pointwise", "mul", "add", "silu", "sigmoid"),
    ),
)


def kernel_kind(name: str) -> str:
    """The kind of a kernel or operator by its name (:data:`KERNEL_KINDS`), ``other`` when none matches."""
    low = name.lower()
    return next((kind for kind, patterns in KERNEL_KINDS if any(p in low for p in patterns)), "other")


def kernel_profile(trainer, warmup: int, top: int = 15) -> dict:
    """Profile one training iteration of ``trainer`` (the one after ``warmup`` iterations; the trainer must run at
    least ``warmup + 1``) with ``torch.profiler``.

    Returns:
        ``step_ms``: the device time of the iteration's kernels (CPU operator self time on a CPU); ``kernels``: the
        ``top`` kernels by time (``name``, ``kind`` of :func:`kernel_kind`, ``calls``, ``ms``, ``share`` of the
        step); ``kinds``: the share of each kind over all kernels. (The profiler counts no FLOPs of 3D
        convolutions: the report divides the step's model FLOPs by the time of its ``matmul/conv`` kernels.)
    """
    from ignite.engine import Events
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(trainer.state.device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiler = profile(activities=activities)

    @trainer.on(Events.ITERATION_STARTED(once=warmup + 1))
    def _start(engine):
        sync(device)
        profiler.__enter__()

    @trainer.on(Events.ITERATION_COMPLETED(once=warmup + 1))
    def _stop(engine):
        sync(device)
        profiler.__exit__(None, None, None)

    trainer.run()
    events = profiler.key_averages()
    if cuda:  # kernels: the events that ran on the device
        timed = [(e.key, e.count, e.self_device_time_total) for e in events if e.self_device_time_total > 0]
        timed = [t for t in timed if not t[0].startswith("aten::") and not t[0].startswith("cuda")]
    else:  # no kernels on a CPU: the operators' own time
        timed = [(e.key, e.count, e.self_cpu_time_total) for e in events if e.key.startswith("aten::")]
    total_us = sum(t[2] for t in timed) or 1.0
    kinds: dict[str, float] = {}
    for name, _, us in timed:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us / total_us
    kernels = [
        {"name": name[:160], "kind": kernel_kind(name), "calls": calls, "ms": us / 1e3, "share": us / total_us}
        for name, calls, us in sorted(timed, key=lambda t: -t[2])[:top]
    ]
    return {"step_ms": total_us / 1e3, "kernels": kernels, "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


def time_engine(trainer, warmup: int) -> tuple[float, int]:
    from ignite.engine import Events

    marks = {}

    @trainer.on(Events.ITERATION_COMPLETED(once=warmup))
    def _start(engine):
        sync(trainer.state.device)
        marks["start"] = time.perf_counter()

    @trainer.on(Events.COMPLETED)
    def _end(engine):
        sync(trainer.state.device)
        marks["end"] = time.perf_counter()

    trainer.run()
    return marks["end"] - marks["start"], trainer.state.iteration - warmup


def timed_loop(
    s: dict, loader, step: Callable[[Any], None], iterations: int, warmup: int, whole_batch: bool = False
) -> float:
    """Samples (patches) per second of ``step`` over the batches of ``loader`` after ``warmup`` untimed steps.

    ``step`` gets the batch's ``image`` on the device, or with ``whole_batch`` the batch dict itself."""
    device = s["device"]
    done, start = 0, None
    while done < iterations:
        for batch in loader:
            step(batch if whole_batch else batch["image"].to(device))
            done += 1
            if done == warmup:
                sync(device)
                start = time.perf_counter()
            if done >= iterations:
                break
    sync(device)
    samples = (iterations - warmup) * s["batch_size"] * s["num_samples"]
    return samples / (time.perf_counter() - start)


def plain_loader(
    s: dict, data: list[dict], workers: int, keys: Sequence[str] = ("image",), value_range: Sequence[float] = (0, 1)
):
    """The public scripts' data path of the plain loops: a CPU ``CacheDataset`` of whole volumes (``keys``, stacked
    as the channels of ``image``; RAS; each channel's 0.5-99.5 percentiles scaled to ``value_range`` and clipped;
    padded with its low end to the patch) + a ``DataLoader`` of ``s["num_samples"]`` random patches per volume."""
    from monai.data import CacheDataset, DataLoader
    from monai.transforms import (
        Compose,
        ConcatItemsd,
        EnsureChannelFirstd,
        EnsureTyped,
        LoadImaged,
        Orientationd,
        RandSpatialCropSamplesd,
        ScaleIntensityRangePercentilesd,
        SpatialPadd,
    )

    keys = list(keys)
    low, high = (float(v) for v in value_range)
    stack = [] if keys == ["image"] else [ConcatItemsd(keys, "image")]
    transforms = Compose(
        [
            LoadImaged(keys),
            EnsureChannelFirstd(keys),
            *stack,
            Orientationd("image", axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
            ScaleIntensityRangePercentilesd(
                "image", lower=0.5, upper=99.5, b_min=low, b_max=high, clip=True, channel_wise=True
            ),
            SpatialPadd("image", spatial_size=s["patch_size"], value=low),
            EnsureTyped("image", dtype=torch.float32),
            RandSpatialCropSamplesd("image", roi_size=s["patch_size"], num_samples=s["num_samples"], random_size=False),
        ]
    )
    dataset = CacheDataset(data, transform=transforms, cache_rate=1.0, progress=False)
    return DataLoader(
        dataset, batch_size=s["batch_size"], shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )


def alternate(
    s: dict,
    bundle: str,
    plain: Callable | None,
    iterations: int,
    warmup: int,
    repeats: int,
    workers: int,
    make_data: Callable[[Path], Path] | None = None,
    keys: Sequence[str] = ("image",),
    extra: dict | None = None,
    load_data: Callable[[Path], tuple[list[dict], dict]] | None = None,
    profile: bool = False,
) -> dict:
    """Run ``plain`` and the bundle's trainer alternately ``repeats`` times on a demo data set.

    Args:
        plain: the plain loop, or None to time the bundle alone (sizes the plain loop cannot hold).
        make_data: builds the data set in a folder and returns its datalist (default: the MNI demo set of
            :func:`common.demo.images.make_demo_dataset`).
        keys: the datalist keys holding volumes.
        extra: further bundle overrides.
        load_data: maps what ``make_data`` returned to ``(training entries of the plain loop, bundle overrides
            locating the data)``; default: the ``training`` section of the datalist and its folder as
            ``dataset_dir``.
        profile: also profile one more bundle iteration (:func:`kernel_profile`).

    Returns:
        Medians of samples/s of each side and of the bundle's data-wait fraction, their ratio (bundle / plain),
        the largest peak memory, the model FLOPs of one bundle training step, the bundle's achieved TFLOP/s and its
        model FLOPs utilisation (``mfu``: achieved / the device's dense bf16 peak; None where the peak is unknown),
        every run under ``runs`` and, with ``profile``, the kernel profile of one more bundle iteration
        (``profile``, :func:`kernel_profile`).
    """
    from common.data.datalist import load_datalist
    from common.demo.images import make_demo_dataset

    with tempfile.TemporaryDirectory() as tmp:
        built = (make_data or make_demo_dataset)(Path(tmp) / "demo")
        if load_data is None:
            data, located = load_datalist(built, "training", keys=keys), {"dataset_dir": str(built.parent)}
        else:
            data, located = load_data(built)
        runs = {"plain": [], "bundle": [], "data_wait": [], "peak_mem_gib": []}
        for r in range(int(repeats)):
            if plain is not None:
                runs["plain"].append(plain(s, data, iterations + warmup, warmup, workers))
            if s["device"].type == "cuda":  # the bundle's peak memory, not the plain loop's
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(s["device"])
            overrides = {**located, **(extra or {})}
            trainer, monitor = bundle_trainer(s, iterations + warmup, str(Path(tmp) / f"run{r}"), overrides, bundle)
            elapsed, steps = time_engine(trainer, warmup)
            runs["bundle"].append(steps * s["batch_size"] * s["num_samples"] / elapsed)
            runs["data_wait"].append(monitor.history[-1]["data_wait"] if monitor.history else float("nan"))
            runs["peak_mem_gib"].append(monitor.history[-1]["peak_mem_gib"] if monitor.history else float("nan"))
        flops = step_flops(s, bundle, {**located, **(extra or {})}, str(Path(tmp) / "flops"))
        profiled = None
        if profile:  # one more run, not timed: the profiler's own overhead stays out of the rates
            trainer, _ = bundle_trainer(s, warmup + 1, str(Path(tmp) / "profile"), {**located, **(extra or {})}, bundle)
            profiled = kernel_profile(trainer, warmup)
    plain_rate = statistics.median(runs["plain"]) if runs["plain"] else None
    bundle_rate = statistics.median(runs["bundle"])
    achieved = flops * bundle_rate / (s["batch_size"] * s["num_samples"]) / 1e12
    peak = peak_bf16_tflops(s["device"])
    return {
        "plain_samples_per_s": plain_rate,
        "bundle_samples_per_s": bundle_rate,
        "speedup": bundle_rate / plain_rate if plain_rate else None,
        "bundle_data_wait": statistics.median(runs["data_wait"]),
        "bundle_peak_mem_gib": max(runs["peak_mem_gib"]),
        "step_flops": flops,
        "bundle_tflops": achieved,
        "peak_bf16_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "runs": runs,
        **({"profile": profiled} if profiled else {}),
    }


def setup(device: str, num_threads: int | None, baseline_workers: int | None) -> tuple[torch.device, int]:
    """Resolve the device, set torch CPU threads, and pick the plain loop's DataLoader workers."""
    from common.utils import resolve_device

    if num_threads:
        torch.set_num_threads(int(num_threads))
    dev = resolve_device(device)
    workers = baseline_workers if baseline_workers is not None else (4 if dev.type == "cuda" else 0)
    return dev, workers


def bundle_command(bundle: str, run_id: str, configs: Sequence[str], overrides: dict) -> list[str]:
    """``python -m monai.bundle run <run_id>`` of ``bundle``'s ``configs`` (merged in order) with ``overrides``
    written so that the command line reads them back exactly."""
    from common.bundle_tools.launch import format_overrides

    files = [str(config_file(bundle, c)) for c in configs]
    return [
        sys.executable,
        "-m",
        "monai.bundle",
        "run",
        run_id,
        "--config_file",
        files[0] if len(files) == 1 else json.dumps(files),
        *format_overrides(overrides),
    ]


def run_command(cmd: list[str]) -> float:
    """Run one bundle command from the repository root (printed first); returns its wall-clock seconds.

    Raises:
        RuntimeError: with the end of its output when it fails.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


@dataclass(frozen=True)
class BundleRuns:
    """How a benchmark of many bundle commands runs them: ``command(run_id, configs, overrides)`` builds one (e.g.
    :func:`bundle_command` of a bundle), ``run(argv)`` runs it and returns its seconds (:func:`run_command`; a
    test's in-process runner), and every command starts from the overrides ``settings`` (sizes, network, data,
    seed, threads)."""

    run: Callable[[list[str]], float]
    command: Callable[[str, Sequence[str], dict], list[str]]
    settings: dict

    def __call__(self, run_id: str, configs: Sequence[str], overrides: dict) -> float:
        """Run ``run_id`` of ``configs`` with ``settings`` updated by ``overrides``; its seconds."""
        return self.run(self.command(run_id, configs, {**self.settings, **overrides}))


def run_probe(module: str, probe: str, **kwargs: Any) -> dict:
    """Call ``module.probe(**kwargs)`` (a function returning a JSON-able dict) in a fresh Python process started in
    the repository root, so that its peak memory and CUDA state are its own."""
    code = (
        f"import json; from {module} import {probe}; print(json.dumps({probe}(**json.loads({json.dumps(kwargs)!r}))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if result.returncode != 0:
        raise RuntimeError(f"{probe}({kwargs}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])

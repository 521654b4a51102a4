# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Benchmarks of ``vqgan_3d`` (commands of ``scripts/benchmark.py``):

    python scripts/benchmark.py vqgan_throughput                   # vqgan_3d, CPU or GPU
    python scripts/benchmark.py vqgan_throughput --patch_size "[64,64,64]" --n_hiddens 16 --iterations 20
    python scripts/benchmark.py vqgan_memory                       # train.json network, 64^3 and 128^3 patches
    python scripts/benchmark.py vqgan_memory --device cuda --amp bf16 --micro_batch_sizes "[1,2,4]"
    python scripts/benchmark.py vqgan_reconstruction               # reduced volume (128x128x151) on the CPU
    python scripts/benchmark.py vqgan_reconstruction --shape "[512,512,604]" --sw_batch_sizes "[1,2,4]" --device cuda

``vqgan_throughput`` does what ``throughput`` (:mod:`scripts.harness.autoencoder`) does for ``vqgan_3d``: a plain
loop with TATS' VQ-GAN losses (``l1_weight`` x L1 + commitment + 2D/3D hinge generator terms + ``gan_feat_weight``
x feature matching; hinge discriminator loss; Adam betas (0.5, 0.9)) against the bundle's trainer, both
micro-batched alike and adversarial from the first iteration. ``vqgan_memory`` measures peak memory and time of
full ``vqgan_3d`` training steps (the bundle's trainer, both discriminators, adversarial terms on) per patch and
micro-batch size, each in a fresh subprocess. ``vqgan_reconstruction`` times whole-volume sliding-window
reconstruction (the bundle's inference path) and fits a peak-memory model ``a + b x sw_batch_size``, each
measurement in a fresh subprocess. Results are printed as a Markdown table and written as JSON.
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from scripts.harness import tools
from scripts.harness.faults import RUN_SETTINGS, BundleCase

__all__ = [
    "BENCHMARKS",
    "THROUGHPUT",
    "fault_case",
    "reconstruction_probe",
    "vqgan_memory",
    "vqgan_memory_probe",
    "vqgan_reconstruction",
    "vqgan_throughput",
]

BUNDLE = "vqgan_3d"


def _vqgan_network(**overrides) -> dict:
    """VQGAN hyperparameters: the ``vqgan_3d`` ``train.json`` defaults, replaced by the overrides that are not None."""
    config = tools.train_config("vqgan_3d")
    network = {}
    for key in ("n_hiddens", "downsample", "embedding_dim", "n_codes", "num_res_blocks", "norm_num_groups"):
        value = config[key] if overrides.get(key) is None else overrides[key]
        network[key] = [int(v) for v in value] if isinstance(value, (list, tuple)) else int(value)
    return network


def _vqgan_settings(
    patch_size,
    network: dict,
    disc_channels,
    disc_layers,
    batch_size,
    patches_per_volume,
    micro_batch_size,
    device,
    amp=None,
    compile=False,
) -> dict:
    """Settings of a ``vqgan_3d`` throughput run; loss weights, optimizer and clipping come from ``train.json``."""
    from common.utils import default_amp

    config = tools.train_config("vqgan_3d")
    return {
        "patch_size": list(patch_size),
        "network": dict(network),
        "disc_channels": int(disc_channels),
        "disc_layers": int(disc_layers),
        "disc_norm": config["disc_norm"],
        "slice_axis": config["slice_axis"],
        "batch_size": int(batch_size),
        "num_samples": int(patches_per_volume),
        "micro_batch_size": int(micro_batch_size),
        "weights": {
            k: float(config[k]) for k in ("l1_weight", "image_gan_weight", "video_gan_weight", "gan_feat_weight")
        },
        "lr": float(config["lr"]),
        "d_lr": float(config["d_lr"]),
        "betas": tuple(config["betas"]),
        "grad_clip": float(config["grad_clip"]),
        "intensity": config["demo_intensity"],
        "device": device,
        "amp": amp or default_amp(device),
        "compile": bool(compile),
    }


def _vqgan(network: dict, device: torch.device):
    """The bundle's VQGAN (codebook EMA decay, commitment cost and restart threshold from ``train.json``)."""
    from common.vqgan.networks import VQGAN

    config = tools.train_config("vqgan_3d")
    return VQGAN(
        spatial_dims=3,
        in_channels=1,
        out_channels=1,
        decay=config["codebook_decay"],
        commitment_cost=config["commitment_cost"],
        restart_thres=config["restart_thres"],
        no_random_restart=config["no_random_restart"],
        **network,
    ).to(device)


def _vqgan_networks(s: dict):
    """The VQGAN and the bundle's SliceVolumeDiscriminator (2D slice + 3D volume heads) at the run's widths."""
    from common.autoencoder.discriminators import SliceVolumeDiscriminator

    disc = SliceVolumeDiscriminator(
        in_channels=1,
        channels=s["disc_channels"],
        num_layers=s["disc_layers"],
        slice_axis=s["slice_axis"],
        image=s["weights"]["image_gan_weight"] > 0,
        video=s["weights"]["video_gan_weight"] > 0,
        norm=s["disc_norm"],
    )
    return _vqgan(s["network"], s["device"]), disc.to(s["device"])


def _vqgan_overrides(s: dict) -> dict:
    return {
        "patch_size": s["patch_size"],
        **s["network"],
        "disc_channels": s["disc_channels"],
        "disc_layers": s["disc_layers"],
        "batch_size": s["batch_size"],
        "patches_per_volume": s["num_samples"],
        "micro_batch_size": s["micro_batch_size"],
        "discriminator_iter_start": 0,
        # a dataset_dir other than the bundle's own demo_data would select the CT window
        "intensity": s["intensity"],
        "compile": s.get("compile", False),
    }


def _vqgan_plain_loop(s: dict, data: list[dict], iterations: int, warmup: int, workers: int) -> float:
    """A plain PyTorch VQ-GAN loop with TATS' losses (fp32, CPU CacheDataset + DataLoader).

    Generator: ``l1_weight`` x L1 + commitment loss + image/video hinge generator terms ``-mean(D(fake))`` +
    ``gan_feat_weight`` x feature matching (real features without gradients); discriminator: hinge loss on the
    same random slices. Each batch is split into ``micro_batch_size`` chunks whose gradients are accumulated
    with weights ``len(chunk) / len(batch)``, one Adam(betas 0.5, 0.9) step per network per batch, gradient
    norm clipped as in ``train.json``. One generator forward per chunk serves both steps (TATS repeats it).
    """
    from common.autoencoder.adversarial import HingeAdversarialLoss, feature_matching_loss

    loader = tools.plain_loader(s, data, workers)
    vqgan, disc = _vqgan_networks(s)
    opt_g = torch.optim.Adam(vqgan.parameters(), lr=s["lr"], betas=s["betas"])
    opt_d = torch.optim.Adam(disc.parameters(), lr=s["d_lr"], betas=s["betas"])
    hinge = HingeAdversarialLoss()
    w = s["weights"]
    head_weights = {"image": w["image_gan_weight"], "video": w["video_gan_weight"]}
    heads = [h for h, weight in head_weights.items() if weight > 0]

    def step(images: torch.Tensor) -> None:
        # a batch of MetaTensors cannot go through the quantizer (MONAI refuses to slice inconsistent batch metadata)
        images = images.as_tensor() if hasattr(images, "as_tensor") else images
        chunks = images.split(s["micro_batch_size"])
        opt_g.zero_grad(set_to_none=True)
        recons = []
        for x in chunks:
            out = vqgan(x)
            recon = out["pred"]
            views = disc.sample_views(x)
            fake = disc(recon, views)
            with torch.no_grad():
                real = disc(x, views)
            loss_g = (
                w["l1_weight"] * torch.nn.functional.l1_loss(recon, x)
                + out["quantization_loss"]
                + sum(head_weights[h] * hinge(fake[h][-1], target_is_real=True, for_discriminator=False) for h in heads)
                + w["gan_feat_weight"] * sum(feature_matching_loss(fake[h], real[h]) for h in heads)
            )
            (loss_g * (x.shape[0] / images.shape[0])).backward()
            recons.append(recon.detach())
        torch.nn.utils.clip_grad_norm_(vqgan.parameters(), s["grad_clip"])
        opt_g.step()
        opt_d.zero_grad(set_to_none=True)
        for x, recon in zip(chunks, recons):
            views = disc.sample_views(x)
            fake, real = disc(recon, views), disc(x, views)
            loss_d = sum(
                0.5
                * (
                    hinge(fake[h][-1], target_is_real=False, for_discriminator=True)
                    + hinge(real[h][-1], target_is_real=True, for_discriminator=True)
                )
                for h in heads
            )
            (loss_d * (x.shape[0] / images.shape[0])).backward()
        torch.nn.utils.clip_grad_norm_(disc.parameters(), s["grad_clip"])
        opt_d.step()
        loss_g.item()  # a plain loop logs the loss every step

    return tools.timed_loop(s, loader, step, iterations, warmup)


def vqgan_throughput(
    patch_size=(32, 32, 32),
    n_hiddens: int = 8,
    n_codes: int = 512,
    embedding_dim: int = 8,
    disc_channels: int = 16,
    disc_layers: int = 2,
    batch_size: int = 2,
    patches_per_volume: int = 2,
    micro_batch_size: int = 2,
    iterations: int = 50,
    warmup: int = 5,
    repeats: int = 2,
    device: str = "auto",
    amp: str | None = None,
    compile: bool = False,
    profile: bool = False,
    baseline_workers: int | None = None,
    num_threads: int | None = None,
    output: str | None = None,
) -> dict:
    """``vqgan_3d`` trainer vs a plain PyTorch VQ-GAN loop with TATS' losses, alternating in one process.

    Both sides train the same VQGAN + SliceVolumeDiscriminator on ``batch_size`` demo volumes x
    ``patches_per_volume`` random patches per step, micro-batched by ``micro_batch_size``, with the adversarial
    terms on from the first iteration (``discriminator_iter_start`` 0); loss weights, Adam betas, learning rates
    and gradient clipping are ``train.json``'s. The plain side is fp32 with a CPU ``CacheDataset`` +
    ``DataLoader``; the bundle side is ``train#trainer`` with all its handlers, its data path and its default
    precision (bf16 on GPUs). Samples are patches. The other widths (``downsample``, ``norm_num_groups``, ...)
    are ``train.json``'s; ``n_hiddens`` must be a multiple of its ``norm_num_groups`` (8).

    Args:
        patch_size: training patch (divisible by the VQGAN's downsampling, 4 per axis).
        n_hiddens: VQGAN base width (16 in ``train.json``).
        n_codes: codebook size (16384 in ``train.json``).
        embedding_dim: code dimension.
        disc_channels: first-layer width of both discriminators (64 in ``train.json``).
        disc_layers: downsampling layers of each discriminator (3 in ``train.json``).
        batch_size: volumes per step.
        patches_per_volume: random patches drawn per volume.
        micro_batch_size: patches forwarded and back-propagated at once.
        iterations: timed steps per run (after ``warmup``).
        warmup: untimed steps at the start of each run.
        repeats: runs of each side; the median is reported.
        device: ``auto``, ``cpu`` or ``cuda``.
        amp: the bundle's autocast, ``bf16``/``fp16``/``none`` (default: bf16 on GPUs, none on CPUs); the plain
            loop runs in fp32.
        compile: ``torch.compile`` the bundle's networks (its ``compile`` id).
        profile: also profile one bundle iteration with ``torch.profiler`` (its top kernels, in the result's
            ``profile``; :func:`scripts.harness.tools.kernel_profile`).
        baseline_workers: DataLoader workers of the plain loop (default: 4 on GPU machines, 0 on 2-core CPUs).
        num_threads: torch CPU threads.
        output: JSON file for the results.
    """
    dev, workers = tools.setup(device, num_threads, baseline_workers)
    network = _vqgan_network(n_hiddens=n_hiddens, n_codes=n_codes, embedding_dim=embedding_dim)
    s = _vqgan_settings(
        patch_size,
        network,
        disc_channels,
        disc_layers,
        batch_size,
        patches_per_volume,
        micro_batch_size,
        dev,
        amp,
        compile,
    )
    summary = {
        "device": tools.device_name(dev),
        "patch_size": list(patch_size),
        "network": network,
        "discriminator": {"channels": s["disc_channels"], "num_layers": s["disc_layers"], "norm": s["disc_norm"]},
        "batch": f"{batch_size}x{patches_per_volume}",
        "micro_batch_size": s["micro_batch_size"],
        "amp": s["amp"],
        "compile": s["compile"],
        "timed_iterations": iterations,
        **tools.alternate(
            s,
            "vqgan_3d",
            _vqgan_plain_loop,
            iterations,
            warmup,
            repeats,
            workers,
            extra=_vqgan_overrides(s),
            profile=profile,
        ),
    }
    _print_throughput(summary)
    return tools.save_summary(summary, output)


def _network_label(network: dict) -> str:
    return f"{network['n_hiddens']}, {network['n_codes']}x{network['embedding_dim']}"


def _print_throughput(summary: dict) -> None:
    """The report of ``vqgan_throughput``: one Markdown row, the run's sizes and then the measured rates."""
    disc = summary["discriminator"]
    tools.print_throughput(
        summary,
        {
            "device": summary["device"],
            "patch": tools.shape_label(summary["patch_size"]),
            "VQGAN (hiddens, codes x dim)": _network_label(summary["network"]),
            "disc (channels x layers)": f"{disc['channels']}x{disc['num_layers']}",
            "batch": summary["batch"],
            "micro-batch": summary["micro_batch_size"],
            "amp": summary["amp"],
            "compile": summary["compile"],
        },
    )


def _memory_volume_shape(patch_size: Sequence[int], downsample: Sequence[int] | int) -> list[int]:
    """Size of the whole volumes of a training-memory probe's temporary data set: a quarter larger than the patch
    on every axis (so random crops move) and a multiple of the VQGAN's downsampling (so the pipeline's
    ``DivisiblePadd`` adds nothing)."""
    factors = [int(downsample)] * len(patch_size) if isinstance(downsample, int) else [int(d) for d in downsample]
    return [math.ceil(int(p) * 5 / 4 / k) * k for p, k in zip(patch_size, factors)]


def _vqgan_memory_runs(
    patch_sizes: Sequence[Sequence[int]],
    micro_batch_sizes: Sequence[int],
    batch_size: int = 1,
    patches_per_volume: int | None = None,
    extra_runs: Sequence[Sequence] = (),
) -> list[dict]:
    """The runs of ``vqgan_memory``: every patch size x micro-batch size, plus each ``extra_runs`` entry
    ``[patch_size, micro_batch_size, patches_per_volume]``; duplicates dropped, ordered by patch volume, then
    micro-batch, then patches per step.

    A step draws ``batch_size`` volumes x ``patches_per_volume`` patches; ``None`` draws just enough for one
    micro-batch (``ceil(micro_batch_size / batch_size)`` per volume).

    Raises:
        ValueError: for sizes below 1, or a step with fewer patches than its micro-batch (the trainer would
            forward a smaller one than the row says).
    """
    wanted = [(p, m, patches_per_volume) for p in patch_sizes for m in micro_batch_sizes]
    wanted += [(run[0], run[1], run[2]) for run in extra_runs]
    runs: dict[tuple, dict] = {}
    for patch, micro, per_volume in wanted:
        micro = int(micro)
        per_volume = math.ceil(micro / int(batch_size)) if per_volume is None else int(per_volume)
        if min(micro, int(batch_size), per_volume, *(int(p) for p in patch)) < 1:
            raise ValueError(f"sizes must be >= 1, got patch {list(patch)}, micro-batch {micro}, {per_volume}/volume")
        if int(batch_size) * per_volume < micro:
            raise ValueError(f"a step of {batch_size} x {per_volume} patches is smaller than its micro-batch ({micro})")
        run = {
            "patch_size": [int(p) for p in patch],
            "batch_size": int(batch_size),
            "patches_per_volume": per_volume,
            "micro_batch_size": micro,
        }
        runs[(tuple(run["patch_size"]), micro, per_volume)] = run
    return sorted(
        runs.values(),
        key=lambda r: (math.prod(r["patch_size"]), r["micro_batch_size"], r["batch_size"] * r["patches_per_volume"]),
    )


def vqgan_memory_probe(
    patch_size,
    network,
    disc_channels,
    disc_layers,
    batch_size,
    patches_per_volume,
    micro_batch_size,
    device,
    amp,
    steps,
    warmup,
    num_threads,
) -> dict:
    """One measurement (run in a fresh process): ``steps`` full training steps of the ``vqgan_3d`` trainer.

    ``train#trainer`` comes from the bundle's ``train.json`` (see ``bundle_trainer``: every handler, Adam,
    gradient clipping, micro-batching, both discriminators, adversarial and feature-matching terms from the
    first step) on a temporary data set of ``batch_size`` phantom volumes a quarter larger than the patch.
    The peak-memory mark (CUDA allocator peak, or the peak resident set size on the CPU) is restarted just
    before the first step and again after ``warmup`` steps: ``peak_mem_gib`` is the largest over all steps,
    ``steady_peak_mem_gib`` over the steps after the warmup (without the first step's one-off allocations: cuDNN
    autotuning, the optimizers' state), ``start_mem_gib`` the footprint before the first step (process, networks,
    cached volumes). The CPU peak never falls below the parent's peak resident set size, which ``exec``
    hands down and no reset clears (the parent stays small). ``seconds_per_step`` is the median wall time of the
    steps after the warmup, batch loading included.
    """
    from ignite.engine import Events

    from common.demo.images import write_phantom_dataset
    from common.handlers.monitor import peak_memory_gib
    from common.utils import resolve_device

    if num_threads:
        torch.set_num_threads(int(num_threads))
    if not 1 <= int(warmup) < int(steps):
        raise ValueError(f"need 1 <= warmup < steps, got warmup={warmup}, steps={steps}")
    dev = resolve_device(device)
    s = _vqgan_settings(
        patch_size, network, disc_channels, disc_layers, batch_size, patches_per_volume, micro_batch_size, dev
    )
    s["amp"] = amp if dev.type == "cuda" else "none"
    marks: dict[str, float] = {}
    ends: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        shape = _memory_volume_shape(patch_size, network["downsample"])
        write_phantom_dataset(Path(tmp) / "data", n_train=int(batch_size), n_val=0, shape=shape)
        trainer, _ = tools.bundle_trainer(
            s,
            int(steps),
            str(Path(tmp) / "run"),
            {"dataset_dir": str(Path(tmp) / "data"), **_vqgan_overrides(s)},
            "vqgan_3d",
        )

        @trainer.on(Events.STARTED)
        def _start(engine) -> None:
            tools.sync(dev)
            marks["resettable"] = _reset_peak_memory(dev)
            marks["start_mem_gib"] = peak_memory_gib(dev)
            ends.append(time.perf_counter())

        @trainer.on(Events.ITERATION_COMPLETED)
        def _step(engine) -> None:
            tools.sync(dev)
            ends.append(time.perf_counter())
            if engine.state.iteration == int(warmup):
                marks["warmup_peak_mem_gib"] = peak_memory_gib(dev)
                _reset_peak_memory(dev)
            elif engine.state.iteration == int(steps):  # before the final checkpoint is written
                marks["steady_peak_mem_gib"] = peak_memory_gib(dev)

        trainer.run()
    seconds = [b - a for a, b in zip(ends, ends[1:])]
    steady = marks["steady_peak_mem_gib"] if marks["resettable"] else None
    return {
        "patch_size": [int(p) for p in patch_size],
        "volume_shape": shape,
        "batch_size": int(batch_size),
        "patches_per_volume": int(patches_per_volume),
        "patches_per_step": int(batch_size) * int(patches_per_volume),
        "micro_batch_size": trainer.micro_batch_size,
        "adversarial_from_step_1": trainer.adversarial_active(1),
        "feature_matching_weight": trainer.feature_matching_weight,
        "amp": trainer.amp_mode,
        "steps": int(steps),
        "warmup": int(warmup),
        "peak_mem_gib": max(marks["warmup_peak_mem_gib"], marks["steady_peak_mem_gib"]),
        "steady_peak_mem_gib": steady,
        "start_mem_gib": marks["start_mem_gib"],
        "seconds_per_step": statistics.median(seconds[int(warmup) :]),
        "step_seconds": seconds,
        "device": tools.device_name(dev),
    }


def vqgan_memory(
    patch_sizes=((64, 64, 64), (128, 128, 128)),
    micro_batch_sizes=(1, 2),
    batch_size: int = 1,
    patches_per_volume: int | None = None,
    extra_runs=(((64, 64, 64), 1, 4),),
    n_hiddens: int | None = None,
    n_codes: int | None = None,
    embedding_dim: int | None = None,
    disc_channels: int | None = None,
    disc_layers: int | None = None,
    steps: int = 3,
    warmup: int = 1,
    device: str = "auto",
    amp: str = "bf16",
    num_threads: int | None = None,
    output: str | None = None,
) -> dict:
    """Peak memory and time of full ``vqgan_3d`` training steps per patch size and micro-batch size.

    Each run builds ``train#trainer`` from the bundle's ``train.json`` (VQGAN + 2D slice and 3D volume
    discriminators, Adam, adversarial and feature-matching terms from the first step) in a fresh subprocess and
    trains ``steps`` steps (see ``vqgan_memory_probe``): on GPUs the CUDA allocator peak, on the CPU the peak
    resident set size of the process. A step draws ``batch_size`` volumes x ``patches_per_volume`` patches and
    forwards them ``micro_batch_size`` at a time; memory follows the micro-batch, not the patches per step,
    which the default extra run (64^3, micro-batch 1, 4 patches per step) shows next to the 1-patch step.

    Defaults: the network of ``train.json`` (``n_hiddens`` 16, ``downsample`` 4, ``embedding_dim`` 8,
    ``n_codes`` 16384, discriminators 64 channels x 3 layers). On GPUs pass ``--device cuda --amp bf16``.

    Args:
        patch_sizes: training patches to measure.
        micro_batch_sizes: patches forwarded and back-propagated at once.
        batch_size: volumes per step.
        patches_per_volume: patches drawn per volume (``None``: one micro-batch per step).
        extra_runs: further ``[patch_size, micro_batch_size, patches_per_volume]`` runs.
        n_hiddens, n_codes, embedding_dim: VQGAN size (default ``train.json``'s).
        disc_channels, disc_layers: discriminator size (default ``train.json``'s).
        steps: training steps per run.
        warmup: steps before the timed ones (their peak counts in ``peak_mem_gib``; at least 1).
        device: ``auto``, ``cpu`` or ``cuda``.
        amp: autocast on GPUs (``bf16``, ``fp16`` or ``none``); the CPU runs fp32.
        num_threads: torch CPU threads.
        output: JSON file for the results.
    """
    config = tools.train_config("vqgan_3d")
    network = _vqgan_network(n_hiddens=n_hiddens, n_codes=n_codes, embedding_dim=embedding_dim)
    disc = {
        "channels": int(config["disc_channels"] if disc_channels is None else disc_channels),
        "num_layers": int(config["disc_layers"] if disc_layers is None else disc_layers),
    }
    runs = _vqgan_memory_runs(patch_sizes, micro_batch_sizes, batch_size, patches_per_volume, extra_runs)
    probe = {
        "network": network,
        "disc_channels": disc["channels"],
        "disc_layers": disc["num_layers"],
        "device": device,
        "amp": amp,
        "steps": int(steps),
        "warmup": int(warmup),
        "num_threads": num_threads,
    }
    rows = [_measure_memory_run(run, probe) for run in runs]
    _print_memory(rows, device, amp)
    summary = {"network": network, "discriminator": disc, "steps": int(steps), "warmup": int(warmup), "rows": rows}
    return tools.save_summary(summary, output)


def _measure_memory_run(run: dict, probe: dict) -> dict:
    """One row of ``vqgan_memory``: ``vqgan_memory_probe`` in a fresh process; a failed probe (out of memory, for
    example) is a row with its ``error``, so the other rows are kept."""
    label = f"{tools.shape_label(run['patch_size'])}, micro-batch {run['micro_batch_size']}"
    print(f"measuring {label}, {run['batch_size']}x{run['patches_per_volume']} patches/step ...", file=sys.stderr)
    start = time.perf_counter()
    try:
        row = tools.run_probe(__name__, "vqgan_memory_probe", **run, **probe)
    except RuntimeError as exc:
        row = {**run, "patches_per_step": run["batch_size"] * run["patches_per_volume"], "error": str(exc)[-500:]}
    print(f"  done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return row


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _print_memory(rows: list[dict], device: str, amp: str) -> None:
    """The report of ``vqgan_memory``: one Markdown row per run (a failed run shows its last error line)."""
    tools.print_table(
        [
            "device",
            "patch",
            "patches / step",
            "micro-batch",
            "amp",
            "peak mem (GiB)",
            "peak after step 1 (GiB)",
            "before step 1 (GiB)",
            "s / step",
        ],
        [
            [
                r.get("device", device),
                tools.shape_label(r["patch_size"]),
                r["patches_per_step"],
                r["micro_batch_size"],
                r.get("amp", amp),
                *(
                    ["failed: " + r["error"].strip().splitlines()[-1][:80], "-", "-", "-"]
                    if "error" in r
                    else [
                        _gib(r["peak_mem_gib"]),
                        _gib(r["steady_peak_mem_gib"]),
                        _gib(r["start_mem_gib"]),
                        f"{r['seconds_per_step']:.2f}",
                    ]
                ),
            ]
            for r in rows
        ],
    )


def _n_windows(shape: Sequence[int], roi: Sequence[int], overlap: float) -> int:
    """Number of sliding windows MONAI's ``SlidingWindowInferer`` runs over a ``shape`` volume."""
    from monai.data.utils import dense_patch_slices

    padded = [max(int(s), int(r)) for s, r in zip(shape, roi)]
    interval = [max(int(int(r) * (1 - float(overlap))), 1) for r in roi]
    return len(dense_patch_slices(padded, [int(r) for r in roi], interval))


def _volume_bytes(shape: Sequence[int], roi: Sequence[int]) -> dict[str, int]:
    """Whole-volume float32 tensors of a sliding-window reconstruction: the input (plus its padded copy when a
    side is shorter than the window) and the stitched output + count map (``2 x 4 bytes x voxels``)."""
    voxels = math.prod(int(s) for s in shape)
    padded = math.prod(max(int(s), int(r)) for s, r in zip(shape, roi))
    input_bytes = 4 * voxels + (4 * padded if padded != voxels else 0)
    return {"input": input_bytes, "output_buffers": 2 * 4 * padded, "total": input_bytes + 2 * 4 * padded}


STAGES = ("encoder", "quantizer", "decoder")


def _reset_peak_memory(device: torch.device) -> bool:
    """Restart this process's peak-memory mark (CUDA allocator peak; on Linux the peak resident set size, via
    ``/proc/self/clear_refs``). Returns False where it cannot be restarted."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _stage_hooks(modules: dict[str, torch.nn.Module], device: torch.device) -> dict[str, dict[str, float]]:
    """Peak memory and time of the forward calls of each named module, and the peak of everything between them
    (``other``: the sliding-window stitching, and the process itself).

    Forward hooks restart the peak-memory mark around each call, so ``peak_gib`` of a stage is the largest
    footprint of the process while that stage ran (its activations plus whatever else was alive).
    """
    from common.handlers.monitor import peak_memory_gib

    stats = {name: {"peak_gib": 0.0, "seconds": 0.0} for name in [*modules, "other"]}
    started: dict[str, float] = {}

    def before(name: str) -> Callable:
        def hook(module, args) -> None:
            tools.sync(device)
            stats["other"]["peak_gib"] = max(stats["other"]["peak_gib"], peak_memory_gib(device))
            _reset_peak_memory(device)
            started[name] = time.perf_counter()

        return hook

    def after(name: str) -> Callable:
        def hook(module, args, output) -> None:
            tools.sync(device)
            stats[name]["seconds"] += time.perf_counter() - started[name]
            stats[name]["peak_gib"] = max(stats[name]["peak_gib"], peak_memory_gib(device))
            _reset_peak_memory(device)

        return hook

    for name, module in modules.items():
        module.register_forward_pre_hook(before(name))
        module.register_forward_hook(after(name))
    return stats


def reconstruction_probe(
    shape, patch_size, sw_batch_size, overlap, network, device, amp, warmup, repeats, num_threads
) -> dict:
    """One measurement (run in a fresh process): sliding-window reconstruction of a random ``shape`` volume.

    The bundle's inference path: ``SlidingWindowInferer`` (roi ``patch_size``, gaussian blending) around
    ``ReconstructionNetwork(VQGAN)`` in eval mode under ``torch.no_grad`` (bf16 autocast on GPUs with
    ``amp=bf16``). Returns the median time of ``repeats`` runs after ``warmup``, the peak memory (CUDA allocator
    peak, or the process's peak resident set size on the CPU) and the peak and share of time of each VQGAN
    stage (encoder, quantizer, decoder; ``None`` peaks where the peak mark cannot be restarted).
    """
    from monai.inferers import SlidingWindowInferer

    from common.handlers.monitor import peak_memory_gib
    from common.networks.wrappers import ReconstructionNetwork
    from common.utils import autocast, resolve_device

    if num_threads:
        torch.set_num_threads(int(num_threads))
    dev = resolve_device(device)
    amp = amp if dev.type == "cuda" else "none"
    vqgan = _vqgan(network, dev).eval()
    net = ReconstructionNetwork(vqgan)
    inferer = SlidingWindowInferer(roi_size=patch_size, sw_batch_size=sw_batch_size, overlap=overlap, mode="gaussian")
    volume = torch.rand(1, 1, *shape, device=dev)
    stages = _stage_hooks({name: getattr(vqgan, name) for name in STAGES}, dev)
    resettable = _reset_peak_memory(dev)
    times = []
    with torch.no_grad(), autocast(dev, amp):
        for _ in range(int(warmup) + int(repeats)):
            tools.sync(dev)
            start = time.perf_counter()
            inferer(volume, net)  # the output is dropped at once, so runs do not overlap in memory
            tools.sync(dev)
            times.append(time.perf_counter() - start)
    stages["other"]["peak_gib"] = max(stages["other"]["peak_gib"], peak_memory_gib(dev))
    windows = _n_windows(shape, patch_size, overlap)
    seconds = statistics.median(times[int(warmup) :])
    return {
        "shape": list(shape),
        "patch_size": list(patch_size),
        "sw_batch_size": int(sw_batch_size),
        "effective_sw_batch_size": min(int(sw_batch_size), windows),
        "windows": windows,
        "amp": amp,
        "seconds_per_volume": seconds,
        "seconds_per_window": seconds / windows,
        "runs_s": times[int(warmup) :],
        "peak_mem_gib": max(s["peak_gib"] for s in stages.values()) if resettable else peak_memory_gib(dev),
        "stage_peak_mem_gib": {n: stages[n]["peak_gib"] if resettable else None for n in (*STAGES, "other")},
        "stage_time_share": {n: stages[n]["seconds"] / sum(times) for n in STAGES},
        "device": tools.device_name(dev),
    }


def _fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _memory_model(rows: list[dict]) -> dict | None:
    """Fit ``peak = a + b x sw_batch_size`` (effective batch) to the whole-process peaks and to each stage's.

    Returns ``None`` with fewer than two distinct effective batch sizes; stage fits only where stage peaks were
    measured.
    """
    xs = [r["effective_sw_batch_size"] for r in rows]
    if len(set(xs)) < 2:
        return None
    model = {"overall": _fit_line(xs, [r["peak_mem_gib"] for r in rows])}
    if all(r["stage_peak_mem_gib"]["other"] is not None for r in rows):
        for name in (*STAGES, "other"):
            model[name] = _fit_line(xs, [r["stage_peak_mem_gib"][name] for r in rows])
    return model


def _predict_peak(model: dict, sw_batch_size: int, extra_gib: float) -> dict[str, float]:
    """Predicted peak at ``sw_batch_size`` from the overall fit and as the largest of the stage fits, each plus
    ``extra_gib`` (the larger whole-volume tensors of the target volume)."""
    at = {name: a + b * sw_batch_size for name, (a, b) in model.items()}
    stages = [v for name, v in at.items() if name != "overall"]
    return {
        "linear_fit_gib": at["overall"] + extra_gib,
        "max_of_stages_gib": max(stages) + extra_gib if stages else float("nan"),
        **{f"{name}_gib": v for name, v in at.items() if name != "overall"},
    }


def vqgan_reconstruction(
    shape=(128, 128, 151),
    patch_size=None,
    sw_batch_sizes=(1, 2),
    overlap: float = 0.25,
    n_hiddens: int | None = None,
    downsample=None,
    embedding_dim: int | None = None,
    n_codes: int | None = None,
    device: str = "auto",
    amp: str = "bf16",
    warmup: int = 1,
    repeats: int = 2,
    target_shape=(512, 512, 604),
    predict_sw_batch_sizes=(1, 2, 4),
    num_threads: int | None = None,
    output: str | None = None,
) -> dict:
    """Whole-volume VQ-GAN reconstruction time and peak memory through the bundle's sliding-window path.

    Each ``sw_batch_size`` is measured in a fresh subprocess (see ``reconstruction_probe``), which also records
    the peak of each VQGAN stage (encoder, quantizer, decoder). Memory model: ``peak = a + b x sw_batch_size``
    (effective batch: at most the number of windows) fitted to the whole-process peaks, and the same fit per
    stage. The peak for ``target_shape`` is predicted from both, plus the growth of the whole-volume float32
    tensors from ``shape`` to ``target_shape`` (input 4 bytes/voxel; stitched output + count map 2 x 4
    bytes/voxel), the only part of the peak that grows with the volume. The stage model (largest stage) is the
    one to trust: the quantizer's nearest-code search runs in chunks of 16384 latent vectors x ``n_codes``
    float32 distances (1 GiB per temporary at 16384 codes), a peak that does not grow with the batch, so while
    it dominates the whole-process fit is flat and under-predicts larger batches. ``a`` also holds the
    interpreter and libraries (~0.6 GiB on the CPU) and the whole-volume tensors of ``shape``.

    Defaults: the network of ``train.json`` (``n_hiddens`` 16, ``downsample`` 4, ``embedding_dim`` 8,
    ``n_codes`` 16384) with its 128^3 patch on a CT pulmonary angiogram reduced 4x per axis (128x128x151 for
    512x512x604: 2 windows), which a 2-core CPU runs in about 4 minutes; on a GPU pass
    ``--shape "[512,512,604]" --sw_batch_sizes "[1,2,4]"`` (150 windows).

    Args:
        shape: volume size (random data).
        patch_size: sliding-window roi (default ``train.json``'s ``patch_size``).
        sw_batch_sizes: windows per forward pass to measure (at least two distinct values for the fit).
        overlap: window overlap.
        n_hiddens, downsample, embedding_dim, n_codes: VQGAN size (default ``train.json``'s).
        device: ``auto``, ``cpu`` or ``cuda``.
        amp: autocast on GPUs (``bf16``, ``fp16`` or ``none``); the CPU runs fp32.
        warmup: untimed reconstructions before the timed ones (in each subprocess).
        repeats: timed reconstructions; the median is reported.
        target_shape: volume size the memory model predicts for.
        predict_sw_batch_sizes: ``sw_batch_size`` values of the prediction.
        num_threads: torch CPU threads.
        output: JSON file for the results.
    """
    network = _vqgan_network(n_hiddens=n_hiddens, downsample=downsample, embedding_dim=embedding_dim, n_codes=n_codes)
    roi = [int(p) for p in (patch_size or tools.train_config("vqgan_3d")["patch_size"])]
    rows = [
        tools.run_probe(
            __name__,
            "reconstruction_probe",
            shape=[int(v) for v in shape],
            patch_size=roi,
            sw_batch_size=int(sw),
            overlap=float(overlap),
            network=network,
            device=device,
            amp=amp,
            warmup=int(warmup),
            repeats=int(repeats),
            num_threads=num_threads,
        )
        for sw in sw_batch_sizes
    ]
    _print_reconstruction(rows, roi, network)
    summary = {
        "network": network,
        "patch_size": roi,
        "overlap": float(overlap),
        "measurements": rows,
        "volume_bytes": {
            tools.shape_label(shape): _volume_bytes(shape, roi),
            tools.shape_label(target_shape): _volume_bytes(target_shape, roi),
        },
    }
    model = _memory_model(rows)
    if model is None:
        print("\nmemory model: needs two distinct effective sw_batch_size values (at most the number of windows).")
    else:
        summary["fit"] = {name: {"a_gib": a, "b_gib_per_window": b} for name, (a, b) in model.items()}
        summary["predictions"] = _predictions(rows, model, shape, target_shape, roi, overlap, predict_sw_batch_sizes)
        _print_predictions(rows, model, shape, target_shape, roi, summary["predictions"])
    return tools.save_summary(summary, output)


def _print_reconstruction(rows: list[dict], roi: Sequence[int], network: dict) -> None:
    """The measurements of ``vqgan_reconstruction`` as a Markdown table, one row per ``sw_batch_size``."""

    def stage_peaks(r: dict) -> str:
        peaks = r["stage_peak_mem_gib"]
        return " / ".join(_gib(peaks[n]) for n in STAGES)

    tools.print_table(
        [
            "device",
            "volume",
            "patch",
            "VQGAN (hiddens, codes x dim)",
            "amp",
            "sw batch",
            "windows",
            "time / volume (s)",
            "s / window",
            "time in encoder / quantizer / decoder",
            "peak mem (GiB)",
            "peak in encoder / quantizer / decoder (GiB)",
        ],
        [
            [
                r["device"],
                tools.shape_label(r["shape"]),
                tools.shape_label(roi),
                _network_label(network),
                r["amp"],
                r["sw_batch_size"]
                if r["sw_batch_size"] == r["effective_sw_batch_size"]
                else f"{r['sw_batch_size']} (runs as {r['effective_sw_batch_size']})",
                r["windows"],
                f"{r['seconds_per_volume']:.2f}",
                f"{r['seconds_per_window']:.2f}",
                " / ".join(f"{r['stage_time_share'][n]:.0%}" for n in STAGES),
                f"{r['peak_mem_gib']:.2f}",
                stage_peaks(r),
            ]
            for r in rows
        ],
    )


def _predictions(
    rows: list[dict],
    model: dict,
    shape: Sequence[int],
    target_shape: Sequence[int],
    roi: Sequence[int],
    overlap: float,
    sw_batch_sizes: Sequence[int],
) -> dict:
    """Peak memory and time of a ``target_shape`` reconstruction per ``sw_batch_size``, from the memory model plus
    the growth of the whole-volume tensors, and the measured time per window at the nearest measured batch."""
    extra = (_volume_bytes(target_shape, roi)["total"] - _volume_bytes(shape, roi)["total"]) / tools.GIB
    windows = _n_windows(target_shape, roi, overlap)
    predictions = []
    for sw in sw_batch_sizes:
        effective = min(int(sw), windows)
        nearest = min(rows, key=lambda r: abs(r["effective_sw_batch_size"] - effective))
        predictions.append(
            {
                "sw_batch_size": int(sw),
                **_predict_peak(model, effective, extra),
                "seconds_per_volume": nearest["seconds_per_window"] * windows,
                "seconds_per_window_from_sw_batch_size": nearest["sw_batch_size"],
            }
        )
    return {"shape": list(target_shape), "windows": windows, "rows": predictions}


def _print_predictions(
    rows: list[dict],
    model: dict,
    shape: Sequence[int],
    target_shape: Sequence[int],
    roi: Sequence[int],
    predictions: dict,
) -> None:
    """The memory model of ``vqgan_reconstruction`` in one line and its predictions as a Markdown table."""
    measured_label, measured = tools.shape_label(shape), _volume_bytes(shape, roi)
    target_label, target = tools.shape_label(target_shape), _volume_bytes(target_shape, roi)
    fits = ", ".join(f"{name} {a:.2f} + {b:.2f} x sw" for name, (a, b) in model.items())
    print(
        f"\nmemory model ({rows[0]['device']}, {rows[0]['amp']}, {measured_label}, GiB): {fits}. "
        f"Whole-volume float32 tensors: {measured_label} input {measured['input'] / tools.GIB:.2f} + "
        f"output/count {measured['output_buffers'] / tools.GIB:.2f} GiB; {target_label} input "
        f"{target['input'] / tools.GIB:.2f} + output/count {target['output_buffers'] / tools.GIB:.2f} GiB."
    )
    tools.print_table(
        [
            "volume",
            "windows",
            "sw batch",
            "predicted peak, linear fit (GiB)",
            "predicted peak, largest stage (GiB)",
            "output + count buffers (GiB)",
            "est. time / volume (s)",
        ],
        [
            [
                target_label,
                predictions["windows"],
                p["sw_batch_size"],
                f"{p['linear_fit_gib']:.2f}",
                f"{p['max_of_stages_gib']:.2f}",
                f"{target['output_buffers'] / tools.GIB:.2f}",
                f"{p['seconds_per_volume']:.0f} (s/window at sw {p['seconds_per_window_from_sw_batch_size']})",
            ]
            for p in predictions["rows"]
        ],
    )


def fault_case(root: Path, seed: int) -> BundleCase:
    """The small ``vqgan_3d`` job of the fault tests (:func:`scripts.harness.faults.make_case`): CT phantoms in HU,
    2 cases (4 for 2 processes), 4 epochs, the discriminator from iteration 3."""
    from common.demo.images import write_phantom_dataset

    write_phantom_dataset(root, n_train=4, n_val=2, shape=(24, 24, 22), kind="ct", spacing=(1.5, 1.5, 2.0), seed=seed)
    args = {"dataset_dir": str(root), "max_cases": 2, "max_epochs": 4, "val_interval": 4}
    args["discriminator_iter_start"] = 3
    return BundleCase(
        BUNDLE,
        ["train.json", "tiny.json"],
        {**args, **RUN_SETTINGS, "seed": seed},
        weights=("vqgan", "discriminator"),
        extra={"max_cases": 4},
    )


BENCHMARKS = {
    "vqgan_memory": vqgan_memory,
    "vqgan_reconstruction": vqgan_reconstruction,
    "vqgan_throughput": vqgan_throughput,
}

# the campaign's throughput rows (scripts/harness/campaign.py): (row name, benchmark, GPU settings, tiny settings)
THROUGHPUT = (
    (
        BUNDLE,
        "vqgan_throughput",
        {"patch_size": [128, 128, 128], "n_hiddens": 16, "n_codes": 16384, "disc_channels": 64, "disc_layers": 3}
        | {"batch_size": 1, "patches_per_volume": 2, "micro_batch_size": 2},
        {"patch_size": [32, 32, 32], "n_hiddens": 8, "n_codes": 64, "disc_channels": 8, "disc_layers": 2}
        | {"batch_size": 1, "patches_per_volume": 1, "micro_batch_size": 1},
    ),
)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Benchmarks of ``xray2ct_cascade`` (commands of ``scripts/benchmark.py``):

    python scripts/benchmark.py xray_throughput                    # stage 1: bundle trainer vs a plain PyTorch loop
    python scripts/benchmark.py xray_throughput --stage 2          # stage 2 (conditioned on a degraded stage 1)
    python scripts/benchmark.py xray_throughput --device cuda --stage 3 --amp bf16 --compile True
    python scripts/benchmark.py xray_quality --iterations 300      # equal budgets: diffusion vs direct vs baseline
    python scripts/benchmark.py xray_quality --num_threads 2 --output /tmp/xray_quality.json
    python scripts/benchmark.py xray_quality --budgets "[300,1200,2400]" --plot budgets.png  # over budgets
    python scripts/benchmark.py xray_memory --stages "[1,2]"      # peak memory of one training step per stage

``xray_throughput`` alternates, in one process, (a) a plain loop written as public X-ray -> CT scripts are (CPU
``CacheDataset`` of the same transforms + ``DataLoader``, fp32, the same :class:`common.xray2ct.networks.XrayCTDenoiser`
built from the same settings, the same v-prediction MSE + projection loss, AdamW with gradient clipping, no EMA and
no handlers; from stage 2 on the same degraded stand-in for the previous stage) and (b) the bundle's
``train#trainer`` with all its handlers, for one stage. It reports samples/s of each, their ratio, the bundle's
data-wait fraction and peak memory. From stage 2 on the bundle's config needs the earlier stages' weights (it
validates on their real output): the benchmark saves randomly initialised ones, turns validation off and does not
initialise from them (``init_from_previous`` false), which changes nothing in a training step.

``xray_quality`` trains the bundle through its command line (a subprocess per command) in each mode, stage 1 then
stage 2 with the same number of iterations (``max_epochs`` 1 x ``epoch_length``), sets each stage's ``model.pt`` to
its final EMA weights (no validation during training), evaluates every stage with ``evaluate.json`` (stage ``k``
runs the cascade of stages ``1..k``) and also evaluates the untrained back-projection baseline; it records PSNR,
SSIM, MS-SSIM, projection error and training time per mode and stage.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from common.bundle_tools.registry import describe
from common.utils import plain_tensor
from scripts.harness import tools
from scripts.harness.faults import RUN_SETTINGS, BundleCase

__all__ = [
    "BENCHMARKS",
    "CAMPAIGN_TINY",
    "THROUGHPUT",
    "fault_case",
    "xray_consistency",
    "xray_memory",
    "xray_quality",
    "xray_throughput",
    "xray_uncertainty",
]

BUNDLE = "xray2ct_cascade"

#: the network keys of ``train.json``'s ``network_settings`` that the benchmarks set
NETWORK_KEYS = (
    "unet_channels",
    "attention_levels",
    "num_res_blocks",
    "norm_num_groups",
    "num_head_channels",
    "transformer_num_layers",
    "vit_patch_size",
    "vit_hidden_size",
    "vit_mlp_dim",
    "vit_layers",
    "vit_heads",
)
#: the small network of CPU runs: the CPU demo's (``scripts/demo.py``; ``train.json``'s is used on GPUs)
CPU_NETWORK = {k: v for k, v in describe(BUNDLE).demo["cpu"].items() if k in NETWORK_KEYS}
CHEST_FOV_MM = 350.0  # the field of view of the chest phantoms of the small jobs
CPU_STAGE_SIZES = [[32, 32, 32], [64, 64, 64]]
CPU_VIEW_SIZE = [64, 64]
#: (iterations, warmup, repeats) of ``xray_throughput`` on CPUs per stage (about 2-3 minutes on 2 cores), and on GPUs
CPU_THROUGHPUT_RUNS = {1: (8, 2, 2), 2: (3, 1, 1)}
GPU_THROUGHPUT_RUNS = (30, 5, 2)
#: the training iterations per stage of ``xray_quality``
CPU_QUALITY_ITERATIONS, GPU_QUALITY_ITERATIONS = 100, 1000
#: the overrides that ``xray_quality`` sets itself
QUALITY_RESERVED = ("stage", "mode", "outputs_root", "output_dir", "max_epochs", "epoch_length", "resume")


def _defaults(device: torch.device, **given) -> dict:
    """Stage sizes, view size and network of a run on ``device``: ``train.json``'s on GPUs, the small CPU ones
    otherwise, each replaced by the values in ``given`` that are not None."""
    config = tools.train_config(BUNDLE)
    network = {k: config[k] for k in NETWORK_KEYS}
    if device.type == "cuda":
        settings = {"stage_sizes": config["stage_sizes"], "view_size": config["view_size"], **network}
    else:
        settings = {"stage_sizes": CPU_STAGE_SIZES, "view_size": CPU_VIEW_SIZE, **network, **CPU_NETWORK}
    settings.update({k: v for k, v in given.items() if v is not None})
    settings["attention_levels"] = [bool(a) for a in settings["attention_levels"]]
    settings["stage_sizes"] = [[int(v) for v in size] for size in settings["stage_sizes"]]
    return settings


def _with_stage_size(sizes: list[list[int]], stage: int, size: Sequence[int]) -> list[list[int]]:
    """``sizes`` with ``size`` as stage ``stage``'s, earlier stages capped at it and later ones raised to it (stage
    sizes must not shrink)."""
    size = [int(v) for v in size]
    out = []
    for k, current in enumerate(sizes, start=1):
        if k == stage:
            out.append(size)
        else:
            pick = min if k < stage else max
            out.append([pick(a, b) for a, b in zip(current, size)])
    return out


def _projector(view_size: Sequence[int]):
    """The bundle's projector (``train.json``'s geometry and window) at ``view_size``."""
    from common.xray2ct.drr import DRRProjector

    config = tools.train_config(BUNDLE)
    return DRRProjector(
        hu_window=config["hu_window"],
        fov_mm=config["fov_mm"],
        views=config["views"],
        view_size=[int(v) for v in view_size],
        mu_water=config["mu_water"],
        geometry=config["geometry"],
        source_to_isocenter_mm=config["source_to_isocenter_mm"],
        source_to_detector_mm=config["source_to_detector_mm"],
    )


def _xray_plain_loop(s: dict, data: list[dict], iterations: int, warmup: int, workers: int) -> float:
    """The plain loop: CPU ``CacheDataset`` of the stage's transforms (the bundle's ``train#deterministic`` list)
    + ``DataLoader``, fp32, v-prediction MSE plus the alpha-bar weighted projection loss, AdamW with gradient
    clipping; no EMA, no handlers."""
    from monai.bundle import ConfigParser
    from monai.data import CacheDataset, DataLoader
    from monai.transforms import Compose, EnsureTyped

    from common.diffusion.schedule import DiffusionSchedule, fast_ddpm_grid
    from common.xray2ct.losses import ProjectionLoss
    from common.xray2ct.networks import XrayCTDenoiser, degrade_to_previous

    config = tools.train_config(BUNDLE)
    projector = _projector(s["view_size"])
    parser = ConfigParser()
    parser.read_config(str(tools.config_file(BUNDLE)))
    parser.update(
        {
            "bundle_root": str(tools.config_file(BUNDLE).parent.parent),
            "stage": s["stage"],
            "stage_sizes": s["stage_sizes"],
            "view_size": s["view_size"],
        }
    )
    steps = parser.get_parsed_content("train#deterministic")
    transforms = Compose([*steps, EnsureTyped(["image", "xray"], dtype=torch.float32, track_meta=True)])
    dataset = CacheDataset(data, transform=transforms, cache_rate=1.0, progress=False)
    loader = DataLoader(
        dataset, batch_size=s["batch_size"], shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )
    device = s["device"]
    net = XrayCTDenoiser(projector, with_previous=s["previous_size"] is not None, **s["network"]).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=s["lr"], weight_decay=config["weight_decay"])
    schedule = DiffusionSchedule(config["num_train_timesteps"], config["beta_schedule"])
    grid = fast_ddpm_grid(config["grid"], config["num_grid_steps"], config["num_train_timesteps"])
    projection_loss = ProjectionLoss(projector)
    physics_weight, grad_clip = float(config["physics_weight"]), float(config["grad_clip"])

    def step(batch: dict) -> None:
        x0 = plain_tensor(batch["image"]).to(device, non_blocking=True).float()
        xray = plain_tensor(batch["xray"]).to(device, non_blocking=True).float()
        previous = None
        if s["previous_size"] is not None:
            previous = degrade_to_previous(x0, s["previous_size"], config["previous_noise"])
        t = grid[torch.randint(0, len(grid), (x0.shape[0],))].to(device)
        noise = torch.randn_like(x0)
        x_t = schedule.add_noise(x0, noise, t)
        target = schedule.velocity(x0, noise, t)
        optimizer.zero_grad(set_to_none=True)
        prediction = net(x_t, t, xray, previous)
        x0_hat = schedule.split(x_t, prediction, t, "v_prediction")[0].float()
        weights = schedule.alpha_bar(t, x0).reshape(-1).float()
        loss = torch.nn.functional.mse_loss(prediction, target)
        loss = loss + physics_weight * (weights * projection_loss(x0_hat, xray)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), grad_clip)
        optimizer.step()

    return tools.timed_loop(s, loader, step, iterations, warmup, whole_batch=True)


def _random_previous_stages(
    folder: Path, stage: int, view_size: Sequence[int], network: dict, seed: int = 0
) -> list[str]:
    """Randomly initialised denoisers of stages ``1 .. stage - 1`` (weights seeded by ``seed``) saved as state dicts
    (the bundle's config loads the earlier stages for validation, which the throughput runs never reach)."""
    from common.xray2ct.networks import XrayCTDenoiser

    projector = _projector(view_size)
    paths = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        for k in range(1, int(stage)):
            path = folder / f"stage{k}_random.pt"
            torch.save(XrayCTDenoiser(projector, with_previous=k > 1, **network).state_dict(), path)
            paths.append(str(path))
    return paths


def xray_throughput(
    stage: int = 1,
    device: str = "auto",
    iterations: int | None = None,
    warmup: int | None = None,
    repeats: int | None = None,
    batch_size: int | None = None,
    volume_size=None,
    view_size=None,
    stage_sizes=None,
    n_cases: int = 8,
    amp: str | None = None,
    compile: bool = False,
    profile: bool = False,
    gradient_checkpointing: bool = False,
    plain: bool = True,
    num_threads: int | None = None,
    baseline_workers: int | None = None,
    seed: int = 0,
    output: str | None = None,
    **network,
) -> dict:
    """``xray2ct_cascade`` trainer of one stage vs a plain loop, same network, batch, data and loss, alternating in
    one process, on chest CT phantoms.

    Defaults: on GPUs ``train.json``'s network, stage sizes (64^3, 128^3, 256^3) and view size (256^2); on CPUs a
    small network (U-Net ``[16, 32, 64]``, ViT 64 wide, 2 layers), stages of 32^3 and 64^3 and 64^2 views, with
    few enough iterations to finish in about 2-3 minutes on 2 cores.

    Args:
        stage: the stage to train (from 2 on, conditioned on the previous stage's degraded stand-in).
        device: ``auto``, ``cpu`` or ``cuda``.
        iterations: timed steps per run (after ``warmup``); default 30 on GPUs, 8 (stage 1) or 3 on CPUs.
        warmup: untimed steps at the start of each run (``torch.compile`` compiles here); default 5 on GPUs, 2
            (stage 1) or 1 on CPUs.
        repeats: runs of each side, the median is reported; default 2, 1 on CPUs from stage 2 on.
        batch_size: volumes per step (default ``train.json``'s ``stage_batch_size`` of the stage).
        volume_size: the stage's volume size (default: its entry of the stage sizes; earlier stages are capped at
            it, later ones raised to it).
        view_size: ``(H, W)`` of the X-rays.
        stage_sizes: the volume size of every stage (replaces the device's default list).
        n_cases: training phantoms (one more for the validation set the bundle builds).
        amp: the bundle's autocast, ``bf16``/``fp16``/``none`` (default: bf16 on GPUs, none on CPUs); the plain
            loop always runs in fp32, as the public scripts do.
        compile: ``torch.compile`` the bundle's denoiser (its ``compile`` id).
        profile: also profile one bundle iteration with ``torch.profiler`` (its top kernels, in the result's
            ``profile``; :func:`scripts.harness.tools.kernel_profile`).
        gradient_checkpointing: the bundle's ``gradient_checkpointing`` (recompute the U-Net blocks in backward).
        plain: run the plain loop too; ``False`` times the bundle alone (e.g. stage 3 at 256^3, which the fp32
            plain loop without checkpointing does not fit).
        num_threads: torch CPU threads.
        baseline_workers: DataLoader workers of the plain loop (default: 4 on GPU machines, 0 on CPUs).
        seed: seed of the phantoms, the earlier stages' random weights, the plain loop and the bundle's runs.
        output: JSON file for the results.
        network: the network's ``train.json`` ids (:data:`NETWORK_KEYS`: ``unet_channels``, ``attention_levels``,
            ``norm_num_groups``, ``num_head_channels``, ``vit_patch_size``, ``vit_hidden_size``, ``vit_mlp_dim``,
            ``vit_layers``, ``vit_heads``, ...; the device's default network by default).

    The phantoms are written at the stage's volume size; both sides resample them to the last stage's size
    (``source_size``), make the X-rays there and average the CT down to the stage's size, as the bundle does.

    Raises:
        ValueError: for a keyword that is not an argument or a network id, or a stage without a size.
    """
    from common.demo.images import make_xray2ct_demo

    unknown = sorted(set(network) - set(NETWORK_KEYS))
    if unknown:
        raise ValueError(f"xray_throughput takes no {unknown}; its network ids are {list(NETWORK_KEYS)}.")
    dev, workers = tools.setup(device, num_threads, baseline_workers)
    torch.manual_seed(int(seed))
    settings = _defaults(dev, stage_sizes=stage_sizes, view_size=view_size, **network)
    s = _stage_settings(dev, int(stage), settings, volume_size, batch_size, amp)
    iterations, warmup, repeats = _throughput_runs(dev, s["stage"], iterations, warmup, repeats)
    network = {k: settings[k] for k in NETWORK_KEYS}
    fov = tools.train_config(BUNDLE)["fov_mm"]
    make_data = functools.partial(
        make_xray2ct_demo, n_train=int(n_cases), n_val=1, shape=s["volume_size"], fov_mm=fov, seed=int(seed)
    )
    with tempfile.TemporaryDirectory() as tmp:
        extra = _throughput_overrides(s, network, Path(tmp), compile, gradient_checkpointing, int(seed))
        plain_loop = _xray_plain_loop if plain else None
        args = (iterations, warmup, repeats, workers, make_data, ("image",), extra)
        result = tools.alternate(s, BUNDLE, plain_loop, *args, profile=profile)
    summary = {
        "device": tools.device_name(dev),
        **{k: s[k] for k in ("stage", "volume_size", "previous_size", "source_size", "view_size")},
        "network": network,
        "batch": s["batch_size"],
        "amp": s["amp"],
        "compile": bool(compile),
        "gradient_checkpointing": bool(gradient_checkpointing),
        "timed_iterations": iterations,
        "warmup": warmup,
        "repeats": repeats,
        **result,
    }
    _print_throughput(summary)
    return tools.save_summary(summary, output)


def _throughput_runs(
    device: torch.device, stage: int, iterations: int | None, warmup: int | None, repeats: int | None
) -> tuple[int, int, int]:
    """The timed iterations, warm-up steps and repeats of ``xray_throughput``: the device's and stage's defaults
    (:data:`CPU_THROUGHPUT_RUNS`, :data:`GPU_THROUGHPUT_RUNS`) where not given."""
    runs = GPU_THROUGHPUT_RUNS if device.type == "cuda" else CPU_THROUGHPUT_RUNS.get(stage, CPU_THROUGHPUT_RUNS[2])
    given = (iterations, warmup, repeats)
    return tuple(default if value is None else int(value) for value, default in zip(given, runs))


def _stage_settings(
    device: torch.device, stage: int, settings: dict, volume_size, batch_size: int | None, amp: str | None
) -> dict:
    """The settings both sides of ``xray_throughput`` train ``stage`` with: sizes (``volume_size`` replacing the
    stage's), ``train.json``'s batch and learning rate of the stage, the network as ``train.json`` builds it."""
    from common.utils import default_amp
    from common.xray2ct.engines import stage_value

    sizes = [list(size) for size in settings["stage_sizes"]]
    stage_value(sizes, stage, "stage_sizes")  # raises for a stage without a size
    if volume_size is not None:
        sizes = _with_stage_size(sizes, stage, volume_size)
    config = tools.train_config(BUNDLE)
    per_stage = config["stage_batch_size"]
    batch = int(batch_size or stage_value(per_stage, min(stage, len(per_stage)), "stage_batch_size"))
    lr = float(stage_value(config["stage_lr"], min(stage, len(config["stage_lr"])), "stage_lr"))
    network = {k: settings[k] for k in NETWORK_KEYS}
    return {
        "device": device,
        "amp": amp or default_amp(device),
        "batch_size": batch,
        "num_samples": 1,
        "volume_size": sizes[stage - 1],
        "source_size": sizes[-1],  # train.json's: the X-rays of every stage are made from the CT at the last size
        "stage": stage,
        "stage_sizes": sizes,
        "previous_size": sizes[stage - 2] if stage > 1 else None,
        "view_size": [int(v) for v in settings["view_size"]],
        "network": {**network, "use_flash_attention": device.type == "cuda"},  # train.json's choice
        "lr": lr,
    }


def _throughput_overrides(
    s: dict, network: dict, folder: Path, compile: bool, gradient_checkpointing: bool, seed: int
) -> dict:
    """The bundle side's overrides of ``xray_throughput``: the plain side's settings, validation off and the
    earlier stages' weights random (saved under ``folder``), not used to initialise the stage."""
    previous = _random_previous_stages(folder, s["stage"], s["view_size"], s["network"], seed)
    return {
        **network,
        **{k: s[k] for k in ("stage", "stage_sizes", "view_size", "lr")},
        "mode": "diffusion",
        "batch_size": s["batch_size"],
        "lr_scaling": "none",
        "compile": bool(compile),
        "gradient_checkpointing": bool(gradient_checkpointing),
        "output_dir": str(folder),
        "init_from_previous": False,
        "previous_ckpts": previous or None,
        "seed": seed,
    }


def _print_throughput(summary: dict) -> None:
    """The report of ``xray_throughput``: one Markdown row, the run's sizes and then the measured rates."""
    views = len(tools.train_config(BUNDLE)["views"])
    leading = {
        "device": summary["device"],
        "stage": summary["stage"],
        "volume": tools.shape_label(summary["volume_size"]),
    }
    leading |= {"views": f"{views}x{tools.shape_label(summary['view_size'])}"}
    leading |= {"U-Net channels": summary["network"]["unet_channels"], "batch": summary["batch"]}
    tools.print_throughput(summary, leading | {"amp": summary["amp"], "compile": summary["compile"]})


def _bundle_cmd(run_id: str, configs: Sequence[str], overrides: dict) -> list[str]:
    return tools.bundle_command(BUNDLE, run_id, configs, overrides)


_run = tools.run_command  # a module attribute, so tests can run the commands in-process


def _final_ema_as_model(models: Path) -> int:
    """Write the final EMA weights of ``last.pt`` as the stage's ``model.pt`` (what the next stage and evaluation
    load); returns the iteration ``last.pt`` was saved at."""
    from common.checkpoint_io import load_checkpoint, save_checkpoint

    last = load_checkpoint(models / "last.pt")
    save_checkpoint({k: v for k, v in last["ema"].items() if k != "n_averaged"}, models / "model.pt")
    return int(last["trainer"]["iteration"])


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def xray_quality(
    device: str = "auto",
    iterations: int | None = None,
    stages: int = 2,
    modes=("diffusion", "direct"),
    output: str | None = "xray_quality.json",
    work_dir: str | None = None,
    seed: int = 0,
    budgets: Sequence[int] | None = None,
    methods: Sequence[str] = ("direct", "diffusion", "residual"),
    num_samples: int = 4,
    guidance_scale: float = 1.0,
    refine_steps: int = 5,
    conditions: Sequence[str] | None = None,
    parallel: int = 2,
    plot: str | None = None,
    **overrides,
) -> dict:
    """Equal training budgets: for each mode, stage 1 then stage 2 (...) trained through the bundle's command line
    with ``iterations`` iterations each (same seed, data, network, batch), every stage evaluated with
    ``evaluate.json`` on the validation phantoms, plus the untrained ``backprojection`` baseline.

    Data: the bundle's own demo (24 training + 6 validation chest phantoms at 64^3, built under
    ``bundles/xray2ct_cascade/demo_data`` on first use) unless ``--dataset_dir`` is given. Defaults: on CPUs the
    small network and sizes of ``xray_throughput`` (stages of 32^3 and 64^3, 64^2 views); on GPUs ``train.json``'s
    network, views (256^2) and the first ``stages`` of its stage sizes (64^3, 128^3, 256^3), with the X-rays of every
    stage made from the CT at the last default size (``source_size``: 64^3 on CPUs, 256^3 on GPUs) unless
    ``stage_sizes`` or ``source_size`` is given.

    Args:
        device: ``auto`` (the bundle's choice), ``cpu`` or ``cuda``.
        iterations: training iterations per stage and mode (default 1000 on GPUs, 100 on CPUs).
        stages: the stages to train and evaluate (1 .. stages).
        modes: the trained modes, ``diffusion`` and/or ``direct``; ``backprojection`` is always evaluated.
        output: JSON file for the results, rewritten after each mode.
        work_dir: where the runs are kept, ``<work_dir>/<mode>`` being each mode's ``output_dir`` (default: a new
            temporary folder, printed).
        seed: the bundle's ``seed`` in every training and evaluation command.
        budgets: with a list of stage-1 iterations (``"[300,1200,2400]"``), the comparison over budgets of
            :mod:`scripts.harness.xray_budgets` instead (``iterations`` and ``modes`` are then not used): on CPUs at
            :data:`scripts.harness.xray_budgets.CPU_BUDGET_SETTINGS` sizes, one thread per command.
        methods: the methods of a budget comparison (``direct``, ``diffusion``, ``residual``, ``min_snr``).
        num_samples: samples per case of the stochastic methods in a budget comparison.
        guidance_scale: the projection-guidance weight of the guided evaluations of a budget comparison, and the
            weight of each refinement step.
        refine_steps: the data-consistency steps of the refined evaluations of a budget comparison (every method
            gets them: ``direct_refined`` is the regressor's output after them).
        conditions: the realistic X-ray conditions of a budget comparison (default: all of
            :data:`scripts.harness.xray_budgets.CONDITIONS`; ``"[]"`` for none).
        parallel: commands run at a time in a budget comparison.
        plot: PNG file of a budget comparison's curves.
        overrides: bundle overrides given to every training and evaluation command (``--num_threads 2``,
            ``--dataset_dir ...``, ``--unet_channels "[32,64,128]"``, ...), applied over the defaults.

    Raises:
        ValueError: for an unknown mode, ``stages``/``iterations`` below 1, or an override the benchmark sets itself.
    """
    if budgets is not None:
        comparison = (num_samples, guidance_scale, refine_steps, conditions, parallel, plot)
        return _quality_budgets(device, stages, output, work_dir, seed, budgets, methods, *comparison, overrides)
    from common.utils import resolve_device

    modes = _quality_modes(modes)
    reserved = sorted(set(overrides) & set(QUALITY_RESERVED))
    if reserved:
        raise ValueError(f"xray_quality sets {reserved} itself for every run; leave them out of the overrides.")
    stages = int(stages)
    dev = resolve_device(device)
    if iterations is None:
        iterations = GPU_QUALITY_ITERATIONS if dev.type == "cuda" else CPU_QUALITY_ITERATIONS
    iterations = int(iterations)
    if stages < 1 or iterations < 1:
        raise ValueError(f"stages and iterations must be >= 1, got stages={stages}, iterations={iterations}.")
    settings = _quality_settings(dev, device, stages, overrides, int(seed))
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="xray_quality_"))
    print(f"runs under {work}", flush=True)
    summary: dict = {
        "device": tools.device_name(dev),
        "iterations": iterations,
        "stages": stages,
        "work_dir": str(work),
        "settings": settings,
        "modes": {},
    }
    for mode in [*modes, "backprojection"]:
        summary["modes"][mode] = {
            f"stage{k}": _quality_stage(settings, mode, k, work / mode, iterations) for k in range(1, stages + 1)
        }
        tools.save_summary(summary, output)  # after each mode: a run cut short keeps what it measured
    _print_quality(summary)
    return summary


def _quality_modes(modes) -> list[str]:
    """The trained modes of ``xray_quality``: distinct modes of the bundle, at least one."""
    from common.xray2ct.networks import MODES

    modes = [modes] if isinstance(modes, str) else list(modes)
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(
            f"modes must be a non-empty list of distinct modes out of {MODES} (the 'backprojection' baseline, which "
            f"has nothing to train, is always evaluated), got {modes!r}."
        )
    return modes


def _quality_settings(dev: torch.device, device: str, stages: int, overrides: dict, seed: int) -> dict:
    """The overrides every command of ``xray_quality`` gets: the device's defaults (the first ``stages`` stage
    sizes), the user's ``overrides`` over them, the seed."""
    defaults = _defaults(dev)
    settings = {**defaults, **overrides, "seed": seed}
    if not isinstance(settings["stage_sizes"], (list, tuple)) or len(settings["stage_sizes"]) < stages:
        raise ValueError(f"{stages} stages need {stages} stage sizes, got {settings['stage_sizes']!r}.")
    settings["stage_sizes"] = [list(size) for size in settings["stage_sizes"][:stages]]
    if "stage_sizes" not in overrides and "source_size" not in overrides:
        # as in train.json, the X-rays of every stage are made from the CT at the last default stage's size
        settings["source_size"] = defaults["stage_sizes"][-1]
    if device != "auto":
        settings["device"] = device
    return settings


def _quality_stage(settings: dict, mode: str, k: int, root: Path, iterations: int) -> dict:
    """Stage ``k`` of ``mode`` in ``xray_quality``: trained for ``iterations`` (nothing for the back-projection
    baseline) with its final EMA weights as its model, then evaluated once with ``evaluate.json``."""
    run = {**settings, "stage": k, "mode": mode, "output_dir": str(root)}
    train_seconds, trained = None, 0
    if mode != "backprojection":
        train = {**run, "max_epochs": 1, "epoch_length": iterations, "resume": False}
        train_seconds = _run(_bundle_cmd("training", ["train.json"], {**train, **tools.NO_VALIDATION}))
        # no validation during training: the final EMA weights are the stage's model, evaluated once
        trained = _final_ema_as_model(root / f"stage{k}" / "models")
    eval_seconds = _run(_bundle_cmd("run", ["train.json", "evaluate.json"], run))
    metrics = json.loads((root / f"stage{k}" / f"eval_{mode}" / "metrics.json").read_text())["latest"]
    return {
        "volume_size": settings["stage_sizes"][k - 1],
        "iterations": trained,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        **{key: metrics.get(key) for key in ("val_psnr", "val_ssim", "val_ms_ssim", "val_proj_error")},
    }


def _print_quality(summary: dict) -> None:
    """The report of ``xray_quality``: one Markdown row per mode and stage."""
    rows = []
    for mode, results in summary["modes"].items():
        for stage, r in results.items():
            minutes = None if r["train_seconds"] is None else r["train_seconds"] / 60
            rows.append(
                [mode, int(stage.removeprefix("stage")), tools.shape_label(r["volume_size"]), r["iterations"]]
                + [_fmt(minutes, ".1f"), f"{r['eval_seconds']:.0f}", _fmt(r["val_psnr"], ".2f")]
                + [_fmt(r["val_ssim"], ".4f"), _fmt(r["val_ms_ssim"], ".4f"), _fmt(r["val_proj_error"], ".4f")]
            )
    header = ["mode", "stage", "volume", "iterations", "training (min)", "evaluation (s)", "PSNR (dB)", "SSIM"]
    tools.print_table([*header, "MS-SSIM", "projection error"], rows)


def _quality_budgets(
    device: str,
    stages: int,
    output: str | None,
    work_dir: str | None,
    seed: int,
    budgets: Sequence[int],
    methods: Sequence[str],
    num_samples: int,
    guidance_scale: float,
    refine_steps: int,
    conditions: Sequence[str] | None,
    parallel: int,
    plot: str | None,
    overrides: dict,
) -> dict:
    """``xray_quality --budgets``: see :func:`scripts.harness.xray_budgets.xray_budgets`."""
    from common.demo.images import make_xray2ct_demo
    from common.utils import resolve_device
    from scripts.harness.xray_budgets import (
        BUDGET_HEADER,
        CONDITIONS,
        CPU_BUDGET_SETTINGS,
        WINNER_HEADER,
        budget_rows,
        plot_budgets,
        winner_rows,
    )
    from scripts.harness.xray_budgets import xray_budgets as run_budgets

    reserved = sorted(
        set(overrides)
        & {*QUALITY_RESERVED, "eval_dir", "num_samples", "guidance_scale", "refine_steps", "noise_tolerance"}
    )
    if reserved:
        raise ValueError(f"xray_quality --budgets sets {reserved} itself for every run; leave them out.")
    dev = resolve_device(device)
    defaults = _defaults(dev)
    profile = describe(BUNDLE).demo["cpu" if dev.type != "cuda" else "gpu"]
    settings = {**defaults, "stage_batch_size": profile["stage_batch_size"], "seed": int(seed)}
    if dev.type != "cuda":
        settings.update({"stage_lr": profile["stage_lr"], **CPU_BUDGET_SETTINGS, "num_threads": 1})
    else:
        settings["source_size"] = settings["stage_sizes"][-1]
    settings.update(overrides)
    settings["stage_sizes"] = [list(size) for size in settings["stage_sizes"][: int(stages)]]
    if device != "auto":
        settings["device"] = device
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="xray_budgets_"))
    print(f"runs under {work}", flush=True)
    if "dataset_dir" not in overrides:  # the demo phantoms at the size the X-rays are made from
        shape = settings.get("source_size") or settings["stage_sizes"][-1]
        fov = tools.train_config(BUNDLE)["fov_mm"]
        settings["dataset_dir"] = str(make_xray2ct_demo(work / "data", shape=shape, fov_mm=fov).parent)
    if isinstance(budgets, (int, str)):
        budgets = [int(budgets)]
    summary = run_budgets(
        tools.BundleRuns(_run, _bundle_cmd, settings),
        [int(b) for b in budgets],
        work,
        methods=[methods] if isinstance(methods, str) else list(methods),
        stages=int(stages),
        num_samples=int(num_samples),
        guidance_scale=float(guidance_scale),
        refine_steps=int(refine_steps),
        conditions=list(CONDITIONS)
        if conditions is None
        else [conditions]
        if isinstance(conditions, str)
        else conditions,
        parallel=int(parallel),
        output=output,
    )
    summary["device"] = tools.device_name(dev)
    if output:
        Path(output).write_text(json.dumps(summary, indent=2))
    tools.print_table(BUDGET_HEADER, budget_rows(summary))
    tools.print_table(WINNER_HEADER, winner_rows(summary))
    if plot:
        print(f"plot: {plot_budgets(summary, plot)}")
    return summary


_MEMORY_STEP = r"""
import json, resource, sys, time
import torch
import torch.nn.functional as F
from common.xray2ct.drr import DRRProjector
from common.diffusion.schedule import DiffusionSchedule
from common.xray2ct.losses import ProjectionLoss
from common.xray2ct.networks import XrayCTDenoiser, degrade_to_previous

cfg = json.loads(sys.argv[1])
torch.set_num_threads(int(cfg["num_threads"]))
torch.manual_seed(0)
size, previous = cfg["volume_size"], cfg["previous_size"]
projector = DRRProjector(fov_mm=350.0, view_size=cfg["view_size"])
network = XrayCTDenoiser(projector, with_previous=previous is not None, gradient_checkpointing=cfg["checkpointing"],
                         **cfg["network"])
optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
schedule = DiffusionSchedule(1000, "cosine")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
x0 = torch.rand(cfg["batch_size"], 1, *size) * 2 - 1
xray = projector.xrays(x0)
start = time.perf_counter()
t = torch.full((x0.shape[0],), 500, dtype=torch.long)
noise = torch.randn_like(x0)
x_t = schedule.add_noise(x0, noise, t)
prev = degrade_to_previous(x0, previous, 0.1) if previous is not None else None
out = network(x_t, t, xray, prev)
x0_hat = schedule.split(x_t, out, t, "v_prediction")[0].float()
loss = F.mse_loss(out, schedule.velocity(x0, noise, t)) + 0.1 * ProjectionLoss(projector)(x0_hat, xray).mean()
loss.backward()
optimizer.step()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
params = sum(p.numel() for p in network.parameters())
print(json.dumps({"peak_gib": peak / 2**20, "step_gib": (peak - before) / 2**20, "seconds": seconds, "parameters": params}))
"""


def xray_memory(
    stages: Sequence[int] = (1, 2),
    stage_sizes: Sequence[Sequence[int]] = ((64, 64, 64), (128, 128, 128), (256, 256, 256)),
    view_size: Sequence[int] = (256, 256),
    batch_size: int = 1,
    checkpointing: Sequence[bool] = (False, True),
    num_threads: int | None = None,
    output: str | None = None,
    **network,
) -> list[dict]:
    """Peak host memory of one fp32 training step (forward, v-loss + projection loss, backward, AdamW step) of each
    stage's denoiser at the bundle's default network and sizes, with and without gradient checkpointing, each in a
    fresh process (the peak resident set size, so the figure includes PyTorch's own memory).

    This is a CPU measurement: the tensors of the step are those a GPU holds in fp32, so it gives the order of the
    GPU memory a stage needs (bf16 autocast roughly halves the activations); no GPU was used.
    """
    config = tools.train_config(BUNDLE)
    settings = {**{k: config[k] for k in NETWORK_KEYS}, **network}
    rows = []
    for stage in stages:
        for ckpt in checkpointing:
            cfg = {
                "volume_size": [int(s) for s in stage_sizes[stage - 1]],
                "previous_size": [int(s) for s in stage_sizes[stage - 2]] if stage > 1 else None,
                "view_size": [int(v) for v in view_size],
                "batch_size": int(batch_size),
                "checkpointing": bool(ckpt),
                "network": settings,
                "num_threads": int(num_threads or os.cpu_count() or 1),
            }
            env = {**os.environ, "PYTHONPATH": str(tools.REPO_ROOT)}
            result = subprocess.run(
                [sys.executable, "-c", _MEMORY_STEP, json.dumps(cfg)], capture_output=True, text=True, env=env
            )
            if result.returncode != 0:
                raise RuntimeError(f"stage {stage} (checkpointing={ckpt}) failed: {result.stderr[-2000:]}")
            row = {"stage": stage, "volume_size": cfg["volume_size"], "checkpointing": bool(ckpt)}
            row.update(json.loads(result.stdout.strip().splitlines()[-1]))
            rows.append(row)
            print(
                f"stage {stage} {cfg['volume_size']} checkpointing={ckpt}: peak {row['peak_gib']:.2f} GiB, "
                f"step {row['seconds']:.1f} s, {row['parameters']:,} parameters",
                flush=True,
            )
            if output:
                Path(output).write_text(json.dumps(rows, indent=2))
    return rows


def fault_case(root: Path, seed: int) -> BundleCase:
    """The small ``xray2ct_cascade`` job of the fault tests (:func:`scripts.harness.faults.make_case`): stage 1 on
    chest CT phantoms at 24^3, 2 epochs (4 for 2 processes)."""
    from common.demo.images import make_xray2ct_demo

    make_xray2ct_demo(root, n_train=4, n_val=2, shape=(24, 24, 24), fov_mm=CHEST_FOV_MM, seed=seed)
    args = {"dataset_dir": str(root), "stage": 1, "stage_batch_size": [1, 1], "max_epochs": 2, "val_interval": 2}
    return BundleCase(
        BUNDLE,
        ["train.json", "tiny.json"],
        {**args, **RUN_SETTINGS, "seed": seed},
        ckpt="stage1/models/last.pt",
        weights=("network", "ema"),
        extra={"max_epochs": 4},
    )


def xray_uncertainty(
    comparison: str,
    work_dir: str,
    methods: Sequence[str] = ("residual", "diffusion"),
    budget: int | None = None,
    stage: int = 1,
    ks: Sequence[int] = (4, 8, 16),
    n_cases: int = 20,
    calibration_fraction: float = 0.5,
    seed: int = 1000,
    output: str | None = "xray_uncertainty.json",
) -> dict:
    """The samples' spread as an uncertainty, and its calibration on held-out cases, for the stochastic snapshots of
    a budget comparison (``xray_quality --budgets``): see :mod:`scripts.harness.xray_uncertainty`.

    Args:
        comparison: the budget comparison's JSON (``--output`` of ``xray_quality --budgets``: its settings and budgets).
        work_dir: its ``--work_dir`` (the snapshots).
        methods: its stochastic methods to score.
        budget: the snapshots' budget (default: the comparison's largest).
        stage: the cascade's stage to evaluate.
        ks: the numbers of samples per case.
        n_cases: new validation phantoms (``seed`` makes them; the comparison's are not reused), split between
            calibration and held-out cases.
        calibration_fraction: the share of ``n_cases`` the calibration is fitted on.
        seed: the phantoms' seed.
        output: JSON file of the results.
    """
    from scripts.harness.xray_uncertainty import UNCERTAINTY_HEADER, uncertainty_rows
    from scripts.harness.xray_uncertainty import xray_uncertainty as run_uncertainty

    summary, settings, datalist = _new_phantoms(comparison, work_dir, n_cases, seed)
    work = Path(work_dir)
    result = run_uncertainty(
        tools.BundleRuns(_run, _bundle_cmd, settings),
        work,
        datalist,
        methods=[methods] if isinstance(methods, str) else list(methods),
        budget=int(budget if budget is not None else max(summary["budgets"])),
        stage=int(stage),
        ks=[int(k) for k in ([ks] if isinstance(ks, int) else ks)],
        guidance_scale=float(summary.get("guidance_scale", 1.0)),
        calibration_fraction=float(calibration_fraction),
        output=output,
    )
    hu = tools.train_config(BUNDLE)["hu_window"]
    tools.print_table(UNCERTAINTY_HEADER, uncertainty_rows(result, hu_width=float(hu[1] - hu[0])))
    return result


def _new_phantoms(comparison: str, work_dir: str, n_cases: int, seed: int) -> tuple[dict, dict, Path]:
    """The budget comparison's summary and settings, with ``n_cases`` new validation phantoms (``seed``) of its size
    under ``<work_dir>/uncertainty_data`` as the data of the settings; and their datalist."""
    from common.demo.images import make_xray2ct_demo

    summary = json.loads(Path(comparison).read_text())
    settings = {k: v for k, v in summary["settings"].items() if k != "dataset_dir"}
    shape = settings.get("source_size") or settings["stage_sizes"][-1]
    fov = settings.get("fov_mm", tools.train_config(BUNDLE)["fov_mm"])
    datalist = make_xray2ct_demo(
        Path(work_dir) / "uncertainty_data", n_train=1, n_val=int(n_cases), shape=shape, fov_mm=fov, seed=seed
    )
    settings["dataset_dir"] = str(datalist.parent)
    return summary, settings, datalist


def xray_consistency(
    comparison: str,
    work_dir: str,
    methods: Sequence[str] = ("direct", "residual"),
    budget: int | None = None,
    stage: int = 1,
    conditions: Sequence[str] | None = None,
    num_samples: int = 4,
    refine_steps: int = 5,
    mismatch_tolerances: Sequence[float] = (1.0, 1.1, 1.25),
    n_cases: int = 20,
    calibration_fraction: float = 0.5,
    seed: int = 1000,
    output: str | None = "xray_consistency.json",
) -> dict:
    """Whether the consistency check keeps guidance and refinement from doing harm under realistic X-ray conditions:
    the snapshots of a budget comparison (``xray_quality --budgets``) on held-out phantoms, clean and under each
    condition, without correction, corrected, and corrected under the check fitted on the other phantoms (clean):
    see :mod:`scripts.harness.xray_uncertainty`.

    Args:
        comparison, work_dir, budget, stage, n_cases, calibration_fraction, seed: as ``xray_uncertainty``.
        methods: the comparison's methods to evaluate (``direct``, ``residual``, ``diffusion``).
        conditions: names out of ``scripts.harness.xray_budgets.CONDITIONS`` (default: all).
        num_samples: samples per case of the stochastic methods.
        refine_steps: the refinement steps (guidance: the comparison's scale).
        mismatch_tolerance: the check's factor of the fitted reference.
        output: JSON file of the results.
    """
    from scripts.harness.xray_budgets import CONDITIONS, _condition
    from scripts.harness.xray_uncertainty import consistency_header, consistency_rows
    from scripts.harness.xray_uncertainty import xray_consistency as run_consistency

    names = list(CONDITIONS) if conditions is None else [conditions] if isinstance(conditions, str) else conditions
    unknown = [c for c in names if c not in CONDITIONS]
    if unknown:
        raise ValueError(f"conditions must be out of {sorted(CONDITIONS)}, got {unknown}.")
    summary, settings, datalist = _new_phantoms(comparison, work_dir, n_cases, seed)
    result = run_consistency(
        tools.BundleRuns(_run, _bundle_cmd, settings),
        Path(work_dir),
        datalist,
        {name: _condition(name, settings) for name in names},
        methods=[methods] if isinstance(methods, str) else list(methods),
        budget=int(budget if budget is not None else max(summary["budgets"])),
        stage=int(stage),
        num_samples=int(num_samples),
        guidance_scale=float(summary.get("guidance_scale", 1.0)),
        refine_steps=int(refine_steps),
        mismatch_tolerances=[
            float(t)
            for t in ([mismatch_tolerances] if isinstance(mismatch_tolerances, (int, float)) else mismatch_tolerances)
        ],
        calibration_fraction=float(calibration_fraction),
        output=output,
    )
    tools.print_table(consistency_header(result), consistency_rows(result))
    return result


BENCHMARKS = {
    "xray_consistency": xray_consistency,
    "xray_memory": xray_memory,
    "xray_quality": xray_quality,
    "xray_throughput": xray_throughput,
    "xray_uncertainty": xray_uncertainty,
}

# the tiny networks and data of the campaign's CPU rehearsal (its throughput rows and the stage-3 step)
CAMPAIGN_TINY = {"stage_sizes": [[16, 16, 16], [32, 32, 32]], "view_size": [32, 32], "n_cases": 3, "batch_size": 1}
CAMPAIGN_TINY |= {"vit_patch_size": 8, "vit_hidden_size": 32, "vit_mlp_dim": 64, "vit_layers": 1, "vit_heads": 2}
CAMPAIGN_TINY |= {"unet_channels": [8, 16, 32], "attention_levels": [False, False, True], "norm_num_groups": 8}
CAMPAIGN_TINY |= {"num_head_channels": 8}
# the campaign's throughput rows (scripts/harness/campaign.py): (row name, benchmark, GPU settings, tiny settings)
THROUGHPUT = tuple(
    (f"xray2ct_stage{stage}", "xray_throughput", {"stage": stage, "n_cases": 4}, {"stage": stage, **CAMPAIGN_TINY})
    for stage in (1, 2)
)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Benchmarks of ``fast_ddpm_3d`` (commands of ``scripts/benchmark.py``):

    python scripts/benchmark.py ddpm_sampling                      # grid (10 steps) vs baseline (1000), one volume
    python scripts/benchmark.py ddpm_sampling --shape "[96,96,96]" --roi_size "[64,64,64]" --device cuda
    python scripts/benchmark.py ddpm_quality --iterations 1500     # equal training budgets, fast vs baseline
    python scripts/benchmark.py ddpm_throughput                    # bundle trainer vs a plain PyTorch loop

``ddpm_sampling`` samples one whole volume with the same network twice, once over Fast-DDPM's grid and once over
all ``num_train_timesteps`` steps (the baseline DDPM), counting network evaluations with a forward hook: passes
over the whole volume (one per time step) and window forwards (the denoiser is applied to overlapping windows when
the volume is larger than ``roi_size``). ``ddpm_quality`` trains the bundle twice with the same seed, data, network
and number of iterations, once in each ``diffusion_mode``, then evaluates each best checkpoint on the whole
validation volumes with its own sampler (PSNR/SSIM/MS-SSIM against the real target, and sampling time).
``ddpm_throughput`` compares the bundle's trainer (all handlers on, EMA, clipping) with a plain loop written as
MONAI's and Fast-DDPM's scripts do (CPU ``CacheDataset`` + ``DataLoader``, fp32, grid time steps, EMA, clipping).
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from common.demo.images import make_diffusion_demo
from scripts.harness import tools
from scripts.harness.faults import RUN_SETTINGS, BundleCase

__all__ = ["BENCHMARKS", "THROUGHPUT", "ddpm_quality", "ddpm_sampling", "ddpm_throughput", "fault_case"]

BUNDLE = "fast_ddpm_3d"


def _unet_settings(**overrides) -> dict:
    """U-Net hyperparameters: ``train.json``'s, replaced by the overrides that are not None."""
    config = tools.train_config(BUNDLE)
    keys = ("unet_channels", "attention_levels", "num_res_blocks", "norm_num_groups", "num_head_channels")
    return {k: config[k] if overrides.get(k) is None else overrides[k] for k in keys}


def _unet(
    settings: dict, in_channels: int, out_channels: int, device: torch.device, flash_attention: bool | None = None
) -> torch.nn.Module:
    """The bundle's U-Net; ``flash_attention`` defaults to the bundle's choice (on for CUDA)."""
    from monai.networks.nets import DiffusionModelUNet

    return DiffusionModelUNet(
        spatial_dims=3,
        in_channels=in_channels,
        out_channels=out_channels,
        channels=settings["unet_channels"],
        attention_levels=[bool(a) for a in settings["attention_levels"]],
        num_res_blocks=settings["num_res_blocks"],
        norm_num_groups=settings["norm_num_groups"],
        num_head_channels=settings["num_head_channels"],
        use_flash_attention=device.type == "cuda" if flash_attention is None else flash_attention,
    ).to(device)


class _CallCounter:
    """Counts forward calls and batch elements (windows) of a module."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls = self.items = 0
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, args) -> None:
        self.calls += 1
        self.items += int(args[0].shape[0])


def ddpm_sampling(
    shape=(32, 32, 32),
    roi_size=None,
    sw_batch_size: int = 1,
    overlap: float = 0.25,
    in_channels: int = 2,
    unet_channels=None,
    attention_levels=None,
    norm_num_groups: int | None = None,
    num_head_channels: int | None = None,
    grid: str = "uniform",
    num_grid_steps: int = 10,
    num_train_timesteps: int = 1000,
    amp: str | None = None,
    modes=("fast", "baseline"),
    device: str = "auto",
    num_threads: int | None = None,
    seed: int = 0,
    output: str | None = None,
) -> dict:
    """Time and network evaluations of sampling one whole volume: Fast-DDPM's grid vs every step (the baseline).

    Both runs use the same (untrained) network and start noise; sampling cost does not depend on the weights.

    Args:
        shape: volume shape (divisible by the U-Net's downsampling).
        roi_size: denoiser window (``None``: the whole volume at once).
        sw_batch_size: windows per network call.
        overlap: window overlap.
        in_channels: denoiser input channels (conditions + 1 target).
        unet_channels, attention_levels, norm_num_groups, num_head_channels: U-Net widths (``train.json``'s by
            default).
        grid, num_grid_steps, num_train_timesteps: the time-step grid of the fast sampler.
        amp: ``bf16``/``fp16``/``none`` autocast (default: bf16 on GPUs, none on CPUs).
        modes: the samplers to time, ``fast`` and/or ``baseline`` (``["fast"]`` for volumes where 1000 steps take
            too long; the ratios need both).
        device: ``auto``, ``cpu`` or ``cuda``.
        num_threads: torch CPU threads.
        seed: seed of the network's weights and the input volume.
        output: JSON file for the results.
    """
    from common.diffusion.engines import DIFFUSION_MODES, sampling_grid
    from common.utils import default_amp

    dev, _ = tools.setup(device, num_threads, 0)
    amp = amp or default_amp(dev)
    modes = [modes] if isinstance(modes, str) else list(modes)
    if not modes or any(m not in DIFFUSION_MODES for m in modes):
        raise ValueError(f"modes must be a non-empty list of {DIFFUSION_MODES}, got {modes!r}.")
    settings = _unet_settings(
        unet_channels=unet_channels,
        attention_levels=attention_levels,
        norm_num_groups=norm_num_groups,
        num_head_channels=num_head_channels,
    )
    torch.manual_seed(int(seed))
    network = _unet(settings, int(in_channels), 1, dev).eval()
    counter = _CallCounter(network)
    image = torch.randn(1, int(in_channels), *[int(s) for s in shape], device=dev)
    sampler = {
        "in_channels": int(in_channels),
        "num_train_timesteps": num_train_timesteps,
        "roi_size": roi_size,
        "sw_batch_size": sw_batch_size,
        "overlap": overlap,
    }
    steps = {mode: sampling_grid(mode, grid, num_grid_steps, num_train_timesteps) for mode in modes}
    results = {mode: _time_sampling(network, counter, image, steps[mode], sampler, amp) for mode in modes}
    counter.handle.remove()
    summary = {
        "device": tools.device_name(dev),
        "shape": list(shape),
        "roi_size": None if roi_size is None else list(roi_size),
        "sw_batch_size": int(sw_batch_size),
        "unet": settings,
        "amp": amp,
        "grid": grid,
        **results,
    }
    if dev.type == "cuda":
        summary["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if "fast" in results and "baseline" in results:
        fast, base = results["fast"], results["baseline"]
        summary["time_ratio_fast_over_baseline"] = fast["seconds"] / base["seconds"]
        summary["evaluation_ratio_fast_over_baseline"] = fast["window_forwards"] / base["window_forwards"]
    _print_sampling(summary, modes)
    return tools.save_summary(summary, output)


def _time_sampling(
    network: torch.nn.Module,
    counter: _CallCounter,
    image: torch.Tensor,
    steps: torch.Tensor | Sequence[int],
    sampler: dict,
    amp: str,
) -> dict:
    """Sample ``image``'s target once over the time ``steps`` after one untimed denoising call (CUDA kernels,
    cuDNN plans): the number of steps, seconds and network evaluations (calls and window forwards, from
    ``counter``). ``sampler`` holds the other arguments of :class:`common.diffusion.networks.DiffusionSampler`."""
    from common.diffusion.networks import DiffusionSampler
    from common.utils import autocast

    run = DiffusionSampler(network, target_channels=[sampler["in_channels"] - 1], timesteps=steps, **sampler)
    dev = image.device
    with torch.no_grad(), autocast(dev, amp):
        run._denoise(image, int(steps[-1]))
    counter.calls = counter.items = 0
    tools.sync(dev)
    start = time.perf_counter()
    with torch.no_grad(), autocast(dev, amp):
        sample = run(image)
    tools.sync(dev)
    seconds = time.perf_counter() - start
    if not torch.isfinite(sample).all():
        raise RuntimeError(f"sampling over {len(steps)} time steps gave non-finite values")
    return {
        "time_steps": len(steps),
        "seconds": seconds,
        "network_calls": counter.calls,
        "window_forwards": counter.items,
    }


def _print_sampling(summary: dict, modes: Sequence[str]) -> None:
    """The report of ``ddpm_sampling``: one Markdown row per sampler, then the fast / baseline ratios."""
    tools.print_table(
        ["sampler", "time steps", "network calls", "window forwards", "seconds / volume"],
        [
            [m, summary[m]["time_steps"], summary[m]["network_calls"], summary[m]["window_forwards"]]
            + [f"{summary[m]['seconds']:.1f}"]
            for m in modes
        ],
    )
    if "time_ratio_fast_over_baseline" in summary:
        print(
            f"\nfast / baseline: time {summary['time_ratio_fast_over_baseline']:.4f}, network evaluations "
            f"{summary['evaluation_ratio_fast_over_baseline']:.4f} ({summary['device']}, "
            f"{tools.shape_label(summary['shape'])})"
        )


def _bundle_cmd(run_id: str, configs: Sequence[str], overrides: dict) -> list[str]:
    return tools.bundle_command(BUNDLE, run_id, configs, overrides)


_run = tools.run_command


def ddpm_quality(
    task: str = "synthesis",
    iterations: int = 1500,
    shape=(32, 32, 32),
    patch_size=(32, 32, 32),
    unet_channels=(16, 32, 64),
    attention_levels=(False, False, True),
    norm_num_groups: int = 8,
    num_head_channels: int = 16,
    patches_per_volume: int = 2,
    lr: float = 2e-4,
    val_sw_batch_size: int = 1,
    device: str = "auto",
    num_threads: int | None = None,
    seed: int = 0,
    output_dir: str | None = None,
    output: str | None = None,
) -> dict:
    """Equal training budgets: the bundle trained for ``iterations`` in ``fast`` and in ``baseline`` mode (same seed,
    data, network, batch), each best checkpoint evaluated on the whole validation volumes with its own sampler.

    Args:
        task: ``synthesis`` (brain tumour phantoms, t1n + t1c + t2w -> t2f) or ``translation`` (MNI T1 -> grey
            matter map at 3 mm).
        iterations: training iterations of each run.
        shape: phantom volume shape (``synthesis``).
        patch_size: training patch and denoiser window.
        unet_channels, attention_levels, norm_num_groups, num_head_channels: the U-Net.
        patches_per_volume: patches per step (batch 1 volume).
        lr: learning rate.
        val_sw_batch_size: windows per network call when sampling.
        device: ``auto`` (the bundle's choice), ``cpu`` or ``cuda``.
        num_threads: CPU threads of the runs.
        seed: seed of the phantoms (``synthesis``) and of both runs (the bundle's ``seed``).
        output_dir: where the runs are kept (default: a temporary folder).
        output: JSON file for the results.
    """
    from common.checkpoint_io import load_checkpoint, save_checkpoint
    from common.demo.images import write_brats_phantom_dataset

    work = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="ddpm_quality_"))
    data = work / "data"
    if task == "synthesis":
        write_brats_phantom_dataset(data, n_train=6, n_val=2, shape=shape, seed=int(seed))
        configs = ["train.json", "brats.json"]
    elif task == "translation":
        make_diffusion_demo(data, "translation")
        configs = ["train.json"]
    else:
        raise ValueError(f"task must be 'synthesis' or 'translation', got {task!r}.")
    common = {
        "dataset_dir": str(data),
        "patch_size": list(patch_size),
        "unet_channels": list(unet_channels),
        "attention_levels": [bool(a) for a in attention_levels],
        "norm_num_groups": norm_num_groups,
        "num_head_channels": num_head_channels,
        "patches_per_volume": patches_per_volume,
        "lr": lr,
        "val_sw_batch_size": val_sw_batch_size,
        "spacing": None,
        "seed": int(seed),
    }
    if device != "auto":
        common["device"] = device
    if num_threads:
        common["num_threads"] = int(num_threads)
    summary: dict = {"task": task, "iterations": iterations, "settings": common, "modes": {}}
    rows = []
    for mode in ("fast", "baseline"):
        run = {**common, "diffusion_mode": mode, "output_dir": str(work / mode)}
        train = {**run, "max_epochs": 1, "epoch_length": iterations, **tools.NO_VALIDATION}
        train_seconds = _run(_bundle_cmd("training", configs, train))
        # no validation during training: the final EMA weights (what model.pt holds) are evaluated once
        models = work / mode / "models"
        ema = load_checkpoint(models / "last.pt")["ema"]
        save_checkpoint({k: v for k, v in ema.items() if k != "n_averaged"}, models / "model.pt")
        eval_seconds = _run(_bundle_cmd("run", [*configs, "evaluate.json"], run))
        metrics = json.loads((work / mode / "eval" / "metrics.json").read_text())["latest"]
        summary["modes"][mode] = {"train_seconds": train_seconds, "eval_seconds": eval_seconds, **metrics}
        tools.save_summary(summary, output)  # after each mode: a run cut short keeps what it measured
        rows.append(
            [
                mode,
                iterations,
                f"{train_seconds / 60:.1f}",
                f"{eval_seconds:.0f}",
                f"{metrics['val_psnr']:.2f}",
                f"{metrics['val_ssim']:.4f}",
                f"{metrics['val_ms_ssim']:.4f}",
                f"{metrics['val_denoise_loss']:.4f}",
            ]
        )
    tools.print_table(
        ["mode", "iterations", "training (min)", "evaluation (s)", "PSNR (dB)", "SSIM", "MS-SSIM", "denoise loss"],
        rows,
    )
    return summary


def _ddpm_plain_loop(s: dict, data: list[dict], iterations: int, warmup: int, workers: int) -> float:
    """A plain Fast-DDPM training loop: CPU ``CacheDataset`` + ``DataLoader`` of (T1, GM) pairs, grid time steps,
    epsilon MSE, Adam, clipping and an EMA of the weights, fp32."""
    from common.diffusion.schedule import DiffusionSchedule, fast_ddpm_grid

    loader = tools.plain_loader(s, data, workers, keys=("t1", "gm"), value_range=(-1, 1))
    device = s["device"]
    net = _unet(s["unet"], 2, 1, device, flash_attention=False)
    ema = [p.detach().clone() for p in net.parameters()]
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    alphas = DiffusionSchedule().alphas_cumprod.float().to(device)
    grid = fast_ddpm_grid("uniform", 10, 1000).to(device)

    def step(images: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        t = grid[torch.randint(0, len(grid), (images.shape[0],), device=device)]
        a = alphas[t].view(-1, 1, 1, 1, 1)
        noise = torch.randn_like(images[:, 1:])
        x_t = a.sqrt() * images[:, 1:] + (1 - a).sqrt() * noise
        loss = torch.nn.functional.mse_loss(net(torch.cat([images[:, :1], x_t], 1), t), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in net.parameters()], 1 - 0.999)

    return tools.timed_loop(s, loader, step, iterations, warmup)


def ddpm_throughput(
    patch_size=(32, 32, 32),
    unet_channels=(16, 32, 64),
    attention_levels=(False, False, True),
    norm_num_groups: int = 8,
    num_head_channels: int = 16,
    batch_size: int = 1,
    patches_per_volume: int = 4,
    iterations: int = 30,
    warmup: int = 5,
    repeats: int = 2,
    amp: str | None = None,
    compile: bool = False,
    profile: bool = False,
    device: str = "auto",
    baseline_workers: int | None = None,
    num_threads: int | None = None,
    seed: int = 0,
    output: str | None = None,
) -> dict:
    """``fast_ddpm_3d`` trainer vs a plain Fast-DDPM loop, same network/batch/patch, alternating in one process, on
    the MNI T1 -> grey-matter translation demo (3 mm).

    Args:
        patch_size: training patch.
        unet_channels, attention_levels, norm_num_groups, num_head_channels: the U-Net (``train.json`` uses
            ``[32, 64, 128, 256]``).
        batch_size: volumes per step; each gives ``patches_per_volume`` patches.
        patches_per_volume: random patches per volume.
        iterations: timed steps per run (after ``warmup``).
        warmup: untimed steps at the start of each run.
        repeats: runs of each side; the median is reported.
        amp: the bundle's autocast, ``bf16``/``fp16``/``none`` (default: bf16 on GPUs, none on CPUs); the plain
            loop always runs in fp32, as the public scripts do.
        compile: ``torch.compile`` the bundle's U-Net (its ``compile`` id); compilation happens in the warm-up.
        profile: also profile one bundle iteration with ``torch.profiler`` (its top kernels, in the result's
            ``profile``; :func:`scripts.harness.tools.kernel_profile`).
        device: ``auto``, ``cpu`` or ``cuda``.
        baseline_workers: DataLoader workers of the plain loop (default: 4 on GPU machines, 0 on 2-core CPUs).
        num_threads: torch CPU threads.
        seed: seed of the plain loop (weights, time steps, noise) and of the bundle's runs.
        output: JSON file for the results.
    """
    from common.utils import default_amp

    dev, workers = tools.setup(device, num_threads, baseline_workers)
    torch.manual_seed(int(seed))
    unet = {
        "unet_channels": [int(c) for c in unet_channels],
        "attention_levels": [bool(a) for a in attention_levels],
        "num_res_blocks": tools.train_config(BUNDLE)["num_res_blocks"],
        "norm_num_groups": int(norm_num_groups),
        "num_head_channels": int(num_head_channels),
    }
    s = {
        "patch_size": [int(p) for p in patch_size],
        "batch_size": int(batch_size),
        "num_samples": int(patches_per_volume),
        "unet": unet,
        "device": dev,
        "amp": amp or default_amp(dev),
    }
    extra = {
        **unet,
        "compile": bool(compile),
        "patch_size": s["patch_size"],
        "batch_size": s["batch_size"],
        "patches_per_volume": s["num_samples"],
        "lr": 1e-4,
        "lr_scaling": "none",
        "seed": int(seed),
    }
    summary = {
        "device": tools.device_name(dev),
        "patch_size": s["patch_size"],
        "unet": unet,
        "batch": f"{batch_size}x{patches_per_volume}",
        "amp": s["amp"],
        "compile": bool(compile),
        "timed_iterations": iterations,
        **tools.alternate(
            s,
            BUNDLE,
            _ddpm_plain_loop,
            iterations,
            warmup,
            repeats,
            workers,
            functools.partial(make_diffusion_demo, kind="translation"),
            ("t1", "gm"),
            extra,
            profile=profile,
        ),
    }
    _print_throughput(summary)
    return tools.save_summary(summary, output)


def _print_throughput(summary: dict) -> None:
    """The report of ``ddpm_throughput``: one Markdown row, the run's sizes and then the measured rates."""
    leading = {"device": summary["device"], "patch": tools.shape_label(summary["patch_size"])}
    leading |= {"U-Net channels": summary["unet"]["unet_channels"], "batch": summary["batch"]}
    tools.print_throughput(summary, leading | {"amp": summary["amp"], "compile": summary["compile"]})


def fault_case(root: Path, seed: int) -> BundleCase:
    """The small ``fast_ddpm_3d`` job of the fault tests (:func:`scripts.harness.faults.make_case`): the BraTS preset
    on brain tumour phantoms, 2 cases (4 for 2 processes), 4 epochs."""
    from common.demo.images import write_brats_phantom_dataset

    write_brats_phantom_dataset(root, n_train=4, n_val=2, shape=(24, 24, 20), spacing=(1.5, 1.5, 2.0), seed=seed)
    args = {"dataset_dir": str(root), "max_cases": 2, "max_epochs": 4, "val_interval": 4}
    configs = ["train.json", "brats.json", "tiny.json"]
    return BundleCase(
        BUNDLE, configs, {**args, **RUN_SETTINGS, "seed": seed}, weights=("unet", "ema"), extra={"max_cases": 4}
    )


BENCHMARKS = {"ddpm_quality": ddpm_quality, "ddpm_sampling": ddpm_sampling, "ddpm_throughput": ddpm_throughput}

# the campaign's throughput rows (scripts/harness/campaign.py): (row name, benchmark, GPU settings, tiny settings)
THROUGHPUT = (
    (
        BUNDLE,
        "ddpm_throughput",
        {
            "patch_size": [96, 96, 96],
            "unet_channels": [32, 64, 128, 256],
            "attention_levels": [False, False, False, True],
        }
        | {"norm_num_groups": 16, "num_head_channels": 32, "batch_size": 1, "patches_per_volume": 2},
        {"patch_size": [16, 16, 16], "batch_size": 1, "patches_per_volume": 1},
    ),
)

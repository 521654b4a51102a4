# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Benchmarks: bundle training throughput against a plain PyTorch loop, and peak memory per patch size.

    python scripts/benchmark.py throughput                         # autoencoder_3d, CPU or GPU
    python scripts/benchmark.py throughput --patch_size "[64,64,64]" --iterations 40
    python scripts/benchmark.py memory --patch_sizes "[[32,32,32],[64,64,64]]"

``throughput`` runs, in one process and alternating, (a) the plain loop of MONAI's 3D latent-diffusion tutorial
(CPU ``CacheDataset`` + ``DataLoader``, fp32, the same AutoencoderKL + PatchDiscriminator, L1 + KL + least-squares
adversarial losses, batch and patch) and (b) the bundle's own trainer built from ``train.json`` with every
handler it normally has. It reports samples/s of each, their ratio, the bundle's data-wait fraction and peak
memory. ``memory`` measures peak memory of training steps at each patch size, each in a fresh subprocess.
Results are printed as a Markdown table and written as JSON.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

CONFIGS = REPO_ROOT / "bundles" / "autoencoder_3d" / "configs"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _settings(patch_size, channels, batch_size, num_samples, device) -> dict:
    small = list(channels) != [32, 64, 64]
    return {
        "patch_size": list(patch_size),
        "channels": list(channels),
        "norm_num_groups": 8 if small else 16,
        "batch_size": batch_size,
        "num_samples": num_samples,
        "d_channels": 16 if small else 32,
        "device": device,
        "amp": "none" if device.type == "cpu" else "bf16",
    }


def _networks(s: dict, use_checkpoint: bool = False, flash_attention: bool | None = None):
    """The bundle's default AutoencoderKL and PatchDiscriminator at the benchmark's channel widths.

    ``flash_attention`` defaults to the bundle's choice (on for CUDA); the tutorial loop passes ``False``.
    """
    from monai.networks.nets import AutoencoderKL, PatchDiscriminator

    device = s["device"]
    ae = AutoencoderKL(
        spatial_dims=3,
        in_channels=1,
        out_channels=1,
        channels=s["channels"],
        latent_channels=3,
        num_res_blocks=1,
        norm_num_groups=s["norm_num_groups"],
        attention_levels=(False, False, True),
        use_checkpoint=use_checkpoint,
        use_flash_attention=device.type == "cuda" if flash_attention is None else flash_attention,
    ).to(device)
    disc = PatchDiscriminator(spatial_dims=3, num_layers_d=3, channels=s["d_channels"], in_channels=1).to(device)
    return ae, disc


def _bundle_trainer(s: dict, iterations: int, output_dir: str, extra: dict | None = None):
    from monai.bundle import ConfigWorkflow

    overrides = {
        "output_dir": output_dir,
        "patch_size": s["patch_size"],
        "channels": s["channels"],
        "norm_num_groups": s["norm_num_groups"],
        "batch_size": s["batch_size"],
        "num_samples": s["num_samples"],
        "d_channels": s["d_channels"],
        "adv_warmup_iterations": 0,
        "max_epochs": 1,
        "epoch_length": iterations,
        "val_interval": 10**6,
        "ckpt_interval": 10**6,
        "log_interval": 10**6,
        "resume": False,
        "device": str(s["device"]),
        "amp": s["amp"],
        "num_threads": torch.get_num_threads(),
        "cache_device": str(s["device"]),
        **(extra or {}),
    }
    workflow = ConfigWorkflow(config_file=str(CONFIGS / "train.json"), workflow_type="train", **overrides)
    workflow.initialize()
    trainer = workflow.parser.get_parsed_content("train#trainer")
    monitor = next(
        h for h in workflow.parser.get_parsed_content("train#handlers") if type(h).__name__ == "TrainingMonitor"
    )
    return trainer, monitor


def _time_engine(trainer, warmup: int) -> tuple[float, int]:
    from ignite.engine import Events

    marks = {}

    def _sync():
        if trainer.state.device.type == "cuda":
            torch.cuda.synchronize()

    @trainer.on(Events.ITERATION_COMPLETED(once=warmup))
    def _start(engine):
        _sync()
        marks["start"] = time.perf_counter()

    @trainer.on(Events.COMPLETED)
    def _end(engine):
        _sync()
        marks["end"] = time.perf_counter()

    trainer.run()
    return marks["end"] - marks["start"], trainer.state.iteration - warmup


def _plain_loop(s: dict, data: list[dict], iterations: int, warmup: int, workers: int) -> float:
    """The training loop of MONAI's 3D latent-diffusion tutorial (fp32, CPU CacheDataset + DataLoader)."""
    from monai.data import CacheDataset, DataLoader
    from monai.losses import PatchAdversarialLoss
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        LoadImaged,
        Orientationd,
        RandSpatialCropSamplesd,
        ScaleIntensityRangePercentilesd,
        SpatialPadd,
    )

    from common.losses.autoencoder import kl_divergence

    device = s["device"]
    transforms = Compose(
        [
            LoadImaged("image"),
            EnsureChannelFirstd("image"),
            Orientationd("image", axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
            ScaleIntensityRangePercentilesd("image", lower=0.5, upper=99.5, b_min=0.0, b_max=1.0, clip=True),
            SpatialPadd("image", spatial_size=s["patch_size"]),
            EnsureTyped("image", dtype=torch.float32),
            RandSpatialCropSamplesd("image", roi_size=s["patch_size"], num_samples=s["num_samples"], random_size=False),
        ]
    )
    dataset = CacheDataset(data, transform=transforms, cache_rate=1.0, progress=False)
    loader = DataLoader(
        dataset, batch_size=s["batch_size"], shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )
    ae, disc = _networks(s, flash_attention=False)
    opt_g = torch.optim.Adam(ae.parameters(), lr=1e-4)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-4)
    adv = PatchAdversarialLoss(criterion="least_squares")
    l1 = torch.nn.L1Loss()
    step, start = 0, None
    while step < iterations:
        for batch in loader:
            images = batch["image"].to(device)
            opt_g.zero_grad(set_to_none=True)
            recon, z_mu, z_sigma = ae(images)
            logits_fake = disc(recon.contiguous().float())[-1]
            loss_g = (
                l1(recon.float(), images.float())
                + 1e-7 * kl_divergence(z_mu, z_sigma)
                + 0.05 * adv(logits_fake, target_is_real=True, for_discriminator=False)
            )
            loss_g.backward()
            opt_g.step()
            opt_d.zero_grad(set_to_none=True)
            logits_fake = disc(recon.contiguous().detach())[-1]
            logits_real = disc(images.contiguous().detach())[-1]
            loss_d = 0.5 * (
                adv(logits_fake, target_is_real=False, for_discriminator=True)
                + adv(logits_real, target_is_real=True, for_discriminator=True)
            )
            loss_d.backward()
            opt_d.step()
            loss_g.item()  # the tutorial logs the loss every step
            step += 1
            if step == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            if step >= iterations:
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    samples = (iterations - warmup) * s["batch_size"] * s["num_samples"]
    return samples / (time.perf_counter() - start)


def throughput(
    patch_size=(32, 32, 32),
    channels=(16, 32, 32),
    batch_size: int = 2,
    num_samples: int = 2,
    iterations: int = 30,
    warmup: int = 5,
    repeats: int = 2,
    device: str = "auto",
    baseline_workers: int | None = None,
    num_threads: int | None = None,
    output: str | None = None,
) -> dict:
    """Bundle trainer vs the tutorial's plain loop, same network/losses/batch/patch, alternating in one process.

    Args:
        patch_size: training patch.
        channels: AutoencoderKL channels (``[32, 64, 64]`` is the bundle default).
        batch_size: volumes per step; each gives ``num_samples`` patches.
        num_samples: patches per volume.
        iterations: timed steps per run (after ``warmup``).
        warmup: untimed steps at the start of each run.
        repeats: runs of each side; the median is reported.
        device: ``auto``, ``cpu`` or ``cuda``.
        baseline_workers: DataLoader workers of the plain loop (default: 4 on GPU machines, 0 on 2-core CPUs).
        num_threads: torch CPU threads.
        output: JSON file for the results.
    """
    from common.data.datalist import load_datalist
    from common.data.demo import make_demo_dataset
    from common.utils import resolve_device

    if num_threads:
        torch.set_num_threads(int(num_threads))
    dev = resolve_device(device)
    s = _settings(patch_size, channels, batch_size, num_samples, dev)
    workers = baseline_workers if baseline_workers is not None else (4 if dev.type == "cuda" else 0)
    with tempfile.TemporaryDirectory() as tmp:
        datalist = make_demo_dataset(Path(tmp) / "demo")
        data = load_datalist(datalist, "training")
        results = {"plain": [], "bundle": [], "data_wait": [], "peak_mem_gib": []}
        for r in range(int(repeats)):
            results["plain"].append(_plain_loop(s, data, iterations + warmup, warmup, workers))
            trainer, monitor = _bundle_trainer(
                s, iterations + warmup, str(Path(tmp) / f"run{r}"), {"dataset_dir": str(Path(tmp) / "demo")}
            )
            elapsed, steps = _time_engine(trainer, warmup)
            results["bundle"].append(steps * s["batch_size"] * s["num_samples"] / elapsed)
            results["data_wait"].append(monitor.history[-1]["data_wait"] if monitor.history else float("nan"))
            results["peak_mem_gib"].append(monitor.history[-1]["peak_mem_gib"] if monitor.history else float("nan"))
    summary = {
        "device": _device_name(dev),
        "patch_size": list(patch_size),
        "channels": list(channels),
        "batch": f"{batch_size}x{num_samples}",
        "amp": s["amp"],
        "timed_iterations": iterations,
        "plain_samples_per_s": statistics.median(results["plain"]),
        "bundle_samples_per_s": statistics.median(results["bundle"]),
        "bundle_data_wait": statistics.median(results["data_wait"]),
        "bundle_peak_mem_gib": max(results["peak_mem_gib"]),
        "runs": results,
    }
    summary["speedup"] = summary["bundle_samples_per_s"] / summary["plain_samples_per_s"]
    print(
        "\n| device | patch | channels | batch | amp | plain loop (samples/s) | bundle (samples/s) | bundle / plain | data wait | peak mem (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {summary['device']} | {'x'.join(map(str, patch_size))} | {list(channels)} | {summary['batch']} | {s['amp']} | "
        f"{summary['plain_samples_per_s']:.2f} | {summary['bundle_samples_per_s']:.2f} | {summary['speedup']:.3f} | "
        f"{summary['bundle_data_wait']:.1%} | {summary['bundle_peak_mem_gib']:.2f} |"
    )
    if output:
        Path(output).write_text(json.dumps(summary, indent=2))
    return summary


def _memory_probe(patch_size, channels, batch_size, num_samples, device, amp, use_checkpoint) -> dict:
    """One measurement (run in a fresh process): peak memory of three full training steps."""
    from monai.losses import PatchAdversarialLoss

    from common.engines.autoencoder_gan import AutoencoderGANTrainer
    from common.handlers.monitor import peak_memory_gib
    from common.utils import resolve_device

    dev = resolve_device(device)
    s = _settings(patch_size, channels, batch_size, num_samples, dev)
    ae, disc = _networks(s, use_checkpoint=use_checkpoint)
    data = [{"image": torch.rand(batch_size * num_samples, 1, *patch_size)} for _ in range(3)]
    trainer = AutoencoderGANTrainer(
        device=dev,
        max_epochs=1,
        train_data_loader=data,
        network=ae,
        optimizer=torch.optim.AdamW(ae.parameters()),
        discriminator=disc,
        d_optimizer=torch.optim.AdamW(disc.parameters()),
        adv_loss=PatchAdversarialLoss(criterion="least_squares"),
        amp=amp if dev.type == "cuda" else "none",
    )
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    trainer.run()
    return {
        "patch_size": list(patch_size),
        "channels": list(channels),
        "batch": batch_size * num_samples,
        "amp": trainer.amp_mode,
        "use_checkpoint": use_checkpoint,
        "peak_mem_gib": peak_memory_gib(dev),
        "device": _device_name(dev),
    }


def memory(
    patch_sizes=((32, 32, 32), (64, 64, 64)),
    channels=(32, 64, 64),
    batch_size: int = 1,
    num_samples: int = 1,
    device: str = "auto",
    amp: str = "bf16",
    use_checkpoint: bool = False,
    output: str | None = None,
) -> list[dict]:
    """Peak memory of training steps (bundle trainer, generator + discriminator) per patch size.

    Each size runs in a fresh subprocess so the CPU figure (peak resident set size) is not inherited.
    """
    rows = []
    for patch in patch_sizes:
        code = (
            f"import json, sys; sys.path.insert(0, {str(REPO_ROOT)!r}); from scripts.benchmark import _memory_probe; "
            f"print(json.dumps(_memory_probe({list(patch)!r}, {list(channels)!r}, {batch_size}, {num_samples}, "
            f"{device!r}, {amp!r}, {bool(use_checkpoint)})))"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        if result.returncode != 0:
            raise RuntimeError(f"memory probe for patch {patch} failed:\n{result.stderr[-3000:]}")
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    print("\n| device | patch | channels | batch | amp | gradient checkpointing | peak mem (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['device']} | {'x'.join(map(str, r['patch_size']))} | {r['channels']} | {r['batch']} | {r['amp']} | "
            f"{r['use_checkpoint']} | {r['peak_mem_gib']:.2f} |"
        )
    if output:
        Path(output).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    import fire

    fire.Fire({"throughput": throughput, "memory": memory}, serialize=lambda _: None)

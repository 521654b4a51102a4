# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Benchmarks of ``autoencoder_3d`` (commands of ``scripts/benchmark.py``):

    python scripts/benchmark.py throughput                         # autoencoder_3d, CPU or GPU
    python scripts/benchmark.py throughput --patch_size "[64,64,64]" --iterations 40
    python scripts/benchmark.py memory --patch_sizes "[[32,32,32],[64,64,64]]"
    python scripts/benchmark.py inference                          # cases/s of 1 and 2 processes (CPU)
    python scripts/benchmark.py inference --device cuda --processes "[1]" --cases 200 --shape "[128,128,128]"

``throughput`` runs, in one process and alternating, (a) the plain loop of MONAI's 3D latent-diffusion tutorial
(CPU ``CacheDataset`` + ``DataLoader``, fp32, the same AutoencoderKL + PatchDiscriminator, L1 + KL + least-squares
adversarial losses, batch and patch) and (b) the bundle's own trainer built from ``train.json`` with every
handler it normally has. It reports samples/s of each, their ratio, the bundle's data-wait fraction, peak
memory, and the model FLOPs of one bundle step with the model FLOPs utilisation they give against the device's bf16
peak (every ``*_throughput`` benchmark does). ``memory`` measures peak memory of training steps at each patch size,
each in a fresh subprocess. ``inference`` runs the bundle's inference command over a folder of volumes with one
process and with several under torchrun (``multi_gpu_inference.json``: the ranks share the cases), the same threads
per process, and reports the cases per second each run logs (first case read to last case written, start-up
excluded). Results are printed as a Markdown table and written as JSON.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from scripts.harness import tools
from scripts.harness.faults import RUN_SETTINGS, BundleCase

__all__ = [
    "BENCHMARKS",
    "THROUGHPUT",
    "fault_case",
    "inference",
    "memory",
    "memory_probe",
    "published_probe",
    "published_reconstruction",
    "throughput",
]

BUNDLE = "autoencoder_3d"


def _settings(patch_size, channels, batch_size, num_samples, device, amp=None, compile=False) -> dict:
    from common.utils import default_amp

    small = list(channels) != [32, 64, 64]
    return {
        "patch_size": list(patch_size),
        "channels": list(channels),
        "norm_num_groups": 8 if small else 16,
        "batch_size": batch_size,
        "num_samples": num_samples,
        "d_channels": 16 if small else 32,
        "device": device,
        "amp": amp or default_amp(device),
        "compile": bool(compile),
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


def _autoencoder_overrides(s: dict) -> dict:
    return {
        "patch_size": s["patch_size"],
        "channels": s["channels"],
        "norm_num_groups": s["norm_num_groups"],
        "batch_size": s["batch_size"],
        "num_samples": s["num_samples"],
        "d_channels": s["d_channels"],
        "adv_warmup_iterations": 0,
        "compile": s.get("compile", False),
    }


def _plain_loop(s: dict, data: list[dict], iterations: int, warmup: int, workers: int) -> float:
    """The training loop of MONAI's 3D latent-diffusion tutorial (fp32, CPU CacheDataset + DataLoader)."""
    from monai.losses import PatchAdversarialLoss

    from common.autoencoder.losses import kl_divergence

    loader = tools.plain_loader(s, data, workers)
    ae, disc = _networks(s, flash_attention=False)
    opt_g = torch.optim.Adam(ae.parameters(), lr=1e-4)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-4)
    adv = PatchAdversarialLoss(criterion="least_squares")
    l1 = torch.nn.L1Loss()

    def step(images: torch.Tensor) -> None:
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

    return tools.timed_loop(s, loader, step, iterations, warmup)


def throughput(
    patch_size=(32, 32, 32),
    channels=(16, 32, 32),
    batch_size: int = 2,
    num_samples: int = 2,
    iterations: int = 30,
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
        amp: the bundle's autocast, ``bf16``/``fp16``/``none`` (default: bf16 on GPUs, none on CPUs); the plain
            loop runs in fp32, as the tutorial does.
        compile: ``torch.compile`` the bundle's networks (its ``compile`` id); compilation happens in the warm-up.
        profile: also profile one bundle iteration with ``torch.profiler`` (its top kernels, in the result's
            ``profile``; :func:`scripts.harness.tools.kernel_profile`).
        baseline_workers: DataLoader workers of the plain loop (default: 4 on GPU machines, 0 on 2-core CPUs).
        num_threads: torch CPU threads.
        output: JSON file for the results.
    """
    dev, workers = tools.setup(device, num_threads, baseline_workers)
    s = _settings(patch_size, channels, batch_size, num_samples, dev, amp, compile)
    summary = {
        "device": tools.device_name(dev),
        "patch_size": list(patch_size),
        "channels": list(channels),
        "batch": f"{batch_size}x{num_samples}",
        "amp": s["amp"],
        "compile": s["compile"],
        "timed_iterations": iterations,
        **tools.alternate(
            s,
            "autoencoder_3d",
            _plain_loop,
            iterations,
            warmup,
            repeats,
            workers,
            extra=_autoencoder_overrides(s),
            profile=profile,
        ),
    }
    tools.print_throughput(
        summary,
        {
            "device": summary["device"],
            "patch": "x".join(map(str, patch_size)),
            "channels": list(channels),
            "batch": summary["batch"],
            "amp": s["amp"],
            "compile": s["compile"],
        },
    )
    if output:
        Path(output).write_text(json.dumps(summary, indent=2))
    return summary


def memory_probe(patch_size, channels, batch_size, num_samples, device, amp, use_checkpoint) -> dict:
    """One measurement (run in a fresh process): peak memory of three full training steps."""
    from common.autoencoder.adversarial import PatchAdversarialLoss
    from common.autoencoder.engines import AutoencoderGANTrainer
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
        "device": tools.device_name(dev),
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

    Each size runs in a fresh subprocess so the CPU figure (peak resident set size) is not inherited; a size that
    fails (e.g. out of memory) gives a row with its ``error`` and the other sizes are still measured.
    """
    rows = []
    for patch in patch_sizes:
        settings = {
            "patch_size": list(patch),
            "channels": list(channels),
            "batch_size": batch_size,
            "num_samples": num_samples,
            "device": device,
            "amp": amp,
            "use_checkpoint": bool(use_checkpoint),
        }
        try:
            rows.append(tools.run_probe(__name__, "memory_probe", **settings))
        except RuntimeError as exc:  # e.g. out of memory: keep the other rows (a larger patch would not fit)
            rows.append({**settings, "batch": batch_size * num_samples, "error": str(exc)[-500:]})
    tools.print_table(
        ["device", "patch", "channels", "batch", "amp", "gradient checkpointing", "peak mem (GiB)"],
        [
            [
                r.get("device", device),
                "x".join(map(str, r["patch_size"])),
                r["channels"],
                r["batch"],
                r["amp"],
                r["use_checkpoint"],
                "failed: " + r["error"].strip().splitlines()[-1][:80] if "error" in r else f"{r['peak_mem_gib']:.2f}",
            ]
            for r in rows
        ],
    )
    if output:
        Path(output).write_text(json.dumps(rows, indent=2))
    return rows


def fault_case(root: Path, seed: int) -> BundleCase:
    """The small ``autoencoder_3d`` job of the fault tests (:func:`scripts.harness.faults.make_case`): 4 training and
    2 validation phantoms at 24^3, 4 epochs, a validation every 2 so that a resumed run crosses one."""
    from common.demo.images import write_phantom_dataset

    write_phantom_dataset(root, n_train=4, n_val=2, shape=(24, 24, 24), seed=seed)
    args = {"dataset_dir": str(root), "max_epochs": 4, "val_interval": 2, "adv_warmup_iterations": 3}
    return BundleCase(
        BUNDLE,
        ["train.json", "tiny.json"],
        {**args, **RUN_SETTINGS, "seed": seed},
        weights=("autoencoder", "discriminator"),
        extra={"batch_size": 1},
    )


def _inference_rate(plan, prediction_dir: Path) -> dict:
    """Run an inference ``plan``; its logged throughput (cases, seconds, cases/s) and the outputs it wrote."""
    print("$ " + plan.shell(), flush=True)
    result = subprocess.run(plan.argv, cwd=plan.cwd, env=plan.environ(), capture_output=True, text=True)
    found = re.search(r"(\d+) case\(s\) run in ([\d.]+) s on (\d+) process\(es\): ([\d.]+) case/s", result.stdout)
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"inference failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return {
        "cases": int(found[1]),
        "seconds": float(found[2]),
        "processes": int(found[3]),
        "cases_per_s": float(found[4]),
        "written": len(list(prediction_dir.glob("*_recon.nii.gz"))),
    }


def inference(
    cases: int = 80,
    shape=(48, 48, 48),
    threads: int = 1,
    processes=(1, 2),
    device: str = "cpu",
    repeats: int = 2,
    work_dir: str | None = None,
    output: str | None = None,
) -> list[dict]:
    """Cases per second of ``inference.json`` (reconstruction) over ``cases`` random volumes of ``shape``, with a
        tiny model (``tiny.json``, one epoch), for each number of ``processes`` (more than one: torchrun with
        ``multi_gpu_inference.json``) at ``threads`` intra-op threads per process. ``device`` ``cpu`` hides the GPUs;
        ``cuda`` gives each process its GPU (as many processes as GPUs at most). Each count runs ``repeats`` times,
    alternating with the others, and its best run is reported. Every run must write every case."""
    import nibabel as nib
    import numpy as np

    from common.bundle_tools.launch import build_plan
    from common.demo.images import write_phantom_dataset

    work = Path(work_dir or tempfile.mkdtemp(prefix="inference_benchmark_"))
    write_phantom_dataset(work / "phantoms", n_train=2, n_val=1, shape=(24, 24, 24), seed=0)
    cpu = str(device) == "cpu"
    train = build_plan(
        BUNDLE,
        nproc_per_node=1,
        cpu=cpu,
        extra_configs=["tiny.json"],
        overrides={"dataset_dir": str(work / "phantoms"), "output_dir": str(work / "run"), "max_epochs": 1},
    )
    made = subprocess.run(train.argv, cwd=train.cwd, env=train.environ(), capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"training the model failed:\n{made.stderr[-3000:]}")
    (work / "cases").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(int(cases)):
        volume = rng.random(tuple(int(s) for s in shape)).astype(np.float32)
        nib.save(nib.Nifti1Image(volume, np.eye(4)), work / "cases" / f"case_{i:04d}.nii.gz")
    best: dict[int, dict] = {}
    for _ in range(int(repeats)):  # alternating, the best run of each count (others on the machine only slow runs)
        for n in processes:
            prediction_dir = work / f"predictions_{n}"
            overrides = {
                "dataset_dir": str(work / "cases"),
                "output_dir": str(work / "run"),
                "prediction_dir": str(prediction_dir),
                "num_threads": int(threads),
                "overwrite": True,
            }
            plan = build_plan(BUNDLE, nproc_per_node=int(n), cpu=cpu, overrides=overrides, job="inference")
            plan.env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
            row = {"device": "cpu" if cpu else tools.device_name(torch.device("cuda")), "threads": int(threads)}
            row.update(_inference_rate(plan, prediction_dir))
            if row["written"] != int(cases):
                raise RuntimeError(f"{n} process(es) wrote {row['written']} of {cases} cases.")
            if n not in best or row["cases_per_s"] > best[n]["cases_per_s"]:
                best[n] = {**row, "repeats": int(repeats)}
    rows = [best[int(n)] for n in processes]
    base = rows[0]["cases_per_s"]
    for row in rows:
        row["speedup"] = row["cases_per_s"] / base
    tools.print_table(
        ["device", "processes", "threads each", "cases", "seconds", "cases/s", "x one process"],
        [
            [
                r["device"],
                r["processes"],
                r["threads"],
                r["cases"],
                f"{r['seconds']:.2f}",
                f"{r['cases_per_s']:.2f}",
                f"{r['speedup']:.2f}",
            ]
            for r in rows
        ],
    )
    if output:
        Path(output).write_text(json.dumps(rows, indent=2))
    return rows


def published_probe(
    architecture: str, shape, num_splits, dim_split, device: str, reference: str, seed: int = 0
) -> dict:
    """One measurement (in a fresh process): whole-volume reconstruction (no sliding window) of a CT phantom of
    ``shape`` by the published network, its seconds and peak memory; the unsplit run (``num_splits`` 1) saves its
    output to ``reference``, the others compare with it."""
    import time

    from common.autoencoder.published import published_network
    from common.demo.images import make_ct_phantom
    from common.handlers.monitor import peak_memory_gib
    from common.utils import resolve_device

    dev = resolve_device(device)
    torch.manual_seed(seed)  # the same weights in every process
    network = published_network(architecture, dev, num_splits, dim_split, reconstructor=True).eval()
    ct = torch.as_tensor(make_ct_phantom(tuple(shape), seed=seed))
    x = ((ct.clamp(-1000, 1000) + 1000) / 2000)[None, None].to(dev)  # MAISI's HU window
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.no_grad(), torch.autocast(dev.type, enabled=dev.type == "cuda"):
        start = time.perf_counter()
        y = network(x)
        tools.sync(dev)
        seconds = time.perf_counter() - start
    if num_splits == 1:
        torch.save(y.float().cpu(), reference)
    diff = float((y.float().cpu() - torch.load(reference)).abs().max()) if Path(reference).is_file() else None
    return {
        "architecture": architecture,
        "shape": list(shape),
        "num_splits": num_splits,
        "dim_split": dim_split,
        "seconds": seconds,
        "peak_mem_gib": peak_memory_gib(dev),
        "max_abs_diff_vs_unsplit": diff,
        "output_range": [float(y.min()), float(y.max())],
        "device": tools.device_name(dev),
    }


def published_reconstruction(
    architecture: str = "maisi_vae",
    shape=(128, 128, 128),
    splits=(1, 4),
    dim_split: int = 1,
    device: str = "auto",
    output: str | None = None,
) -> list[dict]:
    """Whole-volume reconstruction by a published autoencoder (MAISI's VAE by default; random weights of its exact
    architecture, the cost does not depend on the values) with and without MAISI's split convolutions: seconds,
    peak memory (CPU: peak resident set size of the process) and the largest difference from the unsplit output.
    The first entry of ``splits`` must be 1 (the reference); each runs in a fresh process."""
    if list(splits)[:1] != [1]:
        raise ValueError(f"'splits' must start with 1 (the unsplit reference), got {list(splits)}.")
    rows = []
    with tempfile.TemporaryDirectory(prefix="published_") as tmp:
        reference = str(Path(tmp) / "unsplit.pt")
        for n in splits:
            settings = {"architecture": architecture, "shape": list(shape), "num_splits": int(n)}
            settings["dim_split"] = dim_split
            try:
                rows.append(
                    tools.run_probe(__name__, "published_probe", **settings, device=device, reference=reference)
                )
            except RuntimeError as exc:  # e.g. out of memory, or a split narrower than the kernel
                rows.append({**settings, "error": str(exc)[-500:]})
    tools.print_table(
        ["device", "network", "volume", "num_splits", "seconds", "peak mem (GiB)", "max |diff| vs unsplit"],
        [
            [
                r.get("device", device),
                r["architecture"],
                "x".join(map(str, r["shape"])),
                r["num_splits"],
                *(
                    ["failed: " + r["error"].strip().splitlines()[-1][:80], "", ""]
                    if "error" in r
                    else [
                        f"{r['seconds']:.1f}",
                        f"{r['peak_mem_gib']:.2f}",
                        "-" if r["max_abs_diff_vs_unsplit"] is None else f"{r['max_abs_diff_vs_unsplit']:.2e}",
                    ]
                ),
            ]
            for r in rows
        ],
    )
    if output:
        Path(output).write_text(json.dumps(rows, indent=2))
    return rows


BENCHMARKS = {
    "throughput": throughput,
    "memory": memory,
    "inference": inference,
    "published_reconstruction": published_reconstruction,
}

# the campaign's throughput rows (scripts/harness/campaign.py): (row name, benchmark, GPU settings, tiny settings)
THROUGHPUT = (
    (
        BUNDLE,
        "throughput",
        {"patch_size": [128, 128, 128], "channels": [32, 64, 64], "batch_size": 1, "num_samples": 2},
        {"patch_size": [32, 32, 32], "channels": [16, 32, 32], "batch_size": 1, "num_samples": 1},
    ),
)

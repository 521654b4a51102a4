# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Benchmarks of every bundle: training throughput against a plain PyTorch loop, peak memory, whole-volume
reconstruction and sampling cost, quality at equal budgets, and the GPU campaign that runs them all.

    python scripts/benchmark.py throughput                         # autoencoder_3d, CPU or GPU
    python scripts/benchmark.py memory --patch_sizes "[[32,32,32],[64,64,64]]"
    python scripts/benchmark.py vqgan_throughput                   # vqgan_3d, CPU or GPU
    python scripts/benchmark.py vqgan_memory                       # train.json network, 64^3 and 128^3 patches
    python scripts/benchmark.py vqgan_reconstruction               # reduced volume (128x128x151) on the CPU
    python scripts/benchmark.py ddpm_sampling                      # fast_ddpm_3d: 10-step grid vs 1000 steps
    python scripts/benchmark.py ddpm_quality                       # equal training budgets, fast vs baseline
    python scripts/benchmark.py ddpm_throughput                    # fast_ddpm_3d trainer vs a plain loop
    python scripts/benchmark.py mace_throughput                    # mace_survival trainer vs a plain loop
    python scripts/benchmark.py mace_smartcache                    # SmartCache replacement vs epoch time
    python scripts/benchmark.py xray_throughput                    # xray2ct_cascade trainer vs a plain loop
    python scripts/benchmark.py xray_quality                       # equal budgets: diffusion vs direct vs baseline
    python scripts/benchmark.py xray_quality --budgets "[300,1200,2400]"  # curves: direct, diffusion, residual
    python scripts/benchmark.py xray_memory                        # peak memory of one training step per stage
    python scripts/benchmark.py xray_uncertainty --comparison q.json --work_dir runs/  # the spread, calibrated
    python scripts/benchmark.py xray_consistency --comparison q.json --work_dir runs/  # corrections, checked
    python scripts/benchmark.py cpu_inference --bundle autoencoder_3d  # the network per window: fp32/bf16, ONNX, OpenVINO
    python scripts/benchmark.py demo_spread --bundle vqgan_3d --seeds "[0,1,2]"   # quickstart figures over seeds
    python scripts/benchmark.py campaign --plan                    # the GPU campaign: what it runs, minutes each
    python scripts/benchmark.py campaign --minutes 25 --output campaign.json   # every GPU measurement, best first

Each command is a function of the bundle's module in ``scripts/harness`` (the table:
:data:`scripts.harness.bundles.FAMILY_MODULES`), where its arguments are documented; ``campaign`` is
``scripts/harness/campaign.py``. Results are printed as Markdown tables and written as JSON (``--output``). ``<command> --help`` prints a command's
arguments.
"""

from __future__ import annotations

if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import sys

    import fire

    from scripts.harness.commands import benchmark_command, benchmarks

    fire.Fire(benchmarks(), command=benchmark_command(sys.argv[1:]), serialize=lambda _: None)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Train a bundle, or run its inference over a cohort, on one process, all GPUs of this node, several nodes, under
SLURM or in a Kubernetes job.

Builds the right command (``python -m monai.bundle run training`` for one process, torchrun with the bundle's
``multi_gpu_train.json`` otherwise; with ``--job inference`` the same with ``inference.json`` and
``multi_gpu_inference.json``, the ranks sharing the cases) and runs it from the repository root; ``--dry_run True``
prints it instead.
Every ``--key value`` that is not a launcher option is a bundle override (``--max_epochs 5``); ``--overrides
"{...}"`` passes ids that clash with launcher options. Examples::

    python scripts/launch.py autoencoder_3d --max_epochs 5                       # all GPUs here (or 1 CPU process)
    python scripts/launch.py autoencoder_3d --cpu True --nproc_per_node 2 --extra_configs "['tiny.json']"
    python scripts/launch.py autoencoder_3d --nnodes 2 --node_rank 0 --rdzv_endpoint node001:29500  # on each node
    srun python scripts/launch.py autoencoder_3d --slurm True --max_restarts 3   # one per node of an allocation
    python scripts/launch.py autoencoder_3d --nproc_per_node 8 --dry_run True    # print, do not run
    python scripts/launch.py autoencoder_3d --job inference --dataset_dir /data/ct  # score a folder on all GPUs

Exit status: the command's (for inference, see docs/inference.md); 2 for invalid arguments (the message names the bad
value).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from common.bundle_tools.launch import LaunchError, build_plan, run_plan
from common.errors import UserError

__all__ = ["main"]


def main(
    bundle: str,
    nnodes: int | None = None,
    node_rank: int | None = None,
    nproc_per_node: int | str = "auto",
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    rdzv_port: int = 29500,
    max_restarts: int = 0,
    cpu: bool = False,
    slurm: bool | str = "auto",
    extra_configs: list[str] | str | None = None,
    overrides: dict[str, Any] | None = None,
    run_id: str | None = None,
    log_dir: str | None = None,
    dry_run: bool = False,
    job: str = "training",
    **bundle_overrides: Any,
) -> None:
    """Launch (or with ``dry_run`` print) the training or inference command of ``bundle``.

    Args:
        bundle: bundle name under ``bundles/`` (or a bundle folder).
        nnodes: number of nodes (default 1; SLURM_NNODES under SLURM).
        node_rank: index of this node in ``[0, nnodes)`` (default 0; SLURM_NODEID under SLURM).
        nproc_per_node: ``auto`` (one process per visible GPU, one on the CPU) or a number of processes.
        rdzv_endpoint: ``host[:port]`` of the rendezvous on node 0; required for several nodes outside SLURM.
        rdzv_id: id shared by the nodes of one job (default: SLURM_JOB_ID or the bundle name).
        rdzv_port: port for an endpoint given without one and for the SLURM-derived endpoint.
        max_restarts: torchrun restarts of the process group after a failure; training resumes from last.pt.
        cpu: train on the CPU even when GPUs are visible.
        slurm: ``auto`` (read the SLURM environment when inside a job), ``True`` or ``False``.
        extra_configs: config files merged last: paths, or names in the bundle's ``configs/`` (``tiny.json``).
        overrides: bundle overrides as a dict (for ids that clash with the options above).
        run_id: the config id to run (default: ``training``, ``run`` for inference).
        log_dir: folder for torchrun's per-attempt, per-rank log files.
        dry_run: print the command (copy-pasteable) and exit with status 0.
        job: ``training`` or ``inference`` (``inference.json``; ``multi_gpu_inference.json`` for more processes).
        bundle_overrides: any other ``--key value``: a bundle override (``--max_epochs 5``).
    """
    try:
        if overrides is not None and not isinstance(overrides, dict):
            raise LaunchError(f"overrides must be a dict such as \"{{'max_epochs': 5}}\", got {overrides!r}.")
        plan = build_plan(
            bundle,
            nnodes=nnodes,
            node_rank=node_rank,
            nproc_per_node=nproc_per_node,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=rdzv_id,
            rdzv_port=rdzv_port,
            max_restarts=max_restarts,
            cpu=cpu,
            slurm=slurm,
            extra_configs=extra_configs,
            overrides={**(overrides or {}), **bundle_overrides},
            run_id=run_id,
            log_dir=log_dir,
            job=job,
        )
    except UserError as e:  # a LaunchError, or an unknown bundle
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for note in plan.notes:
        print(note, file=sys.stderr)
    if dry_run:
        print(plan.shell(from_dir=Path.cwd()), flush=True)
        sys.exit(0)
    print(f"launch: {plan.shell(from_dir=Path.cwd())}", file=sys.stderr, flush=True)
    sys.exit(run_plan(plan, replace_process=True))


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    fire.Fire(main)

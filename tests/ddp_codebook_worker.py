# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Worker of the 2-process (gloo, CPU) codebook synchronisation test in ``tests/test_vqgan_networks.py``.

Run as ``torchrun --nproc_per_node=2 tests/ddp_codebook_worker.py OUTDIR``. Every rank seeds its RNGs with
``SEED + rank`` (``SEED`` shifted by ``BUNDLE_TEST_SEED``, so the initialisation/restart candidates each rank draws
differ) and feeds its own random latents to the same small ``EMAVectorQuantizer``. It runs, in one process group:

* ``ema``: a quantizer started from a shared, already initialised codebook with ``no_random_restart=True``
  (the codebook at the start of every step is recorded, so a single process can replay each step's update on the
  concatenated batches);
* ``restart``: a fresh quantizer (initialised from the first batch) with dead-code restarts on. Rank 0's first
  batch holds one far-away vector (``OUTLIER`` in every channel): the initialisation picks all 16 vectors of that
  batch for the 16 codes, so it becomes a code whose count is 1.0 after step 1; no later vector comes near it, so
  its count drops to 0.9 < ``RESTART_THRES`` at step 2 and it is restarted: a restart by construction;
* ``metric``: ``CodebookMetric`` usage and perplexity over eval-mode batches that differ per rank;
* ``perturb``: rank 1 changes one buffer, then ``assert_replicas_equal`` must raise on every rank.

Each rank saves what it saw to ``OUTDIR/rank{r}.pt`` and the replica-check message to ``OUTDIR/error_rank{r}.txt``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from common.utils import assert_replicas_equal
from common.vqgan.metrics import CodebookMetric
from common.vqgan.networks import EMAVectorQuantizer
from tests.helpers import shifted_seed

N_CODES, DIM, STEPS, DECAY = 16, 4, 4, 0.9
SEED = shifted_seed(100)
SHAPE = (2, DIM, 2, 2, 2)  # 16 latent vectors per rank and step: rank 0's first batch initialises all 16 codes
RESTART_THRES = 0.95  # a code unused for one step after init drops to 0.9 (no float boundary at exactly 1.0)
OUTLIER = -50.0  # far from every N(0, 1) (rank 0) and N(3, 1) (rank 1) latent vector


def rank_latents(rank: int) -> list[torch.Tensor]:
    """This rank's training latents: different per rank (and shifted on rank 1 so codes go unused there); rank 0's
    first batch holds one vector at ``OUTLIER`` (see the module docstring)."""
    gen = torch.Generator().manual_seed(SEED + 1000 * (rank + 1))
    latents = [torch.randn(SHAPE, generator=gen) + 3.0 * rank for _ in range(STEPS)]
    if rank == 0:
        latents[0][0, :, 0, 0, 0] = OUTLIER
    return latents


def shared_start() -> dict[str, torch.Tensor]:
    """An initialised codebook identical on every rank (drawn from a generator both ranks seed alike)."""
    gen = torch.Generator().manual_seed(SEED)
    codes = torch.randn(N_CODES, DIM, generator=gen) * 2.0
    return {"embeddings": codes, "embed_sum": codes.clone(), "cluster_size": torch.ones(N_CODES)}


def replica_check(modules: dict) -> int | str:
    """``assert_replicas_equal``'s count, or its error message (so the test reports it instead of a crash)."""
    try:
        return assert_replicas_equal(modules)
    except RuntimeError as exc:
        return str(exc)


def buffers(quantizer: EMAVectorQuantizer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in quantizer.state_dict().items()}


def main(outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED + rank)
    latents = rank_latents(rank)
    result: dict = {"latents": latents}

    # ---- ema: exact single-process reference possible
    ema = EMAVectorQuantizer(N_CODES, DIM, decay=DECAY, no_random_restart=True).train()
    start = shared_start()
    with torch.no_grad():
        for key, value in start.items():
            getattr(ema, key).copy_(value)
        ema.initialized.fill_(True)
    result["ema_start"] = start
    codebooks, steps = [], []
    for z in latents:
        codebooks.append(buffers(ema))  # the codebook this step assigns with and updates from
        steps.append(ema(z))
    result["ema_codebooks"] = [*codebooks, buffers(ema)]
    result["ema_indices"] = [s["indices"] for s in steps]
    result["ema_perplexity"] = [s["perplexity"] for s in steps]
    result["ema_usage"] = [s["codebook_usage"] for s in steps]
    result["ema_buffers"] = buffers(ema)
    result["ema_replicas"] = replica_check({"quantizer": ema})

    # ---- restart: initialisation from the first batch and dead-code restarts, candidates from rank 0
    restart = EMAVectorQuantizer(N_CODES, DIM, decay=DECAY, restart_thres=RESTART_THRES).train()
    result["restart_before_init"] = restart.embeddings.clone()  # differs per rank (seed + rank)
    inits: list[torch.Tensor] = []
    initialise = restart._initialise

    def spy(flat: torch.Tensor) -> None:
        fresh = not bool(restart.initialized)
        initialise(flat)
        if fresh:  # the calls after the first change nothing
            inits.append(restart.embeddings.clone())

    restart._initialise = spy
    restart_steps = [restart(z) for z in latents]
    result["restart_init"] = inits
    result["restart_counts"] = [float(s["codebook_restarts"]) for s in restart_steps]
    result["restart_buffers"] = buffers(restart)
    result["restart_replicas"] = replica_check({"quantizer": restart, "ema": ema})

    # ---- metric: eval-mode histograms differ per rank; the metric reports the all-rank statistics
    restart.eval()
    usage, perplexity = CodebookMetric(restart, "usage"), CodebookMetric(restart, "perplexity")
    usage.reset()
    codes = [0, 1, 2, 3, 0, 1, 2, 3] if rank == 0 else list(range(4, 12))
    eval_latent = restart.embeddings[codes].t().reshape(1, DIM, len(codes), 1, 1).clone()
    eval_out = restart(eval_latent)
    result["eval_indices"] = eval_out["indices"].flatten()
    result["local_usage_counts"] = restart.usage_counts.clone()
    result["metric_usage"] = usage.compute()
    result["metric_perplexity"] = perplexity.compute()
    result["eval_buffers"] = buffers(restart)

    # ---- perturb: one buffer differs on rank 1
    perturbed = copy.deepcopy(ema)
    if rank == 1:
        with torch.no_grad():
            perturbed.embed_sum[0, 0] += 1.0
    try:
        assert_replicas_equal({"quantizer": perturbed})
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    Path(outdir, f"error_rank{rank}.txt").write_text(message)

    torch.save(result, Path(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

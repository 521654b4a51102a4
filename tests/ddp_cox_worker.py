# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Worker of the 2-process (gloo, CPU) Cox-loss test in ``tests/test_survival_losses.py``.

Run as ``torchrun --nproc_per_node=2 tests/ddp_cox_worker.py OUTDIR``. Every scenario builds the same tiny linear
model (:func:`make_model`), wraps it in ``DistributedDataParallel``, gives each rank its rows of the shared batch
(:func:`full_batch`, tied times), runs one forward/backward of :func:`common.survival.losses.cox_loss` and records
the loss and the parameter gradient. Scenarios (name -> (rows of rank 0, rows of rank 1, global risk set,
events kept)) are in :data:`SCENARIOS`. Each rank saves ``OUTDIR/rank{r}.pt``.

The features and weights are fixed numbers, not draws, so what the test asserts about the gradients (large enough
to compare, different without the global risk set) holds by construction.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common.survival.losses import cox_loss

N, FEATURES = 12, 5
WEIGHT = (0.6, -0.4, 0.3, 0.2, -0.5)
# name: (rank-0 rows, rank-1 rows, global_risk_set, event mask or None)
SCENARIOS: dict[str, tuple[list[int], list[int], bool, str]] = {
    "global": (list(range(0, 6)), list(range(6, 12)), True, "all"),
    "uneven": (list(range(0, 7)), list(range(7, 12)), True, "all"),
    "local": (list(range(0, 6)), list(range(6, 12)), False, "all"),
    "events_on_rank1_only": (list(range(0, 6)), list(range(6, 12)), True, "rank1"),
    "no_events": (list(range(0, 6)), list(range(6, 12)), True, "none"),
}


def full_batch(events: str = "all") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared batch: features (``sin(0.7 (i + 1) (j + 1) + 0.3 j)`` for row ``i`` and feature ``j``: fixed,
    of full rank, no two rows alike), times with ties (within and across the two halves), events.

    Args:
        events: ``"all"`` keeps every event, ``"rank1"`` keeps only those of rows 6..11, ``"none"`` drops all.
    """
    i = torch.arange(N, dtype=torch.float32).unsqueeze(1)
    j = torch.arange(FEATURES, dtype=torch.float32).unsqueeze(0)
    x = torch.sin(0.7 * (i + 1) * (j + 1) + 0.3 * j)
    time = torch.tensor([2.0, 1.0, 3.0, 1.0, 2.0, 4.0, 1.0, 2.0, 3.0, 5.0, 2.0, 1.0])
    event = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    if events == "rank1":
        event[:6] = 0.0
    elif events == "none":
        event[:] = 0.0
    return x, time, event


def make_model() -> nn.Module:
    """A linear log-hazard with the fixed weights ``WEIGHT`` (a shared bias cancels in the partial likelihood)."""
    model = nn.Linear(FEATURES, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([WEIGHT]))
    return model


def main(outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {}
    for name, (rows0, rows1, global_risk_set, events) in SCENARIOS.items():
        rows = rows0 if rank == 0 else rows1
        x, time, event = full_batch(events)
        model = nn.parallel.DistributedDataParallel(make_model())
        loss = cox_loss(model(x[rows]), time[rows], event[rows], global_risk_set=global_risk_set)
        loss.backward()
        result[name] = {"loss": loss.detach(), "grad": model.module.weight.grad.detach().clone()}
        # a DDP module's reducer holds the process group: free it (and the graph) before the group goes
        del model, loss
    gc.collect()
    torch.save(result, Path(outdir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

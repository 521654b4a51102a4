# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Keeping the non-trained state of DDP replicas identical."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from torch import nn

from common.networks.wrappers import unwrap

__all__ = ["BufferAverager", "average_buffers"]

logger = logging.getLogger(__name__)


@torch.no_grad()
def average_buffers(module: nn.Module) -> int:
    """Replace every floating-point buffer of ``module`` (e.g. BatchNorm running means and variances) by its mean
    over all ranks; integer buffers (``num_batches_tracked``) are the same on every rank and are left alone.

    DDP averages gradients but not buffers: each rank's BatchNorm running statistics follow its own batches, so
    without this an evaluation on several ranks would use different statistics per rank and the replicas would
    differ (timm's ``distribute_bn(reduce=True)`` does the same). A collective: every rank must call it. Without a
    process group it does nothing.

    Returns:
        The number of buffers averaged.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return 0
    buffers = [b for b in unwrap(module).buffers() if b.is_floating_point()]
    world = dist.get_world_size()
    for buffer in buffers:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        buffer.div_(world)
    return len(buffers)


class BufferAverager:
    """At the end of every epoch, average the floating-point buffers of ``network`` over all ranks (see
    :func:`average_buffers`). Attach it to the trainer before the validation handler, so that validation,
    checkpoints and the final model use the same statistics on every rank.

    Args:
        network: the trained network (DDP/compile wrappers are unwrapped).
    """

    def __init__(self, network: nn.Module) -> None:
        self.network = network

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        count = average_buffers(self.network)
        if count and engine.state.epoch == 1:
            logger.info(f"averaging {count} buffer(s) (BatchNorm statistics) over the ranks after every epoch")

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Wrapping networks for training (SyncBatchNorm, DDP, torch.compile) and for inference (reconstruction only), and
applying them to whole volumes by blended windows."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from monai.inferers import sliding_window_inference
from torch import nn

__all__ = [
    "InferenceView",
    "LatentDecoder",
    "LatentEncoder",
    "ReconstructionNetwork",
    "blended_windows",
    "clean_state_dict",
    "inference_view",
    "prepare_network",
    "split_autoencoder_output",
    "unwrap",
]


def prepare_network(
    network: nn.Module,
    device: torch.device | str,
    distributed: bool | None = None,
    compile: bool = False,
    sync_batchnorm: bool = False,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    broadcast_buffers: bool = False,
    compile_kwargs: Mapping | None = None,
) -> nn.Module:
    """Move ``network`` to ``device`` and wrap it for (distributed, compiled) training.

    The returned module is what the trainer calls; keep a reference to the original ``network`` for saving,
    so checkpoints carry clean keys (no ``module.`` or ``_orig_mod.`` prefixes).

    Args:
        network: the plain network.
        device: this rank's device.
        distributed: wrap in ``DistributedDataParallel``; default: whenever a process group is initialised.
        compile: apply ``torch.compile`` (after DDP, so DDP's bucketing still sees the graph breaks).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm; applied only for CUDA + distributed, since
            SyncBatchNorm has no CPU/gloo implementation.
        static_graph: DDP ``static_graph``. Off by default: a static graph breaks ``no_sync`` (PyTorch asserts
            ``expect_autograd_hooks_`` in the reducer), which gradient accumulation and micro-batching rely on.
        find_unused_parameters: DDP ``find_unused_parameters``.
        broadcast_buffers: DDP ``broadcast_buffers``; off by default (BatchNorm statistics stay per rank or are
            synchronised by SyncBatchNorm).
        compile_kwargs: extra arguments of ``torch.compile``.
    """
    device = torch.device(device)
    network = network.to(device)
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        if sync_batchnorm and device.type == "cuda":
            network = nn.SyncBatchNorm.convert_sync_batchnorm(network)
        if not any(p.requires_grad for p in network.parameters()):
            raise ValueError(f"{type(network).__name__} has no trainable parameters to wrap in DDP.")
        network = nn.parallel.DistributedDataParallel(
            network,
            device_ids=[device] if device.type == "cuda" else None,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
        )
    if compile:
        network = torch.compile(network, **dict(compile_kwargs or {}))
    return network


def unwrap(network: nn.Module) -> nn.Module:
    """The plain module inside DDP and/or ``torch.compile`` wrappers."""
    while True:
        if hasattr(network, "_orig_mod"):
            network = network._orig_mod
        elif isinstance(network, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            network = network.module
        else:
            return network


def clean_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip ``module.`` and ``_orig_mod.`` prefixes left by DDP and ``torch.compile``.

    ``module`` is removed only as a leading prefix: inner submodules may legitimately be called ``module``
    (e.g. MONAI's ``ActivationCheckpointWrapper``); ``_orig_mod`` (a compiled submodule) is removed anywhere.
    """
    cleaned = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        while len(parts) > 1 and parts[0] in ("module", "_orig_mod"):
            parts = parts[1:]
        parts = [p for p in parts[:-1] if p != "_orig_mod"] + parts[-1:]
        cleaned[".".join(parts)] = value
    return cleaned


def split_autoencoder_output(output) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Split the output of an autoencoder into the reconstruction and its auxiliary tensors.

    Handles MONAI ``AutoencoderKL`` (``(recon, z_mu, z_sigma)``), ``VQVAE`` (``(recon, quantization_loss)``),
    a dict with a ``pred``/``recon`` key, and a plain tensor.

    Returns:
        ``(reconstruction, extras)`` where ``extras`` may hold ``z_mu``/``z_sigma`` or ``quantization_loss``.
    """
    if isinstance(output, torch.Tensor):
        return output, {}
    if isinstance(output, Mapping):
        key = "pred" if "pred" in output else "recon"
        if key not in output:
            raise ValueError(f"autoencoder output dict needs a 'pred' or 'recon' key, got keys {list(output)}.")
        return output[key], {k: v for k, v in output.items() if k != key}
    if isinstance(output, (tuple, list)):
        if len(output) == 3:
            return output[0], {"z_mu": output[1], "z_sigma": output[2]}
        if len(output) == 2:
            return output[0], {"quantization_loss": output[1]}
    raise ValueError(
        f"unsupported autoencoder output: expected a tensor, (recon, z_mu, z_sigma) or (recon, quantization_loss), "
        f"got {type(output).__name__} of length {len(output) if hasattr(output, '__len__') else 'n/a'}."
    )


class InferenceView(nn.Module):
    """Base of inference views: checkpoints of the wrapped network load and save without a prefix.

    A view starts in eval mode: MONAI evaluators run the network inside ``eval_mode``, which afterwards calls
    ``train()`` on every module that was in training mode when it started - a fresh view would otherwise put the
    wrapped network (e.g. a VQ-GAN whose codebook updates in training mode) back into training mode after each
    inference batch.
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = network
        self.eval()

    def state_dict(self, *args, **kwargs):
        return unwrap(self.network).state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return unwrap(self.network).load_state_dict(clean_state_dict(state_dict), strict=strict, assign=assign)


class ReconstructionNetwork(InferenceView):
    """Inference view of an autoencoder: ``forward(x)`` returns only the reconstruction tensor.

    For a variational autoencoder the deterministic path (decode the posterior mean) is used, so validation
    and inference are repeatable; this is what sliding-window inferers and exporters expect.

    Args:
        network: an autoencoder (MONAI ``AutoencoderKL``, ``VQVAE`` or any module returning a tensor/tuple).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = unwrap(self.network)
        if hasattr(net, "reconstruct"):
            return net.reconstruct(x)
        return split_autoencoder_output(self.network(x))[0]


class LatentEncoder(InferenceView):
    """Inference view of an autoencoder's encoder: ``forward(x)`` returns the latent map.

    ``AutoencoderKL`` gives the posterior mean (deterministic), VQ-VAE style networks the quantized latent
    (``encode_stage_2_inputs``), or with ``quantized=False`` the continuous encoder output (to be stitched
    over sliding windows and quantized afterwards, see ``common.data.pipeline.VQCodesd``).

    Args:
        network: the autoencoder.
        quantized: for VQ networks, return the quantized latent.
    """

    def __init__(self, network: nn.Module, quantized: bool = True) -> None:
        super().__init__(network)
        self.quantized = bool(quantized)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = unwrap(self.network)
        if hasattr(net, "encode_stage_2_inputs") and not hasattr(net, "sampling") and self.quantized:
            return net.encode_stage_2_inputs(x)
        encoded = net.encode(x)
        return encoded[0] if isinstance(encoded, (tuple, list)) else encoded


class LatentDecoder(InferenceView):
    """Inference view of an autoencoder's decoder: ``forward(latent)`` returns the decoded image.

    Args:
        network: the autoencoder (``decode`` of a VQ-GAN also accepts one channel of code indices).
    """

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return unwrap(self.network).decode(latent)


#: the views of an autoencoder that inference configs name by ``mode``
INFERENCE_VIEWS = ("reconstruct", "encode", "decode")


def inference_view(network: nn.Module, mode: str = "reconstruct", quantized: bool = True) -> InferenceView:
    """The inference view of an autoencoder for an inference config's ``mode``: ``reconstruct``
    (:class:`ReconstructionNetwork`), ``encode`` (:class:`LatentEncoder`, with ``quantized``) or ``decode``
    (:class:`LatentDecoder`).

    Raises:
        ValueError: for another ``mode``.
    """
    if mode == "reconstruct":
        return ReconstructionNetwork(network)
    if mode == "encode":
        return LatentEncoder(network, quantized=quantized)
    if mode == "decode":
        return LatentDecoder(network)
    raise ValueError(f"'mode' must be one of {INFERENCE_VIEWS}, got {mode!r}.")


def blended_windows(
    x: torch.Tensor,
    fn: Callable[[torch.Tensor], torch.Tensor],
    roi_size: Sequence[int] | None,
    sw_batch_size: int = 1,
    overlap: float = 0.25,
) -> torch.Tensor:
    """``fn`` applied to ``x`` directly when it fits ``roi_size`` (or ``roi_size`` is ``None``), else to overlapping
    ``roi_size`` windows whose outputs are blended with Gaussian weights (MONAI ``sliding_window_inference``)."""
    if roi_size is None or all(s <= r for s, r in zip(x.shape[2:], roi_size)):
        return fn(x)
    return sliding_window_inference(x, list(roi_size), int(sw_batch_size), fn, overlap=overlap, mode="gaussian")

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Wrapping networks for training (SyncBatchNorm, DDP, torch.compile, the memory layout, gradient checkpointing) and
for inference (reconstruction only), and applying them to whole volumes by blended windows, with fewer windows at
once after running out of GPU memory."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from monai.inferers import SlidingWindowInferer, sliding_window_inference
from torch import nn

from common.errors import OutOfMemoryBackoffError
from common.utils import inference_autocast

__all__ = [
    "MEMORY_FORMATS",
    "BackoffSlidingWindowInferer",
    "InferenceView",
    "LatentDecoder",
    "LatentEncoder",
    "ReconstructionNetwork",
    "blended_windows",
    "clean_state_dict",
    "enable_gradient_checkpointing",
    "inference_view",
    "memory_format_problems",
    "out_of_memory_message",
    "prepare_network",
    "redo_after_out_of_memory",
    "release_cached_memory",
    "split_autoencoder_output",
    "to_memory_format",
    "unwrap",
    "window_problems",
    "with_window_backoff",
]

logger = logging.getLogger(__name__)

#: the memory layouts of 5-D (``B, C, D, H, W``) tensors a network and its inputs may use: ``contiguous``
#: (NCDHW) or ``channels_last_3d`` (NDHWC, what cuDNN's fastest 3D convolution kernels read)
MEMORY_FORMATS = ("contiguous", "channels_last_3d")


def memory_format_problems(memory_format: str) -> list[str]:
    """The memory layout of a step's tensors: one of :data:`MEMORY_FORMATS`."""
    if memory_format in MEMORY_FORMATS:
        return []
    return [f"'memory_format' must be one of {MEMORY_FORMATS}, got {memory_format!r}."]


def _memory_format(name: str) -> torch.memory_format:
    problems = memory_format_problems(name)
    if problems:
        raise ValueError(problems[0])
    return torch.channels_last_3d if name == "channels_last_3d" else torch.contiguous_format


def to_memory_format(value: Any, memory_format: str = "contiguous") -> Any:
    """``value`` with its 5-D tensors in ``memory_format`` (one of :data:`MEMORY_FORMATS`).

    A module is converted in place (its 5-D parameters and buffers: 3D convolution kernels) and returned; a 5-D
    tensor is returned in that layout, another tensor (2-D X-rays, time steps) contiguous (a copy only when its
    layout differs); tuples, lists and dicts are converted item by item; anything else (``None``, numbers) is
    returned unchanged. The values are the same: only the strides change, so a layout is a speed setting, never a
    change of the arithmetic beyond the summation order of a kernel.

    Raises:
        ValueError: for an unknown ``memory_format``.
    """
    fmt = _memory_format(memory_format)
    if isinstance(value, nn.Module):
        for tensor in [*value.parameters(), *value.buffers()]:
            if tensor.dim() == 5:
                tensor.data = tensor.data.contiguous(memory_format=fmt)
        return value
    if isinstance(value, torch.Tensor):
        return value.contiguous(memory_format=fmt) if value.dim() == 5 else value.contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(to_memory_format(v, memory_format) for v in value)
    if isinstance(value, Mapping):
        return {k: to_memory_format(v, memory_format) for k, v in value.items()}
    return value


def enable_gradient_checkpointing(network: nn.Module) -> bool:
    """Turn on activation (gradient) checkpointing in ``network`` where it supports it: a
    ``set_gradient_checkpointing(enabled)`` method (:class:`common.xray2ct.networks.XrayCTDenoiser`) or a
    ``use_checkpoint`` flag read at forward time (MONAI ``AutoencoderKL``).

    Returns:
        ``True`` when checkpointing was off and is now on; ``False`` when it was on already or is not supported.
    """
    net = unwrap(network)
    if getattr(net, "gradient_checkpointing", None) is False and hasattr(net, "set_gradient_checkpointing"):
        net.set_gradient_checkpointing(True)
        return True
    if getattr(net, "use_checkpoint", None) is False:
        net.use_checkpoint = True
        return True
    return False


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
    memory_format: str = "contiguous",
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
        memory_format: the layout of the network's 5-D weights (:func:`to_memory_format`); trainers convert their
            inputs to the same layout (their ``memory_format`` setting).

    Raises:
        ValueError: for an unknown ``memory_format``.
    """
    device = torch.device(device)
    network = to_memory_format(network.to(device), memory_format)
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


def window_problems(sw_batch_size: int, overlap: float) -> list[str]:
    """The sliding-window settings of an inference config, one line per invalid value: windows per forward pass
    (``sw_batch_size``, an integer >= 1) and the share of a window its neighbours cover (``overlap``, a number in
    [0, 1): at 1 the windows would not advance)."""
    problems = []
    if isinstance(sw_batch_size, bool) or not isinstance(sw_batch_size, int) or sw_batch_size < 1:
        problems.append(f"'sw_batch_size' must be an integer >= 1 (windows per forward pass), got {sw_batch_size!r}.")
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap < 1:
        problems.append(
            f"'overlap' must be a number in [0, 1) (the share of a window its neighbours cover), got {overlap!r}."
        )
    return problems


def blended_windows(
    x: torch.Tensor,
    fn: Callable[[torch.Tensor], torch.Tensor],
    roi_size: Sequence[int] | None,
    sw_batch_size: int = 1,
    overlap: float = 0.25,
    owner: Any = None,
) -> torch.Tensor:
    """``fn`` applied to ``x`` directly when it fits ``roi_size`` (or ``roi_size`` is ``None``), else to overlapping
    ``roi_size`` windows whose outputs are blended with Gaussian weights (MONAI ``sliding_window_inference``).

    With an ``owner`` (a sampler or codec with ``sw_batch_size`` and ``oom_backoff`` attributes), the windows per
    batch are the owner's, halved after an out-of-memory error (:func:`with_window_backoff`)."""
    if roi_size is None or all(s <= r for s, r in zip(x.shape[2:], roi_size)):
        return fn(x)
    if owner is None:
        return sliding_window_inference(x, list(roi_size), int(sw_batch_size), fn, overlap=overlap, mode="gaussian")
    return with_window_backoff(
        owner,
        lambda: sliding_window_inference(
            x, list(roi_size), int(owner.sw_batch_size), fn, overlap=overlap, mode="gaussian"
        ),
        getattr(owner, "oom_backoff", True),
    )


def out_of_memory_message(error: BaseException) -> str:
    """The first line of an out-of-memory error's message (CUDA's names the size it tried to allocate)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def release_cached_memory() -> None:
    """Return the CUDA caching allocator's free blocks to the device after an out-of-memory error (a no-op without
    CUDA), so that a redone step starts from the memory the failed one held."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def redo_after_out_of_memory(
    run: Callable[[], Any],
    reduce: Callable[[], str | None],
    where: str,
    current: Callable[[], str],
    advice: str,
    enabled: bool = True,
    undo: Callable[[], None] | None = None,
) -> Any:
    """``run()``, redone after a ``torch.OutOfMemoryError`` with less memory: ``undo()`` puts back what the failed
    attempt changed, the cached memory is released and, when ``enabled``, ``reduce()`` lowers what ``run`` needs
    and says what it changed (logged), or returns ``None`` when nothing is left to reduce.

    Args:
        run: the work; it reads the settings ``reduce`` changes when it is called.
        reduce: lowers the memory ``run`` needs; what it changed, or ``None``.
        where: what ``run`` is, in messages (``the training step of iteration 3 (epoch 1)``).
        current: the settings ``reduce`` works on, for the error message.
        advice: what the user can do, for the error message.
        enabled: whether to redo (``oom_backoff``); off, the first error becomes an :class:`OutOfMemoryBackoffError`.
        undo: restores the state a failed attempt may have changed (gradients, buffers).

    Raises:
        OutOfMemoryBackoffError: when nothing is left to reduce, or when not ``enabled``.
    """
    while True:
        try:
            return run()
        except torch.OutOfMemoryError as error:
            failure = out_of_memory_message(error)
        # outside the except block, so that the traceback's frames (and the tensors they hold) are released
        if undo is not None:
            undo()
        release_cached_memory()
        change = reduce() if enabled else None
        if change is None:
            tried = "nothing is left to reduce" if enabled else "oom_backoff is off"
            raise OutOfMemoryBackoffError(f"out of GPU memory in {where} ({failure}); {tried} ({current()}). {advice}")
        logger.warning(f"out of GPU memory in {where}: {change}; redoing it ({failure}).")


def with_window_backoff(
    owner: Any, run: Callable[[], Any], enabled: bool = True, what: str = "sliding-window inference"
) -> Any:
    """``run()``, redone after a ``torch.OutOfMemoryError`` with ``owner.sw_batch_size`` (the windows forwarded
    at once, which ``run`` reads) halved (:func:`redo_after_out_of_memory`); the smaller value is kept for the next
    calls.

    Args:
        owner: an object with an ``sw_batch_size`` attribute (an inferer, a sampler).
        run: the inference, reading ``owner.sw_batch_size`` when called.
        enabled: whether to back off (``oom_backoff``).
        what: what ``run`` is, in messages.

    Raises:
        OutOfMemoryBackoffError: at one window per batch, or when not ``enabled``.
    """

    def halve() -> str | None:
        windows = int(owner.sw_batch_size)
        if windows <= 1:
            return None
        owner.sw_batch_size = windows // 2
        return f"sw_batch_size halved from {windows} to {owner.sw_batch_size}"

    return redo_after_out_of_memory(
        run,
        halve,
        what,
        lambda: f"sw_batch_size {int(owner.sw_batch_size)}",
        "Lower the window size (patch_size / roi_size), or use a GPU with more memory.",
        enabled,
    )


class BackoffSlidingWindowInferer(SlidingWindowInferer):
    """MONAI's ``SlidingWindowInferer`` that survives running out of GPU memory: the volume is redone with half the
    windows per batch (:func:`with_window_backoff`), which blends to the same output up to the summation order.
    Each batch of windows runs under the inference autocast of ``amp`` (:func:`common.utils.inference_autocast`, on
    the GPU or the CPU) with the network and the windows in ``memory_format``; the blend is in the input's dtype.

    Args:
        oom_backoff: back off (default); ``False`` turns an out-of-memory error into an
            :class:`common.errors.OutOfMemoryBackoffError` at once.
        amp: ``none`` (fp32), ``bf16`` or ``fp16``.
        memory_format: one of :data:`MEMORY_FORMATS` (``channels_last_3d``: 1.15x the contiguous layout for
            autoencoder_3d's network on a CPU in fp32, 1.2x in bf16; ``docs/benchmarks.md``).
        args, kwargs: those of ``monai.inferers.SlidingWindowInferer``.
    """

    def __init__(
        self, *args: Any, oom_backoff: bool = True, amp: str = "none", memory_format: str = "contiguous", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.oom_backoff = bool(oom_backoff)
        self.amp = amp
        self.memory_format = memory_format
        _memory_format(memory_format)

    def __call__(self, inputs: torch.Tensor, network: Callable, *args: Any, **kwargs: Any):
        if isinstance(network, nn.Module):
            to_memory_format(network, self.memory_format)

        def windows(batch: torch.Tensor, *a: Any, **k: Any) -> Any:
            with inference_autocast(batch.device, self.amp):
                return network(to_memory_format(batch, self.memory_format), *a, **k)

        call = super().__call__
        return with_window_backoff(self, lambda: call(inputs, windows, *args, **kwargs), self.oom_backoff)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""A frozen autoencoder (``autoencoder_3d``'s AutoencoderKL or ``vqgan_3d``'s VQ-GAN) as the latent space of a
latent diffusion model: whole-volume encoding and decoding with sliding windows, and latent normalisation."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from common.checkpoint_io import CheckpointError, load_published_weights
from common.networks.wrappers import LatentDecoder, LatentEncoder, blended_windows, unwrap
from common.runs import bundle_of_config
from common.utils import rng_state, set_rng_state

__all__ = ["LatentCodec", "LatentScaleCalibration", "codec_from_bundle", "load_latent_codec"]

logger = logging.getLogger(__name__)


class LatentCodec(nn.Module):
    """Encode every channel of a ``[-1, 1]`` volume to latents with a frozen autoencoder, and decode them back.

    The autoencoders of ``autoencoder_3d`` and ``vqgan_3d`` are single-channel and trained on ``[0, 1]``
    intensities: channel ``c`` of the input becomes latent channels ``c * latent_channels ...`` (see
    :func:`common.diffusion.engines.expand_channels`). Encoding gives AutoencoderKL's posterior mean or
    the VQ-GAN's continuous (pre-quantization) latent; decoding quantizes VQ-GAN latents to the nearest codes
    first (as MedicalDiffusion does), so every sample decodes through the codebook. Volumes larger than
    ``roi_size`` are encoded and decoded with blended sliding windows, as the autoencoder bundles reconstruct.

    ``scale`` (a buffer, ``nan`` until calibrated) is the factor that brings the raw latents to unit variance
    (Rombach et al. 2022); the codec itself encodes and decodes *raw* latents - the diffusion trainer and sampler
    apply ``scale``.

    Args:
        autoencoder: the trained autoencoder (its weights are frozen; it is kept in eval mode).
        roi_size: image-space window of the autoencoder (its training patch).
        downsample: the autoencoder's total downsampling per axis.
        latent_channels: latent channels per image channel.
        sw_batch_size: windows per autoencoder call.
        overlap: window overlap.
        scale: a known latent scale (``None``: calibrate, see :class:`LatentScaleCalibration`).
        oom_backoff: halve ``sw_batch_size`` after running out of GPU memory and redo the volume
            (:func:`common.networks.wrappers.with_window_backoff`).
    """

    def __init__(
        self,
        autoencoder: nn.Module,
        roi_size: Sequence[int],
        downsample: Sequence[int] | int,
        latent_channels: int,
        sw_batch_size: int = 1,
        overlap: float = 0.25,
        scale: float | None = None,
        oom_backoff: bool = True,
    ) -> None:
        super().__init__()
        self.oom_backoff = bool(oom_backoff)
        self.autoencoder = autoencoder.eval().requires_grad_(False)
        self.roi_size = [int(r) for r in roi_size]
        factors = [int(downsample)] * len(self.roi_size) if isinstance(downsample, int) else list(downsample)
        self.downsample = [int(f) for f in factors]
        self.latent_channels = int(latent_channels)
        self.sw_batch_size = int(sw_batch_size)
        self.overlap = float(overlap)
        self.register_buffer("scale", torch.tensor(float("nan") if scale is None else float(scale)))
        self._encoder = LatentEncoder(self.autoencoder, quantized=False)
        self._decoder = LatentDecoder(self.autoencoder)

    @property
    def latent_roi_size(self) -> list[int]:
        return [r // f for r, f in zip(self.roi_size, self.downsample)]

    def train(self, mode: bool = True) -> LatentCodec:
        """The autoencoder stays in eval mode (a VQ-GAN's codebook must never update while encoding)."""
        super().train(mode)
        self.autoencoder.eval()
        return self

    def state_dict(self, *args, **kwargs):
        """Only ``scale``: the autoencoder's weights come from its own checkpoint."""
        return {"scale": self.scale.detach().clone()}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        self.scale.copy_(torch.as_tensor(state_dict["scale"]))
        return nn.modules.module._IncompatibleKeys([], [])

    def _windows(self, x: torch.Tensor, fn: nn.Module, roi: Sequence[int]) -> torch.Tensor:
        return blended_windows(x, fn, roi, overlap=self.overlap, owner=self)

    @torch.no_grad()
    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """Raw latents ``(B, C x latent_channels, *spatial / downsample)`` of ``image`` ``(B, C, *spatial)`` in
        ``[-1, 1]``; every spatial size must be a multiple of ``downsample``."""
        bad = [s for s, f in zip(image.shape[2:], self.downsample) if s % f]
        if bad:
            raise ValueError(
                f"volume shape {tuple(image.shape[2:])} is not divisible by the autoencoder's {self.downsample}."
            )
        unit = (image.float() + 1) / 2
        latents = [self._windows(unit[:, c : c + 1], self._encoder, self.roi_size) for c in range(image.shape[1])]
        return torch.cat(latents, dim=1)

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Images in ``[-1, 1]`` (one channel per block of ``latent_channels``) from raw latents."""
        if latent.shape[1] % self.latent_channels:
            raise ValueError(f"{latent.shape[1]} latent channels are not a multiple of {self.latent_channels}.")
        net = unwrap(self.autoencoder)
        images = []
        for c in range(0, latent.shape[1], self.latent_channels):
            z = latent[:, c : c + self.latent_channels].float()
            if hasattr(net, "quantizer"):  # a VQ-GAN decodes the nearest codebook vectors
                codes = net.quantizer.nearest(z.movedim(1, -1).reshape(-1, z.shape[1]))
                z = net.quantizer.embed(codes.reshape(z.shape[0], *z.shape[2:]))
            images.append(self._windows(z, self._decoder, self.latent_roi_size))
        return torch.cat(images, dim=1) * 2 - 1

    def calibrate(self, latents: torch.Tensor) -> float:
        """Set ``scale`` to ``1 / std`` of ``latents`` pooled over every rank (all ranks get the same value).

        Two passes (the global mean, then the squared deviations from it); a standard deviation below ``1e-9`` of
        the mean is rounding, i.e. constant latents.

        Raises:
            ValueError: when the pooled latents are constant.
        """
        values = latents.detach().double().flatten()
        distributed = dist.is_available() and dist.is_initialized()

        def pooled(*numbers: float) -> list[float]:
            tensor = torch.tensor(numbers, dtype=torch.float64)
            if distributed:
                tensor = tensor.to(self.scale.device)
                dist.all_reduce(tensor)
            return tensor.tolist()

        n, total = pooled(values.numel(), values.sum().item())
        (squares,) = pooled((values - total / n).pow(2).sum().item())
        std = math.sqrt(squares / n)
        if not std > 1e-9 * abs(total / n) or std == 0:
            raise ValueError(f"the latents of the training data have standard deviation {std}: cannot normalise them.")
        self.scale.fill_(1.0 / std)
        logger.info(f"latent scale calibrated on {int(n)} latent values: 1 / std = {1.0 / std:.5g}")
        return 1.0 / std


class LatentScaleCalibration:
    """Ignite handler: at the start of training, calibrate ``codec.scale`` from the first ``max_items`` items of
    the (cached) training dataset, unless it is already set (given in the config, or restored by a resumed run -
    attach it after the checkpoint manager). The global RNG states are restored afterwards, so training draws
    the same crops as without calibration.

    Args:
        codec: the :class:`LatentCodec`.
        dataset: the training dataset (items hold raw latents under ``image``).
        max_items: items read per rank.
    """

    def __init__(self, codec: LatentCodec, dataset: Any, max_items: int = 8) -> None:
        self.codec = codec
        self.dataset = dataset
        self.max_items = int(max_items)

    def attach(self, engine) -> None:
        from ignite.engine import Events

        engine.add_event_handler(Events.STARTED, self)

    def __call__(self, engine=None) -> None:
        if torch.isfinite(self.codec.scale):
            return
        state = rng_state()
        try:
            items = []
            for i in range(min(self.max_items, len(self.dataset))):
                item = self.dataset[i]
                for d in item if isinstance(item, list) else [item]:
                    items.append(torch.as_tensor(d["image"]).float().flatten())
        finally:
            set_rng_state(state)
        self.codec.calibrate(torch.cat(items))


def load_latent_codec(
    autoencoder: nn.Module,
    ckpt_path: str,
    roi_size: Sequence[int],
    latent_channels: int,
    sw_batch_size: int = 1,
    overlap: float = 0.25,
    scale: float | None = None,
    device: torch.device | str = "cpu",
    downsample: Sequence[int] | None = None,
) -> LatentCodec:
    """Load a trained autoencoder checkpoint into ``autoencoder`` and wrap it as a :class:`LatentCodec`.

    The configured latent shape is checked against what the autoencoder really produces on a ``roi_size``
    window, so a checkpoint of another architecture or a wrong ``latent_channels`` is refused before training.

    Raises:
        ValueError: naming ``latent_ckpt``/``latent_config``/``latent_channels``/``latent_downsample`` when the
            checkpoint is missing, unreadable, does not fit the network, or gives other latents than configured.
    """
    if not ckpt_path:
        raise ValueError("'latent_ckpt' must name a trained autoencoder checkpoint (model.pt) for latent mode.")
    try:  # a run's model.pt, or a publisher's file as distributed (MAISI's VAE, the zoo's BraTS autoencoder)
        load_published_weights(unwrap(autoencoder), ckpt_path)
    except CheckpointError as exc:
        if "do not fit" not in str(exc):
            raise ValueError(f"'latent_ckpt': {exc}") from None
        raise ValueError(f"'latent_ckpt' does not fit the network_def of 'latent_config': {exc}") from None
    autoencoder = autoencoder.to(device).eval()
    probe = torch.zeros(1, 1, *[int(r) for r in roi_size], device=device)
    with torch.no_grad():
        latent = LatentEncoder(autoencoder, quantized=False)(probe)
    if latent.shape[1] != int(latent_channels):
        raise ValueError(
            f"'latent_channels' is {latent_channels} but the autoencoder of 'latent_ckpt' {ckpt_path!r} encodes to "
            f"{latent.shape[1]} channel(s)."
        )
    factors = [int(r) // int(s) for r, s in zip(roi_size, latent.shape[2:])]
    if any(int(r) % int(s) for r, s in zip(roi_size, latent.shape[2:])):
        raise ValueError(
            f"the autoencoder's patch_size {list(roi_size)} is not a multiple of its latent grid {list(latent.shape[2:])}."
        )
    if downsample is not None and [int(d) for d in downsample] != factors:
        raise ValueError(
            f"'latent_downsample' is {[int(d) for d in downsample]} but the autoencoder of 'latent_ckpt' {ckpt_path!r} "
            f"downsamples by {factors}."
        )
    codec = LatentCodec(autoencoder, roi_size, factors, latent_channels, sw_batch_size, overlap, scale)
    return codec.to(device)


def codec_from_bundle(
    config_file: str | Sequence[str],
    ckpt_path: str,
    latent_channels: int,
    downsample: Sequence[int] | None = None,
    sw_batch_size: int = 1,
    overlap: float = 0.25,
    scale: float | None = None,
    device: torch.device | str = "cpu",
) -> LatentCodec:
    """The :class:`LatentCodec` of a trained ``autoencoder_3d`` or ``vqgan_3d`` run.

    The autoencoder is built from the ``network_def`` of the config(s) it was trained with (e.g.
    ``bundles/vqgan_3d/configs/train.json``, with the same overrides) and its training ``patch_size`` is the
    encoding window; then :func:`load_latent_codec` loads ``ckpt_path`` and checks the latent shape.

    Args:
        config_file: the autoencoder's training config, or a list of configs merged in order.
        ckpt_path: its trained weights (``model.pt``).
        latent_channels: latent channels per image channel the diffusion model is configured for.
        downsample: the configured downsampling per axis (checked against the autoencoder).
        sw_batch_size, overlap, scale, device: see :class:`LatentCodec`.

    Raises:
        ValueError: naming ``latent_config`` when the config cannot be read or lacks ``network_def`` or
            ``patch_size``, and as :func:`load_latent_codec`.
    """
    from monai.bundle import ConfigParser

    files = [config_file] if isinstance(config_file, (str, os.PathLike)) else list(config_file or [])
    if not files:
        raise ValueError("'latent_config' must name the autoencoder's training config for latent mode.")
    missing = [str(f) for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"'latent_config': no such file {missing[0]!r}.")
    parser = ConfigParser()
    try:
        parser.read_config([str(f) for f in files])
        home = bundle_of_config(Path(files[0]).parent)  # a bare parser: its configs' bundle is told
        if home is not None:
            parser["bundle_root"] = str(home)
        roi_size = [int(r) for r in parser.get_parsed_content("patch_size")]
        autoencoder = parser.get_parsed_content("network_def")
    except Exception as exc:  # noqa: BLE001 - any config problem is reported with the file names
        detail = " ".join(str(exc).split())[:400]
        raise ValueError(f"'latent_config' {files}: cannot build 'network_def' and 'patch_size': {detail}") from None
    if not isinstance(autoencoder, nn.Module):
        raise ValueError(f"'latent_config' {files}: 'network_def' is a {type(autoencoder).__name__}, not a network.")
    return load_latent_codec(
        autoencoder,
        ckpt_path,
        roi_size,
        latent_channels,
        sw_batch_size=sw_batch_size,
        overlap=overlap,
        scale=scale,
        device=device,
        downsample=downsample,
    )

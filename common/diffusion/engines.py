# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Training and evaluation engines of conditional and unconditional 3D diffusion models (Fast-DDPM and DDPM).

A diffusion batch is one ``image`` tensor holding every channel of a case (e.g. the four BraTS modalities, or a
source and a target image), in ``[-1, 1]`` (or latents of an autoencoder). ``target_channels`` are the channels the
model generates: training replaces them by their noised version ``x_t`` and keeps the other channels as the
condition (channel concatenation); sampling starts them from ``N(0, I)``. An unconditional model has only target
channels.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from monai.utils import CommonKeys as Keys
from torch import nn
from torch.optim import Optimizer

from common.diffusion.schedule import (
    PREDICTIONS,
    DiffusionSchedule,
    antithetic_timesteps,
    fast_ddpm_grid,
)
from common.engines.evaluator import StepEvaluator
from common.engines.trainer import StepTrainer
from common.utils import get_rank, get_world_size, plain_tensor

__all__ = [
    "DIFFUSION_MODES",
    "TASKS",
    "DiffusionEvaluator",
    "DiffusionTrainer",
    "case_name",
    "expand_channels",
    "insert_target",
    "latent_roi_size",
    "prepare_diffusion_batch",
    "sampling_grid",
    "target_channel_indices",
    "volume_multiple",
    "volume_seed",
]

DIFFUSION_MODES = ("fast", "baseline")
TASKS = ("synthesis", "translation", "unconditional")


def sampling_grid(
    diffusion_mode: str = "fast", grid: str = "uniform", num_grid_steps: int = 10, num_train_timesteps: int = 1000
) -> torch.Tensor:
    """The time steps a model is trained on and sampled over.

    ``fast``: Fast-DDPM's grid (:func:`common.diffusion.schedule.fast_ddpm_grid`); ``baseline``: every step
    ``0 .. T - 1`` of a standard DDPM.

    Raises:
        ValueError: for an unknown mode, or an invalid grid (see ``fast_ddpm_grid``).
    """
    if diffusion_mode not in DIFFUSION_MODES:
        raise ValueError(f"diffusion_mode must be one of {DIFFUSION_MODES}, got {diffusion_mode!r}.")
    fast = fast_ddpm_grid(grid, num_grid_steps, num_train_timesteps)  # validates the grid settings in both modes
    return fast if diffusion_mode == "fast" else torch.arange(int(num_train_timesteps))


def target_channel_indices(image_keys: Sequence[str], target_key: str, channels_per_key: int = 1) -> list[int]:
    """Channel indices of ``target_key`` in the concatenation of ``image_keys`` (``channels_per_key`` each).

    Raises:
        ValueError: when ``target_key`` is not one of ``image_keys``.
    """
    keys = list(image_keys)
    if target_key not in keys:
        raise ValueError(f"'target_key' {target_key!r} must be one of 'image_keys' {keys}.")
    first = keys.index(target_key) * int(channels_per_key)
    return list(range(first, first + int(channels_per_key)))


def expand_channels(channels: Sequence[int], factor: int) -> list[int]:
    """Indices of image channels ``channels`` in a latent where every image channel became ``factor`` channels."""
    return [int(c) * int(factor) + j for c in channels for j in range(int(factor))]


def volume_multiple(unet_channels: Sequence[int], space_downsample: Sequence[int]) -> list[int]:
    """The multiple every spatial size of a whole volume is padded to: the U-Net's downsampling (it halves the size
    ``len(unet_channels) - 1`` times) times ``space_downsample`` (the autoencoder's downsampling in latent mode,
    1 otherwise), per axis."""
    factor = 2 ** (len(unet_channels) - 1)
    return [factor * int(d) for d in space_downsample]


def latent_roi_size(patch_size: Sequence[int], space_downsample: Sequence[int]) -> list[int]:
    """The training crop and sampling window in the space the U-Net sees: ``patch_size`` (image voxels) divided by
    ``space_downsample`` (the autoencoder's downsampling in latent mode, 1 otherwise), per axis."""
    return [int(p) // int(d) for p, d in zip(patch_size, space_downsample)]


def insert_target(
    condition: torch.Tensor, target: torch.Tensor, target_channels: Sequence[int], in_channels: int
) -> torch.Tensor:
    """The network input: ``condition`` with ``target`` at ``target_channels``.

    ``condition`` holds either all ``in_channels`` (its target channels are replaced) or only the condition
    channels (the target channels are inserted between them, in order).

    Raises:
        ValueError: when ``condition`` has neither ``in_channels`` nor ``in_channels - len(target_channels)``
            channels, or ``target`` does not have ``len(target_channels)``.
    """
    idx = list(target_channels)
    n_cond = int(in_channels) - len(idx)
    if target.shape[1] != len(idx):
        raise ValueError(f"the target has {target.shape[1]} channel(s), expected {len(idx)} ({idx}).")
    if condition.shape[1] == in_channels:
        out = condition.clone()
        out[:, idx] = target.to(out.dtype)
        return out
    if condition.shape[1] != n_cond:
        raise ValueError(
            f"the input has {condition.shape[1]} channel(s); the model takes {in_channels} with the target channels "
            f"{idx} included or {n_cond} without them."
        )
    out = condition.new_empty((condition.shape[0], int(in_channels), *condition.shape[2:]))
    rest = [c for c in range(int(in_channels)) if c not in idx]
    out[:, idx] = target.to(out.dtype)
    if rest:
        out[:, rest] = condition
    return out


def volume_seed(batchdata: Any, index: int = 0, seed: int = 0) -> int:
    """A seed for the sampling noise of one volume, from its ``case_id`` (or file name) and ``seed``.

    The noise of a volume then does not depend on the batch order, the number of processes or earlier
    validations, so metrics are comparable between validations and between single- and multi-GPU runs.
    """
    name = case_name(batchdata, index)
    text = f"{seed}:{name if name is not None else index}"
    return zlib.crc32(text.encode("utf-8")) & 0x7FFFFFFF


def case_name(batchdata: Any, index: int = 0) -> Any:
    """The ``case_id`` (or image file name) of volume ``index`` of a batch, ``None`` when it has neither."""
    name = None
    image = batchdata.get(Keys.IMAGE) if isinstance(batchdata, Mapping) else None
    if isinstance(batchdata, Mapping) and "case_id" in batchdata:
        name = batchdata["case_id"]
    elif isinstance(image, MetaTensor):
        name = image.meta.get("case_id", image.meta.get("filename_or_obj"))
    if isinstance(name, (list, tuple)):
        name = name[index] if index < len(name) else None
    return name


def prepare_diffusion_batch(
    batchdata: Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    non_blocking: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(image, label)``: every channel of the case (the network's channel layout), and the target in image
    space when the batch has one as a tensor (validation: ``label``; ``None`` in training and inference)."""
    image = batchdata[Keys.IMAGE].to(device=device, non_blocking=non_blocking, **kwargs)
    label = batchdata.get(Keys.LABEL)
    if isinstance(label, torch.Tensor):
        label = label.to(device=device, non_blocking=non_blocking, **kwargs)
    else:  # e.g. the file names of a datalist's segmentation ("label" of BraTS entries), not a reference image
        label = None
    return image, label


class DiffusionTrainer(StepTrainer):
    """Trains a denoiser ``network(x, timesteps)`` on the time steps of ``timesteps`` (a Fast-DDPM grid or all
    steps of a DDPM).

    Each iteration draws one time step per sample from ``timesteps`` (in antithetic pairs across the global batch
    of all ranks: index ``i`` and ``len - 1 - i``; a function of ``seed`` and the iteration, so a resumed run draws
    the same steps), noise ``N(0, I)``, forms ``x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise`` for the target channels,
    and regresses the network output (``epsilon`` or ``v_prediction``) with the mean squared error. Mixed
    precision, gradient accumulation with DDP ``no_sync`` and clipping as in
    :class:`common.engines.trainer.StepTrainer`. With a ``latent_codec`` the batch holds raw latents, multiplied
    by the codec's ``scale`` first.

    ``engine.state.output`` (not decollated) holds ``image``, ``loss``, ``grad_norm`` (when clipping) and
    ``timestep_mean``.

    Args:
        network: the denoiser as called for training (may be DDP/compile-wrapped).
        optimizer: its optimizer.
        schedule: the noise schedule.
        timesteps: the time steps to train on.
        target_channels: channels of ``image`` that are generated.
        prediction_type: ``epsilon`` or ``v_prediction``.
        latent_codec: a :class:`common.diffusion.latent.LatentCodec` whose ``scale`` normalises raw latents.
        seed: base seed of the time-step draws.
        settings: ``device``, ``max_epochs``, ``train_data_loader`` (of dicts with an ``image`` key,
            ``B, C, *spatial``), ``amp``, ``accumulation_steps``, ``grad_clip`` and the other settings of
            :class:`common.engines.trainer.StepTrainer`; ``prepare_batch`` defaults to
            :func:`prepare_diffusion_batch`, ``decollate`` to False.
    """

    default_prepare_batch = staticmethod(prepare_diffusion_batch)
    default_decollate = False

    def __init__(
        self,
        network: nn.Module,
        optimizer: Optimizer,
        schedule: DiffusionSchedule,
        timesteps: torch.Tensor | Sequence[int],
        target_channels: Sequence[int],
        prediction_type: str = "epsilon",
        latent_codec: nn.Module | None = None,
        seed: int = 0,
        **settings: Any,
    ) -> None:
        if prediction_type not in PREDICTIONS:
            raise ValueError(f"prediction_type must be one of {PREDICTIONS}, got {prediction_type!r}.")
        if not list(target_channels):
            raise ValueError("target_channels must name at least one channel.")
        super().__init__(network=network, optimizer=optimizer, **settings)
        self.schedule = schedule
        self.timesteps = torch.as_tensor(timesteps, dtype=torch.long).cpu()
        self.target_channels = [int(c) for c in target_channels]
        self.prediction_type = prediction_type
        self.latent_codec = latent_codec
        self.seed = int(seed)

    def draw_timesteps(self, batch_size: int, iteration: int) -> torch.Tensor:
        """This rank's time steps of ``iteration``: antithetic pairs drawn over the global batch of all ranks."""
        world, rank = get_world_size(), get_rank()
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + int(iteration))
        steps = antithetic_timesteps(self.timesteps, batch_size * world, generator)
        return steps[rank * batch_size : (rank + 1) * batch_size]

    def noised(self, x0: torch.Tensor, iteration: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_t, t, target)`` of clean ``x0`` at ``iteration``: this rank's time steps (:meth:`draw_timesteps`),
        ``x0`` noised to them, and the regression target (the noise, or the velocity for ``v_prediction``)."""
        # drawn on the host (seeded, the same on every device); copied without waiting for the queued work
        t = self.draw_timesteps(x0.shape[0], iteration).to(x0.device, non_blocking=True)
        noise = torch.randn_like(x0)
        x_t = self.schedule.add_noise(x0, noise, t)
        target = noise if self.prediction_type == "epsilon" else self.schedule.velocity(x0, noise, t)
        return x_t, t, target

    def prepare_step(self, engine: DiffusionTrainer, batchdata: dict[str, torch.Tensor]) -> dict[str, Any]:
        image, _ = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking, **engine.to_kwargs)
        image = plain_tensor(image).float()
        self.log_effective_batch(image.shape[0])
        if self.latent_codec is not None:
            image = image * self.latent_codec.scale.to(image.device)
        x0 = image[:, self.target_channels]
        x_t, t, target = self.noised(x0, engine.state.iteration)
        inputs = insert_target(image, x_t, self.target_channels, image.shape[1])
        return {
            "args": (inputs, t),
            "output": {Keys.IMAGE: image},
            "target": target,
            "stats": {"timestep_mean": t.float().mean()},
        }

    def compute_loss(
        self, engine: DiffusionTrainer, step: dict[str, Any], prediction: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.mse_loss(prediction.float(), step["target"].float()), {}


class DiffusionEvaluator(StepEvaluator):
    """Samples whole volumes with a :class:`common.diffusion.networks.DiffusionSampler` for validation,
    evaluation and inference.

    For each volume, ``num_samples`` samples are drawn from start noise seeded by :func:`volume_seed` (so results
    do not depend on batch order or the number of ranks). The input ``image`` holds the condition channels and,
    for validation, the clean target channels too (these are replaced by the noise). ``engine.state.output``
    (not decollated) holds ``image`` (the input), ``pred`` (the samples, ``B x num_samples`` volumes mapped to
    ``[0, 1]``, a MetaTensor with the input's metadata), ``label`` (the target in ``[0, 1]``, repeated per
    sample) when the batch has one, and ``denoise_loss`` (the held-out denoising loss per volume, see
    ``DiffusionSampler.denoising_loss``) with ``compute_loss``.

    Args:
        num_samples: samples per volume (``>= 2`` to measure diversity).
        seed: base seed of the start noise.
        compute_loss: also compute the held-out denoising loss (needs the clean target in ``image``).
        settings: the arguments of :class:`common.engines.evaluator.StepEvaluator`: ``device``,
            ``val_data_loader`` (of dicts with ``image``, and ``label`` for conditional validation), ``network``
            (the sampler), ``amp``, ``inferer`` (calls the sampler on each volume's input; default
            ``SimpleInferer``, the sampler itself slides its windows at every time step), ...; ``prepare_batch``
            defaults to :func:`prepare_diffusion_batch`.
    """

    default_prepare_batch = staticmethod(prepare_diffusion_batch)

    def __init__(self, *, num_samples: int = 1, seed: int = 0, compute_loss: bool = False, **settings: Any) -> None:
        if int(num_samples) < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples!r}.")
        super().__init__(**settings)
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.compute_loss = bool(compute_loss)

    def _noise(self, image: torch.Tensor, batchdata: Any, n_target: int) -> tuple[torch.Tensor, list[torch.Generator]]:
        """Start noise ``(B x num_samples, n_target, *spatial)`` and one seeded generator per volume."""
        noises, generators = [], []
        for i in range(image.shape[0]):
            generator = torch.Generator().manual_seed(volume_seed(batchdata, i, self.seed))
            shape = (self.num_samples, n_target, *image.shape[2:])
            noises.append(torch.randn(shape, generator=generator))
            generators.append(generator)
        return torch.cat(noises).to(image.device), generators

    def evaluate_step(
        self, engine: DiffusionEvaluator, batchdata: dict[str, Any], image: torch.Tensor, label: torch.Tensor | None
    ) -> dict:
        sampler = engine.network
        plain = plain_tensor(image).float()
        noise, generators = self._noise(plain, batchdata, len(sampler.target_channels))
        inputs = insert_target(
            plain.repeat_interleave(self.num_samples, dim=0), noise, sampler.target_channels, sampler.in_channels
        )
        output: dict[str, Any] = {Keys.IMAGE: image}
        with self.inference():
            samples = torch.cat(
                [
                    engine.inferer(chunk, sampler, generator=generators[i])
                    for i, chunk in enumerate(inputs.split(self.num_samples))
                ]
            )
            if self.compute_loss:
                output["denoise_loss"] = torch.cat(
                    [
                        sampler.denoising_loss(
                            plain[i : i + 1], torch.Generator().manual_seed(volume_seed(batchdata, i, self.seed + 1))
                        )
                        for i in range(plain.shape[0])
                    ]
                )
        pred = ((samples.float() + 1) / 2).clamp(0, 1)
        if isinstance(image, MetaTensor) and self.num_samples == 1:
            pred = MetaTensor(pred, meta=image.meta, applied_operations=image.applied_operations)
        output[Keys.PRED] = pred
        if label is not None:
            output[Keys.LABEL] = (
                ((plain_tensor(label).float() + 1) / 2).clamp(0, 1).repeat_interleave(self.num_samples, dim=0)
            )
        return output

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The inference network of a diffusion bundle: whole-volume sampling over an explicit time-step grid."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from common.diffusion.schedule import DiffusionSchedule, grid_ddim_sample
from common.networks.wrappers import InferenceView, blended_windows, clean_state_dict, unwrap

__all__ = ["DiffusionSampler"]

LATENT_SCALE_KEY = "latent_scale"


class DiffusionSampler(InferenceView):
    """``forward(image)`` -> a sample of the target channels: DDIM over exactly the points of ``timesteps``.

    ``image`` holds every input channel of the denoiser in its channel layout: the condition channels (source
    images, or raw latents of them) and, at ``target_channels``, the start noise ``N(0, I)``; the result is the
    sample of the target channels in image space (``[-1, 1]``; decoded by ``latent_codec`` in latent mode).
    With ``eta = 0`` it is a deterministic function of its input, so it exports to TorchScript/ONNX.

    Whole volumes: when ``image`` is larger than ``roi_size``, the denoiser is applied at every time step to
    overlapping ``roi_size`` windows of the whole current ``x_t`` whose predictions are blended with Gaussian
    weights (MultiDiffusion, Bar-Tal et al. 2023). Every step therefore updates one coherent volume: windows
    agree where they overlap and no seams are stitched afterwards; the cost is the number of windows per step.

    The checkpoint of a sampler is the denoiser's state dict (plus ``latent_scale`` in latent mode), so a
    sampler saves and loads what a training run writes as ``model.pt``.

    Args:
        network: the denoiser ``network(x, timesteps)`` (e.g. MONAI ``DiffusionModelUNet``; normally the EMA copy).
        target_channels: channels of ``image`` that are generated.
        in_channels: channels the denoiser takes (condition + target).
        timesteps: the ascending time steps to sample over (one network evaluation each).
        num_train_timesteps, beta_schedule, beta_start, beta_end: the noise schedule of training.
        prediction_type: ``epsilon`` or ``v_prediction``.
        eta: 0 for deterministic DDIM, 1 for DDPM-like ancestral sampling.
        clip_sample: clip x0 estimates to ``[-1, 1]`` (image data; off for latents).
        roi_size: denoiser window for whole volumes (``None``: the whole input at once).
        sw_batch_size: windows per denoiser call.
        overlap: window overlap.
        loss_timesteps: time steps of :meth:`denoising_loss` (default ``timesteps``).
        latent_codec: a :class:`common.diffusion.latent.LatentCodec` for latent diffusion.
        oom_backoff: halve ``sw_batch_size`` after running out of GPU memory and redo the time step
            (:func:`common.networks.wrappers.with_window_backoff`).
    """

    def __init__(
        self,
        network: nn.Module,
        target_channels: Sequence[int],
        in_channels: int,
        timesteps: Sequence[int] | torch.Tensor,
        num_train_timesteps: int = 1000,
        beta_schedule: str = "linear",
        beta_start: float = 1e-4,
        beta_end: float = 0.02,
        prediction_type: str = "epsilon",
        eta: float = 0.0,
        clip_sample: bool = True,
        roi_size: Sequence[int] | None = None,
        sw_batch_size: int = 1,
        overlap: float = 0.25,
        loss_timesteps: Sequence[int] | torch.Tensor | None = None,
        latent_codec: nn.Module | None = None,
        oom_backoff: bool = True,
    ) -> None:
        super().__init__(network)
        self.oom_backoff = bool(oom_backoff)
        self.target_channels = [int(c) for c in target_channels]
        self.in_channels = int(in_channels)
        self.timesteps = torch.as_tensor(timesteps, dtype=torch.long).cpu()
        self.loss_timesteps = self.timesteps if loss_timesteps is None else torch.as_tensor(loss_timesteps).long()
        self.schedule = DiffusionSchedule(num_train_timesteps, beta_schedule, beta_start, beta_end)
        self.prediction_type = prediction_type
        self.eta = float(eta)
        self.clip_sample = bool(clip_sample)
        self.roi_size = None if roi_size is None else [int(r) for r in roi_size]
        self.sw_batch_size = int(sw_batch_size)
        self.overlap = float(overlap)
        self.latent_codec = latent_codec
        if latent_codec is not None:
            latent_codec.eval()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *args, **kwargs):
        state = clean_state_dict(unwrap(self.network).state_dict())
        if self.latent_codec is not None:
            state[LATENT_SCALE_KEY] = self.latent_codec.scale.detach().clone()
        return state

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        state = clean_state_dict(dict(state_dict))
        weight = state.get("conv_in.conv.weight")  # MONAI DiffusionModelUNet: (out, in_channels, k, k, k)
        if weight is not None and weight.ndim == 5 and weight.shape[1] != self.in_channels:
            raise RuntimeError(
                f"the checkpoint's denoiser takes {weight.shape[1]} input channel(s) but this sampler is configured for "
                f"{self.in_channels} (len(image_keys) x latent channels): it was trained for another task or latent "
                "mode; use the image_keys/target_key/latent settings of its training run."
            )
        scale = state.pop(LATENT_SCALE_KEY, None)
        if self.latent_codec is not None:
            if scale is None and strict:
                raise RuntimeError(f"a latent diffusion checkpoint must hold {LATENT_SCALE_KEY!r}; this one does not.")
            if scale is not None:
                self.latent_codec.scale.copy_(torch.as_tensor(scale))
        return unwrap(self.network).load_state_dict(clean_state_dict(state), strict=strict, assign=assign)

    # ------------------------------------------------------------------ sampling
    def _denoise(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """The denoiser at time step ``t`` on ``x``, by overlapping windows when ``x`` is larger than ``roi_size``."""
        net = self.network

        def predict(window: torch.Tensor) -> torch.Tensor:
            return net(window, torch.full((window.shape[0],), int(t), dtype=torch.long, device=window.device))

        return blended_windows(x, predict, self.roi_size, overlap=self.overlap, owner=self)

    def _assemble(self, condition: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The denoiser input: the channels of ``condition`` with ``target`` at ``target_channels``.

        Built by concatenating channel slices (no in-place indexed assignment), so traced and ONNX graphs keep a
        dynamic batch size."""
        target = target.to(condition.dtype)
        parts = []
        for c in range(condition.shape[1]):
            if c in self.target_channels:
                j = self.target_channels.index(c)
                parts.append(target[:, j : j + 1])
            else:
                parts.append(condition[:, c : c + 1])
        return torch.cat(parts, dim=1)

    def _condition(self, image: torch.Tensor) -> torch.Tensor:
        """``image`` with its condition channels scaled as in training (latent mode); target channels kept."""
        if self.latent_codec is None:
            return image
        scaled = image * self.latent_codec.scale.to(image.device, image.dtype)
        return self._assemble(scaled, image[:, self.target_channels])

    def sample(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The sampled target channels in the denoiser's space (latents stay latents)."""
        if image.shape[1] != self.in_channels:
            raise ValueError(f"the sampler takes {self.in_channels} channels, got input shape {tuple(image.shape)}.")
        condition = self._condition(image)

        def model_fn(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return self._denoise(self._assemble(condition, x_t), int(t[0])).float()

        return grid_ddim_sample(
            model_fn,
            image[:, self.target_channels].float(),
            self.timesteps,
            self.schedule,
            eta=self.eta,
            prediction_type=self.prediction_type,
            generator=generator,
            clip_sample=self.clip_sample,
        )

    def forward(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        x0 = self.sample(image, generator)
        if self.latent_codec is not None:
            return self.latent_codec.decode(x0 / self.latent_codec.scale.to(x0.device, x0.dtype))
        return x0

    @torch.no_grad()
    def denoising_loss(self, image: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Held-out denoising loss per volume: the training loss of the centre ``roi_size`` crop of a clean
        ``image``, averaged over ``loss_timesteps`` with noise from ``generator`` (a validation loss that is
        comparable between steps, as MONAI's DDPM tutorials report it). In latent mode ``image`` holds raw latents
        of every channel, all scaled as in training."""
        image = image.float()
        if self.latent_codec is not None:
            image = image * self.latent_codec.scale.to(image.device, image.dtype)
        if self.roi_size is not None:
            starts = [max(0, (s - r) // 2) for s, r in zip(image.shape[2:], self.roi_size)]
            index = tuple(slice(b, b + r) for b, r in zip(starts, self.roi_size))
            image = image[(slice(None), slice(None), *index)]
        x0 = image[:, self.target_channels]
        losses = []
        for t in self.loss_timesteps.tolist():
            noise = torch.randn(x0.shape, generator=generator).to(x0.device)
            t_batch = torch.full((x0.shape[0],), int(t), dtype=torch.long, device=x0.device)
            x_in = self._assemble(image, self.schedule.add_noise(x0, noise, t_batch))
            target = noise if self.prediction_type == "epsilon" else self.schedule.velocity(x0, noise, t_batch)
            out = self.network(x_in, t_batch).float()
            losses.append(F.mse_loss(out, target.float(), reduction="none").flatten(1).mean(1))
        return torch.stack(losses).mean(0)

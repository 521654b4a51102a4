# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Biplanar X-ray -> CT networks: a ViT encoder per view, a per-voxel 3D denoiser conditioned on back-projected
views and X-ray tokens, its samplers (diffusion or ``direct`` regression) and the stage cascade.

The denoiser is a MONAI ``DiffusionModelUNet`` that predicts at every voxel of the stage's volume (no coarse token
grid upsampled): its input channels are the noisy volume ``x_t``, one back-projection per view
(:meth:`common.xray2ct.drr.DRRProjector.backproject`, so each voxel sees the X-ray values on its rays) and, from stage
2 on, the upsampled output of the previous stage; its cross-attention blocks attend to the tokens of the X-ray
ViTs. The U-Net's time embedding is sinusoidal followed by a two-layer MLP.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from monai.networks.nets import DiffusionModelUNet, ViT
from torch import nn
from torch.utils.checkpoint import checkpoint

from common.checkpoint_io import CheckpointError, load_checkpoint, save_weights
from common.diffusion.schedule import DiffusionSchedule, grid_ddim_sample
from common.networks.wrappers import InferenceView, clean_state_dict, unwrap
from common.runs import RUN_FILE, RunSettings, read_record, run_settings
from common.utils import is_positive_int
from common.xray2ct.drr import MISMATCH_STATISTICS, DRRProjector, consistency_bounds

__all__ = [
    "MODES",
    "SAMPLER_MODES",
    "CheckpointedBlock",
    "XrayCTCascade",
    "XrayCTDenoiser",
    "XrayCTSampler",
    "XrayEncoder",
    "build_cascade",
    "cascade_checkpoints",
    "cascade_settings",
    "degrade_to_previous",
    "init_from_previous",
    "init_from_previous_stage",
    "load_cascade",
    "load_regressor",
    "previous_stages",
    "sampling_problems",
    "save_cascade",
    "stage_checkpoint",
    "upsample_previous",
    "warn_unchecked_corrections",
]

logger = logging.getLogger(__name__)

MODES = ("diffusion", "residual", "direct")
SAMPLER_MODES = (*MODES, "backprojection")
CONV_IN = "unet.conv_in.conv.weight"


class CheckpointedBlock(nn.Module):
    """Runs ``module`` under activation checkpointing while training with gradients (recomputed in the backward
    pass: less memory, about a third more compute); a plain call otherwise. Keyword arguments pass through, which
    MONAI's ``ActivationCheckpointWrapper`` (one positional input) does not allow for U-Net blocks.

    The wrapper is invisible in state dicts (its ``module.`` level is removed on save and added on load, also
    under DDP or in copies), so checkpoints load with or without checkpointing."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._register_state_dict_hook(_drop_wrapper_level)
        self._register_load_state_dict_pre_hook(_add_wrapper_level)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # attributes of the wrapped block (e.g. ``resnets``, read by the U-Net)
            return getattr(self._modules["module"], name)

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            return checkpoint(self.module, *args, use_reentrant=False, **kwargs)
        return self.module(*args, **kwargs)


def _drop_wrapper_level(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_wrapper_level(state_dict: dict, prefix: str, *args) -> None:
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


class XrayEncoder(nn.Module):
    """One 2D MONAI ViT per view: ``(B, V, H, W)`` radiographs in ``[-1, 1]`` -> ``(B, V * N, hidden)`` tokens,
    with a learned embedding per view added so cross-attention knows which view a token comes from.

    Args:
        num_views: number of views.
        view_size: ``(H, W)`` of the radiographs.
        patch_size: ViT patch size (divides ``view_size``).
        hidden_size, mlp_dim, num_layers, num_heads: ViT settings.
    """

    def __init__(
        self,
        num_views: int = 2,
        view_size: Sequence[int] = (128, 128),
        patch_size: int = 16,
        hidden_size: int = 256,
        mlp_dim: int = 512,
        num_layers: int = 4,
        num_heads: int = 4,
    ) -> None:
        super().__init__()
        self.vits = nn.ModuleList(
            ViT(
                in_channels=1,
                img_size=tuple(int(s) for s in view_size),
                patch_size=int(patch_size),
                hidden_size=int(hidden_size),
                mlp_dim=int(mlp_dim),
                num_layers=int(num_layers),
                num_heads=int(num_heads),
                spatial_dims=2,
                classification=False,
                qkv_bias=True,
            )
            for _ in range(int(num_views))
        )
        for vit in self.vits:  # MONAI keeps an unused cross-attention norm in every block (DDP would wait for it)
            for block in vit.blocks:
                if not block.with_cross_attention:
                    block.norm_cross_attn.requires_grad_(False)
        self.view_embedding = nn.Parameter(torch.zeros(int(num_views), int(hidden_size)))
        nn.init.normal_(self.view_embedding, std=0.02)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        for vit in self.vits:
            vit.blocks = nn.ModuleList(_checkpointed(block, enabled) for block in vit.blocks)

    def forward(self, radiographs: torch.Tensor) -> torch.Tensor:
        tokens = [vit(radiographs[:, i : i + 1])[0] + self.view_embedding[i] for i, vit in enumerate(self.vits)]
        return torch.cat(tokens, dim=1)


def _checkpointed(module: nn.Module, enabled: bool) -> nn.Module:
    inner = module.module if isinstance(module, CheckpointedBlock) else module
    return CheckpointedBlock(inner) if enabled else inner


class XrayCTDenoiser(nn.Module):
    """``forward(x, timesteps, xray, previous=None)`` -> a per-voxel prediction (v, epsilon or x0) of the CT.

    Args:
        projector: the :class:`common.xray2ct.drr.DRRProjector` of the data (views, geometry, units).
        with_previous: take the previous stage's upsampled output as an extra input channel (stage >= 2).
        unet_channels, attention_levels, num_res_blocks, norm_num_groups, num_head_channels,
            transformer_num_layers, use_flash_attention: ``DiffusionModelUNet`` settings (cross-attention at the
            levels with attention and in the middle block).
        vit_patch_size, vit_hidden_size, vit_mlp_dim, vit_layers, vit_heads: :class:`XrayEncoder` settings.
        gradient_checkpointing: checkpoint the U-Net's blocks and the ViT blocks in training.
        residual: a residual denoiser: it holds a frozen direct regressor of the same settings (``regressor``, in
            its state dict) whose estimate is one more input channel (after the views, before the previous
            stage), and its ``x`` is the normalised residual ``(CT - estimate) / residual_scale``
            (:meth:`to_residual`, :meth:`to_volume`).
        residual_scale: the scale of that residual (about the regressor's error, in ``[-1, 1]`` units).
    """

    def __init__(
        self,
        projector: DRRProjector,
        with_previous: bool = False,
        unet_channels: Sequence[int] = (32, 64, 128, 256),
        attention_levels: Sequence[bool] = (False, False, True, True),
        num_res_blocks: int = 1,
        norm_num_groups: int = 16,
        num_head_channels: int = 32,
        transformer_num_layers: int = 1,
        use_flash_attention: bool = False,
        vit_patch_size: int = 16,
        vit_hidden_size: int = 256,
        vit_mlp_dim: int = 512,
        vit_layers: int = 4,
        vit_heads: int = 4,
        gradient_checkpointing: bool = False,
        residual: bool = False,
        residual_scale: float = 0.1,
    ) -> None:
        super().__init__()
        self.projector = projector
        self.with_previous = bool(with_previous)
        self.residual = bool(residual)
        self.residual_scale = float(residual_scale)
        if not self.residual_scale > 0:
            raise ValueError(f"residual_scale must be positive, got {residual_scale!r}.")
        self.in_channels = 1 + projector.num_views + int(self.residual) + int(self.with_previous)
        self.encoder = XrayEncoder(
            projector.num_views,
            projector.view_size,
            vit_patch_size,
            vit_hidden_size,
            vit_mlp_dim,
            vit_layers,
            vit_heads,
        )
        self.unet = DiffusionModelUNet(
            spatial_dims=3,
            in_channels=self.in_channels,
            out_channels=1,
            channels=list(unet_channels),
            attention_levels=list(attention_levels),
            num_res_blocks=int(num_res_blocks),
            norm_num_groups=int(norm_num_groups),
            num_head_channels=int(num_head_channels),
            with_conditioning=True,
            transformer_num_layers=int(transformer_num_layers),
            cross_attention_dim=int(vit_hidden_size),
            use_flash_attention=bool(use_flash_attention),
        )
        self.regressor: XrayCTDenoiser | None = None
        if self.residual:  # the frozen direct regressor whose estimate the diffusion refines
            self.regressor = XrayCTDenoiser(
                projector,
                with_previous=self.with_previous,
                unet_channels=unet_channels,
                attention_levels=attention_levels,
                num_res_blocks=num_res_blocks,
                norm_num_groups=norm_num_groups,
                num_head_channels=num_head_channels,
                transformer_num_layers=transformer_num_layers,
                use_flash_attention=use_flash_attention,
                vit_patch_size=vit_patch_size,
                vit_hidden_size=vit_hidden_size,
                vit_mlp_dim=vit_mlp_dim,
                vit_layers=vit_layers,
                vit_heads=vit_heads,
            )
            self.regressor.requires_grad_(False)
            self.regressor.eval()
        self.gradient_checkpointing = False
        self.set_gradient_checkpointing(gradient_checkpointing)

    def train(self, mode: bool = True) -> XrayCTDenoiser:
        super().train(mode)
        if self.regressor is not None:  # frozen: always evaluated as at inference
            self.regressor.eval()
        return self

    @torch.no_grad()
    def estimate(self, xray: torch.Tensor, previous: torch.Tensor | None, size: Sequence[int]) -> torch.Tensor:
        """The frozen regressor's estimate of the CT in ``[-1, 1]`` at ``size`` (residual denoisers only): one
        evaluation with a zero noisy-volume channel at ``t = 0``, as the ``direct`` sampler does."""
        if self.regressor is None:
            raise ValueError("only a residual denoiser (residual=True) has a regressor to estimate with.")
        zeros = torch.zeros((xray.shape[0], 1, *(int(s) for s in size)), device=xray.device)
        t = torch.zeros(xray.shape[0], dtype=torch.long, device=xray.device)
        return self.regressor(zeros, t, xray, previous).float().clamp(-1.0, 1.0)

    def to_volume(self, residual: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
        """The CT from a normalised residual and the regressor's estimate: ``estimate + residual_scale * r``."""
        return estimate + self.residual_scale * residual

    def to_residual(self, volume: torch.Tensor, estimate: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_volume`."""
        return (volume - estimate) / self.residual_scale

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Switch activation checkpointing of the U-Net's down/middle/up blocks and the ViT blocks."""
        unet = self.unet
        unet.down_blocks = nn.ModuleList(_checkpointed(b, enabled) for b in unet.down_blocks)
        unet.up_blocks = nn.ModuleList(_checkpointed(b, enabled) for b in unet.up_blocks)
        unet.middle_block = _checkpointed(unet.middle_block, enabled)
        self.encoder.set_gradient_checkpointing(enabled)
        self.gradient_checkpointing = bool(enabled)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        state = clean_state_dict(dict(state_dict))
        weight = state.get(CONV_IN)
        if weight is not None and weight.ndim == 5 and weight.shape[1] != self.in_channels:
            raise RuntimeError(
                f"the checkpoint's denoiser takes {weight.shape[1]} input channel(s) but this one takes "
                f"{self.in_channels} (noisy CT + {self.projector.num_views} view(s)"
                f"{' + regressor estimate' if self.residual else ''}"
                f"{' + previous stage' if self.with_previous else ''}): it belongs to another stage, view setup or "
                "mode."
            )
        has_regressor = any(k.startswith("regressor.") for k in state)
        if strict and has_regressor != self.residual:
            raise RuntimeError(
                "the checkpoint is of a residual denoiser (it holds a regressor) but this one is not"
                if has_regressor
                else "this residual denoiser needs its regressor's weights, which the checkpoint does not hold"
            )
        return super().load_state_dict(state, strict=strict, assign=assign)

    def condition(self, xray: torch.Tensor, spatial: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(back-projections, tokens)`` of ``xray`` for a volume of ``spatial`` size (reused over sampling steps)."""
        backprojection = self.projector.backproject(xray, spatial)
        tokens = self.encoder(self.projector.intensity(xray.float()))
        return backprojection, tokens

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor,
        xray: torch.Tensor,
        previous: torch.Tensor | None = None,
        condition: tuple[torch.Tensor, torch.Tensor] | None = None,
        estimate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prediction at ``x`` (the noisy CT, or for a residual denoiser the noisy normalised residual).

        Args:
            x: ``(B, 1, X, Y, Z)``.
            timesteps: ``(B,)``.
            xray: ``(B, V, H, W)`` normalised line integrals.
            previous: the previous stage's output at this size (stage >= 2).
            condition: :meth:`condition` of ``xray`` when already computed.
            estimate: the regressor's estimate (:meth:`estimate`) when already computed (residual only).
        """
        if (previous is not None) != self.with_previous:
            need = "needs the previous stage's upsampled output" if self.with_previous else "takes no previous stage"
            raise ValueError(f"this denoiser {need} (with_previous={self.with_previous}).")
        backprojection, tokens = condition if condition is not None else self.condition(xray, x.shape[2:])
        parts = [x, backprojection.to(x.dtype)]
        if self.residual:
            parts.append((estimate if estimate is not None else self.estimate(xray, previous, x.shape[2:])).to(x.dtype))
        if previous is not None:
            parts.append(previous.to(x.dtype))
        return self.unet(torch.cat(parts, dim=1), timesteps, context=tokens)


def upsample_previous(volume: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """A previous stage's volume brought to the next stage's ``size`` (trilinear)."""
    size = tuple(int(s) for s in size)
    if tuple(volume.shape[2:]) == size:
        return volume
    return F.interpolate(volume.float(), size=size, mode="trilinear", align_corners=False)


def degrade_to_previous(
    x0: torch.Tensor,
    previous_size: Sequence[int],
    noise_std: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The training stand-in for a previous stage's output: ``x0`` area-averaged to ``previous_size``, upsampled
    back, plus Gaussian noise with a per-sample standard deviation uniform in ``[0, noise_std]`` (conditioning
    augmentation of cascaded diffusion, Ho et al. 2022, so the stage tolerates the previous stage's errors)."""
    low = F.adaptive_avg_pool3d(x0.float(), tuple(int(s) for s in previous_size))
    up = upsample_previous(low, x0.shape[2:])
    if noise_std > 0:
        std = torch.rand(x0.shape[0], generator=generator) * float(noise_std)
        noise = torch.randn(up.shape, generator=generator)
        up = up + (std.view(-1, 1, 1, 1, 1) * noise).to(up.device)
    return up


def init_from_previous(network: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Initialise a stage's denoiser from the previous stage's checkpoint.

    Tensors with the same name and shape are copied; the input convolution, which has one more channel (the
    previous stage's output), gets the previous weights for the shared channels and zeros for the new one, so
    the initialised stage starts as the previous stage applied at the new size. Returns the counts of copied,
    partially copied and kept (newly initialised) tensors.

    Raises:
        RuntimeError: when no tensor matches (a different architecture).
    """
    target = unwrap(network)
    own = target.state_dict()
    copied, partial, kept = 0, 0, 0
    new_state = {}
    for name, value in clean_state_dict(dict(state_dict)).items():
        if name not in own:
            continue
        mine = own[name]
        if mine.shape == value.shape:
            new_state[name] = value
            copied += 1
        elif name == CONV_IN and mine.shape[0] == value.shape[0] and mine.shape[2:] == value.shape[2:]:
            n = min(mine.shape[1], value.shape[1])
            merged = torch.zeros_like(mine)
            merged[:, :n] = value[:, :n]
            new_state[name] = merged
            partial += 1
    kept = len(own) - len(new_state)
    if not new_state:
        raise RuntimeError("the previous stage's checkpoint shares no tensor with this stage's network.")
    target.load_state_dict({**own, **new_state})
    logger.info(f"initialised from the previous stage: {copied} tensors copied, {partial} partially, {kept} new")
    return {"copied": copied, "partial": partial, "new": kept}


def init_from_previous_stage(
    network: nn.Module, previous: XrayCTCascade | None, enabled: bool = True
) -> dict[str, int] | None:
    """:func:`init_from_previous` with the weights of the last of the trained ``previous`` stages (what
    :func:`previous_stages` loads); nothing (``None``) for stage 1, which has no previous stage, or when not
    ``enabled``.

    Args:
        network: the stage's denoiser (or a wrapper of it).
        previous: the trained earlier stages, ``None`` for stage 1.
        enabled: the config's ``init_from_previous``.
    """
    if previous is None or not enabled:
        return None
    return init_from_previous(network, previous.stages[-1].state_dict())


def load_regressor(
    network: nn.Module,
    regressor_dir: str | os.PathLike | None,
    stage: int,
    bundle_root: str | os.PathLike,
    enabled: bool = True,
) -> str | None:
    """Load a residual denoiser's frozen regressor: the ``direct`` run ``regressor_dir``'s trained stage ``stage``
    (``stage<k>/models/model.pt``, its final or best EMA weights; its mode read from its record against the
    defaults of the bundle ``bundle_root``). Nothing (``None``) when not ``enabled`` (a mode other than
    ``residual``); otherwise the file loaded.

    Raises:
        CheckpointError: naming the file when it is missing, is not of a ``direct`` run, or does not fit.
    """
    if not enabled:
        return None

    denoiser = unwrap(network)
    if getattr(denoiser, "regressor", None) is None:
        raise ValueError("only a residual denoiser (residual=True) has a regressor to load.")
    path = stage_checkpoint(regressor_dir, stage)
    folder = Path(regressor_dir) / f"stage{int(stage)}"
    record = read_record(folder)
    mode = None if record is None else run_settings(folder, bundle_root, argv=[]).get("mode")
    if mode not in (None, "direct"):
        raise CheckpointError(
            f"the regressor of a residual run must be a '--mode direct' run; {regressor_dir!r} stage {stage} was "
            f"trained with mode {mode!r}."
        )
    state = load_checkpoint(path)
    try:
        denoiser.regressor.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(
            f"the regressor {path!r} does not fit this stage's network (train it with the same network settings "
            f"and stage sizes): {exc}"
        ) from exc
    logger.info(f"residual diffusion over the frozen regressor {path}")
    return path


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sampling_problems(
    num_samples: int, sample_chunk: int | None, guidance_scale: float, refine_steps: int, noise_tolerance: float | None
) -> list[str]:
    """At least one sample per case, drawn in chunks of at least one (or all at once: ``null``), with a projection
    guidance scale >= 0 and ``refine_steps`` >= 0 data-consistency steps after sampling, each of weight
    ``guidance_scale`` (so refinement needs a scale > 0); the discrepancy principle's ``noise_tolerance`` is null
    (off) or >= 0."""
    problems = []
    if not is_positive_int(num_samples):
        problems.append(f"'num_samples' must be an integer >= 1, got {num_samples!r}.")
    if sample_chunk is not None and not is_positive_int(sample_chunk):
        problems.append(f"'sample_chunk' must be an integer >= 1 or null, got {sample_chunk!r}.")
    scale_ok = _is_number(guidance_scale) and guidance_scale >= 0
    if not scale_ok:
        problems.append(f"'guidance_scale' must be a number >= 0 (0: no projection guidance), got {guidance_scale!r}.")
    if isinstance(refine_steps, bool) or not isinstance(refine_steps, int) or refine_steps < 0:
        problems.append(
            f"'refine_steps' must be an integer >= 0 (data-consistency steps after sampling; 0: none), got "
            f"{refine_steps!r}."
        )
    elif refine_steps and scale_ok and not guidance_scale:
        problems.append(
            f"'refine_steps' {refine_steps} takes data-consistency steps of weight 'guidance_scale', which is 0: "
            "give guidance_scale > 0 (1 is a full step) or refine_steps 0."
        )
    if noise_tolerance is not None and not (_is_number(noise_tolerance) and noise_tolerance >= 0):
        problems.append(
            "'noise_tolerance' must be null (every consistency step corrects) or a number >= 0 (a view within this "
            f"many times its X-ray's noise level is left alone), got {noise_tolerance!r}."
        )
    return problems


def warn_unchecked_corrections(
    mode: str,
    guidance_scale: float,
    refine_steps: int,
    consistency_reference: Sequence[float] | None,
    bundle_root: str,
    output_dir: str,
    stage: int,
) -> str | None:
    """Log (and return) one warning when inference corrects every view against the projector with no consistency
    check: refinement (``refine_steps``), or guidance in a diffusion mode, without a ``consistency_reference``.

    Both fit the sample to the X-rays as the projector models them; X-rays of a real detector (blurred, with another
    flat field, or taken in another pose) are then fitted wrongly, which costs PSNR (``docs/benchmarks.md``). The
    check is calibrated once per trained run by ``evaluate.json --calibrate True`` (the command the warning gives,
    for the run ``output_dir`` of the bundle ``bundle_root`` up to ``stage``) and recorded with its weights."""
    guided = mode in ("diffusion", "residual") and bool(guidance_scale)
    if consistency_reference is not None or not (guided or int(refine_steps) > 0):
        return None
    what = " and ".join(
        part
        for part, used in ((f"refine_steps {refine_steps}", int(refine_steps) > 0), ("projection guidance", guided))
        if used
    )
    configs = [os.path.join(bundle_root, "configs", name) for name in ("train.json", "evaluate.json")]
    command = shlex.join(
        ["python", "-m", "monai.bundle", "run", "--config_file", json.dumps(configs), "--output_dir", str(output_dir)]
        + ["--stage", str(stage), "--calibrate", "True"]
    )
    message = (
        f"inference corrects every view of every case towards the projector's X-rays ({what}) without a consistency "
        "check: on X-rays the projector does not model (detector blur, another flat field, a pose error) that "
        f"lowers the quality. Calibrate the check once for this run on cases with their CT: {command}; or pass "
        "--refine_steps 0 --guidance_scale 0 for such X-rays."
    )
    logger.warning(message)
    return message


class XrayCTSampler(InferenceView):
    """``forward(xray, previous=None)`` -> a CT volume in ``[-1, 1]`` of ``volume_size``: the mean of
    ``num_samples`` samples (:meth:`draw` gives the samples themselves).

    ``diffusion``: DDIM over exactly the points of ``timesteps`` from seeded start noise (one network evaluation
    per point; the X-ray back-projections and tokens are computed once). ``residual``: the same over the normalised
    residual ``(CT - estimate) / residual_scale`` of the denoiser's frozen direct regressor, whose estimate is
    computed once per case; the sample is ``estimate + residual_scale * residual``. ``direct``: one deterministic
    evaluation of the network with a zero noisy-volume channel at ``t = 0`` (the regression baseline).
    ``backprojection``: no network, the mean of the views' back-projections (the unlearned baseline: each voxel
    gets the mean attenuation along its rays). ``direct`` and ``backprojection`` give one sample whatever
    ``num_samples``.

    ``guidance_scale`` > 0 makes the samples agree with the X-rays: at every DDIM step the clean-volume estimate
    takes a projection-consistency step of that size (:meth:`common.xray2ct.drr.DRRProjector.data_consistency`,
    a SIRT step with the data's projector against the given X-rays), then the step continues from the corrected
    estimate. ``guidance_scale`` 0 leaves the sampler exactly as without guidance.

    ``refine_steps`` > 0 takes that many more consistency steps of weight ``guidance_scale`` on every sample once it
    is drawn, in every mode: the physics post-processing any method can have (``direct`` with it is the regression
    baseline refined by SIRT; ``backprojection`` with it is SIRT from the back-projection).

    Args:
        network: the :class:`XrayCTDenoiser` (normally the EMA copy).
        volume_size: the stage's volume size.
        mode: ``diffusion``, ``residual``, ``direct`` or ``backprojection``.
        timesteps: ascending time steps to sample over.
        num_train_timesteps, beta_schedule: the noise schedule of training.
        prediction_type: ``v_prediction`` or ``epsilon``.
        eta: DDIM eta (0: deterministic given the start noise).
        clip_sample: clip x0 estimates to ``[-1, 1]`` (the CT window).
        noise_seed: seed of the fixed start noise used when no generator is passed (the same noise for every
            case, so an exported sampler is a deterministic function of the X-rays).
        num_samples: samples drawn per case; ``forward`` returns their mean.
        sample_chunk: at most this many volumes per network evaluation (``None``: all samples of a call at once);
            lower it when the samples of a case do not fit in memory together. Results do not depend on it.
        guidance_scale: weight of the projection-consistency step at each DDIM step and of each refinement step
            (0: off).
        refine_steps: projection-consistency steps on every drawn sample (0: none; needs ``guidance_scale`` > 0).
        noise_tolerance: ``None``, or the discrepancy principle for the guidance and refinement steps: a view whose
            residual is within this many times its X-ray's estimated noise level gets no more correction
            (:meth:`common.xray2ct.drr.DRRProjector.data_consistency`).
        consistency_reference: ``None``, or the consistency check of the guidance and refinement steps: per
            statistic of :meth:`common.xray2ct.drr.DRRProjector.mismatch` (``residual``, the size of a view's
            disagreement with the projection; ``relation``, its systematic part) and per view, the value that the
            sampler's first estimate of the CT leaves on X-rays like those it was trained on (fitted on validation
            cases by :class:`common.xray2ct.metrics.SamplerCalibration`; the forms accepted:
            :func:`common.xray2ct.drr.consistency_bounds`). A sample whose first estimate leaves more than
            ``mismatch_tolerance`` times a bound on a view gets no correction from that view: its X-ray does not
            match the projector (blurred, miscalibrated, scattered, misposed or another geometry), and fitting it
            moves the volume away from the truth. The first estimate is the network's output (``direct``), the
            back-projection (``backprojection``) or the first DDIM step's prediction of the CT (``diffusion``,
            ``residual``), all before any correction.
        mismatch_tolerance: the factor of the bounds beyond which a view is left out (> 0).

    After each :meth:`draw`, :attr:`consistency` holds each statistic (``(N, V)``: each sample's first estimate,
    per view; ``None`` for a diffusion mode sampled without any correction) and ``corrected`` (``(N, V)``
    booleans: the views that corrected it), for the ``N`` samples drawn.
    """

    def __init__(
        self,
        network: nn.Module,
        volume_size: Sequence[int],
        mode: str = "diffusion",
        timesteps: Sequence[int] | torch.Tensor = (0,),
        num_train_timesteps: int = 1000,
        beta_schedule: str = "cosine",
        prediction_type: str = "v_prediction",
        eta: float = 0.0,
        clip_sample: bool = True,
        noise_seed: int = 0,
        num_samples: int = 1,
        sample_chunk: int | None = None,
        guidance_scale: float = 0.0,
        refine_steps: int = 0,
        noise_tolerance: float | None = None,
        consistency_reference: Sequence[float] | None = None,
        mismatch_tolerance: float = 1.0,
    ) -> None:
        super().__init__(network)
        if mode not in SAMPLER_MODES:
            raise ValueError(f"mode must be one of {SAMPLER_MODES}, got {mode!r}.")
        if (mode == "residual") != bool(getattr(unwrap(network), "residual", False)):
            raise ValueError(
                f"mode {mode!r} needs a {'residual' if mode == 'residual' else 'plain'} denoiser "
                f"(XrayCTDenoiser(residual={mode == 'residual'})); this one has residual="
                f"{bool(getattr(unwrap(network), 'residual', False))}."
            )
        problems = sampling_problems(num_samples, sample_chunk, guidance_scale, refine_steps, noise_tolerance)
        if problems:
            raise ValueError(" ".join(problems))
        self.volume_size = [int(s) for s in volume_size]
        self.mode = mode
        self.timesteps = torch.as_tensor(timesteps, dtype=torch.long).cpu()
        self.schedule = DiffusionSchedule(num_train_timesteps, beta_schedule)
        self.prediction_type = prediction_type
        self.eta = float(eta)
        self.clip_sample = bool(clip_sample)
        self.noise_seed = int(noise_seed)
        self.num_samples = int(num_samples)
        self.sample_chunk = None if sample_chunk is None else int(sample_chunk)
        self.guidance_scale = float(guidance_scale)
        self.refine_steps = int(refine_steps)
        self.noise_tolerance = None if noise_tolerance is None else float(noise_tolerance)
        consistency_reference = consistency_bounds(consistency_reference, unwrap(network).projector.views)
        if not (math.isfinite(float(mismatch_tolerance)) and float(mismatch_tolerance) > 0):
            raise ValueError(f"mismatch_tolerance must be a number > 0, got {mismatch_tolerance!r}.")
        self.consistency_reference = consistency_reference
        self.mismatch_tolerance = float(mismatch_tolerance)
        self.consistency: dict[str, torch.Tensor | None] = dict.fromkeys((*MISMATCH_STATISTICS, "corrected"))
        # a buffer, so that a traced (exported) sampler keeps the same noise
        self.register_buffer("start_noise", self._fixed_noise(self.num_samples), persistent=False)

    @property
    def with_previous(self) -> bool:
        return bool(unwrap(self.network).with_previous)

    @property
    def stochastic(self) -> bool:
        """Whether samples differ (``diffusion`` and ``residual``); the other modes give one sample per case."""
        return self.mode in ("diffusion", "residual")

    def samples_per_case(self, num_samples: int | None = None) -> int:
        """The samples :meth:`draw` returns per case (``num_samples``, default the sampler's; 1 when deterministic)."""
        return (self.num_samples if num_samples is None else int(num_samples)) if self.stochastic else 1

    def _start_noise(self, batch: int, k: int, generator: torch.Generator | None) -> torch.Tensor:
        """``(batch * k, 1, *volume_size)`` start noise, the ``k`` samples of a case next to each other."""
        shape = (1, 1, *self.volume_size)
        if generator is not None:
            if k == 1:  # one draw for the batch, as a single sample has always been drawn
                return torch.randn((batch, *shape[1:]), generator=generator)
            return torch.cat([torch.randn(shape, generator=generator) for _ in range(batch * k)])
        noises = self.start_noise if k <= self.start_noise.shape[0] else self._fixed_noise(k)
        return noises[:k].cpu().repeat(batch, 1, 1, 1, 1)

    def _fixed_noise(self, k: int) -> torch.Tensor:
        """``k`` start noises from ``noise_seed``, drawn one after the other (the first is the single-sample one)."""
        fixed = torch.Generator().manual_seed(self.noise_seed)
        return torch.cat([torch.randn((1, 1, *self.volume_size), generator=fixed) for _ in range(int(k))])

    @torch.no_grad()
    def draw(
        self,
        xray: torch.Tensor,
        previous: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        num_samples: int | None = None,
    ) -> torch.Tensor:
        """``(B * K, 1, *volume_size)`` samples, the ``K`` (:meth:`samples_per_case`) of a case next to each other.

        Args:
            xray: ``(B, V, H, W)`` X-rays.
            previous: the previous stage's output, ``B`` volumes or ``B * K`` samples (stage >= 2).
            generator: RNG of the start noise (default: the fixed seeded noise).
            num_samples: ``K`` (default: the sampler's ``num_samples``).
        """
        net = self.network
        batch = xray.shape[0]
        k = self.samples_per_case(num_samples)
        if self.mode == "backprojection":
            backprojection = unwrap(net).projector.backproject(xray, self.volume_size)
            first = backprojection.mean(1, keepdim=True).clamp(-1.0, 1.0)
            return self.refine(first, xray, self._check_consistency(first, xray))
        if previous is not None:
            previous = upsample_previous(previous, self.volume_size)
            if previous.shape[0] not in (batch, batch * k):
                raise ValueError(f"previous holds {previous.shape[0]} volumes; expected {batch} or {batch * k}.")
        condition = unwrap(net).condition(xray, self.volume_size)
        if self.mode == "direct":
            zeros = torch.zeros((batch, 1, *self.volume_size), device=xray.device)
            t = torch.zeros(batch, dtype=torch.long, device=xray.device)
            out = net(zeros, t, xray, previous, condition=condition).float()
            out = out.clamp(-1.0, 1.0) if self.clip_sample else out
            return self.refine(out, xray, self._check_consistency(out, xray))
        noise = self._start_noise(batch, k, generator).to(xray.device)

        def per_sample(x: torch.Tensor | None) -> torch.Tensor | None:
            return x if x is None or k == 1 or x.shape[0] == batch * k else x.repeat_interleave(k, dim=0)

        xray_k, previous_k = per_sample(xray), per_sample(previous)
        condition_k = tuple(per_sample(c) for c in condition)
        estimate_k = None
        if self.mode == "residual":  # once per case, or per sample when each sample has its own previous stage
            per_case = previous is None or previous.shape[0] == batch
            estimate = unwrap(net).estimate(xray if per_case else xray_k, previous, self.volume_size)
            estimate_k = per_sample(estimate)
        chunk = self.sample_chunk or batch * k
        samples, checks = [], []
        for i in range(0, batch * k, chunk):
            sample, check = self._sample_chunk(
                noise[i : i + chunk],
                xray_k[i : i + chunk],
                None if previous_k is None else previous_k[i : i + chunk],
                tuple(c[i : i + chunk] for c in condition_k),
                None if estimate_k is None else estimate_k[i : i + chunk],
                generator,
            )
            samples.append(sample)
            checks.append(check)
        if all(c["corrected"] is not None for c in checks):
            self.consistency = {name: torch.cat([c[name] for c in checks]) for name in checks[0]}
        else:
            self.consistency = {
                **dict.fromkeys(MISMATCH_STATISTICS),
                "corrected": self._all_views(batch * k, xray.device),
            }
        return self.refine(torch.cat(samples), xray_k, self.consistency["corrected"])

    def _all_views(self, n: int, device: torch.device | str) -> torch.Tensor:
        return torch.ones((n, len(unwrap(self.network).projector.views)), dtype=torch.bool, device=device)

    def _check_consistency(self, volume: torch.Tensor, xray: torch.Tensor) -> torch.Tensor:
        """Records the first estimates' mismatch statistics per view in :attr:`consistency` and returns the
        ``(N, V)`` views that may correct them: those within ``mismatch_tolerance`` times every bound of the
        reference (all, without a ``consistency_reference``)."""
        statistics = unwrap(self.network).projector.mismatch(volume, xray)
        corrected = self._all_views(volume.shape[0], volume.device)
        for name, bounds in (self.consistency_reference or {}).items():
            corrected &= statistics[name] <= torch.tensor(bounds, device=volume.device) * self.mismatch_tolerance
        self.consistency = {**statistics, "corrected": corrected}
        return corrected

    def refine(self, volume: torch.Tensor, xray: torch.Tensor, corrected: torch.Tensor | None = None) -> torch.Tensor:
        """``volume`` after ``refine_steps`` projection-consistency steps of weight ``guidance_scale`` against
        ``xray`` (one X-ray per volume), clipped to the CT window after each step when ``clip_sample``; with
        ``corrected`` (``(N, V)`` booleans) only those views correct."""
        projector = unwrap(self.network).projector
        view_weight = None if corrected is None or self.consistency_reference is None else corrected.float()
        for _ in range(self.refine_steps):
            volume = projector.data_consistency(volume, xray, self.guidance_scale, self.noise_tolerance, view_weight)
            volume = volume.clamp(-1.0, 1.0) if self.clip_sample else volume
        return volume

    def _sample_chunk(
        self,
        noise: torch.Tensor,
        xray: torch.Tensor,
        previous: torch.Tensor | None,
        condition: tuple[torch.Tensor, ...],
        estimate: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        """The DDIM samples of one chunk (``noise`` and the per-sample inputs of its volumes), and the consistency
        check of their first estimates (the statistics and ``corrected``, see :attr:`consistency`; each is
        ``None`` when the chunk was sampled without any correction)."""
        net = self.network
        denoiser = unwrap(net)
        extra = {} if estimate is None else {"estimate": estimate}
        check: dict[str, torch.Tensor | None] = dict.fromkeys((*MISMATCH_STATISTICS, "corrected"))

        def model_fn(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return net(x_t, t, xray, previous, condition=condition, **extra).float()

        def to_volume(state: torch.Tensor) -> torch.Tensor:  # the sampled state is the CT or its residual
            return state if estimate is None else denoiser.to_volume(state, estimate.double())

        def to_state(volume: torch.Tensor) -> torch.Tensor:
            return volume if estimate is None else denoiser.to_residual(volume, estimate.double())

        def corrected(x0: torch.Tensor, t: int) -> torch.Tensor:
            volume = to_volume(x0)
            if check["corrected"] is None:  # the first estimate, before any correction
                self._check_consistency(volume.float(), xray)
                check.update(self.consistency)
            if self.guidance_scale:
                views = None if self.consistency_reference is None else check["corrected"].to(volume.dtype)
                volume = denoiser.projector.data_consistency(
                    volume, xray, self.guidance_scale, self.noise_tolerance, views
                )
            if self.clip_sample:
                volume = volume.clamp(-1.0, 1.0)
            return to_state(volume)

        transform = corrected if estimate is not None or self.guidance_scale else None
        out = grid_ddim_sample(
            model_fn,
            noise,
            self.timesteps,
            self.schedule,
            eta=self.eta,
            prediction_type=self.prediction_type,
            generator=generator,
            clip_sample=self.clip_sample and estimate is None and not self.guidance_scale,
            x0_transform=transform,
        )
        return (to_volume(out.double()).to(noise.dtype) if estimate is not None else out), check

    def forward(
        self, xray: torch.Tensor, previous: torch.Tensor | None = None, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        samples = self.draw(xray, previous, generator)
        return samples.reshape(xray.shape[0], -1, *samples.shape[1:]).mean(1)


class XrayCTCascade(nn.Module):
    """The stages in order: stage 1 from the X-rays alone, every later stage also from the upsampled output of
    the one before. ``forward(xray)`` returns the last stage's volume; :meth:`run` returns every stage's.

    The checkpoint is one flat state dict: each stage's denoiser weights under ``stage<k>.``.

    Args:
        samplers: one :class:`XrayCTSampler` per stage, in order; stage ``k >= 2`` must take a previous stage.

    Raises:
        ValueError: when stage 1 takes a previous stage or a later one does not.
    """

    def __init__(self, samplers: Sequence[XrayCTSampler]) -> None:
        super().__init__()
        if not samplers:
            raise ValueError("a cascade needs at least one stage.")
        for i, sampler in enumerate(samplers):
            if sampler.with_previous != (i > 0):
                raise ValueError(
                    f"stage {i + 1} of the cascade {'must' if i else 'must not'} take the previous stage's output "
                    f"(with_previous={sampler.with_previous})."
                )
        self.stages = nn.ModuleList(samplers)

    def state_dict(self, *args, keep_vars: bool = False, **kwargs):
        return {
            f"stage{i + 1}.{k}": v
            for i, stage in enumerate(self.stages)
            for k, v in stage.state_dict(keep_vars=keep_vars).items()
        }

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state_dict.items():
            stage, _, name = key.partition(".")
            parts.setdefault(stage, {})[name] = value
        expected = [f"stage{i + 1}" for i in range(len(self.stages))]
        missing = [k for k in expected if k not in parts]
        if missing:
            raise RuntimeError(f"the cascade checkpoint has no weights for {missing}; it holds {sorted(parts)}.")
        if strict and set(parts) != set(expected):
            raise RuntimeError(f"the cascade checkpoint holds {sorted(parts)}, but this cascade has {expected}.")
        for name, stage in zip(expected, self.stages):
            stage.load_state_dict(parts[name], strict=strict, assign=assign)
        return None

    def draw(
        self, xray: torch.Tensor, generator: torch.Generator | None = None, num_samples: int | None = None
    ) -> list[torch.Tensor]:
        """Every stage's samples (:meth:`XrayCTSampler.draw`): sample ``j`` of a stage conditions on sample ``j`` of
        the stage before, so the last stage's samples are draws of the whole cascade."""
        outputs: list[torch.Tensor] = []
        for stage in self.stages:
            outputs.append(stage.draw(xray, outputs[-1] if outputs else None, generator, num_samples))
        return outputs

    def run(self, xray: torch.Tensor, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """Every stage's output: the mean of its samples."""
        batch = xray.shape[0]
        return [s.reshape(batch, -1, *s.shape[1:]).mean(1) for s in self.draw(xray, generator)]

    def forward(self, xray: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.run(xray, generator)[-1]


def build_cascade(
    projector: DRRProjector,
    stage_sizes: Sequence[Sequence[int]],
    stages: int,
    network_settings: Mapping[str, Any],
    sampler_settings: Mapping[str, Any],
    device: torch.device | str = "cpu",
) -> XrayCTCascade:
    """The cascade of stages ``1 .. stages`` with one network architecture (``network_settings``, the keyword
    arguments of :class:`XrayCTDenoiser` besides ``projector``/``with_previous``) and one sampler setting
    (``sampler_settings``: :class:`XrayCTSampler` arguments besides ``network``/``volume_size``), random weights.
    ``consistency_reference`` is the last stage's (the stage an evaluation calibrates): the earlier stages correct
    without the consistency check."""
    samplers = []
    for k in range(int(stages)):
        network = XrayCTDenoiser(projector, with_previous=k > 0, **dict(network_settings)).to(device)
        settings = dict(sampler_settings)
        if k < int(stages) - 1:
            settings["consistency_reference"] = None
        samplers.append(XrayCTSampler(network, stage_sizes[k], **settings))
    return XrayCTCascade(samplers).to(device)


def stage_checkpoint(root: str | os.PathLike, stage: int) -> str:
    """Where training stage ``stage`` writes its best weights under the run folder ``root``."""
    return str(Path(root) / f"stage{int(stage)}" / "models" / "model.pt")


def _stage_runs(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(k, stage folder)`` of every stage of the run folder ``output_dir`` that recorded its run, in order."""
    return sorted(
        (int(p.parent.parent.name[len("stage") :]), p.parent.parent)
        for p in Path(output_dir).glob(f"stage*/{RUN_FILE.as_posix()}")
        if p.parent.parent.name[len("stage") :].isdigit()
    )


def cascade_settings(output_dir: str | os.PathLike, bundle_root: str | os.PathLike) -> RunSettings:
    """The settings of the cascade trained in the run folder ``output_dir``: those of its highest stage folder
    (``stage<k>/configs/run.json``, with ``stage`` = k), or the bundle's ``train.json`` defaults when no stage was
    recorded (a packaged bundle) - see :func:`common.runs.run_settings`."""
    stages = _stage_runs(output_dir)
    if not stages:
        return run_settings(output_dir, bundle_root)
    stage, folder = stages[-1]
    settings = run_settings(folder, bundle_root)
    settings["stage"] = stage
    return settings


def cascade_record(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The record the combined cascade file carries (:func:`save_cascade`): the ``configs/run.json`` of the highest
    recorded stage of the run folder ``output_dir`` with ``stage`` = k among its settings, so a package of the file
    builds all k stages with the settings they were trained with; ``None`` when no stage recorded its run."""
    stages = _stage_runs(output_dir)
    if not stages:
        return None
    stage, folder = stages[-1]
    record = read_record(folder) or {}
    return {**record, "settings": {**record.get("settings", {}), "stage": stage}}


def cascade_checkpoints(
    outputs_root: str | os.PathLike, bundle_root: str | os.PathLike, stages: int
) -> str | list[str]:
    """The weights of stages ``1 .. stages``: each stage's file written by training (``outputs/stage<k>/models/
    model.pt``) when all exist, else the combined cascade file (:func:`save_cascade`) of the run
    (``outputs/models/model.pt``) or of a packaged bundle (``<bundle_root>/models/model.pt``).

    Raises:
        CheckpointError: naming every missing stage file and the combined file.
    """
    per_stage = [stage_checkpoint(outputs_root, k) for k in range(1, int(stages) + 1)]
    missing = [p for p in per_stage if not os.path.isfile(p)]
    if not missing:
        return per_stage
    combined = [str(Path(root) / "models" / "model.pt") for root in (outputs_root, bundle_root)]
    for path in combined:
        if os.path.isfile(path):
            return path
    raise CheckpointError(
        f"no weights for stage(s) {[per_stage.index(p) + 1 for p in missing]}: {missing} do not exist (train those "
        f"stages first, in order: --stage 1, then --stage 2, ...) and there is no combined cascade {combined}."
    )


def load_cascade(cascade: XrayCTCascade, checkpoints: str | os.PathLike | Sequence[str]) -> XrayCTCascade:
    """Load a combined cascade file (keys ``stage<k>.<name>``) or one file per stage, in order.

    Raises:
        CheckpointError: naming the file that is missing, unreadable or belongs to another stage/architecture.
    """

    if isinstance(checkpoints, (str, os.PathLike)):
        state = load_checkpoint(checkpoints)
        try:
            cascade.load_state_dict(state)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint {os.fspath(checkpoints)!r} does not fit the cascade: {exc}") from exc
        return cascade
    paths = list(checkpoints)
    if len(paths) != len(cascade.stages):
        raise CheckpointError(
            f"the cascade has {len(cascade.stages)} stage(s) but {len(paths)} checkpoint(s): {paths}."
        )
    for k, (stage, path) in enumerate(zip(cascade.stages, paths), start=1):
        state = load_checkpoint(path)  # names a missing or unreadable file
        try:
            stage.load_state_dict(state)
        except RuntimeError as exc:
            raise CheckpointError(f"stage {k}'s checkpoint {os.fspath(path)!r} does not fit stage {k}: {exc}") from exc
    return cascade


def save_cascade(cascade: XrayCTCascade, path: str | os.PathLike, record: Mapping[str, Any] | None = None) -> Path:
    """Write the combined cascade checkpoint (what a packaged bundle ships as ``models/model.pt``) carrying
    ``record`` (:func:`cascade_record`: the settings of its stages, see :func:`common.checkpoint_io.save_weights`).
    """

    return save_weights(cascade.state_dict(), path, record=record)


def previous_stages(
    projector: DRRProjector,
    stage_sizes: Sequence[Sequence[int]],
    stage: int,
    network_settings: Mapping[str, Any],
    sampler_settings: Mapping[str, Any],
    outputs_root: str | os.PathLike,
    checkpoints: Sequence[str] | None = None,
    device: torch.device | str = "cpu",
) -> XrayCTCascade | None:
    """The trained stages before ``stage`` (``None`` for stage 1), loaded from ``checkpoints`` (default: their
    files under ``outputs_root``), frozen, for conditioning a later stage's validation on their real output.

    Raises:
        CheckpointError: naming every missing checkpoint (before anything is trained).
    """
    if int(stage) <= 1:
        return None
    paths = list(checkpoints) if checkpoints else [stage_checkpoint(outputs_root, k) for k in range(1, int(stage))]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise CheckpointError(
            f"stage {stage} needs the trained weights of stage(s) 1..{int(stage) - 1}, but {missing} do not exist: "
            f"train the earlier stages first (--stage 1, ...) or pass --previous_ckpts with their model.pt files."
        )
    cascade = build_cascade(projector, stage_sizes, int(stage) - 1, network_settings, sampler_settings, device)
    load_cascade(cascade, paths)
    cascade.requires_grad_(False)
    return cascade.eval()

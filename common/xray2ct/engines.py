# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Training and evaluation engines of biplanar X-ray -> CT models (one stage of the progressive cascade).

A batch is a dict with ``image`` (the CT at the stage's size, ``B, 1, X, Y, Z`` in ``[-1, 1]``; absent at
inference from X-ray files) and ``xray`` (``B, V, H, W`` normalised line integrals, see
:mod:`common.xray2ct.drr`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from monai.utils import CommonKeys as Keys
from torch import nn

from common.diffusion.engines import DiffusionTrainer, case_name, volume_seed
from common.diffusion.metrics import output_value_handler
from common.engines.evaluator import StepEvaluator
from common.metrics.image import image_quality_handlers
from common.networks.wrappers import unwrap
from common.utils import plain_tensor
from common.xray2ct.drr import DRRProjector
from common.xray2ct.losses import ProjectionLoss, physics_noise_weight
from common.xray2ct.metrics import UNCERTAINTY_SCORES, texture_handlers, uncertainty_scores
from common.xray2ct.networks import MODES, degrade_to_previous

logger = logging.getLogger(__name__)

__all__ = [
    "DIRECT_LOSSES",
    "LOSS_WEIGHTINGS",
    "XRAY_KEY",
    "XrayCTEvaluator",
    "XrayCTTrainer",
    "prepare_xray_batch",
    "snr_loss_weight",
    "stage_value",
    "xray2ct_metric_handlers",
]

XRAY_KEY = "xray"
DIRECT_LOSSES = ("l1", "mse")
LOSS_WEIGHTINGS = ("none", "min_snr")


def prepare_xray_batch(
    batchdata: Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    non_blocking: bool = False,
    **kwargs,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(image, xray)``: the CT (``None`` when the batch has none) and the X-rays, on ``device``."""
    if XRAY_KEY not in batchdata:
        raise KeyError(f"an X-ray -> CT batch needs {XRAY_KEY!r}; it has {sorted(batchdata)}.")
    xray = batchdata[XRAY_KEY].to(device=device, non_blocking=non_blocking, **kwargs)
    image = batchdata.get(Keys.IMAGE)
    if isinstance(image, torch.Tensor):
        image = image.to(device=device, non_blocking=non_blocking, **kwargs)
    else:
        image = None
    return image, xray


def stage_value(values: Sequence[Any], stage: int, name: str) -> Any:
    """The entry of a per-stage list (``stage`` counts from 1).

    Raises:
        ValueError: naming ``name`` when the list has no entry for ``stage``.
    """
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 1:
        raise ValueError(f"'stage' must be an integer >= 1, got {stage!r}.")
    if not isinstance(values, (list, tuple)) or len(values) < stage:
        raise ValueError(f"{name!r} must be a list with an entry for stage {stage}, got {values!r}.")
    return values[stage - 1]


class XrayCTTrainer(DiffusionTrainer):
    """Trains one stage: the denoiser ``network(x, t, xray, previous)`` as a diffusion model or a ``direct``
    regressor, plus the projection ("physics") loss.

    ``diffusion``: time steps from ``timesteps`` (antithetic over the global batch, as
    :class:`common.diffusion.engines.DiffusionTrainer`), ``x_t`` of the CT, MSE on the v (or epsilon)
    target. ``direct``: the same network with a zero ``x_t`` channel at ``t = 0`` regresses the CT (``l1`` or
    ``mse``). Physics: the x0 estimate (from ``x_t`` and the output in diffusion mode) is projected by the data's
    projector and compared with the input X-rays (:class:`common.xray2ct.losses.ProjectionLoss`), weighted by
    ``physics_weight`` and per sample by :func:`common.xray2ct.losses.physics_noise_weight` of its noise level.

    From stage 2 on (``previous_size`` given), the previous stage's output is stood in for by the CT
    area-averaged to ``previous_size`` and upsampled, with conditioning noise up to ``previous_noise``
    (:func:`common.xray2ct.networks.degrade_to_previous`).

    ``engine.state.output`` holds ``image``, ``loss``, ``recon_loss``, ``physics_loss`` (unweighted mean),
    ``grad_norm`` (when clipping) and ``timestep_mean``.

    Args:
        projector: the projector of the data (geometry of the physics loss).
        mode: ``diffusion`` or ``direct``.
        physics_weight: weight of the physics loss (0 disables it).
        physics_weighting: ``alpha_bar`` or ``none``.
        direct_loss: ``l1`` or ``mse`` (direct mode).
        previous_size: the previous stage's volume size (``None`` for stage 1).
        previous_noise: maximum standard deviation of the conditioning noise.
        prediction_type: ``v_prediction`` or ``epsilon`` (diffusion mode).
        settings: the arguments of :class:`common.diffusion.engines.DiffusionTrainer` (``network``,
            ``optimizer``, ``schedule``, ``timesteps``, ``seed``, ...; the target is channel 0), ``prepare_batch``
            defaults to :func:`prepare_xray_batch`.
    """

    default_prepare_batch = staticmethod(prepare_xray_batch)
    output_prediction = False

    def __init__(
        self,
        *,
        projector: DRRProjector,
        mode: str = "diffusion",
        prediction_type: str = "v_prediction",
        physics_weight: float = 0.1,
        physics_weighting: str = "alpha_bar",
        direct_loss: str = "l1",
        previous_size: Sequence[int] | None = None,
        previous_noise: float = 0.1,
        loss_weighting: str = "none",
        min_snr_gamma: float = 5.0,
        **settings: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}.")
        if direct_loss not in DIRECT_LOSSES:
            raise ValueError(f"direct_loss must be one of {DIRECT_LOSSES}, got {direct_loss!r}.")
        physics_noise_weight(torch.ones(1), physics_weighting)  # validates the name
        super().__init__(target_channels=[0], prediction_type=prediction_type, **settings)
        if (mode == "residual") != bool(getattr(unwrap(self.network), "residual", False)):
            raise ValueError(f"mode {mode!r} needs XrayCTDenoiser(residual={mode == 'residual'}).")
        self.mode = mode
        self.projection_loss = ProjectionLoss(projector)
        self.physics_weight = float(physics_weight)
        self.physics_weighting = physics_weighting
        self.direct_loss = direct_loss
        self.previous_size = None if previous_size is None else [int(s) for s in previous_size]
        self.previous_noise = float(previous_noise)
        self.loss_weighting = loss_weighting
        self.min_snr_gamma = float(min_snr_gamma)

    def _inputs(
        self, x0: torch.Tensor, iteration: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_t, t, target, alpha_bar)`` of this iteration."""
        batch = x0.shape[0]
        if self.mode == "direct":
            t = torch.zeros(batch, dtype=torch.long, device=x0.device)
            return torch.zeros_like(x0), t, x0, torch.ones(batch, device=x0.device)
        x_t, t, target = self.noised(x0, iteration)
        return x_t, t, target, self.schedule.alpha_bar(t, x0).reshape(-1).float()

    def prepare_step(self, engine: XrayCTTrainer, batchdata: dict[str, torch.Tensor]) -> dict[str, Any]:
        image, xray = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking, **engine.to_kwargs)
        if image is None:
            raise ValueError(f"training needs the CT as {Keys.IMAGE!r} in every batch.")
        x0, xray = plain_tensor(image).float(), plain_tensor(xray).float()
        self.log_effective_batch(x0.shape[0])
        previous = None
        if self.previous_size is not None:
            previous = degrade_to_previous(x0, self.previous_size, self.previous_noise)
        estimate = None
        state = x0
        if self.mode == "residual":  # the diffusion runs on the normalised residual of the frozen regressor
            denoiser = unwrap(engine.network)
            estimate = denoiser.estimate(xray, previous, x0.shape[2:])
            state = denoiser.to_residual(x0, estimate)
        x_t, t, target, alpha_bar = self._inputs(state, engine.state.iteration)
        return {
            "args": (x_t, t, xray, previous) if estimate is None else (x_t, t, xray, previous, None, estimate),
            "output": {Keys.IMAGE: x0},
            "estimate": estimate,
            "x0": x0,
            "x_t": x_t,
            "t": t,
            "xray": xray,
            "target": target,
            "alpha_bar": alpha_bar,
            "stats": {"timestep_mean": t.float().mean()},
        }

    def compute_loss(
        self, engine: XrayCTTrainer, step: dict[str, Any], prediction: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The v-prediction (or direct) reconstruction loss plus the noise-weighted projection loss."""
        prediction, x0, x_t, t = prediction.float(), step["x0"], step["x_t"], step["t"]
        if self.mode == "direct":
            x0_hat = prediction
            recon = F.l1_loss(prediction, x0) if self.direct_loss == "l1" else F.mse_loss(prediction, x0)
        else:
            x0_hat = self.schedule.split(x_t, prediction, t, self.prediction_type)[0].float()
            if step["estimate"] is not None:
                x0_hat = unwrap(engine.network).to_volume(x0_hat, step["estimate"])
            target = step["target"].float()
            if self.loss_weighting == "none":
                recon = F.mse_loss(prediction, target)
            else:
                errors = (prediction - target).square().flatten(1).mean(1)
                alpha_bar = step["alpha_bar"]
                snr_weights = snr_loss_weight(alpha_bar, self.prediction_type, self.loss_weighting, self.min_snr_gamma)
                recon = (snr_weights.to(errors.device) * errors).mean()
        physics = self.projection_loss(x0_hat, step["xray"])
        weights = physics_noise_weight(step["alpha_bar"], self.physics_weighting)
        loss = recon + self.physics_weight * (weights * physics).mean() if self.physics_weight else recon
        return loss, {"recon_loss": recon, "physics_loss": physics.mean()}


def snr_loss_weight(
    alpha_bar: torch.Tensor, prediction_type: str, weighting: str = "none", gamma: float = 5.0
) -> torch.Tensor:
    """Per-sample weight of the diffusion MSE at signal fraction ``alpha_bar``.

    ``none``: 1 (the plain MSE on the prediction target). ``min_snr``: Min-SNR-gamma (Hang et al. 2023), the
    x0-error weight ``min(SNR, gamma)`` expressed for the prediction target - ``min(SNR, gamma) / (SNR + 1)`` for
    v, ``min(SNR, gamma) / SNR`` for epsilon - so the many nearly noise-free steps stop dominating the gradient.

    Raises:
        ValueError: for an unknown ``weighting`` or a non-positive ``gamma``.
    """
    if weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {weighting!r}.")
    alpha_bar = alpha_bar.reshape(-1).double()
    if weighting == "none":
        return torch.ones_like(alpha_bar).float()
    if not float(gamma) > 0:
        raise ValueError(f"min_snr_gamma must be positive, got {gamma!r}.")
    snr = alpha_bar / (1 - alpha_bar).clamp_min(1e-12)
    clipped = snr.clamp(max=float(gamma))
    return (clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr).float()


class XrayCTEvaluator(StepEvaluator):
    """Generates a CT per case with a :class:`common.xray2ct.networks.XrayCTSampler` (validation, evaluation,
    inference), running the earlier stages first when ``previous`` is given.

    The start noise of each case is seeded by :func:`common.diffusion.engines.volume_seed`, so results do
    not depend on batch order or the number of ranks. ``engine.state.output`` (not decollated) holds ``pred``
    (the CT in ``[0, 1]`` of the HU window; a MetaTensor with the input CT's metadata when there is one),
    ``label`` (the real CT in ``[0, 1]``, when the batch has one), ``xray`` (the input X-rays),
    ``pred_xray`` (the X-rays of the prediction, same size) and ``proj_error`` (per case: the mean absolute
    difference of normalised line integrals between the prediction and the input X-rays at the stage's resolution).

    ``pred`` is the mean of the sampler's ``num_samples`` samples per case (:meth:`XrayCTSampler.draw`, drawn in
    one batched pass or in ``sample_chunk`` pieces; sample ``j`` of stage ``k`` conditions on sample ``j`` of stage
    ``k - 1``). With more than one sample the output also holds ``pred_std`` (the per-voxel standard deviation of
    the samples on the same ``[0, 1]`` scale), ``pred_sample`` (the first sample, the one a single-sample run
    draws) and ``sample_proj_error``; with a real CT too, the per-case scores of that spread as an uncertainty
    (:func:`common.xray2ct.metrics.uncertainty_scores`: ``coverage_1std``, ``coverage_2std``,
    ``std_error_spearman``, ``std_error_partial_spearman``). ``uncertainty_scale`` and ``uncertainty_floor`` calibrate
    the spread, ``scale * (std + floor)`` (fitted on validation cases by
    :class:`common.xray2ct.metrics.SamplerCalibration`; 1 and 0: the samples' own).

    Args:
        previous: the earlier stages (an :class:`common.xray2ct.networks.XrayCTCascade`) for stage >= 2.
        seed: base seed of the start noise.
        uncertainty_scale: factor of the samples' standard deviation in ``pred_std`` (> 0).
        uncertainty_floor: added to the samples' standard deviation before the factor (>= 0, ``[0, 1]`` scale).
        settings: the arguments of :class:`common.engines.evaluator.StepEvaluator`: ``device``,
            ``val_data_loader`` (of dicts with ``xray``, and ``image`` to score against), ``network`` (the
            stage's sampler), ``amp``, ``inferer`` (calls the sampler on each case's X-rays; default
            ``SimpleInferer``), ...; ``prepare_batch`` defaults to :func:`prepare_xray_batch`.
    """

    default_prepare_batch = staticmethod(prepare_xray_batch)

    def __init__(
        self,
        *,
        previous: nn.Module | None = None,
        seed: int = 0,
        uncertainty_scale: float = 1.0,
        uncertainty_floor: float = 0.0,
        **settings: Any,
    ) -> None:
        super().__init__(**settings)
        if not float(uncertainty_scale) > 0 or not float(uncertainty_floor) >= 0:
            raise ValueError(
                f"uncertainty_scale must be positive and uncertainty_floor >= 0, got {uncertainty_scale!r} and "
                f"{uncertainty_floor!r}."
            )
        self.uncertainty_scale, self.uncertainty_floor = float(uncertainty_scale), float(uncertainty_floor)
        if self.network.with_previous and previous is None:
            raise ValueError("this stage conditions on the previous stage: pass the earlier stages as 'previous'.")
        self.previous = previous
        self.seed = int(seed)
        self.projection_loss = ProjectionLoss(unwrap(self.network.network).projector)

    def evaluate_step(
        self, engine: XrayCTEvaluator, batchdata: dict[str, Any], image: torch.Tensor | None, xray: torch.Tensor
    ) -> dict:
        xray = plain_tensor(xray).float()
        sampler = engine.network
        modules = [sampler] + ([self.previous] if self.previous is not None else [])
        means, stds, firsts, checks = [], [], [], []
        with self.inference(*modules):
            for i in range(xray.shape[0]):
                generator = torch.Generator().manual_seed(volume_seed(batchdata, i, self.seed))
                case = xray[i : i + 1]
                previous = self.previous.draw(case, generator=generator)[-1] if self.previous is not None else None
                samples = engine.inferer(case, sampler.draw, previous, generator=generator).float()
                means.append(samples.mean(0, keepdim=True))
                stds.append(samples.std(0, correction=0, keepdim=True))
                firsts.append(samples[:1])
                if sampler.consistency["residual"] is not None:  # per view, the mean over the case's samples
                    checks.append({k: v.float().mean(0, keepdim=True).cpu() for k, v in sampler.consistency.items()})
                    _warn_mismatch(sampler, batchdata, i, checks[-1])
        volume = torch.cat(means)
        projector = unwrap(sampler.network).projector
        output: dict[str, Any] = {
            XRAY_KEY: xray,
            "pred_xray": projector.project(volume, xray.shape[-2:]),
            "proj_error": self.projection_loss(volume, xray),
        }
        if len(checks) == xray.shape[0]:  # per case and view: the first estimates' statistics, the share corrected
            output.update({f"consistency_{k}": torch.cat([c[k] for c in checks]) for k in checks[0]})
        # per case: the share of its samples' views the consistency check let correct them (1: all, or no check)
        share = output.get("consistency_corrected")
        output["corrected_views"] = torch.ones(xray.shape[0]) if share is None else share.mean(1)
        meta = image if isinstance(image, MetaTensor) else batchdata.get(XRAY_KEY)
        output[Keys.PRED] = _with_meta(((volume + 1) / 2).clamp(0, 1), meta)
        if sampler.samples_per_case() > 1:  # the spread of the samples, and one sample scored as the mean is
            # on the [0, 1] scale of ``pred``; calibrated: ``uncertainty_scale * (std + uncertainty_floor)``
            output["pred_std"] = (torch.cat(stds) / 2 + self.uncertainty_floor) * self.uncertainty_scale
            sample = torch.cat(firsts)
            output["pred_sample"] = _with_meta(((sample + 1) / 2).clamp(0, 1), meta)
            output["sample_proj_error"] = self.projection_loss(sample, xray)
        if image is not None:
            output[Keys.LABEL] = ((plain_tensor(image).float() + 1) / 2).clamp(0, 1)
            if "pred_std" in output:  # how well the spread tells where the error is (``uncertainty_scores``)
                scores = uncertainty_scores(plain_tensor(output[Keys.PRED]), output["pred_std"], output[Keys.LABEL])
                output.update(scores)
        return output


def _warn_mismatch(sampler: nn.Module, batchdata: Any, index: int, check: dict[str, torch.Tensor]) -> None:
    """One warning line for a case some of whose views the sampler's consistency check left out (``check``: the
    case's statistics and share corrected, ``(1, V)``), naming each view and the bounds it exceeded."""
    if bool((check["corrected"] >= 1).all()) or not (sampler.guidance_scale and sampler.consistency_reference):
        return
    tolerance = sampler.mismatch_tolerance
    left_out = []
    for v, view in enumerate(unwrap(sampler.network).projector.views):
        if float(check["corrected"][0, v]) < 1:
            beyond = [
                f"{name} {float(check[name][0, v]):.4g} > {tolerance:g} x {bounds[v]:.4g}"
                for name, bounds in sampler.consistency_reference.items()
                if float(check[name][0, v]) > tolerance * bounds[v]
            ]
            left_out.append(f"{view} ({', '.join(beyond) or 'some samples'})")
    name = case_name(batchdata, index)
    logger.warning(
        "case %s: the X-ray of view(s) %s does not match the projector as the calibration cases did (blurred, "
        "miscalibrated, scattered, misposed or another geometry?): no projection correction from it.",
        name if name is not None else index,
        "; ".join(left_out),
    )


def _with_meta(volume: torch.Tensor, source: Any) -> torch.Tensor:
    """``volume`` as a MetaTensor with the metadata of ``source`` (the input CT, else the X-rays) when it has any."""
    if not isinstance(source, MetaTensor):
        return volume
    if source.ndim == 5:
        return MetaTensor(volume, meta=source.meta, applied_operations=source.applied_operations)
    return MetaTensor(volume, meta=source.meta)


def xray2ct_metric_handlers(
    prefix: str = "val_", save_details: bool = False, num_samples: int = 1, mode: str = "diffusion"
) -> dict:
    """The metrics of an X-ray -> CT model, keyed ``prefix + name``: ``psnr``, ``ssim`` and ``ms_ssim`` of the
    generated CT (the mean of the samples) against the real one on ``[0, 1]`` (the projector's HU window, so PSNR's
    data range is the window's width in HU; see :func:`common.metrics.image.image_quality_handlers`),
    ``proj_error``, the evaluator's per-case projection error, ``corrected_views``, the share of the views the
    sampler's consistency check let correct each case (1 without a check), and the texture measures ``hf_ratio`` and
    ``spectral_distance`` (:mod:`common.xray2ct.metrics`). When a stochastic ``mode`` (``diffusion``,
    ``residual``) draws ``num_samples`` > 1 samples, the same of one sample, ``sample_<name>``: the mean is
    smoother than any sample, so the texture of what the model generates is the single sample's; and the scores of
    the samples' spread as an uncertainty (:data:`common.xray2ct.metrics.UNCERTAINTY_SCORES`)."""
    from monai.handlers import from_engine

    metrics = image_quality_handlers(prefix=prefix, save_details=save_details)
    metrics[f"{prefix}proj_error"] = output_value_handler("proj_error", save_details=save_details)
    metrics[f"{prefix}corrected_views"] = output_value_handler("corrected_views", save_details=save_details)
    metrics.update(texture_handlers(prefix=prefix, save_details=save_details))
    if mode in ("diffusion", "residual") and int(num_samples) > 1:
        sample = from_engine(["pred_sample", Keys.LABEL])
        single = f"{prefix}sample_"
        metrics.update(image_quality_handlers(prefix=single, output_transform=sample, save_details=save_details))
        metrics[f"{single}proj_error"] = output_value_handler("sample_proj_error", save_details=save_details)
        metrics.update(texture_handlers(prefix=single, output_transform=sample, save_details=save_details))
        for name in UNCERTAINTY_SCORES:
            metrics[f"{prefix}{name}"] = output_value_handler(name, save_details=save_details)
    return metrics

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""3D survival network (MONAI ResNet backbone, optional covariates, logistic-hazard or Cox head), survival-curve
helpers, and the calibrated inference module whose state dict holds everything inference needs.

Conventions: times and horizons in years; a higher risk score means more risk. Logistic-hazard cut points are
the ``K + 1`` boundaries ``[0 = c_0 < ... < c_K]``, interval ``k`` is ``(c_k, c_{k+1}]``, the network gives
``K`` logits and ``h_k = sigmoid(logit_k)``. The Cox head gives one log relative hazard.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from monai.networks.nets import resnet
from torch import nn

from common.checkpoint_io import CheckpointError, load_checkpoint, mismatch_error
from common.networks.wrappers import clean_state_dict, unwrap
from common.survival.losses import check_cut_points

__all__ = [
    "BACKBONES",
    "CALIBRATION_BUFFERS",
    "HEADS",
    "SurvivalExportView",
    "SurvivalNet",
    "SurvivalPredictor",
    "breslow_cumulative_hazard",
    "cox_survival_at",
    "hazards_to_survival",
    "load_backbone_weights",
    "load_predictor",
    "log_survival_at",
    "output_size",
    "survival_at",
    "widen_factor_problem",
]

logger = logging.getLogger(__name__)

BACKBONES = ("resnet10", "resnet18", "resnet34", "resnet50")
# the channels of the backbone's first stage at widen_factor 1 (MONAI's ResNet block_inplanes[0])
_FIRST_PLANES = 64


def widen_factor_problem(widen_factor: Any) -> str | None:
    """Why ``widen_factor`` cannot scale the backbone's channels (a number > 0 leaving >= 1 channel per stage),
    or ``None``."""
    if isinstance(widen_factor, bool) or not isinstance(widen_factor, (int, float)) or widen_factor <= 0:
        return f"'widen_factor' must be a number > 0 (1 is the standard ResNet width), got {widen_factor!r}."
    if int(_FIRST_PLANES * widen_factor) < 1:
        return (
            f"'widen_factor' {widen_factor!r} leaves no channel in the first stage (it needs >= {1 / _FIRST_PLANES})."
        )
    return None


HEADS = ("logistic_hazard", "cox")
CALIBRATION_BUFFERS = (
    "cut_points",
    "covariate_mean",
    "covariate_std",
    "baseline_grid",
    "baseline_cumhaz",
    "train_risk_quantiles",
    "group_thresholds",
    "calibrated",
)


def output_size(head: str, num_intervals: int | None = None, cut_points: Sequence[float] | None = None) -> int:
    """The number of network outputs of a survival ``head``: one log relative hazard for ``cox``; for
    ``logistic_hazard`` one logit per interval, i.e. ``len(cut_points) - 1`` for explicit ``cut_points``, else
    ``num_intervals``.

    Args:
        head: ``logistic_hazard`` or ``cox``.
        num_intervals: intervals when the cut points come from the training data.
        cut_points: explicit interval boundaries ``[0, ..., c_K]`` (years), taking precedence over ``num_intervals``.
    """
    if head == "cox":
        return 1
    return len(cut_points) - 1 if cut_points else num_intervals


# ------------------------------------------------------------------------------------------------ validation
def _check_head(head: str) -> str:
    if head not in HEADS:
        raise ValueError(f"survival_head must be one of {HEADS}, got {head!r}.")
    return head


def _positive_ints(name: str, value: int | Sequence[int], spatial_dims: int) -> int | tuple[int, ...]:
    """An int >= 1 or ``spatial_dims`` ints >= 1 (MONAI's ``conv1_t_size``/``conv1_t_stride``)."""
    values = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
    if not ok or len(values) not in (1, spatial_dims):
        raise ValueError(f"{name} must be an integer >= 1 or {spatial_dims} of them, got {value!r}.")
    return values[0] if len(values) == 1 else tuple(values)


def _require_int(name: str, value: int, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


# ------------------------------------------------------------------------------------------------ network
def load_backbone_weights(backbone: nn.Module, path: str | os.PathLike) -> int:
    """Load local pretrained weights into a backbone (never a download).

    Accepted files (read with ``torch.load(weights_only=True)``): a plain state dict, or a MedicalNet-style
    ``{"state_dict": {...}}`` whose keys carry DDP ``module.`` prefixes; keys of a whole :class:`SurvivalNet`
    (``backbone.`` prefix) work too. Tensors the backbone does not have (e.g. MedicalNet's ``conv_seg``
    segmentation head) are skipped; backbone tensors absent from the file keep their initialisation. Both are
    logged, with the number of tensors loaded.

    Args:
        backbone: the MONAI ResNet (built with ``feed_forward=False``).
        path: the weights file.

    Returns:
        The number of tensors loaded.

    Raises:
        CheckpointError: naming the file when it is missing or unreadable, holds no tensor dict, none of its keys
            match the backbone, or a matching key has another shape.
    """
    checkpoint = load_checkpoint(path)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, Mapping) else checkpoint
    if not isinstance(state, Mapping) or not state or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(
            f"pretrained weights {str(path)!r} must be a state dict of tensors (or {{'state_dict': ...}}), "
            f"got {type(state).__name__}."
        )
    state = clean_state_dict(state)
    if any(k.startswith("backbone.") for k in state):
        state = {k[len("backbone.") :]: v for k, v in state.items() if k.startswith("backbone.")}
    own = backbone.state_dict()
    matched = {k: v for k, v in state.items() if k in own}
    if not matched:
        raise CheckpointError(
            f"none of the {len(state)} tensors in pretrained weights {str(path)!r} match the backbone "
            f"(file keys e.g. {sorted(state)[:3]}, backbone keys e.g. {list(own)[:3]})."
        )
    wrong = [
        f"{k}: file {tuple(v.shape)} vs backbone {tuple(own[k].shape)}"
        for k, v in matched.items()
        if v.shape != own[k].shape
    ]
    if wrong:
        raise CheckpointError(
            f"pretrained weights {str(path)!r} do not fit the backbone in {len(wrong)} tensor(s): {'; '.join(wrong[:5])}. "
            "Check backbone depth, in_channels, shortcut_type and bias_downsample (MedicalNet: shortcut 'A' with "
            "bias_downsample for resnet18/34, 'B' without it for resnet10/50)."
        )
    backbone.load_state_dict(matched, strict=False)
    unused = sorted(set(state) - set(matched))
    missing = sorted(k for k in set(own) - set(matched) if not k.endswith("num_batches_tracked"))  # old checkpoints
    logger.info(
        f"loaded {len(matched)} of {len(own)} backbone tensors from {str(path)!r}"
        + (f"; {len(unused)} file tensors unused (e.g. {unused[:3]})" if unused else "")
    )
    if missing:
        logger.warning(f"{len(missing)} backbone tensors not in {str(path)!r} keep their initialisation: {missing[:5]}")
    return len(matched)


class SurvivalNet(nn.Module):
    """A MONAI 3D ResNet feature extractor, optional covariates concatenated to its features, and a survival head.

    ``forward(image, covariates=None)`` returns ``(B, K)`` interval logits for ``head="logistic_hazard"`` or a
    ``(B, 1)`` log relative hazard for ``head="cox"``. The head is ``Linear -> ReLU -> Dropout -> Linear`` on
    ``[features, covariates]`` (covariates already standardised, see :class:`SurvivalPredictor`).

    The backbone is ``monai.networks.nets.resnet{10,18,34,50}`` built with ``pretrained=False`` (MONAI's
    ``pretrained=True`` downloads) and ``feed_forward=False``. ``conv1_t_stride`` is passed explicitly: MONAI's
    default of 1 costs about 8x the FLOPs of stride 2 in the whole network. ``shortcut_type`` and
    ``bias_downsample`` default to the MedicalNet layout of each depth (``"A"`` with bias for resnet18/34,
    ``"B"`` without for resnet10/50, MONAI ``get_medicalnet_pretrained_resnet_args``), so MedicalNet weights given
    as ``pretrained_path`` load.

    Args:
        backbone: ``resnet10``, ``resnet18``, ``resnet34`` or ``resnet50``.
        in_channels: image channels.
        conv1_t_size: kernel size of the first convolution (int or one per spatial axis).
        conv1_t_stride: stride of the first convolution (int or one per spatial axis).
        head: ``logistic_hazard`` or ``cox``.
        num_intervals: ``K``, the number of logistic-hazard intervals (ignored for ``cox``).
        num_covariates: covariates per case concatenated to the image features (0: image only).
        hidden_channels: width of the head's hidden layer.
        dropout: dropout probability in the head.
        pretrained_path: a local file of backbone weights (see :func:`load_backbone_weights`).
        spatial_dims: spatial dimensions of the image.
        shortcut_type: ResNet shortcut type (``"A"`` or ``"B"``); default: the MedicalNet layout.
        bias_downsample: bias in the downsampling shortcut convolutions; default: the MedicalNet layout.
        widen_factor: scales the channels of every backbone stage (MONAI's ``widen_factor``): 1 is the standard
            width that MedicalNet weights need; small values make small test models.

    Raises:
        ValueError: naming the config id (``backbone``, ``survival_head``, ``num_intervals``, ``conv1_t_stride``,
            ...) of an invalid setting.
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        in_channels: int = 1,
        conv1_t_size: int | Sequence[int] = 7,
        conv1_t_stride: int | Sequence[int] = 2,
        head: str = "logistic_hazard",
        num_intervals: int = 10,
        num_covariates: int = 0,
        hidden_channels: int = 128,
        dropout: float = 0.0,
        pretrained_path: str | os.PathLike | None = None,
        spatial_dims: int = 3,
        shortcut_type: str | None = None,
        bias_downsample: bool | None = None,
        widen_factor: float = 1.0,
    ) -> None:
        super().__init__()
        if backbone not in BACKBONES:
            raise ValueError(f"backbone must be one of {BACKBONES}, got {backbone!r}.")
        width_problem = widen_factor_problem(widen_factor)
        if width_problem:
            raise ValueError(width_problem)
        self.survival_head = _check_head(head)
        self.num_covariates = _require_int("num_covariates", num_covariates, 0)
        hidden_channels = _require_int("hidden_channels", hidden_channels, 1)
        if head == "logistic_hazard":
            self.num_outputs = _require_int("num_intervals", num_intervals, 1)
        else:
            self.num_outputs = 1
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
        depth = int(backbone[len("resnet") :])
        default_bias, default_shortcut = resnet.get_medicalnet_pretrained_resnet_args(depth)
        shortcut_type = default_shortcut if shortcut_type is None else shortcut_type
        if shortcut_type not in ("A", "B"):
            raise ValueError(f"shortcut_type must be 'A' or 'B', got {shortcut_type!r}.")
        self.backbone_name = backbone
        self.backbone = getattr(resnet, backbone)(
            pretrained=False,
            spatial_dims=spatial_dims,
            n_input_channels=_require_int("in_channels", in_channels, 1),
            conv1_t_size=_positive_ints("conv1_t_size", conv1_t_size, spatial_dims),
            conv1_t_stride=_positive_ints("conv1_t_stride", conv1_t_stride, spatial_dims),
            shortcut_type=shortcut_type,
            bias_downsample=default_bias if bias_downsample is None else bool(bias_downsample),
            feed_forward=False,
            widen_factor=float(widen_factor),
        )
        self.feature_channels = int(self.backbone.in_planes)
        self.head = nn.Sequential(
            nn.Linear(self.feature_channels + self.num_covariates, hidden_channels),
            nn.ReLU(inplace=True),
            nn.Dropout(float(dropout)),
            nn.Linear(hidden_channels, self.num_outputs),
        )
        if pretrained_path:
            load_backbone_weights(self.backbone, pretrained_path)

    def _check_covariates(self, covariates: torch.Tensor | None, batch: int) -> torch.Tensor | None:
        if self.num_covariates == 0:
            if covariates is not None and covariates.numel() > 0:
                raise ValueError(
                    f"the network was built with num_covariates=0 but got covariates of shape {list(covariates.shape)}."
                )
            return None
        if covariates is None:
            raise ValueError(
                f"the network expects {self.num_covariates} covariates per case (num_covariates), got none."
            )
        if covariates.ndim != 2 or covariates.shape[0] != batch or covariates.shape[1] != self.num_covariates:
            raise ValueError(
                f"the network expects covariates of shape ({batch}, {self.num_covariates}) (num_covariates="
                f"{self.num_covariates}), got {list(covariates.shape)}."
            )
        return covariates

    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, K)`` logits (logistic hazard) or ``(B, 1)`` log-hazard (Cox) for ``image`` ``(B, C, *spatial)``."""
        covariates = self._check_covariates(covariates, image.shape[0])
        features = self.backbone(image)
        if covariates is not None:
            features = torch.cat([features, covariates.to(device=features.device, dtype=features.dtype)], dim=1)
        return self.head(features)


# ------------------------------------------------------------------------------------------------ curves
def hazards_to_survival(logits: torch.Tensor) -> torch.Tensor:
    """Survival at the interval ends ``c_1 .. c_K`` from ``(B, K)`` logistic-hazard logits.

    ``S(c_{k+1}) = prod_{j<=k} (1 - h_j)``, computed as ``exp(-cumsum(softplus(logit)))`` (``-log(1 - h) =
    softplus(logit)``), so it is stable for large logits and non-increasing by construction.

    Returns:
        ``(B, K)`` survival probabilities.
    """
    return torch.exp(-torch.cumsum(F.softplus(logits.float()), dim=1))


def _times(times: Sequence[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    times = torch.as_tensor(times, device=device).reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(times).all()) or bool((times < 0).any()):
        raise ValueError(f"times must be finite and non-negative, got {times.tolist()!r}.")
    return times


def log_survival_at(
    logits: torch.Tensor, cut_points: Sequence[float] | torch.Tensor, times: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Log-survival of a logistic-hazard model at arbitrary times, with a constant hazard within each interval
    (``-log_survival_at`` is the cumulative hazard; computed without ``exp``, so it stays finite where ``S``
    underflows).

    For ``c_k < t <= c_{k+1}``: ``S(t) = S(c_k) (1 - h_k)^((t - c_k) / (c_{k+1} - c_k))``, i.e. ``log S`` is
    linear within each interval; ``S(0) = 1``. Non-increasing in ``t`` for every case.

    Args:
        logits: ``(B, K)`` logits.
        cut_points: the ``K + 1`` boundaries ``[0, c_1, ..., c_K]``.
        times: ``(T,)`` non-negative times, at most ``c_K``.

    Returns:
        ``(B, T)`` log survival probabilities.

    Raises:
        ValueError: for a logit/cut-point mismatch, or a time beyond ``c_K`` (the model says nothing there).
    """
    cuts = check_cut_points(cut_points).to(device=logits.device, dtype=torch.float32)
    if logits.ndim != 2 or logits.shape[1] != cuts.numel() - 1:
        raise ValueError(
            f"logits must have shape (B, {cuts.numel() - 1}) for {cuts.numel()} cut points, got {tuple(logits.shape)}."
        )
    times = _times(times, logits.device)
    beyond = times > cuts[-1]
    if bool(beyond.any()):
        raise ValueError(
            f"time {float(times[beyond][0]):g} is beyond the last cut point c_K = {float(cuts[-1]):g}; "
            "the logistic-hazard model has no hazard there."
        )
    return _log_survival(logits, cuts, times)


def _log_survival(logits: torch.Tensor, cuts: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """:func:`log_survival_at` of checked tensors (float32 cut points and times on the logits' device); tensors only,
    so that it scripts, traces and exports to ONNX."""
    log_surv = torch.cat(
        [
            torch.zeros((logits.shape[0], 1), dtype=torch.float32, device=logits.device),
            -torch.cumsum(F.softplus(logits.float()), dim=1),
        ],
        dim=1,
    )  # (B, K + 1): log S(c_0 .. c_K)
    # t in (c_k, c_{k+1}] (t = 0 -> k = 0): k = #{j >= 1 : c_j < t}, written with comparisons (no searchsorted)
    # so that the survival curve exports to ONNX
    k = (cuts[1:-1].unsqueeze(0) < times.unsqueeze(1)).sum(dim=1)
    frac = ((times - cuts[k]) / (cuts[k + 1] - cuts[k])).clamp(0.0, 1.0)
    return log_surv[:, k] + frac.unsqueeze(0) * (log_surv[:, k + 1] - log_surv[:, k])


def survival_at(
    logits: torch.Tensor, cut_points: Sequence[float] | torch.Tensor, times: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Survival of a logistic-hazard model at arbitrary times, ``exp`` of :func:`log_survival_at` (see there):
    ``(B, T)`` probabilities, non-increasing in ``t``, ``S(0) = 1``."""
    return torch.exp(log_survival_at(logits, cut_points, times))


def breslow_cumulative_hazard(
    log_hz: torch.Tensor, time: torch.Tensor, event: torch.Tensor, grid: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """Breslow's baseline cumulative hazard of a Cox model, evaluated on a time grid.

    ``H0(t) = sum_{event times s <= t} d_s / sum_{j : T_j >= s} exp(log_hz_j)`` (``d_s`` events at ``s``; tied
    cases are all in each other's risk set), the estimator of ``sksurv.linear_model.coxph.BreslowEstimator``.
    Computed in float64, the risk-set sums with ``logcumsumexp``.

    Args:
        log_hz: ``(N,)`` or ``(N, 1)`` training log relative hazards.
        time: ``(N,)`` training times.
        event: ``(N,)`` training event indicators (0/1).
        grid: ``(G,)`` non-decreasing evaluation times.

    Returns:
        ``(G,)`` cumulative baseline hazard (0 before the first event time).
    """
    lp = log_hz.detach().reshape(-1).double()
    t = torch.as_tensor(time, device=lp.device).detach().reshape(-1).double()
    e = torch.as_tensor(event, device=lp.device).detach().reshape(-1) > 0.5
    if not lp.shape == t.shape == e.shape:
        raise ValueError(f"log_hz, time and event must have one value per case, got {lp.shape}, {t.shape}, {e.shape}.")
    grid = torch.as_tensor(grid, device=lp.device).reshape(-1).double()
    order = torch.argsort(t, stable=True)
    t, e, lp = t[order], e[order], lp[order]
    log_at_risk = torch.logcumsumexp(lp.flip(0), dim=0).flip(0)  # log sum_{j >= i} exp(lp_j) over sorted cases
    first = torch.searchsorted(t, t, right=False)  # start of the risk set {j : T_j >= T_i} (ties included)
    increments = torch.exp(-log_at_risk[first])[e]  # one term per event: 1 / risk-set sum
    cumulative = torch.cat([grid.new_zeros(1), torch.cumsum(increments, dim=0)])
    counts = torch.searchsorted(t[e].contiguous(), grid, right=True)  # events with time <= grid point
    out_dtype = log_hz.dtype if log_hz.dtype == torch.float64 else torch.float32
    return cumulative[counts].to(out_dtype)


def cox_survival_at(
    log_hz: torch.Tensor,
    baseline_grid: torch.Tensor,
    baseline_cumhaz: torch.Tensor,
    times: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Survival of a Cox model, ``S(t | x) = exp(-H0(t) exp(log_hz))``.

    ``H0`` is a right-continuous step function on the grid: a time between two grid points takes the value of the
    last grid point at or before it (as ``sksurv``'s ``StepFunction`` does between event times), and a time
    before the first grid point has ``H0 = 0``. :class:`SurvivalPredictor` puts its horizons on the grid, so the
    horizons themselves are exact.

    Args:
        log_hz: ``(B,)`` or ``(B, 1)`` log relative hazards.
        baseline_grid: ``(G,)`` non-decreasing grid times.
        baseline_cumhaz: ``(G,)`` ``H0`` at the grid times (:func:`breslow_cumulative_hazard`).
        times: ``(T,)`` non-negative times, at most the last grid time.

    Returns:
        ``(B, T)`` survival probabilities, non-increasing in time.

    Raises:
        ValueError: for a time beyond the grid (the baseline hazard is not estimated there).
    """
    lp = log_hz.reshape(log_hz.shape[0], -1)
    if lp.shape[1] != 1:
        raise ValueError(f"log_hz must have shape (B,) or (B, 1), got {tuple(log_hz.shape)}.")
    grid = baseline_grid.to(device=lp.device, dtype=torch.float32)
    times = _times(times, lp.device)
    beyond = times > grid[-1]
    if bool(beyond.any()):
        raise ValueError(
            f"time {float(times[beyond][0]):g} is beyond the baseline hazard grid (last time {float(grid[-1]):g})."
        )
    return _cox_survival(lp, grid, baseline_cumhaz, times)


def _cox_survival(lp: torch.Tensor, grid: torch.Tensor, cumhaz: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """:func:`cox_survival_at` of checked tensors (``lp`` ``(B, 1)``, float32 ``grid`` and ``times`` on its device);
    tensors only, so that it scripts, traces and exports to ONNX."""
    idx = (grid.unsqueeze(0) <= times.unsqueeze(1)).sum(dim=1) - 1  # last grid point <= t (ONNX-friendly)
    h0 = torch.where(idx >= 0, cumhaz.to(lp.device, torch.float32)[idx.clamp(min=0)], torch.zeros_like(times))
    return torch.exp(-h0.unsqueeze(0) * torch.exp(lp.float()))


def _interpolated_percentile(risk: torch.Tensor, quantiles: torch.Tensor) -> torch.Tensor:
    """Percentile of each risk among the training risks, from the stored 0..100th percentiles ``quantiles``.

    Linear interpolation between neighbouring percentiles; a risk equal to a run of identical percentiles gets the
    middle of that run; risks below the minimum give 0, above the maximum 100.
    """
    q = quantiles.to(risk.device, torch.float32)
    n = q.numel()
    p = torch.linspace(0.0, 100.0, n, device=risk.device)
    r = risk.float()
    left = (q.unsqueeze(0) < r.unsqueeze(1)).sum(dim=1)  # quantiles < r (comparisons export to ONNX)
    right = (q.unsqueeze(0) <= r.unsqueeze(1)).sum(dim=1)  # quantiles <= r
    i = left.clamp(1, n - 1)
    q0, q1 = q[i - 1], q[i]
    frac = ((r - q0) / (q1 - q0).clamp_min(1e-12)).clamp(0.0, 1.0)
    between = p[i - 1] + frac * (p[i] - p[i - 1])
    tied = 0.5 * (p[left.clamp(max=n - 1)] + p[(right - 1).clamp(min=0)])
    return torch.where(right > left, tied, between)


def _group_index(risk: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Index of each risk's group: the number of thresholds at or below it (``bucketize(right=True)``, written
    with comparisons so it exports to ONNX)."""
    return (thresholds.to(risk.device, torch.float32).unsqueeze(0) <= risk.float().unsqueeze(1)).sum(dim=1)


# ------------------------------------------------------------------------------------------------ inference
def _unset(cut_points: torch.Tensor) -> bool:
    """Whether logistic-hazard cut points are still the placeholder (all zeros) awaiting a checkpoint."""
    return cut_points.numel() > 0 and not bool((cut_points != 0).any())


class SurvivalPredictor(nn.Module):
    """Inference module of a survival model: network + everything needed to turn its output into predictions.

    :meth:`predict` (and ``forward``) return a dict:

    * ``pred``: the raw network output (``(B, K)`` logits or ``(B, 1)`` log-hazard);
    * ``risk_score`` ``(B,)``: logistic hazard: the cumulative hazard at the longest horizon,
      ``-log S(max(horizons))``; Cox: the log relative hazard (higher = more risk);
    * ``survival`` ``(B, H)``: ``S(h | x)`` at each horizon; ``p_event = 1 - survival``;
    * ``risk_percentile`` ``(B,)`` in ``[0, 100]``: interpolated in the percentiles of the training risk scores;
    * ``risk_group`` ``(B,)`` long: index into ``group_labels``; group ``g`` holds risks in
      ``[threshold_{g-1}, threshold_g)`` (a risk equal to a threshold goes to the higher group);
    * ``survival_grid`` ``(B, T)``: only from ``predict(..., times=...)``, the survival curve at ``times``.

    Raw covariates are standardised with the stored training mean/std (:meth:`standardize_covariates`) before the
    network sees them.

    The state dict is the network's (no prefix, like ``common.networks.wrappers`` inference views) plus the
    calibration buffers :data:`CALIBRATION_BUFFERS`, all of fixed size given the constructor arguments, so a
    fresh predictor built from the same config loads ``model.pt`` (:func:`load_predictor`) and predicts without
    the training data: ``cut_points`` (K + 1; empty for Cox), ``covariate_mean``/``covariate_std``
    (num_covariates), ``baseline_grid``/``baseline_cumhaz`` (grid_size for Cox; empty for logistic hazard),
    ``train_risk_quantiles`` (risk_quantiles), ``group_thresholds`` (len(group_labels) - 1), ``calibrated``.

    Args:
        network: the survival network, called as ``network(image, covariates)`` (or ``network(image)`` without
            covariates).
        head: ``logistic_hazard`` or ``cox``.
        horizons: prediction horizons in years (output order).
        cut_points: the ``K + 1`` boundaries for logistic hazard (not used by Cox). ``None`` or ``K + 1`` zeros
            (an inference config, which does not know them) leave a placeholder of ``network.num_outputs + 1``
            (or ``K + 1``) zeros that :meth:`load_state_dict` fills from the checkpoint; predictions raise until then.
        num_covariates: covariates per case.
        grid_size: points of the Cox baseline-hazard grid.
        risk_quantiles: stored percentiles of the training risk (101: the 0th..100th).
        group_labels: names of the risk groups, lowest risk first (default tertiles).

    Raises:
        ValueError: for an invalid head, bad cut points, a horizon beyond ``c_K`` or non-positive, a cut-point count
            that does not match the network's outputs, or too small sizes.
    """

    def __init__(
        self,
        network: nn.Module,
        head: str,
        horizons: Sequence[float] = (1, 3, 5),
        cut_points: Sequence[float] | torch.Tensor | None = None,
        num_covariates: int = 0,
        grid_size: int = 256,
        risk_quantiles: int = 101,
        group_labels: Sequence[str] = ("low", "intermediate", "high"),
    ) -> None:
        super().__init__()
        self.network = network
        self.head = _check_head(head)
        self.num_covariates = _require_int("num_covariates", num_covariates, 0)
        self.group_labels = tuple(str(g) for g in group_labels)
        if not self.group_labels:
            raise ValueError("group_labels must name at least one risk group, got none.")
        horizon_values = [float(h) for h in horizons]
        if not horizon_values or any(not h > 0 for h in horizon_values):
            raise ValueError(f"horizons must be positive times in years, got {list(horizons)!r}.")
        _require_int("risk_quantiles", risk_quantiles, 2)
        self.register_buffer("horizons", torch.tensor(horizon_values), persistent=False)
        outputs = getattr(unwrap(network), "num_outputs", None)
        if head == "logistic_hazard":
            cuts = self._initial_cut_points(cut_points, outputs)
            grid_size = 0
        else:
            if outputs is not None and outputs != 1:
                raise ValueError(f"survival_head 'cox' needs a network with 1 output, got {outputs}.")
            cuts = torch.zeros(0)
            _require_int("grid_size", grid_size, len(horizon_values) + 2)
        self.register_buffer("cut_points", cuts)
        self.register_buffer("covariate_mean", torch.zeros(self.num_covariates))
        self.register_buffer("covariate_std", torch.ones(self.num_covariates))
        self.register_buffer("baseline_grid", torch.zeros(grid_size))
        self.register_buffer("baseline_cumhaz", torch.zeros(grid_size))
        self.register_buffer("train_risk_quantiles", torch.zeros(int(risk_quantiles)))
        self.register_buffer("group_thresholds", torch.zeros(len(self.group_labels) - 1))
        self.register_buffer("calibrated", torch.zeros((), dtype=torch.long))
        self.eval()

    def _initial_cut_points(
        self, cut_points: Sequence[float] | torch.Tensor | None, outputs: int | None
    ) -> torch.Tensor:
        if cut_points is None:
            if outputs is None:
                raise ValueError(
                    "survival_head 'logistic_hazard' needs cut_points (K + 1 boundaries) or a network with "
                    "num_outputs to size the placeholder filled from the checkpoint."
                )
            return torch.zeros(outputs + 1)
        cuts = torch.as_tensor(cut_points, dtype=torch.float32).reshape(-1)
        if not _unset(cuts):
            cuts = check_cut_points(cuts).float()
            self._check_horizons(cuts)
        if outputs is not None and outputs != cuts.numel() - 1:
            raise ValueError(
                f"{cuts.numel()} cut_points define {cuts.numel() - 1} intervals but the network has {outputs} "
                "outputs (num_intervals)."
            )
        return cuts

    def _check_horizons(self, cuts: torch.Tensor) -> None:
        late = [float(h) for h in self.horizons if float(h) > float(cuts[-1])]
        if late:
            raise ValueError(f"horizon {late[0]:g} is beyond the last cut point c_K = {float(cuts[-1]):g}.")

    # ------------------------------------------------------------------ state dict: network + buffers
    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        state = unwrap(self.network).state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        for name in CALIBRATION_BUFFERS:
            value = getattr(self, name)
            state[prefix + name] = value if keep_vars else value.detach()
        return state

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load network weights and calibration buffers (``module.``/``_orig_mod.`` prefixes are stripped).

        Raises:
            RuntimeError: for missing calibration buffers (``strict``), a buffer of another size (a different
                config), network mismatches, or loaded cut points that do not cover the horizons.
        """
        state = clean_state_dict(state_dict)
        buffers = {name: state.pop(name) for name in CALIBRATION_BUFFERS if name in state}
        missing = [name for name in CALIBRATION_BUFFERS if name not in buffers]
        if strict and missing:
            raise RuntimeError(f"state dict lacks the calibration buffers {missing} of SurvivalPredictor.")
        for name, value in buffers.items():
            if value.shape != getattr(self, name).shape:
                raise RuntimeError(
                    f"calibration buffer {name!r} has shape {tuple(value.shape)} in the state dict but "
                    f"{tuple(getattr(self, name).shape)} here: check survival_head, cut_points/num_intervals, "
                    "num_covariates, grid_size, risk_quantiles and group_labels."
                )
        cuts = buffers.get("cut_points")
        if self.head == "logistic_hazard" and cuts is not None and not _unset(cuts):
            try:
                self._check_horizons(check_cut_points(cuts))
            except ValueError as exc:
                raise RuntimeError(f"loaded cut points do not fit this predictor: {exc}") from None
        result = unwrap(self.network).load_state_dict(state, strict=strict, assign=assign)
        with torch.no_grad():
            for name, value in buffers.items():
                getattr(self, name).copy_(value)
        result.missing_keys.extend(missing)
        return result

    # ------------------------------------------------------------------ calibration
    def set_covariate_stats(self, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor) -> None:
        """Store the training-set covariate mean and standard deviation (a std of 0 is stored as 1).

        Raises:
            ValueError: for a wrong count (``num_covariates``) or non-finite values.
        """
        mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        for name, value in (("mean", mean), ("std", std)):
            if value.numel() != self.num_covariates or not bool(torch.isfinite(value).all()):
                raise ValueError(
                    f"covariate {name} must hold {self.num_covariates} finite values (num_covariates), "
                    f"got {value.tolist()!r}."
                )
        std = torch.where(std > 0, std, torch.ones_like(std))
        with torch.no_grad():
            self.covariate_mean.copy_(mean)
            self.covariate_std.copy_(std)

    def calibrate(
        self,
        risk: torch.Tensor,
        time: torch.Tensor,
        event: torch.Tensor,
        log_hz: torch.Tensor | None = None,
        covariates: torch.Tensor | None = None,
    ) -> None:
        """Set the calibration buffers from the model's predictions on the training set.

        Stores the 0..100th percentiles of ``risk`` (linear interpolation, as ``numpy.percentile``), the group
        thresholds (tertiles for three groups: the ``g / G`` quantiles) and, for Cox, the Breslow baseline
        cumulative hazard on a grid of ``grid_size`` times: ``grid_size - H`` equally spaced points from 0 to the
        longest training time plus the ``H`` horizons themselves, so ``S(horizon)`` is exact.

        Args:
            risk: ``(N,)`` training risk scores (:meth:`risk_score`).
            time: ``(N,)`` training times in years.
            event: ``(N,)`` training event indicators.
            log_hz: ``(N,)`` training log-hazards for Cox (default: ``risk``, which is the log-hazard for Cox).
            covariates: optional ``(N, num_covariates)`` training covariates, only checked for their shape: the
                standardisation is set by :meth:`set_covariate_stats` before training.

        Raises:
            ValueError: for mismatched or non-finite inputs, a Cox training set without events, or a horizon
                beyond the longest training time (Cox).
        """
        risk = torch.as_tensor(risk).detach().reshape(-1).double().cpu()
        time = torch.as_tensor(time).detach().reshape(-1).double().cpu()
        event = torch.as_tensor(event).detach().reshape(-1).double().cpu()
        n = risk.numel()
        if n == 0 or time.numel() != n or event.numel() != n:
            raise ValueError(f"risk, time and event need one value per case, got {n}, {time.numel()}, {event.numel()}.")
        if not bool(torch.isfinite(risk).all()) or not bool(torch.isfinite(time).all()):
            raise ValueError("risk and time must be finite for calibration; got non-finite values.")
        if covariates is not None and tuple(torch.as_tensor(covariates).shape) != (n, self.num_covariates):
            raise ValueError(
                f"covariates must have shape ({n}, {self.num_covariates}), got {tuple(torch.as_tensor(covariates).shape)}."
            )
        if self.head == "logistic_hazard" and _unset(self.cut_points):
            raise ValueError("the logistic-hazard cut points are not set (pass cut_points or load a checkpoint).")
        levels = torch.linspace(0, 1, self.train_risk_quantiles.numel(), dtype=torch.float64)
        groups = len(self.group_labels)
        thresholds = torch.quantile(risk, torch.arange(1, groups, dtype=torch.float64) / groups) if groups > 1 else None
        if self.head == "cox":
            self._calibrate_baseline(risk if log_hz is None else log_hz, time, event)
        with torch.no_grad():
            self.train_risk_quantiles.copy_(torch.quantile(risk, levels))
            if thresholds is not None:
                self.group_thresholds.copy_(thresholds)
            self.calibrated.fill_(1)
        logger.info(
            f"survival predictor calibrated on {n} training cases ({int((event > 0.5).sum())} events); "
            f"group thresholds {[round(float(t), 4) for t in self.group_thresholds]}"
        )

    def _calibrate_baseline(self, log_hz: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> None:
        lp = torch.as_tensor(log_hz).detach().reshape(-1).double().cpu()
        if lp.numel() != time.numel():
            raise ValueError(f"log_hz needs one value per case ({time.numel()}), got {lp.numel()}.")
        if not bool((event > 0.5).any()):
            raise ValueError("the Cox baseline hazard needs events in the training set; got none.")
        longest = float(time.max())
        late = [float(h) for h in self.horizons if float(h) > longest]
        if late:
            raise ValueError(
                f"horizon {late[0]:g} is beyond the longest training follow-up {longest:g}: the baseline hazard "
                "is not estimated there."
            )
        steps = self.baseline_grid.numel() - self.horizons.numel()
        grid = torch.cat([torch.linspace(0, longest, steps, dtype=torch.float64), self.horizons.double().cpu()])
        grid = torch.sort(grid)[0]
        with torch.no_grad():
            self.baseline_grid.copy_(grid)
            self.baseline_cumhaz.copy_(breslow_cumulative_hazard(lp, time, event, grid))

    def _require_calibration(self, what: str) -> None:
        if not bool(self.calibrated):
            raise RuntimeError(
                f"the survival model is not calibrated: {what} needs calibrate() on the training predictions first "
                "(or a model.pt that holds the calibration)."
            )

    # ------------------------------------------------------------------ predictions
    def standardize_covariates(self, covariates: torch.Tensor | None) -> torch.Tensor | None:
        """Standardise raw covariates ``(B, num_covariates)`` with the stored training statistics.

        ``None`` and, without covariates, a ``(B, 0)`` tensor are returned unchanged.

        Raises:
            ValueError: for another number of covariates.
        """
        if covariates is None or (self.num_covariates == 0 and covariates.numel() == 0):
            return covariates
        if covariates.ndim != 2 or covariates.shape[1] != self.num_covariates:
            raise ValueError(
                f"expected covariates of shape (B, {self.num_covariates}) (num_covariates), got {list(covariates.shape)}."
            )
        mean = self.covariate_mean.to(covariates.device)
        std = self.covariate_std.to(covariates.device)
        return (covariates.float() - mean) / std

    def risk_score(self, out: torch.Tensor) -> torch.Tensor:
        """``(B,)`` risk from the network output: logistic hazard: the cumulative hazard at the longest horizon,
        ``-log S(max(horizons))`` (a monotone function of ``P(event by that horizon)``; the hazards of the last,
        sparsely populated intervals beyond it do not reorder the cases); Cox: the log-hazard."""
        if self.head == "logistic_hazard":
            longest = self.horizons.max().reshape(1).to(out.device, torch.float32)
            return -_log_survival(out, self.cut_points.to(out.device, torch.float32), longest)[:, 0]
        return out.reshape(out.shape[0], -1)[:, 0].float()

    def survival(self, out: torch.Tensor, times: Sequence[float] | torch.Tensor | None = None) -> torch.Tensor:
        """``(B, T)`` survival at ``times`` (default: the horizons); Cox needs the calibration, logistic hazard the
        cut points."""
        if self.head == "logistic_hazard":
            if _unset(self.cut_points):
                self._require_calibration("survival (the cut points come with the calibrated model)")
        else:
            self._require_calibration("Cox survival")
        return self._survival(out, self.horizons if times is None else times)

    def _survival(self, out: torch.Tensor, times: Sequence[float] | torch.Tensor) -> torch.Tensor:
        if self.head == "logistic_hazard":
            return survival_at(out, self.cut_points, times)
        return cox_survival_at(out, self.baseline_grid, self.baseline_cumhaz, times)

    def risk_percentile(self, risk: torch.Tensor) -> torch.Tensor:
        """``(B,)`` percentile in ``[0, 100]`` of each risk among the training risks."""
        self._require_calibration("risk_percentile")
        return _interpolated_percentile(risk, self.train_risk_quantiles)

    def risk_group(self, risk: torch.Tensor) -> torch.Tensor:
        """``(B,)`` long index into ``group_labels``."""
        self._require_calibration("risk_group")
        return _group_index(risk, self.group_thresholds)

    def predict(
        self,
        image: torch.Tensor,
        covariates: torch.Tensor | None = None,
        times: Sequence[float] | torch.Tensor | None = None,
        check: bool = True,
    ) -> dict[str, torch.Tensor]:
        """All predictions for ``image`` and raw ``covariates`` (see the class docstring); with ``times`` also the
        survival curve ``survival_grid`` at those times.

        Args:
            image: ``(B, C, *spatial)``.
            covariates: ``(B, num_covariates)`` raw covariates, or ``None``.
            times: extra times of the survival curve.
            check: refuse an uncalibrated model. :class:`SurvivalExportView` turns it off so that an export graph
                has no data-dependent branch (export a calibrated ``model.pt``; random weights are only for tests).

        Raises:
            RuntimeError: when ``check`` and the model is not calibrated.
        """
        if check:
            self._require_calibration("prediction")
        result = self.outputs(image, covariates)
        if times is not None:
            result["survival_grid"] = self._survival(result["pred"], times)
        return result

    def outputs(self, image: torch.Tensor, covariates: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The predictions of :meth:`predict` at the horizons, without the calibration check: tensors in and out
        only, so that it scripts (TorchScript), traces and exports to ONNX."""
        covariates = self.standardize_covariates(covariates)
        out = self.network(image) if covariates is None else self.network(image, covariates)
        risk = self.risk_score(out)
        horizons = self.horizons.to(out.device, torch.float32)
        if self.head == "logistic_hazard":
            survival = torch.exp(_log_survival(out, self.cut_points.to(out.device, torch.float32), horizons))
        else:
            lp = out.reshape(out.shape[0], -1)
            survival = _cox_survival(
                lp, self.baseline_grid.to(out.device, torch.float32), self.baseline_cumhaz, horizons
            )
        return {
            "pred": out,
            "risk_score": risk,
            "survival": survival,
            "p_event": 1.0 - survival,
            "risk_percentile": _interpolated_percentile(risk, self.train_risk_quantiles),
            "risk_group": _group_index(risk, self.group_thresholds),
        }

    @torch.jit.unused
    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """:meth:`predict` (Python only: a scripted predictor is used through :class:`SurvivalExportView`)."""
        return self.predict(image, covariates)


def load_predictor(
    predictor: SurvivalPredictor, path: str | os.PathLike, settings: Mapping[str, Any] | None = None
) -> SurvivalPredictor:
    """Load ``model.pt`` (a :class:`SurvivalPredictor` state dict, or a resumable checkpoint with a ``predictor``
    entry) into ``predictor`` and check that it holds a calibrated model. ``settings`` (the config's
    ``@trained``) name the settings that differ from the checkpoint's run when the weights do not fit.

    Raises:
        CheckpointError: naming the file when it is missing, unreadable, does not fit the configured predictor
            (another backbone, head, number of intervals or covariates), or was saved before calibration.
    """
    checkpoint = load_checkpoint(path)
    if isinstance(checkpoint, Mapping) and isinstance(checkpoint.get("predictor"), Mapping):
        checkpoint = checkpoint["predictor"]
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a state dict, got {type(checkpoint).__name__}.")
    try:
        predictor.load_state_dict(checkpoint)
    except (RuntimeError, ValueError) as exc:
        error = mismatch_error(predictor, checkpoint, path, settings, detail=str(exc))
        raise error or CheckpointError(f"checkpoint {str(path)!r} does not fit the survival model: {exc}") from None
    if not bool(predictor.calibrated):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds an uncalibrated survival model (no training risk distribution, "
            "group thresholds or baseline hazard); use the model.pt written after validation."
        )
    logger.info(f"loaded calibrated survival model from {str(path)!r}")
    return predictor


class SurvivalExportView(nn.Module):
    """Single-tensor view of a calibrated :class:`SurvivalPredictor` for export (TorchScript trace, ONNX).

    ``forward(image, covariates=None)`` returns ``pred`` of shape ``(B, 3 + H)``: ``risk_score``,
    ``risk_percentile``, ``risk_group`` (as a float index), then ``P(event by horizon)`` for each horizon. Its
    state dict is the predictor's, so it loads ``model.pt`` directly. It does not check the calibration (an export
    graph has no data-dependent branch): export the ``model.pt`` that training wrote, which is calibrated;
    loading an uncalibrated state logs a warning.

    Args:
        predictor: the predictor to export.
    """

    def __init__(self, predictor: SurvivalPredictor) -> None:
        super().__init__()
        self.predictor = predictor
        self.eval()

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.predictor.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        result = self.predictor.load_state_dict(state_dict, strict=strict, assign=assign)
        if not bool(self.predictor.calibrated):
            logger.warning(
                "the loaded survival model is not calibrated: its risk percentiles, risk groups (and Cox survival) "
                "are meaningless; export the model.pt written after a validation."
            )
        return result

    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None = None) -> torch.Tensor:
        out = self.predictor.outputs(image, covariates)
        columns = [out["risk_score"], out["risk_percentile"], out["risk_group"].float()]
        return torch.cat([torch.stack(columns, dim=1), out["p_event"].float()], dim=1)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Survival losses: the discrete-time logistic-hazard likelihood and the Cox partial likelihood with a global
(all-rank) risk set under DDP.

Conventions (shared with ``common.survival.networks`` and ``common.survival.metrics``): times are in years,
``event`` is 0/1, a higher risk/log-hazard means more risk. Logistic-hazard cut points are the ``K + 1``
boundaries ``[0 = c_0 < c_1 < ... < c_K]``; interval ``k`` (0-based) is ``(c_k, c_{k+1}]`` and the network gives
one logit per interval, hazard ``h_k = sigmoid(logit_k)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchsurv.loss.cox import neg_partial_log_likelihood

__all__ = ["check_cut_points", "cox_loss", "discretize", "gather_with_grad", "logistic_hazard_loss"]

REDUCTIONS = ("mean", "sum", "none")
TIES = ("efron", "breslow")


def check_cut_points(cut_points: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Validate logistic-hazard boundaries ``[0 = c_0 < c_1 < ... < c_K]`` (``K >= 1``).

    Args:
        cut_points: the ``K + 1`` interval boundaries in years.

    Returns:
        The boundaries as a 1-D float tensor.

    Raises:
        ValueError: when they are not 1-D, fewer than 2, not finite, do not start at 0 or do not increase strictly.
    """
    cuts = _cut_tensor(cut_points)
    if cuts.ndim != 1 or cuts.numel() < 2:
        raise ValueError(f"cut_points must be K + 1 >= 2 boundaries [0, c_1, ..., c_K], got {cuts.tolist()!r}.")
    if not bool(torch.isfinite(cuts).all()) or float(cuts[0]) != 0.0 or not bool((cuts[1:] > cuts[:-1]).all()):
        raise ValueError(f"cut_points must be finite, start at 0 and increase strictly, got {cuts.tolist()!r}.")
    return cuts


def _cut_tensor(cut_points: Sequence[float] | torch.Tensor) -> torch.Tensor:
    cuts = torch.as_tensor(cut_points).detach()
    return cuts.to(torch.float64 if cuts.dtype == torch.float64 else torch.float32)


def _as_vector(name: str, value: torch.Tensor, n: int | None = None) -> torch.Tensor:
    value = torch.as_tensor(value)
    if value.ndim == 2 and value.shape[1] == 1:
        value = value[:, 0]
    if value.ndim != 1 or (n is not None and value.shape[0] != n):
        expected = f"({n},)" if n is not None else "(N,)"
        raise ValueError(f"{name} must have shape {expected} (or (N, 1)), got {tuple(value.shape)}.")
    return value


def _check_reduction(reduction: str, allowed: Sequence[str] = REDUCTIONS) -> str:
    if reduction not in allowed:
        raise ValueError(f"reduction must be one of {tuple(allowed)}, got {reduction!r}.")
    return reduction


def discretize(
    time: torch.Tensor, event: torch.Tensor, cut_points: Sequence[float] | torch.Tensor, check_values: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map continuous (time, event) pairs to logistic-hazard intervals.

    The convention is pycox's ``LabTransDiscreteTime``/``DiscretizeUnknownC`` one, "events to the right,
    censored times to the left":

    * an event at ``t`` with ``c_k < t <= c_{k+1}`` has ``index = k``, ``observed = 1`` (the case survived
      intervals ``0 .. k - 1`` and had its event in interval ``k``); an event at ``t = 0`` counts in interval 0;
    * an event after ``c_K`` counts as censored at ``c_K``: ``index = K``, ``observed = 0``;
    * a case censored at ``t`` survived every interval with ``c_{k+1} <= t``; the interval in which it was censored
      gives no information. ``index`` is the number of fully survived intervals ``#{k : c_{k+1} <= t}``
      (``0 .. K``) and ``observed = 0``.

    So in both cases intervals ``0 .. index - 1`` were survived, and interval ``index`` holds the event when
    ``observed == 1``.

    Args:
        time: ``(N,)`` follow-up times in years (non-negative).
        event: ``(N,)`` event indicators (1 = event, 0 = censored).
        cut_points: the ``K + 1`` boundaries ``[0, c_1, ..., c_K]``.
        check_values: check the cut points (:func:`check_cut_points`), and that times are finite and non-negative
            and events 0/1. Reading the result on the host waits for a GPU (and breaks a ``torch.compile`` graph);
            a trainer whose cut points were checked when it was built and whose batches come from a cohort checked
            row by row (:func:`common.survival.cohort.read_cohort_csv`) switches it off.

    Returns:
        ``(index, observed)``: ``(N,)`` long tensors.

    Raises:
        ValueError: for bad cut points, shapes, negative or non-finite times, or events other than 0/1.
    """
    cuts = check_cut_points(cut_points) if check_values else _cut_tensor(cut_points)
    time = _as_vector("time", time)
    event = _as_vector("event", event, time.shape[0])
    if check_values and (not bool(torch.isfinite(time).all()) or bool((time < 0).any())):
        raise ValueError(f"time must be finite and non-negative, got {time.tolist()!r}.")
    if check_values and not bool(((event == 0) | (event == 1)).all()):
        raise ValueError(f"event must be 0 or 1, got {event.tolist()!r}.")
    cuts = cuts.to(device=time.device, dtype=torch.float64, non_blocking=time.device.type != "cpu")
    t = time.detach().to(torch.float64)
    num_intervals = cuts.numel() - 1
    # events: first boundary >= t is c_{k+1}; t <= 0 maps to interval 0, t > c_K to "censored at c_K" (index K)
    event_index = (torch.searchsorted(cuts, t, right=False) - 1).clamp(min=0)
    # censored: number of upper boundaries c_{k+1} <= t
    censored_index = torch.searchsorted(cuts[1:], t, right=True)
    is_event = event.to(torch.bool) & (event_index < num_intervals)
    index = torch.where(is_event, event_index, censored_index)
    return index.long(), is_event.long()


def logistic_hazard_loss(
    logits: torch.Tensor,
    time: torch.Tensor,
    event: torch.Tensor,
    cut_points: Sequence[float] | torch.Tensor,
    reduction: str = "mean",
    check_values: bool = True,
) -> torch.Tensor:
    """Negative log-likelihood of the discrete-time (logistic) hazard model, per sample.

    With :func:`discretize` giving ``(index, observed)``, the loss of one case is

    * event in interval ``k``: ``-log h_k - sum_{j<k} log(1 - h_j)``;
    * censored after surviving ``n`` intervals: ``-sum_{j<n} log(1 - h_j)`` (0 for ``n = 0``),

    computed from the logits with binary cross-entropy (``-log h = softplus(-logit)``,
    ``-log(1 - h) = softplus(logit)``), which is stable for any logit. Every case contributes on its own, so the
    loss works for any batch size (also 1, and batches without events).

    Args:
        logits: ``(N, K)`` network output, one logit per interval.
        time: ``(N,)`` follow-up times in years.
        event: ``(N,)`` event indicators (0/1).
        cut_points: the ``K + 1`` boundaries ``[0, c_1, ..., c_K]``.
        reduction: ``"mean"`` (over samples), ``"sum"`` or ``"none"`` (the ``(N,)`` per-sample losses).
        check_values: see :func:`discretize`.

    Returns:
        The reduced loss (a scalar), or the ``(N,)`` per-sample losses for ``reduction="none"``.

    Raises:
        ValueError: for a wrong logit shape (``K`` must equal ``len(cut_points) - 1``), a bad reduction, or what
            :func:`discretize` rejects.
    """
    _check_reduction(reduction)
    cuts = check_cut_points(cut_points) if check_values else _cut_tensor(cut_points)
    if logits.ndim != 2 or logits.shape[1] != cuts.numel() - 1:
        raise ValueError(
            f"logits must have shape (N, K={cuts.numel() - 1}) for {cuts.numel()} cut points, "
            f"got {tuple(logits.shape)}."
        )
    time = _as_vector("time", time, logits.shape[0]).to(logits.device)
    event = _as_vector("event", event, logits.shape[0]).to(logits.device)
    index, observed = discretize(time, event, cuts, check_values=check_values)
    logits = logits.float()
    intervals = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    survived = intervals < index.unsqueeze(1)
    event_cell = (intervals == index.unsqueeze(1)) & observed.bool().unsqueeze(1)
    target = event_cell.to(logits.dtype)
    weight = (survived | event_cell).to(logits.dtype)
    per_sample = (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * weight).sum(dim=1)
    if reduction == "mean":
        return per_sample.mean()
    if reduction == "sum":
        return per_sample.sum()
    return per_sample


def _distributed_world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` (``(n_r, ...)`` on rank ``r``) from all ranks in rank order, keeping autograd.

    Uses the autograd-aware ``torch.distributed.nn.functional.all_gather`` (its backward sends every rank the sum,
    over ranks, of the gradients with respect to its own rows). Ranks may hold different numbers of rows: the
    sizes are exchanged first and every rank pads to the largest, the padding is dropped after the gather.
    Without an initialised process group (or with one rank) ``tensor`` is returned unchanged.

    Args:
        tensor: this rank's rows.

    Returns:
        The ``(sum_r n_r, ...)`` concatenation (identical on every rank).
    """
    world = _distributed_world()
    if world < 2:
        return tensor
    from torch.distributed.nn.functional import all_gather

    sizes = [torch.zeros(1, dtype=torch.long, device=tensor.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device))
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    with warnings.catch_warnings():
        # torch >= 2.9 marks it deprecated in favour of the private _functional_collectives; it is still the
        # public autograd-aware gather and its gloo backward (all-to-all) is what CPU runs need
        warnings.simplefilter("ignore", FutureWarning)
        parts = all_gather(padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])


def cox_loss(
    log_hz: torch.Tensor,
    time: torch.Tensor,
    event: torch.Tensor,
    ties: str = "efron",
    global_risk_set: bool = True,
    reduction: str = "mean",
) -> torch.Tensor:
    """Negative Cox partial log-likelihood (torchsurv ``neg_partial_log_likelihood``), optionally over all ranks.

    **Global risk set.** The partial likelihood of a case compares it with every case still at risk, so it is not
    a sum of per-sample terms: with DDP each rank would otherwise see only its own ``B`` cases. With
    ``global_risk_set=True`` and an initialised process group, ``log_hz``, ``time`` and ``event`` of all ranks
    are gathered first (:func:`gather_with_grad`, autograd-aware), and every rank computes the same loss ``L`` on
    the global batch. In backward, the gather sends each rank the sum over the ``W`` ranks of ``dL/d log_hz`` of
    its own rows, i.e. ``W * dL/d log_hz_r`` (all ranks computed the same ``L``); DDP then averages the parameter
    gradients over the ``W`` ranks, which divides by ``W`` again. The resulting gradient therefore equals the
    single-process gradient of the loss on the concatenated batch (checked by a 2-process test).

    **Reduction.** ``"sum"`` is the negative partial log-likelihood; ``"mean"`` divides it by the number of
    events of the (global) batch. torchsurv's own ``"mean"`` is not used: it averages over events when event
    times are distinct but over *distinct event times* when they tie, so its scale jumps with ties.

    **Degenerate batches.** A (global) batch without events, or with a single case, has no partial likelihood
    (a single case gives ``log(e^x / e^x) = 0``). torchsurv 0.2.0 returns a new leaf ``tensor(0.)`` (no graph) for
    no events or a 0-d input, and raises ``TypeError: len() of a 0-d tensor`` for a batch of shape ``(1,)``;
    here both cases return ``log_hz.sum() * 0``, a zero still connected to the graph, because under DDP every
    rank must run backward. The decision is taken on the global batch, so all ranks take the same branch.

    torchsurv's Efron path accumulates in float32 (its buffers are created with the default dtype) whatever the
    input dtype; the loss is computed in float32 here.

    Args:
        log_hz: ``(N,)`` or ``(N, 1)`` log relative hazards (higher = more risk).
        time: ``(N,)`` event/censoring times.
        event: ``(N,)`` event indicators (0/1).
        ties: ``"efron"`` (default) or ``"breslow"`` handling of tied event times.
        global_risk_set: gather all ranks' cases before computing the loss (no effect without a process group).
        reduction: ``"mean"`` (per event) or ``"sum"``.

    Returns:
        The scalar loss.

    Raises:
        ValueError: for a bad ``ties``/``reduction``, mismatched shapes or events other than 0/1.
    """
    _check_reduction(reduction, ("mean", "sum"))
    if ties not in TIES:
        raise ValueError(f"ties must be one of {TIES}, got {ties!r}.")
    log_hz = _as_vector("log_hz", log_hz)
    time = _as_vector("time", time, log_hz.shape[0]).to(log_hz.device)
    event = _as_vector("event", event, log_hz.shape[0]).to(log_hz.device)
    if not bool(((event == 0) | (event == 1)).all()):
        raise ValueError(f"event must be 0 or 1, got {event.tolist()!r}.")
    columns = torch.stack([log_hz.float(), time.detach().float(), event.detach().float()], dim=1)
    if global_risk_set:
        columns = gather_with_grad(columns)
    log_hz_all, time_all, event_all = columns[:, 0], columns[:, 1].detach(), columns[:, 2].detach() > 0.5
    num_events = int(event_all.sum().item())
    if num_events == 0 or log_hz_all.shape[0] < 2:
        return log_hz_all.sum() * 0.0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Ties in `time` detected")
        nll = neg_partial_log_likelihood(log_hz_all, event_all, time_all, ties_method=ties, reduction="sum")
    return nll / num_events if reduction == "mean" else nll

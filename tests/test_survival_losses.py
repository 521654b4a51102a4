# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the survival losses: logistic-hazard discretisation and likelihood (hand-computed values and an
independent numpy implementation), the Cox partial likelihood (numpy Efron/Breslow formulas and lifelines), its
degenerate batches, and the global risk set under a 2-process torchrun (gloo) run."""

from __future__ import annotations

import math
import subprocess
import warnings

import numpy as np
import pytest
import torch
from torchsurv.loss.cox import neg_partial_log_likelihood

from common.survival.losses import cox_loss, discretize, logistic_hazard_loss
from tests.helpers import REPO_ROOT, HostSyncRecorder, bundle_env, torchrun_cmd

torch.set_num_threads(1)

CUTS = [0.0, 1.0, 2.0, 3.0]
# hazards (0.5, 0.25, 0.75): logits 0, log(1/3), log(3)
LOGIT_ROW = [0.0, math.log(1 / 3), math.log(3)]


# ---------------------------------------------------------------------------------------------- discretize
def test_discretize_events_right_censored_left():
    time = torch.tensor([0.5, 1.0, 2.5, 3.5, 0.5, 1.0, 2.9, 5.0, 0.0, 3.0])
    event = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0])
    index, observed = discretize(time, event, CUTS)
    # events: (0,1] -> 0 (c_1 itself included), (2,3] -> 2, after c_K -> censored at c_K (index K = 3), t = 0 -> 0
    # censored: number of boundaries c_{k+1} <= t: 0.5 -> 0, 1.0 -> 1, 2.9 -> 2, 5.0 -> 3, 3.0 -> 3
    assert index.tolist() == [0, 0, 2, 3, 0, 1, 2, 3, 0, 3]
    assert observed.tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1, 0]
    assert index.dtype == observed.dtype == torch.long


@pytest.mark.parametrize(
    "time, event, cuts, message",
    [
        ([1.0, -0.5], [1, 0], CUTS, "non-negative"),
        ([1.0, float("nan")], [1, 0], CUTS, "non-negative"),
        ([1.0, 2.0], [1, 2], CUTS, "0 or 1"),
        ([1.0, 2.0], [1, 0], [0.5, 1.0, 2.0], "start at 0"),
        ([1.0, 2.0], [1, 0], [0.0, 2.0, 1.0], "increase strictly"),
        ([1.0, 2.0], [1, 0], [0.0], "K + 1 >= 2"),
        ([1.0, 2.0], [1, 0, 1], CUTS, "shape (2,)"),
    ],
)
def test_discretize_rejects_bad_input(time, event, cuts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        discretize(torch.tensor(time), torch.tensor(event), cuts)


def test_discretize_without_value_checks_reads_nothing_back_and_agrees_on_valid_input():
    """``check_values=False`` (the trainer's setting: its cut points were checked when it was built and its cohort
    when read) reads no value back - neither the times and events nor the cut points - and gives the same
    intervals; shapes are still checked."""
    time, event = torch.tensor([0.2, 1.0, 1.7, 3.5]), torch.tensor([1.0, 0.0, 1.0, 1.0])
    cuts = torch.tensor(CUTS)
    with HostSyncRecorder() as unchecked_reads:
        unchecked = discretize(time, event, cuts, check_values=False)
    with HostSyncRecorder() as checked_reads:
        checked = discretize(time, event, cuts)
    assert set(unchecked_reads.sites) == set()
    assert {"common/survival/losses.py:discretize", "common/survival/losses.py:check_cut_points"} <= set(
        checked_reads.sites
    )  # what check_values=False leaves out
    assert all(torch.equal(a, b) for a, b in zip(unchecked, checked))
    with pytest.raises(ValueError, match="shape"):
        discretize(time, event[:3], cuts, check_values=False)
    discretize(torch.tensor([-1.0]), torch.tensor([2.0]), cuts, check_values=False)  # not checked


# ---------------------------------------------------------------------------------------------- logistic hazard
def test_logistic_hazard_loss_hand_computed():
    logits = torch.tensor([LOGIT_ROW] * 5)
    time = torch.tensor([2.5, 2.5, 0.5, 0.5, 4.0])
    event = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    expected = [
        -math.log(0.5 * 0.75 * 0.75),  # event in interval 2: -log h_2 - log(1-h_0) - log(1-h_1) = 1.2685113
        -math.log(0.5 * 0.75),  # censored at 2.5: survived intervals 0, 1 = 0.9808293
        0.0,  # censored inside interval 0: no information
        -math.log(0.5),  # event in interval 0: -log h_0 = 0.6931472
        -math.log(0.5 * 0.75 * 0.25),  # event after c_K: survived all three = 2.3671236
    ]
    assert expected == pytest.approx([1.2685113, 0.9808293, 0.0, 0.6931472, 2.3671236], abs=1e-7)
    per_sample = logistic_hazard_loss(logits, time, event, CUTS, reduction="none")
    assert per_sample.shape == (5,)
    assert per_sample.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert logistic_hazard_loss(logits, time, event, CUTS).item() == pytest.approx(sum(expected) / 5, rel=1e-6)
    assert logistic_hazard_loss(logits, time, event, CUTS, reduction="sum").item() == pytest.approx(
        sum(expected), rel=1e-6
    )
    # per-sample: any batch size, a single case is its own row of the batch loss
    single = logistic_hazard_loss(logits[:1], time[:1], event[:1], CUTS)
    assert single.item() == pytest.approx(expected[0], rel=1e-6)


def _numpy_logistic_hazard_nll(logits: np.ndarray, time: np.ndarray, event: np.ndarray, cuts: list[float]):
    """Direct likelihood from the hazards, one case at a time, in float64 (independent of the torch code)."""
    hazards = 1.0 / (1.0 + np.exp(-logits))
    out = []
    for h, t, e in zip(hazards, time, event):
        k_max = len(cuts) - 1
        if e == 1 and t <= cuts[-1]:
            k = next(j for j in range(k_max) if t <= cuts[j + 1])
            out.append(-np.log(h[k]) - np.sum(np.log(1 - h[:k])))
        else:
            survived = k_max if e == 1 else sum(1 for j in range(k_max) if cuts[j + 1] <= t)
            out.append(-np.sum(np.log(1 - h[:survived])))
    return np.array(out)


def test_logistic_hazard_loss_matches_numpy_on_random_data():
    rng = np.random.default_rng(3)
    cuts = [0.0, 0.5, 1.0, 2.5, 4.0, 6.0]
    logits = rng.normal(scale=2.0, size=(64, 5))
    time = np.concatenate([rng.uniform(0.01, 7.0, 60), [0.5, 1.0, 6.0, 4.0]])  # boundaries and beyond c_K
    event = (rng.random(64) < 0.4).astype(float)
    ours = logistic_hazard_loss(torch.tensor(logits), torch.tensor(time), torch.tensor(event), cuts, reduction="none")
    np.testing.assert_allclose(
        ours.double().numpy(), _numpy_logistic_hazard_nll(logits, time, event, cuts), rtol=1e-5, atol=1e-6
    )


def test_logistic_hazard_loss_is_stable_for_extreme_logits():
    logits = torch.tensor([[100.0, -100.0, 50.0], [-100.0, 100.0, -50.0]], requires_grad=True)
    loss = logistic_hazard_loss(logits, torch.tensor([2.5, 2.5]), torch.tensor([1.0, 0.0]), CUTS)
    loss.backward()
    # case 0 (event in interval 2): -log(1 - h_0) = softplus(100) ~ 100, -log(1 - h_1) ~ 0, -log h_2 ~ 0;
    # case 1 (censored at 2.5, survived intervals 0 and 1): -log(1 - h_0) ~ 0, -log(1 - h_1) = softplus(100) ~ 100
    assert torch.isfinite(loss) and loss.item() == pytest.approx((100.0 + 100.0) / 2, rel=1e-5)
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logits": torch.zeros(2, 4)}, "K=3"),
        ({"reduction": "max"}, "reduction"),
        ({"event": torch.tensor([1.0, 0.5])}, "0 or 1"),
    ],
)
def test_logistic_hazard_loss_rejects_bad_input(kwargs, message):
    args = {"logits": torch.zeros(2, 3), "time": torch.tensor([1.0, 2.0]), "event": torch.tensor([1.0, 0.0])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        logistic_hazard_loss(cut_points=CUTS, **args)


# ---------------------------------------------------------------------------------------------- Cox: values
def _numpy_cox_nll(lp: np.ndarray, time: np.ndarray, event: np.ndarray, ties: str = "efron") -> float:
    """Negative partial log-likelihood written from the textbook formulas (float64)."""
    total = 0.0
    for s in np.unique(time[event == 1]):
        dead = (time == s) & (event == 1)
        at_risk = time >= s
        m = dead.sum()
        risk_sum, dead_sum = np.exp(lp[at_risk]).sum(), np.exp(lp[dead]).sum()
        total += lp[dead].sum()
        if ties == "efron":
            total -= sum(np.log(risk_sum - r / m * dead_sum) for r in range(m))
        else:
            total -= m * np.log(risk_sum)
    return -total


def _tied_data(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    lp = rng.normal(size=n)
    time = rng.integers(1, 8, size=n).astype(float)  # many ties
    event = (rng.random(n) < 0.6).astype(float)
    return lp, time, event


@pytest.mark.parametrize("ties", ["efron", "breslow"])
def test_cox_loss_matches_numpy_formula_with_ties(ties):
    lp, time, event = _tied_data()
    expected = _numpy_cox_nll(lp, time, event, ties)
    args = (torch.tensor(lp, dtype=torch.float32), torch.tensor(time), torch.tensor(event))
    assert cox_loss(*args, ties=ties, reduction="sum").item() == pytest.approx(expected, rel=1e-5)
    assert cox_loss(*args, ties=ties).item() == pytest.approx(expected / event.sum(), rel=1e-5)  # mean per event
    assert cox_loss(args[0][:, None], *args[1:], ties=ties).item() == pytest.approx(expected / event.sum(), rel=1e-5)


def test_cox_loss_efron_matches_lifelines_at_its_maximum():
    """lifelines' CoxPHFitter (Efron) log-likelihood at its fitted coefficient equals minus our summed loss, and our
    gradient vanishes there."""
    import pandas as pd
    from lifelines import CoxPHFitter

    rng = np.random.default_rng(1)
    x = rng.normal(size=60)
    time = np.ceil(rng.exponential(np.exp(-0.8 * x)) * 4)  # integer times: ties
    event = (rng.random(60) < 0.7).astype(float)
    assert len(np.unique(time[event == 1])) < event.sum()  # there are tied event times
    fitter = CoxPHFitter().fit(pd.DataFrame({"x": x, "T": time, "E": event}), "T", "E")
    beta = torch.tensor(float(fitter.params_["x"]), dtype=torch.float64, requires_grad=True)
    loss = cox_loss(beta * torch.tensor(x), torch.tensor(time), torch.tensor(event), reduction="sum")
    assert -loss.item() == pytest.approx(fitter.log_likelihood_, rel=1e-5)
    (grad,) = torch.autograd.grad(loss, beta)
    away = cox_loss((beta.detach() + 0.2) * torch.tensor(x), torch.tensor(time), torch.tensor(event), reduction="sum")
    assert abs(grad.item()) < 1e-3 and away.item() > loss.item() + 0.1


def test_torchsurv_mean_reduction_divides_by_distinct_event_times_with_ties():
    """Documents why cox_loss does its own mean: torchsurv's changes its divisor when event times tie."""
    lp, time, event = _tied_data()
    args = (torch.tensor(lp, dtype=torch.float32), torch.tensor(event).bool(), torch.tensor(time, dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        total = neg_partial_log_likelihood(*args, reduction="sum").item()
        torchsurv_mean = neg_partial_log_likelihood(*args, reduction="mean").item()
    distinct = len(np.unique(time[event == 1]))
    assert distinct < event.sum()
    assert torchsurv_mean == pytest.approx(total / distinct, rel=1e-6)
    assert cox_loss(args[0], torch.tensor(time), torch.tensor(event)).item() == pytest.approx(
        total / event.sum(), rel=1e-6
    )


# ---------------------------------------------------------------------------------------------- Cox: degenerate
def test_cox_loss_without_events_is_a_connected_zero():
    log_hz = torch.tensor([0.3, -1.0, 2.0], requires_grad=True)
    loss = cox_loss(log_hz, torch.tensor([1.0, 2.0, 3.0]), torch.zeros(3))
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert torch.equal(log_hz.grad, torch.zeros(3))
    # torchsurv itself returns a fresh leaf (no graph), which would leave DDP waiting for gradients
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = neg_partial_log_likelihood(log_hz, torch.zeros(3).bool(), torch.tensor([1.0, 2.0, 3.0]))
    assert raw.item() == 0.0 and raw.grad_fn is None


def test_cox_loss_single_case_is_a_connected_zero_where_torchsurv_fails():
    log_hz = torch.tensor([0.7], requires_grad=True)
    loss = cox_loss(log_hz, torch.tensor([1.0]), torch.tensor([1.0]))
    assert loss.item() == 0.0 and loss.grad_fn is not None  # log(e^x / e^x) = 0
    loss.backward()
    assert log_hz.grad.tolist() == [0.0]
    with pytest.raises(TypeError, match="0-d tensor"):  # torchsurv 0.2.0 on a (1,) batch
        neg_partial_log_likelihood(log_hz, torch.tensor([True]), torch.tensor([1.0]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"ties": "exact"}, "ties"),
        ({"reduction": "none"}, "reduction"),
        ({"event": torch.tensor([1.0, 3.0])}, "0 or 1"),
    ],
)
def test_cox_loss_rejects_bad_input(kwargs, message):
    args = {"log_hz": torch.zeros(2), "time": torch.tensor([1.0, 2.0]), "event": torch.tensor([1.0, 0.0])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        cox_loss(**args)


# ---------------------------------------------------------------------------------------------- Cox: DDP (torchrun)
@pytest.fixture(scope="module")
def ddp_cox(tmp_path_factory):
    """One 2-process gloo run of ``tests/ddp_cox_worker.py``: per rank, scenario -> loss and weight gradient."""
    out = tmp_path_factory.mktemp("ddp_cox")
    cmd = torchrun_cmd(2, str(REPO_ROOT / "tests" / "ddp_cox_worker.py"), str(out))
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def _single_process(events: str, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and weight gradient of one process on ``rows`` (default: all) of the worker's batch."""
    from tests.ddp_cox_worker import full_batch, make_model

    x, time, event = full_batch(events)
    rows = list(range(x.shape[0])) if rows is None else rows
    model = make_model()
    loss = cox_loss(model(x[rows]), time[rows], event[rows])
    loss.backward()
    return loss.detach(), model.weight.grad


@pytest.mark.parametrize("scenario", ["global", "uneven", "events_on_rank1_only"])
def test_ddp_global_risk_set_gradient_equals_single_process_full_batch(ddp_cox, scenario):
    from tests.ddp_cox_worker import SCENARIOS

    loss, grad = _single_process(SCENARIOS[scenario][3])
    assert grad.abs().max() > 0.05  # a gradient worth comparing (fixed features and weights: 0.75 and 0.93)
    for rank in ddp_cox:  # float32 sums over other batch splits: a few ulps of the loss and gradient
        assert rank[scenario]["loss"].item() == pytest.approx(loss.item(), rel=1e-5)
        torch.testing.assert_close(rank[scenario]["grad"], grad, atol=1e-6, rtol=1e-5)


def test_ddp_without_global_risk_set_gradient_differs(ddp_cox):
    """Without the global risk set each rank's loss is the partial likelihood of its own half, and DDP averages the
    two halves' gradients: computed here in one process, and (fixed features) far from the full batch's."""
    from tests.ddp_cox_worker import SCENARIOS

    rows0, rows1, global_risk_set, events = SCENARIOS["local"]
    assert not global_risk_set
    _, grad = _single_process(events)
    (loss0, grad0), (loss1, grad1) = _single_process(events, rows0), _single_process(events, rows1)
    r0, r1 = (rank["local"] for rank in ddp_cox)
    assert r0["loss"].item() == pytest.approx(loss0.item(), rel=1e-5)  # each rank saw only its half
    assert r1["loss"].item() == pytest.approx(loss1.item(), rel=1e-5)
    assert loss0.item() != pytest.approx(loss1.item(), rel=1e-3)  # 2.05 and 1.63
    torch.testing.assert_close(r0["grad"], r1["grad"])  # DDP still averages the (wrong) gradients
    torch.testing.assert_close(r0["grad"], (grad0 + grad1) / 2, atol=1e-6, rtol=1e-5)
    assert (r0["grad"] - grad).abs().max() > 1e-2  # 0.20


def test_ddp_global_batch_without_events_is_zero_on_every_rank(ddp_cox):
    for rank in ddp_cox:
        assert rank["no_events"]["loss"].item() == 0.0
        assert torch.equal(rank["no_events"]["grad"], torch.zeros_like(rank["no_events"]["grad"]))

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the survival network (backbones, covariate fusion, local pretrained weights), the survival-curve
helpers (hand-computed values, monotonicity, Breslow against scikit-survival and torchsurv) and the calibrated
inference module (percentiles, groups, state-dict round trip, both heads)."""

from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import pytest
import torch
from monai.networks.nets import resnet

from common.checkpoint_io import CheckpointError
from common.survival.networks import (
    CALIBRATION_BUFFERS,
    SurvivalExportView,
    SurvivalNet,
    SurvivalPredictor,
    breslow_cumulative_hazard,
    cox_survival_at,
    hazards_to_survival,
    load_predictor,
    survival_at,
)

torch.set_num_threads(1)

SIZE = 16


def _image(batch: int = 2, seed: int = 0, channels: int = 1) -> torch.Tensor:
    return torch.randn(batch, channels, SIZE, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))


def _net(seed: int = 0, **kwargs) -> SurvivalNet:
    torch.manual_seed(seed)
    args = {"backbone": "resnet10", "num_intervals": 3, "hidden_channels": 8}
    args.update(kwargs)
    return SurvivalNet(**args).eval()


# ---------------------------------------------------------------------------------------------- SurvivalNet
@pytest.mark.parametrize("head, width", [("logistic_hazard", 3), ("cox", 1)])
def test_survival_net_output_shapes(head, width):
    net = _net(head=head)
    with torch.no_grad():
        out = net(_image())
    assert out.shape == (2, width) and torch.isfinite(out).all()
    assert net.feature_channels == 512 and net.head[0].in_features == 512 and net.head[-1].out_features == width
    assert net.backbone.conv1.stride == (2, 2, 2) and net.backbone.conv1.kernel_size == (7, 7, 7)


def test_survival_net_resnet18_with_anisotropic_stem():
    net = _net(backbone="resnet18", conv1_t_size=(3, 7, 7), conv1_t_stride=(1, 2, 2), in_channels=2, num_intervals=4)
    assert net.backbone.conv1.stride == (1, 2, 2) and net.backbone.conv1.in_channels == 2
    with torch.no_grad():
        assert net(_image(channels=2)).shape == (2, 4)


@pytest.mark.parametrize(
    "name, shortcut, bias",
    [("resnet10", "B", False), ("resnet18", "A", True), ("resnet34", "A", True), ("resnet50", "B", False)],
)
def test_survival_net_builds_each_monai_backbone_offline(monkeypatch, name, shortcut, bias):
    """Each name calls its MONAI constructor with pretrained=False, feed_forward=False, the explicit stem and the
    MedicalNet layout (the spy builds a resnet10 with those arguments to stay fast)."""
    calls = []
    real_resnet10 = resnet.resnet10

    def spy(**kwargs):
        calls.append(kwargs)
        return real_resnet10(**kwargs)

    monkeypatch.setattr(resnet, name, spy)
    net = SurvivalNet(backbone=name, hidden_channels=4, conv1_t_stride=2, num_intervals=2).eval()
    (kwargs,) = calls
    assert kwargs["pretrained"] is False and kwargs["feed_forward"] is False
    assert kwargs["conv1_t_stride"] == 2 and kwargs["conv1_t_size"] == 7 and kwargs["n_input_channels"] == 1
    assert kwargs["shortcut_type"] == shortcut and kwargs["bias_downsample"] is bias
    with torch.no_grad():
        assert net(_image()).shape == (2, 2)


@pytest.mark.parametrize(
    "kwargs, config_id",
    [
        ({"backbone": "resnet101"}, "backbone"),
        ({"head": "weibull"}, "survival_head"),
        ({"num_intervals": 0}, "num_intervals"),
        ({"num_intervals": 2.5}, "num_intervals"),
        ({"conv1_t_stride": 0}, "conv1_t_stride"),
        ({"conv1_t_stride": (2, 2)}, "conv1_t_stride"),
        ({"conv1_t_size": (3, 7, 7, 7)}, "conv1_t_size"),
        ({"num_covariates": -1}, "num_covariates"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_survival_net_rejects_bad_settings_naming_the_config_id(kwargs, config_id):
    with pytest.raises(ValueError, match=config_id):
        SurvivalNet(**{"backbone": "resnet10", **kwargs})


def test_covariates_are_fused_and_checked():
    net = _net(num_covariates=2)
    image = _image()
    with torch.no_grad():
        a = net(image, torch.tensor([[0.0, 0.0], [1.0, -1.0]]))
        b = net(image, torch.tensor([[2.0, 1.0], [1.0, -1.0]]))
    assert net.head[0].in_features == 512 + 2
    assert not torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])  # only the changed case moves
    with pytest.raises(ValueError, match="expects 2 covariates"):
        net(image)
    with pytest.raises(ValueError, match=r"shape \(2, 2\).*got \[2, 3\]"):
        net(image, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="num_covariates=0"):
        _net()(image, torch.zeros(2, 1))


# ---------------------------------------------------------------------------------------------- pretrained weights
def _assert_backbone_equal(a: SurvivalNet, b: SurvivalNet) -> None:
    for (key, x), y in zip(a.backbone.state_dict().items(), b.backbone.state_dict().values()):
        assert torch.equal(x, y), key


def test_pretrained_plain_state_dict_reproduces_the_weights(tmp_path, caplog):
    source = _net(seed=1)
    path = tmp_path / "backbone.pt"
    torch.save(source.backbone.state_dict(), path)
    fresh = _net(seed=2)
    assert not torch.equal(fresh.backbone.conv1.weight, source.backbone.conv1.weight)
    with caplog.at_level(logging.INFO, logger="common.survival.networks"):
        loaded = _net(seed=2, pretrained_path=str(path))
    _assert_backbone_equal(loaded, source)
    n = len(source.backbone.state_dict())
    assert f"loaded {n} of {n} backbone tensors" in caplog.text
    assert torch.equal(loaded.head[0].weight, fresh.head[0].weight)  # the head is not touched


def test_pretrained_medicalnet_style_dict_with_module_prefix(tmp_path, caplog):
    source = _net(seed=3)
    state = {f"module.{k}": v for k, v in source.backbone.state_dict().items()}
    state["module.conv_seg.0.weight"] = torch.randn(4, 512, 1, 1, 1)  # MedicalNet's segmentation head
    path = tmp_path / "resnet_10_23dataset.pth"
    torch.save({"state_dict": state}, path)
    with caplog.at_level(logging.INFO, logger="common.survival.networks"):
        loaded = _net(seed=4, pretrained_path=path)
    _assert_backbone_equal(loaded, source)
    assert "1 file tensors unused" in caplog.text and "conv_seg.0.weight" in caplog.text


@pytest.mark.parametrize("depth", [10, 18])
def test_medicalnet_release_loads_as_monais_own_loader_loads_it(depth, tmp_path, monkeypatch):
    """A file in MedicalNet's released layout (``{"state_dict": {"module.<key>": ...}}``, as the publisher's
    ``resnet_<depth>_23dataset.pth``) gives the same backbone through ``pretrained_path`` as through MONAI's own
    MedicalNet chain (``resnet<depth>(pretrained=True)``, its download replaced by the local file): the same tensors,
    and the same features on a real MRI volume (a crop of the MNI152 T1 template)."""
    import nibabel as nib

    from common.demo.images import mni_template_paths

    stride = 2
    torch.manual_seed(depth)
    bias, shortcut = resnet.get_medicalnet_pretrained_resnet_args(depth)
    publisher = getattr(resnet, f"resnet{depth}")(
        n_input_channels=1, feed_forward=False, shortcut_type=shortcut, bias_downsample=bias, conv1_t_stride=stride
    )
    path = tmp_path / f"resnet_{depth}_23dataset.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in publisher.state_dict().items()}}, path)
    asked = []

    def local_file(repo_id: str, filename: str) -> str:
        asked.append((repo_id, filename))
        return str(path)

    monkeypatch.setattr(resnet, "hf_hub_download", local_file)
    torch.manual_seed(depth + 1)  # a different initialisation, so the file decides every weight
    monai_loaded = getattr(resnet, f"resnet{depth}")(
        pretrained=True,
        n_input_channels=1,
        feed_forward=False,
        shortcut_type=shortcut,
        bias_downsample=bias,
        conv1_t_stride=stride,
    ).eval()
    assert asked == [(f"TencentMedicalNet/MedicalNet-Resnet{depth}", path.name)]
    ours = _net(seed=depth + 2, backbone=f"resnet{depth}", conv1_t_stride=stride, pretrained_path=path)
    for (key, x), y in zip(ours.backbone.state_dict().items(), monai_loaded.state_dict().values(), strict=True):
        assert torch.equal(x, y), key
    t1 = np.asarray(nib.load(mni_template_paths()["t1"]).dataobj, dtype=np.float32)[::2, ::2, ::2]
    centre = [n // 2 for n in t1.shape]
    crop = t1[tuple(slice(c - SIZE, c + SIZE) for c in centre)]
    volume = torch.as_tensor((crop - crop.mean()) / crop.std())[None, None]
    with torch.no_grad():
        torch.testing.assert_close(ours.backbone(volume), monai_loaded(volume), rtol=0, atol=1e-6)


def test_pretrained_whole_survival_net_checkpoint(tmp_path):
    source = _net(seed=5)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    _assert_backbone_equal(_net(seed=6, pretrained_path=tmp_path / "model.pt"), source)


def test_pretrained_errors_name_the_file(tmp_path):
    missing = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError, match="nope.pt.*does not exist"):
        _net(pretrained_path=missing)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="garbage.pt.*unreadable"):
        _net(pretrained_path=garbage)
    unrelated = tmp_path / "unrelated.pt"
    torch.save({"encoder.weight": torch.zeros(3)}, unrelated)
    with pytest.raises(CheckpointError, match="none of the 1 tensors.*unrelated.pt"):
        _net(pretrained_path=unrelated)
    other_channels = tmp_path / "two_channel.pt"
    torch.save(_net(in_channels=2).backbone.state_dict(), other_channels)
    with pytest.raises(
        CheckpointError, match=r"two_channel.pt.*conv1.weight: file \(64, 2, 7, 7, 7\) vs backbone \(64, 1, 7, 7, 7\)"
    ):
        _net(pretrained_path=other_channels)
    not_tensors = tmp_path / "list.pt"
    torch.save([1, 2], not_tensors)
    with pytest.raises(CheckpointError, match="list.pt.*state dict of tensors"):
        _net(pretrained_path=not_tensors)


# ---------------------------------------------------------------------------------------------- curves
CUTS = [0.0, 1.0, 2.0, 4.0]
LOGITS = torch.tensor([[0.0, math.log(3), math.log(1 / 3)]])  # hazards 0.5, 0.75, 0.25


def test_hazards_to_survival_and_survival_at_hand_computed():
    assert hazards_to_survival(LOGITS)[0].tolist() == pytest.approx([0.5, 0.125, 0.09375], rel=1e-6)
    times = [0.0, 0.5, 1.0, 1.5, 3.0, 4.0]
    expected = [
        1.0,  # S(0) = 1
        0.5**0.5,  # half of interval 0 at constant hazard
        0.5,
        0.5 * 0.25**0.5,  # S(1) (1 - h_1)^(1/2)
        0.125 * 0.75**0.5,  # S(2) (1 - h_2)^((3 - 2) / (4 - 2))
        0.09375,
    ]
    assert survival_at(LOGITS, CUTS, times)[0].tolist() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match=r"time 4.5 is beyond the last cut point c_K = 4"):
        survival_at(LOGITS, CUTS, [1.0, 4.5])
    with pytest.raises(ValueError, match="non-negative"):
        survival_at(LOGITS, CUTS, [-1.0])
    with pytest.raises(ValueError, match=r"shape \(B, 3\)"):
        survival_at(torch.zeros(1, 2), CUTS, [1.0])


def test_survival_curves_are_monotone_in_time():
    logits = torch.randn(32, 3, generator=torch.Generator().manual_seed(0)) * 4
    grid = torch.linspace(0, 4, 401)
    s = survival_at(logits, CUTS, grid)
    assert s.shape == (32, 401) and (s.diff(dim=1) <= 0).all() and (s[:, 0] == 1).all()
    cumhaz = torch.cumsum(torch.rand(50, generator=torch.Generator().manual_seed(1)), 0)
    cox = cox_survival_at(torch.randn(32) * 3, torch.linspace(0, 5, 50), cumhaz, torch.linspace(0, 5, 301))
    assert cox.shape == (32, 301) and (cox.diff(dim=1) <= 0).all()


def _cox_data(n: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    lp = rng.normal(size=n)
    time = np.round(rng.exponential(2.0, size=n) + 0.05, 1)  # rounded: tied times
    event = (rng.random(n) < 0.6).astype(float)
    return lp, time, event


def test_breslow_matches_sksurv_and_torchsurv():
    from sksurv.linear_model.coxph import BreslowEstimator
    from torchsurv.loss.cox import baseline_survival_function

    lp, time, event = _cox_data()
    assert len(np.unique(time)) < len(time)
    reference = BreslowEstimator().fit(lp, event.astype(bool), time).cum_baseline_hazard_
    # sksurv returns its first value for any t before its first time: compare from there on
    grid = np.unique(np.concatenate([reference.x, np.linspace(reference.x[0], time.max(), 37)]))
    ours = breslow_cumulative_hazard(torch.tensor(lp), torch.tensor(time), torch.tensor(event), torch.tensor(grid))
    np.testing.assert_allclose(ours.numpy(), reference(grid), rtol=1e-10, atol=1e-12)
    assert ours[-1] > 0 and (ours.diff() >= 0).all()
    first_event = time[event == 1].min()
    before = breslow_cumulative_hazard(
        torch.tensor(lp), torch.tensor(time), torch.tensor(event), [0.0, first_event - 0.01]
    )
    assert before.tolist() == [0.0, 0.0]
    # torchsurv returns float32 times (0.7 -> 0.69999999), so evaluate at the exact unique times, in its order
    torchsurv = baseline_survival_function(torch.tensor(lp), torch.tensor(event).bool(), torch.tensor(time))
    unique = torch.unique(torch.tensor(time))
    torch.testing.assert_close(torchsurv["time"], unique.float())
    ours_at = breslow_cumulative_hazard(torch.tensor(lp), torch.tensor(time), torch.tensor(event), unique)
    torch.testing.assert_close(torch.exp(-ours_at), torchsurv["baseline_survival"].double(), rtol=1e-6, atol=1e-7)


def test_breslow_scales_with_a_log_hazard_offset():
    """The partial likelihood ignores a constant offset in the log-hazards; H0 absorbs it as exp(-offset)."""
    lp, time, event = _cox_data()
    grid = torch.tensor([0.5, 1.0, 3.0])
    base = breslow_cumulative_hazard(torch.tensor(lp), torch.tensor(time), torch.tensor(event), grid)
    shifted = breslow_cumulative_hazard(torch.tensor(lp + 300.0), torch.tensor(time), torch.tensor(event), grid)
    assert (base > 0).all() and (shifted > 0).all()
    torch.testing.assert_close(shifted.log() + 300.0, base.log())


def test_cox_survival_at_is_a_step_function_on_the_grid():
    grid = torch.tensor([0.0, 1.0, 2.0, 3.0])
    cumhaz = torch.tensor([0.0, 0.1, 0.3, 0.6])
    lp = torch.tensor([0.0, math.log(2.0)])
    s = cox_survival_at(lp, grid, cumhaz, [0.0, 0.5, 1.0, 2.99, 3.0])
    h0 = torch.tensor([0.0, 0.0, 0.1, 0.3, 0.6])  # the last grid point at or before each time
    torch.testing.assert_close(s, torch.exp(-torch.stack([h0, 2 * h0])))
    with pytest.raises(ValueError, match=r"time 3.5 is beyond the baseline hazard grid \(last time 3\)"):
        cox_survival_at(lp, grid, cumhaz, [3.5])


# ---------------------------------------------------------------------------------------------- SurvivalPredictor
HORIZONS = (1.0, 3.0, 4.0)


def _logistic_predictor(seed: int = 0) -> SurvivalPredictor:
    return SurvivalPredictor(_net(seed=seed), "logistic_hazard", HORIZONS, cut_points=CUTS)


def test_predictor_requires_calibration():
    predictor = _logistic_predictor()
    with pytest.raises(RuntimeError, match="not calibrated"):
        predictor(_image())
    with pytest.raises(RuntimeError, match="not calibrated"):
        predictor.risk_percentile(torch.zeros(2))
    out = predictor.network(_image())
    assert predictor.survival(out).shape == (2, 3)  # logistic-hazard survival needs no calibration
    cox = SurvivalPredictor(_net(head="cox"), "cox", HORIZONS)
    with pytest.raises(RuntimeError, match="not calibrated: Cox survival"):
        cox.survival(torch.zeros(2, 1))


def test_percentiles_and_groups_on_known_values():
    predictor = _logistic_predictor()
    predictor.calibrate(torch.arange(101.0), torch.full((101,), 2.0), torch.ones(101))
    assert predictor.train_risk_quantiles.tolist() == pytest.approx(list(range(101)))
    assert predictor.group_thresholds.tolist() == pytest.approx([100 / 3, 200 / 3], rel=1e-6)
    pct = predictor.risk_percentile(torch.tensor([-5.0, 0.0, 37.5, 99.25, 100.0, 250.0]))
    assert pct.tolist() == pytest.approx([0.0, 0.0, 37.5, 99.25, 100.0, 100.0], abs=1e-4)
    groups = predictor.risk_group(torch.tensor([0.0, 33.0, 34.0, 66.0, 67.0, 100.0]))
    assert groups.tolist() == [0, 0, 1, 1, 2, 2] and groups.dtype == torch.long
    # ties: 5 of 10 training risks are 0, so quantiles 0..44 are all 0 -> the middle of that run, 22
    predictor.calibrate(torch.tensor([0.0] * 5 + [1.0, 2.0, 3.0, 4.0, 5.0]), torch.ones(10), torch.ones(10))
    assert predictor.risk_percentile(torch.tensor([0.0])).item() == pytest.approx(22.0)
    expected = np.percentile([0.0] * 5 + [1.0, 2.0, 3.0, 4.0, 5.0], [100 / 3, 200 / 3])
    assert predictor.group_thresholds.tolist() == pytest.approx(expected.tolist(), rel=1e-6)


def test_logistic_predictor_outputs_and_state_dict_round_trip(tmp_path):
    predictor = _logistic_predictor(seed=0)
    image = _image(batch=3)
    with torch.no_grad():
        risk = predictor.risk_score(predictor.network(_image(batch=8, seed=1)))
    predictor.calibrate(risk, torch.rand(8) * 4, (torch.arange(8) % 2).float())
    with torch.no_grad():
        out = predictor(image)
    assert set(out) == {"pred", "risk_score", "survival", "p_event", "risk_percentile", "risk_group"}
    assert out["survival"].shape == out["p_event"].shape == (3, 3)
    assert (out["survival"].diff(dim=1) <= 0).all()
    torch.testing.assert_close(out["p_event"], 1 - out["survival"])
    # the risk is the cumulative hazard at the longest horizon: -log P(no event by then)
    torch.testing.assert_close(out["risk_score"], -torch.log(out["survival"][:, -1]), rtol=1e-5, atol=1e-6)
    assert ((out["risk_percentile"] >= 0) & (out["risk_percentile"] <= 100)).all()

    state = predictor.state_dict()
    assert set(CALIBRATION_BUFFERS) <= set(state) and "backbone.conv1.weight" in state
    assert set(state) - set(CALIBRATION_BUFFERS) == set(predictor.network.state_dict())
    torch.save(state, tmp_path / "model.pt")
    fresh = _logistic_predictor(seed=9)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    with torch.no_grad():
        again = fresh(image)
    for key in out:
        assert torch.equal(out[key], again[key]), key
    wrong = SurvivalPredictor(_net(), "logistic_hazard", HORIZONS, cut_points=CUTS, risk_quantiles=11)
    with pytest.raises(RuntimeError, match="'train_risk_quantiles' has shape"):
        wrong.load_state_dict(state)
    with pytest.raises(RuntimeError, match="lacks the calibration buffers"):
        fresh.load_state_dict(predictor.network.state_dict())


def test_cox_predictor_matches_sksurv_and_round_trips(tmp_path):
    from sksurv.linear_model.coxph import BreslowEstimator

    predictor = SurvivalPredictor(_net(head="cox"), "cox", HORIZONS, grid_size=64)
    lp, time, event = _cox_data()
    time = time * 5.0 / time.max()  # follow-up up to 5 years covers the horizons
    predictor.calibrate(torch.tensor(lp), torch.tensor(time), torch.tensor(event))
    grid = predictor.baseline_grid
    assert grid.numel() == 64 and grid[0] == 0 and grid[-1] == pytest.approx(time.max())
    assert all((grid == h).any() for h in HORIZONS) and (grid.diff() >= 0).all()
    reference = BreslowEstimator().fit(lp, event.astype(bool), time)
    new_lp = torch.tensor([-1.0, 0.0, 2.0])
    expected = np.stack([f(np.array(HORIZONS)) for f in reference.get_survival_function(new_lp.numpy())])
    ours = predictor.survival(new_lp[:, None])
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-5)
    assert (ours.diff(dim=1) <= 0).all()

    with torch.no_grad():
        out = predictor(_image())
    assert out["pred"].shape == (2, 1) and torch.equal(out["risk_score"], out["pred"][:, 0])
    assert (out["survival"].diff(dim=1) <= 0).all()
    assert set(predictor.state_dict()) - set(CALIBRATION_BUFFERS) == set(predictor.network.state_dict())
    fresh = SurvivalPredictor(_net(seed=5, head="cox"), "cox", HORIZONS, grid_size=64)
    fresh.load_state_dict(predictor.state_dict())
    with torch.no_grad():
        again = fresh(_image())
    for key in out:
        assert torch.equal(out[key], again[key]), key


def test_cox_calibration_errors():
    predictor = SurvivalPredictor(_net(head="cox"), "cox", (1, 3, 5))
    with pytest.raises(ValueError, match="horizon 5 is beyond the longest training follow-up 4"):
        predictor.calibrate(torch.zeros(3), torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="needs events"):
        predictor.calibrate(torch.zeros(3), torch.tensor([1.0, 2.0, 6.0]), torch.zeros(3))
    assert not bool(predictor.calibrated)


def test_predictor_standardises_covariates():
    net = _net(num_covariates=2)
    predictor = SurvivalPredictor(net, "logistic_hazard", HORIZONS, cut_points=CUTS, num_covariates=2)
    predictor.set_covariate_stats([60.0, 1.0], [10.0, 0.0])
    assert predictor.covariate_std.tolist() == [10.0, 1.0]  # std 0 -> 1
    predictor.calibrate(torch.arange(10.0), torch.ones(10), torch.ones(10))
    raw = torch.tensor([[70.0, 1.0], [50.0, 0.0]])
    image = _image()
    with torch.no_grad():
        out = predictor(image, raw)
        direct = net(image, torch.tensor([[1.0, 0.0], [-1.0, -1.0]]))
    torch.testing.assert_close(out["pred"], direct)
    with pytest.raises(ValueError, match="2 finite values"):
        predictor.set_covariate_stats([1.0], [1.0])
    with pytest.raises(ValueError, match="expects 2 covariates"):
        predictor(image)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cut_points": [0.0, 2.0, 1.0, 4.0]}, "increase strictly"),
        ({"horizons": (1.0, 5.0)}, "horizon 5 is beyond the last cut point c_K = 4"),
        ({"horizons": (0.0, 1.0)}, "positive"),
        ({"cut_points": [0.0, 1.0, 4.0]}, "2 intervals but the network has 3 outputs"),
        ({"head": "aft"}, "survival_head"),
    ],
)
def test_predictor_rejects_bad_settings(kwargs, message):
    args = {"head": "logistic_hazard", "horizons": HORIZONS, "cut_points": CUTS}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SurvivalPredictor(_net(), **args)


def test_predictor_without_cut_points_needs_the_network_output_count():
    with pytest.raises(ValueError, match="cut_points.*num_outputs"):
        SurvivalPredictor(torch.nn.Linear(4, 3), "logistic_hazard", HORIZONS)


def test_placeholder_cut_points_are_filled_from_the_checkpoint(tmp_path):
    trained = _logistic_predictor(seed=0)
    trained.calibrate(torch.arange(20.0), torch.full((20,), 2.0), torch.ones(20))
    torch.save(trained.state_dict(), tmp_path / "model.pt")
    for cut_points in (None, [0.0] * 4):  # what an inference config that does not know the cut points passes
        fresh = SurvivalPredictor(_net(seed=1), "logistic_hazard", HORIZONS, cut_points=cut_points)
        assert fresh.cut_points.tolist() == [0.0] * 4
        with pytest.raises(RuntimeError, match="not calibrated"):
            fresh.survival(torch.zeros(1, 3))
        assert load_predictor(fresh, tmp_path / "model.pt") is fresh
        assert fresh.cut_points.tolist() == CUTS
        with torch.no_grad():
            torch.testing.assert_close(fresh(_image())["survival"], trained(_image())["survival"])
    late = SurvivalPredictor(_net(seed=1), "logistic_hazard", (1.0, 5.0), cut_points=None)
    with pytest.raises(CheckpointError, match="model.pt.*horizon 5 is beyond the last cut point c_K = 4"):
        load_predictor(late, tmp_path / "model.pt")


def test_load_predictor_errors_name_the_file(tmp_path):
    uncalibrated = _logistic_predictor()
    torch.save(uncalibrated.state_dict(), tmp_path / "early.pt")
    with pytest.raises(CheckpointError, match="early.pt.*uncalibrated"):
        load_predictor(_logistic_predictor(), tmp_path / "early.pt")
    uncalibrated.calibrate(torch.arange(5.0), torch.ones(5), torch.ones(5))
    torch.save({"predictor": uncalibrated.state_dict(), "trainer": {"iteration": 3}}, tmp_path / "last.pt")
    assert bool(load_predictor(_logistic_predictor(seed=2), tmp_path / "last.pt").calibrated)
    cox = SurvivalPredictor(_net(head="cox"), "cox", HORIZONS)
    with pytest.raises(CheckpointError, match="last.pt.*does not fit the configured SurvivalPredictor.*cut_points"):
        load_predictor(cox, tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match="missing.pt"):
        load_predictor(cox, tmp_path / "missing.pt")


def test_predict_on_a_time_grid_and_covariate_checks():
    predictor = _logistic_predictor()
    predictor.calibrate(torch.arange(20.0), torch.full((20,), 2.0), torch.ones(20))
    grid = torch.linspace(0.1, 4.0, 40)
    with torch.no_grad():
        out = predictor.predict(_image(), times=grid)
    assert out["survival_grid"].shape == (2, 40) and (out["survival_grid"].diff(dim=1) <= 0).all()
    torch.testing.assert_close(out["survival_grid"], survival_at(out["pred"], CUTS, grid))
    assert predictor.standardize_covariates(torch.zeros(2, 0)).shape == (2, 0)
    with pytest.raises(ValueError, match=r"shape \(B, 0\)"):
        predictor.standardize_covariates(torch.zeros(2, 1))


@pytest.mark.parametrize("head", ["logistic_hazard", "cox"])
def test_export_view_scripts_with_and_without_covariates(head):
    """``torch.jit.script`` (what the model zoo's ``ckpt_export`` does) of the calibrated export view gives the
    eager values for both heads, also with covariates, and keeps the covariate check."""
    for covariates in (None, torch.tensor([[60.0, 1.0], [45.0, 0.0], [70.0, 1.0]])):
        k = 0 if covariates is None else covariates.shape[1]
        net = _net(head=head, num_intervals=3 if head == "logistic_hazard" else 1, num_covariates=k)
        cuts = CUTS if head == "logistic_hazard" else None
        predictor = SurvivalPredictor(net, head, HORIZONS, cut_points=cuts, num_covariates=k)
        if k:
            predictor.set_covariate_stats(covariates.mean(0), covariates.std(0))
        risk, time, event = torch.linspace(-1, 1, 20), torch.linspace(0.5, 6.0, 20), (torch.arange(20) % 2 == 0).float()
        predictor.calibrate(risk, time, event, log_hz=risk if head == "cox" else None)
        view = SurvivalExportView(predictor)
        scripted = torch.jit.script(view)
        image = _image(batch=3, seed=4)
        with torch.no_grad():
            torch.testing.assert_close(scripted(image, covariates), view(image, covariates))
        if k:
            with pytest.raises(torch.jit.Error, match="covariates of shape"):
                scripted(image, covariates[:, :1])


def test_export_view_is_one_tensor_that_traces(tmp_path):
    """The exported ``pred``: risk score, percentile, group, then P(event) per horizon; a trace reproduces it at
    another batch size, and the view loads model.pt."""
    predictor = _logistic_predictor()
    predictor.calibrate(torch.arange(20.0), torch.full((20,), 2.0), torch.ones(20))
    view = SurvivalExportView(predictor)
    image = _image(batch=3, seed=4)
    with torch.no_grad():
        pred, out = view(image), predictor(image)
    assert pred.shape == (3, 3 + len(HORIZONS))
    expected = torch.cat(
        [torch.stack([out["risk_score"], out["risk_percentile"], out["risk_group"].float()], 1), out["p_event"]], 1
    )
    torch.testing.assert_close(pred, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(view, (_image(batch=2),))
    with torch.no_grad():
        torch.testing.assert_close(traced(image), pred)
    torch.save(view.state_dict(), tmp_path / "model.pt")
    fresh = SurvivalExportView(_logistic_predictor(seed=7))
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(fresh(image), pred)

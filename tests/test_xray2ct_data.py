# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the X-ray -> CT data: the chest phantom demo, the stage transforms (CT and X-rays made by the
projector, exact consistency with the projection loss), X-ray view files (PNG and NIfTI round trips, orientation,
errors and their checks before training) and transforms that read the views from files."""

from __future__ import annotations

import json
import os

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

from common.data.datalist import load_datalist
from common.data.preflight import PreflightError
from common.demo.images import make_xray2ct_demo
from common.xray2ct.data import (
    check_view_files,
    grid_spacing,
    read_view,
    save_view_nifti,
    save_view_png,
    screen_inputs,
    view_keys,
)
from common.xray2ct.drr import DRRProjector
from common.xray2ct.losses import ProjectionLoss
from tests.oracles import xray2ct_transforms

FOV = 350.0
SIDE = 16


def projector(view_size=(SIDE, SIDE)) -> DRRProjector:
    return DRRProjector(hu_window=(-1000.0, 1000.0), fov_mm=FOV, view_size=view_size)


def line_integrals(shape=(16, 12), seed: int = 0) -> np.ndarray:
    """Smooth-ish normalised line integrals in [0.1, 3]."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.1, 3.0, size=shape).astype(np.float32)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_xray2ct_demo(tmp_path_factory.mktemp("xray_demo"), n_train=3, n_val=1, shape=(SIDE, SIDE, SIDE))


@pytest.fixture(scope="module")
def case(demo):
    return load_datalist(demo, "training")[0]


# ---------------------------------------------------------------------------------------------- demo
def test_demo_writes_the_requested_cases_and_is_reused(demo):
    sections = json.loads(demo.read_text())
    assert {k: len(v) for k, v in sections.items()} == {"training": 3, "validation": 1}
    entries = load_datalist(demo, "training") + load_datalist(demo, "validation")
    files = [demo, *(entry["image"] for entry in entries)]
    image = nib.load(entries[0]["image"])
    assert image.shape == (SIDE, SIDE, SIDE)
    np.testing.assert_allclose(image.header.get_zooms(), [FOV / SIDE] * 3, rtol=1e-5)
    data = np.asarray(image.dataobj)
    assert data.min() <= -990 and data.max() > 100  # HU: air around the body, bone/contrast inside
    mtimes = [os.stat(f).st_mtime_ns for f in files]
    assert make_xray2ct_demo(demo.parent, n_train=3, n_val=1, shape=(SIDE, SIDE, SIDE)) == demo
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes


# ---------------------------------------------------------------------------------------------- transforms
def test_transforms_give_the_ct_and_its_xrays(case):
    proj = projector()
    out = xray2ct_transforms(proj, (SIDE, SIDE, SIDE))(dict(case))
    image, xray = out["image"], out["xray"]
    assert image.shape == (1, SIDE, SIDE, SIDE) and xray.shape == (2, SIDE, SIDE)
    assert image.dtype == torch.float32 and xray.dtype == torch.float32
    assert float(image.min()) >= -1 and float(image.max()) <= 1
    assert float(image.min()) == -1 and float(image.max()) > 0  # air and dense tissue inside the window
    assert image.meta["case_id"] == "phantom_train_000"
    assert float(xray.min()) >= 0 and float(xray.max()) > 0.1
    loss = ProjectionLoss(proj)(image.as_tensor()[None], xray.as_tensor()[None])
    assert torch.equal(loss, torch.zeros(1))


@pytest.mark.parametrize("view_size", [(2 * SIDE, 2 * SIDE), (SIDE, SIDE)])
def test_xrays_made_at_the_source_size_match_the_stage_volume(case, view_size):
    proj = projector(view_size)
    source = (2 * SIDE,) * 3
    out = xray2ct_transforms(proj, (SIDE, SIDE, SIDE), source_size=source)(dict(case))
    assert out["image"].shape == (1, SIDE, SIDE, SIDE) and out["xray"].shape == (2, *view_size)
    at_source = xray2ct_transforms(proj, source)(dict(case))
    assert at_source["image"].shape == (1, *source)
    torch.testing.assert_close(out["xray"].as_tensor(), at_source["xray"].as_tensor())  # same inputs per stage
    loss = ProjectionLoss(proj)(out["image"].as_tensor()[None], out["xray"].as_tensor()[None])
    # zero in exact arithmetic (the stage CT is the area average of the source CT the X-rays were made from); float32
    # sums of the same attenuations grouped differently, each within about n eps32 |p| for rays of n <= 2 SIDE voxels
    assert float(loss) < 2 * SIDE * torch.finfo(torch.float32).eps * float(out["xray"].abs().max())
    # the CT is area-averaged: a strided subsample of the source CT does not project to the same X-rays
    strided = at_source["image"].as_tensor()[None, :, ::2, ::2, ::2]
    assert float(ProjectionLoss(proj)(strided, out["xray"].as_tensor()[None])) > 1e-3


def test_transforms_need_the_ct_or_view_files():
    with pytest.raises(ValueError, match="got neither"):
        xray2ct_transforms(projector(), (SIDE, SIDE, SIDE), with_image=False, view_files=False)


# ---------------------------------------------------------------------------------------------- view files
def test_png_round_trip_and_orientation(tmp_path):
    p = line_integrals((16, 12))
    p[2, 11] = 4.0  # the brightest point: second row of H, last (superior) column of W
    path = save_view_png(tmp_path / "case_ap.png", p)
    with Image.open(path) as img:
        assert img.size == (16, 12)  # width along H, height along W (superior at the top)
        pixels = np.asarray(img)
    assert pixels.dtype == np.uint16
    assert np.unravel_index(pixels.argmax(), pixels.shape) == (0, 2)
    back = read_view(path, (16, 12))
    assert back.shape == (16, 12) and back.dtype == np.float32
    np.testing.assert_allclose(back, p, rtol=1e-4, atol=1e-5)


def test_nifti_round_trip_is_exact(tmp_path):
    p = line_integrals((16, 12), seed=1)
    back = read_view(save_view_nifti(tmp_path / "case_lateral.nii.gz", p), (16, 12))
    np.testing.assert_array_equal(back, p)


def test_eight_bit_png_is_read_on_its_own_scale(tmp_path):
    p = line_integrals((8, 8), seed=2)
    intensity = 1 - np.exp(-p)
    path = tmp_path / "eight.png"
    Image.fromarray(np.round(intensity.T[::-1] * 255).astype(np.uint8)).save(path)
    back = read_view(path, (8, 8))
    np.testing.assert_allclose(1 - np.exp(-back), intensity, atol=0.5 / 255 + 1e-6)


def bad_files(tmp_path) -> dict[str, str]:
    """One X-ray file per kind of problem (views of 16 x 12 are expected)."""
    files = {
        "good": save_view_png(tmp_path / "good.png", line_integrals((16, 12))),
        "wrong_size": save_view_png(tmp_path / "wrong_size.png", line_integrals((16, 16))),
        "transposed": save_view_nifti(tmp_path / "transposed.nii.gz", line_integrals((12, 16))),
        "volume": tmp_path / "volume.nii.gz",
        "rgb": tmp_path / "rgb.png",
        "jpeg": tmp_path / "view.jpg",
    }
    nib.save(nib.Nifti1Image(np.zeros((16, 12, 3), np.float32), np.eye(4)), files["volume"])
    Image.new("RGB", (16, 12)).save(files["rgb"])
    Image.new("L", (16, 12)).save(files["jpeg"])
    return {k: str(v) for k, v in files.items()}


@pytest.mark.parametrize(
    "kind, text",
    [
        ("missing", "No such file"),
        ("wrong_size", "expected view_size (16, 12)"),
        ("transposed", "transpose"),
        ("rgb", "'RGB'"),
        ("volume", "(16, 12, 3)"),
        ("jpeg", "'.jpg'"),
    ],
)
def test_read_view_errors_name_the_file(tmp_path, kind, text):
    files = bad_files(tmp_path)
    path = files.get(kind, str(tmp_path / "missing.png"))
    with pytest.raises(ValueError) as info:
        read_view(path, (16, 12))
    assert path in str(info.value) and text in str(info.value)


def test_read_view_rejects_non_finite_values(tmp_path):
    p = line_integrals((16, 12))
    p[3, 3] = np.nan
    path = str(save_view_nifti(tmp_path / "nan.nii", p))
    with pytest.raises(ValueError, match="NaN") as info:
        read_view(path, (16, 12))
    assert path in str(info.value)


def test_check_view_files_lists_every_problem(tmp_path):
    files = bad_files(tmp_path)
    keys = ["xray_ap", "xray_lateral"]
    missing = str(tmp_path / "missing.png")
    good = files["good"]
    sections = {
        "training": [
            {"case_id": "c0", "xray_ap": good, "xray_lateral": good},
            {"case_id": "c1", "xray_ap": good},
            {"xray_ap": missing, "xray_lateral": good},
            {"xray_ap": files["wrong_size"], "xray_lateral": files["transposed"]},
        ],
        "validation": [{"xray_ap": files["rgb"], "xray_lateral": files["volume"]}],
    }
    with pytest.raises(PreflightError) as info:
        check_view_files(sections, keys, (16, 12))
    err = info.value
    assert len(err.problems) == 6
    assert not any(good in line for line in err.problems)  # the good files are fine
    expected = [  # (fragments of one problem line): the entry, the file or key and the problem
        ("training[1]", "c1", "missing 'xray_lateral'"),
        ("training[2]", missing, "does not exist"),
        ("training[3]", files["wrong_size"], "(16, 16)"),
        ("training[3]", files["transposed"], "transpose"),
        ("validation[0]", files["rgb"], "'RGB'"),
        ("validation[0]", files["volume"], "(16, 12, 3)"),
    ]
    text = str(err)
    for fragments in expected:
        assert any(all(f in line for f in fragments) for line in text.splitlines()), (fragments, text)
    check_view_files({"training": sections["training"][:1]}, keys, (16, 12))  # a clean section passes


def test_check_view_files_resolves_relative_paths(tmp_path):
    save_view_png(tmp_path / "views" / "a_ap.png", line_integrals((16, 12)))
    save_view_nifti(tmp_path / "views" / "a_lateral.nii", line_integrals((16, 12)))
    entry = {"case_id": "a", "xray_ap": "views/a_ap.png", "xray_lateral": "views/a_lateral.nii"}
    checked = check_view_files({"testing": [entry]}, ["xray_ap", "xray_lateral"], (16, 12), base_dir=tmp_path)
    assert checked == {
        "testing": [
            {
                "case_id": "a",
                "xray_ap": os.path.join(str(tmp_path), "views/a_ap.png"),
                "xray_lateral": os.path.join(str(tmp_path), "views/a_lateral.nii"),
            }
        ]
    }
    assert entry["xray_ap"] == "views/a_ap.png"  # the input entries are not modified
    with pytest.raises(PreflightError, match="does not exist"):  # without base_dir: relative to the cwd
        check_view_files({"testing": [entry]}, ["xray_ap", "xray_lateral"], (16, 12))


def test_transforms_read_view_files_without_the_ct(tmp_path):
    proj = projector((16, 12))
    ap, lateral = line_integrals((16, 12), seed=3), line_integrals((16, 12), seed=4)
    entry = {
        "case_id": "p007",
        "xray_ap": str(save_view_png(tmp_path / "p007_ap.png", ap)),
        "xray_lateral": str(save_view_nifti(tmp_path / "p007_lateral.nii.gz", lateral)),
    }
    assert view_keys(proj) == ["xray_ap", "xray_lateral"]
    out = xray2ct_transforms(proj, (8, 8, 8), with_image=False, view_files=True)(entry)
    assert "image" not in out and "xray_ap" not in out and "xray_lateral" not in out
    xray = out["xray"]
    assert xray.shape == (2, 16, 12) and xray.dtype == torch.float32
    assert xray.meta["case_id"] == "p007"
    np.testing.assert_allclose(xray[0].numpy(), ap, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(xray[1].numpy(), lateral)


def test_view_files_replace_the_projector_xrays(tmp_path, case):
    proj = projector()
    views = {
        key: str(save_view_nifti(tmp_path / f"{key}.nii", line_integrals((SIDE, SIDE), seed=i)))
        for i, key in enumerate(view_keys(proj))
    }
    out = xray2ct_transforms(proj, (SIDE, SIDE, SIDE), view_files=True)({**case, **views})
    assert out["image"].shape == (1, SIDE, SIDE, SIDE)
    for i in range(2):
        np.testing.assert_array_equal(out["xray"][i].numpy(), line_integrals((SIDE, SIDE), seed=i))
    drr = proj.xrays(out["image"].as_tensor()[None])[0]
    assert not torch.allclose(out["xray"].as_tensor(), drr)


def test_dicom_series_and_nifti_of_one_ct_give_the_same_stage_data(tmp_path):
    """A CT stored as a DICOM series folder (e.g. LIDC-IDRI) loads like the same CT as NIfTI: same volume and
    X-rays after resampling to the projector's field of view (DICOM stores HU as integers)."""
    from common.data.io import write_nifti
    from common.demo.images import make_ct_phantom, write_dicom_series

    hu = np.round(make_ct_phantom((24, 24, 20), seed=3))
    spacing = (FOV / 24, FOV / 24, FOV / 20)
    nifti = write_nifti(tmp_path / "ct.nii.gz", hu.astype(np.float32), np.diag([*spacing, 1.0]))
    dicom = write_dicom_series(tmp_path / "ct_dicom", hu, spacing)
    transform = xray2ct_transforms(projector(), (SIDE, SIDE, SIDE))
    a, b = transform({"image": str(nifti)}), transform({"image": str(dicom)})
    assert a["image"].shape == b["image"].shape == (1, SIDE, SIDE, SIDE)
    torch.testing.assert_close(b["image"].as_tensor(), a["image"].as_tensor(), atol=2e-3, rtol=0)
    torch.testing.assert_close(b["xray"].as_tensor(), a["xray"].as_tensor(), atol=2e-3, rtol=0)


# ---------------------------------------------------------------------------------------------- bundle helpers
def test_make_demo_data_writes_only_when_enabled(tmp_path):
    """``common.bundle.make_demo_data`` (the bundles' ``demo`` component) calls the generator only when enabled."""
    from common.bundle import make_demo_data
    from common.errors import MissingInputError

    missing = "common.demo.not_a_module.make"
    assert make_demo_data(missing, enabled=False, output_dir=str(tmp_path)) is None
    with pytest.raises(MissingInputError, match="demo data was requested"):
        make_demo_data(missing, output_dir=str(tmp_path))
    datalist = make_demo_data(
        "common.demo.images.make_xray2ct_demo", output_dir=str(tmp_path), n_train=1, n_val=1, shape=(8, 8, 8)
    )
    assert {k: len(v) for k, v in json.loads(datalist.read_text()).items()} == {"training": 1, "validation": 1}


def test_grid_spacing_spans_the_field_of_view():
    proj = DRRProjector(fov_mm=(160.0, 200.0, 240.0), view_size=(SIDE, SIDE))
    assert grid_spacing(proj, (16, 20, 12)) == [10.0, 10.0, 20.0]


def test_screen_inputs_of_ct_and_xray_files(case, tmp_path):
    """CT entries are screened by their headers (a missing volume is a problem of its entry); X-ray entries by
    their files (each problem names the view's key); a usable entry has no problem."""
    proj = projector()
    assert screen_inputs([{"image": case["image"], "case_id": "c0"}], proj, view_files=False) == [[]]
    assert screen_inputs([{"image": str(tmp_path / "none.nii.gz")}], proj, view_files=False) == [["does not exist"]]
    views = {
        k: str(save_view_nifti(tmp_path / f"c0_{k}.nii.gz", line_integrals((SIDE, SIDE)))) for k in view_keys(proj)
    }
    bad = {**views, "xray_lateral": str(tmp_path / "none.png")}
    problems = screen_inputs([views, bad], proj, view_files=True)
    assert problems[0] == [] and len(problems[1]) == 1 and problems[1][0].startswith("xray_lateral")


# ---------------------------------------------------------------------------------------------- X-ray conditions
def conditioned(condition, volume=None, case="c1", view_size=(SIDE, SIDE), **projector_settings):
    from monai.data import MetaTensor

    from common.xray2ct.data import DRRd, XrayConditiond

    proj = DRRProjector(fov_mm=FOV, view_size=view_size, **projector_settings)
    if volume is None:
        volume = torch.rand((1, SIDE, SIDE, SIDE), generator=torch.Generator().manual_seed(0)) * 1.6 - 0.8
    item = DRRd("image", proj)({"image": MetaTensor(volume, meta={"case_id": case})})
    return item["xray"], XrayConditiond("image", proj, condition)(item)["xray"]


@pytest.mark.parametrize(
    "condition", [None, {}, {"seed": 3, "photons": None, "gain": 1.0, "hardening": 0, "scatter": 0}]
)
def test_a_clean_condition_leaves_the_xrays_alone(condition):
    clean, out = conditioned(condition)
    torch.testing.assert_close(out, clean, rtol=0, atol=2e-6)


def test_miscalibration_is_the_flat_field_formula():
    clean, out = conditioned({"gain": 1.1, "offset": 0.02})
    torch.testing.assert_close(out, -torch.log(1.1 * torch.exp(-clean) + 0.02), rtol=0, atol=1e-5)


def test_beam_hardening_and_scatter_are_their_formulas_and_bend_the_measured_line_integral():
    """Two energies attenuated ``1 -+ h`` times the nominal, in equal parts; scatter adds ``s`` times the view's mean
    transmission. Both bend the measured line integral below the nominal one, more the longer the path."""
    clean, hardened = conditioned({"hardening": 0.3})
    expected = -torch.log((torch.exp(-0.7 * clean) + torch.exp(-1.3 * clean)) / 2)
    torch.testing.assert_close(hardened, expected, rtol=0, atol=1e-5)
    _, scattered = conditioned({"scatter": 0.1})
    transmitted = torch.exp(-clean)
    torch.testing.assert_close(
        scattered, -torch.log(transmitted + 0.1 * transmitted.mean(dim=(-2, -1), keepdim=True)), rtol=0, atol=1e-5
    )
    for bent in (hardened, scattered):
        deficit = (clean - bent).flatten()
        assert bool((deficit > -1e-6).all())
        longest, shortest = clean.flatten().argmax(), clean.flatten().argmin()
        assert float(deficit[longest]) > float(deficit[shortest])


def test_photon_noise_has_the_poisson_spread_and_is_seeded_per_case():
    """Counts ~ Poisson(N exp(-p)): ``p`` keeps its mean and spreads by ``1 / sqrt(N exp(-p))`` (delta method)."""
    flat = torch.full((1, SIDE, SIDE, SIDE), -0.5)  # every ray sees the same line integral
    photons = 2e4
    clean, out = conditioned({"photons": photons}, flat, view_size=(64, 64))
    p = float(clean.mean())
    expected = 1 / np.sqrt(photons * np.exp(-p))
    assert float((out - clean).mean()) == pytest.approx(0.0, abs=4 * expected / 64)
    assert float((out - clean).std()) == pytest.approx(expected, rel=0.08)
    _, again = conditioned({"photons": photons}, flat, view_size=(64, 64))
    _, other_case = conditioned({"photons": photons}, flat, case="c2", view_size=(64, 64))
    _, other_seed = conditioned({"photons": photons, "seed": 1}, flat, view_size=(64, 64))
    assert torch.equal(out, again) and not torch.equal(out, other_case) and not torch.equal(out, other_seed)


def test_detector_blur_spreads_a_point_by_its_sigma_and_keeps_flat_fields_flat():
    from common.xray2ct.data import XrayConditiond

    proj = DRRProjector(fov_mm=FOV, view_size=(64, 64))
    pixel = FOV / 64
    xray = torch.full((2, 64, 64), 2.0)
    xray[:, 32, 32] = 0.0  # one bright ray: transmission 1 against exp(-2)
    blurred = XrayConditiond("image", proj, {"blur_mm": 2 * pixel})({"image": torch.zeros(1, 8, 8, 8), "xray": xray})
    transmitted = torch.exp(-blurred["xray"][0]).double() - np.exp(-2.0)
    assert float(transmitted.sum()) == pytest.approx(1 - np.exp(-2.0), rel=1e-3)  # energy kept
    rows = torch.arange(64, dtype=torch.float64) - 32
    variance = float((transmitted.sum(1) * rows**2).sum() / transmitted.sum())
    assert variance == pytest.approx(4.0, rel=0.05)  # sigma 2 pixels
    # the edges are not darkened: a uniform image stays uniform
    flat = XrayConditiond("image", proj, {"blur_mm": 5.0})({"image": torch.zeros(1, 8, 8, 8), "xray": xray * 0 + 1})
    torch.testing.assert_close(flat["xray"], torch.ones_like(xray), rtol=0, atol=1e-5)


def test_a_pose_shift_of_one_voxel_shifts_the_ap_view_by_one_pixel():
    volume = torch.full((1, SIDE, SIDE, SIDE), -1.0)
    volume[:, 5:9, 6:10, 4:12] = 0.5
    clean, out = conditioned({"shift_mm": [FOV / SIDE, 0.0, 0.0]}, volume)
    # AP (channel 0) images (X, Z): moved by one row; lateral (Y, Z) integrates along X: unchanged
    torch.testing.assert_close(out[0, 1:], clean[0, :-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], clean[1], rtol=0, atol=1e-5)
    _, rotated = conditioned({"rotation_deg": [0.0, 0.0, 2.0]}, volume)
    assert float((rotated - clean).abs().max()) > 0.01


def test_condition_settings_are_checked_with_every_problem_named():
    from common.xray2ct.data import XrayConditiond, condition_problems

    assert condition_problems(None) == condition_problems({"photons": 1e4, "rotation_deg": [1, 2, 0]}) == []
    problems = condition_problems(
        {"photons": 0, "hardening": 1.0, "scatter": -0.1, "gain": -1, "offset": 1.5, "shift_mm": [1, 2], "dose": 3}
    )
    known = "['blur_mm', 'gain', 'hardening', 'offset', 'photons', 'rotation_deg', 'scatter', 'seed', 'shift_mm']"
    assert problems[0] == f"'xray_condition' has unknown key(s) ['dose']; known: {known}."
    assert [p.split("'")[3] for p in problems[1:]] == ["photons", "hardening", "scatter", "gain", "offset", "shift_mm"]
    assert condition_problems("noisy") == [f"'xray_condition' must be null or a mapping of {known}, got 'noisy'."]
    with pytest.raises(ValueError, match="'blur_mm' must be a number >= 0"):
        XrayConditiond("image", projector(), {"blur_mm": -1.0})

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Demo data: the MNI152 demo set, phantoms and the NIfTI writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

import common.data.demo as demo
from common.data.datalist import load_datalist
from common.data.preflight import preflight


def _world_range(path: str, axis: int) -> tuple[float, float]:
    img = nib.load(path)
    corners = np.array([[0, 0, 0, 1], [*(np.array(img.shape[:3]) - 1), 1]], dtype=float).T
    world = (img.affine @ corners)[axis]
    return float(world.min()), float(world.max())


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("nibabel")
    try:
        demo.mni_template_paths()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("demo")
    demo.make_demo_dataset(out, spacing=(2.0, 2.0, 2.0))
    return out


def test_mni_template_paths_exist(demo_dir: Path) -> None:
    paths = demo.mni_template_paths()
    assert set(paths) == {"t1", "gm", "wm"}
    assert all(p.is_file() and p.name.endswith("_converted.nii.gz") for p in paths.values())
    assert "_gm_" in paths["gm"].name and "_wm_" in paths["wm"].name


def test_mni_template_paths_missing_nilearn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps nilearn"):
        demo.mni_template_paths()


def test_demo_dataset_volumes(demo_dir: Path) -> None:
    datalist = demo_dir / "datalist.json"
    raw = json.loads(datalist.read_text())
    assert all(not os.path.isabs(e["image"]) for e in raw["training"] + raw["validation"])
    training = load_datalist(datalist)
    validation = load_datalist(datalist, key="validation")
    assert len(training) >= 3 and len(validation) >= 1
    for entry in training + validation:
        img = nib.load(entry["image"])
        data = np.asarray(img.dataobj)
        assert entry["image"].endswith(".nii.gz") and img.get_data_dtype() == np.float32
        assert len(img.shape) == 3 and min(img.shape) >= 32, (entry, img.shape)
        assert np.isfinite(data).all() and data.max() > 50.0 and data.min() >= 0.0
        assert np.allclose(np.sqrt((img.affine[:3, :3] ** 2).sum(axis=0)), 2.0)
    preflight(datalist, patch_size=(32, 32, 32), allow_pad=False)


def test_demo_validation_is_disjoint_from_training(demo_dir: Path) -> None:
    datalist = demo_dir / "datalist.json"
    train_images = [e["image"] for e in load_datalist(datalist)]
    val_images = [e["image"] for e in load_datalist(datalist, key="validation")]
    t1_train = next(p for p in train_images if "mni_t1_" in p)
    t1_val = next(p for p in val_images if "mni_t1_" in p)
    axis = 2  # superior-inferior in the RAS templates
    train_lo, train_hi = _world_range(t1_train, axis)
    val_lo, val_hi = _world_range(t1_val, axis)
    assert val_hi < train_lo  # validation is the inferior block, entirely below the training block
    for path in train_images:
        assert _world_range(path, axis)[0] > val_hi
    for path in val_images:
        assert _world_range(path, axis)[1] < train_lo
    # the two blocks share the same in-plane grid
    assert _world_range(t1_train, 0) == _world_range(t1_val, 0)


def test_demo_dataset_is_not_rewritten(demo_dir: Path) -> None:
    datalist = demo_dir / "datalist.json"
    files = [datalist] + sorted((demo_dir / "images").iterdir())
    before = {p: p.stat().st_mtime_ns for p in files}
    assert demo.make_demo_dataset(demo_dir) == datalist
    assert {p: p.stat().st_mtime_ns for p in files} == before


def test_demo_dataset_rebuilds_when_an_image_is_missing(tmp_path: Path, demo_dir: Path) -> None:
    out = tmp_path / "copy"
    (out / "images").mkdir(parents=True)
    (out / "datalist.json").write_text((demo_dir / "datalist.json").read_text())
    for path in (demo_dir / "images").iterdir():
        (out / "images" / path.name).write_bytes(path.read_bytes())
    (out / "images" / "mni_t1_val.nii.gz").unlink()
    demo.make_demo_dataset(out)
    assert (out / "images" / "mni_t1_val.nii.gz").is_file()


def test_demo_rejects_bad_spacing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"spacing must be 3 positive numbers, got \[2, -1, 2\]"):
        demo.make_demo_dataset(tmp_path, spacing=[2, -1, 2])
    assert list(tmp_path.iterdir()) == []


def test_make_phantom_is_seeded_structured_and_bounded() -> None:
    a = demo.make_phantom((32, 32, 32), seed=3)
    b = demo.make_phantom((32, 32, 32), seed=3)
    c = demo.make_phantom((32, 32, 32), seed=4)
    assert a.dtype == np.float32 and a.shape == (32, 32, 32)
    assert np.array_equal(a, b) and not np.allclose(a, c)
    assert a.min() >= 0.0 and a.max() <= 1.0
    # structure: a bright interior and a dark border, not just noise
    assert a[12:20, 12:20, 12:20].mean() > 0.15 > a[:2].mean()
    assert a.std() > 0.1
    smooth = np.abs(np.diff(a, axis=0)).mean()
    assert smooth < 0.1  # neighbouring voxels are correlated
    with pytest.raises(ValueError, match="kind must be one of"):
        demo.make_phantom(kind="cubes")


def test_write_phantom_dataset(tmp_path: Path) -> None:
    datalist = demo.write_phantom_dataset(
        tmp_path / "ph", n_train=3, n_val=2, shape=(32, 24, 16), spacing=(1.5, 1.5, 2)
    )
    assert datalist == tmp_path / "ph" / "datalist.json"
    training, validation = load_datalist(datalist), load_datalist(datalist, key="validation")
    assert len(training) == 3 and len(validation) == 2
    arrays = []
    for entry in training + validation:
        img = nib.load(entry["image"])
        assert img.shape == (32, 24, 16)
        assert np.allclose(np.diag(img.affine)[:3], (1.5, 1.5, 2.0))
        arrays.append(np.asarray(img.dataobj))
    assert not np.allclose(arrays[0], arrays[-1])
    preflight(datalist, patch_size=(16, 16, 16), allow_pad=False)


def test_write_nifti_is_atomic_and_checks_suffix(tmp_path: Path) -> None:
    affine = np.diag([2.0, 3.0, 4.0, 1.0])
    affine[:3, 3] = [-10, 5, 7]
    path = demo.write_nifti(tmp_path / "sub" / "x.nii.gz", np.arange(24, dtype=np.float32).reshape(2, 3, 4), affine)
    img = nib.load(path)
    assert np.allclose(img.affine, affine) and np.array_equal(np.asarray(img.dataobj)[1, 2], np.arange(20, 24))
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["x.nii.gz"]
    with pytest.raises(ValueError, match="x.png"):
        demo.write_nifti(tmp_path / "x.png", np.zeros((2, 2, 2)))


def test_demo_cli_phantom(tmp_path: Path, repo_root: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    result = subprocess.run(
        [sys.executable, "-m", "common.data.demo", "--output_dir", str(tmp_path / "out"), "--phantom"],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "out" / "datalist.json")


def test_ct_phantom_has_chest_anatomy_in_hu() -> None:
    a = demo.make_ct_phantom((48, 48, 40), seed=3)
    assert a.dtype == np.float32 and a.shape == (48, 48, 40)
    np.testing.assert_array_equal(a, demo.make_ct_phantom((48, 48, 40), seed=3))
    assert not np.array_equal(a, demo.make_ct_phantom((48, 48, 40), seed=4))
    clean = demo.make_ct_phantom((48, 48, 40), seed=3, noise_hu=0.0)
    assert np.abs(clean[0, 0, :] + 1000).max() < 1  # air in the corner
    centre_slice = clean[:, :, 20]
    for hu, name in ((-850, "lung"), (40, "soft tissue"), (300, "contrast-filled vessels"), (-100, "fat")):
        assert np.sum(np.abs(centre_slice - hu) < 30) > 5, name
    # RAS: the spine (bone, > 200 HU) is posterior (low Y), the contrast-filled heart anterior of it
    bone_y = np.nonzero(clean[20:28, :, 20] > 200)[1]
    blood_y = np.nonzero(np.abs(clean[:, :, 5:20] - 300) < 30)[1]
    assert bone_y.size and blood_y.size and bone_y.mean() < blood_y.mean()


def test_dicom_series_round_trip_keeps_array_and_ras_affine(tmp_path: Path) -> None:
    from monai.transforms import LoadImage

    volume = demo.make_ct_phantom((20, 16, 12), seed=1)
    folder = demo.write_dicom_series(tmp_path / "series", volume, spacing=(0.8, 0.8, 2.5))
    assert len(list(folder.glob("*.dcm"))) == 12
    image = LoadImage(image_only=True)(str(folder))
    np.testing.assert_array_equal(image.numpy(), np.round(volume))
    np.testing.assert_allclose(image.affine.numpy(), np.diag([0.8, 0.8, 2.5, 1.0]), atol=1e-6)
    with pytest.raises(FileExistsError, match="already holds files"):
        demo.write_dicom_series(folder, volume)
    with pytest.raises(ValueError, match="3D"):
        demo.write_dicom_series(tmp_path / "flat", volume[0])


def test_write_phantom_dataset_ct_dicom(tmp_path: Path) -> None:
    datalist = demo.write_phantom_dataset(tmp_path, n_train=2, n_val=1, shape=(12, 12, 8), kind="ct", dicom=True)
    sections = json.loads(datalist.read_text())
    assert [e["image"] for e in sections["training"]] == ["images/phantom_train_000", "images/phantom_train_001"]
    assert len(list((tmp_path / "images" / "phantom_val_000").glob("*.dcm"))) == 8

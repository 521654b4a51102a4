# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The data side of the diffusion bundles: modalities stacked as channels in [-1, 1], labels, latent encoding,
case ids, saving samples on the input grid, unconditional generation inputs and inference inputs."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from torch import nn

from common.data.datalist import DatalistError, inference_entries
from common.data.formats import file_stem
from common.data.io import write_nifti
from common.data.pipeline import CaseMetad, case_name_formatter
from common.data.preflight import screen_entries
from common.diffusion.transforms import (
    CopyChannelsd,
    EncodeLatentd,
    generation_items,
    inference_inputs,
    keeps_values,
    sample_postprocessing,
)
from tests.oracles import diffusion_transforms

torch.set_num_threads(1)

SHAPE = (12, 14, 10)


# ---------------------------------------------------------------------------------------------- helpers
def _affine(spacing: float = 1.5, flip: bool = False) -> np.ndarray:
    """A non-identity affine; ``flip``: LPS-like (the first two axes point left and posterior)."""
    sign = -1.0 if flip else 1.0
    affine = np.diag([sign * spacing, sign * spacing, spacing, 1.0])
    affine[:3, 3] = [12.0, -30.0, 7.5]
    return affine


def _modalities(tmp_path: Path, affine: np.ndarray | None = None, shape=SHAPE, case: str = "case1") -> dict:
    """Two modalities with different contents and ranges; returns {key: (path, array)}."""
    rng = np.random.default_rng(0)
    coords = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"))
    t1 = (coords[0] * 7.0 + rng.uniform(0, 30, shape)).astype(np.float32)  # a gradient along the first axis
    t2 = (3000.0 - coords[2] * 150.0 + rng.normal(0, 200, shape)).astype(np.float32)  # another range and axis
    affine = _affine() if affine is None else affine
    return {
        key: (write_nifti(tmp_path / f"{case}-{key}.nii.gz", array, affine), array)
        for key, array in (("t1", t1), ("t2", t2))
    }


def _mri_normalised(array: np.ndarray, lower: float = 0.5, upper: float = 99.5) -> np.ndarray:
    lo, hi = np.percentile(array, [lower, upper])
    return np.clip((array - lo) / (hi - lo), 0.0, 1.0)


def _expected_channel(array: np.ndarray, size=(16, 16, 16)) -> np.ndarray:
    """``[-1, 1]`` percentile normalisation, then symmetric padding with -1 to ``size``."""
    pad = [((s - a) // 2, s - a - (s - a) // 2) for a, s in zip(array.shape, size)]
    return np.pad(_mri_normalised(array) * 2 - 1, pad, constant_values=-1.0)


def _entry(files: dict, **extra) -> dict:
    return {key: str(path) for key, (path, _) in files.items()} | extra


class _PoolCodec(nn.Module):
    """A stand-in latent codec: 2x2x2 block means."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.0))
        self.downsample = [2, 2, 2]
        self.calls = 0

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert image.ndim == 5 and not isinstance(image, MetaTensor)
        return F.avg_pool3d(image, 2)


def _contains(volume: torch.Tensor, block: torch.Tensor) -> bool:
    """Whether ``block`` is a spatial crop of ``volume`` (all channels)."""
    for start in itertools.product(*[range(v - b + 1) for v, b in zip(volume.shape[1:], block.shape[1:])]):
        window = volume[(slice(None), *[slice(s, s + b) for s, b in zip(start, block.shape[1:])])]
        if torch.equal(window, block):
            return True
    return False


# ---------------------------------------------------------------------------------------------- stacking and intensity
def test_keys_are_stacked_in_order_and_normalised_per_channel(tmp_path):
    files = _modalities(tmp_path)
    data = diffusion_transforms(["t1", "t2"], patch_size=(16, 16, 16), train=False)(_entry(files))
    image = data["image"]
    assert isinstance(image, MetaTensor)
    assert image.shape == (2, 16, 16, 16)
    assert "t1" not in data and "t2" not in data
    for c, key in enumerate(["t1", "t2"]):
        np.testing.assert_allclose(image[c].numpy(), _expected_channel(files[key][1]), atol=1e-5)
        assert image[c].min().item() == -1.0 and image[c].max().item() == pytest.approx(1.0)
    expected_affine = _affine()  # RAS already: no reorientation; the origin moves by the padding (2, 1, 3)
    expected_affine[:3, 3] -= 1.5 * np.array([2, 1, 3])
    np.testing.assert_allclose(image.affine.numpy(), expected_affine, atol=1e-6)
    swapped = diffusion_transforms(["t2", "t1"], patch_size=(16, 16, 16), train=False)(_entry(files))["image"]
    torch.testing.assert_close(swapped.as_tensor(), image.as_tensor().flip(0))


def test_padding_to_a_multiple_is_exactly_minus_one(tmp_path):
    files = _modalities(tmp_path)
    data = diffusion_transforms(["t1", "t2"], patch_size=None, divisible_by=8, train=False)(_entry(files))
    image = data["image"]
    assert image.shape == (2, 16, 16, 16)
    # 12 -> 16 (2 + 2), 14 -> 16 (1 + 1), 10 -> 16 (3 + 3)
    inside = image[:, 2:14, 1:15, 3:13]
    mask = torch.ones(image.shape, dtype=torch.bool)
    mask[:, 2:14, 1:15, 3:13] = False
    assert torch.all(image[mask] == -1.0)
    for c, key in enumerate(["t1", "t2"]):
        np.testing.assert_allclose(inside[c].numpy(), _mri_normalised(files[key][1]) * 2 - 1, atol=1e-5)


def test_ct_window_per_channel(tmp_path):
    array = np.linspace(-1500, 1500, int(np.prod(SHAPE)), dtype=np.float32).reshape(SHAPE)
    path = write_nifti(tmp_path / "ct.nii.gz", array, _affine())
    intensity = {"mode": "ct", "a_min": -1000, "a_max": 1000}
    image = diffusion_transforms(["ct"], intensity=intensity, divisible_by=4, train=False)({"ct": str(path)})["image"]
    assert image.shape == (1, 12, 16, 12)
    expected = np.pad(np.clip(array, -1000, 1000) / 1000, [(0, 0), (1, 1), (1, 1)], constant_values=-1)
    np.testing.assert_allclose(image[0].numpy(), expected, atol=1e-5)


def test_label_channels_are_copied(tmp_path):
    files = _modalities(tmp_path)
    data = diffusion_transforms(["t1", "t2"], patch_size=(16, 16, 16), train=False, label_channels=[1])(_entry(files))
    assert data["label"].shape == (1, 16, 16, 16)
    torch.testing.assert_close(data["label"].as_tensor(), data["image"][1:2].as_tensor())
    both = diffusion_transforms(["t1", "t2"], patch_size=(16, 16, 16), train=False, label_channels=[1, 0])(
        _entry(files)
    )
    torch.testing.assert_close(both["label"].as_tensor(), data["image"].as_tensor().flip(0))
    assert "label" not in diffusion_transforms(["t1", "t2"], patch_size=(16, 16, 16), train=False)(_entry(files))


def test_copy_channels_makes_a_copy():
    image = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 2, 2, 2)
    out = CopyChannelsd("image", [2, 0], name="target")({"image": image})
    torch.testing.assert_close(out["target"], image[[2, 0]])
    out["target"].fill_(-5)
    assert image.min() == 0  # the source is untouched


def test_training_crops_of_the_patch_size(tmp_path):
    files = _modalities(tmp_path, shape=(20, 20, 20))
    crops = diffusion_transforms(["t1", "t2"], patch_size=(12, 12, 12), num_samples=3, train=True)(_entry(files))
    full = diffusion_transforms(["t1", "t2"], patch_size=(12, 12, 12), train=False)(_entry(files))["image"]
    assert len(crops) == 3
    for crop in crops:
        assert crop["image"].shape == (2, 12, 12, 12)
        assert _contains(full.as_tensor(), torch.as_tensor(crop["image"]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one image key"):
        diffusion_transforms([], patch_size=(16, 16, 16))
    with pytest.raises(ValueError, match="patch_size is required"):
        diffusion_transforms(["t1"], patch_size=None, train=True)


# ---------------------------------------------------------------------------------------------- latent mode
def test_latent_mode_encodes_the_image_and_keeps_the_label(tmp_path):
    files = _modalities(tmp_path)
    plain = diffusion_transforms(["t1", "t2"], patch_size=(16, 16, 16), train=False, label_channels=[1])
    codec = _PoolCodec()
    latent = diffusion_transforms(
        ["t1", "t2"], patch_size=(16, 16, 16), train=False, label_channels=[1], latent_codec=codec
    )
    reference = plain(_entry(files, case_id="c9"))
    data = latent(_entry(files, case_id="c9"))
    assert codec.calls == 1
    image = data["image"]
    assert isinstance(image, MetaTensor)
    assert image.shape == (2, 8, 8, 8)
    torch.testing.assert_close(image.as_tensor(), F.avg_pool3d(reference["image"].as_tensor()[None], 2)[0])
    torch.testing.assert_close(data["label"].as_tensor(), reference["label"].as_tensor())  # image space
    assert image.meta["case_id"] == "c9"
    np.testing.assert_allclose(image.affine.numpy(), reference["image"].affine.numpy())
    assert [op["class"] for op in image.applied_operations] == [
        op["class"] for op in reference["image"].applied_operations
    ]


def test_latent_training_crops_have_the_latent_patch_size(tmp_path):
    files = _modalities(tmp_path, shape=(20, 20, 20))
    codec = _PoolCodec()
    kwargs = dict(patch_size=(12, 12, 12), divisible_by=4, label_channels=[0], latent_codec=codec)
    crops = diffusion_transforms(["t1", "t2"], num_samples=3, train=True, **kwargs)(_entry(files))
    full = diffusion_transforms(["t1", "t2"], train=False, **kwargs)(_entry(files))
    assert full["image"].shape == (2, 10, 10, 10)
    assert len(crops) == 3
    for crop in crops:
        assert crop["image"].shape == (2, 6, 6, 6)  # patch_size // downsample
        assert _contains(full["image"].as_tensor(), torch.as_tensor(crop["image"]))
        assert crop["label"].shape == (1, 20, 20, 20)  # the label stays in image space, uncropped
        torch.testing.assert_close(torch.as_tensor(crop["label"]), full["label"].as_tensor())


def test_encode_latentd_on_a_plain_tensor():
    image = torch.rand(2, 4, 4, 4)
    out = EncodeLatentd("image", _PoolCodec())({"image": image, "other": 1})
    assert not isinstance(out["image"], MetaTensor)
    torch.testing.assert_close(out["image"], F.avg_pool3d(image[None], 2)[0])
    assert out["other"] == 1


# ---------------------------------------------------------------------------------------------- case ids and names
def test_case_id_is_kept_in_the_metadata(tmp_path):
    files = _modalities(tmp_path, case="BraTS-00012")
    transforms = diffusion_transforms(["t1", "t2"], patch_size=(16, 16, 16), train=False)
    assert transforms(_entry(files, case_id="patient 7"))["image"].meta["case_id"] == "patient 7"
    assert transforms(_entry(files))["image"].meta["case_id"] == "BraTS-00012-t1"  # stem of the first key's file


def test_case_metad():
    image = MetaTensor(torch.zeros(1, 2, 2, 2), meta={"filename_or_obj": "/data/scan_03.nii.gz"})
    out = CaseMetad("image")({"image": image})
    assert out["image"].meta["case_id"] == "scan_03"
    out = CaseMetad(["image", "plain"], case_key="subject")({"image": image, "plain": torch.zeros(1), "subject": 42})
    assert out["image"].meta["subject"] == "42"
    assert not hasattr(out["plain"], "meta")


def test_case_name_formatter():
    meta = {"filename_or_obj": "/data/scan_03.nii.gz", "case_id": "c1"}
    assert case_name_formatter(meta, None)["subject"] == "c1"
    assert case_name_formatter({"filename_or_obj": "/data/scan_03.nii.gz"}, None)["subject"] == "/data/scan_03.nii.gz"


# ---------------------------------------------------------------------------------------------- saving samples
def _sample_for(data: dict, channel: int) -> MetaTensor:
    """What the evaluator returns for one input: the sample in [0, 1] with the metadata and history of image."""
    image = data["image"]
    return MetaTensor(
        (image[channel : channel + 1].as_tensor() + 1) / 2, meta=image.meta, applied_operations=image.applied_operations
    )


def test_sample_is_saved_on_the_source_grid(tmp_path):
    affine = _affine(flip=True)  # LPS: reoriented to RAS by the preprocessing
    files = _modalities(tmp_path, affine=affine)
    preprocessing = diffusion_transforms(["t1", "t2"], patch_size=(16, 16, 16), divisible_by=8, train=False)
    data = preprocessing(_entry(files, case_id="BraTS-7"))
    assert data["image"].shape == (2, 16, 16, 16)
    assert data["image"].affine[0, 0] > 0  # RAS now
    data["pred"] = _sample_for(data, 1)
    sample_postprocessing(preprocessing, str(tmp_path / "out"), "t2")(data)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["BraTS-7_t2.nii.gz"]
    saved = nib.load(tmp_path / "out" / "BraTS-7_t2.nii.gz")
    assert saved.shape == SHAPE
    np.testing.assert_allclose(saved.affine, affine, atol=1e-5)
    np.testing.assert_allclose(np.asarray(saved.dataobj), _mri_normalised(files["t2"][1]), atol=1e-5)


def test_latent_mode_sample_is_saved_on_the_source_grid(tmp_path):
    """In latent mode ``image`` is the latent; the decoded sample (image space) carries its metadata and history."""
    affine = _affine(flip=True)
    files = _modalities(tmp_path, affine=affine)
    preprocessing = diffusion_transforms(
        ["t1", "t2"], patch_size=(16, 16, 16), train=False, label_channels=[0], latent_codec=_PoolCodec()
    )
    data = preprocessing(_entry(files, case_id="lat"))
    assert data["image"].shape == (2, 8, 8, 8)
    decoded = (data["label"].as_tensor() + 1) / 2  # stands for the decoded sample of the target channel
    data["pred"] = MetaTensor(decoded, meta=data["image"].meta, applied_operations=data["image"].applied_operations)
    sample_postprocessing(preprocessing, str(tmp_path / "out"), "t1")(data)
    saved = nib.load(tmp_path / "out" / "lat_t1.nii.gz")
    assert saved.shape == SHAPE
    np.testing.assert_allclose(saved.affine, affine, atol=1e-5)
    np.testing.assert_allclose(np.asarray(saved.dataobj), _mri_normalised(files["t1"][1]), atol=1e-5)


def test_sample_without_case_id_is_named_by_the_file(tmp_path):
    files = _modalities(tmp_path)
    preprocessing = diffusion_transforms(["t1"], patch_size=(16, 16, 16), train=False)
    data = preprocessing({"t1": str(files["t1"][0])})
    data["pred"] = _sample_for(data, 0)
    sample_postprocessing(preprocessing, str(tmp_path / "out"), "gen")(data)
    saved = nib.load(tmp_path / "out" / "case1-t1_gen.nii.gz")
    assert saved.shape == SHAPE
    np.testing.assert_allclose(np.asarray(saved.dataobj), _mri_normalised(files["t1"][1]), atol=1e-5)


def test_ct_sample_is_saved_in_hounsfield_units(tmp_path):
    array = np.linspace(-1500, 1500, int(np.prod(SHAPE)), dtype=np.float32).reshape(SHAPE)
    affine = _affine(spacing=2.0, flip=True)
    path = write_nifti(tmp_path / "ct7.nii.gz", array, affine)
    intensity = {"mode": "ct", "a_min": -1000, "a_max": 1000}
    preprocessing = diffusion_transforms(["ct"], intensity=intensity, patch_size=(16, 16, 16), train=False)
    data = preprocessing({"ct": str(path), "case_id": "ct7"})
    data["pred"] = _sample_for(data, 0)
    sample_postprocessing(preprocessing, str(tmp_path / "out"), "ct", intensity=intensity)(data)
    saved = nib.load(tmp_path / "out" / "ct7_ct.nii.gz")
    assert saved.shape == SHAPE
    np.testing.assert_allclose(saved.affine, affine, atol=1e-5)
    np.testing.assert_allclose(np.asarray(saved.dataobj), np.clip(array, -1000, 1000), atol=0.05)


# ---------------------------------------------------------------------------------------------- generation
def test_generation_items():
    items = generation_items(3, [8, 6, 4], spacing=[1.5, 2.0, 2.5], channels=2)
    assert [item["case_id"] for item in items] == ["sample_000", "sample_001", "sample_002"]
    for item in items:
        image = item["image"]
        assert isinstance(image, MetaTensor)
        assert image.shape == (2, 8, 6, 4)
        assert image.meta["case_id"] == item["case_id"]
        np.testing.assert_allclose(image.affine.numpy(), np.diag([1.5, 2.0, 2.5, 1.0]))
    items[0]["image"].affine[0, 0] = 9.0  # every item has its own affine
    assert items[1]["image"].affine[0, 0] == 1.5
    default = generation_items(1, (4, 4, 4), prefix="gen")
    assert default[0]["case_id"] == "gen_000"
    np.testing.assert_allclose(default[0]["image"].affine.numpy(), np.eye(4))


def test_generated_sample_is_saved_with_the_generation_affine(tmp_path):
    item = generation_items(2, (8, 6, 4), spacing=(1.5, 2.0, 2.5))[1]
    sample = torch.rand(1, 8, 6, 4, generator=torch.Generator().manual_seed(0))
    data = {"image": item["image"], "pred": MetaTensor(sample, meta=item["image"].meta)}
    sample_postprocessing(None, str(tmp_path), "t1")(data)
    saved = nib.load(tmp_path / "sample_001_t1.nii.gz")
    assert saved.shape == (8, 6, 4)
    np.testing.assert_allclose(saved.affine, np.diag([1.5, 2.0, 2.5, 1.0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(saved.dataobj), sample[0].numpy(), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_volumes=0, shape=(4, 4, 4)), "'num_samples'"),
        (dict(num_volumes=True, shape=(4, 4, 4)), "'num_samples'"),
        (dict(num_volumes=2, shape=(4, 4)), "'sample_shape'"),
        (dict(num_volumes=2, shape=(4, 0, 4)), "'sample_shape'"),
        (dict(num_volumes=2, shape=(4, 4, 4), spacing=(1.0, -1.0, 1.0)), "'spacing'"),
        (dict(num_volumes=2, shape=(4, 4, 4), spacing=(1.0, 1.0)), "'spacing'"),
    ],
)
def test_generation_items_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generation_items(**kwargs)


# ---------------------------------------------------------------------------------------------- inference entries
def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize(
    "path, stem",
    [
        ("/a/b/case1.nii.gz", "case1"),
        ("case2.NII.GZ", "case2"),
        ("x/case3.nii", "case3"),
        ("case4.nrrd", "case4"),
        ("case5.mha", "case5"),
        ("dicom/series6/", "series6"),
        ("notes.txt", "notes.txt"),
        (Path("/a/b.c/d.nii.gz"), "d"),
    ],
)
def test_file_stem(path, stem):
    assert file_stem(path) == stem


def test_inference_entries_from_a_datalist(tmp_path):
    data_dir = tmp_path / "data"
    datalist = {
        "testing": [
            {"t1": "imgs/a_t1.nii.gz", "t2": "imgs/a_t2.nii.gz"},
            {"t1": "/abs/b_t1.nii.gz", "t2": "imgs/b_t2.nii.gz", "case_id": "bee"},
        ],
        "training": [{"t1": "x.nii.gz", "t2": "y.nii.gz"}],
    }
    json_file = tmp_path / "lists" / "datalist.json"
    json_file.parent.mkdir()
    json_file.write_text(json.dumps(datalist))
    # relative paths: against the JSON file's folder (MONAI's convention), against dataset_dir for a dict
    for source, base in ((datalist, data_dir), (json_file, json_file.parent)):
        entries = inference_entries(data_dir, ["t1", "t2"], datalist=source)
        assert entries == [
            {"t1": str(base / "imgs" / "a_t1.nii.gz"), "t2": str(base / "imgs" / "a_t2.nii.gz"), "case_id": "a_t1"},
            {"t1": "/abs/b_t1.nii.gz", "t2": str(base / "imgs" / "b_t2.nii.gz"), "case_id": "bee"},
        ]
    other = inference_entries(data_dir, ["t1", "t2"], datalist=datalist, section="training")
    assert [e["case_id"] for e in other] == ["x"]
    with pytest.raises(DatalistError, match="'t2'"):
        inference_entries(data_dir, ["t1", "t2"], datalist={"testing": [{"t1": "a.nii.gz"}]})
    with pytest.raises(DatalistError, match="no section 'testing'"):
        inference_entries(data_dir, ["t1"], datalist={"training": [{"t1": "a.nii.gz"}]})


def test_inference_entries_from_a_glob(tmp_path):
    for name in ("b.nii.gz", "sub/a.nii", "sub/deeper/c.nii.gz", "notes.txt", "sub/d.mha"):
        _touch(tmp_path / name)
    entries = inference_entries(tmp_path, ["image"])
    assert [e["case_id"] for e in entries] == ["b", "a", "d", "c"]  # every volume format, sorted by path
    assert entries[1] == {"case_id": "a", "image": str((tmp_path / "sub" / "a.nii").absolute())}
    only = inference_entries(tmp_path, ["ct"], pattern="*.mha")
    assert only == [{"case_id": "d", "ct": str((tmp_path / "sub" / "d.mha").absolute())}]


def test_inference_entries_from_brats_folders(tmp_path):
    for case in ("BraTS-002", "BraTS-001"):
        for key in ("t1n", "t1c", "t2w", "seg"):  # the target t2f is absent
            _touch(tmp_path / "cases" / case / f"{case}-{key}.nii.gz")
    entries = inference_entries(tmp_path, ["t1n", "t1c", "t2w"])
    assert [e["case_id"] for e in entries] == ["BraTS-001", "BraTS-002"]
    folder = (tmp_path / "cases" / "BraTS-001").absolute()
    assert entries[0] == {
        "case_id": "BraTS-001",
        "t1n": str(folder / "BraTS-001-t1n.nii.gz"),
        "t1c": str(folder / "BraTS-001-t1c.nii.gz"),
        "t2w": str(folder / "BraTS-001-t2w.nii.gz"),
    }


def test_inference_entries_case_missing_a_source(tmp_path):
    for key in ("t1n", "t2w"):
        _touch(tmp_path / "BraTS-003" / f"BraTS-003-{key}.nii.gz")
    for key in ("t1n", "t1c", "t2w"):
        _touch(tmp_path / "BraTS-004" / f"BraTS-004-{key}.nii.gz")
    with pytest.raises(ValueError, match="BraTS-003.*BraTS-003-t1c.nii.gz") as info:
        inference_entries(tmp_path, ["t1n", "t1c", "t2w"])
    assert "BraTS-004" not in str(info.value)


def test_inference_entries_nothing_found(tmp_path):
    _touch(tmp_path / "notes.txt")
    with pytest.raises(FileNotFoundError, match=r"NIfTI \(\.nii, \.nii\.gz\).*DICOM series folders"):
        inference_entries(tmp_path, ["image"])
    with pytest.raises(FileNotFoundError, match=r"<case>/<case>-\{t1n,t2w\}\.nii\.gz"):
        inference_entries(tmp_path, ["t1n", "t2w"])
    with pytest.raises(FileNotFoundError):
        inference_entries(tmp_path / "missing", ["image"], pattern="*.nii.gz")
    with pytest.raises(ValueError, match="at least one input key"):
        inference_entries(tmp_path, [])


def test_keeps_values_only_for_intensity_mode_none():
    """train.json skips the mapping of [0, 1] to [-1, 1] exactly where ``diffusion_transforms`` does."""
    assert keeps_values({"mode": "none"}) and keeps_values({"mode": "None"})
    for intensity in (None, {}, {"mode": "mri"}, {"mode": "ct", "a_min": -1000, "a_max": 1000}):
        assert not keeps_values(intensity), intensity


def test_inference_inputs_generate_or_list_cases(tmp_path):
    """Unconditional generation makes empty volumes; otherwise the listed cases, with paths resolved against the
    dataset folder, unread (the run screens their headers: a missing source is a problem of its case)."""
    generated = inference_inputs("unconditional", str(tmp_path), [], num_samples=2, sample_shape=(8, 6, 4))
    assert [item["case_id"] for item in generated] == ["sample_000", "sample_001"]
    assert generated[0]["image"].shape == (1, 8, 6, 4)
    files = _modalities(tmp_path)
    datalist = {"testing": [{"t1": str(files["t1"][0]), "t2": str(files["t2"][0]), "case_id": "one"}]}
    cases = inference_inputs("translation", str(tmp_path), ["t1", "t2"], datalist=datalist)
    assert cases == datalist["testing"]
    gone = {"testing": [{"t1": "gone.nii.gz", "t2": str(files["t2"][0]), "case_id": "a"}]}
    listed = inference_inputs("translation", str(tmp_path), ["t1", "t2"], datalist=gone)
    assert listed[0]["t1"] == str(tmp_path / "gone.nii.gz")
    assert screen_entries(listed, keys=["t1", "t2"], num_channels=1) == [
        [f"t1 {tmp_path / 'gone.nii.gz'}: does not exist"]
    ]

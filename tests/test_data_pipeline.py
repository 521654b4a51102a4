# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the volume transforms, rank partitions, cached datasets, latent affines and inference postprocessing."""

from __future__ import annotations

import itertools

import nibabel as nib
import numpy as np
import pytest
import torch
from monai.data import CacheDataset, MetaTensor, SmartCacheDataset, ThreadDataLoader
from monai.transforms import Compose

from common.data.intensity import (
    InvertibleScaleIntensityRangePercentilesd,
    ScaleIntensityModed,
    intensity_transform,
    inverse_linear_scaling,
)
from common.data.io import write_nifti
from common.data.pipeline import (
    LatentAffined,
    cache_size,
    inference_postprocessing,
    make_loader,
    partition_for_rank,
)
from common.demo.images import make_phantom
from common.errors import UserError
from tests.oracles import make_dataset, volume_transforms


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _volume(tmp_path, shape=(20, 20, 20), affine=None, name="vol.nii.gz", seed=0):
    array = make_phantom(shape, seed=seed) * 1000.0 - 200.0  # not already in [0, 1]
    return write_nifti(tmp_path / name, array.astype(np.float32), affine), array


def _mri_normalised(array: np.ndarray, lower: float = 0.5, upper: float = 99.5) -> np.ndarray:
    lo, hi = np.percentile(array, [lower, upper])
    return np.clip((array - lo) / (hi - lo), 0.0, 1.0)


# ---------------------------------------------------------------------------------------------- intensity
def test_ct_window_maps_to_unit_range_with_clipping():
    transform = intensity_transform(["image"], {"mode": "ct", "a_min": -1000, "a_max": 1000})
    image = torch.tensor([[-3000.0, -1000.0, -500.0, 0.0, 1000.0, 2500.0]])
    out = transform({"image": image})["image"]
    torch.testing.assert_close(torch.as_tensor(out), torch.tensor([[0.0, 0.0, 0.25, 0.5, 1.0, 1.0]]))


def test_ct_default_window():
    transform = intensity_transform(["image"], {"mode": "CT"})
    out = transform({"image": torch.tensor([[-1000.0, 0.0, 1000.0]])})["image"]
    torch.testing.assert_close(torch.as_tensor(out), torch.tensor([[0.0, 0.5, 1.0]]))


def test_mri_percentiles():
    gen = torch.Generator().manual_seed(0)
    image = torch.randn(1, 10, 10, 10, generator=gen) * 50 + 300
    transform = intensity_transform(["image"], {"mode": "mri", "lower": 5, "upper": 95})
    out = torch.as_tensor(transform({"image": image})["image"]).numpy()
    np.testing.assert_allclose(out, _mri_normalised(image.numpy(), 5, 95), atol=1e-5)
    assert out.min() == 0.0 and out.max() == 1.0
    assert 0.04 <= (out == 0).mean() <= 0.06  # about the 5 % below the lower percentile are clipped


def test_default_is_mri_and_none_keeps_values():
    assert type(intensity_transform(["image"], {})).__name__ == "InvertibleScaleIntensityRangePercentilesd"
    assert type(intensity_transform(["image"], {}, invertible=False)).__name__ == "ScaleIntensityRangePercentilesd"
    assert intensity_transform(["image"], {"mode": "none"}) is None


@pytest.mark.parametrize(
    "intensity", [None, {"mode": "mri", "lower": 5, "upper": 95}, {"mode": "ct", "a_min": -100, "a_max": 300}]
)
def test_scale_intensity_mode_is_the_transform_of_the_setting(intensity):
    image = MetaTensor(torch.randn(1, 6, 6, 6, generator=torch.Generator().manual_seed(0)) * 200 + 100)
    step = ScaleIntensityModed("image", intensity)
    expected = intensity_transform(["image"], intensity or {"mode": "mri"})({"image": image.clone()})["image"]
    out = step({"image": image.clone()})["image"]
    assert torch.equal(out.as_tensor(), expected.as_tensor())
    restored = step.inverse({"image": out})["image"]  # percentiles are undone, a CT window is kept
    if intensity is None or intensity["mode"] == "mri":
        low, high = np.percentile(image.numpy(), [intensity["lower"], intensity["upper"]] if intensity else [0.5, 99.5])
        np.testing.assert_allclose(restored.numpy(), np.clip(image.numpy(), low, high), rtol=1e-4, atol=1e-3)
    else:
        assert torch.equal(restored.as_tensor(), out.as_tensor())
    assert not restored.applied_operations


def test_scale_intensity_mode_none_keeps_the_values():
    image = torch.arange(8.0).reshape(1, 2, 2, 2)
    step = ScaleIntensityModed(["image"], {"mode": "none"})
    assert step.transform is None
    assert step({"image": image})["image"] is image and step.inverse({"image": image})["image"] is image
    with pytest.raises(ValueError, match="mode must be 'ct', 'mri' or 'none'"):
        ScaleIntensityModed("image", {"mode": "pet"})


@pytest.mark.parametrize("channel_wise", [False, True])
@pytest.mark.parametrize("numel", ["small", "large"])  # MONAI's percentile switches to numpy above 1e6 values
def test_invertible_percentiles_are_bit_identical_to_monai(channel_wise, numel):
    shape = (2, 10, 11, 12) if numel == "small" else (1, 104, 100, 100)
    image = MetaTensor(torch.randn(*shape, generator=torch.Generator().manual_seed(3)) * 300 + 40)
    config = {"mode": "mri", "lower": 0.5, "upper": 99.5}
    plain = intensity_transform(["image"], config, channel_wise=channel_wise, invertible=False)
    recorded = intensity_transform(["image"], config, channel_wise=channel_wise)
    expected = plain({"image": image.clone()})["image"]
    out = recorded({"image": image.clone()})["image"]
    assert out.dtype == expected.dtype and torch.equal(out.as_tensor(), expected.as_tensor())
    info = out.applied_operations[-1]["extra_info"]
    values = image.as_tensor().numpy()
    per_channel = [values[c] for c in range(shape[0])] if channel_wise else [values]
    np.testing.assert_allclose(info["a_min"], [np.percentile(v, 0.5) for v in per_channel], rtol=1e-5)
    np.testing.assert_allclose(info["a_max"], [np.percentile(v, 99.5) for v in per_channel], rtol=1e-5)


def test_invertible_percentiles_inverse_is_the_closed_form():
    image = MetaTensor(torch.randn(2, 9, 10, 11, generator=torch.Generator().manual_seed(4)) * 200 - 50)
    transform = InvertibleScaleIntensityRangePercentilesd("image", 2.0, 98.0, b_min=0.0, b_max=1.0, clip=True)
    out = transform({"image": image.clone()})["image"]
    info = out.applied_operations[-1]["extra_info"]
    (low,), (high,) = info["a_min"], info["a_max"]
    # a prediction with values beyond [0, 1]: clipped to the range the normalisation produced, then mapped back
    pred = out.clone()
    pred[0, 0, 0, :3] = torch.tensor([-0.5, 0.25, 1.5])
    restored = transform.inverse({"image": pred})["image"]
    assert isinstance(restored, MetaTensor) and len(restored.applied_operations) == 0
    closed = np.clip(pred.as_tensor().numpy(), 0.0, 1.0) * (high - low) + low
    np.testing.assert_allclose(restored.numpy(), closed, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(restored[0, 0, 0, :3].numpy(), [low, low + 0.25 * (high - low), high], rtol=1e-6)
    # the input itself comes back inside the percentiles, clipped to them outside
    original = transform.inverse({"image": transform({"image": image.clone()})["image"]})["image"]
    np.testing.assert_allclose(original.numpy(), np.clip(image.numpy(), low, high), rtol=1e-5, atol=1e-3)


def test_inverse_linear_scaling_per_channel_and_constant_volumes():
    image = torch.tensor([[[[0.0, 0.5, 1.0]]], [[[0.0, 0.5, 1.0]]]])
    out = inverse_linear_scaling(image, [-100.0, 10.0], [100.0, 10.0], 0.0, 1.0, clip=True)
    # channel 1 had an empty range: MONAI shifted it by b_min - a_min, undone here
    torch.testing.assert_close(out, torch.tensor([[[[-100.0, 0.0, 100.0]]], [[[10.0, 10.5, 11.0]]]]))
    with pytest.raises(ValueError, match="2 channel"):
        inverse_linear_scaling(image[:1], [0.0, 1.0], [1.0, 2.0], 0.0, 1.0, clip=True)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"mode": "pet"}, "'pet'"),
        ({"mode": "ct", "a_min": 100, "a_max": -100}, "a_min=100.0 must be < a_max=-100.0"),
        ({"mode": "ct", "a_min": 5, "a_max": 5}, "a_min=5.0 must be < a_max=5.0"),
        ({"mode": "mri", "lower": 99, "upper": 1}, "got 99.0 and 1.0"),
        ({"mode": "mri", "lower": 0, "upper": 101}, "got 0.0 and 101.0"),
    ],
)
def test_bad_intensity_config_names_the_value(config, match):
    with pytest.raises(ValueError, match=match):
        intensity_transform(["image"], config)


# ---------------------------------------------------------------------------------------------- volume transforms
def test_training_transforms_crop_patches_of_the_normalised_volume(tmp_path):
    path, array = _volume(tmp_path)
    train = volume_transforms(patch_size=(16, 16, 16), num_samples=3, train=True)
    train.set_random_state(seed=0)
    samples = train({"image": str(path)})
    assert isinstance(samples, list) and len(samples) == 3
    full = _mri_normalised(array)
    for sample in samples:
        patch = sample["image"]
        assert isinstance(patch, torch.Tensor)
        assert patch.shape == (1, 16, 16, 16) and patch.dtype == torch.float32
        matches = [
            (i, j, k)
            for i, j, k in itertools.product(range(5), repeat=3)
            if np.allclose(patch[0].numpy(), full[i : i + 16, j : j + 16, k : k + 16], atol=1e-5)
        ]
        assert len(matches) == 1  # a window of the deterministic volume
    assert len({tuple(s["image"].flatten()[:50].tolist()) for s in samples}) > 1  # random positions


def test_training_transforms_pad_a_small_volume(tmp_path):
    path, _ = _volume(tmp_path, shape=(10, 12, 20))
    samples = volume_transforms(patch_size=(16, 16, 16), num_samples=2, train=True)({"image": str(path)})
    assert [tuple(s["image"].shape) for s in samples] == [(1, 16, 16, 16)] * 2


def test_validation_transforms_keep_the_padded_volume_with_meta(tmp_path):
    affine = np.diag([1.5, 1.5, 2.0, 1.0])
    affine[:3, 3] = [10.0, -20.0, 5.0]
    path, array = _volume(tmp_path, shape=(10, 12, 20), affine=affine)
    out = volume_transforms(patch_size=(16, 16, 16), train=False)({"image": str(path)})
    image = out["image"]
    assert isinstance(image, MetaTensor)
    assert image.shape == (1, 16, 16, 20)
    assert str(path) == str(image.meta["filename_or_obj"])
    # symmetric zero padding around the normalised volume
    np.testing.assert_allclose(image[0, 3:13, 2:14, :].numpy(), _mri_normalised(array), atol=1e-5)
    assert image[0, :3].abs().sum() == 0 and image[0, 13:].abs().sum() == 0 and image[0, :, :2].abs().sum() == 0
    # the affine follows the padding: voxel (3, 2, 0) of the padded grid is voxel (0, 0, 0) of the file
    np.testing.assert_allclose(
        image.affine.numpy() @ np.array([3, 2, 0, 1]), affine @ np.array([0, 0, 0, 1]), atol=1e-5
    )


def test_spacing_and_orientation(tmp_path):
    lps = np.diag([-1.0, -1.0, 1.0, 1.0])
    path, _ = _volume(tmp_path, shape=(20, 20, 20), affine=lps)
    out = volume_transforms(spacing=(2, 2, 2), orientation="RAS", patch_size=None, train=False)({"image": str(path)})
    image = out["image"]
    assert image.shape == (1, 10, 10, 10)
    np.testing.assert_allclose(np.diag(image.affine.numpy())[:3], [2.0, 2.0, 2.0])  # RAS, 2 mm


def test_training_transforms_need_a_patch_size():
    with pytest.raises(ValueError, match="patch_size is required"):
        volume_transforms(patch_size=None, train=True)


# ---------------------------------------------------------------------------------------------- partitions
def test_partition_single_process_returns_everything(single_process):
    data = [{"i": i} for i in range(5)]
    assert partition_for_rank(data) == data


@pytest.mark.parametrize("shuffle", [True, False])
def test_partitions_are_disjoint_equal_and_cover_the_data(single_process, shuffle):
    data = list(range(12))
    single_process.setenv("WORLD_SIZE", "3")
    parts = []
    for rank in range(3):
        single_process.setenv("RANK", str(rank))
        parts.append(partition_for_rank(data, shuffle=shuffle, seed=7))
    assert [len(p) for p in parts] == [4, 4, 4]
    assert sorted(itertools.chain(*parts)) == data
    # every rank computes the same split
    single_process.setenv("RANK", "1")
    assert partition_for_rank(data, shuffle=shuffle, seed=7) == parts[1]


def test_uneven_partitions(single_process):
    data = list(range(10))
    single_process.setenv("WORLD_SIZE", "3")
    even, uneven = [], []
    for rank in range(3):
        single_process.setenv("RANK", str(rank))
        even.append(partition_for_rank(data, seed=1))
        uneven.append(partition_for_rank(data, seed=1, even_divisible=False))
    assert [len(p) for p in even] == [4, 4, 4]  # a few items repeated so every rank takes the same steps
    assert set(itertools.chain(*even)) == set(data)
    assert sorted(len(p) for p in uneven) == [3, 3, 4]
    assert sorted(itertools.chain(*uneven)) == data


@pytest.mark.parametrize("even_divisible", [True, False])
def test_fewer_items_than_ranks_still_gives_every_rank_data(single_process, even_divisible):
    single_process.setenv("WORLD_SIZE", "4")
    parts = []
    for rank in range(4):
        single_process.setenv("RANK", str(rank))
        parts.append(partition_for_rank(["a", "b"], even_divisible=even_divisible))
    assert [len(p) for p in parts] == [1, 1, 1, 1]
    assert set(itertools.chain(*parts)) == {"a", "b"}
    with pytest.raises(ValueError, match="empty datalist"):
        partition_for_rank([])


# ---------------------------------------------------------------------------------------------- datasets
def _items(n: int = 10) -> list[dict]:
    return [{"image": torch.full((1, 2, 2, 2), float(i))} for i in range(n)]


def test_make_dataset_caches_everything_by_default(single_process):
    dataset = make_dataset(_items(), Compose([]))
    assert type(dataset) is CacheDataset and len(dataset) == 10
    assert dataset[3]["image"][0, 0, 0, 0].item() == 3.0


def test_make_dataset_smart_cache_for_a_partial_cache(single_process):
    smart = make_dataset(_items(), Compose([]), cache_rate=0.5, replace_rate=0.2, shuffle=False)
    try:
        assert type(smart) is SmartCacheDataset
        assert len(smart) == 5  # the cache window
    finally:
        smart.shutdown()
    full = make_dataset(_items(), Compose([]), cache_rate=1.0, replace_rate=0.2)
    assert type(full) is CacheDataset and len(full) == 10


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cache_rate": 1.5}, "'cache_rate' must be a number in \\[0, 1\\] .*got 1.5"),
        ({"cache_rate": -0.1}, "'cache_rate'"),
        ({"replace_rate": 2}, "'replace_rate' must be a number in \\(0, 1\\] .*got 2"),
        ({"replace_rate": 0.0}, "'replace_rate' must be a number in \\(0, 1\\]"),  # MONAI refuses 0, so do the configs
    ],
)
def test_make_dataset_follows_the_configs_rule_for_rates(single_process, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_dataset(_items(), Compose([]), **kwargs)


def test_cache_size_keeps_at_least_one_item():
    assert cache_size(range(10), 0.5) == 5 and cache_size(range(10), 1.0) == 10
    assert cache_size(range(4), 0.1) == 1 and cache_size(range(4), 0.0) == 1 and cache_size([], 0.5) == 0
    with pytest.raises(UserError, match="'cache_rate' must be a number in \\[0, 1\\] .*got 1.5"):
        cache_size(range(4), 1.5)


def test_smart_cache_of_everything_is_a_plain_cache(single_process):
    """train.json's default: a SmartCacheDataset caching every item replaces none of them between epochs."""
    smart = SmartCacheDataset(
        _items(4), Compose([]), replace_rate=0.1, cache_num=cache_size(range(4), 1.0), progress=False, seed=1
    )
    try:
        before = sorted(smart[i]["image"].flatten()[0].item() for i in range(len(smart)))
        smart.start()
        for _ in range(3):
            smart.update_cache()
        after = sorted(smart[i]["image"].flatten()[0].item() for i in range(len(smart)))
    finally:
        smart.shutdown()
    assert len(smart) == 4 and before == after == [0.0, 1.0, 2.0, 3.0]


def test_make_dataset_partitions_for_this_rank(single_process):
    single_process.setenv("WORLD_SIZE", "2")
    seen = []
    for rank in (0, 1):
        single_process.setenv("RANK", str(rank))
        dataset = make_dataset(_items(), Compose([]), seed=3)
        assert len(dataset) == 5
        seen += [dataset[i]["image"].flatten()[0].item() for i in range(len(dataset))]
        assert len(make_dataset(_items(), Compose([]), partition=False)) == 10
    assert sorted(seen) == [float(i) for i in range(10)]


def test_make_loader_batches(single_process):
    loader = make_loader(make_dataset(_items(6), Compose([])), batch_size=4, shuffle=False)
    assert isinstance(loader, ThreadDataLoader)
    batches = [b["image"] for b in loader]
    assert [tuple(b.shape) for b in batches] == [(4, 1, 2, 2, 2), (2, 1, 2, 2, 2)]
    assert batches[1][:, 0, 0, 0, 0].tolist() == [4.0, 5.0]


# ---------------------------------------------------------------------------------------------- latent affine
def test_latent_affine_closed_form():
    affine = torch.tensor([[2.0, 0, 0, 10], [0, 3.0, 0, 20], [0, 0, 4.0, 30], [0, 0, 0, 1]], dtype=torch.float64)
    image = MetaTensor(torch.zeros(1, 16, 16, 16), affine=affine)
    latent = MetaTensor(torch.zeros(2, 4, 4, 4), affine=affine.clone())
    out = LatentAffined("pred")({"image": image, "pred": latent})
    expected = torch.tensor([[8.0, 0, 0, 13], [0, 12.0, 0, 24.5], [0, 0, 16.0, 36], [0, 0, 0, 1]], dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(out["pred"].affine, dtype=torch.float64), expected)
    assert torch.equal(image.affine, affine)  # the reference keeps its affine


def test_latent_voxel_centres_are_the_centres_of_their_image_blocks():
    gen = torch.Generator().manual_seed(0)
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, generator=gen, dtype=torch.float64))
    affine = torch.eye(4, dtype=torch.float64)
    affine[:3, :3] = rotation @ torch.diag(torch.tensor([0.8, 1.2, 2.0], dtype=torch.float64))
    affine[:3, 3] = torch.tensor([-5.0, 7.0, 1.0], dtype=torch.float64)
    image = MetaTensor(torch.zeros(1, 16, 8, 12), affine=affine)
    latent = MetaTensor(torch.zeros(3, 4, 4, 3))  # factors 4, 2, 4
    out = LatentAffined(["pred"], ref_key="image")({"image": image, "pred": latent})["pred"]
    factors = torch.tensor([4.0, 2.0, 4.0], dtype=torch.float64)
    for index in ([0, 0, 0], [3, 1, 2], [1, 3, 0]):
        idx = torch.tensor(index, dtype=torch.float64)
        homogeneous = torch.cat([idx, torch.ones(1, dtype=torch.float64)])
        latent_centre = torch.as_tensor(out.affine, dtype=torch.float64) @ homogeneous
        block = idx * factors + (factors - 1) / 2  # mean of the image voxel indices it covers
        image_centre = affine @ torch.cat([block, torch.ones(1, dtype=torch.float64)])
        torch.testing.assert_close(latent_centre, image_centre)


# ---------------------------------------------------------------------------------------------- postprocessing
def test_inference_postprocessing_bad_mode(tmp_path):
    with pytest.raises(ValueError, match="'bad'"):
        inference_postprocessing("bad", volume_transforms(train=False), str(tmp_path))


def test_encode_postprocessing_saves_latent_with_scaled_affine(tmp_path):
    affine = np.diag([1.0, 1.0, 2.0, 1.0])
    meta = {"filename_or_obj": "/in/case7.nii.gz"}
    image = MetaTensor(torch.zeros(1, 8, 8, 8), affine=torch.as_tensor(affine), meta=dict(meta))
    latent = MetaTensor(torch.rand(3, 4, 4, 4), affine=torch.as_tensor(affine), meta=dict(meta))
    post = inference_postprocessing("encode", volume_transforms(train=False), str(tmp_path))
    post({"image": image, "pred": latent})
    saved = nib.load(tmp_path / "case7_latent.nii.gz")
    assert saved.shape == (4, 4, 4, 3)  # channels last
    np.testing.assert_allclose(np.asarray(saved.dataobj), latent.numpy().transpose(1, 2, 3, 0), atol=1e-6)
    expected = np.diag([2.0, 2.0, 4.0, 1.0])
    expected[:3, 3] = [0.5, 0.5, 1.0]
    np.testing.assert_allclose(saved.affine, expected, atol=1e-6)


def _mri_restored(array: np.ndarray, lower: float = 0.5, upper: float = 99.5) -> np.ndarray:
    """What an identity network's reconstruction is in the input's units: the input clipped to its percentiles."""
    return np.clip(array, *np.percentile(array, [lower, upper]))


@pytest.mark.parametrize("units", ["input", "normalised"])
def test_reconstruct_postprocessing_returns_to_the_input_grid(tmp_path, units):
    affine = np.diag([-2.0, -2.0, 2.0, 1.0])  # LPS-like: the preprocessing reorients to RAS
    affine[:3, 3] = [30.0, 40.0, -10.0]
    path, array = _volume(tmp_path, shape=(10, 12, 14), affine=affine, name="case3.nii.gz")
    preprocessing = volume_transforms(patch_size=(16, 16, 16), train=False, invertible_intensity=units == "input")
    data = preprocessing({"image": str(path)})
    assert data["image"].shape == (1, 16, 16, 16)
    data["pred"] = data["image"].clone()
    inference_postprocessing("reconstruct", preprocessing, str(tmp_path / "out"), output_units=units)(data)
    saved = nib.load(tmp_path / "out" / "case3_recon.nii.gz")
    assert saved.shape == (10, 12, 14)
    np.testing.assert_allclose(saved.affine, affine, atol=1e-5)
    expected = _mri_restored(array) if units == "input" else _mri_normalised(array)
    np.testing.assert_allclose(np.asarray(saved.dataobj), expected, atol=1e-3 if units == "input" else 1e-5)


def test_output_units_must_match_the_preprocessing(tmp_path):
    recorded, plain = volume_transforms(train=False), volume_transforms(train=False, invertible_intensity=False)
    with pytest.raises(ValueError, match="'output_units' must be one of"):
        inference_postprocessing("reconstruct", recorded, str(tmp_path), output_units="hounsfield")
    with pytest.raises(ValueError, match="invertible_intensity=False"):
        inference_postprocessing("reconstruct", recorded, str(tmp_path), output_units="normalised")
    with pytest.raises(ValueError, match="invertible_intensity=True"):
        inference_postprocessing("reconstruct", plain, str(tmp_path))
    inference_postprocessing("reconstruct", plain, str(tmp_path), output_units="normalized")  # either spelling


# ---------------------------------------------------------------------------------------------- VQ codes / decode
def _codebook(n_codes: int = 8, dim: int = 3, seed: int = 0):
    from common.vqgan.networks import EMAVectorQuantizer

    quantizer = EMAVectorQuantizer(n_codes, dim)
    with torch.no_grad():
        quantizer.embeddings.copy_(torch.randn(n_codes, dim, generator=torch.Generator().manual_seed(seed)))
    return quantizer.eval()


def _near_codes(quantizer, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` latent vectors ``(n, D)`` built as codebook vectors plus an offset of a fifth of the smallest distance
    between two codes, and their codes ``(n,)`` (every code used): the assigned code is nearer than any other by at
    least 0.6 x that distance squared, so the nearest code is known by construction (no near-ties)."""
    codes = quantizer.embeddings.double()
    distances = torch.cdist(codes, codes).fill_diagonal_(float("inf"))
    separation = float(distances.min())
    assert separation > 1e-2  # far above float32 rounding of the distances
    gen = torch.Generator().manual_seed(seed)
    assignment = (torch.arange(n) % len(codes))[torch.randperm(n, generator=gen)]
    offsets = torch.randn(n, codes.shape[1], generator=gen, dtype=torch.float64)
    vectors = codes[assignment] + 0.2 * separation * offsets / offsets.norm(dim=1, keepdim=True)
    return vectors.float(), assignment


def test_vq_codes_replace_the_latent_with_codebook_vectors_and_add_codes():
    from common.data.pipeline import VQCodesd

    quantizer = _codebook()
    affine = torch.tensor([[4.0, 0, 0, 1.5], [0, 4.0, 0, -2.0], [0, 0, 8.0, 3.0], [0, 0, 0, 1]], dtype=torch.float64)
    vectors, assignment = _near_codes(quantizer, 4 * 5 * 2, seed=1)
    values = vectors.t().reshape(3, 4, 5, 2)  # channel first; voxel i (C order) is vectors[i]
    latent = MetaTensor(values.clone(), affine=affine, meta={"filename_or_obj": "/in/case1.nii.gz"})
    out = VQCodesd("pred", quantizer)({"pred": latent, "other": 5})
    codes, quantized = out["codes"], out["pred"]
    assert out["other"] == 5
    assert isinstance(codes, MetaTensor) and isinstance(quantized, MetaTensor)
    assert codes.dtype == torch.int32 and codes.shape == (1, 4, 5, 2)
    expected = assignment.reshape(1, 4, 5, 2)
    assert torch.equal(codes.as_tensor().long(), expected)
    assert len(expected.unique()) == 8  # every code used
    # every voxel is exactly its codebook vector, i.e. embed(codes)
    assert quantized.shape == (3, 4, 5, 2)
    assert torch.equal(quantized.as_tensor(), quantizer.embed(codes.as_tensor())[0])
    for tensor in (codes, quantized):
        torch.testing.assert_close(torch.as_tensor(tensor.affine, dtype=torch.float64), affine)
        assert tensor.meta["filename_or_obj"] == "/in/case1.nii.gz"
    assert torch.equal(latent.as_tensor(), values)  # the input is not modified in place


def test_vq_codes_accept_a_vqgan_and_a_codes_key():
    from common.data.pipeline import VQCodesd
    from common.vqgan.networks import VQGAN

    torch.manual_seed(0)
    model = VQGAN(n_hiddens=4, norm_num_groups=4, downsample=[2, 2, 2], embedding_dim=3, n_codes=8).eval()
    transform = VQCodesd(["pred"], model, codes_key="idx")
    assert transform.quantizer is model.quantizer
    latent = torch.randn(3, 2, 2, 2)
    out = transform({"pred": latent})
    assert "codes" not in out and out["idx"].shape == (1, 2, 2, 2)
    assert torch.equal(out["pred"].as_tensor(), model.quantizer.embed(out["idx"].as_tensor())[0])


@pytest.mark.parametrize(
    "divisible_by, shape", [([4, 4, 4], (80, 96, 32)), (4, (80, 96, 32)), ([8, 5, 16], (80, 100, 32))]
)
def test_volume_transforms_pad_to_a_multiple(tmp_path, divisible_by, shape):
    path, _ = _volume(tmp_path, shape=(77, 96, 30))
    plain = volume_transforms(patch_size=None, train=False)({"image": str(path)})["image"]
    padded = volume_transforms(patch_size=None, train=False, divisible_by=divisible_by)({"image": str(path)})["image"]
    assert plain.shape == (1, 77, 96, 30)
    assert padded.shape == (1, *shape)
    # symmetric zero padding: the volume sits at floor(pad / 2) on each axis
    offsets = [(s - p) // 2 for s, p in zip(shape, (77, 96, 30))]
    window = tuple(slice(o, o + p) for o, p in zip(offsets, (77, 96, 30)))
    assert torch.equal(padded[(0, *window)], plain[0])
    outside = padded.as_tensor().clone()
    outside[(0, *window)] = 0
    assert outside.abs().sum() == 0  # nothing but zeros outside


def test_divisible_padding_after_the_patch_padding_and_undone_by_reconstruct(tmp_path):
    path, array = _volume(tmp_path, shape=(10, 13, 7), name="case5.nii.gz")
    preprocessing = volume_transforms(patch_size=(12, 12, 12), train=False, divisible_by=[8, 4, 8])
    data = preprocessing({"image": str(path)})
    assert data["image"].shape == (1, 16, 16, 16)  # 12 -> 16, 13 -> 16, 12 -> 16
    data["pred"] = data["image"].clone()
    inference_postprocessing("reconstruct", preprocessing, str(tmp_path / "out"))(data)
    saved = nib.load(tmp_path / "out" / "case5_recon.nii.gz")
    assert saved.shape == (10, 13, 7)
    np.testing.assert_allclose(np.asarray(saved.dataobj), _mri_restored(array), atol=1e-3)


def test_reconstruct_postprocessing_maps_a_ct_window_back_to_hounsfield_units(tmp_path):
    array = np.linspace(-1500, 1500, 8 * 9 * 10, dtype=np.float32).reshape(8, 9, 10)
    path = write_nifti(tmp_path / "ct.nii.gz", array)
    intensity = {"mode": "ct", "a_min": -1000, "a_max": 1000}
    preprocessing = volume_transforms(intensity=intensity, patch_size=None, train=False, divisible_by=4)
    data = preprocessing({"image": str(path)})
    data["pred"] = data["image"].clone()
    inference_postprocessing("reconstruct", preprocessing, str(tmp_path / "out"), intensity=intensity)(data)
    saved = np.asarray(nib.load(tmp_path / "out" / "ct_recon.nii.gz").dataobj)
    np.testing.assert_allclose(saved, np.clip(array, -1000, 1000), atol=0.05)


def _decode_inputs(pred: torch.Tensor):
    latent_affine = torch.tensor([[8.0, 0, 0, 10], [0, 8.0, 0, 20], [0, 0, 8.0, 30], [0, 0, 0, 1]], dtype=torch.float64)
    meta = {"filename_or_obj": "/in/case9.nii.gz"}
    codes = MetaTensor(torch.zeros(1, 4, 4, 2), affine=latent_affine, meta=dict(meta))
    decoded = MetaTensor(pred, affine=latent_affine.clone(), meta=dict(meta))
    return {"image": codes, "pred": decoded}


def test_decode_postprocessing_saves_the_image_on_the_image_grid(tmp_path):
    pred = torch.rand(1, 16, 16, 8, generator=torch.Generator().manual_seed(0))
    post = inference_postprocessing("decode", volume_transforms(train=False), str(tmp_path))
    post(_decode_inputs(pred.clone()))
    saved = nib.load(tmp_path / "case9_decoded.nii.gz")
    assert saved.shape == (16, 16, 8)
    np.testing.assert_allclose(np.asarray(saved.dataobj), pred[0].numpy(), atol=1e-6)
    # 8 mm latent voxels, 4x upsampled: 2 mm image voxels; latent voxel 0 (at 10, 20, 30 mm) is the centre of
    # image voxels 0..3, so image voxel 0 lies 1.5 image voxels (3 mm) before it on every axis
    expected = np.diag([2.0, 2.0, 2.0, 1.0])
    expected[:3, 3] = [7.0, 17.0, 27.0]
    np.testing.assert_allclose(saved.affine, expected, atol=1e-6)


@pytest.mark.parametrize(
    "intensity, expected",
    [
        ({"mode": "ct", "a_min": -1000, "a_max": 1000}, [-1000.0, -500.0, 0.0, 1000.0, 1000.0, -1000.0]),
        ({"mode": "ct", "a_min": -200, "a_max": 300}, [-200.0, -75.0, 50.0, 300.0, 300.0, -200.0]),
        ({"mode": "mri"}, [0.0, 0.25, 0.5, 1.0, 1.2, -0.1]),
        (None, [0.0, 0.25, 0.5, 1.0, 1.2, -0.1]),
    ],
)
def test_decode_postprocessing_intensity(tmp_path, intensity, expected):
    pred = torch.zeros(1, 16, 16, 8)
    pred[0, :6, 0, 0] = torch.tensor([0.0, 0.25, 0.5, 1.0, 1.2, -0.1])  # 1.2 / -0.1: outside the window, clipped
    post = inference_postprocessing("decode", volume_transforms(train=False), str(tmp_path), intensity=intensity)
    post(_decode_inputs(pred))
    saved = np.asarray(nib.load(tmp_path / "case9_decoded.nii.gz").dataobj)
    np.testing.assert_allclose(saved[:6, 0, 0], expected, atol=1e-3)


def test_encode_postprocessing_with_a_quantizer_saves_codes_and_code_vectors(tmp_path):
    quantizer = _codebook(n_codes=8, dim=3)
    affine = np.diag([1.0, 1.0, 2.0, 1.0])
    meta = {"filename_or_obj": "/in/case7.nii.gz"}
    image = MetaTensor(torch.zeros(1, 8, 8, 8), affine=torch.as_tensor(affine), meta=dict(meta))
    vectors, assignment = _near_codes(quantizer, 4 * 4 * 4, seed=2)
    values = vectors.t().reshape(3, 4, 4, 4)  # channel first; voxel i (C order) is vectors[i]
    latent = MetaTensor(values.clone(), affine=torch.as_tensor(affine), meta=dict(meta))
    post = inference_postprocessing("encode", volume_transforms(train=False), str(tmp_path), quantizer=quantizer)
    post({"image": image, "pred": latent})
    codes = nib.load(tmp_path / "case7_codes.nii.gz")
    saved_latent = nib.load(tmp_path / "case7_latent.nii.gz")
    assert codes.get_data_dtype() == np.int32
    expected_codes = assignment.reshape(4, 4, 4)
    np.testing.assert_array_equal(np.asarray(codes.dataobj).reshape(4, 4, 4), expected_codes.numpy())
    vectors = quantizer.embeddings[expected_codes].numpy()  # (4, 4, 4, 3): channels last, as saved
    np.testing.assert_array_equal(np.asarray(saved_latent.dataobj), vectors)  # exactly the codebook rows
    expected_affine = np.diag([2.0, 2.0, 4.0, 1.0])
    expected_affine[:3, 3] = [0.5, 0.5, 1.0]
    np.testing.assert_allclose(codes.affine, expected_affine, atol=1e-6)
    np.testing.assert_allclose(saved_latent.affine, expected_affine, atol=1e-6)


def test_inference_postprocessing_unknown_mode_lists_the_modes(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'reconstruct', 'encode' or 'decode', got 'quantize'"):
        inference_postprocessing("quantize", volume_transforms(train=False), str(tmp_path))


def test_vqcodesd_never_updates_a_training_mode_codebook():
    from monai.data import MetaTensor

    from common.data.pipeline import VQCodesd
    from common.vqgan.networks import EMAVectorQuantizer

    torch.manual_seed(0)
    quantizer = EMAVectorQuantizer(8, 3)
    quantizer.initialized.fill_(True)
    quantizer.train()
    before = quantizer.embeddings.clone()
    out = VQCodesd("pred", quantizer)({"pred": MetaTensor(torch.randn(3, 4, 4, 4))})
    assert torch.equal(quantizer.embeddings, before) and quantizer.training
    assert torch.equal(out["pred"].as_tensor(), quantizer.embed(out["codes"].as_tensor().long())[0])


# ---------------------------------------------------------------------------------------------- other formats
@pytest.mark.parametrize(
    "intensity",
    [{"mode": "mri", "lower": 0.5, "upper": 99.5}, {"mode": "ct", "a_min": -300, "a_max": 400}],
    ids=["percentiles", "ct_window"],
)
def test_nrrd_metaimage_and_dicom_reconstructions_keep_geometry_and_units(tmp_path, intensity):
    """An identity network's reconstruction of tilted, anisotropic LPS volumes (NRRD, MetaImage, DICOM series)
    through the inference pipeline (loader collation and decollation included) lands on the input's voxel grid in
    the input's units: clipped to the volume's percentiles, or to the CT window in HU."""
    from monai.data import DataLoader, Dataset, decollate_batch

    from common.data.datalist import find_volumes
    from tests.helpers import check_restored_volume, write_format_cases

    array = np.round(make_phantom((20, 18, 12), seed=1) * 1400.0 - 700.0).astype(np.float32)
    cases = write_format_cases(tmp_path / "in", array)
    entries = find_volumes(tmp_path / "in")
    assert sorted(e["case_id"] for e in entries) == sorted(cases)
    preprocessing = volume_transforms(intensity=intensity, patch_size=(16, 16, 16), train=False, divisible_by=4)
    post = inference_postprocessing("reconstruct", preprocessing, str(tmp_path / "out"), intensity=intensity)
    for batch in DataLoader(Dataset(entries, preprocessing), batch_size=1):
        assert batch["image"].shape == (1, 1, 20, 20, 16)  # RAS-reoriented, padded
        for item in decollate_batch({**batch, "pred": batch["image"].clone()}):
            post(item)
    if intensity["mode"] == "mri":
        expected = np.clip(array, *np.percentile(array, [0.5, 99.5]))
    else:
        expected = np.clip(array, -300.0, 400.0)
    for case, path in cases.items():
        check_restored_volume(tmp_path / "out" / f"{case}_recon.nii.gz", path, expected)


def test_a_written_prediction_keeps_the_input_header_s_units(tmp_path):
    """The NIfTI units of the input (``('mm', 'sec')``) and its time offset are those of the written file, not
    "unknown"; its grid and values are the prediction's own."""
    from monai.transforms import LoadImaged

    from common.data.pipeline import nifti_saver

    image = nib.Nifti1Image(np.arange(60, dtype=np.float32).reshape(3, 4, 5), np.diag([2.0, 1.5, 3.0, 1.0]))
    image.header.set_xyzt_units("mm", "sec")
    image.header["toffset"] = 4.5
    nib.save(image, tmp_path / "case.nii.gz")
    item = LoadImaged("image", ensure_channel_first=True, image_only=True)({"image": str(tmp_path / "case.nii.gz")})
    item["image"] = item["image"] * 2
    nifti_saver("image", str(tmp_path / "out"), "pred")(item)
    written = nib.load(tmp_path / "out" / "case_pred.nii.gz")
    assert written.header.get_xyzt_units() == ("mm", "sec") and float(written.header["toffset"]) == 4.5
    np.testing.assert_array_equal(written.get_fdata(), np.arange(60).reshape(3, 4, 5) * 2)
    np.testing.assert_allclose(written.affine, image.affine)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the slice (2D) + volume (3D) discriminator pair of the VQ-GAN."""

from __future__ import annotations

import pytest
import torch
from monai.networks.nets import PatchDiscriminator
from torch import nn

from common.autoencoder.discriminators import SliceVolumeDiscriminator

torch.set_num_threads(1)

SHAPE = (3, 1, 20, 16, 24)  # distinct sizes per axis: a slice's shape tells which axis it was taken across


def _disc(**kwargs) -> SliceVolumeDiscriminator:
    torch.manual_seed(0)
    return SliceVolumeDiscriminator(**{"channels": 8, "num_layers": 2, **kwargs}).eval()


def _volume() -> torch.Tensor:
    return torch.rand(SHAPE, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "image, video, keys", [(True, True, {"image", "video"}), (True, False, {"image"}), (False, True, {"video"})]
)
def test_output_keys_and_heads_follow_the_flags(image, video, keys):
    disc = _disc(image=image, video=video)
    assert (disc.image is not None) == image and (disc.video is not None) == video
    assert isinstance(disc.image, PatchDiscriminator) or disc.image is None
    out = disc(_volume(), torch.tensor([0, 1, 2]))
    assert set(out) == keys
    for value in out.values():
        assert isinstance(value, list) and len(value) == 4  # first conv, 2 layers, logits
    if video:
        assert out["video"][-1].ndim == 5 and out["video"][-1].shape[:2] == (3, 1)
    if image:
        assert out["image"][-1].ndim == 4 and out["image"][-1].shape[:2] == (3, 1)
    n_params = sum(p.numel() for p in disc.parameters())
    expected = sum(p.numel() for head in (disc.image, disc.video) if head is not None for p in head.parameters())
    assert n_params == expected  # a disabled head costs nothing


@pytest.mark.parametrize(
    "slice_axis, take",
    [
        (-1, lambda x, b, v: x[b, :, :, :, v]),
        (2, lambda x, b, v: x[b, :, :, :, v]),
        (0, lambda x, b, v: x[b, :, v, :, :]),
        (-2, lambda x, b, v: x[b, :, :, v, :]),
    ],
)
def test_image_head_sees_the_slices_at_the_given_views(slice_axis, take):
    disc = _disc(slice_axis=slice_axis)
    x = _volume()
    views = torch.tensor([0, 5, 11])
    expected_slices = torch.stack([take(x, b, int(v)) for b, v in enumerate(views)])
    slices = disc.slices(x, views)
    assert torch.equal(slices, expected_slices)
    with torch.no_grad():
        out = disc(x, views)
        direct = disc.image(expected_slices)
        video = disc.video(x)
    assert len(out["image"]) == len(direct)
    for got, want in zip(out["image"], direct):
        assert torch.equal(got, want)
    for got, want in zip(out["video"], video):
        assert torch.equal(got, want)


def test_slices_shape_per_axis():
    x = _volume()
    views = torch.tensor([1, 2, 3])
    assert _disc(slice_axis=0).slices(x, views).shape == (3, 1, 16, 24)
    assert _disc(slice_axis=1).slices(x, views).shape == (3, 1, 20, 24)
    assert _disc(slice_axis=-1).slices(x, views).shape == (3, 1, 20, 16)
    assert _disc(slice_axis=-3).slice_axis == 0


@pytest.mark.parametrize("slice_axis, size", [(-1, 24), (0, 20), (1, 16)])
def test_sample_views_are_uniform_over_the_slice_axis(slice_axis, size):
    """One index per volume drawn uniformly from ``[0, size)`` along ``slice_axis`` (``torch.randint`` of the global
    RNG): every index is reachable, none is out of range."""
    disc = _disc(slice_axis=slice_axis)
    x = torch.zeros(6, 1, 20, 16, 24)
    torch.manual_seed(0)
    views = disc.sample_views(x)
    assert views.shape == (6,) and views.dtype == torch.long
    torch.manual_seed(0)
    assert torch.equal(views, torch.randint(0, size, (6,)))
    assert int(views.min()) >= 0 and int(views.max()) <= size - 1


def test_forward_without_views_samples_them():
    disc = _disc()
    x = _volume()
    torch.manual_seed(7)
    views = disc.sample_views(x)
    torch.manual_seed(7)
    with torch.no_grad():
        sampled = disc(x)["image"][-1]
        explicit = disc(x, views)["image"][-1]
        other = disc(x, (views + 1) % SHAPE[-1])["image"][-1]
    assert torch.equal(sampled, explicit)
    assert not torch.equal(sampled, other)


def test_norm_is_passed_to_both_heads():
    disc = _disc(norm="INSTANCE")
    kinds = {
        type(m)
        for m in disc.modules()
        if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm2d, nn.InstanceNorm3d))
    }
    assert kinds == {nn.InstanceNorm2d, nn.InstanceNorm3d}
    kinds = {type(m) for m in _disc().modules() if isinstance(m, (nn.BatchNorm2d, nn.BatchNorm3d))}
    assert kinds == {nn.BatchNorm2d, nn.BatchNorm3d}


def test_channels_and_layers_are_passed_on():
    disc = _disc(in_channels=2, channels=6, num_layers=3)
    out = disc(torch.rand(2, 2, 32, 32, 32), torch.tensor([3, 4]))
    assert [t.shape[1] for t in out["image"]] == [6, 12, 24, 48, 1]
    assert [t.shape[1] for t in out["video"]] == [6, 12, 24, 48, 1]


def test_both_heads_off_is_an_error():
    with pytest.raises(ValueError, match="at least one of image=True or video=True"):
        SliceVolumeDiscriminator(image=False, video=False)


@pytest.mark.parametrize("axis", [3, -4, 5])
def test_bad_slice_axis_names_the_value(axis):
    with pytest.raises(ValueError, match=rf"slice_axis must be a spatial axis in \[-3, 2\], got {axis}"):
        SliceVolumeDiscriminator(slice_axis=axis)

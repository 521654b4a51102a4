# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Published 3D autoencoders a user starts from: the publishers' exact networks and their weight files as
distributed.

- ``maisi_vae``: MAISI's VAE (NVIDIA; MONAI model zoo ``maisi_ct_generative``, ``configs/inference.json``
  ``autoencoder_def``, weights ``models/autoencoder_epoch273.pt``, a plain state dict): MONAI's
  ``AutoencoderKlMaisi``, channels 64/128/256, 2 residual blocks per level, 32 groups, eps 1e-6, 4 latent
  channels, no attention; CT in Hounsfield units [-1000, 1000] scaled to [0, 1] and clipped.
- ``brats_ldm_autoencoder``: the autoencoder of the zoo's ``brats_mri_generative_diffusion``
  (``configs/train_autoencoder.json`` ``autoencoder_def``, weights ``models/model_autoencoder.pt`` in MONAI
  Generative's key layout, which the zoo loads with ``load_old_state_dict``): MONAI's ``AutoencoderKL``, channels
  64/128/256, 2 residual blocks, 32 groups, eps 1e-6, 8 latent channels, no attention, ``include_fc`` false; MRI
  scaled between the 0 and 99.5 percentiles to [0, 1], not clipped.

The weights themselves are the publishers' (their licences apply; nothing here downloads them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from monai.apps.generation.maisi.networks.autoencoderkl_maisi import AutoencoderKlMaisi
from monai.networks.nets import AutoencoderKL
from torch import nn

from common.autoencoder.networks import AutoencoderKLReconstructor
from common.checkpoint_io import (
    CheckpointError,
    checkpoint_record,
    load_network_weights,
    load_published_weights,
    published_state,
)

__all__ = [
    "PUBLISHED",
    "ARCHITECTURES",
    "MaisiReconstructor",
    "autoencoder_network",
    "load_autoencoder_weights",
    "network_problems",
    "published_network",
    "pretrained_problems",
    "published_settings",
    "split_problems",
]

#: name -> (network class, the publisher's arguments, the publisher's intensity convention as this collection's
#: ``intensity`` setting)
PUBLISHED: dict[str, tuple[type[nn.Module], dict[str, Any], dict[str, Any]]] = {
    "maisi_vae": (
        AutoencoderKlMaisi,
        {
            "spatial_dims": 3,
            "in_channels": 1,
            "out_channels": 1,
            "latent_channels": 4,
            "num_channels": [64, 128, 256],
            "num_res_blocks": [2, 2, 2],
            "norm_num_groups": 32,
            "norm_eps": 1e-06,
            "attention_levels": [False, False, False],
            "with_encoder_nonlocal_attn": False,
            "with_decoder_nonlocal_attn": False,
            "use_checkpointing": False,
            "use_convtranspose": False,
            "norm_float16": True,
            "num_splits": 8,
            "dim_split": 1,
        },
        {"mode": "ct", "a_min": -1000.0, "a_max": 1000.0},
    ),
    "brats_ldm_autoencoder": (
        AutoencoderKL,
        {
            "spatial_dims": 3,
            "in_channels": 1,
            "out_channels": 1,
            "latent_channels": 8,
            "channels": [64, 128, 256],
            "num_res_blocks": 2,
            "norm_num_groups": 32,
            "norm_eps": 1e-06,
            "attention_levels": [False, False, False],
            "with_encoder_nonlocal_attn": False,
            "with_decoder_nonlocal_attn": False,
            "include_fc": False,
        },
        {"mode": "mri", "lower": 0.0, "upper": 99.5, "clip": False},
    ),
}
#: the ``architecture`` choices of the autoencoder bundle: this collection's own, then the published ones
ARCHITECTURES = ("autoencoder", *PUBLISHED)


class MaisiReconstructor(AutoencoderKlMaisi):
    """MAISI's VAE whose ``forward(x)`` is its deterministic reconstruction (as
    :class:`common.autoencoder.networks.AutoencoderKLReconstructor` for ``AutoencoderKL``); same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.reconstruct(x)


def published_settings(name: str) -> dict[str, Any]:
    """The autoencoder bundle's settings that describe the published network ``name``: ``architecture``, the
    architecture ids (``channels``, ``latent_channels``, ``num_res_blocks``, ``norm_num_groups``,
    ``attention_levels``, ``with_nonlocal_attn``) and the publisher's ``intensity``. Its preset config file
    (``configs/<name>.json``) holds these values."""
    _, arguments, intensity = PUBLISHED[name]
    blocks = arguments["num_res_blocks"]
    return {
        "architecture": name,
        "channels": list(arguments.get("channels", arguments.get("num_channels"))),
        "latent_channels": arguments["latent_channels"],
        "num_res_blocks": blocks[0] if isinstance(blocks, list) and len(set(blocks)) == 1 else blocks,
        "norm_num_groups": arguments["norm_num_groups"],
        "attention_levels": list(arguments["attention_levels"]),
        "with_nonlocal_attn": arguments["with_encoder_nonlocal_attn"],
        "intensity": dict(intensity),
    }


def network_problems(
    architecture: str,
    channels: Any,
    latent_channels: Any,
    num_res_blocks: Any,
    norm_num_groups: Any,
    attention_levels: Any,
    with_nonlocal_attn: Any,
    num_splits: Any,
    dim_split: Any,
) -> list[str]:
    """``architecture`` is one of :data:`ARCHITECTURES`; a published network's architecture ids are the
    publisher's (its weights fit nothing else: merge its preset ``configs/<architecture>.json``), and
    ``num_splits``/``dim_split`` (MAISI's split convolutions) are null or valid for MAISI."""
    if architecture not in ARCHITECTURES:
        return [f"'architecture' must be one of {list(ARCHITECTURES)}, got {architecture!r}."]
    problems = []
    given = {
        "channels": channels,
        "latent_channels": latent_channels,
        "num_res_blocks": num_res_blocks,
        "norm_num_groups": norm_num_groups,
        "attention_levels": attention_levels,
        "with_nonlocal_attn": with_nonlocal_attn,
    }
    if architecture in PUBLISHED:
        expected = published_settings(architecture)
        differ = [f"'{k}' {given[k]!r} (the publisher's: {expected[k]!r})" for k in given if given[k] != expected[k]]
        if differ:
            problems.append(
                f"'architecture' {architecture!r} is the publisher's network, but {'; '.join(differ)}: merge its "
                f"preset configs/{architecture}.json after the others."
            )
    for key, value, minimum in (("num_splits", num_splits, 1), ("dim_split", dim_split, 0)):
        if value is None:
            continue
        if architecture != "maisi_vae":
            problems.append(f"'{key}' is MAISI's split convolution setting; {architecture!r} has none (use null).")
        elif (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (key == "dim_split" and value > 2)
        ):
            allowed = "0, 1 or 2 (a spatial dimension)" if key == "dim_split" else "an integer >= 1"
            problems.append(f"'{key}' must be null or {allowed}, got {value!r}.")
    return problems


def split_problems(architecture: str, patch_size: Any, num_splits: Any, dim_split: Any) -> list[str]:
    """MAISI's split convolutions cut the window (``patch_size``) along ``dim_split`` into ``num_splits`` pieces
    (null: the publisher's 8 along dimension 1); at the deepest level (the window / 4) each piece must keep at least
    3 voxels, the convolution kernel, or the first case fails inside the network (measured: 64 voxels allow at most
    5 splits)."""
    if architecture != "maisi_vae" or not isinstance(patch_size, (list, tuple)) or len(patch_size) != 3:
        return []
    defaults = PUBLISHED["maisi_vae"][1]
    splits = defaults["num_splits"] if num_splits is None else num_splits
    dim = defaults["dim_split"] if dim_split is None else dim_split
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (splits, dim, *patch_size)) or not 0 <= dim <= 2:
        return []  # network_problems and patch_problems name these
    deepest = patch_size[dim] // 4
    if splits > 1 and deepest // splits < 3:
        most = max(1, deepest // 3)
        return [
            f"'num_splits' {splits} cuts dimension {dim} of the {patch_size[dim]}-voxel window ('patch_size' "
            f"{list(patch_size)}) into pieces of {deepest // splits} voxels at MAISI's deepest level ({deepest}); the "
            f"kernel needs 3: use num_splits <= {most}, another dim_split or a larger patch_size."
        ]
    return []


def autoencoder_network(
    architecture: str = "autoencoder",
    reconstructor: bool = False,
    device: str | torch.device = "cpu",
    num_splits: int | None = None,
    dim_split: int | None = None,
    pretrained_weights: str | None = None,
    **arguments: Any,
) -> nn.Module:
    """The autoencoder bundle's network: ``autoencoder`` is MONAI's ``AutoencoderKL`` (one input and output channel)
    built from ``arguments`` (the bundle's ids); a published name is the publisher's network
    (:func:`published_network`; ``arguments`` then describe it, checked by :func:`network_problems`).
    ``reconstructor``: the inference view, whose ``forward`` is the deterministic reconstruction.
    ``pretrained_weights``: a publisher's weights file loaded into it (:func:`load_published_weights`)."""
    if architecture in PUBLISHED:
        built = published_network(architecture, device, num_splits, dim_split, reconstructor=reconstructor)
    else:
        cls = AutoencoderKLReconstructor if reconstructor else AutoencoderKL
        built = cls(spatial_dims=3, in_channels=1, out_channels=1, **arguments)
    if pretrained_weights:
        load_published_weights(built, pretrained_weights)
    return built


def published_network(
    name: str,
    device: str | torch.device = "cpu",
    num_splits: int | None = None,
    dim_split: int | None = None,
    reconstructor: bool = False,
) -> nn.Module:
    """The publisher's network ``name`` (a key of :data:`PUBLISHED`), randomly initialised; ``reconstructor``: its
    inference view (``forward`` is the deterministic reconstruction).

    MAISI's ``norm_float16`` (group norm in half precision, the publisher's setting) is kept for the inference view
    on a CUDA device only: on the CPU outside autocast it fails ("Input type (c10::Half) and bias type (float)
    should be the same"), and fine-tuning keeps group norm in float32. ``num_splits`` and ``dim_split`` (MAISI
    only) override the publisher's split convolutions (8 along dimension 1): each split must stay wider than the
    3-voxel kernel, so 1 (no split) suits small inputs.

    Raises:
        ValueError: for an unknown name, or split settings given for a network without them.
    """
    if name not in PUBLISHED:
        raise ValueError(f"'network' must be one of {sorted(PUBLISHED)} for published weights, got {name!r}.")
    cls, arguments, _ = PUBLISHED[name]
    arguments = dict(arguments)
    if cls is AutoencoderKL and reconstructor:
        cls = AutoencoderKLReconstructor
    if cls is AutoencoderKlMaisi:
        cls = MaisiReconstructor if reconstructor else cls
        arguments["norm_float16"] = reconstructor and torch.device(device).type == "cuda"
        for key, value in (("num_splits", num_splits), ("dim_split", dim_split)):
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "num_splits" else 0):
                    raise ValueError(f"'{key}' must be an integer >= {1 if key == 'num_splits' else 0}, got {value!r}.")
                arguments[key] = value
        if arguments["dim_split"] > 2:
            raise ValueError(f"'dim_split' must be 0, 1 or 2 (a spatial dimension), got {arguments['dim_split']!r}.")
    elif num_splits is not None or dim_split is not None:
        raise ValueError(f"num_splits/dim_split are MAISI's split convolutions; {name!r} has none.")
    return cls(**arguments).to(device)


def pretrained_problems(
    architecture: str,
    pretrained_weights: Any,
    channels: Any,
    latent_channels: Any,
    num_res_blocks: Any,
    norm_num_groups: Any,
    attention_levels: Any,
    with_nonlocal_attn: Any,
) -> list[str]:
    """``pretrained_weights`` (null, or a weights file) is readable and fits the network the settings build,
    checked before anything is written: the network is built on PyTorch's ``meta`` device (no memory, no random
    numbers drawn), the file read, keys and shapes compared."""
    if not pretrained_weights:
        return []
    arguments = {"channels": channels, "latent_channels": latent_channels, "num_res_blocks": num_res_blocks}
    arguments.update(norm_num_groups=norm_num_groups, attention_levels=attention_levels)
    arguments.update(with_encoder_nonlocal_attn=with_nonlocal_attn, with_decoder_nonlocal_attn=with_nonlocal_attn)
    try:
        with torch.device("meta"):
            network = autoencoder_network(architecture, device="meta", **arguments)
    except Exception:  # invalid architecture settings: their own checks name them
        return []
    try:
        return [problem] if (problem := published_state(network, str(pretrained_weights))[1]) else []
    except CheckpointError as e:
        return [str(e)]


def load_autoencoder_weights(
    network: nn.Module,
    path: str | os.PathLike,
    architecture: str = "autoencoder",
    settings: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Load the weights evaluation and inference use: a checkpoint this collection trained (it carries its run's
    record; :func:`common.checkpoint_io.load_network_weights`, naming the settings that differ when it does not fit),
    or for a published ``architecture`` the publisher's file as distributed (:func:`load_published_weights`:
    zero-shot)."""
    if architecture in PUBLISHED and checkpoint_record(path) is None:
        load_published_weights(network, path)
        return network
    return load_network_weights(network, path, settings=settings)

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

from common.checkpoint_io import CheckpointError, load_checkpoint
from common.networks.wrappers import clean_state_dict

__all__ = ["PUBLISHED", "load_published_weights", "published_network"]

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
# keys of a training checkpoint that hold the network's state dict, in the order they are tried
_WRAPPERS = ("state_dict", "model", "autoencoder", "network", "gnetwork", "model_state_dict")


def published_network(
    name: str, device: str | torch.device = "cpu", num_splits: int | None = None, dim_split: int | None = None
) -> nn.Module:
    """The publisher's network ``name`` (a key of :data:`PUBLISHED`), randomly initialised.

    MAISI's ``norm_float16`` (group norm in half precision) is kept on a CUDA device only: on the CPU outside
    autocast it fails ("Input type (c10::Half) and bias type (float) should be the same"). ``num_splits`` and
    ``dim_split`` (MAISI only) override the publisher's split convolutions (8 along dimension 1): each split must
    stay wider than the 3-voxel kernel, so 1 (no split) suits inputs under 8 x 4 voxels along that dimension.

    Raises:
        ValueError: for an unknown name, or split settings given for a network without them.
    """
    if name not in PUBLISHED:
        raise ValueError(f"'network' must be one of {sorted(PUBLISHED)} for published weights, got {name!r}.")
    cls, arguments, _ = PUBLISHED[name]
    arguments = dict(arguments)
    if cls is AutoencoderKlMaisi:
        arguments["norm_float16"] = torch.device(device).type == "cuda"
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


def _tensor_dict(checkpoint: Any, path: str) -> dict[str, torch.Tensor]:
    """The state dict inside a weights file: the file itself, or under one of the usual keys of a training
    checkpoint (optimizer and scheduler states beside it are ignored)."""
    if isinstance(checkpoint, Mapping) and checkpoint and all(torch.is_tensor(v) for v in checkpoint.values()):
        return dict(checkpoint)
    if isinstance(checkpoint, Mapping):
        for key in _WRAPPERS:
            inner = checkpoint.get(key)
            if isinstance(inner, Mapping) and inner and all(torch.is_tensor(v) for v in inner.values()):
                return dict(inner)
        kinds = {k: type(v).__name__ for k, v in list(checkpoint.items())[:8]}
        raise CheckpointError(
            f"pretrained weights {path!r} hold no state dict of tensors at the top or under {list(_WRAPPERS)}; "
            f"found {kinds}."
        )
    raise CheckpointError(
        f"pretrained weights {path!r} must be a state dict of tensors, got {type(checkpoint).__name__}."
    )


def _from_generative_layout(state: dict[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys of MONAI Generative's ``AutoencoderKL`` renamed to MONAI's (what ``load_old_state_dict`` renames: an
    up-sampling block's ``conv`` is ``postconv``; an attention block's ``to_q/k/v`` sit under ``attn.`` and
    ``proj_attn`` is ``attn.out_proj``); keys already in MONAI's layout stay."""
    renamed = {}
    for key, value in state.items():
        new = key
        if new not in own:
            for old, current in ((".conv.conv.", ".postconv.conv."), (".proj_attn.", ".attn.out_proj.")):
                if old in new and new.replace(old, current) in own:
                    new = new.replace(old, current)
            for part in ("to_q", "to_k", "to_v"):
                candidate = new.replace(f".{part}.", f".attn.{part}.")
                if candidate != new and candidate in own:
                    new = candidate
        renamed[new] = value
    return renamed


def load_published_weights(network: nn.Module, path: str | os.PathLike) -> int:
    """Load a publisher's weights file into ``network`` (built by :func:`published_network`), all of it or
    nothing.

    Accepted as distributed: a plain state dict (MAISI's ``autoencoder_epoch273.pt``), one under ``state_dict``,
    ``model``, ``autoencoder``, ... (a training checkpoint; its optimizer state is ignored), DDP's ``module.`` and
    ``torch.compile``'s ``_orig_mod.`` prefixes, and MONAI Generative's key names (the zoo's BraTS
    ``model_autoencoder.pt``). Unlike MONAI's ``load_old_state_dict``, a tensor the network has and the file lacks
    is an error, not a silently random layer.

    Returns:
        The number of tensors loaded (all of the network's).

    Raises:
        CheckpointError: one line naming the file and what does not fit: unreadable, no state dict, missing or
            unexpected tensors (a few named, with their count), or shapes that differ (e.g. another channel count
            or number of levels).
    """
    path = str(path)
    state = clean_state_dict(_tensor_dict(load_checkpoint(path), path))
    own = network.state_dict()
    state = _from_generative_layout(state, own)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [
        f"{k}: file {tuple(v.shape)} vs network {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    name = type(network).__name__
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the {name}'s {len(own)} tensors are not in the file (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} file tensors are not in the network (e.g. {unexpected[:3]})")
        if wrong:
            parts.append(f"{len(wrong)} tensors differ in shape ({'; '.join(wrong[:3])})")
        raise CheckpointError(
            f"pretrained weights {path!r} do not fit the {name}: {'; '.join(parts)}. Is it the file of this network "
            "(the publisher's channels, levels and latent channels)?"
        )
    network.load_state_dict(state, strict=True)
    return len(state)

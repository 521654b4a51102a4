# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The autoencoder's inference network (``network_def`` of ``inference.json``)."""

from __future__ import annotations

import torch
from monai.bundle import verify_net_in_out
from monai.networks.nets import AutoencoderKL

from common.autoencoder.networks import AutoencoderKLReconstructor
from tests.helpers import BUNDLES

SETTINGS = {
    "spatial_dims": 3,
    "in_channels": 1,
    "out_channels": 1,
    "channels": (8, 16, 16),
    "latent_channels": 3,
    "num_res_blocks": 1,
    "norm_num_groups": 4,
    "attention_levels": (False, False, False),
    "with_encoder_nonlocal_attn": False,
    "with_decoder_nonlocal_attn": False,
}


def test_reconstructor_is_the_deterministic_reconstruction_of_the_autoencoder():
    torch.manual_seed(0)
    trained = AutoencoderKL(**SETTINGS).eval()
    net = AutoencoderKLReconstructor(**SETTINGS).eval()
    net.load_state_dict(trained.state_dict())  # the training network's weights load as they are
    x = torch.rand(2, 1, 16, 16, 16)
    with torch.no_grad():
        out = net(x)
        z_mu, _ = trained.encode(x)
        torch.testing.assert_close(out, trained.decode(z_mu))
        torch.testing.assert_close(net(x), out)  # no sampled latent: repeatable
    assert isinstance(out, torch.Tensor) and out.shape == x.shape


def test_network_def_passes_monai_verify_net_in_out():
    """What the model zoo's ``verify_data_shape`` runs on ``network_def`` (tiny sizes)."""
    configs = BUNDLES / "autoencoder_3d" / "configs"
    verify_net_in_out(
        net_id="network_def",
        meta_file=str(configs / "metadata.json"),
        config_file=[str(configs / "inference.json"), str(configs / "tiny.json")],
        n=1,
        any=16,
        device="cpu",
        bundle_root=str(BUNDLES / "autoencoder_3d"),  # MONAI's function parses a bare ConfigParser
    )

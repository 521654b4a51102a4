# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the training/inference network wrappers: unwrapping, state dicts, inference views, memory layouts,
gradient checkpointing and the sliding-window out-of-memory backoff."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from monai.networks.nets import VQVAE
from torch import nn

from common.bundle import bundle_names
from common.errors import OutOfMemoryBackoffError
from common.networks.wrappers import (
    BackoffSlidingWindowInferer,
    LatentDecoder,
    LatentEncoder,
    ReconstructionNetwork,
    blended_windows,
    clean_state_dict,
    enable_gradient_checkpointing,
    inference_view,
    prepare_network,
    split_autoencoder_output,
    to_memory_format,
    unwrap,
)
from tests.helpers import BUNDLES, tiny_autoencoder


def tiny_vqvae(seed: int = 0) -> VQVAE:
    torch.manual_seed(seed)
    return VQVAE(
        spatial_dims=3,
        in_channels=1,
        out_channels=1,
        channels=(8, 8),
        num_res_channels=8,
        num_res_layers=1,
        downsample_parameters=((2, 4, 1, 1), (2, 4, 1, 1)),
        upsample_parameters=((2, 4, 1, 1, 0), (2, 4, 1, 1, 0)),
        num_embeddings=16,
        embedding_dim=4,
    )


class TupleNet(nn.Module):
    """No ``reconstruct`` method: returns ``(recon, quantization_loss)`` like a VQ-VAE."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y, y.abs().mean()


class Holder(nn.Module):
    """A network with a child literally named ``module`` (like MONAI's activation-checkpoint wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(2, 2))
        self.block.module = nn.Linear(2, 3)
        self.head = nn.Sequential()
        self.head.module = nn.Linear(3, 1)


# ---------------------------------------------------------------------------------------------- state dicts
def test_clean_state_dict_strips_wrapper_prefixes():
    w, b = torch.rand(3), torch.rand(1)
    raw = {
        "module.encoder.weight": w,
        "_orig_mod.decoder.bias": b,
        "_orig_mod.module.head.weight": w,
        "module._orig_mod.head.bias": b,
        "plain.weight": w,
        "scale": b,
    }
    cleaned = clean_state_dict(raw)
    assert list(cleaned) == ["encoder.weight", "decoder.bias", "head.weight", "head.bias", "plain.weight", "scale"]
    assert cleaned["encoder.weight"] is w and cleaned["scale"] is b


def test_clean_state_dict_of_wrapped_modules_matches_plain():
    net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    wrapped = {f"module.{k}": v for k, v in net.state_dict().items()}
    assert clean_state_dict(wrapped).keys() == net.state_dict().keys()
    if hasattr(torch, "compile"):
        compiled = torch.compile(net)
        assert list(compiled.state_dict())[0].startswith("_orig_mod.")
        assert clean_state_dict(compiled.state_dict()).keys() == net.state_dict().keys()


def test_clean_state_dict_keeps_inner_submodules_named_module():
    net = Holder()
    state = net.state_dict()
    assert "block.module.weight" in state and "head.module.weight" in state
    assert clean_state_dict(state).keys() == state.keys()
    # behind DDP/compile prefixes only the prefixes go
    for prefix in ("module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module."):
        prefixed = {prefix + k: v for k, v in state.items()}
        assert clean_state_dict(prefixed).keys() == state.keys()
        Holder().load_state_dict(clean_state_dict(prefixed))
    # a compiled submodule inside a container loses its _orig_mod component
    assert list(clean_state_dict({"net._orig_mod.block.module.weight": 0})) == ["net.block.module.weight"]


def test_clean_state_dict_loads_monai_checkpoint_unet():
    from monai.networks.nets.unet import CheckpointUNet

    net = CheckpointUNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(4, 8), strides=(2,))
    state = net.state_dict()
    assert any(".module." in k for k in state)
    other = CheckpointUNet(spatial_dims=3, in_channels=1, out_channels=1, channels=(4, 8), strides=(2,))
    other.load_state_dict(clean_state_dict({f"module.{k}": v for k, v in state.items()}))
    for key, value in other.state_dict().items():
        assert torch.equal(value, state[key])


# ---------------------------------------------------------------------------------------------- outputs
def test_split_autoencoder_kl_output():
    recon, mu, sigma = torch.rand(1), torch.rand(2), torch.rand(3)
    out, extras = split_autoencoder_output((recon, mu, sigma))
    assert out is recon
    assert extras.keys() == {"z_mu", "z_sigma"}
    assert extras["z_mu"] is mu and extras["z_sigma"] is sigma


def test_split_vqvae_output():
    recon, q = torch.rand(4), torch.tensor(0.5)
    out, extras = split_autoencoder_output([recon, q])
    assert out is recon and extras == {"quantization_loss": q}


def test_split_tensor_and_dict_outputs():
    recon = torch.rand(2)
    assert split_autoencoder_output(recon) == (recon, {})
    extra = torch.rand(1)
    out, extras = split_autoencoder_output({"pred": recon, "z_mu": extra})
    assert out is recon and extras == {"z_mu": extra}
    out, extras = split_autoencoder_output({"recon": recon})
    assert out is recon and extras == {}


@pytest.mark.parametrize(
    "bad, match",
    [
        ((torch.rand(1),), "length 1"),
        ((torch.rand(1),) * 4, "length 4"),
        (3.0, "float of length n/a"),
        ({"image": torch.rand(1)}, "'pred' or 'recon'"),
    ],
)
def test_split_unsupported_output_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        split_autoencoder_output(bad)


# ---------------------------------------------------------------------------------------------- inference views
def test_reconstruction_network_matches_reconstruct_exactly():
    ae = tiny_autoencoder()
    x = torch.rand(2, 1, 16, 16, 16)
    view = ReconstructionNetwork(ae)
    with torch.no_grad():
        expected = ae.reconstruct(x)
        first = view(x)
        second = view(x)
    assert first.shape == x.shape
    assert torch.equal(first, expected)
    assert torch.equal(first, second)
    # the training forward samples the posterior, so it differs from the deterministic view
    with torch.no_grad():
        sampled, _, _ = ae(x)
    assert not torch.equal(sampled, first)


def test_reconstruction_network_without_reconstruct_uses_first_output():
    net = TupleNet()
    x = torch.rand(1, 1, 8, 8, 8)
    with torch.no_grad():
        assert torch.equal(ReconstructionNetwork(net)(x), net.conv(x))


def test_reconstruction_network_sees_through_wrappers():
    ae = tiny_autoencoder()
    x = torch.rand(1, 1, 16, 16, 16)
    wrapped = nn.DataParallel(ae)
    with torch.no_grad():
        assert torch.equal(ReconstructionNetwork(wrapped)(x), ae.reconstruct(x))


def test_latent_encoder_returns_posterior_mean():
    ae = tiny_autoencoder()
    x = torch.rand(2, 1, 16, 16, 16)
    with torch.no_grad():
        z = LatentEncoder(ae)(x)
        z_mu, _ = ae.encode(x)
    assert z.shape == (2, 2, 8, 8, 8)
    assert torch.equal(z, z_mu)
    with torch.no_grad():
        assert torch.equal(LatentEncoder(ae)(x), z)


def test_latent_encoder_quantized_latent_for_vqvae():
    vq = tiny_vqvae().eval()
    x = torch.rand(1, 1, 16, 16, 16)
    with torch.no_grad():
        z = LatentEncoder(vq)(x)
        expected = vq.encode_stage_2_inputs(x)
    assert z.shape == (1, 4, 4, 4, 4)
    assert torch.equal(z, expected)


# ---------------------------------------------------------------------------------------------- training wrappers
@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
def test_unwrap_compiled_network():
    net = nn.Linear(2, 2)
    compiled = torch.compile(net)
    assert compiled is not net
    assert unwrap(compiled) is net
    assert unwrap(net) is net
    assert unwrap(nn.DataParallel(net)) is net


def test_prepare_network_without_distribution_returns_same_module():
    net = nn.Linear(3, 2)
    assert prepare_network(net, "cpu", distributed=False) is net
    assert prepare_network(net, torch.device("cpu")) is net  # no process group: not distributed


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
def test_prepare_network_compile_wraps_lazily():
    net = nn.Linear(3, 2)
    compiled = prepare_network(net, "cpu", distributed=False, compile=True)
    assert compiled is not net and unwrap(compiled) is net


def test_prepare_network_ddp_on_single_process_group(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed without an active process group")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        net = nn.Linear(3, 2)
        reference = copy.deepcopy(net)
        ddp = prepare_network(net, "cpu")
        assert isinstance(ddp, nn.parallel.DistributedDataParallel)
        assert unwrap(ddp) is net
        assert list(ddp.state_dict())[0].startswith("module.")
        assert clean_state_dict(ddp.state_dict()).keys() == reference.state_dict().keys()
        x = torch.rand(4, 3)
        assert torch.equal(ddp(x), reference(x))
        frozen = nn.Linear(3, 2).requires_grad_(False)
        with pytest.raises(ValueError, match="no trainable parameters"):
            prepare_network(frozen, "cpu")
    finally:
        dist.destroy_process_group()


def test_inference_views_do_not_leave_the_network_in_training_mode():
    """MONAI's ``eval_mode`` calls ``train()`` afterwards on modules that were training when it started."""
    from monai.networks.utils import eval_mode

    from common.networks.wrappers import LatentDecoder, LatentEncoder, ReconstructionNetwork
    from common.vqgan.networks import VQGAN

    net = VQGAN(n_hiddens=4, downsample=(4, 4, 4), embedding_dim=4, n_codes=8, norm_num_groups=4)
    for view in (ReconstructionNetwork(net), LatentEncoder(net), LatentDecoder(net)):
        net.train()
        view = type(view)(net)
        with eval_mode(view):
            assert not net.quantizer.training
        assert not net.quantizer.training, type(view).__name__


def test_inference_view_by_mode():
    """An inference config's ``mode`` picks the view: the reconstruction, the (continuous or quantized) latent, or
    the decoded image; another mode is refused with the allowed ones."""
    vq = tiny_vqvae().eval()
    x = torch.randn(1, 1, 8, 8, 8)
    with torch.no_grad():
        assert torch.equal(inference_view(vq, "reconstruct")(x), ReconstructionNetwork(vq)(x))
        latent = inference_view(vq, "encode", quantized=False)(x)
        assert torch.equal(latent, LatentEncoder(vq, quantized=False)(x))
        assert not torch.equal(latent, inference_view(vq, "encode")(x))  # quantized to the codebook
        assert torch.equal(inference_view(vq, "decode")(latent), LatentDecoder(vq)(latent))
    with pytest.raises(ValueError, match="'mode' must be one of"):
        inference_view(vq, "segment")


# ---------------------------------------------------------------------------------------------- memory layout
def test_channels_last_3d_converts_5d_tensors_only_and_keeps_values():
    net = nn.Sequential(nn.Conv3d(2, 4, 3), nn.GroupNorm(2, 4), nn.Linear(6, 3))
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    assert to_memory_format(net, "channels_last_3d") is net
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last_3d) and not net[0].weight.is_contiguous()
    assert net[2].weight.is_contiguous()  # 2-D: unchanged
    assert all(torch.equal(v, weights[k]) for k, v in net.state_dict().items())
    x, xray = torch.randn(2, 2, 4, 5, 6), torch.randn(2, 2, 8, 8)
    converted = to_memory_format({"args": (x, None, xray)}, "channels_last_3d")
    assert converted["args"][0].is_contiguous(memory_format=torch.channels_last_3d)
    assert torch.equal(converted["args"][0], x) and converted["args"][1] is None and converted["args"][2] is xray
    assert to_memory_format(converted["args"][0], "contiguous").is_contiguous()
    with pytest.raises(ValueError, match="'memory_format' must be one of .*got 'nhwc'"):
        to_memory_format(x, "nhwc")


def test_gradient_checkpointing_is_turned_on_where_supported():
    ae = tiny_autoencoder()
    assert ae.use_checkpoint is False
    assert enable_gradient_checkpointing(ae) and ae.use_checkpoint is True
    assert not enable_gradient_checkpointing(ae)  # already on
    assert not enable_gradient_checkpointing(nn.Conv3d(1, 1, 3))  # not supported


# ---------------------------------------------------------------------------------------------- OOM backoff
class WindowLimited(nn.Module):
    """A network on a device that holds at most ``limit`` windows per call."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.calls = limit, []

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({x.shape[0]} windows)")
        self.calls.append(x.shape[0])
        return x * 2 + x.mean(dim=(1, 2, 3, 4), keepdim=True)


def test_sliding_window_inferer_halves_sw_batch_size_after_out_of_memory(caplog):
    x = torch.randn(1, 1, 20, 20, 20)
    settings = {"roi_size": (8, 8, 8), "sw_batch_size": 8, "overlap": 0.25, "mode": "gaussian"}
    expected = BackoffSlidingWindowInferer(**settings)(x, WindowLimited(limit=100))
    inferer, network = BackoffSlidingWindowInferer(**settings), WindowLimited(limit=2)
    with caplog.at_level("WARNING", logger="common.networks.wrappers"):
        out = inferer(x, network)
    assert inferer.sw_batch_size == 2 and max(network.calls) == 2
    assert "sw_batch_size halved from 8 to 4" in caplog.text and "sw_batch_size halved from 4 to 2" in caplog.text
    torch.testing.assert_close(out, expected)
    inferer(x, network)  # the next volume starts at 2 windows per call: no new failure
    assert caplog.text.count("halved") == 2


@pytest.mark.parametrize("backoff", [True, False])
def test_sliding_window_inferer_stops_when_nothing_is_left_to_reduce(backoff):
    inferer = BackoffSlidingWindowInferer(roi_size=(8, 8, 8), sw_batch_size=1 if backoff else 4, oom_backoff=backoff)
    with pytest.raises(OutOfMemoryBackoffError) as raised:
        inferer(torch.randn(1, 1, 12, 12, 12), WindowLimited(limit=0))
    expected = "nothing is left to reduce (sw_batch_size 1)" if backoff else "oom_backoff is off (sw_batch_size 4)"
    assert expected in str(raised.value) and "sliding-window inference (CUDA out of memory (" in str(raised.value)


class Recorded(nn.Module):
    """Two 3D convolutions that record the dtype and the layout of the first one's output."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 1, 3, padding=1)
        self.seen: list[tuple[torch.dtype, bool]] = []

    def forward(self, x):
        hidden = torch.relu(self.first(x))
        self.seen.append((hidden.dtype, hidden.is_contiguous(memory_format=torch.channels_last_3d)))
        return self.second(hidden)


def test_the_sliding_window_inferer_runs_each_batch_of_windows_in_its_precision_and_layout():
    """``amp`` runs the windows under the inference autocast on the CPU too (bf16 convolutions, blended into an
    fp32 volume, within bf16's rounding of fp32); ``memory_format`` puts the network and each batch of windows in
    channels-last 3D, which changes no value beyond the summation order."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 24, 24, 24)  # two channels: one would be contiguous in either layout
    settings = {"roi_size": (16, 16, 16), "sw_batch_size": 2, "overlap": 0.25, "mode": "gaussian"}
    network = Recorded().eval()
    with torch.no_grad():
        fp32 = BackoffSlidingWindowInferer(**settings)(x, network)
        assert {seen for seen in network.seen} == {(torch.float32, False)}
        network.seen.clear()
        bf16 = BackoffSlidingWindowInferer(**settings, amp="bf16")(x, network)
        assert {seen for seen in network.seen} == {(torch.bfloat16, False)}
        network.seen.clear()
        last = BackoffSlidingWindowInferer(**settings, memory_format="channels_last_3d")(x, network)
        assert {seen for seen in network.seen} == {(torch.float32, True)}
    assert fp32.dtype == bf16.dtype == last.dtype == torch.float32
    assert 0 < float((bf16 - fp32).abs().max()) <= 0.02 * float(fp32.abs().max())
    torch.testing.assert_close(last, fp32, rtol=1e-5, atol=1e-5)
    assert network.first.weight.is_contiguous(memory_format=torch.channels_last_3d)
    with pytest.raises(ValueError, match="'memory_format' must be one of"):
        BackoffSlidingWindowInferer(**settings, memory_format="nhwc")


WINDOWED = [
    b
    for b in bundle_names()
    if "BackoffSlidingWindowInferer" in json.dumps(json.loads((BUNDLES / b / "configs" / "inference.json").read_text()))
]


@pytest.mark.parametrize("bundle", WINDOWED)
def test_the_windowed_bundles_hand_their_precision_and_layout_to_the_inferer_alone(bundle):
    """``amp`` and ``memory_format`` of every ``inference.json`` that infers by sliding windows reach the inferer,
    the one place that applies them (MONAI's evaluator would autocast on CUDA only)."""
    from tests.helpers import bundle_parser

    parser = bundle_parser(bundle, ["inference.json"], amp="bf16", memory_format="channels_last_3d")
    inferer = parser.get_parsed_content("inferer")
    assert (inferer.amp, inferer.memory_format) == ("bf16", "channels_last_3d")
    assert "amp" not in parser["evaluator"]


def test_blended_windows_of_a_sampler_back_off_on_the_sampler():
    class Owner:
        sw_batch_size, oom_backoff = 4, True

    x, owner, network = torch.randn(1, 1, 16, 16, 16), Owner(), WindowLimited(limit=1)
    expected = blended_windows(x, WindowLimited(limit=100), (8, 8, 8), 4, 0.25)
    torch.testing.assert_close(blended_windows(x, network, (8, 8, 8), overlap=0.25, owner=owner), expected)
    assert owner.sw_batch_size == 1 and set(network.calls) == {1}

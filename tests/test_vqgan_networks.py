# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the 3D VQ-GAN: the EMA codebook (update, restart, initialisation, DDP sync), the encoder/decoder
shapes, decoding of code maps, and the hyperparameter checks run before a bundle builds anything."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
import torch.nn.functional as F

import common.vqgan.networks as vqgan_module
from common.bundle import call_with_settings
from common.checkpoint_io import CheckpointError
from common.errors import SettingsError
from common.vqgan.networks import VQGAN, EMAVectorQuantizer, VQGANDecoder, VQGANEncoder, downsample_levels
from common.vqgan.settings import TRAINING
from tests.helpers import REPO_ROOT, bundle_env, torchrun_cmd

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------- helpers
def _latent(vectors: torch.Tensor, batch: int, spatial: tuple[int, ...]) -> torch.Tensor:
    """Channel-first latent ``(batch, D, *spatial)`` whose flattened voxels (batch-major) are ``vectors``."""
    return vectors.reshape(batch, *spatial, vectors.shape[1]).movedim(-1, 1).contiguous()


def _flat(z: torch.Tensor) -> torch.Tensor:
    return z.movedim(1, -1).reshape(-1, z.shape[1])


def _set_codebook(q: EMAVectorQuantizer, embeddings, cluster_size, embed_sum, initialized: bool = True) -> None:
    with torch.no_grad():
        q.embeddings.copy_(torch.as_tensor(embeddings, dtype=torch.float32))
        q.cluster_size.copy_(torch.as_tensor(cluster_size, dtype=torch.float32))
        q.embed_sum.copy_(torch.as_tensor(embed_sum, dtype=torch.float32))
        q.initialized.fill_(initialized)


def _ema_oracle(cluster_size, embed_sum, counts, sums, decay: float, eps: float):
    """The class docstring's update in float64: EMA of counts and sums, then Laplace-smoothed means."""
    n_codes = len(counts)
    size = decay * torch.as_tensor(cluster_size, dtype=torch.float64) + (1 - decay) * torch.as_tensor(
        counts, dtype=torch.float64
    )
    total_sum = decay * torch.as_tensor(embed_sum, dtype=torch.float64) + (1 - decay) * torch.as_tensor(
        sums, dtype=torch.float64
    )
    total = size.sum()
    smoothed = (size + eps) / (total + n_codes * eps) * total
    return size, total_sum, total_sum / smoothed[:, None]


def _is_row_of(codes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """For each code, whether it equals (bitwise) some row of ``rows``."""
    return (codes[:, None, :] == rows[None, :, :]).all(-1).any(1)


def _sq_distances(rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Squared distances ``(N, K)`` of ``rows`` to ``codes``, in float64."""
    return ((rows.double()[:, None, :] - codes.double()[None, :, :]) ** 2).sum(-1)


def _nearest_tolerance(rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Per row, how far from the true minimum a float32 ``nearest`` may land: it ranks codes by
    ``||e||^2 - 2 x.e`` (a dot product of ``D`` terms plus two additions), each value off by at most about
    ``(D + 2)`` ulps of ``||x||^2 + max ||e||^2``; 8x that for the two values compared and margin."""
    scale = (rows.double() ** 2).sum(1) + (codes.double() ** 2).sum(1).max()
    return 8 * (codes.shape[1] + 2) * torch.finfo(torch.float32).eps * scale


def _assert_nearest(indices: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor) -> None:
    """Every index is a nearest code of its row: its float64 squared distance is the minimum, up to the float32
    rounding of ``EMAVectorQuantizer.nearest`` (so a near-tie may go either way, anything else may not)."""
    d = _sq_distances(rows, codes)
    excess = d.gather(1, indices.reshape(-1, 1).long()).squeeze(1) - d.min(1).values
    bad = excess > _nearest_tolerance(rows, codes)
    assert not bad.any(), (
        f"{int(bad.sum())} row(s) not assigned to a nearest code (max excess {float(excess.max()):.3g})"
    )


def _min_code_separation(codes: torch.Tensor) -> float:
    """Smallest squared distance between two different codes."""
    return float(_sq_distances(codes, codes).fill_diagonal_(float("inf")).min())


CODES_4 = [[0.0, 0.0], [4.0, 0.0], [0.0, 4.0], [4.0, 4.0]]


# ---------------------------------------------------------------------------------------------- EMA update
def test_ema_update_matches_the_documented_formula_by_hand():
    q = EMAVectorQuantizer(4, 2, decay=0.8, commitment_cost=0.25, eps=0.5, no_random_restart=True).train()
    _set_codebook(q, CODES_4, [2.0, 1.0, 3.0, 0.5], [[1.0, 1.0], [2.0, 0.0], [0.0, 6.0], [1.0, 2.0]])
    vectors = torch.tensor([[0.5, 0.2], [3.8, 0.1], [4.2, -0.3], [0.1, 0.3], [-0.2, 0.1], [3.9, 4.4]])
    z = _latent(vectors, 2, (3, 1, 1))
    out = q(z)
    assert out["indices"].shape == (2, 3, 1, 1)
    assert out["indices"].flatten().tolist() == [0, 1, 1, 0, 0, 3]
    # by hand: n = [3, 2, 0, 1]; s_0 = v0 + v3 + v4, s_1 = v1 + v2, s_3 = v5
    size = torch.tensor([0.8 * 2 + 0.2 * 3, 0.8 * 1 + 0.2 * 2, 0.8 * 3 + 0.0, 0.8 * 0.5 + 0.2 * 1], dtype=torch.float64)
    torch.testing.assert_close(size, torch.tensor([2.2, 1.2, 2.4, 0.6], dtype=torch.float64))
    sums = torch.tensor([[0.4, 0.6], [8.0, -0.2], [0.0, 0.0], [3.9, 4.4]], dtype=torch.float64)
    embed_sum = 0.8 * torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 6.0], [1.0, 2.0]], dtype=torch.float64) + 0.2 * sums
    smoothed = (size + 0.5) / (6.4 + 4 * 0.5) * 6.4
    embeddings = embed_sum / smoothed[:, None]
    torch.testing.assert_close(q.cluster_size.double(), size, atol=1e-6, rtol=0)
    torch.testing.assert_close(q.embed_sum.double(), embed_sum, atol=1e-6, rtol=0)
    torch.testing.assert_close(q.embeddings.double(), embeddings, atol=1e-6, rtol=0)
    # the oracle used by the other tests agrees with the hand computation
    oracle = _ema_oracle(
        [2.0, 1.0, 3.0, 0.5], [[1.0, 1.0], [2.0, 0.0], [0.0, 6.0], [1.0, 2.0]], [3, 2, 0, 1], sums, 0.8, 0.5
    )
    torch.testing.assert_close(oracle[2], embeddings)
    # the batch is quantized with the codebook it was assigned to (before the update), and only z gets the loss
    expected_q = torch.tensor(CODES_4)[[0, 1, 1, 0, 0, 3]]
    torch.testing.assert_close(_flat(out["quantized"]), expected_q)
    assert out["quantization_loss"].item() == pytest.approx(
        0.25 * ((vectors - expected_q) ** 2).mean().item(), rel=1e-6
    )
    assert out["codebook_restarts"].item() == 0.0
    assert q.usage_counts.sum().item() == 0  # training does not touch the eval histogram


def test_ema_update_is_applied_per_call():
    """Two calls compound the EMA: the second starts from the first's buffers."""
    q = EMAVectorQuantizer(4, 2, decay=0.5, eps=1e-3, no_random_restart=True).train()
    _set_codebook(q, CODES_4, [1.0, 1.0, 1.0, 1.0], CODES_4)
    z = _latent(torch.tensor([[0.2, 0.1], [3.9, 0.2], [4.1, 3.8], [3.9, 4.1]]), 1, (4, 1, 1))
    q(z)
    first = (q.cluster_size.clone(), q.embed_sum.clone(), q.embeddings.clone())
    indices = torch.cdist(_flat(z), first[2]).argmin(1)
    assert indices.tolist() == [0, 1, 3, 3]
    counts = torch.bincount(indices, minlength=4)
    sums = torch.zeros(4, 2).index_add_(0, indices, _flat(z))
    q(z)
    size, embed_sum, embeddings = _ema_oracle(first[0], first[1], counts, sums, 0.5, 1e-3)
    torch.testing.assert_close(q.cluster_size.double(), size, atol=1e-6, rtol=0)
    torch.testing.assert_close(q.embed_sum.double(), embed_sum, atol=1e-6, rtol=0)
    torch.testing.assert_close(q.embeddings.double(), embeddings, atol=1e-5, rtol=0)
    assert not torch.equal(first[2], q.embeddings)


# ---------------------------------------------------------------------------------------------- restart
RESTART_VECTORS = torch.tensor([[0.1, 0.2], [-0.3, 0.1], [0.4, -0.2], [3.7, 0.3], [4.2, 0.1], [4.5, -0.4]])


def _restart_quantizer(thres: float, no_random_restart: bool) -> EMAVectorQuantizer:
    q = EMAVectorQuantizer(4, 2, decay=0.5, restart_thres=thres, no_random_restart=no_random_restart).train()
    size = [4.0, 4.0, 0.4, 1.5]
    _set_codebook(q, CODES_4, size, torch.tensor(CODES_4) * torch.tensor(size)[:, None])
    return q


@pytest.mark.parametrize("thres, dead", [(1.0, [2, 3]), (0.5, [2]), (0.1, [])])
def test_dead_codes_and_only_them_are_reseeded_from_the_batch(thres, dead):
    torch.manual_seed(0)
    q = _restart_quantizer(thres, no_random_restart=False)
    z = _latent(RESTART_VECTORS, 1, (2, 3, 1))  # codes 0 and 1 get 3 vectors each, codes 2 and 3 none
    out = q(z)
    assert out["indices"].flatten().tolist() == [0, 0, 0, 1, 1, 1]
    counts = [3, 3, 0, 0]
    sums = torch.zeros(4, 2, dtype=torch.float64)
    sums[0], sums[1] = RESTART_VECTORS[:3].double().sum(0), RESTART_VECTORS[3:].double().sum(0)
    size, embed_sum, embeddings = _ema_oracle(
        [4.0, 4.0, 0.4, 1.5],
        torch.tensor(CODES_4) * torch.tensor([4.0, 4.0, 0.4, 1.5])[:, None],
        counts,
        sums,
        0.5,
        1e-7,
    )
    torch.testing.assert_close(size, torch.tensor([3.5, 3.5, 0.2, 0.75], dtype=torch.float64))
    live = [k for k in range(4) if k not in dead]
    assert out["codebook_restarts"].item() == float(len(dead))
    torch.testing.assert_close(q.cluster_size[live].double(), size[live], atol=1e-6, rtol=0)
    torch.testing.assert_close(q.embed_sum[live].double(), embed_sum[live], atol=1e-6, rtol=0)
    torch.testing.assert_close(q.embeddings[live].double(), embeddings[live], atol=1e-6, rtol=0)
    assert not _is_row_of(q.embeddings[live], RESTART_VECTORS).any()
    if dead:
        assert q.cluster_size[dead].tolist() == [1.0] * len(dead)
        assert _is_row_of(q.embeddings[dead], RESTART_VECTORS).all(), q.embeddings[dead]
        assert torch.equal(q.embed_sum[dead], q.embeddings[dead])
        assert len({tuple(v) for v in q.embeddings[dead].tolist()}) == len(dead)  # distinct batch vectors


def test_no_random_restart_keeps_dead_codes():
    torch.manual_seed(0)
    q = _restart_quantizer(1.0, no_random_restart=True)
    out = q(_latent(RESTART_VECTORS, 1, (2, 3, 1)))
    assert out["codebook_restarts"].item() == 0.0
    torch.testing.assert_close(q.cluster_size, torch.tensor([3.5, 3.5, 0.2, 0.75]))
    # dead codes only decay: m = 0.5 m0, N~ ~= N  ->  e ~= 0.5 m0 / N
    torch.testing.assert_close(q.embed_sum[2:], 0.5 * torch.tensor(CODES_4[2:]) * torch.tensor([0.4, 1.5])[:, None])
    assert not _is_row_of(q.embeddings, RESTART_VECTORS).any()


# ---------------------------------------------------------------------------------------------- initialisation
def _spy_ema(q: EMAVectorQuantizer, monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Record the buffers at the start of each EMA update (i.e. right after the initialisation)."""
    seen: list[dict[str, torch.Tensor]] = []
    update = q._ema_update

    def spy(flat, indices, counts):
        seen.append({k: v.clone() for k, v in q.state_dict().items()})
        return update(flat, indices, counts)

    monkeypatch.setattr(q, "_ema_update", spy)
    return seen


def test_first_training_batch_initialises_every_code_from_the_batch(monkeypatch):
    torch.manual_seed(0)
    q = EMAVectorQuantizer(8, 3, decay=0.9, eps=1e-5, no_random_restart=True).train()
    random_start = q.embeddings.clone()
    assert not bool(q.initialized)
    seen = _spy_ema(q, monkeypatch)
    z = torch.randn(2, 3, 4, 2, 2) * 3
    rows = _flat(z)
    out = q(z)
    assert bool(q.initialized) and len(seen) == 1
    init = seen[0]
    assert _is_row_of(init["embeddings"], rows).all()
    assert len({tuple(v) for v in init["embeddings"].tolist()}) == 8  # 8 different batch vectors
    assert not _is_row_of(init["embeddings"], random_start).any()
    assert torch.equal(init["embed_sum"], init["embeddings"])
    assert init["cluster_size"].tolist() == [1.0] * 8
    # the batch is then assigned to the initial codes and the EMA step is applied from there
    indices = out["indices"].flatten()
    _assert_nearest(indices, rows, init["embeddings"])
    counts = torch.bincount(indices, minlength=8)
    # distinct batch vectors (far apart compared with the rounding of nearest): each code is the only nearest code
    # of the batch vector it was copied from, so every code is used
    assert _min_code_separation(init["embeddings"]) > float(_nearest_tolerance(rows, init["embeddings"]).max())
    assert (counts >= 1).all()
    sums = torch.zeros(8, 3).index_add_(0, indices, rows)
    size, embed_sum, embeddings = _ema_oracle(init["cluster_size"], init["embed_sum"], counts, sums, 0.9, 1e-5)
    torch.testing.assert_close(q.cluster_size.double(), size, atol=1e-6, rtol=0)
    torch.testing.assert_close(q.embeddings.double(), embeddings, atol=1e-5, rtol=1e-5)
    # a second training call does not initialise again: it starts from the first update's codebook
    second = torch.randn(2, 3, 4, 2, 2) * 3
    q(second)
    assert len(seen) == 2
    torch.testing.assert_close(seen[1]["embeddings"].double(), embeddings, atol=1e-5, rtol=1e-5)
    assert not _is_row_of(seen[1]["embeddings"], _flat(second)).any()


def test_initialisation_with_fewer_vectors_than_codes_adds_small_noise(monkeypatch):
    torch.manual_seed(0)
    q = EMAVectorQuantizer(8, 4, no_random_restart=True).train()
    seen = _spy_ema(q, monkeypatch)
    rows = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0], [-5.0, 5.0, -5.0, 5.0]])
    q(_latent(rows, 1, (3, 1, 1)))
    codes = seen[0]["embeddings"]
    distances = torch.cdist(codes, rows)
    nearest = distances.argmin(1)
    assert distances.min(1).values.max() < 0.05  # noise std 0.01 / sqrt(4)
    assert distances.min(1).values.min() > 0  # perturbed copies, not the rows themselves
    assert torch.bincount(nearest, minlength=3).min() >= 2  # 8 of the 9 tiled copies: every row at least twice
    assert len({tuple(v) for v in codes.tolist()}) == 8


def test_eval_mode_neither_initialises_nor_updates_but_counts_usage():
    torch.manual_seed(0)
    q = EMAVectorQuantizer(6, 2).eval()
    before = {k: v.clone() for k, v in q.state_dict().items()}
    z = torch.randn(2, 2, 3, 2, 1)
    out = q(z)
    for key, value in q.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not bool(q.initialized)
    indices = out["indices"].flatten()
    _assert_nearest(indices, _flat(z), q.embeddings)
    expected = torch.bincount(indices, minlength=6)
    assert torch.equal(q.usage_counts, expected) and q.usage_counts.dtype == torch.long
    q(z)
    assert torch.equal(q.usage_counts, 2 * expected)
    q.reset_usage()
    assert q.usage_counts.sum().item() == 0
    assert out["codebook_restarts"].item() == 0.0


# ---------------------------------------------------------------------------------------------- perplexity
@pytest.mark.parametrize(
    "counts, expected",
    [
        ([2, 2, 0, 0], 2.0),
        ([5, 5, 5, 5, 5, 5, 5, 5], 8.0),
        ([7, 0, 0], 1.0),
        ([1, 1, 2], 2**1.5),  # p = (1/4, 1/4, 1/2): H = 1.5 bits
        ([0, 0, 0], 1.0),
    ],
)
def test_perplexity_closed_form(counts, expected):
    value = EMAVectorQuantizer.perplexity(torch.tensor(counts))
    assert value.item() == pytest.approx(expected, rel=1e-6)


LINE_CODES = torch.tensor([[10.0 * k, 0.0] for k in range(8)])


@pytest.mark.parametrize("train", [False, True])
def test_forward_statistics_on_known_assignment(train):
    q = EMAVectorQuantizer(8, 2, no_random_restart=True).train(train)
    _set_codebook(q, LINE_CODES, torch.ones(8), LINE_CODES)
    assignment = [0, 0, 1, 1, 2, 2, 2, 2]
    vectors = LINE_CODES[assignment] + 0.5
    out = q(_latent(vectors, 2, (2, 2, 1)))
    assert out["indices"].flatten().tolist() == assignment
    assert out["perplexity"].item() == pytest.approx(2**1.5, rel=1e-6)
    assert out["codebook_usage"].item() == 3 / 8


# ---------------------------------------------------------------------------------------------- straight-through
def test_straight_through_gradient_and_commitment_loss():
    torch.manual_seed(0)
    q = EMAVectorQuantizer(5, 3, commitment_cost=0.3).eval()
    q.embeddings.requires_grad_(True)  # would catch any gradient path into the codebook
    z = (torch.randn(2, 3, 2, 2, 2) * 2).requires_grad_(True)
    out = q(z)
    codes = q.embeddings.detach()[out["indices"]].movedim(-1, 1)
    torch.testing.assert_close(out["quantized"].detach(), codes)
    out["quantized"].sum().backward()
    assert torch.equal(z.grad, torch.ones_like(z))
    assert q.embeddings.grad is None
    z.grad = None
    out = q(z)
    expected = 0.3 * F.mse_loss(z.detach(), codes)
    assert out["quantization_loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    out["quantization_loss"].backward()
    torch.testing.assert_close(z.grad, 0.3 * 2 * (z.detach() - codes) / z.numel())
    assert q.embeddings.grad is None


# ---------------------------------------------------------------------------------------------- nearest / embed
def test_nearest_in_chunks_equals_brute_force(monkeypatch):
    monkeypatch.setattr(vqgan_module, "_DIST_ARGMIN_CHUNK", 7)
    gen = torch.Generator().manual_seed(3)
    q = EMAVectorQuantizer(13, 5)
    codes = torch.randn(13, 5, generator=gen)
    with torch.no_grad():
        q.embeddings.copy_(codes)
    separation = _min_code_separation(codes) ** 0.5
    assert 0.6 * separation**2 > float(_nearest_tolerance(codes * 3, codes).max())  # |vector| < 3 max |code|
    # every code used, in shuffled order: vector i is code expected[i] moved by a fifth of the smallest code
    # separation, so code expected[i] is nearer than any other by at least 0.6 x separation^2 (no near-ties)
    expected = (torch.arange(101) % 13)[torch.randperm(101, generator=gen)]
    offsets = torch.randn(101, 5, generator=gen)
    flat = codes[expected] + 0.2 * separation * offsets / offsets.norm(dim=1, keepdim=True)  # 14 chunks + 3 rows
    result = q.nearest(flat)
    assert result.dtype == torch.long and result.shape == (101,)
    assert torch.equal(result, expected)
    assert torch.equal(result, _sq_distances(flat, codes).argmin(1))  # the brute-force float64 nearest code


def test_embed_and_its_range_check():
    q = EMAVectorQuantizer(8, 2)
    _set_codebook(q, LINE_CODES, torch.ones(8), LINE_CODES)
    indices = torch.tensor([[[0, 7], [3, 3]]])
    embedded = q.embed(indices)
    assert embedded.shape == (1, 2, 2, 2)
    assert embedded[0, 0].tolist() == [[0.0, 70.0], [30.0, 30.0]]
    with pytest.raises(ValueError, match=r"code indices must be in \[0, 7\], got range \[0, 8\]"):
        q.embed(torch.tensor([[0, 8]]))
    with pytest.raises(ValueError, match=r"got range \[-1, 2\]"):
        q.embed(torch.tensor([[-1, 2]]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_codes": 1, "embedding_dim": 2}, "^'n_codes' must be >= 2, got 1"),  # the settings check's message
        ({"n_codes": 4, "embedding_dim": 2, "decay": 1.0}, r"decay must be in \(0, 1\), got 1.0"),
        ({"n_codes": 4, "embedding_dim": 2, "decay": 0.0}, "got 0.0"),
    ],
)
def test_quantizer_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EMAVectorQuantizer(**kwargs)


def test_quantizer_rejects_wrong_latent_channels():
    with pytest.raises(ValueError, match=r"expected 3 latent channels, got input of shape \(1, 2, 4, 4, 4\)"):
        EMAVectorQuantizer(4, 3)(torch.zeros(1, 2, 4, 4, 4))


# ---------------------------------------------------------------------------------------------- VQGAN
def _vqgan(downsample=(4, 4, 4), **kwargs) -> VQGAN:
    torch.manual_seed(0)
    settings = {"n_hiddens": 4, "norm_num_groups": 4, "embedding_dim": 3, "n_codes": 16, "downsample": downsample}
    return VQGAN(**{**settings, **kwargs})


@pytest.mark.parametrize(
    "downsample, latent",
    [([4, 4, 2], (4, 4, 8)), ([2, 2, 1], (8, 8, 16)), (4, (4, 4, 4)), ([1, 2, 8], (16, 8, 2))],
)
def test_vqgan_shapes_for_per_axis_downsampling(downsample, latent):
    model = _vqgan(downsample)
    x = torch.rand(1, 1, 16, 16, 16)
    assert model.downsample == (tuple(downsample) if isinstance(downsample, list) else (4, 4, 4))
    z = model.encode(x)
    assert z.shape == (1, 3, *latent)
    out = model(x)
    assert set(out) == {"pred", "quantization_loss", "perplexity", "codebook_usage", "codebook_restarts"}
    assert out["pred"].shape == x.shape
    assert model.decode(model.quantize(z)["quantized"]).shape == x.shape


def test_vqgan_encoder_gets_the_reconstruction_gradient_through_the_quantizer():
    model = _vqgan([2, 2, 2]).train()
    x = torch.rand(1, 1, 8, 8, 8)
    out = model(x)
    (out["pred"] - x).abs().mean().backward()  # no quantization loss: only the straight-through path
    grad = model.encoder.conv_first.conv.weight.grad
    assert grad is not None and grad.abs().sum() > 0


def test_decode_code_indices_equals_decode_of_the_quantized_latent():
    model = _vqgan([4, 4, 2]).eval()
    x = torch.rand(2, 1, 16, 16, 16)
    with torch.no_grad():
        z = model.encode(x)
        # the codebook: 16 of the latent's own vectors (distinct beyond the rounding of nearest), so those vectors
        # are assigned their own codes and the code map holds all 16 codes
        picks = torch.arange(0, _flat(z).shape[0], _flat(z).shape[0] // 16)[:16]
        book = _flat(z)[picks]
        _set_codebook(model.quantizer, book, torch.ones(16), book)
        assert _min_code_separation(book) > float(_nearest_tolerance(book, book).max())
        out = model.quantize(z)
        from_latent = model.decode(out["quantized"])
        from_codes = model.decode(out["indices"][:, None].float())  # as saved by encode inference
        from_long = model.decode(out["indices"])  # (B, *spatial)
        reconstructed = model.reconstruct(x)
    torch.testing.assert_close(from_codes, from_latent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_long, from_latent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reconstructed, from_latent, atol=1e-5, rtol=1e-5)
    assert torch.equal(out["indices"].flatten()[picks], torch.arange(16))


def test_decode_rejects_bad_code_maps():
    model = _vqgan([4, 4, 2]).eval()
    codes = torch.zeros(1, 1, 4, 4, 8)
    codes[0, 0, 1, 2, 3] = 2.5
    with pytest.raises(ValueError, match="non-integer values"):
        model.decode(codes)
    codes[0, 0, 1, 2, 3] = 16.0
    with pytest.raises(ValueError, match=r"code indices must be in \[0, 15\], got range \[0, 16\]"):
        model.decode(codes)
    codes[0, 0, 1, 2, 3] = -1.0
    with pytest.raises(ValueError, match=r"got range \[-1, 0\]"):
        model.decode(codes)
    with pytest.raises(ValueError, match=r"decode expects 3 latent channels or one channel of code indices, got shape"):
        model.decode(torch.zeros(1, 2, 4, 4, 8))


def test_one_channel_latent_is_a_latent_when_embedding_dim_is_one():
    model = _vqgan([2, 2, 2], embedding_dim=1).eval()
    latent = torch.full((1, 1, 4, 4, 4), 0.37)  # not an integer: fine, it is a latent
    with torch.no_grad():
        assert torch.equal(model.decode(latent), model.decoder(latent))


@pytest.mark.parametrize("downsample", [[3, 4, 4], [4, 4, 6], [0, 2, 2]])
def test_downsample_not_a_power_of_two_names_the_value(downsample):
    with pytest.raises(ValueError, match=f"got {downsample}".replace("[", r"\[").replace("]", r"\]")):
        _vqgan(downsample)
    with pytest.raises(ValueError, match="powers of two"):
        downsample_levels(downsample)


def test_downsample_levels():
    assert downsample_levels([4, 4, 2]) == [2, 2, 1]
    assert downsample_levels(8) == [3, 3, 3]
    assert downsample_levels([1, 2, 16]) == [0, 1, 4]
    assert downsample_levels([2, 4], spatial_dims=2) == [1, 2]
    with pytest.raises(ValueError, match=r"downsample needs 3 factors \(one per axis\), got \[4, 4\]"):
        downsample_levels([4, 4])


@pytest.mark.parametrize("module", [VQGAN, VQGANEncoder, VQGANDecoder])
def test_norm_groups_must_divide_every_width(module):
    # widths 6 * 2 = 12 and 6 * 4 = 24; 8 divides 24 only
    with pytest.raises(ValueError, match=r"norm_num_groups=8 must divide every feature width; widths \[12, 24\]"):
        module(n_hiddens=6, norm_num_groups=8, downsample=[4, 4, 4])
    module(n_hiddens=6, norm_num_groups=6, downsample=[4, 4, 4])  # divides both


def test_state_dict_round_trip_keeps_the_codebook_but_not_the_usage_histogram():
    model = _vqgan([2, 2, 2]).train()
    x = torch.rand(1, 1, 8, 8, 8)
    model(x)
    model(torch.rand(1, 1, 8, 8, 8))
    model.eval()
    model(x)  # fills usage_counts
    state = model.state_dict()
    codebook = {k for k in state if k.startswith("quantizer.")}
    assert codebook == {
        "quantizer.embeddings",
        "quantizer.cluster_size",
        "quantizer.embed_sum",
        "quantizer.initialized",
    }
    assert model.quantizer.usage_counts.sum() > 0
    torch.manual_seed(123)
    fresh = VQGAN(n_hiddens=4, norm_num_groups=4, embedding_dim=3, n_codes=16, downsample=[2, 2, 2])
    assert not bool(fresh.quantizer.initialized)
    assert not torch.equal(fresh.quantizer.embeddings, model.quantizer.embeddings)
    fresh.load_state_dict(state)
    fresh.eval()
    assert bool(fresh.quantizer.initialized)
    for name in ("embeddings", "cluster_size", "embed_sum"):
        assert torch.equal(getattr(fresh.quantizer, name), getattr(model.quantizer, name)), name
    assert fresh.quantizer.usage_counts.sum() == 0
    with torch.no_grad():
        assert torch.equal(fresh.reconstruct(x), model.reconstruct(x))


# ---------------------------------------------------------------------------------------------- settings checks
VALID = {
    "patch_size": [64, 64, 32],
    "downsample": [4, 4, 2],
    "n_codes": 1024,
    "discriminator_iter_start": 0,
    "intensity": {"mode": "ct", "a_min": -1000, "a_max": 1000},
    "patches_per_volume": 2,
    "micro_batch_size": 1,
    "cache_rate": 1.0,
    "replace_rate": 0.1,
    "preflight": True,
    "allow_irregular_series": False,
    "amp": "none",
    "device": "cpu",
    "memory_format": "contiguous",
}


def test_valid_settings_pass():
    assert TRAINING(**VALID) is None
    assert TRAINING(**{**VALID, "micro_batch_size": None, "intensity": None, "downsample": 4}) is None
    # an MRI config's window keys are irrelevant
    assert TRAINING(**{**VALID, "intensity": {"mode": "mri", "a_min": 5, "a_max": 1}}) is None


@pytest.mark.parametrize(
    "override, config_id, detail",
    [
        ({"patch_size": [64, 62, 32]}, "'patch_size'", "[64, 62, 32] must be divisible by"),
        ({"patch_size": [64, 60, 32], "downsample": 8}, "'patch_size'", "[8, 8, 8]"),
        ({"downsample": [4, 3, 2]}, "'downsample'", "[4, 3, 2]"),
        ({"n_codes": 1}, "'n_codes'", "got 1"),
        ({"n_codes": True}, "'n_codes'", "got True"),
        ({"discriminator_iter_start": -1}, "'discriminator_iter_start'", "got -1"),
        (
            {"intensity": {"mode": "ct", "a_min": 500, "a_max": -500}},
            "'intensity'",
            "a_min=500.0 must be < a_max=-500.0",
        ),
        ({"intensity": {"mode": "CT", "a_min": 100, "a_max": 100}}, "'intensity'", "a_min=100.0"),
        ({"patches_per_volume": 0}, "'patches_per_volume'", "got 0"),
        ({"micro_batch_size": 0}, "'micro_batch_size'", "got 0"),
        ({"cache_rate": 1.5}, "'cache_rate'", "must be a number in [0, 1] (the share of volumes cached), got 1.5"),
        ({"replace_rate": 0.0}, "'replace_rate'", "must be a number in (0, 1]"),
        ({"replace_rate": True}, "'replace_rate'", "got True"),
    ],
)
def test_each_bad_setting_names_its_config_id(override, config_id, detail):
    with pytest.raises(ValueError) as info:
        TRAINING(**{**VALID, **override})
    message = str(info.value)
    assert message.startswith("invalid VQ-GAN configuration:")
    assert config_id in message and detail in message
    assert len(message.splitlines()) == 2  # header + exactly this one problem


def test_every_problem_is_listed_in_one_message():
    with pytest.raises(ValueError) as info:
        TRAINING(
            patch_size=[64, 64, 30],
            downsample=[4, 4, 4],
            n_codes=0,
            discriminator_iter_start=-5,
            intensity={"mode": "ct", "a_min": 1, "a_max": 0},
            patches_per_volume=0,
            micro_batch_size=0,
            cache_rate=1.0,
            replace_rate=0.1,
            preflight=True,
            allow_irregular_series="no",
            amp="none",
            device="cpu",
            memory_format="contiguous",
        )
    lines = str(info.value).splitlines()
    assert len(lines) == 8 and lines[-1].strip().startswith("'allow_irregular_series' must be True or False")
    ids = ["'patch_size'", "'n_codes'", "'discriminator_iter_start'", "'intensity'", "'patches_per_volume'"]
    for config_id, line in zip([*ids, "'micro_batch_size'"], lines[1:]):
        assert line.strip().startswith(config_id), (config_id, line)


def test_call_with_settings_raises_a_settings_error_with_the_checks_message(capsys):
    with pytest.raises(SettingsError) as info:
        call_with_settings(TRAINING, **{**VALID, "n_codes": 1, "patches_per_volume": 0})
    message = str(info.value)
    assert message.startswith("invalid VQ-GAN configuration:")
    assert "'n_codes' must be >= 2, got 1" in message and "'patches_per_volume' must be >= 1, got 0" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value.__cause__, ValueError)
    assert str(info.value.__cause__) == message
    assert capsys.readouterr() == ("", "")  # library code prints nothing and does not end the process


def test_call_with_settings_passes_valid_settings_and_reports_type_errors(capsys):
    assert call_with_settings(TRAINING, **VALID) is None
    with pytest.raises(SettingsError, match="missing") as info:
        call_with_settings(TRAINING, patch_size=[64, 64, 32])  # required settings missing
    assert "'n_codes'" in str(info.value) and isinstance(info.value.__cause__, TypeError)

    def broken(**_):
        raise RuntimeError("not a settings problem")

    with pytest.raises(RuntimeError, match="not a settings problem"):  # only ValueError/TypeError are reported
        call_with_settings(broken)

    def bad_weights(**_):
        raise CheckpointError("weights do not fit")

    with pytest.raises(CheckpointError) as info:  # a user error passes as it is
        call_with_settings(bad_weights)
    assert info.value.__cause__ is None
    assert capsys.readouterr() == ("", "")


# ---------------------------------------------------------------------------------------------- DDP (torchrun)
@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """One 2-process gloo run of ``tests/ddp_codebook_worker.py``; the results of both ranks."""
    out = tmp_path_factory.mktemp("ddp_codebook")
    cmd = torchrun_cmd(2, str(REPO_ROOT / "tests" / "ddp_codebook_worker.py"), str(out))
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    errors = [(out / f"error_rank{r}.txt").read_text() for r in (0, 1)]
    return ranks, errors


def test_ddp_ema_codebook_equals_single_process_on_concatenated_batches(ddp_run):
    (r0, r1), _ = ddp_run
    from tests.ddp_codebook_worker import DECAY, DIM, N_CODES, SHAPE, STEPS

    for key in ("embeddings", "cluster_size", "embed_sum", "initialized"):
        assert torch.equal(r0["ema_buffers"][key], r1["ema_buffers"][key]), key
    assert all(not torch.equal(a, b) for a, b in zip(r0["latents"], r1["latents"]))  # ranks saw different data
    books = r0["ema_codebooks"]  # the codebook at the start of every step, then the final one
    assert len(books) == STEPS + 1
    for key in ("embeddings", "cluster_size", "embed_sum"):
        assert torch.equal(books[0][key], r0["ema_start"][key]), key
        assert torch.equal(books[-1][key], r0["ema_buffers"][key]), key
    for step in range(STEPS):
        start, end = books[step], books[step + 1]
        for key in start:  # the ranks hold the same codebook at every step
            assert torch.equal(start[key], r1["ema_codebooks"][step][key]), (step, key)
        reference = EMAVectorQuantizer(N_CODES, DIM, decay=DECAY, no_random_restart=True).train()
        _set_codebook(reference, start["embeddings"], start["cluster_size"], start["embed_sum"])
        rows = [_flat(rank["latents"][step]) for rank in (r0, r1)]
        indices = [rank["ema_indices"][step].flatten() for rank in (r0, r1)]
        for rank_rows, rank_indices in zip(rows, indices):
            # each rank assigns its own latents with nearest() on the shared codebook: the same computation here,
            # with the worker's single thread
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                assert torch.equal(rank_indices, reference.nearest(rank_rows))
            finally:
                torch.set_num_threads(threads)
            _assert_nearest(rank_indices, rank_rows, start["embeddings"])
        whole_rows, whole_indices = torch.cat(rows), torch.cat(indices)
        # a single process on the concatenated batch assigns the same codes, except where a near-tie may go either
        # way (float64 top-2 gap below 1e-4; GEMMs of other sizes round differently)
        top2 = _sq_distances(whole_rows, start["embeddings"]).topk(2, largest=False).values
        clear = top2[:, 1] - top2[:, 0] > 1e-4
        assert torch.equal(reference.nearest(whole_rows)[clear], whole_indices[clear])
        # the batch statistics of every rank are those of the whole (all-rank) batch
        counts = torch.bincount(whole_indices, minlength=N_CODES).float()
        for rank in (r0, r1):
            assert rank["ema_perplexity"][step].item() == pytest.approx(
                EMAVectorQuantizer.perplexity(counts).item(), rel=1e-6
            )
            assert rank["ema_usage"][step].item() == (counts > 0).float().mean().item()
        # the synced update is the single-process update on the whole batch with these assignments
        reference._ema_update(whole_rows, whole_indices, counts)
        assert torch.equal(end["cluster_size"], reference.cluster_size), step  # integer counts: exact
        torch.testing.assert_close(end["embed_sum"], reference.embed_sum, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(end["embeddings"], reference.embeddings, atol=1e-5, rtol=1e-5)
        sums = torch.zeros(N_CODES, DIM, dtype=torch.float64).index_add_(0, whole_indices, whole_rows.double())
        size, embed_sum, embeddings = _ema_oracle(
            start["cluster_size"], start["embed_sum"], counts, sums, DECAY, reference.eps
        )
        torch.testing.assert_close(end["cluster_size"].double(), size, atol=1e-5, rtol=0)
        torch.testing.assert_close(end["embed_sum"].double(), embed_sum, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(end["embeddings"].double(), embeddings, atol=1e-5, rtol=1e-5)
    # rank 0 alone would have ended elsewhere: its count EMA sees 16 vectors per step, the synced one 32
    per_rank = math.prod(SHAPE) // DIM
    alone = EMAVectorQuantizer(N_CODES, DIM, decay=DECAY, no_random_restart=True).train()
    _set_codebook(alone, books[0]["embeddings"], books[0]["cluster_size"], books[0]["embed_sum"])
    for z0 in r0["latents"]:
        alone(z0)
    start_total, kept = float(books[0]["cluster_size"].sum()), DECAY**STEPS
    assert alone.cluster_size.sum().item() == pytest.approx(start_total * kept + per_rank * (1 - kept), rel=1e-5)
    synced = r0["ema_buffers"]["cluster_size"].sum().item()
    assert synced == pytest.approx(start_total * kept + 2 * per_rank * (1 - kept), rel=1e-5)
    assert r0["ema_replicas"] == r1["ema_replicas"] == 4  # embeddings, cluster_size, embed_sum, initialized


def test_ddp_initialisation_and_restarts_come_from_rank0_and_keep_ranks_identical(ddp_run):
    (r0, r1), _ = ddp_run
    from tests.ddp_codebook_worker import OUTLIER

    assert not torch.equal(r0["restart_before_init"], r1["restart_before_init"])  # seed + rank
    for key in ("embeddings", "cluster_size", "embed_sum", "initialized"):
        assert torch.equal(r0["restart_buffers"][key], r1["restart_buffers"][key]), key
    assert bool(r0["restart_buffers"]["initialized"])
    assert len(r0["restart_init"]) == len(r1["restart_init"]) == 1
    init = r0["restart_init"][0]
    assert torch.equal(init, r1["restart_init"][0])
    assert _is_row_of(init, _flat(r0["latents"][0])).all()  # rank 0's batch, broadcast
    assert not _is_row_of(init, _flat(r1["latents"][0])).any()
    assert _is_row_of(torch.full((1, init.shape[1]), OUTLIER), init).all()  # all 16 vectors became codes
    assert r0["restart_counts"] == r1["restart_counts"]
    # the outlier's code is used by the outlier alone at step 1 and by nothing at step 2: restarted at step 2
    assert r0["restart_counts"][1] >= 1, r0["restart_counts"]
    assert not (r0["restart_buffers"]["embeddings"] == OUTLIER).all(1).any()
    assert r0["restart_replicas"] == r1["restart_replicas"] == 8  # two quantizers x four persistent buffers


def test_ddp_codebook_metric_reports_all_ranks(ddp_run):
    (r0, r1), _ = ddp_run
    # the eval latents are codebook vectors; distinct codes make each the only nearest code of its own vector
    book = r0["eval_buffers"]["embeddings"]
    assert _min_code_separation(book) > float(_nearest_tolerance(book, book).max())
    assert r0["eval_indices"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert r1["eval_indices"].tolist() == list(range(4, 12))
    local = r0["local_usage_counts"]
    assert local.sum().item() == 8 and (local > 0).sum().item() == 4  # rank 0 alone: usage 4 / 16
    # all ranks: counts (2, 2, 2, 2, 1 x 8, 0 x 4) -> usage 12 / 16, perplexity exp(0.5 ln 8 + 0.5 ln 16)
    for rank in (r0, r1):
        assert rank["metric_usage"] == 0.75
        assert rank["metric_perplexity"] == pytest.approx(math.sqrt(128), rel=1e-5)
    # eval mode changed no persistent buffer
    for key in ("embeddings", "cluster_size", "embed_sum"):
        assert torch.equal(r0["eval_buffers"][key], r0["restart_buffers"][key])


def test_ddp_assert_replicas_equal_names_the_differing_tensor(ddp_run):
    _, errors = ddp_run
    assert errors[0] == errors[1]  # every rank raises the same error
    assert errors[0] == "replicas differ from rank 0 in 1 tensor(s): quantizer.embed_sum (ranks [1])"


def test_reconstructor_scripts_and_matches_the_vqgan_without_updating_it():
    """The inference ``network_def``: a VQ-GAN's state dict loads as it is, ``forward`` is the eval-mode
    reconstruction through the nearest codes, it updates nothing (even in training mode) and ``torch.jit.script``
    (the model zoo's ``ckpt_export``) gives the same values."""
    from common.vqgan.networks import VQGANReconstructor

    torch.manual_seed(0)
    settings = {"n_hiddens": 8, "downsample": [4, 4, 4], "embedding_dim": 8, "n_codes": 32, "norm_num_groups": 4}
    trained = VQGAN(**settings).train()
    trained(torch.rand(2, 1, 16, 16, 16))  # initialises and updates the codebook
    reconstructor = VQGANReconstructor(**settings)
    reconstructor.load_state_dict(trained.state_dict())
    trained.eval()
    x = torch.rand(1, 1, 16, 16, 16)
    before = {k: v.clone() for k, v in reconstructor.state_dict().items()}
    with torch.no_grad():
        out = reconstructor.train()(x)
        torch.testing.assert_close(out, trained(x)["pred"])
        scripted = torch.jit.script(reconstructor.eval())
        torch.testing.assert_close(scripted(x), out)
    assert all(torch.equal(before[k], v) for k, v in reconstructor.state_dict().items())
    assert int(reconstructor.quantizer.usage_counts.sum()) == 0

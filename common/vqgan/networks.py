# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""3D VQ-GAN (TATS / MedicalDiffusion design) with an EMA codebook that restarts dead codes and stays in sync
across DDP ranks.

The encoder halves the resolution ``log2(downsample[axis])`` times per axis with stride-2 convolutions (kernel 4)
followed by pre-activation residual blocks (GroupNorm, SiLU), then projects to ``embedding_dim`` channels; the
decoder mirrors it with transposed convolutions. The quantizer keeps an exponential moving average (EMA) of the
code counts and code sums (van den Oord et al. 2017, appendix), is initialised from the encoder outputs of the
first training batch, and re-seeds codes whose EMA count falls below ``restart_thres`` from encoder outputs of the
current batch (Dhariwal et al. 2020, Jukebox). Under ``torch.distributed`` the counts and sums are all-reduced and
the initialisation and restart candidates are broadcast from rank 0, so every rank holds the same codebook
without relying on DDP buffer broadcasting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from monai.networks.blocks import Convolution
from monai.networks.nets.autoencoderkl import AEKLResBlock
from torch import nn

__all__ = [
    "EMAVectorQuantizer",
    "VQGAN",
    "VQGANReconstructor",
    "VQGANDecoder",
    "VQGANEncoder",
    "codebook_problems",
    "downsample_levels",
]

_DIST_ARGMIN_CHUNK = 4096  # rows per distance block: 4096 x n_codes floats (256 MiB at 16384 codes)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def downsample_levels(downsample: Sequence[int] | int, spatial_dims: int = 3) -> list[int]:
    """Number of stride-2 levels per axis for a per-axis ``downsample`` factor (each a power of two >= 1).

    Raises:
        ValueError: when a factor is not a positive power of two or the length does not match ``spatial_dims``.
    """
    factors = [int(downsample)] * spatial_dims if isinstance(downsample, int) else [int(d) for d in downsample]
    if len(factors) != spatial_dims:
        raise ValueError(f"downsample needs {spatial_dims} factors (one per axis), got {list(factors)}.")
    levels = []
    for f in factors:
        if f < 1 or f & (f - 1):
            raise ValueError(f"downsample factors must be powers of two >= 1, got {factors}.")
        levels.append(int(math.log2(f)))
    return levels


def _level_convolution(
    spatial_dims: int, in_channels: int, out_channels: int, strides: Sequence[int], transposed: bool
) -> Convolution:
    """Stride-2 axes use kernel 4, stride-1 axes kernel 3; padding 1 then gives exactly n/2 (or 2n) and n."""
    kernel = [4 if s == 2 else 3 for s in strides]
    return Convolution(
        spatial_dims,
        in_channels,
        out_channels,
        strides=list(strides),
        kernel_size=kernel,
        padding=1,
        output_padding=0 if transposed else None,
        is_transposed=transposed,
        conv_only=True,
    )


def _level_blocks(
    spatial_dims: int,
    channels: int,
    widths: Sequence[int],
    levels: Sequence[int],
    num_res_blocks: int,
    norm_num_groups: int,
    transposed: bool,
) -> nn.Sequential:
    """Level ``i``: a convolution from the previous width to ``widths[i]`` channels, stride 2 on the axes with more
    than ``i`` stride-2 levels (``levels``, per axis; transposed: upsampling), then ``num_res_blocks`` residual
    blocks."""
    blocks: list[nn.Module] = []
    for i, out in enumerate(widths):
        strides = [2 if lv > i else 1 for lv in levels]
        blocks.append(_level_convolution(spatial_dims, channels, out, strides, transposed=transposed))
        blocks.extend(AEKLResBlock(spatial_dims, out, norm_num_groups, 1e-6, out) for _ in range(num_res_blocks))
        channels = out
    return nn.Sequential(*blocks)


def _level_widths(
    n_hiddens: int, downsample: Sequence[int] | int, spatial_dims: int, norm_num_groups: int
) -> tuple[list[int], list[int]]:
    """The stride-2 levels per axis (:func:`downsample_levels`) and the encoder's width of each level,
    ``n_hiddens * 2**(i+1)`` (the decoder's in reverse order).

    Raises:
        ValueError: when ``norm_num_groups`` does not divide every width (``n_hiddens`` without levels).
    """
    levels = downsample_levels(downsample, spatial_dims)
    widths = [n_hiddens * 2 ** (i + 1) for i in range(max(levels))]
    bad = [c for c in widths or [n_hiddens] if c % int(norm_num_groups)]
    if bad:
        raise ValueError(
            f"norm_num_groups={norm_num_groups} must divide every feature width; widths "
            f"{sorted(set(widths or [n_hiddens]))} (n_hiddens x 2^level) include {bad[0]}."
        )
    return levels, widths


class VQGANEncoder(nn.Module):
    """Encoder of the 3D VQ-GAN: ``(B, in_channels, *S) -> (B, embedding_dim, *S / downsample)``.

    Args:
        spatial_dims: number of spatial dimensions.
        in_channels: image channels.
        n_hiddens: width of the first convolution; level ``i`` has ``n_hiddens * 2**(i+1)`` channels.
        downsample: per-axis downsampling factor (powers of two).
        embedding_dim: channels of the latent (the codebook vectors).
        num_res_blocks: residual blocks after each strided convolution.
        norm_num_groups: GroupNorm groups.
    """

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 1,
        n_hiddens: int = 16,
        downsample: Sequence[int] | int = (4, 4, 4),
        embedding_dim: int = 8,
        num_res_blocks: int = 1,
        norm_num_groups: int = 8,
    ) -> None:
        super().__init__()
        levels, widths = _level_widths(n_hiddens, downsample, spatial_dims, norm_num_groups)
        self.conv_first = Convolution(spatial_dims, in_channels, n_hiddens, kernel_size=3, conv_only=True)
        self.blocks = _level_blocks(
            spatial_dims, n_hiddens, widths, levels, num_res_blocks, norm_num_groups, transposed=False
        )
        channels = widths[-1] if widths else n_hiddens
        self.final = nn.Sequential(nn.GroupNorm(norm_num_groups, channels, eps=1e-6), nn.SiLU())
        self.pre_vq_conv = Convolution(spatial_dims, channels, embedding_dim, kernel_size=1, conv_only=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_vq_conv(self.final(self.blocks(self.conv_first(x))))


class VQGANDecoder(nn.Module):
    """Decoder of the 3D VQ-GAN: ``(B, embedding_dim, *L) -> (B, out_channels, *L * downsample)``, the mirror of
    :class:`VQGANEncoder` (the same arguments; ``out_channels``: image channels, ``downsample``: the per-axis
    upsampling factor, ``num_res_blocks`` after each transposed convolution)."""

    def __init__(
        self,
        spatial_dims: int = 3,
        out_channels: int = 1,
        n_hiddens: int = 16,
        downsample: Sequence[int] | int = (4, 4, 4),
        embedding_dim: int = 8,
        num_res_blocks: int = 1,
        norm_num_groups: int = 8,
    ) -> None:
        super().__init__()
        levels, widths = _level_widths(n_hiddens, downsample, spatial_dims, norm_num_groups)
        widths = widths[::-1]  # from the deepest level, whose width the latent is mapped to
        deepest = widths[0] if widths else n_hiddens
        self.post_vq_conv = Convolution(spatial_dims, embedding_dim, deepest, kernel_size=1, conv_only=True)
        self.first = nn.Sequential(nn.GroupNorm(norm_num_groups, deepest, eps=1e-6), nn.SiLU())
        self.blocks = _level_blocks(
            spatial_dims, deepest, widths, levels, num_res_blocks, norm_num_groups, transposed=True
        )
        channels = widths[-1] if widths else deepest
        self.conv_last = Convolution(spatial_dims, channels, out_channels, kernel_size=3, conv_only=True)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.conv_last(self.blocks(self.first(self.post_vq_conv(z))))


def codebook_problems(n_codes: int) -> list[str]:
    """The codebook's size: at least 2 codes."""
    if isinstance(n_codes, bool) or int(n_codes) < 2:
        return [f"'n_codes' must be >= 2, got {n_codes!r}."]
    return []


class EMAVectorQuantizer(nn.Module):
    """Vector quantizer with an EMA codebook, data-dependent initialisation and dead-code restart.

    ``forward(z)`` (``z``: ``(B, D, *spatial)``) returns a dict with ``quantized`` (straight-through, same shape as
    ``z``), ``quantization_loss`` (``commitment_cost * ||z - sg(e)||^2``; the codebook itself is learnt by the EMA,
    not by gradients), ``indices`` (``(B, *spatial)``), and the batch statistics ``perplexity`` and
    ``codebook_usage`` (fraction of codes used by this batch; all ranks' assignments under DDP) and
    ``codebook_restarts`` (codes re-seeded by this call).

    Training-mode update per call, with ``n_k`` the number of vectors assigned to code ``k`` and ``s_k`` their
    sum (both summed over ranks)::

        N_k <- decay N_k + (1 - decay) n_k;   m_k <- decay m_k + (1 - decay) s_k
        e_k <- m_k / N~_k,   N~_k = (N_k + eps) / (sum N + K eps) * sum N   (Laplace smoothing)

    then every code with ``N_k < restart_thres`` (unless ``no_random_restart``) is re-seeded: ``e_k = m_k = x``
    for a random encoder output ``x`` of the batch (chosen on rank 0 and broadcast), ``N_k = 1``. The first
    training call instead initialises all codes from random encoder outputs. In eval mode nothing changes except
    ``usage_counts``, a histogram of assigned codes that evaluation metrics read and reset.

    Args:
        n_codes: codebook size (>= 2).
        embedding_dim: code dimension.
        decay: EMA decay (MedicalDiffusion/TATS use 0.99).
        commitment_cost: weight of the commitment loss (0.25).
        restart_thres: EMA count below which a code is dead.
        no_random_restart: turn the restart off.
        eps: Laplace smoothing constant.
    """

    def __init__(
        self,
        n_codes: int,
        embedding_dim: int,
        decay: float = 0.99,
        commitment_cost: float = 0.25,
        restart_thres: float = 1.0,
        no_random_restart: bool = False,
        eps: float = 1e-7,
    ) -> None:
        super().__init__()
        problems = codebook_problems(n_codes)
        if problems:
            raise ValueError(problems[0])
        if not 0.0 < float(decay) < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay!r}.")
        self.n_codes = int(n_codes)
        self.embedding_dim = int(embedding_dim)
        self.decay = float(decay)
        self.commitment_cost = float(commitment_cost)
        self.restart_thres = float(restart_thres)
        self.no_random_restart = bool(no_random_restart)
        self.eps = float(eps)
        self.argmin_chunk = _DIST_ARGMIN_CHUNK  # rows per distance computation (an attribute: it scripts)
        self.register_buffer("embeddings", torch.randn(self.n_codes, self.embedding_dim))
        self.register_buffer("cluster_size", torch.zeros(self.n_codes))
        self.register_buffer("embed_sum", self.embeddings.clone())
        self.register_buffer("initialized", torch.tensor(False))
        self.register_buffer("usage_counts", torch.zeros(self.n_codes, dtype=torch.long), persistent=False)

    # ------------------------------------------------------------------ helpers
    def _candidates(self, flat: torch.Tensor) -> torch.Tensor:
        """``n_codes`` random rows of ``flat`` (tiled with small noise when there are fewer), rank 0's on all ranks."""
        rows = flat
        if rows.shape[0] < self.n_codes:
            repeats = math.ceil(self.n_codes / rows.shape[0])
            std = 0.01 / math.sqrt(rows.shape[1])
            rows = rows.repeat(repeats, 1)
            rows = rows + torch.randn_like(rows) * std
        picked = rows[torch.randperm(rows.shape[0], device=rows.device)[: self.n_codes]].contiguous()
        if _distributed():
            dist.broadcast(picked, src=0)
        return picked

    @torch.no_grad()
    def _initialise(self, flat: torch.Tensor) -> None:
        """Every code from random rows of ``flat`` if the codebook is not initialised yet, else nothing.

        Decided on the device (``torch.where`` on ``initialized``), not by reading the flag back: a training step
        then neither waits for the GPU nor breaks a ``torch.compile`` graph, at the cost of one candidate draw per
        step (``n_codes`` rows, the size of the restart's)."""
        fresh = ~self.initialized
        candidates = self._candidates(flat)
        self.embeddings.copy_(torch.where(fresh, candidates, self.embeddings))
        self.embed_sum.copy_(torch.where(fresh, candidates, self.embed_sum))
        self.cluster_size.copy_(torch.where(fresh, torch.ones_like(self.cluster_size), self.cluster_size))
        self.initialized.fill_(True)

    @torch.no_grad()
    def nearest(self, flat: torch.Tensor) -> torch.Tensor:
        """Index of the nearest code for each row of ``flat`` (``(N, D)``), computed in chunks to bound memory."""
        return self._nearest(flat)

    def _nearest(self, flat: torch.Tensor) -> torch.Tensor:
        codes = self.embeddings.float()
        code_sq = (codes**2).sum(1)
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for start in range(0, flat.shape[0], self.argmin_chunk):
            chunk = flat[start : start + self.argmin_chunk].float()
            # ||x||^2 is the same for every code of a row, so argmin(||e||^2 - 2 x.e) is the nearest code
            out[start : start + chunk.shape[0]] = torch.addmm(code_sq, chunk, codes.t(), alpha=-2).argmin(1)
        return out

    @torch.no_grad()
    def _ema_update(self, flat: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """EMA step and restarts; returns the number of re-seeded codes as a tensor (no host synchronisation)."""
        sums = torch.zeros_like(self.embed_sum).index_add_(0, indices, flat.float())
        if _distributed():
            dist.all_reduce(sums)
        self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.embed_sum.mul_(self.decay).add_(sums, alpha=1 - self.decay)
        total = self.cluster_size.sum()
        smoothed = (self.cluster_size + self.eps) / (total + self.n_codes * self.eps) * total
        self.embeddings.copy_(self.embed_sum / smoothed.unsqueeze(1))
        if self.no_random_restart:
            return torch.zeros((), device=flat.device)
        candidates = self._candidates(flat.float())  # collective: every rank draws, rank 0's are used
        dead = self.cluster_size < self.restart_thres
        self.embeddings.copy_(torch.where(dead.unsqueeze(1), candidates, self.embeddings))
        self.embed_sum.copy_(torch.where(dead.unsqueeze(1), candidates, self.embed_sum))
        self.cluster_size.masked_fill_(dead, 1.0)
        return dead.sum().float()

    @staticmethod
    def perplexity(counts: torch.Tensor) -> torch.Tensor:
        """``exp(H(p))`` of the code histogram ``counts`` (the effective number of codes in use)."""
        probs = counts.float() / counts.sum().clamp_min(1)
        return torch.exp(-(probs * torch.log(probs + 1e-10)).sum())

    def reset_usage(self) -> None:
        """Zero the eval-mode code histogram."""
        self.usage_counts.zero_()

    def embed(self, indices: torch.Tensor) -> torch.Tensor:
        """Codebook vectors for ``indices`` ``(B, *spatial)``, channel first: ``(B, D, *spatial)``."""
        indices = indices.long()
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.n_codes):
            raise ValueError(
                f"code indices must be in [0, {self.n_codes - 1}], got range "
                f"[{int(indices.min())}, {int(indices.max())}]."
            )
        return F.embedding(indices, self.embeddings).movedim(-1, 1)

    def lookup(self, z: torch.Tensor) -> torch.Tensor:
        """``z`` ``(B, D, *spatial)`` replaced by its nearest codes, with no update of anything: what
        :meth:`forward` quantizes in eval mode, in tensors only, so that it scripts (TorchScript)."""
        flat = z.movedim(1, -1).reshape(-1, self.embedding_dim)
        quantized = self.embeddings[self._nearest(flat.detach())].to(z.dtype)
        shape = [z.shape[0]] + list(z.shape[2:]) + [self.embedding_dim]
        return quantized.reshape(shape).movedim(-1, 1)

    # ------------------------------------------------------------------ forward
    @torch.jit.unused
    def forward(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        if hasattr(z, "as_tensor"):  # a MetaTensor: its batched metadata cannot follow the flattening
            z = z.as_tensor()
        if z.shape[1] != self.embedding_dim:
            raise ValueError(f"expected {self.embedding_dim} latent channels, got input of shape {tuple(z.shape)}.")
        flat = z.movedim(1, -1).reshape(-1, self.embedding_dim)
        if self.training:
            self._initialise(flat.detach().float())
        indices = self.nearest(flat.detach())
        # a histogram of static shape (bincount's length depends on the values: it breaks a compiled graph)
        counts = torch.zeros(self.n_codes, device=z.device).index_add_(
            0, indices, torch.ones_like(indices, dtype=torch.float)
        )
        if _distributed() and self.training:
            dist.all_reduce(counts)
        quantized_flat = self.embeddings[indices].to(z.dtype)
        quantized = quantized_flat.reshape(*z.shape[:1], *z.shape[2:], self.embedding_dim).movedim(-1, 1)
        loss = self.commitment_cost * F.mse_loss(z.float(), quantized.detach().float())
        restarts = torch.zeros((), device=z.device)
        if self.training:
            restarts = self._ema_update(flat.detach(), indices, counts)
        else:
            self.usage_counts += counts.long()
        return {
            "quantized": z + (quantized - z).detach(),
            "quantization_loss": loss,
            "indices": indices.reshape(z.shape[0], *z.shape[2:]),
            "perplexity": self.perplexity(counts),
            "codebook_usage": (counts > 0).float().mean(),
            "codebook_restarts": restarts,
        }


class VQGAN(nn.Module):
    """3D VQ-GAN generator: encoder, EMA vector quantizer and decoder.

    ``forward(x)`` returns a dict: ``pred`` (reconstruction), ``quantization_loss``, and the codebook statistics
    ``perplexity``, ``codebook_usage``, ``codebook_restarts`` (see :class:`EMAVectorQuantizer`). Whole volumes are
    handled by sliding windows outside the network (``reconstruct``/``encode``/``decode`` on patches).

    Args:
        spatial_dims: number of spatial dimensions.
        in_channels: image channels.
        out_channels: reconstructed channels.
        n_hiddens: encoder/decoder base width.
        downsample: per-axis downsampling factor (powers of two), e.g. ``[4, 4, 4]``.
        embedding_dim: code dimension.
        n_codes: codebook size.
        num_res_blocks: residual blocks per level.
        norm_num_groups: GroupNorm groups.
        decay, commitment_cost, restart_thres, no_random_restart: see :class:`EMAVectorQuantizer`.
    """

    def __init__(
        self,
        spatial_dims: int = 3,
        in_channels: int = 1,
        out_channels: int = 1,
        n_hiddens: int = 16,
        downsample: Sequence[int] | int = (4, 4, 4),
        embedding_dim: int = 8,
        n_codes: int = 16384,
        num_res_blocks: int = 1,
        norm_num_groups: int = 8,
        decay: float = 0.99,
        commitment_cost: float = 0.25,
        restart_thres: float = 1.0,
        no_random_restart: bool = False,
    ) -> None:
        super().__init__()
        levels = downsample_levels(downsample, spatial_dims)
        self.downsample = tuple(2**lv for lv in levels)
        self.encoder = VQGANEncoder(
            spatial_dims, in_channels, n_hiddens, downsample, embedding_dim, num_res_blocks, norm_num_groups
        )
        self.quantizer = EMAVectorQuantizer(
            n_codes, embedding_dim, decay, commitment_cost, restart_thres, no_random_restart
        )
        self.decoder = VQGANDecoder(
            spatial_dims, out_channels, n_hiddens, downsample, embedding_dim, num_res_blocks, norm_num_groups
        )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Continuous (pre-quantization) latent of ``x``."""
        return self.encoder(x)

    def quantize(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize a continuous latent (see :class:`EMAVectorQuantizer`)."""
        return self.quantizer(z)

    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Decode quantized latents ``(B, embedding_dim, ...)`` or code indices ``(B, 1, ...)``/``(B, ...)``.

        A one-channel float map is read as code indices when ``embedding_dim > 1`` (as saved by ``encode``
        inference); values must then be integers in ``[0, n_codes)``.
        """
        dim = self.quantizer.embedding_dim
        if latent.ndim == self.decoder_ndim - 1 or (latent.shape[1] == 1 and dim != 1):
            codes = latent[:, 0] if latent.ndim == self.decoder_ndim else latent
            rounded = torch.round(codes.float())
            if not torch.equal(rounded, codes.float()):
                raise ValueError("a one-channel latent is read as code indices, but it holds non-integer values.")
            latent = self.quantizer.embed(rounded.long())
        elif latent.shape[1] != dim:
            raise ValueError(
                f"decode expects {dim} latent channels or one channel of code indices, got shape {tuple(latent.shape)}."
            )
        return self.decoder(latent.to(self.quantizer.embeddings.dtype))

    @property
    def decoder_ndim(self) -> int:
        return len(self.downsample) + 2

    def encode_stage_2_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Quantized latent of ``x`` (what a latent diffusion model trains on)."""
        return self.quantize(self.encode(x))["quantized"]

    def reconstruct(self, x: torch.Tensor) -> torch.Tensor:
        """Encode, quantize and decode ``x``."""
        return self.decoder(self.encode_stage_2_inputs(x))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.quantize(self.encode(x))
        recon = self.decoder(out.pop("quantized"))
        out.pop("indices")
        return {"pred": recon, **out}


class VQGANReconstructor(VQGAN):
    """The VQ-GAN as a single-tensor reconstruction network, what an inference config's ``network_def`` is (the
    model zoo builds it, loads ``model.pt`` and checks and exports it): ``forward(x)`` encodes, replaces the latent
    by its nearest codes (:meth:`EMAVectorQuantizer.lookup`, no codebook update) and decodes, so it scripts
    (TorchScript), traces and exports to ONNX. Same arguments and state dict as :class:`VQGAN`, whose training
    methods (``forward`` with the codebook statistics) it keeps under their other names."""

    __jit_unused_properties__ = ["decoder_ndim"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.decoder(self.quantizer.lookup(self.encoder(x)))

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""One ignite trainer for autoencoder-GANs (AutoencoderKL VAE-GAN, VQ-GAN) built on ``monai.engines.Trainer``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from monai.engines.utils import IterationEvents
from monai.utils import CommonKeys as Keys
from torch import nn
from torch.optim import Optimizer

from common.autoencoder.adversarial import PatchAdversarialLoss, feature_matching_loss
from common.autoencoder.losses import kl_divergence
from common.engines.trainer import StepTrainer, accumulate
from common.networks.wrappers import split_autoencoder_output, to_memory_format, unwrap
from common.utils import autocast

__all__ = ["AutoencoderGANTrainer", "frozen", "prepare_image_batch", "warmup_problems"]


def warmup_problems(adv_warmup_iterations: int) -> list[str]:
    """The adversarial warm-up (iterations before the discriminator trains and its loss counts): an integer >= 0."""
    if isinstance(adv_warmup_iterations, int) and not isinstance(adv_warmup_iterations, bool):
        if adv_warmup_iterations >= 0:
            return []
    return [f"'adv_warmup_iterations' must be an integer >= 0 (iterations), got {adv_warmup_iterations!r}."]


def prepare_image_batch(
    batchdata: dict[str, torch.Tensor], device: torch.device | str | None = None, non_blocking: bool = False, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch preparation for reconstruction: the image is both input and target (key ``image``).

    MetaTensors become plain tensors: metadata is not needed inside the step and its dispatch overhead is not
    free, and ``torch.compile`` needs plain tensors.
    """
    image = batchdata[Keys.IMAGE] if isinstance(batchdata, dict) else batchdata
    if hasattr(image, "as_tensor"):
        image = image.as_tensor()
    image = image.to(device=device, non_blocking=non_blocking, **kwargs)
    return image, image


@contextlib.contextmanager
def frozen(module: nn.Module):
    """Temporarily stop gradients to ``module``'s parameters (gradients still flow to its input)."""
    flags = [p.requires_grad for p in module.parameters()]
    for p in module.parameters():
        p.requires_grad_(False)
    try:
        yield module
    finally:
        for p, flag in zip(module.parameters(), flags):
            p.requires_grad_(flag)


class AutoencoderGANTrainer(StepTrainer):
    """Trains an autoencoder with reconstruction, latent regularisation and optional adversaries.

    Each iteration runs a generator step (``recon_weight`` x reconstruction loss + ``kl_weight`` x KL for
    ``(recon, z_mu, z_sigma)`` outputs, + ``quantization_weight`` x the codebook loss for
    ``(recon, quantization_loss)`` or ``{"pred", "quantization_loss", ...}`` outputs, + ``perceptual_weight`` x
    perceptual loss, + the adversarial terms once ``adv_warmup_iterations`` iterations have passed) and then, after
    the warm-up, a discriminator step. Mixed precision (``bf16`` or ``fp16`` with a GradScaler), gradient
    accumulation over iterations, micro-batching within an iteration and gradient-norm clipping apply to both.

    The discriminator may return one logit map (or MONAI ``PatchDiscriminator``'s list of feature maps whose last
    entry is the logit map), or a mapping of named heads (e.g. ``{"image": [...], "video": [...]}`` from
    :class:`common.autoencoder.discriminators.SliceVolumeDiscriminator`); ``adv_weight`` is then a mapping of per-head
    weights (a head with weight 0 is skipped in both steps). A discriminator with ``sample_views(x)`` (random
    slices) gets the same views for the real and the reconstructed batch. ``feature_matching_weight`` adds the
    L1 distance between discriminator features of real and reconstructed inputs (TATS' ``gan_feat_weight``).

    ``micro_batch_size`` splits each batch (e.g. ``batch_size x patches_per_volume`` patches) into chunks that are
    forwarded and back-propagated one at a time with loss weights ``len(chunk) / len(batch)``, so the update
    equals the full-batch update (exactly for networks without batch statistics) at the memory of one chunk;
    under DDP only the last chunk all-reduces.

    ``engine.state.output`` holds detached tensors (decollated into one dict per sample by default, the MONAI
    convention that MONAI's handlers, e.g. ``--tracking mlflow``, expect; scalar terms stay tensors): ``image``,
    ``pred`` (reconstruction), ``loss`` (generator total), the unweighted terms ``recon_loss``,
    ``kl_loss``/``quantization_loss``, ``perceptual_loss``, ``feature_matching_loss``, ``adv_loss`` (with per-head
    weights: their weighted sum, and ``adv_loss_<head>``), ``d_loss``, scalar statistics the network returns (``perplexity``, ``codebook_usage``, ...) and the per-step
    ``grad_norm``/``d_grad_norm`` when clipping is on. ``IterationEvents`` fire after the generator forward, loss
    (of the last micro-batch), backward and after the whole step.

    Args:
        network: the autoencoder as called for training (may be DDP/compile-wrapped).
        optimizer: generator optimizer.
        recon_loss: pixel loss between reconstruction and input (default L1).
        discriminator: see above; ``None`` trains a plain autoencoder.
        d_optimizer: discriminator optimizer (required with a discriminator).
        adv_loss: adversarial criterion called as ``adv_loss(logits, target_is_real, for_discriminator)``;
            default ``common.autoencoder.adversarial.PatchAdversarialLoss(criterion="least_squares")`` (MONAI's,
            with its labels made on the device).
        adv_weight: weight of the generator's adversarial term, or a mapping head name -> weight.
        adv_warmup_iterations: iterations (not optimizer steps) trained without any adversarial term or
            discriminator step (TATS' ``discriminator_iter_start``).
        feature_matching_weight: weight of the discriminator feature-matching term.
        recon_weight: weight of the reconstruction term (TATS' ``l1_weight``).
        kl_weight: weight of the KL term for variational autoencoders.
        quantization_weight: weight of the codebook/commitment loss returned by VQ-VAE style networks.
        perceptual_loss: optional perceptual criterion ``loss(pred, target)``.
        perceptual_weight: its weight (the loss is skipped when 0 or ``perceptual_loss`` is ``None``).
        settings: ``device``, ``max_epochs``, ``train_data_loader``, ``amp``, ``accumulation_steps``, ``grad_clip``
            (for both networks), ``nonfinite``, ``micro_batch_size``, ``compile`` (the generator and the
            discriminator step are one graph each: :meth:`generator_loss`, :meth:`discriminator_loss`),
            ``memory_format``, ``oom_backoff`` (each step redone on its own: the discriminator's after an applied
            generator step) and the other settings of :class:`StepTrainer`; ``prepare_batch`` defaults to
            :func:`prepare_image_batch`.
    """

    default_prepare_batch = staticmethod(prepare_image_batch)

    def __init__(
        self,
        network: nn.Module,
        optimizer: Optimizer,
        recon_loss: Callable | None = None,
        discriminator: nn.Module | None = None,
        d_optimizer: Optimizer | None = None,
        adv_loss: Callable | None = None,
        adv_weight: float | Mapping[str, float] = 0.01,
        adv_warmup_iterations: int = 0,
        feature_matching_weight: float = 0.0,
        recon_weight: float = 1.0,
        kl_weight: float = 1e-7,
        quantization_weight: float = 1.0,
        perceptual_loss: Callable | None = None,
        perceptual_weight: float = 0.0,
        **settings: Any,
    ) -> None:
        if discriminator is not None and d_optimizer is None:
            raise ValueError("a discriminator was given without d_optimizer.")
        super().__init__(network=network, optimizer=optimizer, **settings)
        self.recon_loss = recon_loss if recon_loss is not None else nn.L1Loss()
        self.discriminator = discriminator
        self.d_optimizer = d_optimizer
        if adv_loss is None and discriminator is not None:
            adv_loss = PatchAdversarialLoss(criterion="least_squares")
        self.adv_loss = adv_loss
        self.adv_weight = dict(adv_weight) if isinstance(adv_weight, Mapping) else float(adv_weight)
        problems = warmup_problems(adv_warmup_iterations)
        if problems:
            raise ValueError(problems[0])
        self.adv_warmup_iterations = adv_warmup_iterations
        self.feature_matching_weight = float(feature_matching_weight)
        self.recon_weight = float(recon_weight)
        self.kl_weight = float(kl_weight)
        self.quantization_weight = float(quantization_weight)
        self.perceptual_loss = perceptual_loss
        self.perceptual_weight = float(perceptual_weight)

    # ------------------------------------------------------------------ helpers
    def _head_weights(self, heads: Mapping[str, Any]) -> dict[str, float]:
        """Per-head weights inside ``adv_loss``: the mapping's values, or 1 for a scalar ``adv_weight`` (which then
        weights ``adv_loss`` as a whole, so that ``adv_loss`` stays the unweighted term of a single head)."""
        if isinstance(self.adv_weight, Mapping):
            return {name: float(self.adv_weight.get(name, 0.0)) for name in heads}
        return dict.fromkeys(heads, 1.0)

    @staticmethod
    def _heads(out: Any) -> dict[str, Any]:
        """Discriminator output as named heads: a mapping stays as is, a tensor/list is the single head ``adv``."""
        return dict(out) if isinstance(out, Mapping) else {"adv": out}

    @staticmethod
    def _views(discriminator: nn.Module, real: torch.Tensor) -> dict[str, Any]:
        """Shared random views (e.g. slice indices) for discriminators that draw them (``sample_views``)."""
        sample = getattr(unwrap(discriminator), "sample_views", None)
        return {"views": sample(real)} if sample is not None else {}

    def adversarial_active(self, iteration: int | None = None) -> bool:
        """Whether the adversarial terms are on at ``iteration`` (default: the current one)."""
        iteration = self.state.iteration if iteration is None else iteration
        weights = self.adv_weight.values() if isinstance(self.adv_weight, Mapping) else [self.adv_weight]
        return (
            self.discriminator is not None
            and any(float(w) > 0 for w in weights)
            and iteration > self.adv_warmup_iterations
        )

    # ------------------------------------------------------------------ iteration
    def _generator_terms(
        self,
        recon: torch.Tensor,
        targets: torch.Tensor,
        extras: dict[str, torch.Tensor],
        adversarial: bool,
        views: dict[str, Any],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Loss terms of the generator (unweighted, except ``adv_loss``: the weighted sum over heads) and the
        auxiliary statistics the network returned (e.g. codebook perplexity)."""
        terms = {"recon_loss": self.recon_loss(recon.float(), targets.float())}
        stats = {}
        for key, value in extras.items():
            if key == "z_mu":
                terms["kl_loss"] = kl_divergence(extras["z_mu"], extras["z_sigma"])
            elif key == "quantization_loss":
                terms["quantization_loss"] = value.float().mean()
            elif key != "z_sigma" and isinstance(value, torch.Tensor) and value.numel() == 1:
                stats[key] = value.detach().float().reshape(())
        if self.perceptual_loss is not None and self.perceptual_weight > 0:
            terms["perceptual_loss"] = self.perceptual_loss(recon.float(), targets.float())
        if adversarial:
            raw = unwrap(self.discriminator)  # the raw module, frozen by the caller
            fake = self._heads(raw(to_memory_format(recon, self.memory_format), **views))
            weights = self._head_weights(fake)
            head_losses = {
                h: self.adv_loss(self._logits(fake[h]), target_is_real=True, for_discriminator=False)
                for h, w in weights.items()
                if w > 0
            }
            terms["adv_loss"] = sum(weights[h] * loss for h, loss in head_losses.items())
            if len(head_losses) > 1 or isinstance(self.adv_weight, Mapping):
                stats.update({f"adv_loss_{h}": loss.detach().float() for h, loss in head_losses.items()})
            if self.feature_matching_weight > 0:
                with torch.no_grad():
                    real = self._heads(raw(to_memory_format(targets, self.memory_format), **views))
                terms["feature_matching_loss"] = sum(
                    feature_matching_loss(fake[h], real[h]) for h, w in weights.items() if w > 0
                )
        return terms, stats

    def generator_loss(
        self, x: torch.Tensor, y: torch.Tensor, adversarial: bool, views: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The compiled region of the generator step: ``(recon, loss, terms, stats)`` of one micro-batch ``x``
        (target ``y``), the discriminator's ``views`` drawn outside. With ``adversarial`` the discriminator must be
        frozen by the caller (``requires_grad`` changes break a graph)."""
        with autocast(self.state.device, self.amp_mode):
            recon, extras = split_autoencoder_output(self.inferer(x, self.network))
            terms, stats = self._generator_terms(recon, y, extras, adversarial, views)
        loss = sum(self._term_weights[name] * value for name, value in terms.items())
        return recon, loss, terms, stats

    def discriminator_loss(self, x: torch.Tensor, recon: torch.Tensor, views: dict[str, Any]) -> torch.Tensor:
        """The compiled region of the discriminator step: its loss on one micro-batch of real ``x`` and detached
        reconstructions ``recon``."""
        with autocast(self.state.device, self.amp_mode):
            fake = self._heads(self.discriminator(to_memory_format(recon, self.memory_format), **views))
            real = self._heads(self.discriminator(to_memory_format(x, self.memory_format), **views))
            return sum(
                0.5
                * (
                    self.adv_loss(self._logits(fake[h]), target_is_real=False, for_discriminator=True)
                    + self.adv_loss(self._logits(real[h]), target_is_real=True, for_discriminator=True)
                )
                for h, w in self._head_weights(fake).items()
                if w > 0
            )

    @property
    def _term_weights(self) -> dict[str, float]:
        return {
            "recon_loss": self.recon_weight,
            "kl_loss": self.kl_weight,
            "quantization_loss": self.quantization_weight,
            "perceptual_loss": self.perceptual_weight,
            "adv_loss": 1.0 if isinstance(self.adv_weight, Mapping) else self.adv_weight,
            "feature_matching_loss": self.feature_matching_weight,
        }

    def _generator_pass(
        self, engine: AutoencoderGANTrainer, inputs: torch.Tensor, targets: torch.Tensor, size: int | None, sync: bool
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of the generator in micro-batches of ``size``: the batch means of its terms
        (``loss`` included) and the detached reconstructions, micro-batch by micro-batch."""
        output = engine.state.output
        adversarial = self.adversarial_active(engine.state.iteration)
        step = self.compiled("generator", self.generator_loss)
        size = size or inputs.shape[0]
        sums: dict[str, torch.Tensor] = {}
        recons = []
        chunks = list(zip(inputs.split(size), targets.split(size)))
        # the raw, frozen discriminator: the generator step must neither all-reduce nor accumulate its gradients
        with frozen(unwrap(self.discriminator)) if adversarial else contextlib.nullcontext():
            for i, (x, y) in enumerate(chunks):
                last = i == len(chunks) - 1
                fraction = x.shape[0] / inputs.shape[0]
                views = self._views(self.discriminator, y) if adversarial else {}
                with self._sync_context(engine.network, sync and last):
                    recon, g_loss, terms, stats = step(x, y, adversarial, views)
                    if last:
                        output[Keys.PRED] = recon
                        engine.fire_event(IterationEvents.FORWARD_COMPLETED)
                        output[Keys.LOSS] = g_loss
                        engine.fire_event(IterationEvents.LOSS_COMPLETED)
                    self._backward(g_loss, fraction)
                accumulate(sums, {**terms, **stats, "loss": g_loss}, fraction)
                recons.append(recon.detach())
        return sums, recons

    def _discriminator_pass(
        self, inputs: torch.Tensor, recon: torch.Tensor, size: int | None, sync: bool
    ) -> torch.Tensor:
        """Forward and backward of the discriminator in micro-batches of ``size``: its batch-mean loss."""
        step = self.compiled("discriminator", self.discriminator_loss)
        size = size or inputs.shape[0]
        chunks = list(zip(inputs.split(size), recon.split(size)))
        total: dict[str, torch.Tensor] = {}
        for i, (x, fake) in enumerate(chunks):
            last = i == len(chunks) - 1
            fraction = x.shape[0] / inputs.shape[0]
            with self._sync_context(self.discriminator, sync and last):
                d_loss = step(x, fake, self._views(self.discriminator, x))
                self._backward(d_loss, fraction)
            accumulate(total, {"d_loss": d_loss}, fraction)
        return total["d_loss"]

    def _iteration(self, engine: AutoencoderGANTrainer, batchdata: dict[str, torch.Tensor]) -> dict[str, Any]:
        if batchdata is None:
            raise ValueError("Must provide batch data for current iteration.")
        inputs, targets = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking, **engine.to_kwargs)
        inputs, targets = to_memory_format((inputs, targets), self.memory_format)
        self.log_effective_batch(inputs.shape[0])
        zero_grad, do_step = self._accumulation_flags(engine)
        adversarial = self.adversarial_active(engine.state.iteration)
        output: dict[str, Any] = {Keys.IMAGE: inputs, Keys.LABEL: targets}
        engine.state.output = output
        batch = inputs.shape[0]

        # generator step, micro-batch by micro-batch; gradients are all-reduced with the last one only
        sums, recons = self.with_backoff(
            "generator",
            engine.network,
            engine.optimizer,
            zero_grad,
            batch,
            lambda size: self._generator_pass(engine, inputs, targets, size, do_step),
        )
        engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
        recon = torch.cat(recons) if len(recons) > 1 else recons[0]
        losses = {name: value for name, value in sums.items() if name.endswith("loss")}
        g_step = do_step and self._finite_or_skip(engine, losses, [engine.optimizer], engine.network)
        d_step = False
        if g_step:
            grad_norm = self._step(engine.optimizer, engine.network)
            if grad_norm is not None:
                output["grad_norm"] = grad_norm.detach()

        # discriminator step, on the reconstructions of the generator step (redone on its own after an OOM)
        if adversarial:
            d_total = self.with_backoff(
                "discriminator",
                self.discriminator,
                self.d_optimizer,
                zero_grad,
                batch,
                lambda size: self._discriminator_pass(inputs, recon, size, do_step),
            )
            d_step = do_step and self._finite_or_skip(
                engine, {"d_loss": d_total}, [self.d_optimizer], self.discriminator
            )
            if d_step:
                d_norm = self._step(self.d_optimizer, self.discriminator)
                if d_norm is not None:
                    output["d_grad_norm"] = d_norm.detach()
            output["d_loss"] = d_total
        if (g_step or d_step) and self.scaler is not None:
            self.scaler.update()

        output.update(sums)
        output[Keys.PRED] = recon
        engine.fire_event(IterationEvents.MODEL_COMPLETED)  # decollates engine.state.output when enabled
        return engine.state.output

    @staticmethod
    def _logits(out: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        return out[-1] if isinstance(out, (list, tuple)) else out

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""One ignite trainer for autoencoder-GANs (AutoencoderKL VAE-GAN, VQ-GAN) built on ``monai.engines.Trainer``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from monai.engines import Trainer
from monai.engines.utils import IterationEvents, default_metric_cmp_fn
from monai.engines.workflow import Workflow
from monai.utils import CommonKeys as Keys
from torch import nn
from torch.optim import Optimizer

from common.losses.autoencoder import kl_divergence
from common.networks.wrappers import split_autoencoder_output, unwrap
from common.utils import amp_dtype, autocast, make_grad_scaler

__all__ = ["AutoencoderGANTrainer", "prepare_image_batch"]


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
def _frozen(module: nn.Module):
    """Temporarily stop gradients to ``module``'s parameters (gradients still flow to its input)."""
    flags = [p.requires_grad for p in module.parameters()]
    for p in module.parameters():
        p.requires_grad_(False)
    try:
        yield module
    finally:
        for p, flag in zip(module.parameters(), flags):
            p.requires_grad_(flag)


class AutoencoderGANTrainer(Trainer):
    """Trains an autoencoder with reconstruction, latent regularisation and an optional patch adversary.

    Each iteration runs a generator step (reconstruction loss + ``kl_weight`` x KL for ``(recon, z_mu, z_sigma)``
    outputs, + ``quantization_weight`` x the codebook loss for ``(recon, quantization_loss)`` outputs,
    + ``perceptual_weight`` x perceptual loss, + ``adv_weight`` x adversarial loss once ``adv_warmup_iterations``
    iterations have passed) and then, after the warm-up, a discriminator step. Mixed precision (``bf16`` or
    ``fp16`` with a GradScaler), gradient accumulation and gradient-norm clipping apply to both steps.

    ``engine.state.output`` holds detached tensors (decollated into one dict per sample by default, the MONAI
    convention that MONAI's handlers, e.g. ``--tracking mlflow``, expect): ``image``, ``pred`` (reconstruction), ``loss`` (generator
    total), ``recon_loss``, ``kl_loss``/``quantization_loss``, ``perceptual_loss``, ``adv_loss``, ``d_loss``
    and the per-step ``grad_norm``/``d_grad_norm`` when clipping is on. ``IterationEvents`` fire after the
    generator forward, loss, backward and after the whole step.

    Args:
        device: the device of this rank.
        max_epochs: number of epochs.
        train_data_loader: loader yielding dicts with an ``image`` key.
        network: the autoencoder as called for training (may be DDP/compile-wrapped).
        optimizer: generator optimizer.
        recon_loss: pixel loss between reconstruction and input (default L1).
        discriminator: patch discriminator returning a tensor or a list of feature maps whose last entry is
            the logit map (MONAI ``PatchDiscriminator``); ``None`` trains a plain autoencoder.
        d_optimizer: discriminator optimizer (required with a discriminator).
        adv_loss: adversarial criterion called as ``adv_loss(logits, target_is_real, for_discriminator)``;
            default MONAI ``PatchAdversarialLoss(criterion="least_squares")``.
        adv_weight: weight of the generator's adversarial term.
        adv_warmup_iterations: iterations trained without any adversarial term or discriminator step.
        kl_weight: weight of the KL term for variational autoencoders.
        quantization_weight: weight of the codebook/commitment loss returned by VQ-VAE style networks.
        perceptual_loss: optional perceptual criterion ``loss(pred, target)``.
        perceptual_weight: its weight (the loss is skipped when 0 or ``perceptual_loss`` is ``None``).
        amp: ``bf16``, ``fp16`` or ``none``.
        accumulation_steps: micro-batches accumulated before each optimizer step.
        grad_clip: max gradient norm for both networks (``None``/0 disables clipping).
        epoch_length: iterations per epoch (default ``len(train_data_loader)``).
        non_blocking: non-blocking host-to-device copies.
        prepare_batch: ``(batchdata, device, non_blocking, **kwargs) -> (image, target)``.
        postprocessing, key_train_metric, additional_metrics, metric_cmp_fn, train_handlers, event_names,
        event_to_attr, decollate, to_kwargs: as in ``monai.engines.SupervisedTrainer``.
    """

    def __init__(
        self,
        device: torch.device | str,
        max_epochs: int,
        train_data_loader: Iterable,
        network: nn.Module,
        optimizer: Optimizer,
        recon_loss: Callable | None = None,
        discriminator: nn.Module | None = None,
        d_optimizer: Optimizer | None = None,
        adv_loss: Callable | None = None,
        adv_weight: float = 0.01,
        adv_warmup_iterations: int = 0,
        kl_weight: float = 1e-7,
        quantization_weight: float = 1.0,
        perceptual_loss: Callable | None = None,
        perceptual_weight: float = 0.0,
        amp: str = "none",
        accumulation_steps: int = 1,
        grad_clip: float | None = None,
        epoch_length: int | None = None,
        non_blocking: bool = False,
        prepare_batch: Callable = prepare_image_batch,
        postprocessing: Callable | None = None,
        key_train_metric: dict | None = None,
        additional_metrics: dict | None = None,
        metric_cmp_fn: Callable = default_metric_cmp_fn,
        train_handlers: Sequence | None = None,
        event_names: list | None = None,
        event_to_attr: dict | None = None,
        decollate: bool = True,
        to_kwargs: dict | None = None,
    ) -> None:
        if discriminator is not None and d_optimizer is None:
            raise ValueError("a discriminator was given without d_optimizer.")
        if int(accumulation_steps) < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps!r}.")
        self.amp_mode = str(amp).lower()
        self.amp_dtype = amp_dtype(self.amp_mode)  # validates the value
        super().__init__(
            device=device,
            max_epochs=max_epochs,
            data_loader=train_data_loader,
            epoch_length=epoch_length,
            non_blocking=non_blocking,
            prepare_batch=prepare_batch,
            iteration_update=None,
            postprocessing=postprocessing,
            key_metric=key_train_metric,
            additional_metrics=additional_metrics,
            metric_cmp_fn=metric_cmp_fn,
            handlers=train_handlers,
            amp=False,
            event_names=event_names,
            event_to_attr=event_to_attr,
            decollate=decollate,
            to_kwargs=to_kwargs,
        )
        self.network = network
        self.optimizer = optimizer
        self.recon_loss = recon_loss if recon_loss is not None else nn.L1Loss()
        self.discriminator = discriminator
        self.d_optimizer = d_optimizer
        if adv_loss is None and discriminator is not None:
            from monai.losses import PatchAdversarialLoss

            adv_loss = PatchAdversarialLoss(criterion="least_squares")
        self.adv_loss = adv_loss
        self.adv_weight = float(adv_weight)
        self.adv_warmup_iterations = int(adv_warmup_iterations)
        self.kl_weight = float(kl_weight)
        self.quantization_weight = float(quantization_weight)
        self.perceptual_loss = perceptual_loss
        self.perceptual_weight = float(perceptual_weight)
        self.accumulation_steps = int(accumulation_steps)
        self.grad_clip = float(grad_clip) if grad_clip else None
        self.scaler = make_grad_scaler(self.state.device, self.amp_mode)

    def run(self) -> None:  # type: ignore[override]
        """Run training, keeping this trainer's GradScaler.

        ``monai.engines.Trainer.run`` replaces ``self.scaler`` according to MONAI's own ``amp`` flag (off here),
        which would silently drop the fp16 GradScaler; ``Workflow.run`` is what remains of it.
        """
        Workflow.run(self)

    # ------------------------------------------------------------------ helpers
    def _accumulation_flags(self, engine: AutoencoderGANTrainer) -> tuple[bool, bool]:
        acc = self.accumulation_steps
        if acc == 1:
            return True, True
        epoch_length = engine.state.epoch_length
        local_iter = (engine.state.iteration - 1) % epoch_length if epoch_length else engine.state.iteration - 1
        last = epoch_length is not None and local_iter + 1 == epoch_length
        return local_iter % acc == 0, (local_iter + 1) % acc == 0 or last

    def _backward(self, loss: torch.Tensor, network: nn.Module, sync: bool) -> None:
        scaled = loss / self.accumulation_steps
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        no_sync = getattr(network, "no_sync", None)
        with contextlib.nullcontext() if sync or no_sync is None else no_sync():
            scaled.backward()

    def _step(self, optimizer: Optimizer, network: nn.Module) -> torch.Tensor | None:
        grad_norm = None
        if self.grad_clip:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            grad_norm = nn.utils.clip_grad_norm_(network.parameters(), self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()
        return grad_norm

    def adversarial_active(self, iteration: int | None = None) -> bool:
        """Whether the adversarial terms are on at ``iteration`` (default: the current one)."""
        iteration = self.state.iteration if iteration is None else iteration
        return self.discriminator is not None and self.adv_weight > 0 and iteration > self.adv_warmup_iterations

    # ------------------------------------------------------------------ iteration
    def _iteration(self, engine: AutoencoderGANTrainer, batchdata: dict[str, torch.Tensor]) -> dict[str, Any]:
        if batchdata is None:
            raise ValueError("Must provide batch data for current iteration.")
        inputs, targets = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking, **engine.to_kwargs)
        zero_grad, do_step = self._accumulation_flags(engine)
        adversarial = self.adversarial_active(engine.state.iteration)
        output: dict[str, Any] = {Keys.IMAGE: inputs, Keys.LABEL: targets}
        engine.state.output = output

        # generator step
        engine.network.train()
        if zero_grad:
            engine.optimizer.zero_grad(set_to_none=True)
        with autocast(self.state.device, self.amp_mode):
            recon, extras = split_autoencoder_output(engine.network(inputs))
            output[Keys.PRED] = recon
            engine.fire_event(IterationEvents.FORWARD_COMPLETED)
            terms = {"recon_loss": self.recon_loss(recon.float(), targets.float())}
            if "z_mu" in extras:
                terms["kl_loss"] = kl_divergence(extras["z_mu"], extras["z_sigma"])
            if "quantization_loss" in extras:
                terms["quantization_loss"] = extras["quantization_loss"].float().mean()
            if self.perceptual_loss is not None and self.perceptual_weight > 0:
                terms["perceptual_loss"] = self.perceptual_loss(recon.float(), targets.float())
            if adversarial:
                # the raw, frozen module: the generator step must neither all-reduce nor accumulate
                # discriminator gradients
                with _frozen(unwrap(self.discriminator)) as raw_discriminator:
                    logits = self._logits(raw_discriminator(recon.contiguous()))
                terms["adv_loss"] = self.adv_loss(logits, target_is_real=True, for_discriminator=False)
        g_loss = terms["recon_loss"]
        weights = {
            "kl_loss": self.kl_weight,
            "quantization_loss": self.quantization_weight,
            "perceptual_loss": self.perceptual_weight,
            "adv_loss": self.adv_weight,
        }
        for name, value in terms.items():
            if name != "recon_loss":
                g_loss = g_loss + weights[name] * value
        output[Keys.LOSS] = g_loss
        engine.fire_event(IterationEvents.LOSS_COMPLETED)
        self._backward(g_loss, engine.network, sync=do_step)
        engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
        if do_step:
            grad_norm = self._step(engine.optimizer, engine.network)
            if grad_norm is not None:
                output["grad_norm"] = grad_norm.detach()

        # discriminator step
        if adversarial:
            self.discriminator.train()
            if zero_grad:
                self.d_optimizer.zero_grad(set_to_none=True)
            with autocast(self.state.device, self.amp_mode):
                fake = self._logits(self.discriminator(recon.detach().contiguous()))
                real = self._logits(self.discriminator(inputs.contiguous()))
                d_loss = 0.5 * (
                    self.adv_loss(fake, target_is_real=False, for_discriminator=True)
                    + self.adv_loss(real, target_is_real=True, for_discriminator=True)
                )
            self._backward(d_loss, self.discriminator, sync=do_step)
            if do_step:
                d_norm = self._step(self.d_optimizer, self.discriminator)
                if d_norm is not None:
                    output["d_grad_norm"] = d_norm.detach()
            output["d_loss"] = d_loss.detach()
        if do_step and self.scaler is not None:
            self.scaler.update()

        for name, value in terms.items():
            output[name] = value.detach()
        output[Keys.LOSS] = g_loss.detach()
        output[Keys.PRED] = recon.detach()
        engine.fire_event(IterationEvents.MODEL_COMPLETED)  # decollates engine.state.output when enabled
        return engine.state.output

    @staticmethod
    def _logits(out: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        return out[-1] if isinstance(out, (list, tuple)) else out

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""GPU tests (``pytest -m gpu``; skipped with a reason where no CUDA device is visible): every bundle trains and
evaluates on CUDA with its GPU defaults (bf16 autocast, cuDNN benchmark, flash attention where it has attention)
and the cache on the GPU, once more with ``torch.compile``; the autoencoder with gradient checkpointing; a job
killed mid-run on CUDA resumes to the weights of an uninterrupted run; every bundle's training step keeps no host
synchronisation beyond the documented ones; a real out-of-memory error is redone with a smaller micro-batch; with
2+ GPUs, a 2-process NCCL job ends with identical replicas. The campaign (``python scripts/benchmark.py campaign``) runs these first."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from common.bundle_tools.registry import describe
from tests.bundle_cases import CASES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)"),
]

# Brief runs at the CPU demo sizes (the point is the CUDA code paths, not the model): each bundle's
# ``gpu_brief`` (tests/bundle_cases.py), the cache on the GPU.
BUNDLES = sorted(CASES)

# Host synchronisations a training iteration is documented to make: the non-finite loss guard reads the loss and
# gradient check of every optimizer step (one per step; the autoencoder-GAN makes two steps per iteration).
DOCUMENTED_SYNCS_PER_STEP = 1


def _brief_run(bundle: str, tmp_path: Path, **extra) -> dict:
    """The CPU demo of ``bundle`` (its description's ``cpu`` overrides) on CUDA, briefly."""
    import scripts.demo as demo

    overrides = {**describe(bundle).demo["cpu"], **CASES[bundle].gpu_brief, "cache_device": "cuda", **extra}
    overrides.pop("num_threads", None)
    return demo.main(bundle=bundle, output_dir=str(tmp_path / bundle), device="cuda", **overrides)


def _run_dir(bundle: str, tmp_path: Path) -> Path:
    """Where the brief run's weights are: its last stage's folder for a bundle trained stage by stage."""
    stages = CASES[bundle].gpu_brief.get("stage_iterations", ())
    return tmp_path / bundle / (f"stage{len(stages)}" if describe(bundle).staged else "")


def _assert_finite(metrics: dict, bundle: str) -> None:
    keys = [k for k in describe(bundle).reported_metrics if k != "logrank_p"]
    assert keys and all(k in metrics for k in keys), f"{bundle}: evaluation lacks {keys}: {sorted(metrics)}"
    bad = {k: metrics[k] for k in keys if not math.isfinite(float(metrics[k]))}
    assert not bad, f"{bundle}: non-finite evaluation metrics on CUDA: {bad}"


@pytest.mark.parametrize("bundle", BUNDLES)
def test_bundle_trains_and_evaluates_on_cuda(bundle, tmp_path):
    metrics = _brief_run(bundle, tmp_path)
    _assert_finite(metrics, bundle)
    run = _run_dir(bundle, tmp_path)
    assert (run / "models" / "model.pt").is_file() and (run / "models" / "last.pt").is_file()
    state = torch.load(run / "models" / "last.pt", map_location="cpu", weights_only=True)
    assert all("cuda" in rank["global"] for rank in state["rng"]), "the CUDA RNG state of a rank is not saved"


def test_autoencoder_with_gradient_checkpointing_and_flash_attention(tmp_path):
    metrics = _brief_run("autoencoder_3d", tmp_path, use_checkpoint=True, use_flash_attention=True)
    _assert_finite(metrics, "autoencoder_3d")


@pytest.mark.parametrize("bundle", sorted(name for name, case in CASES.items() if case.gpu_resume))
def test_resume_on_cuda_continues_where_it_stopped(bundle, tmp_path):
    """The reliability job of ``bundle`` (8 iterations, a checkpoint every 2, ``deterministic``) on CUDA in bf16,
    SIGKILLed at a random iteration and re-run: it resumes from its last checkpoint and ends with the weights of
    the uninterrupted run. Tolerance: none - with deterministic kernels and the saved CUDA RNG states the resumed
    run repeats the same bf16 arithmetic, so the weights must be bit-identical."""
    from scripts.harness.faults import fault_sequence, make_case

    case = make_case(bundle, tmp_path / "data")
    case.args.update(device="cuda", amp="bf16")
    result = fault_sequence(case, tmp_path / "work", faults=("kill",))
    assert all(step.ok for step in result["steps"]), result["steps"]
    assert result["identical"], f"{bundle}: resumed weights differ from the uninterrupted run: {result['differing']}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_replicas_stay_identical(tmp_path):
    """2-process DDP over NCCL (one GPU each, SyncBatchNorm): every weight and BatchNorm statistic is equal on both
    ranks after training."""
    import subprocess

    from common.demo.images import write_phantom_dataset
    from tests.helpers import REPO_ROOT, bundle_env, config_arg, overrides, rank_probe, torchrun_cmd

    datalist = write_phantom_dataset(tmp_path / "data", n_train=4, n_val=2, shape=(32, 32, 32), seed=0)
    out = tmp_path / "ddp"
    probe = rank_probe(
        "autoencoder_3d",
        tmp_path / "probe.json",
        "{'weights': @autoencoder.state_dict(), 'd_weights': @discriminator.state_dict()}",
    )
    args = overrides(
        dataset_dir=str(datalist.parent),
        output_dir=str(out),  # no device override: multi_gpu_train.json puts each rank on cuda:LOCAL_RANK
        max_epochs=2,
        val_interval=1,
        adv_warmup_iterations=1,
        patch_size=[32, 32, 32],
        channels=[16, 32, 32],
        norm_num_groups=8,
        d_channels=16,
    )
    configs = config_arg("autoencoder_3d", "train.json", "multi_gpu_train.json", str(probe))
    cmd = torchrun_cmd(2, "-m", "monai.bundle", "run", "training", "--config_file", configs, *args)
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=bundle_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    r0, r1 = (torch.load(out / f"rank{r}.pt", map_location="cpu", weights_only=True) for r in (0, 1))
    for part in ("weights", "d_weights"):
        differing = [k for k in r0[part] if not torch.equal(r0[part][k], r1[part][k])]
        assert not differing, f"{part} differ between the ranks: {differing[:5]}"


@pytest.mark.compile
@pytest.mark.parametrize("bundle", BUNDLES)
def test_bundle_trains_and_evaluates_compiled(bundle, tmp_path):
    _assert_finite(_brief_run(bundle, tmp_path, compile=True), bundle)


# settings of the fault-test jobs that the step counter sets itself
_RUN_ONLY = ("max_epochs", "val_interval", "ckpt_interval", "deterministic", "num_threads")


def sync_trainer(bundle: str, work_dir: Path, iterations: int, device: str = "cuda", amp: str = "bf16"):
    """``train#trainer`` of ``bundle`` on the small job of its fault tests (:func:`scripts.harness.faults.make_case`)
    with the cache on ``device``, the adversarial terms on from the start, for ``iterations`` iterations."""
    from scripts.harness.faults import make_case
    from tests.helpers import bundle_trainer

    case = make_case(bundle, work_dir / "data")
    settings = {k: v for k, v in case.args.items() if k not in _RUN_ONLY} | CASES[bundle].host_read_settings
    configs = [c for c in case.configs if c != "train.json"]
    run = {"device": device, "amp": amp, "cache_device": device}
    return bundle_trainer(bundle, configs, work_dir / "run", iterations, **run, **settings)


@pytest.mark.parametrize("bundle", BUNDLES)
def test_training_step_host_synchronisations(bundle, tmp_path):
    """Count the synchronising CUDA calls inside training iterations 3-6 (from ``ITERATION_STARTED`` to
    ``ITERATION_COMPLETED``: the step and the per-iteration handlers) with ``torch.cuda.set_sync_debug_mode``: at
    most the documented one per optimizer step (the non-finite guard; the GANs make two steps per iteration). The
    CPU tests (``test_training_step_reads_back_only_the_documented_values``) count the reads by calling function;
    this counts what CUDA itself waits for, inside torch and the libraries too. The failure message lists the calling
    lines."""
    import collections

    from ignite.engine import Events

    trainer = sync_trainer(bundle, tmp_path, 6)
    counted = range(3, 7)

    def start(engine) -> None:
        if engine.state.iteration in counted:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")

    def stop(engine) -> None:
        torch.cuda.set_sync_debug_mode(0)

    trainer.add_event_handler(Events.ITERATION_STARTED, start)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, stop)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)
    )
    total, documented = sum(sites.values()), DOCUMENTED_SYNCS_PER_STEP * CASES[bundle].optimizer_steps
    assert total <= documented * len(counted), (
        f"{bundle}: {total} synchronising calls in {len(counted)} iterations (documented: {documented} per "
        f"iteration), by calling line: {sites.most_common(12)}"
    )


def test_out_of_memory_is_redone_with_a_smaller_micro_batch_on_cuda(caplog):
    """A real CUDA out-of-memory error: with this process held to 3 GiB (``set_per_process_memory_fraction``), one
    step of a 3D convolution network on 32 volumes of 96^3 does not fit (about 113 MB per sample and activation).
    The trainer halves the micro-batch until the step fits and ends where a run that used that micro-batch from the
    start ends."""
    from torch import nn

    from common.engines.trainer import StepTrainer

    class Regression(StepTrainer):
        default_decollate = False

        def prepare_step(self, engine, batchdata):
            image = batchdata["image"].to(engine.state.device)
            return {"args": (image,), "output": {}, "target": image}

        def compute_loss(self, engine, step, prediction):
            return (prediction - step["target"]).square().mean(), {}

    batch = {"image": torch.rand(32, 1, 96, 96, 96, generator=torch.Generator().manual_seed(0))}

    def run(micro_batch_size=None) -> StepTrainer:
        torch.manual_seed(0)
        network = nn.Sequential(nn.Conv3d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv3d(32, 1, 3, padding=1)).cuda()
        trainer = Regression(
            device="cuda",
            max_epochs=1,
            train_data_loader=[batch],
            network=network,
            optimizer=torch.optim.SGD(network.parameters(), lr=0.1),
            micro_batch_size=micro_batch_size,
        )
        trainer.run()
        return trainer

    torch.cuda.empty_cache()
    fraction = 3 * 2**30 / torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        with caplog.at_level("WARNING", logger="common.engines.trainer"):
            recovered = run()
        assert recovered.micro_batch_size is not None and recovered.micro_batch_size < 32
        assert "out of GPU memory in the training step of iteration 1" in caplog.text
        reference = run(recovered.micro_batch_size)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    for a, b in zip(recovered.network.parameters(), reference.network.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

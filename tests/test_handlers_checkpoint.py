# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for atomic checkpoints, safe loading, best-k model files and resumable training."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ignite.engine import Events
from monai.handlers import LrScheduleHandler
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    EnsureTyped,
    LoadImaged,
    RandAffined,
    RandFlipd,
    RandSpatialCropd,
    RandSpatialCropSamplesd,
)
from monai.utils import set_determinism
from torch import nn

import common.handlers.checkpoint as ckpt
from common.autoencoder.engines import AutoencoderGANTrainer
from common.checkpoint_io import CheckpointError, load_checkpoint, load_network_weights, save_checkpoint
from common.data.pipeline import make_loader
from common.demo.images import write_phantom_dataset
from common.engines.lr_schedule import warmup_cosine
from common.handlers.checkpoint import BestCheckpointSaver, CheckpointManager
from tests.helpers import tiny_autoencoder, tiny_discriminator
from tests.oracles import make_dataset

SIDE = 16


class Pickled:
    """A custom class: checkpoints holding it must be refused by ``weights_only`` loading."""

    def __init__(self) -> None:
        self.value = 1


# ---------------------------------------------------------------------------------------------- save / load
def test_save_checkpoint_round_trip(tmp_path):
    obj = {"w": torch.arange(5.0), "meta": {"step": 3, "name": "x"}, "list": [1, 2.5]}
    path = save_checkpoint(obj, tmp_path / "sub" / "a.pt")
    assert path == tmp_path / "sub" / "a.pt"
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["w"], obj["w"]) and loaded["meta"] == obj["meta"] and loaded["list"] == [1, 2.5]
    assert sorted(os.listdir(tmp_path / "sub")) == ["a.pt"]


def test_save_checkpoint_is_atomic_on_a_full_disk(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"version": torch.tensor(1)}, path)
    before = path.read_bytes()

    def full_disk_save(obj, f, *args, **kwargs):
        f.write(b"partial checkpoint bytes" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(OSError) as info:
        save_checkpoint({"version": torch.tensor(2)}, path)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["last.pt"]  # the temporary file is gone
    assert load_checkpoint(path)["version"].item() == 1


def test_save_checkpoint_interrupted_by_keyboard_interrupt_leaves_no_temp(tmp_path, monkeypatch):
    def interrupted(obj, f, *args, **kwargs):
        f.write(b"x")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"a": 1}, tmp_path / "new.pt")
    assert os.listdir(tmp_path) == []


def test_load_checkpoint_refuses_pickled_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weights": torch.zeros(2), "obj": Pickled()}, path)
    with pytest.raises(CheckpointError, match="weights_only") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and "pickled Python objects" in str(info.value)


def test_load_checkpoint_truncated_file(tmp_path):
    path = tmp_path / "torn.pt"
    save_checkpoint({"w": torch.rand(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="unreadable"):
        load_checkpoint(path)


def test_load_checkpoint_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nothing.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path)  # a folder is not a checkpoint


def test_load_network_weights_strips_ddp_prefix(tmp_path):
    torch.manual_seed(0)
    source = tiny_discriminator(seed=None)
    save_checkpoint({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "ddp.pt")
    torch.manual_seed(1)
    target = tiny_discriminator(seed=None)
    assert not torch.equal(next(target.parameters()), next(source.parameters()))
    assert load_network_weights(target, tmp_path / "ddp.pt") is target
    for key, value in target.state_dict().items():
        assert torch.equal(value, source.state_dict()[key])


def test_load_network_weights_from_a_key_into_a_wrapped_network(tmp_path):
    source = tiny_discriminator(seed=None)
    save_checkpoint({"discriminator": source.state_dict(), "other": {}}, tmp_path / "full.pt")
    target = nn.DataParallel(tiny_discriminator(seed=None))
    load_network_weights(target, tmp_path / "full.pt", key="discriminator")
    for key, value in source.state_dict().items():
        assert torch.equal(target.module.state_dict()[key], value)
    with pytest.raises(CheckpointError, match="no key 'generator'") as info:
        load_network_weights(target, tmp_path / "full.pt", key="generator")
    assert "discriminator" in str(info.value)


def test_load_network_weights_mismatch_names_the_network(tmp_path):
    save_checkpoint(tiny_discriminator(seed=None).state_dict(), tmp_path / "d.pt")
    with pytest.raises(CheckpointError, match="does not fit the configured AutoencoderKL") as info:
        load_network_weights(tiny_autoencoder(seed=None), tmp_path / "d.pt")
    n_ae, n_d = len(tiny_autoencoder(seed=None).state_dict()), len(tiny_discriminator(seed=None).state_dict())
    # one sentence, never the list of tensors
    assert f"{n_ae} tensors of the network are not in the checkpoint" in str(info.value)
    assert f"{n_d} tensors of the checkpoint are not in the network" in str(info.value)
    assert "recorded no settings" in str(info.value) and "\n" not in str(info.value)
    # strict=False tolerates missing keys but not mismatched shapes
    first = next(iter(tiny_discriminator(seed=None).state_dict()))
    partial = {first: tiny_discriminator(seed=None).state_dict()[first]}
    save_checkpoint(partial, tmp_path / "partial.pt")
    load_network_weights(tiny_discriminator(seed=None), tmp_path / "partial.pt", strict=False)
    with pytest.raises(CheckpointError, match="does not fit the configured PatchDiscriminator"):
        load_network_weights(tiny_discriminator(seed=None), tmp_path / "partial.pt")


# ---------------------------------------------------------------------------------------------- best-k saver
def _evaluator(value: float, step: int, name: str = "val_psnr") -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(metrics={name: value}, epoch=step), global_step=step * 10)


def _marked_network(net: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(value)


def _ranked_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model_"))


def test_best_checkpoint_saver_keeps_top_k_max(tmp_path):
    net = nn.Linear(2, 1)
    saver = BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=2)
    for step, value in enumerate([1.0, 3.0, 2.0, 0.5, 4.0], start=1):
        _marked_network(net, value)
        saver(_evaluator(value, step))
    assert _ranked_files(tmp_path) == ["model_val_psnr=3_step=20.pt", "model_val_psnr=4_step=50.pt"]
    best = load_checkpoint(tmp_path / "model.pt")
    assert set(best) == {"weight", "bias"}
    assert torch.all(best["weight"] == 4.0) and torch.all(best["bias"] == 4.0)
    assert torch.all(load_checkpoint(tmp_path / "model_val_psnr=3_step=20.pt")["weight"] == 3.0)
    assert sorted(os.listdir(tmp_path)) == ["model.pt", *_ranked_files(tmp_path)]  # no temporary files

    # a new saver on the same folder (a resumed run) continues the ranking
    resumed = BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=2)
    _marked_network(net, 3.5)
    resumed(_evaluator(3.5, 6))
    assert _ranked_files(tmp_path) == ["model_val_psnr=3.5_step=60.pt", "model_val_psnr=4_step=50.pt"]
    assert torch.all(load_checkpoint(tmp_path / "model.pt")["weight"] == 4.0)  # 3.5 is not the best
    _marked_network(net, 2.0)
    resumed(_evaluator(2.0, 7))  # worse than both: nothing written
    assert _ranked_files(tmp_path) == ["model_val_psnr=3.5_step=60.pt", "model_val_psnr=4_step=50.pt"]
    _marked_network(net, 5.0)
    resumed(_evaluator(5.0, 8))
    assert _ranked_files(tmp_path) == ["model_val_psnr=4_step=50.pt", "model_val_psnr=5_step=80.pt"]
    assert torch.all(load_checkpoint(tmp_path / "model.pt")["weight"] == 5.0)


def test_best_checkpoint_saver_lower_is_better(tmp_path):
    """A loss ranks lowest first: the mode comes from the metric's name (common.metrics.key_metric)."""
    net = nn.Linear(2, 1)
    saver = BestCheckpointSaver(tmp_path, net, "val_loss", n_saved=2, filename="best.pt")
    for step, value in enumerate([1.0, 3.0, 2.0, 0.5, 4.0], start=1):
        _marked_network(net, value)
        saver(_evaluator(value, step, "val_loss"))
    assert _ranked_files(tmp_path) == ["model_val_loss=0.5_step=40.pt", "model_val_loss=1_step=10.pt"]
    assert torch.all(load_checkpoint(tmp_path / "best.pt")["weight"] == 0.5)


def test_best_checkpoint_saver_same_step_again_keeps_k_files(tmp_path):
    # a resumed run that validates again at an already recorded step writes the same file name
    net = nn.Linear(2, 1)
    saver = BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=2)
    for step, value in [(1, 1.0), (2, 2.0)]:
        _marked_network(net, value)
        saver(_evaluator(value, step))
    again = BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=2)
    again(_evaluator(2.0, 2))
    assert _ranked_files(tmp_path) == ["model_val_psnr=1_step=10.pt", "model_val_psnr=2_step=20.pt"]


def test_best_checkpoint_saver_compares_exact_values(tmp_path):
    """A tie, or a value that differs from the best only past the 6th digit, never replaces model.pt with a model
    that is not strictly better, also after a resume re-reads the ranking from the file names: the names keep every
    digit where 6 do not read back exactly (the rule of metrics.json's best: the first strictly larger value)."""
    best, tie, worse = 5 / 6, 5 / 6, 5 / 6 - 1e-9  # all three print as 0.833333
    net = nn.Linear(2, 1)
    saver = BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=3)
    _marked_network(net, 1.0)
    saver(_evaluator(best, 1))
    assert _ranked_files(tmp_path) == [f"model_val_psnr={best!r}_step=10.pt"]
    for step, value in [(2, tie), (3, worse)]:
        _marked_network(net, float(step))
        BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=3)(_evaluator(value, step))  # a resumed run
    assert torch.all(load_checkpoint(tmp_path / "model.pt")["weight"] == 1.0)
    _marked_network(net, 4.0)
    saver(_evaluator(best + 1e-9, 4))  # strictly better, in the 9th digit
    assert torch.all(load_checkpoint(tmp_path / "model.pt")["weight"] == 4.0)
    assert len(_ranked_files(tmp_path)) == 3 and f"model_val_psnr={worse!r}_step=30.pt" not in _ranked_files(tmp_path)


def test_best_checkpoint_saver_ignores_other_metrics_and_nan(tmp_path, caplog):
    net = nn.Linear(2, 1)
    other = tmp_path / "model_val_ssim=0.9_step=10.pt"
    save_checkpoint(net.state_dict(), other)
    saver = BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=1)
    saver(_evaluator(20.0, 1))
    with caplog.at_level(logging.WARNING):
        saver(_evaluator(float("nan"), 2))
    assert "NaN" in caplog.text
    assert other.is_file()
    assert _ranked_files(tmp_path) == ["model_val_psnr=20_step=10.pt", other.name]
    with pytest.raises(KeyError, match="val_dice"):
        BestCheckpointSaver(tmp_path, net, "val_dice")(_evaluator(1.0, 3))
    with pytest.raises(TypeError, match="mode"):  # which way a metric improves is not a choice of the handler
        BestCheckpointSaver(tmp_path, net, "val_psnr", mode="min")


def test_best_checkpoint_saver_writes_on_rank_0_only(tmp_path, monkeypatch):
    """Attached on every rank (as the bundles do): the other ranks write nothing but still check the metric."""
    net = nn.Linear(2, 1)
    monkeypatch.setenv("RANK", "1")
    BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=2)(_evaluator(20.0, 1))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyError, match="val_dice"):
        BestCheckpointSaver(tmp_path, net, "val_dice")(_evaluator(1.0, 3))
    monkeypatch.setenv("RANK", "0")
    BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=2)(_evaluator(20.0, 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "model_val_psnr=20_step=10.pt"]


def test_best_checkpoint_saver_default_step_and_attach(tmp_path):
    from ignite.engine import Engine

    net = nn.Linear(2, 1)
    engine = Engine(lambda e, b: None)
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: e.state.metrics.update(val_psnr=float(e.state.epoch)))
    BestCheckpointSaver(tmp_path, net, "val_psnr", n_saved=1).attach(engine)
    engine.run([0, 1], max_epochs=3)
    assert _ranked_files(tmp_path) == ["model_val_psnr=3_step=3.pt"]  # the epoch without a global_step


# ---------------------------------------------------------------------------------------------- transform RNG
def _random_chain() -> Compose:
    return Compose(
        [
            RandSpatialCropd("image", roi_size=(12, 12, 12), random_size=False),
            RandAffined("image", prob=1.0, rotate_range=0.3, translate_range=2, spatial_size=(12, 12, 12)),
            RandSpatialCropSamplesd("image", roi_size=(8, 8, 8), num_samples=2, random_size=False),
            RandFlipd("image", prob=0.5, spatial_axis=0),
        ]
    )


def _apply(transform: Compose, volume: torch.Tensor) -> list[torch.Tensor]:
    return [torch.as_tensor(d["image"]) for d in transform({"image": volume.clone()})]


def test_transform_rng_state_round_trip_covers_nested_randomizers(tmp_path):
    transform = _random_chain()
    transform.set_random_state(seed=3)
    volume = torch.rand(1, 16, 16, 16)
    _apply(transform, volume)
    torch.save(ckpt._transform_rng_state(transform), tmp_path / "t.pt")
    expected = [_apply(transform, volume) for _ in range(3)]

    other = _random_chain()
    other.set_random_state(seed=99)
    ckpt._set_transform_rng_state(other, torch.load(tmp_path / "t.pt", weights_only=True))
    got = [_apply(other, volume) for _ in range(3)]
    for a, b in zip(expected, got):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------- manager
def _trainer(max_epochs: int, save_dir: Path, resume="auto", interval: int = 2, n_batches: int = 2, amp="none"):
    torch.manual_seed(0)
    ae, disc = tiny_autoencoder(seed=None), tiny_discriminator(seed=None)
    opt = torch.optim.Adam(ae.parameters(), lr=1e-3)
    d_opt = torch.optim.Adam(disc.parameters(), lr=1e-3)
    sched = warmup_cosine(opt, 1, 8, 0.1)
    gen = torch.Generator().manual_seed(0)
    batches = [{"image": torch.rand(2, 1, SIDE, SIDE, SIDE, generator=gen)} for _ in range(n_batches)]
    manager = CheckpointManager(
        save_dir,
        {"autoencoder": ae, "discriminator": disc, "optimizer": opt, "d_optimizer": d_opt, "lr_scheduler": sched},
        interval=interval,
        resume=resume,
    )
    trainer = AutoencoderGANTrainer(
        device=torch.device("cpu"),
        max_epochs=max_epochs,
        train_data_loader=batches,
        network=ae,
        optimizer=opt,
        discriminator=disc,
        d_optimizer=d_opt,
        adv_warmup_iterations=1,
        amp=amp,
        decollate=False,
        train_handlers=[LrScheduleHandler(sched, epoch_level=False, print_lr=False), manager],
    )
    iterations: list[int] = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: iterations.append(e.state.iteration))
    return SimpleNamespace(
        trainer=trainer, manager=manager, ae=ae, disc=disc, opt=opt, sched=sched, iterations=iterations
    )


def test_manager_saves_everything_needed_to_resume(tmp_path, monkeypatch):
    saved_at: list[int] = []
    original = ckpt.save_checkpoint

    def recording_save(obj, path):
        saved_at.append(obj["trainer"]["iteration"])
        return original(obj, path)

    monkeypatch.setattr(ckpt, "save_checkpoint", recording_save)
    run = _trainer(max_epochs=2, save_dir=tmp_path)
    run.trainer.run()
    assert saved_at == [2, 4]  # every 2 iterations; the end of training coincides with the last one
    content = load_checkpoint(tmp_path / "last.pt")
    assert set(content) == {
        "autoencoder",
        "discriminator",
        "optimizer",
        "d_optimizer",
        "lr_scheduler",
        "trainer",
        "rng",
        "meta",
    }
    assert content["trainer"] == {"iteration": 4, "epoch": 2, "epoch_length": 2, "max_epochs": 2}
    for key, value in run.ae.state_dict().items():
        assert torch.equal(content["autoencoder"][key], value)
    for key, value in run.disc.state_dict().items():
        assert torch.equal(content["discriminator"][key], value)
    assert content["optimizer"]["state"][0]["step"].item() == 4
    assert content["d_optimizer"]["state"][0]["step"].item() == 3  # the discriminator trains after 1 warm-up step
    assert content["lr_scheduler"]["last_epoch"] == 4
    assert content["lr_scheduler"]["lr_lambdas"][0] == {"warmup_iterations": 1, "total_iterations": 8, "min_ratio": 0.1}
    assert isinstance(content["rng"], list) and len(content["rng"]) == 1
    assert set(content["rng"][0]) == {"global", "transform"}
    assert content["meta"]["world_size"] == 1 and isinstance(content["meta"]["torch"], str)


def test_manager_resumes_automatically(tmp_path):
    _trainer(max_epochs=2, save_dir=tmp_path).trainer.run()
    saved = load_checkpoint(tmp_path / "last.pt")
    run = _trainer(max_epochs=4, save_dir=tmp_path)
    at_start = {}
    run.trainer.add_event_handler(
        Events.STARTED,
        lambda e: at_start.update(
            iteration=e.state.iteration,
            epoch=e.state.epoch,
            lr=run.opt.param_groups[0]["lr"],
            weight=run.ae.state_dict()["encoder.blocks.0.conv.weight"].clone(),
        ),
    )
    run.trainer.run()
    assert at_start["iteration"] == 4 and at_start["epoch"] == 2
    assert torch.equal(at_start["weight"], saved["autoencoder"]["encoder.blocks.0.conv.weight"])
    assert at_start["lr"] == pytest.approx(saved["optimizer"]["param_groups"][0]["lr"])
    assert run.manager.resumed_from == 4
    assert run.iterations == [5, 6, 7, 8]
    assert run.trainer.state.epoch == 4
    assert load_checkpoint(tmp_path / "last.pt")["trainer"]["iteration"] == 8


def test_manager_resume_false_ignores_the_checkpoint(tmp_path):
    _trainer(max_epochs=2, save_dir=tmp_path).trainer.run()
    run = _trainer(max_epochs=1, save_dir=tmp_path, resume=False)
    run.trainer.run()
    assert run.iterations == [1, 2] and run.manager.resumed_from is None
    assert load_checkpoint(tmp_path / "last.pt")["trainer"]["iteration"] == 2  # overwritten by the new run


def test_manager_resume_from_explicit_path(tmp_path):
    _trainer(max_epochs=1, save_dir=tmp_path / "a").trainer.run()
    run = _trainer(max_epochs=2, save_dir=tmp_path / "b", resume=str(tmp_path / "a" / "last.pt"))
    run.trainer.run()
    assert run.iterations == [3, 4]
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        _trainer(max_epochs=2, save_dir=tmp_path / "b", resume=str(tmp_path / "missing.pt")).trainer.run()


def test_manager_without_checkpoint_starts_fresh(tmp_path):
    run = _trainer(max_epochs=1, save_dir=tmp_path / "new")
    run.trainer.run()
    assert run.iterations == [1, 2] and run.manager.resumed_from is None


def test_manager_checkpoint_beyond_max_epochs_is_an_error(tmp_path):
    _trainer(max_epochs=2, save_dir=tmp_path).trainer.run()
    with pytest.raises(CheckpointError, match="beyond max_epochs=1") as info:
        _trainer(max_epochs=1, save_dir=tmp_path).trainer.run()
    assert "iteration 4" in str(info.value) and "raise max_epochs" in str(info.value)


def test_manager_checkpoint_lacking_an_object_is_an_error(tmp_path):
    _trainer(max_epochs=1, save_dir=tmp_path).trainer.run()
    content = load_checkpoint(tmp_path / "last.pt")
    del content["d_optimizer"]
    save_checkpoint(content, tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match=r"lacks \['d_optimizer'\]"):
        _trainer(max_epochs=2, save_dir=tmp_path).trainer.run()


def test_manager_mismatched_network_is_an_error(tmp_path):
    _trainer(max_epochs=1, save_dir=tmp_path).trainer.run()
    content = load_checkpoint(tmp_path / "last.pt")
    content["autoencoder"] = nn.Linear(2, 2).state_dict()
    save_checkpoint(content, tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match="cannot restore 'autoencoder'"):
        _trainer(max_epochs=2, save_dir=tmp_path).trainer.run()


def test_manager_resumes_mid_epoch_by_iteration_count(tmp_path):
    _trainer(max_epochs=1, save_dir=tmp_path, interval=1, n_batches=3).trainer.run()
    content = load_checkpoint(tmp_path / "last.pt")
    assert content["trainer"]["iteration"] == 3
    # pretend the run stopped after iteration 2 of 3 in the first epoch
    content["trainer"].update(iteration=2, epoch=0)
    save_checkpoint(content, tmp_path / "last.pt")
    run = _trainer(max_epochs=2, save_dir=tmp_path, interval=1, n_batches=3)
    epochs = []
    run.trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: epochs.append(e.state.iteration))
    run.trainer.run()
    assert run.iterations == [3, 4, 5, 6]
    assert epochs == [3, 6]


def test_manager_saves_grad_scaler(tmp_path):
    run = _trainer(max_epochs=1, save_dir=tmp_path, amp="fp16")
    run.trainer.run()
    content = load_checkpoint(tmp_path / "last.pt")
    assert "scaler" in content and content["scaler"]["scale"] == run.trainer.scaler.get_scale()


def test_manager_reseeds_when_the_number_of_processes_changed(tmp_path, monkeypatch, caplog):
    _trainer(max_epochs=1, save_dir=tmp_path).trainer.run()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    run = _trainer(max_epochs=2, save_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        run.manager.load(run.trainer)
    assert "number of processes changed" in caplog.text
    draw = torch.rand(4)
    torch.manual_seed(2 * 1000 + 0)
    assert torch.equal(draw, torch.rand(4))


# ---------------------------------------------------------------------------------------------- exact resume
def _resumable_run(data: list[dict], save_dir: Path, max_epochs: int, resume, stop_after_epoch: int | None = None):
    """Everything a training script builds, seeded the same way every time."""
    set_determinism(seed=0)
    transform = Compose(
        [
            LoadImaged("image", image_only=True),
            EnsureChannelFirstd("image"),
            EnsureTyped("image", dtype=torch.float32, track_meta=False),
            RandSpatialCropd("image", roi_size=(18, 18, 18), random_size=False),
            RandSpatialCropSamplesd("image", roi_size=(SIDE,) * 3, num_samples=2, random_size=False),
            RandFlipd("image", prob=0.5, spatial_axis=0),
        ]
    )
    dataset = make_dataset(data, transform, cache_rate=1.0, partition=False, num_init_workers=1)
    loader = make_loader(dataset, batch_size=2, shuffle=True, num_workers=0)
    ae, disc = tiny_autoencoder(seed=None), tiny_discriminator(seed=None)
    opt = torch.optim.Adam(ae.parameters(), lr=1e-3)
    d_opt = torch.optim.Adam(disc.parameters(), lr=1e-3)
    total = max_epochs * len(loader)
    sched = warmup_cosine(opt, 2, total, 0.1)
    d_sched = warmup_cosine(d_opt, 2, total, 0.1)
    manager = CheckpointManager(
        save_dir,
        {
            "autoencoder": ae,
            "discriminator": disc,
            "optimizer": opt,
            "d_optimizer": d_opt,
            "lr_scheduler": sched,
            "d_lr_scheduler": d_sched,
        },
        interval=3,
        resume=resume,
        transform=transform,
    )
    trainer = AutoencoderGANTrainer(
        device=torch.device("cpu"),
        max_epochs=max_epochs,
        train_data_loader=loader,
        network=ae,
        optimizer=opt,
        discriminator=disc,
        d_optimizer=d_opt,
        adv_warmup_iterations=3,
        kl_weight=1e-4,
        decollate=False,
        train_handlers=[
            LrScheduleHandler(sched, epoch_level=False, print_lr=False),
            LrScheduleHandler(d_sched, epoch_level=False, print_lr=False),
            manager,
        ],
    )
    losses: dict[int, float] = {}
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: losses.update({e.state.iteration: e.state.output["loss"].item()})
    )
    if stop_after_epoch is not None:
        trainer.add_event_handler(Events.EPOCH_COMPLETED(once=stop_after_epoch), lambda e: e.terminate())
    trainer.run()
    return SimpleNamespace(trainer=trainer, ae=ae, disc=disc, opt=opt, losses=losses)


def test_resume_at_epoch_boundary_is_bit_identical(tmp_path):
    datalist = write_phantom_dataset(tmp_path / "data", n_train=3, n_val=0, shape=(20, 20, 20))
    data = json.loads(Path(datalist).read_text())["training"]
    data = [{"image": str(tmp_path / "data" / item["image"])} for item in data]
    try:
        straight = _resumable_run(data, tmp_path / "straight", max_epochs=4, resume=False)
        first = _resumable_run(data, tmp_path / "resumed", max_epochs=4, resume="auto", stop_after_epoch=2)
        assert first.trainer.state.iteration == 4
        assert load_checkpoint(tmp_path / "resumed" / "last.pt")["trainer"]["iteration"] == 4
        second = _resumable_run(data, tmp_path / "resumed", max_epochs=4, resume="auto")
    finally:
        set_determinism(seed=None)
    assert straight.trainer.state.iteration == second.trainer.state.iteration == 8
    assert sorted(second.losses) == [5, 6, 7, 8]
    for it in (1, 2, 3, 4):
        assert first.losses[it] == straight.losses[it]
    for it in (5, 6, 7, 8):
        assert second.losses[it] == straight.losses[it], f"iteration {it} differs after resuming"
    for module_a, module_b in ((straight.ae, second.ae), (straight.disc, second.disc)):
        for (key, a), b in zip(module_a.state_dict().items(), module_b.state_dict().values()):
            assert torch.equal(a, b), key
    assert straight.opt.param_groups[0]["lr"] == second.opt.param_groups[0]["lr"]


def test_best_checkpoint_saver_writes_the_runs_record_into_the_weights(tmp_path):
    """In a run folder the saved weights carry the run's ``configs/run.json`` (also after the file is copied out of
    the run), stay a plain state dict for ``load_state_dict`` and ``weights_only`` loading; outside a run folder
    they carry nothing."""
    from common.checkpoint_io import RECORD_KEY, checkpoint_record

    run = tmp_path / "run"
    (run / "configs").mkdir(parents=True)
    record = {"schema": 1, "bundle": "b", "name": "B", "version": "1", "settings": {"channels": [8, 16]}}
    (run / "configs" / "run.json").write_text(json.dumps(record))
    net = nn.Linear(2, 1)
    BestCheckpointSaver(run / "models", net, "val_psnr")(_evaluator(1.0, 1))
    copied = tmp_path / "elsewhere.pt"
    shutil.copy(run / "models" / "model.pt", copied)
    (run / "configs" / "run.json").unlink()
    assert checkpoint_record(copied) == record == checkpoint_record(run / "models" / "model.pt")
    loaded = torch.load(copied, weights_only=True)
    assert loaded._metadata[RECORD_KEY] == record and set(loaded) == {"weight", "bias"}
    nn.Linear(2, 1).load_state_dict(loaded)  # strict: the record is no tensor of the network
    BestCheckpointSaver(tmp_path / "plain", net, "val_psnr")(_evaluator(1.0, 1))
    assert checkpoint_record(tmp_path / "plain" / "model.pt") is None

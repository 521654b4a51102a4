# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Crash-safe checkpoints during training: resumable ``last`` checkpoints and best-k model checkpoints (the files
are written and read by :mod:`common.checkpoint_io`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from ignite.engine import Engine, Events

from common.checkpoint_io import CheckpointError, load_checkpoint, mismatch_error, save_checkpoint, save_weights
from common.engines.trainer import NonFiniteLossError
from common.metrics.key_metric import key_metric_mode
from common.networks.wrappers import clean_state_dict, unwrap
from common.runs import RunRecord
from common.utils import (
    OutputWriteError,
    PeerFailureError,
    abort_distributed,
    describe_peer_failure,
    get_rank,
    get_world_size,
    is_rank0,
    rng_state,
    set_rng_state,
)

__all__ = ["BestCheckpointSaver", "CheckpointManager"]

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Periodic ``last`` checkpoint of everything a run needs to continue, and automatic resume from it.

    Saved every ``interval`` iterations and when training completes: the state dicts of ``save_dict``
    (networks unwrapped from DDP/compile, optimizers, schedulers), the trainer's GradScaler, the engine state
    (iteration/epoch), every rank's RNG states and the random state of the training transforms. Rank 0 writes
    atomically, so a crash during the write never replaces a good checkpoint with a torn one. At ``STARTED``,
    when ``resume`` is on and ``save_dir/filename`` exists, everything is restored and training continues from
    the saved iteration; the current ``max_epochs`` is kept so a run can be extended.

    Args:
        save_dir: folder of the checkpoint.
        save_dict: objects with ``state_dict``/``load_state_dict`` to save and restore.
        interval: iterations between saves (0 saves only at the end of training).
        filename: file name of the checkpoint.
        resume: ``True``/``"auto"`` resumes when the checkpoint exists, ``False`` never resumes, a path resumes
            from that file (an error if it does not exist).
        transform: the training transform whose random state is saved (optional).
        strict: strict state-dict loading for networks.
        run_record: the run's settings (:func:`common.runs.make_record`), written by rank 0 into
            ``<output_dir>/configs/run.json`` once resuming has succeeded (or there was nothing to resume), so a
            command whose settings do not fit the run's checkpoint stops with the settings that differ and leaves
            the run's record as it was.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        save_dict: Mapping[str, Any],
        interval: int = 100,
        filename: str = "last.pt",
        resume: bool | str = "auto",
        transform: Any = None,
        strict: bool = True,
        run_record: RunRecord | None = None,
    ) -> None:
        self.save_dir = Path(save_dir)
        self.save_dict = {k: v for k, v in save_dict.items() if v is not None}
        self.interval = int(interval)
        self.path = self.save_dir / filename
        self.resume = resume
        self.transform = transform
        self.strict = strict
        self.run_record = run_record
        self.resumed_from: int | None = None
        self._saved_iteration: int | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self.load)
        if self.interval > 0:
            engine.add_event_handler(Events.ITERATION_COMPLETED(every=self.interval), self.save)
        engine.add_event_handler(Events.COMPLETED, self.save)
        engine.add_event_handler(Events.EXCEPTION_RAISED, self.stop_on_failure)

    # --------------------------------------------------------------- saving
    def _objects(self, engine: Engine) -> dict[str, Any]:
        objects = dict(self.save_dict)
        scaler = getattr(engine, "scaler", None)
        if scaler is not None:
            objects.setdefault("scaler", scaler)
        return objects

    def state(self, engine: Engine) -> dict[str, Any]:
        """The checkpoint content (collective under DDP: every rank must call it)."""
        rng = _gather_objects({"global": rng_state(), "transform": _transform_rng_state(self.transform)})
        content: dict[str, Any] = {}
        for name, obj in self._objects(engine).items():
            if isinstance(obj, torch.nn.Module):
                content[name] = clean_state_dict(unwrap(obj).state_dict())
            else:
                content[name] = obj.state_dict()
        content["trainer"] = {
            "iteration": engine.state.iteration,
            "epoch": engine.state.epoch,
            "epoch_length": engine.state.epoch_length,
            "max_epochs": engine.state.max_epochs,
        }
        content["rng"] = rng
        if get_world_size() > 1:  # each rank's own statistics (BatchNorm), which DDP does not keep equal
            content["rank_buffers"] = _gather_objects(self._float_buffers(engine))
        content["meta"] = {"world_size": get_world_size(), "saved_at": time.time(), "torch": str(torch.__version__)}
        return content

    def _float_buffers(self, engine: Engine) -> dict[str, dict[str, torch.Tensor]]:
        """Floating-point buffers (BatchNorm running statistics) of every network, by network and buffer name."""
        return {
            name: {k: b.detach().cpu().clone() for k, b in unwrap(obj).named_buffers() if b.is_floating_point()}
            for name, obj in self._objects(engine).items()
            if isinstance(obj, torch.nn.Module)
        }

    def save(self, engine: Engine) -> None:
        """Write the checkpoint (rank 0); every rank learns whether the write succeeded.

        Raises:
            CheckpointError: on every rank when the file system refused the write; the previous checkpoint is
                unchanged.
        """
        if self._saved_iteration == engine.state.iteration:
            return
        content = self.state(engine)
        error = None
        if get_rank() == 0:
            try:
                save_checkpoint(content, self.path)
                logger.info(f"saved checkpoint {self.path} at iteration {engine.state.iteration}")
            except OutputWriteError as exc:
                error = str(exc)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)  # a collective: also keeps the ranks together
            error = box[0]
        if error is not None:
            raise CheckpointError(f"checkpoint at iteration {engine.state.iteration} not saved: {error}")
        self._saved_iteration = engine.state.iteration

    def stop_on_failure(self, engine: Engine, exc: BaseException) -> None:
        """``EXCEPTION_RAISED``: tear the process group down and say what is kept, then let the error propagate.

        The process group is destroyed first (:func:`common.utils.abort_distributed`), so the other ranks fail at
        once instead of waiting for the collective timeout, and a launcher such as ``torchrun --max_restarts`` can
        restart the job, which resumes from the last checkpoint. A non-finite loss, a refused write (full disk,
        read-only file system) or a lost peer rank is logged as one message naming the checkpoint that is kept; a
        lost peer is re-raised as :class:`common.utils.PeerFailureError` with that message.
        """
        peer = describe_peer_failure(exc)
        abort_distributed()
        if peer is None and not isinstance(exc, (NonFiniteLossError, CheckpointError, OutputWriteError)):
            raise exc
        if self.path.is_file():
            at = f" (iteration {self._saved_iteration})" if self._saved_iteration is not None else ""
            kept = f"The last checkpoint {self.path}{at} is intact: re-run the same command to resume from it."
        else:
            kept = "No checkpoint had been written yet."
        reason = str(peer or exc).rstrip(".")
        logger.error(f"training stopped at iteration {engine.state.iteration}: {reason}. {kept}")
        if peer is not None:
            raise PeerFailureError(f"{reason}. {kept}") from exc
        raise exc

    # --------------------------------------------------------------- loading
    def _resume_path(self) -> Path | None:
        if self.resume in (False, None, "false", "False", "none", ""):
            return None
        if self.resume in (True, "auto", "true", "True"):
            return self.path if self.path.is_file() else None
        path = Path(str(self.resume))
        if not path.is_file():
            raise CheckpointError(f"resume={str(self.resume)!r}: no such checkpoint file.")
        return path

    def load(self, engine: Engine) -> None:
        """Resume from the checkpoint when there is one (see ``resume``), then write the run's record."""
        self._remove_partial_writes()
        path = self._resume_path()
        if path is not None:
            self._resume(engine, path)
        if self.run_record is not None and is_rank0():
            self.run_record.write()

    def _resume(self, engine: Engine, path: Path) -> None:
        checkpoint = load_checkpoint(path)
        missing = [k for k in self._objects(engine) if k not in checkpoint]
        if missing:
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {missing}; it has {sorted(checkpoint)}.")
        for name, obj in self._objects(engine).items():
            try:
                if isinstance(obj, torch.nn.Module):
                    self._load_network(name, obj, checkpoint[name], path)
                else:
                    obj.load_state_dict(checkpoint[name])
            except CheckpointError:
                raise
            except (RuntimeError, KeyError, ValueError) as e:
                raise CheckpointError(f"cannot restore {name!r} from {str(path)!r}: {e}") from e
        self._restore_engine(engine, checkpoint["trainer"], path)
        self._restore_rank_buffers(engine, checkpoint.get("rank_buffers"))
        self._restore_rng(checkpoint.get("rng"), engine.state.iteration)
        self.resumed_from = self._saved_iteration = engine.state.iteration
        logger.info(f"resumed from {path} at iteration {engine.state.iteration} (epoch {engine.state.epoch})")

    def _load_network(self, name: str, network: torch.nn.Module, state: Mapping[str, Any], path: Path) -> None:
        """Restore ``network``; weights that do not fit name the settings that differ from the run's record."""
        try:
            unwrap(network).load_state_dict(state, strict=self.strict)
        except (RuntimeError, ValueError) as e:
            settings = self.run_record.full_settings() if self.run_record is not None else None
            error = mismatch_error(network, state, path, settings, strict=self.strict, detail=str(e))
            raise CheckpointError(f"cannot restore {name!r}: {error or e}") from None

    def _remove_partial_writes(self) -> None:
        """Delete temporary files a killed process left while writing this checkpoint (rank 0)."""
        if get_rank() != 0 or not self.save_dir.is_dir():
            return
        for stale in self.save_dir.glob(f".{self.path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
                logger.warning(f"removed {stale.name}, a checkpoint write interrupted by an earlier crash")

    def _restore_engine(self, engine: Engine, saved: Mapping[str, Any], path: Path) -> None:
        epoch_length = engine.state.epoch_length or saved["epoch_length"]
        if saved["epoch_length"] != epoch_length:
            logger.warning(
                f"epoch length changed from {saved['epoch_length']} to {epoch_length} since {path} was saved "
                "(different dataset size or number of processes); continuing by iteration count."
            )
        iteration = int(saved["iteration"])
        if iteration > engine.state.max_epochs * epoch_length:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is at iteration {iteration}, beyond max_epochs={engine.state.max_epochs} x "
                f"{epoch_length} iterations; raise max_epochs to continue training or set resume=false."
            )
        engine.state.iteration = iteration
        engine.state.epoch = iteration // epoch_length
        engine.state.epoch_length = epoch_length
        self._position_sampler(engine, iteration, epoch_length)

    @staticmethod
    def _position_sampler(engine: Engine, iteration: int, epoch_length: int) -> None:
        """Point a resumable sampler (:class:`common.data.pipeline.EpochSampler`) at the interrupted epoch and the
        first item it had not reached, so the resumed run sees the same items in the same order."""
        loader = getattr(engine, "data_loader", None)
        sampler = getattr(loader, "sampler", None)
        if not hasattr(sampler, "resume"):
            return
        if epoch_length != len(loader):
            logger.warning(
                f"epoch_length ({epoch_length}) is not one pass over the data ({len(loader)} batches): the resumed "
                "run continues with a new pass instead of the exact remaining items."
            )
            return
        sampler.resume(iteration // epoch_length, iteration % epoch_length * loader.batch_size)

    @torch.no_grad()
    def _restore_rank_buffers(self, engine: Engine, saved: list | None) -> None:
        """Give each rank back its own floating-point buffers (the networks' state dicts hold rank 0's)."""
        if saved is None or len(saved) != get_world_size():
            return
        mine = saved[get_rank()]
        for name, obj in self._objects(engine).items():
            if isinstance(obj, torch.nn.Module) and name in mine:
                buffers = dict(unwrap(obj).named_buffers())
                for key, value in mine[name].items():
                    if key in buffers:
                        buffers[key].copy_(value)

    def _restore_rng(self, saved: list | None, iteration: int) -> None:
        rank = get_rank()
        if saved is not None and len(saved) == get_world_size():
            set_rng_state(saved[rank]["global"])
            _set_transform_rng_state(self.transform, saved[rank]["transform"])
            return
        logger.warning("the number of processes changed since the checkpoint was saved: RNGs are re-seeded.")
        torch.manual_seed(iteration * 1000 + rank)
        np.random.seed((iteration * 1000 + rank) % 2**32)


class BestCheckpointSaver:
    """Keep the ``n_saved`` best network weights by a validation metric, plus ``filename`` for the best one.

    Attach to the evaluator (on every rank: rank 0 writes, the others only check the metric). Files are plain
    state dicts (what ``ckpt_export`` and ``inference.json`` load) carrying the run's record when ``save_dir`` is
    a run's ``models/`` (:func:`common.checkpoint_io.save_weights`), written atomically; worse files are deleted.
    Existing files in ``save_dir`` from an earlier, resumed run are taken into account.

    Args:
        save_dir: destination folder.
        network: the network to save (unwrapped automatically).
        key_metric: the ranking metric, a key in ``engine.state.metrics``; which way it improves follows
            :func:`common.metrics.key_metric.key_metric_mode`.
        n_saved: how many ranked checkpoints to keep.
        filename: file holding the single best model.
        global_step_transform: gives the step recorded in the file name (e.g. the trainer's iteration).
    """

    _pattern = re.compile(r"^model_(?P<metric>.+)=(?P<value>[-+0-9.einfa]+)_step=(?P<step>\d+)\.pt$")

    def __init__(
        self,
        save_dir: str | os.PathLike,
        network: torch.nn.Module,
        key_metric: str,
        n_saved: int = 3,
        filename: str = "model.pt",
        global_step_transform: Callable[[Engine], int] | None = None,
    ) -> None:
        self.save_dir = Path(save_dir)
        self.network = network
        self.key_metric = key_metric
        self.n_saved = int(n_saved)
        self.mode = key_metric_mode(key_metric)
        self.filename = filename
        self.global_step_transform = global_step_transform or (
            lambda engine: getattr(engine, "global_step", engine.state.epoch)
        )

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def _existing(self) -> list[tuple[float, Path]]:
        found = []
        if self.save_dir.is_dir():
            for path in self.save_dir.iterdir():
                m = self._pattern.match(path.name)
                if m and m.group("metric") == self.key_metric:
                    found.append((float(m.group("value")), path))
        return found

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def __call__(self, engine: Engine) -> None:
        if self.key_metric not in engine.state.metrics:
            raise KeyError(f"metric {self.key_metric!r} not in {sorted(engine.state.metrics)}; check key_metric.")
        if not is_rank0():
            return
        value = float(engine.state.metrics[self.key_metric])
        if math.isnan(value):
            logger.warning(f"{self.key_metric} is NaN: no best checkpoint written.")
            return
        ranked = sorted(self._existing(), key=lambda t: t[0], reverse=self.mode == "max")
        if len(ranked) >= self.n_saved and not self._better(value, ranked[self.n_saved - 1][0]):
            return
        state = clean_state_dict(unwrap(self.network).state_dict())
        step = int(self.global_step_transform(engine))
        path = save_weights(state, self.save_dir / f"model_{self.key_metric}={_exact(value)}_step={step}.pt")
        if not ranked or self._better(value, ranked[0][0]):
            save_weights(state, self.save_dir / self.filename)
            logger.info(f"new best {self.key_metric}={value:.6g} at step {step}: {self.save_dir / self.filename}")
        # the same value at the same step (a resumed run validating again) rewrites an existing file: count it once
        ranked = [(v, p) for v, p in ranked if p != path]
        ranked = sorted([*ranked, (value, path)], key=lambda t: t[0], reverse=self.mode == "max")
        for _, stale in ranked[self.n_saved :]:
            with contextlib.suppress(OSError):
                stale.unlink()


def _exact(value: float) -> str:
    """``value`` as 6 significant digits when they read back exactly, otherwise every digit (``repr``): the ranking
    read back from the file names on a later validation or after a resume compares exact values, so a tie or a
    difference in the 7th digit never replaces ``model.pt`` with a model that is not better."""
    short = f"{value:.6g}"
    return short if float(short) == value else repr(value)


def _randomizable(transform: Any, _seen: set[int] | None = None) -> list[Any]:
    """Every object with its own ``RandomState`` in ``transform``, in a fixed order.

    Besides ``Compose`` members this follows the inner transforms that MONAI's random dictionary transforms
    draw from (``RandSpatialCropd.cropper``, ``RandAffined.rand_affine.rand_affine_grid``, ...).
    """
    from monai.transforms import Randomizable, Transform

    seen = set() if _seen is None else _seen
    if transform is None or id(transform) in seen:
        return []
    seen.add(id(transform))
    found = [transform] if isinstance(getattr(transform, "R", None), np.random.RandomState) else []
    children = list(getattr(transform, "transforms", ()) or ())
    children += [
        v
        for k, v in getattr(transform, "__dict__", {}).items()
        if k != "transforms" and isinstance(v, (Transform, Randomizable))
    ]
    for child in children:
        found.extend(_randomizable(child, seen))
    return found


def _transform_rng_state(transform: Any) -> list[list]:
    states = []
    for t in _randomizable(transform):
        name, keys, pos, has_gauss, cached = t.R.get_state()
        states.append([name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)])
    return states


def _set_transform_rng_state(transform: Any, states: list[list]) -> None:
    targets = _randomizable(transform)
    if len(targets) != len(states):
        logger.warning("the training transforms changed since the checkpoint was saved: their RNGs are not restored.")
        return
    for t, (name, keys, pos, has_gauss, cached) in zip(targets, states):
        t.R.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _gather_objects(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered

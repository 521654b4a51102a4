# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Fault injection and fuzzing for every bundle: crashes, full disks, non-finite losses, dying ranks, hostile
input, and a long run's memory.

Scenarios run the real bundle command (``python -m monai.bundle run training ...``) on small generated data; the
faults are injected by an extra config file (:func:`fault_config`) that calls :func:`inject` inside the bundle
process. The tests call the same functions with small sizes; ``report`` runs everything and prints the tables of
``docs/reliability.md``::

    python scripts/reliability.py faults --bundle autoencoder_3d --workdir /tmp/rel [--processes 2]
    python scripts/reliability.py fuzz --cases 500
    python scripts/reliability.py soak --iterations 3000 --workdir /tmp/soak
    python scripts/reliability.py report --workdir /tmp/rel --fuzz_cases 500 --soak_iterations 3000
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gzip
import io
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.bundle import ROOT as REPO_ROOT
from scripts.harness.bundles import BUNDLES, family
from scripts.harness.tools import config_file

FSIZE_LIMIT = 64 * 1024  # a process file-size limit below every checkpoint and above every log of a tiny run


# ----------------------------------------------------------------------------------------- faults inside a run
def inject(
    trainer: Any,
    kill_at: int | None = None,
    kill_while_saving_at: int | None = None,
    nan_at: int | None = None,
    full_disk_at: int | None = None,
    disk_error: str = "EFBIG",
    stall_at: int | None = None,
    rank: int | None = None,
    once_marker: str | None = None,
    strike_file: str | None = None,
) -> None:
    """Arm faults on a bundle's trainer (called from :func:`fault_config`; iterations are 1-based).

    Args:
        trainer: the ignite trainer.
        kill_at: SIGKILL this process when iteration ``kill_at`` completes (after any checkpoint of it).
        kill_while_saving_at: SIGKILL this process half-way through writing the first checkpoint at or after
            this iteration.
        nan_at: fill the batch's ``image`` with NaN at this iteration.
        full_disk_at: from this iteration on, file writes fail: ``EFBIG`` lowers the process's real file-size limit
            (``RLIMIT_FSIZE``, the kernel refuses the write), ``ENOSPC``/``EROFS`` make ``torch.save`` write part of
            the file and then fail as a full or read-only file system would.
        disk_error: ``EFBIG``, ``ENOSPC`` or ``EROFS``.
        stall_at: stop responding (sleep) at this iteration, as a hung rank does.
        rank: arm the faults on this rank only (``None``: every rank).
        once_marker: a file created when the faults are armed; while it exists they are not armed again (a job
            restarted by ``torchrun --max_restarts`` then runs clean).
        strike_file: a file to which the process writes the time (``time.time()``) at which ``kill_at`` or
            ``stall_at`` strikes, just before it dies or stops responding.
    """
    from ignite.engine import Events

    from common.utils import get_rank

    if rank is not None and get_rank() != rank:
        return
    if once_marker is not None:
        if os.path.exists(once_marker):
            return
        Path(once_marker).touch()
    if kill_at:
        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=kill_at), lambda _: _kill_self(strike_file))
    if kill_while_saving_at:
        trainer.add_event_handler(Events.ITERATION_STARTED(once=kill_while_saving_at), lambda _: _break_saves(True))
    if nan_at:
        trainer.add_event_handler(Events.ITERATION_STARTED(once=nan_at), _poison_batch)
    if full_disk_at:
        trainer.add_event_handler(Events.ITERATION_STARTED(once=full_disk_at), lambda _: _fill_disk(disk_error))
    if stall_at:
        trainer.add_event_handler(Events.ITERATION_STARTED(once=stall_at), lambda _: _stall(strike_file))


def _note_strike(strike_file: str | None) -> None:
    if strike_file is not None:
        Path(strike_file).write_text(repr(time.time()))


def _stall(strike_file: str | None = None) -> None:
    _note_strike(strike_file)
    time.sleep(3600)


def _kill_self(strike_file: str | None = None) -> None:
    _note_strike(strike_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _poison_batch(engine: Any) -> None:
    engine.state.batch["image"].fill_(float("nan"))


def _break_saves(kill: bool, code: int = errno.ENOSPC) -> None:
    """Replace ``torch.save``: write a third of the file, then SIGKILL the process or raise ``OSError(code)``."""
    original = torch.save

    def broken(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        buffer = io.BytesIO()
        original(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 3])
        f.flush()
        if kill:
            _kill_self()
        raise OSError(code, os.strerror(code))

    torch.save = broken


def _fill_disk(disk_error: str) -> None:
    if disk_error == "EFBIG":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    elif disk_error in ("ENOSPC", "EROFS"):
        _break_saves(False, getattr(errno, disk_error))
    else:
        raise ValueError(f"disk_error must be EFBIG, ENOSPC or EROFS, got {disk_error!r}.")


def fault_config(path: str | os.PathLike, **faults: Any) -> Path:
    """Write a config file that arms ``faults`` (see :func:`inject`) when merged last into a training config."""
    arguments = ", ".join(f"{k}={v!r}" for k, v in faults.items() if v is not None)
    expression = f"$inject_faults(@train#trainer, {arguments})"
    path = Path(path)
    path.write_text(
        json.dumps(
            {"+imports": ["$from scripts.harness.faults import inject as inject_faults"], "+initialize": [expression]}
        )
    )
    return path


# ----------------------------------------------------------------------------------------- bundles and runs
@dataclass
class BundleCase:
    """A small training job of one bundle: its configs, overrides, and where its checkpoint and weights are."""

    bundle: str
    configs: list[str]
    args: dict[str, Any]
    data: tuple[str, ...] = ("dataset_dir",)  # the ids of ``args`` that point the configs at the generated data
    output_arg: str = "output_dir"
    ckpt: str = "models/last.pt"
    weights: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)  # overrides of the 2-process version of the job

    def distributed(self) -> BundleCase:
        """The job for 2 processes: ``extra`` keeps 8 or more iterations once the data is split over the ranks."""
        return dataclasses.replace(self, args={**self.args, **self.extra}, extra={})

    def overrides(self, output: Path) -> list[str]:
        """The ``--id value`` words of the job writing to ``output``."""
        from common.bundle_tools.launch import format_overrides

        return format_overrides({**self.args, self.output_arg: str(output)})

    def command(self, output: Path, probe: Path | None = None, multi_gpu: bool = False) -> list[str]:
        configs = [str(config_file(self.bundle, c)) for c in self.configs]
        configs += [str(config_file(self.bundle, "multi_gpu_train.json"))] if multi_gpu else []
        configs += [str(probe)] if probe is not None else []
        return ["-m", "monai.bundle", "run", "training", "--config_file", json.dumps(configs), *self.overrides(output)]

    def checkpoint(self, output: Path) -> Path:
        return output / self.ckpt


# settings of every fault-test job: deterministic kernels, a checkpoint every 2 iterations, one thread
RUN_SETTINGS = {"deterministic": True, "ckpt_interval": 2, "num_threads": 1}


def make_case(bundle: str, root: str | os.PathLike, seed: int = 0) -> BundleCase:
    """Generate small data for ``bundle`` under ``root`` and return its job (the ``fault_case`` of the bundle's
    module in :data:`scripts.harness.bundles.FAMILY_MODULES`): 8 or more iterations, a checkpoint every 2,
    deterministic kernels, a validation at the end (and half-way for ``autoencoder_3d``, so a resumed run crosses a
    validation).

    ``seed`` seeds the data and every run of the job (``--seed``: initialisation, data order, augmentation). For
    ``mace_survival`` the cohort is the first one from seed ``seed`` on that the job can train and validate (see
    :func:`scripts.harness.survival.mace_cohort`); its seed is then the job's seed.

    Raises:
        ValueError: for a bundle that is not in the table.
    """
    module = family(bundle)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return module.fault_case(root, int(seed))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return env


def run_case(
    case: BundleCase, output: Path, probe: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run ``case`` once (one process) with an optional fault config; output captured."""
    cmd = [sys.executable, *case.command(output, probe)]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def saved_iteration(path: Path) -> int | None:
    """The iteration of a ``last`` checkpoint, or ``None`` when it is missing or unreadable."""
    from common.checkpoint_io import CheckpointError, load_checkpoint

    try:
        return int(load_checkpoint(path)["trainer"]["iteration"])
    except CheckpointError:
        return None


def same_weights(case: BundleCase, a: Path, b: Path) -> list[str]:
    """Names of the tensors that differ between two ``last`` checkpoints of ``case`` (empty: bit-identical)."""
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return [
        f"{part}.{key}"
        for part in case.weights
        for key, value in first[part].items()
        if not torch.equal(value, second[part][key])
    ]


def _stale_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*.tmp")) if folder.is_dir() else []


@dataclass
class Step:
    """One run of a fault sequence and what it showed."""

    fault: str
    returncode: int
    resumed_from: int | None
    checkpoint_after: int | None
    message: str
    ok: bool


def _message(result: subprocess.CompletedProcess, marker: str) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if marker in line]
    return lines[-1].strip()[:400] if lines else ""


def _resumed(result: subprocess.CompletedProcess) -> int | None:
    for line in (result.stdout + result.stderr).splitlines():
        if "resumed from" in line and " at iteration " in line:
            return int(line.split(" at iteration ")[1].split()[0])
    return None


FAULTS = ("disk", "nan", "kill_while_saving", "kill")


def _reference(case: BundleCase, run: Callable[..., Any], output: Path, intervals: int) -> tuple[int, int]:
    """Run the uninterrupted reference job; ``(its iterations, the checkpoint interval)``.

    Raises:
        RuntimeError: when the reference run fails.
        ValueError: when the job has fewer than ``intervals`` checkpoint intervals (too short for the faults).
    """
    result = run(case, output)
    if result.returncode != 0:
        raise RuntimeError(f"reference run of {case.bundle} failed:\n{result.stderr[-4000:]}")
    total = saved_iteration(case.checkpoint(output))
    step = int(case.args["ckpt_interval"])
    if total is None or total < intervals * step:
        raise ValueError(f"{case.bundle}: the faults need at least {intervals * step} iterations, the job has {total}.")
    return total, step


def _outcome(case: BundleCase, reference: Path, out: Path, steps: list[Step]) -> dict[str, Any]:
    differing = same_weights(case, case.checkpoint(reference), case.checkpoint(out))
    return {
        "bundle": case.bundle,
        "steps": steps,
        "identical": not differing,
        "differing": differing[:5],
        "ok": all(s.ok for s in steps) and not differing,
    }


def fault_sequence(
    case: BundleCase, workdir: str | os.PathLike, seed: int = 0, faults: Sequence[str] = FAULTS
) -> dict[str, Any]:
    """One uninterrupted reference run, then the same job interrupted by four faults in turn and re-run with the
    same command after each, until it completes:

    1. the disk fills up (``EFBIG`` from the kernel's file-size limit) at a random iteration: the run must stop
       with a message naming the write, keep the previous checkpoint loadable and leave no partial file;
    2. the loss becomes NaN at a random later iteration: the run must stop naming the iteration and the loss terms
       and keep the last checkpoint;
    3. SIGKILL while the checkpoint is being written: the previous checkpoint must stay the ``last`` one;
    4. SIGKILL at a random iteration between checkpoints.

    Each re-run must resume from the last checkpoint (losing at most ``ckpt_interval`` iterations), and the final
    weights must be bit-identical to the reference run's. ``faults`` selects and orders the faults (names of
    :data:`FAULTS`).

    Returns:
        ``{"bundle", "steps": [Step, ...], "identical": bool, "differing": [...], "ok": bool}``.
    """
    workdir = Path(workdir)
    rng = random.Random(seed)
    reference, out = workdir / "reference", workdir / "interrupted"
    total, step = _reference(case, run_case, reference, intervals=4)
    # each fault strikes within one checkpoint interval (+1) of where the previous run left off; `expect` is the
    # iteration of the `last` checkpoint the fault must leave
    catalogue = {
        "disk": ("disk full (EFBIG)", "full_disk_at", lambda r: rng.randint(r + step + 1, r + 2 * step), "could not"),
        "nan": ("NaN loss", "nan_at", lambda r: rng.randint(r + 1, r + step + 1), "non-finite"),
        "kill_while_saving": (
            "SIGKILL while saving",
            "kill_while_saving_at",
            lambda r: rng.randint(r + 1, r + step),
            "",
        ),
        "kill": ("SIGKILL", "kill_at", lambda r: rng.randint(r + 1, min(total, r + step + 1)), ""),
    }
    unknown = [f for f in faults if f not in catalogue]
    if unknown:
        raise ValueError(f"unknown faults {unknown}; expected names of {FAULTS}.")
    plan = [catalogue[f] for f in faults]
    expect = {
        "full_disk_at": lambda f: (f - 1) // step * step,
        "nan_at": lambda f: (f - 1) // step * step,
        "kill_while_saving_at": lambda f: -(-f // step) * step - step,
        "kill_at": lambda f: f // step * step,
    }
    steps, resume_point = [], 0
    for index, (name, key, choose, marker) in enumerate([*plan, ("none (completes)", None, None, "")]):
        before = saved_iteration(case.checkpoint(out))
        at = choose(resume_point) if choose else None
        probe = fault_config(workdir / f"fault{index}.json", **{key: at}) if key else None
        result = run_case(case, out, probe)
        after = saved_iteration(case.checkpoint(out))
        resumed = _resumed(result)
        message = _message(result, marker) if marker else ""
        killed = key in ("kill_at", "kill_while_saving_at")
        if key is None:
            ok = result.returncode == 0 and after == total
        else:
            ok = after == (expect[key](at) or None) and (
                result.returncode == -signal.SIGKILL if killed else result.returncode != 0 and bool(message)
            )
        ok = ok and resumed == before and (killed or not _stale_files(case.checkpoint(out).parent))
        steps.append(Step(f"{name} at iteration {at}" if at else name, result.returncode, resumed, after, message, ok))
        resume_point = after or 0
    return _outcome(case, reference, out, steps)


# ----------------------------------------------------------------------------------------- several processes
def run_torchrun(
    case: BundleCase,
    output: Path,
    probe: Path | None = None,
    max_restarts: int = 0,
    log_dir: Path | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """Run ``case`` as a 2-process CPU job through the collection's launcher (``scripts/launch.py``: ``torchrun``
    with ``multi_gpu_train.json`` merged, per-rank logs under ``log_dir``)."""
    extra = [c for c in case.configs if c != "train.json"] + ([str(probe)] if probe is not None else [])
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "launch.py"), case.bundle, "--nproc_per_node", "2"]
    cmd += ["--cpu", "True", "--max_restarts", str(max_restarts), "--extra_configs", json.dumps(extra)]
    cmd += ["--log_dir", str(log_dir)] if log_dir is not None else []
    cmd += case.overrides(output)
    return subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def distributed_sequence(
    case: BundleCase, workdir: str | os.PathLike, seed: int = 0, kill_rank_0: bool = True
) -> dict[str, Any]:
    """The same job as 2 torchrun processes: an uninterrupted reference, then

    1. SIGKILL of rank 0 at a random iteration (``--max_restarts 0``): the job fails;
    2. a NaN loss on rank 1 only: both ranks stop at that iteration (rank 0 names the other rank), the last
       checkpoint is kept;
    3. rank 1 dies once at a random iteration under ``--max_restarts 1``: torchrun restarts both ranks, which
       resume from the last checkpoint and complete the job.

    Each run resumes from where the previous one left off, and the final weights must be bit-identical to the
    reference's. ``kill_rank_0=False`` leaves out step 1 (step 3 kills a rank as well).

    Returns:
        ``{"bundle", "steps": [Step, ...], "identical", "differing", "ok"}``.
    """
    workdir = Path(workdir)
    rng = random.Random(seed)
    reference, out = workdir / "ddp_reference", workdir / "ddp_interrupted"
    total, step = _reference(case, run_torchrun, reference, intervals=3)
    kill_at = rng.randint(step + 1, 2 * step - 1) if step > 1 else step + 1
    nan_at = kill_at // step * step + 1 if kill_rank_0 else rng.randint(step + 1, 2 * step)
    die_at = nan_at + rng.randint(1, step)
    plan = [
        ("SIGKILL of rank 0", {"kill_at": kill_at, "rank": 0}, 0, kill_at // step * step, ""),
        ("NaN loss on rank 1", {"nan_at": nan_at, "rank": 1}, 0, (nan_at - 1) // step * step, "non-finite loss"),
        ("rank 1 dies, --max_restarts 1", {"kill_at": die_at, "rank": 1}, 1, total, ""),
    ][0 if kill_rank_0 else 1 :]
    steps = []
    for index, (name, faults, restarts, expected, marker) in enumerate(plan):
        before = saved_iteration(case.checkpoint(out))
        if restarts:
            faults = {**faults, "once_marker": str(workdir / f"ddp_fault{index}.done")}
        probe = fault_config(workdir / f"ddp_fault{index}.json", **faults)
        logs = workdir / f"ddp_logs{index}"
        result = run_torchrun(case, out, probe, max_restarts=restarts, log_dir=logs)
        after = saved_iteration(case.checkpoint(out))
        text = result.stdout + result.stderr + "".join(p.read_text() for p in sorted(logs.rglob("*.log")))
        message = next((line.strip()[:400] for line in text.splitlines() if marker and marker in line), "")
        ok = after == expected and (result.returncode == 0) == bool(restarts) and (not marker or bool(message))
        if before is not None:
            ok = ok and f"resumed from {case.checkpoint(out)} at iteration {before}" in text
        if restarts:  # the restarted attempt resumed from the checkpoint the dead rank left
            ok = ok and len(list(logs.glob("*/attempt_1"))) == 1 and "resumed from" in _attempt_logs(logs, 1)
        at = faults.get("kill_at") or faults.get("nan_at")
        steps.append(Step(f"{name} at iteration {at}", result.returncode, before, after, message, ok))
    return _outcome(case, reference, out, steps)


def _attempt_logs(logs: Path, attempt: int) -> str:
    return "".join(p.read_text() for p in sorted(logs.glob(f"*/attempt_{attempt}/*/*.log")))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peer_failure(
    case: BundleCase, workdir: str | os.PathLike, mode: str = "kill", at: int = 3, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Rank 1 of a 2-process job (started without torchrun, so nothing else reacts) dies (``kill``) or hangs
    (``stall``) at iteration ``at``; measure how long rank 0 takes to exit and what it says.

    ``timeout_s`` is the job's collective timeout (``dist_timeout``): a rank that stalls makes rank 0's next
    collective time out after it; a rank that dies closes its connections, so rank 0 fails at once, however long
    the timeout.

    Returns:
        ``{"mode", "returncode", "seconds", "message"}``: rank 0's exit status, its seconds from rank 1's fault (the
        time rank 1 records just before it dies or stops responding) to its exit, and its error line.
    """
    workdir = Path(workdir)
    args = {**case.args, "dist_timeout": timeout_s}
    job = dataclasses.replace(case, args=args, extra={})
    strike = workdir / f"peer_{mode}.strike"
    strike.unlink(missing_ok=True)
    fault = {"kill_at" if mode == "kill" else "stall_at": at, "strike_file": str(strike)}
    probe = fault_config(workdir / f"peer_{mode}.json", rank=1, **fault)
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    procs, logs = [], []
    for rank in (0, 1):
        log = open(workdir / f"peer_{mode}_rank{rank}.log", "w")
        logs.append(log)
        cmd = [sys.executable, *job.command(workdir / f"peer_{mode}", probe, multi_gpu=True)]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    try:
        deadline = time.time() + 600
        while procs[0].poll() is None and time.time() < deadline:
            time.sleep(0.05)
        end = time.time()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for log in logs:
            log.close()
    text = (workdir / f"peer_{mode}_rank0.log").read_text()
    message = next((line.strip() for line in text.splitlines() if "lost contact" in line), "")
    fault_time = float(strike.read_text()) if strike.is_file() and strike.read_text() else None
    return {
        "mode": mode,
        "returncode": procs[0].returncode,
        "seconds": None if fault_time is None else round(end - fault_time, 1),
        "message": message,
    }


# ----------------------------------------------------------------------------------------- hostile input
@dataclass
class FuzzOutcome:
    """Counts of one fuzz family: cases tried, refused with a clear error, accepted, and crashes (raw
    exceptions or errors that do not name the input), with the largest memory seen; and the outcomes of the
    family's two fixed examples: a valid input (run first, untraced: it also imports and warms up what the checks
    use) and a known-bad one (counted with the fuzzed cases): ``accepted`` and ``refused`` as they must be, else
    the outcome and its detail."""

    family: str
    cases: int = 0
    refused: int = 0
    accepted: int = 0
    crashes: list[str] = field(default_factory=list)
    peak_mib: float = 0.0
    valid: str = ""
    known_bad: str = ""


def _nifti_bytes(shape: Sequence[int] = (12, 12, 10), compressed: bool = False, seed: int = 0) -> bytes:
    """A valid small float32 NIfTI-1 file of seeded noise, as bytes (gzip-compressed on request)."""
    import nibabel as nib

    data = np.random.default_rng(seed).normal(size=shape).astype(np.float32)
    raw = nib.Nifti1Image(data, np.diag([1.5, 1.5, 2.0, 1.0])).to_bytes()
    return gzip.compress(raw, mtime=0) if compressed else raw


def _mutated_header(raw: bytes, field_name: str, value: int) -> bytes:
    import nibabel as nib

    header = nib.Nifti1Header.from_fileobj(io.BytesIO(raw[:348]), check=False)
    with contextlib.suppress(Exception):
        if field_name == "dim":
            dims = list(header["dim"])
            dims[1 + abs(value) % 3] = value
            header["dim"] = dims
        else:
            header[field_name] = value
    return header.binaryblock + raw[348:]


def _volume_case(folder: Path, name: str, content: bytes) -> Callable[[], tuple[str, str]]:
    """A datalist with one training entry whose file holds ``content``; returns (outcome, detail)."""
    from common.data.preflight import PreflightError, preflight

    path = folder / name
    path.write_bytes(content)

    def check() -> tuple[str, str]:
        try:
            preflight({"training": [{"image": name}]}, base_dir=str(folder), num_workers=1, required=("training",))
        except PreflightError as exc:
            return ("refused", str(exc)) if name in str(exc) else ("crash", f"error without the file name: {exc}")
        return "accepted", ""

    return check


def _dicom_seed(folder: Path, seed: int = 0) -> list[bytes]:
    from common.demo.images import write_phantom_dataset

    write_phantom_dataset(folder, n_train=1, n_val=0, shape=(16, 16, 6), kind="ct", dicom=True, seed=seed)
    return [p.read_bytes() for p in sorted(folder.rglob("*.dcm"))]


def _run_family(
    family: str,
    cases: int,
    seed: int,
    draw: Callable[[Any], Callable[[], tuple[str, str]]],
    valid: Callable[[], Callable[[], tuple[str, str]]],
    known_bad: Callable[[], Callable[[], tuple[str, str]]],
) -> FuzzOutcome:
    """Run the ``valid`` example untraced (it warms up the imports and caches of the checks, so the traced peaks
    are those of the inputs), then the ``known_bad`` example and ``cases`` hypothesis examples traced and counted:
    ``draw(data)`` builds one input and returns its check."""
    import tracemalloc

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    outcome = FuzzOutcome(family)

    def run(check: Callable[[], tuple[str, str]], traced: bool = True) -> tuple[str, str]:
        if traced:
            tracemalloc.start()
        try:
            kind, detail = check()
        except Exception as exc:  # noqa: BLE001 - a raw exception is what the fuzzing looks for
            kind, detail = "crash", f"{type(exc).__name__}: {exc}"
        finally:
            if traced:
                peak = tracemalloc.get_traced_memory()[1] / 1024**2
                tracemalloc.stop()
        if not traced:
            return kind, detail
        outcome.cases += 1
        outcome.peak_mib = max(outcome.peak_mib, peak)
        if kind == "crash":
            outcome.crashes.append(detail[:300])
        elif kind == "refused":
            outcome.refused += 1
        else:
            outcome.accepted += 1
        return kind, detail

    kind, detail = run(valid(), traced=False)
    outcome.valid = kind if kind == "accepted" else f"{kind}: {detail[:300]}"
    kind, detail = run(known_bad())
    outcome.known_bad = kind if kind == "refused" else f"{kind}: {detail[:300]}"

    @hypothesis_seed(seed)
    @settings(
        max_examples=cases,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @given(st.data())
    def one(data: Any) -> None:
        run(draw(data))

    one()
    return outcome


def fuzz(cases: int = 200, seed: int = 0, workdir: str | None = None) -> list[FuzzOutcome]:
    """Fuzz the readers and checks with ``hypothesis``-generated hostile inputs, ``cases`` per family:

    - ``nifti``: random bytes, valid files truncated anywhere, header fields (dims up to 2^31, datatype,
      bitpix, vox_offset, scale) set to arbitrary values; ``.nii`` and ``.nii.gz``; through :func:`preflight`.
    - ``dicom``: a series whose files are random bytes, truncated or byte-flipped real DICOM files.
    - ``csv``: cohort tables with random cells of mixed types (text, numbers, NaN/inf, quotes, empty, unicode).
    - ``json``: datalists of random JSON values and wrong types, and path entries with ``..`` and symbolic links
      leaving the dataset root.

    Every case must either be accepted or refused with an error naming the input; anything else is a crash.
    Memory is the peak of Python-tracked allocations (numpy included) per case. Each family also runs a fixed
    valid input first (it must be accepted; it warms up imports and caches, untraced) and a fixed known-bad input
    (it must be refused), whatever the draws (see :class:`FuzzOutcome`). ``seed`` seeds the draws and the valid
    files the inputs are made from.
    """
    root = Path(workdir or tempfile.mkdtemp(prefix="fuzz_"))
    root.mkdir(parents=True, exist_ok=True)
    return [fuzz_family(root, cases, seed) for fuzz_family in (_fuzz_nifti, _fuzz_dicom, _fuzz_csv, _fuzz_json)]


def _new_folder(root: Path) -> Path:
    """A new empty folder under ``root`` for one fuzz case."""
    return Path(tempfile.mkdtemp(dir=root))


_NIFTI_FIELDS = ["dim", "datatype", "bitpix", "vox_offset", "scl_slope", "sizeof_hdr", "pixdim"]


def _fuzz_nifti(root: Path, cases: int, seed: int) -> FuzzOutcome:
    """NIfTI volumes through :func:`preflight`: random bytes, valid files truncated anywhere, header fields set to
    arbitrary values, ``.nii`` and ``.nii.gz``."""
    from hypothesis import strategies as st

    raw, packed = _nifti_bytes(seed=seed), _nifti_bytes(compressed=True, seed=seed)

    def nifti(data: Any) -> Callable[[], tuple[str, str]]:
        kind = data.draw(st.sampled_from(["random", "truncated", "header", "header+gz"]))
        if kind == "random":
            content = data.draw(st.binary(min_size=0, max_size=4096))
        elif kind == "truncated":
            source = data.draw(st.sampled_from([raw, packed]))
            content = source[: data.draw(st.integers(0, len(source) - 1))]
        else:
            name = data.draw(st.sampled_from(_NIFTI_FIELDS))
            value = data.draw(st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, 2**15, 30000])))
            content = _mutated_header(raw, name, value)
            if kind == "header+gz":
                content = gzip.compress(content, mtime=0)
        suffix = ".nii.gz" if kind in ("header+gz",) or content[:2] == b"\x1f\x8b" else ".nii"
        return _volume_case(_new_folder(root), f"case{suffix}", content)

    return _run_family(
        "nifti",
        cases,
        seed,
        nifti,
        valid=lambda: _volume_case(_new_folder(root), "case.nii.gz", packed),
        known_bad=lambda: _volume_case(_new_folder(root), "case.nii", raw[: len(raw) // 2]),  # truncated
    )


def _dicom_case(root: Path, contents: Sequence[bytes]) -> Callable[[], tuple[str, str]]:
    """A series of ``contents`` (one file each) and its check through :func:`preflight`."""
    from common.data.preflight import PreflightError, preflight

    folder = _new_folder(root)
    series = folder / "series"
    series.mkdir()
    for i, content in enumerate(contents):
        (series / f"{i:03d}.dcm").write_bytes(content)

    def check() -> tuple[str, str]:
        try:
            preflight({"training": [{"image": "series"}]}, base_dir=str(folder), num_workers=1)
        except PreflightError as exc:
            return ("refused", str(exc)) if "series" in str(exc) else ("crash", str(exc))
        return "accepted", ""

    return check


def _fuzz_dicom(root: Path, cases: int, seed: int) -> FuzzOutcome:
    """DICOM series (a quarter of ``cases``, at least one) whose files are kept, random bytes, truncated or
    byte-flipped real DICOM files."""
    from hypothesis import strategies as st

    seeds = _dicom_seed(root / "dicom_seed", seed=seed)

    def dicom(data: Any) -> Callable[[], tuple[str, str]]:
        contents = []
        for original in seeds:
            kind = data.draw(st.sampled_from(["keep", "random", "truncate", "flip"]))
            if kind == "random":
                content = data.draw(st.binary(min_size=0, max_size=2048))
            elif kind == "truncate":
                content = original[: data.draw(st.integers(0, len(original) - 1))]
            elif kind == "flip":
                position = data.draw(st.integers(0, len(original) - 1))
                content = original[:position] + bytes([original[position] ^ 0xFF]) + original[position + 1 :]
            else:
                content = original
            contents.append(content)
        return _dicom_case(root, contents)

    return _run_family(
        "dicom",
        max(1, cases // 4),
        seed,
        dicom,
        valid=lambda: _dicom_case(root, seeds),
        known_bad=lambda: _dicom_case(root, [b"not a DICOM file"] * len(seeds)),
    )


def _table_case(root: Path, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Callable[[], tuple[str, str]]:
    """A cohort CSV of ``header`` and ``rows`` and its check through :func:`read_cohort_csv`: accepted rows must
    hold valid times and events."""
    from common.survival.cohort import CohortError, read_cohort_csv

    buffer = io.StringIO()
    writer = __import__("csv").writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    path = _new_folder(root) / "cohort.csv"
    path.write_text(buffer.getvalue(), encoding="utf-8")

    def check() -> tuple[str, str]:
        try:
            entries = read_cohort_csv(path, covariates=["age"] if "age" in header else ())
        except CohortError as exc:
            return ("refused", str(exc)) if "cohort.csv" in str(exc) else ("crash", str(exc))
        bad = [e for e in entries if not (np.isfinite(e["time"]) and e["time"] >= 0 and e["event"] in (0, 1))]
        return ("crash", f"accepted invalid rows {bad[:2]}") if bad else ("accepted", "")

    return check


def _fuzz_csv(root: Path, cases: int, seed: int) -> FuzzOutcome:
    """Cohort tables with random cells of mixed types (text, numbers, NaN/inf, quotes, empty, unicode)."""
    from hypothesis import strategies as st

    cell = st.one_of(
        st.text(max_size=12),
        st.integers(-(10**12), 10**12).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(["", " ", "nan", "inf", "-1", "1e309", '"', "1,5", "0x10", "True", "NULL", "1.0", "0"]),
    )

    def table(data: Any) -> Callable[[], tuple[str, str]]:
        header = data.draw(
            st.sampled_from(
                [["case_id", "image", "time", "event"], ["image", "time", "event", "age"], ["id", "img", "t"]]
            )
        )
        rows = data.draw(st.lists(st.lists(cell, min_size=len(header) - 1, max_size=len(header) + 1), max_size=6))
        return _table_case(root, header, rows)

    columns = ["case_id", "image", "time", "event"]
    return _run_family(
        "csv",
        cases,
        seed,
        table,
        valid=lambda: _table_case(root, columns, [["a", "a.nii.gz", "100", "1"], ["b", "b.nii.gz", "200", "0"]]),
        known_bad=lambda: _table_case(root, columns, [["a", "a.nii.gz", "-100", "1"], ["b", "b.nii.gz", "200", "2"]]),
    )


def _datalist_case(root: Path, content: Any) -> Callable[[], tuple[str, str]]:
    """A datalist file of ``content`` beside a link out of its folder, and its check through
    :func:`parse_datalist_section`: no accepted path may leave the folder."""
    from common.data.datalist import DatalistError, parse_datalist_section

    folder = _new_folder(root)
    (folder / "link").symlink_to(root)
    file = folder / "datalist.json"
    file.write_text(json.dumps(content))

    def check() -> tuple[str, str]:
        try:
            entries, problems, _ = parse_datalist_section(file, "training", base_dir=str(folder))
        except DatalistError as exc:
            return ("refused", str(exc)) if "datalist.json" in str(exc) else ("crash", str(exc))
        if problems:
            return "refused", str(problems)
        escaped = [e for e in entries if e and not str(e["image"]).startswith(str(folder))]
        return ("crash", f"path outside the root accepted: {escaped}") if escaped else ("accepted", "")

    return check


def _fuzz_json(root: Path, cases: int, seed: int) -> FuzzOutcome:
    """Datalists of random JSON values and wrong types, and path entries with ``..`` and symbolic links leaving the
    dataset root."""
    from hypothesis import strategies as st

    json_value = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
        max_leaves=8,
    )
    (root / "outside.nii").write_bytes(_nifti_bytes(seed=seed))

    def datalist(data: Any) -> Callable[[], tuple[str, str]]:
        kind = data.draw(st.sampled_from(["random", "entries", "paths"]))
        if kind == "random":
            content = data.draw(json_value)
        elif kind == "entries":
            content = {"training": data.draw(st.lists(json_value | st.fixed_dictionaries({"image": json_value})))}
        else:
            path = data.draw(
                st.sampled_from(["../outside.nii", "link/outside.nii", "a/../../outside.nii", "./x/../.."])
            )
            content = {"training": [{"image": path}]}
        return _datalist_case(root, content)

    return _run_family(
        "json",
        cases,
        seed,
        datalist,
        valid=lambda: _datalist_case(root, {"training": [{"image": "a.nii.gz"}, {"image": "sub/b.nii.gz"}]}),
        known_bad=lambda: _datalist_case(root, {"training": [{"image": "link/outside.nii"}]}),
    )


# ----------------------------------------------------------------------------------------- long run
def _rss_mib_and_fds() -> tuple[float, int]:
    """This process's resident set size (MiB) and number of open file descriptors (Linux ``/proc``)."""
    fds = len(os.listdir("/proc/self/fd")) - 1  # less the descriptor of the listing itself
    status = Path("/proc/self/status").read_text()
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kib / 1024, fds


def record_resources(trainer: Any, path: str, every: int = 2) -> None:
    """Append ``[iteration, RSS MiB, open file descriptors]`` of this process to ``path`` (one JSON list a line)
    every ``every`` iterations, at the same point of the iteration each time (called from :func:`probe_config`)."""
    from ignite.engine import Events

    def sample(engine: Any) -> None:
        rss, fds = _rss_mib_and_fds()
        with open(path, "a") as f:
            f.write(json.dumps([engine.state.iteration, round(rss, 2), fds]) + "\n")

    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=int(every)), sample)


def probe_config(config: str | os.PathLike, **kwargs: Any) -> Path:
    """Write the config file ``config`` that calls :func:`record_resources` with ``kwargs`` when merged last into a
    training config."""
    arguments = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    path = Path(config)
    path.write_text(
        json.dumps(
            {
                "+imports": ["$from scripts.harness.faults import record_resources"],
                "+initialize": [f"$record_resources(@train#trainer, {arguments})"],
            }
        )
    )
    return path


def _growth(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares line through ``(x, y)`` points: its rise over their ``x`` range (0 for fewer than 2)."""
    if len(points) < 2:
        return 0.0
    x, y = np.array(points, dtype=np.float64).T
    if np.ptp(x) == 0:
        return 0.0
    slope = np.polyfit(x, y, 1)[0]
    return float(slope * np.ptp(x))


def soak(iterations: int = 2000, workdir: str | None = None, every: int = 2, seed: int = 0) -> dict[str, Any]:
    """A long tiny ``autoencoder_3d`` run with SmartCache replacement (half the cache replaced every epoch) and a
    validation every epoch; the training process records its RSS and open file descriptors every ``every``
    iterations (:func:`record_resources`, at the end of an iteration, so every sample is taken at the same point
    of the training loop), and the samples from a third of the iterations on (after start-up, caching and the
    first validations and cache replacements) are compared.

    ``seed`` seeds the data and the run.

    Returns:
        ``{"samples": [[iteration, rss_mib, fds], ...], "iterations", "rss_start_mib" (at a third of the
        iterations), "rss_end_mib", "rss_drift_mib" (end - start), "rss_growth_mib" (the rise of the least-squares
        line through the RSS of the second half of the iterations, over that half), "fds_start" (the fewest open
        descriptors in the second third), "fds_end" (the fewest in the last third), "fds_max" (the most from a
        third on), "seconds", "returncode"}``.
    """
    from common.demo.images import write_phantom_dataset

    root = Path(workdir or tempfile.mkdtemp(prefix="soak_"))
    write_phantom_dataset(root / "data", n_train=8, n_val=2, shape=(20, 20, 20), seed=seed)
    epochs = max(1, iterations // 2)  # 4 cached volumes, batch 2: 2 iterations per epoch
    args = {
        "dataset_dir": str(root / "data"),
        "max_epochs": epochs,
        "val_interval": 1,
        "cache_rate": 0.5,
        "replace_rate": 0.5,
        "batch_size": 2,
        "patch_size": [16, 16, 16],
        "ckpt_interval": 200,
        "log_interval": 100,
        "adv_warmup_iterations": 10,
        "num_threads": 1,
        "seed": seed,
    }
    case = BundleCase("autoencoder_3d", ["train.json", "tiny.json"], args)
    record = root / "resources.jsonl"
    record.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        *case.command(root / "run", probe_config(root / "probe.json", path=str(record), every=every)),
    ]
    start = time.time()
    with open(root / "soak.log", "w") as log:
        returncode = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.time() - start
    samples = [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []
    total = epochs * 2
    warm = [s for s in samples if s[0] >= total / 3]
    if len(warm) < 3:
        raise RuntimeError(f"the soak run ended too early (status {returncode}); see {root / 'soak.log'}")
    middle = [s for s in warm if s[0] < 2 * total / 3] or warm[:1]
    late = [s for s in warm if s[0] >= 2 * total / 3] or warm[-1:]
    return {
        "samples": samples,
        "iterations": saved_iteration(case.checkpoint(root / "run")),
        "rss_start_mib": round(warm[0][1], 1),
        "rss_end_mib": round(warm[-1][1], 1),
        "rss_drift_mib": round(warm[-1][1] - warm[0][1], 1),
        "rss_growth_mib": round(_growth([(i, rss) for i, rss, _ in samples if i >= total / 2]), 1),
        "fds_start": min(s[2] for s in middle),
        "fds_end": min(s[2] for s in late),
        "fds_max": max(s[2] for s in warm),
        "seconds": round(seconds, 1),
        "returncode": returncode,
    }


# ----------------------------------------------------------------------------------------- command line
def faults(bundle: str, workdir: str, seed: int = 0, processes: int = 1) -> str:
    """Run :func:`fault_sequence` (``processes=1``, all faults) or :func:`distributed_sequence` (``processes=2``)
    for ``bundle`` on fresh small data under ``workdir``; return its table. ``seed`` seeds the data, the runs and
    the iterations the faults strike at."""
    root = Path(workdir) / bundle
    case = make_case(bundle, root / "data", seed=seed)
    if processes == 1:
        table = _fault_table(fault_sequence(case, root, seed=seed))
    elif processes == 2:
        table = _fault_table(distributed_sequence(case.distributed(), root, seed=seed), "2 processes")
    else:
        raise ValueError(f"processes must be 1 or 2, got {processes!r}.")
    return table  # the command line prints it


def _fault_table(result: Mapping[str, Any], title: str = "1 process") -> str:
    lines = [
        f"### {result['bundle']}, {title}",
        "",
        "| fault | exit | resumed from | `last` after | message | outcome |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for s in result["steps"]:
        message = s.message.replace("|", "/")[:160]
        lines.append(
            f"| {s.fault} | {s.returncode} | {s.resumed_from} | {s.checkpoint_after} | {message} | "
            f"{'ok' if s.ok else 'FAILED'} |"
        )
    same = "bit-identical" if result["identical"] else f"DIFFERENT ({result['differing']})"
    lines += ["", f"Final weights vs the uninterrupted run: {same}.", ""]
    return "\n".join(lines)


def report(
    workdir: str, fuzz_cases: int = 300, soak_iterations: int = 3000, bundles: Sequence[str] = BUNDLES, seed: int = 0
) -> str:
    """Run, for every bundle, the fault sequence (one process), the 2-process sequence and the peer failures (a rank
    killed, a rank hung), then the fuzzing and the long run; return the markdown tables. ``seed`` seeds the data,
    the runs, the iterations the faults strike at and the fuzzing."""
    parts = []
    peers = ["| bundle | rank 1 | rank 0 exit | seconds to exit | message |", "|---|---|---|---|---|"]
    for bundle in bundles:
        root = Path(workdir) / bundle
        case = make_case(bundle, root / "data", seed=seed)
        parts.append(_fault_table(fault_sequence(case, root, seed=seed)))
        parts.append(_fault_table(distributed_sequence(case.distributed(), root, seed=seed), "2 processes"))
        for mode in ("kill", "stall"):
            result = peer_failure(case.distributed(), root, mode=mode, at=3, timeout_s=10)
            message = result["message"].split(": ", 1)[-1].replace("|", "/")[:200]
            peers.append(f"| {bundle} | {mode} | {result['returncode']} | {result['seconds']} | {message} |")
    parts.append("\n".join(peers))
    lines = [
        "| family | cases | refused with a clear error | accepted | crashes | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for o in fuzz(fuzz_cases, seed=seed, workdir=str(Path(workdir) / "fuzz")):
        lines.append(f"| {o.family} | {o.cases} | {o.refused} | {o.accepted} | {len(o.crashes)} | {o.peak_mib:.1f} |")
    parts.append("\n".join(lines))
    long_run = soak(soak_iterations, str(Path(workdir) / "soak"), seed=seed)
    long_run.pop("samples")
    parts.append(json.dumps(long_run, indent=2))
    return "\n\n".join(parts)  # the command line prints it

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Runtime helpers shared by every bundle: distributed setup, devices, precision, seeds, learning-rate scaling."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import gc
import importlib
import logging
import math
import os
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.distributed as dist

from common.errors import UserError

__all__ = [
    "AMP_MODES",
    "OutputWriteError",
    "PeerFailureError",
    "amp_dtype",
    "assert_replicas_equal",
    "autocast",
    "check_amp",
    "default_amp",
    "abort_distributed",
    "describe_peer_failure",
    "describe_write_error",
    "destroy_distributed",
    "get_rank",
    "get_world_size",
    "inference_autocast",
    "init_distributed",
    "is_positive_int",
    "is_rank0",
    "make_grad_scaler",
    "os_error_in_chain",
    "plain_tensor",
    "resolve_device",
    "scale_lr",
    "setup_logging",
    "setup_runtime",
    "write_atomic",
    "write_text_atomic",
]

AMP_MODES = ("bf16", "fp16", "none")
_RANK_FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


def plain_tensor(x: Any) -> torch.Tensor:
    """``x`` as a plain ``torch.Tensor``: a MONAI ``MetaTensor``'s data without its metadata (sharing its memory
    and autograd history, as ``MetaTensor.as_tensor``), an array or a sequence converted with ``torch.as_tensor``."""
    tensor = torch.as_tensor(x)
    return tensor if type(tensor) is torch.Tensor else tensor.as_subclass(torch.Tensor)


def get_rank() -> int:
    """Global rank of this process, 0 when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    """Number of processes in the job, 1 when not distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def is_rank0() -> bool:
    """Whether this process writes shared outputs (checkpoints, TensorBoard, metrics files)."""
    return get_rank() == 0


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """Pick the device for this process.

    Args:
        device: ``"auto"``/``None`` selects ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU;
            any other value is passed to ``torch.device`` unchanged.

    Raises:
        ValueError: when a CUDA device is requested on a machine without CUDA.
    """
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was requested but CUDA is not available on this machine.")
    return device


def init_distributed(device: torch.device, timeout_s: float = 1800.0, backend: str | None = None) -> None:
    """Initialise the default process group from the torchrun/SLURM environment (idempotent).

    Args:
        device: this rank's device; CUDA devices select ``nccl`` and are made current, the CPU selects ``gloo``.
        timeout_s: collective timeout in seconds; a rank waiting longer than this on a dead peer raises.
        backend: force a backend instead of choosing from the device.

    Raises:
        UserError: when no launcher set RANK/WORLD_SIZE (nor SLURM's variables).
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "'distributed' is true (multi_gpu_*.json, or --distributed True) but no distributed launcher started "
            "this process (RANK/WORLD_SIZE are not set): run the command under torchrun or srun, or leave "
            "'distributed' false for one process."
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    # Importing torch._dynamo while a process group exists (DistributedDataParallel does, on construction) keeps
    # references to the group that nothing releases (torch 2.13); imported first, it keeps none.
    importlib.import_module("torch._dynamo")

    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=float(timeout_s)))
    atexit.register(_release_process_groups)


def _release_process_groups() -> None:
    """At exit, free what still holds a destroyed process group, while the interpreter is whole.

    ``destroy_process_group`` forgets the group, but the group lives on (its gloo/NCCL threads too) as long as a
    ``DistributedDataParallel`` wrapper holds it, and the workflow that holds the wrapper is only collected during
    the interpreter's teardown; a group destroyed there can abort a rank after a finished run ("terminate called
    without an active exception"). Collected here, before that teardown, the group's threads are joined.
    """
    gc.collect()


def destroy_distributed() -> None:
    """Tear down the default process group if there is one, after every rank has arrived.

    The barrier keeps a rank (rank 0 hosts the rendezvous store) from tearing its connections down while a peer
    is still finishing its last collective, which can abort the process at exit under gloo.
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died or stalled; the message says so and what to do."""


_PEER_MARKERS = ("Connection reset", "Connection closed", "Broken pipe", "Timed out", "timed out", "gloo", "NCCL")


def describe_peer_failure(exc: BaseException) -> str | None:
    """A clear message when ``exc`` comes from a collective that failed because another rank died or stalled
    (a gloo/NCCL error in a multi-process job), else ``None``."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    text = " ".join(str(exc).split())
    if not (isinstance(exc, getattr(dist, "DistError", ())) or any(m in text for m in _PEER_MARKERS)):
        return None
    kind = "a collective timed out" if "imed out" in text else "a connection to another rank failed"
    return (
        f"rank {dist.get_rank()} of {dist.get_world_size()} lost contact with the other ranks ({kind}: "
        f"{text[:160]}). Another rank probably died (see the first failing rank in the launcher's log) or stalled "
        "longer than the collective timeout (dist_timeout)"
    )


def abort_distributed() -> None:
    """Tear the process group down after a failure, without waiting for the other ranks (no barrier).

    Under gloo this closes the connections, so peers blocked in a collective fail at once instead of waiting for
    the timeout, and the process exits with its own status instead of aborting in gloo's teardown. NCCL groups
    are left to the launcher (their teardown may block on a collective that never completes).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def assert_replicas_equal(modules: dict[str, torch.nn.Module]) -> int:
    """Check that every rank holds bit-identical weights and buffers (a multi-GPU sanity check).

    Each rank hashes every tensor of each module's ``state_dict``; the hashes are gathered and compared. Run it
    at the end of a DDP training (it is a collective: every rank must call it). Without a process group it does
    nothing and returns 0.

    Args:
        modules: name -> module (e.g. ``{"vqgan": network}``).

    Returns:
        The number of tensors compared.

    Raises:
        RuntimeError: naming the first differing tensors and the ranks that disagree with rank 0.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return 0
    import hashlib

    local = {}
    for name, module in modules.items():
        for key, tensor in module.state_dict().items():
            data = tensor.detach().cpu().contiguous().reshape(-1)  # 0-d tensors (counters) cannot be viewed as bytes
            local[f"{name}.{key}"] = hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    differing = {
        key: [rank for rank, hashes in enumerate(gathered) if hashes.get(key) != digest]
        for key, digest in gathered[0].items()
        if any(hashes.get(key) != digest for hashes in gathered)
    }
    if differing:
        listed = "; ".join(f"{k} (ranks {v})" for k, v in list(differing.items())[:5])
        raise RuntimeError(f"replicas differ from rank 0 in {len(differing)} tensor(s): {listed}")
    logging.getLogger(__name__).info(
        f"replica check: {len(local)} tensors of {sorted(modules)} identical on all {len(gathered)} ranks"
    )
    return len(local)


def setup_runtime(
    seed: int | None = 0, cudnn_benchmark: bool = True, deterministic: bool = False, num_threads: int | None = None
) -> int | None:
    """Seed every RNG (offset by rank so ranks draw different crops) and set backend switches.

    Args:
        seed: base seed; each rank uses ``seed + rank``. ``None`` leaves the RNGs alone.
        cudnn_benchmark: let cuDNN pick the fastest convolution algorithms (fixed input shapes).
        deterministic: use deterministic algorithms (slower; overrides ``cudnn_benchmark``).
        num_threads: intra-op CPU threads; ``None`` keeps the torch default.

    Returns:
        The seed used by this rank.
    """
    from monai.utils import set_determinism

    if num_threads:
        torch.set_num_threads(int(num_threads))
    rank_seed = None if seed is None else int(seed) + get_rank()
    if rank_seed is not None:
        set_determinism(seed=rank_seed, use_deterministic_algorithms=deterministic or None)
    torch.backends.cudnn.benchmark = bool(cudnn_benchmark) and not deterministic
    if deterministic:
        torch.backends.cudnn.deterministic = True
        # deterministic cuBLAS needs a fixed workspace, set before the first cuBLAS call (else matmuls raise)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return rank_seed


def default_amp(device: torch.device | str) -> str:
    """``bf16`` on GPUs that support it, ``none`` otherwise (CPU autocast is rarely faster)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "none"


def amp_dtype(amp: str) -> torch.dtype | None:
    """Map an ``amp`` config value to the autocast dtype (``None`` for full precision).

    Raises:
        ValueError: for a value other than ``bf16``, ``fp16`` or ``none``.
    """
    amp = str(amp).lower()
    if amp not in AMP_MODES:
        raise ValueError(f"amp must be one of {AMP_MODES}, got {amp!r}.")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}[amp]


def check_amp(amp: str, device: torch.device | str | None = None) -> None:
    """Check that ``amp`` is a known mode and that ``device`` computes in it natively.

    bf16 needs a GPU with bfloat16 (Ampere or newer) or a CPU with native bfloat16 (AVX512-BF16/AMX); fp16 needs
    a GPU or a CPU with native float16 (AMX-FP16). Elsewhere autocast would emulate the type, many times slower.

    Raises:
        ValueError: naming the mode, the device and what to use instead.
    """
    dtype = amp_dtype(amp)
    if dtype is None:
        return
    device = torch.device("cpu" if device is None else device)
    name = "bfloat16" if dtype is torch.bfloat16 else "float16"
    if device.type == "cuda":
        supported = dtype is torch.float16 or (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    elif device.type == "cpu":
        mkldnn = torch.ops.mkldnn
        supported = bool(
            mkldnn._is_mkldnn_bf16_supported() if dtype is torch.bfloat16 else mkldnn._is_mkldnn_fp16_supported()
        )
    else:
        supported = True
    if not supported:
        raise ValueError(
            f"amp={str(amp)!r} needs native {name} support, which device {str(device)!r} lacks; "
            f"use --amp none{' or --amp fp16' if device.type == 'cuda' else ''}."
        )


def autocast(device: torch.device | str, amp: str) -> Any:
    """An autocast context for ``amp`` on ``device`` (disabled for ``none``)."""
    dtype = amp_dtype(amp)
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=dtype is not None)


def inference_autocast(device: torch.device | str, amp: str) -> Any:
    """The autocast of validation, evaluation and inference: ``amp`` on the device the work runs on, a GPU or the
    CPU. On a CPU with native bf16 (AVX512-BF16 or AMX; :func:`check_amp` refuses bf16 on others) it runs the
    network on oneDNN's bf16 kernels: 2.6x fp32 for autoencoder_3d's network on an AVX512-BF16 CPU
    (``docs/benchmarks.md``, "Inference on a CPU"), at the price of bf16's rounding. The defaults
    (:func:`default_amp`) keep the CPU in fp32: it runs bf16 only when asked."""
    return autocast(device, amp)


def make_grad_scaler(device: torch.device | str, amp: str) -> torch.amp.GradScaler | None:
    """A ``GradScaler`` for fp16 (bf16 and fp32 need none)."""
    if amp_dtype(amp) is not torch.float16:
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def scale_lr(lr: float, world_size: int | None = None, mode: str = "sqrt", accumulation_steps: int = 1) -> float:
    """Scale a single-GPU learning rate to the effective batch of a multi-GPU run.

    Args:
        lr: learning rate tuned for one process and no accumulation.
        world_size: number of processes (default: from the process group / environment).
        mode: ``sqrt`` (Adam-family default), ``linear`` (Goyal et al.) or ``none``.
        accumulation_steps: gradient accumulation steps, which enlarge the effective batch as well.
    """
    factor = (world_size or get_world_size()) * max(int(accumulation_steps), 1)
    if mode == "sqrt":
        return float(lr) * math.sqrt(factor)
    if mode == "linear":
        return float(lr) * factor
    if mode == "none":
        return float(lr)
    raise ValueError(f"lr_scaling must be 'sqrt', 'linear' or 'none', got {mode!r}.")


def setup_logging(output_dir: str | os.PathLike | None = None, filename: str = "train.log", level: int | None = None):
    """Tag every log line with the rank and mirror it to ``output_dir/filename``.

    Keeps the handlers configured by the bundle's ``logging.conf`` and swaps their format for one that carries
    ``[rank N]``; rank ``N`` writes ``filename`` with suffix ``.rankN`` for ``N > 0``.

    Returns:
        The path of the log file (or ``None`` when ``output_dir`` is ``None``).
    """
    rank = get_rank()
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler(sys.stdout))
    if level is not None:
        root.setLevel(level)
    elif root.level in (logging.NOTSET, logging.WARNING):
        root.setLevel(logging.INFO)
    formatter = logging.Formatter(_RANK_FORMAT.format(rank=rank))
    for handler in root.handlers:
        handler.setFormatter(formatter)
    if output_dir is None:
        return None
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    path = Path(output_dir) / (filename if rank == 0 else f"{filename}.rank{rank}")
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve() for h in root.handlers):
        file_handler = logging.FileHandler(path)
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    return path


def rng_state() -> dict[str, Any]:
    """The global RNG states of python, numpy and torch as tensors and plain containers (``weights_only``-safe)."""
    np_state = np.random.get_state()
    state = {
        "python": _to_plain(random.getstate()),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(_to_plain, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy().astype(np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


class OutputWriteError(OSError, UserError):
    """A file could not be written (full disk, read-only file system, no permission, file size limit); the
    message names the file, the cause and says that the previous version of the file is unchanged."""


_WRITE_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EFBIG: "the file exceeds the file-size limit",
}


def describe_write_error(error: OSError) -> str:
    """What a refused write means, in words (``the disk is full``, ``the file system is read-only``, ...), followed
    by the system's own message in parentheses."""
    cause = _WRITE_CAUSES.get(error.errno, error.strerror or str(error))
    return f"{cause} ({error.strerror or error})"


def os_error_in_chain(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself or a cause/context (``torch.save`` re-raises a failed write as a
    ``RuntimeError`` of its zip writer)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Write a file atomically: ``write(handle)`` fills a temporary file in the same folder, which is flushed,
    fsynced and renamed over ``path``. A crash, a full disk or a read-only file system during the write leaves the
    previous file at ``path`` untouched (or no file), never a partial one, and the temporary file is removed.

    Returns:
        The path written.

    Raises:
        OutputWriteError: when the file system refuses the write, naming the file and the cause.
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        os_error = os_error_in_chain(exc)
        if os_error is not None and not isinstance(exc, OutputWriteError):
            kept = "the previous file is unchanged" if path.exists() else "no file was written"
            raise OutputWriteError(
                os_error.errno, f"could not write {str(path)!r}: {describe_write_error(os_error)}; {kept}"
            ) from exc
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` with :func:`write_atomic`: a reader, or a run interrupted while writing,
    sees the old file or the new one, never a partial one.

    Returns:
        The path written.
    """
    return write_atomic(path, lambda handle: handle.write(text.encode("utf-8")))


def is_positive_int(value: Any) -> bool:
    """Whether ``value`` is an integer >= 1 (``True``/``False`` are not counted as integers)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests for the runtime helpers: learning-rate scaling, precision, devices, RNG states, logging and ranks."""

from __future__ import annotations

import logging
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import UserError
from common.utils import (
    amp_dtype,
    autocast,
    default_amp,
    get_rank,
    get_world_size,
    init_distributed,
    is_rank0,
    make_grad_scaler,
    plain_tensor,
    resolve_device,
    rng_state,
    scale_lr,
    set_rng_state,
    setup_logging,
    setup_runtime,
)


@pytest.fixture
def no_dist_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def root_logger():
    """Restore the root logger's handlers, formatters and level after a test that reconfigures it."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    formatters = [h.formatter for h in handlers]
    level = root.level
    yield root
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler, formatter in zip(handlers, formatters):
        handler.setFormatter(formatter)
    root.setLevel(level)


# ---------------------------------------------------------------------------------------------- scale_lr
@pytest.mark.parametrize(
    "mode, world, acc, expected",
    [
        ("sqrt", 4, 1, 2e-4),
        ("sqrt", 2, 2, 2e-4),
        ("sqrt", 1, 1, 1e-4),
        ("linear", 4, 1, 4e-4),
        ("linear", 2, 3, 6e-4),
        ("none", 8, 4, 1e-4),
    ],
)
def test_scale_lr_modes(mode, world, acc, expected):
    assert scale_lr(1e-4, world_size=world, mode=mode, accumulation_steps=acc) == pytest.approx(expected, rel=1e-12)


def test_scale_lr_sqrt_of_non_square_factor():
    assert scale_lr(1.0, world_size=3, mode="sqrt") == pytest.approx(math.sqrt(3))


def test_scale_lr_accumulation_below_one_counts_as_one():
    assert scale_lr(1.0, world_size=2, mode="linear", accumulation_steps=0) == pytest.approx(2.0)


def test_scale_lr_world_size_from_environment(no_dist_env):
    no_dist_env.setenv("WORLD_SIZE", "9")
    assert scale_lr(1.0, mode="sqrt") == pytest.approx(3.0)
    assert scale_lr(1.0, mode="linear", accumulation_steps=2) == pytest.approx(18.0)


def test_scale_lr_bad_mode_names_the_value():
    with pytest.raises(ValueError, match="cubic"):
        scale_lr(1e-4, world_size=2, mode="cubic")


# ---------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize(
    "amp, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("none", None), ("BF16", torch.bfloat16)]
)
def test_amp_dtype_mapping(amp, dtype):
    assert amp_dtype(amp) is dtype


@pytest.mark.parametrize("bad", ["fp32", "float16", "", "auto"])
def test_amp_dtype_error_names_the_value(bad):
    with pytest.raises(ValueError, match=repr(bad.lower())):
        amp_dtype(bad)


def test_autocast_bf16_on_cpu_gives_bf16_matmul():
    a, b = torch.rand(4, 8), torch.rand(8, 3)
    with autocast("cpu", "bf16"):
        out = a @ b
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), a @ b, rtol=2e-2, atol=2e-2)


def test_autocast_none_keeps_float32():
    a, b = torch.rand(4, 8), torch.rand(8, 3)
    with autocast(torch.device("cpu"), "none"):
        out = a @ b
    assert out.dtype == torch.float32
    assert torch.equal(out, a @ b)


def test_autocast_rejects_bad_mode():
    with pytest.raises(ValueError, match="'int8'"):
        autocast("cpu", "int8")


def test_make_grad_scaler_only_for_fp16():
    scaler = make_grad_scaler("cpu", "fp16")
    assert isinstance(scaler, torch.amp.GradScaler)
    assert make_grad_scaler("cpu", "bf16") is None
    assert make_grad_scaler("cpu", "none") is None
    with pytest.raises(ValueError, match="fp32"):
        make_grad_scaler("cpu", "fp32")


def test_default_amp_on_cpu_is_none():
    assert default_amp("cpu") == "none"
    assert default_amp(torch.device("cpu")) == "none"


# ---------------------------------------------------------------------------------------------- devices
def test_resolve_device_cpu_and_auto():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device(None).type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_resolve_device_cuda_without_cuda_is_a_clear_error(device):
    with pytest.raises(ValueError, match="CUDA is not available") as info:
        resolve_device(device)
    assert "cuda" in str(info.value)


# ---------------------------------------------------------------------------------------------- RNG states
def _draws() -> tuple[torch.Tensor, np.ndarray, list[float]]:
    return torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)]


def _assert_same_draws(a, b) -> None:
    assert torch.equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2] == b[2]


def test_rng_state_round_trip_reproduces_draws():
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    np.random.randn()  # leaves a cached Gaussian in numpy's state
    state = rng_state()
    first = _draws()
    _draws()  # move every generator on
    set_rng_state(state)
    second = _draws()
    _assert_same_draws(first, second)
    assert not torch.equal(first[0], torch.rand(5))  # the generators do move on afterwards


def test_rng_state_survives_weights_only_save_and_load(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    state = rng_state()
    first = _draws()
    torch.save({"rng": state}, tmp_path / "rng.pt")
    _draws()
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)["rng"]
    set_rng_state(loaded)
    _assert_same_draws(first, _draws())


def test_rng_state_holds_only_plain_values():
    state = rng_state()
    assert set(state) >= {"python", "numpy", "torch"}
    assert isinstance(state["torch"], torch.Tensor)
    assert state["numpy"][0] == "MT19937"
    assert isinstance(state["numpy"][1], torch.Tensor) and state["numpy"][1].dtype == torch.int64
    assert all(isinstance(v, (int, float, str, list, type(None))) for v in state["python"])


def test_setup_runtime_seeds_with_rank_offset(no_dist_env):
    no_dist_env.setenv("RANK", "2")
    seed = setup_runtime(seed=5, cudnn_benchmark=False)
    assert seed == 7
    draw = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(draw, torch.rand(3))
    assert setup_runtime(seed=None) is None


# ---------------------------------------------------------------------------------------------- logging
def test_setup_logging_tags_rank_and_writes_file(tmp_path, root_logger, no_dist_env):
    path = setup_logging(tmp_path / "logs", level=logging.INFO)
    assert path == tmp_path / "logs" / "train.log"
    logging.getLogger("common.test").info("hello from the test")
    for handler in root_logger.handlers:
        handler.flush()
    lines = [line for line in path.read_text().splitlines() if "hello from the test" in line]
    assert len(lines) == 1
    assert "[rank 0]" in lines[0] and "INFO" in lines[0] and "common.test" in lines[0]
    # calling again does not add a second file handler (no duplicated lines)
    setup_logging(tmp_path / "logs", level=logging.INFO)
    logging.getLogger("common.test").info("second line")
    for handler in root_logger.handlers:
        handler.flush()
    assert path.read_text().count("second line") == 1


def test_setup_logging_other_rank_writes_suffixed_file(tmp_path, root_logger, no_dist_env):
    no_dist_env.setenv("RANK", "3")
    path = setup_logging(tmp_path, filename="run.log", level=logging.INFO)
    assert path.name == "run.log.rank3"
    logging.getLogger("common.test").warning("rank three speaking")
    for handler in root_logger.handlers:
        handler.flush()
    text = path.read_text()
    assert "[rank 3]" in text and "rank three speaking" in text
    assert not (tmp_path / "run.log").exists()


def test_setup_logging_without_dir_returns_none(root_logger, no_dist_env):
    assert setup_logging(None) is None
    assert all("[rank 0]" in h.formatter._fmt for h in root_logger.handlers if h.formatter is not None)


# ---------------------------------------------------------------------------------------------- ranks
def test_rank_and_world_size_from_environment(no_dist_env):
    assert get_rank() == 0 and get_world_size() == 1 and is_rank0()
    no_dist_env.setenv("RANK", "3")
    no_dist_env.setenv("WORLD_SIZE", "8")
    assert get_rank() == 3
    assert get_world_size() == 8
    assert not is_rank0()


def test_init_distributed_without_launcher_is_a_clear_error(no_dist_env):
    """A user error (one ``error:`` line on the command line) naming the setting and what to do."""
    with pytest.raises(UserError, match=r"'distributed' is true .*\(RANK/WORLD_SIZE are not set\).*torchrun or srun"):
        init_distributed(torch.device("cpu"))


_EXIT_PROBE = """
import atexit, os, sys
import torch
import common.utils

def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

atexit.register(lambda: print("at exit:", threads(), flush=True))  # registered first, so it runs last
common.utils.init_distributed(torch.device("cpu"))
held = {"ddp": torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))}
held["self"] = held  # a cycle, as a workflow holds its objects: collected only by the garbage collector
held["ddp"](torch.randn(2, 4)).sum().backward()
common.utils.destroy_distributed()
print("destroyed:", threads(), flush=True)
if sys.argv[1] == "without":
    atexit.unregister(common.utils._release_process_groups)
del held
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_a_destroyed_process_group_is_released_before_the_interpreter_exits(no_dist_env, tmp_path):
    """A DistributedDataParallel wrapper keeps its group (and the group's gloo threads) after destroy_distributed;
    the exit handler of init_distributed frees it while the interpreter is whole (threads joined), not in the
    interpreter's teardown, where releasing it can abort a finished rank."""
    from helpers import REPO_ROOT, bundle_env, free_port

    env = {**bundle_env(), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    lines = {}
    for variant in ("with", "without"):
        result = subprocess.run(
            [sys.executable, "-c", _EXIT_PROBE, variant],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        lines[variant] = {line.split(":")[0]: line for line in result.stdout.splitlines() if ":" in line}
    assert "pt_gloo_runloop" in lines["with"]["destroyed"]  # still held by the wrapper after destroy_process_group
    assert "pt_gloo_runloop" not in lines["with"]["at exit"]
    # without the handler the group outlives every exit handler (the premise of the handler)
    assert "pt_gloo_runloop" in lines["without"]["at exit"]


# ---------------------------------------------------------------------------------------------- replica check
def test_assert_replicas_equal_without_a_process_group_compares_nothing(no_dist_env):
    """Single process: no collective, nothing compared (the 2-rank behaviour is tested under torchrun in
    ``test_vqgan_networks.py``)."""
    import torch.distributed as dist

    from common.utils import assert_replicas_equal

    assert not dist.is_initialized()
    no_dist_env.setenv("WORLD_SIZE", "2")  # the environment alone does not make it distributed
    assert assert_replicas_equal({"net": torch.nn.Linear(2, 2)}) == 0


def test_plain_tensor_drops_the_metadata_and_keeps_memory_and_gradients():
    from monai.data import MetaTensor

    leaf = torch.arange(6.0, requires_grad=True)
    meta = MetaTensor(leaf * 2, meta={"filename_or_obj": "a.nii.gz"})
    plain = plain_tensor(meta)
    assert type(plain) is torch.Tensor and not hasattr(plain, "meta")
    assert plain.data_ptr() == meta.data_ptr()  # a view, not a copy
    plain.sum().backward()
    torch.testing.assert_close(leaf.grad, torch.full((6,), 2.0))
    tensor = torch.ones(2, 3).t()  # a non-contiguous layout is kept
    assert plain_tensor(tensor) is tensor
    converted = plain_tensor(np.array([1.5, 2.5]))
    assert type(converted) is torch.Tensor and converted.tolist() == [1.5, 2.5]
    assert plain_tensor([1, 2]).dtype == torch.int64

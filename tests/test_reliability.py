# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Fault tolerance of every bundle: a job interrupted by a full disk, a NaN loss and two SIGKILLs ends bit-identical
to an uninterrupted one; refused writes keep the previous file; bad command lines, hostile datalists, tables and
image files are refused with clear errors; a long run keeps its memory and file handles flat."""

from __future__ import annotations

import errno
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from common.data.pipeline import EpochSampler, ItemSeededDataset
from common.data.preflight import SLAB_BYTES
from scripts.harness import faults as reliability
from tests.bundle_cases import CASES
from tests.helpers import BUNDLES, bundle_env, overrides, run_bundle, shifted_seed

ALL_BUNDLES = reliability.BUNDLES


# ----------------------------------------------------------------------------------------- a job, interrupted
# every fault on one bundle, one on each other bundle (each case's ``faults``, tests/bundle_cases.py;
# ``scripts/reliability.py report`` runs all four on every bundle; docs/reliability.md has its tables)


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
def test_faults_in_turn_lose_nothing(bundle, tmp_path):
    """Disk full, NaN loss, SIGKILL while saving, SIGKILL, each at a random iteration: each run stops as it must and
    keeps the last checkpoint, the next run resumes from it (in the middle of an epoch too), and the job ends
    bit-identical to one never interrupted (every run of the job with one thread)."""
    case = reliability.make_case(bundle, tmp_path / "data", seed=shifted_seed(0))
    faults = list(CASES[bundle].faults)
    result = reliability.fault_sequence(case, tmp_path, seed=shifted_seed(ALL_BUNDLES.index(bundle)), faults=faults)
    steps = {s.fault.split(" at ")[0]: s for s in result["steps"]}
    assert [s.ok for s in result["steps"]] == [True] * (len(faults) + 1), result["steps"]
    assert result["identical"], result["differing"]
    if "disk" in faults:
        assert "the file exceeds the file-size limit" in steps["disk full (EFBIG)"].message
        assert "the previous file is unchanged" in steps["disk full (EFBIG)"].message
    if "nan" in faults:
        assert "non-finite loss at iteration" in steps["NaN loss"].message and "loss=nan" in steps["NaN loss"].message


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
def test_every_trainer_is_guarded_and_checkpointed(bundle):
    config = json.loads((BUNDLES / bundle / "configs" / "train.json").read_text())
    assert config["nonfinite"] == "stop" and config["train"]["trainer"]["nonfinite"] == "@nonfinite"
    handlers = [h["_target_"] for h in config["train"]["handlers"] if isinstance(h, dict)]
    assert "common.handlers.checkpoint.CheckpointManager" in handlers  # saves, resumes and reports failures
    assert config["train"]["dataloader"]["seed"] == "@seed"  # exact resume inside an epoch


def test_epoch_order_and_augmentation_depend_only_on_seed_epoch_and_item():
    from monai.transforms import Compose, RandGaussianNoised

    seed = shifted_seed(3)
    sampler = EpochSampler(6, seed=seed)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == list(range(6)) and sorted(second) == list(range(6, 12))  # the epoch is in the index
    later = [[i - 6 * epoch for i in list(sampler)] for epoch in range(2, 10)]
    # the order changes with the epoch (ten epochs, not two: two orders of 6 items agree by chance 1 time in 720)
    assert len({tuple(order) for order in [first, [i - 6 for i in second], *later]}) > 1
    sampler.resume(1, 4)
    assert list(sampler) == second[4:] and list(sampler) == _epoch(seed, 2)
    assert [_epoch(seed, epoch) for epoch in range(2, 10)] == [[i + 6 * e for i in o] for e, o in enumerate(later, 2)]

    data = [{"image": torch.zeros(1, 4, 4, 4)} for _ in range(3)]
    dataset = ItemSeededDataset(_Listed(data, Compose([RandGaussianNoised("image", prob=1.0)])), seed=shifted_seed(5))
    forward = [dataset[i]["image"] for i in range(6)]
    backward = [dataset[i]["image"] for i in reversed(range(6))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))  # access order does not matter
    assert not torch.equal(forward[0], forward[3])  # item 0 is augmented differently in epochs 0 and 1


def _epoch(seed: int, epoch: int) -> list[int]:
    sampler = EpochSampler(6, seed=seed)
    sampler.resume(epoch, 0)
    return list(sampler)


class _Listed(torch.utils.data.Dataset):
    def __init__(self, data, transform):
        self.data, self.transform = data, transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.transform(self.data[i])


def test_two_process_job_survives_a_nan_on_one_rank_and_a_killed_rank(tmp_path):
    """torchrun, 2 CPU processes: a NaN on rank 1 stops both ranks; the same command re-run resumes, rank 1 is
    SIGKILLed under ``--max_restarts 1`` and the restarted job resumes again; the result is bit-identical to an
    uninterrupted job (the report also SIGKILLs rank 0 of a job without restarts)."""
    case = reliability.make_case("autoencoder_3d", tmp_path / "data", seed=shifted_seed(0)).distributed()  # 8 on 2
    result = reliability.distributed_sequence(case, tmp_path, seed=shifted_seed(3), kill_rank_0=False)
    assert [s.ok for s in result["steps"]] == [True] * 2, result["steps"]
    assert result["steps"][0].returncode != 0 and result["steps"][1].returncode == 0
    assert "non-finite loss" in result["steps"][0].message
    assert result["identical"], result["differing"]


#: the collective timeout of a job whose rank 1 dies: far longer than rank 0 takes to notice a closed connection
KILL_TIMEOUT_S = 120
#: the collective timeout of a job whose rank 1 stalls, and a bound far above it for rank 0 to exit by
STALL_TIMEOUT_S = 5
HANG_BOUND_S = 120


@pytest.mark.parametrize("mode", ["kill", "stall"])
def test_the_surviving_rank_exits_for_the_right_reason_and_says_why(mode, tmp_path):
    """A dead rank closes its connections: rank 0 fails at once, long before a large collective timeout. A stalled
    rank keeps them open: rank 0 fails when its collective times out, not before (and does not hang)."""
    case = reliability.make_case("autoencoder_3d", tmp_path / "data", seed=shifted_seed(0)).distributed()
    timeout = KILL_TIMEOUT_S if mode == "kill" else STALL_TIMEOUT_S
    result = reliability.peer_failure(case, tmp_path, mode=mode, at=3, timeout_s=timeout)
    assert result["returncode"] == 1, result
    assert "rank 0 of 2 lost contact with the other ranks" in result["message"], result
    assert "is intact: re-run the same command" in result["message"], result
    if mode == "kill":
        assert "a connection to another rank failed" in result["message"], result
        assert result["seconds"] < KILL_TIMEOUT_S, result  # it did not wait for the timeout
    else:
        assert "a collective timed out" in result["message"], result
        assert STALL_TIMEOUT_S - 1 <= result["seconds"] < STALL_TIMEOUT_S + HANG_BOUND_S, result


# ----------------------------------------------------------------------------------------- refused writes
@pytest.mark.parametrize(
    "code, cause", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "the file system is read-only")]
)
def test_refused_write_names_file_and_cause_and_keeps_the_previous_file(tmp_path, monkeypatch, code, cause):
    from common.checkpoint_io import save_checkpoint
    from common.utils import OutputWriteError, write_text_atomic

    path = tmp_path / "last.pt"
    save_checkpoint({"version": torch.tensor(1)}, path)
    write_text_atomic(tmp_path / "metrics.json", "{}")
    monkeypatch.setattr(torch, "save", torch.save)  # restores the real one after the test
    reliability._break_saves(False, code)
    with pytest.raises(OutputWriteError) as info:
        save_checkpoint({"version": torch.tensor(2)}, path)
    assert info.value.errno == code
    assert f"could not write {str(path)!r}: {cause}" in str(info.value)
    assert "the previous file is unchanged" in str(info.value)
    assert torch.load(path, weights_only=True)["version"].item() == 1
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "metrics.json"]


def test_kernel_file_size_limit_is_reported_and_leaves_no_partial_file(tmp_path):
    """A real refused write (``RLIMIT_FSIZE``) in a separate process: the previous file stays, no temporary."""
    target = tmp_path / "metrics.json"
    script = (
        "import resource, signal\n"
        "from common.utils import write_text_atomic\n"
        f"write_text_atomic({str(target)!r}, 'previous')\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        f"write_text_atomic({str(target)!r}, 'x' * 100000)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=bundle_env(), capture_output=True, text=True)
    assert result.returncode == 1
    assert "OutputWriteError: [Errno 27] could not write" in result.stderr
    assert "the file exceeds the file-size limit" in result.stderr and "the previous file is unchanged" in result.stderr
    assert target.read_text() == "previous"
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_partial_write_of_a_killed_run_is_removed_on_restart(tmp_path):
    from ignite.engine import Engine

    from common.handlers.checkpoint import CheckpointManager

    (tmp_path / ".last.pt.abc123.tmp").write_bytes(b"half a checkpoint")
    (tmp_path / ".other.pt.x.tmp").write_bytes(b"not ours")
    manager = CheckpointManager(tmp_path, {"net": torch.nn.Linear(1, 1)}, resume=True)
    manager.load(Engine(lambda e, b: None))
    assert sorted(os.listdir(tmp_path)) == [".other.pt.x.tmp"]


# ----------------------------------------------------------------------------------------- command lines
def _argv(*args: str) -> list[str]:
    return ["/x/site-packages/monai/bundle/__main__.py", "run", "training", *args]


AE_TRAIN = str(BUNDLES / "autoencoder_3d" / "configs" / "train.json")


def test_command_line_overrides_are_checked_against_the_configs():
    from common.overrides import check_command_line
    from common.runs import command_line

    assert command_line(["pytest"]) is None
    good = _argv("--config_file", AE_TRAIN, "--max_epochs", "3", "--lr=0.001", "--deterministic", "--seed", "$1+1")
    assert check_command_line(good) == ["max_epochs", "lr", "deterministic", "seed"]
    nested = _argv("--config_file", json.dumps([AE_TRAIN]), "--train#trainer#max_epochs", "2", "--train#trainer#x", "1")
    assert check_command_line(nested) == ["train#trainer#max_epochs", "train#trainer#x"]  # a new argument
    with pytest.raises(ValueError, match="--train#trainerr#x is not an id"):
        check_command_line(_argv("--config_file", AE_TRAIN, "--train#trainerr#x", "1"))
    bad = _argv(
        *("--config_file", AE_TRAIN, "--max_epoch", "3", "--batch_size", "two", "--patch_size", "64"),
        *("--deterministic", "yes", "--lr", "fast", "--zzz", "1"),
    )
    with pytest.raises(ValueError) as info:
        check_command_line(bad)
    message = str(info.value)
    assert "--max_epoch is not an id of" in message and "did you mean 'max_epochs'" in message
    assert "--batch_size must be an integer like its default 2, got 'two' (str)" in message
    assert "--patch_size must be a list like its default" in message
    assert "--deterministic must be True or False" in message and "--lr must be a number" in message
    assert "--zzz is not an id" in message and "did you mean" not in message.split("--zzz")[1]


def test_amp_is_checked_against_the_device(monkeypatch):
    from common.utils import check_amp

    check_amp("none", "cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match="amp='bf16' needs native bfloat16 support, which device 'cpu' lacks"):
        check_amp("bf16", "cpu")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    with pytest.raises(ValueError, match="float16"):
        check_amp("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="amp must be one of"):
        check_amp("fp8", "cpu")


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
def test_every_config_checks_its_command_line_first(bundle):
    """Every workflow's ``initialize`` starts with its preamble, which checks the overrides before the settings."""
    for name in ("train.json", "evaluate.json", "inference.json", "multi_gpu_train.json"):
        first = json.loads((BUNDLES / bundle / "configs" / name).read_text())["initialize"][0]
        assert first == "@check_settings", (bundle, name)


def test_bad_command_line_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    args = overrides(output_dir=str(out), dataset_dir=str(tmp_path / "none"), amp="fp16")
    result = run_bundle(
        "autoencoder_3d", ["train.json"], args=[*args, "--max_epoch", "2", "--batch_size", "2.5"], check=False
    )
    assert result.returncode == 1
    assert "--max_epoch is not an id of" in result.stderr and "did you mean 'max_epochs'" in result.stderr
    assert "--batch_size must be an integer like its default 2, got 2.5 (float)" in result.stderr
    if not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        assert "amp='fp16' needs native float16 support" in result.stderr
    assert not out.exists()


# ----------------------------------------------------------------------------------------- hostile input
def test_paths_leaving_the_dataset_root_are_refused(tmp_path):
    from common.data.datalist import parse_datalist_section
    from common.survival.cohort import CohortError, read_cohort_csv

    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path)
    (root / "inside").symlink_to(root / "sub")
    datalist = {
        "training": [
            {"image": "../secret.nii.gz"},
            {"image": "escape/secret.nii.gz"},
            {"image": "sub/../../secret.nii.gz"},
            {"image": "inside/a.nii.gz"},
            {"image": str(tmp_path / "elsewhere.nii.gz")},
            {"image": ["sub/1.dcm", "../2.dcm"]},
        ]
    }
    entries, problems, _ = parse_datalist_section(datalist, base_dir=str(root))
    reasons = dict(problems)
    assert sorted(reasons) == [0, 1, 2, 5]
    assert "leaves the dataset root" in reasons[0] and "'..'" in reasons[0]
    assert "through a symbolic link" in reasons[1] and str(tmp_path / "secret.nii.gz") in reasons[1]
    assert entries[3]["image"] == str(root / "inside" / "a.nii.gz")  # a link that stays inside is fine
    assert entries[4]["image"] == str(tmp_path / "elsewhere.nii.gz")  # absolute paths are explicit
    csv_path = root / "cohort.csv"
    csv_path.write_text("case_id,image,time,event\na,../x.nii.gz,100,1\nb,sub/y.nii.gz,200,0\n")
    with pytest.raises(CohortError, match=r"row 1 \(case a\): image path '../x.nii.gz' leaves the dataset root"):
        read_cohort_csv(csv_path)


def _nifti(path: Path, shape=(8, 8, 8)) -> Path:
    nib.save(nib.Nifti1Image(np.zeros(shape, np.float32), np.eye(4)), path)
    return path


def test_headers_declaring_absurd_sizes_or_more_data_than_the_file_are_refused_unread(tmp_path):
    from common.data.preflight import check_volume

    raw = _nifti(tmp_path / "ok.nii").read_bytes()
    header = nib.Nifti1Header.from_fileobj(open(tmp_path / "ok.nii", "rb"))
    header.set_data_shape((30000, 30000, 30000))
    (tmp_path / "huge.nii").write_bytes(header.binaryblock + raw[348:])
    (tmp_path / "huge.nii.gz").write_bytes(gzip.compress(header.binaryblock + raw[348:]))
    (tmp_path / "short.nii").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "huge.mha").write_text(
        "ObjectType = Image\nNDims = 3\nDimSize = 30000 30000 30000\nElementType = MET_FLOAT\nElementDataFile = LOCAL\n"
    )
    for name in ("huge.nii", "huge.nii.gz", "huge.mha"):
        reason = check_volume(str(tmp_path / name))
        assert reason.startswith("declares 100582.8 GiB of voxel data (shape (30000, 30000, 30000))"), name
    assert check_volume(str(tmp_path / "short.nii")).startswith("is truncated: its header declares 2400 bytes")
    assert check_volume(str(tmp_path / "ok.nii")) is None


def test_oversized_text_inputs_are_refused_before_reading(tmp_path, monkeypatch):
    from common.data import datalist as datalist_module
    from common.data.datalist import DatalistError, read_datalist_json
    from common.survival.cohort import CohortError, read_cohort_csv

    monkeypatch.setattr(datalist_module, "MAX_TEXT_BYTES", 100)
    (tmp_path / "d.json").write_text(json.dumps({"training": ["a" * 200]}))
    (tmp_path / "c.csv").write_text("image,time,event\n" + "a.nii,1,1\n" * 20)
    with pytest.raises(DatalistError, match="d.json' is 0 MiB, more than the 0 MiB"):
        read_datalist_json(tmp_path / "d.json")
    with pytest.raises(CohortError, match="c.csv"):
        read_cohort_csv(tmp_path / "c.csv")


def test_fuzzed_inputs_are_accepted_or_refused_clearly_with_bounded_memory(tmp_path):
    outcomes = reliability.fuzz(cases=40, seed=shifted_seed(1), workdir=str(tmp_path))
    assert [o.family for o in outcomes] == ["nifti", "dicom", "csv", "json"]
    for outcome in outcomes:
        assert outcome.crashes == [], (outcome.family, outcome.crashes[:3])
        assert outcome.valid == "accepted" and outcome.known_bad == "refused", outcome
        assert outcome.cases == outcome.refused + outcome.accepted == 1 + (10 if outcome.family == "dicom" else 40)
        # traced after a valid input has warmed up the imports, so this is what the inputs cost: the checks read a
        # volume one slab at a time, so even a header declaring gigabytes costs at most a slab
        assert outcome.peak_mib < SLAB_BYTES / 2**20 + 32, (outcome.family, outcome.peak_mib)


# ----------------------------------------------------------------------------------------- a long run
@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the process's memory from /proc")
def test_long_run_with_smartcache_keeps_memory_and_file_handles_flat(tmp_path):
    """The training process samples itself at the end of every epoch (the same point of the loop each time);
    from a third of the iterations on (after caching and many validations and cache replacements) neither its
    memory nor its open files grow."""
    result = reliability.soak(iterations=160, workdir=str(tmp_path), every=2, seed=shifted_seed(0))
    assert result["returncode"] == 0 and result["iterations"] == 160, result
    assert [s[0] for s in result["samples"]] == list(range(2, 161, 2)), result
    assert result["rss_growth_mib"] < 32, result  # a leak rises with the iterations; this is the second half's rise
    assert result["fds_end"] <= result["fds_start"], result  # no file is left open
    assert result["fds_max"] <= result["fds_start"] + 8, result

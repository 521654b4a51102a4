# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The command that trains a bundle, or runs its inference over a cohort, wherever it runs: one process, all GPUs
of a node, several nodes, a SLURM allocation or a Kubernetes job.

One process in total gives ``python -m monai.bundle run training --config_file <train.json>``; more give torchrun
(``python -m common.bundle_tools.torchrun``, which ends with one line and 128 + the signal's number when a signal
stops it) with the bundle's ``multi_gpu_train.json`` merged on top of ``train.json``. The ``inference`` job is the
same with ``inference.json``, ``multi_gpu_inference.json`` (the ranks share the cases) and the run id ``run``. The
command is built from explicit arguments, or from the SLURM environment (``SLURM_NNODES``, ``SLURM_NODEID``, the
first host of ``SLURM_JOB_NODELIST`` as the rendezvous host, ``SLURM_JOB_ID`` as the rendezvous id). Paths are
written relative to the repository root, where the command runs.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.bundle import ROOT, resolve_bundle
from common.errors import UserError

__all__ = [
    "DEFAULT_RDZV_PORT",
    "JOBS",
    "MULTI_PROCESS_CONFIG",
    "RESERVED_OVERRIDES",
    "SHARED_STORE_SWITCH",
    "TRAIN_CONFIG",
    "LaunchError",
    "LaunchPlan",
    "SlurmTopology",
    "build_plan",
    "expand_first_host",
    "first_slurm_host",
    "format_overrides",
    "normalize_endpoint",
    "run_plan",
    "slurm_topology",
    "visible_gpus",
]

TRAIN_CONFIG = "train.json"
MULTI_PROCESS_CONFIG = "multi_gpu_train.json"
#: job -> (its config, the config merged on it for more than one process, its default run id)
JOBS = {
    "training": (TRAIN_CONFIG, MULTI_PROCESS_CONFIG, "training"),
    "inference": ("inference.json", "multi_gpu_inference.json", "run"),
}
DEFAULT_RDZV_PORT = 29500
RESERVED_OVERRIDES = ("config_file",)
SHARED_STORE_SWITCH = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

_ENDPOINT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)(?::(?P<port>\d+))?$")


class LaunchError(UserError):
    """An argument or environment that does not describe a valid launch."""


@dataclass(frozen=True)
class SlurmTopology:
    """Where this process sits in a SLURM allocation.

    Args:
        job_id: ``SLURM_JOB_ID`` (the rendezvous id: the same on every node and across requeues).
        nnodes: number of nodes of the allocation (``SLURM_NNODES``).
        node_rank: index of this node (``SLURM_NODEID``).
        nodelist: the compressed host list (``SLURM_JOB_NODELIST``), whose first host is the rendezvous host.
    """

    job_id: str
    nnodes: int
    node_rank: int
    nodelist: str | None


@dataclass
class LaunchPlan:
    """A command ready to run from ``cwd``.

    Args:
        argv: the command, ``argv[0]`` being the Python interpreter.
        env: variables set on top of the caller's environment: ``CUDA_VISIBLE_DEVICES=""`` for CPU runs,
            ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` when torchrun may restart the process group.
        cwd: the folder the command runs in (the repository root: configs import ``common``).
        nnodes: number of nodes.
        nproc_per_node: processes started on this node.
        node_rank: index of this node.
        torchrun: whether the command is a torchrun launch (else a single ``monai.bundle run`` process).
        notes: one-line explanations of derived values (printed by the command-line tool).
    """

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    nnodes: int
    nproc_per_node: int
    node_rank: int
    torchrun: bool
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        """Total number of training processes over all nodes."""
        return self.nnodes * self.nproc_per_node

    def shell(self, from_dir: str | os.PathLike | None = None) -> str:
        """The command as one copy-pasteable shell line.

        Args:
            from_dir: the folder the line will be pasted in; when it is not ``cwd``, the line starts with
                ``cd <cwd> &&``.
        """
        words = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()] + [shlex.quote(a) for a in self.argv]
        line = " ".join(words)
        if from_dir is not None and Path(from_dir).resolve() != self.cwd.resolve():
            line = f"cd {shlex.quote(str(self.cwd))} && {line}"
        return line

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The full environment of the command: ``base``, ``cwd`` (the repository root) prepended to
        ``PYTHONPATH`` so that every process imports ``common``, and :attr:`env`.

        Args:
            base: the environment to start from (default ``os.environ``).
        """
        env = dict(os.environ if base is None else base)
        paths = [str(self.cwd)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env.update(self.env)
        return env


def visible_gpus() -> int:
    """Number of CUDA devices this process sees (honours ``CUDA_VISIBLE_DEVICES``); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def normalize_endpoint(endpoint: str, default_port: int = DEFAULT_RDZV_PORT) -> str:
    """``host:port`` from ``host`` or ``host:port`` (IPv6 hosts in brackets: ``[fd00::1]:29500``).

    Args:
        endpoint: the rendezvous endpoint given by the user.
        default_port: port appended when ``endpoint`` has none.

    Raises:
        LaunchError: for an empty or malformed endpoint or a port outside 1-65535.
    """
    match = _ENDPOINT.match(str(endpoint).strip())
    if not match:
        raise LaunchError(f"rdzv_endpoint must be host or host:port (e.g. node001:29500), got {endpoint!r}.")
    port = int(match.group("port") or default_port)
    if not 0 < port < 65536:
        raise LaunchError(f"rdzv_endpoint port must be in 1-65535, got {endpoint!r}.")
    return f"{match.group('host')}:{port}"


def _split_top_level(text: str) -> list[str]:
    """Split a SLURM host list at the commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def expand_first_host(nodelist: str) -> str:
    """The first host of a compressed SLURM host list, without ``scontrol``.

    ``gpu-[003-006,010],cpu01`` gives ``gpu-003``; ``rack[1-2]-n[07,09]`` gives ``rack1-n07``; ranges keep their
    zero padding, as ``scontrol show hostnames`` does.

    Args:
        nodelist: the value of ``SLURM_JOB_NODELIST``.

    Raises:
        LaunchError: when ``nodelist`` is empty or its brackets do not parse.
    """
    text = str(nodelist).strip()
    first = _split_top_level(text)[0].strip() if text else ""
    if not first or first.count("[") != first.count("]"):
        raise LaunchError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}.")

    def _first_of_group(match: re.Match) -> str:
        item = match.group(1).split(",")[0].strip()
        start = item.split("-")[0].strip()
        if not start.isdigit():
            raise LaunchError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r} (bracket [{match.group(1)}]).")
        return start

    host = re.sub(r"\[([^\[\]]*)\]", _first_of_group, first)
    if any(c in host for c in "[],") or not host:
        raise LaunchError(f"cannot read a host from SLURM_JOB_NODELIST={nodelist!r}.")
    return host


def first_slurm_host(nodelist: str, scontrol: str | None = None) -> str:
    """The first host of a SLURM host list: ``scontrol show hostnames`` when it is on ``PATH``, else
    :func:`expand_first_host`.

    Args:
        nodelist: the value of ``SLURM_JOB_NODELIST``.
        scontrol: path of ``scontrol`` (default: looked up on ``PATH``).

    Raises:
        LaunchError: when neither ``scontrol`` nor the parser yields a host.
    """
    scontrol = scontrol or shutil.which("scontrol")
    if scontrol:
        try:
            result = subprocess.run(
                [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60, check=True
            )
            hosts = result.stdout.split()
            if hosts:
                return hosts[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_first_host(nodelist)


def slurm_topology(env: Mapping[str, str]) -> SlurmTopology:
    """Read this node's place in the allocation from the SLURM environment.

    Args:
        env: the environment (``os.environ`` of a process started by ``srun``).

    Raises:
        LaunchError: outside a SLURM job, or when a variable is missing or not an integer.
    """
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise LaunchError("slurm=True but SLURM_JOB_ID is not set: this is not a SLURM job (run it under sbatch/srun).")
    nnodes_text = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    node_text = env.get("SLURM_NODEID")
    if nnodes_text is None or node_text is None:
        raise LaunchError(
            f"SLURM job {job_id}: SLURM_NNODES/SLURM_JOB_NUM_NODES and SLURM_NODEID must be set "
            f"(got SLURM_NNODES={nnodes_text!r}, SLURM_NODEID={node_text!r}); start the launcher with srun."
        )
    try:
        nnodes, node_rank = int(nnodes_text), int(node_text)
    except ValueError as e:
        raise LaunchError(
            f"SLURM_NNODES and SLURM_NODEID must be integers, got {nnodes_text!r} and {node_text!r}."
        ) from e
    return SlurmTopology(job_id, nnodes, node_rank, env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"))


def _literal(key: str, value: Any) -> str:
    """``value`` as a compact Python literal with double-quoted strings (pastes into a shell without escapes)."""
    if isinstance(value, str):
        return json.dumps(value)
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LaunchError(f"override {key!r} must be a finite number, got {value!r}.")
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_literal(key, v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ",".join(_literal(key, v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_literal(key, k)}:{_literal(key, v)}" for k, v in value.items()) + "}"
    raise LaunchError(
        f"override {key!r} must be a string, number, boolean, None, list, tuple or dict, "
        f"got {type(value).__name__}: {value!r}."
    )


def _format_value(key: str, value: Any) -> str:
    from fire.parser import DefaultParseValue

    if isinstance(value, str):
        # the bundle's command line parses values with fire: quote strings it would read as another type or a flag
        parsed = DefaultParseValue(value)
        if isinstance(parsed, str) and parsed == value and not value.startswith("-"):
            return value
    return _literal(key, value)


def format_overrides(overrides: Mapping[str, Any]) -> list[str]:
    """``--key value`` words that ``python -m monai.bundle run`` parses back to exactly ``overrides``.

    Strings stay as they are unless the bundle's command line would read them as another type (``"5"``,
    ``"True"``, ``"-x"``), in which case they are quoted; other values are written as Python literals.

    Args:
        overrides: config ids (``max_epochs``, ``train#dataloader#batch_size``) and their values.

    Raises:
        LaunchError: for an empty or dash-prefixed key, a key the launcher sets itself (``config_file``), or a
            value that is not a plain literal.
    """
    words: list[str] = []
    for key, value in overrides.items():
        key = str(key)
        if not key or key.startswith("-"):
            raise LaunchError(f"override names are config ids such as 'max_epochs', got {key!r}.")
        if key in RESERVED_OVERRIDES:
            raise LaunchError(f"override {key!r}={value!r} is not allowed: the launcher sets it (use extra_configs).")
        words += [f"--{key}", _format_value(key, value)]
    return words


def _as_int(name: str, value: Any, minimum: int | None = None) -> int:
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, bool):
        raise LaunchError(f"{name} must be {expected}, got {value!r}.")
    try:
        number = int(str(value).strip())
    except ValueError as e:
        raise LaunchError(f"{name} must be {expected}, got {value!r}.") from e
    if minimum is not None and number < minimum:
        raise LaunchError(f"{name} must be {expected}, got {value!r}.")
    return number


def _as_flag(name: str, value: Any, allow_auto: bool = False) -> bool | None:
    text = str(value).strip().lower()
    if isinstance(value, bool) or text in ("true", "false", "1", "0", "yes", "no"):
        return text in ("true", "1", "yes")
    if allow_auto and text == "auto":
        return None
    choices = "True, False or auto" if allow_auto else "True or False"
    raise LaunchError(f"{name} must be {choices}, got {value!r}.")


def _display(path: Path) -> str:
    """``path`` relative to the repository root when inside it (the command runs there), else absolute."""
    path = Path(os.path.abspath(path))
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _resolve_config(name: str, configs_dir: Path) -> Path:
    """A bare file name is looked up in the bundle's ``configs/`` first, then as a path (like any other path)."""
    path = Path(str(name)).expanduser()
    in_bundle = configs_dir / path.name
    if str(name) == path.name and in_bundle.is_file():
        return in_bundle
    if path.is_file():
        return path.resolve()
    known = sorted(p.name for p in configs_dir.glob("*.json"))
    raise LaunchError(
        f"extra config {str(name)!r} is neither a file nor one of {_display(configs_dir)}: {', '.join(known)}."
    )


def _config_arg(paths: Sequence[Path]) -> str:
    shown = [_display(p) for p in paths]
    return shown[0] if len(shown) == 1 else _literal("config_file", shown)


def _as_list(name: str, value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    raise LaunchError(f"{name} must be a list of config files, got {value!r}.")


def build_plan(
    bundle: str,
    nnodes: int | None = None,
    node_rank: int | None = None,
    nproc_per_node: int | str = "auto",
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    rdzv_port: int = DEFAULT_RDZV_PORT,
    max_restarts: int = 0,
    cpu: bool = False,
    slurm: bool | str = "auto",
    extra_configs: Sequence[str] | str | None = None,
    overrides: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    log_dir: str | os.PathLike | None = None,
    bundles_dir: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    job: str = "training",
) -> LaunchPlan:
    """Build the command that runs ``bundle``'s ``job`` (training or inference) on this node.

    One process in total (and no restarts or log folder requested) runs ``monai.bundle`` directly; otherwise
    torchrun starts ``nproc_per_node`` processes here: ``--standalone`` on a single node without an endpoint,
    a ``c10d`` rendezvous at ``rdzv_endpoint`` otherwise. More than one process in total merges the bundle's
    ``multi_gpu_train.json`` on ``train.json``; ``extra_configs`` come last.

    Args:
        bundle: a bundle name under ``bundles_dir`` or the path of a bundle folder.
        nnodes: number of nodes (default 1, or ``SLURM_NNODES`` under SLURM).
        node_rank: index of this node in ``[0, nnodes)`` (default 0, or ``SLURM_NODEID`` under SLURM).
        nproc_per_node: processes on this node: ``"auto"`` is the number of visible GPUs (one process when there
            is none, or with ``cpu``), or an integer.
        rdzv_endpoint: ``host[:port]`` of node 0, reachable from every node (under SLURM: the first host of the
            allocation); required for several nodes. Node 0 hosts the rendezvous store there
            (``--rdzv_conf is_host=true``, ``false`` on the other nodes).
        rdzv_id: rendezvous id shared by all nodes of the job (default: ``SLURM_JOB_ID`` or the bundle name).
        rdzv_port: port used when the endpoint has none (and for the SLURM-derived endpoint).
        max_restarts: times torchrun restarts the whole process group after a failure; training resumes from the
            bundle's ``last.pt``. Each attempt then gets a fresh rendezvous store
            (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` unless ``env`` sets it).
        cpu: train on the CPU even when GPUs are visible (hides them with ``CUDA_VISIBLE_DEVICES=""``).
        slurm: ``True`` reads the topology from the SLURM environment, ``False`` ignores it, ``"auto"`` reads it
            when ``SLURM_JOB_ID`` and ``SLURM_NNODES`` are set. Explicit arguments always win.
        extra_configs: config files merged after the bundle's configs: paths, or names in the bundle's
            ``configs/`` folder (``tiny.json``).
        overrides: config ids and values passed as ``--key value``.
        run_id: the config id to run (default: the job's, ``training`` or ``run``).
        log_dir: folder for torchrun's per-attempt, per-rank logs (``<log_dir>/<run>/attempt_<n>/<rank>/``).
        bundles_dir: folder of the bundles (default: ``bundles/`` of this repository).
        env: the environment read for SLURM variables (default ``os.environ``).
        python: the interpreter (default: the running one).
        job: ``training`` (``train.json``, ``multi_gpu_train.json``) or ``inference`` (``inference.json``,
            ``multi_gpu_inference.json``: each case is processed by one rank; a restart skips the cases written).

    Raises:
        LaunchError: for an unknown job, bundle or config, ``nnodes < 1``, ``node_rank`` outside ``[0, nnodes)``,
            several nodes without an endpoint, more processes than visible GPUs, or malformed values.
    """
    env = os.environ if env is None else env
    if job not in JOBS:
        raise LaunchError(f"job must be one of {list(JOBS)}, got {job!r}.")
    run_id = JOBS[job][2] if run_id is None else run_id
    bundle_dir = resolve_bundle(bundle, bundles_dir)
    configs_dir = bundle_dir / "configs"
    extras = [_resolve_config(name, configs_dir) for name in _as_list("extra_configs", extra_configs)]
    override_words = format_overrides(dict(overrides or {}))
    run_id = str(run_id).strip()
    if not run_id or run_id.startswith("-"):
        raise LaunchError(f"run_id must be a config id such as 'training', got {run_id!r}.")
    cpu = bool(_as_flag("cpu", cpu))
    max_restarts = _as_int("max_restarts", max_restarts, 0)
    rdzv_port = _as_int("rdzv_port", rdzv_port, 1)

    allocation = _slurm_allocation(slurm, env)
    nnodes, node_rank = _node_position(nnodes, node_rank, allocation)
    nproc = _processes_per_node(nproc_per_node, cpu)
    endpoint = _rendezvous_endpoint(rdzv_endpoint, rdzv_port, nnodes, allocation)
    if rdzv_id in (None, ""):
        rdzv_id = allocation.job_id if allocation else bundle_dir.name
    notes = []
    if allocation is not None:
        where = f", rendezvous at {endpoint}" if nnodes > 1 else ""
        notes.append(
            f"SLURM job {allocation.job_id}: node {node_rank} of {nnodes}, {nproc} process(es) per node{where}"
        )

    configs = _bundle_configs(bundle_dir, multi_process=nnodes * nproc > 1, job=job) + extras
    if job == "training":
        _check_total_batch(configs, dict(overrides or {}), nnodes * nproc)
    bundle_args = ["-m", "monai.bundle", "run", run_id, "--config_file", _config_arg(configs), *override_words]
    torchrun = nnodes * nproc > 1 or max_restarts > 0 or log_dir is not None
    argv = [python or sys.executable]
    if torchrun:
        argv += _torchrun_options(nnodes, nproc, node_rank, endpoint, str(rdzv_id), max_restarts, log_dir)
    argv += bundle_args
    extra_env = _launch_env(cpu, torchrun and max_restarts > 0, env)
    return LaunchPlan(argv, extra_env, ROOT, nnodes, nproc, node_rank, torchrun, notes)


def _launch_env(cpu: bool, restarts: bool, env: Mapping[str, str]) -> dict[str, str]:
    """The variables ``build_plan``'s command runs with beyond ``env``: no visible GPU with ``cpu``; with torchrun
    ``restarts``, a fresh rendezvous store per attempt (unless ``env`` sets the switch itself)."""
    extra_env = {"CUDA_VISIBLE_DEVICES": ""} if cpu else {}
    if restarts and SHARED_STORE_SWITCH not in env:
        # torchrun's agent-shared TCPStore keeps the previous attempt's process-group keys: a restarted rank can
        # read a dead peer's address and fail to connect (pytorch/pytorch#135712, #167288). A fresh store per
        # attempt avoids it.
        extra_env[SHARED_STORE_SWITCH] = "1"
    return extra_env


def _slurm_allocation(slurm: bool | str, env: Mapping[str, str]) -> SlurmTopology | None:
    """The SLURM allocation ``build_plan`` reads its topology from: with ``slurm`` ``"auto"``, when ``env`` holds a
    job id and a node count; ``None`` when SLURM is not used."""
    use_slurm = _as_flag("slurm", slurm, allow_auto=True)
    if use_slurm is None:
        use_slurm = bool(env.get("SLURM_JOB_ID")) and bool(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES"))
    return slurm_topology(env) if use_slurm else None


def _torchrun_options(
    nnodes: int,
    nproc: int,
    node_rank: int,
    endpoint: str | None,
    rdzv_id: str,
    max_restarts: int,
    log_dir: str | os.PathLike | None,
) -> list[str]:
    """``-m common.bundle_tools.torchrun`` (torchrun) and its options for this node: topology, rendezvous, restarts,
    logs."""
    argv = ["-m", "common.bundle_tools.torchrun", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc)]
    argv += _rendezvous_options(nnodes, node_rank, endpoint, rdzv_id)
    if max_restarts > 0:
        argv += ["--max_restarts", str(max_restarts)]
    if log_dir is not None:
        argv += ["--log_dir", _display(Path(log_dir)), "--tee", "3"]
    return argv


def _check_total_batch(configs: Sequence[Path], overrides: Mapping[str, Any], world: int) -> None:
    """For bundles whose ``batch_size`` is the total batch across all processes (their configs derive a
    ``per_gpu_batch_size``), check that it divides by the number of processes before anything starts.

    Raises:
        LaunchError: when it does not.
    """
    merged: dict[str, Any] = {}
    for path in configs:
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # the bundle itself reports unreadable configs
        if isinstance(content, dict):
            merged.update(content)
    merged.update(overrides)
    batch = merged.get("batch_size")
    if "per_gpu_batch_size" not in merged or isinstance(batch, bool) or not isinstance(batch, int):
        return
    if batch < 1 or batch % world:
        raise LaunchError(
            f"batch_size {batch} is the total batch across all processes and must be a positive multiple of the "
            f"{world} process(es) launched; use e.g. --batch_size {world * max(1, -(-batch // world))}."
        )


def _node_position(nnodes: Any, node_rank: Any, job: SlurmTopology | None) -> tuple[int, int]:
    """``(nnodes, node_rank)`` from the arguments, else the SLURM job, else a single node."""
    nnodes = _as_int("nnodes", nnodes if nnodes is not None else (job.nnodes if job else 1), 1)
    node_rank = _as_int("node_rank", node_rank if node_rank is not None else (job.node_rank if job else 0))
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"node_rank must be in [0, nnodes={nnodes}), got {node_rank}.")
    return nnodes, node_rank


def _processes_per_node(nproc_per_node: Any, cpu: bool) -> int:
    """One process per visible GPU for ``auto`` (one on the CPU), else the given number, at most one per GPU."""
    gpus = 0 if cpu else visible_gpus()
    if str(nproc_per_node).strip().lower() == "auto":
        return max(gpus, 1)
    nproc = _as_int("nproc_per_node", nproc_per_node, 1)
    if gpus and nproc > gpus:
        raise LaunchError(
            f"nproc_per_node={nproc} exceeds the {gpus} visible GPU(s); use at most {gpus}, "
            "or pass cpu=True for CPU processes."
        )
    return nproc


def _rendezvous_endpoint(endpoint: Any, port: int, nnodes: int, job: SlurmTopology | None) -> str | None:
    """The normalised endpoint, the first SLURM host for several nodes in a job, or ``None`` (standalone)."""
    if endpoint not in (None, ""):
        return normalize_endpoint(str(endpoint), port)
    if nnodes == 1:
        return None
    if job is None:
        raise LaunchError(
            f"nnodes={nnodes} needs rdzv_endpoint=host:port (an address of node 0 that every node reaches), "
            "or a SLURM job (slurm=True)."
        )
    if not job.nodelist:
        raise LaunchError(f"SLURM job {job.job_id}: SLURM_JOB_NODELIST is not set; pass rdzv_endpoint.")
    return f"{first_slurm_host(job.nodelist)}:{port}"


def _rendezvous_options(nnodes: int, node_rank: int, endpoint: str | None, rdzv_id: str) -> list[str]:
    if endpoint is None:
        return ["--standalone"]  # a c10d store on a free local port: no clash between jobs on one machine
    if nnodes == 1:
        return ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id]
    # node 0 hosts the rendezvous store: no guessing from hostnames (DNS aliases, Kubernetes service names)
    is_host = "true" if node_rank == 0 else "false"
    return [
        *["--node_rank", str(node_rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint],
        *["--rdzv_id", rdzv_id, "--rdzv_conf", f"is_host={is_host}"],
    ]


def _bundle_configs(bundle_dir: Path, multi_process: bool, job: str = "training") -> list[Path]:
    """The job's config (``train.json``), plus its multi-process config (``multi_gpu_train.json``) for more than one
    process."""
    single, multi, _ = JOBS[job]
    names = [single, multi] if multi_process else [single]
    paths = [bundle_dir / "configs" / name for name in names]
    for path in paths:
        if not path.is_file():
            raise LaunchError(f"bundle {bundle_dir.name!r} has no {_display(path)}; it is needed for this launch.")
    return paths


def run_plan(plan: LaunchPlan, replace_process: bool = False) -> int:
    """Run ``plan`` from its folder with the repository root on ``PYTHONPATH``.

    Args:
        plan: what :func:`build_plan` returned.
        replace_process: replace this Python process with the command (``os.execve``) so that signals from a
            scheduler (SLURM preemption, Kubernetes termination) reach torchrun directly; never returns on POSIX.

    Returns:
        The exit status of the command (torchrun's, or the single training process's).
    """
    env = plan.environ()
    if replace_process and os.name == "posix":
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(plan.cwd)
        os.execve(plan.argv[0], plan.argv, env)
    return subprocess.run(plan.argv, cwd=plan.cwd, env=env, check=False).returncode

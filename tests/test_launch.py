# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests of ``scripts/launch.py`` / ``common.bundle_tools.launch``: the exact commands for one process, one node,
several nodes and SLURM; input errors; the SLURM and Kubernetes templates. A real 2-process CPU job through the
launcher, in which one rank dies and ``--max_restarts`` brings the job back from ``last.pt``, is in
``tests/test_reliability.py``."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import fire
import pytest
import yaml

from common.bundle import BUNDLES_DIR, bundle_names
from common.bundle_tools import launch
from common.bundle_tools.launch import LaunchError, LaunchPlan, build_plan, format_overrides
from common.errors import INTERRUPTED, UserError
from tests.helpers import REPO_ROOT, bundle_env

SCRIPT = REPO_ROOT / "scripts" / "launch.py"
SBATCH = REPO_ROOT / "scripts" / "slurm" / "train.sbatch"
K8S = REPO_ROOT / "scripts" / "k8s"
EXAMPLE = "autoencoder_3d"
ALL_BUNDLES = bundle_names()
UNKNOWN = (
    f"unknown bundle 'nope': neither a bundle in {str(BUNDLES_DIR)!r} nor a folder with configs/metadata.json; "
    f"available: {', '.join(ALL_BUNDLES)}."
)
PY = sys.executable
STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def _configs(bundle: str, *names: str) -> str:
    paths = [f"bundles/{bundle}/configs/{name}" for name in names]
    return paths[0] if len(paths) == 1 else json.dumps(paths, separators=(",", ":"))


def _env(**extra: str) -> dict[str, str]:
    """A launcher environment with no GPU and no SLURM job, whatever machine runs the tests."""
    env = {k: v for k, v in bundle_env().items() if not k.startswith("SLURM_") and k != launch.SHARED_STORE_SWITCH}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def _cli(*args: str, cwd: Path = REPO_ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, str(SCRIPT), *args], cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=120
    )


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)


# --------------------------------------------------------------------------------------------- exact commands
def test_one_cpu_process_runs_monai_bundle_directly():
    overrides = "--max_epochs 5 --dataset_dir /data/x --patch_size [16,16,16] --resume False"
    result = _cli(EXAMPLE, *"--cpu True --dry_run True".split(), *overrides.split())
    assert result.returncode == 0, result.stderr
    expected = [PY, *"-m monai.bundle run training --config_file".split(), _configs(EXAMPLE, "train.json")]
    assert result.stdout.strip() == f"CUDA_VISIBLE_DEVICES='' {shlex.join(expected + overrides.split())}"


def test_one_node_two_cpu_processes_uses_standalone_torchrun():
    line = "--nproc_per_node 2 --cpu True --dry_run True --extra_configs tiny.json --overrides {'max_epochs':2}"
    result = _cli(EXAMPLE, *line.split())
    assert result.returncode == 0, result.stderr
    expected = [
        *[PY, "-m", "common.bundle_tools.torchrun", "--nnodes", "1", "--nproc_per_node", "2", "--standalone"],
        *"-m monai.bundle run training --config_file".split(),
        _configs(EXAMPLE, "train.json", "multi_gpu_train.json", "tiny.json"),
        *["--max_epochs", "2"],
    ]
    assert result.stdout.strip() == f"CUDA_VISIBLE_DEVICES='' {shlex.join(expected)}"


def test_two_nodes_of_eight_gpus(monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 8)
    overrides = {"output_dir": "/shared/runs/ae", "amp": "bf16"}
    plan = build_plan(
        EXAMPLE,
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="node001:29400",
        rdzv_id="ae1",
        max_restarts=3,
        overrides=overrides,
        env={},
    )
    assert plan.argv == [
        PY,
        *"-m common.bundle_tools.torchrun --nnodes 2 --nproc_per_node 8 --node_rank 1 --rdzv_backend c10d".split(),
        *"--rdzv_endpoint node001:29400 --rdzv_id ae1 --rdzv_conf is_host=false --max_restarts 3".split(),
        *"-m monai.bundle run training --config_file".split(),
        _configs(EXAMPLE, "train.json", "multi_gpu_train.json"),
        *"--output_dir /shared/runs/ae --amp bf16".split(),
    ]
    assert plan.env == {launch.SHARED_STORE_SWITCH: "1"} and plan.world_size == 16 and plan.cwd == REPO_ROOT
    node0 = build_plan(EXAMPLE, nnodes=2, node_rank=0, rdzv_endpoint="node001", env={})
    assert node0.argv[node0.argv.index("--rdzv_endpoint") + 1] == "node001:29500"  # default port appended
    assert "is_host=true" in node0.argv and "--max_restarts" not in node0.argv and node0.env == {}
    assert build_plan(EXAMPLE, nproc_per_node=4, env={}).nproc_per_node == 4
    with pytest.raises(LaunchError, match=r"nproc_per_node=9 exceeds the 8 visible GPU"):
        build_plan(EXAMPLE, nproc_per_node=9, env={})
    assert build_plan(EXAMPLE, nproc_per_node=9, cpu=True, env={}).nproc_per_node == 9


SLURM_ENV = {"SLURM_JOB_ID": "777", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu-[003-006]"}


def test_slurm_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 4)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no scontrol: the host list is parsed in Python
    plan = build_plan(EXAMPLE, max_restarts=3, env=SLURM_ENV)
    torchrun_args = plan.argv[: plan.argv.index("-m", 3)]
    assert torchrun_args == [
        PY,
        *"-m common.bundle_tools.torchrun --nnodes 4 --nproc_per_node 4 --node_rank 2 --rdzv_backend c10d".split(),
        *"--rdzv_endpoint gpu-003:29500 --rdzv_id 777 --rdzv_conf is_host=false --max_restarts 3".split(),
    ]
    assert plan.notes == ["SLURM job 777: node 2 of 4, 4 process(es) per node, rendezvous at gpu-003:29500"]

    # scontrol, when present, names the first host
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu-[003-006]" ] && printf "alpha\\nbeta\\n"\n')
    scontrol.chmod(0o755)
    plan = build_plan(EXAMPLE, env=SLURM_ENV, rdzv_port=6000)
    assert plan.argv[plan.argv.index("--rdzv_endpoint") + 1] == "alpha:6000"

    # explicit arguments win over SLURM; slurm=False ignores it; slurm=True needs a job
    plan = build_plan(EXAMPLE, env=SLURM_ENV, nnodes=2, node_rank=0, rdzv_endpoint="head:1234", rdzv_id="mine")
    assert (
        plan.argv[3:17]
        == (
            "--nnodes 2 --nproc_per_node 4 --node_rank 0 --rdzv_backend c10d "
            "--rdzv_endpoint head:1234 --rdzv_id mine --rdzv_conf is_host=true"
        ).split()
    )
    assert build_plan(EXAMPLE, env=SLURM_ENV, slurm=False).nnodes == 1
    one_node = build_plan(EXAMPLE, env={**SLURM_ENV, "SLURM_NNODES": "1", "SLURM_NODEID": "0"})
    assert "--standalone" in one_node.argv and one_node.nproc_per_node == 4
    with pytest.raises(LaunchError, match="SLURM_JOB_ID is not set"):
        build_plan(EXAMPLE, slurm=True, env={})
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST is not set"):
        build_plan(EXAMPLE, env={k: v for k, v in SLURM_ENV.items() if k != "SLURM_JOB_NODELIST"})
    with pytest.raises(LaunchError, match=r"SLURM_NNODES and SLURM_NODEID must be integers, got 'four'"):
        build_plan(EXAMPLE, env={**SLURM_ENV, "SLURM_NNODES": "four"})


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("node01", "node01"),
        ("node[01-04]", "node01"),
        ("gpu-[003-006,010],cpu01", "gpu-003"),
        ("rack[1-2]-n[07,09]", "rack1-n07"),
        ("a,b[1-2]", "a"),
        ("c[9,1-3]", "c9"),
    ],
)
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert launch.expand_first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["", "node[01-04", "node[a-b]"])
def test_unreadable_slurm_host_list(nodelist):
    with pytest.raises(LaunchError, match="cannot read a host from SLURM_JOB_NODELIST"):
        launch.expand_first_host(nodelist)


@pytest.mark.parametrize("bundle", ALL_BUNDLES)
def test_every_bundle_gets_existing_configs(bundle):
    for nproc in (1, 2):
        plan = build_plan(bundle, nproc_per_node=nproc, cpu=True, extra_configs=["tiny.json"], env={})
        configs = fire.parser.DefaultParseValue(plan.argv[plan.argv.index("--config_file") + 1])
        assert len(configs) == nproc + 1 and all((REPO_ROOT / c).is_file() for c in configs)


def test_inference_job_shares_the_cases_over_the_processes():
    """``--job inference``: inference.json (run id ``run``) for one process, with multi_gpu_inference.json for more;
    the batch check of training does not apply; an unknown job is refused."""
    line = "--job inference --nproc_per_node 2 --cpu True --dry_run True --dataset_dir /data/ct"
    result = _cli(EXAMPLE, *line.split())
    assert result.returncode == 0, result.stderr
    expected = [
        *[PY, "-m", "common.bundle_tools.torchrun", "--nnodes", "1", "--nproc_per_node", "2", "--standalone"],
        *"-m monai.bundle run run --config_file".split(),
        _configs(EXAMPLE, "inference.json", "multi_gpu_inference.json"),
        *["--dataset_dir", "/data/ct"],
    ]
    assert result.stdout.strip() == f"CUDA_VISIBLE_DEVICES='' {shlex.join(expected)}"
    for bundle in ALL_BUNDLES:
        plan = build_plan(bundle, nproc_per_node=1, cpu=True, job="inference", env={})
        assert plan.argv[plan.argv.index("run") + 1] == "run" and plan.argv[-1].endswith("configs/inference.json")
    refused = _cli(EXAMPLE, "--job", "predict", "--dry_run", "True")
    assert (
        refused.returncode == 2
        and "error: job must be one of ['training', 'inference'], got 'predict'." in refused.stderr
    )


def test_paths_and_cd_prefix_from_another_folder(tmp_path):
    """Config paths are made absolute (the command runs in the repository root); a bare name of a bundle config
    means the bundle's file even when the current folder has one of that name."""
    for name in ("mine.json", "tiny.json"):
        (tmp_path / name).write_text("{}")
    extras = "['tiny.json','mine.json','./tiny.json']"
    result = _cli(EXAMPLE, *"--cpu True --dry_run True --extra_configs".split(), extras, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    prefix = f"cd {shlex.quote(str(REPO_ROOT))} && CUDA_VISIBLE_DEVICES='' "
    assert result.stdout.startswith(prefix)
    configs = json.loads(shlex.split(result.stdout.strip()[len(prefix) :])[6])
    bundle_configs = json.loads(_configs(EXAMPLE, "train.json", "tiny.json"))
    assert configs == [*bundle_configs, str(tmp_path / "mine.json"), str(tmp_path / "tiny.json")]


def test_overrides_survive_the_bundle_command_line():
    values = {
        "max_epochs": 5,
        "lr": 1e-4,
        "amp": "bf16",
        "resume": False,
        "spacing": None,
        "patch_size": [96, 96, 96],
        "intensity": {"mode": "ct", "a_min": -1000, "a_max": 1000.5},
        "shape": (4,),
        "tag": "007",
        "flag_like": "-x",
        "word": "True",
        "expr": "$@lr * 2",
        "path": "/data/a b",
        "train#dataloader#batch_size": 3,
    }
    parsed: dict = {}

    def run(run_id: str | None = None, **override) -> None:  # the signature of ``monai.bundle run``
        parsed.update(override)

    fire.Fire(run, command=["training", *format_overrides(values)])
    assert parsed == values and all(type(parsed[k]) is type(v) for k, v in values.items())


# ------------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bundle": "nope"}, UNKNOWN),
        ({"nnodes": 0}, "nnodes must be an integer >= 1, got 0"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"}, "node_rank must be in [0, nnodes=2), got 2"),
        ({"node_rank": -1}, "node_rank must be in [0, nnodes=1), got -1"),
        ({"nnodes": 2}, "nnodes=2 needs rdzv_endpoint=host:port"),
        ({"nproc_per_node": "many"}, "nproc_per_node must be an integer >= 1, got 'many'"),
        ({"nproc_per_node": 0}, "nproc_per_node must be an integer >= 1, got 0"),
        ({"nnodes": 2, "rdzv_endpoint": "host:port"}, "rdzv_endpoint must be host or host:port"),
        ({"nnodes": 2, "rdzv_endpoint": "h:70000"}, "rdzv_endpoint port must be in 1-65535, got 'h:70000'"),
        ({"max_restarts": -1}, "max_restarts must be an integer >= 0, got -1"),
        ({"overrides": {"config_file": "x.json"}}, "override 'config_file'='x.json' is not allowed"),
        ({"overrides": {"x": object}}, "override 'x' must be a string, number"),
        ({"extra_configs": ["missing.json"]}, "extra config 'missing.json' is neither a file nor one of"),
        ({"cpu": "maybe"}, "cpu must be True or False, got 'maybe'"),
        ({"slurm": "perhaps"}, "slurm must be True, False or auto, got 'perhaps'"),
        ({"run_id": "--x"}, "run_id must be a config id"),
    ],
)
def test_invalid_launches_are_refused(kwargs, message):
    kwargs = {"bundle": EXAMPLE, "env": {}, **kwargs}
    with pytest.raises(UserError) as info:  # a LaunchError, or the unknown bundle's BundleNotFoundError
        build_plan(**kwargs)
    assert message in str(info.value)


def test_cli_error_exit_status():
    result = _cli("nope", "--dry_run", "True")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == f"error: {UNKNOWN}"
    result = _cli(EXAMPLE, "--overrides", "[1]", "--dry_run", "True")
    assert result.returncode == 2 and "overrides must be a dict" in result.stderr


def test_run_plan_environment_and_exit_status():
    probe = (
        "import os, sys; from pathlib import Path; "
        "ok = os.environ['PYTHONPATH'].split(os.pathsep)[0] == sys.argv[1] "
        "and os.environ['CUDA_VISIBLE_DEVICES'] == '' and Path.cwd() == Path(sys.argv[1]); sys.exit(7 if ok else 1)"
    )
    plan = LaunchPlan([PY, "-c", probe, str(REPO_ROOT)], {"CUDA_VISIBLE_DEVICES": ""}, REPO_ROOT, 1, 1, 0, False)
    assert launch.run_plan(plan) == 7


# ------------------------------------------------------------------------------------------ cluster templates
def _options(words: list[str]) -> dict[str, str]:
    return {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}


def _substitute(words: list[str], values: dict[str, str]) -> list[str]:
    """Kubernetes ``$(VAR)`` expansion."""
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], w) for w in words]


def _launch_args(command: list[str]) -> list[str]:
    assert command[:2] == ["python", "scripts/launch.py"] and command[2] in ALL_BUNDLES, command
    return command[2:]


def _gpus(container: dict) -> int:
    limit = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert limit >= 1 and int(container["resources"]["requests"]["nvidia.com/gpu"]) == limit
    return limit


def _shared_volume(pod: dict, pvc: dict, container: dict) -> str:
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
    }
    assert list(claims.values()) == [pvc["metadata"]["name"]] and "ReadWriteMany" in pvc["spec"]["accessModes"]
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims]
    return mount


def test_pytorchjob_manifest():
    pvc, job = yaml.safe_load_all((K8S / "pytorchjob.yaml").read_text())
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert replicas["Worker"]["replicas"] >= 1
    assert spec["elasticPolicy"]["rdzvBackend"] == "c10d"
    for role in replicas.values():
        assert role["restartPolicy"] == "OnFailure"
        (container,) = role["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # required by the operator
        port = {p["name"]: p["containerPort"] for p in container["ports"]}["pytorchjob-port"]
        args = _launch_args(container["command"])
        opts = _options(args)
        assert opts["--nnodes"] == "$(WORLD_SIZE)" and opts["--node_rank"] == "$(RANK)"
        assert opts["--rdzv_endpoint"] == "$(MASTER_ADDR):$(MASTER_PORT)"
        assert int(opts["--max_restarts"]) == spec["elasticPolicy"]["maxRestarts"]
        assert opts["--output_dir"].startswith(_shared_volume(role["template"]["spec"], pvc, container) + "/")
        gpus = _gpus(container)

    # what the operator's environment makes of it, on the first worker
    nodes = replicas["Master"]["replicas"] + replicas["Worker"]["replicas"]
    master = f"{job['metadata']['name']}-master-0"
    env = {"WORLD_SIZE": str(nodes), "RANK": "1", "MASTER_ADDR": master, "MASTER_PORT": str(port)}
    result = _cli(*_substitute(args, env), "--dry_run", "True")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip())
    torchrun_options = _options(words[words.index("common.bundle_tools.torchrun") + 1 : words.index("-m", 3)])
    assert torchrun_options == {
        "--nnodes": str(nodes),
        "--nproc_per_node": "1",
        "--node_rank": "1",
        "--rdzv_backend": "c10d",
        "--rdzv_endpoint": f"{master}:{port}",
        "--rdzv_id": opts["--rdzv_id"],
        "--rdzv_conf": "is_host=false",
        "--max_restarts": opts["--max_restarts"],
    }
    assert gpus >= 1  # nproc_per_node is "auto": one process per GPU of the pod (1 on this CPU machine)


def test_indexed_job_manifest():
    pvc, service, job = yaml.safe_load_all((K8S / "indexed-job.yaml").read_text())
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    assert (service["apiVersion"], service["kind"]) == ("v1", "Service")
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] >= 2
    assert pod["restartPolicy"] == "OnFailure"
    # headless service selecting the job's pods, used as their DNS subdomain
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    args = _launch_args(container["command"])
    opts = _options(args)
    assert int(opts["--nnodes"]) == spec["completions"]
    assert opts["--node_rank"] == "$(JOB_COMPLETION_INDEX)"
    index_env = {e["name"]: e for e in container["env"]}["JOB_COMPLETION_INDEX"]
    assert "job-completion-index" in index_env["valueFrom"]["fieldRef"]["fieldPath"]
    host, port = opts["--rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod of index 0
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    assert opts["--output_dir"].startswith(_shared_volume(pod, pvc, container) + "/")
    _gpus(container)

    result = _cli(*_substitute(args, {"JOB_COMPLETION_INDEX": "1"}), "--dry_run", "True")
    assert result.returncode == 0, result.stderr
    assert f"--node_rank 1 --rdzv_backend c10d --rdzv_endpoint {opts['--rdzv_endpoint']}" in result.stdout


def test_sbatch_template(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)]).returncode == 0
    directives = dict(
        line[len("#SBATCH --") :].partition("=")[::2]
        for line in SBATCH.read_text().splitlines()
        if line.startswith("#SBATCH --")
    )
    assert directives["ntasks-per-node"] == "1" and int(directives["nodes"]) >= 1
    assert int(directives["gpus-per-node"]) >= 1 and int(directives["cpus-per-task"]) >= 1 and "requeue" in directives

    # run it as sbatch would on node 1 of a 2-node job, with an srun that runs its command here
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/srun_args\nwhile [ "${{1#-}}" != "$1" ]; do shift; done\nexec "$@"\n'
    )
    srun.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    env = _env(
        PATH=os.pathsep.join([str(bin_dir), str(Path(PY).parent), "/usr/bin", "/bin"]),
        PYTHON=PY,
        SLURM_SUBMIT_DIR=str(REPO_ROOT),
        SLURM_CPUS_PER_TASK="4",
        **slurm,
    )
    cmd = ["bash", str(SBATCH), "--dry_run", "True", "--max_epochs", "5"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "srun_args").read_text().startswith("--kill-on-bad-exit=1 --ntasks-per-node=1 ")
    expected = [
        PY,
        *"-m common.bundle_tools.torchrun --nnodes 2 --nproc_per_node 1 --node_rank 1 --rdzv_backend c10d".split(),
        *"--rdzv_endpoint gpu07:29500 --rdzv_id 4242 --rdzv_conf is_host=false --max_restarts 3".split(),
        *"-m monai.bundle run training --config_file".split(),
        _configs(EXAMPLE, "train.json", "multi_gpu_train.json"),
        *["--output_dir", f"{REPO_ROOT}/runs/{EXAMPLE}_4242", "--max_epochs", "5"],
    ]
    assert result.stdout.strip() == f"{STORE} {shlex.join(expected)}"
    assert "SLURM job 4242: node 1 of 2" in result.stderr


# --------------------------------------------------------------------------------------------- two checkouts
ENTRY_POINTS = sorted(p.name for p in (REPO_ROOT / "scripts").glob("*.py") if p.name != "__init__.py")


def _second_checkout(root: Path) -> Path:
    """A copy of this checkout's files (tracked and not ignored) in ``root``: a second clone."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        source = REPO_ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(source.read_bytes())
    return root


def _cli_of(script: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python <script> <args>`` from the folder holding the script's checkout."""
    cwd = script.parent.parent.parent
    return subprocess.run([PY, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_script_runs_the_checkout_it_is_in_or_stops(tmp_path):
    """With one environment and two checkouts, a script of the second one that would import the first one's code
    stops with one line naming both; importing its own checkout, it runs it (the launcher's command starts there)."""
    other = _second_checkout(tmp_path / "second clone")
    for script in ENTRY_POINTS:  # this environment imports REPO_ROOT's common
        result = _cli_of(other / "scripts" / script, "--help", env=_env())
        message = f"error: {script} is in the checkout {str(other)!r} but this Python imports the collection from "
        assert result.returncode == 1 and result.stderr.splitlines() == [
            f"{message}{str(REPO_ROOT)!r}; run it there, or make this environment use this checkout: "
            f"pip install -e {str(other)!r}"
        ], (script, result.stderr[-2000:])
    own = _env(PYTHONPATH=str(other))
    result = _cli_of(other / "scripts" / "launch.py", EXAMPLE, "--cpu", "True", "--dry_run", "True", env=own)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"cd {shlex.quote(str(other))} && "), result.stdout
    assert _cli(EXAMPLE, "--cpu", "True", "--dry_run", "True", cwd=tmp_path).stdout.startswith(
        f"cd {shlex.quote(str(REPO_ROOT))} && "
    )


RANK_WAITING_FOR_CTRL_C = """
import os, pathlib, sys, time
from common.errors import install_user_error_hook

install_user_error_hook()  # as a bundle's first step does: Ctrl-C ends the rank with one line
pathlib.Path(sys.argv[1], f"ready{os.environ['RANK']}").touch()
time.sleep(120)
"""


@pytest.mark.skipif(os.name != "posix", reason="process groups and SIGINT as a terminal sends them")
def test_ctrl_c_under_the_launchers_torchrun_ends_with_130_and_one_line_per_process(tmp_path):
    """Ctrl-C in a terminal reaches torchrun's agent and every rank (one process group). Each rank ends with its
    own whole line (never mixed with another rank's); the agent, which torchrun ends with a ``SignalException``
    traceback and status 1, ends with one line and status 130 under ``common.bundle_tools.torchrun`` (what
    ``scripts/launch.py`` runs)."""
    import signal
    import time

    worker = tmp_path / "rank.py"
    worker.write_text(RANK_WAITING_FOR_CTRL_C)
    argv = [
        PY,
        "-m",
        "common.bundle_tools.torchrun",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        str(tmp_path),
    ]
    env = {**bundle_env(), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready*"))) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list(tmp_path.glob("ready*"))) == 2, process.stderr.read() if process.poll() is not None else "no ranks"
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "SignalException" not in err, err
    assert [line for line in err.splitlines() if "interrupted" in line] == [INTERRUPTED, INTERRUPTED], err
    assert err.count("torchrun: stopped by SIGINT;") == 1

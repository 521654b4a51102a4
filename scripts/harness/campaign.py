# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""One measurement campaign that turns whatever GPU is present into figures, most valuable first.

    python scripts/benchmark.py campaign --plan                         # what it would run, minutes of each
    python scripts/benchmark.py campaign --minutes 25 --output campaign.json
    python scripts/benchmark.py campaign --minutes 9 --output campaign.json --only "[gpu_tests,bf16]"
    python scripts/benchmark.py campaign --report campaign.json                           # Markdown on stdout
    python scripts/benchmark.py campaign --report campaign.json --markdown docs/benchmarks.md  # into the doc
    python scripts/benchmark.py campaign --report docs/campaigns/a.json,docs/campaigns/b.json  # several runs
    python scripts/benchmark.py campaign --tiny True --output /tmp/c.json                 # CPU, seconds per item

Each item is one command of ``scripts/benchmark.py`` (or the GPU tests, ``pytest -m gpu``) run in a fresh
process with a deadline: an item starts only when its estimate fits in the time left, is stopped (its process
group killed) when the campaign's time is up, and every finished item is written to ``--output`` at once
(atomically), so a campaign cut short keeps what it measured. The order is the value order, except that the items
an earlier campaign measured (``docs/campaigns``) come after all those never measured:

    (a) the GPU tests, in three items so that a short lease still runs the first ones: the CUDA synchronisations
        of every bundle's training step, then train -> evaluate of every bundle on CUDA in bf16 with the GPU cache
        (and the autoencoder with gradient checkpointing, and a real out-of-memory error redone with a smaller
        micro-batch), and - after the bf16 rows of (b) - resume after a kill on CUDA and the 2-GPU NCCL replicas;
    (b) every bundle's trainer vs a plain PyTorch loop at a realistic size in bf16 + compile (with the kernel
        profile of one step, :func:`scripts.harness.tools.kernel_profile`), then bf16, then - after (c) to (e) -
        fp32: samples/s, the ratio, data wait, peak memory and model FLOPs utilisation (MFU: FLOPs of one step
        counted by ``torch.utils.flop_counter``, divided by the step time and the device's dense bf16 peak of
        :data:`scripts.harness.tools.PEAK_BF16_TFLOPS`);
    (c) the VQ-GAN whole-volume reconstruction of a 512x512x604 CT at ``sw_batch_size`` 1, 2 and 4;
    (d) one xray2ct stage 3 (256^3) training step with gradient checkpointing and bf16;
    (e) the largest patch and micro-batch that fit for the autoencoder and the VQ-GAN;
    (f) the fast_ddpm equal-budget quality comparison (fast vs the 1000-step DDPM);
    then the GPU tests with ``torch.compile``.

Before the first item, one process imports what each bundle's items need (the modules of its ``train.json``
``imports`` and its benchmark module) and the installed packages are compared with ``requirements.txt``: a bundle
that cannot be imported (a package missing on the machine) has its items skipped at once, with the import error as
the reason, instead of each failing after its start-up; the findings are printed and kept in the output
(``environment``).

``--tiny True`` runs the same items on the CPU at toy sizes (a few iterations each, skipping the GPU tests) so the
machinery and the output schema are exercised without a GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.bundle import ROOT as REPO_ROOT
from scripts.harness.tools import shape_label

__all__ = ["ITEMS", "SCHEMA_VERSION", "Item", "campaign", "render_report"]

SCHEMA_VERSION = 1
# seconds kept in hand at the end of a campaign for writing the output and stopping a process group
MARGIN_S = 20.0
REPORT_START = "<!-- campaign:start (rendered by `python scripts/benchmark.py campaign --report`) -->"
REPORT_END = "<!-- campaign:end -->"


@dataclass(frozen=True)
class Item:
    """One measurement of the campaign.

    Attributes:
        name: unique name (``--only`` selects by name or by tag).
        section: the issue's letter of the measurement: ``a`` GPU tests, ``b`` throughput, ``c`` reconstruction,
            ``d`` stage 3 step, ``e`` largest fit, ``f`` quality, ``g`` inference.
        what: one line for ``--plan`` and the report.
        minutes: estimated minutes on an H100 (``--plan`` and the start rule use it).
        gpu: arguments after ``python scripts/benchmark.py`` on a GPU (``pytest ...`` for the GPU tests).
        tiny: the CPU toy version (None: not run in tiny mode).
        tags: further names ``--only`` accepts (``bf16``, ``fp32``, ``compile``, the bundle name).
    """

    name: str
    section: str
    what: str
    minutes: float
    gpu: tuple[str, ...]
    tiny: tuple[str, ...] | None
    tags: tuple[str, ...] = field(default_factory=tuple)


def _args(command: str, **kwargs: Any) -> tuple[str, ...]:
    """``command --key value ...`` with values written as Python literals, which fire reads back exactly."""
    from common.bundle_tools.launch import format_overrides

    return (command, *format_overrides(kwargs))


_GPU_RUN = {"device": "cuda", "iterations": 20, "warmup": 5, "repeats": 1}
_TINY_RUN = {"device": "cpu", "iterations": 2, "warmup": 1, "repeats": 1, "num_threads": 1}


def _throughput_rows() -> tuple:
    """The throughput rows of every family: ``THROUGHPUT`` of each harness module (:mod:`scripts.harness.bundles`)."""
    from scripts.harness.bundles import modules

    return tuple(row for module in modules() for row in module.THROUGHPUT)


def _xray_tiny() -> dict:
    from scripts.harness.xray2ct import CAMPAIGN_TINY

    return CAMPAIGN_TINY


_PRECISIONS = (("bf16", {"amp": "bf16"}, 1.0), ("fp32", {"amp": "none"}, 1.2), ("compile", {"amp": "bf16"}, 2.5))


def _throughput_items() -> list[Item]:
    items = []
    for label, precision, minutes in _PRECISIONS:
        compiled = {"compile": True} if label == "compile" else {}
        # the kernel profile of one step: of the compiled bf16 step on a GPU, of the bf16 row's step in tiny mode
        gpu_profile = {"profile": True} if label == "compile" else {}
        tiny_profile = {"profile": True} if label == "bf16" else {}
        for name, command, gpu, tiny in _throughput_rows():
            tiny_amp = {} if label == "bf16" else precision  # bf16 autocast on a CPU is slow and not the point
            items.append(
                Item(
                    name=f"throughput_{name}_{label}",
                    section="b",
                    what=f"{name}: bundle vs plain loop, {label}"
                    + (" (bf16 + torch.compile), and the kernel profile of one step" if compiled else ""),
                    minutes=minutes * (1.5 if name.startswith("xray2ct_stage2") else 1.0),
                    gpu=_args(command, **_GPU_RUN, **gpu, **precision, **compiled, **gpu_profile),
                    tiny=_args(command, **_TINY_RUN, **tiny, **tiny_amp, **tiny_profile)
                    if label != "compile"
                    else None,
                    tags=(label, name.split("_stage")[0]),
                )
            )
    return items


_GPU_TESTS = ("pytest", "-m", "gpu and not compile", "-k")

# the order of value: correctness on CUDA, then the compiled bf16 step (the goal's figures: bundle / plain, MFU, the
# kernel profile), then the rest; items measured by an earlier campaign (docs/campaigns) move to the end
ITEMS: tuple[Item, ...] = (
    Item(
        "gpu_tests_sync",
        "a",
        "pytest -m gpu: CUDA synchronisations in training steps of every bundle (torch.cuda.set_sync_debug_mode)",
        2.0,
        (*_GPU_TESTS, "host_synchronisations"),
        None,
        ("gpu_tests",),
    ),
    Item(
        "gpu_tests",
        "a",
        "pytest -m gpu: train -> evaluate of every bundle on CUDA (bf16, cuDNN benchmark, GPU cache), the autoencoder "
        "with gradient checkpointing and flash attention, a real out-of-memory error redone with a smaller micro-batch",
        6.5,
        (*_GPU_TESTS, "trains_and_evaluates_on_cuda or gradient_checkpointing or out_of_memory"),
        None,
        ("gpu_tests",),
    ),
    *[i for i in _throughput_items() if i.tags[0] == "compile"],
    *[i for i in _throughput_items() if i.tags[0] == "bf16"],
    Item(
        "gpu_tests_resume",
        "a",
        "pytest -m gpu: jobs killed mid-run on CUDA resume to the uninterrupted weights; NCCL replicas with 2+ GPUs",
        3.0,
        (*_GPU_TESTS, "resume_on_cuda or nccl"),
        None,
        ("gpu_tests",),
    ),
    Item(
        "vqgan_reconstruction_512",
        "c",
        "vqgan_3d: whole-volume reconstruction of 512x512x604 at sw_batch_size 1, 2, 4 (bf16)",
        2.5,
        _args("vqgan_reconstruction", shape=[512, 512, 604], sw_batch_sizes=[1, 2, 4], device="cuda", amp="bf16"),
        _args(
            "vqgan_reconstruction",
            shape=[32, 32, 40],
            patch_size=[32, 32, 32],
            sw_batch_sizes=[1],
            n_hiddens=8,
            n_codes=64,
            repeats=1,
            device="cpu",
            amp="none",
        ),
        ("vqgan_3d",),
    ),
    Item(
        "xray2ct_stage3_step",
        "d",
        "xray2ct_cascade: stage 3 (256^3) training steps, gradient checkpointing + bf16, bundle alone",
        2.0,
        _args(
            "xray_throughput",
            stage=3,
            device="cuda",
            amp="bf16",
            gradient_checkpointing=True,
            plain=False,
            n_cases=2,
            batch_size=1,
            iterations=4,
            warmup=2,
            repeats=1,
        ),
        _args(
            "xray_throughput",
            **{**_xray_tiny(), "stage_sizes": [[16, 16, 16], [16, 16, 16], [32, 32, 32]]},
            stage=3,
            device="cpu",
            gradient_checkpointing=True,
            plain=False,
            iterations=2,
            warmup=1,
            repeats=1,
            num_threads=1,
        ),
        ("xray2ct",),
    ),
    Item(
        "autoencoder_largest_patch",
        "e",
        "autoencoder_3d: peak memory of training steps at 128^3 .. 256^3 patches (bf16), largest that fits",
        2.0,
        _args(
            "memory",
            patch_sizes=[[128, 128, 128], [160, 160, 160], [192, 192, 192], [224, 224, 224], [256, 256, 256]],
            device="cuda",
            amp="bf16",
        ),
        _args("memory", patch_sizes=[[32, 32, 32]], channels=[8, 16, 16], device="cpu", amp="none"),
        ("autoencoder_3d",),
    ),
    Item(
        "vqgan_largest_micro_batch",
        "e",
        "vqgan_3d: peak memory of training steps at 128^3, micro-batch 1, 2, 4, 8 (bf16), largest that fits",
        2.5,
        _args(
            "vqgan_memory",
            patch_sizes=[[128, 128, 128]],
            micro_batch_sizes=[1, 2, 4, 8],
            extra_runs=[],
            device="cuda",
            amp="bf16",
        ),
        _args(
            "vqgan_memory",
            patch_sizes=[[16, 16, 16]],
            micro_batch_sizes=[1],
            extra_runs=[],
            steps=2,
            device="cpu",
            n_hiddens=8,
            n_codes=64,
            disc_channels=8,
            disc_layers=2,
        ),
        ("vqgan_3d",),
    ),
    *[i for i in _throughput_items() if i.tags[0] == "fp32"],
    Item(
        "xray_budgets",
        "f",
        "xray2ct_cascade: PSNR / projection error / texture over three budgets (64^3 -> 128^3), direct vs diffusion "
        "vs residual diffusion, K = 4 samples with and without projection guidance",
        6.0,
        _args(
            "xray_quality",
            device="cuda",
            budgets=[32, 128, 256],
            num_samples=4,
            parallel=1,
        ),
        None,
        ("xray2ct_cascade",),
    ),
    Item(
        "ddpm_quality",
        "f",
        "fast_ddpm_3d: equal training budgets, fast (10-step grid) vs the 1000-step DDPM, whole-volume metrics",
        12.0,
        _args("ddpm_quality", device="cuda", iterations=1500),
        None,
        ("fast_ddpm_3d",),
    ),
    Item(
        "inference_cases",
        "g",
        "autoencoder_3d inference over a folder: cases/s of one process on the GPU (bf16, 128^3 volumes)",
        2.0,
        _args("inference", device="cuda", processes=[1], cases=60, shape=[128, 128, 128], threads=4, repeats=1),
        None,  # the toy run is tests/test_cohort_inference.py's
        ("autoencoder_3d", "inference"),
    ),
    Item(
        "gpu_tests_compile",
        "a",
        "pytest -m gpu: the same train -> evaluate with --compile True",
        6.0,
        ("pytest", "-m", "gpu and compile"),
        None,
        ("gpu_tests", "compile"),
    ),
)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


#: where the results of earlier campaigns are kept (one JSON document each)
CAMPAIGNS_DIR = REPO_ROOT / "docs" / "campaigns"


def measured_items(folder: Path = CAMPAIGNS_DIR) -> set[str]:
    """The items that an earlier GPU campaign (not a tiny one) in ``folder`` measured."""
    names = set()
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        if not doc.get("tiny"):
            names |= {r["name"] for r in doc.get("items", []) if r.get("status") == "ok"}
    return names


def _selected(only: Sequence[str] | str | None, tiny: bool, measured: set[str] | None = None) -> list[Item]:
    """The items to run in order: those never measured first (in :data:`ITEMS` order), then those in
    ``measured``."""
    names = [only] if isinstance(only, str) else list(only or [])
    known = {i.name for i in ITEMS} | {t for i in ITEMS for t in i.tags} | {i.section for i in ITEMS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"campaign --only: unknown item or tag {unknown}; known: {sorted(known)}")
    items = [i for i in ITEMS if not names or i.name in names or i.section in names or set(i.tags) & set(names)]
    if tiny:
        return [i for i in items if i.tiny is not None]
    measured = measured or set()
    return [i for i in items if i.name not in measured] + [i for i in items if i.name in measured]


def _command(item: Item, tiny: bool, result_file: Path) -> list[str]:
    args = list(item.tiny if tiny else item.gpu)
    if args[0] == "pytest":
        junit = result_file.with_suffix(".xml")
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args[1:], "tests/test_gpu.py",
                f"--junitxml={junit}"]  # fmt: skip
    return [sys.executable, str(REPO_ROOT / "scripts" / "benchmark.py"), *args, "--output", str(result_file)]


def _junit_summary(path: Path) -> dict:
    """Counts and per-test outcomes of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests = []
    for case in suite.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "")[:500]
                break
        else:
            message = ""
        tests.append(
            {"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message}
        )
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {**counts, "tests": tests}


def _run_item(item: Item, tiny: bool, budget_s: float, workdir: Path) -> dict:
    """Run one item in its own process group for at most ``budget_s`` seconds."""
    result_file = workdir / f"{item.name}.json"
    cmd = _command(item, tiny, result_file)
    env = _item_env()
    log = workdir / f"{item.name}.log"
    print(f"[campaign] {item.name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=max(budget_s, 1.0))
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc, status = None, "timed_out"
    seconds = time.perf_counter() - start
    tail = log.read_text(errors="replace")[-4000:]
    row: dict[str, Any] = {
        "name": item.name,
        "section": item.section,
        "what": item.what,
        "tags": list(item.tags),
        "command": ["python", *cmd[1:]],
        "status": status,
        "returncode": rc,
        "seconds": round(seconds, 1),
        "estimated_minutes": item.minutes,
        "result": None,
        "log_tail": tail,
    }
    junit = result_file.with_suffix(".xml")
    if junit.exists():
        row["result"] = _junit_summary(junit)
        if status == "failed" and row["result"]["failed"] + row["result"]["error"] == 0:
            status = row["status"] = "ok" if rc == 5 else status  # 5: no test collected (no CUDA: all skipped)
    elif result_file.exists():
        row["result"] = json.loads(result_file.read_text())
    if status == "ok" and row["result"] is None:
        row["status"] = "failed"
        row["reason"] = "the command ended without writing its result"
    print(f"[campaign] {item.name}: {row['status']} in {seconds:.0f} s", flush=True)
    return row


def _device_summary() -> dict:
    import torch

    from scripts.harness.tools import device_name, peak_bf16_tflops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    summary = {"device": device_name(device), "peak_bf16_tflops": peak_bf16_tflops(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        summary.update(memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return summary


def _bundles_of(item: Item) -> list[str]:
    """The bundles whose code an item runs (by its tags; ``xray2ct`` names ``xray2ct_cascade``)."""
    from scripts.harness.bundles import BUNDLES

    return [b for b in BUNDLES if any(t == b or b.startswith(f"{t}_") for t in item.tags)]


# run in a fresh process (the items' environment): imports each bundle's modules and reads requirements.txt
_ENVIRONMENT_PROBE = """
import importlib, importlib.metadata, json, sys
from pathlib import Path
root = Path(sys.argv[1])
bundles = {}
for name, harness in json.loads(sys.argv[2]).items():
    config = json.loads((root / "bundles" / name / "configs" / "train.json").read_text())
    modules = [e.split()[-1] for e in config.get("imports", []) if e.startswith("$import ")] + [harness]
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:
            bundles[name] = f"import {module}: {type(e).__name__}: {e}"
            break
    else:
        bundles[name] = "ok"
requirements = {}
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
for line in (root / "requirements.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line or Requirement is None:
        continue
    req = Requirement(line)
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        requirements[req.name] = f"not installed (requirements.txt: {line})"
        continue
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        requirements[req.name] = f"{version} installed, requirements.txt asks {line}"
print(json.dumps({"bundles": bundles, "requirements": requirements}))
"""


def _environment(items: Sequence[Item], env: dict[str, str]) -> dict:
    """Import what the bundles of ``items`` need, in a fresh process, and list the packages that differ from
    ``requirements.txt`` (see the module docstring)."""
    from scripts.harness.bundles import FAMILY_MODULES

    needed = {b: FAMILY_MODULES[b] for item in items for b in _bundles_of(item)}
    if not needed:
        return {"bundles": {}, "requirements": {}}
    cmd = [sys.executable, "-c", _ENVIRONMENT_PROBE, str(REPO_ROOT), json.dumps(needed)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"campaign: the environment check failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, problem in found["requirements"].items():
        print(f"[campaign] requirement {name}: {problem}", flush=True)
    for name, outcome in found["bundles"].items():
        if outcome != "ok":
            print(f"[campaign] {name} cannot be imported, its items are skipped: {outcome}", flush=True)
    return found


def _item_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _write(path: Path | None, doc: dict) -> None:
    if path is None:
        return
    from common.utils import write_text_atomic

    write_text_atomic(path, json.dumps(doc, indent=2, default=str))


def _plan_rows(items: Sequence[Item], minutes: float, tiny: bool) -> list[dict]:
    """What a campaign of ``minutes`` would run, in order, with each item's estimate and whether it fits."""
    rows, used = [], 0.0
    for item in items:
        fits = used + item.minutes <= minutes or tiny
        used += item.minutes if fits else 0.0
        rows.append({"name": item.name, "section": item.section, "minutes": item.minutes, "fits": fits,
                     "cumulative": used, "what": item.what})  # fmt: skip
    return rows


def campaign(
    minutes: float = 25.0,
    output: str | None = "campaign.json",
    plan: bool = False,
    report: str | Sequence[str] | None = None,
    markdown: str | None = None,
    tiny: bool = False,
    only: Sequence[str] | str | None = None,
    workdir: str | None = None,
) -> dict | str:
    """Run the GPU measurement campaign (see the module docstring), print its plan, or render a report.

    Args:
        minutes: wall-clock budget; no item starts whose estimate does not fit in the time left, and a running item
            is stopped at the deadline or after twice its estimate (at least 2 minutes more), whichever comes first
            (its row says ``timed_out``).
        output: JSON file, rewritten atomically after every item.
        plan: print the items, their estimated minutes and which fit in ``minutes``; run nothing.
        report: campaign JSON file(s) (a list, or names joined by commas) to render as Markdown tables instead of
            measuring.
        markdown: with ``report``, the Markdown file whose campaign section (between the campaign markers,
            appended when absent) is replaced by the tables.
        tiny: the CPU toy version of each item (the machinery and the schema, not figures).
        only: item names, tags (``bf16``, ``fp32``, ``compile``, a bundle) or section letters to run.
        workdir: where the items' logs and raw results go (default: a temporary folder).
    """
    if report is not None:
        files = report.split(",") if isinstance(report, str) else list(report)
        text = render_report([json.loads(Path(f).read_text()) for f in files])
        if markdown is not None:
            _insert_report(Path(markdown), text)
            print(f"campaign tables written into {markdown}")
        else:
            print(text)
        return text
    items = _selected(only, bool(tiny), measured_items())
    if plan:
        rows = _plan_rows(items, float(minutes), bool(tiny))
        print(f"campaign plan for {float(minutes):g} minutes ({'tiny, CPU' if tiny else 'GPU'}):")
        for r in rows:
            mark = f"{r['cumulative']:6.1f}" if r["fits"] else "  skip"
            print(f"  {mark}  ({r['section']}) {r['name']:<36} ~{r['minutes']:.1f} min  {r['what']}")
        return {"plan": rows}
    deadline = time.monotonic() + float(minutes) * 60.0
    out = Path(output).resolve() if output else None
    doc: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "started": _now(),
        "finished": None,
        "minutes": float(minutes),
        "tiny": bool(tiny),
        **_device_summary(),
        "items": [],
    }
    if not tiny and doc["device"].startswith("CPU"):
        print("[campaign] no CUDA device: the GPU items will measure the CPU or fail; use --tiny True on CPUs")
    doc["environment"] = _environment(items, _item_env())
    _write(out, doc)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for item in items:
            broken = [f"{b}: {doc['environment']['bundles'][b]}" for b in _bundles_of(item)
                      if doc["environment"]["bundles"].get(b, "ok") != "ok"]  # fmt: skip
            if broken:
                doc["items"].append({"name": item.name, "section": item.section, "what": item.what,
                                     "tags": list(item.tags), "status": "skipped",
                                     "reason": f"cannot be imported: {'; '.join(broken)}"})  # fmt: skip
                _write(out, doc)
                continue
            left = deadline - time.monotonic() - MARGIN_S
            if left <= 0 or (not tiny and item.minutes * 60.0 > left):
                doc["items"].append({"name": item.name, "section": item.section, "what": item.what,
                                     "tags": list(item.tags), "status": "skipped",
                                     "reason": f"estimated {item.minutes:.1f} min, {max(left, 0) / 60:.1f} min left"})  # fmt: skip
                _write(out, doc)
                continue
            cap = left if tiny else min(left, max(2.0 * item.minutes, item.minutes + 2.0) * 60.0)
            doc["items"].append(_run_item(item, bool(tiny), cap, Path(tmp)))
            _write(out, doc)
    doc["finished"] = _now()
    _write(out, doc)
    done = sum(r["status"] == "ok" for r in doc["items"])
    print(f"[campaign] {done} of {len(doc['items'])} items measured" + (f"; results in {out}" if out else ""))
    return doc


# ----------------------------------------------------------------------------------------------------------------
# report


def _f(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return format(value * scale, spec)


def _finished(doc: dict, section: str) -> list[tuple[dict, Any]]:
    """``(item, result)`` of each item of ``section`` in a campaign's results that finished (status ``ok``)."""
    return [(r, r["result"]) for r in doc["items"] if r["section"] == section and r["status"] == "ok"]


def _throughput_rows(doc: dict) -> list[list[str]]:
    rows = []
    for r, res in _finished(doc, "b"):
        size = res.get("patch_size") or res.get("volume_size") or res.get("image_size")
        rows.append(
            [
                res["device"],
                r["name"].removeprefix("throughput_").rsplit("_", 1)[0],
                shape_label(size) if size else "-",
                str(res.get("batch", "-")),
                res.get("amp", "-"),
                "yes" if res.get("compile") else "no",
                _f(res.get("plain_samples_per_s"), ".2f"),
                _f(res.get("bundle_samples_per_s"), ".2f"),
                _f(res.get("speedup"), ".2f"),
                _f(res.get("bundle_data_wait"), ".1%"),
                _f(res.get("bundle_peak_mem_gib"), ".2f"),
                _f(res.get("step_flops"), ".2f", 1e-12),
                _f(res.get("bundle_tflops"), ".1f"),
                _f(res.get("mfu"), ".1%"),
            ]
        )
    return rows


def _profile_rows(doc: dict) -> list[list[str]]:
    """The top kernels of each profiled step, with the share of their kind and, for the matrix products and
    convolutions, their achieved TFLOP/s (the step's model FLOPs over those kernels' time)."""
    rows = []
    for r, res in _finished(doc, "b"):
        prof = res.get("profile")
        if not prof:
            continue
        bundle = r["name"].removeprefix("throughput_").rsplit("_", 1)[0]
        mm_ms = prof["kinds"].get("matmul/conv", 0.0) * prof["step_ms"]
        mm_tflops = res["step_flops"] / (mm_ms * 1e9) if res.get("step_flops") and mm_ms else None
        kinds = ", ".join(f"{kind} {share:.0%}" for kind, share in prof["kinds"].items() if share >= 0.01)
        rows.append([res["device"], bundle, "step", f"{prof['step_ms']:.1f} ms: {kinds}", "-", "-", "100%",
                     _f(mm_tflops, ".1f")])  # fmt: skip
        for rank, k in enumerate(prof["kernels"], 1):
            name = k["name"].replace("|", "/")
            rows.append([res["device"], bundle, str(rank), name[:90], k["kind"], str(k["calls"]),
                         _f(k["share"], ".1%"), "-"])  # fmt: skip
    return rows


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _reconstruction_rows(doc: dict) -> list[list[str]]:
    rows = []
    for _, res in _finished(doc, "c"):
        net = res["network"]
        for m in res["measurements"]:
            shares = m.get("stage_time_share", {})
            rows.append(
                [
                    m["device"],
                    shape_label(m["shape"]),
                    shape_label(m["patch_size"]),
                    f"{net['n_hiddens']}, {net['n_codes']}x{net['embedding_dim']}",
                    m["amp"],
                    str(m["sw_batch_size"]),
                    str(m["windows"]),
                    _f(m["seconds_per_volume"], ".2f"),
                    " / ".join(_f(shares.get(k), ".0%") for k in ("encoder", "quantizer", "decoder")),
                    _f(m["peak_mem_gib"], ".2f"),
                ]
            )
    return rows


def _inference_rows(doc: dict) -> list[list[str]]:
    return [
        [m["device"], str(m["processes"]), str(m["threads"]), str(m["cases"])]
        + [_f(m[key], ".2f") for key in ("seconds", "cases_per_s", "speedup")]
        for _, result in _finished(doc, "g")
        for m in result
    ]


def _step_rows(doc: dict) -> list[list[str]]:
    rows = []
    for _, res in _finished(doc, "d"):
        rate = res["bundle_samples_per_s"]
        rows.append(
            [
                res["device"],
                str(res["stage"]),
                shape_label(res["volume_size"]),
                str(res["batch"]),
                res["amp"],
                "yes" if res.get("gradient_checkpointing") else "no",
                _f(res["batch"] / rate if rate else None, ".2f"),
                _f(res["bundle_peak_mem_gib"], ".2f"),
                _f(res.get("step_flops"), ".2f", 1e-12),
                _f(res.get("mfu"), ".1%"),
            ]
        )
    return rows


def _fit_rows(doc: dict) -> list[list[str]]:
    rows = []
    for r in doc["items"]:
        if r["section"] != "e" or r["status"] not in ("ok", "failed") or r.get("result") is None:
            continue
        res = r["result"]
        for m in res["rows"] if isinstance(res, dict) else res:
            failed = m.get("error", "").strip().splitlines()[-1][:80] if m.get("error") else None
            rows.append(
                [
                    m.get("device", doc["device"]),
                    r["name"].split("_")[0],
                    shape_label(m["patch_size"]),
                    str(m.get("micro_batch_size", m.get("batch", "-"))),
                    str(m.get("amp", "-")),
                    "does not fit: " + failed if failed else _f(m.get("peak_mem_gib"), ".2f"),
                    _f(m.get("seconds_per_step"), ".2f"),
                ]
            )
    return rows


def _quality_rows(doc: dict) -> list[list[str]]:
    """fast_ddpm equal-budget rows; a run cut short after its first mode still gives that mode's row."""
    rows = []
    for r in doc["items"]:
        if r["section"] != "f" or not isinstance(r.get("result"), dict):
            continue
        res = r["result"]
        for mode, m in res.get("modes", {}).items():
            rows.append(
                [
                    doc["device"],
                    res["task"],
                    mode,
                    str(res["iterations"]),
                    _f(m["train_seconds"], ".1f", 1 / 60),
                    _f(m["eval_seconds"], ".0f"),
                    _f(m.get("val_psnr"), ".2f"),
                    _f(m.get("val_ssim"), ".4f"),
                    _f(m.get("val_ms_ssim"), ".4f"),
                ]
            )
    return rows


def render_report(docs: dict | Sequence[dict]) -> str:
    """Markdown tables of one or more campaign JSON documents, the device named in every row."""
    docs = [docs] if isinstance(docs, dict) else list(docs)
    for doc in docs:
        if doc.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"campaign report: schema {doc.get('schema')!r} is not {SCHEMA_VERSION}")
    parts = []
    for doc in docs:
        parts.append(
            f"- {doc['started']}: {doc['device']} (torch {doc.get('torch', '?')}, dense bf16 peak "
            f"{_f(doc.get('peak_bf16_tflops'), '.1f')} TFLOP/s), budget {doc['minutes']:g} min"
            + (", tiny CPU mode (a check of the machinery, not figures)" if doc.get("tiny") else "")
        )
    items = [(doc, r) for doc in docs for r in doc["items"]]
    parts += [
        "",
        _table(
            ["device", "item", "status", "seconds", "what"],
            [
                [
                    doc["device"],
                    r["name"],
                    r["status"] + (f" ({r['reason']})" if r.get("reason") else ""),
                    _f(r.get("seconds"), ".0f"),
                    r["what"],
                ]
                for doc, r in items
                if r["status"] != "skipped"
            ],  # fmt: skip
        ),
    ]
    ran = {r["name"] for _, r in items if r["status"] != "skipped"}
    skipped = {r["name"]: r.get("reason", "") for _, r in items if r["status"] == "skipped" and r["name"] not in ran}
    unimportable = {name: reason for name, reason in skipped.items() if reason.startswith("cannot be imported")}
    late = [name for name in skipped if name not in unimportable]
    if late:
        parts += ["", f"Not run yet (no time left in these campaigns): {', '.join(late)}."]
    if unimportable:
        parts += ["", "Not run (a package was missing on the machine):", ""]
        parts += [f"- {name}: {reason}" for name, reason in unimportable.items()]
    for doc, r in items:
        if r["section"] == "a" and isinstance(r.get("result"), dict):
            res = r["result"]
            parts += ["", f"GPU tests ({r['name']}): {res['passed']} passed, {res['failed']} failed, {res['error']} "
                      f"errors, {res['skipped']} skipped.", ""]  # fmt: skip
            parts.append(
                _table(
                    ["device", "test", "outcome", "seconds", "message"],
                    [
                        [
                            doc["device"],
                            t["test"],
                            t["outcome"],
                            f"{t['seconds']:.1f}",
                            t["message"].replace("|", "/").replace("\n", " ")[:160],
                        ]
                        for t in res["tests"]
                    ],  # fmt: skip
                )
            )
    sections = (
        (_throughput_rows, "Training throughput, bundle vs plain loop (plain: fp32, no compile; MFU: model FLOPs per "
         "step x steps/s / dense bf16 peak)",
         ["device", "bundle", "size", "batch", "amp", "compile", "plain (samples/s)", "bundle (samples/s)",
          "bundle / plain", "data wait", "peak mem (GiB)", "TFLOP / step", "TFLOP/s", "MFU"]),
        (_reconstruction_rows, "VQ-GAN whole-volume reconstruction (Gaussian-blended sliding windows, overlap 0.25)",
         ["device", "volume", "window", "VQGAN (hiddens, codes x dim)", "amp", "sw batch", "windows",
          "s / volume", "time in encoder / quantizer / decoder", "peak mem (GiB)"]),
        (_step_rows, "xray2ct training step, bundle alone",
         ["device", "stage", "volume", "batch", "amp", "gradient checkpointing", "s / step", "peak mem (GiB)",
          "TFLOP / step", "MFU"]),
        (_fit_rows, "Largest size that fits (peak memory of training steps)",
         ["device", "bundle", "patch", "batch / micro-batch", "amp", "peak mem (GiB)", "s / step"]),
        (_profile_rows, "Kernel profile of one training step (torch.profiler; on a CPU the operators; TFLOP/s: the "
         "step's model FLOPs over the time of its matrix-product and convolution kernels)",
         ["device", "bundle", "rank", "kernel", "kind", "calls", "share of step", "TFLOP/s"]),
        (_inference_rows, "Inference over a folder of volumes (autoencoder_3d reconstruction; cases/s from the first "
         "case read to the last written)",
         ["device", "processes", "threads each", "cases", "seconds", "cases/s", "x one process"]),
        (_quality_rows, "fast_ddpm_3d after equal training budgets (final EMA weights, whole validation volumes)",
         ["device", "task", "mode", "iterations", "training (min)", "evaluation (s)", "PSNR (dB)", "SSIM",
          "MS-SSIM"]),
    )  # fmt: skip
    for rows_of, title, header in sections:
        rows = [row for doc in docs for row in rows_of(doc)]
        if rows:
            parts += ["", f"{title}:", "", _table(header, rows)]
    return "\n".join(parts) + "\n"


def _insert_report(path: Path, text: str) -> None:
    from common.utils import write_text_atomic

    doc = path.read_text() if path.exists() else ""
    block = f"{REPORT_START}\n\n{text}\n{REPORT_END}"
    if REPORT_START in doc and REPORT_END in doc:
        head, rest = doc.split(REPORT_START, 1)
        tail = rest.split(REPORT_END, 1)[1]
        doc = head + block + tail
    else:
        doc = doc.rstrip("\n") + "\n\n## GPU campaign\n\n" + block + "\n"
    write_text_atomic(path, doc)

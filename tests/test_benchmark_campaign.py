# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The GPU campaign's machinery on the CPU: FLOP counting against a hand count, the peak table, the plan, the
deadline (an item cut short keeps what came before), the tiny CPU mode's output schema, and the report that
``docs/benchmarks.md`` carries, rendered from the stored campaign files."""

from __future__ import annotations

import functools
import inspect
import json
import os
import subprocess
import sys
import time

import fire
import pytest
import torch

from scripts.harness import campaign as bc
from scripts.harness.commands import benchmark_command, benchmarks
from scripts.harness.tools import KERNEL_KINDS, count_flops, kernel_kind, peak_bf16_tflops
from tests.helpers import REPO_ROOT

CAMPAIGNS = sorted((REPO_ROOT / "docs" / "campaigns").glob("*.json"))


def test_flop_count_matches_a_hand_count():
    """Conv3d (2 -> 4 channels, 3^3 kernel, 8^3 output, batch 2) then Linear (2048 -> 5), forward and backward.
    The first convolution's input needs no gradient, so its backward computes the weight gradient only."""
    torch.manual_seed(0)
    conv, linear = torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.Linear(4 * 8**3, 5)
    x = torch.randn(2, 2, 8, 8, 8)

    def step():
        linear(conv(x).flatten(1)).sum().backward()

    conv_fwd = 2 * 2 * 4 * 27 * 8**3 * 2  # 2 flops per multiply-add x C_in x C_out x k^3 x output voxels x batch
    linear_fwd = 2 * 2 * (4 * 8**3) * 5
    expected = conv_fwd * 2 + linear_fwd * 3  # conv: forward + weight grad; linear: forward + input + weight grad
    assert count_flops(step) == expected


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.1),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", None),
        ("Tesla T4", None),
    ],
)
def test_peak_table_matches_device_names(name, peak):
    assert peak_bf16_tflops(name) == peak


def test_peak_of_a_cpu_is_unknown():
    assert peak_bf16_tflops(torch.device("cpu")) is None


def test_plan_orders_by_value_and_marks_what_fits(capsys):
    """The items in value order, those that a stored campaign measured after all the others."""
    result = bc.campaign(plan=True, minutes=10)
    rows = result["plan"]
    measured = bc.measured_items()
    stored = {r["name"] for p in CAMPAIGNS for r in json.loads(p.read_text())["items"] if r["status"] == "ok"}
    assert measured == stored
    names = [i.name for i in bc.ITEMS]
    assert [r["name"] for r in rows] == [n for n in names if n not in measured] + [n for n in names if n in measured]
    assert [r["name"] for r in rows[:3]] == ["gpu_tests_sync", "gpu_tests", "throughput_autoencoder_3d_compile"]
    assert [r["name"] for r in rows][len(names) - len(measured) :] == [n for n in names if n in measured]
    fitting = [r for r in rows if r["fits"]]
    assert sum(r["minutes"] for r in fitting) <= 10 < sum(r["minutes"] for r in rows)
    assert fitting[-1]["cumulative"] == pytest.approx(sum(r["minutes"] for r in fitting))
    assert "skip" in capsys.readouterr().out


def test_unknown_selection_is_refused():
    with pytest.raises(SystemExit, match="unknown item or tag.*'nope'"):
        bc.campaign(plan=True, only=["nope"])


def _fake_items(monkeypatch, commands: dict[str, str], minutes: dict[str, float] | None = None):
    """Replace the campaign's items by ones that run ``commands`` (Python source; ``OUT`` is the result file)."""
    items = tuple(
        bc.Item(name, "b", f"fake {name}", (minutes or {}).get(name, 0.01), ("x",), ("x",)) for name in commands
    )
    monkeypatch.setattr(bc, "ITEMS", items)
    monkeypatch.setattr(
        bc,
        "_command",
        lambda item, tiny, out: [sys.executable, "-c", f"OUT = {str(out)!r}\n" + commands[item.name]],
    )


def test_deadline_stops_an_item_and_keeps_the_finished_ones(monkeypatch, tmp_path):
    write = "import json; json.dump({'value': 1.5}, open(OUT, 'w'))"
    _fake_items(monkeypatch, {"first": write, "slow": "import time; time.sleep(60)", "third": write})
    monkeypatch.setattr(bc, "MARGIN_S", 0.0)
    out = tmp_path / "c.json"
    start = time.monotonic()
    doc = bc.campaign(minutes=0.1, output=str(out), tiny=True, workdir=str(tmp_path))
    assert time.monotonic() - start < 30
    stored = json.loads(out.read_text())
    assert stored == json.loads(json.dumps(doc, default=str))
    status = {r["name"]: r["status"] for r in stored["items"]}
    assert status == {"first": "ok", "slow": "timed_out", "third": "skipped"}
    assert stored["items"][0]["result"] == {"value": 1.5}
    assert stored["finished"] is not None


def test_items_whose_estimate_does_not_fit_are_skipped_without_running(monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    _fake_items(
        monkeypatch,
        {"long": f"open({str(marker)!r}, 'w')", "short": "import json; json.dump({}, open(OUT, 'w'))"},
        {"long": 5.0, "short": 0.01},
    )
    doc = bc.campaign(minutes=1.0, output=str(tmp_path / "c.json"), workdir=str(tmp_path))
    long, short = doc["items"]
    assert long["status"] == "skipped" and "estimated 5.0 min" in long["reason"] and not marker.exists()
    assert short["status"] == "ok"


def test_a_failing_item_is_reported_with_its_output(monkeypatch, tmp_path):
    _fake_items(monkeypatch, {"broken": "raise ValueError('no such patch size')"})
    doc = bc.campaign(minutes=1.0, output=None, tiny=True, workdir=str(tmp_path))
    (row,) = doc["items"]
    assert row["status"] == "failed" and row["returncode"] == 1
    assert "ValueError: no such patch size" in row["log_tail"]


def test_a_bundle_that_cannot_be_imported_has_its_items_skipped_before_any_runs(monkeypatch, tmp_path):
    """A package missing on the machine (as ``pydantic`` for ``torchsurv`` was on a GPU host) skips that bundle's
    items with the import error as the reason, without starting them; the other items run; the report says why."""
    from scripts.harness import bundles

    marker = tmp_path / "ran"
    items = (
        bc.Item("mace", "x", "fake mace item", 0.01, ("x",), ("x",), ("fp32", "mace_survival")),
        bc.Item("other", "x", "fake item", 0.01, ("x",), ("x",), ("fp32",)),
    )
    monkeypatch.setattr(bc, "ITEMS", items)
    commands = {"mace": f"open({str(marker)!r}, 'w')", "other": "import json; json.dump({}, open(OUT, 'w'))"}
    monkeypatch.setattr(
        bc, "_command", lambda item, tiny, out: [sys.executable, "-c", f"OUT = {str(out)!r}\n" + commands[item.name]]
    )
    monkeypatch.setitem(bundles.FAMILY_MODULES, "mace_survival", "no_such_package.survival")
    out = tmp_path / "c.json"
    doc = bc.campaign(minutes=1.0, output=str(out), tiny=True, workdir=str(tmp_path))
    assert doc["environment"]["bundles"] == {
        "mace_survival": "import no_such_package.survival: ModuleNotFoundError: No module named 'no_such_package'"
    }
    mace, other = doc["items"]
    assert mace["status"] == "skipped" and not marker.exists()
    assert mace["reason"] == f"cannot be imported: mace_survival: {doc['environment']['bundles']['mace_survival']}"
    assert other["status"] == "ok"
    text = bc.render_report(json.loads(out.read_text()))
    assert "Not run (a package was missing on the machine)" in text and "No module named 'no_such_package'" in text
    assert "no time left" not in text


def test_bundles_of_an_item_follow_its_tags():
    by_name = {i.name: bc._bundles_of(i) for i in bc.ITEMS}
    assert by_name["throughput_xray2ct_stage2_fp32"] == ["xray2ct_cascade"]
    assert by_name["xray2ct_stage3_step"] == ["xray2ct_cascade"]
    assert by_name["throughput_mace_survival_compile"] == ["mace_survival"]
    assert by_name["gpu_tests"] == by_name["gpu_tests_sync"] == by_name["gpu_tests_resume"] == []
    assert all(by_name[i.name] for i in bc.ITEMS if i.section != "a"), "an item without its bundle"


def test_tiny_campaign_measures_and_reports(tmp_path):
    """The real items of one bundle at toy sizes on the CPU: every row has the schema the report reads."""
    out = tmp_path / "campaign.json"
    doc = bc.campaign(minutes=10, output=str(out), tiny=True, only=["autoencoder_3d"], workdir=str(tmp_path))
    names = [r["name"] for r in doc["items"]]
    assert names == [i.name for i in bc.ITEMS if "autoencoder_3d" in i.tags and i.tiny is not None]
    assert all(r["status"] == "ok" for r in doc["items"]), [(r["name"], r["log_tail"][-800:]) for r in doc["items"]]
    assert doc["schema"] == bc.SCHEMA_VERSION and doc["tiny"] is True and doc["device"].startswith("CPU")
    assert doc["environment"]["bundles"] == {"autoencoder_3d": "ok"}
    for r in doc["items"]:
        if r["section"] == "b":
            res = r["result"]
            assert res["step_flops"] > 0 and res["mfu"] is None and res["peak_bf16_tflops"] is None
            assert res["bundle_samples_per_s"] > 0 and res["speedup"] == pytest.approx(
                res["bundle_samples_per_s"] / res["plain_samples_per_s"]
            )
    profile = next(r["result"]["profile"] for r in doc["items"] if r["name"].endswith("_bf16"))
    assert 1 <= len(profile["kernels"]) <= 15 and profile["step_ms"] > 0
    assert sum(profile["kinds"].values()) == pytest.approx(1.0)
    assert {k["kind"] for k in profile["kernels"]} <= {kind for kind, _ in KERNEL_KINDS} | {"other"}
    assert [k["ms"] for k in profile["kernels"]] == sorted((k["ms"] for k in profile["kernels"]), reverse=True)
    text = bc.render_report(json.loads(out.read_text()))
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| device")]
    assert rows and all(line.startswith(f"| {doc['device']}") for line in rows)
    assert "Training throughput" in text and "Largest size that fits" in text and "Kernel profile" in text


@pytest.mark.skipif(not CAMPAIGNS, reason="no stored campaign")
def test_benchmarks_doc_carries_the_rendered_campaigns(tmp_path):
    """The campaign block of docs/benchmarks.md is exactly the report of the stored campaign files, so its
    figures are rendered, never typed; rendering it again into a copy changes nothing."""
    docs = [json.loads(p.read_text()) for p in CAMPAIGNS]
    text = bc.render_report(docs)
    page = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split(bc.REPORT_START, 1)[1].split(bc.REPORT_END, 1)[0]
    assert block.strip() == text.strip()
    copy = tmp_path / "benchmarks.md"
    copy.write_text(page)
    bc.campaign(report=[str(p) for p in CAMPAIGNS], markdown=str(copy))
    assert copy.read_text() == page


def test_report_refuses_another_schema():
    with pytest.raises(ValueError, match="schema"):
        bc.render_report({"schema": 99, "items": []})


def test_report_keeps_what_a_cut_short_item_measured_and_names_failed_sizes():
    """A quality item stopped after its first mode still gives that mode's row; a size that did not fit is named."""
    doc = {
        "schema": bc.SCHEMA_VERSION,
        "started": "2026-01-01T00:00:00+00:00",
        "minutes": 5.0,
        "device": "NVIDIA H100 80GB HBM3",
        "items": [
            {
                "name": "ddpm_quality",
                "section": "f",
                "what": "quality",
                "status": "timed_out",
                "seconds": 300.0,
                "result": {
                    "task": "synthesis",
                    "iterations": 1500,
                    "modes": {
                        "fast": {
                            "train_seconds": 120.0,
                            "eval_seconds": 9.0,
                            "val_psnr": 21.5,
                            "val_ssim": 0.61,
                            "val_ms_ssim": 0.83,
                        }
                    },  # fmt: skip
                },
            },
            {
                "name": "autoencoder_largest_patch",
                "section": "e",
                "what": "fit",
                "status": "ok",
                "seconds": 60.0,
                "result": [
                    {"patch_size": [128] * 3, "batch": 1, "amp": "bf16", "peak_mem_gib": 20.25},
                    {"patch_size": [256] * 3, "batch": 1, "amp": "bf16", "error": "...\ntorch.OutOfMemoryError: CUDA"},
                ],
            },
        ],
    }
    text = bc.render_report(doc)
    assert "| NVIDIA H100 80GB HBM3 | synthesis | fast | 1500 | 2.0 | 9 | 21.50 | 0.6100 | 0.8300 |" in text
    assert "| 128x128x128 | 1 | bf16 | 20.25 |" in text
    assert "does not fit: torch.OutOfMemoryError: CUDA" in text


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "matmul/conv"),
        ("void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16>(...)", "layout/copy"),
        ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float>(...)", "normalisation"),
        ("triton_red_fused_native_group_norm_0", "normalisation"),
        ("triton_poi_fused_add_mul_silu_3", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda(...)>", "layout/copy"),
        (
            "void at::native::multi_tensor_apply_kernel<at::native::(anonymous namespace)::FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", "attention"),
        ("Memcpy HtoD (Pageable -> Device)", "layout/copy"),
        ("aten::convolution_backward", "matmul/conv"),
        ("aten::empty", "other"),
    ],
)
def test_kernel_kinds_of_gpu_and_cpu_names(name, kind):
    assert kernel_kind(name) == kind


@pytest.mark.parametrize("name", sorted(benchmarks()))
def test_every_benchmark_command_prints_its_help_without_running(name, capsys):
    """``benchmark.py <command> --help`` prints the command's arguments; a command taking ``**overrides`` must not
    take ``--help`` as one of them and start a run."""
    command, ran = benchmarks()[name], []

    @functools.wraps(command)
    def recorded(*args, **kwargs):
        ran.append(kwargs)

    with pytest.raises(fire.core.FireExit) as stopped:
        fire.Fire({name: recorded}, command=benchmark_command([name, "--help"]))
    assert stopped.value.code == 0 and not ran
    out = capsys.readouterr().err  # fire prints help on stderr
    assert "SYNOPSIS" in out and name in out
    assert inspect.getdoc(command).split()[0] in out  # the command's own description


def test_benchmark_help_from_the_command_line_starts_no_run():
    """The whole entry point, as typed: ``xray_quality --help`` (it takes extra ``--key value`` bundle settings)."""
    result = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "xray_quality", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PAGER": "cat"},
    )
    assert result.returncode == 0, result.stderr
    assert "budgets" in result.stderr and "SYNOPSIS" in result.stderr
    assert "Epoch" not in result.stdout + result.stderr


def test_benchmark_command_leaves_other_arguments_alone():
    assert benchmark_command(["xray_quality", "--budgets", "[300]"]) == ["xray_quality", "--budgets", "[300]"]
    assert benchmark_command(["--help"]) == ["--help"]
    assert benchmark_command(["memory", "-h"]) == ["memory", "--", "--help"]

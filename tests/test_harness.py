# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The benchmark and fault-injection harness: one table maps each bundle to its module, each module holds that
bundle's benchmarks and fault-test job, and the command lines are thin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.bundle import bundle_names
from common.bundle_tools.registry import describe
from scripts.harness.bundles import BUNDLES, FAMILY_MODULES, family, modules
from scripts.harness.commands import benchmarks
from scripts.harness.faults import BundleCase

REPO = Path(__file__).resolve().parents[1]


def test_every_bundle_has_its_family_module() -> None:
    """The modules come from the bundles' descriptions: every bundle folder has one, ``scripts.harness.<family>``."""
    assert list(BUNDLES) == bundle_names()
    assert all(FAMILY_MODULES[b] == f"scripts.harness.{describe(b).family}" for b in BUNDLES)


@pytest.mark.parametrize("bundle", BUNDLES)
def test_family_module_holds_its_bundle(bundle: str) -> None:
    """The module's ``BUNDLE`` (what its benchmarks and fault-test job run) is a bundle of the same family."""
    module = family(bundle)
    assert module.__name__ == FAMILY_MODULES[bundle] and describe(module.BUNDLE).family == describe(bundle).family
    assert callable(module.fault_case) and module.BENCHMARKS
    assert all(callable(f) and f.__module__ == module.__name__ for f in module.BENCHMARKS.values())
    assert {"BENCHMARKS", "THROUGHPUT", "fault_case"} <= set(module.__all__)
    for name, command, gpu, tiny in module.THROUGHPUT:  # the campaign's rows: commands of this module
        assert name.startswith(module.BUNDLE.split("_")[0]) and command in module.BENCHMARKS
        assert isinstance(gpu, dict) and isinstance(tiny, dict)


def test_benchmarks_are_the_union_of_the_modules() -> None:
    found = benchmarks()
    expected = {"campaign", "cpu_inference", "demo_spread"} | {name for b in BUNDLES for name in family(b).BENCHMARKS}
    assert set(found) == expected and len(found) == 3 + sum(len(m.BENCHMARKS) for m in modules())
    assert [m.__name__ for m in modules()] == list(dict.fromkeys(FAMILY_MODULES.values()))
    assert {"throughput", "vqgan_reconstruction", "ddpm_sampling", "mace_throughput", "xray_quality"} <= set(found)


def test_unknown_bundle_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown bundle 'no_such_bundle': .*; available: autoencoder_3d, "):
        family("no_such_bundle")


def test_make_case_goes_through_the_table(tmp_path: Path) -> None:
    """``make_case`` builds a bundle's job with its module's ``fault_case`` (every bundle's job and data are run by
    test_reliability)."""
    from scripts.harness.faults import make_case

    case = make_case("autoencoder_3d", tmp_path / "ae", seed=3)
    assert isinstance(case, BundleCase) and case.bundle == "autoencoder_3d" and case.args["seed"] == 3
    assert case.args["deterministic"] is True and case.args["ckpt_interval"] == 2
    assert (tmp_path / "ae" / "datalist.json").is_file()
    with pytest.raises(ValueError, match="unknown bundle"):
        make_case("no_such_bundle", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_no_code_edits_the_import_path() -> None:
    """One mechanism makes ``common`` and ``scripts`` importable: the editable install of ``scripts/setup_env.sh``
    (pytest reads ``pythonpath`` from pyproject.toml for ``tests.helpers``). No module edits ``sys.path`` and no
    shell script exports ``PYTHONPATH``; neither does a bundle notebook."""
    edit = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\s*\+?=")
    offenders = [
        str(p.relative_to(REPO))
        for folder in ("common", "scripts", "tests")
        for p in (REPO / folder).rglob("*.py")
        if edit.search(p.read_text(encoding="utf-8"))
    ]
    offenders += [
        str(p.relative_to(REPO))
        for p in sorted(REPO.glob("bundles/*/docs/*.ipynb"))
        if any(edit.search("".join(cell["source"])) for cell in json.loads(p.read_text(encoding="utf-8"))["cells"])
    ]
    offenders += [
        str(p.relative_to(REPO))
        for p in (REPO / "scripts").glob("*.sh")
        if "PYTHONPATH" in p.read_text(encoding="utf-8")
    ]
    assert not offenders
    assert "--editable ." in (REPO / "scripts" / "setup_env.sh").read_text(encoding="utf-8")


@pytest.mark.parametrize("script", ["benchmark.py", "reliability.py"])
def test_command_lines_are_thin_and_run_from_anywhere(script: str, tmp_path: Path) -> None:
    path = REPO / "scripts" / script
    code = [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    body = code[code.index('"""', 3) + 1 :] if '"""' in code[3:] else code
    assert len(body) < 20, f"{script} should only dispatch to scripts/harness"
    args = ["campaign", "--plan", "--minutes", "1"] if script == "benchmark.py" else ["fuzz", "--help"]
    result = subprocess.run([sys.executable, str(path), *args], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    # fire writes help to stderr when it is not a terminal
    assert "gpu_tests" in result.stdout if script == "benchmark.py" else "reliability.py fuzz" in result.stderr


def test_demo_spread_summarises_the_runs_and_builds_the_quickstart_command(tmp_path: Path) -> None:
    """``demo_spread``'s summary is the mean, sample standard deviation, min and max over the seeds' runs (checked
    against the closed form), and each run is ``scripts/demo.py`` with its seed and its own output folder."""
    from scripts.harness.demos import demo_command, spread

    runs = {0: {"val_psnr": 21.0, "val_ssim": 0.6}, 1: {"val_psnr": 22.0, "val_ssim": 0.5}, 2: {"val_psnr": 24.0}}
    summary = spread(runs, ["val_psnr", "val_ssim", "absent"])
    assert set(summary) == {"val_psnr", "val_ssim"}
    assert summary["val_psnr"]["mean"] == pytest.approx(67 / 3)
    assert summary["val_psnr"]["std"] == pytest.approx(
        (((21 - 67 / 3) ** 2 + (22 - 67 / 3) ** 2 + (24 - 67 / 3) ** 2) / 2) ** 0.5
    )
    assert (summary["val_psnr"]["min"], summary["val_psnr"]["max"], summary["val_psnr"]["n"]) == (21.0, 24.0, 3)
    assert summary["val_ssim"]["n"] == 2 and spread({5: {"val_psnr": 1.0}}, ["val_psnr"])["val_psnr"]["std"] == 0.0
    cmd = demo_command("vqgan_3d", 3, tmp_path / "seed3", preset=None, num_threads=1)
    assert cmd[1].endswith("scripts/demo.py")
    words = cmd[2:]
    assert dict(zip(words[::2], words[1::2])) == {
        "--bundle": "vqgan_3d",
        "--seed": "3",
        "--output_dir": str(tmp_path / "seed3"),
        "--preset": "None",
        "--num_threads": "1",
    }

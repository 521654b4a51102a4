# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Run the MONAI model zoo's own CI checks (``ci/verify_bundle.py`` of Project-MONAI/model-zoo, full mode, as its
GPU premerge runs them) on packaged bundles, one check at a time, and print a Markdown table (bundle x check).

The zoo's checks stop at the first failure; here every check runs in its own process, so the table shows each one.
A check the zoo's own lists exclude for a bundle (``ci/bundle_custom_data.py``) is reported as ``excluded``, and so
is one the bundle declares excluded, with its reason, in ``metadata.json`` ``model_zoo_ci_exclusions``
(``verify_data_shape``, ``verify_torchscript``: what a submission adds to those lists); the check still runs and
its result is shown beside it. The extra column ``ckpt_export (trace)`` is MONAI's ``ckpt_export network
--use_trace True`` of the shipped weights: the inference entry point every model card documents (for most bundles
``network_def`` in a view; for the diffusion bundle the whole sampler, whose ``network_def`` needs the time steps).
Nothing is downloaded: the schema is the local copy and the packages' weights are inside them (``--weights_inside
True``).
Example::

    python scripts/zoo_ci.py dist/*.zip --zoo /path/to/model-zoo --output zoo_ci.json
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common.bundle import ROOT

__all__ = ["CHECKS", "main", "run_checks"]

SCHEMA = ROOT / "tests" / "data" / "meta_schema_20240725.json"
CHECKS = ("directory", "version", "metadata", "properties", "data_shape", "torchscript", "ckpt_export (trace)")
_EXCLUSION_LISTS = {"data_shape": "exclude_verify_shape_list", "torchscript": "exclude_verify_torchscript_list"}
_DECLARED = {"data_shape": "verify_data_shape", "torchscript": "verify_torchscript"}
_DRIVER = """
import os, sys
import verify_bundle as vb  # ci/ and the bundle folder are on PYTHONPATH, as the zoo's CI runs it
bundle, models, check = sys.argv[1:4]
path = os.path.join(models, bundle)
net_id = vb._get_net_id(bundle)
config_file = os.path.join("configs", vb._find_bundle_file(os.path.join(path, "configs"), "inference"))
if check == "directory":
    vb.verify_bundle_directory(models, bundle, "full")
elif check == "version":
    vb.verify_version_changes(models, bundle)
elif check == "metadata":
    vb.verify_metadata_format(path)
elif check == "properties":
    vb.verify_bundle_properties(models, bundle)
elif check == "data_shape":
    vb.verify_data_shape(path, net_id, config_file)
elif check == "torchscript":
    vb.verify_torchscript(path, net_id, config_file, *vb._get_weights_names(bundle))
print("PASSED", check)
"""


def _env() -> dict[str, str]:
    """Only the installed packages importable (each bundle brings its own ``common/``), one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1][:200]


def _trace_export(bundle_dir: Path) -> tuple[bool, str]:
    from common.bundle_tools.export import default_input_shape

    shape = default_input_shape(bundle_dir)  # the bundle folder's own configs (bundle_root is bundle_dir)
    cmd = [sys.executable, "-m", "monai.bundle", "ckpt_export", "network"]
    cmd += ["--filepath", str(bundle_dir / "models" / "trace_check.ts")]
    cmd += ["--ckpt_file", str(bundle_dir / "models" / "model.pt"), "--bundle_root", str(bundle_dir)]
    cmd += ["--meta_file", str(bundle_dir / "configs" / "metadata.json")]
    cmd += ["--config_file", str(bundle_dir / "configs" / "inference.json")]
    cmd += ["--use_trace", "True", "--input_shape", json.dumps(shape)]
    result = subprocess.run(cmd, cwd=bundle_dir, capture_output=True, text=True, env=_env(), timeout=1200)
    return result.returncode == 0, _last_error(result.stdout + result.stderr)


def run_checks(
    zoo: str | os.PathLike, packages: list[str], work_dir: str | os.PathLike, trace: bool = True
) -> dict[str, dict]:
    """``{bundle: {check: (status, detail)}}`` with status ``passed``, ``failed``, ``excluded`` (the zoo's lists)
    or ``excluded (declared; it passed/failed)`` (the bundle's metadata), and the error or the reason as detail.

    Args:
        zoo: a checkout of Project-MONAI/model-zoo (its ``ci/`` folder is used).
        packages: bundle zips made by ``scripts/package_bundle.py``.
        work_dir: receives ``models/<bundle>/`` (the zoo's layout) and a copy of ``ci/``.
        trace: also run the ``ckpt_export (trace)`` column.
    """
    work = Path(work_dir)
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    shutil.copytree(Path(zoo) / "ci", work / "ci", dirs_exist_ok=True)
    (models / "model_info.json").write_text("{}\n")
    zoo_lists = runpy.run_path(str(work / "ci" / "bundle_custom_data.py"))  # the zoo's exclusion lists
    results: dict[str, dict] = {}
    for package in packages:
        with zipfile.ZipFile(package) as zf:
            bundle = zf.namelist()[0].split("/")[0]
            shutil.rmtree(models / bundle, ignore_errors=True)
            zf.extractall(models)
        (models / bundle / "eval").mkdir(exist_ok=True)
        shutil.copy(SCHEMA, models / bundle / "eval" / "schema.json")  # what ci/prepare_schema.py downloads
        meta = json.loads((models / bundle / "configs" / "metadata.json").read_text())
        declared = meta.get("model_zoo_ci_exclusions") or {}
        row = {}
        for check in CHECKS if trace else CHECKS[:-1]:
            if bundle in zoo_lists.get(_EXCLUSION_LISTS.get(check, ""), ()):
                row[check] = ("excluded", "in the zoo's exclusion list")
                continue
            if check == "ckpt_export (trace)":
                ok, detail = _trace_export(models / bundle)
            else:
                cmd = [sys.executable, "-c", _DRIVER, bundle, str(models), check]
                env = {**_env(), "PYTHONPATH": os.pathsep.join([str(work / "ci"), str(models / bundle)])}
                result = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env, timeout=1200)
                ok, detail = result.returncode == 0, _last_error(result.stdout + result.stderr)
            status, detail = ("passed", "") if ok else ("failed", detail)
            if _DECLARED.get(check) in declared:
                status, detail = f"excluded (declared; it {status})", declared[_DECLARED[check]]
            row[check] = (status, detail)
            print(f"{bundle}: {check}: {row[check][0]} {row[check][1]}", file=sys.stderr, flush=True)
        results[bundle] = row
    return results


def main(*packages: str, zoo: str, work_dir: str | None = None, output: str | None = None) -> None:
    """Print the table of :func:`run_checks` (and write it as JSON to ``output``).

    Args:
        packages: bundle zips made by ``scripts/package_bundle.py``.
        zoo: a checkout of Project-MONAI/model-zoo.
        work_dir: where the zoo layout is made (default: a temporary folder).
        output: a JSON file receiving the results.
    """
    with tempfile.TemporaryDirectory(prefix="zoo_ci_") as tmp:
        results = run_checks(zoo, [str(p) for p in packages], work_dir or tmp)
    lines = ["| bundle | " + " | ".join(CHECKS) + " |", "|---" * (len(CHECKS) + 1) + "|"]
    for bundle, row in results.items():
        lines.append(f"| {bundle} | " + " | ".join(row[c][0] for c in CHECKS) + " |")
    notes = [f"- {b} / {c}: {row[c][1]}" for b, row in results.items() for c in CHECKS if row[c][1]]
    print("\n".join(lines + ([""] + notes if notes else [])))
    if output:
        Path(output).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    fire.Fire(main)

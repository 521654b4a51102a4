# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Every bundle notebook (``bundles/*/docs/*.ipynb``) is committed without outputs and runs top to bottom,
headless, in a fresh Python kernel started from this interpreter with the repository importable; plus unit tests
of the notebook helpers in ``common/notebooks.py``.

The notebooks run with their own folder as working directory (as ``jupyter lab`` starts them); the executed
copies are written to the test's temporary folder, never back into the repository.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pytest
import torch
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellControlSignal, DeadKernelError

from common.bundle import bundle_names
from common.notebooks import (
    config_table,
    plot_comparison,
    plot_orthogonal_slices,
    plot_training_curves,
    read_metrics_csv,
    remove_workdir,
    setup_matplotlib,
)
from tests.helpers import BUNDLES, REPO_ROOT, seed_offset, shifted_seed

NOTEBOOKS = sorted(BUNDLES.glob("*/docs/*.ipynb"))
KERNEL_NAME = "python3"
CELL_TIMEOUT_S = 600
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _parameters_cell(nb: nbformat.NotebookNode) -> int:
    """Index of the cell tagged ``parameters`` (papermill's convention), which defines ``SEED``."""
    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
    assert re.search(r"^SEED = 0\b", nb.cells[tagged[0]].source, re.M), "the parameters cell must define SEED = 0"
    return tagged[0]


def _with_seed(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with ``SEED`` shifted by ``BUNDLE_TEST_SEED``: a cell after the parameters cell assigns it, as
    ``papermill -p SEED ...`` does."""
    index = _parameters_cell(nb)
    if seed_offset():
        cell = nbformat.v4.new_code_cell(f"SEED = {shifted_seed(0)}  # injected by the test (BUNDLE_TEST_SEED)")
        cell.id = "injected-seed"
        nb.cells.insert(index + 1, cell)
    return nb


def _notebook_id(path: Path) -> str:
    return path.relative_to(BUNDLES).as_posix()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _source_head(cell: nbformat.NotebookNode, lines: int = 6) -> str:
    source = cell.source.splitlines()
    more = "\n    ..." if len(source) > lines else ""
    return "\n".join(f"    {line}" for line in source[:lines]) + more


def _error_text(cell: nbformat.NotebookNode) -> str:
    """The error output of an executed cell (exception, message and traceback without terminal colours)."""
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            traceback = _ANSI.sub("", "\n".join(output.get("traceback", [])))
            return f"{output.get('ename')}: {output.get('evalue')}\n{traceback[-6000:]}"
    return ""


def _execute(
    nb: nbformat.NotebookNode,
    name: str,
    folder: Path,
    executed: Path,
    on_cell_start: Callable[..., None] | None = None,
    on_cell_executed: Callable[..., None] | None = None,
) -> None:
    """Run ``nb`` in the tests' ``python3`` kernel with ``folder`` as working directory and write the executed copy
    to ``executed``; a failed cell fails the test with its source and error."""
    current: dict[str, int] = {}

    def started(cell_index: int, **kwargs: Any) -> None:
        current["index"] = cell_index
        if on_cell_start is not None:
            on_cell_start(cell_index=cell_index, **kwargs)

    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name=KERNEL_NAME,
        resources={"metadata": {"path": str(folder)}},
        on_cell_start=started,
        on_cell_executed=on_cell_executed,
    )
    failure: Exception | None = None
    try:
        client.execute()
    except (CellControlSignal, DeadKernelError) as e:  # cell errors and timeouts, or a crashed kernel
        failure = e
    nbformat.write(nb, executed)
    if failure is not None:
        index = current.get("index")
        if index is None:
            pytest.fail(f"{name}: the kernel failed before the first cell: {failure}", pytrace=False)
        cell = nb.cells[int(index)]
        detail = _error_text(cell) or _ANSI.sub("", str(failure))[-6000:]
        pytest.fail(
            f"{name}: cell {index} failed ({type(failure).__name__}); executed copy: {executed}\n"
            f"{_source_head(cell)}\n{detail}",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def python_kernel(tmp_path_factory: pytest.TempPathFactory):
    """A private ``python3`` kernelspec that runs this interpreter with the repository on ``PYTHONPATH``.

    It is put first on ``JUPYTER_PATH``, so a ``python3`` kernelspec installed for another interpreter (a user's
    or a system one) cannot be picked instead; only ipykernel needs to be installed, as on a fresh CI machine after
    ``pip install -r requirements.txt``. Runtime files and the IPython profile also live in the temporary folder.
    """
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("jupyter")
    write_kernel_spec(root / "data" / "kernels" / KERNEL_NAME, overrides={"display_name": "Python 3 (tests)"})
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(p for p in (str(root / "data"), os.environ.get("JUPYTER_PATH")) if p))
        mp.setenv("JUPYTER_RUNTIME_DIR", str(root / "runtime"))
        mp.setenv("IPYTHONDIR", str(root / "ipython"))
        mp.setenv("PYTHONPATH", pythonpath)
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
        assert Path(spec.argv[0]) == Path(sys.executable), f"kernel {KERNEL_NAME!r} runs {spec.argv[0]!r}"
        yield spec


def test_notebooks_are_discovered():
    assert NOTEBOOKS, f"no notebook found as {BUNDLES}/*/docs/*.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_notebook_id)
def test_notebook_is_committed_clean(path: Path):
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)
    assert nb.nbformat == 4, f"{path}: nbformat {nb.nbformat}, expected 4"
    dirty = [
        f"cell {index} ({'outputs' if cell.outputs else 'execution count'})"
        for index, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path} is committed with outputs or execution counts in {', '.join(dirty)}; clear them with "
        f"`jupyter nbconvert --clear-output --inplace {path.relative_to(REPO_ROOT)}`"
    )
    kernel = nb.metadata.get("kernelspec", {}).get("name")
    assert kernel == KERNEL_NAME, f"{path}: kernelspec {kernel!r}, expected {KERNEL_NAME!r}"
    assert any(cell.cell_type == "markdown" for cell in nb.cells), f"{path} has no markdown cell"
    source = nb.cells[_parameters_cell(nb)].source
    assert "SEED" in "".join(cell.source for cell in nb.cells[_parameters_cell(nb) + 1 :]), f"{path}: SEED unused"
    assert source.count("\n") == 0, f"{path}: the parameters cell holds only `SEED = 0`, got {source!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_notebook_id)
def test_notebook_runs(path: Path, python_kernel, tmp_path: Path):
    before = _digest(path)
    folder_before = sorted(p.name for p in path.parent.iterdir())
    nb = _with_seed(nbformat.read(path, as_version=4))
    timings: dict[int, float] = {}
    current: dict[str, float | int] = {}

    def on_cell_start(cell_index: int, **_) -> None:
        current.update(index=cell_index, start=time.perf_counter())

    def on_cell_executed(cell_index: int, **_) -> None:
        timings[cell_index] = time.perf_counter() - current["start"]

    start = time.perf_counter()
    _execute(nb, _notebook_id(path), path.parent, tmp_path / path.name, on_cell_start, on_cell_executed)
    total = time.perf_counter() - start
    slowest = sorted(timings.items(), key=lambda item: -item[1])[:3]
    print(f"{_notebook_id(path)}: {total:.1f} s; slowest cells " + ", ".join(f"{i}: {t:.1f} s" for i, t in slowest))

    errors = [index for index, cell in enumerate(nb.cells) if _error_text(cell)]
    assert not errors, f"{_notebook_id(path)}: error outputs in cells {errors}"
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code_cells), "not every code cell ran"
    assert _digest(path) == before, f"{path} was modified by its execution"
    assert sorted(p.name for p in path.parent.iterdir()) == folder_before, f"{path.parent} gained or lost files"


# A notebook user's whole path, no command line: train each bundle's tiny profile, evaluate and infer on that run
# folder with nothing retyped, package its weights. ``jobs.json`` (written by the test) holds each bundle's data,
# its training settings and its inference inputs.
PYTHON_ONLY_CELLS = (
    """import json
from pathlib import Path

import torch
from monai.bundle import ConfigWorkflow, create_workflow

from common.bundle import resolve_bundle
from common.bundle_tools.package import package_bundle
from common.errors import user_error_in_chain

torch.set_num_threads(1)
JOBS = json.loads(Path("jobs.json").read_text())
results = {}


def files(bundle, *names):
    return [str(resolve_bundle(bundle) / "configs" / name) for name in names]


def run(workflow):
    workflow.initialize()
    outcome = workflow.run()
    workflow.finalize()
    return outcome""",
    """for bundle, job in JOBS.items():  # a misspelt id is refused before anything is written, as on the command line
    try:
        ConfigWorkflow(
            config_file=files(bundle, "train.json", *job["profile"]),
            workflow_type="train",
            output_dir=job["output_dir"],
            max_epoch=1,
            **job["data"],
        ).initialize()
        results[bundle] = {"typo": None}
    except RuntimeError as exc:
        results[bundle] = {"typo": str(user_error_in_chain(exc))}
    results[bundle]["written_by_typo"] = Path(job["output_dir"]).exists()""",
    """for bundle, job in JOBS.items():
    out = job["output_dir"]
    train = ConfigWorkflow(
        config_file=files(bundle, "train.json", *job["profile"]), workflow_type="train", output_dir=out, **job["train"]
    )
    run(train)
    run(create_workflow(config_file=files(bundle, "train.json", "evaluate.json"), output_dir=out, **job["evaluate"]))
    inference = create_workflow(
        config_file=files(bundle, "inference.json"),
        output_dir=out,
        prediction_dir=job["prediction_dir"],
        **job["inputs"],
    )
    results[bundle]["summary"] = run(inference)[-2]  # failed cases do not end the kernel
    if job["pack"]:  # one file of the cascade's stages
        run(create_workflow(config_file=files(bundle, "inference.json"), run_id="pack", output_dir=out))
    package = package_bundle(bundle, Path(out) / "models" / "model.pt", job["dist"], weights_inside=True)
    results[bundle]["package"] = str(package)
Path("results.json").write_text(json.dumps(results, indent=1))""",
)


def _python_only_jobs(root: Path) -> dict[str, Any]:
    """Each bundle's job for :data:`PYTHON_ONLY_CELLS`: the data of its fault-test job, trained one epoch; the good
    inference inputs of the fault matrix, plus a truncated volume for the autoencoder (a failed case)."""
    from scripts.harness.faults import make_case
    from tests.test_inference_faults import INPUTS

    jobs = {}
    for bundle in bundle_names():
        job = make_case(bundle, root / bundle / "data", shifted_seed(0))
        train = {**job.args, "max_epochs": 1, "val_interval": 1, "deterministic": False}
        _, inputs = INPUTS[bundle].good(root / bundle / "inputs")
        if bundle == "autoencoder_3d":
            good = (root / bundle / "inputs" / "case0.nii.gz").read_bytes()
            (root / bundle / "inputs" / "cut.nii.gz").write_bytes(good[: len(good) // 2])
        jobs[bundle] = {
            "profile": job.configs[1:],
            "data": {k: job.args[k] for k in job.data},
            "train": train,
            "evaluate": {"num_threads": 1, **({"stage": 1} if "stage" in job.args else {})},
            "inputs": {"num_threads": 1, **inputs},
            "pack": bundle == "xray2ct_cascade",
            "output_dir": str(root / bundle / "run"),
            "prediction_dir": str(root / bundle / "predictions"),
            "dist": str(root / "dist"),
        }
    return jobs


def test_a_notebook_trains_evaluates_infers_and_packages_every_bundle(python_kernel, tmp_path: Path):
    """From a notebook only (a kernel whose working folder is outside the repository): a misspelt override is refused
    as on the command line, a run trained in Python records its settings as a command would, evaluation and
    inference read them with nothing retyped, a failed case returns its summary instead of ending the kernel, and
    the package carries the run's settings."""
    import zipfile

    from common.bundle_tools.launch import format_overrides
    from common.runs import LOCATION_IDS, RUN_FILE, make_record

    jobs = _python_only_jobs(tmp_path)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in PYTHON_ONLY_CELLS])
    _execute(nb, "python-only notebook", tmp_path, tmp_path / "executed.ipynb")
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(results) == sorted(jobs)
    for bundle, job in jobs.items():
        found = results[bundle]
        assert "'max_epoch' is not an id of" in found["typo"] and "did you mean 'max_epochs'" in found["typo"]
        assert not found["written_by_typo"], bundle
        failed = 1 if bundle == "autoencoder_3d" else 0
        assert found["summary"] == {"written": 3, "skipped": 0, "failed": failed, "status": 2 if failed else 0}
        # the record of the run trained in Python holds what the same command line would have recorded
        out = Path(job["output_dir"])
        folder = out / "stage1" if "stage" in job["train"] else out
        recorded = json.loads((folder / RUN_FILE).read_text())
        configs = [str(BUNDLES / bundle / "configs" / c) for c in ("train.json", *job["profile"])]
        argv = ["/x/monai/bundle/__main__.py", "run", "training", "--config_file", json.dumps(configs)]
        argv += format_overrides({**job["train"], "output_dir": str(out)})
        expected = make_record(folder, BUNDLES / bundle, argv=argv).settings
        assert {k: recorded["settings"].get(k) for k in expected} == expected, bundle
        assert recorded["command_line"] is None and recorded["config_files"] == {}
        with zipfile.ZipFile(found["package"]) as zf:
            packaged = json.loads(zf.read(f"{bundle}/configs/train.json"))
        kept = {k: v for k, v in recorded["settings"].items() if "#" not in k and k not in LOCATION_IDS}
        assert {k: packaged[k] for k in kept} == kept and kept["max_epochs"] == 1, bundle


def _write_metrics(path: Path, rows: list[tuple[int, int, str, float]]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "epoch", "tag", "value"])
        writer.writerows(rows)
    return path


def test_read_metrics_csv_and_training_curves(tmp_path: Path):
    rows = [(1, 1, "train/loss", 0.5), (2, 1, "train/loss", 0.25), (2, 1, "val_psnr", 20.0), (3, 2, "train/adv", 0.1)]
    path = _write_metrics(tmp_path / "metrics.csv", rows)
    series = read_metrics_csv(path)
    assert series == {"train/loss": [(1, 0.5), (2, 0.25)], "val_psnr": [(2, 20.0)], "train/adv": [(3, 0.1)]}

    fig = plot_training_curves(path, tags=["val_psnr", "not_logged", "train/loss"])
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["val_psnr", "train/loss"]
    np.testing.assert_allclose(visible[1].lines[0].get_xydata(), [[1, 0.5], [2, 0.25]])
    assert len([ax for ax in plot_training_curves(series, ncols=2).axes if ax.get_visible()]) == 3

    with pytest.raises(ValueError, match="none of the tags"):
        plot_training_curves(path, tags=["not_logged"])
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        read_metrics_csv(tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="bad.csv"):
        read_metrics_csv(tmp_path / "bad.csv")


def test_config_table():
    from monai.bundle import ConfigParser

    parser = ConfigParser({"a": 2, "b": "$@a * 3", "c": {"x": [1, 2]}, "pipe": "a|b", "long": "y" * 200})
    lines = config_table(parser, ["a", "b", "c#x", "pipe", "long"]).splitlines()
    assert lines[:2] == ["| id | in the config | resolved |", "|---|---|---|"]
    assert lines[2] == "| `a` | `2` |  |"
    assert lines[3] == "| `b` | `$@a * 3` | `6` |"
    assert lines[4] == "| `c#x` | `[1, 2]` |  |"
    assert lines[5] == "| `pipe` | `a\\|b` |  |"
    assert lines[6].endswith("...` |  |") and len(lines[6]) < 120
    assert config_table(parser, ["b"], resolve=False).splitlines()[2] == "| `b` | `$@a * 3` |  |"
    with pytest.raises(KeyError, match="missing"):
        config_table(parser, ["missing"])


def test_plot_orthogonal_slices():
    batch = torch.rand(2, 1, 8, 10, 12)
    fig = plot_orthogonal_slices(batch, titles=["first", "second"])
    assert len(fig.axes) == 6
    assert [ax.get_title() for ax in fig.axes[:3]] == ["sagittal", "coronal", "axial"]
    assert fig.axes[3].get_ylabel() == "second"
    axial = fig.axes[2].images[0].get_array()
    np.testing.assert_allclose(axial, np.rot90(batch[0, 0, :, :, 6].numpy()))
    with pytest.raises(ValueError, match="2 volumes"):
        plot_orthogonal_slices(batch, titles=["one"])
    with pytest.raises(ValueError, match="at least one"):
        plot_orthogonal_slices([])


def test_plot_comparison():
    image = torch.rand(1, 10, 12, 6)
    recon = image * 0.5
    fig = plot_comparison(image, recon, error_scale=2.0, title="t")
    assert len(fig.axes) == 9
    assert [ax.get_title() for ax in fig.axes[:3]] == ["input", "reconstruction", "|error| x 2"]
    assert [ax.get_ylabel() for ax in fig.axes[::3]] == ["sagittal", "coronal", "axial"]
    # each cell is cut back to its slice (no padding): sagittal (Z, Y), coronal (Z, X), axial (Y, X) after rotation
    shapes = [fig.axes[3 * row].images[0].get_array().shape for row in range(3)]
    assert shapes == [(6, 12), (6, 10), (12, 10)]
    expected_error = np.clip(np.abs(np.rot90(image[0, :, :, 3].numpy()) * 0.5) * 2.0, 0, 1)
    np.testing.assert_allclose(fig.axes[8].images[0].get_array(), expected_error, atol=1e-6)
    with pytest.raises(ValueError, match="same spatial shape"):
        plot_comparison(image, torch.rand(1, 10, 12, 7))


def test_remove_workdir(tmp_path: Path):
    work, other = tmp_path / "work", tmp_path / "other"
    (work / "outputs").mkdir(parents=True)
    other.mkdir()
    root = logging.getLogger()
    inside = logging.FileHandler(work / "outputs" / "train.log")
    outside = logging.FileHandler(other / "train.log")
    root.addHandler(inside)
    root.addHandler(outside)
    try:
        remove_workdir(work)
        assert not work.exists()
        assert inside not in root.handlers and inside.stream is None
        assert outside in root.handlers
        remove_workdir(work)  # a missing folder is not an error
    finally:
        for handler in (inside, outside):
            root.removeHandler(handler)
            handler.close()


def test_setup_matplotlib_outside_a_kernel():
    assert setup_matplotlib().lower() == "agg"


def test_run_parser_builds_the_network_of_a_run(tmp_path: Path):
    from common.notebooks import run_parser
    from common.runs import make_record

    train = BUNDLES / "autoencoder_3d" / "configs" / "train.json"
    argv = ["/x/monai/bundle/__main__.py", "run", "training", "--config_file", str(train), "--channels", "[8,16,32]"]
    make_record(tmp_path, BUNDLES / "autoencoder_3d", argv=argv).write()
    parser = run_parser("autoencoder_3d", tmp_path, overrides={"device": "cpu", "norm_num_groups": 4})
    network = parser.get_parsed_content("network_def")
    assert next(network.encoder.parameters()).shape[:2] == (8, 1)  # the first convolution: channels[0] = 8
    assert parser.get_parsed_content("channels") == [8, 16, 32]
    assert parser.get_parsed_content("norm_num_groups") == 4  # an override wins over the run's settings
    assert parser.get_parsed_content("output_dir") == str(tmp_path)

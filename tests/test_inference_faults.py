# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The fault matrix of inference: every kind of fault a cohort run meets x every bundle it applies to, each run as
a user runs it (the bundle's ``inference.json`` on a trained tiny run, in this process as a notebook runs it: the
exit status is what its ``run`` list returns, the one ``python -m monai.bundle run`` exits with; a user error is what
the command prints, ``error: <message>``), with
what the user sees: the rows of ``failures.csv``, the exit status, what is on disk.

Every cell also checks the promise of ``docs/inference.md``: every case the folder counts as written (a record in
``.done``) has its files byte-identical to those of a clean run of the same command on the same inputs (so no
wrong, stale or partial file is counted), the folder holds no file that no record lists, and a fault that stopped a
run loses nothing: the same command afterwards completes the folder as a clean run would.

The table in ``docs/reliability.md`` ("What inference does with each fault") is this module's: the last test
compares it with the one the run produced; ``WRITE_FAULT_MATRIX=1 python -m pytest tests/test_inference_faults.py``
writes it.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest

import common.engines.cases as cases_module
from common.bundle import BUNDLES_DIR, ROOT, bundle_names
from common.bundle_tools.registry import describe
from common.demo.images import make_ct_phantom, make_phantom
from common.engines.cases import DONE_DIR, FAILURES_CSV
from common.errors import INTERRUPTED, user_error_in_chain
from common.utils import OutputWriteError
from tests.bundle_cases import CASES
from tests.helpers import shifted_seed

BUNDLES = tuple(bundle_names())


def family(bundle: str) -> str:
    """The bundle's model family: how its inference inputs are laid out and what it writes are the family's."""
    return describe(bundle).family


DOCS = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- inference fault matrix: begin -->", "<!-- inference fault matrix: end -->"
N_GOOD = 3
NOT_APPLICABLE = "-"

# ------------------------------------------------------------------------------------------------ running a bundle


@dataclasses.dataclass
class Outcome:
    """What a user sees of one inference command: its exit status, its last line, the rows of ``failures.csv``."""

    status: int
    last: str
    rows: dict[str, dict[str, str]]
    warnings: list[str]


class _Warnings(logging.Handler):
    """The warnings of the collection's loggers (MONAI's ``logging.conf`` replaces the root logger's handlers)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def infer(bundle: str, trained: Path, prediction_dir: Path, **settings: Any) -> Outcome:
    """``python -m monai.bundle run --config_file <bundle>/configs/inference.json --output_dir <trained>
    --prediction_dir <prediction_dir> --num_threads 1 <settings>``, in this process, as a notebook runs it: the
    status is the value the run list returns (from Python no case's failure ends the process)."""
    from monai.bundle import create_workflow

    config = str(BUNDLES_DIR / bundle / "configs" / "inference.json")
    args = {"output_dir": str(trained), "prediction_dir": str(prediction_dir), "num_threads": 1, **settings}
    printed, warned = io.StringIO(), _Warnings()
    status, last = 0, ""
    logging.getLogger("common").addHandler(warned)
    try:
        with contextlib.redirect_stdout(printed):
            workflow = create_workflow(config_file=config, **args)
            status = workflow.run()[-1]
            workflow.finalize()
    except KeyboardInterrupt:
        status, last = 130, "interrupted"
    except Exception as exc:  # noqa: BLE001 - what the command line prints for a user error
        error = user_error_in_chain(exc)
        if error is None:
            raise
        status, last = 1, f"error: {error}"
    finally:
        logging.getLogger("common").removeHandler(warned)
    lines = printed.getvalue().strip().splitlines()
    last = last or (lines[-1] if lines else "")
    rows = {}
    if (prediction_dir / FAILURES_CSV).is_file():
        with open(prediction_dir / FAILURES_CSV, newline="") as handle:
            rows = {row["case_id"]: row for row in csv.DictReader(handle)}
    return Outcome(status, last, rows, warned.lines)


def records(folder: Path) -> dict[str, dict]:
    """The records of the cases ``folder`` counts as written: ``{product/case: record}``."""
    found = {}
    for path in sorted((folder / DONE_DIR).rglob("*.json")):
        record = json.loads(path.read_text())
        found[str(path.relative_to(folder / DONE_DIR).with_suffix(""))] = record
    return found


#: the settings that say where a bench's inputs lie (a clean run may read a copy of them)
WHERE_INPUTS_LIE = ("dataset_dir", "csv_path", "datalist")


def _essence(record: dict) -> dict:
    """A record without where its inputs lie (a clean run may read a copy): what made it (the weights, every setting
    but those of :data:`WHERE_INPUTS_LIE`, the software), the files, the values, the settings the run changed, and the
    content of the inputs."""
    inputs = record.get("inputs") or {}
    content = {key: [f.get("sha256") for f in files] for key, files in (inputs.get("files") or {}).items()}
    made_with = {k: v for k, v in record["made_with"].items() if k.removeprefix("=") not in WHERE_INPUTS_LIE}
    kept = ("case_id", "outputs", "values", "effective")
    return {**{k: record.get(k) for k in kept}, "made_with": made_with, "content": content, "row": inputs.get("values")}


TABLES = {
    "failures.csv",
    "predictions.csv",
    "risk_groups.csv",
    "report.json",
    "calibration.png",
    "km_by_risk_group.png",
}


def broken_promises(folder: Path, clean: Path, complete: bool = True) -> list[str]:
    """What in ``folder`` breaks the promise of a written case, against ``clean``, a clean run of the same command on
    the same inputs: a record whose files are missing or differ from the clean run's, or whose record differs; a file
    no record lists (a partial or stale output); with ``complete``, a case the clean run wrote that is not written."""
    problems = []
    mine, theirs = records(folder), records(clean)
    listed = set()
    for case, record in mine.items():
        if case not in theirs:
            problems.append(f"{case} is counted as written but a clean run does not write it")
            continue
        for name in record["outputs"]:
            listed.add(name)
            path = folder / name
            if not path.is_file() or path.read_bytes() != (clean / name).read_bytes():
                problems.append(f"{case}: {name} is not the clean run's file")
        if _essence(record) != _essence(theirs[case]):
            problems.append(f"{case}: its record differs from the clean run's")
    for path in folder.iterdir():
        if path.is_file() and path.name not in listed and path.name not in TABLES:
            problems.append(f"{path.name} is in the folder but no record lists it")
    staged = [p for p in (folder / ".staging").rglob("*") if p.is_file()] if (folder / ".staging").exists() else []
    problems += [f"{p} was left in the staging folder" for p in staged]
    if complete:
        problems += [f"{case} is not written" for case in theirs if case not in mine]
    for table in ("predictions.csv", "risk_groups.csv"):
        if complete and (clean / table).is_file() and (folder / table).read_bytes() != (clean / table).read_bytes():
            problems.append(f"{table} differs from the clean run's")
    return problems


# ------------------------------------------------------------------------------------------------ the bundles' inputs


def _phantom(kind: str, shape: tuple[int, int, int], seed: int) -> np.ndarray:
    if kind == "ct":
        return make_ct_phantom(shape, seed=seed).astype(np.float32)
    return make_phantom(shape, seed=seed).astype(np.float32)


def write_series(
    folder: Path, volume: np.ndarray, positions: list[float] | None = None, orientations: dict[int, str] | None = None
) -> Path:
    """A DICOM series of ``volume`` (``(X, Y, Z)``, int16), slice ``k`` at ``positions[k]`` mm (default ``2 k``),
    orientation ``-1\\0\\0\\0\\-1\\0`` unless ``orientations`` gives another for a slice."""
    import itk

    folder.mkdir(parents=True, exist_ok=True)
    array = np.ascontiguousarray(np.round(volume).astype(np.int16).transpose(2, 1, 0))
    positions = positions if positions is not None else [2.0 * k for k in range(array.shape[0])]
    for k, z in enumerate(positions):
        image = itk.image_from_array(np.ascontiguousarray(array[min(k, array.shape[0] - 1)]))
        image.SetSpacing([1.5, 1.5])
        meta = image.GetMetaDataDictionary()
        tags = {
            "0008|0060": "CT",
            "0020|000e": "1.2.826.0.1.3680043.8.498.4242",
            "0020|0013": str(k + 1),
            "0020|0032": f"0\\0\\{z:.4f}",
            "0020|0037": (orientations or {}).get(k, "-1\\0\\0\\0\\-1\\0"),
        }
        for tag, value in tags.items():
            meta[tag] = value
        dicom_io = itk.GDCMImageIO.New()
        dicom_io.KeepOriginalUIDOn()
        itk.ImageFileWriter.New(Input=image, FileName=str(folder / f"slice{k:04d}.dcm"), ImageIO=dicom_io).Update()
    return folder


def _nifti(path: Path, volume: np.ndarray, spacing: tuple[float, float, float]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(volume.astype(np.float32), np.diag([*spacing, 1.0])), path)
    return path


@dataclasses.dataclass
class Inputs:
    """One bundle's inference inputs in a folder: how its cases are written and which settings point the bundle at
    them.

    Args:
        bundle: the bundle.
        kind: the phantoms (``ct`` in HU, else [0, 1] ellipsoids).
        shape: the volumes' shape; spacing: their voxel size.
        dicom: whether the bundle reads DICOM series here (a folder of volumes or a CSV pointing at them).
    """

    bundle: str
    kind: str = "mr"
    shape: tuple[int, int, int] = (24, 24, 24)
    spacing: tuple[float, float, float] = (1.5, 1.5, 2.0)
    dicom: bool = True

    @property
    def family(self) -> str:
        return family(self.bundle)

    def volume(self, seed: int) -> np.ndarray:
        return _phantom(self.kind, self.shape, shifted_seed(seed))

    def write(self, folder: Path, case: str, volume: np.ndarray) -> list[Path]:
        """Write the case ``case`` whose volume is ``volume``; its files."""
        if self.family == "diffusion":  # the BraTS layout: one file per source modality
            return [
                _nifti(folder / case / f"{case}-{key}.nii.gz", volume + i, self.spacing)
                for i, key in enumerate(("t1n", "t1c", "t2w"))
            ]
        path = folder / "images" / f"{case}.nii.gz" if self.family == "survival" else folder / f"{case}.nii.gz"
        return [_nifti(path, volume, self.spacing)]

    def write_series(self, folder: Path, case: str, volume: np.ndarray, **geometry: Any) -> Path:
        base = folder / "images" if self.family == "survival" else folder
        return write_series(base / case, volume, **geometry)

    def settings(self, folder: Path, cases: list[str], covariates: dict[str, str] | None = None) -> dict[str, Any]:
        """The settings that point inference at the cases in ``folder`` (mace: a cohort CSV listing ``cases`` in
        this order, with a row's ``age`` cell from ``covariates``)."""
        if self.family != "survival":
            return {"dataset_dir": str(folder)}
        rows = ["case_id,image,age,sex"]
        for i, case in enumerate(cases):
            image = next((str(p.relative_to(folder)) for p in (folder / "images").glob(f"{case}*")), f"images/{case}")
            rows.append(f"{case},{image},{(covariates or {}).get(case, str(50 + i))},{i % 2}")
        (folder / "cohort.csv").write_text("\n".join(rows) + "\n")
        return {"csv_path": str(folder / "cohort.csv")}

    def good(self, folder: Path) -> tuple[list[str], dict[str, Any]]:
        """``N_GOOD`` good cases: their ids and the settings."""
        cases = [f"case{i}" for i in range(N_GOOD)]
        for i, case in enumerate(cases):
            self.write(folder, case, self.volume(10 + i))
        return cases, self.settings(folder, cases)


INPUTS = {bundle: Inputs(bundle, **case.inference_inputs) for bundle, case in CASES.items()}
# a setting each bundle's outputs depend on, and another value of it (the thread count is the other such row)
BYTE_SETTINGS = {bundle: case.byte_setting for bundle, case in CASES.items()}


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Callable[[str], Path]:
    """A trained run of each bundle's tiny profile (its fault-test job for one epoch; mace with the covariates
    ``age`` and ``sex``), trained on first use with the command line a user types."""
    from scripts.harness.faults import make_case, run_case

    runs: dict[str, Path] = {}

    def run(bundle: str) -> Path:
        if bundle not in runs:
            root = tmp_path_factory.mktemp(f"{bundle}_trained")
            job = make_case(bundle, root / "data", shifted_seed(0))
            args = {**job.args, "deterministic": False}
            args.update({k: 1 for k in ("max_epochs", "val_interval") if k in args})
            if family(bundle) == "survival":
                args["covariates"] = ["age", "sex"]
            result = run_case(dataclasses.replace(job, args=args), root / "run")
            assert result.returncode == 0, result.stderr[-3000:]
            runs[bundle] = root / "run"
        return runs[bundle]

    return run


@dataclasses.dataclass
class Bench:
    """One bundle's trained run, its good inputs and a clean run on them."""

    bundle: str
    trained: Path
    inputs: Inputs
    folder: Path
    cases: list[str]
    settings: dict[str, Any]
    clean: Path
    work: Path

    def copy_inputs(self, name: str) -> tuple[Path, dict[str, Any]]:
        """A copy of the good inputs (to change), and the settings pointing at it."""
        folder = self.work / name
        shutil.copytree(self.folder, folder, symlinks=True)
        return folder, self.inputs.settings(folder, self.cases)

    def infer(self, prediction_dir: Path, **settings: Any) -> Outcome:
        return infer(self.bundle, self.trained, prediction_dir, **{**self.settings, **settings})

    def clean_run(self, name: str, **settings: Any) -> Path:
        """A clean run of the same command (``settings``) into a new folder."""
        folder = self.work / name
        outcome = infer(self.bundle, self.trained, folder, **{**self.settings, **settings})
        assert outcome.status == 0, outcome
        return folder


@pytest.fixture(scope="module")
def benches(trained, tmp_path_factory) -> Callable[[str], Bench]:
    made: dict[str, Bench] = {}

    def bench(bundle: str) -> Bench:
        if bundle not in made:
            work = tmp_path_factory.mktemp(f"{bundle}_faults")
            inputs = INPUTS[bundle]
            cases, settings = inputs.good(work / "good")
            clean = work / "clean"
            outcome = infer(bundle, trained(bundle), clean, **settings)
            assert outcome.status == 0 and len(records(clean)) == N_GOOD, outcome
            made[bundle] = Bench(bundle, trained(bundle), inputs, work / "good", cases, settings, clean, work)
        return made[bundle]

    return bench


# the cells of the matrix: {(row, bundle): cell}, and what the user is told in each row (the first bundle's words)
MATRIX: dict[tuple[str, str], str] = {}
TOLD: dict[str, str] = {}


def note(row: str, bundle: str, cell: str, told: str = "") -> None:
    MATRIX[(row, bundle)] = cell
    if told and row not in TOLD:
        TOLD[row] = " ".join(told.split())


def _short(text: str, limit: int = 150) -> str:
    text = re.sub(r"/\S*/", ".../", " ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "..."


# ------------------------------------------------------------------------------------------------ the faults

SETTING_ROW = "a setting the network cannot take (a patch, image or view size)"


@pytest.mark.parametrize("bundle", BUNDLES)
def test_a_setting_the_network_cannot_take_is_refused_before_any_case(bundle, benches, tmp_path):
    bench = benches(bundle)
    out = tmp_path / "predictions"
    outcome = bench.infer(out, **CASES[bundle].bad_inference_settings)
    assert outcome.status == 1 and outcome.last.startswith("error: invalid"), outcome
    missing = [name for name in CASES[bundle].inference_refused if name not in outcome.last]
    assert not missing, f"{missing} not named in {outcome.last}"
    assert not out.exists()
    note(SETTING_ROW, bundle, "refused before any case; exit 1; nothing written", outcome.last)


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])


def _nan_half(volume: np.ndarray) -> np.ndarray:
    out = volume.copy()
    out[: volume.shape[0] // 2] = np.nan
    return out


def _one_inf(volume: np.ndarray) -> np.ndarray:
    out = volume.copy()
    out[1, 2, 3] = np.inf
    return out


def _broken_link(inputs: Inputs, folder: Path, case: str, volume: np.ndarray) -> None:
    target = inputs.write(folder, case, volume)[0]
    target.unlink()
    target.symlink_to(folder / "gone.nii.gz")


def _slices(volume: np.ndarray) -> list[float]:
    return [2.0 * k for k in range(volume.shape[2])]


#: the input faults, one case each: ``row: (case id, the stage its failures.csv row names, DICOM bundles only,
#: write(inputs, folder, case id, a good volume))``; the matrix's input rows are these
INPUT_FAULTS: dict[str, tuple[str, str, bool, Callable[[Inputs, Path, str, np.ndarray], Any]]] = {
    "NaN voxels in a volume": ("nan", "check", False, lambda i, f, c, v: i.write(f, c, _nan_half(v))),
    "an infinite voxel in a volume": ("inf", "check", False, lambda i, f, c, v: i.write(f, c, _one_inf(v))),
    "a truncated .nii.gz (its header whole)": (
        "truncated",
        "read",
        False,
        lambda i, f, c, v: _truncated(i.write(f, c, v)[-1]),
    ),
    "a file that is not an image": (
        "text",
        "check",
        False,
        lambda i, f, c, v: i.write(f, c, v)[-1].write_text("an export that is not an image"),
    ),
    "a broken symbolic link": ("link", "check", False, _broken_link),
    "DICOM series: a missing slice": (
        "dicom_gap",
        "check",
        True,
        lambda i, f, c, v: i.write_series(f, c, v, positions=_slices(v)[:5] + _slices(v)[6:]),
    ),
    "DICOM series: a duplicate slice": (
        "dicom_twice",
        "check",
        True,
        lambda i, f, c, v: i.write_series(f, c, v, positions=[*_slices(v), _slices(v)[5]]),
    ),
    "DICOM series: uneven slice spacing": (
        "dicom_uneven",
        "check",
        True,
        lambda i, f, c, v: i.write_series(
            f, c, v, positions=[p + (0.5 if k >= 7 else 0.0) for k, p in enumerate(_slices(v))]
        ),
    ),
    "DICOM series: slices of two orientations": (
        "dicom_mixed",
        "check",
        True,
        lambda i, f, c, v: i.write_series(f, c, v, orientations={3: "1\\0\\0\\0\\1\\0"}),
    ),
}
INPUT_ROWS = tuple(INPUT_FAULTS)


def write_faulty_cases(bench: Bench, folder: Path) -> dict[str, tuple[str, str]]:
    """Add a case of each input fault of :data:`INPUT_FAULTS` that the bundle reads to ``folder``: ``{row: (case,
    stage expected)}``."""
    inputs, volume = bench.inputs, bench.inputs.volume(30)
    faults = {}
    for row, (case, stage, dicom_only, write) in INPUT_FAULTS.items():
        if inputs.dicom or not dicom_only:
            write(inputs, folder, case, volume)
            faults[row] = (case, stage)
    return faults


CELL_ROW = "a bad cell in the cohort CSV (a covariate that is not a number)"


@pytest.mark.parametrize("bundle", BUNDLES)
def test_bad_inputs_fail_their_case_and_the_others_are_written(bundle, benches, tmp_path):
    """One folder holding the good cases and one case of each input fault: each fault is a row of failures.csv with
    its stage, no file of it is anywhere, the good cases are those of a clean run."""
    bench = benches(bundle)
    folder, _ = bench.copy_inputs("faulty_inputs")
    faults = write_faulty_cases(bench, folder)
    cases = [*bench.cases, *(case for case, _ in faults.values())]
    covariates = {}
    if family(bundle) == "survival":
        cases.append("bad_cell")
        bench.inputs.write(folder, "bad_cell", bench.inputs.volume(31))
        covariates = {"bad_cell": "abc"}
        faults[CELL_ROW] = ("bad_cell", "check")
    settings = bench.inputs.settings(folder, cases, covariates)
    out = tmp_path / "predictions"
    outcome = bench.infer(out, **settings)
    assert outcome.status == 2, outcome
    assert outcome.last == f"{N_GOOD} written, {len(faults)} failed: see {out / FAILURES_CSV}", outcome
    for row, (case, stage) in faults.items():
        assert outcome.rows[case]["stage"] == stage, (row, outcome.rows[case])
        assert not [p for p in out.rglob(f"{case}_*")], row
        note(row, bundle, f"`{stage}` row; exit 2; no file", outcome.rows[case]["reason"])
    assert set(outcome.rows) == {case for case, _ in faults.values()}
    assert broken_promises(out, bench.clean) == []
    for row in INPUT_ROWS:
        MATRIX.setdefault((row, bundle), NOT_APPLICABLE)
    MATRIX.setdefault((CELL_ROW, bundle), NOT_APPLICABLE)


COLLIDE_ROW = "two case ids with one file name (`p1/ct`, `p2/ct`)"


def _listed(bundle: str, cases: dict[str, str], folder: Path, where: Path, relative: bool = False) -> dict[str, Any]:
    """Settings that list the bench inputs ``folder/<file case>`` as the cases ``{case id: file case}`` in a list
    file in ``where`` (mace: a cohort CSV; autoencoder and VQ-GAN: the entries themselves unless ``relative``; the
    others: a datalist JSON), paths relative to ``where`` with ``relative``."""

    def path(file: Path) -> str:
        return os.path.relpath(file, where) if relative else str(file)

    where.mkdir(parents=True, exist_ok=True)
    if family(bundle) == "survival":
        rows = ["case_id,image,age,sex"]
        rows += [
            f"{c},{path(folder / 'images' / f'{f}.nii.gz')},5{i},{i % 2}" for i, (c, f) in enumerate(cases.items())
        ]
        (where / "cohort.csv").write_text("\n".join(rows) + "\n")
        return {"csv_path": str(where / "cohort.csv")}

    def entry(case: str) -> dict[str, Any]:
        if family(bundle) == "diffusion":
            return {key: path(folder / case / f"{case}-{key}.nii.gz") for key in ("t1n", "t1c", "t2w")}
        return {"image": path(folder / f"{case}.nii.gz")}

    entries = [{"case_id": case, **entry(file)} for case, file in cases.items()]
    if family(bundle) in ("autoencoder", "vqgan") and not relative:
        return {"datalist": entries}
    (where / "datalist.json").write_text(json.dumps({"testing": entries}))
    return {"datalist": str(where / "datalist.json")}


@pytest.mark.parametrize("bundle", BUNDLES)
def test_two_case_ids_with_one_file_name_write_two_files(bundle, benches, tmp_path):
    bench = benches(bundle)
    folder = bench.folder
    ids = ["p1/ct", "p2/ct"]
    settings = _listed(bundle, {case: f"case{i}" for i, case in enumerate(ids)}, folder, tmp_path)
    out = tmp_path / "predictions"
    outcome = bench.infer(out, **settings)
    assert outcome.status == 0, outcome
    written = records(out)
    assert sorted(r["case_id"] for r in written.values()) == ids
    outputs = [set(r["outputs"]) for r in written.values()]
    assert len(outputs) == 2 and not outputs[0] & outputs[1]
    for record in written.values():
        stem = record["case_id"].replace("/", "%2F")
        assert record["outputs"] == [] or all(name.startswith(stem + "_") for name in record["outputs"])
        assert all((out / name).is_file() for name in record["outputs"])
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name not in TABLES)
    if family(bundle) == "survival":
        predicted = (out / "predictions.csv").read_text()
        assert "p1/ct" in predicted and "p2/ct" in predicted
        cell = "two rows in the tables; exit 0"
    else:
        assert files and all(name.startswith(("p1%2Fct_", "p2%2Fct_")) for name in files)
        cell = "two files (`p1%2Fct_...`, `p2%2Fct_...`); exit 0"
    note(COLLIDE_ROW, bundle, cell, f"{len(files)} files: {', '.join(files[:4])}")


@pytest.mark.parametrize("bundle", BUNDLES)
def test_relative_paths_of_a_list_file_mean_its_own_folder(bundle, benches, tmp_path, monkeypatch):
    """A datalist (mace: a cohort CSV) in a third folder, its paths relative to it (``cases/...``), run from a
    fourth folder with ``dataset_dir`` naming a fifth that holds nothing: the cases are the files the list names,
    written as the clean run writes them (MONAI's ``load_decathlon_datalist`` convention)."""
    bench = benches(bundle)
    shutil.copytree(bench.folder, tmp_path / "lists" / "cases", symlinks=True)
    cases = {case: case for case in bench.cases}
    settings = _listed(bundle, cases, tmp_path / "lists" / "cases", tmp_path / "lists", relative=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "decoy").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = tmp_path / "predictions"
    outcome = bench.infer(out, **settings, dataset_dir=str(tmp_path / "decoy"))
    assert outcome.status == 0 and outcome.last == f"{N_GOOD} written, 0 failed", outcome
    assert broken_promises(out, bench.clean) == []


CHANGED_ROWS = {
    "volume": "an input volume replaced after its case was written",
    "dicom": "a DICOM slice file edited after its case was written",
    "covariate": "a covariate corrected in the CSV after its case was written",
}


@pytest.mark.parametrize("bundle", BUNDLES)
def test_inputs_changed_after_their_case_was_written_are_redone(bundle, benches, tmp_path):
    """A re-run redoes exactly the cases whose inputs changed (one warning naming them) and keeps the others: the
    folder is then that of a clean run on the new inputs."""
    bench = benches(bundle)
    folder, _ = bench.copy_inputs("changing")
    cases = list(bench.cases)
    volume = bench.inputs.volume(40)
    if bench.inputs.dicom:
        bench.inputs.write_series(folder, "series", volume)
        cases.append("series")
    covariates = {"case2": "52"}
    out = tmp_path / "predictions"
    assert bench.infer(out, **bench.inputs.settings(folder, cases, covariates)).status == 0
    changed = {"volume": "case1"}
    bench.inputs.write(folder, "case1", bench.inputs.volume(41))
    if bench.inputs.dicom:
        edited = volume.copy()
        edited[:, :, 3] += 100.0
        bench.inputs.write_series(folder, "series", edited)  # the same geometry; one slice's pixels differ
        changed["dicom"] = "series"
    if family(bundle) == "survival":
        covariates = {"case2": "70"}
        changed["covariate"] = "case2"
    settings = bench.inputs.settings(folder, cases, covariates)
    outcome = bench.infer(out, **settings)
    redone = sorted(changed.values())
    assert outcome.status == 0 and outcome.last.startswith(f"{len(redone)} written ({len(cases) - len(redone)} already")
    lines = [w for w in outcome.warnings if "inputs that have changed" in w]
    assert len(lines) == 1 and f"({', '.join(sorted(redone, key=cases.index))})" in lines[0], outcome.warnings
    clean = infer(bundle, bench.trained, tmp_path / "clean", **settings)
    assert clean.status == 0
    assert broken_promises(out, tmp_path / "clean") == []
    for kind, row in CHANGED_ROWS.items():
        cell = f"redone (warned); {len(cases) - len(redone)} kept; exit 0" if kind in changed else None
        note(row, bundle, cell or NOT_APPLICABLE, lines[0] if kind in changed else "")


SETTING_ROWS = {
    "threads": "the thread count changed (`--num_threads 2`)",
    "bytes": "a setting the bytes depend on changed (`sw_batch_size`; mace: `batch_size`; xray2ct: `seed`)",
}


@pytest.mark.parametrize("bundle", BUNDLES)
def test_settings_the_bytes_depend_on_are_part_of_the_identity(bundle, benches, tmp_path):
    """On the CPU the thread count changes an output's last bits, and so do the windows per batch (the cases per
    batch, the seed): a re-run with another value redoes every case, so a folder never mixes outputs of two."""
    import torch

    bench = benches(bundle)
    name, value = BYTE_SETTINGS[bundle]
    threads = torch.get_num_threads()
    for kind, changed in (("threads", {"num_threads": 2}), ("bytes", {name: value})):
        out = tmp_path / kind
        shutil.copytree(bench.clean, out)
        outcome = bench.infer(out, **changed)
        assert outcome.status == 0 and outcome.last == f"{N_GOOD} written, 0 failed", outcome
        lines = [w for w in outcome.warnings if "other weights or settings" in w]
        assert len(lines) == 1 and lines[0].startswith(f"{N_GOOD} case(s)"), outcome.warnings
        clean = tmp_path / f"clean_{kind}"
        assert bench.infer(clean, **changed).status == 0
        torch.set_num_threads(threads)
        assert broken_promises(out, clean) == []
        note(SETTING_ROWS[kind], bundle, f"all {N_GOOD} redone (warned); exit 0", lines[0])


DISK_ROWS = {
    "output": "the disk fills up while an output file is written",
    "record": "the disk fills up while a case's record is written",
    "read_only": "the prediction folder is on a read-only file system",
}


def _fill_disk_at_output(monkeypatch: Any, bundle: str, case: str) -> bool:
    """Make the bundle's writer write part of ``case``'s first file, then fail with ENOSPC; ``False`` when the
    bundle writes no file per case (its cases are rows of its tables)."""
    import common.handlers.images as images

    def full(path: Any) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"\x1f\x8b\x08\x00" + b"\0" * 512)  # what a writer leaves when the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    if family(bundle) == "survival":
        return False
    if family(bundle) == "xray2ct":
        save = images.save_panel_png
        monkeypatch.setattr(
            images, "save_panel_png", lambda panel, path: full(path) if case in str(path) else save(panel, path)
        )
        return True
    save_nifti = nib.save
    monkeypatch.setattr(
        nib,
        "save",
        lambda image, path, *a, **k: full(path) if f"{case}_" in str(path) else save_nifti(image, path, *a, **k),
    )
    return True


def _fill_disk_at_record(monkeypatch: Any, case: str) -> None:
    write = cases_module.write_text_atomic

    def full(path: Path, text: str) -> Path:
        if path.name == f"{case}.json":
            raise OutputWriteError(errno.ENOSPC, f"could not write {str(path)!r}: the disk is full")
        return write(path, text)

    monkeypatch.setattr(cases_module, "write_text_atomic", full)


def _read_only(monkeypatch: Any, folder: Path) -> None:
    """Every file or folder created under ``folder`` fails with EROFS (as on a file system mounted read-only)."""
    open_file, make_dir = os.open, os.mkdir

    def refused(path: Any) -> bool:
        return str(folder) in os.path.abspath(os.fspath(path))

    def guarded_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and refused(path):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return open_file(path, flags, *args, **kwargs)

    def guarded_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if refused(path):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return make_dir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    monkeypatch.setattr(os, "mkdir", guarded_mkdir)


@pytest.mark.parametrize("bundle", BUNDLES)
def test_a_full_or_read_only_disk_stops_the_run_with_nothing_partial_and_a_rerun_completes(bundle, benches, tmp_path):
    """The disk fills up in the middle of ``case1``'s first file, or when its record is written, or the folder is
    read-only: the run stops with one ``error:`` line (exit 1), ``case1`` has a ``write`` row and no file anywhere,
    ``case0`` is complete, nothing after ``case1`` ran; the same command, once space is freed, completes the folder
    as a clean run writes it."""
    bench = benches(bundle)
    for kind in DISK_ROWS:
        out = tmp_path / kind
        with pytest.MonkeyPatch.context() as patch:
            if kind == "output" and not _fill_disk_at_output(patch, bundle, "case1"):
                note(DISK_ROWS[kind], bundle, NOT_APPLICABLE)
                continue
            if kind == "record":
                _fill_disk_at_record(patch, "case1")
            if kind == "read_only":
                out.mkdir()
                _read_only(patch, out)
            outcome = bench.infer(out)
        assert outcome.status == 1 and outcome.last.startswith("error: "), outcome
        if kind == "read_only":
            assert "is not writable: the file system is read-only" in outcome.last and "no case was run" in outcome.last
            assert not any(out.iterdir())
            cell = "refused before any case; exit 1; nothing written"
        else:
            assert "the disk is full" in outcome.last and "run the same command again" in outcome.last, outcome
            assert outcome.rows["case1"]["stage"] == "write", outcome.rows
            assert [r["case_id"] for r in records(out).values()] == ["case0"]
            assert broken_promises(out, bench.clean, complete=False) == []
            cell = "stops at once; exit 1; `write` row; no partial file"
        again = bench.infer(out)
        assert again.status == 0 and again.rows == {}, again
        assert broken_promises(out, bench.clean) == []
        note(DISK_ROWS[kind], bundle, cell + " -> re-run completes, identical", outcome.last)


def _mount(*options: str, target: Path) -> bool:
    """``mount`` a tmpfs (or remount it) at ``target``; ``False`` where this machine does not allow it."""
    command = ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(target)]
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def test_a_real_small_disk_fills_up_and_a_read_only_one_refuses(benches, tmp_path):
    """The same faults on a real file system where this machine allows mounting one (as root): a 100 KB tmpfs
    fills up at the third case; once it is made larger the same command completes the folder as a clean run;
    remounted read-only, a new prediction folder on it is refused before any case."""
    bench = benches("autoencoder_3d")
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _mount("size=100k", target=disk):
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        full = bench.infer(disk / "predictions")
        assert full.status == 1 and "the disk is full" in full.last, full
        assert 1 <= len(records(disk / "predictions")) < N_GOOD
        assert broken_promises(disk / "predictions", bench.clean, complete=False) == []
        assert _mount("remount", "size=2m", target=disk)
        again = bench.infer(disk / "predictions")
        assert again.status == 0 and broken_promises(disk / "predictions", bench.clean) == []
        assert _mount("remount", "ro", target=disk)
        refused = bench.infer(disk / "other")
        assert refused.status == 1 and "is not writable: the file system is read-only" in refused.last, refused
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)


PRODUCT_ROW = "reconstructions and latents written into one folder"


@pytest.mark.parametrize("bundle", BUNDLES)
def test_two_products_of_the_same_cases_keep_their_records(bundle, benches, tmp_path):
    bench = benches(bundle)
    if family(bundle) not in ("autoencoder", "vqgan"):  # the families with an encode mode
        note(PRODUCT_ROW, bundle, NOT_APPLICABLE)
        return
    out = tmp_path / "predictions"
    shutil.copytree(bench.clean, out)
    assert bench.infer(out, mode="encode").last == f"{N_GOOD} written, 0 failed"
    for mode in ("reconstruct", "encode"):
        again = bench.infer(out, mode=mode)
        assert again.status == 0 and again.last == f"0 written ({N_GOOD} already written, skipped), 0 failed", again
    assert all((out / name).is_file() for record in records(out).values() for name in record["outputs"])
    note(PRODUCT_ROW, bundle, "kept apart: a re-run of either mode skips all; exit 0", again.last)


INTERRUPT_ROW = "Ctrl-C (SIGINT), then the same command"


@pytest.mark.parametrize("bundle", BUNDLES)
def test_ctrl_c_stops_after_the_case_in_progress_and_the_same_command_goes_on(bundle, benches, tmp_path, monkeypatch):
    bench = benches(bundle)
    commit = cases_module.CaseRun._commit
    sent = []

    def interrupted_after_the_first(self: Any, *args: Any, **kwargs: Any) -> None:
        commit(self, *args, **kwargs)
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(cases_module.CaseRun, "_commit", interrupted_after_the_first)
    out = tmp_path / "predictions"
    outcome = bench.infer(out)
    monkeypatch.undo()
    assert outcome.status == 130, outcome
    written = len(records(out))
    assert 1 <= written < N_GOOD and broken_promises(out, bench.clean, complete=False) == []
    again = bench.infer(out)
    assert again.status == 0 and again.last.startswith(f"{N_GOOD - written} written ({written} already"), again
    assert broken_promises(out, bench.clean) == []
    note(
        INTERRUPT_ROW, bundle, "stops after the case in progress; exit 130 -> re-run completes, identical", INTERRUPTED
    )


# ------------------------------------------------------------------------------------------------ the identity, by id

ID_ROW = "every top-level id of `inference.json` changed on a finished folder (generated)"


def _another(value: Any) -> Any:
    """Another value of the same kind as the resolved ``value``: a flipped switch, another number, a longer string
    or list, a changed first item, the other kind of device; ``None`` becomes 1."""
    import torch

    if isinstance(value, torch.device):
        return "cuda" if value.type == "cpu" else "cpu"
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 if value else 0.5
    if isinstance(value, str):
        return value + "_changed"
    if isinstance(value, (list, tuple)):
        return [_another(value[0]), *value[1:]] if value else [1]
    if isinstance(value, dict):
        key = next(iter(value), "changed")
        return {**value, key: _another(value.get(key))}
    return 1


def _changed_raw(raw: Any) -> Any:
    """A component or expression as written, changed: its first plain value, else the expression's text."""
    if isinstance(raw, str):
        return raw + " "  # the same code, written otherwise: the identity is the config as written
    if isinstance(raw, dict):
        for key, value in raw.items():
            if key != "_target_" and (not isinstance(value, str) or value[:1] not in "$@%"):
                return {**raw, key: _another(value)}
        return {**raw, "_disabled_": True}
    return [*raw, raw[-1]] if raw else [1]


def _parsed(bundle: str, bench: Bench, **changed: Any) -> Any:
    """The bundle's ``inference.json`` on the bench's finished run as a parsed ``ConfigParser``, with ``changed`` as
    overrides; its settings checks resolved first, as the workflow's ``initialize`` does."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(BUNDLES_DIR / bundle / "configs" / "inference.json"))
    parser.update({"bundle_root": str(BUNDLES_DIR / bundle), "output_dir": str(bench.trained), **bench.settings})
    parser.update({"prediction_dir": str(bench.work / "identity"), "num_threads": 1, **changed})
    parser.parse()
    parser.get_parsed_content("check_settings")
    return parser


def _identity_of(bundle: str, bench: Bench, **changed: Any) -> dict[str, Any]:
    """The config part of the identity of the bundle's inference on the bench's finished run (what
    :class:`common.engines.cases.CaseRun` takes), with ``changed`` as overrides."""
    from common.engines.identity import config_identity

    return config_identity(_parsed(bundle, bench, **changed).ref_resolver)


@pytest.mark.parametrize("bundle", BUNDLES)
def test_every_inference_id_changes_the_identity_or_is_refused_or_is_proven_free(bundle, benches):
    """Generated from the bundle's own ``inference.json``: changing any top-level id's value on a finished run is
    refused by the settings checks (a trained setting the network's input depends on among them), or changes the
    identity of the cases (they are redone, as a fresh run with that value makes them: the settings row of the
    fault matrix), or the id is one of ``NOT_IN_IDENTITY``, whose outputs the next test shows byte-identical. A new id
    or a new bundle is covered without editing this test."""
    from common.engines.identity import NOT_IN_IDENTITY
    from common.runs import FREE_AT_INFERENCE, is_plain, trained_ids

    bench = benches(bundle)
    base = _identity_of(bundle, bench)
    raw = json.loads((BUNDLES_DIR / bundle / "configs" / "inference.json").read_text())
    trained = set(trained_ids(BUNDLES_DIR / bundle))
    resolved = _parsed(bundle, bench)
    outcomes: dict[str, list[str]] = {"refused": [], "redone": [], "free": []}
    for key, value in raw.items():
        if key in NOT_IN_IDENTITY:
            outcomes["free"].append(key)
            continue
        settled = f"={key}" in base or is_plain(value)  # a value: another one; else the code as written, changed
        new = _another(resolved.get_parsed_content(key)) if settled else _changed_raw(value)
        try:
            identity = _identity_of(bundle, bench, **{key: new})
        except Exception as exc:  # noqa: BLE001 - a user error (MONAI wraps it) is a refusal, anything else is not
            if user_error_in_chain(exc) is None:
                raise AssertionError(f"{bundle}: {key}={new!r} ends in {exc!r}, not a user error") from exc
            outcomes["refused"].append(key)
            continue
        if key in trained and key not in FREE_AT_INFERENCE:
            pytest.fail(f"{bundle}: {key!r} reads the trained run but another value of it is not refused")
        assert identity != base, f"{bundle}: changing {key!r} to {new!r} leaves the identity as it was"
        outcomes["redone"].append(key)
    assert outcomes["redone"] and sorted(outcomes["free"]) == sorted(set(NOT_IN_IDENTITY) & set(raw))
    assert (trained & set(raw)) - set(FREE_AT_INFERENCE) <= set(outcomes["refused"])
    counts = {kind: len(ids) for kind, ids in outcomes.items()}
    note(
        ID_ROW,
        bundle,
        f"{len(raw)} ids: {counts['refused']} refused, {counts['redone']} redone, {counts['free']} byte-identical",
    )


@pytest.mark.parametrize("bundle", BUNDLES)
def test_the_ids_left_out_of_the_identity_change_no_output_byte(bundle, benches, tmp_path):
    """Each id of ``NOT_IN_IDENTITY`` at another value writes the clean run's bytes (``distributed``: the torchrun
    test of ``tests/test_cohort_inference.py`` writes one process's bytes), and a finished folder re-run with it
    skips every case."""
    from common.engines.identity import NOT_IN_IDENTITY

    changes = {"progress": False, "num_workers": 1, "fail_fast": True, "overwrite": True, "dist_timeout": 60}
    changes["verify_inputs"] = True
    assert set(changes) | {"distributed", "prediction_dir"} == set(NOT_IN_IDENTITY)
    bench = benches(bundle)
    for key, value in changes.items():
        fresh = tmp_path / key
        assert bench.infer(fresh, **{key: value}).status == 0
        assert broken_promises(fresh, bench.clean) == [], key
        again = bench.infer(fresh, **{key: not value if isinstance(value, bool) else 0 if key == "num_workers" else 30})
        assert again.last.startswith(f"0 written ({N_GOOD} already written"), (key, again)
    moved = tmp_path / "moved"
    shutil.copytree(bench.clean, moved)  # another prediction_dir holding the same folder
    assert bench.infer(moved).last.startswith(f"0 written ({N_GOOD} already written")


@pytest.mark.parametrize("bundle", BUNDLES)
def test_evaluation_refuses_another_value_of_every_trained_setting(bundle, benches):
    """Generated from the bundle's own ``evaluate.json``: every id it reads from the trained run
    (``"$@trained['<id>']"``) given another value is refused by the settings preamble, naming both values, unless
    it is free at inference; the figures of an evaluation run again replace its own
    (``tests/test_handlers_monitor.py``)."""
    from monai.bundle import ConfigParser

    from common.runs import FREE_AT_INFERENCE, trained_ids

    bench = benches(bundle)
    files = [str(BUNDLES_DIR / bundle / "configs" / name) for name in ("train.json", "evaluate.json")]
    base = {"bundle_root": str(BUNDLES_DIR / bundle), "output_dir": str(bench.trained)}
    reference = ConfigParser()
    reference.read_config(files)
    reference.update(base)
    refused = []
    for key in trained_ids(BUNDLES_DIR / bundle):
        if key in FREE_AT_INFERENCE or key not in reference.get():
            continue
        parser = ConfigParser()
        parser.read_config(files)
        parser.update({**base, key: _another(reference.get_parsed_content(key))})
        parser.parse()
        with pytest.raises(Exception) as raised:  # noqa: PT011 - MONAI wraps the user error
            parser.get_parsed_content("check_settings")
        error = user_error_in_chain(raised.value)
        assert error is not None and f"{key!r} is " in str(error) and "trained with" in str(error), (key, raised)
        refused.append(key)
    assert refused


OUTPUT_ROWS = {
    "truncated": "an output file truncated to half its bytes",
    "emptied": "an output file emptied to 0 bytes",
    "swapped": "two cases' output files swapped (each keeping its modification time)",
    "removed": "an output file removed",
}


def _damage(folder: Path, kind: str) -> list[str]:
    """Damage the outputs of ``folder`` as ``kind`` says; the cases whose outputs were damaged."""
    found = records(folder)
    named = [(r["case_id"], r["outputs"][0]) for r in found.values() if r["outputs"]]
    (case, name), (other, other_name) = named[0], named[1]
    path = folder / name
    if kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "emptied":
        path.write_bytes(b"")
    elif kind == "removed":
        path.unlink()
    else:
        os.replace(path, folder / "swap.tmp")
        os.replace(folder / other_name, path)
        os.replace(folder / "swap.tmp", folder / other_name)
        return [case, other]
    return [case]


@pytest.mark.parametrize("bundle", BUNDLES)
def test_a_damaged_output_is_redone_and_the_tables_rebuilt(bundle, benches, tmp_path):
    """A re-run verifies every written case's files against its record (size and modification time, else the
    sha256): a truncated, emptied, swapped or removed output is redone with one warning naming the cases, and the
    folder - its tables too - is then the clean run's."""
    bench = benches(bundle)
    for kind, row in OUTPUT_ROWS.items():
        out = tmp_path / kind
        shutil.copytree(bench.clean, out)
        if not any(r["outputs"] for r in records(out).values()):
            (out / "predictions.csv").write_text("case_id\n")  # mace writes rows, not files: a damaged table
            outcome = bench.infer(out)
            assert outcome.last.startswith(f"0 written ({N_GOOD} already written"), outcome
            assert broken_promises(out, bench.clean) == []
            note(row, bundle, "no file per case; a damaged `predictions.csv` is rebuilt from the records; exit 0")
            continue
        damaged = _damage(out, kind)
        outcome = bench.infer(out)
        expected = f"{len(damaged)} written ({N_GOOD - len(damaged)} already written, skipped), 0 failed"
        assert outcome.status == 0 and outcome.last == expected, outcome
        lines = [w for w in outcome.warnings if "no longer hold the bytes written" in w]
        assert len(lines) == 1 and f"({', '.join(sorted(damaged))})" in lines[0], outcome.warnings
        assert broken_promises(out, bench.clean) == []
        note(row, bundle, f"{len(damaged)} redone (warned); exit 0", lines[0])


# ------------------------------------------------------------------------------------------------ the table

ROWS = (
    SETTING_ROW,
    COLLIDE_ROW,
    *CHANGED_ROWS.values(),
    *INPUT_ROWS,
    CELL_ROW,
    *DISK_ROWS.values(),
    *SETTING_ROWS.values(),
    PRODUCT_ROW,
    INTERRUPT_ROW,
    ID_ROW,
    *OUTPUT_ROWS.values(),
)


def matrix_table() -> str:
    """The fault matrix as a markdown table: a row per fault, a column per bundle, and what the user is told."""
    lines = [
        f"| fault | {' | '.join(f'`{b}`' for b in BUNDLES)} | what the user is told (first bundle) |",
        "|" + "---|" * (len(BUNDLES) + 2),
    ]
    for row in ROWS:
        cells = [MATRIX[(row, bundle)] for bundle in BUNDLES]
        told = _short(TOLD.get(row, "")).replace("|", "\\|")
        lines.append(f"| {row} | {' | '.join(cells)} | {told} |")
    cells = [MATRIX[(row, bundle)] for row in ROWS for bundle in BUNDLES]
    measured = sum(cell != NOT_APPLICABLE for cell in cells)
    lines += [
        "",
        f"{len(ROWS)} rows x {len(BUNDLES)} bundles: {measured} cells measured, {len(cells) - measured} not applicable.",
    ]
    return "\n".join(lines)


def test_the_fault_matrix_in_the_docs_is_the_one_measured():
    """The table in docs/reliability.md is the one this module measured (``WRITE_FAULT_MATRIX=1`` writes it); it
    runs after the faults, and only when all of them ran."""
    missing = [(row, bundle) for row in ROWS for bundle in BUNDLES if (row, bundle) not in MATRIX]
    if missing:
        pytest.skip(f"{len(missing)} cells were not measured in this run (e.g. {missing[0]})")
    measured = sum(cell != NOT_APPLICABLE for cell in MATRIX.values())
    assert len(ROWS) >= 16 and measured >= 80
    table = f"{BEGIN}\n{matrix_table()}\n{END}"
    text = DOCS.read_text(encoding="utf-8")
    if os.environ.get("WRITE_FAULT_MATRIX"):
        start, end = text.index(BEGIN), text.index(END) + len(END)
        DOCS.write_text(text[:start] + table + text[end:], encoding="utf-8")
        text = DOCS.read_text(encoding="utf-8")
    assert table in text, "docs/reliability.md has another fault matrix: WRITE_FAULT_MATRIX=1 writes this one"

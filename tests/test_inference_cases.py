# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``common.engines.cases``: an inference run over a folder where cases fail at every stage (header check, reading,
the model, writing) writes the others, lists the failures in ``failures.csv`` and restarts where it stopped; a full
disk or a folder that refuses files stops it with nothing partial left; a re-run redoes exactly the cases whose
inputs, weights or settings changed."""

from __future__ import annotations

import csv
import errno
import hashlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pytest
import torch
from ignite.engine import Engine, Events
from monai.engines import SupervisedEvaluator
from monai.transforms import Compose, EnsureChannelFirstd, Lambdad

from common.data.dicom import LoadVolumed
from common.data.pipeline import CaseMetad, case_name_formatter, nifti_saver
from common.data.preflight import PreflightError, screen_entries
from common.engines.cases import (
    DONE_DIR,
    EXIT_NONE_WRITTEN,
    EXIT_SOME_FAILED,
    FAILURES_CSV,
    PROBLEMS_KEY,
    CaseDataset,
    CaseFailedError,
    CaseLoader,
    CaseRun,
)
from common.errors import UserError
from common.utils import OutputWriteError
from tests.helpers import written_tree

MODEL_FAILS_AT = 7.0  # a volume filled with this value makes the network raise
WRITE_FAILS_AT = 9.0  # ... and this one makes the writer raise (a file name too long: that case only)


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(torch.all(sample == MODEL_FAILS_AT) for sample in x):
            raise RuntimeError("the network refuses this volume")
        return 2 * x


def _refused_write(x):
    if torch.all(x == 2 * WRITE_FAILS_AT):
        raise OSError(errno.ENAMETOOLONG, "File name too long")
    return x


def write_cases(folder: Path) -> dict[str, str]:
    """Eleven cases: six good, and one failing at each stage; returns the expected stage of the failing ones."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(6):
        nib.save(nib.Nifti1Image(rng.random((6, 7, 5)).astype(np.float32), np.eye(4)), folder / f"good{i}.nii.gz")
    nib.save(nib.Nifti1Image(np.full((6, 7, 5), MODEL_FAILS_AT, np.float32), np.eye(4)), folder / "model.nii.gz")
    nib.save(nib.Nifti1Image(np.full((6, 7, 5), WRITE_FAILS_AT, np.float32), np.eye(4)), folder / "write.nii.gz")
    data = (folder / "good0.nii.gz").read_bytes()
    (folder / "truncated.nii.gz").write_bytes(data[:-40])  # the header is whole, the voxels are not
    nib.save(nib.Nifti1Image(np.zeros((6, 7), np.float32), np.eye(4)), folder / "flat.nii.gz")
    (folder / "text.nii.gz").write_text("not an image")
    return {"model": "model", "write": "write", "truncated": "read", "flat": "check", "text": "check"}


def entries(folder: Path) -> list[dict]:
    return [{"image": str(p)} for p in sorted(folder.glob("*.nii.gz"))]


def run_cases(
    folder: Path,
    out: Path,
    batch_size: int = 1,
    postfixes: tuple[str, ...] = ("out",),
    num_workers: int = 0,
    make_entries: Callable[[Path], list[dict]] = entries,
    network: torch.nn.Module | None = None,
    inferer: Any = None,
    **settings,
) -> tuple[dict, CaseRun]:
    """One inference run over ``folder`` into ``out`` writing one file per postfix and case: ``(finish()'s summary,
    the run)``."""
    cases = CaseRun(out, check=lambda e: screen_entries(e, num_channels=1), **settings)
    preprocessing = Compose([LoadVolumed("image", image_only=True), EnsureChannelFirstd("image")])
    dataset = CaseDataset(cases.select(make_entries(folder)), preprocessing)
    loader = CaseLoader(dataset, cases, batch_size=batch_size, num_workers=num_workers)
    postprocessing = Compose(
        [
            Lambdad("pred", _refused_write),
            CaseMetad("pred"),
            *[nifti_saver("pred", cases.staging_dir, p, name_formatter=case_name_formatter) for p in postfixes],
        ]
    )
    evaluator = SupervisedEvaluator(
        device="cpu",
        val_data_loader=loader,
        network=network or Doubler(),
        postprocessing=postprocessing,
        val_handlers=[cases],
        **({"inferer": inferer} if inferer is not None else {}),
    )
    evaluator.run()
    return cases.finish(), cases


def failures(out: Path) -> dict[str, dict]:
    with open(out / FAILURES_CSV, newline="") as handle:
        return {row["case_id"]: row for row in csv.DictReader(handle)}


@pytest.mark.parametrize("batch_size, num_workers", [(1, 0), (3, 0), (1, 2)])
def test_every_stage_fails_its_case_only(tmp_path, batch_size, num_workers):
    """Six good cases are written, each failing case is one row naming its stage and cause; with batches of three
    a model or write failure is redone case by case, so only the culprit fails; worker processes pass the reading
    failures on."""
    expected = write_cases(tmp_path / "in")
    summary, _ = run_cases(tmp_path / "in", tmp_path / "out", batch_size=batch_size, num_workers=num_workers)
    assert summary == {"written": 6, "skipped": 0, "failed": 5, "status": EXIT_SOME_FAILED}
    written = sorted(p.name for p in (tmp_path / "out").glob("*_out.nii.gz"))
    assert written == [f"good{i}_out.nii.gz" for i in range(6)]
    rows = failures(tmp_path / "out")
    assert {case: row["stage"] for case, row in rows.items()} == expected
    assert list(rows) == sorted(rows)  # the order of the inputs
    assert "EOFError" in rows["truncated"]["reason"] and "3D volume is required" in rows["flat"]["reason"]
    assert "refuses this volume" in rows["model"]["reason"] and "File name too long" in rows["write"]["reason"]
    assert rows["text"]["input"] == str(tmp_path / "in" / "text.nii.gz")
    assert not (tmp_path / "out" / ".staging").exists()
    saved = nib.load(tmp_path / "out" / "good0_out.nii.gz").get_fdata()
    source = nib.load(tmp_path / "in" / "good0.nii.gz").get_fdata()
    np.testing.assert_allclose(saved, 2 * source, rtol=1e-6)


def test_the_files_of_a_batch_go_to_their_cases(tmp_path):
    """Two files per case, three cases per batch: each record lists its case's two files, named after it."""
    write_cases(tmp_path / "in")
    summary, _ = run_cases(tmp_path / "in", tmp_path / "out", batch_size=3, postfixes=("a", "b"))
    assert summary["written"] == 6
    for i in range(6):
        record = json.loads((tmp_path / "out" / DONE_DIR / f"good{i}.json").read_text())
        assert record["outputs"] == [f"good{i}_a.nii.gz", f"good{i}_b.nii.gz"]


def test_a_restart_skips_what_is_written_and_overwrite_redoes_it(tmp_path):
    write_cases(tmp_path / "in")
    first, _ = run_cases(tmp_path / "in", tmp_path / "out")
    before = written_tree(tmp_path / "out")
    again, run = run_cases(tmp_path / "in", tmp_path / "out")
    assert again == {"written": 0, "skipped": 6, "failed": 5, "status": EXIT_SOME_FAILED}
    assert run.total == 5  # only the failed cases were tried again
    assert written_tree(tmp_path / "out") == before
    redone, _ = run_cases(tmp_path / "in", tmp_path / "out", overwrite=True)
    assert redone["written"] == 6 and redone["skipped"] == 0
    assert written_tree(tmp_path / "out") == before  # the same bytes
    record = json.loads((tmp_path / "out" / DONE_DIR / "good0.json").read_text())
    assert record["outputs"] == ["good0_out.nii.gz"] and record["input"].endswith("good0.nii.gz")


def test_outputs_of_other_weights_are_redone(tmp_path, caplog):
    write_cases(tmp_path / "in")
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"one")
    run_cases(tmp_path / "in", tmp_path / "out", identity={"weights": str(weights)})
    same, _ = run_cases(tmp_path / "in", tmp_path / "out", identity={"weights": str(weights)})
    assert same["skipped"] == 6
    weights.write_bytes(b"two")  # the same path, other weights
    with caplog.at_level("WARNING"):
        other, _ = run_cases(tmp_path / "in", tmp_path / "out", identity={"weights": str(weights)})
    assert other["skipped"] == 0 and other["written"] == 6
    assert "6 case(s)" in caplog.text and "other weights or settings" in caplog.text


def test_a_missing_output_makes_its_case_undone(tmp_path):
    write_cases(tmp_path / "in")
    run_cases(tmp_path / "in", tmp_path / "out")
    (tmp_path / "out" / "good3_out.nii.gz").unlink()
    summary, _ = run_cases(tmp_path / "in", tmp_path / "out")
    assert summary["written"] == 1 and summary["skipped"] == 5
    assert (tmp_path / "out" / "good3_out.nii.gz").is_file()


def test_fail_fast_stops_at_the_first_problem(tmp_path):
    write_cases(tmp_path / "in")
    with pytest.raises(PreflightError) as checked:
        run_cases(tmp_path / "in", tmp_path / "out", fail_fast=True)
    assert len(checked.value.problems) == 2  # every header problem, listed at once
    assert not (tmp_path / "out").exists()
    (tmp_path / "in" / "flat.nii.gz").unlink()
    (tmp_path / "in" / "text.nii.gz").unlink()
    with pytest.raises(CaseFailedError, match=r"case model \(.*model.nii.gz\) failed at model: RuntimeError"):
        run_cases(tmp_path / "in", tmp_path / "out", fail_fast=True)
    assert not (tmp_path / "out" / FAILURES_CSV).exists()


def test_nothing_written_is_exit_status_1(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.nii.gz").write_text("no")  # fails the check
    volume = np.random.default_rng(1).random((20, 20, 20)).astype(np.float32)
    nib.save(nib.Nifti1Image(volume, np.eye(4)), tmp_path / "b.nii.gz")
    data = (tmp_path / "b.nii.gz").read_bytes()
    (tmp_path / "in" / "b.nii.gz").write_bytes(data[: len(data) // 2])  # fails when read: the loader yields nothing
    summary, _ = run_cases(tmp_path / "in", tmp_path / "out")
    assert summary == {"written": 0, "skipped": 0, "failed": 2, "status": EXIT_NONE_WRITTEN}
    cases = CaseRun(tmp_path / "out")
    cases.select([])
    assert cases.finish()["status"] == 0
    assert not (tmp_path / "out" / FAILURES_CSV).exists()  # the old list is gone with its failures


def test_the_exit_code_and_the_last_line(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.nii.gz").write_text("no")
    cases = CaseRun(tmp_path / "out", check=screen_entries)
    assert cases.select(entries(tmp_path / "in")) == []
    assert cases.exit_code == 0 and cases.finish()["status"] == cases.exit_code == EXIT_NONE_WRITTEN
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"0 written, 1 failed: see {tmp_path / 'out' / FAILURES_CSV}"
    )


def test_bad_settings_and_inputs_are_refused(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="'overwrite' must be true or false"):
        CaseRun(tmp_path, overwrite="yes")
    with pytest.raises(UserError, match="2 case id"):
        CaseRun(tmp_path).select(
            [{"image": "/a/x.nii.gz"}, {"image": "/b/x.nii.gz"}, {"case_id": "y"}, {"case_id": "y"}]
        )
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="multi_gpu_inference.json"):
        CaseRun(tmp_path)


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(tmp_path, caplog, capsys, monkeypatch):
    write_cases(tmp_path / "in")
    with caplog.at_level("INFO"):
        run_cases(tmp_path / "in", tmp_path / "logged", log_every_s=0.0)
    lines = [r.getMessage() for r in caplog.records if re.match(r"\d+/11 case\(s\)", r.getMessage())]
    assert len(lines) == 11 and lines[-1].startswith("11/11 case(s), ")  # every case counted, failed ones too
    # no rate before a case ran (the two cases failing their check), then the rate of the cases run
    assert lines[:2] == ["1/11 case(s)", "2/11 case(s)"] and all("case/s, about" in line for line in lines[2:])
    assert any(r.getMessage().startswith("9 case(s) run in ") for r in caplog.records)  # the run's throughput
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    caplog.clear()
    with caplog.at_level("INFO"):
        run_cases(tmp_path / "in", tmp_path / "bar", log_every_s=0.0)
    bar = capsys.readouterr().err
    assert "inference: 100%" in bar and "11/11" in bar and "case/s" in bar
    assert not [r for r in caplog.records if "case/s, about" in r.getMessage()]


def _volume(path: Path, value: float | None = None, seed: int = 5) -> np.ndarray:
    data = np.random.default_rng(seed).random((6, 7, 5)).astype(np.float32) if value is None else None
    data = np.full((6, 7, 5), value, np.float32) if data is None else data
    nib.save(nib.Nifti1Image(data, np.eye(4)), path)
    return data


def _break_nibabel_save(monkeypatch, failing: str, code: int = errno.ENOSPC) -> None:
    """Make the NIfTI writer write part of ``failing``'s file, then fail with ``code`` (a disk filling up)."""
    save = nib.save

    def broken(image, filename, *args, **kwargs):
        if failing in str(filename):
            Path(filename).write_bytes(b"\x1f\x8b" + b"\0" * 100)
            raise OSError(code, "No space left on device" if code == errno.ENOSPC else "Read-only file system")
        return save(image, filename, *args, **kwargs)

    monkeypatch.setattr(nib, "save", broken)


def test_a_full_disk_stops_the_run_at_once_and_a_rerun_completes_byte_identical(tmp_path, monkeypatch, capsys):
    """The writer runs out of space in the middle of ``good2``'s file: that case gets a ``write`` row, its partial
    file is nowhere, no later case runs, and the run ends with one error naming the cause; a re-run after space is
    freed writes exactly the files of an uninterrupted run."""
    write_cases(tmp_path / "in")
    run_cases(tmp_path / "in", tmp_path / "reference")
    _break_nibabel_save(monkeypatch, "good2_out")
    with pytest.raises(OutputWriteError, match="the disk is full") as stopped:
        run_cases(tmp_path / "in", tmp_path / "out")
    assert stopped.value.errno == errno.ENOSPC and "run the same command again" in str(stopped.value)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("*.nii.gz")) == ["good0_out.nii.gz", "good1_out.nii.gz"]
    assert not list(out.rglob("good2*")) and not (out / ".staging").exists()
    assert failures(out)["good2"]["stage"] == "write"
    assert capsys.readouterr().out.strip().endswith(f"2 written, 3 failed: see {out / FAILURES_CSV}")
    monkeypatch.undo()  # space is freed
    again, _ = run_cases(tmp_path / "in", out)
    assert again == {"written": 4, "skipped": 2, "failed": 5, "status": EXIT_SOME_FAILED}
    assert written_tree(out) == written_tree(tmp_path / "reference")


@pytest.mark.parametrize("where", ["record", "move"])
def test_a_refused_record_or_move_leaves_no_output_of_the_case(tmp_path, monkeypatch, where):
    """A read-only file system met when the record of ``good1`` is written (after its file was moved) or when its
    file is moved: the case's file is not left behind, and the run stops."""
    import common.engines.cases as cases_module

    write_cases(tmp_path / "in")
    if where == "record":
        write = cases_module.write_text_atomic

        def refuse(path, text):
            if path.name == "good1.json":
                raise OutputWriteError(errno.EROFS, f"could not write {str(path)!r}: the file system is read-only")
            return write(path, text)

        monkeypatch.setattr(cases_module, "write_text_atomic", refuse)
    else:
        replace = cases_module.os.replace

        def refuse_move(source, target):
            if Path(target).name == "good1_out.nii.gz":
                raise OSError(errno.EROFS, "Read-only file system")
            return replace(source, target)

        monkeypatch.setattr(cases_module.os, "replace", refuse_move)
    with pytest.raises(OutputWriteError, match="read-only"):
        run_cases(tmp_path / "in", tmp_path / "out")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("*.nii.gz")) == ["good0_out.nii.gz"]
    assert not (out / DONE_DIR / "good1.json").exists() and failures(out)["good1"]["stage"] == "write"


def test_a_folder_that_refuses_files_is_found_before_any_case_runs(tmp_path, monkeypatch):
    import common.engines.cases as cases_module

    write_cases(tmp_path / "in")
    mkstemp = cases_module.tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == tmp_path / "out":
            raise OSError(errno.EROFS, "Read-only file system")
        return mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(cases_module.tempfile, "mkstemp", read_only)
    network = Doubler()
    calls = []
    network.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(
        OutputWriteError, match=r"prediction folder .*out' is not writable: the file system is read-only"
    ):
        run_cases(tmp_path / "in", tmp_path / "out", network=network)
    assert calls == [] and not list((tmp_path / "out").rglob("*.nii.gz"))


def test_changed_inputs_are_redone_and_only_they(tmp_path, caplog):
    """A volume replaced by another is redone (one warning naming it); a volume whose file was rewritten with the
    same bytes (a new modification time) is not: its sha256 decides; an entry value (a covariate) that changed
    makes its case redone too."""
    write_cases(tmp_path / "in")
    with_age = lambda folder: [dict(e, age=60 if "good4" in e["image"] else 50) for e in entries(folder)]  # noqa: E731
    run_cases(tmp_path / "in", tmp_path / "out", make_entries=with_age)
    new = _volume(tmp_path / "in" / "good1.nii.gz", seed=99)
    (tmp_path / "in" / "good2.nii.gz").write_bytes((tmp_path / "in" / "good2.nii.gz").read_bytes())
    changed_age = lambda folder: [dict(e, age=61 if "good4" in e["image"] else 50) for e in entries(folder)]  # noqa: E731
    with caplog.at_level("WARNING"):
        again, _ = run_cases(tmp_path / "in", tmp_path / "out", make_entries=changed_age)
    assert again["written"] == 2 and again["skipped"] == 4
    lines = [r.getMessage() for r in caplog.records if "inputs that have changed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("2 case(s)") and "(good1, good4)" in lines[0]
    np.testing.assert_allclose(nib.load(tmp_path / "out" / "good1_out.nii.gz").get_fdata(), 2 * new, rtol=1e-6)
    record = json.loads((tmp_path / "out" / DONE_DIR / "good1.json").read_text())
    (printed,) = record["inputs"]["files"]["image"]
    assert printed["path"] == str(tmp_path / "in" / "good1.nii.gz")
    assert printed["sha256"] == hashlib.sha256((tmp_path / "in" / "good1.nii.gz").read_bytes()).hexdigest()


def test_two_case_ids_never_share_an_output_file(tmp_path):
    """Case ids ``p1/ct`` and ``p2/ct`` (one file name, two folders) write two files, each holding its own case."""
    write_cases(tmp_path / "in")
    folder = tmp_path / "in"
    listed = lambda _: [  # noqa: E731
        {"case_id": "p1/ct", "image": str(folder / "good0.nii.gz")},
        {"case_id": "p2/ct", "image": str(folder / "good1.nii.gz")},
    ]
    summary, _ = run_cases(folder, tmp_path / "out", make_entries=listed)
    assert summary["written"] == 2
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("*.nii.gz")) == ["p1%2Fct_out.nii.gz", "p2%2Fct_out.nii.gz"]
    for name, source in (("p1%2Fct", "good0"), ("p2%2Fct", "good1")):
        expected = 2 * nib.load(folder / f"{source}.nii.gz").get_fdata()
        np.testing.assert_allclose(nib.load(out / f"{name}_out.nii.gz").get_fdata(), expected, rtol=1e-6)


def test_ids_a_case_insensitive_folder_would_merge_are_refused(tmp_path, monkeypatch):
    write_cases(tmp_path / "in")
    folder = tmp_path / "in"
    listed = lambda _: [  # noqa: E731
        {"case_id": "Ab", "image": str(folder / "good0.nii.gz")},
        {"case_id": "aB", "image": str(folder / "good1.nii.gz")},
    ]
    run_cases(folder, tmp_path / "sensitive", make_entries=listed)  # told apart here: both written
    monkeypatch.setattr("common.engines.cases._case_insensitive", lambda folder: True)
    with pytest.raises(UserError, match=r"differ only in upper/lower case \(Ab / aB\)"):
        run_cases(folder, tmp_path / "insensitive", make_entries=listed)
    assert not list((tmp_path / "insensitive").rglob("*.nii.gz"))


def test_non_finite_volumes_and_problem_rows_fail_their_check(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    _volume(folder / "good.nii.gz")
    _volume(folder / "nan.nii.gz", value=np.nan)
    data = _volume(folder / "inf.nii.gz")
    data[0, 0, 0] = np.inf
    nib.save(nib.Nifti1Image(data, np.eye(4)), folder / "inf.nii.gz")
    with_row = lambda f: [*entries(f), {"case_id": "row 7", "image": "", PROBLEMS_KEY: ["row 7: 'age' is 'abc'"]}]  # noqa: E731
    summary, _ = run_cases(folder, tmp_path / "out", make_entries=with_row)
    assert summary == {"written": 1, "skipped": 0, "failed": 3, "status": EXIT_SOME_FAILED}
    rows = failures(tmp_path / "out")
    assert {case: row["stage"] for case, row in rows.items()} == {"inf": "check", "nan": "check", "row 7": "check"}
    assert "210 NaN and 0 infinite voxel(s) of 210" in rows["nan"]["reason"]
    assert "0 NaN and 1 infinite" in rows["inf"]["reason"] and "'age' is 'abc'" in rows["row 7"]["reason"]


def test_a_read_that_the_system_refuses_is_a_read_failure(tmp_path, monkeypatch):
    write_cases(tmp_path / "in")
    load = nib.load
    seen = []

    def unreadable(path, *args, **kwargs):
        if "good3" in str(path):
            seen.append(path)
            if len(seen) > 1:  # the header check reads it; the loader cannot
                raise OSError(errno.EIO, "Input/output error")
        return load(path, *args, **kwargs)

    monkeypatch.setattr(nib, "load", unreadable)
    run_cases(tmp_path / "in", tmp_path / "out")
    row = failures(tmp_path / "out")["good3"]
    assert row["stage"] == "read" and "Input/output error" in row["reason"]


def test_products_keep_their_own_records(tmp_path):
    """Two products of the same cases in one folder (an autoencoder's reconstructions and latents) do not redo
    each other's cases."""
    write_cases(tmp_path / "in")
    run_cases(tmp_path / "in", tmp_path / "out", postfixes=("recon",), product="reconstruct")
    run_cases(tmp_path / "in", tmp_path / "out", postfixes=("latent",), product="encode")
    for postfix, product in (("recon", "reconstruct"), ("latent", "encode")):
        again, _ = run_cases(tmp_path / "in", tmp_path / "out", postfixes=(postfix,), product=product)
        assert again["skipped"] == 6 and again["written"] == 0
        assert (tmp_path / "out" / DONE_DIR / product / "good0.json").is_file()


def test_the_thread_count_on_the_cpu_is_part_of_the_identity(tmp_path, caplog):
    write_cases(tmp_path / "in")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        run_cases(tmp_path / "in", tmp_path / "out", device="cpu")
        same, _ = run_cases(tmp_path / "in", tmp_path / "out", device="cpu")
        assert same["skipped"] == 6
        torch.set_num_threads(2)
        with caplog.at_level("WARNING"):
            other, _ = run_cases(tmp_path / "in", tmp_path / "out", device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert other["written"] == 6 and "6 case(s)" in caplog.text and "other weights or settings" in caplog.text


class WindowHungry(torch.nn.Module):
    """Runs out of (pretend) GPU memory when given more than two windows at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 2 * x


def test_settings_changed_by_the_run_itself_are_recorded(tmp_path):
    """The out-of-memory back-off halves ``sw_batch_size`` from 8 to 2: every record says so, and a re-run of the
    same command keeps them; a case of a failed batch, redone alone, says it was made in a batch of one."""
    from common.networks.wrappers import BackoffSlidingWindowInferer

    write_cases(tmp_path / "in")
    inferer = BackoffSlidingWindowInferer(roi_size=(4, 4, 4), sw_batch_size=8, overlap=0.0)
    run_cases(tmp_path / "in", tmp_path / "out", network=WindowHungry(), inferer=inferer, windows=[inferer])
    record = json.loads((tmp_path / "out" / DONE_DIR / "good0.json").read_text())
    assert record["effective"] == {"sw_batch_size": [2]}
    inferer = BackoffSlidingWindowInferer(roi_size=(4, 4, 4), sw_batch_size=8, overlap=0.0)
    again, _ = run_cases(tmp_path / "in", tmp_path / "out", network=WindowHungry(), inferer=inferer, windows=[inferer])
    assert again["skipped"] == 7 and again["written"] == 0  # six good ones and the model case: this network takes it

    folder = tmp_path / "batch"
    folder.mkdir()
    (folder / "a.nii.gz").write_bytes((tmp_path / "in" / "good0.nii.gz").read_bytes())
    (folder / "b.nii.gz").write_bytes((tmp_path / "in" / "model.nii.gz").read_bytes())
    run_cases(folder, tmp_path / "batched", batch_size=2)
    assert json.loads((tmp_path / "batched" / DONE_DIR / "a.json").read_text())["effective"] == {"batch_size": 1}


def test_ignite_runs_the_iteration_function_the_engine_holds() -> None:
    """:meth:`CaseRun.attach` wraps ``engine._process_function`` (ignite has no public way to replace a workflow's
    iteration, and its EXCEPTION_RAISED event comes after the epoch is abandoned): pinned here for the installed
    ignite and MONAI - a workflow keeps its iteration there, the engine calls what the attribute holds at each
    iteration, and an exception in it ends the epoch (so an unguarded failed case would end the run)."""
    evaluator = SupervisedEvaluator(device=torch.device("cpu"), val_data_loader=[0], network=Doubler())
    assert evaluator._process_function.__func__ is SupervisedEvaluator._iteration
    calls: list[int] = []
    engine = Engine(lambda engine, batch: calls.append(-batch))
    engine._process_function = lambda engine, batch: calls.append(batch) or batch
    engine.run([1, 2, 3], max_epochs=1)
    assert calls == [1, 2, 3] and engine.state.output == 3

    def fails(engine, batch):
        calls.append(batch)
        if batch == 2:
            raise RuntimeError("case 2")

    calls.clear()
    engine = Engine(fails)
    engine.add_event_handler(Events.EXCEPTION_RAISED, lambda engine, error: None)
    engine.run([1, 2, 3], max_epochs=1)
    assert calls == [1, 2]  # the handled exception still ended the run before batch 3


def _good_cases(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(4):
        nib.save(nib.Nifti1Image(rng.random((6, 7, 5)).astype(np.float32), np.eye(4)), folder / f"good{i}.nii.gz")


def test_a_damaged_output_is_redone_with_one_warning(tmp_path, caplog):
    """A re-run checks every output file against the size, modification time and sha256 its record holds: an output
    truncated, emptied, swapped with another case's or removed is redone (one warning naming the cases) and the
    folder is again the clean run's; the intact case is kept."""
    import os

    _good_cases(tmp_path / "in")
    run_cases(tmp_path / "in", tmp_path / "out")
    clean = written_tree(tmp_path / "out")
    out = tmp_path / "out"
    data = (out / "good0_out.nii.gz").read_bytes()
    (out / "good0_out.nii.gz").write_bytes(data[: len(data) // 2])
    (out / "good1_out.nii.gz").write_bytes(b"")
    os.replace(out / "good2_out.nii.gz", tmp_path / "swap")
    os.replace(out / "good3_out.nii.gz", out / "good2_out.nii.gz")
    os.replace(tmp_path / "swap", out / "good3_out.nii.gz")  # swapped, each keeping its modification time
    caplog.clear()
    summary, _ = run_cases(tmp_path / "in", out)
    assert summary == {"written": 4, "skipped": 0, "failed": 0, "status": 0}
    warned = [r.getMessage() for r in caplog.records if "no longer hold the bytes written" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("4 case(s)") and "good0, good1, good2, good3" in warned[0]
    assert written_tree(out) == clean
    (out / "good1_out.nii.gz").unlink()
    summary, _ = run_cases(tmp_path / "in", out)
    assert (summary["written"], summary["skipped"]) == (1, 3) and written_tree(out) == clean


def test_new_bytes_behind_an_old_modification_time_are_found_when_verified(tmp_path, caplog):
    """The size and modification time are the fast path: an input rewritten with bytes of the same size and its
    old modification time put back is taken as unchanged (documented), and redone with ``verify_inputs``, which
    compares every file by its sha256."""
    import os

    _good_cases(tmp_path / "in")
    source = tmp_path / "in" / "good1.nii"
    nib.save(nib.load(tmp_path / "in" / "good1.nii.gz"), source)  # uncompressed: its voxels are its last bytes
    (tmp_path / "in" / "good1.nii.gz").unlink()
    listed = {"make_entries": lambda f: [{"image": str(p)} for p in sorted(f.glob("*.nii*"))]}
    run_cases(tmp_path / "in", tmp_path / "out", **listed)
    stat = source.stat()
    data = bytearray(source.read_bytes())
    data[-4:] = np.float32(7.0).tobytes()  # the last voxel, same size
    source.write_bytes(bytes(data))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    summary, _ = run_cases(tmp_path / "in", tmp_path / "out", **listed)
    assert (summary["written"], summary["skipped"]) == (0, 4)
    caplog.clear()
    summary, _ = run_cases(tmp_path / "in", tmp_path / "out", verify_inputs=True, **listed)
    assert (summary["written"], summary["skipped"]) == (1, 3)
    assert any("inputs that have changed" in r.getMessage() and "(good1)" in r.getMessage() for r in caplog.records)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``common.engines.cases``: an inference run over a folder where cases fail at every stage (header check, reading,
the model, writing) writes the others, lists the failures in ``failures.csv`` and restarts where it stopped."""

from __future__ import annotations

import csv
import errno
import json
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
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
    CaseDataset,
    CaseFailedError,
    CaseLoader,
    CaseRun,
)
from common.errors import UserError

MODEL_FAILS_AT = 7.0  # a volume filled with this value makes the network raise
WRITE_FAILS_AT = 9.0  # ... and this one makes the writer raise a full disk


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.all(x == MODEL_FAILS_AT):
            raise RuntimeError("the network refuses this volume")
        return 2 * x


def _full_disk(x):
    if torch.all(x == 2 * WRITE_FAILS_AT):
        raise OSError(errno.ENOSPC, "No space left on device")
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
    **settings,
) -> tuple[dict, CaseRun]:
    """One inference run over ``folder`` into ``out`` writing one file per postfix and case: ``(finish()'s summary,
    the run)``."""
    cases = CaseRun(out, check=lambda e: screen_entries(e, num_channels=1), **settings)
    preprocessing = Compose([LoadVolumed("image", image_only=True), EnsureChannelFirstd("image")])
    dataset = CaseDataset(cases.select(entries(folder)), preprocessing)
    loader = CaseLoader(dataset, cases, batch_size=batch_size, num_workers=num_workers)
    postprocessing = Compose(
        [
            Lambdad("pred", _full_disk),
            CaseMetad("pred"),
            *[nifti_saver("pred", cases.staging_dir, p, name_formatter=case_name_formatter) for p in postfixes],
        ]
    )
    evaluator = SupervisedEvaluator(
        device="cpu", val_data_loader=loader, network=Doubler(), postprocessing=postprocessing, val_handlers=[cases]
    )
    evaluator.run()
    return cases.finish(), cases


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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
    assert "refuses this volume" in rows["model"]["reason"] and "No space left" in rows["write"]["reason"]
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
    before = tree(tmp_path / "out")
    again, run = run_cases(tmp_path / "in", tmp_path / "out")
    assert again == {"written": 0, "skipped": 6, "failed": 5, "status": EXIT_SOME_FAILED}
    assert run.total == 5  # only the failed cases were tried again
    assert tree(tmp_path / "out") == before
    redone, _ = run_cases(tmp_path / "in", tmp_path / "out", overwrite=True)
    assert redone["written"] == 6 and redone["skipped"] == 0
    assert tree(tmp_path / "out") == before  # the same bytes
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
    lines = [r.getMessage() for r in caplog.records if "case/s, about" in r.getMessage()]
    assert len(lines) == 11 and lines[-1].startswith("11/11 case(s), ")  # every case counted, failed ones too
    assert any(r.getMessage().startswith("11 case(s) in ") for r in caplog.records)  # the run's throughput
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    caplog.clear()
    with caplog.at_level("INFO"):
        run_cases(tmp_path / "in", tmp_path / "bar", log_every_s=0.0)
    bar = capsys.readouterr().err
    assert "inference: 100%" in bar and "11/11" in bar and "case/s" in bar
    assert not [r for r in caplog.records if "case/s, about" in r.getMessage()]

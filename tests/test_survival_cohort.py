# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The survival cohort CSV: reading, row checks, splits, cohort checks, cut points and the pre-training report."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from common.survival.cohort import (
    CohortError,
    check_cohort,
    covariate_stats,
    cut_points_from_quantiles,
    inference_cohort,
    load_cohort,
    read_cohort_csv,
    split_cohort,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
HEADER = "case_id,image,time,event,age"


def _csv(folder: Path, *lines: str, name: str = "cohort.csv") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _volume(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(np.random.default_rng(seed).random((16, 16, 16), dtype=np.float32), np.eye(4)), path)
    return path


def _entry(row: int, time: float, event: float, split: str | None = None) -> dict:
    return {"case_id": f"c{row}", "image": f"/x/c{row}.nii.gz", "time": time, "event": event, "covariates": [],
            "split": split, "row": row}  # fmt: skip


def _problems(excinfo: pytest.ExceptionInfo) -> list[str]:
    return excinfo.value.problems


def _listing(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


# ------------------------------------------------------------------------------------------------ reading


def test_read_converts_units_resolves_paths_and_keeps_row_order(tmp_path: Path) -> None:
    lines = [
        HEADER + ",sex,split",
        "a,img/a.nii.gz,365.25,1,61.5,1,train",
        f"b,{tmp_path}/abs/b.nii.gz,730.5,0,70,0,val",
    ]
    path = _csv(tmp_path / "data", *lines)
    entries = read_cohort_csv(path, covariates=("sex", "age"))
    assert entries == [
        {"case_id": "a", "image": str(tmp_path / "data" / "img" / "a.nii.gz"), "time": 1.0, "event": 1.0,
         "covariates": [1.0, 61.5], "split": "train", "row": 1},
        {"case_id": "b", "image": str(tmp_path / "abs" / "b.nii.gz"), "time": 2.0, "event": 0.0,
         "covariates": [0.0, 70.0], "split": "val", "row": 2},
    ]  # fmt: skip
    assert [e["time"] for e in read_cohort_csv(path, time_unit="months")] == [365.25 / 12, 730.5 / 12]
    assert [e["time"] for e in read_cohort_csv(path, time_unit="years")] == [365.25, 730.5]
    other = read_cohort_csv(path, base_dir=tmp_path / "elsewhere")
    assert other[0]["image"] == str(tmp_path / "elsewhere" / "img" / "a.nii.gz")
    assert other[1]["image"] == str(tmp_path / "abs" / "b.nii.gz")  # absolute paths are kept


def test_read_without_case_id_or_split_columns_uses_file_stems(tmp_path: Path) -> None:
    path = _csv(tmp_path, "image,time,event", "scans/p01.nii.gz,10,1", "", "dicom/p02/,20,0.0", "p03.nii,30,1.0")
    entries = read_cohort_csv(path)
    assert [e["case_id"] for e in entries] == ["p01", "p02", "p03"]  # a DICOM folder is a path too
    assert [e["row"] for e in entries] == [1, 3, 4]  # the blank line is counted as a row, not returned
    assert all(e["split"] is None and e["covariates"] == [] for e in entries)
    assert [e["event"] for e in entries] == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "cells, expected",
    [
        ("a.nii.gz,abc,1", "row 2 (case x): time ('time') 'abc' is not a number"),
        ("a.nii.gz,,1", "row 2 (case x): time ('time') is empty"),
        ("a.nii.gz,-3,1", "row 2 (case x): time ('time') '-3' is negative"),
        ("a.nii.gz,nan,1", "row 2 (case x): time ('time') 'nan' is not finite"),
        ("a.nii.gz,inf,0", "row 2 (case x): time ('time') 'inf' is not finite"),
        ("a.nii.gz,5,2", "row 2 (case x): event ('event') '2' is not 0 or 1"),
        ("a.nii.gz,5,yes", "row 2 (case x): event ('event') 'yes' is not 0 or 1"),
        ("a.nii.gz,5,0.5", "row 2 (case x): event ('event') '0.5' is not 0 or 1"),
        ("a.nii.gz,5,", "row 2 (case x): event ('event') is empty"),
        (",5,1", "row 2 (case x): image path ('image') is empty"),
    ],
)
def test_read_reports_a_bad_cell(tmp_path: Path, cells: str, expected: str) -> None:
    path = _csv(tmp_path, "case_id,image,time,event", "ok,ok.nii.gz,1,0", f"x,{cells}")
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path)
    assert len(_problems(info)) == 1
    assert _problems(info)[0].startswith(expected)
    assert str(info.value).startswith(f"cohort CSV {str(path)!r}: 1 problem(s):")


def test_read_reports_bad_covariates_naming_the_column(tmp_path: Path) -> None:
    path = _csv(tmp_path, "case_id,image,time,event,age,bmi", "a,a.nii,1,1,,27", "b,b.nii,1,0,60,fat")
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path, covariates=("age", "bmi"))
    assert _problems(info) == [
        "row 1 (case a): covariate 'age' is empty",
        "row 2 (case b): covariate 'bmi' 'fat' is not a number",
    ]


def test_read_reports_missing_columns_with_the_columns_present(tmp_path: Path) -> None:
    path = _csv(tmp_path, "case_id,img,time", "a,a.nii,1")
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path, covariates=("age",))
    (line,) = _problems(info)
    assert "'image' (image_col)" in line and "'event' (event_col)" in line and "'age' (covariate)" in line
    assert "'time'" not in line.split(";")[0] and "columns present: ['case_id', 'img', 'time']" in line


def test_read_reports_duplicate_case_ids_naming_every_row(tmp_path: Path) -> None:
    path = _csv(tmp_path, "case_id,image,time,event", "a,1.nii,1,1", "b,2.nii,1,0", "a,3.nii,2,0", "a,4.nii,3,1")
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path)
    assert _problems(info) == ["rows 1, 3, 4: duplicate case id 'a'; case ids must be unique"]
    stems = _csv(tmp_path / "stems", "image,time,event", "x/p1.nii.gz,1,1", "y/p1.nii.gz,2,0")
    with pytest.raises(CohortError, match=r"rows 1, 2: duplicate case id 'p1' \(taken from the image file names"):
        read_cohort_csv(stems)


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "the file does not exist"),
        ("", "the file is empty (a header line"),
        ("  \n\n", "the file is empty (a header line"),
        ("case_id,image,time,event\n", "the file has a header but no data rows"),
        (
            "case_id;image;time;event\na;a.nii;1;1\n",
            "the header 'case_id;image;time;event' is separated by semicolons; the file must be comma-separated",
        ),
        (b"\x1f\x8b\x08\x00\xff\xfe\x00\x00binary", "the file is not a text CSV file (not UTF-8"),
        (
            'case_id,image,time,event\na,"a.nii,1,1\n',
            "the file is not a valid CSV file: unexpected end of data (line 2)",
        ),
        (
            'case_id,image,time,event\na,"a.nii"x,1,1\n',
            "the file is not a valid CSV file: ',' expected after '\"' (line 2)",
        ),
    ],
)
def test_read_reports_file_problems(tmp_path: Path, content: str | bytes | None, reason: str) -> None:
    path = tmp_path / "cohort.csv"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path)
    assert len(_problems(info)) == 1 and _problems(info)[0].startswith(reason)
    assert str(path) in str(info.value)


def test_read_reports_a_folder_and_an_unknown_time_unit(tmp_path: Path) -> None:
    with pytest.raises(CohortError, match=r"the path is a folder, not a CSV file"):
        read_cohort_csv(tmp_path)
    path = _csv(tmp_path, "image,time,event", "a.nii,1,1")
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path, time_unit="weeks")
    assert _problems(info) == ["time_unit must be one of 'days', 'months', 'years', got 'weeks'"]


def test_read_lists_every_problem_of_a_bad_csv_at_once(tmp_path: Path) -> None:
    path = _csv(
        tmp_path,
        HEADER,
        "p1,p1.nii.gz,100,1,60",  # fine
        "p2,p2.nii.gz,abc,1,61",  # non-numeric time
        "p3,p3.nii.gz,-5,2,62",  # negative time and bad event
        "p4,,10,0,old",  # empty image and non-numeric covariate
        "p1,p5.nii.gz,10,0,64",  # duplicate of row 1
        "p6,p6.nii.gz,10,0",  # a missing field
    )
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path, covariates=("age",), time_unit="fortnights")
    problems = _problems(info)
    assert problems == [
        "time_unit must be one of 'days', 'months', 'years', got 'fortnights'",
        "row 2 (case p2): time ('time') 'abc' is not a number",
        "row 3 (case p3): time ('time') '-5' is negative",
        "row 3 (case p3): event ('event') '2' is not 0 or 1; it must be 0 (censored) or 1 (event)",
        "row 4 (case p4): image path ('image') is empty",
        "row 4 (case p4): covariate 'age' 'old' is not a number",
        "row 6: has 4 fields but the header has 5 columns",
        "rows 1, 5: duplicate case id 'p1'; case ids must be unique",
    ]
    assert str(info.value).splitlines()[0] == f"cohort CSV {str(path)!r}: 8 problem(s):"


def test_read_keeps_strings_and_accepts_only_plain_event_spellings(tmp_path: Path) -> None:
    path = _csv(tmp_path, "case_id,image,time,event", "007,a.nii, 3 ,1.0", "008,b.nii,1e1,0", "009,c.nii,0,1.00")
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path)
    assert _problems(info) == [
        "row 3 (case 009): event ('event') '1.00' is not 0 or 1; it must be 0 (censored) or 1 (event)"
    ]
    entries = read_cohort_csv(path, max_cases=2)  # the third row is left out, so not checked
    assert [e["case_id"] for e in entries] == ["007", "008"]  # leading zeros kept
    assert [e["time"] for e in entries] == [3 / 365.25, 10 / 365.25]


def test_inference_cohort_from_a_csv_with_or_without_outcomes(tmp_path: Path) -> None:
    lines = ["case_id,image,age,split", "a,a.nii.gz,60,test", "b,b.nii.gz,70,train", "c,c.nii.gz,80,TEST"]
    path = _csv(tmp_path, *lines)
    entries = inference_cohort(path, covariates=("age",), split="testing")
    assert entries == [
        {"case_id": "a", "image": str(tmp_path / "a.nii.gz"), "covariates": [60.0], "split": "test", "row": 1},
        {"case_id": "c", "image": str(tmp_path / "c.nii.gz"), "covariates": [80.0], "split": "TEST", "row": 3},
    ]
    other = inference_cohort(path, dataset_dir=tmp_path / "data")  # relative paths against the CSV's folder
    assert [e["image"] for e in other] == [str(tmp_path / f"{c}.nii.gz") for c in "abc"]
    with pytest.raises(CohortError, match=r"split 'val' selects no case: no row of the split column 'split' names"):
        inference_cohort(path, split="val")
    with pytest.raises(CohortError, match=r"split must be one of train/training/val/validation/test/testing"):
        inference_cohort(path, split="holdout")
    outcomes = _csv(tmp_path / "o", "image,time,event", "x.nii.gz,730.5,1", "y.nii.gz,365.25,0")
    assert [(e["case_id"], e["time"], e["event"]) for e in inference_cohort(outcomes)] == [
        ("x", 2.0, 1.0),
        ("y", 1.0, 0.0),
    ]
    with pytest.raises(CohortError) as info:  # one outcome column: both are required, and checked
        inference_cohort(_csv(tmp_path / "t", "image,time", "x.nii.gz,abc"))
    assert "missing required column(s) 'event' (event_col)" in _problems(info)[0]
    (failing,) = inference_cohort(_csv(tmp_path / "c", "image,age", "x.nii.gz,"), covariates=["age"])
    assert failing["case_problems"] == ["row 1 (case x): covariate 'age' is empty"]  # the row fails, not the file


INFERENCE_ROWS = [
    "case_id,image,time,event,age,split",
    "a,a.nii.gz,365.25,1,60,test",
    "b,b.nii.gz,730.5,0,61,train",
    "c,c.nii.gz,100,1,abc,test",  # non-numeric covariate
    "d,,200,0,63,test",  # empty image path
    "e,e.nii.gz,300,1,64,test",
]


def test_inference_cohort_fails_only_the_rows_with_problems(tmp_path: Path) -> None:
    """A bad cell fails its row (an entry with ``case_problems``, for the engine's input check); the others run."""
    path = _csv(tmp_path, *INFERENCE_ROWS)
    entries = inference_cohort(path, covariates=("age",))
    assert [e["case_id"] for e in entries] == ["a", "b", "c", "d", "e"]
    assert entries[2] == {
        "case_id": "c",
        "image": str(tmp_path / "c.nii.gz"),
        "covariates": [],
        "split": "test",
        "row": 3,
        "case_problems": ["row 3 (case c): covariate 'age' 'abc' is not a number"],
    }
    assert entries[3] == {"case_id": "d", "image": "", "covariates": [], "split": "test", "row": 4,
                          "case_problems": ["row 4 (case d): image path ('image') is empty"]}  # fmt: skip
    good = [entries[i] for i in (0, 1, 4)]
    assert all("case_problems" not in e for e in good)
    # the same CSV with blank lines for the bad rows (counted, so the row numbers stay)
    clean = _csv(tmp_path, *["" if i in (3, 4) else line for i, line in enumerate(INFERENCE_ROWS)], name="clean.csv")
    assert good == inference_cohort(clean, covariates=("age",))  # unchanged values
    assert good[0] == {"case_id": "a", "image": str(tmp_path / "a.nii.gz"), "time": 1.0, "event": 1.0,
                       "covariates": [60.0], "split": "test", "row": 1}  # fmt: skip
    # training still refuses the whole file, listing every problem
    with pytest.raises(CohortError) as info:
        read_cohort_csv(path, covariates=("age",))
    assert _problems(info) == [
        "row 3 (case c): covariate 'age' 'abc' is not a number",
        "row 4 (case d): image path ('image') is empty",
    ]
    with pytest.raises(CohortError, match=r"2 problem\(s\):\n  row 3 \(case c\): covariate 'age' 'abc'"):
        load_cohort(path, covariates=("age",), preflight=False)


def test_inference_cohort_fails_bad_outcomes_field_counts_and_split_filters_them(tmp_path: Path, caplog) -> None:
    lines = [*INFERENCE_ROWS[:3], "f,f.nii.gz,-3,2,65,test", "g,g.nii.gz,1,1", "h,h.nii.gz,1,1,66,TEST"]
    path = _csv(tmp_path, *lines)
    entries = inference_cohort(path, covariates=("age",))
    assert [e.get("case_problems") for e in entries] == [
        None,
        None,
        [
            "row 3 (case f): time ('time') '-3' is negative",
            "row 3 (case f): event ('event') '2' is not 0 or 1; it must be 0 (censored) or 1 (event)",
        ],
        ["row 4: has 4 fields but the header has 6 columns"],
        None,
    ]
    assert [(e["case_id"], e["image"], e["split"]) for e in entries[2:4]] == [
        ("f", str(tmp_path / "f.nii.gz"), "test"),
        ("row 4", "", None),  # its cells cannot be matched to the columns
    ]
    assert "time" not in entries[2] and "event" not in entries[2]
    with caplog.at_level("WARNING", logger="common.survival.cohort"):
        testing = inference_cohort(path, covariates=("age",), split="testing")
    assert [e["case_id"] for e in testing] == ["a", "f", "h"]  # a failing row is kept when its split cell names it
    assert "row(s) 4 fail their check and name no split" in caplog.text
    assert [e["case_id"] for e in inference_cohort(path, covariates=("age",), split="train")] == ["b"]


def test_inference_cohort_fails_every_row_of_a_shared_case_id(tmp_path: Path) -> None:
    path = _csv(tmp_path, "case_id,image", "a,1.nii", "b,2.nii", "a,3.nii", "c,4.nii", "a,5.nii")
    entries = inference_cohort(path)
    line = "rows 1, 3, 5: duplicate case id 'a'; case ids must be unique"
    assert [(e["case_id"], e["image"], e.get("case_problems")) for e in entries] == [
        ("row 1", str(tmp_path / "1.nii"), [line]),  # named by their row, so no two entries share an id
        ("b", str(tmp_path / "2.nii"), None),
        ("row 3", str(tmp_path / "3.nii"), [line]),
        ("c", str(tmp_path / "4.nii"), None),
        ("row 5", str(tmp_path / "5.nii"), [line]),
    ]
    stems = _csv(tmp_path / "stems", "image,age", "x/p1.nii.gz,1", "y/p1.nii.gz,oops", "p2.nii.gz,3")
    entries = inference_cohort(stems, covariates=("age",))
    assert [e["case_id"] for e in entries] == ["row 1", "row 2", "p2"]
    assert entries[1]["case_problems"] == [
        "row 2 (case p1): covariate 'age' 'oops' is not a number",
        "rows 1, 2: duplicate case id 'p1' (taken from the image file names, as there is no case id column); case "
        "ids must be unique",
    ]


def test_inference_cohort_names_a_row_without_a_case_id_by_its_number(tmp_path: Path) -> None:
    path = _csv(tmp_path, "case_id,image,age", "a,a.nii,1", "", ",b.nii,2", " ,c.nii,x")
    entries = inference_cohort(path, covariates=["age"])
    assert [(e["case_id"], e["row"], e.get("case_problems")) for e in entries] == [
        ("a", 1, None),
        ("row 3", 3, ["row 3: case id ('case_id') is empty"]),  # the blank line is row 2, as in the messages
        ("row 4", 4, ["row 4: case id ('case_id') is empty", "row 4: covariate 'age' 'x' is not a number"]),
    ]
    assert entries[1]["image"] == str(tmp_path / "b.nii")
    stems = inference_cohort(_csv(tmp_path / "stems", "image,age", "a.nii,1", ",2"), covariates=["age"])
    assert [(e["case_id"], e.get("case_problems")) for e in stems] == [
        ("a", None),
        ("row 2", ["row 2: image path ('image') is empty"]),
    ]


@pytest.mark.parametrize(
    "lines, options, expected",
    [
        (["case_id,img,age", "a,a.nii,x"], {"covariates": ["age"]}, "missing required column(s) 'image' (image_col)"),
        (["case_id,image", "a,a.nii,x"], {"covariates": ["age"]}, "missing required column(s) 'age' (covariate)"),
        (["case_id,image,time", "a,a.nii,1"], {}, "missing required column(s) 'event' (event_col)"),
        (["case_id,image"], {}, "the file has a header but no data rows"),
        (["case_id,image", "a,a.nii"], {"time_unit": "weeks"}, "time_unit must be one of 'days', 'months', 'years'"),
    ],
)
def test_inference_cohort_still_refuses_a_file_with_problems_of_its_own(
    tmp_path: Path, lines: list[str], options: dict, expected: str
) -> None:
    path = _csv(tmp_path, *lines)
    with pytest.raises(CohortError) as info:
        inference_cohort(path, **options)
    assert len(_problems(info)) == 1 and _problems(info)[0].startswith(expected)
    with pytest.raises(CohortError, match=r"the file does not exist"):
        inference_cohort(tmp_path / "absent.csv")


def test_inference_cohort_from_a_folder(tmp_path: Path) -> None:
    _volume(tmp_path / "scans" / "p2.nii.gz")
    _volume(tmp_path / "scans" / "sub" / "p1.nii.gz")
    entries = inference_cohort(None, dataset_dir=tmp_path / "scans")
    assert entries == [
        {"case_id": "p2", "image": str(tmp_path / "scans" / "p2.nii.gz"), "covariates": []},
        {"case_id": "p1", "image": str(tmp_path / "scans" / "sub" / "p1.nii.gz"), "covariates": []},
    ]
    with pytest.raises(CohortError, match=r"the model uses covariates \['age'\]; give them per case in a cohort CSV"):
        inference_cohort("", dataset_dir=tmp_path / "scans", covariates=["age"])
    with pytest.raises(FileNotFoundError, match=r"no input volumes found under .*matching '\*\.mha'"):
        inference_cohort(None, dataset_dir=tmp_path / "scans", pattern="*.mha")


# ------------------------------------------------------------------------------------------------ splits


def test_split_column_decides_case_insensitively() -> None:
    entries = [
        _entry(1, 1, 1, "Train"),
        _entry(2, 2, 0, "VALIDATION"),
        _entry(3, 3, 1, "test"),
        _entry(4, 4, 0, "training"),
    ]
    sections = split_cohort(entries)
    assert {k: [e["row"] for e in v] for k, v in sections.items()} == {
        "training": [1, 4],
        "validation": [2],
        "testing": [3],
    }
    random = split_cohort(entries, use_split_column=False, val_fraction=0.5)
    assert set(random) == {"training", "validation"}


def test_split_column_rejects_unknown_values_and_partial_filling() -> None:
    entries = [_entry(1, 1, 1, "train"), _entry(2, 2, 0, "holdout"), _entry(3, 3, 1, "tst")]
    with pytest.raises(CohortError) as info:
        split_cohort(entries)
    assert [p.split(":")[0] for p in _problems(info)] == ["row 2 (case c2)", "row 3 (case c3)"]
    assert "split 'holdout' is not one of train/training/val/validation/test/testing" in _problems(info)[0]
    partial = [_entry(1, 1, 1, "train"), _entry(2, 2, 0, None), _entry(3, 3, 1, "val"), _entry(4, 3, 1, None)]
    with pytest.raises(CohortError, match=r"filled for 2 of 4 rows but empty for rows 2, 4"):
        split_cohort(partial)


def test_random_split_is_stratified_seeded_and_deterministic() -> None:
    rng = np.random.default_rng(0)
    entries = [_entry(i + 1, float(rng.uniform(0, 5)), float(i % 4 == 0)) for i in range(50)]  # 13 events
    first = split_cohort(entries, val_fraction=0.2, seed=3)
    assert split_cohort(entries, val_fraction=0.2, seed=3) == first
    assert split_cohort(entries, val_fraction=0.2, seed=4) != first
    val = first["validation"]
    assert len(val) == 10 and sum(e["event"] for e in val) == 3  # round(0.2 * 13) events, round(0.2 * 37) censored
    assert sorted(e["row"] for e in first["training"] + val) == list(range(1, 51))
    assert [e["row"] for e in val] == sorted(e["row"] for e in val)  # input order kept


@pytest.mark.parametrize(
    "events, fraction, expected",
    [
        ([1, 0, 0], 0.2, (0, 1)),  # at least one validation case, the only event stays in training
        ([1, 1, 0, 0, 0, 0, 0, 0, 0, 0], 0.1, (1, 1)),  # two events: one on each side
        ([1, 1], 0.9, (1, 0)),  # one event stays in training
        ([0, 0, 0], 0.99, (0, 2)),  # no events: training still keeps a case
        ([1, 0, 0, 0], 0.0, (0, 0)),
    ],
)
def test_random_split_guarantees(events: list[int], fraction: float, expected: tuple[int, int]) -> None:
    entries = [_entry(i + 1, 1.0 + i, float(e)) for i, e in enumerate(events)]
    val = split_cohort(entries, val_fraction=fraction, seed=0)["validation"]
    assert (sum(e["event"] == 1 for e in val), sum(e["event"] == 0 for e in val)) == expected


def test_split_rejects_bad_fraction() -> None:
    for bad in (-0.1, 1.0, True, "0.2"):
        with pytest.raises(ValueError, match=r"val_fraction must be a number in \[0, 1\)"):
            split_cohort([_entry(1, 1, 1)], val_fraction=bad)


# ------------------------------------------------------------------------------------------------ cohort checks


def test_check_cohort_passes_a_good_cohort() -> None:
    sections = {"training": [_entry(1, 6.0, 1), _entry(2, 2.0, 0)], "validation": [_entry(3, 5.5, 0), _entry(4, 1, 1)]}
    check_cohort(sections, horizons=(1, 3, 5), cut_points=[0, 2.5, 6.0])


def test_check_cohort_lists_every_problem() -> None:
    sections = {"training": [_entry(1, 6.0, 0), _entry(2, 2.0, 0)], "validation": []}
    with pytest.raises(CohortError) as info:
        check_cohort(sections, horizons=(1, 0, -2, float("nan")), cut_points=[0.5, 0.2, 7.0])
    assert _problems(info) == [
        "the training split has no events (all 2 cases are censored); a survival model needs at least one event to "
        "learn from",
        "the validation split is empty; set val_fraction > 0 or mark validation rows in the split column",
        "horizon 0 is not a positive number of years",
        "horizon -2 is not a positive number of years",
        "horizon nan is not a positive number of years",
        "cut_points must start at 0, got [0.5, 0.2, 7.0]",
        "cut_points must be strictly increasing, got [0.5, 0.2, 7.0]",
        "the last cut point 7 years is beyond the largest follow-up time of the training split (6 years); no training "
        "case can inform the last interval(s)",
    ]
    assert str(info.value).startswith("cohort check: 8 problem(s):")


def test_check_cohort_names_horizons_beyond_follow_up() -> None:
    sections = {
        "training": [_entry(1, 6.0, 1), _entry(2, 2.0, 0)],
        "validation": [_entry(3, 4.2, 0), _entry(4, 1.0, 1)],
        "testing": [_entry(5, 3.0, 1)],
    }
    with pytest.raises(CohortError) as info:
        check_cohort(sections, horizons=[1, 3, 5, 6])
    problems = _problems(info)
    assert [p.split(" is ")[0] + " / " + p.split("of the ")[1].split(" split")[0] for p in problems] == [
        "horizon 3 years / testing",
        "horizon 5 years / validation",
        "horizon 5 years / testing",
        "horizon 6 years / training",
        "horizon 6 years / validation",
        "horizon 6 years / testing",
    ]
    assert "largest follow-up time of the validation split (4.2 years); IPCW metrics" in problems[1]
    assert "undefined beyond follow-up" in problems[1]
    with pytest.raises(CohortError, match=r"horizons must be strictly increasing, got \[3, 1\]"):
        check_cohort(sections, horizons=[3, 1])
    with pytest.raises(CohortError, match=r"cut_points must be a list of at least 2 finite numbers"):
        check_cohort(sections, horizons=[1], cut_points=[0])


def test_check_cohort_refuses_a_validation_split_that_no_metric_can_score() -> None:
    """A validation split without events, or whose follow-up starts after every horizon, would stop training at its
    first validation (no metric to rank checkpoints by): both are refused up front."""
    training = [_entry(1, 6.0, 1), _entry(2, 2.0, 0)]
    with pytest.raises(CohortError) as info:
        check_cohort({"training": training, "validation": [_entry(3, 5.5, 0), _entry(4, 1.5, 0)]}, horizons=(1, 3))
    assert _problems(info) == [
        "the validation split has no events (all 2 cases are censored); the C-index, td-AUC and Brier scores of the "
        "validation need at least one event"
    ]
    late = {"training": training, "validation": [_entry(3, 3.75, 1), _entry(4, 5.5, 0)]}
    with pytest.raises(CohortError) as info:
        check_cohort(late, horizons=(1, 2))
    assert _problems(info) == [
        "no horizon of [1.0, 2.0] lies in the follow-up window of the validation split [3.75, 5.5) years (its "
        "earliest follow-up time to the largest one of the validation and training splits), so no validation metric "
        "could be computed; use horizons in that window"
    ]
    check_cohort(late, horizons=(1, 4))  # one horizon in the window is enough (the others are skipped with a warning)


# ------------------------------------------------------------------------------------------------ cut points, stats


def test_cut_points_from_quantiles_hand_computed() -> None:
    time = [1.0, 2.0, 3.0, 4.0, 5.0, 0.5]
    event = [1, 1, 1, 1, 0, 0]
    # quantiles 1/4, 2/4, 3/4 of the event times [1, 2, 3, 4] (linear): 1.75, 2.5, 3.25; then the largest time 5
    assert cut_points_from_quantiles(time, event, 4) == [0.0, 1.75, 2.5, 3.25, 5.0]
    assert cut_points_from_quantiles(torch.tensor(time), torch.tensor(event), 1) == [0.0, 5.0]
    assert cut_points_from_quantiles(np.asarray(time), np.asarray(event), 2) == [0.0, 2.5, 5.0]


def test_cut_points_merge_ties_and_stay_strictly_increasing() -> None:
    time, event = [2.0, 2.0, 2.0, 2.0, 3.0, 3.0], [1, 1, 1, 1, 1, 0]
    cuts = cut_points_from_quantiles(time, event, 5)  # quantiles 2, 2, 2, 2.2 -> merged
    assert cuts == [0.0, 2.0, pytest.approx(2.2), 3.0]
    assert all(b > a for a, b in zip(cuts, cuts[1:]))
    last_event = cut_points_from_quantiles([1.0, 4.0, 4.0], [1, 1, 1], 3)  # quantiles reaching the largest time
    assert last_event == [0.0, 3.0, 4.0]
    rng = np.random.default_rng(0)
    t, e = rng.exponential(3.0, 200), rng.random(200) < 0.3
    cuts = cut_points_from_quantiles(t, e, 10)
    assert cuts[0] == 0 and cuts[-1] == t.max() and len(cuts) == 11 and np.all(np.diff(cuts) > 0)


def test_cut_points_errors() -> None:
    with pytest.raises(ValueError, match=r"none of the 3 training cases has an event"):
        cut_points_from_quantiles([1, 2, 3], [0, 0, 0], 4)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=r"num_intervals must be a positive integer"):
            cut_points_from_quantiles([1, 2], [1, 0], bad)
    with pytest.raises(ValueError, match=r"same length"):
        cut_points_from_quantiles([1, 2], [1], 2)


def test_covariate_stats_population_std_and_constant_columns() -> None:
    entries = [{"covariates": [1.0, 5.0]}, {"covariates": [3.0, 5.0]}, {"covariates": [8.0, 5.0]}]
    mean, std = covariate_stats(entries)
    assert mean == pytest.approx([4.0, 5.0]) and std == pytest.approx([np.sqrt(26 / 3), 1.0])
    assert covariate_stats([{"covariates": []}]) == ([], [])
    with pytest.raises(ValueError, match=r"at least one entry"):
        covariate_stats([])


# ------------------------------------------------------------------------------------------------ load_cohort


@pytest.fixture
def good_cohort(tmp_path: Path) -> Path:
    rows = [HEADER + ",split"]
    times = [400, 200, 900, 1500, 2500, 300, 1800, 2200]  # validation (p1, p6): events at 0.55 and 4.9 years
    for i, (t, e) in enumerate(zip(times, [1, 1, 1, 0, 0, 1, 1, 0])):
        _volume(tmp_path / "images" / f"p{i}.nii.gz", seed=i)
        rows.append(f"p{i},images/p{i}.nii.gz,{t},{e},{50 + i},{'val' if i in (1, 6) else 'train'}")
    return _csv(tmp_path, *rows)


def test_load_cohort_returns_sections_cut_points_and_stats(good_cohort: Path, capsys) -> None:
    cohort = load_cohort(good_cohort, covariates=("age",), horizons=(1, 3), num_intervals=2)
    assert [e["case_id"] for e in cohort["training"]] == ["p0", "p2", "p3", "p4", "p5", "p7"]
    assert [e["case_id"] for e in cohort["validation"]] == ["p1", "p6"]
    assert "testing" not in cohort
    # training event times 400, 900, 300 days; median 400 days; largest training time 2500 days
    assert cohort["cut_points"] == pytest.approx([0.0, 400 / 365.25, 2500 / 365.25])
    ages = [50, 52, 53, 54, 55, 57]
    assert cohort["covariate_mean"] == pytest.approx([np.mean(ages)]) and cohort["covariate_std"] == pytest.approx(
        [np.std(ages)]
    )
    explicit = load_cohort(good_cohort, horizons=(1,), cut_points=[0, 1, 2], num_intervals=5, preflight=False)
    assert explicit["cut_points"] == [0.0, 1.0, 2.0] and explicit["covariate_mean"] == []  # explicit cut points win
    assert load_cohort(good_cohort, horizons=(1,))["cut_points"] is None  # Cox head: no cut points
    assert capsys.readouterr().err == ""


def test_load_cohort_refuses_fewer_quantile_intervals_than_configured(good_cohort: Path, capsys) -> None:
    """Tied training event times give fewer distinct quantile intervals than the network's outputs."""
    text = good_cohort.read_text().replace(",900,1,", ",400,1,").replace(",300,1,", ",400,1,")
    good_cohort.write_text(text)  # the three training events all at 400 days: quantiles [0, 400 d, 2500 d]
    with pytest.raises(CohortError) as info:
        load_cohort(good_cohort, horizons=(1,), num_intervals=5, preflight=False)
    err = str(info.value)
    assert "'num_intervals' 5: the training event times give only 2 distinct intervals" in err
    assert "--num_intervals 2" in err


def test_load_cohort_reports_rows_and_images_and_writes_nothing(good_cohort: Path, capsys) -> None:
    lines = good_cohort.read_text().splitlines()
    lines[2] = "p1,images/p1.nii.gz,abc,0,51,val"  # bad time
    lines[4] = "p3,images/missing.nii.gz,1500,0,53,train"  # image does not exist
    lines[6] = "p5,images/corrupt.nii.gz,300,3,55,train"  # bad event and unreadable image
    (good_cohort.parent / "images" / "corrupt.nii.gz").write_bytes(b"not a nifti file at all" * 20)
    good_cohort.write_text("\n".join(lines) + "\n")
    before = _listing(good_cohort.parent)
    with pytest.raises(CohortError) as info:
        load_cohort(good_cohort, covariates=("age",), num_intervals=3)
    err = str(info.value).splitlines()
    assert err[0] == f"cohort CSV {str(good_cohort)!r}: 4 problem(s):"
    assert err[1:3] == [
        "  row 2 (case p1): time ('time') 'abc' is not a number",
        "  row 6 (case p5): event ('event') '3' is not 0 or 1; it must be 0 (censored) or 1 (event)",
    ]
    missing = good_cohort.parent / "images" / "missing.nii.gz"
    assert err[3] == f"  row 4 (case p3): image {missing}: does not exist"
    assert err[4].startswith("  row 6 (case p5): image ") and "cannot be read" in err[4]
    assert _listing(good_cohort.parent) == before
    assert capsys.readouterr() == ("", "")  # raised, not printed


def test_load_cohort_reports_cohort_checks_and_max_cases(good_cohort: Path, capsys) -> None:
    with pytest.raises(CohortError) as info:
        load_cohort(good_cohort, horizons=(1, 7), cut_points=[0, 9])
    err = str(info.value)
    assert "\n  horizon 7 years is at or beyond the largest follow-up time of the training split" in err
    assert "\n  the last cut point 9 years is beyond" in err
    # the first 7 rows hold both validation cases; max_cases=1 leaves none
    assert len(load_cohort(good_cohort, horizons=(1,), max_cases=7)["training"]) == 5
    with pytest.raises(CohortError, match="the validation split is empty"):
        load_cohort(good_cohort, horizons=(1,), max_cases=1)
    with pytest.raises(CohortError, match="max_cases must be a positive integer or null, got 0"):
        load_cohort(good_cohort, max_cases=0, preflight=False)


WORKER = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from common.survival.cohort import CohortError, load_cohort

    dist.init_process_group("gloo")
    try:
        cohort = load_cohort(sys.argv[1], horizons=(1,))
        print(f"rank {dist.get_rank()} ok {len(cohort['training'])}", flush=True)
    except CohortError as exc:
        print(f"rank {dist.get_rank()} raised", flush=True)
        print(exc, file=sys.stderr, flush=True)
        raise SystemExit(1)
    finally:
        dist.destroy_process_group()
    """
)


def test_load_cohort_under_torch_distributed_every_rank_reports_and_exits(good_cohort: Path, tmp_path: Path) -> None:
    """2 gloo processes share the image reading; each reports both missing images (one read on each rank)."""
    lines = good_cohort.read_text().splitlines()
    lines[1] = lines[1].replace("images/p0.nii.gz", "images/gone0.nii.gz")
    lines[2] = lines[2].replace("images/p1.nii.gz", "images/gone1.nii.gz")
    good_cohort.write_text("\n".join(lines) + "\n")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--master_addr=127.0.0.1",
           f"--master_port={port}", str(worker), str(good_cohort)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode != 0
    assert "rank 0 raised" in result.stdout and "rank 1 raised" in result.stdout, result.stdout + result.stderr
    for name, row in (("gone0", 1), ("gone1", 2)):
        line = f"  row {row} (case p{row - 1}): image {good_cohort.parent / 'images' / name}.nii.gz: does not exist"
        assert result.stderr.count(line) == 2, result.stderr  # printed by both ranks

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Datalist loading/writing and the make_datalist script."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.data.datalist import (
    BRATS_MODALITIES,
    DatalistError,
    MissingSectionError,
    NoInputs,
    find_brats_cases,
    find_volumes,
    found_inputs,
    inference_entries,
    load_datalist,
    no_volumes_error,
    require_inputs,
    write_datalist,
)
from common.data.formats import is_dicom_file
from common.errors import MissingInputError


def _write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def _load_script(repo_root: Path):
    spec = importlib.util.spec_from_file_location("make_datalist_script", repo_root / "scripts" / "make_datalist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_relative_paths_resolve_against_json_folder(tmp_path: Path) -> None:
    sub = tmp_path / "lists"
    sub.mkdir()
    file = _write_json(
        sub / "d.json",
        {"training": [{"image": "imgs/a.nii.gz", "label": 3}, "imgs/b.nii.gz", {"image": "/abs/c.nii.gz"}]},
    )
    entries = load_datalist(file)
    assert entries[0] == {"image": str(sub / "imgs" / "a.nii.gz"), "label": 3}
    assert entries[1] == {"image": str(sub / "imgs" / "b.nii.gz")}
    assert entries[2] == {"image": "/abs/c.nii.gz"}


def test_a_file_s_paths_resolve_against_its_folder_and_home_is_expanded(tmp_path, monkeypatch) -> None:
    """MONAI's convention: a datalist file's relative paths are relative to its folder, wherever the command runs
    and whatever base folder the caller has (a bundle's ``dataset_dir``); ``base_dir`` places a dict's paths."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    content = {"validation": [{"image": "x.nii"}, {"image": "~/y.nii"}]}
    (tmp_path / "lists").mkdir()
    file = _write_json(tmp_path / "lists" / "d.json", content)
    entries = load_datalist(file, key="validation", base_dir=str(tmp_path / "data"))
    assert entries == [{"image": str(tmp_path / "lists" / "x.nii")}, {"image": str(tmp_path / "home" / "y.nii")}]
    entries = load_datalist(content, key="validation", base_dir=str(tmp_path / "data"))
    assert entries[0] == {"image": str(tmp_path / "data" / "x.nii")}


def test_dict_input_and_dicom_file_list(tmp_path: Path) -> None:
    data = {"training": [{"image": ["s/1.dcm", "s/2.dcm"]}]}
    entries = load_datalist(data, base_dir=str(tmp_path))
    assert entries == [{"image": [str(tmp_path / "s" / "1.dcm"), str(tmp_path / "s" / "2.dcm")]}]


def test_input_entries_are_not_modified(tmp_path: Path) -> None:
    data = {"training": [{"image": "a.nii"}]}
    load_datalist(data, base_dir=str(tmp_path))
    assert data == {"training": [{"image": "a.nii"}]}


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatalistError, match="does not exist") as info:
        load_datalist(tmp_path / "nope.json")
    assert "nope.json" in str(info.value)


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    file = tmp_path / "bad.json"
    file.write_text('{\n  "training": [\n    {"image": "a.nii",}\n  ]\n}')
    with pytest.raises(DatalistError) as info:
        load_datalist(file)
    message = str(info.value)
    assert "bad.json" in message and "not valid JSON" in message and "line 3" in message and "column" in message


def test_top_level_not_object(tmp_path: Path) -> None:
    file = _write_json(tmp_path / "list.json", [{"image": "a.nii"}])
    with pytest.raises(DatalistError, match="top-level list") as info:
        load_datalist(file)
    assert "list.json" in str(info.value)


def test_missing_section_lists_present_sections(tmp_path: Path) -> None:
    file = _write_json(tmp_path / "d.json", {"train": [], "test": []})
    with pytest.raises(MissingSectionError) as info:
        load_datalist(file, key="training")
    message = str(info.value)
    assert "d.json" in message and "'training'" in message and "['test', 'train']" in message
    assert isinstance(info.value, DatalistError)


def test_section_not_a_list(tmp_path: Path) -> None:
    file = _write_json(tmp_path / "d.json", {"training": {"image": "a.nii"}})
    with pytest.raises(DatalistError, match="must be a list of entries, got dict") as info:
        load_datalist(file)
    assert "d.json" in str(info.value)


def test_empty_section(tmp_path: Path) -> None:
    file = _write_json(tmp_path / "d.json", {"training": []})
    with pytest.raises(DatalistError, match="'training' is empty") as info:
        load_datalist(file)
    assert "d.json" in str(info.value)


@pytest.mark.parametrize(
    "entry, expected",
    [
        (5, "entry must be an object or a path string, got int 5"),
        ({"label": "a.nii"}, "missing required key 'image'"),
        ({"image": 7}, "'image' must be a path string or a list of path strings, got int 7"),
        ({"image": ""}, "'image' is an empty string"),
        ({"image": []}, "'image' is an empty list"),
        ({"image": ["a.dcm", 3]}, "got item 3"),
    ],
)
def test_bad_entry_names_file_and_index(tmp_path: Path, entry: object, expected: str) -> None:
    file = _write_json(tmp_path / "d.json", {"training": [{"image": "ok.nii"}, entry]})
    with pytest.raises(DatalistError) as info:
        load_datalist(file)
    message = str(info.value)
    assert "d.json" in message and "training[1]" in message and expected in message


def test_all_bad_entries_are_reported(tmp_path: Path) -> None:
    file = _write_json(tmp_path / "d.json", {"training": [1, {"image": "ok.nii"}, {"x": 1}]})
    with pytest.raises(DatalistError) as info:
        load_datalist(file)
    message = str(info.value)
    assert "2 invalid entries" in message and "training[0]" in message and "training[2]" in message
    assert "training[1]" not in message


def test_required_keys(tmp_path: Path) -> None:
    data = {"training": [{"image": "a.nii", "label": "a_seg.nii"}, {"image": "b.nii"}]}
    with pytest.raises(DatalistError, match=r"training\[1\]: entry is missing required key 'label'"):
        load_datalist(data, base_dir=str(tmp_path), keys=("image", "label"))


def test_write_then_load_round_trip(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    sections = {
        "training": [{"image": str(data_dir / "a.nii.gz"), "age": 40}, {"image": "/elsewhere/b.nii.gz"}],
        "validation": [{"image": str(data_dir / "sub" / "c.nii.gz")}],
    }
    out = write_datalist(data_dir / "datalist.json", sections, base_dir=data_dir)
    raw = json.loads(out.read_text())
    assert raw["training"] == [{"image": "a.nii.gz", "age": 40}, {"image": "/elsewhere/b.nii.gz"}]
    assert raw["validation"] == [{"image": os.path.join("sub", "c.nii.gz")}]
    assert load_datalist(out) == sections["training"]
    assert load_datalist(out, key="validation") == sections["validation"]
    assert sorted(p.name for p in data_dir.iterdir()) == ["datalist.json"]  # no temporary file left


def test_write_rejects_bad_sections(tmp_path: Path) -> None:
    with pytest.raises(DatalistError, match="'training' must be a list") as info:
        write_datalist(tmp_path / "d.json", {"training": {"image": "a"}})
    assert "d.json" in str(info.value)
    assert not (tmp_path / "d.json").exists()


def _make_volumes(root: Path, n: int) -> None:
    for i in range(n):
        folder = root / f"case{i:02d}"
        folder.mkdir(parents=True)
        (folder / f"case{i:02d}_flair.nii.gz").write_bytes(b"x")
        (folder / f"case{i:02d}_t1.nii.gz").write_bytes(b"x")


def test_make_datalist_split_and_relative_paths(tmp_path: Path, repo_root: Path) -> None:
    script = _load_script(repo_root)
    data_dir = tmp_path / "brats"
    _make_volumes(data_dir, 10)
    out = script.make_datalist(str(data_dir), output=None, pattern="*flair.nii.gz", val_fraction=0.2, seed=0)
    assert out == data_dir / "datalist.json"
    raw = json.loads(out.read_text())
    assert len(raw["training"]) == 8 and len(raw["validation"]) == 2
    paths = [e["image"] for e in raw["training"] + raw["validation"]]
    assert all(not os.path.isabs(p) and p.endswith("_flair.nii.gz") for p in paths)
    assert len(set(paths)) == 10
    loaded = load_datalist(out) + load_datalist(out, key="validation")
    assert all(os.path.isfile(e["image"]) for e in loaded)
    again = json.loads(script.make_datalist(str(data_dir), pattern="*flair.nii.gz", seed=0).read_text())
    assert again == raw  # the same seed gives the same split


def test_make_datalist_lists_what_inference_lists(tmp_path: Path, repo_root: Path) -> None:
    """Without a pattern, every volume inference would read (a folder of NRRD chest CTs, a MetaImage file), by
    the same rule (:func:`find_volumes`); ``pattern`` narrows it."""
    import itk
    import numpy as np

    script = _load_script(repo_root)
    volume = itk.image_from_array(np.zeros((4, 5, 6), np.float32))
    for name in ("ct1.nrrd", "ct2.nrrd", "sub/ct3.mha"):
        (tmp_path / "ct" / name).parent.mkdir(parents=True, exist_ok=True)
        itk.imwrite(volume, str(tmp_path / "ct" / name))
    (tmp_path / "ct" / "notes.txt").write_text("not a volume")
    raw = json.loads(script.make_datalist(str(tmp_path / "ct")).read_text())
    expected = sorted(e["image"] for e in find_volumes(tmp_path / "ct"))
    assert sorted(str(tmp_path / "ct" / e["image"]) for e in raw["training"] + raw["validation"]) == expected
    assert len(expected) == 3
    narrowed = json.loads(script.make_datalist(str(tmp_path / "ct"), pattern="*.nrrd").read_text())
    assert sorted(e["image"] for e in narrowed["training"] + narrowed["validation"]) == ["ct1.nrrd", "ct2.nrrd"]


def test_make_datalist_small_sets_and_dicom(tmp_path: Path, repo_root: Path) -> None:
    script = _load_script(repo_root)
    assert script.split_items(["a", "b"], 0.0, 0)[1] != []  # at least one validation item from two
    assert script.split_items(["a"], 0.5, 0) == (["a"], [])
    for series in ("p1/s1", "p1/s2", "p2/s1"):
        (tmp_path / "dicom" / series).mkdir(parents=True)
        (tmp_path / "dicom" / series / "IM0001.DCM").write_bytes(b"x")
    out = script.make_datalist(str(tmp_path / "dicom"), output=str(tmp_path / "dl.json"), dicom=True, val_fraction=0.3)
    raw = json.loads(out.read_text())
    paths = sorted(e["image"] for e in raw["training"] + raw["validation"])
    assert paths == [os.path.join("p1", "s1"), os.path.join("p1", "s2"), os.path.join("p2", "s1")]
    assert len(raw["validation"]) == 1


def test_make_datalist_errors_name_data_dir(tmp_path: Path, repo_root: Path) -> None:
    script = _load_script(repo_root)
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        script.make_datalist(str(tmp_path / "missing_dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError, match=r"no input volumes found under '.*empty': .* matching '\*flair.nii.gz'"
    ):
        script.make_datalist(str(tmp_path / "empty"), pattern="*flair.nii.gz")
    with pytest.raises(FileNotFoundError, match=r"NRRD \(.nrrd, .nhdr\).*\(set --data_dir or --pattern\)"):
        script.make_datalist(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="val_fraction"):
        script.split_items(["a", "b"], 1.0, 0)


def test_make_datalist_cli(tmp_path: Path, repo_root: Path) -> None:
    data_dir = tmp_path / "data"
    _make_volumes(data_dir, 3)
    cmd = [sys.executable, "scripts/make_datalist.py", "--data_dir", str(data_dir), "--pattern", "*t1.nii.gz"]
    result = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "2 training, 1 validation" in result.stdout
    failed = subprocess.run(
        [sys.executable, "scripts/make_datalist.py", "--data_dir", str(tmp_path / "nope")],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failed.returncode == 1 and "nope" in failed.stderr


def _brats_tree(root: Path, cases: dict[str, tuple[str, ...]]) -> None:
    for case, modalities in cases.items():
        folder = root / case
        folder.mkdir(parents=True)
        for m in modalities:
            (folder / f"{case}-{m}.nii.gz").write_bytes(b"x")


def test_make_datalist_brats_layout(tmp_path: Path, repo_root: Path) -> None:
    script = _load_script(repo_root)
    full = ("t1n", "t1c", "t2w", "t2f")
    cases = {f"BraTS-GLI-{i:05d}-000": full + (("seg",) if i % 2 == 0 else ()) for i in range(5)}
    _brats_tree(tmp_path / "brats", cases)
    (tmp_path / "brats" / "README.txt").write_text("not a case")
    out = script.make_datalist(str(tmp_path / "brats"), brats=True, val_fraction=0.2, seed=1)
    raw = json.loads(out.read_text())
    entries = raw["training"] + raw["validation"]
    assert len(raw["training"]) == 4 and len(raw["validation"]) == 1
    assert sorted(e["case_id"] for e in entries) == sorted(cases)
    for e in entries:
        case = e["case_id"]
        for m in full:
            assert e[m] == os.path.join(case, f"{case}-{m}.nii.gz")  # relative to data_dir
        assert ("label" in e) == ("seg" in cases[case])
    loaded = load_datalist(out, "training", keys=full)
    assert all(os.path.isabs(e["t1n"]) and os.path.isfile(e["t2f"]) for e in loaded)


def test_make_datalist_brats_names_incomplete_cases(tmp_path: Path, repo_root: Path) -> None:
    script = _load_script(repo_root)
    _brats_tree(
        tmp_path / "brats",
        {"case-a": ("t1n", "t1c", "t2w", "t2f"), "case-b": ("t1n", "t2w"), "case-c": ("t1c", "t2w", "t2f")},
    )
    with pytest.raises(ValueError) as info:
        script.make_datalist(str(tmp_path / "brats"), brats=True)
    message = str(info.value)
    assert "2 BraTS case(s) are incomplete" in message
    assert "case case-b" in message and "case-b-t1c.nii.gz, case-b-t2f.nii.gz" in message
    assert "case case-c" in message and "case-c-t1n.nii.gz" in message and "case-a" not in message
    assert not (tmp_path / "brats" / "datalist.json").exists()
    failed = subprocess.run(
        [sys.executable, "scripts/make_datalist.py", "--data_dir", str(tmp_path / "brats"), "--brats"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failed.returncode == 1 and "case-b-t2f.nii.gz" in failed.stderr


def test_find_brats_cases_lives_in_common_and_is_reexported(tmp_path: Path, repo_root: Path) -> None:
    script = _load_script(repo_root)
    assert script.find_brats_cases is find_brats_cases and script.BRATS_MODALITIES is BRATS_MODALITIES
    assert BRATS_MODALITIES == ("t1n", "t1c", "t2w", "t2f")
    _brats_tree(tmp_path, {"b-case": (*BRATS_MODALITIES, "seg"), "a-case": BRATS_MODALITIES, "other": ("x",)})
    cases = find_brats_cases(tmp_path)
    assert [c["case_id"] for c in cases] == ["a-case", "b-case"]  # sorted; folders without modalities skipped
    assert "label" not in cases[0] and cases[1]["label"] == str(tmp_path / "b-case" / "b-case-seg.nii.gz")
    assert cases[0]["t2f"] == str(tmp_path / "a-case" / "a-case-t2f.nii.gz")


# ---------------------------------------------------------------------------------------------- find_volumes
def _touch(path: Path, content: bytes = b"x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _volume_tree(root: Path) -> None:
    """Every listed format, a MetaImage data file, a DICOM series written by ITK (files without suffix), a ``.dcm``
    series holding a stray NIfTI, a UID-named DICOM file, and files that are not volumes."""
    import numpy as np

    from tests.helpers import write_itk_volume, write_tilted_dicom_series

    array = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
    write_itk_volume(root / "a.nrrd", array)
    (root / "sub").mkdir()
    write_itk_volume(root / "sub" / "b.mhd", array)  # and its data file b.raw
    write_tilted_dicom_series(root / "patient1" / "study" / "series", array)
    for name in ("c.nii.gz", "sub/d.nii", "sub/e.mha", "sub/f.nhdr", "sub/f.raw"):
        _touch(root / name)
    for name in ("slice1.dcm", "slice2.DCM", "converted.nii.gz"):
        _touch(root / "patient2" / "ct" / name)
    _touch(root / "patient3" / "1.2.840.10008.5.1", b"\0" * 128 + b"DICM" + b"\0" * 8)
    _touch(root / "DICOMDIR", b"\0" * 128 + b"DICM")  # a disc index next to the data: not a series
    for name in ("notes.txt", "sub/preview.png", "sub/b.zraw", ".hidden.nii.gz", "short", ".cache/x.nii.gz"):
        _touch(root / name)


def test_find_volumes_lists_every_format_and_each_dicom_series_once(tmp_path: Path) -> None:
    _volume_tree(tmp_path)
    entries = find_volumes(tmp_path)
    assert [e["case_id"] for e in entries] == ["a", "c", "series", "ct", "patient3", "b", "d", "e", "f"]
    assert [Path(e["image"]).relative_to(tmp_path).as_posix() for e in entries] == [
        "a.nrrd",
        "c.nii.gz",
        "patient1/study/series",
        "patient2/ct",
        "patient3",
        "sub/b.mhd",
        "sub/d.nii",
        "sub/e.mha",
        "sub/f.nhdr",
    ]
    assert all(Path(e["image"]).is_absolute() for e in entries)
    assert is_dicom_file(tmp_path / "patient1" / "study" / "series" / "IM0000")  # ITK's GDCM writer: DICM at 128
    assert not is_dicom_file(tmp_path / "short") and not is_dicom_file(tmp_path / "notes.txt")


def test_find_volumes_with_a_pattern_and_another_key(tmp_path: Path) -> None:
    _volume_tree(tmp_path)
    assert [e["case_id"] for e in find_volumes(tmp_path, "*.nii*")] == ["c", "d"]  # not the one in a series folder
    assert find_volumes(tmp_path, "series", key="ct") == [
        {"case_id": "series", "ct": str(tmp_path / "patient1" / "study" / "series")}
    ]
    assert [e["case_id"] for e in find_volumes(tmp_path, "sub/*.m*")] == ["b", "e"]
    assert [e["case_id"] for e in find_volumes(tmp_path, "*.png")] == ["preview.png"]  # any file asked for
    assert find_volumes(tmp_path / "missing") == [] and find_volumes(tmp_path, "*.tiff") == []


def test_find_volumes_dataset_dir_that_is_itself_a_series(tmp_path: Path) -> None:
    series = tmp_path / "CT_0001"
    for name in ("a.dcm", "b.dcm"):
        _touch(series / name)
    assert find_volumes(series) == [{"case_id": "CT_0001", "image": str(series)}]


def test_find_volumes_disambiguates_case_ids_with_the_relative_path(tmp_path: Path) -> None:
    for name in ("site1/scan.nii.gz", "site2/scan.nrrd", "scan.mha", "site1_scan.mhd", "x/ct/1.dcm", "y/ct/1.dcm"):
        _touch(tmp_path / name)
    ids = {Path(e["image"]).relative_to(tmp_path).as_posix(): e["case_id"] for e in find_volumes(tmp_path)}
    assert ids == {
        "scan.mha": "scan",
        "site1/scan.nii.gz": "site1_scan",
        "site1_scan.mhd": "site1_scan_2",
        "site2/scan.nrrd": "site2_scan",
        "x/ct": "x_ct",
        "y/ct": "y_ct",
    }


def test_no_volumes_error_message(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"under '/data' \(the folder does not exist\).*matching '\*\.nii\.gz'"):
        raise no_volumes_error("/data", "*.nii.gz")
    with pytest.raises(FileNotFoundError) as info:
        raise no_volumes_error(str(tmp_path))
    message = str(info.value)
    assert repr(str(tmp_path)) in message and "does not exist" not in message
    for looked_for in ("NIfTI (.nii, .nii.gz)", "NRRD (.nrrd, .nhdr)", "MetaImage (.mha, .mhd)", "DICOM series"):
        assert looked_for in message


def test_a_run_without_inputs_is_built_and_refused_at_its_first_step(tmp_path):
    """``found_inputs`` keeps the finder's MissingInputError in an empty ``NoInputs`` (the workflow can be built, as
    the model zoo's ``check_properties`` does); ``require_inputs`` raises that very error; other errors pass."""
    missing = found_inputs(inference_entries, dataset_dir=tmp_path / "nothing", keys=["image"])
    assert isinstance(missing, NoInputs) and missing == []
    with pytest.raises(
        MissingInputError, match=r"no input volumes found under .*nothing' \(the folder does not exist\)"
    ):
        require_inputs(missing)
    with pytest.raises(MissingInputError, match="the input list is empty"):
        require_inputs([])
    _volume_tree(tmp_path)
    found = found_inputs(inference_entries, dataset_dir=tmp_path, keys=["image"])
    assert found == find_volumes(tmp_path) and require_inputs(found) is True
    with pytest.raises(DatalistError):
        found_inputs(inference_entries, dataset_dir=tmp_path, keys=["image"], datalist=tmp_path / "absent.json")


def test_inference_entries_use_find_volumes_and_name_what_was_looked_for(tmp_path: Path) -> None:
    _volume_tree(tmp_path)
    assert inference_entries(tmp_path, ["image"]) == find_volumes(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no input volumes found under .*matching '\*\.tiff'"):
        inference_entries(tmp_path, ["image"], pattern="*.tiff")
    with pytest.raises(FileNotFoundError) as info:
        inference_entries(tmp_path / "patient1", ["image"], pattern="IM*")  # series files are never cases
    assert repr(str(tmp_path / "patient1")) in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"NIfTI \(\.nii, \.nii\.gz\), NRRD \(\.nrrd, \.nhdr\), MetaImage"):
        inference_entries(tmp_path / "empty", ["image"])


def test_find_volumes_lists_a_broken_link_with_a_volume_name(tmp_path: Path) -> None:
    """A link whose target is gone is a case (the check reports it) instead of silently missing from the run; a
    broken link without a volume name is not a volume, as a file of that name would not be."""
    _touch(tmp_path / "a.nii.gz")
    os.symlink(tmp_path / "moved" / "b.nii.gz", tmp_path / "b.nii.gz")
    os.symlink(tmp_path / "moved" / "c.img", tmp_path / "c.img")
    os.symlink(tmp_path / "moved" / "notes", tmp_path / "notes")
    assert [(e["case_id"], e["image"]) for e in find_volumes(tmp_path)] == [
        ("a", str(tmp_path / "a.nii.gz")),
        ("b", str(tmp_path / "b.nii.gz")),
    ]
    assert [e["case_id"] for e in find_volumes(tmp_path, "*.img")] == ["c.img"]
    assert [e["case_id"] for e in inference_entries(tmp_path, ["image"])] == ["a", "b"]


def test_an_evaluation_section_that_is_not_there_is_one_error_naming_the_setting() -> None:
    """``eval_section`` picks a section of the loaded data; a missing one names the setting and the sections there
    are (a cohort's lists of numbers are not sections)."""
    from common.data.datalist import named_section
    from common.errors import MissingInputError

    sections = {"training": [{"image": "a"}], "validation": [{"image": "b"}], "covariate_mean": [0.5]}
    assert named_section(sections, "validation") == [{"image": "b"}]
    message = r"'eval_section' is 'testing' but the data has no such section \(it has \['training', 'validation'\]\)"
    for name in ("testing", "covariate_mean"):
        with pytest.raises(MissingInputError, match=message.replace("testing", name)):
            named_section(sections, name)

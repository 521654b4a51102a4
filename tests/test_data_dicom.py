# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""DICOM series as users have them: a flat export folder holding several series, and a series given as a list of
its files in any order. The reference is MONAI's own reader on a folder holding the one series alone."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from monai.transforms import Compose, LoadImage

from common.data.datalist import find_volumes, inference_entries, load_datalist
from common.data.dicom import DicomSeriesReader, LoadVolumed, dicom_series, series_files, series_problems
from common.data.preflight import PreflightError, check_volume, preflight, run_preflight, screen_entries
from common.demo.images import make_ct_phantom, write_dicom_series
from tests.helpers import REPO_ROOT
from tests.oracles import spatial_steps

SHAPES = {"ct": (16, 12, 8), "scout": (16, 12, 5)}


@pytest.fixture
def export(tmp_path: Path) -> dict:
    """``data/export``: a flat folder holding a CT series (SeriesNumber 3) and a shorter one (SeriesNumber 7);
    ``data/alone``: a folder holding the CT series alone; ``data/vol.nii.gz``: a NIfTI volume;
    ``ref/<name>``: each series alone, for MONAI's reader."""
    import nibabel as nib

    data = tmp_path / "data"
    volumes = {name: make_ct_phantom(shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())}
    write_dicom_series(data / "export", volumes["ct"], spacing=(0.8, 0.8, 2.5), series_number=3, prefix="ct")
    write_dicom_series(data / "export", volumes["scout"], spacing=(0.8, 0.8, 2.5), series_number=7, prefix="sc")
    write_dicom_series(data / "alone", volumes["ct"], spacing=(0.8, 0.8, 2.5))
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.float32), np.eye(4)), str(data / "vol.nii.gz"))
    for name, volume in volumes.items():
        write_dicom_series(tmp_path / "ref" / name, volume, spacing=(0.8, 0.8, 2.5))
    files = {name: sorted(str(p) for p in (data / "export").glob(f"{prefix}*.dcm")) for name, prefix in
             (("ct", "ct"), ("scout", "sc"))}  # fmt: skip
    return {"root": data, "export": data / "export", "files": files, "ref": tmp_path / "ref", "volumes": volumes}


def test_series_of_a_folder_in_slice_order(export):
    found = dicom_series(export["export"])
    assert sorted((s.number, len(s.files)) for s in found) == [("3", 8), ("7", 5)]
    for s in found:
        name = "ct" if s.number == "3" else "scout"
        assert sorted(s.files) == export["files"][name]
        assert s.files == export["files"][name]  # slice order = the written z order here
    with pytest.raises(NotADirectoryError):
        dicom_series(export["files"]["ct"][0])


def test_a_folder_of_several_series_is_refused_by_name(export):
    """MONAI's ITKReader would read the first series with a warning; the loader and the preflight refuse it and
    list the series."""
    folder = str(export["export"])
    with pytest.raises(ValueError, match="holds 2 DICOM series, one is needed") as info:
        LoadVolumed("image")({"image": folder})
    assert "(8 files, number 3)" in str(info.value) and "(5 files, number 7)" in str(info.value)
    reason = check_volume(folder)
    assert reason.startswith("holds 2 DICOM series, one is needed") and "list the files of one series" in reason
    listing = Path(export["root"]).parent / "listing.json"
    listing.write_text(json.dumps({"training": [{"image": folder}]}))
    with pytest.raises(PreflightError, match="holds 2 DICOM series"):
        preflight(listing)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_series_given_by_its_files_in_any_order_reads_as_monai_reads_its_folder(export, name):
    files = list(export["files"][name])
    random.Random(0).shuffle(files)
    assert files != export["files"][name]
    image = LoadVolumed("image")({"image": files})["image"]
    reference = LoadImage(image_only=True)(str(export["ref"] / name))
    assert image.shape == reference.shape == SHAPES[name]
    np.testing.assert_array_equal(image.numpy(), reference.numpy())
    np.testing.assert_allclose(image.affine.numpy(), reference.affine.numpy(), atol=1e-6)
    np.testing.assert_array_equal(image.numpy(), np.round(export["volumes"][name]))
    assert check_volume(files) is None
    too_small = check_volume(files, patch_size=(16, 16, 16), allow_pad=False)
    assert too_small == f"shape {SHAPES[name]} is smaller than patch_size (16, 16, 16) and padding is disabled"


def test_the_bundles_chain_reads_lists_folders_and_other_files(export):
    """``spatial_steps`` (the Python chain the bundles' JSON lists equal) on a file list, a one-series folder and a
    NIfTI file: the list and the folder of the same series give the same volume."""
    chain = Compose(spatial_steps(["image"], "RAS", None))
    by_list = chain({"image": list(reversed(export["files"]["ct"]))})["image"]
    by_folder = chain({"image": str(export["root"] / "alone")})["image"]
    assert by_list.shape == (1, *SHAPES["ct"])
    np.testing.assert_array_equal(by_list.numpy(), by_folder.numpy())
    assert chain({"image": str(export["root"] / "vol.nii.gz")})["image"].shape == (1, 8, 8, 8)


def test_listed_files_of_two_series_or_strays_are_refused(export, tmp_path):
    mixed = export["files"]["ct"][:3] + export["files"]["scout"][:2]
    with pytest.raises(ValueError, match="belong to 2 DICOM series"):
        series_files(mixed)
    assert "belong to 2 DICOM series" in check_volume(mixed)
    stray = export["root"] / "alone" / "notes.dcm"
    stray.write_bytes(b"\0" * 128 + b"DICM" + b"\0" * 64)
    slices = sorted(str(p) for p in (export["root"] / "alone").glob("slice*"))
    with pytest.raises(ValueError, match="1 listed files are not slices of a DICOM series"):
        series_files([str(stray), *slices])
    other = tmp_path / "elsewhere"
    other.mkdir()
    moved = other / "x.dcm"
    moved.write_bytes(Path(export["files"]["ct"][0]).read_bytes())
    with pytest.raises(ValueError, match="must be in one folder"):
        series_files([str(moved), *export["files"]["ct"][1:]])
    assert DicomSeriesReader().verify_suffix(export["files"]["ct"]) is True
    assert DicomSeriesReader().verify_suffix(export["files"]["ct"][0]) is False  # one file: MONAI's readers
    assert DicomSeriesReader().verify_suffix(str(export["root"] / "vol.nii.gz")) is False


def test_find_volumes_gives_one_case_per_series_of_a_flat_export(export):
    entries = find_volumes(export["root"])
    by_id = {e["case_id"]: e["image"] for e in entries}
    assert sorted(by_id) == ["alone", "export_series3", "export_series7", "vol"]
    assert by_id["export_series3"] == export["files"]["ct"] and by_id["export_series7"] == export["files"]["scout"]
    assert by_id["alone"] == str(export["root"] / "alone")
    assert [e["case_id"] for e in find_volumes(export["root"], dicom_only=True)] == [
        "alone",
        "export_series3",
        "export_series7",
    ]


def test_make_datalist_dicom_lists_each_series_and_the_bundles_read_them(export):
    """``make_datalist.py --dicom`` on the export: relative file lists that pass the preflight and load; inference
    on the datalist names a listed series after its folder."""
    out = export["root"] / "datalist.json"
    cmd = [sys.executable, "scripts/make_datalist.py", "--data_dir", str(export["root"]), "--dicom"]
    result = subprocess.run([*cmd, "--val_fraction", "0.34"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    cases = "export_series3 (8 files), export_series7 (5 files)"
    note = f"note: {export['export']} holds 2 DICOM series, one case each: {cases}"
    assert note in result.stdout.splitlines()
    written = json.loads(out.read_text())
    items = written["training"] + written["validation"]
    assert sorted(e["case_id"] for e in items) == ["alone", "export_series3", "export_series7"]
    listed = next(e for e in items if e["case_id"] == "export_series7")
    assert listed["image"] == [str(Path(f).relative_to(export["root"])) for f in export["files"]["scout"]]
    checked = preflight(out)
    shapes = sorted(LoadVolumed("image")(e)["image"].shape for e in checked["training"] + checked["validation"])
    assert shapes == sorted([SHAPES["ct"], SHAPES["ct"], SHAPES["scout"]])
    section = "training" if listed in written["training"] else "validation"
    entries = load_datalist(out, section, base_dir=str(export["root"]))
    without_ids = {section: [{"image": e["image"]} for e in entries]}
    names = [e["case_id"] for e in inference_entries(export["root"], ["image"], without_ids, section)]
    assert "export" in names


# ------------------------------------------------------------------------------------ the geometry of one series
def _regular(folder: Path, slices: int = 16) -> Path:
    """A regular series of ``slices`` 8 x 8 slices, 2.0 mm apart (positions 0, 2, ... mm along the normal)."""
    return write_dicom_series(folder, make_ct_phantom((8, 8, slices), seed=1), spacing=(1.0, 1.0, 2.0))


def _rewrite(source: Path, target: Path, tags: dict[str, str]) -> Path:
    """Write ``source`` again as ``target`` with ``tags`` (DICOM ``"gggg|eeee"`` -> value) replaced."""
    import itk

    image = itk.imread(str(source), imageio=itk.GDCMImageIO.New())
    meta = image.GetMetaDataDictionary()
    for tag, value in tags.items():
        meta[tag] = value
    io = itk.GDCMImageIO.New()
    io.KeepOriginalUIDOn()
    itk.imwrite(image, str(target), imageio=io)
    return target


def _drop_tag(file: Path, tag: bytes, retired: bytes) -> None:
    """Rename a tag of ``file`` to a retired one in the bytes (``(0020,0032)`` -> ``(0020,0030)``), so the file
    has none."""
    data = file.read_bytes()
    assert data.count(tag) == 1
    file.write_bytes(data.replace(tag, retired))


def test_a_regular_series_has_no_geometry_problems(tmp_path):
    folder = _regular(tmp_path / "ct")
    files = series_files(folder)
    assert len(files) == 16 and series_problems(files) == [] and series_problems(list(reversed(files))) == []
    assert series_problems(files[:1]) == []  # one (e.g. multi-frame) file: no geometry to check
    assert check_volume(str(folder)) is None


def test_a_missing_slice_is_named_with_the_gap_and_accepted_only_when_allowed(tmp_path):
    folder = _regular(tmp_path / "ct")
    (folder / "slice0007.dcm").unlink()  # the slice at 14 mm
    files = series_files(folder)
    assert series_problems(files) == [
        f"DICOM series {folder}: gap of 4.000 mm between the slices at 12.000 mm and 16.000 mm along the slice "
        "normal, the regular spacing is 2.000 mm: a missing slice?"
    ]
    assert series_problems(files, allow_irregular=True) == []
    for name in ("slice0009.dcm", "slice0010.dcm"):
        (folder / name).unlink()
    assert "gap of 6.000 mm between the slices at 16.000 mm and 22.000 mm" in series_problems(series_files(folder))[1]
    assert series_problems(series_files(folder))[1].endswith("2 missing slices?")


def test_a_duplicated_slice_is_named_even_when_irregular_series_are_allowed(tmp_path):
    folder = _regular(tmp_path / "ct")
    _rewrite(folder / "slice0005.dcm", folder / "copy.dcm", {"0008|0018": "1.2.826.0.1.3680043.8.498.77"})
    files = series_files(folder)
    assert len(files) == 17
    expected = (
        f"DICOM series {folder}: duplicate slices: 2 files at position 10.000 mm along the slice normal: copy.dcm, "
        "slice0005.dcm"
    )
    assert series_problems(files) == [expected]
    assert series_problems(files, allow_irregular=True) == [expected]


def test_non_uniform_spacing_is_named_and_rounding_is_not(tmp_path):
    folder = _regular(tmp_path / "ct")
    for k in range(9, 16):  # 0, 2, ..., 16, then 18.2, 20.4, ...: 7 gaps of 2.2 mm among 8 of 2.0 mm
        name = folder / f"slice{k:04d}.dcm"
        _rewrite(name, name, {"0020|0032": f"0\\0\\{16 + (k - 8) * 2.2:.4f}"})
    files = series_files(folder)
    assert series_problems(files) == [
        f"DICOM series {folder}: non-uniform slice spacing: 7 of 15 gaps differ from the regular spacing 2.000 mm by "
        "more than 0.020 mm (gaps from 2.000 to 2.200 mm; first 2.200 mm between 16.000 mm and 18.200 mm)"
    ]
    assert series_problems(files, allow_irregular=True) == []
    rounded = _regular(tmp_path / "rounded")
    _rewrite(rounded / "slice0004.dcm", rounded / "slice0004.dcm", {"0020|0032": "0\\0\\8.006"})  # 2-3 decimals
    assert series_problems(series_files(rounded)) == []


def test_mixed_orientation_or_series_and_unplaced_slices_are_named(tmp_path):
    folder = _regular(tmp_path / "turned")
    _rewrite(folder / "slice0003.dcm", folder / "slice0003.dcm", {"0020|0037": "1\\0\\0\\0\\1\\0"})
    problems = series_problems(series_files(folder), allow_irregular=True)
    assert problems == [
        f"DICOM series {folder}: mixed series: 1 of 16 files have another orientation (ImageOrientationPatient "
        "1\\0\\0\\0\\1\\0 in slice0003.dcm, -1\\0\\0\\0\\-1\\0 in the others)"
    ]
    other = _regular(tmp_path / "two_uids")
    _rewrite(other / "slice0004.dcm", other / "slice0004.dcm", {"0020|000e": "1.2.826.0.1.3680043.8.498.99"})
    files = sorted(str(p) for p in other.glob("*.dcm"))
    with pytest.raises(ValueError, match="belong to 2 DICOM series"):  # GDCM tells them apart: the loader refuses
        series_files(files)
    (line,) = series_problems(files, allow_irregular=True)
    assert line.startswith(f"DICOM series {other}: mixed series: its files differ in SeriesInstanceUID: ")
    assert line.endswith("in slice0000.dcm and 14 more, 1.2.826.0.1.3680043.8.498.99 in slice0004.dcm")
    unplaced = _regular(tmp_path / "unplaced")
    _drop_tag(unplaced / "slice0002.dcm", b"\x20\x00\x32\x00", b"\x20\x00\x30\x00")  # ImagePositionPatient
    _drop_tag(unplaced / "slice0006.dcm", b"\x20\x00\x37\x00", b"\x20\x00\x35\x00")  # ImageOrientationPatient
    problems = series_problems(sorted(str(p) for p in unplaced.glob("*.dcm")), allow_irregular=True)
    assert problems == [
        f"DICOM series {unplaced}: 1 of 16 files have no valid ImagePositionPatient (0020|0032), so their slice "
        "cannot be placed: slice0002.dcm",
        f"DICOM series {unplaced}: 1 of 16 files have no valid ImageOrientationPatient (0020|0037), so their slice "
        "cannot be placed: slice0006.dcm",
    ]


def test_a_series_without_any_geometry_is_refused_unless_irregular_series_are_allowed(tmp_path):
    """No file places its slice (a secondary capture): the geometry cannot be checked, so the series is refused by
    default; ``allow_irregular`` takes it as ITK stacks it (the user accepts that geometry)."""
    folder = _regular(tmp_path / "capture", slices=4)
    for file in sorted(folder.glob("*.dcm")):
        _drop_tag(file, b"\x20\x00\x32\x00", b"\x20\x00\x30\x00")  # ImagePositionPatient
        _drop_tag(file, b"\x20\x00\x37\x00", b"\x20\x00\x35\x00")  # ImageOrientationPatient
    files = sorted(str(p) for p in folder.glob("*.dcm"))
    assert [line.split(": ", 1)[1] for line in series_problems(files)] == [
        "4 of 4 files have no valid ImagePositionPatient (0020|0032), so their slice cannot be placed: "
        "slice0000.dcm and 3 more",
        "4 of 4 files have no valid ImageOrientationPatient (0020|0037), so their slice cannot be placed: "
        "slice0000.dcm and 3 more",
    ]
    assert series_problems(files, allow_irregular=True) == []
    assert "cannot be placed" in check_volume(str(folder))
    assert check_volume(str(folder), allow_irregular_series=True) is None


def test_series_problems_reads_headers_only_and_fast(tmp_path):
    """300 slices of 64 x 64: the headers are read, not the pixels (about 0.2 s here, after ITK is loaded)."""
    folder = write_dicom_series(tmp_path / "ct", np.zeros((64, 64, 300)), spacing=(1.0, 1.0, 1.0))
    files = series_files(folder)
    series_problems(files[:2])  # ITK's GDCM module loads on first use (seconds)
    start = time.perf_counter()
    assert series_problems(files) == []
    elapsed = time.perf_counter() - start
    print(f"series_problems on 300 slices: {elapsed:.3f} s")
    assert elapsed < 2.0


def test_the_training_preflight_refuses_an_irregular_series_unless_allowed(tmp_path):
    folder = _regular(tmp_path / "ct")
    (folder / "slice0007.dcm").unlink()
    _rewrite(folder / "slice0002.dcm", folder / "copy.dcm", {"0008|0018": "1.2.826.0.1.3680043.8.498.78"})
    reason = check_volume(str(folder))
    assert reason == (
        f"DICOM series {folder}: duplicate slices: 2 files at position 4.000 mm along the slice normal: copy.dcm, "
        f"slice0002.dcm; DICOM series {folder}: gap of 4.000 mm between the slices at 12.000 mm and 16.000 mm along "
        "the slice normal, the regular spacing is 2.000 mm: a missing slice?"
    )
    assert check_volume(str(folder), allow_irregular_series=True).endswith("copy.dcm, slice0002.dcm")
    listing = tmp_path / "listing.json"
    listing.write_text(json.dumps({"training": [{"image": str(folder), "case_id": "c1"}]}))
    with pytest.raises(PreflightError) as info:
        preflight(listing)
    where, series = f"training[0] (case c1) {folder}", f"DICOM series {folder}"
    assert [p.split(": ", 2)[:2] for p in info.value.problems] == [[where, series]] * 2
    assert "a missing slice?" in info.value.problems[1] and "duplicate slices" in info.value.problems[0]
    (folder / "copy.dcm").unlink()
    with pytest.raises(PreflightError, match="a missing slice"):
        preflight(listing)
    assert preflight(listing, allow_irregular_series=True)["training"][0]["image"] == str(folder)
    assert run_preflight(listing, allow_irregular_series=True)["training"][0]["case_id"] == "c1"


def test_the_inference_screen_reads_slice_headers_only_when_asked(tmp_path, monkeypatch):
    import common.data.dicom as dicom

    folder = _regular(tmp_path / "ct")
    (folder / "slice0007.dcm").unlink()
    files = [str(f) for f in series_files(folder)]
    entries = [{"image": str(folder)}, {"image": files}]
    read: list[int] = []
    original = dicom.series_problems
    monkeypatch.setattr(dicom, "series_problems", lambda f, *a, **k: read.append(len(f)) or original(f, *a, **k))
    assert screen_entries(entries) == [[], []] and read == []  # one header per series, not one per slice
    problems = screen_entries(entries, series_geometry=True)
    assert read == [15, 15]
    assert [len(p) for p in problems] == [1, 1] and all("a missing slice?" in p[0] for p in problems)
    assert str(folder) in problems[0][0] and "gap of 4.000 mm" in problems[1][0]
    assert screen_entries(entries, series_geometry=True, allow_irregular_series=True) == [[], []]


def test_a_broken_link_in_a_series_folder_is_named(tmp_path):
    folder = _regular(tmp_path / "ct")
    target = tmp_path / "pacs" / "slice0016.dcm"
    os.symlink(target, folder / "slice0016.dcm")
    assert [e["image"] for e in find_volumes(tmp_path)] == [str(folder)]
    reason = (
        f"holds 1 broken symbolic link(s); slice0016.dcm is a broken symbolic link: its target {target} does not exist"
    )
    assert check_volume(str(folder)) == reason
    assert screen_entries([{"image": str(folder)}]) == [[reason]]

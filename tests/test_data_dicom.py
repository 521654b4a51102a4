# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""DICOM series as users have them: a flat export folder holding several series, and a series given as a list of
its files in any order. The reference is MONAI's own reader on a folder holding the one series alone."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from monai.transforms import Compose, LoadImage

from common.data.datalist import find_volumes, inference_entries, load_datalist
from common.data.dicom import DicomSeriesReader, LoadVolumed, dicom_series, series_files
from common.data.preflight import PreflightError, check_volume, preflight
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

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Preflight checks of datalists and volumes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from common.data.preflight import PreflightError, check_volume, preflight, screen_entries
from common.demo.images import write_dicom_series


def _nifti(path: Path, array: np.ndarray) -> Path:
    nib.save(nib.Nifti1Image(array, np.eye(4)), str(path))
    return path


def _good(path: Path, shape: tuple[int, ...] = (16, 16, 16), seed: int = 0) -> Path:
    return _nifti(path, np.random.default_rng(seed).random(shape, dtype=np.float32))


def _datalist(path: Path, training: list, validation: list | None = None) -> Path:
    data = {"training": [{"image": str(p)} for p in training]}
    if validation is not None:
        data["validation"] = [{"image": str(p)} for p in validation]
    path.write_text(json.dumps(data))
    return path


def _listing(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def _write_dicom_series(folder: Path, shape_zyx: tuple[int, int, int] = (8, 16, 16)) -> Path:
    """Write a 3D int16 image as one DICOM file per slice with ITK's series writer."""
    import itk

    folder.mkdir(parents=True)
    array = (np.random.default_rng(0).random(shape_zyx) * 1000).astype(np.int16)
    image = itk.image_from_array(array)
    writer = itk.ImageSeriesWriter[type(image), itk.Image[itk.SS, 2]].New()
    writer.SetInput(image)
    writer.SetImageIO(itk.GDCMImageIO.New())
    writer.SetFileNames([str(folder / f"slice{z:03d}.dcm") for z in range(shape_zyx[0])])
    writer.Update()
    return folder


@pytest.fixture
def bad_set(tmp_path: Path) -> dict[str, Path]:
    """One good volume and one of each kind of bad volume, in ``tmp_path/images``."""
    images = tmp_path / "images"
    images.mkdir()
    good = _good(images / "good.nii.gz")
    corrupt = images / "corrupt.nii.gz"
    corrupt.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    full = _good(images / "full.nii.gz", (32, 32, 32), seed=2).read_bytes()
    truncated = images / "truncated.nii.gz"
    truncated.write_bytes(full[: len(full) // 2])
    (images / "full.nii.gz").unlink()
    flat = _nifti(images / "flat.nii.gz", np.ones((64, 64), np.float32))
    nan_volume = np.ones((16, 16, 16), np.float32)
    nan_volume[1, 2, 3] = np.nan
    nan_volume[4, 5, 6] = np.inf
    nans = _nifti(images / "nans.nii.gz", nan_volume)
    small = _good(images / "small.nii.gz", (8, 8, 8))
    return {
        "good": good,
        "missing": images / "missing.nii.gz",
        "corrupt": corrupt,
        "truncated": truncated,
        "flat": flat,
        "nans": nans,
        "small": small,
    }


def test_check_volume_good_and_reasons(bad_set: dict[str, Path]) -> None:
    assert check_volume(str(bad_set["good"])) is None
    assert check_volume(str(bad_set["missing"])) == "does not exist"
    assert check_volume(str(bad_set["corrupt"])).startswith("cannot be read:")
    truncated = check_volume(str(bad_set["truncated"]))
    assert truncated.startswith("cannot be read:") and "EOFError" in truncated
    assert check_volume(str(bad_set["flat"])) == "is 2D (shape (64, 64)); a 3D volume is required"
    assert check_volume(str(bad_set["nans"])) == "contains 2 non-finite voxels (NaN/Inf)"
    assert check_volume(str(bad_set["nans"]), check_values=False) is None
    assert check_volume(str(bad_set["small"]), patch_size=(16, 16, 16)) is None  # will be padded
    assert (
        check_volume(str(bad_set["small"]), patch_size=(16, 16, 16), allow_pad=False)
        == "shape (8, 8, 8) is smaller than patch_size (16, 16, 16) and padding is disabled"
    )


@pytest.mark.parametrize(
    "shape, ok",
    [
        ((8, 8, 8, 3), True),
        ((8, 8, 8, 1), True),
        ((8, 8, 8, 1, 2), True),
        ((64, 64, 1), False),
        ((8, 8, 8, 2, 2), False),
    ],
)
def test_check_volume_channel_layouts(tmp_path: Path, shape: tuple[int, ...], ok: bool) -> None:
    reason = check_volume(str(_nifti(tmp_path / "v.nii.gz", np.ones(shape, np.float32))))
    assert (reason is None) == ok, reason
    if shape == (64, 64, 1):
        assert reason == "is 2D (shape (64, 64, 1)); a 3D volume is required"


def test_check_volume_uncompressed_truncated(tmp_path: Path) -> None:
    full = _good(tmp_path / "v.nii", (16, 16, 16)).read_bytes()
    (tmp_path / "v.nii").write_bytes(full[: len(full) - 1000])
    reason = check_volume(str(tmp_path / "v.nii"))
    assert (
        reason
        == f"is truncated: its header declares {len(full)} bytes (voxel data from offset 352), the file has {len(full) - 1000}"
    )


def test_check_volume_reads_in_bounded_slabs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import common.data.preflight as module

    volume = np.ones((16, 16, 40), np.float32)
    volume[:, :, 37] = np.nan
    path = _nifti(tmp_path / "v.nii.gz", volume)
    monkeypatch.setattr(module, "SLAB_BYTES", 16 * 16 * 4 * 3)  # three slices per read
    assert list(module._slabs((16, 16, 40), 4, 16 * 16 * 4 * 3))[-1] == (slice(None), slice(None), slice(39, 40))
    assert check_volume(str(path)) == "contains 256 non-finite voxels (NaN/Inf)"


def test_check_volume_bad_patch_size_raises() -> None:
    with pytest.raises(ValueError, match=r"patch_size must be 3 positive integers, got \[32, 32\]"):
        check_volume("whatever.nii.gz", patch_size=[32, 32])


def test_preflight_reports_every_problem_at_once(tmp_path: Path, bad_set: dict[str, Path]) -> None:
    order = ["good", "missing", "corrupt", "truncated", "flat", "nans", "small"]
    file = _datalist(tmp_path / "datalist.json", [bad_set[name] for name in order])
    with pytest.raises(PreflightError) as info:
        preflight(file, patch_size=(16, 16, 16), allow_pad=False)
    error = info.value
    lines = str(error).splitlines()
    assert lines[0] == f"preflight found 6 problem(s) in {file}:"
    assert len(lines) == 7 and len(error.problems) == 6
    expected = {
        "missing": "does not exist",
        "corrupt": "cannot be read:",
        "truncated": "cannot be read:",
        "flat": "is 2D (shape (64, 64))",
        "nans": "contains 2 non-finite voxels (NaN/Inf)",
        "small": "is smaller than patch_size (16, 16, 16) and padding is disabled",
    }
    for index, name in enumerate(order[1:], start=1):
        matching = [p for p in error.problems if str(bad_set[name]) in p]
        assert len(matching) == 1, (name, error.problems)
        assert matching[0].startswith(f"training[{index}] {bad_set[name]}: ")
        assert expected[name] in matching[0]
    assert not any(str(bad_set["good"]) in p for p in error.problems)


def test_preflight_ok_returns_sections_and_dedups(tmp_path: Path) -> None:
    a, b = _good(tmp_path / "a.nii.gz"), _good(tmp_path / "b.nii", seed=1)
    file = _datalist(tmp_path / "d.json", [a, a, b], [b])
    loaded = preflight(file, patch_size=[16, 16, 16], allow_pad=False, num_workers=2)
    assert [e["image"] for e in loaded["training"]] == [str(a), str(a), str(b)]
    assert [e["image"] for e in loaded["validation"]] == [str(b)]


def test_preflight_validation_optional_but_not_empty(tmp_path: Path) -> None:
    good = _good(tmp_path / "a.nii.gz")
    assert set(preflight(_datalist(tmp_path / "d.json", [good]))) == {"training"}
    with pytest.raises(PreflightError, match="'validation' is empty"):
        preflight(_datalist(tmp_path / "d.json", [good], []))


def test_preflight_empty_training(tmp_path: Path) -> None:
    file = _datalist(tmp_path / "d.json", [], [_good(tmp_path / "a.nii.gz")])
    with pytest.raises(PreflightError) as info:
        preflight(file)
    assert len(info.value.problems) == 1
    assert "'training' is empty" in info.value.problems[0] and "d.json" in info.value.problems[0]


def test_preflight_missing_training_section(tmp_path: Path) -> None:
    file = tmp_path / "d.json"
    file.write_text(json.dumps({"validation": [{"image": "a.nii.gz"}]}))
    with pytest.raises(PreflightError, match="no section 'training'; sections present: \\['validation'\\]"):
        preflight(file)


def test_preflight_bad_json(tmp_path: Path) -> None:
    file = tmp_path / "d.json"
    file.write_text('{"training": [')
    with pytest.raises(PreflightError) as info:
        preflight(file)
    assert len(info.value.problems) == 1
    assert str(file) in info.value.problems[0] and "not valid JSON" in info.value.problems[0]


def test_preflight_reports_bad_entries_and_bad_files_together(tmp_path: Path) -> None:
    file = tmp_path / "d.json"
    file.write_text(json.dumps({"training": [{"label": "x"}, {"image": "missing.nii.gz"}, 3]}))
    with pytest.raises(PreflightError) as info:
        preflight(file)
    problems = info.value.problems
    assert len(problems) == 3
    assert problems[0].startswith("training[0]: entry is missing required key 'image'")
    assert problems[1].startswith("training[2]: entry must be an object or a path string")
    assert problems[2] == f"training[1] {tmp_path / 'missing.nii.gz'}: does not exist"


def test_preflight_writes_nothing(tmp_path: Path, bad_set: dict[str, Path]) -> None:
    file = _datalist(tmp_path / "datalist.json", list(bad_set.values()), [bad_set["good"]])
    good_file = _datalist(tmp_path / "good.json", [bad_set["good"]])
    before = _listing(tmp_path)
    with pytest.raises(PreflightError):
        preflight(file, patch_size=(16, 16, 16))
    assert _listing(tmp_path) == before
    preflight(good_file)
    assert _listing(tmp_path) == before


def test_preflight_accepts_dicom_series_folder(tmp_path: Path) -> None:
    # ITK's series writer places its slices only once this process has written a series with positions: accepted
    # either way when irregular series are (test_data_dicom.py checks that a series without geometry is refused)
    series = _write_dicom_series(tmp_path / "series")
    assert check_volume(str(series), allow_irregular_series=True) is None
    series = write_dicom_series(tmp_path / "placed", np.ones((16, 16, 8), np.float32), spacing=(1.0, 1.0, 2.0))
    assert check_volume(str(series)) is None
    assert check_volume(str(series), patch_size=(16, 16, 16), allow_pad=False) is not None  # only 8 slices
    files = sorted(str(p) for p in series.glob("*.dcm"))
    file = tmp_path / "d.json"
    file.write_text(json.dumps({"training": [{"image": "placed"}, {"image": files}]}))
    loaded = preflight(file)
    assert loaded["training"][0]["image"] == str(series)
    empty = tmp_path / "empty_series"
    empty.mkdir()
    assert check_volume(str(empty)) == "is a folder without files; a DICOM series folder is required"


def test_check_volume_other_formats_via_monai(tmp_path: Path) -> None:
    import itk

    volume = itk.image_from_array(np.ones((6, 7, 8), np.float32))
    itk.imwrite(volume, str(tmp_path / "v.mha"))
    itk.imwrite(itk.image_from_array(np.ones((7, 8), np.float32)), str(tmp_path / "s.nrrd"))
    assert check_volume(str(tmp_path / "v.mha"), patch_size=(8, 7, 6), allow_pad=False) is None
    assert check_volume(str(tmp_path / "s.nrrd")) == "is 2D (shape (8, 7)); a 3D volume is required"
    with gzip.open(tmp_path / "junk.mha", "wb") as handle:
        handle.write(b"not an image")
    assert check_volume(str(tmp_path / "junk.mha")).startswith("cannot be read:")


def _run_cli(repo_root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    return subprocess.run(
        [sys.executable, "-m", "common.data.preflight", *args],
        cwd=repo_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_exit_codes(tmp_path: Path, repo_root: Path) -> None:
    good = _good(tmp_path / "a.nii.gz", (16, 16, 16))
    ok = _run_cli(repo_root, str(_datalist(tmp_path / "ok.json", [good, good], [good])), "--patch_size", "[16,16,16]")
    assert ok.returncode == 0, ok.stderr
    assert "preflight OK: 2 training, 1 validation volumes" in ok.stdout
    bad = _run_cli(
        repo_root,
        str(_datalist(tmp_path / "bad.json", [good, tmp_path / "gone.nii.gz"])),
        "--patch_size",
        "[32,32,32]",
        "--allow_pad",
        "False",
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "error: preflight found 2 problem(s)" in bad.stderr
    assert "gone.nii.gz: does not exist" in bad.stderr
    assert "is smaller than patch_size (32, 32, 32)" in bad.stderr


# ---------------------------------------------------------------------------------------------- max_cases
@pytest.fixture
def cohort(tmp_path: Path) -> dict:
    """Training: good, good, missing, corrupt; validation: good, missing. Only the first entries are usable."""
    good = [_good(tmp_path / f"good{i}.nii.gz", seed=i) for i in range(3)]
    corrupt = tmp_path / "corrupt.nii.gz"
    corrupt.write_bytes(b"not a nifti file at all" * 20)
    training = [good[0], good[1], tmp_path / "missing.nii.gz", corrupt]
    validation = [good[2], tmp_path / "missing_val.nii.gz"]
    return {
        "file": _datalist(tmp_path / "d.json", training, validation),
        "training": training,
        "validation": validation,
    }


def _spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every volume read (``_inspect`` does all reading, for ``check_volume`` and ``preflight`` alike)."""
    import common.data.preflight as module

    seen: list[str] = []
    inspect = module._inspect

    def spy(path, *args, **kwargs):
        seen.append(str(path))
        return inspect(path, *args, **kwargs)

    monkeypatch.setattr(module, "_inspect", spy)
    return seen


def test_preflight_max_cases_keeps_and_checks_only_the_first_entries(cohort: dict, monkeypatch) -> None:
    seen = _spy_reads(monkeypatch)
    loaded = preflight(cohort["file"], max_cases=1)
    assert [e["image"] for e in loaded["training"]] == [str(cohort["training"][0])]
    assert [e["image"] for e in loaded["validation"]] == [str(cohort["validation"][0])]
    assert sorted(seen) == sorted([str(cohort["training"][0]), str(cohort["validation"][0])])  # nothing else read


def test_preflight_max_cases_reports_problems_within_the_kept_entries_only(cohort: dict) -> None:
    with pytest.raises(PreflightError) as info:
        preflight(cohort["file"], max_cases=3)
    problems = info.value.problems
    assert problems == [
        f"training[2] {cohort['training'][2]}: does not exist",
        f"validation[1] {cohort['validation'][1]}: does not exist",
    ]  # training[3] (corrupt) lies beyond max_cases
    with pytest.raises(PreflightError) as info:
        preflight(cohort["file"])
    assert len(info.value.problems) == 3 and any("training[3]" in p for p in info.value.problems)


def test_preflight_max_cases_larger_than_a_section_keeps_it_whole(tmp_path: Path) -> None:
    good = [_good(tmp_path / f"g{i}.nii.gz", seed=i) for i in range(3)]
    loaded = preflight(_datalist(tmp_path / "d.json", good, good[:1]), max_cases=2)
    assert [e["image"] for e in loaded["training"]] == [str(g) for g in good[:2]]
    assert [e["image"] for e in loaded["validation"]] == [str(good[0])]
    assert len(preflight(_datalist(tmp_path / "d.json", good), max_cases=10)["training"]) == 3


def test_max_cases_also_skips_bad_entries_beyond_it(tmp_path: Path) -> None:
    good = _good(tmp_path / "a.nii.gz")
    file = tmp_path / "d.json"
    file.write_text(json.dumps({"training": [{"image": str(good)}, {"label": "x"}, 7]}))
    assert [e["image"] for e in preflight(file, max_cases=1)["training"]] == [str(good)]
    with pytest.raises(PreflightError) as info:
        preflight(file, max_cases=2)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("training[1]: entry is missing required key 'image'")


def test_load_sections_max_cases(cohort: dict, monkeypatch) -> None:
    from common.data.preflight import load_sections

    seen = _spy_reads(monkeypatch)
    loaded = load_sections(cohort["file"], max_cases=2)
    assert [e["image"] for e in loaded["training"]] == [str(p) for p in cohort["training"][:2]]
    assert [e["image"] for e in loaded["validation"]] == [str(p) for p in cohort["validation"][:2]]
    assert len(load_sections(cohort["file"])["training"]) == 4
    assert load_sections(cohort["file"], max_cases=2.0) == loaded  # a whole float (from a config) is fine
    assert seen == []  # no volume is read


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "abc"])
def test_invalid_max_cases_is_a_preflight_error(cohort: dict, bad) -> None:
    from common.data.preflight import load_sections

    match = rf"max_cases must be a positive integer or null, got {bad!r}".replace("(", r"\(")
    with pytest.raises(PreflightError, match=match):
        preflight(cohort["file"], max_cases=bad)
    with pytest.raises(PreflightError, match=match):
        load_sections(cohort["file"], max_cases=bad)


def test_run_preflight_passes_max_cases_on(cohort: dict, capsys) -> None:
    from common.data.preflight import run_preflight

    loaded = run_preflight(cohort["file"], max_cases=1)
    assert [e["image"] for e in loaded["training"]] == [str(cohort["training"][0])]
    assert [e["image"] for e in loaded["validation"]] == [str(cohort["validation"][0])]
    with pytest.raises(PreflightError) as info:
        run_preflight(cohort["file"], max_cases=3)
    err = str(info.value)
    assert "preflight found 2 problem(s)" in err and "training[3]" not in err
    unchecked = run_preflight(cohort["file"], enabled=False, max_cases=3)  # structure only, no volume read
    assert [e["image"] for e in unchecked["training"]] == [str(p) for p in cohort["training"][:3]]
    with pytest.raises(PreflightError, match="max_cases must be a positive integer or null, got 0"):
        run_preflight(cohort["file"], enabled=False, max_cases=0)
    assert capsys.readouterr() == ("", "")  # raised, not printed


# ------------------------------------------------------------- multi-modality: channels, shapes, case ids
MODALITIES = ("t1n", "t1c", "t2w", "t2f")


def _brats_case(root: Path, case_id: str, shapes: dict[str, tuple[int, ...]] | None = None) -> dict:
    """Write one BraTS-style case (4 modalities and a label, (6, 6, 5) unless ``shapes`` says otherwise) and
    return its datalist entry."""
    folder = root / case_id
    folder.mkdir(parents=True)
    entry: dict = {"case_id": case_id}
    for seed, key in enumerate((*MODALITIES, "label")):
        shape = (shapes or {}).get(key, (6, 6, 5))
        entry[key] = str(_good(folder / f"{case_id}-{key}.nii.gz", shape, seed=seed))
    return entry


def _write_json(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "shape, channels",
    [((6, 6, 5), 1), ((6, 6, 5, 1), 1), ((6, 6, 5, 2), 2), ((6, 6, 5, 1, 3), 3)],
)
def test_check_volume_num_channels_nifti_layouts(tmp_path: Path, shape: tuple[int, ...], channels: int) -> None:
    path = str(_good(tmp_path / "v.nii.gz", shape))
    assert check_volume(path) is None  # no channel check by default
    assert check_volume(path, num_channels=channels) is None
    other = 2 if channels == 1 else 1
    plural = "channel" if channels == 1 else "channels"
    assert check_volume(path, num_channels=other) == f"has {channels} {plural}; {other} expected"


def test_check_volume_num_channels_validation_and_precedence(tmp_path: Path) -> None:
    flat = str(_nifti(tmp_path / "flat.nii.gz", np.ones((8, 8), np.float32)))
    assert check_volume(flat, num_channels=3) == "is 2D (shape (8, 8)); a 3D volume is required"  # first reason wins
    assert check_volume(str(tmp_path / "gone.nii.gz"), num_channels=1) == "does not exist"
    good = str(_good(tmp_path / "v.nii.gz", (6, 6, 5)))
    assert check_volume(good, num_channels=2.0) == "has 1 channel; 2 expected"  # a whole float (from a config)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match=r"num_channels must be a positive integer or None, got "):
            check_volume(good, num_channels=bad)
    with pytest.raises(ValueError, match="per-key counts are given to preflight"):
        check_volume(good, num_channels={"image": 1})


def test_check_volume_num_channels_itk_and_monai(tmp_path: Path) -> None:
    import itk

    series = str(_write_dicom_series(tmp_path / "series", (6, 7, 8)))
    assert check_volume(series, num_channels=1) is None
    assert check_volume(series, num_channels=3) == "has 1 channel; 3 expected"
    itk.imwrite(itk.image_from_array(np.ones((6, 7, 8), np.float32)), str(tmp_path / "s.mha"))
    vector = itk.image_from_array(np.ones((6, 7, 8, 2), np.float32), is_vector=True)
    itk.imwrite(vector, str(tmp_path / "v.mha"))
    assert check_volume(str(tmp_path / "s.mha"), num_channels=1) is None
    assert check_volume(str(tmp_path / "v.mha"), num_channels=2) is None
    assert check_volume(str(tmp_path / "v.mha"), num_channels=1) == "has 2 channels; 1 expected"


def test_preflight_clean_four_modality_case_passes(tmp_path: Path) -> None:
    cases = [_brats_case(tmp_path, f"BraTS-GLI-0000{i}-000") for i in range(2)]
    file = _write_json(tmp_path / "d.json", {"training": cases[:1], "validation": cases[1:]})
    loaded = preflight(file, keys=MODALITIES, num_channels=1)
    assert loaded["training"] == cases[:1] and loaded["validation"] == cases[1:]
    assert preflight(file, keys=(*MODALITIES, "label"), num_channels={"label": 1}) == loaded


def test_preflight_wrong_channel_counts_name_key_and_case(tmp_path: Path) -> None:
    two = _brats_case(tmp_path, "BraTS-GLI-00000-000", {"t1c": (6, 6, 5, 2)})  # 2 channels where 1 is expected
    file = _write_json(tmp_path / "d.json", {"training": [two]})
    assert preflight(file, keys=MODALITIES)  # no channel check without num_channels
    with pytest.raises(PreflightError) as info:
        preflight(file, keys=MODALITIES, num_channels=1)
    assert info.value.problems == [
        f"training[0] (case BraTS-GLI-00000-000) {two['t1c']}: has 2 channels; 1 expected for key 't1c'"
    ]
    with pytest.raises(PreflightError) as info:  # and 1 channel where 2 are expected
        preflight(file, keys=MODALITIES, num_channels={"t1c": 2, "t1n": 2})
    assert info.value.problems == [
        f"training[0] (case BraTS-GLI-00000-000) {two['t1n']}: has 1 channel; 2 expected for key 't1n'"
    ]


def test_preflight_num_channels_per_key_mapping(tmp_path: Path) -> None:
    image = _good(tmp_path / "image.nii.gz", (6, 6, 5, 4))
    label = _good(tmp_path / "label.nii.gz", (6, 6, 5))
    file = _write_json(tmp_path / "d.json", {"training": [{"image": str(image), "label": str(label)}]})
    keys = ("image", "label")
    assert preflight(file, keys=keys, num_channels={"image": 4, "label": 1})
    assert preflight(file, keys=keys, num_channels={"image": 4, "label": None})  # None: key not checked
    with pytest.raises(PreflightError) as info:
        preflight(file, keys=keys, num_channels={"image": 1, "label": 1})
    assert info.value.problems == [f"training[0] {image}: has 4 channels; 1 expected for key 'image'"]
    with pytest.raises(ValueError, match=r"num_channels names key 'seg', which is not one of the checked keys"):
        preflight(file, keys=keys, num_channels={"image": 4, "seg": 1})
    with pytest.raises(ValueError, match=r"num_channels\['label'\] must be a positive integer or None, got 0"):
        preflight(file, keys=keys, num_channels={"image": 4, "label": 0})
    with pytest.raises(ValueError, match=r"num_channels must be a positive integer or None, got 'x'"):
        preflight(file, keys=keys, num_channels="x")


def test_preflight_one_file_under_two_keys_is_read_once_and_checked_per_key(tmp_path: Path, monkeypatch) -> None:
    seen = _spy_reads(monkeypatch)
    path = str(_good(tmp_path / "v.nii.gz", (6, 6, 5)))
    file = _write_json(tmp_path / "d.json", {"training": [{"case_id": "c0", "image": path, "label": path}]})
    with pytest.raises(PreflightError) as info:
        preflight(file, keys=("image", "label"), num_channels={"image": 1, "label": 2})
    assert info.value.problems == [f"training[0] (case c0) {path}: has 1 channel; 2 expected for key 'label'"]
    assert seen == [path]


def test_preflight_mismatched_shapes_within_a_case(tmp_path: Path) -> None:
    good = _brats_case(tmp_path, "BraTS-GLI-00000-000")
    off = _brats_case(tmp_path, "BraTS-GLI-00003-000", {"t2f": (6, 6, 4)})
    anonymous = _brats_case(tmp_path, "anonymous", {"t1c": (7, 6, 5)})
    del anonymous["case_id"]
    file = _write_json(tmp_path / "d.json", {"training": [good, off], "validation": [anonymous]})
    with pytest.raises(PreflightError) as info:
        preflight(file, keys=MODALITIES)
    assert info.value.problems == [
        "training[1] (case BraTS-GLI-00003-000): spatial shapes differ between keys: t1n (6, 6, 5), "
        "t1c (6, 6, 5), t2w (6, 6, 5), t2f (6, 6, 4); modalities of a case must share one grid",
        "validation[0]: spatial shapes differ between keys: t1n (6, 6, 5), t1c (7, 6, 5), t2w (6, 6, 5), "
        "t2f (6, 6, 5); modalities of a case must share one grid",
    ]
    assert preflight(file, keys=MODALITIES, same_shape=False)
    assert preflight(file, keys=("t2f",))  # a single key has nothing to compare with
    # channels do not count as shape: (X, Y, Z, 2) and (X, Y, Z) share one grid
    two = _brats_case(tmp_path, "two", {"t1n": (6, 6, 5, 2)})
    assert preflight(_write_json(tmp_path / "two.json", {"training": [two]}), keys=MODALITIES)


def test_preflight_skips_shape_comparison_when_a_volume_has_a_problem(tmp_path: Path) -> None:
    case = _brats_case(tmp_path, "BraTS-GLI-00001-000", {"t2f": (6, 6, 4), "t1c": (6, 6, 5, 2)})
    file = _write_json(tmp_path / "d.json", {"training": [case]})
    with pytest.raises(PreflightError) as info:
        preflight(file, keys=MODALITIES, num_channels=1)
    assert info.value.problems == [
        f"training[0] (case BraTS-GLI-00001-000) {case['t1c']}: has 2 channels; 1 expected for key 't1c'"
    ]


def test_preflight_case_ids_in_entry_and_volume_problems(tmp_path: Path) -> None:
    good = _brats_case(tmp_path, "BraTS-GLI-00000-000")
    incomplete = {k: v for k, v in _brats_case(tmp_path, "BraTS-GLI-00002-000").items() if k != "t2f"}
    gone = dict(_brats_case(tmp_path, "BraTS-GLI-00003-000"), t1n=str(tmp_path / "gone.nii.gz"))
    no_id = {k: v for k, v in _brats_case(tmp_path, "no-id").items() if k not in ("case_id", "t2w")}
    blank_id = dict(_brats_case(tmp_path, "blank"), case_id="", t1c=str(tmp_path / "gone2.nii.gz"))
    file = _write_json(tmp_path / "d.json", {"training": [good, incomplete, gone, no_id, blank_id, 7]})
    with pytest.raises(PreflightError) as info:
        preflight(file, keys=MODALITIES)
    present = sorted(incomplete)
    assert info.value.problems == [
        f"training[1] (case BraTS-GLI-00002-000): entry is missing required key 't2f' (keys present: {present})",
        f"training[3]: entry is missing required key 't2w' (keys present: {sorted(no_id)})",
        "training[5]: entry must be an object or a path string, got int 7",
        f"training[2] (case BraTS-GLI-00003-000) {tmp_path / 'gone.nii.gz'}: does not exist",
        f"training[4] {tmp_path / 'gone2.nii.gz'}: does not exist",
    ]
    from common.data.preflight import load_sections

    with pytest.raises(PreflightError) as info:  # structure-only loading names the case too
        load_sections(file, keys=MODALITIES)
    assert info.value.problems[0].startswith("training[1] (case BraTS-GLI-00002-000): entry is missing")
    in_memory = {"training": [{"case_id": 12, "image": str(tmp_path / "x.nii.gz")}, {"case_id": 13}]}
    with pytest.raises(PreflightError) as info:
        preflight(in_memory)
    assert info.value.problems == [
        "training[1] (case 13): entry is missing required key 'image' (keys present: ['case_id'])",
        f"training[0] (case 12) {tmp_path / 'x.nii.gz'}: does not exist",
    ]


def test_preflight_shards_by_entry_when_comparing_shapes(tmp_path: Path, monkeypatch) -> None:
    seen = _spy_reads(monkeypatch)
    cases = [_brats_case(tmp_path, f"c{i}", {"t2f": (6, 6, 4)} if i == 1 else None) for i in range(3)]
    file = _write_json(tmp_path / "d.json", {"training": cases})
    problems: list[str] = []
    reads: list[list[str]] = []
    for rank in range(2):
        seen.clear()
        try:
            preflight(file, keys=MODALITIES, shard=(rank, 2))
        except PreflightError as exc:
            problems += exc.problems
        reads.append(sorted(seen))
    assert len(problems) == 1 and problems[0].startswith("training[1] (case c1): spatial shapes differ")
    everything = sorted(case[k] for case in cases for k in MODALITIES)
    assert sorted(reads[0] + reads[1]) == everything  # each volume read once, by the rank owning its case
    for case in cases:  # all volumes of a case are read by one rank, so its shapes can be compared there
        assert sum({case[k] for k in MODALITIES} <= set(rank_reads) for rank_reads in reads) == 1


def test_run_preflight_passes_num_channels_and_same_shape_on(tmp_path: Path, capsys) -> None:
    from common.data.preflight import run_preflight

    case = _brats_case(tmp_path, "BraTS-GLI-00005-000", {"t2w": (6, 6, 5, 3), "t2f": (5, 6, 5)})
    file = _write_json(tmp_path / "d.json", {"training": [case]})
    with pytest.raises(PreflightError) as info:
        run_preflight(file, keys=MODALITIES, num_channels=1)
    err = str(info.value)
    assert "preflight found 1 problem(s)" in err
    assert f"training[0] (case BraTS-GLI-00005-000) {case['t2w']}: has 3 channels; 1 expected for key 't2w'" in err
    with pytest.raises(PreflightError, match="spatial shapes differ between keys"):
        run_preflight(file, keys=MODALITIES)
    assert run_preflight(file, keys=MODALITIES, same_shape=False)["training"] == [case]


def test_cli_num_channels_and_same_shape(tmp_path: Path, repo_root: Path) -> None:
    case = _brats_case(tmp_path, "BraTS-GLI-00007-000", {"t2f": (6, 6, 4)})
    file = str(_write_json(tmp_path / "d.json", {"training": [case]}))
    keys = "[t1n,t1c,t2w,t2f]"
    bad = _run_cli(repo_root, file, "--keys", keys, "--num_channels", "{t1n: 2}")
    assert bad.returncode == 1
    assert "has 1 channel; 2 expected for key 't1n'" in bad.stderr and "spatial shapes differ" not in bad.stderr
    shapes = _run_cli(repo_root, file, "--keys", keys, "--num_channels", "1")
    assert shapes.returncode == 1 and "(case BraTS-GLI-00007-000): spatial shapes differ" in shapes.stderr
    ok = _run_cli(repo_root, file, "--keys", keys, "--num_channels", "1", "--same_shape", "False")
    assert ok.returncode == 0, ok.stderr
    assert "preflight OK: 1 training, 0 validation volumes" in ok.stdout


def test_preflight_reads_every_format_inference_lists(tmp_path: Path) -> None:
    """Every case :func:`common.data.datalist.find_volumes` lists (NRRD with attached and detached header,
    MetaImage with attached and detached data, a DICOM series folder without file suffixes) passes the preflight
    that fast_ddpm_3d and mace_survival inference run; their sizes are the ITK ones."""
    from common.data.datalist import find_volumes
    from tests.helpers import write_format_cases, write_itk_volume

    array = np.arange(12 * 10 * 8, dtype=np.float32).reshape(12, 10, 8)
    write_format_cases(tmp_path, array)
    write_itk_volume(tmp_path / "detached.nhdr", array)
    write_itk_volume(tmp_path / "detached.mhd", array)
    entries = find_volumes(tmp_path)
    assert len(entries) == 5
    for entry in entries:
        assert check_volume(entry["image"], patch_size=(12, 10, 8), allow_pad=False, num_channels=1) is None, entry
        assert "shape (12, 10, 8) is smaller" in check_volume(entry["image"], patch_size=(13, 10, 8), allow_pad=False)
    sections = preflight({"testing": entries}, sections=["testing"], required=["testing"], num_channels=1)
    assert len(sections["testing"]) == 5


def test_a_broken_symbolic_link_is_named_with_its_target(tmp_path: Path) -> None:
    """A link whose target was moved or unmounted: the header screen of inference and the training preflight name
    the target instead of a bare "does not exist"."""
    good = _good(tmp_path / "good.nii.gz")
    target = tmp_path / "moved" / "gone.nii.gz"
    link = tmp_path / "gone.nii.gz"
    os.symlink(target, link)
    relative = tmp_path / "relative.nii.gz"
    os.symlink("moved/other.nii.gz", relative)
    chain = tmp_path / "chain.nii.gz"
    os.symlink(link, chain)
    reason = f"is a broken symbolic link: its target {target} does not exist"
    assert screen_entries([{"image": str(good)}, {"image": str(link)}]) == [[], [reason]]
    assert check_volume(str(link)) == reason
    assert check_volume(str(relative)) == (
        f"is a broken symbolic link: its target {tmp_path / 'moved' / 'other.nii.gz'} does not exist"
    )
    assert check_volume(str(chain)) == (
        f"is a broken symbolic link: its target {link} (it leads to {target}) does not exist"
    )
    loop = tmp_path / "loop.nii.gz"
    os.symlink(loop, loop)
    assert check_volume(str(loop)) == f"is a symbolic link loop (through {loop})"
    with pytest.raises(PreflightError) as info:
        preflight(_datalist(tmp_path / "list.json", [good, link]))
    assert info.value.problems == [f"training[1] {link}: {reason}"]
    series = _write_dicom_series(tmp_path / "series")
    files = sorted(str(p) for p in series.glob("*.dcm"))
    os.symlink(tmp_path / "pacs" / "slice008.dcm", series / "slice008.dcm")
    listed = [*files, str(series / "slice008.dcm")]
    assert screen_entries([{"image": listed}]) == [
        [
            f"1 of 9 series files do not exist (first: {series / 'slice008.dcm'}, a broken symbolic link: its target "
            f"{tmp_path / 'pacs' / 'slice008.dcm'} does not exist)"
        ]
    ]

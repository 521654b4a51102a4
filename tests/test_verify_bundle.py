# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Tests of ``scripts/verify_bundle.py`` / ``common.bundle_tools.verify``: every bundle of the repository passes,
and deliberately broken copies of a bundle give exactly the expected problem lines and exit status 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.bundle import bundle_names, resolve_bundle
from common.bundle_tools.verify import (
    check_large_files,
    check_net_in_out,
    verify_bundle,
    verify_bundles,
)
from common.errors import BundleNotFoundError
from tests.helpers import BUNDLES, REPO_ROOT, bundle_env

SCRIPT = REPO_ROOT / "scripts" / "verify_bundle.py"
EXAMPLE = "autoencoder_3d"
ALL_BUNDLES = [BUNDLES / name for name in bundle_names()]
IN = "configs/inference.json + configs/tiny.json"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO_ROOT,
        env=bundle_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _copy_bundle(dst: Path, name: str = EXAMPLE) -> Path:
    """A copy of ``bundles/<name>`` (configs, docs, LICENSE, large_files.yml; no data or outputs) at ``dst``."""
    ignore = shutil.ignore_patterns("outputs", "demo_data", "models", "eval", "__pycache__")
    shutil.copytree(BUNDLES / name, dst, ignore=ignore)
    return dst


def _edit_json(path: Path, change: Callable[[dict], object]) -> None:
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content, indent=4))


def _rename_trainer(train: dict) -> None:
    train["train"]["trainer2"] = train["train"].pop("trainer")


def _break_json(path: Path) -> None:
    path.write_text(path.read_text().rstrip() + "\n}\n")


def _json_error_line(path: Path) -> int:
    return len(path.read_text().rstrip().splitlines())


# case -> (breakage applied to the copy's folder, expected problem lines after the "<copy>: " prefix)
BROKEN: dict[str, tuple[Callable[[Path], None], Callable[[Path], list[str]]]] = {
    "no_logging_conf": (
        lambda b: (b / "configs" / "logging.conf").unlink(),
        lambda b: ["configs/logging.conf: required file is missing"],
    ),
    "version_not_in_changelog": (
        lambda b: _edit_json(b / "configs" / "metadata.json", lambda m: m.update(version="9.9.9")),
        lambda b: [
            "configs/metadata.json: version '9.9.9' is not in changelog (has "
            + ", ".join(repr(v) for v in json.loads((b / "configs" / "metadata.json").read_text())["changelog"])
            + ")"
        ],
    ),
    "no_authors": (
        lambda b: _edit_json(b / "configs" / "metadata.json", lambda m: m.pop("authors")),
        lambda b: ["configs/metadata.json: schema violation at $: 'authors' is a required property"],
    ),
    "no_description": (
        lambda b: _edit_json(b / "configs" / "metadata.json", lambda m: m.pop("collection")),
        lambda b: [
            "configs/metadata.json: no 'collection' section (the bundle's family and demo; see "
            "common.bundle_tools.registry)"
        ],
    ),
    "broken_description": (
        lambda b: _edit_json(
            b / "configs" / "metadata.json",
            lambda m: m["collection"].update(
                family="segmentation", demo={**m["collection"]["demo"], "gpu": {"max_epoch": 5}, "reported_metrics": []}
            ),
        ),
        lambda b: [
            "configs/metadata.json: 'collection.family' must name a package of common/, got 'segmentation'",
            "configs/metadata.json: 'collection.demo.gpu' overrides ['max_epoch'], which are not ids of its configs",
            "configs/metadata.json: 'collection.demo.reported_metrics' must be a non-empty list of metric names",
        ],
    ),
    "no_trainer": (
        lambda b: _edit_json(b / "configs" / "train.json", _rename_trainer),
        lambda b: ["configs/train.json: missing required id 'train#trainer'"],
    ),
    "invalid_inference_json": (
        lambda b: _break_json(b / "configs" / "inference.json"),
        lambda b: [
            f"configs/inference.json: invalid JSON at line {_json_error_line(b / 'configs' / 'inference.json')}, "
            "column 1: Extra data"
        ],
    ),
    "norm_groups_not_dividing_channels": (
        lambda b: _edit_json(b / "configs" / "tiny.json", lambda t: t.update(norm_num_groups=3)),
        lambda b: [
            "configs/train.json + configs/tiny.json: cannot instantiate 'network_def': "
            "ValueError: AutoencoderKL expects all channels being multiple of norm_num_groups",
            f"{IN}: cannot instantiate 'network': "
            "ValueError: AutoencoderKL expects all channels being multiple of norm_num_groups",
        ],
    ),
}


@pytest.fixture(scope="module")
def repo_run() -> subprocess.CompletedProcess:
    """The full (non-quick) check of every bundle in the repository, once."""
    return _cli()


@pytest.fixture(scope="module")
def broken_copies(tmp_path_factory) -> dict[str, Path]:
    copies = {}
    for case, (breakage, _) in BROKEN.items():
        copy = _copy_bundle(tmp_path_factory.mktemp(case) / EXAMPLE)
        breakage(copy)
        copies[case] = copy
    return copies


@pytest.fixture(scope="module")
def broken_run(broken_copies) -> subprocess.CompletedProcess:
    """One full CLI check of all broken copies (by path) and of the example bundle (by name)."""
    return _cli(*map(str, broken_copies.values()), EXAMPLE)


@pytest.fixture
def in_repo_root(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)


def test_bundles_are_discovered():
    assert ALL_BUNDLES and BUNDLES / EXAMPLE in ALL_BUNDLES
    assert all((b / "configs" / "metadata.json").is_file() for b in ALL_BUNDLES)


@pytest.mark.parametrize("bundle", ALL_BUNDLES, ids=lambda b: b.name)
def test_every_bundle_passes(repo_run, bundle):
    lines = repo_run.stdout.splitlines()
    assert [line for line in lines if line.startswith(f"bundles/{bundle.name}:")] == []
    assert f"OK: {bundle.name}" in lines


def test_repository_exit_status_zero(repo_run):
    assert repo_run.returncode == 0, repo_run.stdout + repo_run.stderr[-3000:]
    assert repo_run.stdout.splitlines() == [f"OK: {b.name}" for b in ALL_BUNDLES]


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_copy_cli(broken_run, broken_copies, case):
    copy = broken_copies[case]
    expected = [f"{copy}: {line}" for line in BROKEN[case][1](copy)]
    assert [line for line in broken_run.stdout.splitlines() if line.startswith(f"{copy}: ")] == expected
    assert f"OK: {EXAMPLE}" in broken_run.stdout.splitlines()
    assert broken_run.returncode == 1


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_copy_library(broken_copies, case, in_repo_root):
    copy = broken_copies[case]
    expected = [f"{copy}: {line}" for line in BROKEN[case][1](copy)]
    assert verify_bundle(copy) == expected
    lines, status = verify_bundles([str(copy)], BUNDLES)
    assert (lines, status) == (expected, 1)


def test_quick_skips_instantiation(broken_copies, in_repo_root):
    assert verify_bundle(broken_copies["norm_groups_not_dividing_channels"], quick=True) == []
    assert verify_bundles([str(broken_copies["no_trainer"])], BUNDLES, quick=True)[1] == 1


def test_unknown_bundle_name(in_repo_root):
    lines, status = verify_bundles(["no_such_bundle"], BUNDLES, quick=True)
    assert status == 1
    assert lines == [
        f"unknown bundle 'no_such_bundle': neither a bundle in {str(BUNDLES)!r} nor a folder with "
        f"configs/metadata.json; available: {', '.join(p.name for p in ALL_BUNDLES)}."
    ]


def test_bundle_names_and_resolve_bundle(tmp_path, monkeypatch):
    """One way to list and find bundles: folders with configs/metadata.json, by name under a bundles folder or by
    path (relative to the working directory or absolute); anything else is one error naming what there is."""
    for name in ("b", "a"):
        (tmp_path / name / "configs").mkdir(parents=True)
        (tmp_path / name / "configs" / "metadata.json").write_text("{}")
    (tmp_path / "not_a_bundle").mkdir()
    assert bundle_names(tmp_path) == ["a", "b"]
    assert resolve_bundle("a", tmp_path) == tmp_path / "a"
    assert resolve_bundle(tmp_path / "b") == tmp_path / "b"
    monkeypatch.chdir(tmp_path)
    assert resolve_bundle("b", tmp_path / "not_a_bundle") == tmp_path / "b"  # a relative path
    assert resolve_bundle(EXAMPLE) == BUNDLES / EXAMPLE  # a name under the repository's bundles/
    with pytest.raises(BundleNotFoundError, match=r"unknown bundle 'not_a_bundle': .*; available: a, b\.$") as info:
        resolve_bundle("not_a_bundle", tmp_path)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    lines, status = verify_bundles([], tmp_path / "not_a_bundle")
    assert status == 1 and lines == [f"{tmp_path / 'not_a_bundle'}: no bundles found (no */configs/metadata.json)"]


def test_multi_gpu_must_be_distributed(tmp_path, in_repo_root):
    copy = _copy_bundle(tmp_path / EXAMPLE)
    _edit_json(copy / "configs" / "multi_gpu_train.json", lambda c: c.update(distributed=False))
    _edit_json(copy / "configs" / "multi_gpu_train.json", lambda c: c.pop("finalize"))
    _edit_json(copy / "configs" / "train.json", lambda c: c.pop("finalize"))
    assert verify_bundle(copy, quick=True) == [
        f"{copy}: configs/train.json: missing required id 'finalize'",
        f"{copy}: configs/train.json + configs/multi_gpu_train.json: missing required id 'finalize'",
        f"{copy}: configs/train.json + configs/multi_gpu_train.json: 'distributed' must be true, got False",
    ]


def test_metadata_io_names_and_nested_schema_path(tmp_path, in_repo_root):
    copy = _copy_bundle(tmp_path / EXAMPLE)

    def change(meta: dict) -> None:
        fmt = meta["network_data_format"]
        fmt["inputs"]["image"]["num_channels"] = "one"
        fmt["outputs"]["latent"] = fmt["outputs"].pop("pred")

    _edit_json(copy / "configs" / "metadata.json", change)
    assert verify_bundle(copy, quick=True) == [
        f"{copy}: configs/metadata.json: schema violation at $.network_data_format.inputs.image.num_channels: "
        "'one' is not of type 'integer'",
        f"{copy}: configs/metadata.json: network_data_format.outputs has no 'pred' (has 'latent')",
    ]


def test_inference_output_checked_against_metadata(tmp_path, in_repo_root):
    """An inference network whose output contradicts the metadata (here: the latent encoder) is reported."""
    copy = _copy_bundle(tmp_path / EXAMPLE)
    _edit_json(copy / "configs" / "tiny.json", lambda t: t.update(mode="encode"))
    latent_channels = json.loads((copy / "configs" / "train.json").read_text())[
        "latent_channels"
    ]  # read back by inference
    assert verify_bundle(copy) == [
        f"{copy}: {IN}: 'network' output has {latent_channels} channels, metadata outputs.pred.num_channels is 1",
        f"{copy}: {IN}: 'network' output spatial shape (4, 4, 4) does not match (16, 16, 16), "
        "metadata outputs.pred.spatial_shape ['4*n', '4*n', '4*n'] with n=4, p=1",
    ]


def _meta(out_channels: int = 1, out_shape: list | None = None, dtype: str = "float32") -> dict:
    tensor = {"num_channels": 1, "spatial_shape": ["2*n", "2*n", 6], "dtype": "float32"}
    out = dict(tensor, num_channels=out_channels, spatial_shape=out_shape or tensor["spatial_shape"], dtype=dtype)
    return {"network_data_format": {"inputs": {"image": tensor}, "outputs": {"pred": out}}}


class _Pair(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_check_net_in_out_unit():
    identity = torch.nn.Identity()
    assert check_net_in_out(identity, _meta(), n=3) == []
    assert check_net_in_out(identity, _meta(out_shape=["*", "2*n", 6]), n=3) == []
    assert check_net_in_out(identity, _meta(out_channels=2), n=3) == [
        f"{IN}: 'network' output has 1 channels, metadata outputs.pred.num_channels is 2"
    ]
    assert check_net_in_out(torch.nn.AvgPool3d(2), _meta(), n=3) == [
        f"{IN}: 'network' output spatial shape (3, 3, 3) does not match (6, 6, 6), "
        "metadata outputs.pred.spatial_shape ['2*n', '2*n', 6] with n=3, p=1"
    ]
    assert check_net_in_out(identity, _meta(dtype="float16"), n=3) == [
        f"{IN}: 'network' output dtype torch.float32 does not match metadata outputs.pred.dtype 'float16'"
    ]
    assert check_net_in_out(_Pair(), _meta(), n=3) == [f"{IN}: 'network' output is a tuple, expected a tensor"]
    assert check_net_in_out(torch.nn.Conv3d(2, 1, 1), _meta(), n=1) == [
        f"{IN}: 'network' forward of a (1, 1, 2, 2, 6) float32 input failed: RuntimeError: "
        "Given groups=1, weight of size [1, 2, 1, 1, 1], expected input[1, 1, 2, 2, 6] to have 2 channels, "
        "but got 1 channels instead"
    ]


def test_large_files_yml(tmp_path):
    (tmp_path / "large_files.yml").write_text(
        "large_files:\n  - path: models/model.pt\n    url: https://example.org/model.pt\n  - just a string\n"
    )
    assert check_large_files(tmp_path) == [
        "large_files.yml: large_files[0] lacks 'hash_val', 'hash_type'",
        "large_files.yml: large_files[1] must be a mapping, got 'just a string'",
    ]
    (tmp_path / "large_files.yml").write_text("large_files: [a,\n  b: c: d\n")
    assert check_large_files(tmp_path) == [
        "large_files.yml: invalid YAML at line 2, column 7: expected ',' or ']', but got ':'"
    ]
    (tmp_path / "large_files.yml").write_text("files: []\n")
    assert check_large_files(tmp_path) == [
        "large_files.yml: must be a mapping with a 'large_files' list, got {'files': []}"
    ]


def test_bundle_json_in_model_zoo_layout():
    """Every JSON file of the bundles is formatted as the MONAI model zoo's pre-commit formats it
    (``pretty-format-json --no-sort-keys --indent=4``, which exits 1 and names each file it would change)."""
    files = sorted(str(p) for p in BUNDLES.glob("*/configs/*.json"))
    assert len(files) >= 30
    cmd = [sys.executable, "-m", "pre_commit_hooks.pretty_format_json", "--no-sort-keys", "--indent=4", *files]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Packaging every bundle into a standalone zip, running it without the repository, ``large_files.yml`` hash
checks, and downloading from a loopback HTTP server with MONAI's ``download`` and the safe wrapper, including
archives that try to write outside the target folder."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import threading
import warnings
import zipfile
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from common.bundle import bundle_names
from common.bundle_tools.package import (
    MODEL_FILE,
    LargeFileError,
    PackageError,
    UnsafeArchiveError,
    bundle_modules,
    check_archive,
    download_bundle,
    extract_bundle,
    package_bundle,
    verify_large_files,
)
from common.bundle_tools.registry import describe
from common.checkpoint_io import CheckpointError, with_record
from common.runs import LOCATION_IDS, is_plain
from tests.helpers import (
    BUNDLES,
    REPO_ROOT,
    STANDALONE_PYTHON,
    HubHandler,
    bundle_env,
    model_zoo_checks,
    seed_args,
    shifted_seed,
    standalone_env,
)

BUNDLE_NAMES = bundle_names()
ZIP_DATE = (1980, 1, 1, 0, 0, 0)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the signature of the base class
        pass


@contextlib.contextmanager
def _serving(root: Path, handler: type) -> Iterator[tuple[Path, str]]:
    """A loopback HTTP server on a free port serving ``root`` with ``handler``: ``(root, base url)``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A loopback HTTP server on a free port serving a temporary folder: ``(folder, base url)``."""
    with _serving(tmp_path_factory.mktemp("served"), _QuietHandler) as served:
        yield served


def _configs(name: str, *files: str) -> list[str]:
    configs = BUNDLES / name / "configs"
    return [str(configs / f) for f in files if (configs / f).is_file()]


def _tiny_record(name: str) -> dict:
    """The record a training run with ``configs/tiny.json`` merged writes (its settings: tiny.json's values)."""
    meta = _metadata(name)
    tiny = json.loads((BUNDLES / name / "configs" / "tiny.json").read_text())
    settings = {k: v for k, v in tiny.items() if k != "imports" and is_plain(v)}
    return {"schema": 1, "bundle": name, "name": meta["name"], "version": meta["version"], "settings": settings}


def _tiny_checkpoint(name: str, path: Path, record: bool = True) -> Path:
    """The state dict of the bundle's inference ``network`` at ``configs/tiny.json`` sizes (no training needed),
    carrying the record a tiny training run writes into its ``model.pt`` (unless ``record`` is False).

    A model whose inference needs a calibration from the training predictions (the survival ``predictor``: risk
    percentiles, groups) is calibrated on random training outcomes, as training would write ``model.pt``."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(_configs(name, "inference.json", "tiny.json"))
    parser["bundle_root"] = str(BUNDLES / name)
    torch.manual_seed(shifted_seed(0))
    network = parser.get_parsed_content("network")
    predictor = parser.get_parsed_content("predictor") if "predictor" in parser else None
    if predictor is not None and hasattr(predictor, "calibrate"):
        n = 12
        predictor.calibrate(torch.randn(n), torch.rand(n) * 10 + 5, (torch.arange(n) % 3 == 0).float())
    torch.save(with_record(network.state_dict(), _tiny_record(name) if record else None), path)
    return path


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Every bundle packaged once with a tiny checkpoint that carries its run's settings: ``name -> (zip,
    checkpoint)``. Nothing but the package is used afterwards: no ``tiny.json`` is merged."""
    root = tmp_path_factory.mktemp("packages")
    made = {}
    for name in BUNDLE_NAMES:
        ckpt = _tiny_checkpoint(name, root / f"{name}_tiny.pt")
        made[name] = (package_bundle(name, ckpt, root / "dist", weights_inside=True), ckpt)
    return made


def _module_path(module: str) -> str:
    """The path in a package of the module ``common.<...>``."""
    path = module.replace(".", "/")
    return f"{path}.py" if (REPO_ROOT / f"{path}.py").is_file() else f"{path}/__init__.py"


def _families_named_by(bundle: Path) -> set[str]:
    """The packages of ``common`` that a bundle's configs (not its metadata) name."""
    import re

    configs = [p for p in (bundle / "configs").glob("*.json") if p.name != "metadata.json"]
    return {m for p in configs for m in re.findall(r"\bcommon\.([a-z_0-9]+)\.", p.read_text())}


def _families_imported_by(family: str) -> set[str]:
    """The packages of ``common`` that the modules of ``common/<family>`` import directly."""
    import ast

    found = set()
    for path in (REPO_ROOT / "common" / family).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found |= {n.split(".")[1] for n in names if n.startswith("common.") and n.count(".") >= 1}
    return found


def _metadata(name: str) -> dict:
    return json.loads((BUNDLES / name / "configs" / "metadata.json").read_text())


def _input_files(name: str) -> int:
    """Volumes an inference run reads per case: the network's input channels, or, for a generative bundle whose
    network input also holds the start noise, its ``source_keys`` in ``inference.json``."""
    from monai.bundle import ConfigParser

    spec = _metadata(name)["network_data_format"]["inputs"].get("image", {})
    parser = ConfigParser()
    parser.read_config(str(BUNDLES / name / "configs" / "inference.json"))
    parser["bundle_root"] = str(BUNDLES / name)
    if "source_keys" in parser:
        return len(parser.get_parsed_content("source_keys"))
    return int(spec.get("num_channels", 1))


def _input_volume(name: str, folder: Path) -> Path:
    """A random NIfTI volume shaped as the metadata's ``image`` input (every side at least 24)."""
    import nibabel as nib
    from monai.bundle.scripts import _get_fake_spatial_shape

    spec = _metadata(name)["network_data_format"]["inputs"].get("image", {})
    shape = spec.get("spatial_shape", [])
    if len(shape) != 3 or _input_files(name) != 1:
        pytest.skip(f"{name}: standalone test needs one single-channel 3D input volume, metadata declares {spec!r}")
    n = 1
    while min(_get_fake_spatial_shape(shape, n=n, any=24)) < 24:
        n += 1
    size = _get_fake_spatial_shape(shape, n=n, any=24)
    folder.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(shifted_seed(0)).random(size).astype(np.float32)
    nib.save(nib.Nifti1Image(data, np.diag([2.0, 2.0, 2.0, 1.0])), folder / "volume.nii.gz")
    return folder


def _run_standalone(bundle: Path, name: str, dataset: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m monai.bundle run`` of the package's inference.json alone (its train.json carries the settings of
    its weights) from inside the bundle folder (with the shifted seed of :func:`seed_args`)."""
    configs = ["configs/inference.json"]
    cmd = [*STANDALONE_PYTHON, "-m", "monai.bundle", "run", "--config_file", json.dumps(configs)]
    cmd += ["--dataset_dir", str(dataset), *args, *seed_args(name, [Path(c).name for c in configs], args)]
    result = subprocess.run(cmd, cwd=bundle, env=standalone_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{name}: {result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def _predictions(name: str, folder: Path) -> int:
    """How many cases an inference run predicted: NIfTI files for image outputs; rows of ``predictions.csv`` for
    outputs without spatial dimensions (per-case values such as survival risks)."""
    spec = _metadata(name)["network_data_format"]["outputs"].get("pred", {})
    if spec.get("spatial_shape"):
        return len(list(folder.glob("*.nii*")))
    csv_file = folder / "predictions.csv"
    return len(csv_file.read_text().strip().splitlines()) - 1 if csv_file.is_file() else 0


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _write_zip(path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    """A zip with raw member names (no sanitising) and the given unix modes."""
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as zf:
        warnings.simplefilter("ignore")  # "Duplicate name" when a test writes one on purpose
        for member, data, mode in members:
            info = zipfile.ZipInfo(member, date_time=ZIP_DATE)
            info.create_system = 3
            info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


# ------------------------------------------------------------------------------------------------ packaging
@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_tiny_profile_weights_are_under_1_mb(name, tmp_path):
    """The weights of every bundle's tiny profile (for the X-ray cascade: all its stages) stay under the model zoo's
    1 MB limit for files committed with a bundle."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(_configs(name, "inference.json", "tiny.json"))
    parser["bundle_root"] = str(BUNDLES / name)
    if "stage_sizes" in parser:
        parser["stage"] = len(parser["stage_sizes"])
    path = tmp_path / "model.pt"
    torch.save(with_record(parser.get_parsed_content("network").state_dict(), _tiny_record(name)), path)
    assert path.stat().st_size < 1_000_000, path.stat().st_size


@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_package_layout(name, packages):
    zip_path, ckpt = packages[name]
    version = _metadata(name)["version"]
    assert zip_path.name == f"{name}_v{version}.zip"
    with zipfile.ZipFile(zip_path) as zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        assert names == sorted(names) and len(set(names)) == len(names)
        assert all(n.startswith(f"{name}/") and ".." not in n.split("/") and not n.startswith("/") for n in names)
        assert all(i.date_time == ZIP_DATE and i.external_attr >> 16 == stat.S_IFREG | 0o644 for i in infos)
        rel = {n[len(name) + 1 :] for n in names}
        bundle = BUNDLES / name
        configs = {f"configs/{p.name}" for p in (bundle / "configs").iterdir() if p.is_file()}
        assert (
            configs | {"configs/run.json"} <= rel
            and {"LICENSE", "docs/README.md", "large_files.yml", MODEL_FILE} <= rel
        )
        for item in sorted(configs - {"configs/train.json"}) + ["LICENSE", "docs/README.md"]:
            assert zf.read(f"{name}/{item}") == (bundle / item).read_bytes(), item
        # the settings the weights carry become the package's defaults; the record is kept beside them
        record = _tiny_record(name)
        train = json.loads((bundle / "configs" / "train.json").read_text())
        shipped = {k: v for k, v in record["settings"].items() if k not in LOCATION_IDS}  # not where it ran
        assert json.loads(zf.read(f"{name}/configs/train.json")) == {**train, **shipped}
        assert json.loads(zf.read(f"{name}/configs/run.json")) == record
        assert zf.read(f"{name}/{MODEL_FILE}") == ckpt.read_bytes()
        # the modules its configs import, transitively (bundle_modules): its own family's, not other bundles'
        common = {_module_path(m) for m in bundle_modules(bundle)}
        assert {r for r in rel if r.startswith("common/")} == common
        description = _metadata(name)["collection"]
        family = description["family"]
        assert {"common/__init__.py", "common/bundle.py", f"common/{family}/__init__.py"} <= common
        named = _families_named_by(bundle) | {m.split(".")[1] for m in description.get("also_imports", [])}
        used = named | {base for f in named for base in _families_imported_by(f)}
        families = {
            json.loads((BUNDLES / b / "configs" / "metadata.json").read_text())["collection"]["family"]
            for b in BUNDLE_NAMES
        }
        assert not {f for f in families - used if any(r.startswith(f"common/{f}/") for r in common)}
        assert not any(r.startswith(("common/demo/", "common/bundle_tools/")) for r in rel)
        assert not any("__pycache__" in r or r.endswith(".pyc") for r in rel)
        assert not any(r.startswith(("outputs/", "demo_data/")) for r in rel)

        import yaml

        large = yaml.safe_load(zf.read(f"{name}/large_files.yml"))["large_files"]
    entry = next(e for e in large if e["path"] == MODEL_FILE)
    assert entry == {
        "path": MODEL_FILE,
        "url": "",
        "hash_val": hashlib.sha256(ckpt.read_bytes()).hexdigest(),
        "hash_type": "sha256",
    }


def test_package_cli_is_deterministic(packages, tmp_path):
    """The CLI, another checkpoint path with a different mtime and another folder give the same zip bytes (a
    property of the packer, checked on one bundle; every bundle's zip content is checked by test_package_layout)."""
    name = BUNDLE_NAMES[0]
    zip_path, ckpt = packages[name]
    copy = tmp_path / "elsewhere.pt"
    copy.write_bytes(ckpt.read_bytes())
    os.utime(copy, (1_000_000_000, 1_000_000_000))
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "package_bundle.py"), name, "--ckpt", str(copy)]
    cmd += ["--weights_inside", "True"]
    result = subprocess.run(
        [*cmd, "--output", str(tmp_path / "out")], cwd=tmp_path, env=bundle_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    again = tmp_path / "out" / zip_path.name
    assert again.read_bytes() == zip_path.read_bytes()
    assert f"sha256 {hashlib.sha256(again.read_bytes()).hexdigest()}" in result.stdout


def _bundle_copy(name: str, folder: Path, version: str) -> Path:
    """A copy of the bundle's packaged files whose metadata ``version`` is replaced."""
    import shutil

    copy = folder / name
    for item in ("configs", "docs"):
        shutil.copytree(BUNDLES / name / item, copy / item)
    for item in ("LICENSE", "large_files.yml"):
        shutil.copy(BUNDLES / name / item, copy / item)
    meta = _metadata(name)
    meta["version"] = version
    (copy / "configs" / "metadata.json").write_text(json.dumps(meta))
    return copy


class _Payload:
    """A Python object: a checkpoint holding it needs unpickling code and must be refused."""


def test_package_refusals(packages, tmp_path):
    name = BUNDLE_NAMES[0]
    _, good = packages[name]
    out = tmp_path / "dist"
    pickled = tmp_path / "pickled.pt"
    torch.save({"weight": torch.zeros(2), "payload": _Payload()}, pickled)
    with pytest.raises(CheckpointError, match="pickled Python objects") as e:
        package_bundle(name, pickled, out)
    assert str(pickled) in str(e.value)
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        package_bundle(name, corrupt, out)
    empty = tmp_path / "empty.pt"
    torch.save({"epoch": 3}, empty)
    with pytest.raises(CheckpointError, match="holds no tensors"):
        package_bundle(name, empty, out)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        package_bundle(name, tmp_path / "missing.pt", out)
    with pytest.raises(ValueError, match="differs from 'version'"):
        package_bundle(name, good, out, version="99.0.0")
    unreleased = _bundle_copy(name, tmp_path / "copy", "9.9.9")
    with pytest.raises(ValueError, match="'9.9.9' has no entry in 'changelog'"):
        package_bundle(unreleased, good, out)
    with pytest.raises(FileNotFoundError, match="no_such_bundle"):
        package_bundle("no_such_bundle", good, out)
    with pytest.raises(PackageError, match="no url for models/model.pt") as e:  # the zoo could not fetch them
        package_bundle(name, good, out)
    assert "--url" in str(e.value) and "--weights_inside True" in str(e.value)
    with pytest.raises(PackageError, match="url must be"):
        package_bundle(name, good, out, url="weights.pt")
    assert not out.exists() or not list(out.iterdir())


@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_package_refuses_weights_that_do_not_fit_its_configs(name, tmp_path):
    """Weights without the record of their run (a copied file of a tiny network) do not fit the bundle's default
    configs: refused when the package is made, naming the file, what differs and the fix; nothing written."""
    plain = _tiny_checkpoint(name, tmp_path / "copied.pt", record=False)
    out = tmp_path / "dist"
    with pytest.raises(PackageError, match="do not fit the package's configs") as e:
        package_bundle(name, plain, out, weights_inside=True)
    assert str(plain) in str(e.value) and "train.json" in str(e.value)
    assert not out.exists() or not list(out.iterdir())


def test_package_cli_refuses_pickled_checkpoint(tmp_path):
    pickled = tmp_path / "pickled.pt"
    torch.save({"weight": torch.zeros(2), "payload": _Payload()}, pickled)
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "package_bundle.py"), BUNDLE_NAMES[0], "--ckpt", str(pickled)]
    result = subprocess.run(
        [*cmd, "--output", str(tmp_path / "out")], cwd=tmp_path, env=bundle_env(), capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "pickled Python objects" in result.stderr and str(pickled) in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- large files
def test_large_files_hashes(packages, server, tmp_path):
    """The packaged ``large_files.yml`` works with MONAI's ``download_large_files`` and with ours, with and
    without a url, and a modified weights file is an error for both."""
    from monai.apps.utils import HashCheckError
    from monai.bundle import download_large_files

    name = BUNDLE_NAMES[0]
    zip_path, ckpt = packages[name]
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(tmp_path / "plain")
    bundle = tmp_path / "plain" / name
    assert verify_large_files(bundle) == [MODEL_FILE]
    download_large_files(bundle_path=str(bundle))  # url "": only the hash of the file in the bundle is checked
    assert (bundle / MODEL_FILE).read_bytes() == ckpt.read_bytes()

    data = bytearray((bundle / MODEL_FILE).read_bytes())
    data[-100] ^= 0xFF
    (bundle / MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(LargeFileError, match="model.pt") as e:
        verify_large_files(bundle)
    assert "sha256" in str(e.value)
    with pytest.raises(HashCheckError):
        download_large_files(bundle_path=str(bundle))

    # with a url: a missing weights file is downloaded (loopback) and checked; wrong content is refused
    served, base = server
    (served / "weights.pt").write_bytes(ckpt.read_bytes())
    (served / "wrong.pt").write_bytes(b"not the weights")
    with_url = package_bundle(name, ckpt, tmp_path / "url" / "b.zip", url=f"{base}/weights.pt")
    with zipfile.ZipFile(with_url) as zf:
        zf.extractall(tmp_path / "url")
    bundle = tmp_path / "url" / name
    (bundle / MODEL_FILE).unlink()
    assert verify_large_files(bundle) == []
    with pytest.raises(LargeFileError, match="missing"):
        verify_large_files(bundle, missing_ok=False)
    download_large_files(bundle_path=str(bundle))
    assert (bundle / MODEL_FILE).read_bytes() == ckpt.read_bytes()
    assert verify_large_files(bundle, missing_ok=False) == [MODEL_FILE]

    yml = bundle / "large_files.yml"
    yml.write_text(yml.read_text().replace(f"{base}/weights.pt", f"{base}/wrong.pt"))
    (bundle / MODEL_FILE).unlink()
    with pytest.raises(HashCheckError):
        download_large_files(bundle_path=str(bundle))
    assert not (bundle / MODEL_FILE).exists()


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"path": "../outside.pt", "url": "", "hash_val": "0" * 64}, "contains '..'"),
        ({"path": "/etc/passwd", "url": "", "hash_val": "0" * 64}, "absolute path"),
        ({"path": "models/model.pt", "url": ""}, "no hash_val"),
        ({"path": "models/model.pt", "url": "", "hash_val": "0" * 64, "hash_type": "crc32"}, "hash_type"),
    ],
)
def test_verify_large_files_refusals(tmp_path, entry, message):
    import yaml

    (tmp_path / "models").mkdir()
    (tmp_path / MODEL_FILE).write_bytes(b"weights")
    (tmp_path / "large_files.yml").write_text(yaml.safe_dump({"large_files": [entry]}))
    with pytest.raises(LargeFileError, match=message):
        verify_large_files(tmp_path)


# ------------------------------------------------------------------------------------- standalone inference
# ------------------------------------------------------------------------------------------------ download
@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_download_and_run(name, packages, server, tmp_path):
    """``monai.bundle download`` and ``scripts/download_bundle.py`` fetch the zip from a loopback server into the
    same tree, byte for byte; the wrapper checks the zip's hash; a downloaded bundle runs standalone (one bundle: the
    others' zips run standalone in ``test_package_trains_evaluates_and_infers_with_what_it_carries``)."""
    from monai.apps.utils import HashCheckError

    zip_path, _ = packages[name]
    served, base = server
    (served / zip_path.name).write_bytes(zip_path.read_bytes())
    url = f"{base}/{zip_path.name}"
    sha = hashlib.sha256(zip_path.read_bytes()).hexdigest()
    with zipfile.ZipFile(zip_path) as zf:
        expected = sorted(n[len(name) + 1 :] for n in zf.namelist())

    plain = tmp_path / "plain"
    cmd = [sys.executable, "-m", "monai.bundle", "download", "--name", name, "--source", "url", "--url", url]
    result = subprocess.run(
        [*cmd, "--bundle_dir", str(plain), "--progress", "False"], env=bundle_env(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p for p in _listing(plain / name) if (plain / name / p).is_file()) == expected

    safe = tmp_path / "safe"
    with pytest.raises(HashCheckError, match="hash check of downloaded file failed"):
        download_bundle(url, safe, name=name, hash_val="f" * 64, progress=False)
    assert not safe.exists()
    script = [sys.executable, str(REPO_ROOT / "scripts" / "download_bundle.py"), "--url", url, "--name", name]
    script += ["--bundle_dir", str(safe), "--progress", "False", "--hash_val", sha]
    result = subprocess.run(script, env=bundle_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _listing(safe) == [name] + [f"{name}/{p}" for p in _listing(safe / name)]  # no zip, no staging left
    assert sorted(p for p in _listing(safe / name) if (safe / name / p).is_file()) == expected
    for rel in expected:
        assert (safe / name / rel).read_bytes() == (plain / name / rel).read_bytes(), rel

    with pytest.raises(FileExistsError, match="already exists"):
        download_bundle(url, safe, name=name, hash_val=sha, progress=False)

    if name == BUNDLE_NAMES[0]:  # the downloaded files equal the zip's, whose standalone run every bundle has
        out = tmp_path / "predictions_out"
        _run_standalone(safe / name, name, _input_volume(name, tmp_path / "data"), "--output_dir", str(out))
        assert _predictions(name, out / "predictions") == 1


GOOD = ("evil/configs/metadata.json", b"{}", stat.S_IFREG | 0o644)
UNSAFE = {
    "dotdot": [GOOD, ("../evil.txt", b"pwned", stat.S_IFREG | 0o644)],
    "nested_dotdot": [GOOD, ("evil/../../evil.txt", b"pwned", stat.S_IFREG | 0o644)],
    "absolute": [GOOD, ("/tmp/evil_absolute_member.txt", b"pwned", stat.S_IFREG | 0o644)],
    "symlink": [GOOD, ("evil/configs/link", b"../../../outside", stat.S_IFLNK | 0o777)],
    "backslash": [GOOD, ("evil\\..\\..\\evil.txt", b"pwned", stat.S_IFREG | 0o644)],
}
BAD_MEMBER = {
    "dotdot": "'../evil.txt' contains '..'",
    "nested_dotdot": "'evil/../../evil.txt' contains '..'",
    "absolute": "'/tmp/evil_absolute_member.txt' is an absolute path",
    "symlink": "'evil/configs/link' is a symbolic link",
    "backslash": "contains a backslash",
}


@pytest.mark.parametrize("kind", sorted(UNSAFE))
def test_download_refuses_unsafe_zip(kind, server, tmp_path):
    """Unsafe members are refused before extraction: nothing appears in or beside the target folder."""
    served, base = server
    _write_zip(served / f"{kind}.zip", UNSAFE[kind])
    parent = tmp_path / "parent"
    parent.mkdir()
    target = parent / "target"
    before = _listing(tmp_path)
    with pytest.raises(UnsafeArchiveError) as e:
        download_bundle(f"{base}/{kind}.zip", target, progress=False)
    assert BAD_MEMBER[kind] in str(e.value)
    assert _listing(tmp_path) == before and not target.exists()
    assert not Path("/tmp/evil_absolute_member.txt").exists()


def test_download_cli_refuses_zip_slip(server, tmp_path):
    served, base = server
    _write_zip(served / "slip.zip", UNSAFE["dotdot"])
    target = tmp_path / "parent" / "target"
    target.mkdir(parents=True)
    before = _listing(tmp_path)
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "download_bundle.py"), "--url", f"{base}/slip.zip"]
    result = subprocess.run(
        [*cmd, "--bundle_dir", str(target), "--progress", "False"], env=bundle_env(), capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "refusing" in result.stderr and "'../evil.txt' contains '..'" in result.stderr
    assert "Traceback" not in result.stderr
    assert _listing(tmp_path) == before and not list(target.iterdir())


def test_plain_monai_download_with_zip_slip(server, tmp_path):
    """What MONAI 1.6.1's own ``download`` does with a ``..`` member: it fails and writes nothing outside the
    target folder (its ``safe_extract_member``), but only when it reaches the member, so the zip and the members
    before it stay inside. Recorded here; the wrapper does not rely on it."""
    served, base = server
    _write_zip(served / "slip_monai.zip", UNSAFE["dotdot"])
    target = tmp_path / "parent" / "target"
    target.mkdir(parents=True)
    before = _listing(tmp_path / "parent")
    cmd = [sys.executable, "-m", "monai.bundle", "download", "--name", "evil", "--source", "url"]
    cmd += ["--url", f"{base}/slip_monai.zip", "--bundle_dir", str(target), "--progress", "False"]
    result = subprocess.run(cmd, env=bundle_env(), capture_output=True, text=True)
    assert result.returncode != 0 and "Unsafe path detected in archive: ../evil.txt" in result.stderr
    after = _listing(tmp_path / "parent")
    assert [p for p in after if not p.startswith("target/")] == before
    assert not (tmp_path / "parent" / "evil.txt").exists()


# --------------------------------------------------------------------------------------- archive checks
def test_check_archive_layout(packages, tmp_path):
    name = BUNDLE_NAMES[0]
    zip_path, _ = packages[name]
    assert check_archive(zip_path) == name == check_archive(zip_path, name)
    with pytest.raises(UnsafeArchiveError, match="expected 'other'"):
        check_archive(zip_path, "other")
    meta = ("a/configs/metadata.json", b"{}", stat.S_IFREG | 0o644)
    cases = {
        "two_tops.zip": ([meta, ("b/x.txt", b"", stat.S_IFREG | 0o644)], "expected one top folder"),
        "top_file.zip": ([meta, ("x.txt", b"", stat.S_IFREG | 0o644)], "'x.txt' is a file at the top level"),
        "no_meta.zip": ([("a/x.txt", b"", stat.S_IFREG | 0o644)], "not a bundle"),
        "duplicate.zip": ([meta, meta], "appears twice"),
        "fifo.zip": ([meta, ("a/pipe", b"", stat.S_IFIFO | 0o644)], "special file"),
        "dot.zip": ([meta, ("a/./x.txt", b"", stat.S_IFREG | 0o644)], "not a normalised relative path"),
        "char_device.zip": ([meta, ("a/tty", b"", stat.S_IFCHR | 0o600)], "special file"),
        "socket.zip": ([meta, ("a/sock", b"", stat.S_IFSOCK | 0o600)], "special file"),
        "bare_symlink.zip": ([meta, ("a/link", b"/etc/passwd", stat.S_IFLNK)], "symbolic link"),
    }
    for file, (members, message) in cases.items():
        with pytest.raises(UnsafeArchiveError, match=message):
            check_archive(_write_zip(tmp_path / file, members))
    (tmp_path / "text.zip").write_text("not a zip")
    with pytest.raises(UnsafeArchiveError, match="not a readable zip"):
        check_archive(tmp_path / "text.zip")


def test_a_zip_of_plain_permission_bits_is_a_zip_of_regular_files(packages, tmp_path):
    """``ZipFile.writestr(name, data)`` records mode 0o600 with no file-type bits, which unzip and zipfile's
    extraction take for a regular file: such a repacked bundle is extracted to the same bytes."""
    name = BUNDLE_NAMES[0]
    zip_path, _ = packages[name]
    repacked = tmp_path / "repacked.zip"
    with zipfile.ZipFile(zip_path) as src, zipfile.ZipFile(repacked, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))  # a str name: mode 0o600 (0o40775 for a folder)
    with zipfile.ZipFile(repacked) as zf:
        modes = {info.external_attr >> 16 for info in zf.infolist() if not info.is_dir()}
    assert modes == {0o600}  # no file-type bits: what the check used to refuse as "a special file"
    assert check_archive(repacked, name) == name
    bundle = extract_bundle(repacked, tmp_path / "target", name=name)
    with zipfile.ZipFile(zip_path) as src:
        for info in src.infolist():
            if not info.is_dir():
                assert (bundle.parent / info.filename).read_bytes() == src.read(info), info.filename


def test_extract_refuses_tampered_weights(packages, tmp_path):
    """A zip whose weights do not match its ``large_files.yml`` leaves nothing in the target folder."""
    name = BUNDLE_NAMES[0]
    zip_path, _ = packages[name]
    tampered = tmp_path / "tampered.zip"
    with zipfile.ZipFile(zip_path) as src, zipfile.ZipFile(tampered, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, b"other weights" if info.filename == f"{name}/{MODEL_FILE}" else data)
    target = tmp_path / "target"
    with pytest.raises(LargeFileError, match="model.pt"):
        extract_bundle(tampered, target, name=name)
    assert target.is_dir() and not list(target.iterdir())
    bundle = extract_bundle(zip_path, target, name=name)
    assert verify_large_files(bundle, missing_ok=False) == [MODEL_FILE]
    with pytest.raises(FileExistsError, match="already exists"):
        extract_bundle(zip_path, target, name=name)
    (bundle / "configs" / "extra.json").write_text("{}")
    assert extract_bundle(zip_path, target, name=name, overwrite=True) == bundle
    assert not (bundle / "configs" / "extra.json").exists()
    assert all(p.split("/")[0] == name for p in _listing(target))  # no staging folder left


# ------------------------------------------------------------------------------------------- model-zoo checks
@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_model_zoo_checks(name, packages, tmp_path):
    """The checks of the MONAI model zoo's CI (``ci/verify_bundle.py``) on the packaged bundle, unzipped, with its
    weights: ``verify_metadata``, ``ConfigWorkflow(workflow_type="infer")`` initialised and ``check_properties()``,
    ``verify_net_in_out`` (at ``tiny.json`` sizes), and the shipped ``model.pt`` loaded into the network and exported
    with ``ckpt_export --use_trace True`` (the train properties: each bundle's test)."""
    from common.bundle_tools.export import default_input_shape

    zip_path, _ = packages[name]
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(tmp_path / "zoo")
    bundle = tmp_path / "zoo" / name
    kind = describe(name).family
    if kind == "xray2ct":  # CT volumes in, X-rays made by the projector (its input is two X-rays)
        import nibabel as nib

        dataset = tmp_path / "data"
        dataset.mkdir()
        volume = np.random.default_rng(shifted_seed(0)).uniform(-1000, 1000, (24, 24, 24)).astype(np.float32)
        nib.save(nib.Nifti1Image(volume, np.diag([14.0, 14.0, 14.0, 1.0])), dataset / "ct.nii.gz")
    else:
        dataset = _input_volume(name, tmp_path / "data")
    shape = default_input_shape(bundle)
    # the survival model's network_def is its exported predictor; the generative bundles' entry point is
    # `network` (the zoo excludes generative bundles from the network_def shape check)
    net_id = "network_def" if kind == "survival" else "network"
    overrides = {"dataset_dir": str(dataset)}
    lines = model_zoo_checks(bundle, ["infer"], [], overrides, shape, True, net_id)
    assert lines == ["metadata verified", "infer properties verified", "net in out verified", "torchscript verified"]


_PROPERTIES_WITHOUT_INPUTS = """
import os, sys
from monai.bundle import create_workflow
from monai.bundle.properties import InferProperties, MetaProperties
bundle, empty, out = sys.argv[1:4]  # run in the bundle folder, whose common/ is imported
from common.errors import MissingInputError, user_error_in_chain
configs = os.path.join(bundle, "configs")
workflow = create_workflow(workflow_type="inference", bundle_root=bundle, config_file=os.path.join(configs,
    "inference.json"), meta_file=os.path.join(configs, "metadata.json"), dataset_dir=empty, output_dir=out)
workflow.properties = {**MetaProperties, **InferProperties}  # what the zoo's check_properties sets
print("missing properties", workflow.check_properties())
try:
    workflow.run()
except Exception as e:
    error = user_error_in_chain(e)
    print("refused", type(error).__name__, error)
"""


@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_an_inference_workflow_is_built_before_its_inputs(name, packages, tmp_path):
    """As the model zoo's ``check_properties`` (and an application driving the bundle) do, the package's inference
    workflow is created without inputs and has MONAI's ``InferProperties`` and ``MetaProperties``; its run then
    refuses at its first step, with the command line's message naming the folder, and writes nothing."""
    zip_path, _ = packages[name]
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(tmp_path / "zoo")
    empty, out = tmp_path / "no_inputs", tmp_path / "out"
    empty.mkdir()
    bundle = tmp_path / "zoo" / name
    cmd = [*STANDALONE_PYTHON, "-c", _PROPERTIES_WITHOUT_INPUTS, str(bundle), str(empty), str(out)]
    result = subprocess.run(cmd, cwd=bundle, env=standalone_env(), capture_output=True, text=True, timeout=600)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and "missing properties []" in lines, result.stdout[-2000:] + result.stderr[-3000:]
    refused = [line for line in lines if line.startswith("refused ")]
    assert refused and re.match(r"refused MissingInputError no (input volumes|inference inputs)", refused[0]), lines
    assert repr(str(empty)) in refused[0]
    assert not out.exists() or not any(out.rglob("*.nii*"))


# ----------------------------------------------------------------------------------- notebook, outside the bundle
_NOTEBOOK_CHECK = """
import common, torch
assert Path(common.__file__).resolve().parent == BUNDLE / "common", common.__file__  # the package's own library
saved = torch.load(BUNDLE / "models" / "model.pt", weights_only=True)
own = model.state_dict()
assert set(saved) <= set(own), sorted(set(saved) - set(own))[:5]
assert all(torch.equal(own[k].cpu(), v) for k, v in saved.items())
print("loaded", type(model).__name__, len(saved))
"""


def _notebook_block(readme: Path) -> str:
    """The Python block of the model card's section "From Python or a notebook, in any folder"."""
    text = readme.read_text()
    section = text[text.index("## From Python or a notebook, in any folder") :]
    return section[
        section.index("```python\n") + len("```python\n") : section.index("\n```", section.index("```python"))
    ]


@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_notebook_step_outside_the_bundle(name, packages, tmp_path):
    """The model card's block, as written, run from a temporary folder that is not the bundle's, with nothing of
    this repository importable: the package's own ``common/`` is imported and ``load_weights`` gives the network
    holding exactly the shipped weights."""
    zip_path, _ = packages[name]
    downloads = tmp_path / "downloads"
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(downloads)
    block = _notebook_block(downloads / name / "docs" / "README.md")
    assert f'Path("downloads/{name}")' in block
    work = tmp_path / "notebooks"
    work.mkdir()
    (work / "downloads").symlink_to(downloads, target_is_directory=True)
    script = work / "cell.py"
    script.write_text(block + "\n" + _NOTEBOOK_CHECK)
    result = subprocess.run(
        [*STANDALONE_PYTHON, str(script)], cwd=work, env=standalone_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"{name}: {result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "loaded" in result.stdout


# ------------------------------------------------------------------------------------------ verify a package
@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_verify_bundle_checks_the_package_with_its_own_weights(name, packages, tmp_path):
    """``scripts/verify_bundle.py`` on an unzipped package builds the network from the package's configs alone,
    loads its weights and runs it on a generated input: the package passes; with the bundle's default settings in
    its ``train.json`` (tiny weights packed without their settings), it fails, naming the weights."""
    from common.bundle_tools.verify import verify_bundle

    zip_path, _ = packages[name]
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(tmp_path)
    bundle = tmp_path / name
    assert verify_bundle(bundle) == []
    (bundle / "configs" / "train.json").write_bytes((BUNDLES / name / "configs" / "train.json").read_bytes())
    (bundle / "configs" / "run.json").unlink()
    problems = verify_bundle(bundle, schema_file=REPO_ROOT / "tests" / "data" / "meta_schema_20240725.json")
    assert any("models/model.pt with configs/inference.json: the weights do not fit" in p for p in problems), problems


# ----------------------------------------------------------------------------------------- Hugging Face Hub
@pytest.fixture
def hub(tmp_path):
    """A local stand-in for the Hugging Face Hub on 127.0.0.1 (:class:`tests.helpers.HubHandler`): ``(folder of
    its repositories, endpoint)``."""
    root = tmp_path / "hub"
    root.mkdir()
    with _serving(root, HubHandler) as served:
        yield served


def test_hugging_face_layout_downloads_with_monai_and_runs(hub, tmp_path, monkeypatch):
    """``package_bundle(..., hf_repo=...)`` lays the package out as its Hugging Face repository, with the weights'
    address on the Hub in ``large_files.yml``; served by a local endpoint (``HF_ENDPOINT``), ``python -m
    monai.bundle download --source huggingface_hub`` fetches the same files back, and the bundle runs inference."""
    pytest.importorskip("huggingface_hub")
    import yaml

    name = BUNDLE_NAMES[0]
    served, endpoint = hub
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    ckpt = _tiny_checkpoint(name, tmp_path / "weights.pt")
    zip_path = package_bundle(name, ckpt, tmp_path / "dist", hf_repo=f"monai-test/{name}")
    layout = tmp_path / "dist" / f"{zip_path.stem}_hf" / name
    with zipfile.ZipFile(zip_path) as zf:
        expected = sorted(n[len(name) + 1 :] for n in zf.namelist())
    assert sorted(p for p in _listing(layout) if (layout / p).is_file()) == expected
    large = yaml.safe_load((layout / "large_files.yml").read_text())["large_files"]
    assert next(e for e in large if e["path"] == MODEL_FILE)["url"] == (
        f"{endpoint}/monai-test/{name}/resolve/main/{MODEL_FILE}"
    )
    import shutil

    shutil.copytree(layout, served / "monai-test" / name)  # what push_to_hf_hub uploads
    downloads = tmp_path / "downloads"
    cmd = [sys.executable, "-m", "monai.bundle", "download", "--name", name, "--source", "huggingface_hub"]
    cmd += ["--repo", f"monai-test/{name}", "--bundle_dir", str(downloads), "--progress", "False"]
    env = bundle_env(HF_ENDPOINT=endpoint, HF_HUB_DISABLE_XET="1", HF_HOME=str(tmp_path / "hf_home"))
    result = subprocess.run(
        cmd, env=env, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    bundle = downloads / name
    got = sorted(p for p in _listing(bundle) if (bundle / p).is_file() and not p.startswith(".cache"))
    assert got == expected
    for rel in expected:
        assert (bundle / rel).read_bytes() == (layout / rel).read_bytes(), rel
    assert verify_large_files(bundle, missing_ok=False) == [MODEL_FILE]
    out = tmp_path / "predictions_out"
    _run_standalone(bundle, name, _input_volume(name, tmp_path / "data"), "--output_dir", str(out))
    assert _predictions(name, out / "predictions") == 1


def _demo_data(package: Path, folder: Path) -> list[str]:
    """Write the demo data of a package's training settings (the generator named by its ``train.json``, run here,
    since a package carries none) under ``folder``; the command-line arguments that point the package at it."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(package / "configs" / "train.json"))
    parser.update({"bundle_root": str(folder), "demo_data": True})
    parser.get_parsed_content("demo_dataset")
    if "csv_path" in parser:  # a cohort CSV names the volumes
        return ["--csv_path", parser.get_parsed_content("csv_path")]
    return ["--dataset_dir", parser.get_parsed_content("dataset_dir")]


@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_package_trains_evaluates_and_infers_with_what_it_carries(name, packages, tmp_path):
    """A package holds the modules its configs import and nothing else, and that is enough: unzipped anywhere and
    run from its folder with nothing of this repository importable (``python -S``), it imports its own ``common``,
    trains one epoch on data in another folder, evaluates the run, and predicts with the weights it ships
    (``models/model.pt``, found by default) into ``<bundle>/outputs``."""
    zip_path, _ = packages[name]
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(tmp_path / "anywhere")
    package = tmp_path / "anywhere" / name
    probe = subprocess.run(
        [
            *STANDALONE_PYTHON,
            "-c",
            f"import common, common.bundle; print(common.__file__); print(common.bundle.bundle_root({name!r}))",
        ],
        cwd=package,
        env=standalone_env(),
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr
    common_file, root = probe.stdout.splitlines()
    assert Path(common_file).resolve() == (package / "common" / "__init__.py").resolve()
    assert Path(root).resolve() == package.resolve()
    data = _demo_data(package, tmp_path / "data")
    out = tmp_path / "run"

    def run(run_id: str, configs: list[str], *args: str) -> None:
        cmd = [*STANDALONE_PYTHON, "-m", "monai.bundle", "run", run_id, "--config_file", json.dumps(configs), *args]
        cmd += seed_args(name, [Path(c).name for c in configs], args)
        result = subprocess.run(cmd, cwd=package, env=standalone_env(), capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{name} {run_id} {configs}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"

    run("training", ["configs/train.json"], *data, "--output_dir", str(out), "--max_epochs", "1", "--val_interval", "1")
    run_dir = next(p.parent.parent for p in sorted(out.rglob("models/model.pt")))
    assert (run_dir / "configs" / "run.json").is_file()
    run("run", ["configs/train.json", "configs/evaluate.json"], "--output_dir", str(out))
    assert list(out.rglob("eval*/metrics.json")), sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    run("run", ["configs/inference.json"], *data)  # the shipped weights, outputs in the package's own folder
    predictions = package / "outputs" / "predictions"
    assert list(predictions.glob(".done/**/*.json")), _listing(package / "outputs")
    assert _predictions(name, predictions) >= 1, _listing(package / "outputs")

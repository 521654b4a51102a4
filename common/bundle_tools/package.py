# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Packaging a bundle into a standalone, reproducible zip, checking ``large_files.yml`` hashes, and downloading a
bundle zip with extraction that refuses unsafe archives before anything is written.

A packaged bundle ``<name>_v<version>.zip`` holds one folder ``<name>/`` with ``configs/``, ``docs/``, ``LICENSE``,
``large_files.yml``, ``models/model.pt`` and the modules of the collection's ``common/`` package that its configs
import, transitively (:func:`bundle_modules`; not the demo-data generators of ``common/demo``), so ``python -m
monai.bundle run --config_file configs/inference.json ...`` run from that folder needs only the requirements
installed: ``python -m`` puts the working directory, which holds ``common/``, on ``sys.path``.

``large_files.yml`` of a package lists ``models/model.pt`` with its sha256. With a ``url`` (a Hugging Face
repository's address with ``hf_repo``) the entry says where the weights can be downloaded again, which a model-zoo
submission needs; a package distributed as the zip itself (``weights_inside``) has ``url: ""``: MONAI's
``download_large_files`` requires the key, and with an empty url it only checks the hash of the file already in the
bundle (it fails, naming the url, when the file is missing). The same file is checked by :func:`verify_large_files`.

The weights carry the record of their training run (:func:`common.checkpoint_io.checkpoint_record`), which becomes
the package's ``train.json`` defaults and ``configs/run.json`` (:func:`run_configs`); a package whose weights do not
fit its own configs is refused before it is written (:func:`check_package_weights`).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from common.bundle import resolve_bundle
from common.bundle_tools.registry import describe
from common.checkpoint_io import CheckpointError, checkpoint_record, load_checkpoint
from common.errors import UserError, user_error_in_chain
from common.runs import LOCATION_IDS, check_record_bundle, recorded_settings

__all__ = [
    "COMMON_DIR",
    "LARGE_FILES",
    "MODEL_FILE",
    "PACKAGED_ITEMS",
    "REQUIRED_FILES",
    "LargeFileError",
    "PackageError",
    "UnsafeArchiveError",
    "bundle_modules",
    "bundle_version",
    "check_archive",
    "check_checkpoint",
    "check_package_weights",
    "default_checkpoint",
    "download_bundle",
    "extract_bundle",
    "file_hash",
    "hf_layout",
    "hf_layout_dir",
    "hf_weights_url",
    "package_bundle",
    "read_large_files",
    "run_configs",
    "verify_large_files",
]

logger = logging.getLogger(__name__)

COMMON_DIR = Path(__file__).resolve().parents[1]
# folders of ``common/`` a trained bundle does not need: the demo-data generators
UNPACKAGED_COMMON = ("demo",)
PACKAGED_ITEMS = ("configs", "docs", "LICENSE")
REQUIRED_FILES = ("configs/metadata.json", "configs/inference.json", "docs/README.md")
LARGE_FILES = "large_files.yml"
MODEL_FILE = "models/model.pt"
HASH_TYPES = ("md5", "sha1", "sha256", "sha512")
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can hold: entries do not depend on file times
_FILE_MODE = 0o644
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_LARGE_FILES_HEADER = (
    "# Large files of this bundle with their hashes. An empty url means the file ships inside the bundle archive.\n"
    "# Check them: python -m monai.bundle download_large_files --bundle_path <bundle folder>\n"
)


class UnsafeArchiveError(UserError):
    """A bundle archive that is refused before extraction (unsafe member paths, links, wrong layout)."""


class LargeFileError(UserError):
    """A ``large_files.yml`` that is malformed, or a file it lists that is missing or whose hash does not match."""


class PackageError(UserError):
    """A package that is refused when it is made: weights that do not fit its configs, weights with no hosting
    URL."""


# ----------------------------------------------------------------------------------------------------- helpers
def file_hash(path: str | os.PathLike, hash_type: str = "sha256") -> str:
    """The hex digest of a file, read in 1 MiB chunks.

    Args:
        path: the file.
        hash_type: one of ``md5``, ``sha1``, ``sha256``, ``sha512`` (the types MONAI's ``check_hash`` accepts).

    Raises:
        ValueError: for another hash type.
    """
    if hash_type.lower() not in HASH_TYPES:
        raise ValueError(f"hash_type must be one of {HASH_TYPES}, got {hash_type!r}.")
    digest = hashlib.new(hash_type.lower())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _unsafe_reason(name: str) -> str | None:
    """Why a relative POSIX path (a zip member or a ``large_files.yml`` path) could escape its folder, or None."""
    if "\x00" in name:
        return "contains a NUL character"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return "is an absolute path"
    parts = name.rstrip("/").split("/")
    if ".." in parts:
        return "contains '..'"
    if any(part in ("", ".") for part in parts):
        return "is not a normalised relative path"
    return None


def bundle_version(bundle_dir: str | os.PathLike) -> str:
    """The ``version`` of ``configs/metadata.json``, checked to have a ``changelog`` entry.

    Args:
        bundle_dir: the bundle folder.

    Raises:
        FileNotFoundError: without ``configs/metadata.json``.
        ValueError: when the version is missing or has no changelog entry.
    """
    path = Path(bundle_dir) / "configs" / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist: {str(bundle_dir)!r} is not a bundle folder.")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    version = meta.get("version")
    if not isinstance(version, str) or not version:
        raise ValueError(f"{str(path)!r}: 'version' must be a non-empty string, got {version!r}.")
    changelog = meta.get("changelog")
    if not isinstance(changelog, Mapping) or version not in changelog:
        listed = sorted(changelog) if isinstance(changelog, Mapping) else changelog
        raise ValueError(f"{str(path)!r}: version {version!r} has no entry in 'changelog' (it lists {listed!r}).")
    return version


def _resolve_bundle(name_or_dir: str | os.PathLike) -> Path:
    bundle_dir = resolve_bundle(name_or_dir)
    if not _SAFE_NAME.match(bundle_dir.name):
        raise ValueError(f"bundle folder name {bundle_dir.name!r} must match {_SAFE_NAME.pattern}.")
    return bundle_dir


def _count_tensors(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, Mapping):
        return sum(_count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count_tensors(v) for v in obj)
    return 0


def check_checkpoint(path: str | os.PathLike) -> int:
    """Check that ``path`` loads with ``torch.load(weights_only=True)`` and holds tensors; returns their number.

    Args:
        path: the checkpoint file.

    Raises:
        common.checkpoint_io.CheckpointError: for a missing, corrupt or pickled (code-carrying) file, or one
            holding no tensors.
    """

    content = load_checkpoint(path)
    count = _count_tensors(content)
    if count == 0:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no tensors (got {type(content).__name__}).")
    return count


def default_checkpoint(name_or_dir: str | os.PathLike) -> Path:
    """The weights the bundle's ``configs/inference.json`` loads by default (its ``ckpt_path``).

    Args:
        name_or_dir: a bundle name under ``bundles/`` or a bundle folder.

    Raises:
        FileNotFoundError: when the config finds no weights (the message names the places it looked).
    """
    from monai.bundle import ConfigParser

    bundle_dir = _resolve_bundle(name_or_dir)
    parser = ConfigParser()
    parser.read_config(str(bundle_dir / "configs" / "inference.json"))
    parser["bundle_root"] = str(bundle_dir)
    try:
        found = parser.get_parsed_content("ckpt_path")
    except RuntimeError as e:  # MONAI wraps errors raised by `$` expressions
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, FileNotFoundError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise FileNotFoundError(f"bundle {bundle_dir.name!r}: {cause} (when packaging: give the checkpoint)") from e
        raise
    if not isinstance(found, (str, os.PathLike)):  # one file per stage (a cascade): they are combined first
        raise PackageError(
            f"bundle {bundle_dir.name!r} loads {len(found)} files ({found}); combine them into one first "
            f"(python -m monai.bundle run pack --config_file {bundle_dir / 'configs' / 'inference.json'} --output_dir "
            "<run folder>) and pass --ckpt <run folder>/models/model.pt."
        )
    return Path(found)


# ----------------------------------------------------------------------------------------------- large files
def read_large_files(bundle_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The entries of ``<bundle_dir>/large_files.yml`` (an empty list when the file is absent).

    Args:
        bundle_dir: the bundle folder.

    Raises:
        LargeFileError: when the file is not a ``large_files`` list of mappings with safe relative ``path`` values.
    """
    import yaml

    path = Path(bundle_dir) / LARGE_FILES
    if not path.is_file():
        return []
    try:
        content = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise LargeFileError(f"{str(path)!r} is not valid YAML: {e}") from e
    entries = content.get("large_files") if isinstance(content, dict) else None
    if not isinstance(entries, list):
        raise LargeFileError(f"{str(path)!r} must hold a 'large_files' list, got {content!r}.")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise LargeFileError(f"{str(path)!r}: large_files[{i}] must be a mapping with a 'path', got {entry!r}.")
        reason = _unsafe_reason(entry["path"])
        if reason:
            raise LargeFileError(f"{str(path)!r}: large_files[{i}] path {entry['path']!r} {reason}.")
    return entries


def verify_large_files(bundle_dir: str | os.PathLike, missing_ok: bool = True) -> list[str]:
    """Check the hash of every file listed in ``<bundle_dir>/large_files.yml`` that exists.

    Args:
        bundle_dir: the bundle folder.
        missing_ok: skip listed files that do not exist (they can be fetched with MONAI's
            ``download_large_files``); when False a missing file is an error.

    Returns:
        the verified paths, relative to the bundle folder.

    Raises:
        LargeFileError: naming the file when its hash differs, when it has no ``hash_val``, when its
            ``hash_type`` is unknown, or when it is missing and ``missing_ok`` is False.
    """
    verified = []
    for entry in read_large_files(bundle_dir):
        rel = entry["path"]
        target = Path(bundle_dir) / rel
        if not target.is_file():
            if missing_ok:
                continue
            raise LargeFileError(
                f"{rel!r} listed in {LARGE_FILES} is missing from {str(bundle_dir)!r}; "
                f"download it from url {entry.get('url')!r}."
            )
        expected = entry.get("hash_val")
        hash_type = str(entry.get("hash_type") or "sha256").lower()
        if not expected:
            raise LargeFileError(f"{rel!r} in {LARGE_FILES} of {str(bundle_dir)!r} has no hash_val to check.")
        if hash_type not in HASH_TYPES:
            raise LargeFileError(f"{rel!r} in {LARGE_FILES}: hash_type must be one of {HASH_TYPES}, got {hash_type!r}.")
        actual = file_hash(target, hash_type)
        if actual != str(expected).lower():
            raise LargeFileError(
                f"{hash_type} of {str(target)!r} is {actual}, but {LARGE_FILES} expects {expected}: "
                "the file is corrupt or was replaced."
            )
        verified.append(rel)
    return verified


def _packaged_large_files(bundle_dir: Path, model_hash: str, url: str | None) -> bytes:
    """``large_files.yml`` of a package: the bundle's other entries plus ``models/model.pt`` with its sha256."""
    import yaml

    entries = [dict(e) for e in read_large_files(bundle_dir) if e["path"] != MODEL_FILE]
    entries.append({"path": MODEL_FILE, "url": url or "", "hash_val": model_hash, "hash_type": "sha256"})
    body = yaml.safe_dump({"large_files": entries}, sort_keys=False, default_flow_style=False)
    return (_LARGE_FILES_HEADER + body).encode("utf-8")


# ------------------------------------------------------------------------------------------- Hugging Face Hub
_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hf_weights_url(repo: str, revision: str = "main") -> str:
    """Where a Hugging Face model repository ``repo`` (``owner/name``) serves the bundle's weights:
    ``<HF_ENDPOINT>/<repo>/resolve/<revision>/models/model.pt`` (``HF_ENDPOINT``: the Hub's address, as for the
    ``huggingface_hub`` client; default ``https://huggingface.co``).

    Raises:
        PackageError: when ``repo`` is not ``owner/name``.
    """
    if not isinstance(repo, str) or not _HF_REPO_ID.match(repo):
        raise PackageError(f"a Hugging Face repository is named 'owner/name', got {repo!r}.")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    return f"{endpoint}/{repo}/resolve/{revision}/{MODEL_FILE}"


def hf_layout_dir(zip_path: str | os.PathLike) -> Path:
    """The folder that receives the Hugging Face layout of the package ``zip_path`` (:func:`hf_layout`):
    ``<name>_v<version>_hf`` beside the zip; the repository's files are in its ``<name>/``."""
    zip_path = Path(zip_path)
    return zip_path.with_name(f"{zip_path.stem}_hf")


def hf_layout(zip_path: str | os.PathLike) -> Path:
    """Lay a package out as the Hugging Face model repository of the bundle: ``<hf_layout_dir>/<name>/`` holds the
    files of the repository (the bundle folder: ``configs/``, ``models/``, ``docs/``, ``common/``, ...), extracted
    and checked by :func:`extract_bundle` (an existing layout is replaced). MONAI's ``push_to_hf_hub --name <name>
    --bundle_dir <hf_layout_dir>`` uploads it (adding ``README.md``, the model card with the Hub's metadata), and
    ``python -m monai.bundle download --source huggingface_hub --repo <owner/name> --name <name>`` puts the same
    files back into ``<bundle_dir>/<name>/``.

    Returns:
        the repository folder ``<hf_layout_dir>/<name>``.
    """
    return extract_bundle(zip_path, hf_layout_dir(zip_path), overwrite=True)


# ------------------------------------------------------------------------------------------------- packaging
_COMMON_NAME = re.compile(r"\bcommon(?:\.[A-Za-z_]\w*)+")


def _module_file(module: str) -> Path | None:
    """The file of the module ``common.<...>`` (``<...>.py`` or a package's ``__init__.py``), or ``None``."""
    path = COMMON_DIR.parent.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _as_module(dotted: str) -> str | None:
    """The longest prefix of ``dotted`` (``common.x.y.name``) that is a module of ``common``."""
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        if _module_file(".".join(parts[:end])) is not None:
            return ".".join(parts[:end])
    return None


def _imports_of(module: str) -> set[str]:
    """The modules of ``common`` that ``module`` imports (at the top or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(_module_file(module).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # a submodule imported by name
    return {m for name in found if name.split(".")[0] == "common" and (m := _as_module(name)) is not None}


def bundle_modules(bundle_dir: str | os.PathLike) -> list[str]:
    """The modules of ``common`` a bundle needs: those its configs name (``$import``, ``_target_``, expressions)
    and those its description's ``also_imports`` lists (every module of a package), the modules they import,
    transitively, and their packages; not the demo-data generators (``common.demo``, which a packaged bundle
    replaces by ``--dataset_dir``), sorted.

    Args:
        bundle_dir: the bundle folder; every ``configs/*.json`` but ``metadata.json`` is read.
    """
    skipped = tuple(f"common.{name}" for name in UNPACKAGED_COMMON)
    text = "\n".join(
        p.read_text(encoding="utf-8")
        for p in sorted(Path(bundle_dir).glob("configs/*.json"))
        if p.name != "metadata.json"
    )
    todo = {m for match in _COMMON_NAME.findall(text) if (m := _as_module(match)) is not None}
    for name in describe(bundle_dir).also_imports:
        path = COMMON_DIR.parent.joinpath(*name.split("."))
        todo |= {name} | {f"{name}.{p.stem}" for p in path.glob("*.py") if p.stem != "__init__"}
    needed: set[str] = set()
    while todo:
        module = todo.pop()
        if module in needed or module in skipped or module.startswith(tuple(f"{s}." for s in skipped)):
            continue
        needed.add(module)
        parts = module.split(".")
        todo |= {".".join(parts[:end]) for end in range(1, len(parts))}  # its packages' __init__
        todo |= _imports_of(module)
    return sorted(needed)


def _tree_files(
    root: Path, rel_root: str, python_only: bool = False, skip: Sequence[str] = ()
) -> Iterator[tuple[str, Path]]:
    """``(relative posix path, file)`` for the regular files under ``root``; caches, hidden files and the top-level
    folders named in ``skip`` left out."""
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part == "__pycache__" or part.startswith(".") for part in rel.parts) or rel.parts[0] in skip:
            continue
        if path.is_symlink():
            raise ValueError(f"{str(path)!r} is a symbolic link; a packaged bundle holds regular files only.")
        if not path.is_file() or path.suffix == ".pyc" or (python_only and path.suffix != ".py"):
            continue
        yield f"{rel_root}/{rel.as_posix()}", path


def run_configs(bundle_dir: Path, ckpt: Path) -> dict[str, bytes]:
    """The configs that make a package use the settings its weights were trained with: when ``ckpt`` carries the
    record of its training run (:func:`common.checkpoint_io.checkpoint_record`: inside the file, or the run folder
    whose ``models/`` holds it), ``configs/train.json`` with the run's recorded settings as its defaults (locations
    such as ``dataset_dir`` and ``output_dir`` left out, see :data:`common.runs.LOCATION_IDS`) and the record as
    ``configs/run.json``, so the packaged bundle evaluates and runs inference without overrides. Empty otherwise.

    Raises:
        common.runs.RunRecordError: when the record belongs to another bundle.
    """

    record = checkpoint_record(ckpt)
    if record is None:
        return {}
    check_record_bundle(record, bundle_dir, ckpt)
    train = json.loads((bundle_dir / "configs" / "train.json").read_text(encoding="utf-8"))
    for key, value in recorded_settings(record, bundle_dir).items():
        if "#" not in key and key not in LOCATION_IDS:
            train[key] = value
    return {
        "configs/train.json": (json.dumps(train, indent=4) + "\n").encode("utf-8"),
        "configs/run.json": (json.dumps(record, indent=4) + "\n").encode("utf-8"),
    }


def _package_members(bundle_dir: Path, ckpt: Path, large_files: bytes) -> dict[str, Path | bytes]:
    members: dict[str, Path | bytes] = {}
    for item in PACKAGED_ITEMS:
        source = bundle_dir / item
        if source.is_dir():
            members.update(_tree_files(source, item))
        elif source.is_file() and not source.is_symlink():
            members[item] = source
        else:
            raise FileNotFoundError(f"bundle {bundle_dir.name!r} lacks {item!r} (looked for {str(source)!r}).")
    for required in REQUIRED_FILES:
        if required not in members:
            raise FileNotFoundError(f"bundle {bundle_dir.name!r} lacks {required!r} (looked in {str(bundle_dir)!r}).")
    for module in bundle_modules(bundle_dir):
        path = _module_file(module)
        members[path.relative_to(COMMON_DIR.parent).as_posix()] = path
    members[LARGE_FILES] = large_files
    members[MODEL_FILE] = ckpt
    members.update(run_configs(bundle_dir, ckpt))
    return members


def check_package_weights(
    bundle_dir: str | os.PathLike, source: str | os.PathLike | None = None, device: str | None = None
) -> Any:
    """Check that a bundle folder's ``models/model.pt`` fits its own configs: ``load_weights`` of
    ``configs/inference.json`` (the bundle's own loader, which its inference runs first) is evaluated with the
    folder's ``train.json`` defaults and nothing merged, as a run from that folder would.

    Args:
        bundle_dir: the bundle folder (a package, unzipped).
        source: the file the weights were copied from, named in the error instead of ``models/model.pt``.
        device: the config's ``device`` (default: the config's own choice).

    Returns:
        The ``ConfigParser`` of ``inference.json`` in which the weights were loaded (its ``network`` holds them).

    Raises:
        PackageError: naming the loader's explanation (which settings differ) and the fix.
    """
    from monai.bundle import ConfigParser

    bundle_dir = Path(bundle_dir)
    parser = ConfigParser()
    parser.read_config(str(bundle_dir / "configs" / "inference.json"))
    parser.update({"bundle_root": str(bundle_dir), **({} if device is None else {"device": device})})
    with tempfile.TemporaryDirectory(prefix="package_check_") as tmp:
        parser["output_dir"] = os.path.join(tmp, "outputs")  # no run folder: the weights of models/model.pt load
        try:
            parser.get_parsed_content("load_weights")
        except Exception as exc:
            text = _error_text(user_error_in_chain(exc) or exc)
            if source is not None:
                text = text.replace(str(bundle_dir / MODEL_FILE), str(source))
            raise PackageError(
                f"the weights do not fit the package's configs ({text}). A package must run with its "
                "own settings: package the models/model.pt a training run wrote (it carries the run's settings; "
                "for the X-ray cascade, the file 'run pack' writes), or, for weights from elsewhere, set the "
                "network settings they were trained with in the bundle's configs/train.json first."
            ) from exc
    return parser


def _error_text(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 1500 else text[:1500] + " ..."


def _write_member(zf: zipfile.ZipFile, arcname: str, source: Path | bytes) -> None:
    """One file entry with a fixed date, mode and creator, so the bytes depend on the content only."""
    info = zipfile.ZipInfo(arcname, date_time=_ZIP_DATE)
    info.create_system = 3  # unix, so external_attr holds the mode on every platform
    info.external_attr = (stat.S_IFREG | _FILE_MODE) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    if isinstance(source, bytes):
        info.file_size = len(source)
        stream: Any = io.BytesIO(source)
    else:
        info.file_size = source.stat().st_size
        stream = open(source, "rb")
    with stream, zf.open(info, "w") as target:
        shutil.copyfileobj(stream, target, 1 << 20)


def package_bundle(
    name_or_dir: str | os.PathLike,
    ckpt: str | os.PathLike,
    output_zip: str | os.PathLike,
    url: str | None = None,
    version: str | None = None,
    weights_inside: bool = False,
    hf_repo: str | None = None,
) -> Path:
    """Write a standalone, reproducible zip of a bundle with its trained weights.

    The zip holds one folder ``<name>/``: ``configs/`` and ``docs/`` (every file but hidden ones; for weights of a
    training run, ``train.json`` carries the run's settings and ``configs/run.json`` its record: see
    :func:`run_configs`), ``LICENSE``,
    ``large_files.yml`` (the bundle's entries plus ``models/model.pt`` with its sha256 and ``url`` or ``""``),
    ``models/model.pt`` and the ``common/`` package (``.py`` files only, ``common/demo`` left out). Entries are
    sorted, dated 1980-01-01 with mode 0644 and deflated, so the same inputs give the same bytes (with the same zlib). The file is
    written atomically.

    Args:
        name_or_dir: a bundle name under ``bundles/`` or a bundle folder.
        ckpt: the weights to ship as ``models/model.pt`` (what ``configs/inference.json`` loads); it must load with
            ``torch.load(weights_only=True)``.
        output_zip: a path ending in ``.zip``, or a folder that receives ``<name>_v<version>.zip``.
        url: where ``models/model.pt`` can be downloaded from (``https://``, ``http://``), written to
            ``large_files.yml``: a model-zoo submission leaves the weights out and the zoo fetches them from there.
        version: the version being released; must equal ``version`` in ``configs/metadata.json`` (which must have a
            changelog entry). ``None`` takes the metadata's version.
        weights_inside: the package is distributed as this zip, weights inside, and ``large_files.yml`` lists them
            with ``url: ""`` (MONAI's ``download_large_files`` then only checks their hash). Without it a ``url``
            (or ``hf_repo``) is required.
        hf_repo: the Hugging Face model repository (``owner/name``) that will host the bundle: the weights' url
            defaults to its address (:func:`hf_weights_url`) and the package is also laid out as that repository
            in ``<name>_v<version>_hf/<name>/`` beside the zip (:func:`hf_layout`, :func:`hf_layout_dir`).

    Returns:
        the path of the zip.

    Raises:
        FileNotFoundError: for a missing bundle, checkpoint or required bundle file.
        ValueError: for a version mismatch, a version without changelog entry or a symlink in the bundle.
        PackageError: without ``url`` or ``weights_inside``, or when the weights do not fit the package's configs
            (:func:`check_package_weights`); nothing is written.
        common.checkpoint_io.CheckpointError: for a corrupt or pickled checkpoint.
    """
    bundle_dir = _resolve_bundle(name_or_dir)
    name = bundle_dir.name
    meta_version = bundle_version(bundle_dir)
    if version is not None and str(version) != meta_version:
        raise ValueError(
            f"version {str(version)!r} differs from 'version' {meta_version!r} in "
            f"{str(bundle_dir / 'configs' / 'metadata.json')!r}; update 'version' and 'changelog' there first."
        )
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint {str(ckpt)!r} does not exist.")
    check_checkpoint(ckpt)
    if hf_repo is not None and url is None:
        url = hf_weights_url(hf_repo)
    if url is not None and (not isinstance(url, str) or not re.match(r"^(https?|file)://\S+$", url)):
        raise PackageError(f"url must be the http(s):// or file:// address of the weights, got {url!r}.")
    if url is None and not weights_inside:
        raise PackageError(
            f"no url for {MODEL_FILE}: large_files.yml would list it with url '', which the MONAI model zoo cannot "
            "download (a zoo submission leaves weights over 1 MB out of the bundle). Pass --url with the address "
            "where the weights are hosted (e.g. https://huggingface.co/<org>/<repo>/resolve/main/models/model.pt), "
            "or --weights_inside True when the package is distributed as this zip with the weights inside."
        )

    large_files = _packaged_large_files(bundle_dir, file_hash(ckpt, "sha256"), url)
    members = _package_members(bundle_dir, ckpt, large_files)

    out = Path(output_zip)
    if out.suffix != ".zip" or out.is_dir():
        out = out / f"{name}_v{meta_version}.zip"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w") as zf:
                for rel in sorted(members):
                    _write_member(zf, f"{name}/{rel}", members[rel])
            f.flush()
            os.fsync(f.fileno())
        check_archive(tmp, name)
        with tempfile.TemporaryDirectory(prefix="package_staging_") as staging:
            check_package_weights(extract_bundle(tmp, staging, name), source=ckpt)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    logger.info(f"packaged {name} v{meta_version} ({len(members)} files) to {out}")
    if hf_repo is not None:
        layout = hf_layout(out)
        logger.info(f"laid out as the Hugging Face repository {hf_repo}: {layout}")
    return out


# ------------------------------------------------------------------------------------------ safe extraction
def _member_problem(info: zipfile.ZipInfo) -> str | None:
    reason = _unsafe_reason(info.filename)
    if reason:
        return reason
    mode = info.external_attr >> 16
    # permission bits without a file type (Python's ``ZipFile.writestr(name, data)`` writes 0o600) are a regular
    # file, as unzip and zipfile's extraction read them
    if info.create_system == 3 and stat.S_IFMT(mode):
        if stat.S_ISLNK(mode):
            return "is a symbolic link"
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return f"is a special file (mode {oct(mode)})"
    if info.flag_bits & 0x1:
        return "is encrypted"
    return None


def check_archive(zip_path: str | os.PathLike, name: str | None = None) -> str:
    """Check a bundle zip without extracting anything; returns its single top folder.

    Refused: members with absolute paths, ``..``, backslashes or non-normalised paths, symbolic links and special
    files, encrypted or duplicate members, members outside a single top folder (which must be ``name`` when given)
    and archives without ``<top>/configs/metadata.json``.

    Args:
        zip_path: the archive.
        name: the expected top folder (bundle name).

    Raises:
        UnsafeArchiveError: naming every refused member (the first 20).
    """
    try:
        with zipfile.ZipFile(zip_path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise UnsafeArchiveError(f"{str(zip_path)!r} is not a readable zip archive: {e}") from e
    problems = []
    seen: set[str] = set()
    tops: set[str] = set()
    for info in infos:
        problem = _member_problem(info)
        if problem is None and info.filename.rstrip("/") in seen:
            problem = "appears twice"
        if problem is not None:
            problems.append(f"{info.filename!r} {problem}")
            continue
        seen.add(info.filename.rstrip("/"))
        parts = info.filename.rstrip("/").split("/")
        tops.add(parts[0])
        if len(parts) == 1 and not info.is_dir():
            problems.append(f"{info.filename!r} is a file at the top level (expected a single bundle folder)")
    if problems:
        shown = "; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise UnsafeArchiveError(f"refusing {str(zip_path)!r}: {shown}.")
    if len(tops) != 1:
        raise UnsafeArchiveError(f"refusing {str(zip_path)!r}: expected one top folder, found {sorted(tops)!r}.")
    top = tops.pop()
    if name is not None and top != name:
        raise UnsafeArchiveError(f"refusing {str(zip_path)!r}: its top folder is {top!r}, expected {name!r}.")
    if not _SAFE_NAME.match(top):
        raise UnsafeArchiveError(f"refusing {str(zip_path)!r}: top folder {top!r} must match {_SAFE_NAME.pattern}.")
    if f"{top}/configs/metadata.json" not in seen:
        raise UnsafeArchiveError(f"refusing {str(zip_path)!r}: no {top}/configs/metadata.json (not a bundle).")
    return top


def _extract_checked(zip_path: Path, staging: Path) -> None:
    """Extract an archive that passed :func:`check_archive` into the empty folder ``staging``."""
    root = staging.resolve()
    with zipfile.ZipFile(zip_path) as zf:
        for info in zf.infolist():
            target = (staging / PurePosixPath(info.filename)).resolve()
            if os.path.commonpath([root, target]) != str(root):
                raise UnsafeArchiveError(f"refusing member {info.filename!r}: it resolves outside {str(root)!r}.")
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as source, open(target, "xb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            os.chmod(target, _FILE_MODE)


def extract_bundle(
    zip_path: str | os.PathLike, bundle_dir: str | os.PathLike, name: str | None = None, overwrite: bool = False
) -> Path:
    """Safely extract a bundle zip into ``bundle_dir/<top folder>`` and check its large-file hashes.

    The archive is checked with :func:`check_archive` before anything is written; it is then extracted into a
    hidden staging folder inside ``bundle_dir``, its ``large_files.yml`` hashes are verified, and only then is the
    bundle folder moved into place. On any error nothing is left behind.

    Args:
        zip_path: the archive.
        bundle_dir: the folder receiving the bundle folder.
        name: the expected bundle name (top folder of the zip).
        overwrite: replace an existing bundle folder; otherwise an existing folder is an error.

    Returns:
        the extracted bundle folder.

    Raises:
        UnsafeArchiveError: for an unsafe archive (nothing written).
        FileExistsError: when the bundle folder exists and ``overwrite`` is False (nothing written).
        LargeFileError: when a listed file's hash does not match (nothing left behind).
    """
    zip_path = Path(zip_path)
    top = check_archive(zip_path, name)
    bundle_dir = Path(bundle_dir)
    target = bundle_dir / top
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise FileExistsError(f"{str(target)!r} already exists; remove it or pass overwrite=True.")
    bundle_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{top}.partial-", dir=bundle_dir))
    try:
        _extract_checked(zip_path, staging)
        verify_large_files(staging / top)
        previous = None
        if target.exists() or target.is_symlink():
            previous = staging / ".replaced"
            os.replace(target, previous)
        try:
            os.replace(staging / top, target)
        except OSError:
            if previous is not None:
                os.replace(previous, target)
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _warn_monai_version(bundle: Path) -> None:
    import monai

    try:
        wanted = json.loads((bundle / "configs" / "metadata.json").read_text(encoding="utf-8")).get("monai_version")
    except (OSError, json.JSONDecodeError):
        return
    if wanted and str(wanted) != monai.__version__:
        logger.warning(f"bundle {bundle.name!r} was made with MONAI {wanted}; MONAI {monai.__version__} is installed.")


def download_bundle(
    url: str,
    bundle_dir: str | os.PathLike = ".",
    name: str | None = None,
    hash_val: str | None = None,
    hash_type: str = "sha256",
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Download a bundle zip with MONAI's downloader and extract it with :func:`extract_bundle`.

    The zip is downloaded to a temporary folder outside ``bundle_dir`` (MONAI's ``download_url``, which checks
    ``hash_val`` when given), checked member by member before extraction, extracted, and its
    ``large_files.yml`` hashes verified; the temporary zip is removed.

    Args:
        url: the zip's URL (``http(s)://``, ``file://``).
        bundle_dir: the folder receiving ``<name>/``.
        name: the expected bundle name (top folder of the zip); any single top folder when None.
        hash_val: expected hash of the zip (printed by ``scripts/package_bundle.py``); strongly recommended.
        hash_type: hash algorithm of ``hash_val``.
        overwrite: replace an existing bundle folder.
        progress: show MONAI's progress bar.

    Returns:
        the bundle folder.

    Raises:
        monai.apps.utils.HashCheckError: when the zip's hash differs from ``hash_val``.
        UnsafeArchiveError: for an unsafe archive (nothing written to ``bundle_dir``).
        LargeFileError: when a large file's hash does not match (nothing left in ``bundle_dir``).
    """
    from monai.apps.utils import download_url

    if name is not None:
        existing = Path(bundle_dir) / name
        if (existing.exists() or existing.is_symlink()) and not overwrite:
            raise FileExistsError(f"{str(existing)!r} already exists; remove it or pass overwrite=True.")
    if hash_val is None:
        logger.warning(f"no hash_val given: the integrity of {url} is not verified.")
    with tempfile.TemporaryDirectory(prefix="bundle_download_") as tmp:
        zip_path = Path(tmp) / "bundle.zip"
        download_url(url=url, filepath=zip_path, hash_val=hash_val, hash_type=hash_type, progress=progress)
        if not zip_path.is_file():
            raise OSError(f"downloading {url} produced no file.")
        bundle = extract_bundle(zip_path, bundle_dir, name=name, overwrite=overwrite)
    _warn_monai_version(bundle)
    logger.info(f"downloaded bundle {bundle.name!r} to {bundle}")
    return bundle

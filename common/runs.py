# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The record of a training run, ``<output_dir>/configs/run.json``: the bundle and version it ran, the hashes of
its config files, its command line and the settings that differ from the bundle's ``train.json``. Evaluation,
inference, export and packaging read it back (:func:`run_settings`), so the folder of a trained run is itself a
deployable bundle: pointed at it with ``--output_dir``, they rebuild the network and the data pipeline the weights
were trained with, and a command-line override still wins. Importing this module imports neither torch nor
MONAI."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.errors import UserError

__all__ = [
    "CALIBRATED_IDS",
    "FREE_AT_INFERENCE",
    "LOCATION_IDS",
    "METADATA",
    "RUN_ARGUMENTS",
    "RUN_FILE",
    "TRAINING_ONLY_IDS",
    "RunRecord",
    "RunRecordError",
    "RunSettings",
    "bundle_of_config",
    "changed_settings",
    "check_record_bundle",
    "command_config_files",
    "command_line",
    "config_being_parsed",
    "config_file_list",
    "default_settings",
    "former_defaults",
    "is_plain",
    "make_record",
    "parsed_config",
    "read_record",
    "recorded_settings",
    "record_calibration",
    "run_dir_of",
    "run_settings",
    "settings_differences",
    "trained_ids",
    "trained_problems",
    "version_key",
    "workflow_being_run",
]

RUN_FILE = Path("configs") / "run.json"
#: what makes a folder a bundle folder
METADATA = Path("configs") / "metadata.json"
# where and how one process ran: read back by evaluation (same data, same run folder), never baked into a
# packaged bundle's defaults and never reported as a difference between a checkpoint and a config
LOCATION_IDS = frozenset(
    {
        "bundle_root",
        "output_dir",
        "outputs_root",
        "ckpt_dir",
        "ckpt_path",
        "dataset_dir",
        "datalist",
        "csv_path",
        "device",
        "distributed",
        "dist_timeout",
        "resume",
        "num_workers",
        "num_threads",
        "profile",
    }
)
# settings that shape the optimisation only: they differ between runs of the same network harmlessly
TRAINING_ONLY_IDS = frozenset(
    {
        "max_epochs",
        "epoch_length",
        "val_interval",
        "lr",
        "d_lr",
        "lr_warmup_iterations",
        "log_interval",
        "ckpt_interval",
        "adv_warmup_iterations",
        "discriminator_iter_start",
        "num_samples",
        "patches_per_volume",
        "batch_size",
        "micro_batch_size",
        "stage_batch_size",
        "stage_lr",
        "stage_iterations",
        "seed",
        "deterministic",
        "cudnn_benchmark",
        "compile",
        "memory_format",
        "oom_backoff",
        "amp",
        "preflight",
        "cache_rate",
        "replace_rate",
        "cache_device",
    }
)
# settings fitted on validation cases after training and written into the run's record by an evaluation
# (:func:`record_calibration`): a resumed run rewrites its record without them, for its weights change
CALIBRATED_IDS = frozenset({"uncertainty_scale", "uncertainty_floor", "consistency_reference"})
#: trained settings that evaluation and inference may set to another value than the run trained with (the model
#: cards say so): they choose how the trained network is run or read its input table, never what the network sees.
#: Every other id an evaluation or inference config reads from the run (``"$@trained['<id>']"``) must keep the
#: trained value (:func:`trained_problems`)
FREE_AT_INFERENCE = {
    "image_col": "the column of a cohort CSV naming the image",
    "time_col": "the column of a cohort CSV holding the follow-up time",
    "event_col": "the column of a cohort CSV holding the event",
    "id_col": "the column of a cohort CSV naming the case",
    "split_col": "the column of a cohort CSV naming the split",
    "num_splits": "how many pieces MAISI's split convolutions cut a volume into (memory, not the result)",
    "dim_split": "the axis MAISI's split convolutions cut along",
    "use_checkpoint": "activation checkpointing (memory in training; nothing at inference)",
    "eta": "the DDIM sampler's stochasticity",
    "latent_sw_batch_size": "latent windows per batch (memory)",
    "mode": "the X-ray cascade's output path, checked against the trained one by its own rule",
    "num_samples": "samples drawn per case (their mean and spread are the output)",
    "sample_chunk": "samples drawn at once (memory)",
    "guidance_scale": "data-consistency guidance of the X-ray sampler",
    "refine_steps": "data-consistency refinement steps of the X-ray cascade",
    "noise_tolerance": "the noise the X-ray consistency check tolerates",
    "mismatch_tolerance": "the mismatch the X-ray consistency check tolerates",
    "uncertainty_scale": "the calibration of the X-ray uncertainty map",
    "uncertainty_floor": "the calibration of the X-ray uncertainty map",
    "consistency_reference": "the calibration of the X-ray consistency check",
    "val_overlap": "the overlap of evaluation's sliding windows",
    "val_sw_batch_size": "evaluation's windows per batch (memory)",
    "val_batch_size": "evaluation's cases per batch (memory)",
    "val_denoise_loss": "whether evaluation also reports the denoising loss",
    "key_metric": "which figure evaluation names its key metric",
}
# arguments of ``monai.bundle.scripts.run`` that are not config overrides
RUN_ARGUMENTS = frozenset(
    {
        "run_id",
        "init_id",
        "final_id",
        "meta_file",
        "config_file",
        "logging_file",
        "tracking",
        "args_file",
        "workflow_name",
        "workflow_type",
        "properties_path",
    }
)
# the bundle's own workflow config files (any other file a command merges is the user's choice of settings)
WORKFLOW_FILES = ("train.json", "evaluate.json", "inference.json", "multi_gpu_train.json")
_SCHEMA = 1


class RunRecordError(UserError, ValueError):
    """A ``run.json`` that cannot be used: unreadable, or the record of another bundle."""


def _is_bundle_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is MONAI's bundle command line, ``python -m monai.bundle ...`` (directly or under torchrun)."""
    return bool(argv) and str(argv[0]).replace("\\", "/").endswith("monai/bundle/__main__.py")


def exit_on_command_line(status: int, argv: Sequence[str] | None = None) -> int:
    """The last item of an inference ``run`` list: on MONAI's bundle command line (``python -m monai.bundle ...``) a
    non-zero ``status`` becomes the process's exit status; anywhere else (a notebook, ``ConfigWorkflow(...).run()``,
    ``monai.bundle.run(...)`` called from Python) it is returned and the process goes on.

    ``python -m monai.bundle`` ends with status 0 whatever its run list returns, so this is the only way a bundle
    command can report a partial result; it is also the only place in the shared library that ends the process.

    Args:
        status: the exit status (:attr:`common.engines.cases.CaseRun.exit_code`: 0 all written, 1 none, 2 some failed).
        argv: the command line (default ``sys.argv``).

    Returns:
        ``status``, when the process is not the bundle command line or ``status`` is 0.
    """
    if status and _is_bundle_command(list(sys.argv if argv is None else argv)):
        sys.stdout.flush()
        sys.exit(status)
    return status


def command_line(argv: Sequence[str] | None = None) -> dict[str, Any] | None:
    """The ``--id value`` arguments of a ``python -m monai.bundle run ...`` command line, values parsed as ``fire``
    parses them; ``None`` when the process is not that command (a notebook, a test, another script).

    Args:
        argv: the command line (default ``sys.argv``).
    """
    from fire.parser import DefaultParseValue

    argv = list(sys.argv if argv is None else argv)
    if not _is_bundle_command(argv) or argv[1:2] != ["run"]:
        return None
    found: dict[str, Any] = {}
    args, i = argv[2:], 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            continue  # the positional run id
        name, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i < len(args) and not args[i].startswith("--"):
                value, i = args[i], i + 1
            else:
                value = "True"  # a bare flag
        found[name.replace("-", "_")] = DefaultParseValue(value)
    return found


def command_config_files(argv: Sequence[str] | None = None) -> list[str]:
    """The ``--config_file`` files of a MONAI bundle command other than a workflow run (``python -m monai.bundle
    ckpt_export ...``, ``verify_net_in_out ...``: their parsers are bare ``ConfigParser`` objects); ``[]`` elsewhere,
    and while a ``ConfigWorkflow`` runs - a parser it does not own is not of the command line's files.

    Args:
        argv: the command line (default ``sys.argv``).
    """
    from monai.bundle import ConfigWorkflow

    argv = list(sys.argv if argv is None else argv)
    if not _is_bundle_command(argv) or _on_stack(ConfigWorkflow) is not None:
        return []
    for i, arg in enumerate(argv):
        name, has_value, value = arg.partition("=")
        if name == "--config_file":
            return config_file_list(value if has_value else argv[i + 1] if i + 1 < len(argv) else "")
    return []


def config_file_list(value: Any) -> list[str]:
    """The files of a ``--config_file`` value: a list, a list literal or comma-separated names."""
    import ast

    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text.strip("[]").split(",")
        else:
            value = text.split(",")
    items = value if isinstance(value, (list, tuple)) else [value]
    return [str(v).strip().strip("'\"") for v in items if str(v).strip()]


def is_plain(value: Any) -> bool:
    """Whether a raw config value is plain JSON data: no ``$`` expression, ``@`` reference, ``%`` macro or
    ``_target_`` component anywhere inside it."""
    if isinstance(value, str):
        return value[:1] not in ("$", "@", "%")
    if isinstance(value, Mapping):
        return "_target_" not in value and all(is_plain(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float))


def _read_json(path: str | os.PathLike) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunRecordError(f"{str(path)!r} cannot be read as JSON: {e}") from e


def default_settings(bundle_root: str | os.PathLike) -> dict[str, Any]:
    """The plain top-level values of ``<bundle_root>/configs/train.json`` (the bundle's defaults)."""
    config = _read_json(Path(bundle_root) / "configs" / "train.json")
    return {k: v for k, v in config.items() if isinstance(k, str) and k != "imports" and is_plain(v)}


def version_key(version: Any) -> tuple[int, ...] | None:
    """``"0.3.11"`` as ``(0, 3, 11)``; ``None`` for anything that is not dotted integers."""
    parts = str(version).split(".") if version is not None else []
    return tuple(int(p) for p in parts) if parts and all(p.isdigit() for p in parts) else None


def former_defaults(bundle_root: str | os.PathLike, version: Any) -> dict[str, Any]:
    """The ``train.json`` defaults that a run recorded by bundle ``version`` had where they have changed since.

    A record keeps only the settings that differ from ``train.json``, so a changed default would silently change
    what an older run's record means. ``collection.former_defaults`` of ``metadata.json`` keeps, per version that
    changed defaults, the values before it (``{"0.3.11": {"mode": "diffusion"}}``: runs of versions before 0.3.11
    had ``mode`` diffusion by default); a later change of the same id wins for the versions before it. Nothing
    for an unknown version (a record written by hand).
    """
    recorded = version_key(version)
    metadata = _read_json(Path(bundle_root) / "configs" / "metadata.json")
    changes = (metadata.get("collection") or {}).get("former_defaults") or {}
    found: dict[str, Any] = {}
    if recorded is None:
        return found
    for changed in sorted(changes, key=lambda v: version_key(v) or (), reverse=True):  # the oldest change last
        if (version_key(changed) or ()) > recorded:
            found.update(changes[changed])
    return found


def _on_stack(kind: type, accept: Any = None) -> Any:
    """The innermost ``self`` on the call stack that is a ``kind`` (and that ``accept`` accepts), or ``None``.

    MONAI 1.6 gives a config's expressions and components no reference to the parser or resolver evaluating them,
    nor to the workflow running them (``@`` references name items, never the config itself), so what a check reads,
    the record of the merged config and the folder of the config files can only be found here; this is the one
    function of the collection that walks the stack (:func:`config_being_parsed`, :func:`workflow_being_run`)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, kind) and (accept is None or accept(owner)):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def bundle_of_config(config_folder: str | os.PathLike) -> Path | None:
    """The bundle folder whose config files lie in ``config_folder``, absolute, by MONAI's rule (``ConfigWorkflow``
    reads ``metadata.json`` there and puts the folder above a ``configs`` folder on ``sys.path``); ``None`` when
    that is no bundle folder (it has no :data:`METADATA`)."""
    folder = Path(config_folder).expanduser().absolute()
    folder = folder.parent if folder.name == "configs" else folder
    return folder.resolve() if (folder / METADATA).is_file() else None


def config_being_parsed() -> Any:
    """The ``monai.bundle.ReferenceResolver`` resolving the config item whose expression or component is running now
    (:func:`_on_stack`), or ``None`` outside a config's resolution."""
    from monai.bundle.reference_resolver import ReferenceResolver

    return _on_stack(ReferenceResolver)


def workflow_being_run(resolver: Any = None) -> Any:
    """The ``monai.bundle.ConfigWorkflow`` whose parser owns ``resolver`` (default: the config being parsed), if
    one is running it (:func:`_on_stack`): ``python -m monai.bundle run``, ``create_workflow`` or a
    ``ConfigWorkflow`` in Python; ``None`` for a bare ``ConfigParser`` - also one parsed inside another bundle's
    workflow, whose files are not that workflow's.

    Args:
        resolver: a ``monai.bundle.ReferenceResolver``.
    """
    from monai.bundle import ConfigWorkflow

    resolver = resolver if resolver is not None else config_being_parsed()
    if resolver is None:
        return None
    return _on_stack(ConfigWorkflow, lambda w: getattr(getattr(w, "parser", None), "ref_resolver", None) is resolver)


def parsed_config(config: Any = None) -> dict[str, Any] | None:
    """The merged raw content of a config: its files in order, then its overrides, however they were given
    (``--id value`` on the command line, ``ConfigWorkflow(..., id=value)``, ``parser.update(...)`` in a notebook).

    Args:
        config: a ``monai.bundle.ConfigParser`` or its ``ReferenceResolver``; default: the config being parsed
            (:func:`config_being_parsed`).

    Returns:
        The content, or ``None`` outside a config's resolution without ``config``.
    """
    source = config if config is not None else config_being_parsed()
    if source is None:
        return None
    if hasattr(source, "ref_resolver"):  # a ConfigParser
        content = source.get()
    else:  # a ReferenceResolver: the root item ("") holds the whole config
        root = source.items.get("")
        content = None if root is None else root.get_config()
    return content if isinstance(content, dict) else None


def _changed(value: Any, default: Any, config_id: str, found: dict[str, Any]) -> None:
    """Add to ``found`` every plain value inside ``value`` that differs from ``default`` at the same place, by id."""
    if is_plain(value):
        if value != default:
            found[config_id] = value
        return
    if isinstance(value, Mapping) and isinstance(default, Mapping):
        items: Any = value.items()
    elif isinstance(value, list) and isinstance(default, list):
        items = enumerate(value)
    else:
        return  # an expression or a component where the default is something else: rebuilt from the plain values
    missing = object()
    for key, item in items:
        old = (
            default.get(key, missing)
            if isinstance(default, Mapping)
            else (default[key] if key < len(default) else missing)
        )
        if old is missing:
            if is_plain(item):
                found[f"{config_id}#{key}"] = item  # a new argument of an existing component
            continue
        _changed(item, old, f"{config_id}#{key}", found)


def changed_settings(merged: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The plain values of the merged config ``merged`` that differ from ``defaults`` (the bundle's ``train.json``):
    top-level ids, and nested ids (``train#trainer#grad_clip``) where a plain value inside a component changed or
    was added. Expressions and components are left out (they are rebuilt from the plain values)."""
    changed: dict[str, Any] = {}
    for key, value in merged.items():
        if not isinstance(key, str) or key in ("imports", "_meta_") or not is_plain(value) and key not in defaults:
            continue
        if key not in defaults:
            changed[key] = value
        else:
            _changed(value, defaults[key], key, changed)
    return changed


def _merged_files(config_files: Sequence[str], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The content of ``config_files`` merged and updated with ``overrides``, as ``monai.bundle run`` merges them."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(list(config_files))
    parser.update({k: v for k, v in overrides.items() if k not in RUN_ARGUMENTS})
    return parser.get()


def _sha256(path: str | os.PathLike) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


class RunRecord:
    """What a training run writes into ``<output_dir>/configs/run.json`` (rank 0, atomically; the checkpoint
    handler writes it once resuming has succeeded, so a command whose settings do not fit the run's checkpoint
    leaves the record of the run as it was).

    The settings are the plain values of the run's merged config that differ from the bundle's ``train.json``
    (:func:`changed_settings`), whichever way they came: a config file merged after ``train.json``, a command-line
    override, an override given in Python. ``config_files`` and ``command_line`` are recorded where the command
    line names them; a run started from Python records none (MONAI's workflow does not keep them).

    Args:
        output_dir: the run folder.
        bundle_root: the bundle's folder (its ``configs/metadata.json`` names the version, its ``configs/train.json``
            holds the defaults).
        config_files: the config files of the command, the bundle's ``train.json`` first (none from Python).
        overrides: the command-line overrides.
        resolved: values of ids whose default is an expression (e.g. an intensity chosen from the data), recorded
            as resolved so that evaluation and inference use them as they were.
        merged: the run's merged config (:func:`parsed_config`); default: ``config_files`` merged and updated
            with ``overrides``.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        bundle_root: str | os.PathLike,
        config_files: Sequence[str] = (),
        overrides: Mapping[str, Any] | None = None,
        resolved: Mapping[str, Any] | None = None,
        merged: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(output_dir) / RUN_FILE
        self.bundle_root = Path(bundle_root)
        self.config_files = [str(Path(f).resolve()) for f in config_files]
        self.overrides = None if overrides is None else {k: v for k, v in overrides.items() if k not in RUN_ARGUMENTS}
        if merged is None:
            merged = _merged_files(self.config_files, self.overrides or {})
        defaults = _read_json(self.bundle_root / "configs" / "train.json")
        self.settings = {**changed_settings(merged, defaults), **_jsonable(dict(resolved or {}))}

    def content(self) -> dict[str, Any]:
        """The JSON content: ``bundle`` (folder name) and ``bundle_root`` (its path), ``name`` and ``version`` (from
        ``metadata.json``), ``created``, ``config_files`` (path: sha256), ``command_line`` (``null`` from Python)
        and ``settings``."""
        metadata = _read_json(self.bundle_root / "configs" / "metadata.json")
        return {
            "schema": _SCHEMA,
            "bundle": self.bundle_root.name,
            "bundle_root": str(self.bundle_root.resolve()),
            "name": metadata.get("name"),
            "version": metadata.get("version"),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config_files": {f: _sha256(f) for f in self.config_files},
            "command_line": None if self.overrides is None else _jsonable(self.overrides),
            "settings": _jsonable(self.settings),
        }

    def full_settings(self) -> dict[str, Any]:
        """The bundle's ``train.json`` defaults updated with this run's settings."""
        return {**default_settings(self.bundle_root), **self.settings}

    def write(self) -> Path:
        """Write ``run.json`` atomically; returns its path."""
        from common.utils import write_text_atomic  # imported here: common.utils imports torch, this module does not

        return write_text_atomic(self.path, json.dumps(self.content(), indent=4) + "\n")


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists and anything JSON cannot hold as its ``str``."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def make_record(
    output_dir: str | os.PathLike,
    bundle_root: str | os.PathLike,
    resolved: Mapping[str, Any] | None = None,
    argv: Sequence[str] | None = None,
    config: Any = None,
) -> RunRecord | None:
    """The record of this training run, the same from the command line and from Python: its settings come from the
    config being parsed (or ``config``, see :func:`parsed_config`); on a ``python -m monai.bundle run ...
    --config_file ...`` command line (``argv``, default ``sys.argv``) its files and overrides are recorded too.
    ``None`` outside both (nothing to record). See :class:`RunRecord` for ``resolved``."""
    overrides = command_line(argv)
    if not overrides or "config_file" not in overrides:
        overrides = None
    merged = parsed_config(config)
    if merged is None and overrides is None:
        return None
    files = config_file_list(overrides["config_file"]) if overrides is not None else []
    return RunRecord(output_dir, bundle_root, files, overrides, resolved, merged)


def read_record(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The content of ``<output_dir>/configs/run.json``, or ``None`` when there is none.

    Raises:
        RunRecordError: naming the file when it is not a run record.
    """
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return None
    record = _read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("settings"), dict):
        raise RunRecordError(f"{str(path)!r} is not the record of a training run (no 'settings' object).")
    return record


def record_calibration(output_dir: str | os.PathLike, values: Mapping[str, Any]) -> Path | None:
    """Add ``values`` (ids of :data:`CALIBRATED_IDS`) to the settings of the run recorded in ``output_dir`` and
    write its ``run.json`` again atomically, with ``calibrated`` (the time); evaluation and inference then read them
    as the run's settings. Returns the record's path, or ``None`` when the folder holds no record (a packaged
    bundle: its ``train.json`` carries the settings).

    Raises:
        ValueError: for an id that is not calibrated.
        RunRecordError: when ``run.json`` is unreadable.
    """
    from common.utils import write_text_atomic  # imported here: common.utils imports torch, this module does not

    unknown = sorted(set(values) - CALIBRATED_IDS)
    if unknown:
        raise ValueError(f"{unknown} are not calibrated settings ({sorted(CALIBRATED_IDS)}).")
    record = read_record(output_dir)
    if record is None:
        return None
    record["settings"].update(_jsonable(dict(values)))
    record["calibrated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return write_text_atomic(Path(output_dir) / RUN_FILE, json.dumps(record, indent=4) + "\n")


def check_record_bundle(record: Mapping[str, Any], bundle_root: str | os.PathLike, where: Any) -> None:
    """Refuse the record of a run of another bundle (compared by the ``name`` in ``metadata.json``, so a bundle
    unzipped into a folder of another name still reads its runs).

    Raises:
        RunRecordError: naming ``where`` and both bundles.
    """
    name = _read_json(Path(bundle_root) / "configs" / "metadata.json").get("name")
    if record.get("name") not in (None, name):
        raise RunRecordError(
            f"{str(where)!r} records a run of bundle {record.get('name')!r} ({record.get('bundle')}), not {name!r}: "
            "point --output_dir at a run of this bundle."
        )


def _extra_config_settings(bundle_root: str | os.PathLike, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The plain top-level values of the config files this command merges besides the bundle's own workflow files
    (``tiny.json``, ``brats.json``, a user's file), in order."""
    overrides = command_line(argv)
    if not overrides or "config_file" not in overrides:
        return {}
    own = {(Path(bundle_root) / "configs" / name).resolve() for name in WORKFLOW_FILES}
    settings: dict[str, Any] = {}
    for name in config_file_list(overrides["config_file"]):
        if Path(name).resolve() not in own and Path(name).is_file():
            content = _read_json(name)
            if isinstance(content, dict):
                settings.update({k: v for k, v in content.items() if k != "imports" and is_plain(v)})
    return settings


def recorded_settings(record: Mapping[str, Any], bundle_root: str | os.PathLike) -> dict[str, Any]:
    """What a run record says differs from the bundle's current ``train.json``: the former defaults of the version
    that wrote it (:func:`former_defaults`), then the settings it recorded."""
    return {**former_defaults(bundle_root, record.get("version")), **record.get("settings", {})}


class RunSettings(dict):
    """The settings of a trained run (:func:`run_settings`), which know the record they were read from.

    Args:
        settings: the settings.
        source: the run's ``configs/run.json``; ``None`` when no run is recorded (weights described by the command).
    """

    def __init__(self, settings: Mapping[str, Any], source: str | os.PathLike | None = None) -> None:
        super().__init__(settings)
        self.source = None if source is None else str(source)


def run_settings(
    output_dir: str | os.PathLike, bundle_root: str | os.PathLike, argv: Sequence[str] | None = None
) -> RunSettings:
    """The settings of the run in ``output_dir``: the bundle's ``train.json`` defaults, the defaults of the version
    that recorded the run where they have changed since (:func:`former_defaults`), then the run's recorded settings.
    When the folder holds no ``run.json`` (a packaged bundle whose ``train.json`` already carries its run's
    settings, published weights described by the command), the defaults then the plain values of any other config
    file this command merges (``tiny.json``, ``maisi_vae.json``). Configs read their network and data settings from
    it (``"channels": "$@trained['channels']"``); a config file or override giving such an id another value than a
    recorded run's is refused (:func:`trained_problems`), so listing ``brats.json`` again changes nothing.

    Raises:
        RunRecordError: when ``run.json`` is unreadable or records another bundle.
    """
    settings = default_settings(bundle_root)
    record = read_record(output_dir)
    if record is None:
        packaged = Path(bundle_root) / RUN_FILE  # a packaged bundle: its train.json carries the run's settings
        source = packaged if packaged.is_file() else None
        return RunSettings({**settings, **_extra_config_settings(bundle_root, argv)}, source)
    check_record_bundle(record, bundle_root, Path(output_dir) / RUN_FILE)
    recorded = {k: v for k, v in recorded_settings(record, bundle_root).items() if "#" not in k}
    return RunSettings({**settings, **recorded}, Path(output_dir) / RUN_FILE)


def run_dir_of(checkpoint: str | os.PathLike) -> Path | None:
    """The run folder whose ``models/`` holds ``checkpoint`` when that run recorded its settings, else ``None``."""
    run_dir = Path(checkpoint).resolve().parent.parent
    return run_dir if (run_dir / RUN_FILE).is_file() else None


def settings_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``id: checkpoint <value>, config <value>`` for every id both mappings hold with different values, leaving
    out locations, optimisation-only and calibrated settings (see ``LOCATION_IDS``, ``TRAINING_ONLY_IDS``,
    ``CALIBRATED_IDS``)."""
    skip = LOCATION_IDS | TRAINING_ONLY_IDS | CALIBRATED_IDS
    lines = []
    for key in sorted(set(recorded) & set(current)):
        if key in skip:
            continue
        old, new = _jsonable(recorded[key]), _jsonable(current[key])
        if is_plain(new) and old != new:
            lines.append(f"{key}: checkpoint {json.dumps(old)}, config {json.dumps(new)}")
    return lines


def trained_ids(bundle_root: str | os.PathLike) -> list[str]:
    """The ids that the bundle's evaluation and inference configs read from the trained run: those whose value in
    ``configs/evaluate.json`` or ``configs/inference.json`` is ``"$@trained['<the same id>']"``."""
    found: list[str] = []
    for name in ("evaluate.json", "inference.json"):
        path = Path(bundle_root) / "configs" / name
        content = _read_json(path) if path.is_file() else {}
        found += [k for k, v in content.items() if isinstance(k, str) and v == f"$@trained['{k}']" and k not in found]
    return found


def trained_problems(resolver: Any) -> list[str]:
    """One line for every id that the bundle's evaluation or inference reads from the trained run
    (:func:`trained_ids`) but that resolves to another value in the config ``resolver`` resolves (a command-line
    override, a config file merged after the bundle's): a model only runs on what it was trained to see. The ids of
    :data:`FREE_AT_INFERENCE` may differ. Only a recorded run is compared with (``trained`` is a :class:`RunSettings`
    with a ``source``): weights without one (published weights) are described by the command, and a config without
    a ``trained`` id has nothing to compare.

    Args:
        resolver: the ``monai.bundle.ReferenceResolver`` (or ``ConfigParser``) of an evaluation or inference config.
    """
    resolver = getattr(resolver, "ref_resolver", resolver)
    if any(key not in resolver.items for key in ("trained", "bundle_root")):
        return []
    trained = resolver.get_resolved_content("trained")
    source = getattr(trained, "source", None)
    if source is None:
        return []  # no run is recorded (weights described by the command): there is nothing to compare with
    problems = []
    for key in trained_ids(resolver.get_resolved_content("bundle_root")):
        if key in FREE_AT_INFERENCE or key not in resolver.items or key not in trained:
            continue
        value, recorded = _jsonable(resolver.get_resolved_content(key)), _jsonable(trained[key])
        if value != recorded:
            problems.append(
                f"{key!r} is {json.dumps(value)} here but the model was trained with {json.dumps(recorded)} "
                f"({source}): a model only runs on what it was trained to see; drop the override."
            )
    return problems

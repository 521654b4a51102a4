# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The one description of each bundle: the ``collection`` section of its ``configs/metadata.json``.

Every tool reads it from there: ``scripts/demo.py`` (the demo profiles, presets, reported metrics, staged training),
the harness (``scripts.harness.<family>``: benchmarks, the fault-test job, the campaign's throughput rows),
``tests/test_layout.py`` (which ``common`` package a bundle's family is) and ``scripts/verify_bundle.py``, which
checks the section (:func:`check_description`). A new bundle is described by adding the section; nothing else lists
bundles::

    "collection": {
        "family": "autoencoder",
        "also_imports": [],
        "demo": {
            "cpu": {"patch_size": [32, 32, 32], "max_epochs": 200},
            "gpu": {"patch_size": [64, 64, 64], "max_epochs": 200},
            "presets": {"brats": {"configs": ["brats.json"], "cpu": {}, "gpu": {}}},
            "reported_metrics": ["val_psnr", "val_ssim"],
            "stage_iterations": {"cpu": [300, 150], "gpu": [2000, 1000]}
        }
    }

``family`` names the package ``common.<family>`` that holds the bundle's model code and the harness module
``scripts.harness.<family>``. ``also_imports`` lists modules or packages of ``common`` that the bundle imports
without its configs naming them (``fast_ddpm_3d`` builds the autoencoder of another bundle's config for latent
diffusion); packaging ships them with what the configs import (:func:`common.bundle_tools.package.bundle_modules`). The demo profiles are overrides of ``train.json`` ids (of the preset's configs too);
A bundle with ``stage_iterations`` trains stage by stage, stage ``k`` for ``stage_iterations[device][k - 1]``
iterations (one validated epoch), into ``<output_dir>/stage<k>``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.bundle import METADATA, ROOT, bundle_names, resolve_bundle
from common.errors import UserError
from common.runs import version_key

__all__ = [
    "DEVICES",
    "SECTION",
    "BundleDescription",
    "check_description",
    "describe",
    "descriptions",
    "former_defaults_problems",
]

SECTION = "collection"
DEVICES = ("cpu", "gpu")
_DEMO_KEYS = {*DEVICES, "presets", "reported_metrics", "stage_iterations"}


@dataclass(frozen=True)
class BundleDescription:
    """A bundle as the collection's tools see it (read from its metadata by :func:`describe`).

    Attributes:
        name: the bundle folder's name.
        folder: the bundle folder.
        family: the model family: ``common.<family>`` and ``scripts.harness.<family>``.
        also_imports: modules or packages of ``common`` the bundle imports that its configs do not name.
        demo: the demo's overrides of ``train.json`` per device (``cpu``, ``gpu``).
        presets: demo presets by name: extra ``configs`` merged after ``train.json`` and their overrides per device.
        reported_metrics: the metrics the demo prints.
        stage_iterations: per device, the iterations of each stage of a bundle trained stage by stage into
            ``<output_dir>/stage<k>`` (empty: trained in one run).
    """

    name: str
    folder: Path
    family: str
    demo: Mapping[str, Mapping[str, Any]]
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    also_imports: tuple[str, ...] = ()
    reported_metrics: tuple[str, ...] = ()
    stage_iterations: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def staged(self) -> bool:
        """Whether the bundle trains stage by stage."""
        return bool(self.stage_iterations)

    @property
    def package(self) -> str:
        """The ``common`` package of the family."""
        return f"common.{self.family}"

    @property
    def harness(self) -> str:
        """The harness module: benchmarks, fault-test job and throughput rows of the campaign."""
        return f"scripts.harness.{self.family}"

    def demo_run(self, device: str, preset: str | None = None) -> tuple[list[str], dict[str, Any]]:
        """``(extra config files, overrides)`` of a demo run on ``device`` (``cpu`` or ``gpu``), with a preset.

        Raises:
            UserError: for an unknown device or preset (the message lists the known ones).
        """
        if device not in DEVICES:
            raise UserError(f"demo device must be one of {DEVICES}, got {device!r}.")
        overrides = dict(self.demo[device])
        if preset is None:
            return [], overrides
        if preset not in self.presets:
            raise UserError(f"no demo preset {preset!r} for {self.name!r}; available: {sorted(self.presets)}.")
        chosen = self.presets[preset]
        return list(chosen.get("configs", [])), {**overrides, **chosen.get(device, {})}


def _where(key: str = "") -> str:
    return f"{METADATA.as_posix()}: '{SECTION}{'.' + key if key else ''}'"


def describe(target: str | os.PathLike) -> BundleDescription:
    """The description of the bundle ``target`` (a name or a folder, see :func:`common.bundle.resolve_bundle`).

    Raises:
        BundleNotFoundError: for an unknown bundle.
        UserError: when the section is missing or malformed (the message names the file and the key).
    """
    folder = resolve_bundle(target)
    problems = check_description(folder)
    if problems:
        raise UserError(f"{folder}: " + "; ".join(problems))
    section = json.loads((folder / METADATA).read_text())[SECTION]
    demo = section["demo"]
    return BundleDescription(
        name=folder.name,
        folder=folder,
        family=section["family"],
        demo={device: dict(demo[device]) for device in DEVICES},
        presets={name: dict(preset) for name, preset in demo.get("presets", {}).items()},
        also_imports=tuple(section.get("also_imports", [])),
        reported_metrics=tuple(demo["reported_metrics"]),
        stage_iterations={device: tuple(n) for device, n in demo.get("stage_iterations", {}).items()},
    )


def descriptions() -> list[BundleDescription]:
    """The description of every bundle of the repository, by name."""
    return [describe(name) for name in bundle_names()]


def _config_ids(folder: Path, names: list[str]) -> set[str] | None:
    ids: set[str] = set()
    for name in ["train.json", *names]:
        try:
            ids |= set(json.loads((folder / "configs" / name).read_text()))
        except (OSError, ValueError):
            return None  # reported by the checks of the config files themselves
    return ids


def _check_overrides(key: str, overrides: Any, ids: set[str] | None) -> list[str]:
    if not isinstance(overrides, Mapping):
        return [f"{_where(key)} must be a dict of train.json ids, got {type(overrides).__name__}"]
    unknown = sorted(k for k in overrides if ids is not None and k not in ids)
    return [f"{_where(key)} overrides {unknown}, which are not ids of its configs"] if unknown else []


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return name.split(".")[0] == "common" and (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file())


def check_description(bundle_dir: str | os.PathLike) -> list[str]:
    """Problems of the ``collection`` section of a bundle's metadata, one line each naming the file relative to the
    bundle folder (empty: none): its family is a package of ``common``, the demo profiles override ids the configs
    have, the reported metrics are names.

    Args:
        bundle_dir: the bundle folder.
    """
    folder = Path(bundle_dir)
    try:
        section = json.loads((folder / METADATA).read_text()).get(SECTION)
    except (OSError, ValueError, AttributeError):
        return []  # a missing or broken metadata.json is reported by the metadata checks
    if not isinstance(section, Mapping):
        return [f"{METADATA.as_posix()}: no '{SECTION}' section (the bundle's family and demo; see {__name__})"]
    problems = []
    family = section.get("family")
    if not isinstance(family, str) or not (ROOT / "common" / family / "__init__.py").is_file():
        problems.append(f"{_where('family')} must name a package of common/, got {family!r}")
    also = section.get("also_imports", [])
    if not isinstance(also, list) or not all(isinstance(m, str) and _is_module(m) for m in also):
        problems.append(f"{_where('also_imports')} must list modules or packages of common, got {also!r}")
    demo = section.get("demo")
    if not isinstance(demo, Mapping):
        return [*problems, f"{_where('demo')} must be a dict with {sorted(_DEMO_KEYS)}"]
    problems += [
        f"{_where('demo.' + k)} is not a known key ({sorted(_DEMO_KEYS)})" for k in demo if k not in _DEMO_KEYS
    ]
    ids = _config_ids(folder, [])
    problems += [p for device in DEVICES for p in _check_overrides(f"demo.{device}", demo.get(device), ids)]
    presets = demo.get("presets", {})
    for name, preset in presets.items() if isinstance(presets, Mapping) else ():
        configs = preset.get("configs", []) if isinstance(preset, Mapping) else None
        if not isinstance(configs, list) or not all((folder / "configs" / str(c)).is_file() for c in configs):
            problems.append(f"{_where(f'demo.presets.{name}.configs')} must list files of configs/")
            continue
        preset_ids = _config_ids(folder, configs)
        for device in DEVICES:
            key = f"demo.presets.{name}.{device}"
            problems += _check_overrides(key, preset.get(device, {}), preset_ids)
    metrics = demo.get("reported_metrics")
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) and m for m in metrics):
        problems.append(f"{_where('demo.reported_metrics')} must be a non-empty list of metric names")
    stages = demo.get("stage_iterations", {})
    if not isinstance(stages, Mapping) or (stages and set(stages) != set(DEVICES)):
        problems.append(f"{_where('demo.stage_iterations')} must give the iterations per stage for {DEVICES}")
    elif not all(isinstance(n, list) and n and all(isinstance(i, int) and i > 0 for i in n) for n in stages.values()):
        problems.append(f"{_where('demo.stage_iterations')} must be lists of positive integers")
    return problems + former_defaults_problems(folder, section.get("former_defaults", {}), ids)


def former_defaults_problems(folder: Path, former: Any, ids: set[str] | None) -> list[str]:
    """Problems of ``collection.former_defaults`` of the bundle ``folder`` (one line each): per version that changed
    defaults (dotted integers, not above the bundle's version), ``train.json`` ids among ``ids`` and their values
    before it (:func:`common.runs.former_defaults`)."""
    version = version_key(json.loads((folder / METADATA).read_text()).get("version"))
    where = _where("former_defaults")
    if not isinstance(former, Mapping):
        return [f"{where} must map versions to the train.json defaults before them, got {former!r}"]
    problems = []
    for changed, values in former.items():
        key = version_key(changed)
        if key is None or version is None or key > version:
            problems.append(f"{where}: {changed!r} must be a version (dotted integers) up to the bundle's")
        if not isinstance(values, Mapping) or not values:
            problems.append(f"{_where('former_defaults.' + changed)} must map train.json ids to their former defaults")
            continue
        problems += [
            f"{_where('former_defaults.' + changed)}: {k!r} is not an id of configs/train.json"
            for k in values
            if ids is not None and k not in ids
        ]
    return problems

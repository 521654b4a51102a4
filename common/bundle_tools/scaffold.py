# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""A new bundle of an existing model family, made from the family's bundle (in the spirit of MONAI's
``init_bundle``, but one that trains): its configs, ``LICENSE``, ``large_files.yml`` and data license, with its own
name, version ``0.1.0`` and a model card to fill in. It passes ``scripts/verify_bundle.py`` and trains with its
tiny profile as made; then change its configs (see ``docs/adding_a_bundle.md``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

from common.bundle import BUNDLES_DIR, METADATA, bundle_names
from common.bundle_tools.registry import descriptions
from common.errors import UserError

__all__ = ["NAME_PATTERN", "family_templates", "new_bundle", "train_command"]

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]*$")
_COPIED = ("configs", "LICENSE", "large_files.yml", "docs/data_license.txt")

_CARD = """# {name}

A bundle of the `{family}` family, made from [`{template}`](../../{template}/docs/README.md) by
`scripts/new_bundle.py`; its configs are those of `{template}` until you change them.

## Train

```bash
{train} --dataset_dir <your data>
```

`configs/tiny.json` merged after `train.json` gives the tiny profile the tests train.

## Model card

Fill in what `{template}`'s model card says for its model: intended use, data, training, the figures you measured
(with the commands), limitations.
"""


def train_command(folder: str | os.PathLike, *configs: str) -> list[str]:
    """``python -m monai.bundle run training`` of the bundle ``folder`` with ``configs`` (default ``train.json``),
    paths relative to the working directory; the configs find their bundle from their own folder
    (:func:`common.bundle.config_bundle_root`), wherever it is."""
    rel = Path(os.path.relpath(folder, Path.cwd()))
    files = [str(rel / "configs" / c) for c in (configs or ("train.json",))]
    config_file = files[0] if len(files) == 1 else json.dumps(files)
    return ["python", "-m", "monai.bundle", "run", "training", "--config_file", config_file]


def family_templates() -> dict[str, str]:
    """The bundle each family's new bundles are made from: the first bundle of the family, by name."""
    found: dict[str, str] = {}
    for description in descriptions():
        found.setdefault(description.family, description.name)
    return found


def new_bundle(
    name: str, family: str, bundles_dir: str | os.PathLike | None = None, template: str | None = None
) -> Path:
    """Make the bundle ``<bundles_dir>/<name>`` of model family ``family``, a copy of the family's bundle with its
    own name, version ``0.1.0``, a fresh changelog and a model card to fill in.

    Args:
        name: the new bundle's name (its folder): lower case letters, digits and ``_``.
        family: an existing model family (``common.<family>``), e.g. ``autoencoder``.
        bundles_dir: where the bundle folder is made; default: the repository's ``bundles/``.
        template: the bundle to copy (default: the family's first bundle, :func:`family_templates`).

    Returns:
        The new bundle folder.

    Raises:
        UserError: for a bad or taken name, an unknown family or template; nothing is written then.
    """
    root = Path(bundles_dir) if bundles_dir is not None else BUNDLES_DIR
    templates = family_templates()
    if not NAME_PATTERN.match(str(name)):
        raise UserError(f"bundle name {name!r} must match {NAME_PATTERN.pattern} (lower case, digits, '_').")
    if family not in templates:
        raise UserError(
            f"unknown family {family!r}; the families are {sorted(templates)} (a new family is a package of "
            "common/ first: see docs/adding_a_bundle.md)."
        )
    template = template or templates[family]
    if template not in bundle_names():
        raise UserError(f"unknown template bundle {template!r}; the bundles are {bundle_names()}.")
    source = BUNDLES_DIR / template
    target = root / name
    if target.exists() or name in bundle_names():
        raise UserError(f"{str(target)!r} exists or {name!r} is already a bundle: choose another name.")
    staging = root / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for item in _COPIED:
            if (source / item).is_dir():
                shutil.copytree(source / item, staging / item)
            elif (source / item).is_file():
                (staging / item).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source / item, staging / item)
        metadata = json.loads((staging / METADATA).read_text(encoding="utf-8"))
        metadata.update(
            name=name,
            version="0.1.0",
            changelog={"0.1.0": f"made from {template} {metadata['version']} by scripts/new_bundle.py"},
        )
        (staging / METADATA).write_text(json.dumps(metadata, indent=4) + "\n", encoding="utf-8")
        card = _CARD.format(name=name, family=family, template=template, train=shlex.join(train_command(target)))
        (staging / "docs").mkdir(exist_ok=True)
        (staging / "docs" / "README.md").write_text(card, encoding="utf-8")
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target

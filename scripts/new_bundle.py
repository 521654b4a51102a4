# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Make a new bundle of an existing model family from the family's bundle, ready to verify and train::

    python scripts/new_bundle.py ct_autoencoder --family autoencoder
    python scripts/new_bundle.py brats_ddpm --family diffusion --bundles_dir /tmp/bundles

It prints the commands that verify it and train its tiny profile. Exits with status 1 and an ``error:`` line for a
bad or taken name or an unknown family; nothing is written then. Adding a new family: ``docs/adding_a_bundle.md``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from common.bundle_tools.scaffold import new_bundle, train_command
from common.errors import UserError

__all__ = ["main"]


def main(name: str, family: str, bundles_dir: str | None = None, template: str | None = None) -> None:
    """Make ``<bundles_dir>/<name>`` and print the commands that verify it and train it.

    Args:
        name: the new bundle's name (lower case letters, digits and ``_``).
        family: its model family (``autoencoder``, ``vqgan``, ``diffusion``, ``survival``, ``xray2ct``, ...).
        bundles_dir: where to make it (default: ``bundles/`` of this repository).
        template: the bundle to copy (default: the family's first bundle).
    """
    try:
        folder = new_bundle(str(name), str(family), bundles_dir, template)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    rel = Path(os.path.relpath(folder, Path.cwd()))
    train = train_command(folder, "train.json", "tiny.json")
    verify = ["python", os.path.relpath(Path(__file__).with_name("verify_bundle.py"), Path.cwd()), str(rel)]
    print(f"made {rel}")
    print(f"verify it: {shlex.join(verify)}")
    print(
        f"train its tiny profile on its demo data: {shlex.join([*train, '--output_dir', str(rel / 'outputs' / 'tiny')])}"
    )


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    fire.Fire(main)

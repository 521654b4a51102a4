# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Check bundles for missing files, invalid configs or metadata, missing config ids, and (unless ``--quick True``)
that their networks instantiate with ``configs/tiny.json`` and honour the metadata's input/output format.

Prints one line per problem (``bundles/<name>: <problem>``), ``OK: <name>`` for each clean bundle, and exits
with status 1 when any problem was found. Example::

    python scripts/verify_bundle.py                      # every bundle under bundles/
    python scripts/verify_bundle.py autoencoder_3d --quick True
    python scripts/verify_bundle.py /tmp/unpacked/autoencoder_3d
"""

from __future__ import annotations

import sys

from common.bundle_tools.verify import verify_bundles

__all__ = ["main"]


def main(*names: str, bundles_dir: str | None = None, quick: bool = False, device: str = "cpu", n: int = 4) -> None:
    """Verify bundles and exit with status 1 when any has a problem.

    Args:
        names: bundle names under ``bundles_dir`` or paths to bundle folders; all bundles when none is given.
        bundles_dir: the folder holding the bundles (default: ``bundles/`` of this repository).
        quick: only the static checks (files, syntax, metadata, config ids); no network is built.
        device: device for building and running the networks.
        n: value of ``n`` in the metadata spatial shapes of the test input (``"4*n"`` gives 16 with 4).
    """
    lines, status = verify_bundles([str(name) for name in names], bundles_dir, quick=bool(quick), device=device, n=n)
    print("\n".join(lines), flush=True)
    sys.exit(status)


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    fire.Fire(main)

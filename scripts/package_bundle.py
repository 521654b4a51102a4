# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Package a bundle with its trained weights into a standalone, reproducible ``<name>_v<version>.zip``.

Prints the zip's path and sha256 (give the hash to ``scripts/download_bundle.py --hash_val``). Exits with status 1
and a one-line error for a missing bundle or checkpoint, a corrupt or pickled checkpoint, or a version without a
changelog entry. Example::

    python scripts/package_bundle.py autoencoder_3d --ckpt runs/ae/models/model.pt --output dist
    python scripts/package_bundle.py autoencoder_3d --ckpt runs/ae/models/model.pt \\
        --url https://example.org/autoencoder_3d/model.pt --version 0.1.0
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.bundle_tools.package import default_checkpoint, file_hash, package_bundle  # noqa: E402
from common.checkpoint_io import CheckpointError  # noqa: E402

__all__ = ["main"]


def main(
    bundle: str, ckpt: str | None = None, output: str = "dist", url: str | None = None, version: str | None = None
) -> None:
    """Write ``<output>/<name>_v<version>.zip`` and print its path and sha256.

    Args:
        bundle: a bundle name under ``bundles/`` or a bundle folder.
        ckpt: the weights to ship as ``models/model.pt``; default: what the bundle's ``configs/inference.json``
            loads (``<output_dir>/models/model.pt`` or ``<bundle>/models/model.pt``).
        output: a folder (receives ``<name>_v<version>.zip``) or a path ending in ``.zip``.
        url: download URL of the weights recorded in ``large_files.yml`` (empty when omitted: they ship in the zip).
        version: the version being released; must equal ``version`` in ``configs/metadata.json``.
    """
    try:
        weights = Path(ckpt) if ckpt is not None else default_checkpoint(str(bundle))
        zip_path = package_bundle(
            str(bundle), weights, output, url=url, version=None if version is None else str(version)
        )
    except (FileNotFoundError, ValueError, CheckpointError) as e:
        print(f"package_bundle: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {zip_path}")
    print(f"sha256 {file_hash(zip_path, 'sha256')}")


if __name__ == "__main__":
    import fire

    fire.Fire(main)

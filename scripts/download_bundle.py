# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Download a bundle zip with MONAI's downloader and extract it safely.

Unlike ``python -m monai.bundle download``, the archive is checked before anything is written: members with
absolute paths, ``..``, backslashes, symbolic links or outside a single ``<name>/`` folder are refused and nothing
is written to ``--bundle_dir``. The zip's hash is checked when ``--hash_val`` is given, and the hashes in the
bundle's ``large_files.yml`` are checked before the bundle folder appears. Exits with status 1 and a one-line
error on any refusal. Example::

    python scripts/download_bundle.py --url https://example.org/autoencoder_3d_v0.1.0.zip \\
        --name autoencoder_3d --bundle_dir bundles_downloaded --hash_val <sha256 printed by package_bundle.py>
"""

from __future__ import annotations

import logging
import sys

from monai.apps.utils import HashCheckError

from common.bundle_tools.package import LargeFileError, UnsafeArchiveError, download_bundle

__all__ = ["main"]


def main(
    url: str,
    bundle_dir: str = ".",
    name: str | None = None,
    hash_val: str | None = None,
    hash_type: str = "sha256",
    overwrite: bool = False,
    progress: bool = True,
) -> None:
    """Download ``url`` into ``<bundle_dir>/<name>/`` and print the folder.

    Args:
        url: the bundle zip's URL (``https://``, ``http://``, ``file://``).
        bundle_dir: the folder receiving the bundle folder.
        name: the expected bundle name (the zip's top folder); any single top folder when omitted.
        hash_val: the zip's expected hash (printed by ``scripts/package_bundle.py``).
        hash_type: algorithm of ``hash_val`` (``sha256``, ``sha512``, ``sha1`` or ``md5``).
        overwrite: replace an existing ``<bundle_dir>/<name>/``.
        progress: show a progress bar.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if hash_val is not None and not isinstance(hash_val, str):
        print(f"download_bundle: error: pass --hash_val as a quoted string, got {hash_val!r}.", file=sys.stderr)
        sys.exit(1)
    try:
        bundle = download_bundle(
            str(url),
            bundle_dir,
            name=None if name is None else str(name),
            hash_val=hash_val,
            hash_type=hash_type,
            overwrite=bool(overwrite),
            progress=bool(progress),
        )
    except (UnsafeArchiveError, LargeFileError, HashCheckError, FileExistsError, ValueError, OSError) as e:
        print(f"download_bundle: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"bundle {bundle}")
    print(f"run it: cd {bundle} && python -m monai.bundle run --config_file configs/inference.json --dataset_dir <dir>")


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    fire.Fire(main)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Package a bundle with its trained weights into a standalone, reproducible ``<name>_v<version>.zip``.

Prints the zip's path and sha256 (give the hash to ``scripts/download_bundle.py --hash_val``). The package's
configs carry the settings the weights were trained with (recorded in the checkpoint by training). Exits with
status 1 and an ``error:`` line for a missing bundle or checkpoint, a corrupt or pickled checkpoint, weights that do
not fit the package's configs, no ``--url`` (unless ``--weights_inside True``), or a version without a changelog
entry; nothing is written then. Example::

    python scripts/package_bundle.py autoencoder_3d --ckpt runs/ae/models/model.pt --output dist --weights_inside True
    python scripts/package_bundle.py autoencoder_3d --ckpt runs/ae/models/model.pt \\
        --url https://huggingface.co/<org>/autoencoder_3d/resolve/main/models/model.pt --version 0.1.0
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.bundle_tools.package import default_checkpoint, file_hash, hf_layout_dir, package_bundle

__all__ = ["main"]


def main(
    bundle: str,
    ckpt: str | None = None,
    output: str = "dist",
    url: str | None = None,
    version: str | None = None,
    weights_inside: bool = False,
    hf_repo: str | None = None,
) -> None:
    """Write ``<output>/<name>_v<version>.zip`` and print its path and sha256.

    Args:
        bundle: a bundle name under ``bundles/`` or a bundle folder.
        ckpt: the weights to ship as ``models/model.pt``; default: what the bundle's ``configs/inference.json``
            loads (``<output_dir>/models/model.pt`` or ``<bundle>/models/model.pt``).
        output: a folder (receives ``<name>_v<version>.zip``) or a path ending in ``.zip``.
        url: where the weights are hosted (``https://...``), recorded in ``large_files.yml``.
        version: the version being released; must equal ``version`` in ``configs/metadata.json``.
        weights_inside: the zip is what is distributed, weights inside (``large_files.yml`` lists them with
            ``url: ""``); required when no ``url`` is given.
        hf_repo: the Hugging Face model repository (``owner/name``) that will host it: the weights' url is its
            address, and ``<output>/<name>_v<version>_hf/<name>/`` is the repository laid out, with the commands
            to upload and download it printed.
    """
    if weights_inside not in (True, False):
        print(
            f"package_bundle: error: --weights_inside must be True or False, got {weights_inside!r}.", file=sys.stderr
        )
        sys.exit(1)
    try:
        weights = Path(ckpt) if ckpt is not None else default_checkpoint(str(bundle))
        zip_path = package_bundle(
            str(bundle),
            weights,
            output,
            url=url,
            version=None if version is None else str(version),
            weights_inside=weights_inside,
            hf_repo=None if hf_repo is None else str(hf_repo),
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"package_bundle: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {zip_path}")
    print(f"sha256 {file_hash(zip_path, 'sha256')}")
    if hf_repo is not None:
        name, version = zip_path.stem.rsplit("_v", 1)
        layout = hf_layout_dir(zip_path)
        print(f"Hugging Face repository {hf_repo} laid out in {layout / name}")
        print(
            f"upload: python -m monai.bundle push_to_hf_hub --repo {hf_repo} --name {name} --bundle_dir {layout} "
            f"--version {version} --tag_as_latest_version True"
        )
        print(f"download: python -m monai.bundle download --source huggingface_hub --repo {hf_repo} --name {name}")


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    fire.Fire(main)

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Running bundles in subprocesses the way users do (``python -m monai.bundle run ...``, ``torchrun``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from http.server import SimpleHTTPRequestHandler
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.networks.nets import AutoencoderKL, PatchDiscriminator

from common.bundle import BUNDLES_DIR as BUNDLES
from common.bundle import ROOT as REPO_ROOT

SCHEMA = REPO_ROOT / "tests" / "data" / "meta_schema_20240725.json"


SEED_VARIABLE = "BUNDLE_TEST_SEED"


def seed_offset() -> int:
    """The shift of every seed the bundle, notebook and benchmark tests use: the integer in ``BUNDLE_TEST_SEED``
    (default 0). Running the suite with other values shows that no test depends on one particular random draw.

    Raises:
        ValueError: when the variable is not an integer.
    """
    text = os.environ.get(SEED_VARIABLE, "0").strip() or "0"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{SEED_VARIABLE} must be an integer (a shift of every test seed), got {text!r}.") from None


def shifted_seed(seed: int = 0) -> int:
    """``seed`` shifted by :func:`seed_offset`: the seed of a test's data generator, network or bundle run."""
    return int(seed) + seed_offset()


def suite_threads() -> str:
    """Threads per test process: ``OMP_NUM_THREADS`` as the suite was started with (default 1)."""
    return os.environ.get("OMP_NUM_THREADS") or "1"


def bundle_env(**extra: str) -> dict[str, str]:
    """Environment of a bundle subprocess: repository importable, the suite's thread count (``OMP_NUM_THREADS``,
    default 1) and seed shift (``BUNDLE_TEST_SEED``) passed on."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update({"OMP_NUM_THREADS": suite_threads(), "MKL_NUM_THREADS": suite_threads(), "PYTHONWARNINGS": "ignore"})
    env.update(extra)
    return env


STANDALONE_PYTHON = (sys.executable, "-S")
"""The interpreter of a standalone run: without ``site``, so no ``.pth`` file (the editable install of this
repository included) makes ``common`` importable; :func:`standalone_env` puts the installed packages back."""


def standalone_env() -> dict[str, str]:
    """Environment of a :data:`STANDALONE_PYTHON` subprocess: the installed packages (site-packages, without their
    ``.pth`` files) importable, nothing of this repository, one thread."""
    import site

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    installed = [*site.getsitepackages(), site.getusersitepackages()]
    env.update(PYTHONPATH=os.pathsep.join(installed), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.update(PYTHONWARNINGS="ignore")
    return env


def _config_paths(bundle: str, names: Sequence[str]) -> list[Path]:
    return [Path(name) if os.path.isabs(name) else BUNDLES / bundle / "configs" / name for name in names]


def seed_args(bundle: str, configs: Sequence[str], args: Sequence[str] = ()) -> list[str]:
    """``["--seed", N]`` for a run of ``configs`` whose ``seed`` is shifted by ``BUNDLE_TEST_SEED``: the seed the
    merged configs define plus the shift. Empty without a shift, when ``args`` already set the seed, or when no
    config defines ``seed`` (the bundle refuses unknown ids)."""
    if not seed_offset() or "--seed" in args:
        return []
    seeds = [
        config["seed"]
        for config in (
            json.loads(path.read_text()) for path in _config_paths(bundle, configs) if path.suffix == ".json"
        )
        if isinstance(config.get("seed"), int) and not isinstance(config.get("seed"), bool)
    ]
    return ["--seed", str(shifted_seed(seeds[-1]))] if seeds else []


def config_arg(bundle: str, *names: str) -> str:
    """The ``--config_file`` value for one or several (merged) configs of ``bundle`` (absolute paths kept)."""
    paths = [str(path) for path in _config_paths(bundle, names)]
    return paths[0] if len(paths) == 1 else json.dumps(paths)


def overrides(**kwargs) -> list[str]:
    """``--key value`` pairs as fire parses them back (lists as JSON, booleans as ``True``/``False``)."""
    args = []
    for key, value in kwargs.items():
        if isinstance(value, bool):
            text = str(value)  # fire reads True/False as booleans, true/false as strings
        else:
            text = value if isinstance(value, str) else json.dumps(value)
        args += [f"--{key}", text]
    return args


def rank_probe(bundle: str, path: Path, saved: str, folder: str = "@output_dir") -> Path:
    """Write ``path``: a config whose ``finalize`` saves ``saved`` (a config expression of a dict) to
    ``<folder>/rank<R>.pt`` on each rank, then runs the bundle's own multi-GPU ``finalize`` (replica check, writer
    closed, process group torn down), so a test ends its processes as a user's run does."""
    finalize = json.loads((BUNDLES / bundle / "configs" / "multi_gpu_train.json").read_text())["finalize"]
    save = f"$torch.save({saved}, {folder} + '/rank' + str(torch.distributed.get_rank()) + '.pt')"
    path.write_text(json.dumps({"finalize": [save, *finalize]}))
    return path


def run_bundle(
    bundle: str,
    configs: Sequence[str],
    run_id: str = "training",
    args: Sequence[str] = (),
    timeout: float = 600,
    check: bool = True,
    env: dict[str, str] | None = None,
    processes: int = 1,
) -> subprocess.CompletedProcess:
    """``python -m monai.bundle run <run_id> --config_file ... <args>`` from the repository root (with the shifted
    seed of :func:`seed_args`), under ``torchrun`` (:func:`torchrun_cmd`) with several ``processes``."""
    module_args = ["-m", "monai.bundle", "run", run_id, "--config_file", config_arg(bundle, *configs), *args]
    cmd = torchrun_cmd(processes, *module_args) if processes > 1 else [sys.executable, *module_args]
    cmd += seed_args(bundle, configs, args)
    result = subprocess.run(
        cmd, cwd=REPO_ROOT, env=env or bundle_env(), capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
            f"\nfirst error lines:\n{_error_lines(result.stderr)}"
        )
    return result


def _error_lines(text: str, limit: int = 20) -> str:
    """The first lines of ``text`` that report an error (a rank's exception, a C++ abort), which a torchrun
    failure's closing summary pushes out of the tail."""
    marks = ("Error", "error:", "terminate called", "what():", "Abort", "Fatal")
    lines = [line for line in text.splitlines() if any(m in line for m in marks) and "errors/__init__" not in line]
    return "\n".join(lines[:limit]) or "(none)"


_ZOO_CHECKS = """
import json, os, shutil, sys
import torch
from monai.bundle import ConfigWorkflow, ckpt_export, verify_metadata, verify_net_in_out

bundle, kinds, extra, overrides, shape, net_id = sys.argv[1], *map(json.loads, sys.argv[2:6]), sys.argv[7]
configs = os.path.join(bundle, "configs")
meta = os.path.join(configs, "metadata.json")
extra = [os.path.join(configs, f) for f in extra]
# verify_metadata downloads the schema named in metadata.json unless the file is there (no network in tests)
schema = os.path.join(bundle, "eval", "schema.json")
os.makedirs(os.path.dirname(schema), exist_ok=True)
shutil.copy(sys.argv[6], schema)
verify_metadata(meta_file=meta, filepath=schema)
print("metadata verified", flush=True)
files = {"train": "train.json", "infer": "inference.json"}
for kind in kinds:
    config = [os.path.join(configs, files[kind]), *extra]
    workflow = ConfigWorkflow(config_file=config, meta_file=meta, workflow_type=kind, bundle_root=bundle, **overrides)
    workflow.initialize()
    problems = workflow.check_properties()
    assert not problems, (kind, problems)
    print(kind, "properties verified", flush=True)
if shape is not None:
    inference = [os.path.join(configs, "inference.json"), *extra]
    verify_net_in_out(net_id=net_id, meta_file=meta, config_file=inference, bundle_root=bundle, n=1, any=1,
                      **overrides)
    print("net in out verified", flush=True)
    # the shipped weights load into the network, which exports to TorchScript by tracing (not by scripting)
    target = os.path.join(bundle, "models", "verify_model.ts")
    ckpt_export(net_id=net_id, filepath=target, ckpt_file=os.path.join(bundle, "models", "model.pt"),
                meta_file=meta, config_file=inference, bundle_root=bundle, use_trace=True, input_shape=shape,
                **overrides)
    torch.jit.load(target)
    print("torchscript verified", flush=True)
"""


def model_zoo_checks(
    bundle_dir: Path,
    kinds: Sequence[str],
    extra_configs: Sequence[str] = (),
    overrides: dict | None = None,
    shape: Sequence[int] | None = None,
    standalone: bool = False,
    net_id: str = "network_def",
) -> list[str]:
    """Run the checks of the MONAI model zoo's CI (``ci/verify_bundle.py``) on ``bundle_dir`` in a subprocess:
    ``verify_metadata`` (against the schema copy), then for each of ``kinds`` (``train``, ``infer``) the workflow
    built from ``train.json``/``inference.json`` + ``extra_configs`` with ``overrides``, initialised, and its
    ``check_properties()``; with ``shape``, ``verify_net_in_out`` on ``net_id`` (the zoo's ``network_def``; the zoo
    excludes generative bundles from this check, which name their documented entry point instead) and
    ``ckpt_export`` by tracing of the bundle's ``models/model.pt`` into ``net_id``. Returns the lines it printed (one
    per passed check). ``standalone``: with :data:`STANDALONE_PYTHON` (nothing of this repository importable).
    """
    overrides = {"device": "cpu", **(overrides or {})}
    args = [json.dumps(list(kinds)), json.dumps(list(extra_configs)), json.dumps(overrides), json.dumps(shape)]
    python = STANDALONE_PYTHON if standalone else (sys.executable,)
    cmd = [*python, "-c", _ZOO_CHECKS, str(bundle_dir), *args, str(SCHEMA), net_id]
    env = standalone_env() if standalone else bundle_env()
    result = subprocess.run(cmd, cwd=bundle_dir, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{bundle_dir}: {result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return [line for line in result.stdout.splitlines() if line.endswith(" verified")]


def model_zoo_train_properties(bundle: str, extra_configs: Sequence[str], overrides: dict, work_dir: Path) -> list[str]:
    """:func:`model_zoo_checks` of the metadata and the ``train`` workflow of a copy of ``bundle``'s configs in
    ``work_dir`` (the checks write ``eval/schema.json`` into the bundle folder)."""
    import shutil

    copy = work_dir / bundle
    shutil.copytree(BUNDLES / bundle / "configs", copy / "configs")
    overrides = {"output_dir": str(work_dir / "outputs"), **overrides}
    return model_zoo_checks(copy, ["train"], extra_configs, overrides)


def edited_pipeline_configs(
    folder: Path, keys: Sequence[str] = ("image",), sample: str = "[0][0]['image']"
) -> tuple[Path, Path]:
    """Two config files a user merges after a bundle's train.json: ``noise.json`` appends ``RandGaussianNoised`` of
    ``keys`` to ``train#augmentation`` (MONAI's ``+`` merge of lists) and replaces ``train#dataset`` by a
    ``CacheDataset``; ``probe.json`` saves, at ``finalize``, what the trainer used to ``<output_dir>/probe.pt``
    (dataset type, transforms, ``sample`` of the dataset - by default the image of the first crop of the first item -,
    the iteration)."""
    edit, probe = folder / "noise.json", folder / "probe.json"
    noise = {"_target_": "RandGaussianNoised", "keys": list(keys), "prob": 1.0, "std": 0.1}
    dataset = {
        "_target_": "CacheDataset",
        "data": "@train#data",
        "transform": "@train#preprocessing",
        "cache_rate": "@cache_rate",
        "num_workers": 1,
        "progress": False,
    }
    edit.write_text(json.dumps({"+train#augmentation": [noise], "train#dataset": dataset}))
    used = "@train#trainer.data_loader.dataset.dataset"  # the loader wraps the dataset for seeded augmentation
    record = (
        f"$torch.save({{'type': type({used}).__name__, 'transforms': [type(t).__name__ for t in "
        f"{used}.transform.transforms], 'sample': {used}{sample}.detach().cpu().numpy().tolist(), "
        "'iteration': @train#trainer.state.iteration}, @output_dir + '/probe.pt')"
    )
    probe.write_text(json.dumps({"finalize": [record]}))
    return edit, probe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(nproc: int, *module_args: str) -> list[str]:
    """A single-node ``torchrun`` command on a free loopback port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--nnodes=1",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        *module_args,
    ]


def tiny_autoencoder(seed: int | None = 0, channels: Sequence[int] = (8, 16)) -> AutoencoderKL:
    """A 2-level AutoencoderKL (2x downsampling, no attention) small enough for CPU unit tests."""
    if seed is not None:
        torch.manual_seed(seed)
    return AutoencoderKL(
        spatial_dims=3,
        in_channels=1,
        out_channels=1,
        channels=tuple(channels),
        latent_channels=2,
        num_res_blocks=1,
        norm_num_groups=4,
        attention_levels=(False, False),
        with_encoder_nonlocal_attn=False,
        with_decoder_nonlocal_attn=False,
    )


def tiny_discriminator(seed: int | None = 1) -> PatchDiscriminator:
    """A 2-layer PatchDiscriminator for 16^3 inputs."""
    if seed is not None:
        torch.manual_seed(seed)
    return PatchDiscriminator(spatial_dims=3, channels=8, in_channels=1, num_layers_d=2)


#: the tiny X-ray -> CT denoiser of the CPU unit tests (16^2 views, two U-Net levels, one ViT layer)
TINY_XRAY_NETWORK = {
    "unet_channels": (8, 16),
    "attention_levels": (False, True),
    "norm_num_groups": 4,
    "num_head_channels": 8,
    "vit_patch_size": 8,
    "vit_hidden_size": 16,
    "vit_mlp_dim": 32,
    "vit_layers": 1,
    "vit_heads": 2,
}


def xray_projector(view_size=(16, 16)):
    """A DRR projector over an anisotropic field of view (so the two views differ in their path lengths)."""
    from common.xray2ct.drr import DRRProjector

    return DRRProjector(fov_mm=(160.0, 200.0, 240.0), view_size=view_size)


def randomise_zero_parameters(network: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give the zero-initialised tensors (MONAI's U-Net output convolution, whose zeros make every fresh denoiser
    output 0 whatever its other weights) seeded random values, so outputs and gradients depend on all weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return network


def tiny_xray_denoiser(seed: int = 0, with_previous: bool = False, **kwargs):
    """A seeded tiny ``XrayCTDenoiser`` (see :func:`randomise_zero_parameters`)."""
    from common.xray2ct.networks import XrayCTDenoiser

    torch.manual_seed(seed)
    net = XrayCTDenoiser(xray_projector(), with_previous=with_previous, **{**TINY_XRAY_NETWORK, **kwargs})
    return randomise_zero_parameters(net, seed)


def _rotation(z: float, x: float) -> np.ndarray:
    cz, sz, cx, sx = np.cos(z), np.sin(z), np.cos(x), np.sin(x)
    return np.array([[cz, -sz, 0.0], [sz, cz, 0.0], [0.0, 0.0, 1.0]]) @ np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])


#: a tilted LPS direction (0.3 rad about z, 0.2 rad about x) and an anisotropic voxel size for the ITK format tests
TILTED_DIRECTION = _rotation(0.3, 0.2)
ANISOTROPIC_SPACING = (0.7, 0.9, 2.5)


def write_itk_volume(path, array, spacing=ANISOTROPIC_SPACING, origin=(-10.0, 20.0, 30.0), direction=TILTED_DIRECTION):
    """Write an ``(X, Y, Z)`` array with ITK (format from the suffix: ``.nrrd``, ``.nhdr``, ``.mha``, ``.mhd``...) in
    ITK's LPS world coordinates with the given voxel size, origin and direction."""
    import itk

    image = itk.image_from_array(np.ascontiguousarray(np.asarray(array).transpose(2, 1, 0)))
    image.SetSpacing([float(s) for s in spacing])
    image.SetOrigin([float(o) for o in origin])
    image.SetDirection(itk.matrix_from_array(np.asarray(direction, dtype=np.float64)))
    itk.imwrite(image, str(path))
    return Path(path)


def write_tilted_dicom_series(
    folder, array, spacing=ANISOTROPIC_SPACING, origin=(-10.0, 20.0, 30.0), direction=TILTED_DIRECTION, suffix=""
):
    """Write an ``(X, Y, Z)`` array (rounded to int16) as a DICOM series with ITK's GDCM writer, one file per slice
    (``IM0000<suffix>``, ...): LPS slice positions ``origin + k * spacing[2] * direction[:, 2]`` and the row and
    column cosines of ``direction``."""
    import itk

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    direction = np.asarray(direction, dtype=np.float64)
    slices = np.round(np.asarray(array)).astype(np.int16).transpose(2, 1, 0)
    cosines = "\\".join(f"{c:.7f}" for c in [*direction[:, 0], *direction[:, 1]])
    for k in range(slices.shape[0]):
        image = itk.image_from_array(np.ascontiguousarray(slices[k]))
        image.SetSpacing([float(spacing[0]), float(spacing[1])])
        position = np.asarray(origin, dtype=np.float64) + k * float(spacing[2]) * direction[:, 2]
        meta = image.GetMetaDataDictionary()
        for tag, value in {
            "0008|0060": "CT",
            "0020|000e": "1.2.826.0.1.3680043.8.498.77",
            "0020|0013": str(k + 1),
            "0020|0032": "\\".join(f"{p:.6f}" for p in position),
            "0020|0037": cosines,
            "0018|0050": f"{float(spacing[2]):.6f}",
        }.items():
            meta[tag] = value
        io = itk.GDCMImageIO.New()
        io.KeepOriginalUIDOn()
        itk.ImageFileWriter.New(Input=image, FileName=str(folder / f"IM{k:04d}{suffix}"), ImageIO=io).Update()
    return folder


def itk_ras_affine(path):
    """The voxel-to-world affine of an image (file or DICOM series folder) as ITK reads it, converted from ITK's
    LPS to RAS (the convention of NIfTI and MONAI): ``diag(-1, -1, 1) @ direction @ diag(spacing)``, origin too."""
    import itk

    image = itk.imread(str(path))
    affine = np.eye(4)
    affine[:3, :3] = itk.array_from_matrix(image.GetDirection()) @ np.diag(np.asarray(image.GetSpacing()))
    affine[:3, 3] = np.asarray(image.GetOrigin())
    return np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine


def write_format_cases(root, array) -> dict[str, Path]:
    """The same ``(X, Y, Z)`` array (integers: DICOM stores int16) as an NRRD file, a MetaImage file and a DICOM
    series folder under ``root``, tilted and anisotropic (:data:`TILTED_DIRECTION`, :data:`ANISOTROPIC_SPACING`);
    case id -> path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {
        "nrrd_case": write_itk_volume(root / "nrrd_case.nrrd", array),
        "mha_case": write_itk_volume(root / "mha_case.mha", array),
        "dicom_case": write_tilted_dicom_series(root / "dicom_case", array),
    }


def check_restored_volume(saved_path, source_path, expected) -> None:
    """``saved_path`` (NIfTI) has the voxel grid of ``source_path`` as ITK reads it (the same world point for every
    voxel, LPS converted to RAS) and the values ``expected`` (``(X, Y, Z)``)."""
    import nibabel as nib

    saved = nib.load(str(saved_path))
    assert saved.shape == expected.shape, (saved.shape, expected.shape)
    np.testing.assert_allclose(saved.affine, itk_ras_affine(source_path), atol=1e-4)
    np.testing.assert_allclose(np.asarray(saved.dataobj), expected, rtol=1e-5, atol=1e-3)


def check_json_training_dataset(
    parser: Any, training: Sequence[Mapping], rates: Mapping, key: str = "image"
) -> tuple[Any, Any]:
    """Check that a bundle's ``train#dataset`` caches the entries ``make_dataset`` caches from ``training`` with the
    same ``rates``, in its order (the loader's epoch order and seeded augmentation follow the dataset's positions): a
    ``SmartCacheDataset`` of every entry in datalist order by default, of a seeded random ``cache_rate`` share with
    ``cache_rate`` < 1. Entries are compared by ``key``; returns the dataset and ``make_dataset``'s."""
    from monai.data import CacheDataset, SmartCacheDataset

    from tests.oracles import make_dataset

    train = parser.get_parsed_content("train#dataset")
    transform = parser.get_parsed_content("train#preprocessing")
    rate = {"cache_rate": 1.0, "replace_rate": parser.get_parsed_content("replace_rate"), **rates}
    expected = make_dataset(training, transform, **rate, partition=False, seed=parser["seed"])
    assert isinstance(train, SmartCacheDataset) and type(expected) is (SmartCacheDataset if rates else CacheDataset)
    assert [d[key] for d in train.data] == [d[key] for d in expected.data]
    assert len(train) == len(expected) == max(1, int(len(training) * rate["cache_rate"]))
    if not rates:
        assert [d[key] for d in train.data] == [d[key] for d in training]
    return train, expected


def bundle_parser(bundle: str, configs: Sequence[str], **settings: Any) -> Any:
    """``bundle``'s config files ``configs`` (names in its ``configs`` folder, or paths), merged in order and parsed
    in this process on the CPU with ``settings`` set."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(BUNDLES / bundle / "configs" / name) for name in configs])
    for key, value in {"bundle_root": str(BUNDLES / bundle), "device": "cpu", **settings}.items():
        parser[key] = value
    return parser


def same_tensor(a: Any, b: Any) -> None:
    """``a`` and ``b`` are the same tensor: type, dtype, device and values, and for MetaTensors also the affine, the
    ``case_id`` and the classes of the applied operations (so that ``Invertd`` undoes the same steps)."""
    assert type(a) is type(b) and a.dtype == b.dtype and a.device == b.device
    assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if hasattr(a, "meta"):
        assert torch.equal(a.affine, b.affine) and a.meta.get("case_id") == b.meta.get("case_id")
        assert [op["class"] for op in a.applied_operations] == [op["class"] for op in b.applied_operations]


def same_seeded_outputs(
    transform: Any, expected: Any, item: Mapping, keys: Sequence[str] = ("image",), seeds: Sequence[int] = (0, 1)
) -> None:
    """A random ``transform`` chain and its oracle ``expected`` give the same items (or lists of crops) of ``item``
    under each of ``seeds``: the same count, the same keys, the same tensors under ``keys`` (:func:`same_tensor`)."""
    for seed in seeds:
        transform.set_random_state(seed), expected.set_random_state(seed)
        got, want = transform(dict(item)), expected(dict(item))
        got, want = (got, want) if isinstance(got, list) else ([got], [want])
        assert len(got) == len(want) and len(got) > 0, (seed, len(got), len(want))
        for a, b in zip(got, want):
            assert set(a) == set(b), (seed, sorted(a), sorted(b))
            for key in keys:
                same_tensor(a[key], b[key])


# Calls that make the host wait for a GPU when their tensor lives there: reading a value back (item, bool, float,
# tolist, ...), data-dependent shapes (nonzero, masked_select, boolean-mask indexing) and CPU tensors made inside a
# step (``torch.tensor``, ``Tensor.type``) that a blocking copy then moves to the device. On the CPU they cost
# nothing, but recording where they are called shows what a GPU step would wait for.
HOST_SYNC_CALLS = frozenset(
    ("item", "__bool__", "__float__", "__int__", "tolist", "numpy", "cpu", "nonzero", "argwhere", "masked_select")
    + ("unique", "unique_consecutive", "tensor", "type")
)
# The host reads a training step is documented to make, as "file:function" of the calling line: the non-finite
# guard reads one flag per optimizer step; the EMA's update count is a CPU tensor (reading it waits for no device).
DOCUMENTED_HOST_READS = frozenset(("common/engines/trainer.py:_finite_or_skip", "common/handlers/ema.py:update"))


class HostSyncRecorder:
    """A ``TorchFunctionMode`` context that counts, while ``active``, the calls of :data:`HOST_SYNC_CALLS` (and
    boolean-mask indexing) by "file:function" of the calling line outside torch (``sites``)."""

    def __init__(self, active: bool = True) -> None:
        import collections

        self.active = active
        self.sites: collections.Counter = collections.Counter()

    def __enter__(self) -> HostSyncRecorder:
        import traceback

        from torch.overrides import TorchFunctionMode

        torch_dir, recorder = str(Path(torch.__file__).parent), self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                mask = name == "__getitem__" and len(args) > 1 and getattr(args[1], "dtype", None) == torch.bool
                if recorder.active and (name in HOST_SYNC_CALLS or mask):
                    caller = traceback.extract_stack(limit=2)[0]
                    if not caller.filename.startswith(torch_dir):
                        path = Path(caller.filename)
                        rel = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else Path(*path.parts[-2:])
                        recorder.sites[f"{rel.as_posix()}:{caller.name}"] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def host_sync_sites(trainer: Any, first: int, last: int) -> dict[str, int]:
    """Run ``trainer`` and count, by "file:function" of the calling line (outside torch), the calls of
    :data:`HOST_SYNC_CALLS` made from iteration ``first`` to ``last`` (the step and the per-iteration handlers)."""
    from ignite.engine import Events

    recorder = HostSyncRecorder(active=False)
    trainer.add_event_handler(
        Events.ITERATION_STARTED, lambda e: setattr(recorder, "active", first <= e.state.iteration <= last)
    )
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: setattr(recorder, "active", False))
    with recorder:
        trainer.run()
    return dict(recorder.sites)


def bundle_workflow(bundle: str, configs: Sequence[str], work_dir: Path, iterations: int, **settings: Any) -> Any:
    """The initialised training workflow of ``bundle`` (``configs`` merged onto ``train.json``) for ``iterations``
    epochs of one iteration each, validation and checkpoints out of reach; on the CPU without autocast unless
    ``settings`` say otherwise (``device``, ``amp``: the GPU tests; ``max_epochs``, ``epoch_length``)."""
    from monai.bundle import ConfigWorkflow

    files = [str(BUNDLES / bundle / "configs" / name) for name in ("train.json", *configs)]
    run = {"output_dir": str(work_dir), "max_epochs": iterations, "epoch_length": 1, "val_interval": 10**6}
    run |= {"ckpt_interval": 10**6, "log_interval": 10**6, "resume": False, "device": "cpu", "amp": "none"}
    workflow = ConfigWorkflow(config_file=files, workflow_type="train", **{**run, **settings})
    workflow.initialize()
    return workflow


def bundle_trainer(bundle: str, configs: Sequence[str], work_dir: Path, iterations: int, **settings: Any) -> Any:
    """``train#trainer`` of :func:`bundle_workflow`."""
    return bundle_workflow(bundle, configs, work_dir, iterations, **settings).parser.get_parsed_content("train#trainer")


def undocumented_host_syncs(bundle: str, configs: Sequence[str], work_dir: Path, **settings: Any) -> dict[str, int]:
    """The calls of :data:`HOST_SYNC_CALLS` in training iterations 2-5 of ``bundle`` (:func:`bundle_trainer`) whose
    calling function is not one of :data:`DOCUMENTED_HOST_READS`: what a GPU training step would wait for beyond
    the documented reads."""
    sites = host_sync_sites(bundle_trainer(bundle, configs, work_dir, 5, **settings), 2, 5)
    return {site: n for site, n in sites.items() if site not in DOCUMENTED_HOST_READS}


def check_tracked_training_loss(bundle: str, configs: Sequence[str], work_dir: Path, **settings: Any) -> None:
    """What ``--tracking mlflow`` logs of ``bundle``'s training iteration (MONAI's default trainer
    ``output_transform``, ``from_engine(["loss"], first=True)``, on the output of one iteration of
    :func:`bundle_trainer`) is one finite number: the output must be one dict per sample (a dict of the batch gives
    a tuple, which MLflow refuses)."""
    import monai
    from monai.bundle.utils import DEFAULT_MLFLOW_SETTINGS

    trainer = bundle_trainer(bundle, configs, work_dir, 1, **settings)
    trainer.run()
    output_transform = DEFAULT_MLFLOW_SETTINGS["configs"]["trainer"]["output_transform"]
    loss = eval(output_transform[1:], {"monai": monai})(trainer.state.output)
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and torch.isfinite(loss), f"{bundle}: logs {loss!r}"


class HubHandler(SimpleHTTPRequestHandler):
    """The part of the Hugging Face Hub's HTTP API that ``huggingface_hub.snapshot_download`` (what
    ``monai.bundle download --source huggingface_hub`` calls) uses, serving the model repositories under
    ``self.directory`` (``<owner>/<name>/`` each, one commit, reachable as ``main``, any tag or the commit): refs,
    revision info, the recursive tree, and ``resolve`` with the headers the client reads (``X-Repo-Commit``,
    ``ETag``, ``Content-Length``)."""

    commit = "0" * 40

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the signature of the base class
        pass

    def _files(self, repo: str) -> list[Path]:
        root = Path(self.directory) / repo
        return sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []

    def _send(self, status: int, body: bytes, content_type: str = "application/json", head: bool = False, **headers):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key.replace("_", "-"), value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head: bool) -> None:
        import hashlib
        import urllib.parse

        path = urllib.parse.urlsplit(self.path).path
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 5:
            repo, kind = "/".join(parts[2:4]), parts[4]
            files = self._files(repo)
            if not files:
                return self._send(404, b'{"error": "Repository not found"}', head=head, X_Error_Code="RepoNotFound")
            root = Path(self.directory) / repo
            if kind == "refs":
                ref = {"name": "main", "ref": "refs/heads/main", "targetCommit": self.commit}
                return self._send(200, json.dumps({"branches": [ref], "tags": [], "converts": []}).encode(), head=head)
            if kind == "revision":
                siblings = [{"rfilename": p.relative_to(root).as_posix()} for p in files]
                info = {"id": repo, "modelId": repo, "sha": self.commit, "private": False, "siblings": siblings}
                return self._send(200, json.dumps(info).encode(), head=head)
            if kind == "tree":
                entries = [
                    {
                        "type": "file",
                        "path": p.relative_to(root).as_posix(),
                        "size": p.stat().st_size,
                        "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                    }  # fmt: skip
                    for p in files
                ]
                return self._send(200, json.dumps(entries).encode(), head=head)
        if len(parts) >= 5 and parts[2] == "resolve":
            target = Path(self.directory) / parts[0] / parts[1] / "/".join(parts[4:])
            if target.is_file():
                body = target.read_bytes()
                etag = '"' + hashlib.sha1(body).hexdigest() + '"'
                return self._send(200, body, "application/octet-stream", head, X_Repo_Commit=self.commit, ETag=etag)
            return self._send(404, b'{"error": "Entry not found"}', head=head, X_Error_Code="EntryNotFound")
        return self._send(404, b'{"error": "not found"}', head=head)

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self._route(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(head=True)


def slowed_env(folder: Path, seconds: float) -> dict[str, str]:
    """The environment of a bundle subprocess (:func:`bundle_env`) in which every case an inference run commits is
    followed by ``seconds`` of sleep, so that the run lasts long enough to be killed half-way. The pause is made
    outside the config (a ``sitecustomize`` in ``folder``), so the run's identity is that of the plain command."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import time\n"
        "import common.engines.cases as cases\n"
        "_commit = cases.CaseRun._commit\n"
        "def _slowed(self, *args, **kwargs):\n"
        "    _commit(self, *args, **kwargs)\n"
        f"    time.sleep({float(seconds)!r})\n"
        "cases.CaseRun._commit = _slowed\n"
    )
    env = bundle_env()
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env["PYTHONPATH"]])
    return env


def written_tree(folder: Path) -> dict[str, Any]:
    """Every file of a prediction folder by its path: its bytes, or for a case's record (``.done``) its content less
    where and when its outputs were written (the folder may be a copy, the files of another run), so that two runs
    writing the same outputs from the same inputs compare equal."""
    found: dict[str, Any] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        found[str(path.relative_to(folder))] = path.read_bytes()
        if ".done" in path.relative_to(folder).parts:
            record = json.loads(path.read_text())
            for written in record.get("output_files", []):
                del written["mtime_ns"], written["path"]
            found[str(path.relative_to(folder))] = record
    return found

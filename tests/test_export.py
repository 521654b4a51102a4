# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""TorchScript and ONNX export of every bundle's inference network (``common.bundle_tools.export`` and
``scripts/export_bundle.py``): parity with PyTorch on new inputs, embedded metadata, clear errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from common.bundle import bundle_names
from common.bundle_tools.export import (
    ExportError,
    compare_outputs,
    default_input_shape,
    export_module_onnx,
    export_module_torchscript,
    random_input,
    run_export,
)
from common.checkpoint_io import CheckpointError
from tests.helpers import BUNDLES, REPO_ROOT, bundle_env, shifted_seed

BUNDLE_NAMES = bundle_names()
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def _tiny(bundle: str) -> Path:
    tiny = BUNDLES / bundle / "configs" / "tiny.json"
    assert tiny.is_file(), f"bundle {bundle!r} needs configs/tiny.json (small sizes for CPU tests) to be exported here"
    return tiny


def _reference_network(bundle: str, ckpt: Path | None = None, seed: int = 0) -> nn.Module:
    """The inference network built directly with MONAI's ConfigParser (tiny sizes), random or from ``ckpt``."""
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config([str(BUNDLES / bundle / "configs" / "inference.json"), str(_tiny(bundle))])
    parser["bundle_root"] = str(BUNDLES / bundle)
    if "device" in parser:
        parser["device"] = "cpu"
    torch.manual_seed(seed)
    network = parser.get_parsed_content("network")
    if ckpt is not None:
        network.load_state_dict(torch.load(ckpt, weights_only=True))
    return network.eval()


def _metadata(bundle: str) -> dict:
    return json.loads((BUNDLES / bundle / "configs" / "metadata.json").read_text())


def _new_input(shape, seed: int = 1234) -> torch.Tensor:
    return torch.rand(tuple(shape), generator=torch.Generator().manual_seed(seed))


#: smallest gap between the two nearest codes (squared distances) of every latent vector of a quantizing network's
#: test input. An export's continuous latent differs from PyTorch's by ~1e-6, which moves a difference of squared
#: distances by at most 2 |dz| |e_j - e_k| (~1e-5 here); a gap 100x that keeps every code, so the outputs compare
#: with the continuous tolerance. Inside a smaller gap the export may legitimately pick the other code.
CODE_GAP = 1e-3


def _code_gap(network: nn.Module, x: torch.Tensor) -> float:
    """The smallest top-2 squared-distance gap over the latent vectors of ``x`` (``inf`` without a quantizer)."""
    from common.vqgan.networks import VQGAN

    vqgan = next((m for m in network.modules() if isinstance(m, VQGAN)), None)
    if vqgan is None:
        return float("inf")
    with torch.no_grad():
        z = vqgan.encode(x)
    flat = z.movedim(1, -1).reshape(-1, z.shape[1]).double()
    distances = ((flat[:, None] - vqgan.quantizer.embeddings.double()[None]) ** 2).sum(-1)
    top2 = distances.topk(2, dim=1, largest=False).values
    return float((top2[:, 1] - top2[:, 0]).min())


def _clear_seed(network: nn.Module, inputs, seed: int, tries: int = 100) -> int:
    """The first seed from ``seed`` whose inputs (``inputs(s)``: the tensors drawn with seed ``s``) keep every code
    of ``network`` ``CODE_GAP`` away from a tie; ``seed`` itself for a network without a quantizer."""
    for candidate in range(seed, seed + tries):
        if all(_code_gap(network, x) > CODE_GAP for x in inputs(candidate)):
            return candidate
    raise AssertionError(f"no input seed in [{seed}, {seed + tries}) keeps the codes {CODE_GAP} away from a tie")


def _clear_input(network: nn.Module, shape, seed: int) -> torch.Tensor:
    """``_new_input(shape, s)`` for the first seed ``s >= seed`` clear of code ties (see ``CODE_GAP``)."""
    return _new_input(shape, _clear_seed(network, lambda s: [_new_input(shape, s)], seed))


def _outputs(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in _outputs(v)]
    return [t for v in output for t in _outputs(v)]


@pytest.fixture(scope="module", params=BUNDLE_NAMES)
def exported(request, tmp_path_factory) -> dict:
    """A random-init tiny checkpoint of the bundle's network, exported to TorchScript and ONNX."""
    bundle = request.param
    root = tmp_path_factory.mktemp(f"export_{bundle}")
    ckpt = root / "model.pt"
    network = _reference_network(bundle, seed=shifted_seed(0))
    torch.save(network.state_dict(), ckpt)
    shape = default_input_shape(bundle, overrides=str(_tiny(bundle)))
    # the exporters verify on random_input(seed + 1) in the input's value range (TorchScript: the example shape;
    # ONNX: one more in the batch); a seed whose verification inputs are clear of code ties (see CODE_GAP)
    spec = _metadata(bundle)["network_data_format"]["inputs"]
    value_range = tuple(spec.get("image", next(iter(spec.values()))).get("value_range") or (0.0, 1.0))
    seed = _clear_seed(
        network,
        lambda s: [random_input(c, value_range=value_range, seed=s + 1) for c in (shape, [shape[0] + 1, *shape[1:]])],
        shifted_seed(0),
    )
    ts = run_export("torchscript", bundle, ckpt, root / "model.ts", overrides=str(_tiny(bundle)), seed=seed)
    onnx_result = run_export("onnx", bundle, ckpt, root / "model.onnx", overrides=str(_tiny(bundle)), seed=seed)
    return {"bundle": bundle, "ckpt": ckpt, "root": root, "shape": shape, "ts": ts, "onnx": onnx_result}


def test_default_input_shape_follows_metadata(exported):
    spec = _metadata(exported["bundle"])["network_data_format"]["inputs"]
    spec = spec.get("image", next(iter(spec.values())))
    shape = exported["shape"]
    assert shape[0] == 1 and shape[1] == spec["num_channels"]
    assert len(shape) == 2 + len(spec["spatial_shape"])
    assert exported["ts"].input_shape == exported["onnx"].input_shape == shape


def test_torchscript_matches_pytorch_on_new_input(exported):
    result = exported["ts"]
    assert result.path.is_file() and result.path.stat().st_size > 0
    assert result.method in ("script", "trace")
    assert result.max_abs_diff <= 1e-4 * max(1.0, result.output_scale)
    module = torch.jit.load(str(result.path))
    network = _reference_network(exported["bundle"], exported["ckpt"], seed=shifted_seed(99))  # weights: the file's
    x = _clear_input(network, exported["shape"], shifted_seed(1234))
    with torch.no_grad():
        expected, actual = _outputs(network(x)), _outputs(module(x))
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


def test_torchscript_carries_metadata(exported):
    from monai.data import load_net_with_metadata

    extra = {"metadata.json": "", "inference.json": "", "export.json": ""}
    torch.jit.load(str(exported["ts"].path), _extra_files=extra)
    metadata, expected = json.loads(extra["metadata.json"]), _metadata(exported["bundle"])
    for key in ("name", "version", "network_data_format"):
        assert metadata[key] == expected[key]
    assert "pytorch_version" in metadata and "monai_version" in metadata
    info = json.loads(extra["export.json"])
    assert info["method"] == exported["ts"].method and info["input_shape"] == exported["shape"]
    assert info["bundle"] == exported["bundle"] and info["net_id"] == "network"
    assert "network" in json.loads(extra["inference.json"])
    _, meta, _ = load_net_with_metadata(str(exported["ts"].path))  # MONAI's own reader
    assert meta["version"] == expected["version"]


def test_onnx_matches_pytorch_with_dynamic_batch(exported):
    result = exported["onnx"]
    assert result.path.is_file() and result.method in ("dynamo", "legacy") and result.opset
    onnx.checker.check_model(str(result.path), full_check=True)
    model = onnx.load(str(result.path))
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["metadata.json"])["version"] == _metadata(exported["bundle"])["version"]
    assert json.loads(props["export.json"])["exporter"] == result.method

    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    assert inp.name == "image" or inp.name in _metadata(exported["bundle"])["network_data_format"]["inputs"]
    assert inp.shape[0] == "batch" and list(inp.shape[1:]) == exported["shape"][1:]
    network = _reference_network(exported["bundle"], exported["ckpt"], seed=shifted_seed(99))
    x = _clear_input(network, [3, *exported["shape"][1:]], shifted_seed(4321))  # a batch size not used in exporting
    with torch.no_grad():
        expected = _outputs(network(x))
    actual = session.run(None, {inp.name: x.numpy()})
    assert len(actual) == len(expected)
    for e, a in zip(expected, actual):
        assert a.shape == tuple(e.shape)
        scale = max(1.0, float(e.abs().max()))
        assert float(np.abs(a - e.numpy()).max()) <= 1e-4 * scale


def test_corrupted_or_mismatched_checkpoint_names_the_file(exported, tmp_path):
    bundle, tiny = exported["bundle"], str(_tiny(exported["bundle"]))
    corrupted = tmp_path / "corrupted.pt"
    corrupted.write_bytes(b"definitely not a checkpoint" * 10)
    with pytest.raises(CheckpointError, match=re.escape(str(corrupted))):
        run_export("torchscript", bundle, corrupted, tmp_path / "a.ts", overrides=tiny)

    state = torch.load(exported["ckpt"], weights_only=True)
    state.pop(sorted(state)[-1])  # a checkpoint of a different network: one tensor missing
    mismatched = tmp_path / "mismatched.pt"
    torch.save(state, mismatched)
    with pytest.raises(CheckpointError, match=re.escape(str(mismatched)) + ".*does not fit"):
        run_export("onnx", bundle, mismatched, tmp_path / "b.onnx", overrides=tiny)

    missing = tmp_path / "missing.pt"
    with pytest.raises(CheckpointError, match=re.escape(str(missing))):
        run_export("torchscript", bundle, missing, tmp_path / "c.ts", overrides=tiny)
    assert not any(tmp_path.glob("*.ts")) and not any(tmp_path.glob("*.onnx"))


class _FrozenNoise(nn.Module):
    """Adds 10 x the number of its calls, made with NumPy: not scriptable, and tracing freezes the value of the
    tracing call, so every export differs from every eager run (by 10 or more) by construction."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.conv(x) + torch.from_numpy(np.full(1, 10.0 * self.calls, dtype=np.float32))


def test_export_that_differs_from_pytorch_is_refused(tmp_path):
    with pytest.raises(ExportError, match="differs from PyTorch") as error:
        export_module_torchscript(_FrozenNoise().eval(), tmp_path / "bad.ts", [1, 1, 4, 4, 4])
    assert "torch.jit.script failed" in str(error.value)  # the fallback and why are part of the message
    with pytest.raises(ExportError, match="differs from PyTorch"):
        export_module_onnx(_FrozenNoise().eval(), tmp_path / "bad.onnx", [1, 1, 4, 4, 4], exporter="legacy")
    assert not (tmp_path / "bad.ts").exists() and not (tmp_path / "bad.onnx").exists()
    assert not list(tmp_path.iterdir()), "no temporary files are left behind"


def test_scriptable_module_is_scripted(tmp_path):
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.SiLU()).eval()
    result = export_module_torchscript(network, tmp_path / "net.ts", [2, 1, 8, 8, 8], metadata={"version": "9"})
    assert result.method == "script" and result.max_abs_diff <= 1e-5
    scripted = torch.jit.load(str(tmp_path / "net.ts"))
    x = _new_input([1, 1, 12, 10, 8])  # scripting keeps shapes dynamic
    torch.testing.assert_close(scripted(x), network(x), rtol=1e-4, atol=1e-5)
    forced = export_module_torchscript(network, tmp_path / "traced.ts", [2, 1, 8, 8, 8], method="trace")
    assert forced.method == "trace"


def test_onnx_dynamic_spatial_dimensions(tmp_path):
    torch.manual_seed(0)
    network = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv3d(4, 2, 1)).eval()
    result = export_module_onnx(
        network, tmp_path / "net.onnx", [1, 1, 8, 8, 8], dynamic_spatial=True, check_shapes=[[1, 1, 12, 10, 8]]
    )
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 1, "spatial_0", "spatial_1", "spatial_2"]
    x = _new_input([2, 1, 6, 14, 9])  # neither the example nor a verification shape
    np.testing.assert_allclose(session.run(None, {"image": x.numpy()})[0], network(x).detach().numpy(), atol=1e-4)
    static = export_module_onnx(network, tmp_path / "static.onnx", [1, 1, 8, 8, 8])
    session = ort.InferenceSession(str(static.path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 1, 8, 8, 8]


def test_compare_outputs_tolerances():
    e = torch.full((2, 3), 100.0)
    assert compare_outputs([e], [e + 5e-3], "x", atol=1e-4, relative_to_scale=True)[0] == pytest.approx(5e-3, rel=1e-3)
    with pytest.raises(ExportError, match="exceeds the tolerance"):
        compare_outputs([e], [e + 5e-3], "x", atol=1e-4)
    with pytest.raises(ExportError, match="shape"):
        compare_outputs([e], [e[:1]], "x")
    with pytest.raises(ExportError, match="2 outputs"):
        compare_outputs([e], [e, e], "x")
    with pytest.raises(ExportError, match="non-finite"):
        compare_outputs([e], [e * float("nan")], "x")


def _fake_bundle(root: Path, spatial_shape: list, patch_size=None) -> Path:
    configs = root / "configs"
    configs.mkdir(parents=True)
    inputs = {"image": {"num_channels": 2, "spatial_shape": spatial_shape, "dtype": "float32"}}
    (configs / "metadata.json").write_text(json.dumps({"network_data_format": {"inputs": inputs}}))
    (configs / "inference.json").write_text(json.dumps({} if patch_size is None else {"patch_size": patch_size}))
    return root


def test_default_input_shape_rules(tmp_path):
    bundle = _fake_bundle(tmp_path / "a", ["4*n", "2**p", 40, "*", "n*48"])
    assert default_input_shape(bundle) == [1, 2, 64, 64, 40, 64, 96]
    bundle = _fake_bundle(tmp_path / "b", ["4*n", "2**p", 40], patch_size=[32, 16, 40])
    assert default_input_shape(bundle) == [1, 2, 32, 16, 40]
    assert default_input_shape(bundle, overrides={"patch_size": [8, 8, 40]}) == [1, 2, 8, 8, 40]
    with pytest.raises(ValueError, match=r"inference\.json.*patch_size\[0\]=30.*'4\*n'"):
        default_input_shape(bundle, overrides={"patch_size": [30, 16, 40]})
    with pytest.raises(ValueError, match=r"metadata\.json.*only n, p"):
        default_input_shape(_fake_bundle(tmp_path / "c", ["4*k"]))


@pytest.mark.skipif(not BUNDLE_NAMES, reason="no bundles")
def test_cli_exports_all_formats_and_reports_errors(exported, tmp_path):
    if exported["bundle"] != BUNDLE_NAMES[0]:
        pytest.skip("the command line is tested once, on the first bundle")
    script = str(REPO_ROOT / "scripts" / "export_bundle.py")
    bundle, tiny = exported["bundle"], str(_tiny(exported["bundle"]))
    cmd = [sys.executable, script, "all", "--bundle", bundle, "--ckpt", str(exported["ckpt"])]
    cmd += ["--output_dir", str(tmp_path / "out"), "--overrides", tiny]
    result = subprocess.run(cmd, cwd=tmp_path, env=bundle_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| format | method |") and len(rows) == 3
    assert rows[1].startswith("| torchscript |") and rows[2].startswith("| onnx |")
    assert (tmp_path / "out" / "model.ts").is_file() and (tmp_path / "out" / "model.onnx").is_file()

    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"\0" * 64)
    cmd = [sys.executable, script, "torchscript", "--bundle", bundle, "--ckpt", str(bad)]
    cmd += ["--output", str(tmp_path / "bad.ts"), "--overrides", tiny]
    result = subprocess.run(cmd, cwd=tmp_path, env=bundle_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "export failed" in result.stderr and str(bad) in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "bad.ts").exists()

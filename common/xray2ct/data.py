# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Data of the biplanar X-ray -> CT bundle: CT transforms with X-rays made on the fly by the DRR projector, X-ray
files per case (PNG or NIfTI), their checks before training, inference items and the chest CT phantom demo.

X-ray files, one per view and case under the keys ``xray_<view>`` (``xray_ap``, ``xray_lateral``):

* PNG (8 or 16 bit grey): a radiograph with bone bright, rows running from superior (top) to inferior, columns
  along the view's first in-plane axis (AP: patient right to left as stored in RAS, lateral: posterior to
  anterior); its grey value ``g / max`` is the intensity ``1 - exp(-p)`` of :mod:`common.xray2ct.drr`;
* NIfTI: a 2D array of normalised line integrals ``p`` with axes ``(H, W)`` exactly as the projector makes them
  (what :func:`save_view_nifti` writes).

Both must have the projector's ``view_size`` (``H, W``); a transposed file is named as such.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from monai.data import MetaTensor
from monai.networks.layers import GaussianFilter
from monai.transforms import Affine, MapTransform

from common.data.datalist import inference_entries, load_datalist
from common.data.preflight import PreflightError, screen_entries
from common.xray2ct.drr import DRRProjector

__all__ = [
    "CONDITION_DEFAULTS",
    "IMAGE_SUFFIXES",
    "DRRd",
    "LoadViewsd",
    "XrayConditiond",
    "condition_problems",
    "check_view_files",
    "grid_spacing",
    "read_view",
    "save_view_nifti",
    "save_view_png",
    "screen_inputs",
    "view_keys",
    "xray_inference_items",
]


IMAGE_SUFFIXES = (".png",)
NIFTI_SUFFIXES = (".nii", ".nii.gz")


def view_keys(projector: DRRProjector) -> list[str]:
    """The datalist keys of X-ray files: ``xray_<view>`` per view of ``projector``."""
    return [f"xray_{v}" for v in projector.views]


def _suffix(path: str | os.PathLike) -> str:
    name = os.fspath(path).lower()
    return ".nii.gz" if name.endswith(".nii.gz") else os.path.splitext(name)[1]


def _view_shape(path: str | os.PathLike) -> tuple[int, ...]:
    """The 2D shape ``(H, W)`` of an X-ray file from its header, without reading the pixels."""
    suffix = _suffix(path)
    if suffix in IMAGE_SUFFIXES:
        from PIL import Image

        with Image.open(path) as img:
            width, height = img.size
            if img.mode not in ("L", "I;16", "I;16B", "I", "F"):
                raise ValueError(f"is a {img.mode!r} image; a grey-scale (8 or 16 bit) radiograph is required")
        return (width, height)  # stored rows are the second in-plane axis (superior up): (H, W) = (cols, rows)
    if suffix in NIFTI_SUFFIXES:
        import nibabel as nib

        shape = tuple(int(s) for s in nib.load(os.fspath(path)).shape)
        squeezed = tuple(s for s in shape if s != 1)
        if len(squeezed) != 2:
            raise ValueError(f"has shape {shape}; a 2D X-ray is required")
        return squeezed
    raise ValueError(f"has the unsupported suffix {suffix!r}; use {[*IMAGE_SUFFIXES, *NIFTI_SUFFIXES]}")


def _size_problem(shape: tuple[int, ...], view_size: Sequence[int]) -> str | None:
    expected = tuple(int(s) for s in view_size)
    if shape == expected:
        return None
    if shape == expected[::-1]:
        return f"has size {shape}, the transpose of view_size {expected}: the view is rotated or transposed"
    return f"has size {shape}, expected view_size {expected} (H, W)"


def read_view(path: str | os.PathLike, view_size: Sequence[int]) -> np.ndarray:
    """Normalised line integrals ``(H, W)`` of one X-ray file (see the module docstring).

    Raises:
        ValueError: naming the file when it cannot be read, is not 2D grey-scale or has another size.
    """
    try:
        problem = _size_problem(_view_shape(path), view_size)
        if problem:
            raise ValueError(problem)
        if _suffix(path) in NIFTI_SUFFIXES:
            import nibabel as nib

            data = np.asarray(nib.load(os.fspath(path)).dataobj, dtype=np.float32).squeeze()
        else:
            from PIL import Image

            with Image.open(path) as img:
                pixels = np.asarray(img)
            top = 65535.0 if pixels.dtype == np.uint16 or pixels.max() > 255 else 255.0
            intensity = torch.from_numpy(pixels.astype(np.float32) / top * 2.0 - 1.0)
            data = DRRProjector.line_integral(intensity).numpy()[::-1].T  # rows superior->inferior -> (H, W)
    except (OSError, ValueError) as exc:
        raise ValueError(f"X-ray file {os.fspath(path)!r} {exc}") from None
    if not np.isfinite(data).all():
        raise ValueError(f"X-ray file {os.fspath(path)!r} holds NaN or Inf values.")
    return np.ascontiguousarray(data, dtype=np.float32)


def save_view_png(path: str | os.PathLike, xray: torch.Tensor | np.ndarray) -> Path:
    """Write normalised line integrals ``(H, W)`` as a 16-bit PNG radiograph (readable by :func:`read_view`)."""
    from PIL import Image

    p = torch.as_tensor(np.asarray(xray, dtype=np.float32))
    intensity = ((DRRProjector.intensity(p) + 1.0) * 0.5).clamp(0, 1).numpy()
    pixels = np.round(intensity.T[::-1] * 65535.0).astype(np.uint16)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)
    return path


def save_view_nifti(path: str | os.PathLike, xray: torch.Tensor | np.ndarray) -> Path:
    """Write normalised line integrals ``(H, W)`` as a 2D NIfTI file (readable by :func:`read_view`)."""
    import nibabel as nib

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(np.asarray(xray, dtype=np.float32), np.eye(4)), os.fspath(path))
    return path


def _view_problems(entry: dict[str, Any], keys: Sequence[str], view_size: Sequence[int], base_dir: Any) -> list[str]:
    """The problems of one entry's X-ray files (see :func:`check_view_files`); relative paths in ``entry`` are
    resolved against ``base_dir`` in place."""
    problems = []
    for key in keys:
        path = entry.get(key)
        if not path or not isinstance(path, str):
            problems.append(f"missing {key!r} (one X-ray file per view: {list(keys)})")
            continue
        if base_dir is not None and not os.path.isabs(path):
            path = entry[key] = os.path.join(os.fspath(base_dir), path)
        if not os.path.isfile(path):
            problems.append(f"{key} {path!r} does not exist")
            continue
        try:
            problem = _size_problem(_view_shape(path), view_size)
        except (OSError, ValueError) as exc:
            problem = str(exc)
        if problem:
            problems.append(f"{key} {path!r} {problem}")
    return problems


def check_view_files(
    sections: Mapping[str, Sequence[Mapping[str, Any]]],
    keys: Sequence[str],
    view_size: Sequence[int],
    base_dir: str | os.PathLike | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Check the X-ray files of every entry (present, readable header, 2D grey-scale, ``view_size``) and return the
    entries with their X-ray paths resolved against ``base_dir``.

    Raises:
        PreflightError: listing every problem, each naming the section, entry and file.
    """
    problems, checked = [], {}
    for section, entries in sections.items():
        checked[section] = []
        for i, entry in enumerate(entries):
            entry = dict(entry)
            checked[section].append(entry)
            where = f"{section}[{i}]" + (f" (case {entry['case_id']})" if "case_id" in entry else "")
            problems += [f"{where}: {p}" for p in _view_problems(entry, keys, view_size, base_dir)]
    if problems:
        raise PreflightError(problems, "the X-ray files")
    return checked


def screen_inputs(entries: Sequence[Mapping[str, Any]], projector: DRRProjector, view_files: bool) -> list[list[str]]:
    """The problems of each inference entry (:func:`xray_inference_items`), one list per entry: its X-ray files
    (present, 2D grey-scale, ``view_size``) with ``view_files``, else the header of its CT volume (one channel,
    3D: :func:`common.data.preflight.screen_entries`); the check of :class:`common.engines.cases.CaseRun`."""

    if view_files:
        return [_view_problems(dict(e), view_keys(projector), projector.view_size, None) for e in entries]
    return screen_entries(entries, keys=["image"], num_channels=1)


class DRRd(MapTransform):
    """Adds ``xray``: the projector's X-rays of the CT under ``keys`` (``1, X, Y, Z`` in ``[-1, 1]``)."""

    def __init__(self, keys: str, projector: DRRProjector, output_key: str = "xray") -> None:
        super().__init__(keys)
        self.projector = projector
        self.output_key = output_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        volume = torch.as_tensor(d[self.keys[0]]).float()
        with torch.no_grad():
            d[self.output_key] = self.projector.xrays(volume.unsqueeze(0))[0]
        return d


#: the settings of :class:`XrayConditiond` (``xray_condition`` in the configs) and their clean values
CONDITION_DEFAULTS: dict[str, Any] = {
    "photons": None,
    "hardening": 0.0,
    "scatter": 0.0,
    "blur_mm": 0.0,
    "gain": 1.0,
    "offset": 0.0,
    "rotation_deg": [0.0, 0.0, 0.0],
    "shift_mm": [0.0, 0.0, 0.0],
    "seed": 0,
}


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and bool(np.isfinite(value))


def condition_problems(xray_condition: Mapping[str, Any] | None) -> list[str]:
    """The X-ray condition (``null``: clean X-rays) is a mapping of :data:`CONDITION_DEFAULTS`' keys: ``photons``
    (``null`` or > 0: counts per pixel of the unattenuated beam), ``hardening`` in ``[0, 1)``, ``scatter`` >= 0,
    ``blur_mm`` >= 0, ``gain`` > 0, ``offset`` in
    ``(-1, 1)``, ``rotation_deg`` and ``shift_mm`` (a number or 3 numbers) and an integer ``seed`` >= 0."""
    if xray_condition is None:
        return []
    if not isinstance(xray_condition, Mapping):
        return [f"'xray_condition' must be null or a mapping of {sorted(CONDITION_DEFAULTS)}, got {xray_condition!r}."]
    unknown = sorted(set(xray_condition) - set(CONDITION_DEFAULTS))
    problems = (
        [f"'xray_condition' has unknown key(s) {unknown}; known: {sorted(CONDITION_DEFAULTS)}."] if unknown else []
    )
    c = {**CONDITION_DEFAULTS, **xray_condition}
    rules = {
        "photons": c["photons"] is None or (_real(c["photons"]) and c["photons"] > 0),
        "hardening": _real(c["hardening"]) and 0 <= c["hardening"] < 1,
        "scatter": _real(c["scatter"]) and c["scatter"] >= 0,
        "blur_mm": _real(c["blur_mm"]) and c["blur_mm"] >= 0,
        "gain": _real(c["gain"]) and c["gain"] > 0,
        "offset": _real(c["offset"]) and -1 < c["offset"] < 1,
        "seed": isinstance(c["seed"], int) and not isinstance(c["seed"], bool) and c["seed"] >= 0,
    }
    for key in ("rotation_deg", "shift_mm"):
        values = c[key] if isinstance(c[key], (list, tuple)) else [c[key]]
        rules[key] = len(values) in (1, 3) and all(_real(v) for v in values)
    wanted = {
        "photons": "null or a number > 0 (counts per pixel of the unattenuated beam)",
        "hardening": "a number in [0, 1) (the beam's two energies attenuate 1 -+ hardening times the nominal; 0: "
        "monochromatic)",
        "scatter": "a number >= 0 (scatter-to-primary ratio of the view's mean; 0: none)",
        "blur_mm": "a number >= 0 (the detector blur's Gaussian sigma, mm)",
        "gain": "a number > 0 (1: calibrated)",
        "offset": "a number in (-1, 1) (a fraction of the unattenuated intensity; 0: calibrated)",
        "seed": "an integer >= 0",
        "rotation_deg": "a number or 3 numbers (degrees about X, Y, Z)",
        "shift_mm": "a number or 3 numbers (mm along X, Y, Z)",
    }
    problems += [
        f"'xray_condition' {key!r} must be {wanted[key]}, got {c[key]!r}." for key, ok in rules.items() if not ok
    ]
    return problems


def _triple_of(value: Any) -> list[float]:
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)] * 3


class XrayConditiond(MapTransform):
    """X-rays as a real detector and patient give them: replaces ``xray`` (made by :class:`DRRd`) with the X-rays of
    the CT under ``keys`` seen under ``condition`` (:data:`CONDITION_DEFAULTS`, each applied when it differs from
    its clean value), in the order physics applies them:

    1. pose: the CT rotated by ``rotation_deg`` (degrees about X, Y, Z, around its centre) and shifted by
       ``shift_mm`` before it is projected (air comes in at the borders), while the model assumes the nominal pose;
    2. beam hardening: a beam of two energies in equal parts, attenuated ``1 - hardening`` and ``1 + hardening``
       times the nominal energy's line integral ``p``: the transmission ``(exp(-(1 - h) p) + exp(-(1 + h) p)) / 2``,
       whose ``-log`` bends below ``p`` as the path lengthens (the denser, the harder the beam);
    3. scatter: a uniform background of ``scatter`` times the view's mean transmission added to it (a scatter-to-
       primary ratio over the field);
    4. detector blur: a Gaussian of sigma ``blur_mm`` (at the volume's centre) on the transmitted intensity;
    5. photon noise: Poisson counts of ``photons`` per pixel of the unattenuated beam times the transmission
       (``null``: no noise), floored at half a photon;
    6. miscalibration: the flat field off by ``gain`` and ``offset`` (``gain I + offset``), then ``-log``.

    The noise and nothing else is random, from ``seed`` and the case's id (the same case gets the same noise in every
    run). The ground-truth CT is not changed.

    Args:
        keys: the CT key (``1, X, Y, Z`` in ``[-1, 1]``, at the size the X-rays are made from).
        projector: the DRR projector (geometry, field of view, view size).
        condition: the condition, ``None`` for clean X-rays (the transform does nothing).
        output_key: the X-ray key.

    Raises:
        ValueError: listing every bad setting of ``condition`` (:func:`condition_problems`).
    """

    def __init__(
        self, keys: str, projector: DRRProjector, condition: Mapping[str, Any] | None, output_key: str = "xray"
    ) -> None:
        super().__init__(keys)
        problems = condition_problems(condition)
        if problems:
            raise ValueError(" ".join(problems))
        self.projector = projector
        self.condition = None if condition is None else {**CONDITION_DEFAULTS, **condition}
        self.output_key = output_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        if self.condition is None:
            return d
        c = self.condition
        volume = torch.as_tensor(d[self.keys[0]]).float()
        xray = torch.as_tensor(d[self.output_key]).float()
        with torch.no_grad():
            rotation, shift = _triple_of(c["rotation_deg"]), _triple_of(c["shift_mm"])
            if any(rotation) or any(shift):
                xray = self.projector.xrays(self._moved(volume, rotation, shift).unsqueeze(0))[0]
            h = float(c["hardening"])
            transmitted = (torch.exp(-(1 - h) * xray) + torch.exp(-(1 + h) * xray)) / 2 if h else torch.exp(-xray)
            if c["scatter"] > 0:
                transmitted = transmitted + float(c["scatter"]) * transmitted.mean(dim=(-2, -1), keepdim=True)
            if c["blur_mm"] > 0:
                transmitted = self._blurred(transmitted, float(c["blur_mm"]))
            floor = 1e-6
            if c["photons"] is not None:
                photons = float(c["photons"])
                generator = torch.Generator().manual_seed(self._seed(d))
                transmitted = torch.poisson(transmitted.double() * photons, generator).float() / photons
                floor = 0.5 / photons
            transmitted = transmitted.clamp(min=floor) * float(c["gain"]) + float(c["offset"])
            out = -torch.log(transmitted.clamp(min=floor))
        d[self.output_key] = MetaTensor(out, meta=getattr(d[self.output_key], "meta", {}))
        return d

    def _moved(self, volume: torch.Tensor, rotation: list[float], shift: list[float]) -> torch.Tensor:
        """The CT ``(1, X, Y, Z)`` rotated about its centre and shifted (mm), air outside."""
        spacing = [f / n for f, n in zip(self.projector.fov_mm, volume.shape[1:])]
        affine = Affine(
            rotate_params=[float(np.deg2rad(r)) for r in rotation],
            translate_params=[-s / v for s, v in zip(shift, spacing)],  # MONAI moves the sampling grid
            padding_mode="zeros",
            mode="bilinear",
            image_only=True,
        )
        return torch.as_tensor(affine(volume + 1.0)) - 1.0  # air (-1) pads as 0

    def _blurred(self, image: torch.Tensor, sigma_mm: float) -> torch.Tensor:
        """``(V, H, W)`` views blurred by a Gaussian of ``sigma_mm`` at the volume's centre, each in its own pixels."""
        out = []
        for i, view in enumerate(self.projector.views):
            pixel = [p / self.projector.magnification for p in self.projector.detector_pixel_mm(view)]
            sigma = [sigma_mm / p for p in pixel]
            pad = [int(np.ceil(4 * s)) for s in sigma]  # the edge's values continue (the filter pads with zeros)
            padded = F.pad(image[i][None, None], (pad[1], pad[1], pad[0], pad[0]), mode="replicate")
            blur = GaussianFilter(2, sigma)
            blurred = (blur(padded) / blur(torch.ones_like(padded)))[0, 0]  # the truncated kernel, summing to 1
            out.append(blurred[pad[0] : blurred.shape[0] - pad[0], pad[1] : blurred.shape[1] - pad[1]])
        return torch.stack(out)

    def _seed(self, data: Mapping[str, Any]) -> int:
        meta = getattr(data[self.keys[0]], "meta", {}) or {}
        name = str(meta.get("case_id") or meta.get("filename_or_obj") or "")
        return (zlib.crc32(name.encode()) + 1_000_003 * int(self.condition["seed"])) % (2**63)


class LoadViewsd(MapTransform):
    """Reads the X-ray files under ``keys`` (one per view, in order) into ``xray`` ``(V, H, W)`` (a MetaTensor
    carrying the entry's ``case_id`` and first file name), dropping the path entries."""

    reads_files = True  # its errors are reading errors (:class:`common.engines.cases.CaseDataset`)

    def __init__(self, keys: Sequence[str], view_size: Sequence[int], output_key: str = "xray") -> None:
        super().__init__(keys)
        self.view_size = [int(s) for s in view_size]
        self.output_key = output_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        paths = [d.pop(k) for k in self.keys]
        views = np.stack([read_view(p, self.view_size) for p in paths])
        meta = {"filename_or_obj": os.fspath(paths[0])}
        if "case_id" in d:
            meta["case_id"] = d["case_id"]
        d[self.output_key] = MetaTensor(torch.from_numpy(views), meta=meta)
        return d


def grid_spacing(projector: DRRProjector, size: Sequence[int]) -> list[float]:
    """The voxel size in mm of a grid of ``size`` voxels spanning the projector's field of view (``fov_mm``): the
    spacing ``Spacingd`` resamples a CT to before it is padded or cropped to ``size``.

    Args:
        projector: the DRR projector (its ``fov_mm`` per axis).
        size: voxels per axis.
    """
    return [float(f) / int(s) for f, s in zip(projector.fov_mm, size)]


def xray_inference_items(
    dataset_dir: str | os.PathLike,
    projector: DRRProjector,
    datalist: str | os.PathLike | None = None,
    section: str = "testing",
) -> list[dict[str, Any]]:
    """The inputs of an inference run, one entry per case with a ``case_id``: X-ray files (``xray_<view>``) or CT
    volumes (``image``, whose X-rays the projector makes).

    With ``datalist``: its ``section``. Otherwise the files under ``dataset_dir`` (recursively): X-ray pairs named
    ``<case>_<view>.png`` / ``.nii`` / ``.nii.gz`` (e.g. ``p001_ap.png`` and ``p001_lateral.png``) when there are
    any, else every CT volume (NIfTI, NRRD, MetaImage files and DICOM series folders, see
    :func:`common.data.datalist.find_volumes`).

    Raises:
        ValueError: naming the cases that lack a view, or a datalist mixing X-ray and CT entries.
        MissingInputError: when nothing is found.
    """

    keys = view_keys(projector)
    base = Path(os.path.expanduser(os.fspath(dataset_dir)))
    if datalist:
        entries = load_datalist(datalist, section, base_dir=str(base))
        kinds = {"xray" if all(k in e for k in keys) else "ct" if "image" in e else "none" for e in entries}
        if kinds - {"xray", "ct"} or len(kinds) > 1:
            raise ValueError(
                f"every entry of section {section!r} of {os.fspath(datalist)!r} must hold either all of {keys} "
                "(X-ray files) or 'image' (a CT volume), the same for all entries."
            )
        for entry in entries:
            first = entry[keys[0]] if keys[0] in entry else entry["image"]
            entry.setdefault("case_id", Path(str(first)).name.split(".")[0])
        return entries
    cases: dict[str, dict[str, str]] = {}
    for path in sorted(base.rglob("*")):
        if not path.is_file() or _suffix(path) not in (*IMAGE_SUFFIXES, *NIFTI_SUFFIXES):
            continue
        stem = path.name[: -len(_suffix(path))]
        for view, key in zip(projector.views, keys):
            if stem.endswith(f"_{view}"):
                cases.setdefault(stem[: -len(view) - 1], {})[key] = str(path.absolute())
    if not cases:
        return inference_entries(base, ["image"])
    incomplete = {case: sorted(set(keys) - set(found)) for case, found in cases.items() if set(found) != set(keys)}
    if incomplete:
        raise ValueError(f"X-ray cases under {str(base)!r} lack views (case: missing keys): {incomplete}.")
    return [{"case_id": case, **found} for case, found in sorted(cases.items())]

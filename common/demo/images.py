# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Small demo data sets: real brain blocks cut from the MNI152 2009 template (single volumes, or paired volumes for
image-to-image translation), and seeded synthetic phantoms (ellipsoids, chest CT, and multi-modal brain MRI with a
glioma in the BraTS 2023 layout).

Example::

    python -m common.demo.images --output_dir demo_data --spacing "[2,2,2]"
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from common.data.datalist import (
    BRATS_MODALITIES,
    DatalistError,
    find_brats_cases,
    load_datalist,
    read_datalist_json,
    write_datalist,
)
from common.data.io import write_nifti

__all__ = [
    "DEMO_VOLUMES",
    "DIFFUSION_DEMOS",
    "PHANTOM_KINDS",
    "TISSUES",
    "TISSUE_CONTRAST",
    "TRANSLATION_VOLUMES",
    "existing_datalist",
    "make_brain_tumour_phantom",
    "make_ct_phantom",
    "make_diffusion_demo",
    "make_translation_demo",
    "make_xray2ct_demo",
    "write_dicom_series",
    "main",
    "make_demo_dataset",
    "make_phantom",
    "mni_template_paths",
    "validate_triple",
    "write_brats_phantom_dataset",
    "write_phantom_dataset",
]

PHANTOM_KINDS = ("ellipsoids",)
# the MNI demo volumes, and the ones each block of make_demo_dataset gets (superior: training, inferior: validation)
DEMO_VOLUMES = ("t1", "gm", "wm", "synth")
DEMO_SECTIONS = {"training": ("t1", "gm", "wm", "synth"), "validation": ("t1", "synth")}
MNI_FILES = {
    "t1": "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz",
    "gm": "mni_icbm152_gm_tal_nlin_sym_09a_converted.nii.gz",
    "wm": "mni_icbm152_wm_tal_nlin_sym_09a_converted.nii.gz",
}
NILEARN_HINT = "install it with `pip install --no-deps nilearn` (only its bundled data files are used)"
MIN_SIZE = 32
VAL_FRACTION = 0.4
MARGIN_VOXELS = 2
# synthetic T1-like contrast: white matter brightest, grey matter darker, CSF/background dark
GM_WEIGHT, WM_WEIGHT = 0.6, 1.0


def mni_template_paths() -> dict[str, Path]:
    """Locate the MNI152 2009 (ICBM 152 non-linear symmetric 09a) templates shipped inside the nilearn wheel.

    nilearn is only located, never imported, so its dependencies need not be installed.

    Returns:
        ``{"t1": ..., "gm": ..., "wm": ...}``: the T1 template and the grey/white matter probability maps
        (197 x 233 x 189 voxels at 1 mm, RAS).

    Raises:
        FileNotFoundError: when nilearn is not installed or lacks the template files.
    """
    spec = importlib.util.find_spec("nilearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the MNI152 demo templates come with the nilearn package, which is missing: {NILEARN_HINT}"
        )
    data_dir = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"
    paths = {name: data_dir / filename for name, filename in MNI_FILES.items()}
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"nilearn is installed but the MNI152 template {missing[0]!r} is missing: {NILEARN_HINT}"
        )
    return paths


def validate_triple(name: str, value: float | Sequence[float], positive_int: bool = False) -> tuple:
    """Return ``value`` as 3 positive numbers (a single number is repeated).

    Raises:
        ValueError: naming ``name`` when the value is not 3 positive numbers.
    """
    values = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be 3 positive numbers, got {value!r}") from None
    if len(out) != 3 or any(not np.isfinite(v) or v <= 0 for v in out):
        raise ValueError(f"{name} must be 3 positive numbers, got {value!r}")
    if positive_int:
        if any(not v.is_integer() for v in out):
            raise ValueError(f"{name} must be 3 positive integers, got {value!r}")
        return tuple(int(v) for v in out)
    return out


def _load_resampled(path: Path, spacing: tuple[float, float, float]) -> tuple[np.ndarray, np.ndarray]:
    """Load a template as float32 and resample it to ``spacing`` (RAS), with Gaussian anti-aliasing."""
    import nibabel as nib
    from nibabel.processing import resample_to_output
    from scipy.ndimage import gaussian_filter

    img = nib.load(str(path))
    data = np.asarray(img.dataobj, dtype=np.float32)
    voxel = np.sqrt((img.affine[:3, :3] ** 2).sum(axis=0))
    factor = np.asarray(spacing) / voxel
    sigma = np.sqrt(np.clip(factor**2 - 1.0, 0.0, None)) / (2.0 * np.sqrt(2.0 * np.log(2.0)))
    if np.any(sigma > 0):
        data = gaussian_filter(data, sigma=sigma, mode="nearest")
    out = resample_to_output(nib.Nifti1Image(data, img.affine), voxel_sizes=spacing, order=1, mode="constant", cval=0.0)
    return np.clip(np.asarray(out.dataobj, dtype=np.float32), 0.0, None), out.affine


def _crop(
    data: np.ndarray, affine: np.ndarray, start: Sequence[int], stop: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Crop ``data`` to ``[start, stop)`` per axis and shift the affine accordingly."""
    index = tuple(slice(int(a), int(b)) for a, b in zip(start, stop))
    shift = np.eye(4)
    shift[:3, 3] = start
    return data[index].copy(), affine @ shift


def _pad_to(
    data: np.ndarray, affine: np.ndarray, min_size: int, si_axis: int, outer_low: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Zero-pad every axis to ``min_size``: symmetrically, except along ``si_axis``, padded on its outer side
    only (the low-index side when ``outer_low``) so the block never grows towards the other block."""
    pads = []
    for axis, size in enumerate(data.shape):
        missing = max(0, min_size - size)
        if axis == si_axis:
            pads.append((missing, 0) if outer_low else (0, missing))
        else:
            pads.append((missing // 2, missing - missing // 2))
    if not any(before or after for before, after in pads):
        return data, affine
    shift = np.eye(4)
    shift[:3, 3] = [-before for before, _ in pads]
    return np.pad(data, pads), affine @ shift


def _si_axis(affine: np.ndarray) -> tuple[int, bool]:
    """Voxel axis closest to superior-inferior, and whether increasing index points superior."""
    import nibabel as nib

    codes = nib.aff2axcodes(affine)
    for axis, code in enumerate(codes):
        if code in ("S", "I"):
            return axis, code == "S"
    raise ValueError(f"cannot find a superior-inferior axis in affine with orientation {codes}")


def _brain_box(t1: np.ndarray, margin: int) -> tuple[np.ndarray, np.ndarray]:
    """Bounding box ``[start, stop)`` of the brain (voxels above 5% of the 99th percentile) plus a margin."""
    mask = t1 > 0.05 * np.percentile(t1[t1 > 0], 99)
    where = np.argwhere(mask)
    start = np.maximum(where.min(axis=0) - margin, 0)
    stop = np.minimum(where.max(axis=0) + 1 + margin, t1.shape)
    return start, stop


def _demo_volumes(
    spacing: tuple[float, float, float], names: Mapping[str, Sequence[str]] | None = None
) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Build the demo blocks: ``{"training": {name: (data, affine)}, "validation": {...}}``.

    Args:
        spacing: voxel size in mm.
        names: for each section (``"training"``: the superior block, ``"validation"``: the inferior block), the
            volumes it gets, in order, among ``DEMO_VOLUMES``; ``DEMO_SECTIONS`` (what :func:`make_demo_dataset`
            writes) when ``None``.

    Raises:
        ValueError: for an unknown section or volume name, or a spacing too coarse for two blocks.
    """
    names = DEMO_SECTIONS if names is None else names
    for section, section_names in names.items():
        if section not in ("training", "validation"):
            raise ValueError(f"demo sections are 'training' and 'validation', got {section!r}")
        unknown = [name for name in section_names if name not in DEMO_VOLUMES]
        if unknown:
            raise ValueError(f"demo volumes are {DEMO_VOLUMES}, got {unknown[0]!r} for section {section!r}")
    wanted = {name for section_names in names.values() for name in section_names}
    paths = mni_template_paths()
    t1, affine = _load_resampled(paths["t1"], spacing)
    scale = float(np.percentile(t1[t1 > 0], 99))
    # the templates store probabilities as 0..255; the tissue maps are scaled to the T1's 99th percentile
    tissue = {
        key: _load_resampled(paths[key], spacing)[0] / 255.0
        for key in ("gm", "wm")
        if key in wanted or "synth" in wanted
    }
    full = {"t1": t1}
    for key, prob in tissue.items():
        if key in wanted:
            full[key] = prob * scale
    if "synth" in wanted:
        full["synth"] = (GM_WEIGHT * tissue["gm"] + WM_WEIGHT * tissue["wm"]) * scale
    start, stop = _brain_box(t1, MARGIN_VOXELS)
    full = {name: _crop(data, affine, start, stop)[0] for name, data in full.items()}
    affine = _crop(t1, affine, start, stop)[1]
    axis, superior_up = _si_axis(affine)
    n = full["t1"].shape[axis]
    n_val = min(n - 1, max(MIN_SIZE, int(round(VAL_FRACTION * n))))
    if n_val < 1:
        raise ValueError(f"spacing {spacing} leaves {n} slice(s) along the superior-inferior axis; use a finer spacing")
    # (first slice, end slice, whether the block's outer side is at low indices) along the S-I axis
    if superior_up:
        ranges = {"training": (n_val, n, False), "validation": (0, n_val, True)}
    else:
        ranges = {"training": (0, n - n_val, True), "validation": (n - n_val, n, False)}
    blocks: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for section, section_names in names.items():
        lo, hi, outer_low = ranges[section]
        b_start, b_stop = np.zeros(3, dtype=int), np.asarray(full["t1"].shape)
        b_start[axis], b_stop[axis] = lo, hi
        blocks[section] = {}
        for name in section_names:
            data, block_affine = _crop(full[name], affine, b_start, b_stop)
            data, block_affine = _pad_to(data, block_affine, MIN_SIZE, axis, outer_low=outer_low)
            blocks[section][name] = (data.astype(np.float32), block_affine)
    return blocks


def existing_datalist(
    datalist: Path, keys: Sequence[str] = ("image",), counts: Mapping[str, int] | None = None
) -> bool:
    """Whether ``datalist`` exists and every file it lists under ``keys`` exists.

    Args:
        datalist: the JSON file.
        keys: the entry keys holding paths; every entry must have them all.
        counts: when given, the datalist must hold exactly these sections with these numbers of entries;
            otherwise its ``"training"`` and ``"validation"`` sections are checked.
    """
    if not datalist.is_file():
        return False
    sections = ("training", "validation") if counts is None else tuple(counts)
    try:
        if counts is not None and set(read_datalist_json(datalist)) != set(counts):
            return False
        loaded = {section: load_datalist(datalist, section, keys=keys) for section in sections}
    except DatalistError:
        return False
    if counts is not None and any(len(loaded[section]) != n for section, n in counts.items()):
        return False
    return all(os.path.isfile(entry[key]) for entries in loaded.values() for entry in entries for key in keys)


def make_demo_dataset(
    output_dir: str | os.PathLike, spacing: float | Sequence[float] = (2.0, 2.0, 2.0), overwrite: bool = False
) -> Path:
    """Build a small real-data demo set from the MNI152 2009 template and its tissue maps.

    The 1 mm T1 template and its grey/white matter probability maps are anti-alias filtered and resampled to
    ``spacing``, then cropped to the brain bounding box plus a 2-voxel margin. The box is cut along the
    superior-inferior axis into two disjoint blocks: the inferior ~40% of the axial slices (at least 32)
    is validation, the superior rest is training, so no validation voxel is ever seen in training.

    - training (superior block): ``mni_t1_train`` (T1), ``mni_gm_train`` and ``mni_wm_train`` (tissue
      probabilities times the T1's 99th percentile), ``mni_synth_train`` (synthetic T1-like contrast
      ``0.6 * gm + 1.0 * wm``, same scale);
    - validation (inferior block): ``mni_t1_val`` and ``mni_synth_val``.

    Blocks thinner than 32 voxels on any axis (only at coarse spacings) are zero-padded to 32, along the
    superior-inferior axis on the side away from the other block. At 2 mm every volume has at least 32 voxels
    per axis. Images are float32 ``.nii.gz`` files with their world affines in ``output_dir/images/``;
    ``output_dir/datalist.json`` lists them relative to ``output_dir``.

    Args:
        output_dir: folder to write into (created when missing).
        spacing: voxel size in mm, 3 numbers or one for all axes.
        overwrite: rebuild even when a complete demo set is already there.

    Returns:
        The path of ``datalist.json``. When it already exists with all its images and ``overwrite`` is False,
        it is returned without writing anything.

    Raises:
        FileNotFoundError: when nilearn (which ships the templates) is not installed.
        ValueError: when ``spacing`` is not 3 positive numbers or is too coarse for two blocks.
    """
    spacing = validate_triple("spacing", spacing)
    out = Path(os.path.expanduser(os.fspath(output_dir))).absolute()
    datalist = out / "datalist.json"
    if not overwrite and existing_datalist(datalist):
        return datalist
    sections: dict[str, list[dict]] = {}
    for section, volumes in _demo_volumes(spacing).items():
        suffix = "train" if section == "training" else "val"
        sections[section] = []
        for name, (data, affine) in volumes.items():
            path = write_nifti(out / "images" / f"mni_{name}_{suffix}.nii.gz", data, affine)
            sections[section].append({"image": str(path)})
    return write_datalist(datalist, sections, base_dir=out)


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    """A uniformly random 3x3 rotation matrix."""
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q *= np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] *= -1
    return q


def make_phantom(shape: Sequence[int] = (32, 32, 32), seed: int = 0, kind: str = "ellipsoids") -> np.ndarray:
    """A seeded synthetic volume with learnable structure.

    ``"ellipsoids"``: a dim background ellipsoid ("body") holding 4 to 8 randomly placed, rotated, smooth-edged
    ellipsoids of different intensities, plus mild Gaussian noise.

    Args:
        shape: spatial size ``(X, Y, Z)``.
        seed: random seed; the same seed gives the same volume.
        kind: the phantom family; one of ``PHANTOM_KINDS``.

    Returns:
        A float32 array of ``shape`` with values in ``[0, 1]``.

    Raises:
        ValueError: for an unknown ``kind`` or a ``shape`` that is not 3 positive integers.
    """
    if kind not in PHANTOM_KINDS:
        raise ValueError(f"kind must be one of {PHANTOM_KINDS}, got {kind!r}")
    shape = validate_triple("shape", shape, positive_int=True)
    rng = np.random.default_rng(seed)
    axes = [np.linspace(-1.0, 1.0, s, dtype=np.float32) for s in shape]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)  # (X, Y, Z, 3) in [-1, 1]
    sharpness = 12.0

    def ellipsoid(center: np.ndarray, radii: np.ndarray, rotation: np.ndarray) -> np.ndarray:
        local = (grid - center) @ rotation
        dist = np.sqrt(((local / radii) ** 2).sum(axis=-1))
        return 1.0 / (1.0 + np.exp(np.clip(sharpness * (dist - 1.0), -50.0, 50.0)))

    body = ellipsoid(rng.uniform(-0.05, 0.05, 3), rng.uniform(0.75, 0.9, 3), _random_rotation(rng))
    volume = 0.15 * body
    for _ in range(int(rng.integers(4, 9))):
        center = rng.uniform(-0.45, 0.45, 3)
        radii = rng.uniform(0.15, 0.45, 3)
        blob = ellipsoid(center, radii, _random_rotation(rng)) * body
        intensity = rng.uniform(0.35, 1.0)
        volume = volume * (1.0 - blob) + intensity * blob
    volume = volume + rng.normal(0.0, 0.02, size=shape)
    return np.clip(volume, 0.0, 1.0).astype(np.float32)


def make_ct_phantom(shape: Sequence[int] = (64, 64, 64), seed: int = 0, noise_hu: float = 15.0) -> np.ndarray:
    """A seeded synthetic chest CT (contrast-enhanced, CT-pulmonary-angiography-like) in Hounsfield units.

    Axes are ``(X, Y, Z)`` with +Y anterior and +Z superior (RAS), axial slices along Z. Air
    outside the body (-1000 HU); an elliptic body of soft tissue (40 HU) with a subcutaneous fat layer
    (-100 HU); two lungs (-850 HU); a heart (40 HU) holding a contrast-filled blood pool (300 HU) from which
    pulmonary arteries (300 HU) run into the lungs, with 0-2 filling defects ("emboli", 30 HU); a vertebral
    column (cancellous 250 HU in a 700 HU cortex); and rib segments (600 HU). Sizes, positions and the number
    of vessels vary with ``seed``; edges are slightly blurred and Gaussian noise of ``noise_hu`` is added.

    Args:
        shape: spatial size ``(X, Y, Z)``.
        seed: random seed; the same seed gives the same volume.
        noise_hu: standard deviation of the added noise in HU.

    Returns:
        A float32 array of ``shape`` in HU (about -1000 to 800).
    """
    from scipy.ndimage import gaussian_filter

    shape = validate_triple("shape", shape, positive_int=True)
    rng = np.random.default_rng(seed)
    x, y, z = np.meshgrid(*[np.linspace(-1.0, 1.0, s, dtype=np.float32) for s in shape], indexing="ij")
    hu = np.full(shape, -1000.0, dtype=np.float32)

    def inside(cx, cy, cz, rx, ry, rz):
        return ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 + ((z - cz) / rz) ** 2 <= 1.0

    bx, by = rng.uniform(0.82, 0.92), rng.uniform(0.6, 0.7)
    body = (x / bx) ** 2 + (y / by) ** 2 <= 1.0
    hu[body] = -100.0  # fat layer
    hu[(x / (bx - 0.07)) ** 2 + (y / (by - 0.07)) ** 2 <= 1.0] = 40.0
    for side in (-1, 1):
        lung = inside(side * rng.uniform(0.34, 0.42), rng.uniform(-0.08, 0.02), 0.1, 0.28, 0.4, 0.95)
        hu[lung] = -850.0
    hx, hy, hz = rng.uniform(0.0, 0.12), rng.uniform(0.15, 0.25), rng.uniform(-0.35, -0.15)
    hu[inside(hx, hy, hz, 0.26, 0.22, 0.35)] = 40.0
    hu[inside(hx, hy, hz, 0.17, 0.14, 0.24)] = 300.0
    for _ in range(int(rng.integers(2, 5))):
        # a pulmonary artery: a tube from the heart towards one lung
        side = rng.choice([-1.0, 1.0])
        end = np.array([side * rng.uniform(0.3, 0.5), rng.uniform(-0.2, 0.1), rng.uniform(-0.2, 0.6)])
        start = np.array([hx, hy, hz])
        t = np.clip(
            ((x - start[0]) * (end - start)[0] + (y - start[1]) * (end - start)[1] + (z - start[2]) * (end - start)[2])
            / np.sum((end - start) ** 2),
            0.0,
            1.0,
        )
        d2 = (x - start[0] - t * (end - start)[0]) ** 2 + (y - start[1] - t * (end - start)[1]) ** 2
        d2 = d2 + (z - start[2] - t * (end - start)[2]) ** 2
        radius = rng.uniform(0.035, 0.06)
        hu[d2 <= radius**2] = 300.0
    for _ in range(int(rng.integers(0, 3))):
        ex, ey, ez = rng.uniform(-0.4, 0.4), rng.uniform(-0.2, 0.2), rng.uniform(-0.2, 0.6)
        hu[inside(ex, ey, ez, 0.04, 0.04, 0.06) & (hu == 300.0)] = 30.0
    sx = rng.uniform(-0.03, 0.03)
    spine = (x - sx) ** 2 + (y + 0.45) ** 2
    hu[spine <= 0.12**2] = 700.0
    hu[spine <= 0.08**2] = 250.0
    ring = np.sqrt((x / (bx - 0.1)) ** 2 + (y / (by - 0.1)) ** 2)
    period = rng.uniform(0.25, 0.35)
    ribs = (np.abs(ring - 1.0) < 0.04) & (np.cos(np.pi * z / period * 2) > 0.7)
    hu[ribs & body] = 600.0
    hu = gaussian_filter(hu, sigma=0.6)
    hu += rng.normal(0.0, float(noise_hu), size=shape).astype(np.float32)
    return hu.astype(np.float32)


def write_dicom_series(
    folder: str | os.PathLike,
    volume: np.ndarray,
    spacing: Sequence[float] = (1.0, 1.0, 1.0),
    series_number: int | None = None,
    prefix: str = "slice",
) -> Path:
    """Write a 3D ``(X, Y, Z)`` RAS volume as a DICOM series (one int16 file per axial slice) with ITK.

    The series' orientation is set so that reading it back (ITK, MONAI ``LoadImage``) gives the same array
    with an RAS affine of ``diag(spacing)``.

    Args:
        folder: the series folder (created; must not already hold files named ``<prefix>*``).
        volume: the voxel values (rounded to int16, e.g. HU).
        spacing: voxel size in mm.
        series_number: the ``SeriesNumber`` tag (left out when ``None``).
        prefix: the file names, ``<prefix><slice:04d>.dcm``; another prefix writes a second series into the same
            folder, as a flat PACS export holds several.

    Returns:
        The folder.

    Raises:
        FileExistsError: when ``folder`` already holds files of that ``prefix``.
        ValueError: when ``volume`` is not 3D.
    """
    import itk

    folder = Path(os.path.expanduser(os.fspath(folder))).absolute()
    volume = np.asarray(volume)
    if volume.ndim != 3:
        raise ValueError(f"volume must be 3D (X, Y, Z), got shape {volume.shape}")
    if folder.is_dir() and any(p.name.startswith(prefix) for p in folder.iterdir()):
        raise FileExistsError(f"{folder} already holds {prefix}* files")
    folder.mkdir(parents=True, exist_ok=True)
    array = np.ascontiguousarray(np.clip(np.round(volume), -32768, 32767).astype(np.int16).transpose(2, 1, 0))
    sx, sy, sz = validate_triple("spacing", spacing)
    # DICOM patient space is LPS: the array's +X (right to left in RAS terms, -L) and +Y (anterior, -P) give row
    # and column cosines (-1, 0, 0) and (0, -1, 0); every slice carries its own position along Z
    key = f"{folder}|{prefix}|{volume.shape}".encode()
    series_uid = f"1.2.826.0.1.3680043.8.498.{int(hashlib.sha256(key).hexdigest(), 16) % 10**12}"
    for k in range(array.shape[0]):
        image = itk.image_from_array(np.ascontiguousarray(array[k]))
        image.SetSpacing([float(sx), float(sy)])
        meta = image.GetMetaDataDictionary()
        for tag, value in {
            "0008|0060": "CT",
            "0020|000e": series_uid,
            "0020|0013": str(k + 1),
            "0020|0032": f"0\\0\\{k * sz:.6f}",
            "0020|0037": "-1\\0\\0\\0\\-1\\0",
            "0018|0050": f"{sz:.6f}",
            **({"0020|0011": str(int(series_number))} if series_number is not None else {}),
        }.items():
            meta[tag] = value
        io = itk.GDCMImageIO.New()
        io.KeepOriginalUIDOn()
        writer = itk.ImageFileWriter.New(Input=image, FileName=str(folder / f"{prefix}{k:04d}.dcm"), ImageIO=io)
        writer.Update()
    return folder


def write_phantom_dataset(
    output_dir: str | os.PathLike,
    n_train: int = 4,
    n_val: int = 2,
    shape: Sequence[int] = (32, 32, 32),
    seed: int = 0,
    spacing: Sequence[float] = (1, 1, 1),
    kind: str = "ellipsoids",
    dicom: bool = False,
) -> Path:
    """Write seeded phantoms as NIfTI files and a datalist (same layout as :func:`make_demo_dataset`).

    Every volume gets its own seed derived from ``seed``, so training and validation volumes differ.
    ``kind="ct"`` writes chest CT phantoms in HU (:func:`make_ct_phantom`); ``dicom=True`` writes each volume
    as a DICOM series folder (``images/<name>/slice*.dcm``) instead of a NIfTI file.

    Args:
        output_dir: folder to write into (created when missing); images go to ``output_dir/images/``.
        n_train: number of training volumes (at least 1).
        n_val: number of validation volumes (0 leaves the section out).
        shape: spatial size of each volume.
        seed: base random seed.
        spacing: voxel size in mm, written into the affines.
        kind: ``"ellipsoids"`` (values in [0, 1]) or ``"ct"`` (HU).
        dicom: write DICOM series folders instead of NIfTI files.

    Returns:
        The path of ``output_dir/datalist.json`` (paths relative to ``output_dir``).

    Raises:
        ValueError: for fewer than 1 training or negative validation volumes, or invalid shape/spacing.
    """
    if int(n_train) < 1 or int(n_val) < 0:
        raise ValueError(f"n_train must be >= 1 and n_val >= 0, got n_train={n_train!r}, n_val={n_val!r}")
    n_train, n_val = int(n_train), int(n_val)
    spacing = validate_triple("spacing", spacing)
    shape = validate_triple("shape", shape, positive_int=True)
    out = Path(os.path.expanduser(os.fspath(output_dir))).absolute()
    affine = np.diag([*spacing, 1.0])
    seeds = np.random.SeedSequence(int(seed)).generate_state(n_train + n_val)
    sections: dict[str, list[dict]] = {"training": []}
    if n_val:
        sections["validation"] = []
    for i, volume_seed in enumerate(seeds):
        section, suffix, index = ("training", "train", i) if i < n_train else ("validation", "val", i - n_train)
        data = (
            make_ct_phantom(shape, seed=int(volume_seed))
            if kind == "ct"
            else make_phantom(shape, seed=int(volume_seed), kind=kind)
        )
        name = f"phantom_{suffix}_{index:03d}"
        if dicom:
            path = write_dicom_series(out / "images" / name, data, spacing)
        else:
            path = write_nifti(out / "images" / f"{name}.nii.gz", data, affine)
        sections[section].append({"image": str(path)})
    return write_datalist(out / "datalist.json", sections, base_dir=out)


def _radial_perturbation(
    rng: np.random.Generator, directions: np.ndarray, amplitude: float, max_order: int
) -> np.ndarray:
    """A smooth random function of direction with values in ``[-amplitude, amplitude]``.

    It is a mean of 4 cosines of the angle to random axes with orders 1 to ``max_order``, so it changes slowly
    over the sphere; multiplying an ellipsoid's radius by ``1 + perturbation`` gives an irregular blob.

    Args:
        rng: the random generator.
        directions: unit vectors, shape ``(..., 3)``.
        amplitude: the largest relative change of the radius.
        max_order: the highest angular frequency.
    """
    out = np.zeros(directions.shape[:-1], dtype=np.float32)
    n_terms = 4
    for _ in range(n_terms):
        axis = rng.normal(size=3)
        axis /= np.linalg.norm(axis)
        order = int(rng.integers(1, max_order + 1))
        weight, phase = rng.uniform(-1.0, 1.0), rng.uniform(0.0, 2.0 * np.pi)
        out += np.float32(weight) * np.cos(order * np.pi * (directions @ axis.astype(np.float32)) + phase)
    return out * np.float32(amplitude / n_terms)


def _blob_distance(
    rng: np.random.Generator,
    grid: np.ndarray,
    center: Sequence[float],
    radii: Sequence[float],
    amplitude: float = 0.0,
    max_order: int = 2,
) -> np.ndarray:
    """Normalised distance to ``center`` of an ellipsoid with radii ``radii`` whose radius is perturbed by a smooth
    random function of direction (``< 1`` inside)."""
    local = (grid - np.asarray(center, dtype=np.float32)) / np.asarray(radii, dtype=np.float32)
    dist = np.sqrt((local**2).sum(axis=-1))
    if amplitude <= 0:
        return dist
    directions = local / np.maximum(dist, 1e-6)[..., None]
    return dist / (1.0 + _radial_perturbation(rng, directions, amplitude, max_order))


def _smooth_field(rng: np.random.Generator, grid: np.ndarray, n_terms: int = 4) -> np.ndarray:
    """A low-frequency random field over ``grid`` (coordinates in about ``[-1, 1]``) scaled to ``[-1, 1]``."""
    field = np.zeros(grid.shape[:-1], dtype=np.float32)
    for _ in range(n_terms):
        wave = rng.uniform(-0.8, 0.8, size=3).astype(np.float32)
        field += np.float32(rng.uniform(0.5, 1.0)) * np.cos(np.pi * (grid @ wave) + rng.uniform(0.0, 2.0 * np.pi))
    return field / max(float(np.abs(field).max()), 1e-6)


# tissue classes of the brain tumour phantom and their relative intensity in each BraTS 2023 modality
TISSUES = ("background", "csf", "gm", "wm", "edema", "enhancing", "necrosis")
TISSUE_CONTRAST = {
    "t1n": (0.0, 0.25, 0.55, 0.75, 0.45, 0.5, 0.3),
    "t1c": (0.0, 0.25, 0.55, 0.75, 0.45, 0.95, 0.3),
    "t2w": (0.0, 1.0, 0.6, 0.45, 0.8, 0.7, 0.9),
    "t2f": (0.0, 0.1, 0.6, 0.45, 0.9, 0.75, 0.5),
}
# BraTS 2023 label of each tissue class: 1 necrotic core (NCR), 2 peritumoral edema (SNFH), 3 enhancing tumour (ET)
TISSUE_LABEL = (0, 0, 0, 0, 2, 3, 1)
PHANTOM_MIN_SIZE = 16


def make_brain_tumour_phantom(
    shape: Sequence[int] = (48, 48, 48), seed: int = 0, return_tissue: bool = False
) -> dict[str, np.ndarray]:
    """A seeded, skull-stripped multi-modal brain MRI phantom with a glioma, as BraTS 2023 provides it.

    Axes are ``(X, Y, Z)`` = (left-right, posterior-anterior, inferior-superior). The brain is a slightly
    irregular ellipsoid (exactly 0 outside); inside it a smoothly deformed white matter core, a grey matter
    cortex around it split by a midline fissure, cerebrospinal fluid in two curved lateral ventricles and a thin
    outer rim. A tumour in a random hemisphere is an irregular peritumoral edema blob around a tumour core: an
    enhancing rim around a necrotic centre. Every case has all three tumour labels.

    Each modality maps the tissue classes to the relative intensities of ``TISSUE_CONTRAST`` (FLAIR ``t2f`` has
    dark CSF and bright edema, post-contrast ``t1c`` a bright enhancing rim), then edges are blurred (Gaussian,
    sigma 0.7 voxel), a smooth multiplicative bias field (up to +-10%) and Gaussian noise (1.5%) are applied,
    and the modality is scaled by a random gain in ``[200, 1200]``, as scanners scale differently. Brain voxels
    stay strictly positive, so the non-zero mask of any modality is the brain mask. Since every modality is a
    function of the tissue class, ``t2f`` can be predicted from ``t1n``, ``t1c`` and ``t2w``.

    Args:
        shape: spatial size ``(X, Y, Z)``, at least 16 per axis.
        seed: random seed; the same seed gives the same case.
        return_tissue: also return ``"tissue"``, the uint8 tissue class map before blurring (indices into
            ``TISSUES``: 0 background, 1 CSF, 2 grey matter, 3 white matter, 4 edema, 5 enhancing, 6 necrosis).

    Returns:
        ``{"t1n", "t1c", "t2w", "t2f"}``: float32 arrays of ``shape`` (non-negative, MR-like units), and
        ``"seg"``: a uint8 array of BraTS 2023 labels (0 background/healthy tissue, 1 NCR, 2 edema, 3 ET);
        with ``return_tissue``, ``"tissue"`` as well.

    Raises:
        ValueError: when ``shape`` is not 3 integers of at least 16.
    """
    from scipy.ndimage import gaussian_filter

    shape = validate_triple("shape", shape, positive_int=True)
    if min(shape) < PHANTOM_MIN_SIZE:
        raise ValueError(f"shape must be at least {PHANTOM_MIN_SIZE} voxels per axis, got {shape!r}")
    rng = np.random.default_rng(seed)
    axes = [np.linspace(-1.0, 1.0, s, dtype=np.float32) for s in shape]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)  # (X, Y, Z, 3) in [-1, 1]
    voxel = 2.0 / (np.asarray(shape, dtype=np.float32) - 1.0)  # voxel size in grid units, per axis

    # brain: an ellipsoid with a slightly irregular surface, in "brain units" (1 at the surface)
    center = rng.uniform(-0.04, 0.04, 3)
    radii = np.array([0.74, 0.86, 0.76]) * rng.uniform(0.94, 1.04, 3)
    brain_dist = _blob_distance(rng, grid, center, radii, amplitude=0.03, max_order=3)
    brain = brain_dist < 1.0
    local = (grid - center.astype(np.float32)) / radii.astype(np.float32)  # brain coordinates, about [-1, 1]
    brain_voxel = float(np.mean(voxel / radii))  # one voxel in brain units

    tissue = np.zeros(shape, dtype=np.uint8)
    tissue[brain] = TISSUES.index("gm")
    # white matter: a smoothly deformed ellipsoid inside the cortex (gyri-like bumps of higher angular order)
    wm_radii = rng.uniform(0.68, 0.76) * rng.uniform(0.95, 1.05, 3)
    wm = _blob_distance(rng, local, (0.0, 0.0, 0.0), wm_radii, amplitude=0.08, max_order=5) < 1.0
    tissue[wm & brain] = TISSUES.index("wm")
    # CSF: a thin outer rim, the interhemispheric fissure in the cortex and two lateral ventricles
    csf = brain & (brain_dist > 1.0 - 1.2 * brain_voxel)
    csf |= brain & ~wm & (np.abs(local[..., 0]) < 0.7 * float(voxel[0] / radii[0])) & (local[..., 2] > -0.3)
    v_y, v_z = rng.uniform(-0.1, 0.05), rng.uniform(0.0, 0.1)
    for side in (-1.0, 1.0):
        v_x = side * rng.uniform(0.11, 0.15)
        v_radii = (rng.uniform(0.08, 0.11), rng.uniform(0.3, 0.38), rng.uniform(0.11, 0.15))
        curved = local.copy()
        curved[..., 2] += 0.5 * (local[..., 1] - v_y) ** 2  # the ventricle bends down at both ends
        csf |= _blob_distance(rng, curved, (v_x, v_y, v_z), v_radii) < 1.0
    tissue[csf & brain] = TISSUES.index("csf")

    # tumour in one hemisphere: edema blob > enhancing rim > necrotic centre, each at least ~1.5 voxels thick
    side = rng.choice([-1.0, 1.0])
    t_center = np.array([side * rng.uniform(0.3, 0.42), rng.uniform(-0.35, 0.35), rng.uniform(-0.25, 0.35)])
    r_ncr = max(rng.uniform(0.12, 0.17), 1.5 * brain_voxel)
    r_core = max(r_ncr * rng.uniform(1.6, 2.0), r_ncr + 2.0 * brain_voxel)
    r_edema = max(r_core * rng.uniform(1.5, 1.9), r_core + 2.0 * brain_voxel)
    edema = _blob_distance(rng, local, t_center, r_edema * rng.uniform(0.85, 1.15, 3), 0.25, 3) < 1.0
    core = _blob_distance(rng, local, t_center, r_core * rng.uniform(0.9, 1.1, 3), 0.15, 2) < 1.0
    necrosis = _blob_distance(rng, local, t_center, r_ncr * rng.uniform(0.9, 1.1, 3), 0.15, 2) < 1.0
    necrosis[np.unravel_index(int(((local - t_center.astype(np.float32)) ** 2).sum(axis=-1).argmin()), shape)] = True
    tissue[edema & brain] = TISSUES.index("edema")
    tissue[core & brain] = TISSUES.index("enhancing")
    tissue[necrosis & brain] = TISSUES.index("necrosis")

    seg = np.asarray(TISSUE_LABEL, dtype=np.uint8)[tissue]
    bias_amplitude = rng.uniform(0.05, 0.1)
    out: dict[str, np.ndarray] = {}
    for modality, contrast in TISSUE_CONTRAST.items():
        image = gaussian_filter(np.asarray(contrast, dtype=np.float32)[tissue], sigma=0.7)
        image *= 1.0 + np.float32(bias_amplitude) * _smooth_field(rng, grid)
        image += rng.normal(0.0, 0.015, size=shape).astype(np.float32)
        image = np.where(brain, np.maximum(image, 0.01), 0.0)
        out[modality] = (image * rng.uniform(200.0, 1200.0)).astype(np.float32)
    out["seg"] = seg
    if return_tissue:
        out["tissue"] = tissue
    return out


def write_brats_phantom_dataset(
    output_dir: str | os.PathLike,
    n_train: int = 6,
    n_val: int = 2,
    shape: Sequence[int] = (48, 48, 48),
    seed: int = 0,
    spacing: float | Sequence[float] = (1.0, 1.0, 1.0),
    overwrite: bool = False,
) -> Path:
    """Write brain tumour phantoms (:func:`make_brain_tumour_phantom`) in the BraTS 2023 layout, with a datalist.

    Case ``i`` is ``output_dir/BraTS-PHANTOM-<i:05d>-000/`` holding ``<case>-t1n.nii.gz``, ``-t1c``, ``-t2w``,
    ``-t2f`` (float32) and ``-seg.nii.gz`` (uint8 labels), with the RAS affine ``diag(spacing)``; every case
    gets its own seed derived from ``seed``. ``output_dir/datalist.json`` lists the first ``n_train`` cases as
    training and the rest as validation (left out when ``n_val`` is 0), with entries
    ``{"case_id", "t1n", "t1c", "t2w", "t2f", "label"}`` relative to ``output_dir``, as
    ``scripts/make_datalist.py --brats`` writes them.

    Args:
        output_dir: folder to write into (created when missing).
        n_train: number of training cases (at least 1).
        n_val: number of validation cases (0 leaves the section out).
        shape: spatial size of each volume, at least 16 per axis.
        seed: base random seed.
        spacing: voxel size in mm, 3 numbers or one for all axes.
        overwrite: rebuild even when a complete data set is already there.

    Returns:
        The path of ``datalist.json``. When it already exists with ``n_train``/``n_val`` entries whose files all
        exist and ``overwrite`` is False, it is returned without writing anything (shape, seed and spacing are
        not checked; pass ``overwrite=True`` after changing them).

    Raises:
        ValueError: for fewer than 1 training or negative validation cases, or an invalid shape/spacing.
    """
    if isinstance(n_train, bool) or isinstance(n_val, bool) or int(n_train) != n_train or int(n_val) != n_val:
        raise ValueError(f"n_train and n_val must be integers, got n_train={n_train!r}, n_val={n_val!r}")
    if n_train < 1:
        raise ValueError(f"n_train must be at least 1, got {n_train!r}")
    if n_val < 0:
        raise ValueError(f"n_val must be 0 or more, got {n_val!r}")
    n_train, n_val = int(n_train), int(n_val)
    shape = validate_triple("shape", shape, positive_int=True)
    if min(shape) < PHANTOM_MIN_SIZE:
        raise ValueError(f"shape must be at least {PHANTOM_MIN_SIZE} voxels per axis, got {shape!r}")
    spacing = validate_triple("spacing", spacing)
    out = Path(os.path.expanduser(os.fspath(output_dir))).absolute()
    datalist = out / "datalist.json"
    keys = (*BRATS_MODALITIES, "label")
    counts = {"training": n_train, **({"validation": n_val} if n_val else {})}
    if not overwrite and existing_datalist(datalist, keys=keys, counts=counts):
        return datalist
    affine = np.diag([*spacing, 1.0])
    case_ids = []
    for i, case_seed in enumerate(np.random.SeedSequence(int(seed)).generate_state(n_train + n_val)):
        case = f"BraTS-PHANTOM-{i:05d}-000"
        for name, data in make_brain_tumour_phantom(shape, seed=int(case_seed)).items():
            write_nifti(out / case / f"{case}-{name}.nii.gz", data, affine)
        case_ids.append(case)
    found = {entry["case_id"]: entry for entry in find_brats_cases(out)}
    entries = [found[case] for case in case_ids]
    sections = {"training": entries[:n_train]}
    if n_val:
        sections["validation"] = entries[n_train:]
    return write_datalist(datalist, sections, base_dir=out, keys=keys)


TRANSLATION_VOLUMES = DEMO_VOLUMES


def make_translation_demo(
    output_dir: str | os.PathLike,
    spacing: float | Sequence[float] = (2.0, 2.0, 2.0),
    source: str = "t1",
    target: str = "gm",
    overwrite: bool = False,
) -> Path:
    """Build a paired image-to-image translation demo set from the MNI152 2009 template and its tissue maps.

    The volumes are those of :func:`make_demo_dataset` (same resampling, brain box and disjoint superior
    training / inferior validation blocks): ``"t1"`` the T1 template, ``"gm"`` and ``"wm"`` the grey/white
    matter probabilities times the T1's 99th percentile, ``"synth"`` the synthetic contrast
    ``0.6 * gm + 1.0 * wm`` on the same scale. Both blocks get ``source`` and ``target``, written to
    ``output_dir/images/mni_<name>_<train|val>.nii.gz``; ``output_dir/datalist.json`` is
    ``{"training": [{"case_id": "mni_train", source: ..., target: ...}], "validation": [{"case_id": "mni_val",
    ...}]}`` with paths relative to ``output_dir``. The file names are those of :func:`make_demo_dataset`, so
    give each its own folder (both write ``datalist.json``).

    Args:
        output_dir: folder to write into (created when missing).
        spacing: voxel size in mm, 3 numbers or one for all axes.
        source: the input volume, one of ``TRANSLATION_VOLUMES``.
        target: the output volume, another one of ``TRANSLATION_VOLUMES``.
        overwrite: rebuild even when a complete demo set is already there.

    Returns:
        The path of ``datalist.json``. When it already lists ``source`` and ``target`` for one training and one
        validation entry whose files all exist and ``overwrite`` is False, it is returned without writing
        anything (the spacing is not checked).

    Raises:
        FileNotFoundError: when nilearn (which ships the templates) is not installed.
        ValueError: when ``source``/``target`` are not two different names of ``TRANSLATION_VOLUMES``, or
            ``spacing`` is not 3 positive numbers or is too coarse for two blocks.
    """
    for role, name in (("source", source), ("target", target)):
        if name not in TRANSLATION_VOLUMES:
            raise ValueError(f"{role} must be one of {TRANSLATION_VOLUMES}, got {name!r}")
    if source == target:
        raise ValueError(f"source and target must differ, got {source!r} for both")
    spacing = validate_triple("spacing", spacing)
    out = Path(os.path.expanduser(os.fspath(output_dir))).absolute()
    datalist = out / "datalist.json"
    if not overwrite and existing_datalist(datalist, keys=(source, target), counts={"training": 1, "validation": 1}):
        return datalist
    names = {"training": (source, target), "validation": (source, target)}
    sections: dict[str, list[dict]] = {}
    for section, volumes in _demo_volumes(spacing, names).items():
        suffix = "train" if section == "training" else "val"
        entry: dict[str, str] = {"case_id": f"mni_{suffix}"}
        for name, (data, affine) in volumes.items():
            entry[name] = str(write_nifti(out / "images" / f"mni_{name}_{suffix}.nii.gz", data, affine))
        sections[section] = [entry]
    return write_datalist(datalist, sections, base_dir=out, keys=(source, target))


DIFFUSION_DEMOS = ("translation", "brats_phantom")


def make_diffusion_demo(
    output_dir: str | os.PathLike, kind: str = "translation", spacing: float = 3.0, overwrite: bool = False
) -> Path:
    """The demo data of the diffusion bundle, built on first use.

    ``translation``: T1 -> grey-matter map pairs cut from the real MNI152 template (:func:`make_translation_demo`,
    at ``spacing`` mm); ``brats_phantom``: six training and two validation brain tumour phantoms with the four
    BraTS 2023 modalities (:func:`write_brats_phantom_dataset`, 48^3 at 1 mm).

    Raises:
        ValueError: for another ``kind``.
    """
    if kind == "translation":
        return make_translation_demo(output_dir, spacing=spacing, source="t1", target="gm", overwrite=overwrite)
    if kind == "brats_phantom":
        return write_brats_phantom_dataset(output_dir, n_train=6, n_val=2, shape=(48, 48, 48), overwrite=overwrite)
    raise ValueError(f"'demo' must be one of {DIFFUSION_DEMOS}, got {kind!r}.")


def make_xray2ct_demo(
    output_dir: str | os.PathLike,
    n_train: int = 24,
    n_val: int = 6,
    shape: Sequence[int] = (64, 64, 64),
    fov_mm: float = 350.0,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """The demo data of the X-ray -> CT bundle, built on first use: seeded chest CT phantoms in HU (body with a
    fat layer, lungs, heart with a blood pool and pulmonary arteries, spine, ribs; sizes and positions vary,
    :func:`make_ct_phantom`) of ``shape`` voxels over a ``fov_mm`` cube, as NIfTI files and a
    datalist. Returns the datalist path; an existing complete demo is reused unless ``overwrite``."""
    out = Path(os.path.expanduser(os.fspath(output_dir))).absolute()
    datalist = out / "datalist.json"
    counts = {"training": int(n_train), "validation": int(n_val)} if int(n_val) else {"training": int(n_train)}
    if not overwrite and existing_datalist(datalist, counts=counts):
        return datalist
    spacing = [float(fov_mm) / int(s) for s in shape]
    return write_phantom_dataset(out, n_train=n_train, n_val=n_val, shape=shape, seed=seed, spacing=spacing, kind="ct")


def main(
    output_dir: str, spacing: float | Sequence[float] = (2.0, 2.0, 2.0), overwrite: bool = False, phantom: bool = False
) -> None:
    """Command-line entry: build the MNI demo set (or a phantom set) and print the datalist path.

    Args:
        output_dir: folder to write into.
        spacing: voxel size in mm, for example ``"[2,2,2]"``.
        overwrite: rebuild even when the demo set already exists.
        phantom: write the synthetic phantom set instead of the MNI demo set.
    """
    if phantom:
        print(write_phantom_dataset(output_dir, spacing=spacing))
    else:
        print(make_demo_dataset(output_dir, spacing=spacing, overwrite=overwrite))


if __name__ == "__main__":
    import fire

    fire.Fire(main)

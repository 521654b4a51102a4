# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The data steps the bundles' configs name (the configs own the pipelines): cache sizes and the checks of the cache
and intensity settings, this rank's partition, loaders, case names, inference postprocessing."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence, Sized
from typing import Any

import nibabel as nib
import numpy as np
import torch
from monai.data import MetaTensor, NibabelWriter, ThreadDataLoader, partition_dataset
from monai.transforms import (
    Compose,
    Invertd,
    MapTransform,
    SaveImaged,
    ScaleIntensityRanged,
    ScaleIntensityRangePercentilesd,
)
from monai.utils import CommonKeys as Keys
from monai.utils import get_equivalent_dtype

from common.data.formats import file_stem
from common.data.intensity import InvertibleScaleIntensityRangePercentilesd, ScaleIntensityModed
from common.errors import UserError
from common.utils import get_rank, get_world_size, plain_tensor

__all__ = [
    "EpochSampler",
    "HeaderKeepingWriter",
    "ItemSeededDataset",
    "CaseMetad",
    "batch_case_ids",
    "cache_size",
    "LatentAffined",
    "OUTPUT_UNITS",
    "VQCodesd",
    "cache_problems",
    "case_name_formatter",
    "check_output_units",
    "inference_postprocessing",
    "orientation_problems",
    "spacing_problems",
    "make_loader",
    "partition_for_rank",
    "hu_window_steps",
    "nifti_saver",
    "output_stem",
]


#: ``output_units`` of inference: the input's intensity units where the normalisation can be undone, or [0, 1]
OUTPUT_UNITS = ("input", "normalised")


def spacing_problems(spacing: Any) -> list[str]:
    """Why the config ``spacing`` (the voxel size volumes are resampled to, in mm; ``null``: kept) is invalid."""
    values = list(spacing) if isinstance(spacing, (list, tuple)) else None
    if spacing is None or (
        values is not None
        and len(values) == 3
        and all(not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0 for v in values)
    ):
        return []
    return [f"'spacing' must be null (keep each volume's voxel size) or 3 positive numbers (mm), got {spacing!r}."]


#: the axis codes of ``Orientationd`` (the bundles' ``labels``): one letter of each pair, in any order
_AXIS_PAIRS = ("LR", "PA", "IS")


def orientation_problems(orientation: Any) -> list[str]:
    """Why the config ``orientation`` (the axis codes volumes are reoriented to, e.g. ``"RAS"``; ``null`` or empty:
    kept) is invalid: ``Orientationd`` would silently turn a repeated axis (``"RAR"``) into a wrong orientation."""
    if not orientation:
        return []
    codes = str(orientation) if isinstance(orientation, str) else ""
    pairs = sorted(next((i for i, pair in enumerate(_AXIS_PAIRS) if c in pair), -1) for c in codes)
    if pairs == [0, 1, 2]:
        return []
    return [
        f"'orientation' must be null or 3 axis codes, one of each of L/R, P/A and I/S in capitals (e.g. 'RAS'), got "
        f"{orientation!r}."
    ]


def cache_problems(cache_rate: Any, replace_rate: Any, **other_cache_rates: Any) -> list[str]:
    """Why the config ``cache_rate`` (share of volumes cached, in [0, 1]), ``replace_rate`` (share of a
    ``SmartCacheDataset``'s cache replaced each epoch, in (0, 1]: MONAI refuses 0, and with ``cache_rate`` 1 nothing
    is replaced anyway) or another cache rate of a bundle (``other_cache_rates``, by config id, in [0, 1]) is invalid,
    one line per problem naming the config id."""
    problems = []
    for name, rate in {"cache_rate": cache_rate, **other_cache_rates}.items():
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            problems.append(f"'{name}' must be a number in [0, 1] (the share of volumes cached), got {rate!r}.")
    if isinstance(replace_rate, bool) or not isinstance(replace_rate, (int, float)) or not 0 < replace_rate <= 1:
        problems.append(
            f"'replace_rate' must be a number in (0, 1] (the share of a SmartCacheDataset's cache replaced each epoch; "
            f"with cache_rate 1 nothing is replaced), got {replace_rate!r}."
        )
    return problems


class CaseMetad(MapTransform):
    """Store the entry's ``case_id`` in the metadata of ``keys`` (it then names saved predictions, see
    :func:`case_name_formatter`); entries without one get the stem of their file name.

    Args:
        keys: MetaTensor keys.
        case_key: the entry key holding the case identifier.
    """

    def __init__(self, keys: str | Sequence[str], case_key: str = "case_id") -> None:
        super().__init__(keys)
        self.case_key = case_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        for key in self.key_iterator(d):
            value = d[key]
            if isinstance(value, MetaTensor):
                case = d.get(self.case_key) or file_stem(value.meta.get("filename_or_obj", key))
                value.meta[self.case_key] = str(case)
        return d


def batch_case_ids(batchdata: Mapping[str, Any], n: int) -> list[str]:
    """The ``case_id`` of each of the ``n`` cases of a batch; without it the image file names (from the metadata),
    else the positions in the batch."""
    ids = batchdata.get("case_id")
    if ids is None:
        ids = getattr(batchdata.get(Keys.IMAGE), "meta", {}).get("filename_or_obj")
    if ids is None:
        ids = [str(i) for i in range(n)]
    return [str(c) for c in (ids if isinstance(ids, (list, tuple)) else [ids])]


#: characters a case id may hold that cannot be part of a file name on some system (path separators, Windows'
#: reserved characters, control characters) and ``%`` itself, which :func:`output_stem` writes as ``%XX``
_UNSAFE_IN_NAMES = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|%]')


def output_stem(case_id: Any) -> str:
    """The start of the names of a case's output files: its case id, with every character that cannot be part of a
    file name (``/``, ``\\``, ``:``, ``*``, ``?``, ``"``, ``<``, ``>``, ``|``, control characters), ``%`` itself and
    a leading ``.`` written as ``%XX`` (its code in hexadecimal). Distinct case ids give distinct stems (``p1/ct``
    -> ``p1%2Fct``, ``p2/ct`` -> ``p2%2Fct``), and a stem is always one file name in the prediction folder, never
    a path out of it; ids made of letters, digits, ``_``, ``-``, ``.`` and spaces are unchanged."""
    stem = _UNSAFE_IN_NAMES.sub(lambda found: f"%{ord(found.group()):02X}", str(case_id))
    return "%2E" + stem[1:] if stem.startswith(".") else stem


def case_name_formatter(metadict: Mapping[str, Any] | None, saver: Any) -> dict[str, Any]:
    """``SaveImage`` name formatter: the :func:`output_stem` of the ``case_id`` of the metadata (see
    :class:`CaseMetad`), else MONAI's default (the input file name)."""
    from monai.data.folder_layout import default_name_formatter

    names = default_name_formatter(metadict, saver)
    case = (metadict or {}).get("case_id")
    if case:
        names["subject"] = output_stem(case)
    return names


def partition_for_rank(data: Sequence[Any], shuffle: bool = True, seed: int = 0, even_divisible: bool = True) -> list:
    """This rank's share of ``data`` (all of it when not distributed).

    With ``even_divisible`` every rank gets the same number of items (a few repeated when needed), so all ranks
    take the same number of steps per epoch; validation uses ``even_divisible=False`` unless there are fewer
    items than ranks.
    """
    world = get_world_size()
    data = list(data)
    if world == 1:
        return data
    if not data:
        raise ValueError("cannot partition an empty datalist across ranks.")
    even = even_divisible or len(data) < world
    if len(data) < world:  # partition_dataset refuses fewer items than partitions: repeat them
        data = (data * (world // len(data) + 1))[:world]
    return list(
        partition_dataset(data, num_partitions=world, shuffle=shuffle, seed=seed, even_divisible=even)[get_rank()]
    )


def cache_size(data: Sized, cache_rate: float) -> int:
    """How many items of ``data`` a cache of ``cache_rate`` holds (a dataset's ``cache_num``): at least one of a
    non-empty ``data``, since a ``SmartCacheDataset`` draws an epoch from its cache only.

    Raises:
        UserError: when ``cache_rate`` is not a number in [0, 1] (:func:`cache_problems`, the one rule of the rates).
    """
    problems = cache_problems(cache_rate, replace_rate=1.0)
    if problems:
        raise UserError(problems[0])
    return max(1, int(len(data) * float(cache_rate))) if len(data) else 0


class EpochSampler(torch.utils.data.Sampler):
    """Shuffles ``size`` items in an order that depends only on ``(seed, epoch)``, and can start an epoch part-way.

    It yields ``epoch * size + position`` so that :class:`ItemSeededDataset` knows the epoch of every item it
    prepares (in whatever thread or worker process prepares it). After :meth:`resume`, the next epoch it yields is
    the given one, without its first ``start`` items: a run resumed in the middle of an epoch sees exactly the items
    the interrupted run had not reached yet.

    Args:
        size: number of items.
        seed: base seed of the orders.
    """

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = int(size)
        self.seed = int(seed)
        self.epoch = 0
        self.start = 0

    def resume(self, epoch: int, start: int) -> None:
        """Make the next epoch yielded epoch ``epoch`` (0-based), starting at its item ``start``."""
        self.epoch, self.start = int(epoch), int(start)

    def __iter__(self):
        generator = torch.Generator().manual_seed(_mix_seed(self.seed, self.epoch))
        order = torch.randperm(self.size, generator=generator)[self.start :]
        epoch, self.epoch, self.start = self.epoch, self.epoch + 1, 0
        return iter((order + epoch * self.size).tolist())

    def __len__(self) -> int:
        return self.size


class ItemSeededDataset(torch.utils.data.Dataset):
    """Wraps a dataset so that its random transforms draw from a seed of ``(seed, epoch, item)``: the augmentation
    of an item does not depend on which thread or worker prepares it, on prefetching, or on what came before, so an
    interrupted run resumed part-way through an epoch prepares the remaining items exactly as the uninterrupted run.

    Indices are ``epoch * len(dataset) + item``, as :class:`EpochSampler` yields them.

    Args:
        dataset: a dataset whose ``transform`` (a ``Compose``) holds the random transforms.
        seed: base seed.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int = 0) -> None:
        self.dataset = dataset
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        epoch, item = divmod(int(index), len(self.dataset))
        transform = getattr(self.dataset, "transform", None)
        if hasattr(transform, "set_random_state"):
            transform.set_random_state(seed=_mix_seed(self.seed, epoch, item))
        return self.dataset[item]


def _mix_seed(*values: int) -> int:
    """A 32-bit seed from several integers (numpy's ``SeedSequence`` mixing)."""
    return int(np.random.SeedSequence([int(v) % 2**63 for v in values]).generate_state(1)[0])


def make_loader(
    dataset: torch.utils.data.Dataset,
    batch_size: int = 1,
    shuffle: bool = True,
    num_workers: int = 0,
    seed: int | None = None,
    **kwargs: Any,
) -> ThreadDataLoader:
    """A ``ThreadDataLoader``: batches are prepared in a background thread while the step runs.

    With ``shuffle`` and a ``seed``, the order of every epoch and the random augmentation of every item follow from
    ``(seed, rank, epoch, item)`` (:class:`EpochSampler`, :class:`ItemSeededDataset`), so a run killed in the middle
    of an epoch resumes it exactly (:class:`common.handlers.checkpoint.CheckpointManager` positions the sampler).

    Keep ``num_workers=0`` when the cache lives on the GPU (forked workers cannot share CUDA tensors).
    """
    if shuffle and seed is not None:
        seed = _mix_seed(seed, get_rank())
        kwargs["sampler"] = EpochSampler(len(dataset), seed)
        # the loader's own per-epoch seed draw comes from this generator, not from the global RNG that the training
        # step draws its noise from (a resumed run starts one extra epoch iterator)
        kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        dataset, shuffle = ItemSeededDataset(dataset, seed), False
    return ThreadDataLoader(
        dataset, batch_size=int(batch_size), shuffle=shuffle, num_workers=int(num_workers), **kwargs
    )


class LatentAffined(MapTransform):
    """Give a latent map the affine of its image grid: voxel size multiplied by the downsampling factor.

    Args:
        keys: latent keys (channel-first MetaTensors).
        ref_key: the image the latent was encoded from.
    """

    def __init__(self, keys: Sequence[str] | str, ref_key: str = "image") -> None:
        super().__init__(keys)
        self.ref_key = ref_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        ref = d[self.ref_key]
        for key in self.key_iterator(d):
            latent = d[key]
            factors = [r / s for r, s in zip(ref.shape[1:], latent.shape[1:])]
            ref_affine = torch.as_tensor(ref.affine, dtype=torch.float64)
            scale = torch.tensor(factors, dtype=torch.float64)
            affine = ref_affine.clone()
            affine[:3, :3] = ref_affine[:3, :3] @ torch.diag(scale)
            # a latent voxel covers `factor` image voxels: its centre sits (factor - 1) / 2 voxels further in
            affine[:3, 3] = ref_affine[:3, 3] + ref_affine[:3, :3] @ ((scale - 1) / 2)
            latent.affine = affine
        return d


class VQCodesd(MapTransform):
    """Quantize a stitched continuous latent with a vector quantizer and add its code indices.

    The latent under each key (channel first, one volume) is replaced by its quantized version and the indices
    are stored under ``codes_key`` (``(1, *spatial)``, int32), both keeping the latent's metadata (affine).
    Quantizing after stitching keeps every latent voxel a codebook vector, which blending quantized windows
    would not.

    Args:
        keys: continuous latent keys.
        quantizer: an ``EMAVectorQuantizer`` (or a module with a ``quantizer`` attribute); it is switched to eval
            mode while quantizing (the codebook never changes) and its mode is restored afterwards.
        codes_key: key of the code indices.
    """

    def __init__(self, keys: Sequence[str] | str, quantizer: torch.nn.Module, codes_key: str = "codes") -> None:
        super().__init__(keys)
        self.quantizer = getattr(quantizer, "quantizer", quantizer)
        self.codes_key = codes_key

    def __call__(self, data: Mapping[str, Any]) -> dict[str, Any]:
        d = dict(data)
        device = self.quantizer.embeddings.device
        for key in self.key_iterator(d):
            latent = d[key]
            meta = dict(getattr(latent, "meta", {}))
            plain = plain_tensor(latent)
            training = self.quantizer.training
            self.quantizer.eval()  # quantizing must never update the codebook (MONAI's eval_mode restores train())
            try:
                with torch.no_grad():
                    out = self.quantizer(plain[None].to(device))
            finally:
                self.quantizer.train(training)
            # the codebook rows themselves: the straight-through output z + (e - z) differs from e in the last bits
            quantized = self.quantizer.embed(out["indices"])[0]
            d[key] = MetaTensor(quantized.to(plain.dtype).detach().cpu(), meta=meta)
            d[self.codes_key] = MetaTensor(out["indices"][:1].to(torch.int32).cpu(), meta=dict(meta))
        return d


class HeaderKeepingWriter(NibabelWriter):
    """MONAI's ``NibabelWriter`` that also keeps what the input's NIfTI header said beyond the grid and that MONAI's
    NIfTI reader puts into the metadata: its units (``xyzt_units``: millimetres and seconds stay so, instead of
    "unknown") and time offset (:attr:`KEPT_HEADER_FIELDS`). Fields the data or the grid decide (shape, type,
    scaling, affine) are the written array's own."""

    #: header fields carried from the input's metadata to the written file
    KEPT_HEADER_FIELDS = ("xyzt_units", "toffset")

    def set_metadata(self, meta_dict: Mapping | None, resample: bool = True, **options: Any) -> None:
        self.kept = {k: meta_dict[k] for k in self.KEPT_HEADER_FIELDS if meta_dict and k in meta_dict}
        super().set_metadata(meta_dict, resample=resample, **options)

    def write(self, filename: Any, verbose: bool = False, **obj_kwargs: Any) -> None:
        if getattr(self, "kept", None):
            header = nib.Nifti1Header()
            header.set_data_dtype(get_equivalent_dtype(self.output_dtype or self.data_obj.dtype, np.ndarray))
            for name, value in self.kept.items():
                header[name] = np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value).reshape(())
            obj_kwargs["header"] = header
        super().write(filename, verbose=verbose, **obj_kwargs)


def nifti_saver(
    key: str, output_dir: str, postfix: str, dtype: Any = np.float32, name_formatter: Callable | None = None
) -> SaveImaged:
    """``SaveImaged`` of ``key`` as ``<name>_<postfix>.nii.gz`` in ``output_dir`` (one flat folder, no resampling,
    ``dtype`` on disk, names from ``name_formatter``, e.g. :func:`case_name_formatter`, the input's units kept:
    :class:`HeaderKeepingWriter`). Only nibabel writes: when it fails (a full disk), MONAI's fallback to another
    writer could leave a partial file that looks written."""
    return SaveImaged(
        keys=key,
        writer=HeaderKeepingWriter,
        output_dir=output_dir,
        output_postfix=postfix,
        separate_folder=False,
        resample=False,
        print_log=False,
        output_dtype=dtype,
        output_name_formatter=name_formatter,
    )


def hu_window_steps(key: str, intensity: Mapping[str, Any] | None) -> list:
    """For a CT window, map [0, 1] back to Hounsfield units, clipped to the window (the network only ever saw
    windowed intensities); nothing for other intensity modes."""
    if not intensity or str(intensity.get("mode", "")).lower() != "ct":
        return []
    a_min, a_max = float(intensity.get("a_min", -1000)), float(intensity.get("a_max", 1000))
    return [ScaleIntensityRanged(key, a_min=0.0, a_max=1.0, b_min=a_min, b_max=a_max, clip=True)]


def check_output_units(output_units: str, preprocessing: Compose | None = None) -> str:
    """``output_units`` (one of :data:`OUTPUT_UNITS`) in lower case; with ``preprocessing``, also check that it
    records the per-volume percentiles exactly when the output is to be in the input's units (``Invertd`` undoes
    what was recorded, see :class:`common.data.intensity.ScaleIntensityModed`'s ``invertible``).

    Raises:
        ValueError: for another value, or a preprocessing that does not match it.
    """
    units = str(output_units).lower().replace("normalized", "normalised")
    if units not in OUTPUT_UNITS:
        raise ValueError(f"'output_units' must be one of {list(OUTPUT_UNITS)}, got {output_units!r}.")
    if preprocessing is not None:
        transforms = preprocessing.flatten().transforms if isinstance(preprocessing, Compose) else [preprocessing]
        transforms = [t.transform if isinstance(t, ScaleIntensityModed) else t for t in transforms]
        records = any(isinstance(t, InvertibleScaleIntensityRangePercentilesd) for t in transforms)
        plain = any(isinstance(t, ScaleIntensityRangePercentilesd) for t in transforms)  # not recorded
        if units == "normalised" and records:
            raise ValueError(
                "'output_units' is 'normalised' but the preprocessing records the percentiles to undo them: build it "
                "with invertible_intensity=False."
            )
        if units == "input" and plain:
            raise ValueError(
                "'output_units' is 'input' but the preprocessing's percentile scaling cannot be undone: build it with "
                "invertible_intensity=True."
            )
    return units


def inference_postprocessing(
    mode: str,
    preprocessing: Compose,
    output_dir: str,
    pred_key: str = "pred",
    quantizer: torch.nn.Module | None = None,
    intensity: Mapping[str, Any] | None = None,
    output_units: str = "input",
) -> Compose:
    """Postprocessing for an autoencoder's inference; files are named by the entry's ``case_id``
    (:class:`CaseMetad`, :func:`case_name_formatter`), else by the input file.

    ``reconstruct``: undo padding/spacing/orientation so the reconstruction lies on the input's grid with the
    input's affine, then save ``<name>_recon.nii.gz``. ``encode``: save the latent map as ``<name>_latent.nii.gz``
    (channels last, the affine scaled by the downsampling factor) for latent diffusion models; with a
    ``quantizer`` the stitched latent is quantized first and the code indices are saved as
    ``<name>_codes.nii.gz`` (int32, same affine). ``decode``: the input is a latent (or code) map; save the
    decoded image as ``<name>_decoded.nii.gz`` (``<name>`` the latent's own case name, ``sub01_latent``) with the
    affine scaled back to the image grid.

    Intensities, with ``output_units="input"``: a reconstruction is returned to the input's units where the
    normalisation can be undone: a CT ``intensity`` window to Hounsfield units (clipped to the window, the only
    values the network saw), per-volume percentiles (recorded by
    :class:`common.data.intensity.InvertibleScaleIntensityRangePercentilesd`) by the inverse of that volume's
    linear mapping (``Invertd``; values beyond the percentiles were clipped to them by the normalisation). A
    decoded image has no input volume: Hounsfield units for a CT window, the network's normalised scale for
    percentiles (not clipped: a decoder's output can fall outside the training images' [0, 1]). With
    ``"normalised"`` every output stays in [0, 1] (the preprocessing must then be built with
    ``invertible_intensity=False``).

    Raises:
        ValueError: for another mode, an unknown ``output_units`` or a preprocessing that does not match it
            (:func:`check_output_units`).
    """
    units = check_output_units(output_units, preprocessing if mode == "reconstruct" else None)
    to_units = hu_window_steps(pred_key, intensity) if units == "input" else []
    if mode == "reconstruct":
        return Compose(
            [
                Invertd(
                    keys=pred_key, transform=preprocessing, orig_keys="image", nearest_interp=False, to_tensor=True
                ),
                *to_units,
                CaseMetad(pred_key),
                nifti_saver(pred_key, output_dir, "recon", name_formatter=case_name_formatter),
            ]
        )
    if mode == "encode":
        steps: list = [LatentAffined(keys=pred_key, ref_key="image"), CaseMetad(pred_key)]
        if quantizer is not None:
            steps += [
                VQCodesd(pred_key, quantizer),
                nifti_saver("codes", output_dir, "codes", np.int32, name_formatter=case_name_formatter),
            ]
        return Compose([*steps, nifti_saver(pred_key, output_dir, "latent", name_formatter=case_name_formatter)])
    if mode == "decode":
        return Compose(
            [
                LatentAffined(keys=pred_key, ref_key="image"),
                *to_units,
                CaseMetad(pred_key),
                nifti_saver(pred_key, output_dir, "decoded", name_formatter=case_name_formatter),
            ]
        )
    raise ValueError(f"mode must be 'reconstruct', 'encode' or 'decode', got {mode!r}.")

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Benchmarks of ``mace_survival`` (commands of ``scripts/benchmark.py``):

    python scripts/benchmark.py mace_throughput                    # bundle trainer vs a plain PyTorch loop
    python scripts/benchmark.py mace_throughput --device cuda --image_size "[128,128,96]" --batch_size 16
    python scripts/benchmark.py mace_smartcache                    # SmartCache replacement vs epoch time

``mace_throughput`` alternates, in one process, a plain loop written as the MONAI survival scripts are (CPU
``CacheDataset`` + ``DataLoader``, fp32, the same ResNet, augmentation and logistic-hazard loss, AdamW) and the
bundle's ``train#trainer`` with all its handlers, on the synthetic MACE cohort; it reports cases/s of each, their
ratio, the bundle's data-wait fraction and peak memory. ``mace_smartcache`` trains the bundle for a few epochs with a
``SmartCacheDataset`` holding ``cache_rate`` of the cohort and replacing ``replace_rate`` of its cache every epoch,
and reports how long the end of each epoch waits for the replacement thread (``update_cache``) against the epoch
time: the stall fraction; a ``CacheDataset`` of the whole cohort is the reference.

Both build the cohort with ``--seed`` (also the bundle's seed). The cohort decides two settings the bundle checks
against it: the horizons (default: the bundle's, those inside the validation follow-up window, else the middle of
that window) and the number of logistic-hazard intervals (at most what the training event times
give: tied quantiles are merged). Both are in the results.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from scripts.harness import tools
from scripts.harness.faults import RUN_SETTINGS, BundleCase

__all__ = [
    "BENCHMARKS",
    "THROUGHPUT",
    "MACE_HORIZONS",
    "MACE_INTERVALS",
    "cohort_intervals",
    "fault_case",
    "followup_horizons",
    "mace_cohort",
    "mace_cohort_problems",
    "mace_smartcache",
    "mace_throughput",
]

BUNDLE = "mace_survival"
WINDOW = {"mode": "ct", "a_min": -1000, "a_max": 1500}


DEMO_SPACING = (7.0, 7.0, 8.0)


def _make_cohort(
    folder: Path,
    n_cases: int,
    shape: Sequence[int],
    spacing: Sequence[float] = DEMO_SPACING,
    seed: int = 0,
    censoring: str = "uniform",
) -> Path:
    from common.demo.survival import make_mace_cohort

    return make_mace_cohort(
        folder,
        n_cases=int(n_cases),
        shape=tuple(int(s) for s in shape),
        spacing=tuple(float(v) for v in spacing),
        seed=int(seed),
        censoring=censoring,
    )


def _sections(csv: Path) -> dict[str, list[dict]]:
    """The cohort's splits as the bundle reads them (the split column decides)."""
    from common.survival.cohort import read_cohort_csv, split_cohort

    return split_cohort(read_cohort_csv(csv, time_unit="days"))


def followup_horizons(csv: Path, horizons: Sequence[float] | None = None) -> list[float]:
    """The horizons (years) of a run on the cohort ``csv``: ``horizons`` when given; else the bundle's default
    horizons inside the follow-up window the bundle checks (at or after the earliest validation time, before the
    largest time of every split), or, when none is, the middle of that window."""
    if horizons is not None:
        return [float(h) for h in horizons]
    sections = _sections(csv)
    limit = min(max(e["time"] for e in entries) for entries in sections.values() if entries)
    first = min(e["time"] for e in sections["validation"])
    inside = [float(h) for h in tools.train_config(BUNDLE)["horizons"] if first <= float(h) < limit]
    return inside or [(first + limit) / 2.0]


def cohort_intervals(csv: Path, num_intervals: int) -> int:
    """The logistic-hazard intervals of the bundle on ``csv``: ``num_intervals``, or fewer when tied quantiles of
    the training event times merge cut points (the bundle refuses the requested number then)."""
    from common.survival.cohort import cut_points_from_quantiles

    training = _sections(csv)["training"]
    times, events = [e["time"] for e in training], [e["event"] for e in training]
    return len(cut_points_from_quantiles(times, events, int(num_intervals))) - 1


def _load_cohort(csv: Path, num_intervals: int, horizons: Sequence[float] | None, chosen: dict) -> tuple[list, dict]:
    """The training entries and the bundle overrides locating them, with the horizons and intervals the cohort
    allows (also recorded in ``chosen``)."""
    chosen.update(horizons=followup_horizons(csv, horizons), num_intervals=cohort_intervals(csv, num_intervals))
    return _sections(csv)["training"], {"csv_path": str(csv), **chosen}


def _mace_plain_loop(s: dict, data: list[dict], iterations: int, warmup: int, workers: int) -> float:
    """The plain loop: CPU ``CacheDataset`` + ``DataLoader`` of whole CT volumes, fp32, AdamW, logistic hazard."""
    from monai.data import CacheDataset, DataLoader
    from monai.transforms import (
        Compose,
        CropForegroundd,
        EnsureChannelFirstd,
        EnsureTyped,
        LoadImaged,
        Orientationd,
        RandAffined,
        RandGaussianNoised,
        ResizeWithPadOrCropd,
        ScaleIntensityRanged,
    )

    from common.survival.cohort import cut_points_from_quantiles
    from common.survival.losses import logistic_hazard_loss
    from common.survival.networks import SurvivalNet

    size = tuple(s["image_size"])
    transforms = Compose(
        [
            LoadImaged("image"),
            EnsureChannelFirstd("image"),
            Orientationd("image", axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S"))),
            ScaleIntensityRanged("image", a_min=-1000, a_max=1500, b_min=0.0, b_max=1.0, clip=True),
            CropForegroundd("image", source_key="image", select_fn=lambda x: x > 0.05, allow_smaller=True),
            ResizeWithPadOrCropd("image", spatial_size=size),
            EnsureTyped(["image", "time", "event"], dtype=torch.float32),
            RandAffined(
                "image",
                prob=0.5,
                rotate_range=(0.1, 0.1, 0.1),
                scale_range=(0.1, 0.1, 0.1),
                translate_range=tuple(0.05 * v for v in size),
                padding_mode="zeros",
            ),
            RandGaussianNoised("image", prob=0.2, std=0.01),
        ]
    )
    times, events = [e["time"] for e in data], [e["event"] for e in data]
    cuts = torch.tensor(cut_points_from_quantiles(times, events, s["num_intervals"]))  # as the bundle derives them
    items = [{k: e[k] for k in ("image", "time", "event")} for e in data]
    dataset = CacheDataset(items, transform=transforms, cache_rate=1.0, progress=False)
    loader = DataLoader(
        dataset,
        batch_size=s["batch_size"],
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )
    device = s["device"]
    net = SurvivalNet(s["backbone"], num_intervals=len(cuts) - 1, hidden_channels=128, dropout=0.2).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=1e-4)
    cuts = cuts.to(device)

    def step(batch: dict) -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = net(batch["image"].to(device))
        loss = logistic_hazard_loss(logits, batch["time"].to(device), batch["event"].to(device), cuts)
        loss.backward()
        optimizer.step()

    return tools.timed_loop(s, loader, step, iterations, warmup, whole_batch=True)


def mace_throughput(
    image_size=(48, 48, 40),
    backbone: str = "resnet18",
    batch_size: int = 8,
    n_cases: int = 64,
    num_intervals: int = 10,
    iterations: int = 20,
    warmup: int = 3,
    repeats: int = 2,
    amp: str | None = None,
    compile: bool = False,
    profile: bool = False,
    cache_device: str | None = None,
    device: str = "auto",
    baseline_workers: int | None = None,
    num_threads: int | None = None,
    seed: int = 0,
    horizons: Sequence[float] | None = None,
    censoring: str = "uniform",
    output: str | None = None,
) -> dict:
    """``mace_survival`` trainer vs a plain loop, same network, batch, image size and augmentation, alternating in
    one process, on the synthetic MACE cohort (phantoms of ``image_size``).

    Args:
        image_size: volume and network input size.
        backbone: MONAI ResNet depth.
        batch_size: cases per step (one process).
        n_cases: cohort size (75% training).
        num_intervals: logistic-hazard intervals (fewer when tied event-time quantiles of the cohort merge cut points).
        iterations: timed steps per run (after ``warmup``).
        warmup: untimed steps at the start of each run.
        repeats: runs of each side; the median is reported.
        amp: the bundle's autocast (default: bf16 on GPUs, none on CPUs); the plain loop runs in fp32.
        compile: ``torch.compile`` the bundle's network.
        profile: also profile one bundle iteration with ``torch.profiler`` (its top kernels, in the result's
            ``profile``; :func:`scripts.harness.tools.kernel_profile`).
        cache_device: where the bundle caches the volumes (default: the GPU on CUDA, else the CPU).
        device: ``auto``, ``cpu`` or ``cuda``.
        baseline_workers: DataLoader workers of the plain loop (default: 4 on GPU machines, 0 on CPUs).
        num_threads: torch CPU threads.
        seed: seed of the cohort and of the bundle.
        horizons: prediction horizons in years (default: chosen from the cohort's follow-up, see the module).
        censoring: censoring of the cohort (``uniform`` or ``none``: every case has an event).
        output: JSON file for the results.
    """
    from common.utils import default_amp

    dev, workers = tools.setup(device, num_threads, baseline_workers)
    size = [int(v) for v in image_size]
    s = {
        "image_size": size,
        "backbone": backbone,
        "batch_size": int(batch_size),
        "num_intervals": int(num_intervals),
        "num_samples": 1,
        "device": dev,
        "amp": amp or default_amp(dev),
    }
    extra = {  # the cohort's horizons and intervals come with the data (_load_cohort)
        "image_size": size,
        "backbone": backbone,
        "batch_size": int(batch_size),
        "compile": bool(compile),
        "lr_schedule": False,
        "cache_device": cache_device or str(dev),
        "seed": int(seed),
    }
    chosen: dict = {}
    results = tools.alternate(
        s,
        BUNDLE,
        _mace_plain_loop,
        iterations,
        warmup,
        repeats,
        workers,
        functools.partial(_make_cohort, n_cases=n_cases, shape=size, seed=seed, censoring=censoring),
        extra=extra,
        load_data=functools.partial(_load_cohort, num_intervals=num_intervals, horizons=horizons, chosen=chosen),
        profile=profile,
    )
    summary = {
        "device": tools.device_name(dev),
        "image_size": size,
        "backbone": backbone,
        "batch": int(batch_size),
        "amp": s["amp"],
        "compile": bool(compile),
        "timed_iterations": iterations,
        "seed": int(seed),
        **chosen,
        **results,
    }
    _print_throughput(summary)
    return tools.save_summary(summary, output)


def _print_throughput(summary: dict) -> None:
    """The report of ``mace_throughput``: one Markdown row, the run's sizes and then the measured rates."""
    leading = {"device": summary["device"], "image": tools.shape_label(summary["image_size"])}
    leading |= {"backbone": summary["backbone"], "batch": summary["batch"]}
    tools.print_throughput(summary, leading | {"amp": summary["amp"], "compile": summary["compile"]})


#: the ``train#dataset`` of the reference run: every training case cached once, nothing replaced
CACHE_DATASET = {
    "_target_": "CacheDataset",
    "data": "@train#data",
    "transform": "@train#preprocessing",
    "cache_rate": "@cache_rate",
    "num_workers": None,
    "progress": False,
}


def _smartcache_run(csv: Path, work: Path, s: dict, overrides: dict, epochs: int) -> dict:
    """Train the bundle for ``epochs`` epochs; time each epoch and each wait for the cache replacement."""
    from ignite.engine import Events
    from monai.data import SmartCacheDataset

    located = {"csv_path": str(csv), "max_epochs": int(epochs), "epoch_length": None, **overrides}
    trainer, monitor = tools.bundle_trainer(s, 1, str(work), located, BUNDLE)
    dataset = trainer.data_loader.dataset
    waits: list[float] = []
    if isinstance(dataset, SmartCacheDataset):
        update = dataset.update_cache

        def timed_update() -> None:
            start = time.perf_counter()
            update()
            waits.append(time.perf_counter() - start)

        dataset.update_cache = timed_update
    epochs_s: list[float] = []
    marks: dict[str, float] = {}

    @trainer.on(Events.EPOCH_STARTED)
    def _start(engine) -> None:
        tools.sync(s["device"])
        marks["start"] = time.perf_counter()

    @trainer.on(Events.EPOCH_COMPLETED)
    def _end(engine) -> None:  # registered after the SmartCacheHandler: the epoch includes its wait
        tools.sync(s["device"])
        epochs_s.append(time.perf_counter() - marks["start"])

    trainer.run()
    steady = epochs_s[1:] or epochs_s  # the first epoch includes start-up
    wait = statistics.median(waits[1:] or waits) if waits else 0.0
    return {
        "cached_cases": len(dataset),
        "iterations_per_epoch": len(trainer.data_loader),
        "epoch_s": statistics.median(steady),
        "replacement_wait_s": wait,
        "stall_fraction": wait / statistics.median(steady),
        "data_wait": monitor.history[-1]["data_wait"] if monitor.history else float("nan"),
    }


def mace_smartcache(
    n_cases: int = 96,
    image_size=(48, 48, 40),
    file_shape=None,
    backbone: str = "resnet10",
    batch_size: int = 8,
    cache_rate: float = 0.5,
    replace_rates=(0.25, 0.5, 1.0),
    epochs: int = 4,
    device: str = "auto",
    num_threads: int | None = None,
    seed: int = 0,
    horizons: Sequence[float] | None = None,
    censoring: str = "uniform",
    output: str | None = None,
) -> dict:
    """SmartCache replacement time against epoch time on the synthetic cohort: for each ``replace_rate``, the
    median wait at the end of an epoch for the replacement thread, the epoch time and their ratio (the stall
    fraction), after the first epoch; a ``CacheDataset`` of every case is the reference.

    Args:
        n_cases: cohort size (75% training).
        image_size: network input size (the demo's voxel size, 7 x 7 x 8 mm).
        file_shape: voxels of the image files (default ``image_size``); a larger shape writes the same anatomy at a
            finer voxel size, which the bundle resamples to the demo's (``spacing``), so each volume the
            replacement thread loads costs what a real CT costs to decode and resample.
        backbone: MONAI ResNet depth.
        batch_size: cases per step.
        cache_rate: fraction of the training cases in the SmartCache.
        replace_rates: fractions of the cache replaced per epoch.
        epochs: epochs per run.
        device: ``auto``, ``cpu`` or ``cuda``.
        num_threads: torch CPU threads.
        seed: seed of the cohort and of the bundle.
        horizons: prediction horizons in years (default: chosen from the cohort's follow-up, see the module).
        censoring: censoring of the cohort (``uniform`` or ``none``: every case has an event).
        output: JSON file for the results.
    """
    from common.utils import default_amp

    dev, _ = tools.setup(device, num_threads, 0)
    size = [int(v) for v in image_size]
    s = {"device": dev, "amp": default_amp(dev), "batch_size": int(batch_size), "num_samples": 1}
    base = {
        "image_size": size,
        "backbone": backbone,
        "batch_size": int(batch_size),
        "lr_schedule": False,
        "seed": int(seed),
    }
    files = size if file_shape is None else [int(v) for v in file_shape]
    file_spacing = [sp * s_ / f for sp, s_, f in zip(DEMO_SPACING, size, files)]
    if files != size:
        base["spacing"] = list(DEMO_SPACING)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        csv = _make_cohort(Path(tmp) / "cohort", n_cases, files, file_spacing, seed=seed, censoring=censoring)
        print(
            f"cohort of {n_cases} volumes of {tools.shape_label(files)} written in {time.perf_counter() - start:.0f} s"
        )
        chosen = {
            "horizons": followup_horizons(csv, horizons),
            "num_intervals": cohort_intervals(csv, tools.train_config(BUNDLE)["num_intervals"]),
        }
        base.update(chosen)
        # replace_rate 0: the reference, a CacheDataset of every case in place of train.json's SmartCacheDataset
        settings = [(1.0, 0.0)] + [(float(cache_rate), float(r)) for r in replace_rates]
        runs = [
            _smartcache_setting(csv, Path(tmp) / f"run{i}", s, base, cache, replace, epochs)
            for i, (cache, replace) in enumerate(settings)
        ]
    summary = {
        "device": tools.device_name(dev),
        "image_size": size,
        "file_shape": files,
        "backbone": backbone,
        "batch": batch_size,
        "seed": int(seed),
        **chosen,
        "runs": runs,
    }
    _print_smartcache(runs)
    return tools.save_summary(summary, output)


def _smartcache_setting(csv: Path, work: Path, s: dict, base: dict, cache: float, replace: float, epochs: int) -> dict:
    """One run of ``mace_smartcache``: a SmartCacheDataset holding ``cache`` of the cases and replacing ``replace``
    of them per epoch, or with ``replace`` 0 the reference CacheDataset of every case."""
    dataset = {"train#dataset": CACHE_DATASET} if replace == 0 else {"replace_rate": replace}
    run = _smartcache_run(csv, work, s, {**base, "cache_rate": cache, **dataset}, epochs)
    return {**run, "cache_rate": cache, "replace_rate": replace}


def _print_smartcache(runs: list[dict]) -> None:
    """The report of ``mace_smartcache``: one Markdown row per run, the reference first."""
    tools.print_table(
        [
            "dataset",
            "cache_rate",
            "replace_rate",
            "cached cases",
            "epoch (s)",
            "s / iteration",
            "replacement wait (s)",
            "stall",
            "data wait",
        ],
        [
            [
                "CacheDataset" if run["replace_rate"] == 0 else "SmartCacheDataset",
                f"{run['cache_rate']:g}",
                f"{run['replace_rate']:g}",
                run["cached_cases"],
                f"{run['epoch_s']:.2f}",
                f"{run['epoch_s'] / max(run['iterations_per_epoch'], 1):.3f}",
                f"{run['replacement_wait_s']:.3f}",
                f"{run['stall_fraction']:.1%}",
                f"{run['data_wait']:.1%}",
            ]
            for run in runs
        ],
    )


MACE_HORIZONS = (1.0, 2.0)  # years: the evaluation horizons of the small mace_survival job
MACE_INTERVALS = 4  # logistic-hazard intervals of ``configs/tiny.json``


def mace_cohort_problems(
    csv_path: str | os.PathLike, horizons: Sequence[float] = MACE_HORIZONS, num_intervals: int = MACE_INTERVALS
) -> list[str]:
    """Why the ``mace_survival`` job cannot train and validate on the cohort at ``csv_path`` (empty: it can): the
    checks of the bundle's ``load_cohort`` on the CSV's own split (:func:`check_cohort`: events in both splits,
    ``horizons`` below every split's largest follow-up time and one inside the validation follow-up) and
    ``num_intervals`` distinct cut points from the training event times."""
    from common.survival.cohort import (
        CohortError,
        check_cohort,
        cut_points_from_quantiles,
        read_cohort_csv,
        split_cohort,
    )

    sections = split_cohort(read_cohort_csv(csv_path), use_split_column=True)
    problems = []
    try:
        check_cohort(sections, horizons=list(horizons))
    except CohortError as exc:
        problems += list(exc.problems)
    training = sections.get("training") or []
    if any(entry["event"] == 1 for entry in training):
        cuts = cut_points_from_quantiles([e["time"] for e in training], [e["event"] for e in training], num_intervals)
        if len(cuts) - 1 != num_intervals:
            problems.append(f"the training event times give {len(cuts) - 1} distinct intervals, not {num_intervals}")
    return problems


def mace_cohort(root: str | os.PathLike, seed: int = 0, tries: int = 100) -> tuple[Path, int]:
    """The small cohort of the ``mace_survival`` job under ``root``: ``(its CSV, its seed)``.

    16 cases are few: about one cohort seed in five gives a cohort the job cannot use (tied cut-point quantiles,
    no horizon inside the validation follow-up, a horizon beyond a split's follow-up, no validation event;
    :func:`mace_cohort_problems`). The cohort is the one of the first seed ``seed, seed + 1, ...`` without such a
    problem, so every ``seed`` gives a usable cohort and the same ``seed`` always gives the same one.

    Raises:
        RuntimeError: when none of ``tries`` consecutive seeds gives a usable cohort.
    """
    from common.demo.survival import make_mace_cohort

    problems: list[str] = []
    for cohort_seed in range(int(seed), int(seed) + tries):
        csv_path = make_mace_cohort(root, n_cases=16, shape=(24, 24, 20), spacing=(14, 14, 16), seed=cohort_seed)
        problems = mace_cohort_problems(csv_path)
        if not problems:
            return csv_path, cohort_seed
    raise RuntimeError(f"no usable mace_survival cohort for seeds {seed}..{seed + tries - 1}; the last: {problems}")


def fault_case(root: Path, seed: int) -> BundleCase:
    """The small ``mace_survival`` job of the fault tests (:func:`scripts.harness.faults.make_case`): the first usable
    16-case cohort from ``seed`` on (:func:`mace_cohort`; its seed becomes the job's), 3 epochs."""
    csv_path, seed = mace_cohort(root, seed)
    args = {"csv_path": str(csv_path), "horizons": list(MACE_HORIZONS), "max_epochs": 3, "val_interval": 3}
    return BundleCase(
        BUNDLE,
        ["train.json", "tiny.json"],
        {**args, **RUN_SETTINGS, "seed": seed},
        data=("csv_path", "horizons"),
        weights=("predictor",),
    )


BENCHMARKS = {"mace_smartcache": mace_smartcache, "mace_throughput": mace_throughput}

# the campaign's throughput rows (scripts/harness/campaign.py): (row name, benchmark, GPU settings, tiny settings)
THROUGHPUT = (
    (
        BUNDLE,
        "mace_throughput",
        {},
        {"image_size": [24, 24, 16], "backbone": "resnet10", "batch_size": 4, "n_cases": 24},
    ),
)

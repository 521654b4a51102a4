# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Settings checks read the values of the ids they name from the config being parsed (common.config_checks)."""

from __future__ import annotations

import importlib

import pytest
import torch
from monai.bundle import ConfigParser

from common.bundle import bundle_names, resolve_bundle
from common.bundle_tools.registry import describe
from common.config_checks import SettingsChecks, check_config, switches
from common.errors import SettingsError


def size_problems(patch_size, batch_size):
    problems = []
    if any(p % 4 for p in patch_size):
        problems.append(f"'patch_size' {patch_size} must be divisible by 4.")
    if batch_size < 1:
        problems.append(f"'batch_size' must be >= 1, got {batch_size}.")
    return problems


def rate_problems(lr):
    SEEN.append(lr)
    return [] if lr > 0 else [f"'lr' must be > 0, got {lr}."]


CHECKS = SettingsChecks("toy", size_problems, rate_problems, switches("amp_on", "compile"))
SEEN = []


def test_ids_are_the_parameters_of_the_checks_each_once():
    assert CHECKS.ids == ["patch_size", "batch_size", "lr", "amp_on", "compile"]
    assert CHECKS.with_checks(without=(rate_problems,)).ids == ["patch_size", "batch_size", "amp_on", "compile"]


def parsed(**overrides):
    """A config whose ``initialize`` runs the checks as a bundle's does; ``lr`` is an expression of another id."""
    parser = ConfigParser(
        {
            "imports": ["$import common", "$import common.config_checks"],
            "checks": CHECKS,
            "patch_size": [32, 32, 32],
            "batch_size": 2,
            "base_lr": 0.001,
            "lr": "$@base_lr * @batch_size",
            "amp_on": True,
            "compile": False,
            "check_settings": "$common.config_checks.check_config(@checks)",
            "network": {"_target_": "torch.nn.Identity"},
            "initialize": ["@check_settings", "@network"],
        }
    )
    parser.update(overrides)
    return parser


def test_the_check_gets_the_parsed_values_of_its_ids_from_the_config():
    SEEN.clear()
    checked, network = parsed(batch_size=4).get_parsed_content("initialize")
    assert checked is None and isinstance(network, torch.nn.Identity)  # the checks passed, and what follows ran
    assert SEEN == [0.004]  # the expression's value, with the override


@pytest.mark.parametrize(
    "overrides, lines",
    [
        ({"patch_size": [30, 32, 32]}, ["'patch_size' [30, 32, 32] must be divisible by 4."]),
        ({"base_lr": -1.0}, ["'lr' must be > 0, got -2.0."]),  # the expression's value, not its text
        (
            {"batch_size": 0, "compile": "false"},
            [
                "'batch_size' must be >= 1, got 0.",
                "'lr' must be > 0, got 0.0.",
                "'compile' must be True or False (write True/False on the command line), got 'false'.",
            ],
        ),
    ],
)
def test_every_problem_names_its_id_in_one_settings_error(overrides, lines):
    with pytest.raises(RuntimeError) as info:  # MONAI wraps what an expression raises
        parsed(**overrides).get_parsed_content("check_settings")
    error = info.value.__cause__
    assert isinstance(error, SettingsError) and isinstance(error, ValueError)
    assert str(error).splitlines() == ["invalid toy configuration:", *[f"  {line}" for line in lines]]


def test_a_check_of_an_id_the_config_lacks_is_an_error_in_the_check():
    parser = parsed()
    parser.get().pop("compile")
    with pytest.raises(
        KeyError,
        match=r"the settings check switches\('amp_on', 'compile'\) reads config id 'compile', which the config lacks",
    ):
        check_config(CHECKS, config=parser)


def test_a_parser_can_be_checked_from_a_notebook_with_values_replaced():
    parser = parsed()
    check_config(CHECKS, config=parser)
    with pytest.raises(SettingsError, match="'batch_size' must be >= 1, got 0."):
        check_config(CHECKS, config=parser, batch_size=0)
    with pytest.raises(TypeError, match=r"\['epochs'\] are not read by"):
        check_config(CHECKS, config=parser, epochs=3)
    with pytest.raises(RuntimeError, match="call it from a config, or pass config="):
        check_config(CHECKS)


def test_calling_the_checks_needs_every_id():
    CHECKS(patch_size=[8, 8, 8], batch_size=1, lr=0.1, amp_on=False, compile=True, unused=1)  # extras are not read
    with pytest.raises(TypeError, match=r"missing \['lr', 'amp_on', 'compile'\]"):
        CHECKS(patch_size=[8, 8, 8], batch_size=1)


# --- the checks of inference runs: shared ones (common/config_checks, common/networks/wrappers, common/data/pipeline)
# and each family's INFERENCE (common/<family>/settings.py)


@pytest.mark.parametrize("bundle", bundle_names())
def test_the_default_inference_settings_pass_their_checks(bundle):
    """The good case: a bundle's inference.json as shipped (its trained settings: train.json's defaults here)."""
    checks = importlib.import_module(f"{describe(bundle).package}.settings").INFERENCE
    parser = ConfigParser()
    parser.read_config(str(resolve_bundle(bundle) / "configs" / "inference.json"))
    parser["bundle_root"] = str(resolve_bundle(bundle))
    check_config(checks, config=parser)
    with pytest.raises(SettingsError, match=r"'num_workers' must be an integer >= 0 .*got -1\."):
        check_config(checks, config=parser, num_workers=-1)


def test_the_preamble_reports_the_overrides_and_the_settings_in_one_error():
    """A misspelt id and an invalid value given from Python (``parser.update``, as ``ConfigWorkflow`` merges them),
    and how the run computes (``amp``, ``memory_format``): one settings error, the overrides first."""
    from common.autoencoder.settings import TRAINING

    parser = ConfigParser()
    parser.read_config(str(resolve_bundle("autoencoder_3d") / "configs" / "train.json"))
    parser.update(
        {
            "bundle_root": str(resolve_bundle("autoencoder_3d")),
            "max_epoch": 5,
            "kl_weight": -1.0,
            "amp": "fp8",
            "memory_format": "nhwc",
        }
    )
    with pytest.raises(SettingsError) as info:
        check_config(TRAINING, config=parser)
    message = str(info.value)
    assert message.startswith("the overrides have problems:\n  'max_epoch' is not an id of"), message
    assert "did you mean 'max_epochs'" in message
    lines = message.split("invalid autoencoder configuration:\n")[1].splitlines()
    assert [line.strip().split(" ")[0] for line in lines] == ["'kl_weight'", "amp", "'memory_format'"], lines
    assert "'memory_format' must be one of ('contiguous', 'channels_last_3d'), got 'nhwc'." in message


def test_amp_and_memory_format_problems():
    from common.config_checks import amp_problems
    from common.networks.wrappers import memory_format_problems

    assert amp_problems("none", "cpu") == [] and memory_format_problems("channels_last_3d") == []
    assert amp_problems("fp8", "cpu")[0].startswith("amp must be one of")
    assert memory_format_problems("nhwc") == [
        "'memory_format' must be one of ('contiguous', 'channels_last_3d'), got 'nhwc'."
    ]


def test_run_problems():
    from common.config_checks import run_problems

    assert run_problems(0, None, 1800) == run_problems(4, 2, 0.5) == []
    assert run_problems(-1, 0, 0) == [
        "'num_workers' must be an integer >= 0 (data-loading processes; 0 loads in the main process), got -1.",
        "'num_threads' must be null (torch's default) or an integer >= 1 (CPU threads), got 0.",
        "'dist_timeout' must be a number of seconds > 0 (how long a rank waits for the others), got 0.",
    ]
    assert len(run_problems("2", True, "1800")) == 3  # command-line strings and booleans are not counts


def test_window_problems():
    from common.networks.wrappers import window_problems

    assert window_problems(1, 0) == window_problems(4, 0.25) == []
    assert window_problems(0, 1.0) == [
        "'sw_batch_size' must be an integer >= 1 (windows per forward pass), got 0.",
        "'overlap' must be a number in [0, 1) (the share of a window its neighbours cover), got 1.0.",
    ]
    assert len(window_problems(2.0, -0.1)) == 2 and len(window_problems(True, "0.5")) == 2


def test_spacing_and_orientation_problems():
    from common.data.pipeline import orientation_problems, spacing_problems

    assert spacing_problems(None) == spacing_problems([1, 1.5, 2.0]) == []
    assert spacing_problems([1.0, 0, 1.0]) == [
        "'spacing' must be null (keep each volume's voxel size) or 3 positive numbers (mm), got [1.0, 0, 1.0]."
    ]
    assert spacing_problems([1.0, 1.0]) and spacing_problems("1.0")
    assert orientation_problems(None) == orientation_problems("") == orientation_problems("RAS") == []
    assert orientation_problems("LPI") == orientation_problems("SAR") == []
    assert orientation_problems("RAR") == [
        "'orientation' must be null or 3 axis codes, one of each of L/R, P/A and I/S in capitals (e.g. 'RAS'), got "
        "'RAR'."
    ]
    assert orientation_problems("ras") and orientation_problems("RA") and orientation_problems(["R", "A", "S"])


def test_autoencoder_inference_checks():
    from common.autoencoder.settings import INFERENCE, latent_channel_problems, output_problems, patch_problems

    assert patch_problems([16, 16, 16], [8, 16, 16]) == []
    assert patch_problems([15, 15, 15], [8, 16, 16]) == [
        "'patch_size' [15, 15, 15] must be divisible by 4 on every axis (the autoencoder downsamples 2 times: one "
        "fewer than the levels of 'channels')."
    ]
    assert output_problems("reconstruct", "input") == output_problems("decode", "Normalized") == []
    assert output_problems("segment", "hu") == [
        "'mode' must be one of ('reconstruct', 'encode', 'decode') (what inference writes of each volume), got "
        "'segment'.",
        "'output_units' must be one of ['input', 'normalised'], got 'hu'.",
    ]
    assert latent_channel_problems(3) == [] and latent_channel_problems(0)
    assert {"patch_size", "channels", "sw_batch_size", "overlap", "mode", "output_units", "oom_backoff"} <= set(
        INFERENCE.ids
    )


def test_vqgan_inference_checks():
    from common.vqgan.settings import INFERENCE, downsample_problems

    assert downsample_problems([16, 16, 16], [4, 4, 4]) == []
    assert downsample_problems([15, 15, 15], [4, 4, 4]) == [
        "'patch_size' [15, 15, 15] must be divisible by the total downsampling 'downsample' [4, 4, 4] on every axis."
    ]
    assert downsample_problems([0, 16, 16], [4, 4, 4]) == ["'patch_size' must be 3 positive integers, got [0, 16, 16]."]
    assert {"patch_size", "downsample", "sw_batch_size", "overlap", "mode", "output_units"} <= set(INFERENCE.ids)


def test_diffusion_inference_checks():
    from common.diffusion.settings import INFERENCE, generation_problems, latent_problems, patch_problems

    assert patch_problems([16, 16, 16], [8, 16], [1, 1, 1]) == []
    assert patch_problems([15, 16, 16], [8, 16], [1, 1, 1]) == [
        "'patch_size' [15, 16, 16] must be divisible by 2 (the U-Net halves it 1 times) on every axis."
    ]
    assert patch_problems([16, 16, 16], [8, 16, 32], [4, 4, 4]) == []  # the U-Net's 4 times the latent's 4
    assert patch_problems([16, 16, 16], [8, 16, 32, 32], [4, 4, 4]) == [
        "'patch_size' [16, 16, 16] must be divisible by 8 (the U-Net halves it 3 times) times the autoencoder's "
        "downsampling [4, 4, 4] on every axis."
    ]
    assert generation_problems("translation", 4, [64, 64, 64], [8, 16], [1, 1, 1], 0) == []
    assert generation_problems("translation", 4, [63, 64, 64], [8, 16], [1, 1, 1], 0) == []  # padded: not whole
    assert generation_problems("unconditional", 0, [63, 64, 64], [8, 16], [1, 1, 1], -1) == [
        "'seed' must be an integer >= 0 (it seeds each case's sampling noise), got -1.",
        "'num_samples' must be an integer >= 1 (volumes generated), got 0.",
        "'sample_shape' [63, 64, 64] must be divisible by [2, 2, 2] on every axis (the U-Net halves it 1 times, "
        "times the autoencoder's downsampling [1, 1, 1]).",
    ]
    assert generation_problems("translation", 1, [64, 64], [8, 16], [1, 1, 1], 0) == [
        "'sample_shape' must be 3 positive integers, got [64, 64]."
    ]
    assert latent_problems(False, None, 0) == latent_problems(True, [4, 4, 4], 1) == []
    assert latent_problems(True, [4, 4], 0) == [
        "'latent_downsample' must be 3 positive integers, got [4, 4].",
        "'latent_sw_batch_size' must be an integer >= 1, got 0.",
    ]
    assert {"patch_size", "unet_channels", "space_downsample", "sw_batch_size", "overlap", "seed"} <= set(INFERENCE.ids)


def test_survival_inference_checks():
    from common.survival.settings import INFERENCE, image_size_problems, inference_batch_problems, split_problems

    assert image_size_problems([16, 16, 16]) == []
    assert image_size_problems([16, 16]) == ["'image_size' must be 3 positive integers, got [16, 16]."]
    assert inference_batch_problems(1) == []
    assert inference_batch_problems(0) == ["'batch_size' must be a positive integer (cases per forward pass), got 0."]
    assert split_problems(None) == split_problems("Test") == split_problems("validation") == []
    assert split_problems("holdout") == [
        "'split' must be one of train/training/val/validation/test/testing or null (every row), got 'holdout'."
    ]
    assert {"image_size", "batch_size", "split", "horizons", "crop_foreground"} <= set(INFERENCE.ids)


def test_xray2ct_inference_checks():
    from common.xray2ct.settings import (
        EVALUATION,
        INFERENCE,
        noise_problems,
        projection_problems,
        trained_mode_problems,
        trained_network_problems,
    )

    trained = {"view_size": [64, 64], "views": ["ap", "lateral"], "mode": "diffusion"}
    assert trained_network_problems(["ap", "lateral"], [64, 64], trained) == []
    assert trained_network_problems(["lateral", "ap"], [32, 32], trained) == [
        "'view_size' [32, 32] is not the view size the trained network was built for, [64, 64] ('view_size' of its "
        "run record, 'trained'): its X-ray encoder's patches and position embeddings fit that size only; leave "
        "view_size out or pass [64, 64].",
        "'views' ['lateral', 'ap'] are not the views the trained network was built for, ['ap', 'lateral'] ('views' "
        "of its run record, 'trained'), in that order.",
    ]
    assert trained_network_problems(["ap"], [64], trained)[0] == "'view_size' must be 2 positive integers, got [64]."
    # evaluation and inference: the weights run in their own mode, or the network-free baseline
    assert trained_mode_problems("diffusion", trained) == trained_mode_problems("backprojection", trained) == []
    assert trained_mode_problems("direct", {}) == []  # no record of the mode: nothing to compare with
    assert trained_mode_problems("direct", trained) == [
        "'mode' 'direct' is not the mode the trained network was trained in, 'diffusion' ('mode' of its run record, "
        "'trained'): run it in that mode, or 'backprojection' (no network)."
    ]
    assert trained_mode_problems("gan", trained)[0].startswith("'mode' must be one of")
    assert trained_mode_problems in EVALUATION.checks and trained_mode_problems in INFERENCE.checks
    parallel = ("parallel", 1000.0, 1500.0)
    assert projection_problems([-1000, 1000], 350.0, 0.2, *parallel) == []
    assert projection_problems([-500, 500], [350, 350, 300], 1, "cone", 400.0, 600.0) == []
    assert len(projection_problems([1000, -1000], [350, 0], 0, *parallel)) == 3
    assert projection_problems([-1000, 1000], 350.0, 0.2, "fan", 1.0, 1.0) == [
        "'geometry' must be one of ('parallel', 'cone'), got 'fan'."
    ]
    assert projection_problems([-1000, 1000], 350.0, 0.2, "cone", 300.0, 600.0) == [
        "'source_to_isocenter_mm' must put the cone beam's source outside the volume (> 303.1 mm, half the diagonal "
        "of fov_mm), got 300.0."
    ]
    assert projection_problems([-1000, 1000], 350.0, 0.2, "cone", 1000.0, 900.0) == [
        "'source_to_detector_mm' must be at least source_to_isocenter_mm 1000.0 (the detector is behind the "
        "patient), got 900.0."
    ]
    assert projection_problems([-1000, 1000], 350.0, 0.2, "cone", "far", None) == [
        "'source_to_isocenter_mm' must be a number of mm, got 'far'.",
        "'source_to_detector_mm' must be a number of mm, got None.",
    ]
    assert noise_problems(0.0, 0) == noise_problems(1, 7) == []
    assert noise_problems(1.5, "0") == [
        "'eta' must be a number in [0, 1] (0: deterministic DDIM), got 1.5.",
        "'seed' must be an integer >= 0 (it seeds each case's sampling noise), got '0'.",
    ]
    assert {"view_size", "vit_patch_size", "trained", "stage", "save_volumes"} <= set(INFERENCE.ids)

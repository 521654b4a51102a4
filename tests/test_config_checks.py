# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Settings checks read the values of the ids they name from the config being parsed (common.config_checks)."""

from __future__ import annotations

import pytest
import torch
from monai.bundle import ConfigParser

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
    with pytest.raises(KeyError, match="the settings check switches reads config id 'compile', which the config lacks"):
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

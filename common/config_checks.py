# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Settings checks that name each config id once, run by one preamble per workflow.

A check is a function whose parameters are the config ids it reads and which returns one problem line per invalid
value (an empty list when all is well). A family groups its checks in a :class:`SettingsChecks`
(``common/<family>/settings.py``), and every bundle config names them in one item, its preamble,
``"check_settings": "$common.config_checks.check_config(common.<family>.settings.TRAINING)"``, which its
``initialize`` runs first: :func:`check_config` checks the run's overrides (unknown ids, values of the wrong kind) and
hands every check the values of its ids from the config being parsed, so the config never lists them again. Which
function checks an id is read in ``common/<family>/settings.py`` at the name the preamble gives. A check reading an id
that the config lacks is an error in the check (a ``KeyError`` naming both), which ``tests/test_layout.py`` finds for
every bundle config.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from common.errors import SettingsError, install_user_error_hook
from common.networks.wrappers import memory_format_problems
from common.overrides import check_command_line, check_parsed_overrides
from common.runs import command_line, config_being_parsed, trained_problems
from common.utils import check_amp

__all__ = [
    "CASE_RUN_CHECKS",
    "RUN_CHECKS",
    "TRAINING_RUN_CHECKS",
    "SettingsChecks",
    "Switches",
    "amp_problems",
    "check_config",
    "choice_problems",
    "run_problems",
    "switches",
]

Check = Callable[..., list[str]]


class Switches:
    """A check that the on/off settings ``ids`` hold booleans: the command line reads ``true``/``false`` as strings,
    and the string ``"false"`` is true. Made by :func:`switches`; it reads the ids it holds (:attr:`ids`).

    Args:
        ids: the config ids of the switches.
    """

    def __init__(self, *ids: str) -> None:
        self.ids = tuple(ids)

    def __call__(self, **values: Any) -> list[str]:
        return [
            f"{name!r} must be True or False (write True/False on the command line), got {value!r}."
            for name, value in values.items()
            if not isinstance(value, bool)
        ]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Switches) and other.ids == self.ids

    def __hash__(self) -> int:
        return hash(self.ids)

    def __repr__(self) -> str:
        return f"switches{self.ids!r}"


def switches(*ids: str) -> Switches:
    """The check that the on/off settings ``ids`` hold booleans (:class:`Switches`)."""
    return Switches(*ids)


def _reads(check: Check) -> list[str]:
    """The config ids ``check`` reads: the ids of a :class:`Switches`, the named parameters of a function
    (``**kwargs`` catch-alls are not ids)."""
    if isinstance(check, Switches):
        return list(check.ids)
    return [
        name
        for name, parameter in inspect.signature(check).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]


def choice_problems(**choices: tuple[Any, Any]) -> list[str]:
    """A problem line for every config id given as ``id=(value, options)`` whose value is not one of its options."""
    return [
        f"{name!r} must be one of {tuple(options)}, got {value!r}."
        for name, (value, options) in choices.items()
        if value not in options
    ]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def run_problems(num_workers: int, num_threads: int | None, dist_timeout: float) -> list[str]:
    """The settings of how a command runs, shared by every bundle's inference: data-loading processes
    (``num_workers``, an integer >= 0; 0 loads in the main process), CPU threads (``num_threads``, ``null`` for torch's
    default or an integer >= 1) and the distributed collective timeout (``dist_timeout``, seconds > 0)."""
    problems = []
    if not _is_int(num_workers) or num_workers < 0:
        problems.append(
            f"'num_workers' must be an integer >= 0 (data-loading processes; 0 loads in the main process), got "
            f"{num_workers!r}."
        )
    if num_threads is not None and (not _is_int(num_threads) or num_threads < 1):
        problems.append(
            f"'num_threads' must be null (torch's default) or an integer >= 1 (CPU threads), got {num_threads!r}."
        )
    if isinstance(dist_timeout, bool) or not isinstance(dist_timeout, (int, float)) or not dist_timeout > 0:
        problems.append(
            f"'dist_timeout' must be a number of seconds > 0 (how long a rank waits for the others), got "
            f"{dist_timeout!r}."
        )
    return problems


def amp_problems(amp: str, device: Any) -> list[str]:
    """The mixed precision against the device it runs on (:func:`common.utils.check_amp`): a known mode the device
    computes in natively."""
    try:
        check_amp(amp, device)
    except ValueError as exc:
        return [str(exc)]
    return []


RUN_CHECKS = (amp_problems,)
"""The checks of how any run computes, in every family's checks: the mixed precision against the device."""

TRAINING_RUN_CHECKS = (*RUN_CHECKS, memory_format_problems)
"""The checks of how a training run computes, in every family's ``TRAINING`` checks: :data:`RUN_CHECKS` and the
memory layout (:func:`common.networks.wrappers.memory_format_problems`)."""

CASE_RUN_CHECKS = (
    *RUN_CHECKS,
    run_problems,
    switches("fail_fast", "overwrite", "verify_inputs", "allow_irregular_series", "progress", "distributed"),
)
"""The checks every ``inference.json`` runs on the settings of its run over cases (:class:`common.engines.cases.CaseRun`,
``docs/inference.md``): :data:`RUN_CHECKS`, :func:`run_problems` and its on/off settings; a family's ``INFERENCE``
checks hold them."""


class SettingsChecks:
    """The checks of one kind of run (a family's training, say), each reading the config ids it names.

    Calling it with every id's value (``checks(patch_size=[64, 64, 64], ...)``) runs every check and raises one
    ``ValueError`` listing every problem, headed ``invalid <subject> configuration:``.

    Args:
        subject: what the settings configure, for the error's heading (``"autoencoder"``).
        checks: the checks (see the module docstring).
    """

    def __init__(self, subject: str, *checks: Check) -> None:
        self.subject = subject
        self.checks = tuple(checks)

    @property
    def ids(self) -> list[str]:
        """The config ids read by the checks, each once, in the order the checks name them."""
        return list(dict.fromkeys(name for check in self.checks for name in _reads(check)))

    def with_checks(self, *checks: Check, without: tuple[Check, ...] = ()) -> SettingsChecks:
        """These checks less ``without``, plus ``checks`` (e.g. evaluation's variant of the training checks)."""
        return SettingsChecks(self.subject, *(c for c in self.checks if c not in without), *checks)

    def problems(self, **values: Any) -> list[str]:
        """The problem lines of every check, given the value of every id in :attr:`ids` (other entries of
        ``values`` are not read).

        Raises:
            TypeError: naming the ids missing from ``values``.
        """
        missing = [name for name in self.ids if name not in values]
        if missing:
            raise TypeError(f"the {self.subject} settings checks read {self.ids}: missing {missing}.")
        found: list[str] = []
        for check in self.checks:
            found += check(**{name: values[name] for name in _reads(check)})
        return found

    def report(self, problems: list[str]) -> str:
        """``problems`` under the heading ``invalid <subject> configuration:``, one line each."""
        return f"invalid {self.subject} configuration:\n  " + "\n  ".join(problems)

    def __call__(self, **values: Any) -> None:
        problems = self.problems(**values)
        if problems:
            raise ValueError(self.report(problems))

    def __repr__(self) -> str:
        return f"SettingsChecks({self.subject!r}, reads={self.ids})"


def _values(ids: list[str], config: Any, checks: SettingsChecks) -> dict[str, Any]:
    """The parsed values of ``ids`` from ``config`` (a ``ConfigParser`` or a ``ReferenceResolver``)."""
    resolver = getattr(config, "ref_resolver", config)
    if not resolver.items and hasattr(config, "parse"):
        config.parse()
    values = {}
    for name in ids:
        if resolver.normalize_id(name) not in resolver.items:
            readers = [
                repr(c) if isinstance(c, Switches) else c.__qualname__ for c in checks.checks if name in _reads(c)
            ]
            raise KeyError(f"the settings check {', '.join(readers)} reads config id {name!r}, which the config lacks.")
        values[name] = resolver.get_resolved_content(name)
    return values


def check_config(checks: SettingsChecks, config: Any = None, **given: Any) -> None:
    """The settings preamble of a bundle config, first thing in ``initialize``, before anything is built or written:
    the run's overrides (on the command line :func:`common.overrides.check_command_line`, from Python
    :func:`common.overrides.check_parsed_overrides`), then ``checks`` on the values of the ids they read and, in an
    evaluation or inference config, the trained settings against the run's (:func:`common.runs.trained_problems`).
    Every problem
    found goes into one :class:`common.errors.SettingsError` (on the command line: ``error: <message>``, exit
    status 1, the hook installed here; from Python it can be caught: MONAI raises it as the cause of a
    ``RuntimeError``).

    Args:
        checks: the family's checks, e.g. ``common.autoencoder.settings.TRAINING``.
        config: the ``monai.bundle.ConfigParser`` to read; default: the config being parsed
            (:func:`common.runs.config_being_parsed`), i.e. the one whose ``initialize`` runs this.
        given: values that replace the config's for these ids.

    Raises:
        SettingsError: listing every problem.
        KeyError: when a check reads an id that the config lacks (an error in the check, not in the settings).
        TypeError: when ``given`` names an id that no check reads.
        RuntimeError: when called outside a config's resolution without ``config``.
    """
    source = config if config is not None else config_being_parsed()
    if source is None:
        raise RuntimeError(
            "check_config reads the config being parsed: call it from a config, or pass config=<ConfigParser>."
        )
    unknown = [name for name in given if name not in checks.ids]
    if unknown:
        raise TypeError(f"{unknown} are not read by {checks!r}.")
    install_user_error_hook()
    values = {**_values([i for i in checks.ids if i not in given], source, checks), **given}  # parses the config
    messages = []
    try:
        if config is None and command_line() is not None:
            check_command_line()
        else:
            check_parsed_overrides(source)
    except SettingsError as exc:
        messages.append(str(exc))
    problems = checks.problems(**values) + trained_problems(source)
    if problems:
        messages.append(checks.report(problems))
    if messages:
        raise SettingsError("\n".join(messages))

# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Settings checks that name each config id once.

A check is a function whose parameters are the config ids it reads and which returns one problem line per invalid
value (an empty list when all is well). A family groups its checks in a :class:`SettingsChecks`
(``common/<family>/settings.py``), and a bundle runs them first in its ``initialize`` with one line,
``"$common.config_checks.check_config(common.<family>.settings.TRAINING)"``: :func:`check_config` hands every check the
values of its ids from the config being parsed, so the config never lists them again. A check reading an id that
the config lacks is an error in the check (a ``KeyError`` naming both), which ``tests/test_layout.py`` finds for every
bundle config.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from common.errors import SettingsError
from common.runs import config_being_parsed

__all__ = [
    "CASE_RUN_CHECKS",
    "SettingsChecks",
    "check_config",
    "choice_problems",
    "run_problems",
    "switches",
]

Check = Callable[..., list[str]]


def _reads(check: Check) -> list[str]:
    """The config ids ``check`` reads: its named parameters (``**kwargs`` catch-alls are not ids)."""
    return [
        name
        for name, parameter in inspect.signature(check).parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]


def switches(*ids: str) -> Check:
    """A check that the on/off settings ``ids`` hold booleans: the command line reads ``true``/``false`` as strings,
    and the string ``"false"`` is true.

    Args:
        ids: the config ids of the switches.
    """

    def check(**values: Any) -> list[str]:
        return [
            f"{name!r} must be True or False (write True/False on the command line), got {value!r}."
            for name, value in values.items()
            if not isinstance(value, bool)
        ]

    check.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in ids]
    )
    check.__name__ = check.__qualname__ = "switches"
    return check


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


CASE_RUN_CHECKS = (
    run_problems,
    switches("fail_fast", "overwrite", "allow_irregular_series", "progress", "distributed"),
)
"""The checks every ``inference.json`` runs on the settings of its run over cases (:class:`common.engines.cases.CaseRun`,
``docs/inference.md``): :func:`run_problems` and its on/off settings; a family's ``INFERENCE`` checks hold them."""


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

    def __call__(self, **values: Any) -> None:
        problems = self.problems(**values)
        if problems:
            raise ValueError(f"invalid {self.subject} configuration:\n  " + "\n  ".join(problems))

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
            readers = [c.__qualname__ for c in checks.checks if name in _reads(c)]
            raise KeyError(f"the settings check {', '.join(readers)} reads config id {name!r}, which the config lacks.")
        values[name] = resolver.get_resolved_content(name)
    return values


def check_config(checks: SettingsChecks, config: Any = None, **given: Any) -> None:
    """Run ``checks`` on the values of the ids they read, first thing in ``initialize``, before anything is built or
    written; a problem becomes a :class:`common.errors.SettingsError` whose message names every invalid id (on the
    command line: ``error: <message>``, exit status 1).

    Args:
        checks: the family's checks, e.g. ``common.autoencoder.settings.TRAINING``.
        config: the ``monai.bundle.ConfigParser`` to read; default: the config being parsed
            (:func:`config_being_parsed`), i.e. the one whose ``initialize`` runs this.
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
    values = {**_values([i for i in checks.ids if i not in given], source, checks), **given}
    try:
        checks(**values)
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc

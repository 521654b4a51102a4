# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""User errors: problems of the input, settings or files (not bugs), which a bundle command reports as one message
at the end of its output instead of a traceback. Importing this module imports nothing heavy (no torch)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "INTERRUPTED",
    "MissingInputError",
    "OutOfMemoryBackoffError",
    "SettingsError",
    "UserError",
    "install_user_error_hook",
    "user_error_in_chain",
]


class UserError(ValueError):
    """Base of the errors that describe a problem of the user's input, settings or files (not a bug): a bundle
    command that fails with one ends with its message as the last line and exit status 1, without a traceback
    (:func:`install_user_error_hook`).

    Library and workflow code only raise it, so a notebook or a ``ConfigWorkflow`` user can catch it. MONAI wraps
    an error raised while a config item is evaluated in a ``RuntimeError`` whose cause is the original error:
    :func:`user_error_in_chain` finds it there.
    """


class SettingsError(UserError):
    """A bundle's settings (its config ids) are invalid or do not fit together, or weights do not fit them."""


class OutOfMemoryBackoffError(UserError, MemoryError):
    """A training step or a sliding-window inference ran out of GPU memory with nothing left to reduce (one sample
    per micro-batch or one window per batch, gradient checkpointing on or unsupported), or with the backoff turned
    off (``oom_backoff`` False); the message names the step and what was tried."""


def user_error_in_chain(exc: BaseException | None) -> UserError | None:
    """The :class:`UserError` that is ``exc`` or its explicit cause (``raise ... from``: MONAI wraps errors raised
    while a config expression is evaluated in a ``RuntimeError``), or ``None``. An error raised while handling a
    user error (its implicit context) is a bug and keeps its traceback."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__
    return None


#: the line an interrupted command ends with (Ctrl-C: what a bundle wrote is complete, and its restart goes on)
INTERRUPTED = "interrupted: what was written is complete; run the same command again to go on."


def _last_line(line: str) -> None:
    """``line`` on stderr in one write, so that the ranks of a torchrun job sharing one stderr never mix their lines
    (``print`` writes the text and the newline apart)."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def install_user_error_hook() -> None:
    """Make an uncaught :class:`UserError` (or an error caused by one) end the process with ``error: <message>``
    on stderr as the last line (exit status 1) instead of a traceback, and Ctrl-C (``KeyboardInterrupt``) with the
    one line :data:`INTERRUPTED` (Python then ends the process by SIGINT: exit status 130 in a shell); other
    exceptions - bugs - keep their traceback. Installed once per process by the bundles' first ``initialize``
    step."""
    previous = sys.excepthook
    if getattr(previous, "user_errors", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            _last_line(INTERRUPTED)
            return
        error = user_error_in_chain(value)
        if error is None:
            previous(kind, value, tb)
            return
        _last_line(f"error: {error}")

    hook.user_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class MissingInputError(FileNotFoundError, UserError):
    """A file or folder the command needs is not there (no input volumes, no trained weights)."""


class BundleNotFoundError(MissingInputError):
    """A bundle named or given by path that is not there (no ``configs/metadata.json``); the message lists the
    bundles that are."""

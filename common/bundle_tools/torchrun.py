# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""``python -m common.bundle_tools.torchrun ...``: torchrun (``python -m torch.distributed.run``, the same arguments),
except when a signal stops it.

Ctrl-C, a scheduler's preemption or a Kubernetes termination reaches torchrun's agent as a signal, which it passes on
to the ranks and then reports as a ``SignalException`` traceback with exit status 1. The ranks of these bundles
already say what they kept (one ``interrupted: ...`` line each, :func:`common.errors.install_user_error_hook`).
This entry point ends the agent with one line naming the signal and the shell's status for it, ``128 + signal
number`` (130 for Ctrl-C), so that a script or scheduler sees an interruption, not a failure. ``scripts/launch.py``
runs it.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun

__all__ = ["main"]


def main(args: list[str] | None = None) -> int:
    """Run torchrun with ``args`` (default: the command line); returns 0, or ``128 + signal number`` when a signal
    stopped it (torchrun's own failures raise as they do under torchrun)."""
    try:
        torchrun(args)
    except SignalException as e:
        name = signal.Signals(int(e.sigval)).name
        print(f"torchrun: stopped by {name}; the ranks' lines above say what each kept.", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

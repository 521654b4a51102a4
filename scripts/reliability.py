# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Fault injection and fuzzing for every bundle: crashes, full disks, non-finite losses, dying ranks, hostile
input, and a long run's memory (the harness: ``scripts/harness/faults.py``; each bundle's small job:
``fault_case`` of its module in ``scripts/harness``)::

    python scripts/reliability.py faults --bundle autoencoder_3d --workdir /tmp/rel [--processes 2]
    python scripts/reliability.py fuzz --cases 500
    python scripts/reliability.py soak --iterations 3000 --workdir /tmp/soak
    python scripts/reliability.py report --workdir /tmp/rel --fuzz_cases 500 --soak_iterations 3000
"""

from __future__ import annotations

if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    from scripts.harness.faults import faults, fuzz, report, soak

    fire.Fire({"faults": faults, "fuzz": fuzz, "soak": soak, "report": report})

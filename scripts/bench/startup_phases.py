#!/usr/bin/env python
"""Where one accel-train run's start-up goes: wall (and CPU) seconds per phase, measured in
this process by timing the imports and wrapping each phase's function with perf_counter.

    python scripts/bench/startup_phases.py +debug=fast_dev_run dataset=synthetic \\
        hydra.run.dir=/tmp/x

Arguments are accel-train's. The table goes to stderr at exit (BENCHMARKS.md section 9).
"""

# ruff: noqa: E402 - the imports below are what is being timed
from __future__ import annotations

import atexit
import contextlib
import functools
import sys
import time

T0, C0 = time.perf_counter(), time.process_time()
phases: dict[str, tuple[float, float, int]] = {}  # label -> (wall s, CPU s, calls)


def timed_import(label: str, started: float) -> None:
    phases[label] = (time.perf_counter() - started, 0.0, 1)


t = time.perf_counter()
import hydra._internal.hydra as hydra_internal

import accel_train.cli as cli

timed_import("import hydra + accel_train.cli", t)
t = time.perf_counter()
import torch  # noqa: F401

timed_import("import torch", t)
t = time.perf_counter()
import accel_train.launch.launcher as launcher

timed_import("import the launcher chain (distributed, FSDP, dynamo)", t)
import accel_train.train.loop as loop


def wrap(owner: object, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            w, c, n = phases.get(label, (0.0, 0.0, 0))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            phases[label] = (w + wall, c + cpu, n + 1)

    setattr(owner, name, timed)


wrap(hydra_internal.Hydra, "compose_config", "Hydra compose_config")
wrap(launcher, "validate", "validate")
wrap(launcher, "resolve", "resolve")
wrap(launcher, "write_run_config", "write_run_config (and config_tree.txt)")
wrap(launcher, "_startup_tree", "the start-up tree (a compose + rich)")
wrap(launcher, "run_worker", "run_worker (build + fit)")
wrap(loop, "build_components", "  build_components")
wrap(loop.Loop, "fit", "  Loop.fit")
wrap(loop.Loop, "_train", "    training")
wrap(loop.Loop, "_test", "    the test pass")


def report() -> None:
    for label, (wall, cpu, calls) in phases.items():
        print(f"{wall:7.2f} s wall {cpu:6.2f} s CPU  x{calls}  {label}", file=sys.stderr)
    total, cpu = time.perf_counter() - T0, time.process_time() - C0
    print(f"{total:7.2f} s wall total (process CPU {cpu:.2f} s)", file=sys.stderr)


atexit.register(report)
sys.argv = ["accel-train", *sys.argv[1:]]
with contextlib.suppress(SystemExit):
    cli.train()

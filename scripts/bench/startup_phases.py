#!/usr/bin/env python
"""Where one accel-train run's start-up goes: wall (and CPU) seconds per phase, measured in
this process by timing the imports and wrapping each phase's function with perf_counter.

    python scripts/bench/startup_phases.py +debug=fast_dev_run dataset=synthetic \\
        hydra.run.dir=/tmp/x

Arguments are accel-train's. The table goes to stderr at exit (BENCHMARKS.md section 9); with
ACCEL_PHASES_JSON=<file> also as JSON ({label: [wall s, CPU s, calls]}, and "total"), which
startup.py reads to report each phase's median beside the ratio.
"""

# ruff: noqa: E402 - the imports below are what is being timed
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import time

T0, C0 = time.perf_counter(), time.process_time()
phases: dict[str, tuple[float, float, int]] = {}  # label -> (wall s, CPU s, calls)


def timed_import(label: str, started: float) -> None:
    phases[label] = (time.perf_counter() - started, 0.0, 1)


t = time.perf_counter()
import hydra._internal.config_loader_impl as config_loader

import accel_train.cli as cli

timed_import("import hydra + accel_train.cli", t)
t = time.perf_counter()
import torch  # noqa: F401

timed_import("import torch", t)
t = time.perf_counter()
import accel_train.launchers.launch as launcher
import accel_train.launchers.torchrun as local_launch

timed_import("import the launcher chain (distributed, FSDP, dynamo)", t)
import accel_train.techniques.speed as speed
import accel_train.train.build as build
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


# Every compose Hydra really does (a config handed on without composing is not one).
wrap(config_loader.ConfigLoaderImpl, "load_configuration", "Hydra composes the config")
wrap(launcher, "validate", "validate")
wrap(launcher, "resolve", "resolve")
wrap(local_launch, "write_run_config", "write_run_config (and config_tree.txt)")
wrap(local_launch, "launch_tree", "the start-up tree (defaults from the options' files)")
wrap(local_launch, "run_worker", "run_worker (build + fit)")
wrap(loop, "build_components", "  build_components")
# The first FLOP count imports torch._dynamo (~0.5 s), as any first optimizer would.
wrap(speed, "training_flops_per_sample", "    FLOP count (imports torch._dynamo)")
wrap(build, "build_optimizer", "    build_optimizer")
wrap(loop.Loop, "fit", "  Loop.fit")
wrap(loop.Loop, "_train", "    training")
wrap(loop, "test_pass", "    the test pass")


def report() -> None:
    for label, (wall, cpu, calls) in phases.items():
        print(f"{wall:7.2f} s wall {cpu:6.2f} s CPU  x{calls}  {label}", file=sys.stderr)
    total, cpu = time.perf_counter() - T0, time.process_time() - C0
    print(f"{total:7.2f} s wall total (process CPU {cpu:.2f} s)", file=sys.stderr)
    if os.environ.get("ACCEL_PHASES_JSON"):
        out = {label: list(v) for label, v in phases.items()} | {"total": [total, cpu, 1]}
        with open(os.environ["ACCEL_PHASES_JSON"], "w") as f:
            json.dump(out, f)


atexit.register(report)
sys.argv = ["accel-train", *sys.argv[1:]]
with contextlib.suppress(SystemExit):
    cli.train()

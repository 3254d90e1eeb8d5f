"""What the test suite's warm CLI (tests/warm_cli.py) saves a CLI run: CPU and wall seconds of
the same commands forked from the warm parent and started as a new interpreter, alternated.

    python scripts/bench/warm_cli.py --rounds 5

Commands: a 4-step training run of the suite's FAST recipe, the same run's accel-eval, a
refusal (`trainer.max_epochs=-1`) and a 2-process DDP run (torchrun's workers fork from the warm
parent too). CPU seconds are the run's own and its children's (the fork's
from the warm parent's wait4, the new interpreter's from RUSAGE_CHILDREN); medians of the rounds.
The warm parent's own start (once per pytest process) is reported apart.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path.insert(0, str(TESTS))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the suite's conftest.py sets it

import helpers  # noqa: E402
import warm_cli  # noqa: E402


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _commands(cwd: Path) -> dict[str, tuple[str, list[str]]]:
    run = cwd / "run"
    ddp = cwd / f"ddp-{time.monotonic_ns()}"  # a new run dir each time
    return {
        "train (4 steps)": ("accel-train", [*helpers.FAST, "trainer.max_epochs=1",
                                            f"hydra.run.dir={run}"]),
        "accel-eval": ("accel-eval", [f"ckpt_path={run}/checkpoints/best.pt"]),
        "refusal": ("accel-train", ["trainer.max_epochs=-1"]),
        # torchrun's two workers: forked too on the warm side (warm_cli.worker_stub)
        "ddp, 2 processes (2 steps)": ("accel-train", [*helpers.FAST, "trainer.max_epochs=1",
                                                       "launcher.nproc_per_node=2", "strategy=ddp",
                                                       f"hydra.run.dir={ddp}"]),
    }  # fmt: skip


def _once(prog: str, args: list[str], cwd: Path, warm: bool) -> tuple[float, float]:
    cpu0, warm0, t0 = _children_cpu(), warm_cli.CHILD_CPU_S[0], time.monotonic()
    proc = helpers.run_cli(args, cwd, prog=prog, warm=warm, timeout=600)
    wall = time.monotonic() - t0
    if proc.returncode not in (0, 2):
        raise SystemExit(f"{prog} {args} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return _children_cpu() - cpu0 + warm_cli.CHILD_CPU_S[0] - warm0, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    helpers.BASE_ENV.update(helpers.base_env())  # as conftest.py does
    t0 = time.monotonic()
    helpers.warm_server()
    print(f"warm parent start: {time.monotonic() - t0:.2f} s wall (once per pytest process)")
    results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    cwd = Path(tempfile.mkdtemp(prefix="warm-bench-"))
    for _ in range(rounds):
        for warm in (True, False):  # alternated: the machine's load hits both alike
            for name, (prog, args) in _commands(cwd).items():
                results.setdefault((name, warm), []).append(_once(prog, args, cwd, warm))
    print("| command | new interpreter: CPU s, wall s | warm fork: CPU s, wall s | CPU ratio |")
    print("|---|---|---|---|")
    for name in _commands(cwd):
        (fc, fw), (wc, ww) = (
            [statistics.median(v) for v in zip(*results[(name, w)], strict=True)]
            for w in (False, True)
        )
        print(f"| {name} | {fc:.2f}, {fw:.2f} | {wc:.2f}, {ww:.2f} | {wc / fc:.2f} |")


if __name__ == "__main__":
    main()

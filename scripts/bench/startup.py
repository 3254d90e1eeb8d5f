"""Start-up cost: `accel-train +debug=fast_dev_run dataset=synthetic` (a whole smoke run: compose,
validate, build, 2 training + 2 validation batches, the test pass, checkpoints) against
`python -c "import torch"`, and against the least a hand-written torch training script pays
before its first step (import torch and build an optimizer, which imports torch._dynamo).

The variants alternate, round after round, so that a change in the machine's load hits all of
them; the medians of wall and CPU seconds (user + system, from the child's rusage) and their
ratios are printed with the load average.

python scripts/bench/startup.py --rounds 7
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time

from _common import console_script, load_avg, machine, median, table

OPTIMIZER = "import torch; torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])"


def measure(cmd: list[str], cwd: str) -> tuple[float, float]:
    """(wall s, CPU s = user + sys) of one run of cmd."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args()
    work = tempfile.mkdtemp(prefix="accel_bench_startup_")
    variants = {
        "import torch": [sys.executable, "-c", "import torch"],
        "import torch + an optimizer": [sys.executable, "-c", OPTIMIZER],
        "accel-train +debug=fast_dev_run": [
            console_script("accel-train"),
            "+debug=fast_dev_run",
            "dataset=synthetic",
        ],
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    loads = [load_avg()]
    for r in range(a.rounds):
        for name, cmd in variants.items():
            times[name].append(measure(cmd, work))
        loads.append(load_avg())
        print(f"round {r + 1}/{a.rounds} done; load {loads[-1]}", file=sys.stderr)
    base_wall = median([w for w, _ in times["import torch"]])
    base_cpu = median([c for _, c in times["import torch"]])
    rows = []
    for name, runs in times.items():
        wall, cpu = median([w for w, _ in runs]), median([c for _, c in runs])
        rows.append(
            [name, f"{wall:.2f}", f"{cpu:.2f}", f"{wall / base_wall:.2f}", f"{cpu / base_cpu:.2f}"]
        )
    print(machine())
    print(f"load average before / after each round: {' | '.join(loads)}")
    print(f"medians of {a.rounds} alternating rounds (cwd {work})")
    print(table(["command", "wall s", "CPU s", "wall / torch", "CPU / torch"], rows))


if __name__ == "__main__":
    main()

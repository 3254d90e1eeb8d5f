"""Start-up cost: `accel-train +debug=fast_dev_run logger=none` (a whole smoke run: compose,
validate, build, one training, one validation and one test batch) against
`python -c "import torch"` (the bar: at most 2.0x), and against the least a hand-written torch
training script pays before its first step (import torch and build an optimizer, which imports
torch._dynamo).

The variants alternate, round after round, so that a change in the machine's load hits all of
them; the medians of wall and CPU seconds (user + system, from the child's rusage) and their
ratios are printed with the load average. Each round also runs the same command under
startup_phases.py (not counted in the ratio) and the median of each phase is printed.
`--compare SRC` adds the same command run from another checkout's `src` (PYTHONPATH=SRC, e.g.
a `git worktree` of the commit before) to the alternation: before and after in the same rounds.

`--extra ARGS` appends overrides to the command, e.g. `--extra "launcher.nproc_per_node=2"`: a
2-process DDP smoke run through torchrun, whose workers (`python -m accel_train.worker`) inherit
PYTHONPATH, so `--compare` times the other checkout's workers too.

`--refusal` times a config the checks refuse instead (`accel-train trainer.max_epochs=-1`: one
paragraph and exit 2, BENCHMARKS.md section 38); each run must fail with its paragraph, and the
phases are skipped.

python scripts/bench/startup.py --rounds 7 [--compare /tmp/before/src] [--extra "k=v k2=v2"]
python scripts/bench/startup.py --rounds 5 --refusal --compare /tmp/before/src

Byte-compile an editable install first (`python -m compileall -q src`), as `pip install .` does at
install time and CI does: with PYTHONDONTWRITEBYTECODE set, every run otherwise compiles
accel_train's modules again (~0.2 s here).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import console_script, load_avg, machine, median, table

RUN = ["+debug=fast_dev_run", "logger=none"]  # the command the bar is about
REFUSAL = ["trainer.max_epochs=-1"]  # refused by the config checks: its paragraph says
REFUSED = "nothing to train"
PHASES = str(Path(__file__).with_name("startup_phases.py"))

OPTIMIZER = "import torch; torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])"


def measure(
    cmd: list[str], cwd: str, env: dict | None = None, refused: bool = False
) -> tuple[float, float]:
    """(wall s, CPU s = user + sys) of one run of cmd (`refused`: it must fail, in a paragraph)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if refused and (proc.returncode == 0 or REFUSED not in proc.stderr):
        sys.exit(f"{' '.join(cmd)} was not refused ({proc.returncode}):\n{proc.stderr[-2000:]}")
    if not refused and proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", help="another checkout's src dir, run the same way")
    parser.add_argument("--no-phases", action="store_true", help="skip startup_phases.py")
    parser.add_argument("--extra", default="", help="overrides appended to the command")
    parser.add_argument("--refusal", action="store_true", help="time a refused config instead")
    a = parser.parse_args()
    run = [*(REFUSAL if a.refusal else RUN), *a.extra.split()]
    work = tempfile.mkdtemp(prefix="accel_bench_startup_")
    script = console_script("accel-train")
    variants: dict[str, tuple[list[str], dict | None]] = {
        "import torch": ([sys.executable, "-c", "import torch"], None),
        "import torch + an optimizer": ([sys.executable, "-c", OPTIMIZER], None),
        "accel-train " + " ".join(run): ([sys.executable, script, *run], None),
    }
    if a.compare:
        other = dict(os.environ, PYTHONPATH=str(Path(a.compare).resolve()))
        # That checkout's console script: cli.main where it has one, else cli.train (older).
        entry = "import accel_train.cli as c; sys.exit((getattr(c, 'main', None) or c.train)())"
        cmd = [sys.executable, "-c", f"import sys; sys.argv[0] = 'accel-train'; {entry}"]
        variants[f"the same from {a.compare}"] = ([*cmd, *run], other)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    phases: list[dict[str, list[float]]] = []
    loads = [load_avg()]
    for r in range(a.rounds):
        for name, (cmd, env) in variants.items():
            refused = a.refusal and name.startswith(("accel-train", "the same"))
            times[name].append(measure(cmd, work, env, refused))
        if not (a.no_phases or a.refusal):
            out = Path(work) / f"phases{r}.json"
            env = dict(os.environ, ACCEL_PHASES_JSON=str(out))
            phased = [sys.executable, PHASES, *run, f"hydra.run.dir={work}/phases{r}"]
            wall, cpu = measure(phased, work, env)
            got = json.loads(out.read_text())
            # The child's whole life less what its timer saw: the interpreter's start and its
            # teardown (startup_phases.py calls cli.train, which tears down as usual).
            got["outside the timer: interpreter start + teardown"] = [
                wall - got["total"][0],
                cpu - got["total"][1],
                1,
            ]
            phases.append(got)
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
    if phases:
        print(f"\nphases of `{' '.join(run)}` under startup_phases.py (medians of {len(phases)}):")
        prows = []
        for label in phases[-1]:
            got = [p[label] for p in phases if label in p]
            wall, cpu = median([g[0] for g in got]), median([g[1] for g in got])
            prows.append([label, f"{wall:.2f}", f"{cpu:.2f}", str(int(got[-1][2]))])
        print(table(["phase", "wall s", "CPU s", "calls"], prows))


if __name__ == "__main__":
    main()

"""`trainer.tune_malloc=true` vs `false`: per-epoch train time through the real CLI, alternating.

python scripts/bench/malloc.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _common import (
    child_env,
    console_script,
    epoch_times,
    load_avg,
    machine,
    median,
    run_child,
    table,
)


def run(a: argparse.Namespace, precision: str, tuned: bool) -> tuple[list[float], dict]:
    run_dir = Path(tempfile.mkdtemp(prefix="accel_bench_malloc_"))
    cmd = [
        console_script("accel-train"),
        "dataset=mnist",
        f"paths.data_dir={a.data_dir}",
        "model=mnist_cnn",
        "loader=device",
        f"precision={precision}",
        f"trainer.max_epochs={a.epochs}",
        "trainer.val_every_n_epochs=1000",
        "trainer.limit_val_batches=1",
        "trainer.progress=none",
        "logger=none",
        f"trainer.tune_malloc={str(tuned).lower()}",
        f"hydra.run.dir={run_dir}",
    ]
    proc, usage = run_child(cmd, child_env(None))  # no MALLOC_* variables: the switch alone
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return epoch_times(run_dir)[1:], usage  # first epoch is warm-up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[3] / "shared/data"))
    p.add_argument("--epochs", type=int, default=3, help="per run; the first is dropped")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(f"machine: {machine()}; load average at start: {load_avg()}")
    rows = []
    for precision in ("fp32", "amp"):
        times: dict[bool, list[float]] = {True: [], False: []}
        faults: dict[bool, list[int]] = {True: [], False: []}
        for r in range(a.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for tuned in order:
                epochs, usage = run(a, precision, tuned)
                times[tuned] += epochs
                faults[tuned].append(usage["minflt"])
                print(
                    f"round {r + 1}/{a.rounds} {precision} tune_malloc={tuned}: epochs "
                    f"{' '.join(f'{t:.2f}' for t in epochs)} s, {usage['minflt'] // 1000}k "
                    "page faults",
                    flush=True,
                )
        off, on = median(times[False]), median(times[True])
        rows.append(
            [
                precision,
                f"{off:.3f}",
                f"{on:.3f}",
                f"{off / on:.2f}x",
                f"{median(faults[False]) / 1000:.0f}k / {median(faults[True]) / 1000:.0f}k",
            ]
        )
    print()
    print(
        table(
            [
                "precision",
                "tune_malloc=false s/epoch",
                "tune_malloc=true s/epoch",
                "speed-up",
                "page faults/run off / on",
            ],
            rows,
        )
    )
    print(f"{a.rounds} alternating rounds; load average at end: {load_avg()}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Accuracy: `accel-train +experiment=mnist_amp` on real MNIST, then `accel-eval` on it.

Runs, as subprocesses through the real console scripts:

    accel-train +experiment=mnist_amp paths.data_dir=DATA hydra.run.dir=RUN [EXTRA overrides]
    accel-eval ckpt_path=RUN/checkpoints/best.pt
    accel-eval ckpt_path=RUN/checkpoints/last.pt

and prints the official 10,000-image test-set accuracy of both checkpoints, the epochs and steps
trained and the wall times. best.pt is the epoch with the best accuracy on the validation split
held out of the training data (dataset.val_fraction, 500 of the 5,000 images by default): the
test set plays no part in training or selection. The run's own test pass
(trainer.test_after_fit) must agree with accel-eval on best.pt. Bar: best.pt test accuracy
>= 98.0%.

Extra arguments after the options are passed to accel-train as overrides, e.g.
    accuracy.py trainer.max_epochs=4 precision=fp32
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_DATA_DIR,
    REPO,
    child_env,
    console_script,
    load_avg,
    machine,
    run_child,
    run_cli,
    table,
)

BAR = 0.98


def evaluate(ckpt: Path, threads: int | None) -> tuple[dict, float]:
    out = ckpt.parent.parent / f"eval_{ckpt.stem}.json"
    cmd = [console_script("accel-eval"), f"ckpt_path={ckpt}", f"out_path={out}"]
    proc, usage = run_child(cmd, child_env(threads))
    wall = usage["wall"]
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        sys.exit(f"accel-eval failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(out.read_text()), wall


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"default {DEFAULT_DATA_DIR}")
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="the run directory (default: outputs/bench_accuracy/<date>_<time> in the repo)",
    )
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: torch's)")
    p.add_argument("overrides", nargs="*", help="extra accel-train overrides")
    a = p.parse_args()
    run_dir = a.run_dir or REPO / "outputs" / "bench_accuracy" / datetime.datetime.now().strftime(
        "%Y-%m-%d_%H-%M-%S-%f"
    )

    print(f"machine: {machine()}; load average at start: {load_avg()}", flush=True)
    train_cmd = ["+experiment=mnist_amp", f"paths.data_dir={a.data_dir}", *a.overrides]
    print(f"accel-train {' '.join(train_cmd)} hydra.run.dir={run_dir}", flush=True)
    run_dir, usage = run_cli(train_cmd, threads=a.threads, run_dir=run_dir)
    train_wall = usage["wall"]
    summary = json.loads((run_dir / "summary.json").read_text())

    rows, best_acc = [], None
    for name in ("best", "last"):
        result, eval_wall = evaluate(run_dir / "checkpoints" / f"{name}.pt", a.threads)
        acc = result["test/acc"]
        if name == "best":
            best_acc = acc
        rows.append(
            [
                f"{name}.pt",
                str(result["epoch"]),
                str(result["num_samples"]),
                f"{100 * acc:.2f}%",
                f"{result['test/loss']:.4f}",
                f"{eval_wall:.1f}",
            ]
        )
    print()
    print(f"run dir: {run_dir}")
    val = [
        (row["epoch"], row["val/acc"])
        for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "val/acc" in row
    ]
    first = next((e for e, acc in val if acc >= BAR), None)
    print(
        f"trained {summary['epochs']} epochs, {summary['steps']} steps, {summary['precision']}; "
        f"fit wall {summary['wall_s']:.1f} s (training + per-epoch validation + checkpoints; "
        f"the accel-train command took {train_wall:.1f} s incl. start-up), "
        f"{summary['train_samples_per_s']:.0f} train samples/s"
    )
    print(
        f"the run's own test pass ({summary.get('test_ckpt')}.pt): "
        f"test/acc {100 * summary.get('test_acc', float('nan')):.2f}%"
    )
    print("val/acc by epoch: " + ", ".join(f"{e}: {100 * acc:.2f}%" for e, acc in val))
    print(
        f"first epoch with val/acc >= {100 * BAR:.1f}%: {first if first is not None else 'none'}\n"
    )
    print(
        table(
            ["checkpoint", "epochs done", "test images", "test acc", "test loss", "eval wall s"],
            rows,
        )
    )
    ok = best_acc is not None and best_acc >= BAR
    print(f"\nbar: best.pt test accuracy >= {100 * BAR:.1f}%: {'PASS' if ok else 'FAIL'}")
    print(f"load average at end: {load_avg()}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

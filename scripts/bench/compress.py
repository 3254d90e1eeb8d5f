#!/usr/bin/env python
"""Compression techniques on real MNIST (the 5,000-image training subset, the 10,000-image test
set): does distillation help a small student, what pruning costs in accuracy, and what
selective backprop saves in time. Every run goes through the real CLI:

    teacher:   accel-train model=mnist_cnn dataset=mnist loader=device trainer.max_epochs=T
    distill:   accel-train model=mlp model.hidden_dims=[32] ... [distill.teacher=<teacher best.pt>]
    prune:     accel-train model=mlp ... prune.amount=0|0.5|0.8
    selective: accel-train model=mlp ... [selective_backprop.keep=0.5 ...]

and reports test/acc of best.pt (summary.json: picked on the held-out validation split), the
child's CPU seconds (user + sys, from rusage: less sensitive than wall time to the other
processes on a shared machine) and wall seconds, with the load average before each run. The
variants of a comparison run alternately, `--reps` times each, and the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DATA_DIR, load_avg, machine, median, run_cli, table  # noqa: E402


def train(overrides: list[str], out: Path, name: str) -> dict:
    """One run (or its recorded result, when `out` already holds it: re-running the script
    with the same --out finishes an interrupted benchmark instead of starting over)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")  # Hydra's override grammar
    recorded = out / slug / "bench_row.json"
    if recorded.exists():
        row = json.loads(recorded.read_text())
        print(f"  {name}: recorded earlier ({recorded})", flush=True)
        return row
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = load_avg()
    run_dir, usage = run_cli(overrides, threads=None, run_dir=out / slug)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"name": name, "cpu": cpu, "wall": usage["wall"], "load": load, **summary}
    recorded.write_text(json.dumps(row, indent=2) + "\n")
    print(
        f"  {name}: test/acc {summary['test_acc']:.4f}  cpu {cpu:.1f} s  wall "
        f"{usage['wall']:.1f} s  load {load}",
        flush=True,
    )
    return row


def compare(variants: dict[str, list[str]], base: list[str], reps: int, out: Path) -> list[list]:
    results: dict[str, list[dict]] = {k: [] for k in variants}
    for rep in range(reps):
        for name, extra in variants.items():  # alternate the variants
            results[name].append(train([*base, *extra], out, f"{name}-{rep}"))
    rows = []
    for name, runs in results.items():
        rows.append(
            [
                name,
                f"{median([r['test_acc'] for r in runs]):.4f}",
                f"{median([r['cpu'] for r in runs]):.1f}",
                f"{median([r['wall'] for r in runs]):.1f}",
                " / ".join(r["load"].split()[0] for r in runs),
                _extra(runs[-1]),
            ]
        )
    return rows


def _extra(row: dict) -> str:
    if "prune" in row:
        return f"sparsity {row['prune']['sparsity']:.3f}"
    if "selective_backprop" in row:
        sb = row["selective_backprop"]
        return f"{sb['kept_samples']}/{sb['seen_samples']} kept on {sb['selected_batches']} batches"
    if "distill" in row:
        return f"teacher sha256 {row['distill']['teacher_sha256'][:10]}"
    return ""


HEAD = ["variant", "test/acc (median)", "CPU s", "wall s", "load avg (1 min)", "notes"]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"default {DEFAULT_DATA_DIR}")
    p.add_argument("--epochs", type=int, default=3, help="student / pruning / selective epochs")
    p.add_argument("--teacher-epochs", type=int, default=3)
    p.add_argument("--reps", type=int, default=1, help="runs per variant (alternated)")
    p.add_argument("--only", choices=["distill", "prune", "selective"], action="append")
    p.add_argument("--out", type=Path, default=None, help="where the run dirs go (a temp dir)")
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="accel_bench_compress_"))
    only = set(args.only or ["distill", "prune", "selective"])
    data = [
        "dataset=mnist",
        f"paths.data_dir={args.data_dir}",
        "loader=device",
        "trainer.progress=plain",
        "trainer.log_every_n_steps=50",
    ]
    print(f"machine: {machine()}\nrun dirs under {out}\n", flush=True)
    mlp = [*data, "model=mlp", f"trainer.max_epochs={args.epochs}"]
    sections = []

    if "distill" in only:
        print("teacher (mnist_cnn):", flush=True)
        teacher = train(
            [*data, "model=mnist_cnn", f"trainer.max_epochs={args.teacher_epochs}"], out, "teacher"
        )
        ckpt = Path(teacher["run_dir"]) / "checkpoints" / "best.pt"
        student = [*mlp, "model.hidden_dims=[32]"]
        print("student (mlp, one hidden layer of 32):", flush=True)
        rows = compare(
            {
                "student alone": [],
                "student + teacher (alpha 0.5, T 4)": [f"distill.teacher={ckpt}"],
                "student + teacher (alpha 0.1, T 4)": [
                    f"distill.teacher={ckpt}",
                    "distill.alpha=0.1",
                ],
            },
            student,
            args.reps,
            out,
        )
        rows.insert(
            0,
            [
                f"teacher mnist_cnn ({args.teacher_epochs} ep)",
                f"{teacher['test_acc']:.4f}",
                f"{teacher['cpu']:.1f}",
                f"{teacher['wall']:.1f}",
                teacher["load"].split()[0],
                "",
            ],
        )
        sections.append(("distillation", rows))

    if "prune" in only:
        print("pruning (mlp 512-256):", flush=True)
        rows = compare(
            {
                "dense": [],
                "50% global unstructured": ["prune.amount=0.5"],
                "80% global unstructured": ["prune.amount=0.8"],
                "50% structured (neurons)": [
                    "prune.amount=0.5",
                    "prune.method=structured",
                    "prune.scope=layer",
                ],
            },
            mlp,
            args.reps,
            out,
        )
        sections.append(("pruning", rows))

    if "selective" in only:
        print("selective backprop (mlp 512-256):", flush=True)
        rows = compare(
            {
                "full batches": [],
                "keep 0.5, steps 50-90%, interrupt 2": ["selective_backprop.keep=0.5"],
                "keep 0.5, all steps, no interrupt": [
                    "selective_backprop.keep=0.5",
                    "selective_backprop.start=0",
                    "selective_backprop.end=1",
                    "selective_backprop.interrupt=0",
                ],
            },
            mlp,
            args.reps,
            out,
        )
        sections.append(("selective backprop", rows))

    print(f"\nmachine: {machine()}; load average at the end: {load_avg()}")
    for title, rows in sections:
        print(f"\n{title}\n{table(HEAD, rows)}")


if __name__ == "__main__":
    main()

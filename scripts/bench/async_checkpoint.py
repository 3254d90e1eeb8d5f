"""Checkpoint saves that do not stop training, and tensor parallelism's throughput (issue 29).

1. The training loop's time blocked per save (`checkpoint/blocked_s`, logged by every save),
   synchronous vs `checkpoint.async_save=true`, on a GPT whose checkpoint (weights + AdamW's two
   moments) is at least 200 MB at the default size: one process (last.pt) and FSDP over 2
   (last.dcp). Goal: async blocks <= 10 % of the synchronous save.
2. `--tp`: tokens/s of TP = 2 and 2 x 2 FSDP x TP against DDP over 2 and 4 processes on the same
   model (gloo on the CPU: TP is expected to lose there; the parity tests prove the plumbing).

Every run is the real CLI on a token folder (`--data`, else this repo's docs tokenized by
characters into a temp dir). Medians over the saves after the first (the first pays for the
writer's start-up).

    python scripts/bench/async_checkpoint.py                         # part 1, >= 200 MB
    python scripts/bench/async_checkpoint.py --tp --steps 30          # parts 1 and 2
    python scripts/bench/async_checkpoint.py --size tiny --steps 6    # seconds: checks it works
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import REPO, child_env, console_script, load_avg, machine, median, run_cli, table

# (n_layer, n_head, n_embd, block_size): "full" is ~21 M parameters = ~250 MB with AdamW state.
SIZES = {"tiny": (2, 4, 32, 16), "full": (8, 8, 448, 128)}


def token_folder(data: str | None, work: Path) -> str:
    if data:
        return data
    text = work / "text.txt"
    text.write_text("".join(p.read_text() for p in [REPO / "README.md", *REPO.glob("docs/*.md")]))
    cmd = [console_script("accel-data"), "tokenize", f"input={text}", f"out={work / 'tokens'}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(None))
    if proc.returncode != 0:
        sys.exit(proc.stderr[-2000:])
    return str(work / "tokens")


def overrides(args, tokens: str) -> list[str]:
    layers, heads, width, block = SIZES[args.size]
    return [
        "+experiment=gpt_char",
        f"dataset.path={tokens}",
        f"model.n_layer={layers}",
        f"model.n_head={heads}",
        f"model.n_embd={width}",
        f"model.block_size={block}",
        f"loader.batch_size={args.batch}",
        f"trainer.max_steps={args.steps}",
        f"trainer.ckpt_every_n_steps={args.every}",
        f"trainer.log_every_n_steps={args.every}",
        "trainer.val_check_interval=1.0",
        "dataset.eval_windows=16",
        "trainer.progress=none",
        "trainer.plot_curves=false",
        "logger=none",
        "trainer.test_after_fit=false",
        "scheduler.warmup_steps=0",
        "checkpoint.save_top_k=0",  # the periodic last.pt saves only: the runs differ by those
    ]


def blocked(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["checkpoint/blocked_s"] for r in rows if "checkpoint/blocked_s" in r]


def size_mb(run_dir: Path) -> float:
    last = run_dir / "checkpoints"
    return (
        sum(p.stat().st_size for p in last.rglob("*") if p.is_file() and "last" in str(p)) / 2**20
    )


def save_rows(args, base: list[str], work: Path) -> list[list[str]]:
    """Per strategy: a run without saves, then sync, then async. Blocked: the loop's own
    checkpoint/blocked_s per save. Cost: (the run's wall_s - the run without saves) / saves,
    which also counts what a background copy or write takes from the training threads."""
    rows = []
    for label, strategy in (
        ("1 process (.pt)", []),
        ("FSDP 2 (.dcp)", ["strategy=fsdp", "launcher.nproc_per_node=2"]),
    ):
        times, walls, saves_n = {}, {}, 0
        for mode in ("none", "false", "true"):
            extra = (
                ["trainer.ckpt_every_n_steps=0", "checkpoint.save_last=false"]
                if mode == "none"
                else [f"checkpoint.async_save={mode}"]
            )
            run_dir, _ = run_cli(
                [*base, *strategy, *extra],
                threads=args.threads,
                run_dir=work / f"{label[:6].strip()}_{mode}".replace(" ", "_"),
            )
            walls[mode] = json.loads((run_dir / "summary.json").read_text())["wall_s"]
            if mode == "none":
                continue
            saves = blocked(run_dir)
            saves_n = len(saves)
            times[mode] = median(saves[1:] or saves)
            mb = size_mb(run_dir)
        cost = {m: (walls[m] - walls["none"]) / saves_n for m in ("false", "true")}
        rows.append(
            [
                label,
                f"{mb:.0f} MB",
                f"{times['false']:.3f}",
                f"{times['true']:.3f}",
                f"{times['true'] / times['false']:.1%}",
                f"{cost['false']:.3f}",
                f"{cost['true']:.3f}",
            ]
        )
    return rows


def tp_rows(args, base: list[str], work: Path) -> list[list[str]]:
    layers, heads, width, block = SIZES[args.size]
    variants = [
        ("DDP 2", ["strategy=ddp", "launcher.nproc_per_node=2"]),
        ("TP 2", ["strategy=tp", "launcher.nproc_per_node=2"]),
        ("DDP 4", ["strategy=ddp", "launcher.nproc_per_node=4"]),
        ("FSDP 2 x TP 2", ["strategy=fsdp", "strategy.tp=2", "launcher.nproc_per_node=4"]),
    ]
    rows = []
    for label, extra in variants:
        run_dir, usage = run_cli(
            [*base, *extra, "trainer.ckpt_every_n_steps=0"],
            threads=args.threads,
            run_dir=work / label.replace(" ", "_"),
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        tokens_s = summary["train_samples_per_s"] * block
        rows.append(
            [label, f"{summary['global_batch']}", f"{tokens_s:,.0f}", f"{usage['wall']:.1f}"]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=5, help="steps between saves")
    parser.add_argument("--batch", type=int, default=4, help="loader.batch_size per process")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--data", help="a token folder (default: the docs, tokenized)")
    parser.add_argument("--tp", action="store_true", help="also tokens/s of TP and FSDP x TP")
    args = parser.parse_args()
    print(f"machine: {machine()}; load {load_avg()}")
    with tempfile.TemporaryDirectory(prefix="accel_async_") as tmp:
        work = Path(tmp)
        base = overrides(args, token_folder(args.data, work))
        rows = save_rows(args, base, work)
        print(
            f"\nblocked per save (median of saves 2.., every {args.every} steps), size {args.size}"
        )
        head = ["run", "last checkpoint", "blocked sync s", "blocked async s", "async / sync"]
        print(table([*head, "run cost per save, sync s", "async s"], rows))
        if args.tp:
            print(f"\ntokens/s, size {args.size}, {args.steps} steps, no checkpoints")
            print(
                table(["strategy", "global batch", "tokens/s", "wall s"], tp_rows(args, base, work))
            )


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Device loader: `loader=device` vs `loader=torch` (num_workers 0, 1, 2) per-epoch train time.

Every variant is a real `accel-train dataset=mnist ...` run in its own subprocess, with the same
model (--model, default mnist_cnn), batch size, optimizer and precision; only the loader
differs. The variants alternate within each round (the order rotates every round so none always
runs first), the first epoch of every run is dropped (worker start-up, warm-up), and the medians
of the remaining `train/epoch_s` values from metrics.jsonl are compared. The best torch variant
(lowest median) is the baseline: ratio = torch(best num_workers) / device.

A second, in-process table times the loaders alone (one epoch of batches, no model), which shows
how much of an epoch is data loading at all.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_DATA_DIR,
    composed,
    cpu_busy,
    epoch_times,
    load_avg,
    machine,
    median,
    run_cli,
    table,
)

SEED = 42


def variants(workers: list[int]) -> list[tuple[str, list[str]]]:
    out = [("device", ["loader=device"])]
    for w in workers:
        out.append((f"torch, num_workers={w}", ["loader=torch", f"loader.num_workers={w}"]))
    return out


def loader_only(a: argparse.Namespace, workers: list[int], epochs: int = 3) -> list[list[str]]:
    """Median seconds to iterate one training epoch of batches (and normalise them), no model."""
    import torch

    from accel_train.data.build import build_splits
    from accel_train.data.loaders import build_loader

    data = build_splits(composed(["dataset=mnist"]).dataset, a.data_dir).train
    rows = []
    for name, _ in variants(workers):
        kind = "device" if name == "device" else "torch"
        lc = composed([f"loader={kind}"]).loader
        lc.batch_size = a.batch_size
        if kind == "torch":
            lc.num_workers = int(name.rsplit("=", 1)[1])
        loader = build_loader(
            data,
            lc,
            train=True,
            device=torch.device("cpu"),
            seed=SEED,
            rank=0,
            world=1,
            limit=0,
            num_classes=10,
        )
        times = []
        for e in range(epochs + 1):
            t0 = time.perf_counter()
            for x, _y in loader.epoch(e):
                x.float()
            times.append(time.perf_counter() - t0)
        t = median(times[1:])
        rows.append([name, f"{t * 1000:.1f}", f"{len(data) / t:,.0f}"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    p.add_argument(
        "--epochs", type=int, default=3, help="epochs per run, the first dropped (default 3)"
    )
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="torch loader num_workers values to try (default: 0 1 2)",
    )
    p.add_argument(
        "--precision",
        default="fp32",
        choices=["fp32", "amp", "bf16"],
        help="default fp32 (amp = bf16 autocast on the CPU, what mnist_amp uses)",
    )
    p.add_argument(
        "--model",
        default="mnist_cnn",
        choices=["mnist_cnn", "mlp", "resnet18"],
        help="default mnist_cnn (mlp: far less compute per batch, so loading weighs more)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="default 64")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"default {DEFAULT_DATA_DIR}")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: torch's)")
    p.add_argument(
        "--malloc-tuned",
        action="store_true",
        help="run with MALLOC_MMAP_THRESHOLD_=32MiB MALLOC_TRIM_THRESHOLD_=4GiB (glibc keeps freed "
        "memory instead of page-faulting it back every step; removes most run-to-run noise)",
    )
    p.add_argument(
        "--no-loader-only", action="store_true", help="skip the loader-only (no model) table"
    )
    a = p.parse_args()
    if a.epochs < 2:
        p.error("--epochs must be >= 2 (the first epoch of each run is dropped)")

    print(f"machine: {machine()}; load average at start: {load_avg()}", flush=True)
    print(
        f"{a.model} on MNIST ({a.data_dir}), precision={a.precision}, batch {a.batch_size}, Adam; "
        f"{a.rounds} rounds x {a.epochs} epochs per run, first epoch dropped",
        flush=True,
    )
    common = [
        "dataset=mnist",
        f"model={a.model}",
        "optimizer=adam",
        "scheduler=none",
        f"precision={a.precision}",
        f"loader.batch_size={a.batch_size}",
        f"trainer.max_epochs={a.epochs}",
        f"trainer.seed={SEED}",
        "trainer.val_every_n_epochs=1000",
        "trainer.limit_val_batches=1",
        "trainer.progress=none",
        "logger=none",
        f"paths.data_dir={a.data_dir}",
    ]
    vs = variants(a.workers)
    kept: dict[str, list[float]] = {name: [] for name, _ in vs}
    t_start = time.perf_counter()
    for r in range(a.rounds):
        k = r % len(vs)
        for name, overrides in vs[k:] + vs[:k]:
            busy = cpu_busy()  # other load on the machine just before this run
            run_dir, usage = run_cli(
                common + overrides, threads=a.threads, malloc_tuned=a.malloc_tuned
            )
            times = epoch_times(run_dir)
            kept[name].extend(times[1:])
            print(
                f"round {r + 1}/{a.rounds} {name:20s}: epochs "
                + " ".join(f"{t:.2f}" for t in times)
                + f" s (first dropped); run wall {usage['wall']:.1f} s; "
                f"machine busy before: {busy:.0%}",
                flush=True,
            )

    meds = {name: median(ts) for name, ts in kept.items()}
    dev = meds["device"]
    torch_names = [n for n in meds if n != "device"]
    best = min(torch_names, key=meds.__getitem__) if torch_names else None
    rows = [
        [
            name + (" (best torch)" if name == best else ""),
            f"{meds[name]:.3f}",
            f"{min(kept[name]):.3f}-{max(kept[name]):.3f}",
            str(len(kept[name])),
            f"{meds[name] / dev:.3f}",
        ]
        for name, _ in vs
    ]
    print()
    print(
        table(
            ["loader", "s/epoch (median)", "range", "epochs", "ratio to device"],
            rows,
        )
    )
    if best:
        print(
            f"\nratio torch(best: {best}) / device = {meds[best] / dev:.3f}  "
            f"({a.rounds} alternating rounds, {a.epochs - 1} timed epochs per run"
            f"{', glibc malloc tuned' if a.malloc_tuned else ''}; "
            f"total {time.perf_counter() - t_start:.0f} s; load average at end: {load_avg()})"
        )
    if not a.no_loader_only:
        print("\nloaders alone (one training epoch of batches, uint8 -> float, no model):\n")
        print(table(["loader", "ms/epoch (median)", "images/s"], loader_only(a, a.workers)))


if __name__ == "__main__":
    main()

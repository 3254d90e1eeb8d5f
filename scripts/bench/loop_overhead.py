#!/usr/bin/env python
"""Loop overhead: accel-train's per-epoch train time vs a minimal hand-written PyTorch loop.

Both sides train the same model (mnist_cnn, same seed so the same initial weights), on the same
MNIST training split, with the same loader (accel_train.data.loaders.build_loader: same batches),
batch size, optimizer (Adam, same lr, no scheduler) and precision. Each runs in its own fresh
subprocess: the hand-written loop in this script (--hand-worker), accel-train through its real
CLI, whose per-epoch train time is read from `train/epoch_s` in the run's metrics.jsonl.

The two alternate (A B, B A, A B, ... so neither always runs first) for --rounds rounds, the
first epoch of every run is dropped as warm-up, and the medians of the remaining epochs are
compared. Bar (issue 2): accel/hand <= 1.03.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_DATA_DIR,
    child_env,
    composed,
    cpu_busy,
    epoch_times,
    load_avg,
    machine,
    median,
    run_child,
    run_cli,
    table,
)

BAR = 1.03
SEED = 42  # accel-train's trainer.seed default: same initial weights and data order


def hand_worker(a: argparse.Namespace) -> None:
    """The obvious hand-written loop; prints {"epoch_s": [...]} as one JSON line."""
    import torch
    import torch.nn.functional as F

    from accel_train.data.build import build_splits
    from accel_train.data.loaders import build_loader
    from accel_train.models import build_model
    from accel_train.precision import cpu_has_fast_bf16

    device = torch.device("cpu")
    workers = [f"loader.num_workers={a.num_workers}"] if a.loader == "torch" else []
    cfg = composed(
        ["dataset=mnist", f"paths.data_dir={a.data_dir}", f"loader={a.loader}", *workers]
    )
    ds = cfg.dataset
    # The same training split accel-train trains on (the held-out validation part removed).
    splits = build_splits(ds, a.data_dir)
    cfg.loader.batch_size = a.batch_size
    loader = build_loader(
        splits.train,
        cfg.loader,
        train=True,
        device=device,
        seed=SEED,
        rank=0,
        world=1,
        limit=0,
        num_classes=10,
    )
    torch.manual_seed(SEED)
    model = build_model(cfg.model, {"in_channels": 1, "image_size": 28, "num_classes": 10}).to(
        device
    )
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    mean, std = ds.mean[0], ds.std[0]
    # What precision=amp resolves to on this CPU: bf16 autocast where the CPU has bf16
    # instructions, plain fp32 elsewhere.
    bf16 = a.precision == "amp" and cpu_has_fast_bf16()

    times = []
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        model.train()
        for x, y in loader.epoch(epoch):
            x = (x.float() / 255.0 - mean) / std
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"epoch_s": times, "final_loss": loss.item()}))


def run_hand(a: argparse.Namespace, precision: str) -> tuple[list[float], dict]:
    cmd = [
        sys.executable,
        __file__,
        "--hand-worker",
        f"--precision={precision}",
        f"--epochs={a.epochs}",
        f"--batch-size={a.batch_size}",
        f"--lr={a.lr}",
        f"--loader={a.loader}",
        f"--num-workers={a.num_workers}",
        f"--data-dir={a.data_dir}",
    ]
    proc, usage = run_child(cmd, child_env(a.threads, a.malloc_tuned))
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        sys.exit(f"hand-written loop failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])["epoch_s"], usage


def run_accel(a: argparse.Namespace, precision: str) -> tuple[list[float], dict]:
    overrides = [
        "dataset=mnist",
        "model=mnist_cnn",
        "optimizer=adam",
        f"optimizer.lr={a.lr}",
        "scheduler=none",
        f"precision={precision}",
        f"loader={a.loader}",
        f"loader.batch_size={a.batch_size}",
        f"trainer.max_epochs={a.epochs}",
        f"trainer.seed={SEED}",
        "trainer.val_every_n_epochs=1000",  # no validation between epochs ...
        "trainer.limit_val_batches=1",  # ... and a one-batch one after the last (untimed anyway)
        "trainer.progress=none",
        "logger=none",
        f"paths.data_dir={a.data_dir}",
    ]
    if a.loader == "torch":
        overrides.append(f"loader.num_workers={a.num_workers}")
    run_dir, usage = run_cli(overrides, threads=a.threads, malloc_tuned=a.malloc_tuned)
    return epoch_times(run_dir), usage


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=4, help="A/B rounds (default 4)")
    p.add_argument(
        "--epochs", type=int, default=3, help="epochs per run, the first dropped (default 3)"
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        default=["fp32", "amp"],
        choices=["fp32", "amp"],
        help="precisions to compare (default: fp32 amp; amp = bf16 autocast on a bf16 CPU)",
    )
    p.add_argument("--batch-size", type=int, default=64, help="default 64 (the loader default)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam lr (default 1e-3)")
    p.add_argument("--loader", choices=["device", "torch"], default="device", help="default device")
    p.add_argument("--num-workers", type=int, default=0, help="with --loader torch (default 0)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"default {DEFAULT_DATA_DIR}")
    p.add_argument(
        "--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: torch's)"
    )
    p.add_argument(
        "--malloc-tuned",
        action="store_true",
        help="run both with MALLOC_MMAP_THRESHOLD_=32MiB MALLOC_TRIM_THRESHOLD_=4GiB (glibc keeps "
        "freed memory instead of returning it to the OS and page-faulting it back every step)",
    )
    p.add_argument("--hand-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.hand_worker:
        hand_worker(a)
        return
    if a.epochs < 2:
        p.error("--epochs must be >= 2 (the first epoch of each run is dropped)")

    print(f"machine: {machine()}; load average at start: {load_avg()}", flush=True)
    print(
        f"mnist_cnn on MNIST ({a.data_dir}), loader={a.loader}, batch {a.batch_size}, "
        f"Adam lr {a.lr}; {a.rounds} rounds x {a.epochs} epochs per run, first epoch dropped",
        flush=True,
    )
    runners = {"hand": run_hand, "accel": run_accel}
    kept: dict[tuple[str, str], list[float]] = {}
    faults: dict[tuple[str, str], list[int]] = {}
    paired: dict[str, list[float]] = {pr: [] for pr in a.precisions}
    t_start = time.perf_counter()
    for r in range(a.rounds):
        for pr in a.precisions:
            order = ["hand", "accel"] if r % 2 == 0 else ["accel", "hand"]
            med = {}
            for who in order:
                busy = cpu_busy()  # other load on the machine just before this run
                times, usage = runners[who](a, pr)
                kept.setdefault((pr, who), []).extend(times[1:])
                faults.setdefault((pr, who), []).append(usage["minflt"])
                med[who] = median(times[1:])
                print(
                    f"round {r + 1}/{a.rounds} {pr:4s} {who:5s}: epochs "
                    + " ".join(f"{t:.2f}" for t in times)
                    + f" s (first dropped); run: wall {usage['wall']:.1f} s, "
                    f"{usage['minflt'] / 1000:.0f}k minor page faults, sys {usage['sys']:.1f} s; "
                    f"machine busy before: {busy:.0%}",
                    flush=True,
                )
            paired[pr].append(med["accel"] / med["hand"])

    rows, verdicts = [], []
    for pr in a.precisions:
        hand, accel = median(kept[(pr, "hand")]), median(kept[(pr, "accel")])
        ratio = accel / hand
        rows.append(
            [
                pr,
                f"{hand:.3f}",
                f"{accel:.3f}",
                f"{ratio:.3f}",
                f"{median(paired[pr]):.3f}",
                f"{min(paired[pr]):.3f}-{max(paired[pr]):.3f}",
                str(len(kept[(pr, "hand")])),
                f"{median(faults[(pr, 'hand')]) / 1000:.0f}k / "
                f"{median(faults[(pr, 'accel')]) / 1000:.0f}k",
                "PASS" if ratio <= BAR else "FAIL",
            ]
        )
        verdicts.append(ratio <= BAR)
    print()
    print(
        table(
            [
                "precision",
                "hand s/epoch (median)",
                "accel-train s/epoch (median)",
                "ratio accel/hand",
                "per-round ratio (median)",
                "per-round range",
                "epochs each",
                "page faults/run hand / accel",
                f"bar <= {BAR}",
            ],
            rows,
        )
    )
    print(
        f"\n{a.rounds} alternating rounds, {a.epochs - 1} timed epochs per run"
        f"{', glibc malloc tuned (--malloc-tuned)' if a.malloc_tuned else ''}; "
        f"total {time.perf_counter() - t_start:.0f} s; load average at end: {load_avg()}"
    )
    sys.exit(0 if all(verdicts) else 1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Where a gpt_char step's host time goes: accel-train's loop phases (its methods timed
in-process) against the hand-written loop's, and on CUDA every device sync the loop makes after
the warm-up (torch.cuda.set_sync_debug_mode("warn"), counted by call stack). BENCHMARKS.md
section 19.

    python scripts/bench/step_host_time.py --device cuda --precision bf16 --side hand
    python scripts/bench/step_host_time.py --device cuda --precision bf16 --side accel

The first 50 steps are warm-up and not counted. On the CPU the phases include the compute
(the CPU runs each op as it is issued); on CUDA they are the host's launch work.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

WARMUP = 50


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def report(side: str, a: argparse.Namespace, total: float, phases: dict[str, float]) -> None:
    n = a.steps - WARMUP
    parts = ", ".join(f"{k} {1e3 * v / n:.3f}" for k, v in phases.items())
    print(f"{side} {a.precision}: {1e3 * total / n:.3f} ms/step wall; host ms/step: {parts}")


def hand(a: argparse.Namespace) -> None:
    """The gpt_race.py hand loop, its phases timed on the host."""
    import torch.nn.functional as F

    from accel_train.models.gpt import GPT

    folder = Path(a.data)
    meta = json.loads((folder / "meta.json").read_text())
    train = np.memmap(folder / "train.bin", dtype=np.dtype(meta["dtype"]), mode="r")
    torch.manual_seed(0)
    device = torch.device(a.device)
    model = GPT(vocab_size=meta["vocab_size"], block_size=64, n_layer=4, n_head=4, n_embd=128)
    model.to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=True
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    gen = np.random.default_rng(0)
    phases: collections.Counter = collections.Counter()
    for it in range(a.steps):
        if it == WARMUP:
            sync(a.device)
            start = time.perf_counter()
            phases.clear()
        t0 = time.perf_counter()
        starts = gen.integers(0, len(train) - 66, size=12)
        rows = np.stack([np.asarray(train[s : s + 65], dtype=np.int64) for s in starts])
        xy = torch.from_numpy(rows)
        if device.type == "cuda":
            xy = xy.pin_memory().to(device, non_blocking=True)
        x, y = xy[:, :-1], xy[:, 1:]
        t1 = time.perf_counter()
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        phases["data"] += t1 - t0
        phases["forward+backward"] += t2 - t1
        phases["optimizer"] += t3 - t2
    sync(a.device)
    report("hand", a, time.perf_counter() - start, phases)


def accel(a: argparse.Namespace) -> None:
    """accel-train's CLI in this process, its Loop's step methods wrapped with host timers."""
    from accel_train.cli import train
    from accel_train.train import loop as loop_module

    Loop = loop_module.Loop
    phases: collections.Counter = collections.Counter()
    clock: dict[str, float] = {}

    def timed(name: str, label: str):
        method = getattr(Loop, name)

        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                if "start" in clock:
                    phases[label] += time.perf_counter() - t0

        setattr(Loop, name, wrapper)

    timed("_forward_backward", "forward+backward")
    timed("_log_train", "logging steps")
    batches = Loop._timed

    def counted_batches(self, loader):
        for batch in batches(self, loader):
            if self.step == WARMUP and "start" not in clock:
                sync(a.device)
                clock["start"] = time.perf_counter()
            yield batch

    Loop._timed = counted_batches
    step = Loop._optimizer_step

    def optimizer_step(self):
        t0 = time.perf_counter()
        step(self)
        if "start" in clock:
            phases["optimizer (lr schedule, zero_grad)"] += time.perf_counter() - t0
        if self.step == a.steps:
            sync(a.device)
            clock["end"] = time.perf_counter()

    Loop._optimizer_step = optimizer_step
    syncs: collections.Counter = collections.Counter()
    if a.device == "cuda":

        def record(message, category, filename, lineno, file=None, line=None):
            if "start" in clock and "end" not in clock:
                syncs["".join(traceback.format_stack(limit=10)[:-2])] += 1

        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
    sys.argv = [
        "accel-train",
        "+experiment=gpt_char",
        f"dataset.path={a.data}",
        f"precision={a.precision}",
        f"trainer.device={a.device}",
        f"trainer.max_steps={a.steps}",
        "trainer.val_check_interval=100000",  # validate once, at the end
        "trainer.log_every_n_steps=100",
        "scheduler.warmup_steps=10",
        "logger=none",
        "trainer.progress=none",
        "trainer.plot_curves=false",
        f"hydra.run.dir={a.out}",
    ]
    train()
    if a.device == "cuda":
        torch.cuda.set_sync_debug_mode(0)
    total = clock["end"] - clock["start"]
    phases["data + loop bookkeeping"] = total - sum(phases.values())
    report("accel", a, total, phases)
    print(f"device syncs between step {WARMUP} and the last step: {sum(syncs.values())}")
    for stack, count in syncs.most_common(8):
        print(f"--- {count} from:\n{stack}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/pycode")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--side", default="accel", choices=["hand", "accel"])
    p.add_argument("--out", default="outputs/bench_step_host_time")
    a = p.parse_args()
    (hand if a.side == "hand" else accel)(a)


if __name__ == "__main__":
    main()

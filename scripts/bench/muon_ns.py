#!/usr/bin/env python
"""One Muon step on GPT-sized hidden matrices: torch.optim.Muon (Newton-Schulz in bf16) against
accel-train's Muon with the iteration in fp32 and in bf16 (optim.py; `optimizer.ns_dtype`).
Median CPU ms of a step (the process's CPU time, one intra-op thread by default: on a shared
machine the wall clock measures the neighbours too) over --steps steps after two warm-ups, the
three stepped in turn, per set of matrices (issue 62).

    python scripts/bench/muon_ns.py
    ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench/muon_ns.py   # oneDNN limited to AVX2 kernels

On a CPU with native bf16 (AVX512-BF16 or AMX) the bf16 iteration is the fast one and
`ns_dtype=auto` keeps it; on a CPU without, bf16 is emulated and auto picks fp32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, table  # noqa: E402

from accel_train.optim import Muon  # noqa: E402
from accel_train.precision import cpu_has_fast_bf16  # noqa: E402


def gpt_matrices(width: int, layers: int) -> list[tuple[int, int]]:
    """The hidden matrices Muon updates in `layers` GPT blocks: qkv, the attention's output,
    the MLP's two (nn.Linear's (out, in) shapes)."""
    return [(3 * width, width), (width, width), (4 * width, width), (width, 4 * width)] * layers


# name -> the matrices: gpt_char's model (4 blocks 128 wide, as gpt_char_fast trains it), and
# one block of model=gpt's default width (384; the default has 6).
SETS = {
    "gpt_char (4 blocks x 128)": gpt_matrices(128, 4),
    "model=gpt width (1 block x 384)": gpt_matrices(384, 1),
}


def step_ms(makers: dict, shapes: list[tuple[int, int]], steps: int) -> dict[str, float]:
    """Median CPU ms of one step of each optimizer, the optimizers stepped in turn (round-robin),
    so a machine whose load drifts slows each alike."""
    opts, params, times = {}, {}, {k: [] for k in makers}
    for name, make in makers.items():
        torch.manual_seed(0)
        params[name] = [torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes]
        opts[name] = make(params[name])
    for i in range(steps + 2):
        for name, opt in opts.items():
            for p in params[name]:
                p.grad = torch.randn_like(p)
            start = time.process_time()
            opt.step()
            if i >= 2:  # two warm-ups (oneDNN picks and packs its kernels on the first calls)
                times[name].append(time.process_time() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(machine())
    print(
        f"native bf16 on this CPU (AVX512-BF16 or AMX, as torch reports it): {cpu_has_fast_bf16()}"
    )
    makers = {
        "torch Muon (bf16 NS) CPU ms": lambda ps: torch.optim.Muon(ps, lr=0.02),
        "fp32 NS CPU ms": lambda ps: Muon(ps, lr=0.02, ns_dtype=torch.float32),
        "bf16 NS CPU ms": lambda ps: Muon(ps, lr=0.02, ns_dtype=torch.bfloat16),
    }
    rows = []
    for name, shapes in SETS.items():
        ms = step_ms(makers, shapes, a.steps)
        torch_ms, fp32_ms = ms["torch Muon (bf16 NS) CPU ms"], ms["fp32 NS CPU ms"]
        rows.append(
            [name, f"{sum(r * c for r, c in shapes) / 1e6:.2f} M"]
            + [f"{v:.1f}" for v in ms.values()]
            + [f"{torch_ms / fp32_ms:.2f}x"]
        )
        print(rows[-1], flush=True)
    headers = ["matrices", "parameters", *makers, "torch / fp32"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()

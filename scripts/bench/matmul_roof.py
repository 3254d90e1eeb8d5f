#!/usr/bin/env python
"""The machine's measured matmul roof: the FLOP/s of large square matrix products in fp32 and
bf16 with torch's default threads, the denominator of an honest MFU on a CPU (issue 18: "MFU
against the machine's measured matmul roof"). Median of --repeats timed products after two
warm-ups, per size.

    python scripts/bench/matmul_roof.py --sizes 1024,2048,4096
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


def gflops(n: int, dtype: torch.dtype, repeats: int, device: str) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # two warm-ups (oneDNN's first call picks and packs its kernels)
            times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1024,2048,4096")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args()
    print(machine())
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        row = [str(n)]
        for dtype in (torch.float32, torch.bfloat16):
            row.append(f"{gflops(n, dtype, a.repeats, a.device):.1f}")
        rows.append(row)
        print(table(["n", "fp32 GFLOP/s", "bf16 GFLOP/s"], [row]), flush=True)
    print(table(["n", "fp32 GFLOP/s", "bf16 GFLOP/s"], rows))


if __name__ == "__main__":
    main()

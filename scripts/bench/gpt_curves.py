#!/usr/bin/env python
"""The gpt_char loss curves: train/loss and val/loss against the step, one line per run dir
(e.g. gpt_race.py's accel-train runs, fp32 and bf16), into one small PNG for the docs.

    python scripts/bench/gpt_curves.py outputs/bench_gpt_race/fp32_r0 \
        outputs/bench_gpt_race/bf16_r0 --out docs/images/gpt_char_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run dirs holding metrics.jsonl")
    p.add_argument("--out", default="docs/images/gpt_char_curves.png")
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=80)  # small: the PNG stays well under 100 KB
    for run in map(Path, a.runs):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
        name = run.name
        train = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
        val = [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]
        (line,) = ax.plot(*zip(*train, strict=True), label=f"{name} train", lw=1.2)
        ax.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{name} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / char)")
    ax.set_title("+experiment=gpt_char on pycode (2,000 steps, batch 12 x 64)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"{out}: {out.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()

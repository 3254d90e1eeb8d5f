#!/usr/bin/env python
"""EMA with and without its warm-up on a short run: `+experiment=mnist_amp` on real MNIST for
`--epochs` epochs (mnist_amp has about 70 optimizer steps an epoch), three variants per seed,
alternated:

    off      ema.enabled=false
    ema      ema.enabled=true ema.warmup=false   (decay 0.999 from the first step)
    warmup   ema.enabled=true ema.warmup=true    (min(0.999, (1 + n) / (10 + n)), the default)

Each run's own test pass scores best.pt. With EMA on, best.pt holds the average, so the test
accuracy is the average's. Selection stays on the validation split held out of the training
images. The table shows the mean and range over the seeds. The precision is set explicitly
(fp32 by default) so the numbers mean the same on every CPU.

    python scripts/bench/ema_warmup.py --seeds 1,2 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DATA_DIR, load_avg, machine, run_cli, table  # noqa: E402

VARIANTS = {
    "off": ["ema.enabled=false"],
    "ema": ["ema.enabled=true", "ema.warmup=false"],
    "warmup": ["ema.enabled=true", "ema.warmup=true"],
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"default {DEFAULT_DATA_DIR}")
    p.add_argument("--seeds", default="1,2", help="comma-separated trainer.seed values")
    p.add_argument("--epochs", type=int, default=2, help="trainer.max_epochs (default 2)")
    p.add_argument("--precision", default="fp32", help="precision option (default fp32)")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    print(f"machine: {machine()}; load average at start: {load_avg()}", flush=True)
    common = [
        "+experiment=mnist_amp",
        f"paths.data_dir={a.data_dir}",
        f"precision={a.precision}",
        f"trainer.max_epochs={a.epochs}",
        f"checkpoint.every_n_epochs={a.epochs}",  # mnist_amp ranks only its final epoch
        "trainer.progress=none",
        "trainer.plot_curves=false",
        "logger=none",
    ]
    print("accel-train " + " ".join(common) + " trainer.seed=S <variant>", flush=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    root = Path(tempfile.mkdtemp(prefix="accel_bench_ema_"))
    for seed in seeds:
        for name, switch in VARIANTS.items():
            run_dir = root / f"{name}_s{seed}"
            run_cli([*common, f"trainer.seed={seed}", *switch], threads=None, run_dir=run_dir)
            summary = json.loads((run_dir / "summary.json").read_text())
            results[name].append((summary["best_val_acc"], summary["test_acc"]))
            print(
                f"seed {seed} {name}: val acc {summary['best_val_acc']:.4f}, "
                f"test acc {summary['test_acc']:.4f} ({summary['steps']} steps)",
                flush=True,
            )
    rows = []
    for name, scores in results.items():
        val = [v for v, _ in scores]
        test = [t for _, t in scores]
        rows.append(
            [
                name,
                " ".join(VARIANTS[name]),
                f"{100 * sum(val) / len(val):.2f}",
                f"{100 * sum(test) / len(test):.2f} ({100 * min(test):.2f}-{100 * max(test):.2f})",
            ]
        )
    print()
    print(f"{a.epochs} epochs, precision={a.precision}, seeds {a.seeds}")
    print(table(["variant", "switches", "val acc %", "test acc % (min-max)"], rows))
    print(f"load average at end: {load_avg()}")


if __name__ == "__main__":
    main()

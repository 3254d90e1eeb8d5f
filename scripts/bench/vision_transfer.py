#!/usr/bin/env python
"""The transfer check of `model.weights` with a timm folder (issue 38): do weights saved the way
timm saves them carry what was learnt into a fine-tuning run?

1. The MNIST files in --data-dir are split by digit into two data dirs in torchvision's raw IDX
   layout: digits 0-4 and digits 5-9 (training and test files each; labels kept as they are).
2. Pretrain `model=timm model.name=<arch>` on digits 0-4 (`dataset.num_classes=5`) with the real
   CLI, then write its last.pt as timm writes a model for the hub: timm.create_model +
   load_state_dict + `timm.models.save_for_hf` (config.json + model.safetensors).
3. Fine-tune on digits 5-9 (`dataset.num_classes=10`: a head of another shape, which
   `model.weights` re-initialises) for --steps steps, `model.weights=<folder>` against the same
   run from random weights, for each seed, alternated. The table gives the median validation
   accuracy (the held-out tenth of the 5-9 training images) and test accuracy (the official
   test images of 5-9) of each, over the seeds.

    python scripts/bench/vision_transfer.py --seeds 1,2,3
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DATA_DIR, load_avg, machine, run_cli, table  # noqa: E402


def write_idx(path: Path, data) -> None:
    """IDX: magic (0, 0, 0x08 = ubyte, ndim), big-endian int32 dims, the raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, data.dim()) + struct.pack(
        f">{data.dim()}I", *data.shape
    )
    path.write_bytes(header + data.contiguous().numpy().tobytes())


def split_by_digit(data_dir: str, root: Path) -> dict[str, Path]:
    """Two data dirs holding MNIST/raw/ with only digits 0-4, and only 5-9."""
    from torchvision.datasets import MNIST

    dirs = {"0-4": root / "digits_0_4", "5-9": root / "digits_5_9"}
    for train, prefix in ((True, "train"), (False, "t10k")):
        mnist = MNIST(data_dir, train=train, download=False)
        for name, folder in dirs.items():
            keep = mnist.targets < 5 if name == "0-4" else mnist.targets >= 5
            raw = folder / "MNIST" / "raw"
            raw.mkdir(parents=True, exist_ok=True)
            write_idx(raw / f"{prefix}-images-idx3-ubyte", mnist.data[keep])
            labels = mnist.targets[keep].to(dtype=mnist.data.dtype)
            write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return dirs


def save_as_timm(run_dir: Path, arch: str, folder: Path) -> None:
    """The run's last.pt written as timm writes a model (save_for_hf)."""
    import timm
    import torch
    from timm.models import save_for_hf

    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    model = timm.create_model(arch, pretrained=False, num_classes=5, in_chans=1)
    model.load_state_dict(state)
    save_for_hf(model, str(folder), safe_serialization=True)


def spread(xs: list[float]) -> str:
    """Median (min-max), in percent."""
    return f"{100 * statistics.median(xs):.2f} ({100 * min(xs):.2f}-{100 * max(xs):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"default {DEFAULT_DATA_DIR}")
    p.add_argument("--arch", default="resnet10t", help="the timm architecture (resnet10t)")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated trainer.seed values")
    p.add_argument("--pretrain-epochs", type=int, default=2, help="on digits 0-4 (default 2)")
    p.add_argument("--steps", type=int, default=30, help="fine-tuning steps (default 30)")
    p.add_argument("--precision", default="fp32", help="precision option (default fp32)")
    a = p.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    print(f"machine: {machine()}; load average at start: {load_avg()}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="accel_bench_transfer_"))
    dirs = split_by_digit(a.data_dir, root)
    common = [
        "model=timm",
        f"model.name={a.arch}",
        "dataset=mnist",
        "dataset.download=false",
        f"precision={a.precision}",
        "loader.batch_size=64",
        "trainer.progress=none",
        "trainer.plot_curves=false",
        "logger=none",
    ]
    pretrain = [*common, f"paths.data_dir={dirs['0-4']}", "dataset.num_classes=5"]
    pretrain += [f"trainer.max_epochs={a.pretrain_epochs}", "trainer.seed=0"]
    print("pretrain: accel-train " + " ".join(pretrain), flush=True)
    run_dir, _ = run_cli(pretrain, threads=None, run_dir=root / "pretrain")
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"pretrained on 0-4: test acc {summary['test_acc']:.4f}", flush=True)
    folder = root / f"{a.arch}_digits_0_4"
    save_as_timm(run_dir, a.arch, folder)
    variants = {"pretrained": [f"model.weights={folder}"], "random": []}
    finetune = [*common, f"paths.data_dir={dirs['5-9']}", "dataset.num_classes=10"]
    finetune += ["loader.batch_size=32", f"trainer.max_steps={a.steps}"]
    shown = " ".join(finetune)
    print(f"fine-tune: accel-train {shown} trainer.seed=S [model.weights=<folder>]", flush=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for seed in seeds:
        for name, switch in variants.items():
            run_dir, _ = run_cli(
                [*finetune, f"trainer.seed={seed}", *switch],
                threads=None,
                run_dir=root / f"{name}_s{seed}",
            )
            summary = json.loads((run_dir / "summary.json").read_text())
            results[name].append((summary["best_val_acc"], summary["test_acc"]))
            print(
                f"seed {seed} {name}: val acc {summary['best_val_acc']:.4f}, "
                f"test acc {summary['test_acc']:.4f} ({summary['steps']} steps)",
                flush=True,
            )
    rows = []
    for name, scores in results.items():
        val, test = [v for v, _ in scores], [t for _, t in scores]
        rows.append(
            [
                name,
                " ".join(variants[name]).replace(str(folder), "<folder>") or "(random init)",
                spread(val),
                spread(test),
            ]
        )
    print()
    print(f"{a.arch}, {a.steps} fine-tuning steps, precision={a.precision}, seeds {a.seeds}")
    print(
        table(
            ["start", "switch", "val acc % median (min-max)", "test acc % median (min-max)"], rows
        )
    )
    print(f"load average at end: {load_avg()}")


if __name__ == "__main__":
    main()

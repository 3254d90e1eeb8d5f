#!/usr/bin/env python
"""dataset=image_folder: decoding JPEGs vs the RAM / disk cache, and the DataLoader knobs.

Writes a JPEG tree once (--images in --classes classes, --size px square, under
outputs/bench_data/; reused when present) and measures, in this process:

1. the loader alone: one training epoch of `build_image_folder(...)`'s train split through a
   torch DataLoader (batch 256, shuffled, `getitem(i, epoch)` like accel-train's loader), no
   model, for cache none / ram / disk, num_workers 0 / 1 / 2, pin_memory on / off and
   augment=cpu vs augment=device (the batch-wise crop then runs on the CPU, timed with it);
2. building the splits: cache none (scanning only), ram (decode everything), disk cold (decode
   and write the file), disk warm (reuse it);
3. persistent_workers on / off: the start of each of 3 epochs (time to the first batch).

and then, through the real CLI, 4. a resnet18 training epoch for num_workers 0 / 2 and cache
none / disk (--skip-train leaves this out).

Variants alternate within each round (the order rotates every round), the medians are
compared, and ratios are against the uncached num_workers=0 baseline. CPU seconds (this process
plus its reaped worker processes) are steadier than wall seconds on a shared machine.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    REPO,
    cpu_busy,
    epoch_times,
    finish_tree,
    fresh_tree,
    load_avg,
    machine,
    median,
    run_cli,
    table,
)

SEED = 0
BATCH = 256


# ---- the data ---------------------------------------------------------------------------------


def write_data(root: Path, n: int, size: int, classes: int) -> Path:
    """root/train/<class>/*.jpg, unless a finished tree with the same parameters is there.
    Class c: a smooth random pattern tinted with the class's colour (JPEG-friendly, like
    photos), so files are a realistic few KB rather than incompressible noise."""
    import torch
    import torch.nn.functional as F
    from torchvision.io import encode_jpeg

    stamp = f"{n} {size} {classes}\n"
    tmp = fresh_tree(root, stamp)
    if tmp is None:
        return root
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(SEED)
    tints = torch.rand(classes, 3, 1, 1, generator=gen) * 0.8 + 0.2
    for c in range(classes):
        (tmp / "train" / f"class{c:02d}").mkdir(parents=True)
    for start in range(0, n, 500):
        k = min(500, n - start)
        labels = torch.arange(start, start + k) % classes
        coarse = torch.rand(k, 3, 6, 6, generator=gen)
        smooth = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False)
        img = smooth * tints[labels] + 0.04 * torch.randn(k, 3, size, size, generator=gen)
        img = (img.clamp(0, 1) * 255).to(torch.uint8)
        for j, data in enumerate(encode_jpeg(list(img), quality=90)):
            i = start + j
            (tmp / "train" / f"class{int(labels[j]):02d}" / f"{i:06d}.jpg").write_bytes(
                data.numpy().tobytes()
            )
    finish_tree(tmp, root, stamp)
    print(f"wrote {n} JPEGs under {root} in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in (root / "train").rglob("*.jpg"))


# ---- measuring ----------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU of this process and of its finished (reaped) children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class EpochView:
    """What accel-train's torch loader does: item i of epoch e is ``split.getitem(i, e)``."""

    def __init__(self, split, epoch: int):
        self.split, self.epoch = split, epoch

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        return self.split.getitem(i, self.epoch)


def make_loader(split, epoch: int, workers: int, pin: bool = False, persistent: bool = False):
    import torch
    from torch.utils.data import DataLoader

    order = torch.randperm(len(split), generator=torch.Generator().manual_seed(epoch)).tolist()
    return DataLoader(
        EpochView(split, epoch),
        batch_size=BATCH,
        sampler=order,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=persistent and workers > 0,
    )


def loader_epoch(splits, workers: int, pin: bool, epoch: int) -> tuple[float, float]:
    """(wall s, CPU s) of one epoch of batches, workers started and stopped inside it."""
    import torch

    gen = torch.Generator().manual_seed(epoch)
    c0, t0 = cpu_seconds(), time.perf_counter()
    for x, _y in make_loader(splits.train, epoch, workers, pin):
        if splits.device_augment is not None:
            x = splits.device_augment(x, gen)
    return time.perf_counter() - t0, cpu_seconds() - c0


def timed(fn) -> tuple[float, float]:
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


def rotate(xs: list, r: int) -> list:
    k = r % len(xs)
    return xs[k:] + xs[:k]


def ratio_rows(names, walls, cpus, n_samples, base) -> list[list[str]]:
    rows = []
    for name in names:
        w, c = median(walls[name]), median(cpus[name])
        rows.append(
            [
                name,
                f"{n_samples / w:,.0f}",
                f"{min(walls[name]):.2f}-{max(walls[name]):.2f}",
                f"{c:.2f}",
                f"{median(walls[base]) / w:.2f}",
                f"{median(cpus[base]) / c:.2f}",
            ]
        )
    return rows


# ---- 1-3: in this process --------------------------------------------------------------------


def splits_builder(a: argparse.Namespace, root: Path):
    from accel_train.data.images.folder import build_image_folder

    common = dict(root=str(root), test_split=None, seed=SEED, image_size=a.size)
    return lambda **kw: build_image_folder(**{**common, **kw})


def build_table(a: argparse.Namespace, root: Path) -> None:
    """2. Building the splits. Runs first, so "disk cold" starts without a cache file."""
    build = splits_builder(a, root)

    def disk_cold():
        shutil.rmtree(root / ".accel_cache", ignore_errors=True)
        return build(cache="disk")

    builds = {
        "cache=none (scan only)": build,
        "cache=ram (decode all)": lambda: build(cache="ram"),
        "cache=disk cold (decode, write)": disk_cold,
        "cache=disk warm (reuse)": lambda: build(cache="disk"),
    }
    walls: dict[str, list[float]] = {k: [] for k in builds}
    cpus: dict[str, list[float]] = {k: [] for k in builds}
    for r in range(a.rounds):
        for name, fn in builds.items():  # a fixed order: "warm" reuses what "cold" wrote
            w, c = timed(fn)
            walls[name].append(w)
            cpus[name].append(c)
            print(f"build round {r + 1}/{a.rounds} {name:32s}: {w:.2f} s wall, {c:.2f} s CPU")
    s = build()
    print(f"\n### 2. Building the splits ({len(s.train) + len(s.val):,} files, train + val)\n")
    rows = [[name, f"{median(walls[name]):.2f}", f"{median(cpus[name]):.2f}"] for name in builds]
    print(table(["build", "wall s (median)", "CPU s (median)"], rows))


def loader_table(a: argparse.Namespace, root: Path) -> None:
    """1. One epoch of batches through a DataLoader, no model."""
    build = splits_builder(a, root)
    variants = {  # name: (builder arguments, num_workers, pin_memory)
        "cache=none, workers=0": ({}, 0, False),
        "cache=none, workers=1": ({}, 1, False),
        "cache=none, workers=2": ({}, 2, False),
        "cache=none, workers=2, pin_memory": ({}, 2, True),
        "cache=ram, workers=0": ({"cache": "ram"}, 0, False),
        "cache=ram, workers=2": ({"cache": "ram"}, 2, False),
        "cache=disk warm, workers=0": ({"cache": "disk"}, 0, False),
        "cache=disk warm, workers=2": ({"cache": "disk"}, 2, False),
        "cache=ram, augment=device, workers=0": ({"cache": "ram", "augment": "device"}, 0, False),
    }
    splits = {name: build(**kw) for name, (kw, _, _) in variants.items()}
    n = len(splits["cache=none, workers=0"].train)
    walls: dict[str, list[float]] = {k: [] for k in variants}
    cpus: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a.rounds):
        for name in rotate(list(variants), r):
            _, workers, pin = variants[name]
            busy = cpu_busy(0.5)
            w, c = loader_epoch(splits[name], workers, pin, epoch=r + 1)
            walls[name].append(w)
            cpus[name].append(c)
            print(
                f"loader round {r + 1}/{a.rounds} {name:38s}: {n / w:7,.0f} samples/s, "
                f"{w:.2f} s wall, {c:.2f} s CPU; machine busy before: {busy:.0%}",
                flush=True,
            )
    print(f"\n### 1. Loader alone: one epoch of {n:,} training images, batch {BATCH}\n")
    print(
        table(
            ["variant", "samples/s", "wall s range", "CPU s/epoch", "x wall", "x CPU"],
            ratio_rows(list(variants), walls, cpus, n, "cache=none, workers=0"),
        )
    )


def persistent_table(a: argparse.Namespace, root: Path) -> None:
    """3. The same DataLoader (num_workers=2, cache=none) for 3 epochs: how long each epoch
    waits for its first batch, with and without persistent workers."""
    split = splits_builder(a, root)().train
    starts: dict[bool, list[list[float]]] = {False: [], True: []}
    for r in range(a.rounds):
        for persistent in rotate([False, True], r):
            loader = make_loader(split, 0, 2, persistent=persistent)
            run = []
            for _ in range(3):
                t0 = time.perf_counter()
                it = iter(loader)
                next(it)
                run.append(time.perf_counter() - t0)
                for _ in it:
                    pass
            starts[persistent].append(run)
            del loader, it
            print(
                f"persistent round {r + 1}/{a.rounds} persistent_workers={persistent}: first "
                "batch after " + ", ".join(f"{t * 1000:.0f}" for t in run) + " ms",
                flush=True,
            )
    print("\n### 3. persistent_workers (num_workers=2, cache=none): time to the first batch\n")
    rows = [
        [f"persistent_workers={p}"]
        + [f"{median([run[e] for run in runs]) * 1000:.0f}" for e in range(3)]
        for p, runs in starts.items()
    ]
    print(table(["variant", "epoch 1 ms", "epoch 2 ms", "epoch 3 ms"], rows))


# ---- 4: the real CLI ---------------------------------------------------------------------------


def train_table(a: argparse.Namespace, root: Path) -> None:
    variants = [(w, c) for c in ("none", "disk") for w in (0, 2)]
    common = [
        "dataset=image_folder",
        f"dataset.root={root}",
        "dataset.test_split=null",
        f"dataset.image_size={a.size}",
        "model=resnet18",
        f"loader.batch_size={a.train_batch}",
        "trainer.max_epochs=2",
        f"trainer.limit_train_batches={a.train_batches}",
        "trainer.limit_val_batches=1",
        "trainer.val_every_n_epochs=1000",
        f"trainer.seed={SEED}",
        "trainer.progress=none",
        "logger=none",
    ]
    kept: dict[tuple[int, str], list[float]] = {v: [] for v in variants}
    run_cpu: dict[tuple[int, str], list[float]] = {v: [] for v in variants}
    for r in range(a.train_rounds):
        for w, c in rotate(variants, r):
            busy = cpu_busy()
            c0 = cpu_seconds()  # the run's CPU: it is a reaped child, with its workers
            run_dir, usage = run_cli(
                [*common, f"loader.num_workers={w}", f"dataset.cache={c}"], threads=None
            )
            run_cpu[(w, c)].append(cpu_seconds() - c0)
            times = epoch_times(run_dir)
            kept[(w, c)].extend(times[1:])
            print(
                f"train round {r + 1}/{a.train_rounds} workers={w} cache={c}: epochs "
                + " ".join(f"{t:.1f}" for t in times)
                + f" s (first dropped); run wall {usage['wall']:.0f} s, CPU "
                f"{run_cpu[(w, c)][-1]:.0f} s; busy before {busy:.0%}",
                flush=True,
            )
    n = a.train_batches * a.train_batch
    base = median(kept[(0, "none")])
    rows = [
        [
            f"num_workers={w}, cache={c}",
            f"{median(kept[(w, c)]):.1f}",
            f"{n / median(kept[(w, c)]):.1f}",
            f"{base / median(kept[(w, c)]):.2f}",
            f"{median(run_cpu[(w, c)]):.0f}",
        ]
        for w, c in variants
    ]
    print(f"\n### 4. resnet18 training, {a.train_batches} batches of {a.train_batch} per epoch\n")
    headers = ["variant", "s/epoch (median)", "samples/s", "x vs workers=0, none", "run CPU s"]
    print(table(headers, rows))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--images", type=int, default=20000, help="JPEGs written (default 20000)")
    p.add_argument("--size", type=int, default=64, help="image side in px and dataset.image_size")
    p.add_argument("--classes", type=int, default=10, help="default 10")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds, tables 1-3")
    p.add_argument("--skip-loader", action="store_true", help="leave out tables 1-3")
    p.add_argument("--skip-train", action="store_true", help="leave out the CLI table 4")
    p.add_argument("--train-rounds", type=int, default=2, help="alternating rounds, table 4")
    p.add_argument("--train-batches", type=int, default=4, help="batches per CLI epoch (default 4)")
    p.add_argument("--train-batch", type=int, default=32, help="CLI batch size (default 32)")
    a = p.parse_args()

    print(f"machine: {machine()}; load average at start: {load_avg()}", flush=True)
    name = f"image_folder_{a.images}x{a.size}px_{a.classes}cls"
    root = write_data(REPO / "outputs" / "bench_data" / name, a.images, a.size, a.classes)
    print(f"data: {root}, {tree_bytes(root) / 2**20:.0f} MiB of JPEG", flush=True)
    t0 = time.perf_counter()
    if not a.skip_loader:
        build_table(a, root)
        loader_table(a, root)
        persistent_table(a, root)
    if not a.skip_train:
        train_table(a, root)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average at end: {load_avg()}")


if __name__ == "__main__":
    main()

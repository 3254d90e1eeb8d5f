#!/usr/bin/env python
"""The recipe switches of issue 38: what each costs, and (not run by default) what each buys.

Cost, in process, one thread (``torch.set_num_threads(1)``), medians of --rounds rounds with the
variants alternating in each round:

(a) per sample, in the loader worker: the training path of ``dataset=image_folder`` (header,
    crop box, DCT-scaled decode, resize to 224, flip: data/images/decode.py ``decode_train``) on
    photo-like JPEGs (scripts/bench/image_loader.py's, written under outputs/bench_data/),
    without a policy and with each ``dataset.auto_augment`` (data/images/sample_recipe.py
    AutoAugment, the PIL round trip included): images/s of one core;
(b) per batch, on the device (here the CPU): a normalised float batch 64 x 3 x 224 x 224
    through data/images/batch_mix.py's BatchMix with random erasing (0.25, pixel), mixup + cutmix
    (0.8 / 1.0, label smoothing 0.1) and both, against a plain float normalisation of the
    same uint8 batch for scale: ms per batch.

``optimizer.layer_decay`` costs nothing per step (more param groups, the same kernels), and
``trainer.progressive_resize`` makes the early epochs cheaper (a 160 px image is ~51 % of a
224 px one's pixels): neither is timed here.

``--accuracy``: the accuracy rows, each a real ``accel-report`` over image_folder data with a
timm model (``model=timm`` needs issue 38's models part), long runs that were not run for the
first report (see docs/vision.md):

    accel-report --variants auto_augment,random_erasing,mixup_cutmix,progressive_resize,layer_decay
        --repeats 3 dataset=image_folder dataset.root=DIR model=timm model.name=resnet18 ...

    .venv/bin/python scripts/bench/vision_recipe.py                # ~1 min on 2 busy cores
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, load_avg, machine, median, table  # noqa: E402
from image_loader import write_data  # noqa: E402

MEAN = (0.485, 0.456, 0.406)
POLICIES = ("none", "rand-m9-mstd0.5-inc1", "trivial", "augmix-m5-w3")


def per_sample(files: list[Path], policy: str) -> float:
    """images/s of one core: decode_train (+ the policy) over the files."""
    from accel_train.data.crops import RandomResizedCrop
    from accel_train.data.images.decode import decode_train
    from accel_train.data.images.sample_recipe import AutoAugment

    crop = RandomResizedCrop(224, (0.08, 1.0), True)
    augment = None if policy == "none" else AutoAugment(policy, MEAN, "bilinear")
    start = time.process_time()
    for i, path in enumerate(files):
        rng = random.Random(f"0/0/{i}")
        image = decode_train(str(path), str(path), crop, 224, rng)
        if augment is not None:
            image = augment(image, rng)
    return len(files) / (time.process_time() - start)


def batch_switches() -> dict:
    from omegaconf import OmegaConf

    from accel_train.data.images.batch_mix import build_batch_mix

    base = dict(random_erasing=0.0, random_erasing_mode="pixel", random_erasing_count=1,
                mixup_alpha=0.0, cutmix_alpha=0.0, mixup_prob=1.0, mixup_switch_prob=0.5,
                mixup_mode="batch")  # fmt: skip
    made = {}
    for name, switches in (
        ("random_erasing 0.25", {"random_erasing": 0.25}),
        ("mixup 0.8 + cutmix 1.0", {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}),
        ("both", {"random_erasing": 0.25, "mixup_alpha": 0.8, "cutmix_alpha": 1.0}),
    ):
        ds = OmegaConf.create({**base, **switches})
        made[name] = build_batch_mix(ds, 1000, 0.1, seed=0, rank=0, device="cpu")
    return made


def per_batch(rounds: int) -> dict[str, float]:
    import torch

    mixes = batch_switches()
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    images = torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8)
    labels = torch.randint(0, 1000, (64,))
    times: dict[str, list[float]] = {"normalise (for scale)": [], **{k: [] for k in mixes}}
    for r in range(rounds):
        for b in range(4):  # four batches a round: different lambdas, boxes
            t = time.perf_counter()
            x = (images.float() - mean) / 58.0
            times["normalise (for scale)"].append(time.perf_counter() - t)
            for name, mix in mixes.items():
                y = x.clone()
                t = time.perf_counter()
                mix(y, labels, r, b)
                times[name].append(time.perf_counter() - t)
    return {k: 1000 * median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    what = "run the accuracy rows: accel-report with these accel-train overrides"
    p.add_argument("--accuracy", nargs="*", metavar="OVERRIDE", default=None, help=what)
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    print(f"machine: {machine()}; load average at start: {load_avg()}", flush=True)
    root = write_data(REPO / "outputs" / "bench_data" / "photos", a.images, 10)
    files = sorted(root.rglob("*.jpg"))[: a.images]
    rates: dict[str, list[float]] = {k: [] for k in POLICIES}
    for r in range(a.rounds):
        for policy in POLICIES[r % len(POLICIES) :] + POLICIES[: r % len(POLICIES)]:
            rates[policy].append(per_sample(files, policy))
    none = median(rates["none"])
    rows = [[k, f"{median(v):.0f}", f"{median(v) / none:.2f}"] for k, v in rates.items()]
    print("\n(a) per sample, one core, decode + crop 224 (+ policy)\n")
    print(table(["dataset.auto_augment", "images/s", "vs none"], rows))
    print("\n(b) per batch of 64 x 3 x 224 x 224 float32 on the CPU, one thread\n")
    rows = [[k, f"{v:.1f}"] for k, v in per_batch(a.rounds).items()]
    print(table(["batch step", "ms per batch"], rows))
    print(f"\nload average at end: {load_avg()}")
    if a.accuracy is not None:
        variants = "auto_augment,random_erasing,mixup_cutmix,progressive_resize,layer_decay"
        cmd = ["accel-report", "--variants", variants, "--repeats", "3", *a.accuracy]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()

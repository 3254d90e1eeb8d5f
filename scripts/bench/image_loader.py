#!/usr/bin/env python
"""Photos at full size (issue 38): one training epoch of ImageNet-sized JPEGs through four
loaders at equal augmentation (random resized crop to 224 of the whole image, scale (0.08, 1),
plus a flip, normalised), 2 loader workers, batch 64, a model that costs nothing:

(a) PyTorch's ImageNet example: ``ImageFolder`` + PIL ``RandomResizedCrop(224)`` +
    ``RandomHorizontalFlip`` + ``ToTensor`` + ``Normalize`` in a ``DataLoader``;
(b) timm's ``create_dataset`` / ``create_loader`` (``is_training=True``, ``re_prob=0``,
    ``color_jitter=0``, no prefetcher: there is no CUDA here);
(c) accel-train's real pipeline objects: ``build_image_folder(...)`` (the header check
    included, as a run does it), the loader ``build_loader`` makes (``ShardedOrder``,
    ``getitem(i, epoch)``, its collate) and the device transform ``BatchTransform``, whose
    normalisation runs on the CPU here in the main process (on a GPU it is the device's);
    the CLI's loop is left out: it adds nothing per image;
(d) decoding alone on one core, every file once: PIL (``Image.open(...).convert("RGB")``) and
    simplejpeg (``decode_jpeg(..., fastdct=True)``; accel-train decodes colour JPEGs with it,
    with ``fastupsample`` too for training samples);
(e) one training sample on one core, every file once, from its bytes to the flipped crop: the
    example's transform, and accel-train's ``decode_train`` through simplejpeg and through PIL.

Writes --images photo-like JPEGs once (400-560 x 300-440 px, smooth waves + flat shapes +
noise, quality 90, ~78 KB each, --classes classes) under outputs/bench_data/ (reused when
present). The variants alternate within each round (the order rotates every round); the
medians of --rounds rounds are compared, in images/s of wall time and in images per CPU second
(this process and its loader workers: what the loader costs, whatever else runs). Goals: (c)
>= 2x (a), and (c) per worker >= 0.5x the decode-only rate.

    .venv/bin/python scripts/bench/image_loader.py            # ~5 min on 2 busy cores
    .venv/bin/python scripts/bench/image_loader.py --header-check-only   # (f) alone: seconds

(f) the header check a run does first (``check_images``), on the same files from the page
cache, with and without its end-of-image read (issue 47: a truncated JPEG is refused by its
missing EOI marker): ms per file and what the EOI read adds.
    sudo scripts/bench/top_priority.sh .venv/bin/python scripts/bench/image_loader.py
"""

from __future__ import annotations

import argparse
import io
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, finish_tree, fresh_tree, load_avg, machine, median, table  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SIZE = 224


# ---- the data ---------------------------------------------------------------------------------


def photo(rng):
    """One photo-like PIL image: 400-560 x 300-440 px, ~78 KB at quality 90."""
    import numpy as np
    from PIL import Image, ImageDraw

    w, h = int(rng.integers(400, 561)), int(rng.integers(300, 441))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.empty((h, w, 3), np.float32)
    for c in range(3):
        a, b, p = rng.uniform(-1, 1, 3)
        img[..., c] = 128 + 60 * np.sin(xx * a / 60 + yy * b / 50 + p * 6)
    pil = Image.fromarray(img.astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    for _ in range(int(rng.integers(4, 10))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(20, 200)), y0 + int(rng.integers(20, 200))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=fill)
    arr = np.asarray(pil).astype(np.float32) + rng.normal(0, 15, (h, w, 3))
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def write_data(root: Path, n: int, classes: int) -> Path:
    """root/train/<class>/*.jpg, unless a finished tree with the same parameters is there."""
    import numpy as np

    stamp = f"photos {n} {classes}\n"
    tmp = fresh_tree(root, stamp)
    if tmp is None:
        return root
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = tmp / "train" / f"class{i % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        photo(rng).save(folder / f"{i:06d}.jpg", quality=90)
    finish_tree(tmp, root, stamp)
    print(f"wrote {n} JPEGs under {root} in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


# ---- the loaders: each returns (images, seconds) of one epoch ---------------------------------


def torchvision_example(a, root: Path) -> tuple[int, float]:
    import torch
    from torchvision import datasets, transforms

    t0 = time.perf_counter()
    tf = transforms.Compose([
        transforms.RandomResizedCrop(SIZE),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])  # fmt: skip
    ds = datasets.ImageFolder(str(root / "train"), tf)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=a.batch, shuffle=True, num_workers=a.workers
    )
    n = sum(len(x) for x, _ in loader)
    return n, time.perf_counter() - t0


def timm_loader(a, root: Path) -> tuple[int, float]:
    import torch
    from timm.data import create_dataset, create_loader

    t0 = time.perf_counter()
    ds = create_dataset("", root=str(root), split="train", is_training=True)
    loader = create_loader(
        ds,
        input_size=(3, SIZE, SIZE),
        batch_size=a.batch,
        is_training=True,
        re_prob=0.0,
        scale=(0.08, 1.0),
        hflip=0.5,
        color_jitter=0.0,
        interpolation="bilinear",
        mean=MEAN,
        std=STD,
        num_workers=a.workers,
        use_prefetcher=False,
        persistent_workers=False,
        device=torch.device("cpu"),
    )
    n = sum(len(x) for x, _ in loader)
    return n, time.perf_counter() - t0


def accel_train_loader(a, root: Path) -> tuple[int, float]:
    import torch
    from omegaconf import OmegaConf

    from accel_train.data.images.folder import build_image_folder
    from accel_train.data.loaders import build_loader
    from accel_train.data.transform import BatchTransform

    t0 = time.perf_counter()
    splits = build_image_folder(root=str(root), test_split=None, val_fraction=0.0, image_size=SIZE)
    loader_cfg = OmegaConf.create({
        "name": "torch", "batch_size": a.batch, "eval_batch_size": None, "shuffle": True,
        "drop_last": False, "num_workers": a.workers, "pin_memory": False,
        "persistent_workers": False, "prefetch_factor": 2, "multiprocessing_context": None,
    })  # fmt: skip
    cpu = torch.device("cpu")
    loader = build_loader(
        splits.train, loader_cfg, train=True, device=cpu, seed=0, rank=0, world=1,
        limit=None, num_classes=splits.num_classes,
    )  # fmt: skip
    ds = OmegaConf.create({"mean": list(MEAN), "std": list(STD)})
    transform = BatchTransform(ds, splits, cpu, torch.float32, seed=0, rank=0)
    n = 0
    for b, (x, _y) in enumerate(loader.epoch(0)):
        n += len(transform(x, train=True, epoch=0, batch=b))
    loader.close()
    return n, time.perf_counter() - t0


VARIANTS = {
    "(a) PyTorch ImageNet example": torchvision_example,
    "(b) timm create_loader": timm_loader,
    "(c) accel-train image_folder": accel_train_loader,
}


def decode_pil(data: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def decode_simplejpeg(data: bytes):
    import simplejpeg

    return simplejpeg.decode_jpeg(data, fastdct=True)


DECODERS = {"(d) decode only, 1 core: PIL": decode_pil}


def sample_functions() -> dict:
    """(e) one training sample in this process, from the bytes to the flipped 224 crop: the
    example's transform (to its normalised float tensor), accel-train's path through
    simplejpeg and through PIL (its uint8 crop; normalising is the device's, per batch)."""
    import itertools
    import random

    from PIL import Image
    from torchvision import transforms

    import accel_train.data.images.decode as decode
    from accel_train.data.crops import RandomResizedCrop

    tf = transforms.Compose([
        transforms.RandomResizedCrop(SIZE), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD),
    ])  # fmt: skip
    crop, count = RandomResizedCrop(SIZE, (0.08, 1.0), hflip=True), itertools.count()

    def example(data: bytes):
        with Image.open(io.BytesIO(data)) as im:
            return tf(im.convert("RGB"))

    def ours(data: bytes):
        return decode.decode_train(data, "x", crop, SIZE, random.Random(next(count)))

    def ours_pil(data: bytes):
        saved, decode._SIMPLEJPEG[:] = list(decode._SIMPLEJPEG), [None]
        try:
            return ours(data)
        finally:
            decode._SIMPLEJPEG[:] = saved

    return {
        "(e) one sample, 1 core: the example's transform": example,
        "(e) one sample, 1 core: accel-train (simplejpeg)": ours,
        "(e) one sample, 1 core: accel-train (PIL)": ours_pil,
    }


def decode_pass(fn, files: list[Path]) -> tuple[int, float]:
    """Every file read and decoded once in this process (one core)."""
    t0 = time.perf_counter()
    for f in files:
        fn(f.read_bytes())
    return len(files), time.perf_counter() - t0


def cpu_seconds() -> float:
    """User + system CPU of this process and of its finished (reaped) children: the loader
    workers of an epoch are reaped when it ends. Steadier than wall time on a shared machine."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def header_check_cost(files: list[Path], rounds: int) -> None:
    """(f): check_images over every file, alternating with and without the EOI read (the
    JPEG-end check replaced by a stub), medians of ``rounds``; one thread pool, as a run's."""
    import accel_train.data.images.decode as decode

    paths = [str(f) for f in files]
    decode.check_images(paths)  # warm the page cache and the imports
    real, times = decode._jpeg_ends, {"with the EOI read": [], "headers only": []}
    for r in range(rounds):
        for name in rotate(list(times), r):
            decode._jpeg_ends = real if name == "with the EOI read" else (lambda p, h: True)
            start = time.perf_counter()
            decode.check_images(paths)
            times[name].append(time.perf_counter() - start)
    decode._jpeg_ends = real
    ms = {k: 1e3 * median(v) / len(paths) for k, v in times.items()}
    rows = [[k, f"{v:.4f}", f"{v / ms['headers only']:.2f}"] for k, v in ms.items()]
    print(f"\n(f) the header check, {len(paths)} files, median of {rounds} rounds:")
    print(table(["check_images", "ms per file", "vs headers only"], rows))


def rotate(xs: list, r: int) -> list:
    k = r % len(xs)
    return xs[k:] + xs[:k]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--data", type=Path, default=REPO / "outputs" / "bench_data")
    p.add_argument("--header-check-only", action="store_true", help="only (f): seconds")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)  # every variant's main process alike: the workers take the cores
    root = write_data(a.data / f"photos_{a.images}x{a.classes}cls", a.images, a.classes)
    files = sorted((root / "train").rglob("*.jpg"))
    kb = sum(f.stat().st_size for f in files) / len(files) / 1e3
    try:
        import simplejpeg  # noqa: F401

        DECODERS["(d) decode only, 1 core: simplejpeg fastdct"] = decode_simplejpeg
    except ImportError:
        print("simplejpeg is not installed: its decode-only row is left out")
    print(f"# {machine()}\n# load average before: {load_avg()}; {len(files)} JPEGs, {kb:.0f} KB")
    if a.header_check_only:
        header_check_cost(files, max(a.rounds, 5))
        return
    samples = sample_functions()
    runs = {**VARIANTS, **{k: None for k in DECODERS}, **{k: None for k in samples}}
    rates: dict[str, list[float]] = {k: [] for k in runs}
    per_cpu: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(a.rounds):
        for name in rotate(list(runs), r):
            c0 = cpu_seconds()
            if name in DECODERS or name in samples:
                n, s = decode_pass({**DECODERS, **samples}[name], files)
            else:
                n, s = VARIANTS[name](a, root)
            cpu = cpu_seconds() - c0
            rates[name].append(n / s)
            per_cpu[name].append(n / cpu)
            print(f"round {r + 1}: {name}: {n / s:,.0f} images/s ({s:.1f} s wall, {cpu:.1f} s CPU)",
                  flush=True)  # fmt: skip
    base = median(rates["(a) PyTorch ImageNet example"])
    # The decode-only rates a worker is compared with: PIL's, and simplejpeg's (the decoder
    # accel-train uses for colour JPEGs when it is installed).
    decoders = {k.rsplit(": ", 1)[1].split()[0]: median(rates[k]) for k in DECODERS}
    base_cpu = median(per_cpu["(a) PyTorch ImageNet example"])
    rows = []
    for name, values in rates.items():
        m, c = median(values), median(per_cpu[name])
        per_worker = m / a.workers if name in VARIANTS else m
        rows.append([
            name, f"{m:,.0f}", f"{min(values):,.0f}-{max(values):,.0f}", f"{m / base:.2f}",
            *(f"{per_worker / d:.2f}" for d in decoders.values()), f"{c:,.0f}",
            f"{c / base_cpu:.2f}",
        ])  # fmt: skip
    print(f"\nload average after: {load_avg()}\n")
    headers = ["loader", "images/s (median)", "range", "vs (a)",
               *(f"per worker vs {d} decode" for d in decoders), "images per CPU s",
               "vs (a)"]  # fmt: skip
    print(table(headers, rows))
    header_check_cost(files, max(a.rounds, 5))


if __name__ == "__main__":
    main()

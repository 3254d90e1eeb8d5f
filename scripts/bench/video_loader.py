#!/usr/bin/env python
"""Video clips (issue 49): one training epoch of generated H.264 videos through three paths at
equal work per clip (``--frames`` frames ``--stride`` source frames apart from a random start,
one random resized crop to ``--size`` px and a flip shared by the clip's frames), ``--workers``
loader workers, batch ``--batch``, no model:

(a) the naive loader users write: a Dataset whose ``__getitem__`` opens the file with PyAV and
    decodes frame after frame from the start, keeping the clip's frames and stopping after the
    last one (it never seeks), then torchvision's ``v2.RandomResizedCrop`` and
    ``RandomHorizontalFlip`` on the (T, C, H, W) clip, in a ``DataLoader``;
(b) torchcodec's own decode-only rate for the same frames on one core, in this process:
    ``VideoDecoder(path, num_ffmpeg_threads=1)`` (its default, exact seek mode) and
    ``get_frames_at(indices)``, nothing else;
(c) accel-train's ``dataset=video_folder``: the splits, loader (``build_loader``) and device
    transform (``BatchTransform``, normalising on the CPU here) a run builds from
    ``dataset=video_folder dataset.root=... dataset.frames=F dataset.frame_stride=S
    dataset.image_size=P loader.num_workers=W``; the header check (every file's metadata,
    read once when the run starts) is timed apart and left out of the epoch.

The videos (default 200 of 10 s, 480x360, 30 fps, H.264 by libx264 at its default GOP, CRF 23;
a panning textured background, moving shapes and a little grain, so they compress like camera
footage) are written once under --work-dir (default <temp dir>/accel-bench-video, outside the
repository) and reused. ``--gop N`` writes them with a key frame at least every N frames
(libx264's ``g``; 0, the default: its own 250, i.e. one every 8.3 s at 30 fps), in a folder of
their own (``..._gopN``): (b) and (c) decode a clip from the key frame before it, so a short GOP
is what makes seeking pay, as ``accel-data shard dataset=video_folder gop=N`` writes; the header
line reports the mean file size, the GOP's cost.

The variants alternate within each round (the order rotates every round); medians of --rounds
rounds, in clips/s and frames/s of wall time. Goals: (c) >= 3x (a), and (c) per worker >= 0.7x
(b).

    .venv/bin/python scripts/bench/video_loader.py                       # the measurement
    .venv/bin/python scripts/bench/video_loader.py --num-videos 4 --seconds 2 --rounds 1   # smoke
    .venv/bin/python scripts/bench/video_loader.py --gop 30     # key frames every second
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    composed,
    finish_tree,
    fresh_tree,
    load_avg,
    machine,
    median,
    table,
)

CLASSES = 4  # class folders (the labels do not matter to a loader)
SEED = 0


# ---- the data ---------------------------------------------------------------------------------


def write_video(
    path: Path, seconds: float, width: int, height: int, fps: int, seed: int, gop: int = 0
) -> None:
    """One H.264 MP4 through PyAV's libx264 (one encoder thread): a textured background twice
    the frame's size panned across, three moving rectangles, grain; a key frame at least every
    ``gop`` frames (0: libx264's default)."""
    import av
    import numpy as np

    rng = np.random.default_rng(seed)
    bh, bw = 2 * height, 2 * width
    yy, xx = np.mgrid[0:bh, 0:bw].astype(np.float32)
    background = np.empty((bh, bw, 3), np.float32)
    for c in range(3):
        a, b, p = rng.uniform(-1, 1, 3)
        background[..., c] = 120 + 50 * np.sin(xx * a / 40 + yy * b / 30 + p * 6)
    background += rng.normal(0, 12, (bh, bw, 3))  # texture: fixed, so it pans with the camera
    background = background.clip(0, 255).astype(np.uint8)
    boxes = [
        (rng.integers(0, width - 60), rng.integers(0, height - 60), *rng.uniform(-4, 4, 2),
         rng.integers(0, 256, 3).astype(np.uint8))
        for _ in range(3)
    ]  # fmt: skip
    vx, vy = rng.uniform(-1.5, 1.5, 2)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "23", **({"g": str(gop)} if gop > 0 else {})}
        stream.codec_context.thread_count = 1
        for k in range(int(seconds * fps)):
            x0 = int((width / 2 + vx * k) % width)
            y0 = int((height / 2 + vy * k) % height)
            frame = background[y0 : y0 + height, x0 : x0 + width].copy()
            for bx, by, dx, dy, color in boxes:
                x = int(bx + dx * k) % (width - 60)
                y = int(by + dy * k) % (height - 60)
                frame[y : y + 60, x : x + 60] = color
            grain = rng.integers(-6, 7, frame.shape, dtype=np.int16)
            frame = (frame.astype(np.int16) + grain).clip(0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_data(a: argparse.Namespace) -> Path:
    """<work-dir>/videos_<params>/{train,val}/<class>/*.mp4 (val: one video a class, so that the
    run's layout holds no held-out share of train), unless finished before."""
    name = f"videos_{a.num_videos}x{a.seconds:g}s_{a.width}x{a.height}_{a.fps}fps"
    name += f"_gop{a.gop}" if a.gop > 0 else ""  # (the default GOP's folder keeps its old name)
    root = a.work_dir / name
    stamp = f"{name}\n"
    tmp = fresh_tree(root, stamp)
    if tmp is None:
        return root
    t0 = time.perf_counter()
    jobs = [("train", i) for i in range(a.num_videos)] + [("val", i) for i in range(CLASSES)]
    for split, i in jobs:
        folder = tmp / split / f"class{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        seed = i if split == "train" else 10_000 + i
        write_video(folder / f"{i:05d}.mp4", a.seconds, a.width, a.height, a.fps, seed, a.gop)
    finish_tree(tmp, root, stamp)
    print(f"wrote {len(jobs)} videos under {root} in {time.perf_counter() - t0:.0f} s", flush=True)
    return root


def train_files(root: Path) -> list[tuple[str, int]]:
    files = sorted((root / "train").rglob("*.mp4"))
    return [(str(f), int(f.parent.name.removeprefix("class"))) for f in files]


def clip_indices(a, num_frames: int, index: int, epoch: int) -> list[int]:
    """A random clip's frame indices (the same for (a) and (b))."""
    span = (a.frames - 1) * a.stride + 1
    start = random.Random(f"{SEED}/{epoch}/{index}").randint(0, max(0, num_frames - span))
    return [min(start + k * a.stride, num_frames - 1) for k in range(a.frames)]


# ---- (a) the naive PyAV loader ------------------------------------------------------------------


class NaiveClips:
    """torch Dataset: decode from the start of the file until the clip's last frame."""

    def __init__(self, a, files: list[tuple[str, int]], lengths: list[int]):
        from torchvision.transforms import v2

        self.a, self.files, self.lengths = a, files, lengths
        self.tf = v2.Compose(
            [v2.RandomResizedCrop(a.size, antialias=True), v2.RandomHorizontalFlip()]
        )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import av
        import numpy as np
        import torch

        path, label = self.files[i]
        wanted = clip_indices(self.a, self.lengths[i], i, 0)
        keep, frames = set(wanted), {}
        with av.open(path) as container:
            stream = container.streams.video[0]
            stream.thread_count = 1
            for k, frame in enumerate(container.decode(stream)):
                if k in keep:
                    frames[k] = frame.to_ndarray(format="rgb24")
                if k >= wanted[-1]:
                    break
        clip = torch.from_numpy(np.stack([frames[k] for k in wanted])).permute(0, 3, 1, 2)
        return self.tf(clip).permute(1, 0, 2, 3).contiguous(), label  # (C, T, H, W)


def naive(a, root: Path, files, lengths) -> int:
    import torch

    loader = torch.utils.data.DataLoader(
        NaiveClips(a, files, lengths), batch_size=a.batch, shuffle=True, num_workers=a.workers
    )
    return sum(len(x) for x, _ in loader)


# ---- (b) torchcodec decode-only -----------------------------------------------------------------


def decode_only(a, root: Path, files, lengths) -> int:
    from torchcodec.decoders import VideoDecoder

    for i, (path, _) in enumerate(files):
        decoder = VideoDecoder(path, num_ffmpeg_threads=1)
        decoder.get_frames_at(indices=clip_indices(a, lengths[i], i, 0))
    return len(files)


# ---- (c) accel-train's dataset=video_folder -----------------------------------------------------


def run_config(a, root: Path):
    return composed([
        "dataset=video_folder", f"dataset.root={root}", f"dataset.frames={a.frames}",
        f"dataset.frame_stride={a.stride}", f"dataset.image_size={a.size}",
        f"loader.batch_size={a.batch}", f"loader.num_workers={a.workers}",
        "loader.persistent_workers=false",
    ])  # fmt: skip


def build_ours(a, root: Path):
    """(the splits, the loader config, seconds): the header check included, as a run does it."""
    from accel_train.data.build import build_splits

    cfg = run_config(a, root)
    t0 = time.perf_counter()
    splits = build_splits(cfg.dataset, str(root))
    return splits, cfg, time.perf_counter() - t0


def ours(a, built) -> int:
    import torch

    from accel_train.data.loaders import build_loader
    from accel_train.data.transform import BatchTransform

    splits, cfg, _ = built
    cpu = torch.device("cpu")
    loader = build_loader(
        splits.train, cfg.loader, train=True, device=cpu, seed=SEED, rank=0, world=1,
        limit=None, num_classes=splits.num_classes,
    )  # fmt: skip
    transform = BatchTransform(cfg.dataset, splits, cpu, torch.float32, seed=SEED, rank=0)
    n = 0
    for b, (x, _y) in enumerate(loader.epoch(0)):
        n += len(transform(x, train=True, epoch=0, batch=b))
    loader.close()
    return n


# ---- the rounds ---------------------------------------------------------------------------------

NAIVE, DECODE, OURS = (
    "(a) naive PyAV loader",
    "(b) torchcodec decode only, 1 core",
    "(c) accel-train dataset=video_folder",
)


def rotate(xs: list, r: int) -> list:
    k = r % len(xs)
    return xs[k:] + xs[:k]


def measure(a, root: Path) -> dict[str, list[float]]:
    """clips/s of each variant, one epoch a round, the order rotating."""
    from torchcodec.decoders import VideoDecoder

    files = train_files(root)
    lengths = [int(VideoDecoder(p).metadata.num_frames) for p, _ in files]
    built = build_ours(a, root)
    print(f"(c)'s header check (every file's metadata, once a run): {built[2]:.1f} s", flush=True)
    runs = {
        NAIVE: lambda: naive(a, root, files, lengths),
        DECODE: lambda: decode_only(a, root, files, lengths),
        OURS: lambda: ours(a, built),
    }
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(a.rounds):
        for name in rotate(list(runs), r):
            t0 = time.perf_counter()
            n = runs[name]()
            s = time.perf_counter() - t0
            rates[name].append(n / s)
            print(f"round {r + 1}: {name}: {n / s:.1f} clips/s ({n} clips, {s:.1f} s)", flush=True)
    return rates


def report(a, rates: dict[str, list[float]]) -> None:
    m = {k: median(v) for k, v in rates.items()}
    rows = []
    for name, values in rates.items():
        per_worker = m[name] / a.workers if name != DECODE else m[name]
        rows.append([
            name, f"{m[name]:.1f}", f"{m[name] * a.frames:,.0f}",
            f"{min(values):.1f}-{max(values):.1f}", f"{m[name] / m[NAIVE]:.2f}",
            f"{per_worker / m[DECODE]:.2f}",
        ])  # fmt: skip
    print(f"\nload average after: {load_avg()}\n")
    headers = ["loader", "clips/s (median)", "frames/s", "range", "vs (a)",
               "per worker vs (b)"]  # fmt: skip
    print(table(headers, rows))
    vs_naive, per_worker = m[OURS] / m[NAIVE], m[OURS] / a.workers / m[DECODE]
    print(
        f"\ngoals: (c) >= 3x (a): {vs_naive:.2f}x {'met' if vs_naive >= 3 else 'NOT met'}; "
        f"(c) per worker >= 0.7x (b): {per_worker:.2f}x "
        f"{'met' if per_worker >= 0.7 else 'NOT met'}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-videos", type=int, default=200)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--width", type=int, default=480)
    p.add_argument("--height", type=int, default=360)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--frames", type=int, default=16, help="frames per clip")
    p.add_argument("--stride", type=int, default=2, help="source frames between a clip's frames")
    p.add_argument("--size", type=int, default=112, help="the crop's side in pixels")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--gop", type=int, default=0, help="a key frame at least every N frames (0: libx264's 250)"
    )
    p.add_argument(
        "--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "accel-bench-video"
    )
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)  # every variant's main process alike: the workers take the cores
    root = write_data(a)
    sizes = [f.stat().st_size for f in (root / "train").rglob("*.mp4")]
    gop = f"GOP {a.gop}" if a.gop > 0 else "libx264's default GOP"
    print(f"# {machine()}\n# load average before: {load_avg()}; {a.num_videos} videos of "
          f"{a.seconds:g} s, {a.width}x{a.height}, {a.fps} fps, H.264 ({gop}, mean "
          f"{sum(sizes) / len(sizes) / 1e6:.2f} MB); clips of {a.frames} frames at stride "
          f"{a.stride}, {a.size} px crops, {a.workers} workers")  # fmt: skip
    report(a, measure(a, root))


if __name__ == "__main__":
    main()

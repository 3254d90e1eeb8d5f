#!/usr/bin/env python
"""dataset=streaming vs dataset=image_folder: samples/s and peak RSS (docs/streaming.md).

Writes a JPEG tree once (scripts/bench/image_folder.py's generator, under outputs/bench_data/),
shards it with `accel-data shard` to a local folder and to moto's S3 server (started here on
127.0.0.1, plain http), and measures, each variant in its own process (so its peak RSS is its
own, workers included):

1. the loader alone: one training epoch through accel-train's loader (`build_loader`, batch
   256, augment=cpu), no model: image_folder with cache none / ram, streaming from the local
   shards, streaming from S3 with a cold cache (emptied before every run) and a warm one (kept),
   at num_workers 0 / 1 / 2;
2. a resnet18 training epoch through the real CLI (train/epoch_samples_per_s), the same
   variants at num_workers 0 / 2 (--skip-train leaves this out).

Variants alternate within each round (the order rotates every round); medians, and ratios
against image_folder (cache none) at the same num_workers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, console_script, load_avg, machine, median, table  # noqa: E402
from image_folder import write_data  # noqa: E402

VARIANTS = ("image_folder", "image_folder+ram", "stream local", "stream s3 cold", "stream s3 warm")
BUCKET = "bench"
SECRETS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}


def child_loader(args: argparse.Namespace) -> None:
    """One loader epoch in this process: prints samples/s (its peak RSS is measured by the
    wrapper process that runs it, peak_rss_of: ru_maxrss survives exec, so a child of this
    script would report the parent's)."""
    import torch
    from omegaconf import OmegaConf

    from accel_train.data.loaders import build_loader

    if args.variant.startswith("image_folder"):
        from accel_train.data.images.folder import build_image_folder

        cache = "ram" if args.variant.endswith("ram") else "none"
        splits = build_image_folder(root=args.root, image_size=args.size, cache=cache)
    else:
        from accel_train.data.images.streaming import build_streaming

        remote = args.local_shards if "local" in args.variant else f"s3://{BUCKET}/bench"
        splits = build_streaming(
            remote=remote, local=args.cache, cache_limit="20gb", image_size=args.size
        )
    cfg = OmegaConf.create(
        {
            "name": "torch",
            "batch_size": 256,
            "num_workers": args.workers,
            "shuffle": True,
            "pin_memory": False,
            "persistent_workers": False,
            "prefetch_factor": 2,
            "multiprocessing_context": None,
            "drop_last": False,
        }
    )
    loader = build_loader(
        splits.train,
        cfg,
        train=True,
        device=torch.device("cpu"),
        seed=0,
        rank=0,
        world=1,
        limit=0,
        num_classes=splits.num_classes,
    )
    t0 = time.perf_counter()
    n = sum(len(y) for _, y in loader.epoch(0))
    wall = time.perf_counter() - t0
    loader.close()
    print(json.dumps({"samples_per_s": n / wall}))


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [console_script("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    return proc, f"http://127.0.0.1:{port}"


def peak_rss_of(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """Run cmd in a wrapper process: the peak RSS (MiB) of the largest of its processes."""
    wrapper = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True,"
        " text=True); sys.stdout.write(p.stdout); sys.stderr.write(p.stderr);"
        " print('RSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env
    )
    rss = float(proc.stdout.rsplit("RSS", 1)[1]) if "RSS" in proc.stdout else float("nan")
    return proc, rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--px", type=int, default=96, help="side of the generated JPEGs")
    p.add_argument("--size", type=int, default=64, help="dataset.image_size")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--train-batches", type=int, default=8, help="resnet18: batches of 64 timed")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--local-shards", default="", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child_loader(a)
        return

    data_root = REPO / "outputs" / "bench_data"
    root = write_data(
        data_root / f"stream_jpegs_{a.images}_{a.px}_{a.classes}", a.images, a.px, a.classes
    )
    work = Path(tempfile.mkdtemp(prefix="accel_bench_stream_"))
    moto, endpoint = start_moto()
    env = {
        **os.environ,
        **SECRETS,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **_keys()).create_bucket(
            Bucket=BUCKET
        )
        shards = work / "shards"
        for out in (shards, f"s3://{BUCKET}/bench"):
            cmd = [console_script("accel-data"), "shard", "dataset=image_folder"]
            cmd += [f"dataset.root={root}", "dataset.test_split=null", f"out={out}"]
            cmd += ["chunk_bytes=4MB"]
            subprocess.run(cmd, check=True, env=env, capture_output=True)
        print(f"machine: {machine()}; load {load_avg()}", flush=True)
        loader_table(a, root, shards, work, env)
        if not a.skip_train:
            train_table(a, root, shards, work, env)
    finally:
        moto.terminate()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)


def _keys() -> dict:
    return {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


def loader_table(a, root: Path, shards: Path, work: Path, env: dict) -> None:
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    warm = work / "cache_warm"
    for r in range(a.rounds):
        for workers in (0, 1, 2):
            order = list(VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)])
            for v in order:
                cache = warm if v.endswith("warm") else work / "cache_cold"
                if v.endswith("cold"):
                    shutil.rmtree(cache, ignore_errors=True)
                cmd = [sys.executable, __file__, "--child", f"--variant={v}"]
                cmd += [f"--workers={workers}", f"--root={root}", f"--size={a.size}"]
                cmd += [f"--local-shards={shards}", f"--cache={cache}"]
                if v.endswith("warm") and not warm.exists():  # fill the warm cache first
                    subprocess.run(cmd, env=env, capture_output=True, check=True)
                proc, rss = peak_rss_of(cmd, env)
                if proc.returncode:
                    sys.exit(f"{v} workers={workers} failed:\n{proc.stderr[-3000:]}")
                out = json.loads(proc.stdout.strip().splitlines()[-2])
                out["rss_mib"] = rss
                results.setdefault((v, workers), []).append((out["samples_per_s"], rss))
                print(f"  loader {v} w={workers}: {out}", flush=True)
    rows = []
    for workers in (0, 1, 2):
        base = median([s for s, _ in results[("image_folder", workers)]])
        for v in VARIANTS:
            speed = median([s for s, _ in results[(v, workers)]])
            rss = max(m for _, m in results[(v, workers)])
            rows.append([v, str(workers), f"{speed:.0f}", f"{speed / base:.2f}", f"{rss:.0f}"])
    print(
        f"\n1. loader alone, one epoch of {a.images} images, image_size {a.size}, batch 256 "
        f"(median of {a.rounds} rounds):"
    )
    print(table(["variant", "workers", "samples/s", "vs image_folder", "peak RSS MiB"], rows))


def train_table(a, root: Path, shards: Path, work: Path, env: dict) -> None:
    rows, results = [], {}
    warm = work / "cache_warm"
    for workers in (0, 2):
        for v in VARIANTS:
            run_dir = work / f"run_{v.replace(' ', '_')}_{workers}"
            cmd = [console_script("accel-train"), "model=resnet18", "trainer.max_epochs=1"]
            cmd += ["trainer.progress=none", "trainer.plot_curves=false", "logger=none"]
            cmd += [f"loader.num_workers={workers}", "loader.batch_size=64"]
            cmd += [f"dataset.image_size={a.size}", "trainer.test_after_fit=false"]
            cmd += ["trainer.limit_val_batches=1", f"hydra.run.dir={run_dir}"]
            cmd += [f"trainer.limit_train_batches={a.train_batches}"]
            if v.startswith("image_folder"):
                cmd += ["dataset=image_folder", f"dataset.root={root}", "dataset.test_split=null"]
                cmd += ["dataset.cache=ram" if v.endswith("ram") else "dataset.cache=none"]
            else:
                remote = shards if "local" in v else f"s3://{BUCKET}/bench"
                cache = warm if v.endswith("warm") else work / "cache_cold"
                if v.endswith("cold"):
                    shutil.rmtree(cache, ignore_errors=True)
                cmd += ["dataset=streaming", f"dataset.remote={remote}", f"dataset.local={cache}"]
            proc, rss = peak_rss_of(cmd, env)
            if proc.returncode:
                sys.exit(f"{v} failed:\n{proc.stderr[-3000:]}")
            metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            speed = [
                m["train/epoch_samples_per_s"] for m in metrics if "train/epoch_samples_per_s" in m
            ][0]
            results[(v, workers)] = (speed, rss)
            print(f"  resnet18 {v} w={workers}: {speed:.1f} samples/s, {rss:.0f} MiB", flush=True)
    for workers in (0, 2):
        base = results[("image_folder", workers)][0]
        for v in VARIANTS:
            speed, rss = results[(v, workers)]
            rows.append([v, str(workers), f"{speed:.1f}", f"{speed / base:.2f}", f"{rss:.0f}"])
    print(
        f"\n2. resnet18, a training epoch of {a.train_batches} batches of 64 through "
        f"accel-train (fp32, CPU, image_size {a.size}; peak RSS: the training process):"
    )
    print(table(["variant", "workers", "samples/s", "vs image_folder", "peak RSS MiB"], rows))


if __name__ == "__main__":
    main()

"""DDP on this machine: 1 process vs 2 gloo processes, side by side, through the real CLI.

Reports, for the same global batch:
  * per-step time (median over epochs after the first) and throughput;
  * start-up time: from running `accel-train` to its first optimizer step (measured by
    watching metrics.jsonl, with a line logged every step);
  * the gradient all-reduce: the same bytes DDP reduces (the model's gradients, fp32) all-reduced
    by 2 gloo processes, timed alone, as a share of the 2-process step.

    python scripts/bench/ddp_scaling.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import composed  # noqa: E402

BIN = Path(sys.executable).parent


def run_cli(nproc: int, args, workdir: Path) -> dict:
    run_dir = workdir / f"n{nproc}_{time.time_ns()}"
    cores = os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // nproc))}
    cmd = [
        str(BIN / "accel-train"),
        "dataset=mnist",
        f"paths.data_dir={args.data_dir}",
        "model=mnist_cnn",
        "loader=device",
        "strategy=ddp",
        f"launcher.nproc_per_node={nproc}",
        f"loader.batch_size={args.global_batch // nproc}",
        f"trainer.max_epochs={args.epochs}",
        "trainer.log_every_n_steps=1",
        "trainer.val_every_n_epochs=1000",
        "trainer.progress=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    metrics = run_dir / "metrics.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first_step = None
    while proc.poll() is None:
        if first_step is None and metrics.exists() and '"train/loss"' in metrics.read_text():
            first_step = time.perf_counter() - start
        time.sleep(0.02)
    if proc.returncode != 0:
        raise SystemExit(f"accel-train failed:\n{proc.stderr.read().decode()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    epoch_s = [r["train/epoch_s"] for r in rows if "train/epoch_s" in r][1:]  # drop warm-up
    steps_per_epoch = summary["steps"] // summary["epochs"]
    return {
        "step_ms": 1000 * statistics.median(epoch_s) / steps_per_epoch,
        "samples_per_s": args.global_batch * steps_per_epoch / statistics.median(epoch_s),
        "startup_s": first_step,
    }


def _allreduce_worker(rank: int, port: int, numel: int, iters: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        grad = torch.randn(numel)
        for _ in range(3):
            dist.all_reduce(grad)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(grad)
        elapsed = (time.perf_counter() - t0) / iters
        if rank == 0:
            Path(out).write_text(str(elapsed))
    finally:
        dist.destroy_process_group()


def allreduce_ms(numel: int, iters: int = 30) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile() as f:
        mp.spawn(_allreduce_worker, args=(port, numel, iters, f.name), nprocs=2)
        return 1000 * float(Path(f.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--epochs", type=int, default=3, help="per run; the first is warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="alternating 1/2-process rounds")
    parser.add_argument("--global-batch", type=int, default=128)
    args = parser.parse_args()
    args.data_dir = str(Path(args.data_dir).resolve())

    results: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for nproc in (1, 2):
                res = run_cli(nproc, args, Path(tmp))
                results[nproc].append(res)
                print(f"round {r} nproc {nproc}: {res}", flush=True)

    from accel_train.models import build_model, count_parameters

    numel = count_parameters(
        build_model(
            composed(["model=mnist_cnn"]).model,
            {"in_channels": 1, "image_size": 28, "num_classes": 10},
        )
    )
    ar_ms = allreduce_ms(numel)

    def med(n, key):
        return statistics.median(x[key] for x in results[n])

    step1, step2 = med(1, "step_ms"), med(2, "step_ms")
    print()
    print(
        f"global batch {args.global_batch}, mnist_cnn, loader=device, fp32, gloo, "
        f"{os.cpu_count()} cores, torch {torch.__version__}"
    )
    print(
        f"{'processes':>10} {'threads/proc':>12} {'step ms':>9} {'samples/s':>10} "
        f"{'start-up s':>11}"
    )
    for n in (1, 2):
        print(
            f"{n:>10} {max(1, (os.cpu_count() or 1) // n):>12} {med(n, 'step_ms'):>9.1f} "
            f"{med(n, 'samples_per_s'):>10.0f} {med(n, 'startup_s'):>11.1f}"
        )
    print(f"speed-up 2 vs 1 process: {step1 / step2:.2f}x")
    print(
        f"gradient all-reduce ({numel * 4 / 2**20:.1f} MiB fp32, 2 gloo procs): "
        f"{ar_ms:.1f} ms = {100 * ar_ms / step2:.0f}% of the 2-process step"
    )


if __name__ == "__main__":
    main()

"""Pipeline parallelism on this CPU (issue 12): step time per schedule and micro-batch count
against the ideal, parameter/optimizer memory per stage, and 2 stages vs DDP 2 vs 1 process.

It times the training step itself (the pipeline strategy's step + the optimizer step), not a CLI
run: start-up would swamp the differences. Each variant runs in fresh gloo processes (one thread
each) on resnet18 at small images; the variants are interleaved over `--rounds` rounds and the
medians reported, with the load average next to each (the machine is shared).

    python scripts/bench/pipeline.py --rounds 3 --steps 6
    python scripts/bench/pipeline.py --rounds 2 --steps 6 \
        --only "1 process;pipeline 2, 1f1b, m=4;pipeline 2, 1f1b, m=4, split layer3"

Ideal for p balanced stages and m micro-batches: T1 / p * (m + p - 1) / m, T1 the one-process
step time (the bubble is (p-1)/(m+p-1) of the pipelined step)."""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from accel_train.models import resnet18
from accel_train.parallel import DistEnv
from accel_train.precision import resolve_precision
from accel_train.strategies import strategy_for

IMAGE, CLASSES, BATCH = 16, 10, 32


def _worker(rank, world, port, variant, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    device = torch.device("cpu")
    env = DistEnv(rank, rank, world, device)
    precision = resolve_precision("fp32", device)
    model = resnet18(in_channels=3, image_size=IMAGE, num_classes=CLASSES)
    x = torch.randn(BATCH, 3, IMAGE, IMAGE)
    y = torch.randint(0, CLASSES, (BATCH,))
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    pipe = None
    if variant["kind"] == "pipeline":
        cfg = OmegaConf.create(
            {
                "strategy": {
                    "name": "pipeline",
                    "stages": 0,
                    "split_points": variant.get("split", []),
                    "schedule": variant["schedule"],
                    "microbatches": variant["m"],
                },
                "model": {"_target_": "resnet18"},
                "loader": {"batch_size": BATCH},
            }
        )
        strategy = strategy_for(cfg)  # cuts the model, as a training run's build does
        train = strategy.wrap(model, env, x[:2], precision).model
        pipe = strategy.pipe
    elif variant["kind"] == "ddp":
        train = DistributedDataParallel(model)
        x, y = x[: BATCH // world], y[: BATCH // world]  # the same global batch
    else:
        train = model
    params = list(train.parameters())
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    times, cpu = [], []
    for i in range(steps + 2):  # 2 warm-up steps
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if pipe is not None:
            pipe.step(x, y, 1.0, loss_fn, scaler)
        else:
            loss_fn(train(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    state_bytes = sum(p.numel() * p.element_size() for p in params) * 3  # weights, grads, momentum
    out[rank] = {
        "step_s": statistics.median(times),
        "cpu_s": statistics.median(cpu),
        "params": sum(p.numel() for p in params),
        "state_mib": state_bytes / 2**20,
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if world > 1:
        dist.destroy_process_group()


def run(variant: dict, steps: int, port: int) -> dict:
    world = variant["world"]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, (world, port, variant, steps, out), nprocs=world, join=True)
        return {r: dict(out[r]) for r in range(world)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default="", help="variant names separated by ';'")
    args = parser.parse_args()
    variants = {
        "1 process": {"kind": "single", "world": 1},
        "DDP 2": {"kind": "ddp", "world": 2},
        **{
            f"pipeline 2, {s}, m={m}": {"kind": "pipeline", "world": 2, "schedule": s, "m": m}
            for s in ("gpipe", "1f1b")
            for m in (2, 4, 8)
        },
        # By compute rather than parameters: layer1-2 hold 6% of the weights but run at the
        # highest resolution.
        "pipeline 2, 1f1b, m=4, split layer3": {
            "kind": "pipeline",
            "world": 2,
            "schedule": "1f1b",
            "m": 4,
            "split": ["layer3"],
        },
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only.split(";")}
    results: dict[str, list] = {name: [] for name in variants}
    port = 29600
    for r in range(args.rounds):
        for name, variant in variants.items():
            port += 1
            load = os.getloadavg()[0]
            per_rank = run(variant, args.steps, port)
            results[name].append((per_rank, load))
            step = max(v["step_s"] for v in per_rank.values())
            print(f"round {r} {name:24s} step {step:.3f} s  load {load:.1f}", flush=True)
    t1 = statistics.median(res[0][0]["step_s"] for res in results["1 process"])
    print(
        f"\nmedians over {args.rounds} rounds of {args.steps} steps; resnet18 {IMAGE}x{IMAGE}, "
        f"global batch {BATCH}, fp32, 1 thread per process"
    )
    print(
        "| variant | step s (median) | vs 1 process | ideal s | bubble (p-1)/(m+p-1) | "
        "CPU s/step per rank | params per rank | weights+grads+momentum MiB per rank | "
        "peak RSS MiB per rank | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, variant in variants.items():
        rows = results[name]
        step = statistics.median(max(v["step_s"] for v in pr.values()) for pr, _ in rows)
        load = statistics.median(load for _, load in rows)
        last = rows[-1][0]
        ranks = sorted(last)
        cpu = " / ".join(
            f"{statistics.median(pr[k]['cpu_s'] for pr, _ in rows):.2f}" for k in ranks
        )
        params = " / ".join(f"{last[k]['params'] / 1e6:.2f}M" for k in ranks)
        state = " / ".join(f"{last[k]['state_mib']:.0f}" for k in ranks)
        rss = " / ".join(f"{last[k]['maxrss_mib']:.0f}" for k in ranks)
        if variant["kind"] == "pipeline":
            p, m = 2, variant["m"]
            ideal, bubble = t1 / p * (m + p - 1) / m, f"{(p - 1) / (m + p - 1):.2f}"
            ideal_s = f"{ideal:.3f}"
        elif variant["kind"] == "ddp":
            ideal_s, bubble = f"{t1 / 2:.3f}", "-"
        else:
            ideal_s, bubble = "-", "-"
        print(
            f"| {name} | {step:.3f} | {t1 / step:.2f}x | {ideal_s} | {bubble} | {cpu} | "
            f"{params} | {state} | {rss} | {load:.1f} |"
        )


if __name__ == "__main__":
    main()

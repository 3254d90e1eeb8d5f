"""The memory techniques on this CPU: activation checkpointing's peak memory and step time,
EMA's cost per step, and loader.batch_size=auto's probe table.

python scripts/bench/memory.py ac --rounds 3          # resnet18, 64 px, batch 64
python scripts/bench/memory.py ema --rounds 5
python scripts/bench/memory.py auto                   # the CLI's probe table (mnist_cnn)

`ac`: each variant runs in a fresh child process (alternating off/selective/full, `--rounds`
times; glibc's mmap threshold fixed so freed activations leave the RSS): 1 warm-up step, then
the peak RSS (VmHWM, reset after the warm-up) minus the RSS before the timed steps (the memory
a step adds: activations, gradients' temporaries), and the median CPU seconds per step. `ema`:
one process, the update (Ema.on_train_step_end) timed against the training step of the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from _common import console_script, load_avg, machine


def _kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _resnet_step(mode: str, batch: int, size: int, steps: int) -> dict:
    """In the child: resnet18 with activation_checkpointing.mode=`mode`, `steps` steps."""
    import torch
    from omegaconf import OmegaConf

    from accel_train.models import resnet18
    from accel_train.techniques.activation_checkpointing import ActivationCheckpointing

    torch.manual_seed(0)
    model = resnet18(in_channels=3, image_size=size, num_classes=10)
    if mode != "off":
        ctx = SimpleNamespace(
            cfg=OmegaConf.create({"trainer": {"compile": False}}),
            env=SimpleNamespace(is_main=False),
        )
        model = ActivationCheckpointing(mode, every=2).transform(model, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: allocates the momentum buffers
    Path("/proc/self/clear_refs").write_text("5")
    base = _kib("VmRSS")
    cpu, wall = [], []
    for _ in range(steps):
        c, w = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {
        "mode": mode,
        "step_peak_mib": (_kib("VmHWM") - base) / 1024,
        "cpu_s": statistics.median(cpu),
        "wall_s": statistics.median(wall),
    }


def bench_ac(a: argparse.Namespace) -> None:
    results: dict[str, list[dict]] = {"off": [], "selective": [], "full": []}
    for r in range(a.rounds):
        for mode in results:
            cmd = [sys.executable, __file__, "child", mode, str(a.batch), str(a.size), str(a.steps)]
            # A fixed mmap threshold: glibc maps every large block and unmaps it when freed, so
            # the RSS between steps drops back and the peak above it is the step's own memory
            # (glibc's default raises the threshold and keeps freed blocks in the heap).
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
            results[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r} {results[mode][-1]}  load {load_avg()}", flush=True)
    off = {k: statistics.median(x[k] for x in results["off"]) for k in ("step_peak_mib", "cpu_s")}
    print(f"\nresnet18, {a.size} px, batch {a.batch}, {a.steps} steps x {a.rounds} rounds")
    print(f"{machine()}; load after: {load_avg()}")
    print("| mode | step peak RSS (MiB) | vs off | CPU s/step | vs off | wall s/step |")
    print("|---|---|---|---|---|---|")
    for mode, rows in results.items():
        peak = statistics.median(x["step_peak_mib"] for x in rows)
        cpu = statistics.median(x["cpu_s"] for x in rows)
        wall = statistics.median(x["wall_s"] for x in rows)
        print(
            f"| {mode} | {peak:.0f} | {peak / off['step_peak_mib'] - 1:+.0%} | {cpu:.2f} | "
            f"{cpu / off['cpu_s'] - 1:+.0%} | {wall:.2f} |"
        )


def bench_ema(a: argparse.Namespace) -> None:
    import torch

    from accel_train.models import resnet18
    from accel_train.techniques.ema import Ema

    torch.manual_seed(0)
    model = resnet18(in_channels=3, image_size=a.size, num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(a.batch, 3, a.size, a.size), torch.randint(0, 10, (a.batch,))
    ema = Ema(0.999)
    loop = SimpleNamespace(module=model, step=10)
    ema.on_fit_start(loop)
    steps, updates = [], []
    for _ in range(a.rounds * 3):
        c = time.process_time()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(time.process_time() - c)
        c = time.process_time()
        ema.on_train_step_end(loop)
        updates.append(time.process_time() - c)
    step, update = statistics.median(steps[1:]), statistics.median(updates[1:])
    n = sum(t.numel() for t in ema.average)
    print(f"resnet18 ({n:,} averaged values), {a.size} px, batch {a.batch}; {machine()}")
    print(f"load: {load_avg()}")
    print("| training step CPU s | EMA update CPU s | overhead |\n|---|---|---|")
    print(f"| {step:.3f} | {update:.4f} | {update / step:+.1%} |")


def bench_auto(a: argparse.Namespace) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="accel_bench_auto_"))
    cmd = [
        console_script("accel-train"),
        "model=mnist_cnn",
        "dataset=synthetic",
        "dataset.num_train=4096",
        "loader.batch_size=auto",
        f"loader.max_batch_size={a.max_batch}",
        "trainer.max_steps=1",
        "trainer.progress=none",
        "trainer.test_after_fit=false",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    print(" ".join(["accel-train", *cmd[1:-1]]))
    print(f"{machine()}; load after: {load_avg()}")
    print((run_dir / "batch_size_probe.csv").read_text())
    import yaml

    chosen = yaml.safe_load((run_dir / "config.yaml").read_text())["loader"]["batch_size"]
    print(f"chosen: loader.batch_size={chosen}")


def main() -> None:
    if sys.argv[1] == "child":
        mode, batch, size, steps = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(_resnet_step(mode, batch, size, steps)))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["ac", "ema", "auto"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=512)
    a = parser.parse_args()
    {"ac": bench_ac, "ema": bench_ema, "auto": bench_auto}[a.what](a)


if __name__ == "__main__":
    main()

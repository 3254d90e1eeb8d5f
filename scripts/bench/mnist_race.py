#!/usr/bin/env python
"""The mnist_amp race (issue 9): `accel-train +experiment=mnist_amp`, launch to exit, against a
careful hand-written PyTorch loop doing the same job on the same machine.

The hand loop (--hand-worker, run as its own subprocess so its imports count too) is what an
experienced engineer writes for this job, with no framework:

- MNIST's IDX files read straight into one uint8 tensor (the 5,000-image training subset; 10% held
  out for validation like accel-train's `dataset.val_fraction`, so both train on 4,500 images);
- label smoothing 0.1, as the recipe;
- a 0.32 M-parameter CNN (conv32 5x5 - pool - conv64 5x5 - pool - fc256 - fc10: accel-train's
  `model=small_cnn`), Adam + OneCycle, +-2 px random shifts drawn on the batch, batch 64;
- `--precision amp` (the default): bf16 autocast where the CPU has native bf16, else fp32 (what
  `precision=amp` does: bf16 is emulated, 5x slower, on CPUs without AVX512-BF16/AMX);
  `--precision fp32` or `bf16`: that precision on both sides (accel-train gets `precision=`);
- one validation pass at the end and one test pass on the 10,000 test images.

The two alternate (hand, accel, accel, hand, ...) for --rounds rounds. Reported per side: wall
seconds launch to exit (median, min, max), CPU seconds, and test accuracy. accel-train's run also
records its time to the target (`trainer.stop_at`) when the experiment sets one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_DATA_DIR,
    console_script,
    load_avg,
    machine,
    median,
    table,
    timed,
)


def hand_worker(a: argparse.Namespace) -> None:
    start = time.perf_counter()
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch import nn

    def idx(path: Path) -> torch.Tensor:
        data = path.read_bytes()
        ndim = data[3]
        shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
        return torch.from_numpy(np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).copy()).view(
            shape
        )

    raw = Path(a.data_dir) / "MNIST" / "raw"
    x_all, y_all = idx(raw / "train-images-idx3-ubyte"), idx(raw / "train-labels-idx1-ubyte")
    x_test, y_test = idx(raw / "t10k-images-idx3-ubyte"), idx(raw / "t10k-labels-idx1-ubyte")
    torch.manual_seed(0)
    perm = torch.randperm(len(x_all))
    n_val = len(x_all) // 10
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    x_train, y_train = x_all[train_idx], y_all[train_idx].long()
    x_val, y_val = x_all[val_idx], y_all[val_idx].long()
    torch.manual_seed(a.seed)  # the split stays fixed (seed 0); weights and order follow --seed

    def prep(x: torch.Tensor) -> torch.Tensor:
        return ((x.float() / 255.0) - 0.1307).div_(0.3081).unsqueeze(1)

    model = nn.Sequential(
        nn.Conv2d(1, 32, 5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1024, 256),
        nn.ReLU(inplace=True),
        nn.Dropout(0.25),
        nn.Linear(256, 10),
    )
    fast_bf16 = torch.backends.cpu.get_cpu_capability() in ("AVX512_BF16", "AMX")
    amp = torch.bfloat16 if fast_bf16 else None
    dtype = {"amp": amp, "bf16": torch.bfloat16, "fp32": None}[a.precision]
    epochs, bs = a.epochs, 64
    steps = epochs * ((len(x_train) + bs - 1) // bs)
    opt = torch.optim.Adam(model.parameters(), lr=0.002)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.003, total_steps=steps)

    def shift(x: torch.Tensor) -> torch.Tensor:
        dx, dy = torch.randint(-2, 3, (2,)).tolist()  # one shift per batch: cheap
        return torch.roll(x, shifts=(dy, dx), dims=(2, 3))

    def evaluate(x, y) -> float:
        model.eval()
        correct = 0
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            for i in range(0, len(x), 1000):
                correct += (model(prep(x[i : i + 1000])).argmax(1) == y[i : i + 1000]).sum().item()
        model.train()
        return correct / len(x)

    for _ in range(epochs):
        order = torch.randperm(len(x_train))
        for i in range(0, len(order), bs):
            b = order[i : i + bs]
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits = model(shift(prep(x_train[b])))
                loss = F.cross_entropy(logits, y_train[b], label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    val_acc = evaluate(x_val, y_val)
    test_acc = evaluate(x_test, y_test.long())
    own_s = time.perf_counter() - start
    print(json.dumps({"val_acc": val_acc, "test_acc": test_acc, "own_s": own_s}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=8, help="the hand loop's epochs")
    p.add_argument("--out", default="outputs/bench_race")
    p.add_argument("--precision", choices=["amp", "fp32", "bf16"], default="amp")
    p.add_argument("--seed", type=int, default=42, help="both sides' training seed")
    p.add_argument("--hand-worker", action="store_true", help=argparse.SUPPRESS)
    a, extra = p.parse_known_args()
    if a.hand_worker:
        hand_worker(a)
        return
    print(machine())
    results: dict[str, list[dict]] = {"hand": [], "accel": []}
    for r in range(a.rounds):
        order = ("hand", "accel") if r % 2 == 0 else ("accel", "hand")
        for side in order:
            load = load_avg()
            if side == "hand":
                cmd = [sys.executable, __file__, "--hand-worker", f"--data-dir={a.data_dir}"]
                cmd += [f"--precision={a.precision}", f"--seed={a.seed}"]
                proc, wall, cpu = timed([*cmd, f"--epochs={a.epochs}"])
                out = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                run_dir = Path(a.out).resolve() / f"r{r}"
                cmd = [
                    console_script("accel-train"),
                    "+experiment=mnist_amp",
                    f"paths.data_dir={a.data_dir}",
                    "trainer.progress=none",
                    f"precision={a.precision}",
                    f"trainer.seed={a.seed}",
                    f"hydra.run.dir={run_dir}",
                    *extra,
                ]
                proc, wall, cpu = timed(cmd)
                out = json.loads((run_dir / "summary.json").read_text())
            row = {"wall": wall, "cpu": cpu, "test_acc": out["test_acc"], "load": load}
            row["time_to_target_s"] = out.get("time_to_target_s")
            results[side].append(row)
            print(f"round {r + 1} {side}: {json.dumps(row)}", flush=True)
    rows = []
    for side, runs in results.items():
        walls = [x["wall"] for x in runs]
        rows.append(
            [
                side,
                f"{median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f})",
                f"{median([x['cpu'] for x in runs]):.1f}",
                " ".join(f"{x['test_acc']:.4f}" for x in runs),
            ]
        )
    print(table(["side", "wall s launch to exit, median (min-max)", "CPU s", "test acc"], rows))
    ratio = median([x["wall"] for x in results["accel"]]) / median(
        [x["wall"] for x in results["hand"]]
    )
    print(f"accel / hand wall: {ratio:.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""The gpt_char race (issue 18): `accel-train +experiment=gpt_char`, launch to exit, against a
hand-written nanoGPT-style loop doing the same job on the same machine.

The hand loop (--hand-worker, its own subprocess so its imports count too) is nanoGPT's
`train.py` reduced to this job, with no framework:

- train.bin / val.bin memory-mapped; each batch is `batch` random windows of block_size + 1
  tokens (nanoGPT's `get_batch`);
- the same model (accel_train.models.gpt.GPT: 4 layers, 4 heads, 128 wide, context 64, no
  dropout, no bias), fused AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.1) with 100 warm-up
  steps and cosine decay to 1e-4, batch 12, 2,000 iterations, fp32 or bf16 autocast
  (--precision);
- --device cuda: nanoGPT's GPU habits (TF32 matmuls, batches pinned and copied non_blocking,
  CUDA autocast); accel-train runs with trainer.device=cuda and its defaults (TF32 on);
- the validation loss at steps 1,000 and 2,000 (where the recipe validates) on the same fixed
  windows accel-train's `dataset.eval_windows` scores (1,000 windows evenly spaced over val.bin).

The two alternate (hand, accel, accel, hand, ...) for --rounds rounds per precision; with
--seeds, round r of both sides uses seed seeds[r % len(seeds)] (the hand loop's model init and
window draws, accel-train's trainer.seed), so the val losses get a spread. Reported:
wall seconds launch to exit, CPU seconds, tokens/s of training, the final val loss, and the
ratio accel / hand.

    python scripts/bench/gpt_race.py --data ../shared/data/pycode --rounds 2 --precisions fp32,bf16
    python scripts/bench/gpt_race.py --device cuda --rounds 3 --precisions bf16   # on a GPU
    python scripts/bench/gpt_race.py --rounds 3 --seeds 1,2,3 --precisions fp32   # loss spread
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import console_script, load_avg, machine, median, table, timed  # noqa: E402

STEPS, BATCH, BLOCK, EVAL_WINDOWS = 2000, 12, 64, 1000
EVAL_AT = (1000, 2000)  # where gpt_char validates


def hand_worker(a: argparse.Namespace) -> None:
    start = time.perf_counter()
    import numpy as np
    import torch
    import torch.nn.functional as F

    from accel_train.models.gpt import GPT

    folder = Path(a.data)
    meta = json.loads((folder / "meta.json").read_text())
    dtype = np.dtype(meta["dtype"])
    train = np.memmap(folder / "train.bin", dtype=dtype, mode="r")
    val = np.memmap(folder / "val.bin", dtype=dtype, mode="r")
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:  # nanoGPT's train.py: TF32 matmuls and convolutions
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = GPT(vocab_size=meta["vocab_size"], block_size=BLOCK, n_layer=4, n_head=4, n_embd=128)
    model.to(device)
    # fused=True: nanoGPT's choice on CUDA, and the fastest AdamW torch has on this CPU too
    # (nanoGPT's own check predates CPU fused kernels and asks for CUDA).
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=True
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def lr_at(it: int) -> float:
        if it < 100:
            return 1e-3 * (it + 1) / 100
        progress = (it - 100) / (STEPS - 100)
        return 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * progress))

    def windows(data, starts) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.asarray(data[s : s + BLOCK + 1], dtype=np.int64) for s in starts])
        xy = torch.from_numpy(rows)
        if cuda:  # nanoGPT's get_batch: pinned, then an asynchronous copy
            xy = xy.pin_memory().to(device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    starts = np.linspace(0, len(val) - BLOCK - 1, EVAL_WINDOWS).astype(np.int64)

    def evaluate() -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad(), autocast:
            for i in range(0, EVAL_WINDOWS, 250):
                x, y = windows(val, starts[i : i + 250])
                logits = model(x)
                total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")
                count += y.numel()
        model.train()
        return float(total) / count

    gen = np.random.default_rng(a.seed)
    t_train, eval_s, losses = time.perf_counter(), 0.0, {}
    for it in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(it)
        x, y = windows(train, gen.integers(0, len(train) - BLOCK - 1, size=BATCH))
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (it + 1) in EVAL_AT:  # the recipe's validation points (val_check_interval 1000)
            if cuda:  # the training steps queued so far count as training time
                torch.cuda.synchronize()
            t_eval = time.perf_counter()
            losses[it + 1] = evaluate()
            eval_s += time.perf_counter() - t_eval
    train_s = time.perf_counter() - t_train - eval_s
    out = {
        "val_loss": losses[STEPS],
        "val_loss_1000": losses[1000],
        "tokens_per_s": STEPS * BATCH * BLOCK / train_s,
        "own_s": time.perf_counter() - start,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    print(json.dumps(out))


def accel_result(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    tokens_s = summary["train_samples_per_s"] * BLOCK
    val = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    mfu = [r["train/mfu"] for r in rows if "train/mfu" in r]
    out = {"val_loss": val[max(val)], "val_loss_1000": val.get(1000), "tokens_per_s": tokens_s}
    return {**out, **({"mfu": median(mfu)} if mfu else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/pycode")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seeds", default="", help="comma-separated seeds, one per round (cycled)")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both train")
    p.add_argument("--out", default="outputs/bench_gpt_race")
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--hand-worker", action="store_true", help=argparse.SUPPRESS)
    a, extra = p.parse_known_args()
    if a.hand_worker:
        hand_worker(a)
        return
    print(machine())
    data = str(Path(a.data).resolve())
    results: dict[tuple[str, str], list[dict]] = {}
    for precision in a.precisions.split(","):
        for r in range(a.rounds):
            order = ("hand", "accel") if r % 2 == 0 else ("accel", "hand")
            seeds = [int(x) for x in a.seeds.split(",") if x]
            seed = seeds[r % len(seeds)] if seeds else None
            for side in order:
                load = load_avg()
                if side == "hand":
                    cmd = [sys.executable, __file__, "--hand-worker", f"--data={data}"]
                    cmd.append(f"--device={a.device}")
                    if seed is not None:
                        cmd.append(f"--seed={seed}")
                    proc, wall, cpu = timed([*cmd, f"--precision={precision}"])
                    out = json.loads(proc.stdout.strip().splitlines()[-1])
                else:
                    run_dir = Path(a.out).resolve() / f"{precision}_r{r}"
                    cmd = [
                        console_script("accel-train"),
                        "+experiment=gpt_char",
                        f"dataset.path={data}",
                        f"precision={precision}",
                        f"trainer.device={a.device}",
                        "trainer.progress=none",
                        "trainer.plot_curves=false",
                        f"hydra.run.dir={run_dir}",
                        *([f"trainer.seed={seed}"] if seed is not None else []),
                        *extra,
                    ]
                    proc, wall, cpu = timed(cmd)
                    out = accel_result(run_dir)
                row = {"wall": wall, "cpu": cpu, "load": load, "seed": seed, **out}
                results.setdefault((precision, side), []).append(row)
                print(f"{precision} round {r + 1} {side}: {json.dumps(row)}", flush=True)
    rows = []
    for (precision, side), runs in results.items():
        walls = [x["wall"] for x in runs]
        rows.append(
            [
                precision,
                side,
                f"{median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f})",
                f"{median([x['cpu'] for x in runs]):.1f}",
                f"{median([x['tokens_per_s'] for x in runs]):.0f}",
                " ".join(f"{x['val_loss']:.3f}" for x in runs),
            ]
        )
    print(table(["precision", "side", "wall s (min-max)", "CPU s", "tokens/s", "val loss"], rows))
    for precision in a.precisions.split(","):
        hand = median([x["wall"] for x in results[(precision, "hand")]])
        accel = median([x["wall"] for x in results[(precision, "accel")]])
        print(f"{precision}: accel / hand wall {accel / hand:.2f}")
        for side in ("hand", "accel"):
            losses = [x["val_loss"] for x in results[(precision, side)]]
            spread = f" (sd {statistics.stdev(losses):.4f})" if len(losses) > 1 else ""
            print(f"{precision}: {side} val loss mean {statistics.mean(losses):.4f}{spread}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Issue 31's race: `accel-train +experiment=gpt_char_fast` against nanoGPT's own `train.py`
(its README's CPU recipe), launch to exit, alternated on the same machine.

nanoGPT is not vendored: --nanogpt is a checkout of it (`git clone
https://github.com/karpathy/nanoGPT`; its commit is printed). Its train.py, model.py,
configurator.py and config/ are copied into a temp dir with the corpus in its layout (train.bin,
val.bin, and meta.pkl holding the vocabulary size) and run as its README's CPU line says, with
the data set and the output dir added:

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False \
        --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 \
        --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

nanoGPT trains in fp32 on a CPU whatever its --dtype (its autocast context is a no-op there), so
its run is the reference for both precisions. Its saved weights (out_dir/ckpt.pt: those of its
best 250-step evaluation, the last one unless its estimate rose) are scored outside the timed run
with nanoGPT's own model class on the windows every accel-train recipe validates on (1,000
windows of 64 characters evenly spaced over val.bin; gpt_race.py's hand loop scores the same).

Each round runs nanoGPT, then gpt_char_fast in each of --precisions (and `+experiment=gpt_char`
with --with-gpt-char, the no-regression check), the order rotated by round; gpt_char_fast's seed
is round r's entry of --seeds. Reported: wall seconds launch to exit (median and range), every
run's final val loss, and gpt_char_fast / nanoGPT wall. The goal (issue 31): a val loss no worse
than nanoGPT's in at most half its wall time.

    python scripts/bench/gpt_fast_race.py --nanogpt ../nanoGPT --rounds 3 --precisions fp32,bf16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import console_script, load_avg, machine, median, table, timed  # noqa: E402

BLOCK, EVAL_WINDOWS = 64, 1000  # gpt_char's context and validation windows
README_RECIPE = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]


def nanogpt_dir(checkout: Path, data: Path, work: Path) -> Path:
    """nanoGPT's scripts and the corpus in its layout, in `work`."""
    root = work / "nanogpt"
    root.mkdir()
    for name in ("train.py", "model.py", "configurator.py"):
        shutil.copy(checkout / name, root / name)
    shutil.copytree(checkout / "config", root / "config")
    folder = root / "data" / "pycode"
    folder.mkdir(parents=True)
    for name in ("train.bin", "val.bin"):
        shutil.copy(data / name, folder / name)
    meta = json.loads((data / "meta.json").read_text())
    with open(folder / "meta.pkl", "wb") as f:  # nanoGPT reads the vocabulary size from it
        pickle.dump({"vocab_size": meta["vocab_size"]}, f)
    return root


def score_nanogpt(root: Path, ckpt_path: Path, data: Path) -> dict:
    """nanoGPT's saved weights scored on the recipe's validation windows (nanoGPT's model
    class; the checkpoint read with weights_only=True)."""
    import numpy as np
    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", root / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    model = module.GPT(module.GPTConfig(**ckpt["model_args"]))
    prefix = "_orig_mod."
    state = {k.removeprefix(prefix): v for k, v in ckpt["model"].items()}
    model.load_state_dict(state)
    model.eval()
    val = np.memmap(data / "val.bin", dtype=np.uint16, mode="r")
    starts = np.linspace(0, len(val) - BLOCK - 1, EVAL_WINDOWS).astype(np.int64)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, EVAL_WINDOWS, 250):
            rows = np.stack(
                [np.asarray(val[s : s + BLOCK + 1], dtype=np.int64) for s in starts[i : i + 250]]
            )
            xy = torch.from_numpy(rows)
            x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
            _, loss = model(x, y)  # the mean over every position
            total += float(loss) * xy[:, 1:].numel()
            count += xy[:, 1:].numel()
    return {
        "val_loss": total / count,
        "iter_num": int(ckpt["iter_num"]),
        "own_estimate": float(ckpt["best_val_loss"]),  # nanoGPT's 20-batch estimate
    }


def run_nanogpt(root: Path, out: Path, data: Path) -> dict:
    cmd = [sys.executable, "train.py", *README_RECIPE, "--dataset=pycode", f"--out_dir={out}"]
    _, wall, cpu = timed(cmd, cwd=root)
    return {"wall": wall, "cpu": cpu, **score_nanogpt(root, out / "ckpt.pt", data)}


def run_accel(
    experiment: str, precision: str, seed: int | None, data: Path, run_dir: Path, extra
) -> dict:
    cmd = [
        console_script("accel-train"),
        f"+experiment={experiment}",
        f"dataset.path={data}",
        f"precision={precision}",
        "trainer.progress=none",
        "trainer.plot_curves=false",
        f"hydra.run.dir={run_dir}",
        *([f"trainer.seed={seed}"] if seed is not None else []),
        *extra,
    ]
    _, wall, cpu = timed(cmd)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall": wall,
        "cpu": cpu,
        "val_loss": summary["final_val_loss"],
        "steps": summary["steps"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", required=True, help="a checkout of github.com/karpathy/nanoGPT")
    p.add_argument("--data", default="../shared/data/pycode")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", default="0,1,2", help="gpt_char_fast's trainer.seed per round")
    p.add_argument("--precisions", default="fp32,bf16", help="gpt_char_fast's precisions")
    p.add_argument("--with-gpt-char", action="store_true", help="+experiment=gpt_char too (fp32)")
    p.add_argument("--out", default="outputs/bench_gpt_fast_race")
    a, extra = p.parse_known_args()
    checkout, data = Path(a.nanogpt).resolve(), Path(a.data).resolve()
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(machine())
    print(f"nanoGPT {commit or '(not a git checkout)'}; extra overrides: {extra}")
    seeds = [int(s) for s in a.seeds.split(",")]
    sides = [("nanogpt", "fp32")]
    sides += [("gpt_char_fast", precision) for precision in a.precisions.split(",")]
    if a.with_gpt_char:
        sides.append(("gpt_char", "fp32"))
    out = Path(a.out).resolve()
    results: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = nanogpt_dir(checkout, data, Path(tmp))
        for r in range(a.rounds):
            shift = r % len(sides)
            for side, precision in sides[shift:] + sides[:shift]:
                load = load_avg()
                if side == "nanogpt":
                    row = run_nanogpt(root, Path(tmp) / f"out{r}", data)
                else:
                    seed = seeds[r % len(seeds)] if side == "gpt_char_fast" else None
                    run_dir = out / f"{side}_{precision}_r{r}"
                    row = run_accel(
                        side,
                        precision,
                        seed,
                        data,
                        run_dir,
                        extra if side == "gpt_char_fast" else [],
                    )
                    row["seed"] = seed
                row["load"] = load
                results.setdefault((side, precision), []).append(row)
                print(f"round {r + 1} {side} {precision}: {json.dumps(row)}", flush=True)
    rows = []
    for (side, precision), runs in results.items():
        walls = [x["wall"] for x in runs]
        losses = [x["val_loss"] for x in runs]
        rows.append(
            [
                side,
                precision,
                f"{median(walls):.1f} ({min(walls):.1f}-{max(walls):.1f})",
                f"{median([x['cpu'] for x in runs]):.1f}",
                " ".join(f"{v:.3f}" for v in losses),
                f"{statistics.mean(losses):.3f}",
            ]
        )
    print(
        table(
            ["side", "precision", "wall s (min-max)", "CPU s", "val loss per round", "mean"], rows
        )
    )
    ref = results[("nanogpt", "fp32")]
    ref_wall, ref_loss = (
        median([x["wall"] for x in ref]),
        statistics.mean(x["val_loss"] for x in ref),
    )
    for (side, precision), runs in results.items():
        if side == "nanogpt":
            continue
        wall = median([x["wall"] for x in runs])
        loss = statistics.mean(x["val_loss"] for x in runs)
        verdict = (
            "met"
            if wall <= ref_wall / 2 and max(x["val_loss"] for x in runs) <= ref_loss
            else "not met"
        )
        print(
            f"{side} {precision}: wall {wall / ref_wall:.2f}x nanoGPT's, val loss {loss:.3f} "
            f"(nanoGPT {ref_loss:.3f}); goal (<= 0.50x, every seed's loss <= nanoGPT's): {verdict}"
        )


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Issue 31's ablation: each switch of `+experiment=gpt_char_fast` turned back, one at a time,
over several seeds: the val loss at the recipe's wall time, and the wall time to a target loss.

Every run is the real CLI, launch to exit, with the recipe's steps, validating at 5 evenly spaced
points (the same 1,000 windows as the recipe; each validation costs every variant the same), so
that each run gives a curve of (seconds since launch, val loss): the seconds are read from the
validation lines' timestamps in train.log. For each variant and seed:

- val loss at equal wall: the curve interpolated at the recipe's median wall time over the seeds
  (a variant that ends sooner keeps its last loss: it has no more steps to spend);
- wall to target: the first crossing of --target (nanoGPT's score from gpt_fast_race.py),
  interpolated between validations; "-" when the run never reaches it.

The variants run alternated (variant order rotated per seed), one at a time.

    python scripts/bench/gpt_fast_ablation.py --seeds 0,1,2 --target 1.60
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import console_script, load_avg, machine, median, table, timed  # noqa: E402

# name -> the overrides that turn one switch of the recipe back.
VARIANTS = {
    "recipe (gpt_char_fast)": [],
    "AdamW instead of Muon": [
        "optimizer=adamw",
        "optimizer.lr=0.003",
        "optimizer.betas=[0.9,0.95]",
    ],
    "learned positions, not rotary": ["model.pos_embedding=learned"],
    "no QK-norm": ["model.qk_norm=false"],
    "GELU, not ReLU²": ["model.activation=gelu"],
    "tied head": ["model.tie_embeddings=true"],
    "no warm-up": ["scheduler.warmup_steps=0"],
    "cosine to a tenth, not to 0": ["scheduler.min_lr=0.002"],
    "batch 12 x 4 the steps (nanoGPT's batch)": ["batch12"],
    "trainer.compile=true (cache warm)": ["trainer.compile=true"],
}
LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\].* step (\d+) .*val/loss=([0-9.]+)")


def curve(log: Path, launched: float) -> list[tuple[float, float]]:
    """(seconds since launch, val loss) of each validation line in train.log."""
    points = []
    for line in log.read_text().splitlines():
        m = LINE.match(line)
        if m:
            stamp = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            points.append((stamp - launched, float(m.group(3))))
    return points


def loss_at(points, wall: float) -> float:
    if wall >= points[-1][0]:
        return points[-1][1]
    for (t0, v0), (t1, v1) in zip([(0.0, points[0][1]), *points], points, strict=False):
        if t0 <= wall <= t1:
            return v0 + (v1 - v0) * (wall - t0) / max(t1 - t0, 1e-9)
    return points[0][1]


def wall_to(points, target: float) -> float | None:
    previous = None
    for t, v in points:
        if v <= target:
            if previous is None or previous[1] <= target:
                return t
            (t0, v0) = previous
            return t0 + (t - t0) * (v0 - target) / (v0 - v)
        previous = (t, v)
    return None


# The recipe with AdamW (lr 0.003) in Muon's place: gpt_char plus the recipe's own keys (the
# recipe sets optimizer.adamw_lr, a key AdamW's schema does not have, so `optimizer=adamw` on
# top of it does not compose). `--cfg job` composes both to the same config.
ADAMW = [
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "optimizer.betas=[0.9,0.95]",
    "optimizer.weight_decay=0.0",
    "name=gpt_char_fast",
    "model.pos_embedding=rope",
    "model.qk_norm=true",
    "model.activation=relu2",
    "model.tie_embeddings=false",
    "scheduler.min_lr=0.0",
]


def overrides(name: str, recipe: dict) -> list[str]:
    steps, batch = recipe["steps"], recipe["batch"]
    if VARIANTS[name] == ["adamw"]:
        return [
            *ADAMW,
            f"dataset.windows_per_epoch={steps * batch}",
            f"loader.batch_size={batch}",
            f"scheduler.warmup_steps={recipe['warmup']}",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps // 5}",
        ]
    if VARIANTS[name] == ["batch12"]:
        steps, batch = steps * batch // 12, 12
        return [
            "loader.batch_size=12",
            f"trainer.max_steps={steps}",
            f"scheduler.warmup_steps={recipe['warmup'] * steps // recipe['steps']}",
            f"trainer.val_check_interval={steps // 5}",
        ]
    return [*VARIANTS[name], f"trainer.val_check_interval={steps // 5}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/pycode")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--target", type=float, default=1.60, help="nanoGPT's val loss")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--variants", default="", help="comma-separated indices into the table")
    p.add_argument("--out", default="outputs/bench_gpt_fast_ablation")
    a = p.parse_args()
    print(machine())
    recipe = composed(a)
    names = list(VARIANTS)
    if a.variants:
        names = [names[int(i)] for i in a.variants.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    if "trainer.compile=true (cache warm)" in names:  # fill Inductor's cache first
        timed(
            _cmd(
                a,
                recipe,
                names[0],
                seeds[0],
                Path(a.out).resolve() / "warm",
                ["trainer.compile=true"],
            )
        )
    runs: dict[str, list[dict]] = {}
    for i, seed in enumerate(seeds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            run_dir = Path(a.out).resolve() / f"v{names.index(name)}_s{seed}"
            load = load_avg()
            launched = time.time()
            _, wall, cpu = timed(_cmd(a, recipe, name, seed, run_dir, overrides(name, recipe)))
            points = curve(run_dir / "train.log", launched)
            row = {"seed": seed, "wall": wall, "cpu": cpu, "load": load, "curve": points}
            runs.setdefault(name, []).append(row)
            print(f"{name} seed {seed}: {json.dumps(row)}", flush=True)
    ref_wall = median([r["wall"] for r in runs[names[0]]])
    rows = []
    for name in names:
        rs = runs[name]
        at = [loss_at(r["curve"], ref_wall) for r in rs]
        to = [wall_to(r["curve"], a.target) for r in rs]
        reached = [t for t in to if t is not None]
        rows.append(
            [
                name,
                f"{median([r['wall'] for r in rs]):.1f}",
                " ".join(f"{r['curve'][-1][1]:.3f}" for r in rs),
                f"{statistics.mean(at):.3f} ± {statistics.pstdev(at):.3f}",
                f"{median(reached):.1f} ({len(reached)}/{len(rs)})"
                if reached
                else f"- (0/{len(rs)})",
            ]
        )
    print(f"target {a.target}; the recipe's median wall {ref_wall:.1f} s; {a.precision}")
    print(
        table(
            [
                "variant",
                "wall s (median)",
                "final val loss per seed",
                f"val loss at {ref_wall:.0f} s (mean ± sd)",
                "s to target (runs reaching it)",
            ],
            rows,
        )
    )


def composed(a) -> dict:
    """The recipe's steps, batch and warm-up, as Hydra composes them (`--cfg job`)."""
    import subprocess

    import yaml

    cmd = [console_script("accel-train"), "+experiment=gpt_char_fast", "--cfg", "job"]
    cfg = yaml.safe_load(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {
        "steps": cfg["trainer"]["max_steps"],
        "batch": cfg["loader"]["batch_size"],
        "warmup": cfg["scheduler"]["warmup_steps"],
    }


def _cmd(a, recipe, name, seed, run_dir: Path, extra: list[str]) -> list[str]:
    experiment = "gpt_char" if VARIANTS.get(name) == ["adamw"] else "gpt_char_fast"
    return [
        console_script("accel-train"),
        f"+experiment={experiment}",
        f"dataset.path={Path(a.data).resolve()}",
        f"precision={a.precision}",
        f"trainer.seed={seed}",
        "trainer.plot_curves=false",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


if __name__ == "__main__":
    main()

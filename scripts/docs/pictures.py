"""Draw the pictures of the manual (docs/images/*.png) from real runs and measured numbers.

    python scripts/docs/pictures.py curves RUN_DIR          # docs/images/curves_mnist_amp.png
    python scripts/docs/pictures.py report [SPEED_REPORT.csv]   # docs/images/speed_report.png
    python scripts/docs/pictures.py benchmarks              # docs/images/bench_*.png

`curves`: loss and accuracy against the optimizer step from a run's metrics.jsonl (train and
validation; the test accuracy as a dashed line). `report`: the speed report's samples/s per
variant, relative to the baseline, from `accel-report`'s speed_report.csv, or without one from
the table in BENCHMARKS.md section 13 (a real `accel-report` run, its command printed there).
`benchmarks`: bar charts of tables in BENCHMARKS.md, parsed from the file, so a picture never
shows a number the file does not hold. Needs matplotlib (a core dependency).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
BENCHMARKS = ROOT / "BENCHMARKS.md"


def _save(fig, name: str) -> Path:
    IMAGES.mkdir(parents=True, exist_ok=True)
    path = IMAGES / name
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"wrote {path} ({path.stat().st_size // 1024} KB)")
    return path


# ---- the loss and accuracy curves of a run ---------------------------------------------------


def curves(run_dir: Path, name: str = "curves_mnist_amp.png") -> Path:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        for key in ("train/loss", "val/loss", "train/acc", "val/acc", "test/acc"):
            if key in row and "step" in row:
                xs, ys = series.setdefault(key, ([], []))
                xs.append(row["step"])
                ys.append(row[key])
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.4))
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        if key in series:
            ax_loss.plot(*series[key], style, label=key, markersize=3)
    for key, style in (("train/acc", "-"), ("val/acc", "o-")):
        if key in series:
            ax_acc.plot(*series[key], style, label=key, markersize=3)
    if "test/acc" in series:
        test = series["test/acc"][1][-1]
        ax_acc.axhline(test, linestyle="--", color="gray", label="test/acc (best.pt)")
    ax_loss.set(xlabel="optimizer step", ylabel="loss", yscale="log", title="loss")
    ax_acc.set(xlabel="optimizer step", ylabel="accuracy", title="accuracy", ylim=(0.8, 1.0))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, name)


# ---- tables of BENCHMARKS.md -----------------------------------------------------------------


def section(number: int) -> str:
    text = BENCHMARKS.read_text()
    match = re.search(rf"^## {number}\. .*?(?=^## \d+\. |\Z)", text, flags=re.M | re.S)
    if not match:
        raise SystemExit(f"BENCHMARKS.md has no section {number}")
    return match.group(0)


def table_after(text: str, marker: str) -> list[dict[str, str]]:
    """The first Markdown table after `marker` in `text`, as rows of {header: cell}."""
    start = text.index(marker)
    lines = [x.strip() for x in text[start:].splitlines()]
    first = next(i for i, x in enumerate(lines) if x.startswith("|"))
    block = []
    for x in lines[first:]:
        if not x.startswith("|"):
            break
        block.append([c.strip() for c in x.strip("|").split("|")])
    header, body = block[0], [r for r in block[2:]]
    return [dict(zip(header, r, strict=False)) for r in body]


def _number(cell: str) -> float:
    return float(re.search(r"[-\d.]+", cell.replace("*", "")).group(0))


def report(csv_path: Path | None = None, name: str = "speed_report.png") -> Path:
    """samples/s relative to the baseline of the same round, per variant."""
    if csv_path is not None:
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        labels = [f"{r['variant']}" + (" (phase 2)" if r.get("phase") == "2" else "") for r in rows]
        values = [float(r["vs_baseline"]) if r.get("vs_baseline") else 1.0 for r in rows]
        title = f"accel-report: {csv_path.parent.name}"
    else:
        rows = table_after(section(13), "### The speed report on mnist_amp")
        labels = [r["variant"] for r in rows]
        values = [_number(r["vs baseline"]) for r in rows]
        title = "accel-report +experiment=mnist_amp (BENCHMARKS.md section 13)"
    fig, ax = plt.subplots(figsize=(8, 3.2))
    colors = ["gray" if v == 1.0 else ("tab:green" if v > 1 else "tab:red") for v in values]
    bars = ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    ax.bar_label(bars, fmt="%.2fx", fontsize=8, padding=2)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set(xlabel="samples/s vs the same round's baseline (median of 3 rounds)", title=title)
    ax.set_xlim(0, max(values) * 1.2)
    ax.title.set_fontsize(10)
    return _save(fig, name)


def benchmarks() -> list[Path]:
    paths = []
    # Section 13: launch to exit, accel-train against the hand-written loop.
    rows = table_after(section(13), "### The race")
    fig, ax = plt.subplots(figsize=(6, 2.2))
    labels = [r["side"] for r in rows]
    values = [_number(r["wall s launch to exit, median (min-max)"]) for r in rows]
    bars = ax.barh(labels[::-1], values[::-1], color=["tab:blue", "gray"])
    ax.bar_label(bars, fmt="%.1f s", fontsize=8, padding=2)
    ax.set(
        xlabel="seconds, launch to exit (median of 3; 2 CPU cores)", xlim=(0, max(values) * 1.25)
    )
    ax.set_title("MNIST to 98.75 % test accuracy: accel-train vs a hand-written loop", fontsize=9)
    paths.append(_save(fig, "bench_race.png"))
    # Section 13: test accuracy over seeds of the default.
    rows = table_after(section(13), "### The new default, across seeds")
    fig, ax = plt.subplots(figsize=(6, 2.4))
    seeds = [r["seed"].split()[0] for r in rows]
    accs = [_number(r["test/acc, best.pt (10,000)"]) for r in rows]
    ax.bar(seeds, accs, color="tab:blue")
    ax.axhline(0.985, color="black", linewidth=0.8, linestyle="--", label="0.985")
    ax.set(xlabel="trainer.seed", ylabel="test accuracy", ylim=(0.975, 0.99))
    ax.set_title("+experiment=mnist_amp, 6 seeds (BENCHMARKS.md section 13)", fontsize=9)
    ax.legend(fontsize=8)
    paths.append(_save(fig, "bench_seeds.png"))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("curves").add_argument("run_dir", type=Path)
    sub.add_parser("report").add_argument("csv", type=Path, nargs="?")
    sub.add_parser("benchmarks")
    args = parser.parse_args(argv)
    if args.what == "curves":
        curves(args.run_dir)
    elif args.what == "report":
        report(args.csv)
    else:
        benchmarks()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`accuracy_vs_snr.png` beside curves.png (issue 64): a classifier's accuracy per group of a
per-sample field (data/splits.py EvalGroups: a radio set's SNR), from the last validation row of
metrics.jsonl that holds `val/acc_<name>/<value>` keys: the RadioML figure, accuracy against SNR."""

from __future__ import annotations

import os
import re
from pathlib import Path

GROUP_KEY = re.compile(r"^val/acc_(?P<name>[a-z0-9_]+)/(?P<value>-?[0-9.e+]+)$")


def last_group_accuracy(rows: list[dict]) -> dict[str, dict[float, float]]:
    """{group name: {value: accuracy}} of the last row that has any (the final validation)."""
    for row in reversed(rows):
        found: dict[str, dict[float, float]] = {}
        for key, value in row.items():
            m = GROUP_KEY.match(key)
            if m and isinstance(value, int | float):
                found.setdefault(m["name"], {})[float(m["value"])] = float(value)
        if found:
            return found
    return {}


def draw_group_accuracy(groups: dict[str, dict[float, float]], run_dir: Path) -> list[Path]:
    """One picture per group name, `accuracy_vs_<name>.png` (matplotlib's object API: no
    global figure registry shared across threads)."""
    from matplotlib.figure import Figure

    written = []
    for name, points in groups.items():
        xs = sorted(points)
        fig = Figure(figsize=(5, 4))
        ax = fig.subplots()
        ax.plot(xs, [points[x] for x in xs], "o-")
        ax.set_xlabel(f"{name.upper()} (dB)" if name == "snr" else name)
        ax.set_ylabel("validation accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"accuracy per {name.upper() if name == 'snr' else name}")
        fig.tight_layout()
        path = run_dir / f"accuracy_vs_{name}.png"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
        written.append(path)
    return written

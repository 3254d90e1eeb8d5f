"""What the user sees on the console while training: the progress bar (rich) or plain lines."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

log = logging.getLogger("accel_train")


class Progress:
    """A rich progress bar on a terminal, plain log lines otherwise (or nothing)."""

    def __init__(self, mode: str, enabled: bool):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self.bar = self.task = None
        if self.mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                transient=False,
            )
            self.bar.start()

    def start_epoch(self, epoch: int, total: int, done: int = 0) -> None:
        if self.bar:
            if self.task is not None:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(f"epoch {epoch}", total=total, completed=done, stats="")

    def advance(self) -> None:
        if self.bar:
            self.bar.advance(self.task)

    def show(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        text = "  ".join(_fmt(k, v) for k, v in metrics.items())
        if self.bar:
            self.bar.update(self.task, stats=text)
        elif self.mode == "plain":
            log.info("epoch %d step %d  %s", epoch, step, text)

    def message(self, text: str) -> None:
        if self.bar:
            self.bar.console.print(text)
        elif self.mode == "plain":
            log.info(text)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
            self.bar, self.mode = None, "plain"  # later messages: log lines, below the bar

    def console(self) -> Console:
        """Where rich output goes: the bar's console, or a plain one on stdout."""
        return self.bar.console if self.bar else Console()


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:.4g}" if "lr" in key else f"{key}={value:.4f}".rstrip("0")
    return f"{key}={value}"


# ---- start-up: what was chosen and changed -------------------------------------------------


def startup_tree(
    cfg: Any,
    choices: dict[str, str],
    default_choices: dict[str, str],
    defaults: dict[str, Any],
    keys: set[str] | None = None,
) -> Tree:
    """The config at start-up, short: each group's option (bold when not the default one) and
    the values that differ from the chosen options' defaults (experiment files and overrides).
    `keys`: the only keys that may differ (those set), whose defaults `defaults` holds (a key
    missing from it was added); None: every key, `defaults` a whole composed default config.
    The whole tree is in <run dir>/config_tree.txt."""
    tree = Tree(
        f"[bold]config[/bold] [dim](all keys: {Path(cfg.paths.output_dir) / 'config_tree.txt'})",
        guide_style="dim",
    )
    shown = []
    for group, option in choices.items():
        text = f"{group}={option}"
        shown.append(f"[bold]{text}[/bold]" if default_choices.get(group) != option else text)
    tree.add("options: " + "  ".join(shown))
    changed = tree.add("changed from the defaults")
    flat = _leaves(OmegaConf.to_container(cfg, resolve=True))
    count = 0
    for key, value in flat.items():
        if key.split(".")[0] in ("paths", "hydra") or key.endswith(".name"):
            continue
        if keys is not None and key not in keys:
            continue
        if key in defaults and defaults[key] != value:
            changed.add(f"{key}: {value} [dim](default {defaults[key]})")
            count += 1
        elif key not in defaults and (defaults or keys is not None):
            changed.add(f"{key}: {value} [dim](added)")
            count += 1
    if not count:
        changed.label = "changed from the defaults: nothing"
    return tree


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            if isinstance(value, dict) and value:
                flat.update(_leaves(value, f"{prefix}{key}."))
            else:
                flat[f"{prefix}{key}"] = value
    return flat


def flat_defaults(tree: Any) -> dict[str, Any]:
    """Dotted key -> value of a composed default config (see startup_tree)."""
    return _leaves(tree)


# ---- the end of a run: a summary table, curves.png -----------------------------------------


def summary_table(summary: dict[str, Any], ckpt_dir: Path, monitor: str) -> Table:
    table = Table(title="run summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()

    def num(value: Any, digits: int = 4) -> str:
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    best = summary.get("best_score")
    if best is not None:  # the score best.pt was chosen by (the `done:` line's)
        table.add_row(f"best.pt {monitor}", num(best))
    acc = summary.get("best_val_acc")
    if acc is not None and not (monitor == "val/acc" and acc == best):
        # Higher than best.pt's when checkpoint.every_n_epochs ranks only some epochs.
        table.add_row("highest val/acc (any validation)", num(acc))
    if acc is not None:  # a task that logs accuracy
        table.add_row(
            "final val/acc, val/loss",
            f"{num(summary.get('final_val_acc'))}, {num(summary.get('final_val_loss'))}",
        )
    else:  # every metric of the task's last validation
        final = {
            k[len("final_val_") :]: v for k, v in summary.items() if k.startswith("final_val_")
        }
        final = {k: v for k, v in final.items() if v is not None}
        if final:
            table.add_row(
                "final " + ", ".join(f"val/{k}" for k in final),
                ", ".join(num(v) for v in final.values()),
            )
    if "test_acc" in summary:
        table.add_row(
            f"test/acc, test/loss ({summary.get('test_ckpt')} weights)",
            f"{num(summary['test_acc'])}, {num(summary.get('test_loss'))}",
        )
    elif "test_loss" in summary:
        tested = {k[len("test_") :]: v for k, v in summary.items() if k.startswith("test_")}
        tested.pop("ckpt", None)
        table.add_row(
            ", ".join(f"test/{k}" for k in tested) + f" ({summary.get('test_ckpt')} weights)",
            ", ".join(num(v) for v in tested.values()),
        )
    table.add_row("steps, epochs", f"{summary.get('steps')}, {summary.get('epochs')}")
    table.add_row("time", f"{summary.get('wall_s', 0.0):.1f} s")
    if summary.get("train_tokens_per_s"):  # a language model: tokens/s is the number read
        table.add_row("train tokens/s", f"{summary['train_tokens_per_s']:,.0f}")
    else:
        table.add_row("train samples/s", f"{summary.get('train_samples_per_s', 0.0):,.0f}")
    files = sorted(p.name for p in ckpt_dir.glob("*") if not p.name.startswith("."))
    table.add_row("checkpoints", ", ".join(files) or "none kept")
    return table


def print_summary(console: Console, summary: dict[str, Any], ckpt_dir: Path, monitor: str) -> None:
    """The table, then the checkpoint folder on a line of its own, never wrapped or cut: the
    path accel-export, accel-sample and accel-eval take (a table cell would fold it)."""
    console.print(summary_table(summary, ckpt_dir, monitor))
    console.print(f"checkpoints: {ckpt_dir}/", soft_wrap=True, highlight=False, markup=False)


_said_no_matplotlib = False

CURVES = ("train/loss", "val/loss", "train/acc", "val/acc", "val/ppl")
# The second panel: accuracy (a classifier), else perplexity (a language model), else none.
SECOND_PANEL = ("acc", "ppl")


def start_curves_plot(run_dir: Path) -> Callable[[], Path | None]:
    """Start drawing curves.png (loss and accuracy against the optimizer step, from
    metrics.jsonl) in a background thread; the returned function waits for it and gives its path.

    Called when training ends, so the drawing (~1 s of matplotlib, most of it holding the GIL)
    overlaps the test pass (torch kernels, which release the GIL). The series are read here, in
    the caller's thread: the test pass appends to metrics.jsonl while the thread draws. matplotlib
    is a core dependency, imported here, at the end of training (never at start-up); an
    environment where it cannot be imported gets one info line a process and no plot."""
    global _said_no_matplotlib
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font cache notes
    except ImportError:
        if not _said_no_matplotlib:
            _said_no_matplotlib = True
            log.info(
                "curves.png skipped: matplotlib (a dependency of accel-train) cannot be imported "
                "here: `pip install matplotlib` to get it"
            )
        return lambda: None
    series: dict[str, tuple[list[int], list[float]]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        for key in CURVES:
            if isinstance(row.get(key), int | float):
                steps, values = series.setdefault(key, ([], []))
                steps.append(row["step"])
                values.append(row[key])
    if not series:
        return lambda: None
    result: list[Path | BaseException] = []

    def draw() -> None:
        try:
            result.append(_draw_curves(series, run_dir / "curves.png"))
        except BaseException as e:  # re-raised in the caller's thread by wait()
            result.append(e)

    thread = threading.Thread(target=draw, name="curves.png", daemon=True)
    thread.start()

    def wait() -> Path | None:
        thread.join()
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    return wait


def _draw_curves(series: dict[str, tuple[list[int], list[float]]], path: Path) -> Path:
    # matplotlib's object API, not pyplot: no global figure registry shared across threads.
    from matplotlib.figure import Figure

    kinds = ["loss"]
    kinds += [k for k in SECOND_PANEL if any(key.endswith("/" + k) for key in series)][:1]
    fig = Figure(figsize=(5 * len(kinds), 4))
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=True):
        for split in ("train", "val"):
            key = f"{split}/{kind}"
            if key in series:
                style = "-" if split == "train" else "o-"
                ax.plot(*series[key], style, label=key)
        ax.set_xlabel("optimizer step")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path

"""What the user sees on the console while training: the progress bar (rich) or plain lines."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from accel_train.loggers.group_plot import draw_group_accuracy, last_group_accuracy

log = logging.getLogger("accel_train")


class Progress:
    """A rich progress bar on a terminal (the epoch and the whole run, with steps/s and the
    time left), plain log lines otherwise (`epoch k/N step s/T ... ETA h:mm:ss`), or nothing.
    Only rank 0 shows it (`enabled`).

    Nothing here runs per step: the loop's counters are read by the bar's own refresh thread
    (`position`, 10 times a second), and the numbers by show() at the logging steps, where the
    loop has already waited for the device."""

    def __init__(self, mode: str, enabled: bool):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode if enabled else "none"
        self.bar = self.epoch_task = self.run_task = None
        self.max_epochs = self.total_steps = self.first_step = 0
        self.started = time.perf_counter()
        self.position: Callable[[], tuple[int, int, int]] | None = None
        self.shown_epoch = self.epoch_batches = 0  # the epoch the bar shows, its batches
        self._unroute: Callable[[], None] = lambda: None
        if self.mode == "rich":
            self.bar = _bar(self._poll)
            out, err = sys.stdout, sys.stderr
            self.bar.start()
            self._unroute = _route_log_lines({id(out): sys.stdout, id(err): sys.stderr})

    def start_run(
        self,
        total_steps: int,
        max_epochs: int,
        step: int,
        position: Callable[[], tuple[int, int, int]],
    ) -> None:
        """Training starts (or resumes) at `step`; `position()` gives (optimizer steps done,
        the epoch, batches done in it) whenever the bar is drawn."""
        self.total_steps, self.max_epochs, self.first_step = total_steps, max_epochs, step
        self.started, self.position = time.perf_counter(), position
        if self.bar:
            self.run_task = self.bar.add_task(
                "run", total=total_steps, completed=step, unit="steps"
            )

    def start_epoch(self, epoch: int, total: int, done: int = 0) -> None:
        if not self.bar:
            return
        description = f"epoch {epoch + 1}/{self.max_epochs}"
        self.shown_epoch, self.epoch_batches = epoch, total
        if self.epoch_task is None:
            self.epoch_task = self.bar.add_task(
                description, total=total, completed=done, unit="batches"
            )
        else:  # the same task (the refresh thread holds its id): its clock and speed restart
            self.bar.reset(self.epoch_task, total=total, completed=done, description=description)

    def _poll(self) -> None:
        """The bar's refresh thread: move both bars to where the loop is (host integers)."""
        if self.position is None:
            return
        step, epoch, batch = self.position()
        if self.run_task is not None:
            self.bar.update(self.run_task, completed=step)
        if self.epoch_task is not None:
            # (past the shown epoch's end the loop counts the next one's batches: 0 so far)
            done = batch if epoch == self.shown_epoch else self.epoch_batches
            self.bar.update(self.epoch_task, completed=done)

    def where(self, epoch: int, step: int) -> str:
        """`epoch k/N step s/T`: the epoch counted from 1, as a progress display does."""
        epochs = f"/{self.max_epochs}" if self.max_epochs else ""
        steps = f"/{self.total_steps}" if self.total_steps else ""
        return f"epoch {epoch + 1}{epochs} step {step}{steps}"

    def eta(self, step: int) -> str:
        """The time left at this step's pace since the start (validations included)."""
        done = step - self.first_step
        if done <= 0 or not self.total_steps:
            return "?"
        left = (self.total_steps - step) * (time.perf_counter() - self.started) / done
        return _clock(left)

    def show(self, metrics: dict[str, Any], step: int, epoch: int) -> None:
        text = "  ".join(_fmt(k, v) for k, v in metrics.items())
        if self.bar:
            self.bar.stats = text  # drawn by the refresh thread
        elif self.mode == "plain":
            log.info("%s  %s  ETA %s", self.where(epoch, step), text, self.eta(step))

    def message(self, text: str) -> None:
        if self.bar:
            self.bar.console.print(text)
        elif self.mode == "plain":
            log.info(text)

    def close(self) -> None:
        if self.bar:
            self._unroute()
            self.bar.stop()
            self.bar, self.mode = None, "plain"  # later messages: log lines, below the bar

    def console(self) -> Console:
        """Where rich output goes: the bar's console, or the stream the log lines go to (so
        that a table printed after them comes after them, also through torchrun's capture
        of a worker's stdout and stderr as separate files)."""
        if self.bar:
            return self.bar.console
        stream = log_stream()
        stream.flush()
        return Console(file=stream)


def log_stream():
    """The console stream the `accel_train` log lines are written to: Hydra's handler writes to
    stdout, a torchrun worker's (logging.basicConfig) to stderr."""
    logger: logging.Logger | None = log
    while logger is not None:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:  # (not a FileHandler, a subclass)
                return handler.stream
        logger = logger.parent if logger.propagate else None
    return sys.stdout


def _route_log_lines(proxies: dict[int, Any]) -> Callable[[], None]:
    """Point the logging handlers that write to the terminal (Hydra's, opened before the bar)
    at rich's proxies of stdout and stderr (`proxies`: the stream's id -> its proxy) while the
    bar is live, so a log line prints above the bar instead of into its frame; returns the
    undo. Without a terminal rich proxies nothing and nothing moves."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    moved = []
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            ):
                proxy = proxies.get(id(handler.stream))
                if proxy is not None and proxy is not handler.stream:
                    moved.append((handler, handler.setStream(proxy)))

    def undo() -> None:
        for handler, stream in moved:
            handler.setStream(stream)

    return undo


def _clock(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _bar(poll: Callable[[], None]):
    """rich's Progress: one row per bar, then the last logged numbers on a line of their own;
    its refresh thread first calls `poll` (the loop's counters)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as RichProgress
    from rich.table import Column
    from rich.text import Text

    class Speed(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            unit = task.fields.get("unit", "steps")
            return Text(f"{speed:.2f} {unit}/s" if speed else f"- {unit}/s", style="cyan")

    class Elapsed(TimeElapsedColumn):  # labelled: two bare clocks side by side were a riddle
        def render(self, task) -> Text:
            return Text.assemble(("elapsed ", "dim"), super().render(task))

    class Remaining(TimeRemainingColumn):
        def render(self, task) -> Text:
            return Text.assemble(("left ", "dim"), super().render(task))

    class Bar(RichProgress):
        stats = ""  # the last logging step's numbers

        def get_renderables(self):
            poll()
            yield self.make_tasks_table(self.tasks)
            if self.stats:
                yield Text(self.stats, style="dim")

    return Bar(
        TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True)),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        Speed(table_column=Column(no_wrap=True)),
        Elapsed(),
        Remaining(),
        transient=False,
    )


def shown_numbers(metrics: dict[str, Any], task_metrics: dict[str, Any]) -> dict[str, Any]:
    """A logging step's numbers as the console shows them (the metrics rows hold them all)."""
    shown = {"loss": metrics["train/loss"], **task_metrics}  # the task's own: acc, mae, ...
    shown["lr"] = metrics["train/lr"]
    if "train/grad_norm" in metrics:
        shown["grad_norm"] = metrics["train/grad_norm"]
    if "train/tokens_per_s" in metrics:  # what language-model users read
        shown["tokens/s"] = round(metrics["train/tokens_per_s"])
    elif "train/samples_per_s" in metrics:
        shown["samples/s"] = round(metrics["train/samples_per_s"])
    if "train/samples_per_s" in metrics:
        shown["data"] = f"{metrics['train/data_wait_share']:.0%}"
        shown["mem"] = f"{metrics['train/peak_mem_mb']:.0f}MB"
    if "train/mfu" in metrics:
        shown["mfu"] = f"{metrics['train/mfu']:.1%}"
    if "data/remote_images_per_s" in metrics:  # loader=ray: the pool's output and load
        shown["remote"] = f"{metrics['data/remote_images_per_s']:.0f}/s"
        shown["remote_busy"] = f"{metrics.get('data/remote_busy_share', 0.0):.0%}"
        if metrics.get("data/resubmitted"):
            shown["resubmitted"] = metrics["data/resubmitted"]
    return shown


def _fmt(key: str, value: Any) -> str:
    return f"{key}={short_number(value, lr='lr' in key)}"


def short_number(value: Any, lr: bool = False) -> str:
    """A number as the console shows it: 4 decimals without trailing zeros (1.0 -> 1, not
    "1."), 3 significant digits for a small non-zero one (GRPO's loss, ~1e-7, is not 0), an
    lr in 4 significant digits; anything else as str()."""
    if not isinstance(value, float):
        return str(value)
    if lr:
        return f"{value:.4g}"
    if value != 0 and abs(value) < 1e-3 and math.isfinite(value):
        return f"{value:.3g}"
    text = f"{value:.4f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


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


def print_startup(tree: Tree) -> None:
    """The start-up tree on stdout. Without a terminal (a log file, CI, a SLURM log) its lines
    are as long as they are: a path folded mid-word could not be copied from the log."""
    (Console() if sys.stdout.isatty() else Console(width=100_000)).print(tree)


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
        for k, v in final.items():  # one row each: a long list of names in one cell folds
            table.add_row(f"final val/{k}", num(v))
    if "test_acc" in summary:
        table.add_row(
            f"test/acc, test/loss ({summary.get('test_ckpt')} weights)",
            f"{num(summary['test_acc'])}, {num(summary.get('test_loss'))}",
        )
    elif "test_loss" in summary:
        tested = {k[len("test_") :]: v for k, v in summary.items() if k.startswith("test_")}
        tested.pop("ckpt", None)
        for k, v in tested.items():
            table.add_row(f"test/{k} ({summary.get('test_ckpt')} weights)", num(v))
    epochs = summary.get("epochs_trained", summary.get("epochs"))
    table.add_row("steps, epochs", f"{summary.get('steps')}, {short_number(epochs)}")
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
# A policy trained on rewards (task=grpo): its loss says little (~1e-7, TRL's docs), so the
# reward (with its spread over the completions) and the completions' length come first.
REWARD_PANELS = ("reward", "completions/mean_length")
CURVES += ("train/reward", "val/reward", "train/reward_std", "train/completions/mean_length",
           "val/completions/mean_length")  # fmt: skip


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
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows.append(row)
        for key in CURVES:
            if isinstance(row.get(key), int | float):
                steps, values = series.setdefault(key, ([], []))
                steps.append(row["step"])
                values.append(row[key])
    groups = last_group_accuracy(rows)  # accuracy per SNR: accuracy_vs_snr.png
    if not series:
        return lambda: None
    result: list[Path | BaseException] = []

    def draw() -> None:
        try:
            draw_group_accuracy(groups, run_dir)
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
    if "train/reward" in series:
        kinds = [*REWARD_PANELS, "loss"]
    fig = Figure(figsize=(5 * len(kinds), 4))
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=True):
        for split in ("train", "val"):
            key = f"{split}/{kind}"
            if key in series:
                style = "-" if split == "train" else "o-"
                ax.plot(*series[key], style, label=key)
        if kind == "reward" and "train/reward_std" in series:
            ax.plot(*series["train/reward_std"], "--", label="train/reward_std")
        ax.set_xlabel("optimizer step")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path

"""`accel-report`: the speed report. Trains the baseline and each technique switch side by side,
repeated and alternating, each as a normal `accel-train` run dir, then the combination of the
switches that helped, and writes `speed_report.md`, `speed_report.csv` and
`speed_report.png` into the report dir.

    accel-report +experiment=mnist_amp                      # every applicable switch, 3 repeats
    accel-report --variants compile,channels_last --repeats 5 model=resnet18 dataset=image_folder
    accel-report "trainer.stop_at='val/acc>=0.985'" +experiment=mnist_amp   # adds time to target

Everything that is not a report flag is an accel-train override applied to every run (your own
`_target_` model, `strategy=ddp launcher.nproc_per_node=2`, ...). Before any run starts, every
variant's config is composed and validated (one error, not N failed runs), and a variant that
changes nothing in the base config (e.g. `loader=device` when the experiment already uses it) is
left out and said so.

Order: repeat-major (baseline, v1, v2, ..., baseline, v1, v2, ...), so a machine whose load
drifts affects every variant alike; each row reports median and min-max over its repeats, and
the ratio to the baseline is the median of per-repeat ratios (each against the baseline of the
same round). The load average before each run is recorded. Phase 2 runs the combination of the
variants whose throughput gain is measurable (below) and whose median ratio is above
`--min-gain`, and whose median test accuracy (best validation accuracy without a test split)
stayed within `--max-acc-drop` of the baseline, alternating with the baseline again.

Noise: the baseline's samples/s differ from round to round (a 2-step run's by tens of percent).
That spread, (max - min) / median over the rounds, is reported, and a switch is called faster
(or slower) only when every round's ratio lies above 1 + spread (or below 1 - spread); anything
else is "no measurable difference", never a winner. One round measures no spread, so nothing is
judged then (`--no-spread-check`: judge by the medians alone).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from accel_train.config import CONFIG_DIR
from accel_train.config.aliases import alias_overrides
from accel_train.config.checks import validate
from accel_train.config.hydra_errors import as_user_error
from accel_train.config.run_config import typed
from accel_train.config.schema import register_configs
from accel_train.environment import register_resolvers
from accel_train.errors import UserError, report_user_errors
from accel_train.optim import optimizer_emulation
from accel_train.precision import cpu_has_fast_bf16, precision_emulation

log = logging.getLogger("accel_train")

# Technique switches: name -> overrides. Order = the report's row order.
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    "device_loader": ["loader=device"],
    "channels_last": ["trainer.channels_last=true"],
    "compile": ["trainer.compile=true"],
    "amp": ["precision=amp"],
    "bf16": ["precision=bf16"],
    "ema": ["ema.enabled=true"],
    "selective_backprop": ["selective_backprop.keep=0.5"],
    "activation_checkpointing": ["activation_checkpointing.mode=full"],
}
# The vision recipe switches (issue 38, docs/vision.md "Recipe switches"): they trade speed for
# accuracy on image_folder data, so they run only when named (`--variants auto_augment,...`,
# with `dataset=image_folder ...`; layer_decay with a timm model). The progressive resize is
# FFCV's ResNet-50 ramp (160 -> 192 px) over the whole run.
RECIPE_VARIANTS: dict[str, list[str]] = {
    "auto_augment": ["dataset.auto_augment=rand-m9-mstd0.5-inc1"],
    "random_erasing": ["dataset.random_erasing=0.25"],
    "mixup_cutmix": ["dataset.mixup_alpha=0.8", "dataset.cutmix_alpha=1.0"],
    "progressive_resize": [
        "trainer.progressive_resize={start_size:160,end_size:192,start_epoch:0,"
        "end_epoch:${trainer.max_epochs}}"
    ],
    "layer_decay": ["optimizer.layer_decay=0.65"],
}
# loader=ray (docs/data.md, "When one node's CPUs are not enough"): decoding on a Ray cluster's
# CPUs; it starts a local Ray for each run unless `loader.address` is in the base overrides, so
# it runs only when named (`--variants ray_loader`).
CLUSTER_VARIANTS: dict[str, list[str]] = {"ray_loader": ["loader=ray"]}
OPT_IN = {**RECIPE_VARIANTS, **CLUSTER_VARIANTS}
ALL_VARIANTS = {**VARIANTS, **OPT_IN}
# Variants that are alternatives to each other: a combination takes the best one of each set.
EXCLUSIVE = [{"amp", "bf16"}, {"device_loader", "ray_loader"}]

# summary.json fields reported, and how they are shown.
FIELDS = {
    "samples_per_s": "samples/s",
    "wall_s": "launch to exit s",
    "time_to_target_s": "time to target s",
    "peak_mem_mb": "peak mem MB",
    "best_val_acc": "best val acc",
    "test_acc": "test acc",
    "cpu_s": "CPU s",
}


@dataclass
class Run:
    variant: str
    repeat: int
    phase: int
    run_dir: Path
    load: float
    status: str = "pending"
    values: dict[str, float | None] = field(default_factory=dict)
    error: str = ""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="accel-report",
        description=(
            "Train the baseline and each technique switch side by side (repeated, alternating) "
            "and write speed_report.md/.csv/.png. Other arguments are accel-train overrides "
            "applied to every run."
        ),
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from: {', '.join(ALL_VARIANTS)} (baseline is always run; "
        f"by default all but the opt-in {', '.join(OPT_IN)})",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument(
        "--out", default=None, help="report dir (default outputs/speed_report/<time>)"
    )
    parser.add_argument("--no-combine", action="store_true", help="skip the combination phase")
    parser.add_argument("--min-gain", type=float, default=1.02, help="throughput ratio to count")
    parser.add_argument(
        "--no-spread-check",
        action="store_true",
        help="judge switches by their median ratio alone, even inside the rounds' spread",
    )
    parser.add_argument(
        "--max-acc-drop",
        type=float,
        default=0.005,
        help="test accuracy (best val accuracy without a test split) a switch may lose",
    )
    return parser.parse_known_args(argv)


def compose_run(overrides: list[str], run_dir: Path):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        return compose(config_name="train", overrides=[*overrides, f"paths.output_dir={run_dir}"])


def comparable(cfg) -> dict[str, Any]:
    container = OmegaConf.to_container(cfg, resolve=False)
    for key in ("paths", "hydra", "name"):
        container.pop(key, None)
    return container


def emulated(cfg) -> list[str]:
    """What of a composed run computes in a dtype this machine emulates (bf16 on a CPU without
    bf16 instructions, fp16 on any CPU), each with the switch that avoids it: the warnings the
    run itself would log, known before it is timed."""
    dev = cfg.trainer.device
    kind = "cuda" if dev == "cuda" or (dev == "auto" and torch.cuda.is_available()) else "cpu"
    found = [
        precision_emulation(cfg.precision.name, kind),
        optimizer_emulation(cfg.optimizer, kind),
    ]
    return [text for text in found if text]


def emulation_lines(notes: dict[str, list[str]]) -> list[str]:
    """The report's paragraph on what runs emulated here, each warning once with its variants."""
    native = "has" if cpu_has_fast_bf16() else "has no"
    head = f"This CPU {native} native bf16 (AVX512-BF16 or AMX)"
    by_text: dict[str, list[str]] = {}
    for name, texts in notes.items():
        for text in texts:
            by_text.setdefault(text, []).append(name)
    if not by_text:
        return [f"{head}: nothing these runs ask for is emulated here.  "]
    return [f"{head}. Emulated here, so timed slower than this machine can run it:", ""] + [
        f"- {', '.join(names)}: {text}" for text, names in by_text.items()
    ]


def plan(
    variants: list[str], base: list[str], out: Path, notes: dict[str, list[str]] | None = None
) -> list[str]:
    """Validate every variant's config; drop those that change nothing. Returns the kept ones;
    `notes` gets each kept one's emulated parts (:func:`emulated`)."""
    register_configs()
    register_resolvers()
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        raise UserError(
            f"accel-report --variants: unknown {', '.join(unknown)}; pick from "
            f"{', '.join(ALL_VARIANTS)}."
        )
    configs = {}
    for name in ["baseline", *[v for v in variants if v != "baseline"]]:
        try:
            cfg = compose_run([*base, *ALL_VARIANTS[name]], out / name)
            validate(cfg)
            typed(OmegaConf.to_container(cfg), resolved=False)  # a key added with `+`
        except UserError as err:
            shown = " ".join(ALL_VARIANTS[name]) or "no change"
            raise UserError(f"the {name} variant ({shown}): {err}") from None
        except Exception as err:  # Hydra's compose errors: a misspelled override
            user = as_user_error(err)
            if user is None:
                raise
            raise UserError(f"the overrides {' '.join(base)} do not compose: {user}") from None
        configs[name] = comparable(cfg)
        if notes is not None:
            notes[name] = emulated(cfg)
    kept = ["baseline"]
    for name in configs:
        if name == "baseline":
            continue
        if configs[name] == configs["baseline"]:
            log.info("%s: the base config already has %s; left out", name, ALL_VARIANTS[name])
        else:
            kept.append(name)
    if notes is not None:
        for name in set(notes) - set(kept):
            del notes[name]
        for line in emulation_lines(notes):
            if line.strip():
                log.info("%s", line.strip())
    return kept


def accel_train_command() -> list[str]:
    script = Path(sys.argv[0]).resolve().parent / "accel-train"
    found = str(script) if script.exists() else shutil.which("accel-train")
    return (
        [found] if found else [sys.executable, "-c", "from accel_train.cli import train; train()"]
    )


def execute(run: Run, base: list[str], overrides: list[str]) -> None:
    args = [
        *accel_train_command(),
        *base,
        *overrides,
        "trainer.progress=none",
        f"hydra.run.dir={run.run_dir}",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "report_run.log").write_text(
        f"$ {shlex.join(args)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    summary_path = run.run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.is_file():
        run.status = f"failed (exit {proc.returncode})"
        # The error's paragraph, not Hydra's "(Set HYDRA_FULL_ERROR=1 ...)" line after it.
        lines = [x for x in proc.stderr.splitlines() if x.strip() and "HYDRA_FULL_ERROR" not in x]
        run.error = lines[-1] if lines else ""
        return
    summary = json.loads(summary_path.read_text())
    run.status = "done"
    run.values = {
        "samples_per_s": summary.get("samples_per_s") or summary.get("train_samples_per_s"),
        "wall_s": wall,  # launch to exit, as the user waits for it
        "time_to_target_s": summary.get("time_to_target_s"),
        "peak_mem_mb": summary.get("peak_mem_mb"),
        "best_val_acc": summary.get("best_val_acc"),
        "test_acc": summary.get("test_acc"),
        "best_score": summary.get("best_score"),  # the task's monitor, for quality()
        "monitor_mode": summary.get("monitor_mode"),
        "cpu_s": cpu,
        "sample_shape": summary.get("sample_shape"),  # what a sample is (techniques/speed.py)
    }


def quality(summary: dict) -> float | None:
    """What the accuracy guard compares, higher is better: test accuracy, else the best
    validation accuracy, else (a task that logs no accuracy) the best value of the task's
    monitor (checkpoint.monitor), negated when lower is better (val/loss)."""
    if summary.get("test_acc") is not None:
        return summary["test_acc"]
    acc = summary.get("best_val_acc")
    if acc is not None and acc >= 0:
        return acc
    best = summary.get("best_score")
    if best is None:
        return None
    return -best if summary.get("monitor_mode") == "min" else best


def run_rounds(names, repeats, phase, out, base, overrides_of, runs: list[Run]) -> None:
    for repeat in range(repeats):
        for name in names:
            run = Run(name, repeat, phase, out / name / f"r{repeat}", os.getloadavg()[0])
            log.info("[phase %d, round %d/%d] %s", phase, repeat + 1, repeats, name)
            execute(run, base, overrides_of[name])
            if run.status != "done":
                log.warning("%s round %d: %s %s", name, repeat + 1, run.status, run.error)
            runs.append(run)


def _values(runs: list[Run], name: str, key: str, phase: int) -> list[float]:
    return [
        r.values[key]
        for r in runs
        if r.variant == name and r.phase == phase and r.values.get(key) is not None
    ]


def ratio_to_baseline(runs: list[Run], name: str, phase: int) -> list[float]:
    """samples/s of each repeat over the baseline's of the same round."""
    base = {
        r.repeat: r.values["samples_per_s"]
        for r in runs
        if r.variant == "baseline" and r.phase == phase and r.status == "done"
    }
    return [
        r.values["samples_per_s"] / base[r.repeat]
        for r in runs
        if r.variant == name and r.phase == phase and r.status == "done" and base.get(r.repeat)
    ]


def baseline_spread(runs: list[Run], phase: int) -> float | None:
    """The baseline's round-to-round spread of samples/s, (max - min) / median; None with fewer
    than two rounds (nothing to measure it on)."""
    speeds = _values(runs, "baseline", "samples_per_s", phase)
    if len(speeds) < 2 or statistics.median(speeds) <= 0:
        return None
    return (max(speeds) - min(speeds)) / statistics.median(speeds)


NO_DIFFERENCE = "no measurable difference"


def verdict(runs: list[Run], name: str, phase: int, spread_check: bool = True) -> str:
    """faster / slower when every round's ratio to its baseline lies outside 1 +- the baseline's
    spread; inside it: no measurable difference. Without the check: the median's side of 1."""
    ratios = ratio_to_baseline(runs, name, phase)
    if not ratios:
        return "-"
    med = statistics.median(ratios)
    if not spread_check:
        return f"{med:.2f}x (median only)"
    spread = baseline_spread(runs, phase)
    if spread is None:
        return "not judged (1 round: no spread)"
    if min(ratios) > 1 + spread:
        return f"faster, {med:.2f}x"
    if max(ratios) < 1 - spread:
        return f"slower, {med:.2f}x"
    return NO_DIFFERENCE


def combination(
    runs: list[Run], kept: list[str], min_gain: float, max_drop: float, spread_check: bool = False
) -> list[str]:
    """The switches that helped on their own, at most one of each exclusive set: a median ratio
    of at least `min_gain`, and with `spread_check` a gain outside the rounds' spread. The accuracy
    guard compares test accuracy, or the best validation accuracy when the data set has no test
    split, or for a task without accuracy its monitored metric (a switch must not buy its speed
    with quality in any case)."""

    def judged(name: str) -> list[float]:  # test acc, best val acc, or the task's monitor
        done = [r for r in runs if r.variant == name and r.phase == 1 and r.status == "done"]
        return [q for q in (quality(r.values) for r in done) if q is not None]

    base_acc = judged("baseline")
    winners = {}
    for name in kept:
        if name == "baseline":
            continue
        ratios = ratio_to_baseline(runs, name, 1)
        accs = judged(name)
        if not ratios or statistics.median(ratios) < min_gain:
            continue
        if spread_check and not verdict(runs, name, 1).startswith("faster"):
            continue  # inside the noise (or one round): nothing measured to combine
        if base_acc and accs and statistics.median(accs) < statistics.median(base_acc) - max_drop:
            continue
        winners[name] = statistics.median(ratios)
    for group in EXCLUSIVE:
        rivals = [n for n in winners if n in group]
        for loser in sorted(rivals, key=winners.get)[:-1]:
            del winners[loser]
    return list(winners)


def _cell(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def spread_line(runs: list[Run], phase: int, spread_check: bool) -> str:
    """What the verdicts of a phase were judged against, in one sentence."""
    spread = baseline_spread(runs, phase)
    rounds = len(_values(runs, "baseline", "samples_per_s", phase))
    where = "" if phase == 1 else " (phase 2)"
    if spread is None:
        measured = f"The baseline{where} ran {rounds} round: no spread measured"
    else:
        measured = (
            f"The baseline's samples/s{where} spread {spread:.0%} over its {rounds} rounds "
            "((max - min) / median)"
        )
    if not spread_check:
        return f"{measured}; switches judged by their median ratio alone (--no-spread-check)."
    if spread is None:
        return f"{measured}, so no switch is judged faster or slower: use --repeats 3 or more."
    return (
        f"{measured}: a switch is faster or slower only when every round's ratio lies outside "
        f"1 +- {spread:.2f}; inside it, {NO_DIFFERENCE}."
    )


def sample_line(runs: list[Run]) -> str:
    """What samples/s counts, from the runs' input shapes (an image, a clip of frames, a row
    of tokens: the shape says it, whatever the data set)."""
    shapes = {tuple(r.values["sample_shape"]) for r in runs if r.values.get("sample_shape")}
    if not shapes:
        return ""
    shown = ", ".join("x".join(str(d) for d in s) for s in sorted(shapes))
    return (
        f"A sample is one training input of shape {shown} (e.g. C x H x W: an image; "
        "C x T x H x W: a clip of T frames, so samples/s is clips/s).  "
    )


def write_report(
    out: Path,
    runs: list[Run],
    rows: list[tuple[str, int, str]],
    argv: list[str],
    spread_check: bool = True,
    notes: dict[str, list[str]] | None = None,
):
    """rows: (variant, phase, overrides shown); notes: plan's emulated parts per variant."""
    loads = [r.load for r in runs]
    lines = [
        "# Speed report",
        "",
        f"Command: `accel-report {shlex.join(argv)}`  ",
        f"Written {datetime.now():%Y-%m-%d %H:%M}; {os.cpu_count()} CPUs; load average before "
        f"the runs: min {min(loads):.1f}, median {statistics.median(loads):.1f}, max "
        f"{max(loads):.1f} (a loaded machine makes every number noisier).  ",
        "Each cell: median (min-max) over the repeats. `vs baseline`: the median of per-round "
        "throughput ratios against the baseline run of the same round. samples/s leaves out the "
        "first logging interval (warm-up); `launch to exit` is the whole command.  ",
        sample_line(runs),
        "",
        *(emulation_lines(notes) + [""] if notes is not None else []),
        *(spread_line(runs, p, spread_check) + "  " for p in sorted({p for _, p, _ in rows})),
        "",
        "| variant | overrides | samples/s | vs baseline | verdict | "
        + " | ".join(FIELDS[k] for k in list(FIELDS)[1:])
        + " | runs |",
        "|" + "---|" * (len(FIELDS) + 5),
    ]
    for name, phase, shown in rows:
        mine = [r for r in runs if r.variant == name and r.phase == phase]
        ok = [r for r in mine if r.status == "done"]
        ratios = ratio_to_baseline(runs, name, phase) if name != "baseline" else []
        cells = [
            _cell(_values(runs, name, "samples_per_s", phase), ".0f"),
            _cell(ratios, ".2f") if ratios else ("1.00" if name == "baseline" else "-"),
            "-" if name == "baseline" else verdict(runs, name, phase, spread_check),
            _cell(_values(runs, name, "wall_s", phase), ".1f"),
            _cell(_values(runs, name, "time_to_target_s", phase), ".1f"),
            _cell(_values(runs, name, "peak_mem_mb", phase), ".0f"),
            _cell(_values(runs, name, "best_val_acc", phase), ".4f"),
            _cell(_values(runs, name, "test_acc", phase), ".4f"),
            _cell(_values(runs, name, "cpu_s", phase), ".1f"),
        ]
        label = name if phase == 1 else f"{name} (phase 2)"
        lines.append(
            f"| {label} | `{shown or '-'}` | " + " | ".join(cells) + f" | {len(ok)}/{len(mine)} |"
        )
    failed = [r for r in runs if r.status != "done"]
    if failed:
        lines += ["", "Failed runs:", ""]
        lines += [
            f"- {r.variant} round {r.repeat + 1}: {r.status}: {r.error} ({r.run_dir})"
            for r in failed
        ]
    lines += ["", "Run dirs: `<report dir>/[phase2/]<variant>/r<k>/` (each with report_run.log)."]
    (out / "speed_report.md").write_text("\n".join(lines) + "\n")
    _write_csv(out, runs)
    _plot(out, runs, rows)


def _write_csv(out: Path, runs: list[Run]) -> None:
    """speed_report.csv: one row a run, every measured field."""
    with open(out / "speed_report.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["variant", "phase", "repeat", "status", "load", *FIELDS, "run_dir"])
        for r in runs:
            writer.writerow(
                [r.variant, r.phase, r.repeat, r.status, f"{r.load:.2f}"]
                + [r.values.get(k) for k in FIELDS]
                + [str(r.run_dir)]
            )


def _plot(out: Path, runs: list[Run], rows) -> None:
    try:
        import matplotlib  # a core dependency, imported only to draw

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib (a dependency of accel-train) cannot be imported here: no PNG")
        return
    labels, medians, lows, highs = [], [], [], []
    for name, phase, _ in rows:
        ratios = [1.0] if name == "baseline" else ratio_to_baseline(runs, name, phase)
        if not ratios:
            continue
        med = statistics.median(ratios)
        labels.append(name if phase == 1 else f"{name} (2)")
        medians.append(med)
        lows.append(med - min(ratios))
        highs.append(max(ratios) - med)
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(labels) + 1.5))
    ax.barh(labels, medians, xerr=[lows, highs], color="tab:blue", alpha=0.8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("training throughput vs baseline (median, min-max)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "speed_report.png", dpi=120)
    plt.close(fig)


@report_user_errors
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="[accel-report] %(message)s")
    opts, base = parse_args(argv)
    base = alias_overrides(base).argv  # lightning-hydra-template's spellings too
    if opts.repeats < 1:
        raise UserError(f"accel-report --repeats {opts.repeats}: must be >= 1.")
    out = Path(opts.out or f"outputs/speed_report/{datetime.now():%Y-%m-%d_%H-%M-%S}")
    wanted = [v.strip() for v in opts.variants.split(",") if v.strip()]
    notes: dict[str, list[str]] = {}
    kept = plan(wanted, base, out, notes)
    out.mkdir(parents=True, exist_ok=True)
    overrides_of = {name: ALL_VARIANTS[name] for name in kept}
    runs: list[Run] = []
    run_rounds(kept, opts.repeats, 1, out, base, overrides_of, runs)
    rows = [(n, 1, " ".join(ALL_VARIANTS[n])) for n in kept]
    check = not opts.no_spread_check
    best = (
        []
        if opts.no_combine
        else combination(runs, kept, opts.min_gain, opts.max_acc_drop, spread_check=check)
    )
    if len(best) > 1:  # one winner is already measured as it is
        combo = [o for n in best for o in ALL_VARIANTS[n]]
        try:
            validate(compose_run([*base, *combo], out / "best"))
        except UserError as err:
            log.warning("the combination %s is refused: %s", "+".join(best), err)
        else:
            overrides_of |= {"best": combo}
            run_rounds(
                ["baseline", "best"], opts.repeats, 2, out / "phase2", base, overrides_of, runs
            )
            rows += [("baseline", 2, ""), ("best", 2, " ".join(combo))]
    write_report(out, runs, rows, argv, spread_check=check, notes=notes)
    print((out / "speed_report.md").read_text())
    png = " and .png" if (out / "speed_report.png").exists() else ""
    print(f"accel-report: wrote {out / 'speed_report.md'} (and .csv{png})")
    if all(r.status != "done" for r in runs if r.variant == "baseline"):
        sys.exit(1)

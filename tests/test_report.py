"""`accel-report` (commands/report.py): baseline and switches side by side, the combination phase,
the report files; variants that change nothing are left out; bad arguments are one paragraph;
what runs emulated on this CPU is said with the switch that avoids it (issue 62)."""

from __future__ import annotations

import csv
import statistics

from helpers import FAST, check_ok

from accel_train.commands.report import Run, combination, plan, verdict
from accel_train.precision import NATIVE_BF16_ENV

TINY = [*FAST, "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "logger=csv"]


def test_the_report_runs_each_switch_then_the_combination(run_cli, tmp_path):
    """--min-gain 0 and --no-spread-check (one round measures no spread): both switches count
    as winners, so phase 2 runs their combination against the baseline again. 5 tiny runs."""
    out = tmp_path / "report"
    proc = run_cli(
        [
            "--variants",
            "device_loader,channels_last",
            "--repeats",
            "1",
            "--min-gain",
            "0",
            "--max-acc-drop",
            "1",
            "--no-spread-check",
            "--out",
            out,
            *TINY,
        ],
        prog="accel-report",
        timeout=600,
    )
    check_ok(proc)
    rows = list(csv.DictReader((out / "speed_report.csv").read_text().splitlines()))
    assert [(r["variant"], r["phase"]) for r in rows] == [
        ("baseline", "1"),
        ("device_loader", "1"),
        ("channels_last", "1"),
        ("baseline", "2"),
        ("best", "2"),
    ]
    assert all(r["status"] == "done" and float(r["samples_per_s"]) > 0 for r in rows)
    assert (out / "phase2" / "best" / "r0" / "summary.json").is_file()  # a normal run dir
    config = (out / "phase2" / "best" / "r0" / "config.yaml").read_text()
    assert "channels_last: true" in config and "name: device" in config
    report = (out / "speed_report.md").read_text()
    assert "| best (phase 2) | `loader=device trainer.channels_last=true` |" in report
    assert "load average before the runs" in report
    assert "judged by their median ratio alone (--no-spread-check)" in report


def test_a_difference_inside_the_rounds_spread_is_no_measurable_difference(run_cli, tmp_path):
    """Two rounds of 2-step runs: the report gives the baseline's spread, and each switch's
    verdict follows from the CSV's own numbers (faster only outside 1 + spread). 4 tiny runs."""
    out = tmp_path / "report"
    args = ["--variants", "channels_last", "--repeats", "2", "--out", out, *TINY]
    proc = run_cli([*args, "trainer.max_steps=2"], prog="accel-report", timeout=600)
    check_ok(proc)
    rows = list(csv.DictReader((out / "speed_report.csv").read_text().splitlines()))
    speed = {(r["variant"], r["repeat"]): float(r["samples_per_s"]) for r in rows}
    base = [speed["baseline", k] for k in ("0", "1")]
    spread = (max(base) - min(base)) / statistics.median(base)
    ratios = [speed["channels_last", k] / speed["baseline", k] for k in ("0", "1")]
    report = (out / "speed_report.md").read_text()
    assert f"spread {spread:.0%} over its 2 rounds" in report, report
    row = next(line for line in report.splitlines() if line.startswith("| channels_last |"))
    if min(ratios) > 1 + spread:
        assert "| faster, " in row, row
    elif max(ratios) < 1 - spread:
        assert "| slower, " in row, row
    else:
        assert "| no measurable difference |" in row, row


def test_a_gain_inside_the_noise_is_not_combined(tmp_path):
    """RandAugment "1.59x faster" from a 2-step run: the baseline's own rounds differ by more
    than that, so neither switch is a winner, and a clear gain outside the spread is."""

    def run(variant: str, repeat: int, speed: float) -> Run:
        values = {"samples_per_s": speed, "test_acc": 0.5}
        return Run(variant, repeat, 1, tmp_path, 0.0, "done", values)

    runs = [run("baseline", 0, 100), run("baseline", 1, 180), run("baseline", 2, 110)]
    runs += [run("auto_augment", k, s) for k, s in enumerate((190, 200, 170))]  # 1.1-1.9x
    runs += [run("ema", k, s) for k, s in enumerate((300, 540, 330))]  # 3x every round
    assert verdict(runs, "auto_augment", 1) == "no measurable difference"
    assert verdict(runs, "ema", 1) == "faster, 3.00x"
    kept = ["baseline", "auto_augment", "ema"]
    assert combination(runs, kept, 1.02, 1, spread_check=True) == ["ema"]
    assert combination(runs, kept, 1.02, 1) == ["auto_augment", "ema"]  # medians alone


def test_a_switch_the_base_config_already_has_is_left_out(tmp_path):
    kept = plan(["device_loader", "channels_last"], [*TINY, "loader=device"], tmp_path)
    assert kept == ["baseline", "channels_last"]
    # loader=ray (opt-in): composed and validated like the others, left out where the base has it.
    assert plan(["ray_loader"], TINY, tmp_path / "a") == ["baseline", "ray_loader"]
    assert plan(["ray_loader"], [*TINY, "loader=ray"], tmp_path / "b") == ["baseline"]


def test_the_plan_names_what_runs_emulated_on_this_cpu(tmp_path, monkeypatch):
    """A CPU without native bf16 (the detection overridden): precision=bf16 and Muon's forced
    bf16 Newton-Schulz are named, each with its switch; amp and Muon's auto are not."""
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")
    notes: dict[str, list[str]] = {}
    base = [*TINY, "optimizer=muon", "optimizer.ns_dtype=bf16"]
    assert plan(["bf16", "amp"], base, tmp_path, notes) == ["baseline", "bf16", "amp"]
    muon = [n for n in notes["baseline"] if "optimizer.ns_dtype=bf16" in n]
    assert len(notes["baseline"]) == 1 and "`optimizer.ns_dtype=auto`" in muon[0]
    assert notes["amp"] == notes["baseline"]
    assert any("precision=bf16 on a CPU without bf16" in n for n in notes["bf16"])
    assert any("`precision=amp` picks bf16 only where" in n for n in notes["bf16"])
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    plan(["bf16"], base, tmp_path / "native", notes := {})
    assert notes == {"baseline": [], "bf16": []}  # nothing emulated where the CPU has bf16


def test_the_report_says_which_variant_runs_emulated(run_cli, tmp_path):
    """The real command on a CPU without native bf16: its speed_report.md says that the bf16
    variant is emulated here and what to switch, before the numbers. 2 tiny runs."""
    out = tmp_path / "report"
    args = ["--variants", "bf16", "--repeats", "1", "--no-combine", "--out", out, *TINY]
    proc = run_cli(args, prog="accel-report", timeout=600, env={NATIVE_BF16_ENV: "0"})
    check_ok(proc)
    report = (out / "speed_report.md").read_text()
    assert "This CPU has no native bf16 (AVX512-BF16 or AMX). Emulated here" in report
    assert "- bf16: precision=bf16 on a CPU without bf16 instructions" in report
    assert "`precision=amp` picks bf16 only where the CPU has it" in report
    assert report.index("Emulated here") < report.index("| variant |")


def test_bad_report_arguments_are_one_paragraph(run_cli):
    proc = run_cli(["--variants", "warp_drive", *TINY], prog="accel-report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown warp_drive" in proc.stderr and "device_loader" in proc.stderr
    proc = run_cli(["--repeats", "1", "model=no_such_model"], prog="accel-report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model=no_such_model" in proc.stderr


def test_the_combination_guards_accuracy_with_val_when_there_is_no_test_split(tmp_path):
    """Without test accuracy (an image_folder tree with no test folder) a switch that is faster
    but loses validation accuracy is not combined; one that keeps it is."""

    def run(variant: str, speed: float, val: float) -> Run:
        values = {"samples_per_s": speed, "best_val_acc": val, "test_acc": None}
        return Run(variant, 0, 1, tmp_path, 0.0, "done", values)

    runs = [run("baseline", 10, 0.80), run("channels_last", 12, 0.80), run("ema", 13, 0.10)]
    assert combination(runs, ["baseline", "channels_last", "ema"], 1.02, 0.005) == ["channels_last"]

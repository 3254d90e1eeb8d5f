"""`accel-report` (commands/report.py): baseline and switches side by side, the combination phase,
the report files; variants that change nothing are left out; bad arguments are one paragraph."""

from __future__ import annotations

import csv

from helpers import FAST, check_ok

from accel_train.commands.report import Run, combination, plan

TINY = [*FAST, "trainer.max_epochs=1", "trainer.log_every_n_steps=1", "logger=csv"]


def test_the_report_runs_each_switch_then_the_combination(run_cli, tmp_path):
    """--min-gain 0: both switches count as winners, so phase 2 runs their combination
    against the baseline again. 5 tiny runs."""
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


def test_a_switch_the_base_config_already_has_is_left_out(tmp_path):
    kept = plan(["device_loader", "channels_last"], [*TINY, "loader=device"], tmp_path)
    assert kept == ["baseline", "channels_last"]
    # loader=ray (opt-in): composed and validated like the others, left out where the base has it.
    assert plan(["ray_loader"], TINY, tmp_path / "a") == ["baseline", "ray_loader"]
    assert plan(["ray_loader"], [*TINY, "loader=ray"], tmp_path / "b") == ["baseline"]


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

"""`accel-report` (launch/report.py): baseline and switches side by side, the combination phase,
the report files; variants that change nothing are left out; bad arguments are one paragraph."""

from __future__ import annotations

import csv

from helpers import FAST, check_ok

from accel_train.launch.report import plan

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


def test_bad_report_arguments_are_one_paragraph(run_cli):
    proc = run_cli(["--variants", "warp_drive", *TINY], prog="accel-report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "unknown warp_drive" in proc.stderr and "device_loader" in proc.stderr
    proc = run_cli(["--repeats", "1", "model=no_such_model"], prog="accel-report")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model=no_such_model" in proc.stderr

"""Hydra multirun through the real CLI: grids, a failing job, resuming a sweep, Optuna.

Every sweep writes into `hydra.sweep.dir=<tmp>/<name>`; each job is a tiny synthetic run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import FAST, check_ok
from omegaconf import OmegaConf

from accel_train.commands import sweep_summary as sweep
from accel_train.errors import UserError

SWEEP = [*FAST, "dataset=synthetic", "trainer.max_epochs=1"]
GRID = ["loader.batch_size=32,64", "optimizer.lr=1e-3,3e-3"]


def _summary(sweep_dir) -> dict:
    data = json.loads((sweep_dir / "sweep_summary.json").read_text())
    csv_lines = (sweep_dir / "sweep_summary.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(data["rows"])  # header + one line per job
    return data


@pytest.fixture(scope="module")
def grid(tmp_path_factory, run_cli_in):
    cwd = tmp_path_factory.mktemp("grid")
    sweep_dir = cwd / "sweep"
    proc = run_cli_in(["-m", *SWEEP, *GRID, f"hydra.sweep.dir={sweep_dir}"], cwd, timeout=600)
    check_ok(proc)
    return sweep_dir, proc


def test_grid_runs_every_job_and_writes_the_summary(grid):
    sweep_dir, proc = grid
    data = _summary(sweep_dir)
    assert data["jobs"] == 4 and data["failed"] == 0
    assert [r["job"] for r in data["rows"]] == [0, 1, 2, 3]
    combos = {tuple(r["varying"]) for r in data["rows"]}
    assert combos == {
        (f"loader.batch_size={b}", f"optimizer.lr={lr}")
        for b in (32, 64)
        for lr in ("0.001", "0.003")
    }
    for row in data["rows"]:
        assert row["status"] == "done" and row["error"] is None
        job_summary = json.loads((sweep_dir / str(row["job"]) / "summary.json").read_text())
        for key in ("best_val_acc", "final_val_acc", "train_samples_per_s", "wall_s"):
            assert row[key] == job_summary[key]
        assert row["objective"] == job_summary["best_val_acc"]  # objective: best_val_acc
        assert "dataset=synthetic" in row["overrides"]  # the full overrides rerun the job
    best = max(data["rows"], key=lambda r: r["objective"])
    assert data["best"]["job"] == best["job"]
    # The rich table on stdout: a row per job.
    assert "sweep_summary.csv" in proc.stdout
    for row in data["rows"]:
        assert " ".join(row["varying"]) in proc.stdout


def test_a_failing_job_does_not_stop_the_sweep(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(["-m", *SWEEP, "loader.batch_size=0,32", f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 of 2 sweep jobs failed" in proc.stderr
    data = _summary(sweep_dir)
    bad, good = data["rows"]
    assert bad["varying"] == ["loader.batch_size=0"]
    assert bad["status"] == "failed" and "loader.batch_size=0 must be >= 1" in bad["error"]
    assert bad["objective"] is None and bad["best_val_acc"] is None
    assert good["status"] == "done" and good["best_val_acc"] is not None
    assert (sweep_dir / "1" / "summary.json").is_file()
    status = json.loads((sweep_dir / "0" / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == bad["error"]
    assert "job 0 failed: loader.batch_size=0" in (sweep_dir / "0" / "train.log").read_text()
    assert "Traceback" not in proc.stdout + proc.stderr  # a UserError is one line


def test_an_unexpected_error_is_recorded_with_its_traceback(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    # A bug in a loop hook (a user callback from the working directory) raises a RuntimeError,
    # not a UserError, in the middle of the run.
    (tmp_path / "boom.py").write_text(
        "from accel_train.techniques import Technique\n\n\n"
        "class Boom(Technique):\n"
        "    def on_fit_start(self, loop):\n"
        "        raise RuntimeError('boom')\n"
    )
    hook = "+callbacks.boom._target_=boom.Boom"
    proc = run_cli(["-m", *SWEEP, hook, f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (row,) = _summary(sweep_dir)["rows"]
    assert row["status"] == "failed" and row["error"].startswith("RuntimeError: ")
    log = (sweep_dir / "0" / "train.log").read_text()
    assert "Traceback (most recent call last)" in log and "RuntimeError" in log


def test_resume_skips_finished_jobs_and_resumes_the_others(grid, run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    shutil.copytree(grid[0], sweep_dir)
    (sweep_dir / "1" / "summary.json").unlink()  # job 1 "did not finish"
    before = {j: (sweep_dir / str(j) / "summary.json").read_text() for j in (0, 2, 3)}
    proc = run_cli(["-m", *SWEEP, *GRID, "resume=auto", f"hydra.sweep.dir={sweep_dir}"])
    check_ok(proc)
    rows = _summary(sweep_dir)["rows"]
    assert [r["status"] for r in rows] == ["skipped (done)", "done", "skipped (done)"] + [
        "skipped (done)"
    ]
    for job, text in before.items():  # not trained again
        assert (sweep_dir / str(job) / "summary.json").read_text() == text
        assert rows[job]["objective"] == json.loads(text)["best_val_acc"]
    events = [
        json.loads(line)
        for line in (sweep_dir / "1" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert any(e.get("event") == "resume" for e in events)  # from its own last.pt
    assert json.loads((sweep_dir / "1" / "summary.json").read_text())["steps"] == 8  # 256 / 32


def test_resume_refuses_a_job_dir_of_another_config(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = ["-m", *SWEEP, "trainer.limit_train_batches=1", f"hydra.sweep.dir={sweep_dir}"]
    check_ok(run_cli([*args, "loader.batch_size=32"]))
    proc = run_cli([*args, "loader.batch_size=64", "resume=auto"])
    assert proc.returncode == 1
    (row,) = _summary(sweep_dir)["rows"]
    assert row["status"] == "failed"
    assert "loader.batch_size=32 there, 64 now" in row["error"]


def test_optuna_search_reports_the_best_trial(run_cli, tmp_path):
    pytest.importorskip("optuna")
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SWEEP,
            "hparams_search=mnist_optuna",
            "hydra.sweeper.n_trials=3",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=600,
    )
    check_ok(proc)
    data = _summary(sweep_dir)
    assert [r["status"] for r in data["rows"]] == ["done"] * 3
    for row in data["rows"]:
        keys = {o.split("=")[0] for o in row["varying"]}
        assert keys == {"optimizer.lr", "loader.batch_size", "optimizer"}, row["varying"]
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    best = max(data["rows"], key=lambda r: r["objective"])
    assert results.best_value == pytest.approx(best["objective"])
    assert data["best"]["job"] == best["job"]
    assert set(results.best_params) == {"optimizer.lr", "loader.batch_size", "optimizer"}
    assert 1e-4 <= results.best_params["optimizer.lr"] <= 1e-2
    assert "Best value" in proc.stdout


def test_a_ddp_job_inside_a_sweep_runs_torchrun_without_a_new_sweep(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SWEEP,
            "strategy=ddp",
            "launcher.nproc_per_node=2",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=600,
    )
    check_ok(proc)
    (row,) = _summary(sweep_dir)["rows"]
    assert row["status"] == "done"
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2
    # The workers read the job's config.yaml; nothing else was launched or written.
    assert (
        "accel_train.worker" in proc.stdout and str(sweep_dir / "0" / "config.yaml") in proc.stdout
    )
    assert proc.stdout.count("Launching 1 jobs") == 1
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0"]
    assert not (tmp_path / "outputs").exists()


def test_submitit_local_launcher_runs_jobs_in_their_own_processes(run_cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SWEEP,
            "hydra/launcher=submitit_local",
            "loader.batch_size=0,32",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = _summary(sweep_dir)["rows"]
    assert [r["status"] for r in rows] == ["failed", "done"]
    assert (sweep_dir / ".submitit").is_dir()


# ---- plugins and config ---------------------------------------------------------------


def test_missing_optuna_plugin_names_the_extra(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['optuna'] = None  # as if not installed\n"
        "sys.argv = ['accel-train', '-m', 'hparams_search=mnist_optuna']\n"
        "from accel_train.cli import train\n"
        "train()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'pip install -e ".[sweep]"' in proc.stderr
    assert "Optuna" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()  # nothing ran


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["-m", "hydra/sweeper=optuna"], "sweep"),
        (["-m", "+experiment=mnist_amp", "hparams_search=mnist_optuna"], "sweep"),
        (["-m", "hydra/launcher=submitit_slurm", "precision=fp32,bf16"], "slurm"),
        (["-m", "hydra/launcher=submitit_local"], "slurm"),
    ],
)
def test_check_plugins_names_the_extra(monkeypatch, argv, extra):
    monkeypatch.setattr(sweep, "_installed", lambda module: False)
    with pytest.raises(UserError, match=rf'pip install -e "\.\[{extra}\]"'):
        sweep.check_plugins(argv)
    monkeypatch.setattr(sweep, "_installed", lambda module: True)
    sweep.check_plugins(argv)


def test_check_plugins_ignores_other_overrides(monkeypatch):
    monkeypatch.setattr(sweep, "_installed", lambda module: False)
    sweep.check_plugins(["-m", "loader.batch_size=32,64", "+experiment=mnist_amp", "--cfg", "job"])


def test_hparams_search_config_composes():
    pytest.importorskip("optuna")
    from hydra import compose, initialize_config_dir

    from accel_train.config import CONFIG_DIR
    from accel_train.config.schema import register_configs

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("train", ["hparams_search=mnist_optuna"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper")
    assert sweeper.direction == "maximize" and cfg.objective == "best_val_acc"
    assert sweeper.sampler.seed is not None
    assert dict(sweeper.params) == {
        "optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
        "loader.batch_size": "choice(32, 64, 128)",
        "optimizer": "choice(adam, adamw, sgd)",
    }
    assert "sweep_summary" in cfg.hydra.callbacks


def test_objective_must_be_a_summary_metric(run_cli):
    proc = run_cli([*SWEEP, "objective=accuracy"])
    assert proc.returncode == 2
    assert "objective='accuracy'" in proc.stderr and "best_val_acc" in proc.stderr

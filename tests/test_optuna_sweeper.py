"""accel-train's Optuna sweeper (`hydra/sweeper=optuna`, hydra_plugins/accel_train_optuna) through
the real CLI: a study kept in SQLite and resumed, every search-space form, several objectives,
a pruned trial, failed trials, and configs refused with one paragraph.

Every trial is a tiny synthetic run in the sweeping process (Hydra's basic launcher), except
the DDP trial; the study is read back with `optuna.load_study`, as a user would."""

from __future__ import annotations

import json
from wsgiref.util import setup_testing_defaults

import pytest
from helpers import check_ok
from omegaconf import OmegaConf

optuna = pytest.importorskip("optuna")

TINY = [
    "model=mlp",
    "dataset=synthetic",
    "dataset.num_train=64",
    "dataset.num_test=16",
    "trainer.progress=none",
    "logger=none",
]
SEARCH = [*TINY, "trainer.max_steps=2", "hparams_search=mnist_optuna"]


def _study(tmp_path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'optuna.db'}")


def _rows(sweep_dir) -> list[dict]:
    return json.loads((sweep_dir / "sweep_summary.json").read_text())["rows"]


def _one_paragraph(proc, *needles: str, code: int = 2) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("accel-train: ")]
    for needle in needles:
        assert needle in line, line
    return line


def test_a_study_in_sqlite_is_kept_and_a_rerun_resumes_it(run_cli, tmp_path):
    storage = "hydra.sweeper.storage=sqlite:///optuna.db"  # in the working directory
    first = tmp_path / "first"
    proc = run_cli(["-m", *SEARCH, storage, "hydra.sweeper.n_trials=3", f"hydra.sweep.dir={first}"])
    check_ok(proc)
    assert [r["status"] for r in _rows(first)] == ["done"] * 3
    results = OmegaConf.load(first / "optimization_results.yaml")
    assert set(results.best_params) == {"optimizer.lr", "loader.batch_size", "optimizer"}

    # The same command with n_trials=5: two more trials, numbered on from the study's.
    second = tmp_path / "second"
    proc = run_cli(
        ["-m", *SEARCH, storage, "hydra.sweeper.n_trials=5", f"hydra.sweep.dir={second}"]
    )
    check_ok(proc)
    assert "holds 3 finished trials: 2 more to reach n_trials=5" in proc.stdout
    assert [r["job"] for r in _rows(second)] == [3, 4]
    assert sorted(p.name for p in second.iterdir() if p.is_dir() and p.name[0] != ".") == [
        "3",
        "4",
    ]

    study = _study(tmp_path, "mnist_optuna")
    trials = study.trials
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]
    assert {t.state for t in trials} == {optuna.trial.TrialState.COMPLETE}
    assert [t.user_attrs["job_dir"] for t in trials] == [
        *(str(first / str(n)) for n in range(3)),
        *(str(second / str(n)) for n in (3, 4)),
    ]
    for trial in trials:  # each trial's value is its run's summary.json objective
        summary = json.loads((tmp_path / trial.user_attrs["job_dir"] / "summary.json").read_text())
        assert trial.value == summary["best_val_acc"]
    # The resumed (seeded) sampler did not propose the first trials' values again.
    assert {t.params["optimizer.lr"] for t in trials[3:]}.isdisjoint(
        t.params["optimizer.lr"] for t in trials[:3]
    )
    assert OmegaConf.load(second / "optimization_results.yaml").best_value == study.best_value

    # Already at n_trials: nothing runs, the command still succeeds.
    proc = run_cli(["-m", *SEARCH, storage, "hydra.sweeper.n_trials=5"])
    check_ok(proc)
    assert "Launching" not in proc.stdout and len(_study(tmp_path, "mnist_optuna").trials) == 5

    # optuna-dashboard (the `sweep` extra) opens the study: its web app's JSON API, in-process.
    dashboard = pytest.importorskip("optuna_dashboard")
    app = dashboard.wsgi(f"sqlite:///{tmp_path / 'optuna.db'}")

    def get(path: str) -> dict:
        environ: dict = {"PATH_INFO": path}
        setup_testing_defaults(environ)
        status = []
        body = b"".join(app(environ, lambda s, headers, exc_info=None: status.append(s)))
        assert status == ["200 OK"], body[:500]
        return json.loads(body)

    (listed,) = get("/api/studies")["study_summaries"]
    assert listed["study_name"] == "mnist_optuna"
    shown = get(f"/api/studies/{listed['study_id']}")["trials"]
    assert [t["state"] for t in shown] == ["Complete"] * 5


def test_every_search_space_form(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *TINY,
            "trainer.max_steps=1",
            "hydra/sweeper=optuna",  # the sweeper's own defaults: TPE, 20 trials, ...
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.storage=sqlite:///optuna.db",
            "hydra.sweeper.study_name=forms",
            # params in the config (an experiment's YAML would hold them the same way) ...
            "hydra.sweeper.params={optimizer.eps:'tag(log, interval(1e-9, 1e-6))',"
            "loader.num_workers:0}",
            # ... and sweeps on the command line
            "optimizer.lr=interval(1e-4,1e-2)",
            "optimizer.weight_decay=tag(log,interval(1e-6,1e-3))",
            "trainer.seed=int(interval(1,100))",
            "trainer.max_epochs=range(1,4)",
            "loader.batch_size=choice(16,32)",
            "optimizer=adam,adamw",  # a config group option per trial
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    check_ok(proc)
    D = optuna.distributions
    expected = {
        "optimizer.eps": D.FloatDistribution(1e-9, 1e-6, log=True),
        "optimizer.lr": D.FloatDistribution(1e-4, 1e-2),
        "optimizer.weight_decay": D.FloatDistribution(1e-6, 1e-3, log=True),
        "trainer.seed": D.IntDistribution(1, 100),
        "trainer.max_epochs": D.IntDistribution(1, 3),
        "loader.batch_size": D.CategoricalDistribution([16, 32]),
        "optimizer": D.CategoricalDistribution(["adam", "adamw"]),
    }
    for trial in _study(tmp_path, "forms").trials:
        assert trial.state == optuna.trial.TrialState.COMPLETE
        assert trial.distributions == expected
        # Each sampled value reached the run's config; the plain value too.
        config = OmegaConf.load(sweep_dir / str(trial.number) / "config.yaml")
        for key, value in trial.params.items():
            node = config.optimizer.name if key == "optimizer" else OmegaConf.select(config, key)
            assert node == pytest.approx(value) if isinstance(value, float) else node == value
        assert config.loader.num_workers == 0


def test_several_objectives(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SEARCH,
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.storage=sqlite:///optuna.db",
            "hydra.sweeper.objectives=[best_val_acc,wall_s]",
            "hydra.sweeper.direction=null",  # each objective's own: maximize, minimize
            "hydra.sweeper.sampler._target_=optuna.samplers.NSGAIISampler",
            "~hydra.sweeper.sampler.n_startup_trials",  # mnist_optuna's, for TPE
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    check_ok(proc)
    study = _study(tmp_path, "mnist_optuna")
    assert study.directions == [
        optuna.study.StudyDirection.MAXIMIZE,
        optuna.study.StudyDirection.MINIMIZE,
    ]
    for trial in study.trials:
        summary = json.loads((sweep_dir / str(trial.number) / "summary.json").read_text())
        assert trial.values == [summary["best_val_acc"], summary["wall_s"]]
    results = OmegaConf.load(sweep_dir / "optimization_results.yaml")
    assert {s.trial for s in results.solutions} == {t.number for t in study.best_trials}


def test_time_to_target_as_the_objective(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SEARCH,
            "hydra.sweeper.n_trials=1",
            "hydra.sweeper.storage=sqlite:///optuna.db",
            "hydra.sweeper.direction=null",  # time_to_target_s: minimize
            "objective=time_to_target_s",
            "trainer.target='val/acc>=0'",  # reached at the first validation
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    check_ok(proc)
    study = _study(tmp_path, "mnist_optuna")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert study.best_trial.value == summary["time_to_target_s"] > 0


def test_a_pruned_trial_stops_early_and_says_so(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SEARCH,
            "trainer.max_steps=-1",
            "trainer.max_epochs=3",
            "hydra.sweeper.n_trials=1",
            "hydra.sweeper.storage=sqlite:///optuna.db",
            # val/acc can never reach 2: the pruner stops the trial at its first report
            "hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,lower:2.0}",
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    check_ok(proc)  # a pruned trial is an outcome, not a failure
    (trial,) = _study(tmp_path, "mnist_optuna").trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    job_dir = sweep_dir / "0"
    summary = json.loads((job_dir / "summary.json").read_text())
    assert trial.intermediate_values == {1: summary["best_val_acc"]}  # val/acc after epoch 1
    assert summary["epochs"] == 1 and summary["trial_pruned_at_epoch"] == 1
    assert summary["finished_early"].startswith("pruned by Optuna's pruner")
    assert json.loads((job_dir / "status.json").read_text())["status"] == "pruned"
    assert [r["status"] for r in _rows(sweep_dir)] == ["pruned"]


def test_a_failed_trial_is_recorded_with_its_reason(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *TINY,
            "trainer.max_steps=2",
            "hydra/sweeper=optuna",  # study_name: the run's name, `train`
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.storage=sqlite:///optuna.db",
            "hydra.sweeper.sampler._target_=optuna.samplers.GridSampler",
            "loader.batch_size=0,32",  # 0 is refused
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # as any sweep with a failed job
    assert "1 of 2 sweep jobs failed" in proc.stderr
    by_batch = {t.params["loader.batch_size"]: t for t in _study(tmp_path, "train").trials}
    bad, good = by_batch[0], by_batch[32]
    assert bad.state == optuna.trial.TrialState.FAIL
    assert "loader.batch_size=0 must be >= 1" in bad.user_attrs["fail_reason"]
    assert good.state == optuna.trial.TrialState.COMPLETE
    rows = {r["job"]: r for r in _rows(sweep_dir)}
    assert rows[bad.number]["status"] == "failed"
    assert rows[bad.number]["error"] == bad.user_attrs["fail_reason"]


def test_a_search_whose_every_trial_fails_ends_in_one_paragraph(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            "model=mlp",
            "trainer.progress=none",
            "logger=none",
            "hparams_search=mnist_optuna",
            "dataset=mnist",
            f"paths.data_dir={tmp_path / 'no-such-dir'}",  # (and no network in the tests)
            "hydra.sweeper.n_trials=2",
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    # As any sweep whose jobs failed (exit 1), each trial's reason in the paragraph.
    line = _one_paragraph(proc, "2 of 2 sweep jobs failed", "jobs 0, 1: dataset=mnist", code=1)
    assert "Then the sweep stopped: every one of its 2 trials failed" in line
    assert str(sweep_dir / "sweep_summary.csv") in line
    rows = _rows(sweep_dir)  # the summary is written, each trial's reason in it
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("dataset=mnist" in r["error"] for r in rows)
    assert line in proc.stderr.rstrip().splitlines()[-2:]  # the paragraph comes last


def test_max_failure_rate_stops_the_search(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SEARCH,
            "loader.batch_size=0",  # every trial fails
            "hydra.sweeper.n_trials=3",
            "hydra.sweeper.max_failure_rate=0.5",
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    _one_paragraph(
        proc,
        "1 of 1 sweep jobs failed (job 0: loader.batch_size=0 must be >= 1",
        "Optuna stopped the search after 1 trials",
        "max_failure_rate=0.5",
        code=1,
    )
    assert [r["status"] for r in _rows(sweep_dir)] == ["failed"]


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["hydra.sweeper.sampler._target_=optuna.samplers.TPESamplr"],
            ["hydra.sweeper.sampler._target_=optuna.samplers.TPESamplr", "TPESampler"],
        ),
        (
            ["hydra.sweeper.sampler._target_=optuna.pruners.MedianPruner"],
            ["is not an Optuna BaseSampler"],
        ),
        (["optimizer.lr=tag(log,interval(0,1))"], ["optimizer.lr=tag(log,interval(0,1))"]),
        (["optimizer.lr=glob(*)"], ["optimizer.lr=glob(*)", "cannot search"]),
        (
            ["hydra.sweeper.params={optimizer.lr:'interval(1e-3'}"],
            ["hydra.sweeper.params.optimizer.lr='interval(1e-3'", "interval(low, high)"],
        ),
        (
            ["hydra.sweeper.direction=[maximize,minimize]"],
            ["hydra.sweeper.direction", "best_val_acc"],
        ),
        (["hydra.sweeper.search_space={x:1}"], ["rename it to hydra.sweeper.params"]),
        # n_trials=0 ran nothing and exited 0 without a word.
        (["hydra.sweeper.n_trials=0"], ["hydra.sweeper.n_trials=0", ">= 1"]),
        (
            [
                "hydra.sweeper.objectives=[best_val_acc,wall_s]",
                "hydra.sweeper.direction=null",
                "hydra.sweeper.pruner={_target_:optuna.pruners.MedianPruner}",
            ],
            ["only single-objective"],
        ),  # fmt: skip
    ],
)
def test_a_wrong_sweeper_config_is_one_paragraph(run_cli, tmp_path, args, needles):
    proc = run_cli(["-m", *SEARCH, "hydra.sweeper.n_trials=1", *args])
    _one_paragraph(proc, *needles)
    assert not list(tmp_path.rglob("summary.json"))  # refused before any trial ran


def test_a_search_file_written_for_hydra_optuna_sweeper_runs_unchanged(run_cli, tmp_path):
    # A user's own hparams_search file, as hydra-optuna-sweeper's docs had it.
    (tmp_path / "my_configs" / "hparams_search").mkdir(parents=True)
    (tmp_path / "my_configs" / "hparams_search" / "mine.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n"
        "  - override /hydra/sweeper: optuna\n"
        "hydra:\n"
        "  sweeper:\n"
        "    _target_: hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper\n"
        "    direction: maximize\n"
        "    n_trials: 1\n"
        "    sampler:\n"
        "      _target_: optuna.samplers.RandomSampler\n"
        "      seed: 3\n"
        "    params:\n"
        "      optimizer.lr: interval(1e-4, 1e-2)\n"
    )
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *TINY,
            "trainer.max_steps=1",
            "hydra.searchpath=[file://my_configs]",
            "hparams_search=mine",
            f"hydra.sweep.dir={sweep_dir}",
        ]
    )
    check_ok(proc)
    (row,) = _rows(sweep_dir)
    assert row["status"] == "done"
    assert any(o.startswith("optimizer.lr=") for o in row["overrides"])  # the searched one


def test_a_ddp_trial_reports_to_the_study_from_its_workers(run_cli, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SEARCH,
            "trainer.max_steps=-1",
            "trainer.max_epochs=1",
            "strategy=ddp",
            "launcher.nproc_per_node=2",
            "hydra.sweeper.n_trials=1",
            "hydra.sweeper.storage=sqlite:///optuna.db",
            # the first trial is never pruned by the median; it still reports each epoch
            "hydra.sweeper.pruner={_target_:optuna.pruners.MedianPruner}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=300,
    )
    check_ok(proc)
    (trial,) = _study(tmp_path, "mnist_optuna").trials
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert trial.value == summary["best_val_acc"]
    # Rank 0, a torchrun worker, reported through the database.
    assert trial.intermediate_values == {1: summary["final_val_acc"]}


def test_trials_as_submitit_jobs_are_pruned_through_the_database(run_cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep_dir = tmp_path / "sweep"
    proc = run_cli(
        [
            "-m",
            *SEARCH,
            "trainer.max_steps=-1",
            "trainer.max_epochs=2",
            "hydra/launcher=submitit_local",  # each trial in its own process, as on SLURM
            "hydra.sweeper.n_trials=2",
            "hydra.sweeper.n_jobs=2",  # one batch of two jobs in parallel
            "hydra.sweeper.storage=sqlite:///optuna.db",
            "hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,lower:2.0}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=300,
    )
    check_ok(proc)
    trials = _study(tmp_path, "mnist_optuna").trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] * 2
    assert all(list(t.intermediate_values) == [1] for t in trials)
    assert [r["status"] for r in _rows(sweep_dir)] == ["pruned", "pruned"]
    assert (sweep_dir / ".submitit").is_dir()

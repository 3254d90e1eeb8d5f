"""The search: open (or resume) the study, then ask a batch of `n_jobs` trials, launch them
through the configured Hydra launcher, read each job's outcome from its dir and tell Optuna,
until the study holds `n_trials` finished trials.

A trial's outcome is what commands/sweep.py's run_job wrote in the job dir (status.json and the
run's summary.json), not only the value it returned: a failed job returns None, and a failure
must reach the study as a failed trial with its reason, a pruned run as a pruned trial. The
objectives are read from summary.json, so a trial can return several (multi-objective) and any
summary metric can be one, `time_to_target_s` (trainer.target) included.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.utils import get_method
from omegaconf import DictConfig, OmegaConf
from optuna.trial import Trial, TrialState

from accel_train.commands.sweep_summary import (
    STATUS_FILE,
    SUMMARY_FILE,
    Columns,
    one_line,
    read_json,
)
from accel_train.config.facts import OBJECTIVES
from accel_train.errors import UserError
from accel_train.targets import build, locate
from hydra_plugins.accel_train_optuna._registry import LINK_DIR, LIVE
from hydra_plugins.accel_train_optuna._search_space import (
    SearchSpace,
    as_override,
    parse_search_space,
)

log = logging.getLogger("accel_train")

SAMPLERS = (
    "TPESampler, RandomSampler, GridSampler, CmaEsSampler, NSGAIISampler, QMCSampler, GPSampler"
)
PRUNERS = (
    "MedianPruner, PercentilePruner, SuccessiveHalvingPruner, HyperbandPruner, ThresholdPruner"
)
# The callback each trial's loop runs when a pruner is set (a fixed override of every trial).
PRUNING_CALLBACK = (
    "+callbacks.optuna_pruning._target_=hydra_plugins.accel_train_optuna._pruning.ReportToTrial"
)
# Which way a validation metric is better, to catch a pruner fed the wrong way round.
METRIC_DIRECTIONS = {"val/acc": "maximize", "val/loss": "minimize"}
RESULTS_FILE = "optimization_results.yaml"


@dataclass
class _Search:
    """One search's settings, read and checked once, and its open study."""

    sweeper: Any
    settings: dict[str, Any]
    n_trials: int
    n_jobs: int
    objectives: list[str]
    space: SearchSpace
    grid_size: int | None
    monitor: Columns
    pruner: Any
    metric: str | None
    custom: Any
    study_name: str
    storage: Any
    study: Any
    sweep_dir: Path
    fixed: list[str]  # every trial's overrides (the pruning callback)


def run_search(sweeper: Any, arguments: list[str]) -> list[JobReturn]:
    search = _prepare(sweeper, arguments)
    todo = _trials_to_run(search)
    outcomes: list[tuple[int, TrialState, str | None]] = []  # this invocation's trials
    returns: list[JobReturn] = []
    LIVE[search.study_name] = search.study
    try:
        while todo > 0:
            ask = search.study.ask
            batch = [ask(search.space.distributions) for _ in range(min(search.n_jobs, todo))]
            todo -= len(batch)
            returns.extend(_run_batch(search, batch, outcomes))
            _stop_if_failing(search, outcomes, todo)
    finally:
        LIVE.pop(search.study_name, None)
    _write_results(
        search.study, search.sweep_dir, search.storage, search.objectives, search.monitor
    )
    if outcomes and all(state == TrialState.FAIL for _, state, _ in outcomes):
        # The CLI writes the summary and lists each trial's reason in one paragraph, then this.
        raise UserError(
            f"every one of its {len(outcomes)} trials failed, so the search found nothing; "
            "failed trials do not count towards hydra.sweeper.n_trials, so the same command "
            "again retries them"
        )
    return returns


def _prepare(sweeper: Any, arguments: list[str]) -> _Search:
    """The settings checked in order (the first wrong one is reported), then the study opened
    (or resumed) and the sweep dir made."""
    cfg: DictConfig = sweeper.config
    s = {k: _plain(v) for k, v in sweeper.settings.items()}
    if s.get("search_space") is not None:
        raise UserError(
            "hydra.sweeper.search_space is hydra-optuna-sweeper's old name for the search "
            "space: rename it to hydra.sweeper.params (same syntax, e.g. `optimizer.lr: "
            "tag(log, interval(1e-4, 1e-2))`)."
        )
    # n_trials=0 would run nothing and exit 0 without a word: at least one trial.
    n_trials, n_jobs = _count(s, "n_trials", 1), _count(s, "n_jobs", 1)
    objectives = _objectives(s.get("objectives"), cfg)
    directions = _directions(s.get("direction"), objectives)
    space = parse_search_space(s.get("params"), arguments)
    sampler, grid_size = _sampler(s.get("sampler"), space)
    monitor = Columns.of(cfg)  # the task's monitored metric: the pruner's default
    pruner, metric = _pruner(
        s.get("pruner"), s.get("pruning_metric"), objectives, directions, monitor
    )
    study_name = str(s.get("study_name") or cfg.name)
    storage = s.get("storage")
    custom = _custom_search_space(s.get("custom_search_space"))
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own lines say what happens
    study = _open_study(storage, study_name, sampler, pruner, directions)
    earlier = len(study.get_trials(deepcopy=False))
    seed = (s.get("sampler") or {}).get("seed")
    if earlier and isinstance(seed, int):
        # A resumed study: the seeded sampler would draw its first (random) trials' values
        # again; seeded by the trials so far, it continues the sequence, reproducibly.
        study.sampler, _ = _sampler({**s["sampler"], "seed": seed + earlier}, space)
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fixed = [*space.fixed, *([PRUNING_CALLBACK] if pruner is not None else [])]
    return _Search(
        sweeper=sweeper, settings=s, n_trials=n_trials, n_jobs=n_jobs, objectives=objectives,
        space=space, grid_size=grid_size, monitor=monitor, pruner=pruner, metric=metric,
        custom=custom, study_name=study_name, storage=storage, study=study,
        sweep_dir=sweep_dir, fixed=fixed,
    )  # fmt: skip


def _trials_to_run(search: _Search) -> int:
    """How many trials this invocation asks for (a resumed study holds some already); logged."""
    kept = _finished(search.study)
    todo = search.n_trials - kept
    if search.grid_size is not None:
        todo = min(todo, search.grid_size - kept)  # the grid has no more distinct trials
    name, storage = search.study_name, search.storage
    where = f"in {storage}" if storage else "in memory"
    if kept:
        log.info(
            "study %r %s holds %d finished trials: %d more to reach n_trials=%d",
            name, where, kept, max(todo, 0), search.n_trials,
        )  # fmt: skip
    else:
        log.info("study %r %s: %d trials, %d per batch", name, where, todo, search.n_jobs)
    return todo


def _run_batch(
    search: _Search, batch: list[Trial], outcomes: list[tuple[int, TrialState, str | None]]
) -> list[JobReturn]:
    """Launches a batch of trials and tells the study each one's outcome (kept in `outcomes`)."""
    s, study, cfg = search.settings, search.study, search.sweeper.config
    told: set[int] = set()
    try:
        overrides = [_overrides(t, search.space, search.fixed, search.custom, cfg) for t in batch]
        for number, trial in zip(_job_numbers(batch), batch):
            _write_link(
                search.sweep_dir, number, trial, search.study_name, search.storage, s,
                search.metric,
            )  # fmt: skip
        rets = _launch(search.sweeper, batch, overrides)
        for trial, ret in zip(batch, rets):
            outcomes.append(_tell(study, trial, ret, search.objectives))
            told.add(trial.number)
        return rets
    finally:  # an error or Ctrl-C: the batch's other trials do not stay "running"
        for trial in batch:
            if trial.number not in told:
                _fail_if_running(study, trial, "the sweep stopped before it ended")


def _stop_if_failing(
    search: _Search, outcomes: list[tuple[int, TrialState, str | None]], todo: int
) -> None:
    """hydra.sweeper.max_failure_rate: the search stops once more of its trials failed."""
    failed = sum(state == TrialState.FAIL for _, state, _ in outcomes)
    rate = float(search.settings.get("max_failure_rate", 1.0))
    if failed / len(outcomes) > rate and todo > 0:
        _write_results(
            search.study, search.sweep_dir, search.storage, search.objectives, search.monitor
        )
        # The CLI writes the sweep summary and reports the failed trials' reasons in
        # one paragraph, then this (accel_train.cli._sweep_failure).
        raise UserError(
            f"Optuna stopped the search after {len(outcomes)} trials, {failed} of them "
            f"failed: more than hydra.sweeper.max_failure_rate={rate}. Failed trials do "
            "not count towards hydra.sweeper.n_trials: the same command again retries"
        )


# ---- the settings ----------------------------------------------------------------------


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def _count(s: dict[str, Any], key: str, minimum: int) -> int:
    value = s.get(key)
    if not isinstance(value, int) or value < minimum:
        raise UserError(
            f"hydra.sweeper.{key}={value!r} must be an integer >= {minimum}, e.g. "
            f"`hydra.sweeper.{key}={max(minimum, 4)}`."
        )
    return value


def _objectives(names: Any, cfg: DictConfig) -> list[str]:
    if names is None:
        return [str(cfg.objective)]
    names = [names] if isinstance(names, str) else list(names)
    if not names or any(n not in OBJECTIVES for n in names):
        raise UserError(
            f"hydra.sweeper.objectives={names!r}: each must be a summary.json metric, one of "
            f"{', '.join(OBJECTIVES)} (time_to_target_s with trainer.target), e.g. "
            "`hydra.sweeper.objectives=[best_val_acc,wall_s]`."
        )
    return names


def _directions(direction: Any, objectives: list[str]) -> list[str]:
    default = [OBJECTIVES[n] for n in objectives]
    if direction is None:
        return default
    given = [direction] if isinstance(direction, str) else list(direction)
    if len(given) != len(objectives) or any(d not in ("minimize", "maximize") for d in given):
        raise UserError(
            f"hydra.sweeper.direction={direction!r} does not fit the objectives "
            f"{objectives}: give minimize or maximize for each (e.g. "
            f"`hydra.sweeper.direction=[{','.join(default)}]`), or null for each objective's "
            "own direction."
        )
    return given


def _built(node: Any, key: str, base: type, package: str, known: str, **extra: Any) -> Any:
    """The sampler or pruner a config node names by `_target_`, or a UserError naming the key."""
    if not isinstance(node, dict) or "_target_" not in node:
        raise UserError(
            f"{key}={node!r} needs a `_target_`: one of Optuna's, {package}.X with X one of "
            f"{known} (e.g. `{key}._target_={package}.{known.split(',')[0]}`)."
        )
    target = str(node["_target_"])
    try:
        cls = locate(target, f"{key}._target_")
    except UserError as err:
        raise UserError(f"{err} Optuna's are {package}.X with X one of {known}.") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserError(
            f"{key}._target_={target} is not an Optuna {base.__name__}: give {package}.X with X "
            f"one of {known}."
        )
    arguments = {**{k: v for k, v in extra.items() if k not in node}, **node}
    return cls, build(OmegaConf.create(arguments), key, exclude=())


def _sampler(node: Any, space: SearchSpace) -> tuple[Any, int | None]:
    if node is None:
        node = {"_target_": "optuna.samplers.TPESampler"}
    grid = None
    if isinstance(node, dict) and str(node.get("_target_", "")).endswith("GridSampler"):
        # GridSampler's own argument, or the grid of `params` (each one's list of values)
        grid = node.get("search_space") or space.grid()
    key, base = "hydra.sweeper.sampler", optuna.samplers.BaseSampler
    extra = {"search_space": grid} if grid is not None else {}
    cls, sampler = _built(node, key, base, "optuna.samplers", SAMPLERS, **extra)
    if grid is None or not issubclass(cls, optuna.samplers.GridSampler):
        return sampler, None
    return sampler, math.prod(len(values) for values in grid.values())


def _pruner(
    node: Any, metric: Any, objectives: list[str], directions: list[str], monitor: Columns
) -> tuple[Any, str | None]:
    if node is None:
        return None, None
    key, base = "hydra.sweeper.pruner", optuna.pruners.BasePruner
    _, pruner = _built(node, key, base, "optuna.pruners", PRUNERS)
    if len(objectives) > 1:
        raise UserError(
            f"hydra.sweeper.pruner: Optuna prunes only single-objective studies, and this one "
            f"has {len(objectives)} objectives ({', '.join(objectives)}). Set "
            "`hydra.sweeper.pruner=null`, or search one objective."
        )
    metric = str(metric or _objective_metric(objectives[0]) or monitor.monitor)
    known = {**METRIC_DIRECTIONS, monitor.monitor: f"{monitor.mode}imize"}
    better = known.get(metric)
    if better is not None and better != directions[0]:
        raise UserError(
            f"hydra.sweeper.pruner compares the {metric} that trials report after each epoch "
            f"in the study's direction ({directions[0]} {objectives[0]}), but {metric} is "
            f"better when it is {better}d: the pruner would stop the best trials. Set "
            f"hydra.sweeper.pruning_metric to a metric that is better {directions[0]}d "
            f"({', '.join(m for m, d in METRIC_DIRECTIONS.items() if d == directions[0])}), "
            "or drop the pruner."
        )
    return pruner, metric


def _objective_metric(objective: str) -> str | None:
    """The validation metric an objective is read from (best_val_loss -> val/loss), if any."""
    for prefix in ("best_val_", "final_val_"):
        if objective.startswith(prefix):
            return "val/" + objective.removeprefix(prefix)
    return None


def _custom_search_space(name: Any) -> Any:
    if name is None:
        return None
    try:
        return get_method(str(name))
    except Exception as err:  # noqa: BLE001 - Hydra wraps every failure the same way
        raise UserError(
            f"hydra.sweeper.custom_search_space={name!r}: {one_line(str(err))}. Give the dotted "
            "path of a function `fn(cfg, trial)` that calls trial.suggest_*()."
        ) from None


def _open_study(storage: Any, name: str, sampler: Any, pruner: Any, directions: list[str]):
    try:
        return optuna.create_study(
            storage=storage,
            sampler=sampler,
            pruner=pruner,
            study_name=name,
            directions=directions,
            load_if_exists=True,
        )
    except ValueError as err:
        if "direction" not in str(err):
            raise
        raise UserError(
            f"study {name!r} in {storage} was created with other directions or objectives "
            f"({one_line(str(err))}); this search has {directions}. Give a new "
            "hydra.sweeper.study_name, or search the same objectives."
        ) from None
    except Exception as err:  # noqa: BLE001 - SQLAlchemy's and the drivers' many errors
        raise UserError(
            f"hydra.sweeper.storage={storage!r}: Optuna could not open the study there "
            f"({type(err).__name__}: {one_line(str(err))[:300]}). Give a database URL such as "
            "`sqlite:///optuna.db` (a file in the working directory; its directory must "
            "exist) or `null` for a study in memory."
        ) from None


# ---- one batch ------------------------------------------------------------------------


def _finished(study: Any) -> int:
    states = (TrialState.COMPLETE, TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=states))


def _job_numbers(batch: Sequence[Trial]) -> list[int]:
    """The trials' Hydra job numbers: their trial numbers (so job dir N is trial N), which the
    launcher numbers consecutively from the first. Another process asking trials of the same
    study in between breaks the run: then the launcher numbers them from the first anyway."""
    first = batch[0].number
    return list(range(first, first + len(batch)))


def _overrides(
    trial: Trial, space: SearchSpace, fixed: list[str], custom: Any, cfg: DictConfig
) -> list[str]:
    if custom is not None:
        custom(cfg, trial)  # suggests more parameters on the trial
    values = dict(trial.params)
    searched = [f"{space.keys.get(k, k)}={as_override(v)}" for k, v in values.items()]
    return [*fixed, *searched]


def _write_link(
    sweep_dir: Path,
    job: int,
    trial: Trial,
    study_name: str,
    storage: Any,
    s: dict[str, Any],
    metric: str | None,
) -> None:
    """What the trial's pruning callback needs to find its trial (_pruning.py)."""
    if metric is None:
        return
    link = {
        "study_name": study_name,
        "storage": storage,
        "trial_id": trial._trial_id,  # Trial(study, trial_id) is Optuna's way to reopen it
        "number": trial.number,
        "metric": metric,
        "pruner": s.get("pruner"),
    }
    path = sweep_dir / LINK_DIR / f"{job}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(link, indent=2) + "\n")


def _launch(sweeper: Any, batch: list[Trial], overrides: list[list[str]]) -> list[JobReturn]:
    try:
        rets = list(sweeper.launcher.launch(overrides, initial_job_idx=batch[0].number))
    except HydraException as err:  # e.g. a choice naming a config group option that is not there
        raise UserError(
            f"the trials' overrides do not compose ({one_line(str(err))}). Check "
            f"hydra.sweeper.params against `accel-train --help`; trial {batch[0].number} had: "
            f"{' '.join(overrides[0])}."
        ) from None
    if len(rets) != len(batch):
        raise UserError(f"the launcher returned {len(rets)} results for {len(batch)} trials.")
    return rets


def _tell(
    study: Any, trial: Trial, ret: JobReturn, objectives: list[str]
) -> tuple[int, TrialState, str | None]:
    job_dir = _job_dir(ret)
    if job_dir is not None:
        trial.set_user_attr("job_dir", str(job_dir))
    state, values, reason = _outcome(ret, job_dir, objectives)
    if reason is not None:
        trial.set_user_attr("fail_reason", reason)
    if state == TrialState.COMPLETE:
        _told(study, trial, values=values)
        shown = ", ".join(f"{n}={v:.4g}" for n, v in zip(objectives, values))
        log.info("trial %d complete: %s (%s)", trial.number, shown, _params(trial))
    else:
        _told(study, trial, state=state)
        what = "pruned" if state == TrialState.PRUNED else f"failed: {reason}"
        log.info("trial %d %s (%s)", trial.number, what, _params(trial))
    return trial.number, state, reason


def _told(study: Any, trial: Trial, **outcome: Any) -> None:
    try:
        study.tell(trial, **outcome)
    except RuntimeError as err:
        # GridSampler calls study.stop() once its grid is done, which only optimize() allows;
        # the trial is stored anyway (Optuna stores it in a `finally`), and the number of
        # trials asked for already ends at the grid's size.
        if "Study.stop" not in str(err):
            raise


def _fail_if_running(study: Any, trial: Trial, reason: str) -> None:
    try:
        trial.set_user_attr("fail_reason", reason)
        _told(study, trial, state=TrialState.FAIL)
    except (optuna.exceptions.UpdateFinishedTrialError, ValueError):
        pass  # it was told after all


def _params(trial: Trial) -> str:
    return " ".join(f"{k}={as_override(v)}" for k, v in trial.params.items())


def _job_dir(ret: JobReturn) -> Path | None:
    output_dir = (
        OmegaConf.select(ret.hydra_cfg, "hydra.runtime.output_dir") if ret.hydra_cfg else None
    )
    return Path(str(output_dir)) if output_dir else None


def _outcome(
    ret: JobReturn, job_dir: Path | None, objectives: list[str]
) -> tuple[TrialState, list[float] | None, str | None]:
    if ret.status != JobStatus.COMPLETED:
        err = ret._return_value  # (return_value re-raises it)
        return TrialState.FAIL, None, one_line(f"{type(err).__name__}: {err}")
    status = read_json(job_dir / STATUS_FILE) if job_dir else None
    state = (status or {}).get("status")
    if state == "pruned":
        return TrialState.PRUNED, None, None
    if state in ("failed", "stopped"):
        return TrialState.FAIL, None, str(status.get("error") or state)
    if state == "submitted":
        return (
            TrialState.FAIL,
            None,
            (
                "launcher=slurm submitted the run and returned before it trained: Optuna needs "
                "each trial's result, so run trials on SLURM with hydra/launcher=submitit_slurm"
            ),
        )
    summary = (read_json(job_dir / SUMMARY_FILE) if job_dir else None) or {}
    values = []
    for name in objectives:
        value = summary.get(name)
        if value is None and len(objectives) == 1 and name not in summary:
            value = ret._return_value  # no summary.json to read: the job's own value
        if not isinstance(value, (int, float)) or math.isnan(value):
            hint = " (trainer.target was not reached, or is not set)" * (name == "time_to_target_s")
            return TrialState.FAIL, None, f"the run's summary.json has no value for {name}{hint}"
        values.append(float(value))
    return TrialState.COMPLETE, values, None


# ---- the end ----------------------------------------------------------------------------


def _write_results(
    study: Any, sweep_dir: Path, storage: Any, objectives: list[str], monitor: Columns
) -> None:
    """optimization_results.yaml (hydra-optuna-sweeper's file) with the study's best trial(s),
    earlier runs' included, naming the objective(s) and the task's monitored metric."""
    try:
        best = study.best_trials
    except ValueError:
        best = []
    if not best:
        return
    directions = [d.name.lower() for d in study.directions]
    results: dict[str, Any] = {
        "name": study.study_name,
        "storage": storage,
        "objectives": objectives,
        "directions": directions,
        "monitor": monitor.monitor,
        "monitor_mode": monitor.mode,
    }
    if len(study.directions) == 1:
        trial = best[0]
        results.update(best_trial=trial.number, best_params=trial.params, best_value=trial.value)
        log.info("Best parameters: %s", trial.params)
        log.info(
            "Best value: %s=%s (%s; trial %d)",
            objectives[0],
            trial.value,
            directions[0],
            trial.number,
        )
    else:
        results["solutions"] = [
            {"trial": t.number, "params": t.params, "values": t.values} for t in best
        ]
        log.info("Pareto front: %d trials (%s)", len(best), RESULTS_FILE)
    OmegaConf.save(OmegaConf.create(results), sweep_dir / RESULTS_FILE)

"""`logger=mlflow`: the run as an MLflow run, through MLflow's own client (MlflowClient).

- store: `logger.mlflow.tracking_uri`, or by default a local SQLite store at
  `<paths.log_dir>/mlruns/mlflow.db` with the artifacts beside it (`mlruns/artifacts`). MLflow 3
  keeps its plain-file store (`./mlruns` directories) in maintenance mode and refuses it unless
  told otherwise; SQLite is what it recommends for a local store, and `mlflow ui
  --backend-store-uri sqlite:///outputs/mlruns/mlflow.db` shows it.
- experiment: `logger.mlflow.experiment_name` (default the run's `name`), so every job of a sweep
  lands in one experiment; run name: the run dir's name (a sweep job: `<sweep dir>/<job>`).
- params: the resolved config, flattened to dotted keys; tags: the run's `tags` (each one a tag
  set to "true", and all of them comma-separated in `tags`), `run_dir`, and at the end
  `best_checkpoint`; metrics: every logged number, by optimizer step; artifacts at the end:
  config.yaml and summary.json.
- a resumed run (resume=auto in the same run dir) continues the MLflow run it started, whose
  id is kept in `<run dir>/.mlflow_run_id`.

mlflow is an optional extra, imported here only when chosen (it costs seconds of start-up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel_train.config.run_config import flatten
from accel_train.errors import UserError

log = logging.getLogger("accel_train")

RUN_ID_FILE = ".mlflow_run_id"
# MLflow refuses longer param values (6000 characters in MLflow 2 and 3) and more than 100
# params in one batch.
_MAX_VALUE, _BATCH = 6000, 100


def run_name(run_dir: Path) -> str:
    """The run dir's name; for a sweep job (dir `<sweep dir>/<number>`) with the sweep's."""
    return f"{run_dir.parent.name}/{run_dir.name}" if run_dir.name.isdigit() else run_dir.name


def best_checkpoint(run_dir: Path) -> Path | None:
    for name in ("best.pt", "best.dcp"):
        if (run_dir / "checkpoints" / name).exists():
            return run_dir / "checkpoints" / name
    return None


def missing_extra(logger: str, module: str) -> UserError:
    return UserError(
        f"logger={logger} needs the {module} package, which is not installed. Install it with "
        f'`pip install "accel-train[{logger}]"` (or `pip install {module}`), or pick other '
        "loggers (e.g. `logger=csv`)."
    )


class MlflowTracker:
    def __init__(self, options: Mapping[str, Any], run_dir: Path, config: Mapping[str, Any]):
        try:
            from mlflow.entities import Metric, Param  # lazy: an optional, heavy extra
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing_extra("mlflow", "mlflow") from None
        self.Metric, self.run_dir, self.failed = Metric, Path(run_dir), False
        uri = options.get("tracking_uri")
        artifacts = None
        if not uri:
            store = Path(config.get("paths", {}).get("log_dir") or self.run_dir.parent) / "mlruns"
            store = store.absolute()
            store.mkdir(parents=True, exist_ok=True)
            uri, artifacts = f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
            logging.getLogger("mlflow").setLevel(logging.WARNING)  # "creating tables" lines
        experiment = options.get("experiment_name") or config.get("name") or "accel-train"
        tags = [str(t) for t in config.get("tags") or ()]
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = self._resumed_run()
            if self.run_id is None:
                run = self.client.create_run(
                    self._experiment_id(experiment, artifacts, MlflowException),
                    run_name=options.get("run_name") or run_name(self.run_dir),
                    tags={
                        "run_dir": str(self.run_dir.absolute()),
                        "tags": ",".join(tags),
                        **{t: "true" for t in tags},
                    },
                )
                self.run_id = run.info.run_id
                params = [
                    Param(k, str(v)[:_MAX_VALUE]) for k, v in sorted(flatten(dict(config)).items())
                ]
                for i in range(0, len(params), _BATCH):
                    self.client.log_batch(self.run_id, params=params[i : i + _BATCH])
                (self.run_dir / RUN_ID_FILE).write_text(self.run_id + "\n")
        except MlflowException as err:
            raise UserError(
                f"logger=mlflow: the MLflow store at {uri} refused the run: "
                f"{' '.join(str(err).split())[:300]}. Check logger.mlflow.tracking_uri (null = a "
                "local store under outputs/mlruns)."
            ) from None

    def _experiment_id(self, name: str, artifacts: str | None, error: type) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except error:  # another job of the sweep created it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _resumed_run(self) -> str | None:
        try:
            run_id = (self.run_dir / RUN_ID_FILE).read_text().strip()
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        except Exception:  # no file, or a run this store does not have: start a new one
            return None

    def log(self, numbers: Mapping[str, float], step: int) -> None:
        if self.failed or not numbers:
            return
        now = int(time.time() * 1000)
        metrics = [self.Metric(k, float(v), now, step) for k, v in numbers.items()]
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except Exception as err:  # a server gone mid-run: metrics.jsonl still has every row
            self._give_up(err)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """The rows appended to the run's table artifact `<name>.json` (MLflow's log_table
        adds to an existing one; the UI's artifact view shows it as a table)."""
        if self.failed:
            return
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        try:
            self.client.log_table(self.run_id, data=data, artifact_file=f"{name}.json")
        except Exception as err:  # (log_table needs pandas): the text is in the run dir anyway
            log.warning(
                "logger=mlflow: the %s table was not logged (%s); the run dir has it",
                name,
                " ".join(str(err).split())[:200],
            )

    def _give_up(self, err: Exception) -> None:
        self.failed = True
        log.warning(
            "logger=mlflow: logging to MLflow failed (%s); the run goes on, metrics.jsonl in the "
            "run dir has every metric",
            " ".join(str(err).split())[:200],
        )

    def close(self) -> None:
        if self.failed:
            return
        summary = self.run_dir / "summary.json"
        try:
            for path in (self.run_dir / "config.yaml", summary):
                if path.is_file():
                    self.client.log_artifact(self.run_id, str(path))
            best = best_checkpoint(self.run_dir)
            if best is not None:
                self.client.set_tag(self.run_id, "best_checkpoint", str(best.absolute()))
            # FINISHED with a summary; KILLED when stopped early (preempted, stopped, failed).
            self.client.set_terminated(self.run_id, "FINISHED" if summary.is_file() else "KILLED")
        except Exception as err:
            self._give_up(err)

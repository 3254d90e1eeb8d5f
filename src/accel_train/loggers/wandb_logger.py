"""`logger=wandb`: the run as a Weights & Biases run, through `wandb` itself.

Offline by default (`logger.wandb.mode=offline`: no account, no network; the run is written to
`<run dir>/wandb/offline-run-*` and can be uploaded later with `wandb sync`); `mode=online`
with `wandb login` or $WANDB_API_KEY. The same content as logger=mlflow: the resolved config
(the run's config), every logged number by optimizer step, `tags`, and at the end summary.json's
values plus `best_checkpoint` in the run summary and config.yaml / summary.json saved as run
files (under `<run dir name>/`, since wandb keeps a config.yaml of its own). Runs of one `name`,
and all the jobs of a sweep, share a group (`logger.wandb.group`). A resumed run (same run dir)
continues the W&B run it started (its id is kept in `<run dir>/.wandb_run_id`).

wandb is an optional extra, imported here only when chosen.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accel_train.errors import UserError
from accel_train.loggers.mlflow_logger import best_checkpoint, missing_extra, run_name

log = logging.getLogger("accel_train")

RUN_ID_FILE = ".wandb_run_id"


class WandbTracker:
    def __init__(self, options: Mapping[str, Any], run_dir: Path, config: Mapping[str, Any]):
        try:
            import wandb  # lazy: an optional, heavy extra
        except ImportError:
            raise missing_extra("wandb", "wandb") from None
        self.run_dir, self.failed = Path(run_dir), False
        id_file = self.run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        mode = options.get("mode") or "offline"
        try:
            self.run = wandb.init(
                project=options.get("project") or "accel-train",
                entity=options.get("entity"),
                group=options.get("group") or config.get("name"),
                name=options.get("run_name") or run_name(self.run_dir),
                mode=mode,
                dir=str(self.run_dir),
                config=dict(config),
                tags=[str(t) for t in config.get("tags") or ()],
                id=run_id,
                resume="allow",
            )
        except Exception as err:  # wandb raises its own types (UsageError, CommError, ...)
            raise UserError(
                f"logger=wandb (mode={mode}) could not start a run: "
                f"{' '.join(str(err).split())[:300]}. Offline runs need no account; online ones "
                "need `wandb login` or $WANDB_API_KEY (or use `logger.wandb.mode=offline`)."
            ) from None
        id_file.write_text(run_id + "\n")

    def log(self, numbers: Mapping[str, float], step: int) -> None:
        if self.failed or not numbers:
            return
        try:
            self.run.log(dict(numbers), step=step)
        except Exception as err:
            self._give_up(err)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A wandb.Table under `name` at `step` (W&B shows each step's table)."""
        if self.failed:
            return
        try:
            import wandb  # (imported by __init__ already)

            self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)
        except Exception as err:
            self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        self.failed = True
        log.warning(
            "logger=wandb: logging to W&B failed (%s); the run goes on, metrics.jsonl in the run "
            "dir has every metric",
            " ".join(str(err).split())[:200],
        )

    def close(self) -> None:
        summary = self.run_dir / "summary.json"
        try:
            if not self.failed:
                if summary.is_file():
                    values = json.loads(summary.read_text())
                    self.run.summary.update({k: v for k, v in values.items() if v is not None})
                best = best_checkpoint(self.run_dir)
                if best is not None:
                    self.run.summary["best_checkpoint"] = str(best.absolute())
                for path in (self.run_dir / "config.yaml", summary):
                    if path.is_file():
                        self.run.save(str(path), base_path=str(self.run_dir.parent), policy="now")
            self.run.finish(exit_code=0 if summary.is_file() else 1)
        except Exception as err:
            self._give_up(err)

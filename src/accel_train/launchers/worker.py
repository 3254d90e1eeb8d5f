"""One training process: `python -m accel_train.worker <run_dir>/config.yaml` under torchrun,
or called in-process by the launcher. After the loop it decides what an early stop means
(the SLURM requeue lives here, on the launch side, not in the loop).

Reads the resolved config the launcher wrote; never composes a config or parses overrides, so
it also runs under a user's own torchrun: `torchrun --nproc_per_node 4 -m accel_train.worker ...`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from accel_train.config.run_config import load_run_config
from accel_train.errors import UserError, report_user_errors
from accel_train.launchers.lock import hold_run_dir
from accel_train.launchers.slurm_job import DEFAULT_MAX_REQUEUES, requeue_or_stop


def run_worker(cfg: DictConfig) -> dict[str, Any]:
    # deferred: the loop's imports (DTensor, the tasks, the techniques: ~1 s) are the workers'
    # to pay, not every command's start-up (a refused config, a submitted job)
    from accel_train.train.loop import run_training

    summary = run_training(cfg)
    if summary.get("status") == "preempted" and os.environ.get("RANK", "0") == "0":
        allowed = cfg.launcher.get("max_requeues", DEFAULT_MAX_REQUEUES)
        requeue_or_stop(allowed, Path(summary["checkpoint"]))
    return summary


@report_user_errors
def main(argv: list[str]) -> None:
    try:
        _main(argv)
    except UserError as err:
        _write_error_file(str(err), user_error=True)
        raise
    except KeyboardInterrupt:
        # SIGINT forwarded by the torchrun agent before the loop installed its handler (while
        # importing or building): nothing trained yet, so no traceback in the worker's log.
        sys.exit(130)
    except Exception as err:
        # Not a paragraph of ours (a library's assertion, a bug): the launcher shows its one
        # line and where the traceback is; the traceback goes to this rank's log as before.
        _write_error_file(f"{type(err).__name__}: {err}", user_error=False)
        raise


def _write_error_file(message: str, user_error: bool) -> None:
    """Hand the message to the torchrun agent (it reads TORCHELASTIC_ERROR_FILE), so the
    launcher's own error says what went wrong, whichever rank failed: a UserError's whole
    paragraph, or another exception's type and message (`user_error` tells them apart)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        row = {"message": message, "timestamp": int(time.time()), "user_error": user_error}
        with open(path, "w") as f:
            json.dump(row, f)


def log_to_run_dir(run_dir: Path) -> None:
    """Global rank 0 under torchrun: its log lines and Python warnings also go to
    <run dir>/train.log, after the launcher's own lines (the launcher's process, not this one,
    holds Hydra's handler on that file; both append). The other ranks' output stays in
    torchrun's per-rank files under <run dir>/logs/ (launchers/torchrun_process.py)."""
    handler = logging.FileHandler(run_dir / "train.log", mode="a")
    handler.setFormatter(logging.Formatter("[%(asctime)s][rank 0][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.captureWarnings(True)  # e.g. torch's UserWarnings: to the file too, once each


def _main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise UserError("usage: python -m accel_train.worker <run_dir>/config.yaml")
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO if rank == "0" else logging.WARNING,
        format=f"[%(asctime)s][rank {rank}][%(levelname)s] - %(message)s",
    )
    run_config_file(argv[0])


def run_config_file(path: str) -> dict[str, Any]:
    """The worker's body on a run dir's config.yaml (torchrun's workers and Ray Train's)."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found: pass the run dir's config.yaml.")
    cfg = load_run_config(path)
    if os.environ.get("RANK", "0") == "0":
        log_to_run_dir(Path(cfg.paths.output_dir))
    hold_run_dir(cfg)  # join the launcher's run dir lock, or take it as global rank 0
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and cfg.resume is None:
        # torchrun restarted the group after a failure: continue, don't start over.
        cfg.resume = "auto"
    return run_worker(cfg)

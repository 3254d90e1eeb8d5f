"""Run `accel-train` and `accel-report` command lines the way their console scripts do, in one
process, up to the point where training would start: `accel-train` composes (aliases, the
schema, `-m` sweeps through their sweeper and launcher), validates, resolves and runs every
check `launch()` and the launcher's own `launch` run (checkpoint monitor, resume, strategy,
SLURM's keys, the Kubernetes manifest), and then starts and submits nothing; `accel-report`
checks every variant's config (its `plan`) and runs nothing.

    python tests/doc_dry_run.py commands.json results.json

commands.json: a list of argv lists (argv[0] the program). results.json: per command its exit
status and the tail of what it printed. tests/test_docs_commands.py runs it; one process for all
commands, as torch and Hydra are imported once.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
import traceback
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra

from accel_train import cli
from accel_train.commands import report
from accel_train.config.facts import OBJECTIVES
from accel_train.errors import UserError
from accel_train.launchers import kubernetes_manifest, launch, ray_train, slurm_job, torchrun


def _no_training(cfg) -> dict:
    """Instead of the workers: a summary.json, so that a sweep job reports an objective."""
    summary = dict.fromkeys(OBJECTIVES, 0.5)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary))
    return summary


# Stubbed: only what starts processes or reaches a cluster. Each launcher's own `launch` runs up
# to there (its strategy check, the config it writes), so a command refused there is refused
# here too (the canaries of tests/test_docs_commands.py).
torchrun.run_worker = _no_training
# (with the rendezvous check: a multi-node line would wait for its node0)
torchrun.run_torchrun = lambda cfg, path, nproc: _no_training(cfg)
slurm_job.submit = lambda cfg, path: None  # sbatch
ray_train.drive = lambda cfg, path, in_job=False: _no_training(cfg)  # no Ray started
ray_train.submit_job = lambda lc, path: "dry-run"
kubernetes_manifest.finish = lambda cfg, manifest: None  # checked against the models already
launch.hold_run_dir = lambda cfg: None  # this one process would hold every run dir's lock


def _report(argv: list[str]) -> None:
    opts, base = report.parse_args(argv)
    base = report.alias_overrides(base).argv
    wanted = [v.strip() for v in opts.variants.split(",") if v.strip()]
    try:
        report.plan(wanted, base, Path("outputs/speed_report/dry"))
    except UserError as err:
        print(f"accel-report: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def run(argv: list[str]) -> dict:
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        GlobalHydra.instance().clear()
        sys.argv = list(argv)
        try:
            if argv[0] == "accel-report":
                _report(argv[1:])
            else:
                cli.train()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - reported with the command
            traceback.print_exc()
            code = 1
    return {"argv": argv, "rc": code, "output": out.getvalue()[-4000:]}


def main() -> None:
    commands_file, results_file = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    results = []
    for argv in json.loads(commands_file.read_text()):
        start = time.perf_counter()
        results.append(run(argv) | {"wall_s": round(time.perf_counter() - start, 2)})
        results_file.write_text(json.dumps(results))


if __name__ == "__main__":
    main()

"""Start-up (issue 22, section 3): a single run composes its config once (Hydra's get_mode keeps
its config for the run: config/hydra_compose.py), while every path that needs Hydra's own
behaviour keeps it: `-m` sweeps, a config that sets `hydra.mode: MULTIRUN`, a sweep override
without `-m` (refused as before), and the run's config is the one Hydra would compose."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# The CLI with training stubbed out: each job records its config; composes are counted.
SCRIPT = """
import json, sys
import hydra._internal.config_loader_impl as loader
import accel_train.cli as cli
import accel_train.commands.sweep as sweep

composes = []
inner = loader.ConfigLoaderImpl.load_configuration
def counted(self, *args, **kwargs):
    composes.append(str(kwargs.get("run_mode")))
    return inner(self, *args, **kwargs)
loader.ConfigLoaderImpl.load_configuration = counted

jobs = []
def record(cfg):
    from hydra.core.hydra_config import HydraConfig
    hc = HydraConfig.get()
    jobs.append({"seed": cfg.trainer.seed, "mode": str(hc.mode),
                 "hydra_overrides": list(hc.overrides.hydra),
                 "task_overrides": list(hc.overrides.task)})
cli._train_single = record
sweep.run_job = record
sys.argv = ["accel-train", *sys.argv[1:]]
try:
    cli.train()
finally:
    print(json.dumps({"composes": composes, "jobs": jobs}))
"""


def _run(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], cwd=cwd, capture_output=True, text=True
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
    return proc, json.loads(last)


def test_a_run_composes_once_with_hydras_config(tmp_path):
    proc, out = _run(["trainer.seed=7", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out["composes"] == ["RunMode.RUN"]  # was: get_mode's MULTIRUN compose, then RUN
    (job,) = out["jobs"]
    assert job["seed"] == 7 and job["mode"] == "RunMode.RUN"
    # As Hydra's _run_app leaves it when the config sets no mode.
    assert job["hydra_overrides"][-1] == "hydra.mode=RUN"
    assert job["task_overrides"] == ["trainer.seed=7"]
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


def test_multirun_and_a_config_that_sets_multirun_still_sweep(tmp_path):
    sweep = ["trainer.seed=1,2", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc, out = _run(["-m", *sweep], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(j["seed"] for j in out["jobs"]) == [1, 2]
    assert all(j["mode"] == "RunMode.MULTIRUN" for j in out["jobs"])
    # hydra.mode=MULTIRUN without -m (what hparams_search=... sets in its YAML).
    proc, out = _run(["hydra.mode=MULTIRUN", *sweep], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(j["seed"] for j in out["jobs"]) == [1, 2]
    proc, out = _run(["hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path / 's2'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [j["mode"] for j in out["jobs"]] == ["RunMode.MULTIRUN"]


def test_a_sweep_without_multirun_and_a_bad_override_are_still_refused(tmp_path):
    proc, out = _run(["trainer.seed=1,2", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode != 0 and not out["jobs"]
    assert "trainer.seed=1,2" in proc.stderr and "Traceback" not in proc.stderr
    proc, out = _run(["trainer.no_such_key=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2 and not out["jobs"]
    assert "trainer.no_such_key is not a key of trainer" in proc.stderr

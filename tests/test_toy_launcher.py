"""A new launcher is one file and one registry line (docs/architecture.md): tests/toy_launcher.py
is registered from outside the package, its option put on Hydra's search path, and the real CLI
trains through it in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import FAST, check_ok

TESTS = Path(__file__).parent

# What a developer's own entry point would do: register the launcher and its option's schema
# (data: the keys of launcher=local), then run accel-train.
RUNNER = """\
import sys
from toy_launcher import ToyLauncher
from accel_train.config.schema import OPTION_SCHEMAS, LauncherConfig
from accel_train.launchers import LAUNCHERS
LAUNCHERS["toy"] = ToyLauncher
OPTION_SCHEMAS["launcher"]["toy"] = LauncherConfig
from accel_train.cli import main
sys.argv = ["accel-train", *sys.argv[1:]]
main()
"""


def test_a_toy_launcher_trains_through_the_cli(tmp_path):
    from toy_launcher import MARKER, OPTION_YAML

    configs = tmp_path / "configs"
    (configs / "launcher").mkdir(parents=True)
    (configs / "launcher" / "toy.yaml").write_text(OPTION_YAML)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env["ACCEL_TRAIN_DATA_DIR"] = str(tmp_path / "no-data-here")
    args = [
        *FAST,
        "dataset=synthetic",
        "launcher=toy",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
        "trainer.test_after_fit=false",
        "trainer.plot_curves=false",
        "logger=none",
        f"hydra.searchpath=[file://{configs}]",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(proc)
    assert (run_dir / MARKER).is_file(), "the toy launcher did not launch the run"
    assert "name: toy" in (run_dir / "config.yaml").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2

"""A new launcher or strategy is one file and one registry line (docs/architecture.md):
tests/toy_launcher.py and tests/toy_strategy.py are registered from outside the package, their
options put on Hydra's search path, and the real CLI trains through both in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import FAST, check_ok

TESTS = Path(__file__).parent

# What a developer's own entry point would do: register the launcher and the strategy and their
# options' schemas (data: the base keys of a launcher and a strategy), then run accel-train.
RUNNER = """\
import sys
from toy_launcher import ToyLauncher
from toy_strategy import ToyStrategy
from accel_train.config.schema import OPTION_SCHEMAS, LauncherConfig, StrategyConfig
from accel_train.launchers import LAUNCHERS
from accel_train.strategies import STRATEGIES
LAUNCHERS["toy"] = ToyLauncher
STRATEGIES["toy"] = ToyStrategy
OPTION_SCHEMAS["launcher"]["toy"] = LauncherConfig
OPTION_SCHEMAS["strategy"]["toy"] = StrategyConfig
from accel_train.cli import main
sys.argv = ["accel-train", *sys.argv[1:]]
main()
"""


def test_a_toy_launcher_and_strategy_train_through_the_cli(tmp_path):
    import toy_launcher
    import toy_strategy

    configs = tmp_path / "configs"
    for group, module in (("launcher", toy_launcher), ("strategy", toy_strategy)):
        (configs / group).mkdir(parents=True)
        (configs / group / "toy.yaml").write_text(module.OPTION_YAML)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env["ACCEL_TRAIN_DATA_DIR"] = str(tmp_path / "no-data-here")
    args = [
        *FAST,
        "dataset=synthetic",
        "launcher=toy",
        "strategy=toy",
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
    assert (run_dir / toy_launcher.MARKER).is_file(), "the toy launcher did not launch the run"
    config = (run_dir / "config.yaml").read_text()
    assert config.count("name: toy") == 2, config  # the launcher and the strategy
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
    # The loop asked the toy strategy before each optimizer step.
    assert (run_dir / toy_strategy.MARKER).read_text().strip() == "2"

"""A new launcher, strategy or task from a package of the user's own, with no edit to accel-train
(docs/architecture.md): a package holding tests/toy_launcher.py, toy_strategy.py and toy_task.py is
installed the way pip installs one (the modules beside a `.dist-info` folder whose
entry_points.txt names them in the `accel_train.plugins` group, found by importlib.metadata on
the path), and the real CLI lists the options in `--help` and trains through them. A plugin
that fails to import is reported as its own error, with its file and line."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import FAST, check_ok

TESTS = Path(__file__).parent


def install_package(site: Path, name: str, modules: dict[str, str]) -> None:
    """`pip install`'s result for a package `name` of `modules` (module name -> source), each
    an `accel_train.plugins` entry point: the package, and its .dist-info beside it."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("")
    for module, source in modules.items():
        (site / name / f"{module}.py").write_text(source)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    points = "".join(f"{m} = {name}.{m}\n" for m in modules)
    (info / "entry_points.txt").write_text(f"[accel_train.plugins]\n{points}")


def _env(site: Path) -> dict[str, str]:
    import os

    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def test_a_plugin_package_adds_a_launcher_a_strategy_and_a_task(tmp_path, run_cli):
    site = tmp_path / "site"
    sources = {m: (TESTS / f"toy_{m}.py").read_text() for m in ("launcher", "strategy", "task")}
    install_package(site, "toyplug", sources)
    help_text = run_cli(["--help"], env=_env(site))
    check_ok(help_text)
    lines = {line.split("=")[0].strip(): line for line in help_text.stdout.splitlines()}
    assert "toy" in lines["launcher"] and "toy" in lines["strategy"], help_text.stdout
    assert "toy_cls" in lines["task"], help_text.stdout
    run_dir = tmp_path / "run"
    args = [
        *FAST,
        "dataset=synthetic",
        "launcher=toy",
        "strategy=toy",
        "strategy.marker=seen.txt",  # the plugin's own key, typed by its dataclass
        "task=toy_cls",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
        "trainer.test_after_fit=false",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    check_ok(run_cli(args, env=_env(site)))
    assert (run_dir / "launched_by_toy.txt").is_file(), "the toy launcher did not launch the run"
    config = (run_dir / "config.yaml").read_text()
    assert config.count("name: toy\n") == 2, config  # the launcher and the strategy
    assert "_target_: toyplug.task.ToyTask" in config and "name: toy_cls" in config
    assert (tmp_path / "built_toy_task.txt").is_file()  # the task class was built
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    # The loop asked the toy strategy before each optimizer step.
    assert (run_dir / "seen.txt").read_text().strip() == "2"


def test_a_plugin_that_fails_to_import_names_its_file_and_line(tmp_path, run_cli):
    site = tmp_path / "site"
    broken = "from accel_train.plugins import register_launcher\n\nx = 1\ny = undefined_name\n"
    install_package(site, "brokenplug", {"launcher": broken})
    proc = run_cli([*FAST, "hydra.run.dir=run"], env=_env(site))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    where = f"{site / 'brokenplug' / 'launcher.py'} line 4"
    assert "NameError" in proc.stderr and where in proc.stderr, proc.stderr
    assert "brokenplug" in proc.stderr and not (tmp_path / "run").exists()

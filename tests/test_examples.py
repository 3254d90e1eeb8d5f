"""The user projects in examples/ run as their README says, from their own folder (issue 17):
the command is read from the README, so the two cannot drift apart."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from helpers import check_ok, read_jsonl

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def readme_command(example: str) -> list[str]:
    """The README's first `accel-train ...` line, split as a shell would."""
    for line in (EXAMPLES / example / "README.md").read_text().splitlines():
        if line.startswith("accel-train "):
            return shlex.split(line)[1:]
    raise AssertionError(f"examples/{example}/README.md has no accel-train command")


# Shorter than the README's runs (CI's 2 cores); the logged metrics say they learn.
QUICK = ["trainer.max_epochs=2", "trainer.progress=none", "logger=none"]


@pytest.mark.parametrize(
    "example, metric", [("regression", "val/mae"), ("custom_step", "val/token_acc")]
)
def test_an_example_runs_as_its_readme_says(example, metric, run_cli, tmp_path):
    run_dir = tmp_path / "run"
    args = [a for a in readme_command(example) if not a.startswith("trainer.max_epochs")]
    proc = run_cli([*args, *QUICK, f"hydra.run.dir={run_dir}"], cwd=EXAMPLES / example)
    check_ok(proc)
    values = [m[metric] for m in read_jsonl(run_dir / "metrics.jsonl") if metric in m]
    assert len(values) == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["monitor"] == "val/loss" and summary["best_score"] is not None
    if example == "regression":
        assert values[-1] < values[0]  # the error shrinks
    else:
        assert values[-1] > values[0]  # the next token is learnt

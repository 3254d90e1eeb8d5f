"""The warm CLI (tests/warm_cli.py) is the CLI: representative commands run both ways, forked
from the warm parent and in a new interpreter, give the same exit codes, the same files in their
run dirs, the same metrics rows (timings aside) and the same error text."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers import FAST, check_ok, read_jsonl, run_cli

# Start-up is what this module compares: the fresh side must really be fresh.
pytestmark = pytest.mark.fresh

# Metrics whose values are clock readings: compared by name, not by value.
TIMED = re.compile(r"time|_s$|per_s|share|flops|mfu|throughput|speed|eta|wall|elapsed|rss|mem")
EXACT = [*FAST, "trainer.deterministic=true", "trainer.log_every_n_steps=1", "logger=none"]


def _tokens_text(cwd: Path) -> Path:
    text = cwd / "input.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    return text


# name -> (program, argv with {run} for the run dir and {cwd} for the working dir).
COMMANDS = {
    "train": ("accel-train", [*EXACT, "trainer.max_epochs=1", "hydra.run.dir={run}"]),
    "resume": (
        "accel-train",
        [
            *EXACT,
            "trainer.max_epochs=2",
            "resume={cwd}/train/checkpoints/last.pt",
            "hydra.run.dir={run}",
        ],
    ),
    "eval": ("accel-eval", ["ckpt_path={cwd}/train/checkpoints/best.pt"]),
    "sweep": (
        "accel-train",
        [
            "-m",
            *FAST,
            "trainer.max_steps=2",
            "optimizer.lr=0.01,0.02",
            "logger=none",
            "hydra.sweep.dir={run}",
        ],
    ),
    # Two torchrun workers: on the warm side they fork from the warm parent too (worker_stub).
    "ddp": (
        "accel-train",
        [
            *EXACT,
            "trainer.max_epochs=1",
            "launcher.nproc_per_node=2",
            "strategy=ddp",
            "hydra.run.dir={run}",
        ],
    ),
    "refuse-value": ("accel-train", ["trainer.max_epochs=-1", "hydra.run.dir={run}"]),
    "refuse-key": ("accel-train", ["trainer.max_epoch=1", "hydra.run.dir={run}"]),
    "refuse-option": ("accel-train", ["strategy=fdsp", "hydra.run.dir={run}"]),
    "refuse-eval": ("accel-eval", ["ckpt_path={cwd}/nothing.pt"]),
    "tokenize": ("accel-data", ["tokenize", "input={cwd}/input.txt", "out={run}"]),
    "help": ("accel-train", ["--help"]),
}


def _run_both(tmp_path: Path) -> dict[str, dict[str, tuple[subprocess.CompletedProcess, Path]]]:
    results: dict[str, dict] = {"warm": {}, "fresh": {}}
    for way in results:
        cwd = tmp_path / way
        cwd.mkdir()
        _tokens_text(cwd)
        for name, (prog, argv) in COMMANDS.items():  # in order: resume and eval need train
            run = cwd / name
            args = [a.format(run=run, cwd=cwd) for a in argv]
            proc = run_cli(args, cwd, prog=prog, warm=way == "warm", timeout=300)
            results[way][name] = (proc, run)
    return results


def _files(run: Path) -> set[str]:
    """The run dir's files, torchrun's per-run log folder (logs/node0/<random id>) named alike."""
    names = {str(p.relative_to(run)) for p in run.rglob("*")} if run.exists() else set()
    return {re.sub(r"^(logs/node\d+/)[^/]+", r"\1<id>", name) for name in names}


def _untimed(rows: list[dict], way_dir: Path) -> list[dict]:
    """The rows without clock readings, the run's own folder written <cwd>."""
    text = json.dumps([{k: v for k, v in r.items() if not TIMED.search(k)} for r in rows])
    return json.loads(text.replace(str(way_dir), "<cwd>"))


def _error_text(proc: subprocess.CompletedProcess, way_dir: Path) -> str:
    return proc.stderr.replace(str(way_dir), "<cwd>")


def test_warm_and_fresh_runs_are_the_same(tmp_path):
    results = _run_both(tmp_path)
    for name in COMMANDS:
        (warm, warm_run), (fresh, fresh_run) = results["warm"][name], results["fresh"][name]
        assert warm.returncode == fresh.returncode, (
            name,
            warm.stderr[-2000:],
            fresh.stderr[-2000:],
        )
        assert _files(warm_run) == _files(fresh_run), name
        for metrics in sorted(fresh_run.rglob("metrics.jsonl")):
            twin = warm_run / metrics.relative_to(fresh_run)
            assert _untimed(read_jsonl(twin), tmp_path / "warm") == _untimed(
                read_jsonl(metrics), tmp_path / "fresh"
            ), (name, metrics)
        if fresh.returncode != 0:
            assert fresh.stderr.strip(), name
            assert _error_text(warm, tmp_path / "warm") == _error_text(fresh, tmp_path / "fresh")
    # What the runs ended with, the same both ways: the trained and the resumed run's summaries
    # (timings aside), the evaluation's scores, the help text.
    for name in ("train", "resume", "ddp"):
        warm_summary, fresh_summary = (
            _untimed(
                [json.loads((results[way][name][1] / "summary.json").read_text())], tmp_path / way
            )
            for way in results
        )
        assert warm_summary == fresh_summary, name
    for name in ("eval", "help"):
        warm, fresh = (results[way][name][0] for way in results)
        check_ok(fresh)
        assert _scores(warm.stdout, tmp_path / "warm") == _scores(fresh.stdout, tmp_path / "fresh")


def _scores(stdout: str, way_dir: Path) -> list[str]:
    """The output's lines without the log lines' time stamps and throughput figures."""
    lines = stdout.replace(str(way_dir), "<cwd>").splitlines()
    lines = [re.sub(r"^\[[^]]*\]", "", line) for line in lines]
    return [re.sub(r"[\d.]+ (samples|tokens)/s|[\d.]+ s\b", "<t>", line) for line in lines]

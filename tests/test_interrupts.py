"""Ctrl-C and kill during `accel-data tokenize` and `accel-data shard` (issue 32), through the real
console script started in a session of its own, as a terminal would: an interrupt exits 130
with one line and leaves nothing partial (LitData's own SIGINT handler exited 0 without a
word); a killed run's leftovers (its partial folder, LitData's staging folder) are removed by the
next run. The signal is sent once the partial folder exists, i.e. while the command writes."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, check_ok, run_cli

# About interrupts: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = pytest.mark.fresh

# A text whose char encoding takes a moment (~48 MB: the encoding pass lasts ~1.5 s, long
# enough for the signal to land inside it on a loaded machine; 0.5 s was not, under the suite).
LINE = "def f(x):\n    return x * 2 + 1  # some code\n"
BIG = LINE * 1_200_000
# A text whose token folder, in 1 KB shards, takes seconds to shard.
SHARD_TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(6000))


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["TMPDIR"] = str(tmp_path / "tmp")  # LitData's staging folders land here, to be checked
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return env


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    # As a terminal starts a foreground job: SIGINT at its default. A test suite started in the
    # background of a non-interactive shell (`pytest &` in a script) has SIGINT ignored (POSIX),
    # which every command it starts inherits: `accel-data tokenize` then ran through the Ctrl-C
    # and exited 0. A Python handler here becomes the default in the command (exec resets it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    # An exec keeps the signal mask as well: SIGINT unblocked too, for the same reason.
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        return subprocess.Popen(
            [str(BIN / "accel-data"), *args],
            cwd=cwd,
            env=_env(cwd),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the signal reaches it as Ctrl-C would
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)


def _when_writing(proc: subprocess.Popen, cwd: Path, out: str, inside: str | None) -> None:
    """Wait until the command writes its partial folder (and `inside` it, when given)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for partial in cwd.glob(f".{out}.partial-*"):
            if inside is None or (partial / inside).exists():
                return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    raise AssertionError("the command never started writing")


def _leftovers(cwd: Path, out: str) -> list[str]:
    """The partial folder beside `out`, and anything in $TMPDIR (LitData's staging folder and
    its items list, which an interrupt left there)."""
    return [p.name for p in cwd.glob(f".{out}.*")] + [p.name for p in (cwd / "tmp").iterdir()]


def _signal_state() -> str:
    """This process's SIGINT handler and mask, for a failure's message."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return f"SIGINT here: handler {signal.getsignal(signal.SIGINT)!r}, blocked {blocked}"


def _signalled(proc: subprocess.Popen, sig: int) -> tuple[int, str]:
    # A command that finished before the signal left (this test starved of CPU under a loaded
    # suite) says so, rather than reading as a command that exits 0 on Ctrl-C.
    done = proc.poll()
    assert done is None, f"the command finished (exit {done}) before the signal was sent"
    os.killpg(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def _tokenize_args(out: str) -> list[str]:
    return ["tokenize", "input=big.txt", f"out={out}"]


def _shard_args(out: str) -> list[str]:
    return ["shard", "dataset=tokens", "dataset.path=tok", f"out={out}", "chunk_bytes=1KB"]


@pytest.fixture
def texts(tmp_path) -> Path:
    (tmp_path / "big.txt").write_text(BIG)
    (tmp_path / "code.txt").write_text(SHARD_TEXT)
    check_ok(run_cli(["tokenize", "input=code.txt", "out=tok"], tmp_path, prog="accel-data"))
    return tmp_path


@pytest.mark.parametrize(
    ("command", "inside"), [(_tokenize_args, "train.bin"), (_shard_args, "train")]
)
def test_ctrl_c_exits_130_in_one_line_and_leaves_nothing(texts, command, inside):
    proc = _start(command("out"), texts)
    _when_writing(proc, texts, "out", inside)
    code, err = _signalled(proc, signal.SIGINT)
    assert code == 130, (err, _signal_state())
    assert "Traceback" not in err and "accel-data: interrupted" in err, err
    assert not (texts / "out").exists() and _leftovers(texts, "out") == []


def test_sigterm_during_tokenize_exits_143_and_leaves_nothing(texts):
    proc = _start(_tokenize_args("out"), texts)
    _when_writing(proc, texts, "out", "train.bin")
    code, err = _signalled(proc, signal.SIGTERM)
    assert code == 143 and "Traceback" not in err, err
    assert not (texts / "out").exists() and _leftovers(texts, "out") == []


@pytest.mark.parametrize(
    ("command", "inside"), [(_tokenize_args, "train.bin"), (_shard_args, "train")]
)
def test_a_killed_runs_leftovers_go_with_the_next_run(texts, command, inside):
    proc = _start(command("out"), texts)
    _when_writing(proc, texts, "out", inside)
    code, _ = _signalled(proc, signal.SIGKILL)
    assert code == -signal.SIGKILL and _leftovers(texts, "out")  # nothing could clean up
    if command is _shard_args:  # the next run, smaller, writes the same folder
        again = ["shard", "dataset=tokens", "dataset.path=tok", "out=out"]
    else:
        again = ["tokenize", "input=code.txt", "out=out"]
    check_ok(run_cli(again, texts, prog="accel-data", env={"TMPDIR": str(texts / "tmp")}))
    assert _leftovers(texts, "out") == [] and (texts / "out").is_dir()

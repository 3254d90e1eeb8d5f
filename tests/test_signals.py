"""SIGTERM and SIGINT through the real CLI: checkpoint at the step where the run stopped, one
log line, exit 128 + signum, no traceback; a second Ctrl-C exits at once; `resume=auto`
continues. The StopRequest rules themselves are checked in-process (no subprocess)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import BIN, FAST, check_ok, read_jsonl

from accel_train.checkpoint import load_checkpoint
from accel_train.train.signals import Stopped, StopRequest

# About signals: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = pytest.mark.fresh

# One step is a few milliseconds: a run of 1000 epochs is still going when the signal comes.
RUN = [
    *FAST,
    "loader.batch_size=32",
    "trainer.max_epochs=1000",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "trainer.test_after_fit=false",
    "logger=none",
]

# A loop hook that makes every step after the first last `seconds` (for a signal that must land
# mid-step).
SLOW_HOOK = """
import time
from accel_train.techniques import Technique

class Slow(Technique):
    def __init__(self, seconds=1.0):
        self.seconds = seconds

    def on_train_step_end(self, loop):
        if loop.step > 1:
            time.sleep(self.seconds)

class SlowValidation(Technique):
    def on_validation_start(self, loop):
        print("validating", flush=True)
        time.sleep(30)
"""


def slow(seconds: float) -> list[str]:
    return ["+callbacks.slow._target_=slowhook.Slow", f"+callbacks.slow.seconds={seconds}"]


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True, scope="module")
def _reap():
    """A failed assertion must not leave a run training in the background."""
    yield
    for proc in _started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Run:
    """`accel-train` in the background, its output in a file, as a user's terminal has it."""

    def __init__(
        self,
        args: list[str],
        cwd: Path,
        run_dir: Path,
        env: dict | None = None,
        new_session: bool = False,
    ):
        (cwd / "slowhook.py").write_text(SLOW_HOOK)
        self.run_dir, self.log = run_dir, cwd / f"{run_dir.name}.log"
        env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | (env or {})
        env["ACCEL_TRAIN_DATA_DIR"] = str(cwd / "no-data-here")
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [str(BIN / "accel-train"), *args, f"hydra.run.dir={run_dir}"],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=new_session,  # its own process group, as a terminal gives it
            )
        _started.append(self.proc)

    @property
    def output(self) -> str:
        return self.log.read_text()

    def trained_steps(self) -> list[int]:
        path = self.run_dir / "metrics.jsonl"
        rows = read_jsonl(path) if path.exists() else []
        return [r["step"] for r in rows if "train/loss" in r]

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(s >= step for s in self.trained_steps()):
            assert self.proc.poll() is None, f"the run ended early:\n{self.output[-3000:]}"
            assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
            time.sleep(0.05)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def stopped_at(output: str, signame: str) -> int:
    """The step named by the run's last line, '<SIG>: stopped at epoch E step S, ...'."""
    found = re.findall(rf"{signame}: stopped at epoch \d+ step (\d+), checkpoint (\S+);", output)
    assert len(found) == 1, output[-3000:]
    return int(found[0][0])


def check_stopped(run: Run, signum: signal.Signals) -> int:
    """Exit 128 + signum, one line, no traceback, last.pt at the step it stopped, no step
    trained after the checkpoint. Returns that step."""
    code = run.wait()
    out = run.output
    assert code == 128 + signum, f"exit {code}\n{out[-3000:]}"
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    step = stopped_at(out, signum.name)
    last = run.run_dir / "checkpoints" / "last.pt"
    assert load_checkpoint(last)["progress"]["step"] == step
    assert max(run.trained_steps()) == step  # nothing trained after the checkpoint: 0 lost
    rows = read_jsonl(run.run_dir / "metrics.jsonl")
    assert rows[-1]["event"] == "stopped" and rows[-1]["signal"] == signum.name
    assert not (run.run_dir / "summary.json").exists()
    return step


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[signal.Signals, tuple[Run, int]]:
    """Two runs, started together (start-up is most of their cost), stopped after a few steps:
    one by SIGTERM, one by SIGINT. {signal: (the run, the step it stopped at)}."""
    runs = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        cwd = tmp_path_factory.mktemp(signum.name.lower())
        runs[signum] = Run(RUN, cwd, cwd / "run")
    for signum, run in runs.items():
        run.wait_for_step(3)
        run.proc.send_signal(signum)
    return {signum: (run, check_stopped(run, signum)) for signum, run in runs.items()}


def test_sigterm_checkpoints_at_the_next_step_and_exits_143(stopped):
    run, step = stopped[signal.SIGTERM]
    assert step >= 3
    assert "SIGTERM received: checkpointing at the next step and exiting" in run.output


def test_sigint_checkpoints_and_exits_130(stopped):
    run, step = stopped[signal.SIGINT]
    assert step >= 3
    assert "SIGINT received: checkpointing at the next step and exiting" in run.output
    assert "(Ctrl-C again to exit at once)" in run.output


def test_resume_auto_continues_after_sigterm(stopped, run_cli):
    run, step = stopped[signal.SIGTERM]
    proc = run_cli(
        [*RUN, "resume=auto", f"trainer.max_steps={step + 3}", f"hydra.run.dir={run.run_dir}"],
        cwd=run.run_dir.parent,
    )
    check_ok(proc)
    rows = read_jsonl(run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("event") == "resume"] == [step]
    summary = (run.run_dir / "summary.json").read_text()
    assert f'"steps": {step + 3}' in summary


def test_second_sigint_exits_at_once(tmp_path):
    """Ctrl-C twice while a step takes 20 s: out long before the step ends (on a loaded
    machine exiting the interpreter alone may take seconds), 130, no checkpoint of that step."""
    run = Run([*RUN, *slow(20.0)], tmp_path, tmp_path / "run")
    run.wait_for_step(1)  # the first step is logged; the second one sleeps for 20 s
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    code = run.wait(timeout=30)
    took = time.monotonic() - sent
    out = run.output
    assert code == 130, f"exit {code}\n{out[-3000:]}"
    assert "SIGINT again: exiting now without a new checkpoint" in out
    assert "stopped at epoch" not in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert took < 15.0, f"{took:.1f} s after the second Ctrl-C"
    assert not list((tmp_path / "run").rglob("*.tmp-*"))


# ---- the rules, in-process -------------------------------------------------------------------


def test_stop_request_rules():
    stop = StopRequest(rank=0)
    with stop.installed():
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop._handle(signal.SIGUSR1, None)
        assert stop.requested and not stop.exits  # preemption: checkpoint, no exit
        stop._handle(signal.SIGTERM, None)
        assert stop.exits and stop.signum == signal.SIGTERM  # the job is going away
        stop._handle(signal.SIGUSR1, None)
        stop._handle(signal.SIGTERM, None)  # duplicates (SLURM + the agent) change nothing
        assert stop.signum == signal.SIGTERM
        stop._handle(signal.SIGINT, None)  # a first Ctrl-C only asks
        with pytest.raises(Stopped) as raised:
            stop._handle(signal.SIGINT, None)  # the second one exits
        assert raised.value.code == 130
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored


def test_stop_request_ignores_signals_in_forked_children():
    """A DataLoader worker forked from the trainer inherits the handler: it neither stops nor
    exits there (the trainer closes it after its checkpoint)."""
    stop = StopRequest(rank=0)
    with stop.installed():
        pid = os.fork()
        if pid == 0:  # the child: two Ctrl-C must not raise
            try:
                stop._handle(signal.SIGINT, None)
                stop._handle(signal.SIGINT, None)
                os._exit(0 if not stop.requested else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not stop.requested


# ---- under torchrun -----------------------------------------------------------------------------


def test_sigterm_to_the_torchrun_launcher_checkpoints_every_rank(tmp_path, run_cli):
    """`kill -TERM <accel-train>` of a 2-process DDP run: the torchrun agent forwards it, the
    ranks agree at the next logging step, save last.pt and exit within the agent's shutdown
    timeout; the launcher exits 143. resume=auto with the same processes finishes the run."""
    ddp = [
        *RUN,
        "strategy=ddp",
        "launcher.nproc_per_node=2",
        "trainer.log_every_n_steps=2",
        "dataset.val_fraction=0",  # (the warning about it is not what this test reads)
    ]
    env = {"OMP_NUM_THREADS": "1"}  # two processes on two shared cores
    run = Run(ddp, tmp_path, tmp_path / "run", env=env)
    run.wait_for_step(2, timeout=240)
    run.proc.send_signal(signal.SIGTERM)
    code = run.wait(timeout=120)
    out = run.output
    assert code == 143, f"exit {code}\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    step = stopped_at(out, "SIGTERM")
    assert step % 2 == 0  # a logging step: where the ranks agree
    assert load_checkpoint(run.run_dir / "checkpoints" / "last.pt")["progress"]["step"] == step
    assert max(run.trained_steps()) == step
    assert "torchrun agent stopped by SIGTERM" in out
    proc = run_cli(
        [*ddp, "resume=auto", f"trainer.max_steps={step + 2}", f"hydra.run.dir={run.run_dir}"],
        env=env,
        timeout=360,
    )
    check_ok(proc)
    summary = (run.run_dir / "summary.json").read_text()
    assert f'"steps": {step + 2}' in summary


def _workers_of(config: Path) -> list[int]:
    """The `accel_train.worker` processes reading this run's config."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or it exited meanwhile
            continue
        if b"accel_train.worker" in cmdline and str(config).encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    """A thread of it not yet a zombie: a process that is exiting holds its files (the run dir's
    lock) until its last thread is gone, after its command line and its main thread."""
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                return True
        except (OSError, IndexError):  # that thread exited meanwhile
            continue
    return False


def _lock_is_free(run_dir: Path) -> bool:
    fd = os.open(run_dir / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what the resume takes
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_workers_die_with_a_killed_launcher_and_free_the_run_dir(tmp_path):
    """SIGKILL to the process group of a 2-process run (what a terminal's or a scheduler's kill
    does): torchrun's workers, in sessions of their own, end within seconds too (their
    parent-death signal), and the run dir's lock is free for the resume."""
    ddp = [*RUN, "strategy=ddp", "launcher.nproc_per_node=2", "dataset.val_fraction=0"]
    run = Run(ddp, tmp_path, tmp_path / "run", env={"OMP_NUM_THREADS": "1"}, new_session=True)
    workers: list[int] = []
    try:
        run.wait_for_step(2, timeout=240)
        workers = _workers_of(run.run_dir / "config.yaml")
        assert len(workers) == 2
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), "workers still training after their launcher died"
        while not _lock_is_free(run.run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)  # (their last thread's files go a moment after it)
        assert _lock_is_free(run.run_dir), "the run dir is still locked"
    finally:
        for pid in filter(_alive, workers):
            os.kill(pid, signal.SIGKILL)


def test_a_signal_during_the_last_validation_stops_before_the_test_pass(tmp_path, run_cli):
    """The last validation comes after the last step that could act on a signal: the run
    stops (143, last.pt at the end, no summary) instead of running the test pass, and
    `resume=auto` then only runs the test pass."""
    args = [
        *FAST,
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "logger=csv",
        "+callbacks.slow._target_=slowhook.SlowValidation",
    ]
    run = Run(args, tmp_path, tmp_path / "run")
    deadline = time.monotonic() + 300
    while "validating" not in run.output:
        assert run.proc.poll() is None, run.output[-3000:]
        assert time.monotonic() < deadline, run.output[-3000:]
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGTERM)
    assert check_stopped(run, signal.SIGTERM) == 2
    proc = run_cli(
        [*args[:-1], "resume=auto", f"hydra.run.dir={run.run_dir}"],
        cwd=tmp_path,
    )
    check_ok(proc)
    summary = (run.run_dir / "summary.json").read_text()
    assert '"steps": 2' in summary and '"test_acc"' in summary
    rows = read_jsonl(run.run_dir / "metrics.jsonl")
    assert not [r for r in rows if r.get("step", 0) > 2]

"""Shared helpers for the test suite (fixtures live in conftest.py)."""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from warm_cli import WarmServer, env_differences, warm_env_ok

BIN = Path(sys.executable).parent

# Small, fast runs where the model and data set size do not matter.
FAST = [
    "model=mlp",
    "dataset.num_train=256",
    "dataset.num_test=64",
    "trainer.progress=none",
]

# Size of the tiny IDX MNIST written by the `mnist_dir` fixture.
MNIST_TRAIN, MNIST_TEST = 256, 64


def free_port() -> int:
    """A TCP port of 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(
    args: list[str],
    cwd: Path,
    *,
    prog: str = "accel-train",
    timeout: float = 180,
    env: dict[str, str] | None = None,
    input: str | None = None,
    warm: bool | None = None,
) -> subprocess.CompletedProcess:
    """Run a console script the way a user would and capture its output (`input`: its standard
    input): in a process forked from the warm parent (tests/warm_cli.py) where the test and the
    environment allow it, else in a new interpreter. `warm=False` / `True` forces one way."""
    full_env = base_env()
    # Never fall back to ./data or the shared data set: a test that needs data says where.
    full_env["ACCEL_TRAIN_DATA_DIR"] = str(Path(cwd) / "no-data-here")
    full_env.update(env or {})
    args = [str(a) for a in args]
    if prog == "accel-train" and not any("plot_curves" in a or a == "--help" for a in args):
        # matplotlib's import and a plot cost ~1 CPU s a run: only the tests of curves.png plot.
        args.append("trainer.plot_curves=false")
    warm = warm if warm is not None else warm_allowed(prog, full_env)
    _count(prog, warm, full_env)
    if warm:
        return warm_server().run(
            [str(BIN / prog), *args], cwd=Path(cwd), env=full_env, timeout=timeout, input=input
        )
    return subprocess.run(
        [str(BIN / prog), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


# ---- the warm CLI (tests/warm_cli.py) ----------------------------------------------------------

# The console scripts a warm parent can run; anything else (torchrun, moto_server) starts fresh.
WARM_PROGS = {
    "accel-train",
    "accel-eval",
    "accel-export",
    "accel-data",
    "accel-sample",
    "accel-report",
}
# Set by conftest.py for each test: False while a test marked `fresh` runs (start-up, signals,
# torchrun, SLURM, Ray, installation), whose CLI runs keep a new interpreter each.
WARM = {"enabled": os.environ.get("ACCEL_TEST_WARM", "1") != "0"}
_server: list[WarmServer] = []


def base_env() -> dict[str, str]:
    """The environment every CLI run starts from (run_cli's, before a test's own `env`)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# The warm parent's environment: the pytest process's at the start of the session
# (conftest.py), before any test changed os.environ.
BASE_ENV: dict[str, str] = {}


def warm_allowed(prog: str, env: dict[str, str]) -> bool:
    """Whether this run may fork from the warm parent: a console script of ours, a test not
    marked `fresh`, and an environment that differs from the parent's only in variables read
    at run time."""
    if not BASE_ENV:
        BASE_ENV.update(base_env())
    if not (WARM["enabled"] and prog in WARM_PROGS):
        return False
    server = warm_server()
    return warm_env_ok(env, BASE_ENV, server.imported, server.imported_with)


# This process's CLI runs, warm and fresh, and why runs that could have forked did not (the
# variables their environment set otherwise): conftest.py's CPU log records them per test, so
# a change that silently sends every run fresh shows in tests/cpu_report.py.
RUNS: dict = {"warm": 0, "fresh": 0, "fresh_because": {}}


def _count(prog: str, warm: bool, env: dict[str, str]) -> None:
    RUNS["warm" if warm else "fresh"] += 1
    if not warm and WARM["enabled"] and prog in WARM_PROGS and BASE_ENV:
        imported_with = _server[0].imported_with if _server else None
        for key in sorted(env_differences(env, BASE_ENV, imported_with)) or ["(forced fresh)"]:
            RUNS["fresh_because"][key] = RUNS["fresh_because"].get(key, 0) + 1


def warm_server() -> WarmServer:
    if not _server or not _server[0].alive():
        _server[:] = [WarmServer(BASE_ENV)]
        atexit.register(_server[0].stop)
    return _server[0]


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
        f"{proc.stderr[-4000:]}"
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(run_dir: Path) -> dict:
    """A run's summary.json."""
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path) -> dict[int, float]:
    """A run's training loss by optimizer step (metrics.jsonl)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ between {a} and {b} in {different}"


# ---- tiny MNIST in torchvision's raw IDX layout ----------------------------------------------


def _write_idx(path: Path, data: torch.Tensor) -> None:
    """IDX format: magic (0, 0, type 0x08 = ubyte, ndim), big-endian int32 dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, data.dim())
    header += struct.pack(f">{data.dim()}I", *data.shape)
    path.write_bytes(header + data.to(torch.uint8).contiguous().numpy().tobytes())


def make_digits(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable 28x28 uint8 "digits": a bright 6x6 block whose position encodes the class,
    jittered by a pixel and on a noisy background."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    labels = labels[torch.randperm(n, generator=gen)]
    images = torch.randint(0, 60, (n, 28, 28), generator=gen, dtype=torch.int64)
    jitter = torch.randint(-1, 2, (n, 2), generator=gen)
    for i, c in enumerate(labels.tolist()):
        r = 3 + (c // 4) * 8 + int(jitter[i, 0])
        col = 2 + (c % 4) * 6 + int(jitter[i, 1])
        images[i, r : r + 6, col : col + 6] = 255
    return images.to(torch.uint8), labels.to(torch.uint8)


def write_mnist(root: Path, n_train: int = MNIST_TRAIN, n_test: int = MNIST_TEST) -> Path:
    """The four uncompressed files torchvision.datasets.MNIST reads (root/MNIST/raw/...)."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n, seed in (("train", n_train, 1), ("t10k", n_test, 2)):
        images, labels = make_digits(n, seed)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return root


# ---- counting host reads of tensors (the hot-path tests) ---------------------------------

# What reads a tensor's value on the host (and so waits for the device on CUDA).
SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")
# Frames in these places count: the loop, the techniques, the wrappers. The data loaders work on
# host tensors before the transfer, and torch's own internals are torch's business.
_SRC = Path(__file__).resolve().parents[1] / "src" / "accel_train"
OURS = (str(_SRC / "train"), str(_SRC / "techniques"), str(_SRC / "parallel.py"))


def count_host_reads(monkeypatch) -> list[str]:
    """Patch torch.Tensor's host-reading methods; returns the list the calls made from OURS
    are appended to (as "name at file:line")."""
    calls: list[str] = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(OURS):
                calls.append(f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}")
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return calls


def slurm_job_field(job_id: str, field: str) -> str:
    """One field of `scontrol show job` (e.g. Restarts, JobState); "" when it is not there."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    match = re.search(rf"\b{field}=(\S+)", out.stdout)
    return match.group(1) if match else ""


def wait_for(predicate: Callable[[], bool], timeout: float, what: str | Callable[[], str]) -> None:
    """Poll `predicate` every half second; fail naming `what` after `timeout` seconds (a
    callable `what` is read then: e.g. a job's log as it stands at the timeout)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout}s waiting for {said}")
        time.sleep(0.5)


def background_env() -> dict[str, str]:
    """The environment of a background run: none of a launcher's own variables, one thread."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "HYDRA_FULL_ERROR"
        and not k.startswith(("TORCHELASTIC_", "SLURM_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # two cores shared by every process of every test
    return env


class Proc:
    """A started command (several run at once); output to files; its own session so a timeout
    ends all its workers. `timeout`: seconds for the run while other runs share the cores."""

    def __init__(
        self, args: list[str], cwd: Path, name: str, prog: str = "accel-train", timeout=420
    ):
        cwd.mkdir(parents=True, exist_ok=True)
        self.args, self.timeout = [str(BIN / prog), *args], timeout
        self.out, self.err = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.popen = subprocess.Popen(
                self.args,
                cwd=cwd,
                env=background_env(),
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def wait(self) -> tuple[int, str]:
        try:
            code = self.popen.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        output = self.out.read_text() + self.err.read_text()
        assert code is not None, f"timed out: {' '.join(self.args)}\n{output[-4000:]}"
        return code, output

    def ok(self) -> str:
        code, output = self.wait()
        assert code == 0, f"{' '.join(self.args)}\nexit {code}\n{output[-6000:]}"
        return output

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


def train_losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

"""Distributed training through the real CLI: CPU, gloo, real processes (issue 3).

Every run is a subprocess of `accel-train` (or torchrun), the way a user starts it. Most of a
run's wall time here is start-up (importing torch) and rendezvous waiting, so the independent
runs are all queued when the module's first test asks for them (`started`) and start as slots
free up (at most `MAX_RUNNING` at once: a dozen multi-process runs at once on two cores spend
their time thrashing and timing out); each test then waits for its own. Runs that start from
another run's output form a second wave (`second_wave`). Refusals that are pure config checks
(no process, no network) are checked in-process (`test_config_refusals_name_the_key`); the
refusals the CLI shows here are those of the launcher and the rendezvous.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import background_env
from omegaconf import OmegaConf

from accel_train.config.checks import validate
from accel_train.config.run_config import resolve
from accel_train.errors import UserError
from accel_train.launchers.rendezvous import check_rendezvous
from accel_train.launchers.world import check_strategy

# About torchrun: its CLI runs start a new interpreter, never the warm parent
# (tests/warm_cli.py).
pytestmark = pytest.mark.fresh

BIN = Path(sys.executable).parent
TIMEOUT = 360  # seconds for one run while a dozen others share the two cores

# Small and fast. 250 training samples leave a short last batch (250 = 7 x 32 + 26), and 63
# validation samples make two ranks pad their shards (63 = 2 x 32 - 1). These tests are about
# the distributed mechanics, so they validate on the test split (val_fraction=0) and keep the
# whole training set for training: the arithmetic below stays simple.
SMALL = [
    "model=mlp",
    "dataset=synthetic",
    "dataset.num_train=250",
    "dataset.num_test=63",
    "dataset.val_fraction=0",
    "trainer.progress=none",
]


def small(**changes: object) -> list[str]:
    """SMALL with some values changed (Hydra refuses a key given twice)."""
    kept = [a for a in SMALL if a.split("=")[0] not in changes]
    return kept + [f"{k}={v}" for k, v in changes.items()]


# ---- running commands -----------------------------------------------------------------------


@dataclass
class Result:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def check(self) -> Result:
        assert self.returncode == 0, self.describe()
        return self

    def describe(self) -> str:
        return (
            f"{' '.join(self.args)}\nexit {self.returncode}\n--- stdout\n{self.stdout[-5000:]}"
            f"\n--- stderr\n{self.stderr[-5000:]}"
        )


# Commands of this module running at once (a 2-process run counts once). Two cores: more runs
# at once only share them finer, and slow every rendezvous and every run's start-up.
MAX_RUNNING = 4
_slots = threading.BoundedSemaphore(MAX_RUNNING)


class Proc:
    """A command, started by `queue` as soon as a slot is free; its output goes to files (no
    pipe can fill up and block it). A command still running after TIMEOUT is killed."""

    def __init__(self, cmd: Iterable[object], cwd: Path, name: str):
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        self.args = [str(a) for a in cmd]
        self.out_path, self.err_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        self.result: Result | None = None
        self.popen: subprocess.Popen | None = None
        self.cancelled = False
        self.timed_out = False
        self.started = threading.Event()
        self.ended = threading.Event()

    def _start(self) -> None:
        if not self.cancelled:
            with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
                # Its own session, so that a timeout ends exactly this command and its workers.
                self.popen = subprocess.Popen(
                    self.args,
                    cwd=self.cwd,
                    env=background_env(),
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
        self.started.set()

    def _wait_exit(self, deadline: float) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                self.timed_out = True
                self.kill()
        self.ended.set()

    def wait(self) -> Result:
        if self.result is None:
            self.ended.wait()
            code = None if self.popen is None or self.timed_out else self.popen.returncode
            read = lambda p: p.read_text() if p.exists() else ""  # noqa: E731
            self.result = Result(self.args, code, read(self.out_path), read(self.err_path))
            assert code is not None, f"timed out after {TIMEOUT} s\n{self.result.describe()}"
        return self.result

    def kill(self) -> None:
        self.cancelled = True
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


def queue(*procs: Proc) -> None:
    """Start these commands together (the node agents of one two-node job: one alone would
    only wait for its peer), one slot each, as soon as the slots are free; a thread waits for
    them and gives the slots back."""

    def run() -> None:
        for _ in procs:
            _slots.acquire()
        try:
            for proc in procs:
                proc._start()
            deadline = time.monotonic() + TIMEOUT
            for proc in procs:
                proc._wait_exit(deadline)
        finally:
            for proc in procs:
                proc.ended.set()
                _slots.release()

    threading.Thread(target=run, daemon=True).start()


def kill_strays(root: Path) -> None:
    """SIGKILL every process whose command line names a path under `root`: the workers that
    torchrun starts in sessions of their own (an elastic restart's, or a killed agent's) are
    not in the command's process group, and would outlive the test."""
    needle = f"{root}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):  # exited meanwhile, or not ours
            continue


def start(args: Iterable[object], cwd: Path, name: str, prog: str = "accel-train") -> Proc:
    """Queue one command (see Proc)."""
    proc = Proc([BIN / prog, *args], cwd, name)
    queue(proc)
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def this_host_address() -> str:
    """An IPv4 address of this machine's network interface (no packet is sent), else
    127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


# ---- reading a run dir ----------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(run_dir: Path, key: str) -> dict[int, float]:
    """step -> value of one metric; asserts that no step was logged twice (one writer)."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if key in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"{key} logged twice for a step: {steps}"
    return {r["step"]: r[key] for r in rows}


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def only_child(folder: Path) -> Path:
    children = [p for p in folder.iterdir() if not p.name.startswith(".")]
    assert len(children) == 1, f"expected one run dir in {folder}, found {children}"
    return children[0]


def assert_no_traceback(result: Result) -> None:
    assert "Traceback" not in result.output, result.describe()


# ---- elastic restart: a worker killed as soon as a checkpoint exists -----------------------

ELASTIC_CKPT_EVERY, ELASTIC_STEPS = 2, 64  # 1024 samples / 2 ranks / 8 per batch = 64 steps


def _worker_pids(config_path: Path) -> dict[int, int]:
    """rank -> pid of the `accel_train.worker` processes reading this run's config."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if b"accel_train.worker" not in cmdline or str(config_path).encode() not in cmdline:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # exited meanwhile, or not ours to read
            continue
        rank = next((v[5:] for v in environ if v.startswith(b"RANK=")), None)
        if rank is not None:
            found[int(rank)] = int(entry.name)
    return found


class ElasticRun:
    """A DDP run with one restart allowed, and a thread that kill -9s rank 0's worker as soon
    as the first checkpoint exists (rank 0 writes the checkpoints and metrics)."""

    def __init__(self, root: Path):
        self.run_dir = root / "run"
        self.proc = start(
            [
                *small(**{"dataset.num_train": 1024}),
                "loader.batch_size=8",
                "strategy=ddp",
                "launcher.nproc_per_node=2",
                "launcher.max_restarts=1",
                "launcher.monitor_interval=0.5",
                f"trainer.ckpt_every_n_steps={ELASTIC_CKPT_EVERY}",
                "trainer.log_every_n_steps=1",
                "trainer.max_epochs=1",
                f"hydra.run.dir={self.run_dir}",
            ],
            root,
            "elastic",
        )
        self.killed: dict[int, int] | str = "not yet"
        self.thread = threading.Thread(target=self._kill_after_first_checkpoint, daemon=True)
        self.thread.start()

    def _kill_after_first_checkpoint(self) -> None:
        last = self.run_dir / "checkpoints" / "last.pt"
        self.proc.started.wait()
        deadline = time.monotonic() + TIMEOUT
        while not last.exists():
            if self.proc.ended.is_set() or time.monotonic() > deadline:
                self.killed = "the run ended (or timed out) before its first checkpoint"
                return
            time.sleep(0.02)
        self.killed = pids = _worker_pids(self.run_dir / "config.yaml")
        if 0 in pids:
            os.kill(pids[0], signal.SIGKILL)

    def wait(self) -> Result:
        result = self.proc.wait()
        self.thread.join()
        # Workers of the killed attempt that outlived the agent (torchrun starts them in
        # sessions of their own): not left running for the rest of the suite.
        kill_strays(self.run_dir)
        return result


# ---- what the module runs -------------------------------------------------------------------

# The same 20 steps at a global batch of 32, three ways (see `parity`).
PARITY = [
    *SMALL,
    "model.dropout=0",
    "precision=fp32",
    "trainer.deterministic=true",
    "trainer.log_every_n_steps=1",
    "trainer.max_steps=20",  # 8 steps per epoch: crosses two epoch ends and two short batches
    "trainer.seed=3",
]

# name: (overrides, texts the error message must contain); {busy} and {closed} are ports.
# Through the CLI: what the launcher and the rendezvous check, with real ports.
BAD_INPUTS = {
    "single_with_2_procs": (
        ["strategy=single", "launcher.nproc_per_node=2"],
        ["strategy=single", "launcher.nproc_per_node=2", "strategy=ddp"],
    ),
    "port_in_use": (
        [
            "strategy=ddp",
            "launcher.nnodes=2",
            "launcher.node_rank=0",
            "launcher.rdzv_endpoint=localhost:{busy}",
            "launcher.rdzv_id=x",
        ],
        ["launcher.rdzv_endpoint=localhost:{busy}", "already in use"],
    ),
    "endpoint_unreachable": (
        [
            "strategy=ddp",
            "launcher.nnodes=2",
            "launcher.node_rank=1",
            "launcher.rdzv_endpoint=localhost:{closed}",
            "launcher.rdzv_id=x",
            "launcher.rdzv_timeout=3",
        ],
        ["launcher.rdzv_endpoint=localhost:{closed}", "nothing answered", "rdzv_timeout=3"],
    ),
    # Node 0 alone: it says whom it waits for, and the timeout names the node that never came.
    "node0_alone": (
        [
            "strategy=ddp",
            "launcher.nnodes=2",
            "launcher.node_rank=0",
            "launcher.rdzv_endpoint=localhost:{alone}",
            "launcher.rdzv_id=x",
            "launcher.rdzv_timeout=3",
        ],
        [
            "waiting for 2 nodes at localhost:{alone}",
            "only node_rank 0 joined, and node_rank 1 never came",
            "launcher.rdzv_timeout=3",
        ],
    ),
    # ... also when the endpoint names this machine by an address of its network interface:
    # node 0 hosts the rendezvous, it does not wait for itself to answer.
    "node0_by_address": (
        [
            "strategy=ddp",
            "launcher.nnodes=2",
            "launcher.node_rank=0",
            "launcher.rdzv_endpoint={address}:{alone2}",
            "launcher.rdzv_id=x",
            "launcher.rdzv_timeout=3",
        ],
        ["waiting for 2 nodes at {address}:{alone2}", "node_rank 1 never came"],
    ),
}
# In-process: refusals of the config alone, by the functions the launcher calls before it
# starts anything (validate, check_strategy, check_rendezvous): (overrides, check, texts).
CONFIG_REFUSALS = {
    "dp": (["strategy=dp"], "validate", ["strategy=dp", "DistributedDataParallel", "strategy=ddp"]),
    "nccl_without_cuda": (
        ["strategy=ddp", "launcher.nproc_per_node=2", "strategy.backend=nccl"],
        "check_strategy",
        ["strategy.backend=nccl", "gloo"],
    ),
    "two_nodes_without_rdzv_id": (
        ["strategy=ddp", "launcher.nnodes=2", "launcher.rdzv_endpoint=localhost:29999"],
        "check_rendezvous",
        ["launcher.rdzv_id"],
    ),
    "two_nodes_on_a_random_port": (
        ["strategy=ddp", "launcher.nnodes=2", "launcher.rdzv_id=x"],
        "check_rendezvous",
        ["launcher.rdzv_endpoint", "fixed port"],
    ),
}


def _start_two_nodes(root: Path, rdzv_id: str, node1_extra: list[str]) -> dict[int, Proc]:
    """Two `accel-train` node agents of one job on localhost (one process each)."""
    common = [
        *SMALL,
        "strategy=ddp",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=1",
        f"launcher.rdzv_endpoint=localhost:{free_port()}",
        f"launcher.rdzv_id={rdzv_id}",
        f"paths.log_dir={root}",  # the run dir is <log_dir>/train/<rdzv_id> on every node
        "trainer.max_epochs=1",
    ]
    procs = {
        0: Proc([BIN / "accel-train", *common, "launcher.node_rank=0"], root, "node0"),
        1: Proc(
            [BIN / "accel-train", *common, "launcher.node_rank=1", *node1_extra], root, "node1"
        ),
    }
    queue(*procs.values())
    return procs


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """Start every run that needs nothing but the CLI; yields {name: Proc or dict of Procs}."""
    root = tmp_path_factory.mktemp("dist")
    procs: dict = {"root": root}
    parity = root / "parity"
    procs["parity"] = {
        # one: 1 process x 32. ddp: 2 processes x 16, its run dir from paths.log_dir (not
        # hydra.run.dir), so a rank composing its own config would make a second run dir.
        # accum: 1 process x 16 x 2 micro-batches.
        "one": start(
            [*PARITY, "loader.batch_size=32", f"hydra.run.dir={parity / 'one'}"], parity, "one"
        ),
        "ddp": start(
            [
                *PARITY,
                "strategy=ddp",
                "launcher.nproc_per_node=2",
                "loader.batch_size=16",
                f"paths.log_dir={parity / 'ddp_logs'}",
            ],
            parity,
            "ddp",
        ),
        "accum": start(
            [
                *PARITY,
                "loader.batch_size=16",
                "trainer.accumulate_grad_batches=2",
                f"hydra.run.dir={parity / 'accum'}",
            ],
            parity,
            "accum",
        ),
    }
    fsdp = root / "fsdp"
    procs["fsdp"] = start(
        [
            *SMALL,
            "strategy=fsdp",
            "launcher.nproc_per_node=2",
            "trainer.max_epochs=2",
            "trainer.log_every_n_steps=1",
            f"hydra.run.dir={fsdp / 'run'}",
        ],
        fsdp,
        "fsdp",
    )
    procs["elastic"] = ElasticRun(root / "elastic")
    procs["two_nodes"] = _start_two_nodes(root / "two_nodes", "job2n", [])
    procs["disagree"] = _start_two_nodes(root / "disagree", "disagree", ["optimizer.lr=0.01"])

    busy = socket.socket()  # held open until every bad input has run
    busy.bind(("", 0))
    busy.listen()
    ports = {
        "busy": busy.getsockname()[1],
        "closed": free_port(),
        "alone": free_port(),
        "alone2": free_port(),
        "address": this_host_address(),
    }
    procs["ports"] = ports
    bad = root / "bad"
    procs["bad"] = {
        name: start(
            [*SMALL, f"paths.log_dir={bad / name}", *(a.format(**ports) for a in args)], bad, name
        )
        for name, (args, _) in BAD_INPUTS.items()
    }
    yield procs
    busy.close()
    procs["elastic"].proc.kill()
    for group in procs.values():
        for proc in group.values() if isinstance(group, dict) else [group]:
            if isinstance(proc, Proc):
                proc.kill()  # a test that failed early may have left its runs behind
    kill_strays(root)


@pytest.fixture(scope="module")
def parity(started) -> dict[str, Path]:
    results = {name: proc.wait() for name, proc in started["parity"].items()}
    for result in results.values():
        result.check()
    root = started["root"] / "parity"
    return {
        "one": root / "one",
        "ddp": only_child(root / "ddp_logs" / "train"),
        "accum": root / "accum",
        "ddp_output": results["ddp"].output,
        "root": root,
    }


@pytest.fixture(scope="module")
def fsdp_run(started) -> Path:
    started["fsdp"].wait().check()
    return started["root"] / "fsdp" / "run"


@pytest.fixture(scope="module")
def second_wave(parity, fsdp_run, tmp_path_factory) -> dict[str, Proc]:
    """Runs that start from the first wave's outputs, started together."""
    root = tmp_path_factory.mktemp("second")
    procs = {}
    # accel-eval of the FSDP run's sharded best checkpoint, at world size 1.
    procs["eval"] = start(
        [f"ckpt_path={fsdp_run / 'checkpoints' / 'best.dcp'}", f"out_path={root / 'eval.json'}"],
        root,
        "eval",
        prog="accel-eval",
    )
    # Resume the FSDP run (world size 2) in one process for one more epoch.
    procs["fsdp_resume"] = start(
        [
            *SMALL,
            "strategy=fsdp",
            "launcher.nproc_per_node=1",
            f"resume={fsdp_run / 'checkpoints' / 'last.dcp'}",
            "trainer.max_epochs=3",
            "trainer.log_every_n_steps=1",
            f"hydra.run.dir={root / 'fsdp_resume'}",
        ],
        root,
        "fsdp_resume",
    )
    # A user's own torchrun running the worker on a config file: a 1-process run's resolved
    # config with strategy=ddp.
    cfg = OmegaConf.load(parity["one"] / "config.yaml")
    run_dir = root / "user_torchrun"
    cfg.strategy.name = "ddp"
    cfg.paths.output_dir = str(run_dir)
    cfg.trainer.max_steps = 4
    run_dir.mkdir()
    OmegaConf.save(cfg, run_dir / "config.yaml")
    procs["user_torchrun"] = Proc(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "accel_train.worker",
            run_dir / "config.yaml",
        ],
        root,
        "user_torchrun",
    )
    queue(procs["user_torchrun"])
    procs["root"] = root
    yield procs
    for proc in procs.values():
        if isinstance(proc, Proc):
            proc.kill()
    kill_strays(root)


# ---- 2 processes on one node, and parity with 1 process -------------------------------------


def test_ddp_two_processes_write_one_run_dir(parity):
    run_dir = parity["ddp"]
    assert (run_dir / "config.yaml").is_file()
    assert not list(run_dir.glob("config.node*.yaml"))  # one node: no per-node copies
    assert checkpoint_names(run_dir) == ["best.pt", "last.pt"]
    # One metrics file, one config, one summary, one set of checkpoints; nothing elsewhere.
    for name in ("metrics.jsonl", "summary.json", "config.yaml", "checkpoints"):
        found = [p for p in (parity["root"] / "ddp_logs").rglob(name) if ".hydra" not in p.parts]
        assert found == [run_dir / name], found
    assert not (parity["root"] / "outputs").exists()  # no rank fell back to the default dir
    s = summary(run_dir)
    assert (s["world_size"], s["global_batch"], s["steps"]) == (2, 32, 20)
    assert sorted(series(run_dir, "train/loss")) == list(range(1, 21))  # rank 0 writes alone
    assert "16 per device x 1 accumulation x 2 process(es) = 32 global" in parity["ddp_output"]
    for rank in (0, 1):  # a log file per rank, and only rank 0 echoed to the console
        assert list((run_dir / "logs" / "node0").glob(f"*/attempt_0/{rank}/stderr.log")), rank
    assert "[default0]:" in parity["ddp_output"] and "[default1]:" not in parity["ddp_output"]
    # The config the workers read is the resolved one: it names the run dir itself.
    assert OmegaConf.load(run_dir / "config.yaml").paths.output_dir == str(run_dir)


def _assert_same_training(run: Path, reference: Path) -> None:
    losses, ref_losses = series(run, "train/loss"), series(reference, "train/loss")
    assert sorted(losses) == sorted(ref_losses) == list(range(1, 21))
    for step, ref in ref_losses.items():
        assert losses[step] == pytest.approx(ref, rel=1e-4), f"train/loss at step {step}"
    # Validation (sharded under DDP) counts each of the 63 examples once, like one process.
    for key in ("val/loss", "val/acc"):
        assert series(run, key) == pytest.approx(series(reference, key), rel=1e-4), key
    mine = weights(run / "checkpoints" / "last.pt")
    ref_weights = weights(reference / "checkpoints" / "last.pt")
    assert mine.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        torch.testing.assert_close(mine[name], ref, rtol=0, atol=1e-5, msg=name)


def test_ddp_matches_one_process_at_the_same_global_batch(parity):
    _assert_same_training(parity["ddp"], parity["one"])


def test_accumulation_matches_one_large_batch(parity):
    _assert_same_training(parity["accum"], parity["one"])


# ---- two nodes on localhost -----------------------------------------------------------------


def test_two_nodes_on_localhost_form_one_job(started):
    for proc in started["two_nodes"].values():
        proc.wait().check()
    root = started["root"] / "two_nodes"
    assert sorted(p.name for p in (root / "train").iterdir()) == ["job2n"]
    run_dir = root / "train" / "job2n"
    assert (run_dir / "config.yaml").is_file()
    s = summary(run_dir)
    assert (s["world_size"], s["global_batch"], s["steps"]) == (2, 128, 2)  # 125 per rank
    assert checkpoint_names(run_dir) == ["best.pt", "last.pt"]
    assert sorted(series(run_dir, "train/epoch_s")) == [2]  # one writer
    for node in (0, 1):  # each node agent keeps its ranks' logs in the shared run dir
        assert list((run_dir / "logs" / f"node{node}").glob("*/attempt_0/0/stdout.log")), node


def test_nodes_that_disagree_on_the_config_are_refused(started):
    for proc in started["disagree"].values():
        result = proc.wait()
        assert result.returncode != 0, result.describe()
        # The launcher's own error line names the key and both values.
        errors = [line for line in result.stderr.splitlines() if "accel-train: error:" in line]
        assert errors, result.describe()
        assert "optimizer.lr=0.001" in errors[0] and "0.01 on rank 1" in errors[0], errors[0]
        assert_no_traceback(result)
    run_dir = started["root"] / "disagree" / "train" / "disagree"
    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "checkpoints").exists()


# ---- bad inputs: refused with one clear message, no traceback ------------------------------


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_refused_naming_the_key(name, started):
    result = started["bad"][name].wait()
    assert result.returncode != 0, result.describe()
    assert "accel-train: error:" in result.stderr, result.describe()
    for text in BAD_INPUTS[name][1]:
        assert text.format(**started["ports"]) in result.output, result.describe()
    assert_no_traceback(result)


@pytest.mark.parametrize("name", sorted(CONFIG_REFUSALS))
def test_config_refusals_name_the_key(name, compose_cfg, tmp_path):
    overrides, check, texts = CONFIG_REFUSALS[name]
    cfg = compose_cfg([*SMALL, *overrides, f"paths.output_dir={tmp_path}"])
    calls = {
        "validate": lambda: validate(cfg),
        "check_strategy": lambda: check_strategy(resolve(cfg), 2),
        "check_rendezvous": lambda: check_rendezvous(resolve(cfg)),
    }
    with pytest.raises(UserError) as refused:
        calls[check]()
    for text in texts:
        assert text in str(refused.value), str(refused.value)


# ---- FSDP -----------------------------------------------------------------------------------


def test_fsdp_two_processes_save_sharded_checkpoints(fsdp_run):
    s = summary(fsdp_run)
    assert (s["world_size"], s["steps"], s["epochs"]) == (2, 4, 2)  # 125 per rank, 64 a batch
    assert checkpoint_names(fsdp_run) == ["best.dcp", "last.dcp"]
    for name in ("best.dcp", "last.dcp"):
        folder = fsdp_run / "checkpoints" / name
        assert (folder / "meta.pt").is_file() and (folder / ".metadata").is_file()
        assert len(list(folder.glob("*.distcp"))) == 2  # one shard file per rank


def test_fsdp_checkpoint_evaluates_at_world_size_1(fsdp_run, second_wave):
    second_wave["eval"].wait().check()
    report = json.loads((second_wave["root"] / "eval.json").read_text())
    val_acc, val_loss = series(fsdp_run, "val/acc"), series(fsdp_run, "val/loss")
    best_step = min(step for step, acc in val_acc.items() if acc == max(val_acc.values()))
    assert report["num_samples"] == 63
    assert report["step"] == best_step
    assert report["test/acc"] == summary(fsdp_run)["best_val_acc"] == val_acc[best_step]
    # The run's own test pass scored the same sharded best checkpoint on the same split.
    assert report["test/acc"] == summary(fsdp_run)["test_acc"]
    assert report["test/loss"] == pytest.approx(val_loss[best_step], rel=1e-5)


def test_fsdp_resumes_at_world_size_1(fsdp_run, second_wave):
    result = second_wave["fsdp_resume"].wait()
    result.check()
    last = fsdp_run / "checkpoints" / "last.dcp"
    run_dir = second_wave["root"] / "fsdp_resume"
    assert f"resumed from {last} at epoch 2, step 4" in result.output
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[0]["event"] == "resume" and rows[0]["from"] == str(last)
    s = summary(run_dir)
    # One more epoch at world size 1: 250 samples / 64 per batch = 4 steps.
    assert (s["world_size"], s["epochs"], s["steps"]) == (1, 3, 4 + 4)
    # The weights came from the checkpoint: the first loss is a trained model's, well below
    # the fresh model's first loss (about ln 10) in the FSDP run.
    first_loss = series(run_dir, "train/loss")[5]
    fresh_loss = series(fsdp_run, "train/loss")[1]
    assert first_loss < fresh_loss - 0.2, (first_loss, fresh_loss)


# ---- a user's own torchrun ------------------------------------------------------------------


def test_user_torchrun_runs_the_worker_on_a_written_config(second_wave):
    """`torchrun --nproc_per_node=2 -m accel_train.worker <config.yaml>`, no launcher."""
    second_wave["user_torchrun"].wait().check()
    run_dir = second_wave["root"] / "user_torchrun"
    s = summary(run_dir)
    assert (s["world_size"], s["steps"], s["global_batch"]) == (2, 4, 64)
    assert sorted(series(run_dir, "train/loss")) == [1, 2, 3, 4]
    assert checkpoint_names(run_dir) == ["best.pt", "last.pt"]


# ---- elastic restart ------------------------------------------------------------------------


def test_elastic_restart_resumes_and_finishes(started):
    elastic = started["elastic"]
    result = elastic.wait()
    assert isinstance(elastic.killed, dict) and 0 in elastic.killed, elastic.killed
    result.check()
    run_dir = elastic.run_dir
    assert summary(run_dir)["steps"] == ELASTIC_STEPS
    rows = read_jsonl(run_dir / "metrics.jsonl")
    resumes = [i for i, r in enumerate(rows) if r.get("event") == "resume"]
    assert len(resumes) == 1, "the run finished before the kill, or restarted twice"
    resumed_at = rows[resumes[0]]["step"]
    assert rows[resumes[0]]["from"] == str(run_dir / "checkpoints" / "last.pt")
    assert resumed_at > 0 and resumed_at % ELASTIC_CKPT_EVERY == 0
    # Work lost: steps trained before the kill and not in the checkpoint resumed from.
    trained = max(r["step"] for r in rows[: resumes[0]] if "train/loss" in r)
    assert trained - resumed_at <= ELASTIC_CKPT_EVERY
    # After the restart, training continues at the checkpoint's next step and runs to the end.
    after = [r["step"] for r in rows[resumes[0] :] if "train/loss" in r]
    assert after == list(range(resumed_at + 1, ELASTIC_STEPS + 1))
    assert list((run_dir / "logs" / "node0").glob("*/attempt_1/0/stderr.log"))

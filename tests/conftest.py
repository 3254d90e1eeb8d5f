"""Fixtures: a tiny IDX MNIST on disk, CLI runners, and Hydra's compose API."""

from __future__ import annotations

import functools
import json
import os
import resource
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BASE_ENV, BIN, RUNS, WARM, base_env, free_port, write_mnist
from helpers import run_cli as _run_cli
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from warm_cli import CHILD_CPU_S

from accel_train.config import CONFIG_DIR
from accel_train.config.schema import register_configs
from accel_train.environment import register_resolvers


def pytest_configure(config):
    # The CLI runs the tests start get one CPU thread each: the suite runs in two processes
    # (pytest-xdist) on machines as small as 2 cores, and tiny models gain nothing from more
    # threads, while OpenMP threads of two runs spinning on the same cores slow both.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # trainer.compile's inductor compiles its kernels in this process instead of a pool of
    # compile workers (each of which imports torch again: seconds of CPU a run, for a
    # handful of tiny kernels); the kernels are the same.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_finish(session):
    # The warm CLI's parent (tests/warm_cli.py) gets the session's environment once the test
    # modules are imported (an import at collection may set variables: MONAI sets KMP_*,
    # CUBLAS_WORKSPACE_CONFIG, ...; every run inherits them alike) and before any test changes
    # os.environ.
    BASE_ENV.clear()
    BASE_ENV.update(base_env())


_WARM_BY_DEFAULT = WARM["enabled"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures (module-scoped ones included) start any CLI run: a test marked
    `fresh` (start-up, signals, torchrun, SLURM, Ray, installation) runs its CLI in a new
    interpreter; every other test forks it from the warm parent (ACCEL_TEST_WARM=0: never)."""
    WARM["enabled"] = _WARM_BY_DEFAULT and item.get_closest_marker("fresh") is None


# The modules whose tests take longest (multi-process runs, SLURM jobs, chains of CLI runs), in
# the order pytest-xdist hands them out first (pyproject: --no-loadscope-reorder): a long module
# that started last would keep one test process busy after the others have run out of work.
LONGEST_FIRST = (
    "test_slurm.py",
    "test_ray.py",
    "test_kubernetes.py",
    "test_finetune.py",
    "test_preference.py",
    "test_docs_commands.py",
    "test_distributed.py",
    "test_teardown.py",
    "test_vision_models.py",
    "test_video.py",
    "test_video_extras.py",
    "test_lm_techniques.py",
    "test_harness_eval.py",
    "test_streaming.py",
    "test_streaming_tokens.py",
    "test_async_save.py",
    "test_checkpoint_strategies.py",
    "test_pipeline.py",
    "test_user_code.py",
    "test_memory_techniques.py",
    "test_cli.py",
    "test_signals.py",
    "test_numerics_and_inputs.py",
    "test_resume_integrity.py",
    "test_lock_and_disk.py",
    "test_compress.py",
    "test_export.py",
    "test_holdout.py",
    "test_sweep.py",
    "test_new_user.py",
    "test_report.py",
    "test_install.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable


def _cpu_s() -> float:
    """CPU seconds of this process and of the child processes it has waited for (the CLI runs
    a test starts, with their own children: torchrun workers, loader workers, ...)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = CHILD_CPU_S[0]  # the CLI runs forked from the warm parent (tests/warm_cli.py)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + warm


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """ACCEL_TEST_CPU_LOG=<file>: append each test's CPU seconds (setup, call and teardown,
    its CLI runs included) and wall seconds to <file> as JSON lines. CPU time, unlike wall time,
    barely depends on what else the machine runs: what the suite costs on a quiet 2-core
    machine is about the sum over 2 (tests/cpu_report.py sums a file up)."""
    log = os.environ.get("ACCEL_TEST_CPU_LOG")
    cpu, wall = _cpu_s(), time.monotonic()
    warm, fresh = RUNS["warm"], RUNS["fresh"]
    because = dict(RUNS["fresh_because"])
    yield
    if log:
        row = {"test": item.nodeid, "cpu_s": round(_cpu_s() - cpu, 2)}
        row["wall_s"] = round(time.monotonic() - wall, 2)
        # Its CLI runs: forked warm, started fresh, and the variables that sent them fresh.
        row["warm_runs"], row["fresh_runs"] = RUNS["warm"] - warm, RUNS["fresh"] - fresh
        row["fresh_because"] = {
            k: n - because.get(k, 0)
            for k, n in RUNS["fresh_because"].items()
            if n > because.get(k, 0)
        }
        with open(log, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory) -> Path:
    """A data dir holding MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte: 256 training
    and 64 test images that torchvision's own MNIST class loads."""
    return write_mnist(tmp_path_factory.mktemp("mnist-data"))


@pytest.fixture
def run_cli(tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """run_cli(args, prog="accel-train"|"accel-eval", timeout=..., env=..., cwd=tmp_path)."""

    def run(args, *, cwd: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
        return _run_cli(args, cwd or tmp_path, **kwargs)

    return run


@pytest.fixture(scope="session")
def run_cli_in() -> Callable[..., subprocess.CompletedProcess]:
    """Like run_cli, for module-scoped fixtures: run_cli_in(args, cwd, ...)."""
    return _run_cli


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """moto's standalone S3 server on a free port of 127.0.0.1, for the module that asks (the
    streaming tests: an S3-compatible endpoint on plain http)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


@functools.cache
def _register() -> None:
    register_configs()
    register_resolvers()


@pytest.fixture(scope="session")
def compose_cfg() -> Callable[..., DictConfig]:
    """compose_cfg(overrides, config_name="train"): the composed (unresolved) config."""
    _register()

    def _compose(overrides=(), config_name: str = "train") -> DictConfig:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
            return compose(config_name=config_name, overrides=list(overrides))

    return _compose

"""The warm CLI: the tests' console-script runs forked from a parent that has already imported
torch, Hydra and accel-train, instead of a new interpreter each (3-4 CPU s of imports a run).

One server process per pytest process (started at the first run, stopped at exit) imports what
a run imports and then only waits: it never runs a torch op, never starts a thread and never
initialises CUDA, so a fork of it is what a new interpreter would be after its imports. For
each run it forks a child that takes the run's argv, environment, working directory and
stdin/stdout/stderr (files the client reads back), calls the console script's function as the
script would, and ends the way `accel_train.environment.exit_without_teardown` and a normal exit
do (non-daemon threads joined, atexit handlers, stdio flushed). Hydra's global state, the
ConfigStore's entries, logging handlers, signal handlers and torch's thread settings are the
parent's untouched post-import ones in every child.

`run(...)` returns a subprocess.CompletedProcess as `subprocess.run(capture_output=True,
text=True)` would. Whether a run may go warm is decided by the caller (tests/helpers.py):
tests about start-up, signals, torchrun, SLURM, Ray and installation keep a fresh interpreter
(`@pytest.mark.fresh`), and so does any run whose environment differs from the server's in a
variable read at import time (`warm_env_ok`).

A warm run's torchrun workers are warm too. torchrun starts each worker as `$PYTHON_EXEC -u -m
accel_train.worker CONFIG` (torch.distributed.run's documented override); a warm run has
PYTHON_EXEC pointing at a small stdlib-only stub (`worker_stub`) that hands its argv,
environment, working directory and stdin/stdout/stderr (the descriptors themselves, which the
agent pointed at the rank's log files) to the server, which forks the worker from its warm
state. The stub stays torchrun's child: it forwards the signals the agent sends, ends with the
worker's exit status (a signal's death included), and dies with the agent (PR_SET_PDEATHSIG);
the worker dies with the stub (a pidfd watch), as a worker dies with its launcher
(environment.die_with_launcher).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Environment variables a run may set differently from the server's: read when the command
# runs, never at import time. Any other difference (PYTHONPATH, TMPDIR, OMP_NUM_THREADS,
# TORCH_*, HF_*, ...) means the imports the server did could differ: such a run goes fresh.
RUNTIME_ENV = {
    "ACCEL_TRAIN_DATA_DIR",
    "HYDRA_FULL_ERROR",
    "COLUMNS",
    "LINES",
    "TERM",
    "NO_COLOR",
    "FORCE_COLOR",
    "WANDB_MODE",
    "WANDB_DIR",
    "WANDB_SILENT",
    "MLFLOW_TRACKING_URI",
    "ACCEL_TEST_CPU_LOG",
    "ACCEL_TRAIN_CPU_NATIVE_BF16",  # (precision.py: read at each detection)
    "WANDB_API_KEY",
    # pytest's name of the running test: set in os.environ during each test (never at the
    # session's start, when the server's environment is taken), read by no import.
    "PYTEST_CURRENT_TEST",
    # Inductor's cache folder: read when it compiles (torch._inductor's cache_dir()), and set
    # in the pytest process by an import there (a test's own transformers/torchao): without
    # it here, every run after that import in the process went fresh.
    "TORCHINDUCTOR_CACHE_DIR",
}
# What the server imports: what a training run, an evaluation, an export and a sample import
# on their way (torch._dynamo: torch imports it at the first optimizer step, ~1.7 CPU s).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.utils.data",
    "numpy",
    "hydra",
    "omegaconf",
    "accel_train.cli",
    "accel_train.commands.report",
    "accel_train.launchers.launch",
    "accel_train.train.loop",
    "accel_train.train.build",
    "accel_train.train.evaluate",
    "accel_train.export",
    "accel_train.commands.sample",
    # curves.png at the end of every training run (console.start_curves_plot): matplotlib's
    # import and font cache, ~0.5 CPU s a run.
    "matplotlib",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    # model=timm / the vision recipes, and model=hf / LoRA: timm ~0.9, transformers'
    # modeling_utils + peft ~2 CPU s a run. HF_HUB_OFFLINE is set first, as models/hf.py does
    # before its own import (huggingface_hub reads it at import time).
    "timm",
    "transformers",
    "transformers.modeling_utils",
    "peft",
)


def warm_env_ok(
    env: dict[str, str],
    server_env: dict[str, str],
    imported: set[str],
    imported_with: dict[str, str] | None = None,
) -> bool:
    """True when `env` differs from the server's only in variables read at run time (or set
    to the values its imports ran with), and in a PYTHONPATH that puts folders before the
    server's (a test's user code) holding no module the server has imported (`imported`: its
    top-level names), which they would shadow."""
    differ = env_differences(env, server_env, imported_with)
    if differ - {"PYTHONPATH"}:
        return False
    return not differ or _added_path(env, server_env, imported) is not None


def env_differences(
    env: dict[str, str], server_env: dict[str, str], imported_with: dict[str, str] | None = None
) -> set[str]:
    """The variables `env` sets otherwise than the server's, run-time ones aside, and those it
    sets to the value the server's imports ran with (`imported_with`: its environment after
    them, e.g. HF_HUB_OFFLINE=1 that an in-process test set in the pytest process too)."""
    keys = set(env) | set(server_env)
    differ = {k for k in keys if env.get(k) != server_env.get(k)} - RUNTIME_ENV
    return {k for k in differ if imported_with is None or env.get(k) != imported_with.get(k)}


def _added_path(env: dict[str, str], server_env: dict[str, str], imported: set[str]):
    """The folders env's PYTHONPATH adds before the server's, or None where it changes more or
    they hold a module the server imported."""
    ours = [p for p in server_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if len(theirs) < len(ours) or theirs[len(theirs) - len(ours) :] != ours:
        return None
    added = theirs[: len(theirs) - len(ours)]
    for folder in added:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        if {n.split(".")[0] for n in names} & imported:
            return None
    return added


# ---- the client (in the pytest process) -------------------------------------------------------

# CPU seconds of the warm runs this process waited for (their children included): the test
# suite's CPU log (conftest.py) adds them to its own RUSAGE_CHILDREN, which cannot see them.
CHILD_CPU_S = [0.0]


class WarmServer:
    """One warm parent, started on first use with `env` (the pytest process's run env)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.dir = Path(tempfile.mkdtemp(prefix="accel-warm-"))
        self.socket_path = str(self.dir / "server.sock")
        log = open(self.dir / "server.log", "w")  # noqa: SIM115 - the server's own stderr
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.socket_path, str(Path(sys.executable).parent)],
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(self.socket_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the warm CLI server did not start: {(self.dir / 'server.log').read_text()}"
                )
            time.sleep(0.05)
        # The top-level names of the modules the server imported (warm_env_ok).
        self.imported = set(json.loads(Path(self.socket_path + ".modules.json").read_text()))
        self.imported_with = json.loads(Path(self.socket_path + ".env.json").read_text())
        # torchrun's PYTHON_EXEC for a warm run's workers: this file's worker_stub, started
        # without site-packages (-S: it needs the standard library only, ~20 ms).
        self.python = self.dir / "python"
        here = str(Path(__file__).parent)
        self.python.write_text(
            f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {here!r})\n"
            "from warm_cli import worker_stub\nworker_stub(sys.argv[1:])\n"
        )
        self.python.chmod(0o755)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()

    def run(
        self,
        argv: list[str],
        *,
        cwd: Path,
        env: dict[str, str],
        timeout: float,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """argv[0]: the console script's path. As subprocess.run(argv, capture_output=True,
        text=True, timeout=timeout, input=input, cwd=cwd, env=env)."""
        with tempfile.TemporaryDirectory(prefix="accel-warm-run-") as tmp:
            files = {name: os.path.join(tmp, name) for name in ("stdin", "stdout", "stderr")}
            Path(files["stdin"]).write_text(input or "")
            added = _added_path(env, self.env, self.imported) or []
            # The run's torchrun workers fork from this server too (worker_stub).
            env = {**env, "PYTHON_EXEC": str(self.python), WARM_SOCKET: self.socket_path}
            request = {"argv": argv, "cwd": str(cwd), "env": env, "path": added, **files}
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.socket_path)
            sock.sendall(b"R")  # a run (a worker stub sends its descriptors with this byte)
            with sock, sock.makefile("rwb") as stream:
                stream.write(json.dumps(request).encode() + b"\n")
                stream.flush()
                pid = json.loads(stream.readline())["pid"]
                sock.settimeout(timeout)
                try:
                    reply = json.loads(stream.readline())
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)  # as subprocess.run kills its child
                    raise subprocess.TimeoutExpired(argv, timeout) from None
            # Text as subprocess.run(text=True) gives it: the locale's encoding, newlines
            # translated.
            stdout, stderr = (_read_text(files[name]) for name in ("stdout", "stderr"))
        CHILD_CPU_S[0] += reply["cpu_s"]
        return subprocess.CompletedProcess(argv, reply["returncode"], stdout, stderr)


def _read_text(path: str) -> str:
    with open(path) as f:  # text mode: newlines translated, as subprocess.run(text=True)
        return f.read()


WARM_SOCKET = "ACCEL_TEST_WARM_SOCKET"  # the server's socket, for a warm run's worker stubs


def worker_stub(argv: list[str]) -> None:
    """torchrun's worker process in a warm run (PYTHON_EXEC): the server forks the real worker
    with this process's argv, environment, working directory and stdio; this process forwards
    the agent's signals to it and ends as it ended. Never returns."""
    import ctypes

    # Dies with the agent (SIGKILL, as environment.die_with_launcher's workers do); the worker
    # then dies with this process (_watch_stub).
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ[WARM_SOCKET])
    socket.send_fds(sock, [b"W"], [0, 1, 2])
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "stub": os.getpid()}
    sock.sendall(json.dumps(request).encode() + b"\n")
    stream = sock.makefile("rb")
    pid = json.loads(stream.readline())["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda sig, _frame: os.kill(pid, sig))
    code = json.loads(stream.readline())["returncode"]
    if code < 0:  # killed by a signal: so is the stub, for torchrun's agent to see
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# ---- the server (a process of its own: `python warm_cli.py SOCKET BIN`) ------------------------


def _serve(socket_path: str, bin_dir: str) -> None:
    import importlib

    # As models/hf.py before its import of transformers: offline (huggingface_hub reads it at
    # import time; a run whose environment sets HF_* itself goes fresh, warm_env_ok), and
    # torchao's pytree notes at import kept out of the server's log.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    for name in PRELOAD:
        importlib.import_module(name)
    pytree.setLevel(level)  # a run's own level, as a new interpreter's
    # The parent must stay single-threaded: a fork copies only the forking thread, and a lock
    # another thread held would stay locked in the child forever.
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise SystemExit(f"warm CLI server: {len(threads)} threads after the imports")
    imported = sorted({name.split(".")[0] for name in sys.modules})
    Path(socket_path + ".modules.json").write_text(json.dumps(imported))
    # Its environment after the imports (HF_HUB_OFFLINE=1, set above): a run that sets a
    # variable to the value the server itself imported with may fork (warm_env_ok).
    Path(socket_path + ".env.json").write_text(json.dumps(dict(os.environ)))
    parent = os.getppid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    listener.listen(16)
    os.rename(socket_path + ".tmp", socket_path)  # the client waits for this name
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # child pid -> the connection waiting for it
    while os.getppid() == parent:  # the pytest process is gone: so is its server
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                _, fds, _, _ = socket.recv_fds(conn, 1, 3)  # a worker stub's stdio, or none
                request = json.loads(conn.makefile("rb").readline())
                request["stdio"] = fds
                pid = os.fork()
                if pid == 0:
                    _child(request, bin_dir, [listener.fileno(), conn.fileno(), wake_r, wake_w])
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                running[pid] = (conn, bool(fds))
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
        _reap(running)


# CPU seconds of finished workers (forked for stubs), not yet reported to a run's client.
WORKERS_CPU_S = [0.0]


def _reap(running: dict[int, tuple[socket.socket, bool]]) -> None:
    for pid in list(running):
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            conn, worker = running.pop(pid)
            # The child's CPU time and its waited-for children's (a subprocess' would count
            # in the client's RUSAGE_CHILDREN): the client adds it to CHILD_CPU_S. A worker's
            # goes with the next run's reply: the run that started it ends after it.
            cpu = usage.ru_utime + usage.ru_stime
            if worker:
                WORKERS_CPU_S[0] += cpu
            else:
                cpu, WORKERS_CPU_S[0] = cpu + WORKERS_CPU_S[0], 0.0
            reply = {"returncode": os.waitstatus_to_exitcode(status), "cpu_s": cpu}
            with contextlib.suppress(OSError):  # the client timed out and left
                conn.sendall(json.dumps(reply).encode() + b"\n")
            conn.close()


def _child(request: dict, bin_dir: str, server_fds: list[int]) -> None:
    """In the forked child: become the run, then end as the console script would. Never
    returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        # What a new interpreter has: Python ignores SIGPIPE and handles SIGINT itself.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in server_fds:
            os.close(fd)
        _take_stdio(request)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if request["stdio"]:  # a worker stub's: `python -u -m accel_train.worker CONFIG`
            code = _run_worker(request)
            raise SystemExit(code)
        argv = request["argv"]
        sys.argv = list(argv)
        # A console script's sys.path: its folder first, then PYTHONPATH's folders.
        sys.path[0:1] = [os.path.dirname(argv[0]), *request["path"]]
        if "numpy" in sys.modules:  # a new interpreter seeds numpy's global RNG afresh
            sys.modules["numpy"].random.seed()
        code = _call_script(os.path.basename(argv[0]))
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        import atexit
        import threading

        threading._shutdown()  # noqa: SLF001 - a normal exit's order (environment.py)
        atexit._run_exitfuncs()  # noqa: SLF001
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _take_stdio(request: dict) -> None:
    """fds 0-2: a worker stub's own (sent over the socket), or a run's files."""
    if request["stdio"]:
        for fd, received in enumerate(request["stdio"]):
            os.dup2(received, fd)
            os.close(received)
        return
    for fd, name, flags in (
        (0, "stdin", os.O_RDONLY),
        (1, "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(request[name], flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)


def _run_worker(request: dict) -> int:
    """The worker `python -u -m MODULE ARGS` would be (stdio is unbuffered already: the suite
    runs with PYTHONUNBUFFERED), watched by its stub."""
    import runpy
    import threading

    assert request["argv"][:2] == ["-u", "-m"], request["argv"]
    module, *args = request["argv"][2:]
    # `-m`: the working directory first on sys.path, then PYTHONPATH's folders.
    extra = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.path[0:1] = [os.getcwd(), *(p for p in extra if p and p not in sys.path)]
    if "OMP_NUM_THREADS" in os.environ:  # torchrun's per-worker setting, as a new process reads it
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    stub = os.pidfd_open(request["stub"])
    threading.Thread(target=_die_with, args=(stub,), name="warm-stub-watch", daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def _die_with(pidfd: int) -> None:
    """SIGKILL this worker when its stub is gone (the pidfd becomes readable)."""
    import select

    select.select([pidfd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def _call_script(name: str) -> int:
    """The console script's function, called as its generated script does:
    `sys.exit(main())`."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == name]
    return _exit_code(script.load()())


def _exit_code(value) -> int:
    """sys.exit(value)'s exit status: None is 0, an int itself, anything else printed, 1."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2])

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


def warm_env_ok(env: dict[str, str], server_env: dict[str, str], imported: set[str]) -> bool:
    """True when `env` differs from the server's only in variables read at run time, and in a
    PYTHONPATH that puts folders before the server's (a test's user code) holding no module the
    server has imported (`imported`: its top-level names), which they would shadow."""
    keys = set(env) | set(server_env)
    differ = {k for k in keys if env.get(k) != server_env.get(k)} - RUNTIME_ENV
    if differ - {"PYTHONPATH"}:
        return False
    return not differ or _added_path(env, server_env, imported) is not None


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
            request = {"argv": argv, "cwd": str(cwd), "env": env, "path": added, **files}
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.socket_path)
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
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    _child(request, bin_dir, [listener.fileno(), conn.fileno(), wake_r, wake_w])
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                running[pid] = conn
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
        _reap(running)


def _reap(running: dict[int, socket.socket]) -> None:
    for pid in list(running):
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            conn = running.pop(pid)
            # The child's CPU time and its waited-for children's (a subprocess' would count
            # in the client's RUSAGE_CHILDREN): the client adds it to CHILD_CPU_S.
            cpu = usage.ru_utime + usage.ru_stime
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
        for fd, name, flags in (
            (0, "stdin", os.O_RDONLY),
            (1, "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            opened = os.open(request[name], flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
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

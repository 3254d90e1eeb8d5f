"""One writer per run dir, stale temp files, and a checkpoint dir that is full or read-only.

Through the real CLI, as one scenario on one run dir (each `accel-train` start costs seconds):

1. run A trains, saving last.pt every step into a small tmpfs mounted on its checkpoints dir;
2. a second `accel-train` on the same dir is refused, naming A's pid, touching none of A's files;
3. the tmpfs is filled: A's next save fails with one paragraph (path, free space), exit 2, and
   last.pt is the one saved before;
4. with A gone (its lock with it) and the space back, run B resumes in the same dir: a dead
   holder blocks nothing, and the temp files planted there (as killed saves leave them) go;
5. the tmpfs is remounted read-only: run C's first save fails with one paragraph, last.pt intact.

Mounting needs root (CAP_SYS_ADMIN); without it the checkpoints dir is a plain directory, A is
stopped with SIGTERM instead of the full disk, and C writes under RLIMIT_FSIZE (EFBIG, a write
the kernel refuses, like a full disk) instead of a read-only mount. The lock's own rules
(workers keeping the dir after their launcher died, who takes the lock) and the temp-file
rules are checked in-process.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import BIN, FAST, read_jsonl
from omegaconf import OmegaConf

from accel_train import checkpoint as ckpt_io
from accel_train.errors import UserError
from accel_train.launchers import lock
from accel_train.loggers import MetricsLogger

# A small model (a ~0.6 MB checkpoint) and slow steps (a loop hook sleeps), so that run A is
# still training while the other runs come and go.
RUN = [
    *FAST,
    "model.hidden_dims=[64]",
    "loader.batch_size=32",
    "trainer.max_epochs=1000",
    "trainer.log_every_n_steps=1",
    "trainer.ckpt_every_n_steps=1",
    "trainer.test_after_fit=false",
    "trainer.deterministic=true",
    "logger=none",
]
SLOW_HOOK = """
import time
from accel_train.techniques import Technique

class Slow(Technique):
    def on_train_step_end(self, loop):
        time.sleep(0.3)
"""
SLOW = ["+callbacks.slow._target_=slowhook.Slow"]
FS_SIZE = "8m"


def _env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["ACCEL_TRAIN_DATA_DIR"] = str(cwd / "no-data-here")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start(args: list[str], cwd: Path, name: str, fsize: int | None = None) -> subprocess.Popen:
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    out = open(cwd / f"{name}.log", "w")  # noqa: SIM115 (closed by finish)
    proc = subprocess.Popen(
        [str(BIN / "accel-train"), *args],
        cwd=cwd,
        env=_env(cwd),
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=limit_file_size if fsize else None,
    )
    proc.log = cwd / f"{name}.log"  # type: ignore[attr-defined]
    proc.out = out  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.out.close()  # type: ignore[attr-defined]
    return code, proc.log.read_text()  # type: ignore[attr-defined]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout=180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        path = run_dir / "metrics.jsonl"
        rows = read_jsonl(path) if path.exists() else []
        if any(r.get("step", -1) >= step and "train/loss" in r for r in rows):
            return
        assert proc.poll() is None, proc.log.read_text()[-3000:]  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"no step {step} after {timeout} s"
        time.sleep(0.05)


def _mount(target: Path, options: str) -> bool:
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def _fill(where: Path) -> None:
    """Write zeros until the filesystem has no byte left."""
    fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 20, 4096, 1):
            block = b"\0" * chunk
            while True:
                try:
                    os.write(fd, block)
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


def _snapshot(run_dir: Path) -> dict[str, tuple[int, bytes]]:
    """The files a run writes once at its start, with their mtimes and contents."""
    names = [".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml", "config.yaml"]
    names += ["config_tree.txt", ".lock"]
    return {n: ((run_dir / n).stat().st_mtime_ns, (run_dir / n).read_bytes()) for n in names}


def _paragraph(output: str) -> str:
    """The one error paragraph; there must be exactly one and no traceback."""
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("accel-train: error:")]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("lock_and_disk")
    (cwd / "slowhook.py").write_text(SLOW_HOOK)
    run_dir = cwd / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    mounted = _mount(ckpts, f"size={FS_SIZE}")
    seen: dict = {"mounted": mounted, "run_dir": run_dir}
    a = None
    try:
        # 1. A trains.
        a = start([*RUN, *SLOW, f"hydra.run.dir={run_dir}"], cwd, "a")
        seen["a_pid"] = a.pid
        wait_for_step(a, run_dir, 2)
        # 2. A second run on A's dir.
        before = _snapshot(run_dir)
        seen["contender"] = finish(
            start([*RUN, "trainer.seed=7", f"hydra.run.dir={run_dir}"], cwd, "contender")
        )
        seen["untouched"] = before == _snapshot(run_dir)
        # 3. The disk fills up under A (or A is stopped).
        if mounted:
            _fill(ckpts)
            seen["a"] = finish(a)
        else:
            a.send_signal(signal.SIGTERM)
            seen["a"] = finish(a)
        last = ckpts / "last.pt"
        seen["last_after_a"] = last.read_bytes()
        step = ckpt_io.load_checkpoint(last)["progress"]["step"]
        seen["step_a"] = step
        seen["temps_after_a"] = sorted(p.name for p in ckpts.iterdir() if ".tmp" in p.name)
        with contextlib.suppress(FileNotFoundError):
            (ckpts / "filler").unlink()
        # 4. B resumes in A's dir, where killed saves left temp files.
        dead = subprocess.Popen(["true"])
        dead.wait()
        planted = [
            ckpts / f".last.pt.tmp-{dead.pid}",
            ckpts / f".best.pt.tmp-{os.getpid()}",  # a live pid: stale all the same (locked)
            run_dir / f".config.yaml.tmp-{dead.pid}",
        ]
        for path in planted:
            path.write_bytes(b"half of a save")
        for name in (".last.dcp.tmp", ".last.dcp.old"):
            (ckpts / name).mkdir()
            (ckpts / name / "__0_0.distcp").write_bytes(b"shard")
        (ckpts / "last.dcp").mkdir()
        seen["planted"] = [*planted, ckpts / ".last.dcp.tmp", ckpts / ".last.dcp.old"]
        seen["b"] = finish(
            start(
                [*RUN, "resume=auto", f"trainer.max_steps={step + 2}", f"hydra.run.dir={run_dir}"],
                cwd,
                "b",
            )
        )
        seen["b_step"] = ckpt_io.load_checkpoint(last)["progress"]["step"]
        # 5. A read-only checkpoints dir (or a file size limit the checkpoint exceeds).
        seen["last_before_c"] = last.read_bytes()
        c_args = [*RUN, "resume=auto", f"trainer.max_steps={step + 6}", f"hydra.run.dir={run_dir}"]
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(ckpts)], check=True)
            seen["c"] = finish(start(c_args, cwd, "c"))
            subprocess.run(["mount", "-o", "remount,rw", str(ckpts)], check=True)
        else:
            seen["c"] = finish(start(c_args, cwd, "c", fsize=len(seen["last_before_c"]) // 2))
        seen["last_after_c"] = last.read_bytes()
        seen["temps_after_c"] = sorted(p.name for p in ckpts.iterdir() if ".tmp" in p.name)
        yield seen
    finally:
        if a is not None and a.poll() is None:  # a step above failed: don't leave A training
            a.kill()
            a.wait()
        if mounted:
            subprocess.run(["umount", "-l", str(ckpts)], check=False)


def test_second_run_on_a_live_run_dir_is_refused(scenario):
    code, out = scenario["contender"]
    assert code == 2, out[-3000:]
    error = _paragraph(out)
    assert f"is in use by accel-train pid {scenario['a_pid']} on host {socket.gethostname()}" in (
        error
    )
    assert f"kill -TERM {scenario['a_pid']}" in error
    assert scenario["untouched"], "the refused run changed files of the live one"
    train_log = (scenario["run_dir"] / "train.log").read_text()
    assert "trainer.seed=7" not in train_log and "seed: 7" not in train_log


def test_full_disk_during_a_save_is_one_paragraph_and_keeps_last_pt(scenario):
    if not scenario["mounted"]:
        pytest.skip("mounting a tmpfs needs root here; the file-size-limit run covers the path")
    code, out = scenario["a"]
    assert code == 2, out[-3000:]
    error = _paragraph(out)
    ckpts = scenario["run_dir"] / "checkpoints"
    assert f"could not write the checkpoint {ckpts}/" in error
    assert "No space left on device (ENOSPC)" in error and "free of" in error
    assert "resume=auto" in error
    # last.pt is the checkpoint of the last step saved before the disk filled; no temp left.
    assert scenario["temps_after_a"] == []
    assert scenario["step_a"] >= 2


def test_dead_holder_does_not_block_and_stale_temps_are_removed(scenario):
    code, out = scenario["b"]
    assert code == 0, out[-3000:]
    assert scenario["b_step"] == scenario["step_a"] + 2  # resumed and finished
    for path in scenario["planted"]:
        assert not path.exists(), f"{path} was left"
    assert (scenario["run_dir"] / "checkpoints" / "last.dcp").is_dir()  # not a temp: kept
    assert "removed " in out and ".last.pt.tmp-" in out
    holder = lock.holders(scenario["run_dir"] / ".lock")
    assert [h["kind"] for h in holder] == ["launcher"]  # B's line replaced A's


def test_unwritable_checkpoint_dir_is_one_paragraph_and_keeps_last_pt(scenario):
    code, out = scenario["c"]
    assert code == 2, out[-3000:]
    error = _paragraph(out)
    ckpts = scenario["run_dir"] / "checkpoints"
    assert f"could not write the checkpoint {ckpts}/last.pt" in error
    reason = "(EROFS)" if scenario["mounted"] else "(EFBIG)"
    assert reason in error and "free of" in error
    assert scenario["last_after_c"] == scenario["last_before_c"]
    assert scenario["temps_after_c"] == []


# ---- the lock's rules, in-process ---------------------------------------------------------


def test_workers_keep_the_run_dir_after_their_launcher_died(tmp_path):
    """torchrun starts workers in sessions of their own, so they may outlive a SIGKILLed
    launcher (for the moment their parent-death signal takes: test_signals.py); they joined its
    lock, so the dir stays theirs while they live. (Forks stand in for the processes: the
    worker drops the descriptor it inherited, as an exec'd one would not have it.)"""
    pid_r, pid_w = os.pipe()
    go_r, go_w = os.pipe()
    launcher = os.fork()
    if launcher == 0:
        code = 3
        try:
            lock.acquire(tmp_path)
            inherited = lock._held.fd
            if os.fork() == 0:
                os.close(inherited)
                lock._held = None
                lock.acquire(tmp_path, shared=True)  # finds $ACCEL_TRAIN_RUN_LOCK
                os.write(pid_w, f"{os.getpid()}\n".encode())
                os.write(go_w, b"x")
                time.sleep(120)
                os._exit(0)
            os.read(go_r, 1)
            code = 0
        finally:
            os._exit(code)  # dies without releasing anything itself
    assert os.waitstatus_to_exitcode(os.waitpid(launcher, 0)[1]) == 0
    worker = int(os.read(pid_r, 100).decode())
    try:
        with pytest.raises(UserError) as refused:
            lock.acquire(tmp_path)
        text = str(refused.value)
        assert f"accel-train pid {launcher} " in text
        assert f"which has exited; its workers ({worker}) still hold it" in text
        assert f"kill -TERM {worker}" in text
    finally:
        os.kill(worker, signal.SIGKILL)
        for _ in range(200):
            if not Path(f"/proc/{worker}").exists() or "Z" in _state(worker):
                break
            time.sleep(0.05)
    try:
        assert lock.acquire(tmp_path)  # the last holder is gone
        assert os.environ[lock.ENV_VAR] == str(tmp_path.resolve() / ".lock")
    finally:
        lock.release()
    assert lock.ENV_VAR not in os.environ


def test_a_submission_only_checks_the_lock(tmp_path):
    """`launcher=slurm` on the login node refuses a held dir but takes nothing: the job's own
    rank 0 takes the lock when it starts."""
    ready_r, ready_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        try:
            lock.acquire(tmp_path)
            os.write(ready_w, b"x")
            time.sleep(120)
        finally:
            os._exit(0)
    os.read(ready_r, 1)
    try:
        with pytest.raises(UserError, match=f"in use by accel-train pid {holder} "):
            lock.check_free(tmp_path)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    lock.check_free(tmp_path)  # free: and still free afterwards, nothing was taken
    lock.check_free(tmp_path)


def _state(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return "gone"


def _cfg(nnodes="1", launcher="local", run_dir="/tmp/run"):
    return OmegaConf.create(
        {"paths": {"output_dir": run_dir}, "launcher": {"name": launcher, "nnodes": nnodes}}
    )


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}


@pytest.mark.parametrize(
    ("cfg", "env", "expected"),
    [
        (_cfg(), {}, "hold"),  # in-process or single-node torchrun: the launcher
        (_cfg(nnodes="2"), {}, "skip"),  # a node of a multi-node run: rank 0 takes it
        (_cfg(launcher="slurm"), {}, "check"),  # submits; the job takes it
        (_cfg(), {**TORCHRUN, "MASTER_PORT": "1"}, "hold"),  # rank 0 under a user's torchrun
        (_cfg(), {**TORCHRUN, "MASTER_PORT": "1", "RANK": "1"}, "skip"),
        (
            _cfg(),
            {**TORCHRUN, "MASTER_PORT": "1", "RANK": "1", lock.ENV_VAR: "/tmp/run/.lock"},
            "join",  # a worker of our own launcher
        ),
        (
            _cfg(),
            {"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}
            | {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2"},
            "skip",  # srun: one node agent per node of two
        ),
        (
            _cfg(),
            {"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}
            | {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "4"},
            "hold",  # srun: one task per process, this is rank 0
        ),
    ],
)
def test_who_takes_the_lock(cfg, env, expected, monkeypatch):
    for var in (*TORCHRUN, "MASTER_PORT", "SLURM_JOB_ID", lock.ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert lock.role(cfg) == expected


# ---- temp files of killed saves, in-process -------------------------------------------------


def _dcp(path: Path, complete: bool) -> Path:
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (path / ".metadata").write_bytes(b"meta")
        (path / "meta.pt").write_bytes(b"progress")
    return path


@pytest.mark.parametrize("tmp_complete", [True, False])
def test_a_sharded_save_killed_between_its_renames_is_put_back(tmp_path, tmp_complete):
    """No last.dcp, the previous one as .old, the new one as .tmp: the new one if whole."""
    _dcp(tmp_path / ".last.dcp.old", complete=True)
    (tmp_path / ".last.dcp.old" / "which").write_text("old")
    _dcp(tmp_path / ".last.dcp.tmp", complete=tmp_complete)
    (tmp_path / ".last.dcp.tmp" / "which").write_text("new")
    ckpt_io.remove_stale_temps(tmp_path, locked=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"]
    expected = "new" if tmp_complete else "old"
    assert (tmp_path / "last.dcp" / "which").read_text() == expected


def test_without_the_lock_only_temps_of_dead_processes_go(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp_path / f".last.pt.tmp-{dead.pid}"
    live = tmp_path / f".last.pt.tmp-{os.getpid()}"
    sharded = _dcp(tmp_path / ".last.dcp.tmp", complete=False)
    for path in (gone, live):
        path.write_bytes(b"x")
    assert ckpt_io.remove_stale_temps(tmp_path, locked=False) == [gone]
    assert live.exists() and sharded.exists()


def test_atomic_save_turns_a_failed_write_into_a_user_error(tmp_path, monkeypatch):
    """The in-process view of the CLI runs above: the temp file goes, the old file stays."""
    path = tmp_path / "last.pt"
    ckpt_io.atomic_save({"v": torch.zeros(3)}, path)
    before = path.read_bytes()
    real_fsync = os.fsync

    def full(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".last.pt.tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match=r"No space left on device \(ENOSPC\); .* free of "):
        ckpt_io.atomic_save({"v": torch.ones(3)}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_stale_temp_names_match_what_atomic_save_writes(tmp_path):
    path = tmp_path / "best.pt"
    assert ckpt_io.temp_path(path).name == f".best.pt.tmp-{os.getpid()}"
    ckpt_io.temp_path(path).write_bytes(b"half of a save")
    assert ckpt_io.remove_stale_temps(tmp_path, locked=True) == [ckpt_io.temp_path(path)]


@pytest.fixture
def one_rank_group():
    """A process group of one (gloo), for save_sharded's barriers."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded_save(path: Path, value: float) -> None:
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = {"format": ckpt_io.FORMAT_VERSION, "progress": {"step": int(value)}}
    ckpt_io.save_sharded(model, optimizer, meta, path, is_main=True)


def test_a_failed_sharded_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, one_rank_group):
    path = tmp_path / "last.dcp"
    _sharded_save(path, 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"]

    # A rank's write fails: DCP gathers it into a CheckpointException (a BaseException).
    def full(*args, **kwargs):
        error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise dcp.CheckpointException("save failed", {0: (error, None)})

    with monkeypatch.context() as patch:
        patch.setattr(dcp, "save", full)
        with pytest.raises(UserError, match=r"last\.dcp: No space left on device \(ENOSPC\)"):
            _sharded_save(path, 2.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"]
    assert ckpt_io.load_sharded_meta(path, "resume")["progress"]["step"] == 1

    # The new one cannot be renamed into place once the old one was moved aside: back it comes.
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(src).name == ".last.dcp.tmp":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(UserError, match=r"Input/output error \(EIO\)"):
        _sharded_save(path, 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"]
    assert ckpt_io.load_sharded_meta(path, "resume")["progress"]["step"] == 1


def test_a_full_disk_while_logging_metrics_is_one_paragraph(tmp_path):
    """metrics.jsonl written on a full disk: a UserError naming the run dir and the free space
    (the loop's caller prints it as one paragraph, exit 2), not an OSError traceback."""

    class FullDisk(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    metrics = MetricsLogger(tmp_path, "none")
    metrics.log({"train/loss": 1.0}, 1, 0)
    metrics.jsonl = FullDisk()
    with pytest.raises(UserError) as err:
        metrics.log({"train/loss": 0.5}, 2, 0)
    message = str(err.value)
    assert str(tmp_path) in message and "No space left on device" in message
    assert "MiB free" in message and "resume=auto" in message
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1  # the written row is kept

"""Helpers shared by the benchmark scripts: run the real CLI, read its metrics, print tables."""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The shared data beside the checkout (<repo>/../shared/data), written relative to the current
# dir so that the tables the scripts print name no machine's path.
DEFAULT_DATA_DIR = os.environ.get(
    "ACCEL_TRAIN_DATA_DIR", os.path.relpath(REPO.parent / "shared" / "data")
)


def console_script(name: str) -> str:
    """The console script next to this interpreter (the venv's), else the one on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        sys.exit(f"{name} not found next to {sys.executable} or on PATH: pip install -e .")
    return found


# glibc malloc settings that stop it from handing freed memory back to the OS (and page-faulting
# it in again on the next step): mmap only above 32 MiB, never trim the heap top.
MALLOC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def child_env(threads: int | None, malloc_tuned: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    if malloc_tuned:
        env.update(MALLOC_TUNED)
    return env


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, dict]:
    """Run cmd to completion; also its wall time, minor page faults and system CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    usage = {
        "wall": wall,
        "minflt": after.ru_minflt - before.ru_minflt,
        "sys": after.ru_stime - before.ru_stime,
    }
    return proc, usage


def run_cli(
    overrides: list[str],
    *,
    threads: int | None,
    run_dir: Path | None = None,
    malloc_tuned: bool = False,
) -> tuple[Path, dict]:
    """`accel-train <overrides> hydra.run.dir=<run_dir>` in a subprocess; (run dir, usage)."""
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="accel_bench_"))
    # Both sides of a comparison get the same allocator settings (accel-train's own switch, or
    # the environment variables for the hand-written loop).
    cmd = [
        console_script("accel-train"),
        *overrides,
        f"trainer.tune_malloc={str(malloc_tuned).lower()}",
        f"hydra.run.dir={run_dir}",
    ]
    proc, usage = run_child(cmd, child_env(threads, malloc_tuned))
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        sys.exit(f"accel-train failed (exit {proc.returncode}): {' '.join(cmd)}")
    return run_dir, usage


def epoch_times(run_dir: Path) -> list[float]:
    """The `train/epoch_s` values accel-train wrote to metrics.jsonl, one per epoch."""
    times = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/epoch_s" in row:
            times.append(float(row["train/epoch_s"]))
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine() -> str:
    import torch

    return (
        f"{platform.machine()} {os.cpu_count()} CPU cores ({_cpu_model()}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"python {platform.python_version()}"
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain-text table (Markdown-compatible, so it pastes into BENCHMARKS.md as is)."""
    cols = [headers, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(headers))]

    def line(r):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def cpu_busy(seconds: float = 1.0) -> float:
    """The whole machine's CPU busy fraction over the next `seconds` (from /proc/stat), or NaN."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    try:
        b0, t0 = sample()
        time.sleep(seconds)
        b1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return float("nan")
    return (b1 - b0) / max(t1 - t0, 1)


def composed(overrides: list[str]):
    """The resolved config `accel-train <overrides>` would run (Hydra's compose API), for the
    benchmarks that build accel-train's own data, loaders and models in-process."""
    from hydra import compose, initialize_config_dir

    from accel_train.config import CONFIG_DIR
    from accel_train.config.run_config import resolve
    from accel_train.config.schema import register_configs
    from accel_train.environment import register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        cfg = compose("train", overrides=[*overrides, "paths.output_dir=unused"])
    return resolve(cfg)


def timed(cmd: list[str], cwd=None) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run a benchmark child to the end: (the process, wall s, CPU s of it); exit on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        sys.exit(f"failed: {' '.join(cmd)}")
    return proc, wall, cpu


def fresh_tree(root: Path, stamp: str) -> Path | None:
    """None when `root` holds a tree this script family finished with the same `stamp` (its
    COMPLETE file); else an empty `<root>.tmp` to write into, then `finish_tree`. A folder of
    other files at `root` is refused, never replaced."""
    done = root / "COMPLETE"
    if done.is_file() and done.read_text() == stamp:
        return None
    if root.is_dir() and not done.is_file() and any(root.iterdir()):
        raise SystemExit(f"{root} holds files this script did not write: give a new folder")
    shutil.rmtree(root, ignore_errors=True)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def finish_tree(tmp: Path, root: Path, stamp: str) -> None:
    """Stamp the written tree and move it into place (a killed run leaves only `<root>.tmp`)."""
    (tmp / "COMPLETE").write_text(stamp)
    tmp.rename(root)

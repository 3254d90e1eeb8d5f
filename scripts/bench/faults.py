"""Faults: kill a run 30 times (SIGKILL, SIGTERM, SIGINT) at seeded random moments, resume it
with `resume=auto` each time, and compare its final weights with an uninterrupted run.

The run saves last.pt after every optimizer step (`trainer.ckpt_every_n_steps=1`), so many
kills land inside a save; a third of the moments wait for a save's temp file to appear and kill
right then. Reported per signal:

  * survived: the next start resumed from the checkpoint the killed process left (or started
    fresh when it had none yet) and the run went on; the run survives as a whole if it ends
    with the uninterrupted run's weights, bit for bit (trainer.deterministic=true, CPU);
  * steps lost: the last step the killed process logged (a metrics line every step) minus the
    step the next start resumed from; at most ckpt_every_n_steps (1) for SIGKILL, 0 is the aim
    for SIGTERM/SIGINT (they checkpoint at the step they stop at), 1 is allowed;
  * exit status: -9 for SIGKILL, 143 / 130 for SIGTERM / SIGINT (128 + signum);
  * temp files (.last.pt.tmp-<pid>, ...) found right after the kill, and still in the run dir
    once the next start is training (each start removes the stale ones: it holds the lock).

    python scripts/bench/faults.py                       # 30 kills, seed 0: a few minutes
    python scripts/bench/faults.py --kills 9 --seed 1    # a quicker look
    python scripts/bench/faults.py --async-save          # saves written in the background

With `--async-save` (checkpoint.async_save=true) a SIGKILL may also land while a save is still
being written in the background: the next start resumes from the save before it, so up to 2
steps may be lost (the step of the save in flight and the one after it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import child_env, console_script, load_avg, machine, table

# A tiny deterministic run: an MLP with one hidden layer of 64 on 460 synthetic digits, 16 per
# batch (29 steps per epoch), validation every epoch, last.pt after every step.
RUN = [
    "model=mlp",
    "model.hidden_dims=[64]",
    "dataset=synthetic",
    "dataset.num_train=512",
    "dataset.num_test=64",
    "loader.batch_size=16",
    "trainer.max_epochs=1000",
    "trainer.ckpt_every_n_steps=1",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "trainer.test_after_fit=false",
    "trainer.progress=none",
    "logger=none",
]
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
MOMENTS = ("random", "random", "in a save")
TEMP_MARKERS = (".tmp-", ".dcp.tmp", ".dcp.old")


@dataclass
class Kill:
    signum: signal.Signals
    moment: str
    delay: float
    exit_code: int | None = None
    last_logged: int = 0  # the last step the killed process logged
    resumed_from: int | None = None  # the step the next start resumed from (0: fresh)
    temps_after_kill: list[str] = field(default_factory=list)
    temps_after_restart: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int | None:
        return None if self.resumed_from is None else self.last_logged - self.resumed_from

    @property
    def expected_exit(self) -> int:
        return -9 if self.signum == signal.SIGKILL else 128 + self.signum


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by the kill
            rows.append(json.loads(line))
    return rows


def temps(run_dir: Path, running: int | None = None) -> list[str]:
    """Temp files of saves in the run dir, but the one the running process (pid) is writing."""
    return sorted(
        str(p.relative_to(run_dir))
        for p in run_dir.rglob(".*")
        if any(m in p.name for m in TEMP_MARKERS) and not p.name.endswith(f".tmp-{running}")
    )


def start(run_dir: Path, steps: int, log: Path, resume: bool) -> subprocess.Popen:
    cmd = [
        console_script("accel-train"),
        *RUN,
        f"trainer.max_steps={steps}",
        *(["resume=auto"] if resume else []),
        f"hydra.run.dir={run_dir}",
    ]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(threads=1))


# Where a start's own rows begin in metrics.jsonl. A start that resumes rewrites the file first
# (it drops the rows logged after the checkpoint, to log those steps again) and then logs a
# resume event, which stays: its rows are the ones after its resume event. A start with nothing
# to resume from rewrites nothing: its rows are the ones after the file's length before it.
Marker = tuple[str, int]  # ("resume", how many resume events precede it) or ("index", rows)


def own_rows(run_dir: Path, marker: Marker) -> list[dict] | None:
    """The rows this start logged (None: it has not written its resume event yet)."""
    rows = metrics(run_dir)
    kind, n = marker
    if kind == "index":
        return rows[n:]
    events = [i for i, r in enumerate(rows) if r.get("event") == "resume"]
    return rows[events[n] :] if len(events) > n else None


def marker_for_restart(run_dir: Path) -> Marker:
    rows = metrics(run_dir)
    if (run_dir / "checkpoints" / "last.pt").exists():
        return ("resume", sum(r.get("event") == "resume" for r in rows))
    return ("index", len(rows))


def wait_training(proc: subprocess.Popen, run_dir: Path, marker: Marker, timeout=300) -> bool:
    """Until this start logged its first step (False: it ended first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("train/loss" in r for r in own_rows(run_dir, marker) or []):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise SystemExit(f"no training step after {timeout} s")


def kill_at(proc: subprocess.Popen, run_dir: Path, kill: Kill) -> None:
    if kill.moment == "in a save":
        # As soon as a save's temp file exists (one save per step, ~10-20 ms with its fsync).
        deadline = time.monotonic() + 10
        ckpts = run_dir / "checkpoints"
        while time.monotonic() < deadline and proc.poll() is None:
            if ckpts.is_dir() and any(p.name.startswith(".last.pt.tmp-") for p in ckpts.iterdir()):
                break
            time.sleep(0.0005)
    else:
        time.sleep(kill.delay)
    if proc.poll() is None:
        proc.send_signal(kill.signum)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=1.5, help="s after the first step")
    p.add_argument("--steps-per-kill", type=int, default=40, help="sets trainer.max_steps")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--async-save", action="store_true", help="checkpoint.async_save=true")
    a = p.parse_args()
    if a.async_save:
        RUN.append("checkpoint.async_save=true")
    rng = random.Random(a.seed)
    steps = a.steps_per_kill * a.kills
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="accel_bench_faults_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; load average at start: {load_avg()}")
    print(f"run dirs under {workdir}; {steps} steps; seed {a.seed}", flush=True)
    t0 = time.perf_counter()

    reference = workdir / "reference"
    proc = start(reference, steps, workdir / "reference.log", resume=False)
    if proc.wait() != 0:
        sys.exit(f"the uninterrupted run failed: see {workdir / 'reference.log'}")
    print(f"uninterrupted run: {time.perf_counter() - t0:.0f} s", flush=True)

    plan = [s for s in SIGNALS for _ in range(a.kills // len(SIGNALS))]
    plan += list(SIGNALS[: a.kills - len(plan)])
    rng.shuffle(plan)
    kills = [Kill(s, rng.choice(MOMENTS), rng.uniform(0, a.max_delay)) for s in plan]

    run_dir, log = workdir / "faulted", workdir / "faulted.log"
    done: list[Kill] = []
    proc, marker = start(run_dir, steps, log, resume=True), marker_for_restart(run_dir)
    for i, kill in enumerate(kills):
        if not wait_training(proc, run_dir, marker):
            print(f"the run finished before kill {i + 1}: raise --steps-per-kill")
            break
        if done:  # the previous kill's temp files, now that this start is training
            done[-1].temps_after_restart = temps(run_dir, running=proc.pid)
        kill_at(proc, run_dir, kill)
        kill.exit_code = proc.wait(timeout=120)
        kill.temps_after_kill = temps(run_dir)
        mine = [r["step"] for r in own_rows(run_dir, marker) or [] if "train/loss" in r]
        kill.last_logged = max(mine, default=0)
        done.append(kill)
        marker = marker_for_restart(run_dir)
        proc = start(run_dir, steps, log, resume=True)
        if marker[0] == "resume":  # the step in its resume event
            while (rows := own_rows(run_dir, marker)) is None:
                if proc.poll() is not None:
                    sys.exit(f"the restart after kill {i + 1} failed: see {log}")
                time.sleep(0.02)
            kill.resumed_from = rows[0]["step"]
        else:
            kill.resumed_from = 0  # nothing to resume from: a fresh start
        print(
            f"kill {i + 1:2d}/{len(kills)}: {kill.signum.name:7s} {kill.moment:9s} "
            f"exit {kill.exit_code:4d}  logged step {kill.last_logged:4d}, resumed from "
            f"{kill.resumed_from:4d} (lost {kill.lost}); temp files after the kill: "
            f"{len(kill.temps_after_kill)}",
            flush=True,
        )
    final_code = proc.wait()
    if done:
        done[-1].temps_after_restart = temps(run_dir)
    same = final_code == 0 and _same(reference, run_dir)
    wall = time.perf_counter() - t0

    print()
    rows = []
    for s in SIGNALS:
        mine = [k for k in done if k.signum == s]
        if not mine:
            continue
        lost = [k.lost for k in mine if k.lost is not None]
        rows.append(
            [
                s.name,
                str(len(mine)),
                f"{sum(k.resumed_from is not None for k in mine)}/{len(mine)}",
                f"{sum(k.exit_code == k.expected_exit for k in mine)}/{len(mine)} "
                f"({mine[0].expected_exit})",
                f"{sum(k.moment == 'in a save' for k in mine)}",
                f"{max(lost)}" if lost else "-",
                f"{sum(lost) / len(lost):.2f}" if lost else "-",
                str(sum(bool(k.temps_after_kill) for k in mine)),
                str(sum(bool(k.temps_after_restart) for k in mine)),
            ]
        )
    print(
        table(
            [
                "signal",
                "kills",
                "resumed",
                "exit status as expected",
                "aimed in a save",
                "max steps lost",
                "mean steps lost",
                "temp files after the kill",
                "after the restart",
            ],
            rows,
        )
    )
    leftover = temps(run_dir)
    print(
        f"final run: exit {final_code}; final weights bit-identical to the uninterrupted run: "
        f"{'yes' if same else 'NO'}; temp files left in the run dir: {len(leftover)} "
        f"{leftover if leftover else ''}"
    )
    print(f"{len(done)} kills, {wall:.0f} s in all; load average at end: {load_avg()}")
    # With async saves a SIGKILL may land while the save of the last step is still written: the
    # steps since the last complete save are then 2 (see the docstring).
    most = 2 if a.async_save else 1
    bad = [
        k
        for k in done
        if k.exit_code != k.expected_exit
        or k.lost is None
        or k.lost > most
        or k.temps_after_restart
    ]
    if bad or not same or leftover:
        sys.exit(f"FAILED: {len(bad)} kills out of bounds, identical={same}, leftover={leftover}")


def _same(reference: Path, run_dir: Path) -> bool:
    a = weights(reference / "checkpoints" / "last.pt")
    b = weights(run_dir / "checkpoints" / "last.pt")
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


if __name__ == "__main__":
    main()

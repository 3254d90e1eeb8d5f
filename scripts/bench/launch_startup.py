"""Start-up of a 2-worker DDP run through `launcher=ray` against the same run under torchrun
(`launcher.nproc_per_node=2`): the wall and CPU seconds of a one-step run, which is almost all
start-up (compose, start the workers, build the process group, build the model, one step,
write the run dir).

Variants, alternating round after round so that a change in the machine's load hits all:
- `torchrun`: torchrun's agent starts 2 worker processes;
- `ray-local`: launcher.address unset, so a local Ray is started for the run and stopped after
  (what `accel-train launcher=ray` costs on a machine without a cluster);
- `ray-head` (with --head): a Ray head started once by this script on 127.0.0.1 (token auth
  on), each run a driver joining it: what a run costs on a running cluster.

CPU seconds are the children's rusage (the processes the run waited for): Ray's own processes
(GCS, raylet, and the workers the raylet starts) are not, so both Ray rows undercount CPU; the
wall times are what a user waits.

python scripts/bench/launch_startup.py --rounds 3 [--head]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import console_script, load_avg, machine, median, table
from startup import measure  # (wall s, CPU s) of one run, as startup.py times it

RUN = [
    "model=mlp",
    "dataset=synthetic",
    "dataset.num_train=256",
    "dataset.num_test=64",
    "trainer.max_steps=1",
    "trainer.progress=none",
    "trainer.plot_curves=false",
    "logger=none",
    "strategy=ddp",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(env: dict, temp: str) -> tuple[subprocess.Popen, str]:
    """`ray start --head --block` on 127.0.0.1; stopped by its process id (never `ray stop`)."""
    gcs, dashboard = free_port(), free_port()
    proc = subprocess.Popen(
        [
            console_script("ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--include-dashboard=false",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={dashboard}",
            "--num-cpus=2",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", gcs), timeout=1).close()
            time.sleep(5)  # the raylet registers after the GCS listens
            return proc, f"127.0.0.1:{gcs}"
        except OSError:
            time.sleep(1)
    proc.kill()
    sys.exit("the Ray head did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head", action="store_true", help="also runs on a running Ray head")
    a = parser.parse_args()
    work = tempfile.mkdtemp(prefix="accel_bench_launch_")
    temp = tempfile.mkdtemp(prefix="rb")  # Ray's socket paths must stay short
    env = {
        **os.environ,
        "HOME": work,  # Ray's ~/.ray (its token) stays in the scratch folder
        "RAY_TMPDIR": temp,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "OMP_NUM_THREADS": "1",
        "ACCEL_TRAIN_DATA_DIR": str(Path(work) / "no-data"),
    }
    train = console_script("accel-train")
    variants = {
        "torchrun": [train, *RUN, "launcher.nproc_per_node=2"],
        "ray-local": [train, *RUN, "launcher=ray", "launcher.num_workers=2"],
    }
    head = None
    if a.head:
        head, address = start_head(env, temp)
        variants["ray-head"] = [*variants["ray-local"], f"launcher.address={address}"]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    try:
        for r in range(a.rounds):
            for name, cmd in variants.items():
                run_dir = Path(work) / f"{name}-{r}"
                times[name].append(measure([*cmd, f"hydra.run.dir={run_dir}"], work, env))
                print(f"round {r + 1} {name}: {times[name][-1][0]:.1f} s", flush=True)
    finally:
        if head is not None:
            head.send_signal(signal.SIGTERM)
            head.wait(timeout=60)
        for folder in (work, temp):
            shutil.rmtree(folder, ignore_errors=True)
    base = median([w for w, _ in times["torchrun"]])
    rows = [
        [
            name,
            f"{median([w for w, _ in t]):.1f}",
            f"{median([c for _, c in t]):.1f}",
            f"{median([w for w, _ in t]) / base:.2f}x",
        ]
        for name, t in times.items()
    ]
    print(f"\n{machine()}; load average {load_avg()}; {a.rounds} round(s), medians")
    print(table(["variant", "wall s", "CPU s", "wall vs torchrun"], rows))


if __name__ == "__main__":
    main()

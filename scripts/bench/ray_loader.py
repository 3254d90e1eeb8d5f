#!/usr/bin/env python
"""loader=ray against a local loader on a CPU-starved "GPU node" (issue 48), simulated on one
machine with CPU affinity:

(a) local: the trainer and its loader pinned to core 0 (`taskset -c 0`), loader=torch with
    --local-workers workers (0: decoding in the training process);
(b) ray: the same trainer on core 0 with loader=ray; Ray's head runs on core 0 too (the
    trainer's node runs a raylet in a real cluster as well), and a second `ray start` pinned to
    core 1 is the CPU node: it offers --ray-workers CPUs and a custom resource `cpu_node`, which
    the data workers ask for (`loader.resources`), so they all run there;
(c) ray+own: as (b), plus one data worker on the trainer's own node (the head offers core 0's
    one CPU): what a cluster whose GPU nodes also join the pool gets, the trainer's idle core
    decoding beside the CPU node's.

Both runs are the real CLI on --images photo-sized JPEGs (section 29's, written once under
outputs/bench_data/ by scripts/bench/image_loader.py's generator), 224 px RandomResizedCrop +
flip decoded per sample, one epoch, batch 64, a model that costs nothing (a pooled linear
layer: _cheap_model.py). The variants alternate, the order rotating each round; medians of
--rounds rounds. Reported from each run's summary.json (the steady intervals: the first logging
interval, with start-up and warm-up, left out): images/s, the trainer process's own CPU seconds
per image (`train_cpu_s_per_sample`: what receiving a batch costs it), `data_wait_share`, and for
(b)/(c) the pool's images/s and busy share. Goals: >= 1.8x (a) in images/s; the trainer CPU per
image <= 0.2x (a)'s (with --local-workers 0, (a)'s is the local decode + crop cost).

The object store of both Ray nodes is capped at --object-store-mb (200 MB: the issue's bound);
its use is sampled during the ray rounds and the peak (and anything spilled) printed.

    .venv/bin/python scripts/bench/ray_loader.py                 # ~10 min on 2 idle cores
    .venv/bin/python scripts/bench/ray_loader.py --rounds 1 --images 256   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, console_script, load_avg, machine, median, table  # noqa: E402
from image_loader import write_data  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
VARIANTS = ["local", "ray", "ray+own"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A head on core 0 (offering its one CPU to (c) only: (b) asks for `cpu_node`) and a CPU
    node on core 1, stopped by process id."""

    def __init__(self, cpus: int, object_store_mb: int, env: dict[str, str]):
        self.temp = Path(tempfile.mkdtemp(prefix="rb"))  # Ray's socket paths must stay short
        self.port = free_port()
        self.env = env
        self.log = open(self.temp / "ray.log", "w")  # noqa: SIM115 - closed in stop()
        store = f"--object-store-memory={object_store_mb << 20}"
        common = ["--block", "--node-ip-address=127.0.0.1", store, "--disable-usage-stats"]
        ports = lambda: [  # noqa: E731 - every node its own free ports (two on one machine)
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        ray = console_script("ray")
        self.procs = [
            self._start(
                ["taskset", "-c", "0", ray, "start", "--head", f"--port={self.port}",
                 "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={self.temp}",
                 f"--ray-client-server-port={free_port()}", *ports(), *common]
            )
        ]  # fmt: skip
        self._wait_for("head")  # the GCS up before the second node joins
        self.procs.append(
            self._start(
                ["taskset", "-c", "1", ray, "start", f"--address={self.address}",
                 f"--num-cpus={cpus}", '--resources={"cpu_node": 1000}', *ports(), *common]
            )
        )  # fmt: skip
        self._wait_for("cpu_node")

    def _wait_for(self, what: str) -> None:
        """Until `ray status` lists the head (or the CPU node's resource), at most 5 minutes."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = subprocess.run(
                [console_script("ray"), "status", f"--address={self.address}"],
                env=self.env,
                capture_output=True,
                text=True,
            )
            if status.returncode == 0 and (what == "head" or what in status.stdout):
                return
            time.sleep(3)
        sys.exit(f"the Ray {what} did not start; see {self.temp / 'ray.log'}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops what it started
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


class StoreWatch:
    """The object store's use across both nodes, sampled every 0.25 s while a ray round runs
    (Ray's own memory summary, read by a driver of this process): its peak, and any spilling."""

    def __init__(self, cluster: Cluster):
        # (the token before Ray is imported: it reads its authentication settings then)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=cluster.env["RAY_AUTH_TOKEN"])
        import ray
        from ray._private.internal_api import memory_summary

        ray.init(address=cluster.address, log_to_driver=False, _node_ip_address="127.0.0.1")
        self.ray, self.summary = ray, memory_summary
        self.peak_mib = self.spilled_mib = 0.0
        self.running = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        import re

        while True:
            self.running.wait()
            text = self.summary(stats_only=True)
            used = re.search(r"Plasma memory usage (\d+) MiB", text)
            spilled = re.search(r"Spilled (\d+) MiB", text)
            self.peak_mib = max(self.peak_mib, float(used.group(1)) if used else 0.0)
            self.spilled_mib = max(self.spilled_mib, float(spilled.group(1)) if spilled else 0.0)
            time.sleep(0.25)


def train(a, root: Path, variant: str, run_dir: Path, cluster: Cluster) -> dict:
    args = [
        "dataset=image_folder",
        f"dataset.root={root}",
        "dataset.image_size=224",
        "dataset.test_split=null",
        "dataset.val_fraction=0.02",  # a few images: validation is not measured
        "dataset.check_images=false",  # the same files every round: checked by the first
        "model=custom",
        "model._target_=_cheap_model.Pooled",
        f"loader.batch_size={a.batch}",
        "trainer.max_epochs=1",
        "trainer.log_every_n_steps=2",
        "trainer.limit_val_batches=1",
        "trainer.test_after_fit=false",
        "trainer.progress=none",
        "trainer.plot_curves=false",
        "checkpoint.save_last=false",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    if variant == "local":
        args += ["loader=torch", f"loader.num_workers={a.local_workers}"]
    else:
        args += ["loader=ray", f"loader.address={cluster.address}", f"loader.prefetch={a.prefetch}"]
        if variant == "ray":  # every worker on the CPU node
            args += [f"loader.num_workers={a.ray_workers}", "+loader.resources.cpu_node=1"]
        else:  # ray+own: one more, placed by Ray on the head's (the trainer's) free CPU
            args += [f"loader.num_workers={a.ray_workers + 1}"]
    env = {**cluster.env, "PYTHONPATH": f"{BENCH_DIR}{os.pathsep}{cluster.env['PYTHONPATH']}"}
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["taskset", "-c", "0", console_script("accel-train"), *args],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{variant} run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pool = [r for r in rows if "data/remote_images_per_s" in r][1:]  # past the warm-up
    summary["pool_images_per_s"] = median([r["data/remote_images_per_s"] for r in pool] or [0])
    summary["pool_busy_share"] = median([r["data/remote_busy_share"] for r in pool] or [0])
    summary["run_wall_s"] = time.perf_counter() - t0
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--local-workers", type=int, default=0)
    p.add_argument("--ray-workers", type=int, default=1, help="data workers on the CPU node")
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--object-store-mb", type=int, default=200)
    p.add_argument("--data", type=Path, default=REPO / "outputs" / "bench_data")
    a = p.parse_args()
    root = write_data(a.data / f"photos-{a.images}", a.images, a.classes)
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    print(machine(), "| load before:", load_avg(), flush=True)
    cluster = Cluster(a.ray_workers, a.object_store_mb, env)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    out = Path(tempfile.mkdtemp(prefix="ray_loader_bench"))
    store = None
    try:
        store = StoreWatch(cluster)
        for r in range(a.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # each variant first once in 3 rounds
            for variant in order:
                if variant != "local":
                    store.running.set()
                s = train(a, root, variant, out / f"{variant}{r}", cluster)
                store.running.clear()
                results[variant].append(s)
                print(
                    f"round {r} {variant}: {s['samples_per_s']:.0f} images/s, trainer CPU "
                    f"{1e3 * s['train_cpu_s_per_sample']:.2f} ms/image, data wait "
                    f"{s['data_wait_share']:.0%}",
                    flush=True,
                )
    finally:
        if store is not None:
            store.ray.shutdown()
        cluster.stop()
        shutil.rmtree(out, ignore_errors=True)
    report(a, results)
    print(
        f"object store (both nodes, capped at {a.object_store_mb} MB each): peak "
        f"{store.peak_mib:.0f} MiB during the ray rounds, spilled {store.spilled_mib:.0f} MiB"
    )
    print("load after:", load_avg())


def report(a, results: dict[str, list[dict]]) -> None:
    def med(variant: str, key: str) -> float:
        return median([s[key] for s in results[variant]])

    base_rate, base_cpu = med("local", "samples_per_s"), med("local", "train_cpu_s_per_sample")
    rows = []
    for variant, letter in zip(VARIANTS, "abc"):
        rate, cpu = med(variant, "samples_per_s"), med(variant, "train_cpu_s_per_sample")
        rates = [s["samples_per_s"] for s in results[variant]]
        rows.append([
            f"({letter}) {variant}",
            f"{rate:,.0f}",
            f"{min(rates):,.0f}-{max(rates):,.0f}",
            f"{rate / base_rate:.2f}",
            f"{1e3 * cpu:.2f}",
            f"{cpu / base_cpu:.2f}",
            f"{med(variant, 'data_wait_share'):.0%}",
            f"{med(variant, 'pool_images_per_s'):,.0f}" if variant != "local" else "-",
            f"{med(variant, 'pool_busy_share'):.0%}" if variant != "local" else "-",
        ])  # fmt: skip
    print(
        table(
            [
                "loader", "images/s (median)", "range", "vs (a)", "trainer CPU ms/image",
                "vs (a)", "data_wait_share", "pool images/s", "pool busy",
            ],
            rows,
        )
    )  # fmt: skip
    print(
        f"{a.images} images, batch {a.batch}, {a.rounds} rounds; (a) loader=torch "
        f"num_workers={a.local_workers} on core 0; (b) loader=ray, {a.ray_workers} worker(s) on "
        f"core 1, prefetch {a.prefetch}, object store {a.object_store_mb} MB a node; (c) as (b) "
        "plus one worker on core 0"
    )


if __name__ == "__main__":
    main()

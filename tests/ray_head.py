"""A Ray head of a test module's own, on 127.0.0.1: started by `ray start --head --block` (token
authentication on, as current Ray does by default) and stopped by its process id, never by
`ray stop` (which would stop other users' Ray). tests/test_ray.py (launcher=ray) and
tests/test_ray_loader.py (loader=ray) each start one per module."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from helpers import BIN, free_port


class Head:
    """A Ray head of this module's own: its process, addresses, token and environment."""

    def __init__(self, root: Path, num_cpus: int = 2, object_store_mb: int | None = None):
        # Ray's unix socket paths must stay under ~107 bytes: a short temp dir of its own.
        self.temp = Path(tempfile.mkdtemp(prefix="rt"))
        self.gcs, self.dashboard = free_port(), free_port()
        self.token = secrets.token_hex(16)
        home = root / "home"  # Ray's ~/.ray (tokens) and caches stay inside the test
        home.mkdir()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "HYDRA_FULL"))},
            "HOME": str(home),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "ACCEL_TRAIN_DATA_DIR": str(root / "no-data-here"),
        }
        store = [f"--object-store-memory={object_store_mb << 20}"] if object_store_mb else []
        self.log = root / "head.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    BIN / "ray",
                    "start",
                    "--head",
                    "--block",
                    "--node-ip-address=127.0.0.1",
                    f"--port={self.gcs}",
                    "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={self.dashboard}",
                    f"--dashboard-agent-listen-port={free_port()}",
                    f"--ray-client-server-port={free_port()}",
                    f"--num-cpus={num_cpus}",
                    *store,
                    f"--temp-dir={self.temp}",
                    "--disable-usage-stats",
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_for_dashboard()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs}"

    @property
    def jobs_address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def _wait_for_dashboard(self) -> None:
        deadline = time.monotonic() + 180
        request = urllib.request.Request(
            f"{self.jobs_address}/api/version", headers={"Authorization": f"Bearer {self.token}"}
        )
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(request, timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"the Ray head did not start\n{self.log.read_text()[-3000:]}")

    def processes(self) -> list[int]:
        """Every process the head started (gcs_server, raylet, dashboard, the workers)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += children.get(pid, [])
        return found[1:]

    def train_workers(self) -> list[int]:
        return self.titled(b"ray::RayTrainWorker")

    def titled(self, title: bytes) -> list[int]:
        """The head's processes whose title (Ray sets it as ray::<actor class>) starts so."""
        pids = []
        for pid in self.processes():
            try:
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title):
                    pids.append(pid)
            except OSError:
                continue
        return sorted(pids)

    def stop(self) -> None:
        """SIGTERM to `ray start --block` (it stops what it started), then SIGKILL to any of
        its processes still there: by process id, never `ray stop` (other users' Ray)."""
        started = self.processes()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # exited already
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp, ignore_errors=True)

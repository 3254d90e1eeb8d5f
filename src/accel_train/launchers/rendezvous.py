"""Fail fast, naming the endpoint, when torchrun's rendezvous cannot work; while the nodes
gather, say who is there and who is not.

Node 0 hosts the rendezvous (c10d's TCP store at launcher.rdzv_endpoint): it checks that the
port is free here and never waits for itself, whatever name the endpoint gives this machine.
The other nodes wait for it to answer. While they gather, each node writes its node_rank into
that store and reads the others' (`Arrivals`), so a node that waits says for whom, and a
rendezvous that times out names the nodes that never came.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from datetime import timedelta

from omegaconf import DictConfig

from accel_train.errors import UserError

log = logging.getLogger("accel_train")


def check_rendezvous(cfg: DictConfig) -> None:
    """A missing rdzv_id, a malformed endpoint, a busy port here or nobody answering there."""
    lc = cfg.launcher
    if str(lc.nnodes) != "1" and not lc.rdzv_id:
        raise UserError(
            f"launcher.nnodes={lc.nnodes} needs launcher.rdzv_id (a job id every node is given) "
            "and a fixed rendezvous port, e.g. `launcher.rdzv_id=job42 "
            "launcher.rdzv_endpoint=node0:29500`."
        )
    host, _, port_text = str(lc.rdzv_endpoint).rpartition(":")
    if not host or not port_text.isdigit():
        raise UserError(
            f"launcher.rdzv_endpoint={lc.rdzv_endpoint!r} is not host:port (e.g. node0:29500)."
        )
    port = int(port_text)
    if port == 0:
        if str(lc.nnodes) != "1":
            raise UserError(
                "launcher.rdzv_endpoint ends in :0 (a random port) but launcher.nnodes="
                f"{lc.nnodes}: the other nodes could not find it. Give a fixed port, e.g. "
                "`launcher.rdzv_endpoint=node0:29500`."
            )
        return
    if lc.node_rank == 0:  # it hosts the store (rdzv_conf is_host, torchrun_process.py)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # Like TCPStore: a port in TIME_WAIT from a finished run is free to use.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError:
                raise UserError(
                    f"launcher.rdzv_endpoint={lc.rdzv_endpoint}: port {port} is already in use on "
                    "this host (another run?). Pick a free port, e.g. "
                    f"`launcher.rdzv_endpoint={host}:{port + 1}`."
                ) from None
        return
    log.info(
        "waiting for node_rank=0 to answer at %s:%d (launcher.rdzv_timeout=%ss)",
        host,
        port,
        lc.rdzv_timeout,
    )
    if not _reachable(host, port, timeout_s=lc.rdzv_timeout):
        raise UserError(
            f"launcher.rdzv_endpoint={lc.rdzv_endpoint}: nothing answered at {host}:{port} within "
            f"launcher.rdzv_timeout={lc.rdzv_timeout}s. Start node_rank=0 first, check the host "
            "name and port, and that the port is open between the nodes."
        )


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


# ---- who has arrived ------------------------------------------------------------------------


class Arrivals:
    """The nodes that reached the rendezvous, by node_rank, as the store at the endpoint holds
    them: each node writes its own once the store answers (node 0's agent starts it), then
    reads the others' every second, saying who joins, until all are there. A thread of this
    process; what it cannot reach it leaves unsaid."""

    def __init__(self, cfg: DictConfig):
        lc = cfg.launcher
        host, _, port = str(lc.rdzv_endpoint).rpartition(":")
        self.host, self.port = host, int(port)
        self.nnodes, self.node_rank = int(lc.nnodes), int(lc.node_rank)
        self.prefix = f"accel_train/{lc.rdzv_id}/node"
        self.arrived: dict[int, str] = {}
        self.stop = threading.Event()

    def start(self) -> Arrivals:
        log.info(
            "waiting for %d nodes at %s:%d (this is node_rank=%d)",
            self.nnodes,
            self.host,
            self.port,
            self.node_rank,
        )
        threading.Thread(target=self._watch, daemon=True, name="arrivals").start()
        return self

    def missing(self) -> list[int]:
        return [k for k in range(self.nnodes) if k not in self.arrived]

    def _watch(self) -> None:
        try:
            store = self._connect()
            if store is None:
                return
            store.set(f"{self.prefix}/{self.node_rank}", socket.gethostname())
            self.arrived[self.node_rank] = socket.gethostname()
            while not self.stop.is_set() and self.missing():
                for k in self.missing():
                    if store.check([f"{self.prefix}/{k}"]):
                        self.arrived[k] = store.get(f"{self.prefix}/{k}").decode()
                        if k != self.node_rank:
                            log.info(
                                "node_rank=%d (%s) joined: %d of %d nodes",
                                k,
                                self.arrived[k],
                                len(self.arrived),
                                self.nnodes,
                            )
                self.stop.wait(1.0)
        except Exception:  # noqa: BLE001 - the store went away (the rendezvous ended): done
            return

    def _connect(self):
        from torch.distributed import TCPStore  # (torch is loaded by now: torchrun's agent)

        while not self.stop.is_set():
            try:
                return TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=2))
            except Exception:  # noqa: BLE001 - not up yet (node 0's agent starts it)
                self.stop.wait(0.5)
        return None


def timed_out(cfg: DictConfig, arrivals: Arrivals | None) -> UserError:
    """The rendezvous gave up: which nodes never came, and what to check."""
    lc = cfg.launcher
    where = f"launcher.rdzv_endpoint={lc.rdzv_endpoint} (launcher.rdzv_id={lc.rdzv_id})"
    if arrivals is None or not arrivals.arrived:
        came = "no node's arrival could be read"
        missing = "the other nodes"
    else:
        came = "only node_rank " + ", ".join(str(k) for k in sorted(arrivals.arrived)) + " joined"
        gone = arrivals.missing()
        missing = "node_rank " + ", ".join(str(k) for k in gone)
    return UserError(
        f"launcher.nnodes={lc.nnodes}: the rendezvous at {where} timed out after "
        f"launcher.rdzv_timeout={lc.rdzv_timeout}s; {came}, and {missing} never came. Start "
        "each missing node with the same launcher.rdzv_endpoint and launcher.rdzv_id and its "
        "own launcher.node_rank, check that it can reach this port, or raise "
        "launcher.rdzv_timeout."
    )

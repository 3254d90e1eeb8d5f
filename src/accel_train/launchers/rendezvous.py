"""Fail fast, naming the endpoint, when torchrun's rendezvous cannot work."""

from __future__ import annotations

import socket
import time

from omegaconf import DictConfig

from accel_train.errors import UserError


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
    if lc.node_rank == 0 and _is_local(host):
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
    if not _reachable(host, port, timeout_s=lc.rdzv_timeout):
        raise UserError(
            f"launcher.rdzv_endpoint={lc.rdzv_endpoint}: nothing answered at {host}:{port} within "
            f"launcher.rdzv_timeout={lc.rdzv_timeout}s. Start node_rank=0 first, check the host "
            "name and port, and that the port is open between the nodes."
        )


def _is_local(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


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

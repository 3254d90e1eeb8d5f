"""Start or join a Ray cluster: the one place that calls `ray.init`.

Both users of Ray go through here: `launcher=ray` (launchers/ray_train.py: the trainers are Ray
Train workers) and `loader=ray` (data/remote/ray_loader.py: the input pipeline's workers are Ray
actors). An address names where:

- unset (null): a local Ray on 127.0.0.1, started for this run and stopped when it ends;
- `auto`: the cluster this node already belongs to (`ray start` ran here);
- `host:port`: the head's GCS address (`ray://host:10001`, Ray Client, works too).

A process that is already connected (a Ray Train worker, a job's driver) keeps its connection
and does not stop it: `loader=ray` under `launcher=ray` uses the trainers' own cluster.

`ray` is imported only when one of those options runs: the others never pay for it.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from accel_train.errors import UserError


def import_ray(what: str, *modules: str):
    """`ray` (and `modules`, e.g. ray.train.torch), or one paragraph saying how to get it."""
    try:
        ray = importlib.import_module("ray")
        for name in modules:
            importlib.import_module(name)
    except ImportError as err:
        raise UserError(
            f"{what} needs Ray, which is not installed here ({err}). Install it with `pip "
            "install 'accel-train[ray]'` (ray[default,train]), on this machine and on every "
            "node of the cluster."
        ) from None
    return ray


@dataclass
class Connection:
    """A connection this process made (or found): `started` says whether ending it is ours."""

    ray: Any
    where: str  # for log lines: "a local Ray on 127.0.0.1", the address, "the job's cluster"
    started: bool

    def close(self) -> None:
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()  # a local Ray this process started stops with it


def plain_prefixes() -> None:
    """Ray prints its workers' lines behind a coloured `(pid=...)` prefix, colour codes
    included whatever the output: into a log file (`accel-train ... > run.log`, a SLURM
    job's output) they go raw. Off where the output is no terminal (RAY_COLOR_PREFIX=0,
    Ray's own switch), unless the user set it."""
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def connect(
    ray,
    address: str | None,
    *,
    key: str,
    num_cpus: float = 1,
    runtime_env: dict[str, Any] | None = None,
    object_store_memory: int | None = None,
    in_job: bool = False,
) -> Connection:
    """ray.init for `address` (see the module docstring); `key` names the config key in the
    errors (launcher.address, loader.address)."""
    if ray.is_initialized():  # a Ray Train worker, or a second user in this process
        return Connection(ray, "the cluster this process is in", started=False)
    plain_prefixes()
    if in_job:
        # The Jobs API sets RAY_ADDRESS for its drivers, and the job's runtime_env already
        # holds for this driver and its workers.
        ray.init(log_to_driver=True)
        return Connection(ray, "the job's cluster", started=True)
    kwargs: dict[str, Any] = {"log_to_driver": True}
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    if address is None:
        target = "local"
        kwargs.update(
            num_cpus=max(int(num_cpus + 0.999), 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )
        if object_store_memory:
            kwargs["object_store_memory"] = int(object_store_memory)
    else:
        target = address
        _check_listening(address, key)
    try:
        ray.init(address=target, **kwargs)
    except ray.exceptions.AuthenticationError as err:
        raise UserError(auth_paragraph(address, err, key)) from None
    except (ConnectionError, ValueError, RuntimeError) as err:
        if _host_port(address or "") is not None or "auth" in str(err).lower():
            # Something listens there (checked above) and still refused us: Ray's token
            # authentication (on by default) says so only in its C++ log lines.
            raise UserError(auth_paragraph(address, err, key)) from None
        raise UserError(unreachable(address, one_line(err), key)) from None
    where = "a local Ray on 127.0.0.1" if address is None else str(address)
    return Connection(ray, where, started=True)


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def _check_listening(address: str, key: str) -> None:
    """A GCS address with nothing listening fails now, not after Ray's half-minute retries."""
    where = _host_port(address)
    if where is None:
        return
    try:
        socket.create_connection(where, timeout=5).close()
    except OSError as err:
        why = f"{where[0]}:{where[1]}: {err.strerror}"
        raise UserError(unreachable(address, why, key)) from None


def unreachable(address: str | None, why: str, key: str) -> str:
    jobs = "`http://head:8265` with `launcher.submit=job`, " if key.startswith("launcher.") else ""
    return (
        f"{key}={address}: could not connect to a Ray cluster there ({why}). Give the head's "
        f"GCS address (host:6379, or `auto` on a node of the cluster), {jobs}or leave {key} "
        "unset to start a local Ray for this run."
    )


def auth_paragraph(address: str | None, err: BaseException, key: str) -> str:
    return (
        f"the Ray cluster at {key}={address} answers but refused this process "
        f"({one_line(err)}): it uses token authentication (on by default in current Ray) and "
        "this process has no valid token. Give it the cluster's token: `export "
        "RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<token>` (or RAY_AUTH_TOKEN_PATH=<file>); `ray "
        "get-auth-token` on the head prints it. (A Ray version other than the head's is "
        "refused the same way: `ray --version` must match.)"
    )


def one_line(err: BaseException) -> str:
    text = " ".join(str(getattr(err, "message", None) or err).split())
    return (text[:300] + "...") if len(text) > 300 else text.rstrip(".")

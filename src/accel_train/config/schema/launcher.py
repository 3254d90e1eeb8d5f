"""launcher: how the processes are started (accel_train/launchers/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class LauncherConfig:
    name: str = MISSING
    nproc_per_node: str = "1"
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"
    rdzv_id: str | None = None
    rdzv_timeout: int = 300
    max_restarts: int = 0
    monitor_interval: float = 1.0
    log_dir: str | None = None
    omp_num_threads: int | None = None


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    mem: str | None = None
    time: str = "01:00:00"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    job_name: str | None = None
    sbatch_extra: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    signal_grace_s: int = 120
    max_requeues: int = 3
    submit: bool = True


@dataclass
class RayLauncherConfig(LauncherConfig):
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    address: str | None = None
    submit: str = "none"
    max_failures: int = 0
    runtime_env: dict[str, Any] = field(default_factory=dict)
    python: str = "python"


@dataclass
class KubernetesLauncherConfig(LauncherConfig):
    kind: str = "trainjob"
    image: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0
    cpu: str | None = None
    memory: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    image_pull_secrets: list[str] = field(default_factory=list)
    volume: str | None = None
    mount_path: str = "/runs"
    namespace: str = "default"
    job_name: str | None = None
    runtime: str = "torch-distributed"
    submit: bool = False
    context: str | None = None

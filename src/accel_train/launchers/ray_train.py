"""launcher=ray: Ray Train's TorchTrainer starts the workers; each runs the torchrun worker.

The parent writes the run dir and config.yaml once (as for SLURM), then either drives the run
itself (`launcher.submit=none`: a local Ray started for the run, `auto`, or a cluster's GCS
address) or submits a driver through Ray's Jobs API (`launcher.submit=job`) and exits. The
driver started here holds the run dir's lock and its workers join it; in a job, global
rank 0 takes it (as in a SLURM job). Each worker reads the same config.yaml and runs
`launchers.worker.run_config_file`, in the process group Ray Train built (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT are Ray's; parallel.process_group reuses the group).
A failed worker restarts the whole group through Ray's FailureConfig; config.yaml says
`resume: auto`, so the new group continues from checkpoints/last.pt.

`ray` is imported only here, only when the launcher runs: the other launchers never pay for it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accel_train import ray_cluster
from accel_train.config.run_config import load_run_config, write_run_config
from accel_train.errors import UserError
from accel_train.launchers.lock import ENV_VAR as LOCK_ENV_VAR
from accel_train.launchers.worker import run_config_file

log = logging.getLogger("accel_train")

SUBMIT_MODES = ("none", "job")
# Environment variables a driver hands to the workers (and a job to its driver): where data
# lives, the thread count, and the run dir's lock for the workers to join.
FORWARDED_PREFIXES = ("ACCEL_TRAIN_", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")


def check(lc: DictConfig) -> None:
    """launcher.* values that can be refused before anything is written."""
    if lc.num_workers < 1:
        raise UserError(
            f"launcher.num_workers={lc.num_workers}: a Ray run needs at least one worker, e.g. "
            "`launcher.num_workers=2`."
        )
    if lc.submit not in SUBMIT_MODES:
        raise UserError(
            f"launcher.submit={lc.submit!r} is not one of {', '.join(SUBMIT_MODES)}: `none` "
            "drives the run from this process, `job` submits it through Ray's Jobs API."
        )
    address = lc.address or ""
    is_http = address.startswith(("http://", "https://"))
    if lc.submit == "job" and not is_http:
        raise UserError(
            f"launcher.submit=job needs the dashboard's address, e.g. "
            f"`launcher.address=http://head:8265` (got launcher.address={lc.address!r})."
        )
    if is_http and lc.submit != "job":
        raise UserError(
            f"launcher.address={address} is a dashboard (Jobs API) address: add "
            "`launcher.submit=job`, or give the cluster's GCS address (`auto` on a cluster "
            "node, or host:6379) to drive the run from here."
        )


def planned_world_size(lc: DictConfig) -> int:
    return int(lc.num_workers)


def launch(cfg: DictConfig, run_dir: Path) -> float | None:
    """Write config.yaml once, then run it on Ray (or submit it); the run's objective."""
    lc = cfg.launcher
    if cfg.resume is None:
        cfg.resume = "auto"  # a restarted worker group continues from last.pt
    absolute_paths(cfg)
    path = write_run_config(cfg, run_dir)
    if lc.submit == "job":
        submit_job(lc, path)
        return None
    summary = drive(cfg, path)
    return summary.get(cfg.objective)


def absolute_paths(cfg: DictConfig) -> None:
    """Ray starts workers in folders of its own: every relative path becomes absolute here."""
    for key in ("data_dir", "log_dir", "output_dir"):
        cfg.paths[key] = os.path.abspath(cfg.paths[key])

    def walk(node: DictConfig) -> None:
        for key in node:
            value = node[key]
            if isinstance(value, DictConfig):
                walk(value)
            elif isinstance(value, str) and value.startswith(("./", "../")):
                node[key] = os.path.abspath(value)

    walk(cfg)


# ---- the driver ---------------------------------------------------------------------------


def drive(cfg: DictConfig, config_path: Path, in_job: bool = False) -> dict[str, Any]:
    """Connect to (or start) Ray, run the TorchTrainer to the end, disconnect (stopping a Ray
    it started). Returns summary.json, which global rank 0 wrote."""
    ray = import_ray()
    lc, run_dir = cfg.launcher, Path(cfg.paths.output_dir)
    connection = connect(ray, lc, in_job, data_cpus(cfg))
    try:
        check_resources(ray, lc)
        trainer = build_trainer(cfg, config_path)
        log.info("Ray Train: %d workers on %s", lc.num_workers, _where(ray, lc, in_job))
        fit(trainer, cfg)
    finally:
        connection.close()  # a Ray this process started stops with it
    summary = run_dir / "summary.json"
    if not summary.is_file():
        raise UserError(
            f"the Ray workers finished but wrote no {summary}; see {run_dir / 'train.log'}."
        )
    return json.loads(summary.read_text())


def import_ray():
    return ray_cluster.import_ray("launcher=ray", "ray.train.torch")


def worker_env() -> dict[str, str]:
    """What the workers (and a job's driver) must see of this process's environment."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}


def _runtime_env(lc: DictConfig) -> dict[str, Any]:
    env = OmegaConf.to_container(lc.runtime_env, resolve=True) if lc.runtime_env else {}
    env_vars = {**worker_env(), **{k: str(v) for k, v in env.get("env_vars", {}).items()}}
    if lc.omp_num_threads:
        env_vars["OMP_NUM_THREADS"] = str(lc.omp_num_threads)
    return {**env, "env_vars": env_vars}


def data_cpus(cfg: DictConfig) -> float:
    """The CPUs loader=ray's data workers take beside the trainers (each trainer has its own
    pool, in the same cluster): a local Ray started here must offer them too."""
    loader = cfg.loader
    if loader.name != "ray":
        return 0.0
    return cfg.launcher.num_workers * loader.num_workers * loader.cpus_per_worker


def connect(ray, lc: DictConfig, in_job: bool, extra_cpus: float = 0.0) -> ray_cluster.Connection:
    """ray.init through ray_cluster: a job's driver joins its cluster; address null starts a
    local Ray on 127.0.0.1 for this run; otherwise the address given (auto, host:port)."""
    return ray_cluster.connect(
        ray,
        lc.address,
        key="launcher.address",
        num_cpus=lc.num_workers * lc.cpus_per_worker + extra_cpus,
        runtime_env=_runtime_env(lc),
        in_job=in_job,
    )


def check_resources(ray, lc: DictConfig) -> None:
    """The cluster must have the GPUs (and CPUs) the workers ask for: Ray Train would otherwise
    wait for them forever, its autoscaler saying so only in Ray's own logs."""
    have = ray.cluster_resources()
    wants = {"CPU": lc.num_workers * lc.cpus_per_worker}
    if lc.use_gpu:
        wants["GPU"] = lc.num_workers  # one each (ScalingConfig.use_gpu)
    short = {k: v for k, v in wants.items() if have.get(k, 0) < v}
    if not short:
        return
    where = "the local Ray started for this run" if lc.address is None else lc.address
    listed = ", ".join(f"{v:g} {k}" for k, v in short.items())
    held = ", ".join(f"{have.get(k, 0):g} {k}" for k in short)
    fix = (
        "`launcher.use_gpu=false` trains on the CPUs, or fewer `launcher.num_workers`"
        if "GPU" in short
        else "lower `launcher.num_workers` or `launcher.cpus_per_worker`"
    )
    raise UserError(
        f"launcher.num_workers={lc.num_workers} with launcher.use_gpu={str(lc.use_gpu).lower()} "
        f"and launcher.cpus_per_worker={lc.cpus_per_worker:g} need {listed}, but {where} has "
        f"{held}: Ray would wait for them forever. Use a cluster that has them (an autoscaling "
        f"one: start its nodes first), or {fix}."
    )


def auth_paragraph(address: str | None, err: BaseException) -> str:
    return ray_cluster.auth_paragraph(address, err, "launcher.address")


def _one_line(err: BaseException) -> str:
    return ray_cluster.one_line(err)


def _where(ray, lc: DictConfig, in_job: bool) -> str:
    if in_job:
        return "the job's cluster"
    return "a local Ray on 127.0.0.1" if lc.address is None else str(lc.address)


def build_trainer(cfg: DictConfig, config_path: Path):
    train = importlib.import_module("ray.train")
    torch_train = importlib.import_module("ray.train.torch")
    lc, run_dir = cfg.launcher, Path(cfg.paths.output_dir)
    backend = cfg.strategy.backend
    if backend == "auto":
        backend = "nccl" if lc.use_gpu else "gloo"
    return torch_train.TorchTrainer(
        train_worker,
        train_loop_config={"config": str(Path(config_path).resolve())},
        torch_config=torch_train.TorchConfig(backend=backend, timeout_s=int(lc.rdzv_timeout)),
        scaling_config=train.ScalingConfig(
            num_workers=int(lc.num_workers),
            use_gpu=bool(lc.use_gpu),
            resources_per_worker={"CPU": float(lc.cpus_per_worker)},
        ),
        run_config=train.RunConfig(
            name="ray_train",
            storage_path=str(run_dir),  # Ray Train's own state, beside the run's files
            failure_config=train.FailureConfig(max_failures=int(lc.max_failures)),
            # Ray Train logs a failed worker's traceback (twice); the driver says it in one
            # paragraph instead. Ray's session logs keep everything.
            logging_config=train.LoggingConfig(
                log_level="INFO" if os.environ.get("HYDRA_FULL_ERROR") == "1" else "CRITICAL"
            ),
        ),
    )


def train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: the torchrun worker on the run's config.yaml."""
    run_config_file(config["config"])


def fit(trainer, cfg: DictConfig) -> None:
    try:
        trainer.fit()
    except Exception as err:  # noqa: BLE001 - Ray wraps the workers' errors in its own types
        if type(err).__name__ not in ("TrainingFailedError", "WorkerGroupError"):
            raise
        run_dir = Path(cfg.paths.output_dir)
        saved = any((run_dir / "checkpoints").glob("last.*"))
        hint = (
            f"; its checkpoints are kept: rerun with `hydra.run.dir={run_dir}` to continue"
            if saved
            else ""
        )
        raise UserError(
            f"the Ray workers failed{_restarts(cfg)}: {worker_error(err)}. The ranks' output "
            f"is in {run_dir / 'train.log'} and Ray's worker logs{hint}."
        ) from None


def _restarts(cfg: DictConfig) -> str:
    n = int(cfg.launcher.max_failures)
    return f" after {n} restart(s) (launcher.max_failures={n})" if n else ""


def worker_error(err: BaseException) -> str:
    """The first failed worker's own message (a UserError's paragraph), not Ray's traceback."""
    failures = getattr(err, "worker_failures", None) or {}
    first = failures[min(failures)] if failures else err
    text = str(first).strip()
    for marker in ("UserError: ",):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    lines = [line for line in text.splitlines() if line.strip()]
    return " ".join(lines[-1].split()).rstrip(".") if lines else type(err).__name__


# ---- the Jobs API ---------------------------------------------------------------------------


def submit_job(lc: DictConfig, config_path: Path) -> str:
    """Submit `python -m accel_train.launchers.ray_job <config.yaml>` and say how to follow it."""
    import_ray()
    module = importlib.import_module("ray.job_submission")
    entrypoint = f"{lc.python} -m accel_train.launchers.ray_job {shlex.quote(str(config_path))}"
    try:
        client = module.JobSubmissionClient(lc.address)
        runtime_env = _runtime_env(lc)
        runtime_env["env_vars"].pop(LOCK_ENV_VAR, None)  # the job's rank 0 takes the lock
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    except Exception as err:  # noqa: BLE001 - the client raises plain RuntimeError/ConnectionError
        if "401" in str(err) or "auth" in str(err).lower():
            raise UserError(auth_paragraph(lc.address, err)) from None
        raise UserError(
            f"launcher.address={lc.address}: Ray's Jobs API did not take the job "
            f"({_one_line(err)}). Check that the head's dashboard listens there (`ray start "
            "--head --dashboard-host=0.0.0.0`), and that `ray job list --address "
            f"{lc.address}` works from this machine."
        ) from None
    a = shlex.quote(str(lc.address))
    print(
        f"submitted Ray job {job_id} (run dir {config_path.parent})\n"
        f"  follow: ray job logs --follow --address {a} {job_id}\n"
        f"  status: ray job status --address {a} {job_id}\n"
        f"  stop:   ray job stop --address {a} {job_id}"
    )
    sys.stdout.flush()
    return job_id


def job_main(config_path: str) -> None:
    """The driver of a job submitted with launcher.submit=job, on the cluster."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][ray driver] %(message)s")
    if not os.path.isfile(config_path):
        raise UserError(
            f"config file {config_path!r} not found on the Ray cluster: the run dir must be on "
            "storage that the head and every worker node share (docs/ray.md)."
        )
    cfg = load_run_config(config_path)
    run_dir = Path(cfg.paths.output_dir)
    # No lock here: global rank 0 takes the run dir's (launchers/lock.py), as in a SLURM job.
    drive(cfg, Path(config_path), in_job=True)
    log.info("done: %s", run_dir / "summary.json")

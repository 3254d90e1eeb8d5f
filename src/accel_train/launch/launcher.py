"""Compose once, resolve once, write the run config, then run: in-process or under torchrun.

Workers (``python -m accel_train.worker <config.yaml>``) only ever read that file; they never
compose a config or parse Hydra overrides.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console

from accel_train.config import CONFIG_DIR
from accel_train.config.checks import validate
from accel_train.config.run_config import config_tree, resolve, write_run_config
from accel_train.console import flat_defaults, startup_tree
from accel_train.environment import in_srun_step, inside_torchrun
from accel_train.errors import UserError
from accel_train.launch import kubernetes, ray, slurm
from accel_train.launch.lock import hold_run_dir
from accel_train.launch.torchrun import run_torchrun
from accel_train.launch.worker import run_worker
from accel_train.parallel import resolve_device
from accel_train.strategies import strategy_for
from accel_train.train.checkpointing import check as check_checkpointing
from accel_train.train.checkpointing import known_metrics
from accel_train.train.found import forget as forget_checkpoint
from accel_train.train.resume import check_resume

log = logging.getLogger("accel_train")


def launch(cfg: DictConfig) -> float | None:
    """The body of `accel-train`: returns the run's objective (summary.json's `objective` key:
    best_val_acc for a classifier, final_val_loss for the other tasks by default)."""
    validate(cfg)
    if cfg.launcher.name == "ray":
        ray.check(cfg.launcher)  # before anything is written
    cfg = resolve(cfg)
    if cfg.launcher.name == "kubernetes":
        kubernetes.check(cfg)  # before anything is written
    # checkpoint.monitor names a metric validation logs: refused now, not after an epoch.
    check_checkpointing(cfg.checkpoint, known_metrics(cfg))
    run_dir = Path(cfg.paths.output_dir)
    hold_run_dir(cfg)  # before anything is written there: one live run per run dir
    # Before anything is written: a refused or unreadable resume leaves the run dir as it was,
    # and a run that already finished is not trained again.
    finished = check_resume(cfg, strategy_for(cfg).data_world(planned_world_size(cfg)))
    if finished is not None:
        return finished.get(cfg.objective)
    if cfg.launcher.name == "slurm":
        forget_checkpoint()  # the job's processes read it themselves
        return _launch_slurm(cfg, run_dir)
    if cfg.launcher.name == "ray":
        check_strategy(cfg, ray.planned_world_size(cfg.launcher))
        return ray.launch(cfg, run_dir)
    if cfg.launcher.name == "kubernetes":
        return _launch_kubernetes(cfg, run_dir)
    if in_srun_step() and not inside_torchrun():
        adopt_srun_task(cfg)
    nproc, nnodes = local_world_size(cfg), cfg.launcher.nnodes
    check_strategy(cfg, nproc)
    if inside_torchrun():
        # Started by the user's own torchrun (or srun): this process *is* a worker.
        if int(os.environ["RANK"]) == 0:
            write_run_config(cfg, run_dir)
        return run_worker(cfg).get(cfg.objective)
    # Nodes of a multi-node run share the run dir: each writes config.node<k>.yaml, and global
    # rank 0 writes config.yaml once all ranks agree on it (train.agree_on_config).
    multi_node = str(nnodes) != "1"
    name = f"config.node{cfg.launcher.node_rank}.yaml" if multi_node else "config.yaml"
    path = write_run_config(cfg, run_dir, name)
    if cfg.trainer.progress != "none":
        Console().print(_startup_tree(cfg))
    log.info("run dir: %s", run_dir)
    if cfg.launcher.name != "torchrun" and nproc == 1 and not multi_node:
        return run_worker(cfg).get(cfg.objective)
    forget_checkpoint()  # the workers read it themselves: this process keeps no copy
    run_torchrun(cfg, path, nproc)
    summary = run_dir / "summary.json"  # written by global rank 0, possibly on another node
    return json.loads(summary.read_text()).get(cfg.objective) if summary.is_file() else None


def _startup_tree(cfg: DictConfig):
    """The chosen options and the values that differ from their defaults (the full tree is
    config_tree.txt). Without a second compose (~0.2 s): the values that can differ are those
    the command line sets and those the added groups' files (experiment, debug) set; each is
    compared with the default its chosen option's own file (or that option's schema) gives
    (`_option_defaults`). Outside a Hydra run (or if that fails), the full tree as before."""
    try:
        hydra_cfg = HydraConfig.get()
        runtime = hydra_cfg.runtime.choices
        primary = OmegaConf.load(CONFIG_DIR / "train.yaml").defaults
        default_choices = {
            k: v for entry in primary if isinstance(entry, DictConfig) for k, v in entry.items()
        }
        groups = [g for g in default_choices if g not in ("hydra", "paths", "hparams_search")]
        choices = {g: runtime[g] for g in groups if runtime.get(g)}
        repo = GlobalHydra.instance().config_loader().repository
        changed = _set_keys(list(hydra_cfg.overrides.task), runtime, default_choices, repo)
        flat = _option_defaults(changed, runtime, repo)
    except Exception:  # noqa: BLE001 - a display nicety: never fail a run on it
        return config_tree(cfg)
    return startup_tree(cfg, choices, default_choices, flat, keys=changed)


def _set_keys(
    overrides: list[str], runtime: DictConfig, default_choices: dict, repo: object
) -> set[str]:
    """The dotted leaf keys the command line and the added groups' files (experiment, debug:
    groups with no default in train.yaml) set."""
    keys: set[str] = set()
    for group, option in runtime.items():
        if group in default_choices or group.startswith("hydra") or not isinstance(option, str):
            continue
        loaded = repo.load_config(f"{group}/{option}")
        if loaded is None:
            continue
        package = loaded.header.get("package") or group
        node = OmegaConf.to_container(loaded.config, resolve=False)
        node.pop("defaults", None)
        prefix = "" if package == "_global_" else f"{package.removeprefix('_global_.')}."
        keys.update(prefix + k for k in flat_defaults(node))
    for line in overrides:
        key, _, value = line.lstrip("+~").partition("=")
        if not key or key in runtime or line.startswith("~"):
            continue
        nested = _as_dict(value)
        if nested:
            keys.update(f"{key}.{k}" for k in flat_defaults(nested))
        else:
            keys.add(key)
    return keys


def _as_dict(value: str) -> dict:
    """`key={a: 1}` sets key.a: the dict an override's value is, else {}."""
    if not value.startswith("{"):
        return {}
    node = OmegaConf.create(value)
    return OmegaConf.to_container(node) if isinstance(node, DictConfig) else {}


def _option_defaults(keys: set[str], runtime: DictConfig, repo: object) -> dict[str, object]:
    """Each key's default: from the file of its group's chosen option, else from that option's
    schema (the first entry of the file's defaults list); top-level keys from train.yaml and
    its schema. A key found in neither is missing from the result (shown as added)."""
    sources: dict[str, list[DictConfig]] = {}

    def chain(group: str) -> list[DictConfig]:
        if group not in sources:
            option = runtime.get(group) if group else "train"
            found: list[DictConfig] = []
            path = f"{group}/{option}" if group else "train"
            while isinstance(option, str) and path and len(found) < 3:
                loaded = repo.load_config(path)
                if loaded is None:
                    break
                found.append(loaded.config)
                first = (loaded.config.get("defaults") or [None])[0]  # the schema, if any
                path = None
                if isinstance(first, str) and not first.startswith("override"):
                    path = f"{group}/{first}" if group else first
            sources[group] = found
        return sources[group]

    defaults: dict[str, object] = {}
    for key in keys:
        group, _, rest = key.partition(".")
        group, rest = (group, rest) if rest and group in runtime else ("", key)
        for node in chain(group):
            value = OmegaConf.select(node, rest, default=_ABSENT, throw_on_missing=False)
            if value is not _ABSENT:
                defaults[key] = (
                    OmegaConf.to_container(value)
                    if isinstance(value, DictConfig | ListConfig)
                    else value
                )
                break
    return defaults


_ABSENT = object()


def _launch_slurm(cfg: DictConfig, run_dir: Path) -> None:
    if in_srun_step():
        raise UserError(
            "launcher=slurm inside an srun step would submit a job from every task. Inside an "
            "allocation call `srun accel-train ...` with launcher=local (the default), or run "
            "`accel-train launcher=slurm` once from the batch script or salloc shell."
        )
    lc = cfg.launcher
    nproc = slurm.processes_per_node(lc)
    check_strategy(cfg, nproc * lc.nodes, nodes=lc.nodes)
    if cfg.resume is None:
        cfg.resume = "auto"  # a requeued job lands in this run dir and continues
    path = write_run_config(cfg, run_dir)
    slurm.submit(cfg, path)
    return None


def _launch_kubernetes(cfg: DictConfig, run_dir: Path) -> None:
    lc = cfg.launcher
    nproc = kubernetes.processes_per_node(lc)
    check_strategy(cfg, nproc * lc.nodes, nodes=lc.nodes)
    if cfg.resume is None:
        cfg.resume = "auto"  # a restarted pod lands in this run dir and continues
    # Rendered and checked against the engine's models before anything is written.
    manifest = kubernetes.launch(cfg, run_dir / "config.yaml")
    write_run_config(cfg, run_dir)
    kubernetes.finish(cfg, manifest)
    return None


def adopt_srun_task(cfg: DictConfig) -> None:
    """`srun accel-train ...` inside an allocation: one task per node becomes a node agent
    (torchrun); one task per process becomes a worker directly (torchrun's variables from
    SLURM's, as torchrun would set them)."""
    env = os.environ
    nodes, ntasks = int(env["SLURM_JOB_NUM_NODES"]), int(env["SLURM_NTASKS"])
    head = slurm.head_node()
    port = slurm.step_port(env["SLURM_JOB_ID"], env["SLURM_STEP_ID"])
    if ntasks == nodes:
        lc = cfg.launcher
        lc.nnodes, lc.node_rank = str(nodes), int(env["SLURM_NODEID"])
        lc.rdzv_endpoint = f"{head}:{port}"
        lc.rdzv_id = f"{env['SLURM_JOB_ID']}_{env['SLURM_STEP_ID']}"
        if nodes > 1 and lc.name == "local":
            lc.name = "torchrun"
        return
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(ntasks),
        LOCAL_RANK=env["SLURM_LOCALID"],
        LOCAL_WORLD_SIZE=str(ntasks // nodes),
        MASTER_ADDR=head,
        MASTER_PORT=str(port),
    )


def planned_world_size(cfg: DictConfig) -> int | None:
    """The number of processes this run will have, where the launcher can tell before
    starting them (None: an elastic node range, or srun's own layout; the loop checks then)."""
    if inside_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if cfg.launcher.name == "slurm":
        return slurm.processes_per_node(cfg.launcher) * int(cfg.launcher.nodes)
    if cfg.launcher.name == "ray":
        return ray.planned_world_size(cfg.launcher)
    if cfg.launcher.name == "kubernetes":
        return kubernetes.processes_per_node(cfg.launcher) * int(cfg.launcher.nodes)
    if in_srun_step() or not str(cfg.launcher.nnodes).isdigit():
        return None
    return local_world_size(cfg) * int(cfg.launcher.nnodes)


def local_world_size(cfg: DictConfig) -> int:
    """Processes on this node; checks `nproc_per_node` against the GPUs when training on CUDA."""
    lc, want = cfg.launcher, str(cfg.launcher.nproc_per_node)
    on_cuda = cfg.trainer.device == "cuda" or (
        cfg.trainer.device == "auto" and torch.cuda.is_available()
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.trainer.device == "cuda" and not gpus:
        resolve_device("cuda")  # raises: names trainer.device=cuda and the fix
    if want == "auto":
        return max(gpus, 1) if on_cuda else 1
    try:
        nproc = int(want)
    except ValueError:
        raise UserError(
            f"launcher.nproc_per_node={lc.nproc_per_node!r} is not a number or `auto`."
        ) from None
    if nproc < 1:
        raise UserError(f"launcher.nproc_per_node={nproc} must be >= 1 (or `auto`).")
    if on_cuda and nproc > gpus:
        raise UserError(
            f"launcher.nproc_per_node={nproc} but this node has {gpus} GPU(s). Use "
            f"`launcher.nproc_per_node={gpus}` or `auto`, or train on the CPU with "
            "`trainer.device=cpu` (gloo)."
        )
    return nproc


def check_strategy(cfg: DictConfig, nproc: int, nodes: int | None = None) -> None:
    """The strategy's refusals for `nproc` processes on each of the nodes, before any starts:
    its layout (every mesh degree divides the world, a TP degree the heads), its own limits."""
    sc, nnodes = cfg.strategy, str(nodes or cfg.launcher.nnodes)
    world = nproc * int(nnodes) if nnodes.isdigit() else None
    strategy_for(cfg).check_world(world, nproc, nnodes)
    if sc.backend == "nccl" and not torch.cuda.is_available():
        raise UserError(
            "strategy.backend=nccl but this machine has no CUDA device; NCCL only runs on GPUs. "
            "Use `strategy.backend=gloo` (or `auto`, which picks gloo on the CPU)."
        )

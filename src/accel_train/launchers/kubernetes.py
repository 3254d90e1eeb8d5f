"""`launcher=kubernetes`: write a Kubeflow TrainJob or PyTorchJob into the run dir, checked
against the engine's models (launchers/kubernetes_manifest.py), and apply it with submit=true;
the pods train later."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from accel_train.config.run_config import write_run_config
from accel_train.config.schema import KubernetesLauncherConfig
from accel_train.launchers import kubernetes_manifest as manifests
from accel_train.launchers.base import Launcher
from accel_train.launchers.world import check_strategy, node_keys
from accel_train.plugins import register_launcher
from accel_train.strategies import WorldKeys


@register_launcher("kubernetes", KubernetesLauncherConfig)
class Kubernetes(Launcher):
    def check(self, cfg: DictConfig) -> None:
        manifests.check(cfg)

    def planned_world_size(self, cfg: DictConfig) -> int:
        return manifests.processes_per_node(cfg.launcher) * int(cfg.launcher.nodes)

    def world_keys(self, cfg: DictConfig) -> WorldKeys:
        return node_keys(cfg.launcher)

    def submits_and_exits(self, cfg: DictConfig) -> bool:
        return True

    def launch(self, cfg: DictConfig) -> None:
        lc, run_dir = cfg.launcher, Path(cfg.paths.output_dir)
        check_strategy(cfg, manifests.processes_per_node(lc), lc.nodes, self.world_keys(cfg))
        if cfg.resume is None:
            cfg.resume = "auto"  # a restarted pod lands in this run dir and continues
        # Rendered and checked against the engine's models before anything is written.
        manifest = manifests.launch(cfg, run_dir / "config.yaml")
        write_run_config(cfg, run_dir)
        manifests.finish(cfg, manifest)
        return None

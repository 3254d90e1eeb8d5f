"""What a launcher is: the object `launcher=<name>` chooses, asked questions instead of having
its name tested.

`launchers/launch.py` runs the steps every launch shares (validate, resolve, this launcher's
`check`, the run dir's lock, the resume check on `planned_world_size`), then hands the run to
`launch`. A new launcher is a subclass in a file of its own plus one line in the registry
(`launchers/__init__.py`); its options are a YAML in configs/launcher/ with a schema.
"""

from __future__ import annotations

from omegaconf import DictConfig

from accel_train.strategies import WorldKeys


class Launcher:
    """One way of starting a run's processes. Subclasses override what differs."""

    def check(self, cfg: DictConfig) -> None:
        """Refuse launcher.* values (UserError) before anything is written. The config is
        resolved; the run dir does not exist yet, or is as the last run left it."""

    def planned_world_size(self, cfg: DictConfig) -> int | None:
        """The number of processes the run will have, where this launcher can tell before
        starting them; None when it cannot (the loop checks then)."""
        raise NotImplementedError

    def world_keys(self, cfg: DictConfig) -> WorldKeys:
        """This launcher's keys for the processes, with the user's values: what the
        strategies' refusals name (torchrun's nproc_per_node and nnodes by default)."""
        lc = cfg.launcher
        nproc, nnodes = lc.nproc_per_node, str(lc.nnodes)
        if nnodes == "1":
            given = f"launcher.nproc_per_node={nproc}"
            return WorldKeys(given, "launcher.nproc_per_node", "launcher.nproc_per_node=1")
        return WorldKeys(
            f"launcher.nproc_per_node={nproc} and launcher.nnodes={nnodes}",
            "launcher.nproc_per_node (x launcher.nnodes)",
            "launcher.nproc_per_node=1 launcher.nnodes=1",
        )

    def submits_and_exits(self, cfg: DictConfig) -> bool:
        """True when `launch` hands the run to a scheduler and returns before it trains: this
        process then only checks the run dir's lock (the job's global rank 0 takes it), and a
        sweep job records "submitted" instead of waiting for summary.json."""
        return False

    def launch(self, cfg: DictConfig) -> float | None:
        """Start (or submit) the run in cfg.paths.output_dir; the run's objective when it
        trained here, None when it trains elsewhere or later."""
        raise NotImplementedError

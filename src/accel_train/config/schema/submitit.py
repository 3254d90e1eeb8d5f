"""hydra/launcher=submitit_slurm: Hydra's submitit plugin (the `slurm` extra)."""

from __future__ import annotations

from dataclasses import dataclass

try:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
except ImportError:  # not installed: commands/sweep_summary.check_plugins names the extra
    SlurmQueueConf = None

SubmititSlurmConfig = None
if SlurmQueueConf is not None:

    @dataclass
    class SubmititSlurmConfig(SlurmQueueConf):
        """The plugin's `submitit_slurm` option with two changes (every other key and default is
        the plugin's): its SlurmLauncher with errors that name the key to set, and requeues
        after the time limit, since every sweep job resumes from its last.pt when requeued."""

        # the plugin's SlurmLauncher, reporting refused submissions and lost jobs as UserErrors
        _target_: str = "hydra_plugins.accel_train_submitit.SlurmLauncher"
        # requeues after reaching the time limit (the plugin's 0 ends a timed-out job; a
        # preempted job is always requeued), as launcher=slurm's max_requeues
        max_num_timeout: int = 3

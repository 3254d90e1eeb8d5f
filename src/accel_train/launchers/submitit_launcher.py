"""`hydra/launcher=submitit_slurm`: Hydra's submitit launcher plugin, with errors a user can act on.

Hydra only instantiates launchers from the `hydra_plugins` package, so the launcher class is
`hydra_plugins.accel_train_submitit.SlurmLauncher`, the plugin's SlurmLauncher with the mixin
below; config/schema/submitit.py points `hydra/launcher=submitit_slurm` at it. The mixin
changes only how failures on the submitting side are reported (one paragraph naming the
`hydra.launcher.*` key to set, exit 2; see errors.py):

- no SLURM commands on this machine (submitit itself would raise a RuntimeError),
- sbatch refusing the jobs (a partition, account or time limit the cluster does not accept),
- a job that ended without a result (cancelled, killed, out of memory): the plugin raises the
  first such job's error and stops waiting for the others.

The jobs themselves run as before: submitit pickles this launcher, and in each SLURM job its
`__call__` runs the Hydra job (commands/sweep.py). Preemption and requeueing are the job's side
(train/signals.py, launchers/slurm_job.py).
"""

from __future__ import annotations

import shutil
import traceback
from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn

from accel_train.errors import UserError, report_user_errors

# What a cluster may insist on, in the plugin's spelling (hydra.launcher.KEY).
CLUSTER_KEYS = (
    "partition, account, qos, timeout_min (minutes), cpus_per_task, mem_gb, gpus_per_node"
)


class ReportErrors:
    """Mixed into the plugin's SlurmLauncher (hydra_plugins/accel_train_submitit)."""

    params: dict
    config: Any

    @report_user_errors
    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        if shutil.which("sbatch") is None or shutil.which("srun") is None:
            raise UserError(
                "hydra/launcher=submitit_slurm submits each sweep job with `sbatch`, which is "
                "not on PATH here (not a SLURM login node?). Run the sweep on the cluster's "
                "login node; `scripts/slurm/local-cluster.sh start` runs a one-node SLURM on "
                "this machine, and `hydra/launcher=submitit_local` runs the jobs as local "
                "processes instead."
            )
        # Imported here, as the plugin does: Hydra imports this module at every start-up.
        from submitit.core.utils import FailedJobError, UncompletedJobError

        sweep_dir = self.config.hydra.sweep.dir if self.config is not None else "<sweep dir>"
        try:
            return super().launch(job_overrides, initial_job_idx)
        except FailedJobError as err:
            if not _while_submitting(err):
                raise
            message = " ".join(str(err).split())
            raise UserError(
                f"hydra/launcher=submitit_slurm: sbatch refused the sweep's jobs: {message}. Set "
                f"what this cluster needs with hydra.launcher.KEY=VALUE ({CLUSTER_KEYS}; `sinfo` "
                "lists the partitions and their time limits); any other #SBATCH option goes in "
                "`hydra.launcher.additional_parameters={KEY:VALUE}`. The script submitit "
                f"handed to sbatch is {sweep_dir}/.submitit/.submission_file_*.sh."
            ) from None
        except UncompletedJobError as err:
            first = " ".join(str(err).split("Error stream produced:")[0].split())
            raise UserError(
                f"a sweep job ended on SLURM without a result (cancelled, killed, out of memory "
                f"or out of time?): {first}. Its log is next to that path. Other jobs of the "
                "sweep may still be running (`squeue --me`). Run the same command again with "
                f"`resume=auto hydra.sweep.dir={sweep_dir}`: finished jobs are skipped and the "
                "others resume from their last.pt; for a job that ran out of memory or time, "
                "raise hydra.launcher.mem_gb or hydra.launcher.timeout_min."
            ) from None


def _while_submitting(err: BaseException) -> bool:
    """The error came from sbatch (submitit's map_array), not from a job's result."""
    return any(frame.name == "map_array" for frame in traceback.extract_tb(err.__traceback__))

"""accel-train's `hydra/launcher=submitit_slurm` launcher (Hydra instantiates launchers only from
the `hydra_plugins` package): Hydra's submitit plugin's SlurmLauncher, reporting what a user can
fix as one-paragraph errors (accel_train/launchers/submitit_launcher.py). Hydra scans this package
at every start-up: without the plugin (the `slurm` extra) it defines nothing."""

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
        SlurmLauncher as _PluginSlurmLauncher,
    )
except ImportError:
    _PluginSlurmLauncher = None

if _PluginSlurmLauncher is not None:
    from accel_train.launchers.submitit_launcher import ReportErrors

    class SlurmLauncher(ReportErrors, _PluginSlurmLauncher):
        """The plugin's SlurmLauncher; see accel_train.launchers.submitit_launcher."""

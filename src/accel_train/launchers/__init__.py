"""Launchers: the objects `launcher=<name>` chooses, one small file each, and what they share.

- base.py (what a launcher answers), names.py (the built-in launchers' names and modules, and
  whether each submits: no launcher imported), registry.py (`launcher_for`: the launcher
  registered under the name, its module imported then), preflight.py (the config checks that
  need no torch, run before launch.py is imported), launch.py (the body of `accel-train`: the
  steps every launch shares, then the launcher's `launch`);
- local.py, torchrun.py (this node: in-process or torchrun), slurm.py, ray.py, kubernetes.py;
- their helpers: world (processes per node, the strategy's check), startup_tree (what a launch
  prints), torchrun_process, rendezvous, worker and node (the processes torchrun and srun
  start), slurm_job (sbatch, requeues, srun tasks), ray_train and ray_job (Ray Train, the Jobs
  API driver), kubernetes_manifest (Kubeflow manifests), submitit_launcher (the Hydra plugin's
  error messages);
- lock.py: one live run per run dir. It lives with the launchers, not in a package of its own,
  because who takes the lock (the launching process, global rank 0 or a submitted job) is a
  question about how the run was launched.

A new launcher is one file with a `Launcher` subclass under `@register_launcher(name, Config)`
(accel_train.plugins), and its lines in names.py's BUILTIN_MODULES and SUBMITTED (or, outside
accel-train, an `accel_train.plugins` entry point). This package imports nothing: a run imports
only the launcher it uses, and Hydra's plugin scan, which imports submitit_launcher.py at every
start-up (hydra_plugins/accel_train_submitit), imports no torch.
"""

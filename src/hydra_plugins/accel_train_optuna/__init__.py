"""accel-train's Optuna sweeper: `hydra/sweeper=optuna` (the `sweep` extra: Optuna >= 4).

A Hydra sweeper on Optuna's ask/tell interface, with the config surface of Hydra's former
hydra-optuna-sweeper plugin (`params:` in Hydra's override syntax, `n_trials`, `n_jobs`,
`direction`, `sampler`, `storage`, `study_name`) plus `pruner`. That plugin pins optuna<3; this
one runs on a current Optuna and keeps studies in a database (`storage=sqlite:///optuna.db`).

Hydra imports every module of this package whose name does not start with `_` at each start-up
(its plugin scan), so only `config` and `optuna_sweeper` are public and neither imports Optuna
or torch at module level; the work is in the `_`-modules, imported when a sweep starts:

- `_search_space`: `params` and command-line sweeps -> Optuna distributions and overrides,
- `_study`: the search itself (ask a batch, launch it, tell each trial's outcome),
- `_pruning`: the loop callback that reports a trial's validation metric and stops it when
  the pruner says so.
"""

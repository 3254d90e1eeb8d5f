"""Studies of the sweep running in this process, by name: a trial that trains in this same
process (Hydra's basic launcher, one process per trial) reports to the live study even when it
is only in memory. Its own module: Hydra's plugin scan re-executes public modules, not this."""

from __future__ import annotations

from typing import Any

LIVE: dict[str, Any] = {}  # study name -> optuna.Study

# Where the sweeper leaves each trial's link for its pruning callback:
# <sweep dir>/LINK_DIR/<job number>.json
LINK_DIR = ".optuna_trials"

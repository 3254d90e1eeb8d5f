"""`python -m accel_train.node <config.yaml> ...`: the stable name of the per-node torchrun
agent that SLURM batch scripts start; see launchers/node.py."""

import sys

from accel_train.launchers.node import main

if __name__ == "__main__":
    main(sys.argv[1:])

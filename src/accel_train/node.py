"""`python -m accel_train.node <config.yaml> ...`: the stable name of the per-node torchrun
agent that SLURM batch scripts start; see launch/node.py."""

import sys

from accel_train.launch.node import main

if __name__ == "__main__":
    main(sys.argv[1:])

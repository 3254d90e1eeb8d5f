"""`python -m accel_train.worker <run_dir>/config.yaml`: the stable name of the torchrun worker
entry point (documented for users' own torchrun and batch scripts); see launchers/worker.py."""

import sys

from accel_train.environment import die_with_launcher, exit_without_teardown

if __name__ == "__main__":
    die_with_launcher()  # first: importing the worker (torch) takes seconds
    from accel_train.launchers.worker import main

    main(sys.argv[1:])
    exit_without_teardown(0)  # a finished worker: see the function (errors end as before)

"""`python -m accel_train.launchers.ray_job <run_dir>/config.yaml`: the driver of a run submitted
with `launcher=ray launcher.submit=job` (Ray's Jobs API runs it on the cluster); see
launchers/ray_train.py."""

from __future__ import annotations

import sys

from accel_train.errors import report_user_errors
from accel_train.launchers.ray_train import job_main


@report_user_errors
def main(argv: list[str]) -> None:
    if len(argv) != 1:
        print(
            "usage: python -m accel_train.launchers.ray_job <run_dir>/config.yaml", file=sys.stderr
        )
        sys.exit(2)
    job_main(argv[0])


if __name__ == "__main__":
    main(sys.argv[1:])

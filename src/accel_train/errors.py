"""UserError and the decorator that reports it: one paragraph, exit 2, no traceback.

Imports nothing from accel_train and no Hydra, so every entry point (the Hydra CLI, torchrun
workers, SLURM node agents) can use it.
"""

from __future__ import annotations

import functools
import os
import sys


class UserError(ValueError):
    """A problem the user can fix: reported as one paragraph, exit 2, no traceback.

    Raised in a DataLoader worker (a label check, an unreadable image, a token id outside the
    vocabulary), it reaches the main process re-created by torch as ``type(err)("Caught
    <name> in DataLoader worker process 0. Original Traceback ...: <message>")``; the
    constructor keeps only the message, so the user still sees one paragraph."""

    def __init__(self, message: object = "", *args: object):
        text = str(message)
        marker = f"{type(self).__name__}: "
        if text.startswith("Caught ") and "Original Traceback" in text and marker in text:
            message = text.rsplit(marker, 1)[1].strip()
        super().__init__(message, *args)


class DataSourceLost(UserError):
    """The loader lost what makes its batches (loader=ray: the Ray cluster or all of its data
    workers) mid-epoch. The loop saves last.pt before it reports this, so the run resumes."""


def report_user_errors(fn):
    """A UserError becomes one paragraph on stderr and exit code 2 (the traceback only with
    HYDRA_FULL_ERROR=1, like Hydra's own errors)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            prog = os.path.basename(sys.argv[0]) or "accel-train"
            if prog.endswith(".py") or prog == "-m":  # python -m accel_train.worker / node
                prog = "accel-train"
            print(
                f"{prog}: error: {err}\n(Set HYDRA_FULL_ERROR=1 for the traceback.)",
                file=sys.stderr,
            )
            sys.exit(2)

    return wrapper

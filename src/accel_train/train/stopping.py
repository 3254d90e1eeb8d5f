"""What a run asked to stop does once every rank agreed (train/signals.py has the signals, the
loop the agreement): save last, then return status "preempted" or exit with 128 + the signal.
And what a run whose loader lost its source does: save last, then say how to resume."""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch

from accel_train.train.signals import Stopped, signal_name

log = logging.getLogger("accel_train")


def stop_run(loop: Any) -> dict[str, Any]:
    """Asked to stop by a signal (train/signals.py): save last, then return "preempted"
    (SIGUSR1: preemption or the time limit; the launch side may requeue) or exit with
    128 + signum (SIGTERM, SIGINT)."""
    exits = loop.stop.exits
    if loop.env.distributed:
        # The ranks agreed to stop; agree on how, too (one rank may have had SIGTERM and
        # another only the SIGUSR1 before it, or nothing): one tiny collective, once a run.
        vote = torch.tensor([float(exits)], device=loop.env.device)
        exits = loop.env.all_reduce_sum(vote).item() > 0
    # (Saved at this very step already, e.g. a trainer.ckpt_every_n_steps step: don't spend
    # the grace period before SIGKILL on writing it twice.)
    loop.save_last()
    loop.checkpointer.wait()  # complete before the run exits or is requeued
    ckpt = loop.checkpointer.path("last")
    loop.progress.close()
    if exits:
        signum = loop.stop.signum if loop.stop.exits else signal.SIGTERM
        loop.metrics.log({"event": "stopped", "signal": signal_name(signum)}, loop.step, loop.epoch)
        loop.metrics.close()
        if loop.env.is_main:
            log.warning(
                "%s: stopped at epoch %d step %d, checkpoint %s; continue with "
                "`resume=auto hydra.run.dir=%s`",
                signal_name(signum),
                loop.epoch,
                loop.step,
                ckpt,
                loop.run_dir,
            )
        raise Stopped(signum)
    log.warning("stopped at epoch %d step %d; checkpoint %s", loop.epoch, loop.step, ckpt)
    loop.metrics.log({"event": "preempted"}, loop.step, loop.epoch)
    loop.metrics.close()
    return {
        "status": "preempted",
        "steps": loop.step,
        "epochs": loop.epoch,
        "checkpoint": str(ckpt),
    }


def save_after_lost_source(loop: Any, err: Exception) -> str:
    """The loader lost its source mid-epoch (loader=ray: the cluster, or every data worker):
    save last.pt at the last optimizer step (the weights have not moved since; a partial
    accumulation window is made again on resume) and say how to continue. Several processes
    cannot agree on a save here (the others may be waiting elsewhere): their last periodic
    checkpoint stands."""
    where = loop.checkpointer.path("last")
    if loop.env.distributed:
        if not where.exists():
            return f"{err} No checkpoint was written before it (step {loop.step})."
        return (
            f"{err} The last periodic checkpoint, {where}, resumes it: rerun with `resume=auto "
            f"hydra.run.dir={loop.run_dir}`."
        )
    loop.save("last")
    loop.checkpointer.wait()
    return (
        f"{err} The run is resumable: {where} holds step {loop.step} "
        f"(epoch {loop.epoch}, batch {loop.batch_in_epoch}); rerun with `resume=auto "
        f"hydra.run.dir={loop.run_dir}` to continue."
    )

"""Atomic checkpoint files and the RNG state that makes a resume exact."""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

# Clearing what killed saves left (the run dir's lock does it, with no torch import).
from accel_train.checkpoint_temps import pid_alive as pid_alive
from accel_train.checkpoint_temps import remove_stale_temps as remove_stale_temps
from accel_train.errors import UserError
from accel_train.safe_load import load_dcp, torch_load_error

FORMAT_VERSION = 1


def atomic_save(obj: Any, path: str | Path) -> None:
    """Write to a temp file beside `path`, fsync, rename: a kill at any moment leaves either the
    old file or the new one, never a torn one (a SIGKILL can leave the temp file itself:
    `remove_stale_temps` clears it on the next start). A full disk or an unwritable directory
    is a UserError that names the path and the free space; the old file stays as it was."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except (OSError, RuntimeError) as err:
        # torch.save reports a failed write as RuntimeError("... unexpected pos ...") with the
        # OSError (ENOSPC, EDQUOT, EIO...) as its context; other RuntimeErrors are not ours.
        cause = _os_error(err)
        if cause is None:
            raise
        raise write_error(path, cause) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def temp_path(path: Path) -> Path:
    """Where atomic_save writes `path` first: hidden, beside it, named by the writing process."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _os_error(err: BaseException | None) -> OSError | None:
    """The OSError behind an exception (itself, its cause or context, or a failure that
    torch.distributed.checkpoint collected from a rank), if there is one."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, OSError):
            return err
        for failure in (getattr(err, "failures", None) or {}).values():  # CheckpointException
            inner = _os_error(failure[0] if isinstance(failure, tuple) else failure)
            if inner is not None:
                return inner
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def write_error(path: Path, err: OSError) -> UserError:
    """One paragraph for a checkpoint that could not be written: the path, the reason, the free
    space, and that the previous checkpoints are intact."""
    reason = err.strerror or str(err)
    code = errno.errorcode.get(err.errno, "") if err.errno else ""
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
        space = f"{_size(usage.free)} free of {_size(usage.total)} on that filesystem"
    except OSError:
        space = "free space unknown"
    return UserError(
        f"could not write the checkpoint {path}: {reason}{f' ({code})' if code else ''}; "
        f"{space}. The previous checkpoints in {path.parent} are intact (a save writes a temp "
        "file, removed again, and renames it only once complete). Free some space or make the "
        "directory writable, then continue the run with `resume=auto` and the same "
        "hydra.run.dir: it resumes from the last checkpoint that was written."
    )


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def load_checkpoint(path: str | Path, key: str = "ckpt_path") -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{key}={str(path)!r}: no such file. Give the path of a .pt checkpoint.")
    try:
        # weights_only: torch's allow-list unpickler builds tensors and plain values only; a
        # file asking for anything else raises UnpicklingError instead of running it.
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        EOFError,
        pickle.UnpicklingError,  # refused: named a function/class, or not a pickle at all
        zipfile.BadZipFile,
        OSError,
        KeyError,  # these three: a file of another kind (text, random bytes)
        IndexError,
        ValueError,
    ) as err:
        # torch's whole reason (it explains the danger), in the one-paragraph message.
        raise torch_load_error(path, err, key) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT_VERSION:
        raise UserError(
            f"{key}={str(path)!r} was not written by this version of accel-train "
            "(no 'format' marker). Use a checkpoint from checkpoints/ of an accel-train run."
        )
    return ckpt


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(x):
    # random.setstate wants tuples; be lenient if a round trip turned them into lists.
    return tuple(_as_tuples(v) for v in x) if isinstance(x, list | tuple) else x


# ---- sharded (FSDP) checkpoints: a directory written by torch.distributed.checkpoint --------
# <name>.dcp/ holds the model and optimizer shards (reloadable at any world size) and meta.pt
# (progress, RNG, scaler, scheduler, config) from rank 0. It is written to a temp dir and
# renamed, so a kill during a save leaves the previous checkpoint intact (a kill between moving
# the previous one aside and renaming the new one leaves both as .<name>.old/.tmp, and
# remove_stale_temps puts one back on the next start).


def save_sharded(
    model,
    optimizer,
    meta: dict[str, Any],
    path: Path,
    is_main: bool,
    flat_optimizer=False,
    saver=None,
    then=None,
) -> None:
    """`flat_optimizer` (pipeline): the optimizer state keyed by parameter name, hyperparameters
    too, so that each stage writes its own keys (the default layout has one `param_groups`
    list, which differs between stages) and the checkpoint loads at another layout.

    `saver` (async_save.AsyncSaver, checkpoint.async_save=true): the shards are copied to host
    memory and written by torch.distributed.checkpoint.async_save in the background; rank 0
    then writes meta.pt, renames the directory into place and calls `then` (e.g. link best).
    The caller has waited for the previous save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flat_optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    meta = {**meta, "flat_optimizer": flat_optimizer}
    tmp = path.with_name(f".{path.name}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state = {"model": model_sd, "optimizer": optim_sd}
    if saver is None:
        _write_sharded(lambda: dcp.save(state, checkpoint_id=str(tmp)), meta, path, is_main)
        dist.barrier()
        return
    # The saver's stager copies the shards to host memory on its thread (the loop waits for
    # the copy before the next optimizer step); dcp's thread then writes them.
    response = dcp.async_save(
        state, checkpoint_id=str(tmp), process_group=saver.group, async_stager=saver.stager
    )

    def finish() -> None:
        _write_sharded(response.upload_completion.result, meta, path, is_main)
        if then is not None and is_main:
            then()

    saver.submit(finish, staging=response.staging_completion)


def _write_sharded(write, meta: dict[str, Any], path: Path, is_main: bool) -> None:
    """Run `write` (the shards into .<name>.tmp), then rank 0 puts meta.pt in and renames the
    directory into place. A failure leaves the previous checkpoint where it was."""
    import torch.distributed.checkpoint as dcp

    tmp = path.with_name(f".{path.name}.tmp")
    old = path.with_name(f".{path.name}.old")
    try:
        # dcp.save gathers every rank's write errors and raises them on all ranks (as a
        # CheckpointException, a BaseException), so all ranks report the same UserError.
        write()
        if is_main:
            atomic_save(meta, tmp / "meta.pt")
            shutil.rmtree(old, ignore_errors=True)
            if path.exists():
                os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError, UserError, dcp.CheckpointException) as err:
        if is_main:
            if not path.exists() and old.is_dir():
                # Failed between the two renames: put the previous checkpoint back.
                with contextlib.suppress(OSError):
                    os.replace(old, path)
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, UserError):
            raise
        cause = _os_error(err)
        if cause is None:
            raise
        raise write_error(path, cause) from None


def load_full_into_sharded(model, optimizer, state: dict[str, Any]) -> None:
    """A single-file checkpoint (single, DDP) into a sharded model (FSDP, TP, FSDP x TP): the
    whole weights are cut into this process's shards by set_model_state_dict; each optimizer
    state tensor the shape of its parameter is cut like the parameter (distribute_tensor, on
    every rank in the same order). The file's optimizer state is keyed by position in the
    optimizer's parameter list (torch's own format): the same config builds the same groups in
    the same order."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=True))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = state["optimizer"]

    def cut(value, param):
        sharded = isinstance(param, DTensor) and isinstance(value, torch.Tensor)
        if sharded and value.shape == param.shape:
            value = value.to(param.to_local().device)
            return distribute_tensor(value, param.device_mesh, param.placements)
        return value

    optim_state = {
        i: {k: cut(v, params[i]) for k, v in per_param.items()}
        for i, per_param in saved["state"].items()
    }
    # The kernel choice is this run's: a fused optimizer (chosen for plain tensors) does not
    # take DTensors, and load_state_dict would bring the file's choice back.
    kernels = ("fused", "foreach", "capturable")
    groups = [
        {**g, **{k: live[k] for k in kernels if k in live}}
        for g, live in zip(saved["param_groups"], optimizer.param_groups, strict=True)
    ]
    optimizer.load_state_dict({"state": optim_state, "param_groups": groups})


def load_sharded_meta(path: Path, key: str) -> dict[str, Any]:
    return load_checkpoint(path / "meta.pt", key=key)


def load_sharded(model, optimizer, path: Path) -> None:
    """Load model (and optimizer, if given) shards into an FSDP or plain module."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    # dcp.load itself unpickles .metadata with plain pickle and non-tensor entries with
    # weights_only=False; load_dcp reads both with allow-lists (see safe_load).
    with warnings.catch_warnings():
        if not dist.is_initialized():  # one process loading shards of several is the point
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        if optimizer is None:
            model_sd = model.state_dict()
            load_dcp({"model": model_sd}, path)
            model.load_state_dict(model_sd)
            return
        flat = load_sharded_meta(path, "resume").get("flat_optimizer", False)
        options = StateDictOptions(flatten_optimizer_state_dict=flat)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        state = {"model": model_sd, "optimizer": optim_sd}
        load_dcp(state, path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=options,
        )

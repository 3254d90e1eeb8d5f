"""Atomic checkpoint files and the RNG state that makes a resume exact."""

from __future__ import annotations

import os
import pickle
import random
import zipfile
from pathlib import Path
from typing import Any

import torch

from accel_train.errors import UserError
from accel_train.safe_load import load_dcp, torch_load_error

FORMAT_VERSION = 1


def atomic_save(obj: Any, path: str | Path) -> None:
    """Write to a temp file beside `path`, fsync, rename: a kill at any moment leaves either the
    old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


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
# renamed, so a kill during a save leaves the previous checkpoint intact.


def save_sharded(model, optimizer, meta: dict[str, Any], path: Path, is_main: bool) -> None:
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tmp = path.with_name(f".{path.name}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    if is_main:
        atomic_save(meta, tmp / "meta.pt")
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_sharded_meta(path: Path, key: str) -> dict[str, Any]:
    return load_checkpoint(path / "meta.pt", key=key)


def load_sharded(model, optimizer, path: Path) -> None:
    """Load model (and optimizer, if given) shards into an FSDP or plain module."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        load_dcp(state, path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )

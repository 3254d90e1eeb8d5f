"""Load checkpoints without ever running code stored in them.

A checkpoint is a pickle, and unpickling can call any function the file names
(``__reduce__``), so a crafted checkpoint would run code on `accel-eval ckpt_path=...` or
`accel-train resume=...`. Single files are loaded with ``torch.load(weights_only=True)``.
Sharded (DCP) checkpoints need more, because in the installed torch (2.14) `dcp.load`:

* reads ``<dir>/.metadata`` with a plain ``pickle.load``
  (torch/distributed/checkpoint/filesystem.py, ``FileSystemReader.read_metadata``), and
* loads every non-tensor entry of the ``.distcp`` files (e.g. the optimizer's ``param_groups``)
  with ``torch.load(weights_only=False)`` (default_planner.py, ``DefaultLoadPlanner.load_bytes``).

Tensor entries are already read with ``weights_only=True`` (filesystem.py,
``FileSystemReader.read_data``). `load_dcp` closes the two gaps: `.metadata` goes through an
unpickler that knows only the classes DCP metadata is made of, and non-tensor entries go through
``torch.load(weights_only=True)``. Anything else is refused with a `UserError` naming the file.

`load_dcp` pulls in torch.distributed.checkpoint (about a second to import), so that happens on
first use only; the single-file helpers do not need it.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import pickle
import re
from pathlib import Path, PosixPath
from typing import Any

import torch

from accel_train.errors import UserError

# What to do, shared by every refusal.
_ADVICE = (
    "Use a checkpoint that accel-train wrote in a run you trust (checkpoints/last.pt, best.pt "
    "or their .dcp directories), and do not load this one any other way (e.g. torch.load with "
    "weights_only=False) unless you know where it came from."
)


def _one_line(text: str) -> str:
    """torch's full reason on one line: its ANSI bold codes dropped, whitespace collapsed."""
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())


def refused(file: str | Path, reason: str, key: str | None = None) -> UserError:
    """The one-paragraph error for a checkpoint file that holds more than data."""
    where = f"{key}={str(file)!r}" if key else str(file)
    reason = _one_line(reason)
    return UserError(
        f"{where} was refused: it contains something other than checkpoint data (tensors and "
        "plain values), and loading it would run code stored in the file. "
        f"Reason: {reason}{'' if reason.endswith('.') else '.'} {_ADVICE}"
    )


def unreadable(file: str | Path, reason: str, key: str | None = None) -> UserError:
    """The one-paragraph error for a checkpoint file that is damaged or of another kind."""
    where = f"{key}={str(file)!r}" if key else str(file)
    return UserError(
        f"{where} is not a readable checkpoint ({_one_line(reason)}). It may be truncated or not "
        "written by accel-train; use another checkpoint (e.g. checkpoints/best.pt or last.pt)."
    )


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def torch_load_error(file: str | Path, err: BaseException, key: str | None = None) -> UserError:
    """Turn a failed ``torch.load(weights_only=True)`` into a UserError.

    The weights-only unpickler raises UnpicklingError when the file asks for anything outside
    its allow-list (a function to call, a class to build): that is a refusal, reported with
    torch's whole reason, which explains the danger. Bytes that are no pickle at all (its
    "Unsupported operand" error on a file that does not start like a pickle) and anything else
    mean a damaged file."""
    reason = _reason(err)
    detail = reason.partition("WeightsUnpickler error:")[2].strip()
    if isinstance(err, pickle.UnpicklingError) and (
        not detail.startswith("Unsupported operand") or _starts_like_a_pickle(file)
    ):
        return refused(file, reason, key)
    return unreadable(file, reason, key)


def _starts_like_a_pickle(file: str | Path) -> bool:
    """Pickle protocols 2+ open with the PROTO opcode (0x80); a torch zip file with 'PK'."""
    try:
        with open(file, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


# ---- DCP metadata: a pickle of a few dataclasses ---------------------------------------------


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    """(module, name) -> object: all the globals a `.metadata` pickle may name.

    Derived from real checkpoints (dcp.save of a plain module + Adam in one process, and of an
    FSDP2 module + AdamW in two): both name exactly these. None of them can run code when the
    unpickler calls or builds them: the dataclasses' __init__/__setstate__ only store fields,
    the rest look values up."""
    from torch.distributed.checkpoint import filesystem, metadata

    allowed: dict[tuple[str, str], Any] = {
        # The metadata tree itself (torch/distributed/checkpoint/metadata.py).
        ("torch.distributed.checkpoint.metadata", cls.__name__): cls
        for cls in (
            metadata.Metadata,  # the root object
            metadata.MetadataIndex,  # keys of storage_data (fqn + shard offset)
            metadata.StorageMeta,  # save id and checkpoint_id of the save
            metadata.TensorStorageMetadata,  # one per tensor: properties, size, chunks
            metadata.ChunkStorageMetadata,  # one per shard of a tensor: offsets, sizes
            metadata.TensorProperties,  # dtype/layout; __setstate__ only decodes the enum below
            metadata.BytesStorageMetadata,  # one per non-tensor entry (e.g. optimizer lr)
            metadata._MEM_FORMAT_ENCODING,  # Enum: TensorProperties' memory format
        )
    }
    # storage_data values: which .distcp file, offset and length hold an entry.
    allowed["torch.distributed.checkpoint.filesystem", "_StorageInfo"] = filesystem._StorageInfo
    # Shapes and offsets: a tuple subclass.
    allowed["torch", "Size"] = torch.Size
    # dtypes pickle as the global itself (torch.float32, torch.bfloat16, ...): plain values.
    allowed.update(
        {("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
    )
    # torch.layout pickles as _get_layout("torch.strided") (torch/serialization.py): a lookup in
    # torch's own layouts; torch's weights-only unpickler allows it too.
    allowed["torch.serialization", "_get_layout"] = torch.serialization._get_layout
    # StorageMeta.checkpoint_id is the Path the checkpoint was saved to; building a PosixPath
    # touches no file. Python 3.13+ names its module pathlib._local.
    allowed["pathlib", "PosixPath"] = PosixPath
    allowed["pathlib._local", "PosixPath"] = PosixPath
    return allowed


@functools.cache
def _buildable() -> dict[type, frozenset[str] | None]:
    """The classes BUILD may fill in -> their field names (None: the class's own __setstate__
    checks the state). Only fresh instances of these dataclasses have state to set."""
    from torch.distributed.checkpoint import filesystem, metadata

    classes = [
        metadata.Metadata,
        metadata.MetadataIndex,
        metadata.StorageMeta,
        metadata.TensorStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.BytesStorageMetadata,
        filesystem._StorageInfo,
    ]
    built = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in classes}
    built[metadata.TensorProperties] = None  # __setstate__ unpacks a 5-tuple, decodes an enum
    return built


class _MetadataUnpickler(pickle._Unpickler):
    """pickle with an allow-list: every global the stream names is looked up in
    `_metadata_globals` (never imported), so it can only build DCP metadata (the "restricting
    globals" recipe of the Python pickle docs).

    It is the pure-Python unpickler so that BUILD can be checked as well: with the C one, a
    stream could BUILD on an allowed class itself, or on an enum member, and so set attributes
    that the whole process shares. It is ~15x slower (about 1 s for 16,000 shard entries), which
    is paid once per load."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _metadata_globals()[module, name]
        except KeyError:
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which is not part of DCP checkpoint metadata"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP metadata never does")

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        buildable = _buildable()
        if type(inst) not in buildable:
            raise pickle.UnpicklingError(
                f"it sets the state of a {type(inst).__name__}, which DCP metadata never does"
            )
        fields = buildable[type(inst)]
        if fields is not None and not (isinstance(state, dict) and set(state) <= fields):
            raise pickle.UnpicklingError(f"it sets unknown fields of a {type(inst).__name__}")
        pickle._Unpickler.load_build(self)

    def load_ext(self) -> None:
        # EXT opcodes name globals through copyreg's registry and a process-wide cache that
        # bypasses find_class; dcp.save never writes them.
        raise pickle.UnpicklingError("it uses a copyreg extension code, which DCP never writes")

    dispatch[pickle.BUILD[0]] = load_build
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = load_ext
    del _op


def read_dcp_metadata(path: str | Path, filename: str = ".metadata"):
    """The `Metadata` of the DCP checkpoint directory `path`, read without running code from it
    and checked to have the shape dcp.save writes."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    file = Path(path) / filename
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise refused(file, str(err)) from None
    except FileNotFoundError:
        raise UserError(
            f"{file} is missing, so {path} is not a complete sharded checkpoint (a save may have "
            "been interrupted). Use another checkpoint (e.g. checkpoints/best.dcp or last.dcp)."
        ) from None
    except Exception as err:  # damaged: truncated, a wrong field for a class, ...
        raise unreadable(file, _reason(err)) from None

    def shape_error(what: str) -> UserError:
        return unreadable(file, f"it is not DCP checkpoint metadata: {what}")

    if not isinstance(md, Metadata):
        raise shape_error(f"it holds a {type(md).__name__}")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise shape_error("state_dict_metadata/storage_data are not dicts")
    if not all(
        isinstance(v, TensorStorageMetadata | BytesStorageMetadata)
        for v in md.state_dict_metadata.values()
    ):
        raise shape_error("state_dict_metadata holds other objects")
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise shape_error("storage_data holds other objects")
        name = info.relative_path
        # Each entry points into a shard file in this directory: never elsewhere on disk.
        if not isinstance(name, str) or name in ("", ".", "..") or re.search(r"[/\\]", name):
            raise shape_error(f"a shard is stored at {name!r}, outside the checkpoint")
    return md


# ---- the DCP reader and planner ---------------------------------------------------------------


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    """SafeFileSystemReader and SafeLoadPlanner, defined on first use (see module doc).

    Long because the two classes are defined inside it, so that importing this module does not
    import torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class SafeLoadPlanner(dcp.DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor entries are read with weights_only=True
        (DefaultLoadPlanner.load_bytes uses weights_only=False). Same body otherwise."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    class SafeFileSystemReader(dcp.FileSystemReader):
        """FileSystemReader that reads `.metadata` with `read_dcp_metadata` and turns a shard
        file that holds more than data into a UserError naming that file. (dcp.load wraps it
        in a CheckpointException; `load_dcp` unwraps it.)"""

        def __init__(self, path: str | os.PathLike, metadata=None) -> None:
            super().__init__(path)
            self._metadata = metadata  # already read and checked (load_dcp does that first)

        def reset(self, checkpoint_id=None) -> None:
            super().reset(checkpoint_id)
            if checkpoint_id:
                self._metadata = None  # it belonged to another directory

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self._metadata is None:
                rank = kwargs.get("rank")  # rank-local metadata: __<rank>.metadata
                name = ".metadata" if rank is None else f"__{rank}.metadata"
                self._metadata = read_dcp_metadata(self.path, name)
            md = self._metadata
            if getattr(md, "storage_meta", None) is None:  # as FileSystemReader does
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan, planner):
            if any(item.type == LoadItemType.BYTE_IO for item in plan.items) and not isinstance(
                planner, SafeLoadPlanner
            ):  # another planner would unpickle them with weights_only=False
                raise TypeError("SafeFileSystemReader needs planner=SafeLoadPlanner()")
            # One shard file at a time, so that a refusal can name the file.
            per_file: dict[str, list] = {}
            for item in plan.items:
                name = self.storage_data[item.storage_index].relative_path
                per_file.setdefault(name, []).append(item)
            for name, items in per_file.items():
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except AssertionError:
                    raise  # torch's check that the shard fits the model: not the file's content
                except Exception as err:  # nothing but allow-listed code ran: the file is at fault
                    raise torch_load_error(Path(self.path) / name, err) from None
            done: Future = Future()
            done.set_result(None)
            return done

    return SafeFileSystemReader, SafeLoadPlanner


def __getattr__(name: str) -> Any:
    # `from accel_train.safe_load import SafeFileSystemReader` works, importing DCP only then.
    if name == "SafeFileSystemReader":
        return _dcp_classes()[0]
    if name == "SafeLoadPlanner":
        return _dcp_classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_dcp(state_dict: dict[str, Any], path: str | Path) -> None:
    """`dcp.load(state_dict, checkpoint_id=path)` that never runs code from the checkpoint.

    Raises UserError naming the file if `.metadata` or a shard file holds anything but data."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader_cls, planner_cls = _dcp_classes()
    # Metadata first, outside dcp.load: dcp.load would log a failed read with its traceback
    # and then retry with a rank-local __0.metadata file. Every rank reads the same file, so
    # a refusal here stops all of them before any collective.
    reader = reader_cls(path, read_dcp_metadata(path))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner_cls())
    except CheckpointException as err:  # a BaseException holding what every rank raised
        own = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # This rank's refusal first, else another rank's (failures are gathered from all).
        for _rank, (exc, _trace) in sorted(err.failures.items(), key=lambda f: (f[0] != own, f[0])):
            if isinstance(exc, UserError):
                raise exc from None
        raise

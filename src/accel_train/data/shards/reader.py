"""Reading a shard set with LitData, whatever its items: the source that opens one split in
any process, the splits read by index (validation, test) and the training loader with its
exact mid-epoch resume. The options (data/images/streaming.py, data/video/streaming.py,
data/text/streaming_tokens.py, streaming_sft.py, streaming_preference.py) differ only in the
decoder they hand to :class:`StreamingSource`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from accel_train.config.facts import limited_batches
from accel_train.data.batch import to_device
from accel_train.data.loaders import CheckedCollate, ignore_stop_signals
from accel_train.data.shards.object_store import allow_plain_http, is_s3, s3_error, storage_options
from accel_train.errors import UserError


class _NoSmallCacheAdvice(logging.Filter):
    """LitData warns on every open that a `max_cache_size` below 25GB may thrash with many
    workers and 64MB chunks: a small dataset.cache_limit is the user's choice here (the docs
    say how to size it), and the warning would repeat for every split and epoch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "max_cache_size` is less than" not in str(record.msg)


logging.getLogger("litdata.streaming.dataset").addFilter(_NoSmallCacheAdvice())


class _Once(logging.Filter):
    """LitData's "max_cache_size is unset; using ..." note comes from every reader it opens
    (each split, each loader worker, each epoch): said once a process, the rest dropped."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "max_cache_size is unset" not in str(record.msg):
            return True
        first, _Once.said = not _Once.said, True
        return first


logging.getLogger("litdata.utilities.format").addFilter(_Once())


def _litdata_class():
    from litdata import StreamingDataset

    class _Shards(StreamingDataset):
        """LitData's StreamingDataset whose items go through ``decoder``; re-applies the http
        shim in every process it is unpickled in (spawned loader workers)."""

        decoder: Callable[[Any, int], Any]  # (item, epoch) -> sample

        def __getitem__(self, index):
            try:
                return self.decoder(super().__getitem__(index), int(self.current_epoch))
            except Exception as err:  # noqa: BLE001 - one paragraph naming the chunk file
                raise sample_error(err, self, index) from None

        def __setstate__(self, state):
            self.__dict__.update(state)
            allow_plain_http()

    return _Shards


def _chunk_file(ds, index) -> str | None:
    """The chunk file that holds sample `index` of a LitData StreamingDataset (its internals,
    read defensively: None where they differ)."""
    try:
        chunk = getattr(index, "chunk_index", None)
        if chunk is None:
            chunk = ds.cache._get_chunk_index_from_index(int(index))[1]
        return str(ds.cache._reader.config._chunks[chunk]["filename"])
    except Exception:  # noqa: BLE001 - only the error message is at stake
        return None


def sample_error(err: Exception, ds, index) -> UserError:
    """Reading or decoding one sample failed: one paragraph that names its chunk file."""
    chunk = _chunk_file(ds, index)
    url = getattr(getattr(ds, "input_dir", None), "url", None) or getattr(
        getattr(ds, "input_dir", None), "path", ""
    )
    if chunk is None:
        return err if isinstance(err, UserError) else reading_error(err, str(url))
    if isinstance(err, UserError):  # the decoder's own paragraph, plus where the sample is
        return UserError(f"{err} The sample is in the chunk {chunk}.")
    reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    return UserError(
        f"dataset.remote: the chunk {chunk} of the shards {url} could not be read "
        f"({type(err).__name__}: {reason[:300]}): it is damaged. Write the shard set again "
        "(`accel-data shard ... overwrite=true`); with an object store, also delete the chunk "
        "from the dataset.local cache."
    )


class StreamingSource:
    """Where one split's shards are and how to open them with LitData (in any process).
    ``item_loader``: makes a fresh LitData item loader for each data set opened (it holds the
    state of the chunks being read), e.g. a TokensLoader for token shards; None = LitData's
    default, for items such as the images' dicts."""

    def __init__(self, remote, split, cache, cache_limit, decoder, item_loader=None):
        self.remote, self.split, self.cache = remote.rstrip("/"), split, cache
        self.cache_limit, self.decoder = cache_limit, decoder
        self.item_loader = item_loader

    def open(self, *, shuffle: bool, seed: int, drop_last: bool):
        from litdata.streaming.resolver import Dir

        allow_plain_http()
        url = f"{self.remote}/{self.split}"
        if is_s3(self.remote):
            where = Dir(path=str(self.cache / self.split), url=url)
        else:
            where = str(Path(url).expanduser().absolute())
        try:
            ds = _litdata_class()(
                where,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
                max_cache_size=self.cache_limit,
                storage_options=storage_options(),
                item_loader=self.item_loader() if self.item_loader else None,
            )
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - LitData's own errors, as one paragraph
            raise reading_error(err, url) from None
        ds.decoder = self.decoder
        return ds


def reading_error(err: BaseException, url: str) -> UserError:
    if isinstance(err, UserError):
        return err
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(err, BotoCoreError | ClientError):
            return s3_error(err, url, "dataset.remote")
    except ImportError:  # pragma: no cover
        pass
    reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    return UserError(
        f"dataset.remote: reading the shards {url} failed ({type(err).__name__}: {reason[:300]}). "
        "Check that the shards are complete and readable (write them again with `accel-data "
        "shard ... overwrite=true`) and that the endpoint and credentials work."
    )


class StreamingEvalSplit(Dataset):
    """A split read by index, in order (chunk after chunk), through the usual torch loader:
    validation and test. These chunks stay in the cache (they are read every validation).
    Image splits know their ``labels`` (one per item); token splits read only the items of
    ``indices`` (the fixed validation windows)."""

    def __init__(self, source: StreamingSource, labels=None, indices: Sequence[int] = ()):
        self.source, self.labels = source, labels
        self.indices = indices if labels is None else range(len(labels))
        self._ds = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self._ds is None:  # opened in the process that reads (a loader worker too)
            ds = self.source.open(shuffle=False, seed=0, drop_last=False)
            ds._on_demand_bytes = False  # whole chunks into the cache, not one range GET each
            self._ds = ds
        try:
            return self._ds[int(self.indices[i])]
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001
            raise reading_error(err, f"{self.source.remote}/{self.source.split}") from None

    def __getstate__(self):
        return {**self.__dict__, "_ds": None}

    def __repr__(self) -> str:
        where = f"{self.source.remote}/{self.source.split}"
        return f"{type(self).__name__}({len(self)} samples of {where})"


class StreamingTrainSplit(StreamingEvalSplit):
    """The training split: read by index only for a look at its first items (the model's
    input shape); training reads it through :meth:`make_loader`, which the loader builder calls
    instead of wrapping the split in a loader of its own: streaming reads chunk by chunk, in
    LitData's order."""

    def make_loader(
        self, loader_cfg, *, device, seed, rank, world, limit, num_classes, labelled=True, **_
    ):
        # Class labels are checked per batch (as the torch loader does); token windows have none.
        # (a split of pairs pads its batches with a collate of its own)
        collate = CheckedCollate(num_classes) if labelled else getattr(self, "collate", None)
        return StreamingLoader(self.source, loader_cfg, device, seed, rank, world, limit, collate)


# ---- the training loader -------------------------------------------------------------------


class StreamOrder:
    """What the training loop reads of a loader's order: this rank's batches in an epoch."""

    train = True

    def __init__(self, per_rank: int, batch_size: int, num_batches: int):
        self.per_rank, self.batch_size, self.num_batches = per_rank, batch_size, num_batches
        self.epoch, self.start_batch = 0, 0

    def batch_len(self, b: int) -> int:
        return max(0, min(self.batch_size, self.per_rank - b * self.batch_size))

    def valid_len(self, b: int) -> int:
        return self.batch_len(b)

    def window_len(self, b: int, accum: int) -> int:
        first = b - b % accum
        return sum(self.batch_len(i) for i in range(first, min(first + accum, self.num_batches)))

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.num_batches - self.start_batch


class StreamingLoader:
    """LitData's StreamingDataLoader over the train shards, with the interface of the
    loaders in data/loaders.py: ``epoch(epoch, start_batch)``, ``order``, ``close``.

    LitData's epoch is ours + 1 (its loader counts from 1). A mid-epoch start is handed to
    LitData as the state its own loader would have saved after ``start_batch`` batches (the
    samples this rank has read, and the worker the next batch comes from); LitData replays
    its order up to there, so the resumed epoch reads exactly the samples not yet seen."""

    def __init__(self, source, loader_cfg, device, seed, rank, world, limit, collate_fn):
        from litdata import StreamingDataLoader
        from litdata.utilities.env import _DistributedEnv

        self.device, self.url = device, f"{source.remote}/{source.split}"
        self.batch_size = int(loader_cfg.batch_size)
        self.workers = int(loader_cfg.num_workers)
        # LitData deals each rank's samples to its workers in turn, so the order also depends
        # on their number: a mid-epoch resume with another count would repeat or skip samples
        # (train/resume.check_loader_order refuses it; at an epoch boundary it may change).
        self.order_depends_on = {"loader.num_workers": self.workers}
        # Every rank drops the same tail, so all ranks run the same number of steps (DDP).
        self.dataset = source.open(shuffle=bool(loader_cfg.shuffle), seed=seed, drop_last=world > 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        self.dataset.distributed_env = _DistributedEnv(world, rank, max(1, world // max(1, local)))
        try:
            self.loader = StreamingDataLoader(
                self.dataset,
                batch_size=self.batch_size,
                num_workers=self.workers,
                collate_fn=collate_fn,
                pin_memory=loader_cfg.pin_memory and device.type == "cuda",
                # Not persistent: workers must see each epoch's (and a resume's) state.
                persistent_workers=False,
                prefetch_factor=loader_cfg.prefetch_factor if self.workers > 0 else None,
                worker_init_fn=ignore_stop_signals,
                # Its own generator: an iterator otherwise draws its seed from the global RNG,
                # and a resumed run would draw other dropout masks than the uninterrupted one.
                generator=torch.Generator().manual_seed(seed),
                multiprocessing_context=loader_cfg.multiprocessing_context
                if self.workers > 0
                else None,
            )
            per_rank = self.dataset.get_len(self.workers, self.batch_size)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001
            raise reading_error(err, self.url) from None
        num_batches = math.ceil(per_rank / self.batch_size)
        if loader_cfg.drop_last:
            num_batches = per_rank // self.batch_size
        self.order = StreamOrder(per_rank, self.batch_size, limited_batches(limit, num_batches))

    def __len__(self) -> int:
        return len(self.order)

    def close(self) -> None:
        iterator = getattr(self.loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.loader._iterator = None

    def _resume_state(self, epoch: int, start_batch: int) -> dict:
        yielded = start_batch * self.batch_size
        self.dataset.reset_state_dict()
        self.dataset.current_epoch = epoch + 1
        state = self.dataset.state_dict(yielded, self.workers, self.batch_size)
        return {
            "dataset": state,
            "current_epoch": epoch + 1,
            "num_samples_yielded": yielded,
            "latest_worker_idx": (start_batch - 1) % max(1, self.workers),
        }

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator:

        self.order.set_epoch(epoch, start_batch)
        self.loader.restore = False
        self.dataset.reset_state_dict()
        if start_batch:
            self.loader.load_state_dict(self._resume_state(epoch, start_batch))
        else:
            self.loader.current_epoch = epoch  # its __iter__ counts it up by one
        batches = iter(self.loader)
        for _ in range(start_batch, self.order.num_batches):
            try:
                batch = next(batches)
            except StopIteration:
                return
            except UserError:
                raise
            except Exception as err:  # noqa: BLE001 - a worker's failure, as one paragraph
                raise reading_error(err, self.url) from None
            if isinstance(batch, list):  # LitData's collate makes lists of tuple items
                batch = tuple(batch)
            yield to_device(batch, self.device)  # (a dict of pairs stays a dict)

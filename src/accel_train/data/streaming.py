"""`dataset=streaming`: image shards written by `accel-data shard`, read through LitData's
StreamingDataset from a local folder or an object store (`s3://`, any S3-compatible endpoint),
through a bounded local cache.

A shard set (docs/streaming.md) is LitData's own format, one LitData data set per split, plus
one small file of ours that lists the classes and labels:

    <remote>/accel_train.index.json     classes, and each split's sample count and labels
    <remote>/train/index.json, chunk-*.bin    LitData (each item: index, encoded image, label)
    <remote>/val/...  <remote>/test/...

Training reads the train split with LitData's StreamingDataLoader: LitData shuffles chunks and
the items inside them by (seed, epoch), gives each rank and each loader worker its own chunks,
downloads ahead and evicts used chunks once the cache would pass `cache_limit`. The position in
an epoch is the loop's `batch_in_epoch`; :class:`StreamingLoader` turns it into the state LitData
resumes from, so a resumed run reads exactly the samples the epoch had left. Validation and test
(small) are read by index in order, through the usual torch loader.

Images are decoded and augmented by data/image_folder.py's code, so `dataset=streaming` and
`dataset=image_folder` of the same files give the same pixels.

Token shards (`dataset=streaming_tokens`, data/streaming_tokens.py) use this module's remotes,
checks, cache and loader; the index's `kind` keeps each option to its own kind of shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from accel_train.config.checks import limited_batches
from accel_train.data.batch import to_device
from accel_train.data.image_folder import (
    DeviceRandomResizedCrop,
    RandomResizedCrop,
    _check_options,
    decode_base_image,
    view_of,
)
from accel_train.data.loaders import _CheckedCollate, ignore_stop_signals
from accel_train.data.splits import Splits
from accel_train.errors import UserError

log = logging.getLogger(__name__)

META = "accel_train.index.json"  # ends in index.json: LitData fetches such files with boto3
META_FORMAT = 1
SPLITS = ("train", "val", "test")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class _NoSmallCacheAdvice(logging.Filter):
    """LitData warns on every open that a `max_cache_size` below 25GB may thrash with many
    workers and 64MB chunks: a small dataset.cache_limit is the user's choice here (the docs
    say how to size it), and the warning would repeat for every split and epoch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "max_cache_size` is less than" not in str(record.msg)


logging.getLogger("litdata.streaming.dataset").addFilter(_NoSmallCacheAdvice())


# ---- remotes, endpoints, credentials -------------------------------------------------------


def is_s3(url: str) -> bool:
    return str(url).startswith("s3://")


_BUCKET = re.compile(r"^[a-zA-Z0-9.\-_]{1,255}$")  # botocore's own check of a bucket name


def check_url(url: str, key: str) -> None:
    """A URL that is not a well-formed s3://bucket/prefix would reach botocore as a raw
    validation dump, or (`s3:/b`, `s3://`) become a local folder named `s3:`."""
    text = str(url)
    scheme = text.split("://")[0] if "://" in text else None
    if scheme is None and not text.lower().startswith("s3:"):
        return  # a local folder
    example = f"`{key}=s3://my-bucket/imagenette`"
    if scheme != "s3":
        raise UserError(
            f"{key}={url}: shard sets live in a local folder or at an s3://bucket/prefix URL, "
            f"and this is neither. Write e.g. {example}."
        )
    bucket = split_url(text)[0]
    if not _BUCKET.match(bucket):
        what = f"{bucket!r} is not a bucket name" if bucket else "it names no bucket"
        raise UserError(
            f"{key}={url}: {what} (a bucket name is letters, digits, dots and hyphens). Write "
            f"{key}=s3://<bucket>/<prefix>, e.g. {example}."
        )


def endpoint_url() -> str | None:
    """The S3 endpoint from the standard places: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL
    (boto3 reads both, and ~/.aws/config's endpoint_url), else S3_ENDPOINT_URL (s3cmd's and
    MinIO's spelling, which boto3 ignores); None = AWS itself."""
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL"):
        if os.environ.get(key):
            return os.environ[key]
    return None


def storage_options() -> dict[str, str]:
    """What LitData's boto3 client is built with: only the endpoint when boto3 would not find
    it by itself. Credentials are never passed: boto3 reads them from the environment and
    ~/.aws/, so they never reach a config, a log or a checkpoint."""
    url = os.environ.get("S3_ENDPOINT_URL")
    if url and not (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")):
        return {"endpoint_url": url}
    return {}


def allow_plain_http() -> None:
    """The shim for plain-http endpoints (on-prem MinIO, moto): LitData 0.2.76 builds obstore
    stores with fixed client options that lack `allow_http`, so every chunk GET/PUT to an
    http:// endpoint fails with obstore's `BadScheme` builder error (obstore issue 159). Adding
    the option to LitData's module-level options is what an upstream fix would do; https
    endpoints are left alone. Called in every process that reads (spawned workers too)."""
    url = endpoint_url() or _configured_endpoint()
    if not url or not url.lower().startswith("http://"):
        return
    try:
        from litdata.streaming import downloader
    except ImportError:  # pragma: no cover - litdata is a dependency
        return
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


def _configured_endpoint() -> str | None:
    """endpoint_url from ~/.aws/config (the profile boto3 uses), if any."""
    try:
        import botocore.session

        return botocore.session.Session().get_scoped_config().get("endpoint_url")
    except Exception:  # noqa: BLE001 - an unreadable profile is boto3's error to report later
        return None


def s3_client():
    """A boto3 S3 client as LitData builds one, with standard retries: transient errors
    (throttling, 5xx, dropped connections) are retried with exponential back-off."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard"}, connect_timeout=10, read_timeout=60)
    return boto3.client("s3", config=config, **storage_options())


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/a/b -> (bucket, "a/b")."""
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def s3_error(err: Exception, url: str, key: str) -> UserError:
    """A boto3/botocore failure on ``url`` as one paragraph that says what to check."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    where = endpoint_url() or "AWS's default endpoint"
    if isinstance(err, EndpointConnectionError | ConnectionError) or "Could not connect" in str(
        err
    ):
        return UserError(
            f"{key}={url}: cannot reach the S3 endpoint {where} (after retries). Check that the "
            "server is up and that AWS_ENDPOINT_URL (or S3_ENDPOINT_URL, or endpoint_url in "
            "~/.aws/config) points at it."
        )
    if isinstance(err, NoCredentialsError | PartialCredentialsError):
        return UserError(
            f"{key}={url}: no S3 credentials found. Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in the environment, or a profile in ~/.aws/credentials "
            "(AWS_PROFILE); accel-train never reads them from its config."
        )
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        bucket = split_url(url)[0]
        if code == "NoSuchBucket":
            return UserError(
                f"{key}={url}: the bucket {bucket!r} does not exist at {where}. Check the "
                "bucket name and the endpoint (AWS_ENDPOINT_URL)."
            )
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            return UserError(
                f"{key}={url}: the S3 endpoint {where} refused the credentials ({code}). Check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the ~/.aws/ profile) and the "
                "bucket's permissions."
            )
        return UserError(f"{key}={url}: the S3 endpoint {where} answered {code}: {err}.")
    return UserError(f"{key}={url}: {type(err).__name__}: {err}")


# ---- reading what accel-data shard wrote ---------------------------------------------------


# What each kind of shard set is written from and read with: the refusals name the other.
KINDS = {
    "image_folder": ("image", "dataset=image_folder dataset.root=<image folder>", "streaming"),
    "tokens": ("token", "dataset=tokens dataset.path=<token folder>", "streaming_tokens"),
    "sft": (
        "instruction",
        "dataset=sft dataset.path=<records> dataset.tokenizer=<model folder>",
        "streaming_sft",
    ),
}


def read_meta(remote: str, key: str = "dataset.remote", kind: str = "image_folder") -> dict:
    """The shard set's accel_train.index.json (which `accel-data shard` writes last: a shard
    set without it is incomplete), refused unless it holds ``kind`` (image_folder, tokens)."""
    check_url(remote, key)
    url = f"{remote.rstrip('/')}/{META}"
    missing = (
        f"{key}={remote}: there is no shard set there ({META} is missing). Check the URL, or "
        f"write one: `accel-data shard {KINDS[kind][1]} out={remote}`."
    )
    if is_s3(remote):
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, prefix = split_url(url)
        try:
            text = s3_client().get_object(Bucket=bucket, Key=prefix)["Body"].read()
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise UserError(missing) from None
            raise s3_error(err, remote, key) from None
        except (BotoCoreError, ConnectionError) as err:
            raise s3_error(err, remote, key) from None
    else:
        path = Path(remote).expanduser()
        if "://" in remote:
            raise UserError(
                f"{key}={remote}: only local folders and s3:// URLs are supported (other "
                "schemes LitData knows, gs:// and azure://, are untested here)."
            )
        if not (path / META).is_file():
            raise UserError(missing)
        text = (path / META).read_bytes()
    try:
        meta = json.loads(text)
        assert meta["format"] == META_FORMAT and meta["splits"]["train"]["samples"] > 0
    except (ValueError, KeyError, TypeError, AssertionError):
        raise UserError(
            f"{key}={remote}: {url} is not a shard index written by this version of accel-data "
            "shard. Write the shards again (`accel-data shard ... overwrite=true`)."
        ) from None
    found = meta.get("kind", "image_folder")
    if found != kind and found in KINDS:
        what, source, option = KINDS[found]
        raise UserError(
            f"{key}={remote} holds {what} shards (written by `accel-data shard {source}`), but "
            f"dataset={KINDS[kind][2]} reads {KINDS[kind][0]} shards. Train from these with "
            f"`dataset={option} {key}={remote}`, or point {key} at {KINDS[kind][0]} shards "
            f"(`accel-data shard {KINDS[kind][1]} out=<folder or s3://...>`)."
        )
    return meta


def check_shards(remote: str, split: str, expected: int, key: str = "dataset.remote") -> dict:
    """The split's LitData index.json against its chunk files (each there, each of the size
    the index records) and against the sample count of accel_train.index.json: a missing or
    truncated chunk, or an index that belongs to other shards, fails here, naming the file,
    instead of inside a loader worker mid-epoch. Returns the LitData index."""
    base = f"{remote.rstrip('/')}/{split}"
    sizes: dict[str, int] = {}
    if is_s3(remote):
        from botocore.exceptions import BotoCoreError, ClientError

        bucket, prefix = split_url(base)
        client = s3_client()
        try:
            index = json.loads(
                client.get_object(Bucket=bucket, Key=f"{prefix}/index.json")["Body"].read()
            )
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=f"{prefix}/"
            ):
                for obj in page.get("Contents", []):
                    sizes[obj["Key"].rsplit("/", 1)[-1]] = obj["Size"]
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise UserError(
                    f"{key}={remote}: {base}/index.json is missing: the {split} shards are "
                    "incomplete. Write the shard set again with `accel-data shard ... "
                    "overwrite=true`."
                ) from None
            raise s3_error(err, remote, key) from None
        except (BotoCoreError, ConnectionError) as err:
            raise s3_error(err, remote, key) from None
    else:
        folder = Path(remote).expanduser() / split
        try:
            index = json.loads((folder / "index.json").read_text())
        except (OSError, ValueError):
            raise UserError(
                f"{key}={remote}: {folder / 'index.json'} is missing or unreadable: the {split} "
                "shards are incomplete. Write the shard set again with `accel-data shard ... "
                "overwrite=true`."
            ) from None
        sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    chunks = index.get("chunks") or []
    samples = sum(int(c.get("chunk_size", 0)) for c in chunks)
    if samples != expected:
        raise UserError(
            f"{key}={remote}: {base}/index.json lists {samples} samples but {META} says the "
            f"{split} split has {expected}: the index and the shards come from different runs. "
            "Write the shard set again with `accel-data shard ... overwrite=true`."
        )
    for chunk in chunks:
        name = chunk["filename"]
        if name not in sizes:
            raise UserError(
                f"{key}={remote}: the shard {base}/{name} listed in {base}/index.json is "
                "missing. Restore it, or write the shard set again with `accel-data shard ... "
                "overwrite=true`."
            )
        if chunk.get("chunk_bytes") and sizes[name] != int(chunk["chunk_bytes"]):
            raise UserError(
                f"{key}={remote}: the shard {base}/{name} has {sizes[name]} bytes but its index "
                f"records {chunk['chunk_bytes']}: it is truncated or from another run. Write "
                "the shard set again with `accel-data shard ... overwrite=true`."
            )
    return index


def parse_size(value: Any, key: str) -> int:
    """'20gb', '512MB', '1.5g', 2000000 -> bytes (decimal units, as LitData's sizes)."""
    if isinstance(value, int | float) and value > 0:
        return int(value)
    match = _SIZE.match(str(value))
    if not match or float(match.group(1)) <= 0:
        raise UserError(
            f"{key}={value!r} is not a size: write e.g. `{key}=20gb` (k, m, g, t: powers of "
            "1000) or a number of bytes."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)[:1].lower()])


def cache_folder(local: str, remote: str, key: str = "dataset.local") -> Path:
    """<local>/<remote's name>-<hash>: one cache folder per remote, so two data sets never
    share chunks. Checked writable now, not by a loader worker later."""
    tag = re.sub(r"[^A-Za-z0-9_.-]+", "_", remote.rstrip("/").rsplit("/", 1)[-1]) or "remote"
    digest = hashlib.sha256(remote.rstrip("/").encode()).hexdigest()[:10]
    folder = Path(local).expanduser() / f"{tag}-{digest}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"{key}={local}: cannot write the shard cache there ({err.strerror or err}). Set "
            f"`{key}=<a writable folder with room for dataset.cache_limit>`."
        ) from None
    return folder


# ---- the splits ----------------------------------------------------------------------------


def open_shard_set(remote, local, cache_limit, kind: str) -> tuple[str, dict, Path, int]:
    """The checks every streaming option starts with: (remote, its index, the cache folder,
    the cache limit in bytes). ``kind``: the shards the option reads (image_folder, tokens)."""
    if not remote or str(remote) == "???":
        raise UserError(
            "dataset.remote is required: the folder or s3:// URL `accel-data shard` wrote, e.g. "
            "`dataset.remote=s3://my-bucket/imagenette`."
        )
    remote = str(remote)
    require_litdata()
    limit = parse_size(cache_limit, "dataset.cache_limit")
    meta = read_meta(remote, kind=kind)
    if is_s3(remote):
        if not local:
            raise UserError(
                f"dataset.remote={remote} is an object store: set `dataset.local=<a local "
                "folder>` for the shard cache (at most dataset.cache_limit of it is used)."
            )
        cache = cache_folder(str(local), remote)
    else:
        cache = Path(remote)  # read in place: nothing is copied
    return remote, meta, cache, limit


class _Decoder:
    """An item of the shards -> (uint8 image, label), as dataset=image_folder makes it."""

    def __init__(self, base_size, size, view, crop, seed, where):
        self.base_size, self.size, self.view = base_size, size, view
        self.crop, self.seed, self.where = crop, seed, where

    def __call__(self, item: dict, epoch: int) -> tuple[torch.Tensor, int]:
        index = int(item["index"])
        data = torch.frombuffer(bytearray(item["image"]), dtype=torch.uint8)
        what = f"dataset.remote: sample {index} of the shards {self.where}"
        base = decode_base_image(data, self.base_size, what)
        image = view_of(base, self.view, self.crop, self.size, f"{self.seed}/{epoch}/{index}")
        return image, int(item["label"])


def require_litdata() -> None:
    try:
        import litdata  # noqa: F401
    except ImportError:
        raise UserError(
            "dataset=streaming and `accel-data shard` need LitData: `pip install "
            "'accel-train[stream]'`."
        ) from None


def _litdata_class():
    from litdata import StreamingDataset

    class _Shards(StreamingDataset):
        """LitData's StreamingDataset whose items are decoded images; re-applies the http
        shim in every process it is unpickled in (spawned loader workers)."""

        decoder: _Decoder

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
        collate = _CheckedCollate(num_classes) if labelled else None
        return StreamingLoader(self.source, loader_cfg, device, seed, rank, world, limit, collate)


def build_streaming(
    *,
    remote: str,
    local: str | None = None,
    cache_limit: Any = "20gb",
    seed: int = 0,
    image_size: int = 64,
    resize_size: int = 0,
    augment: str = "cpu",
    crop_scale: Sequence[float] = (0.35, 1.0),
    random_hflip: bool = True,
    num_classes: int | None = None,
    **_,
) -> Splits:
    """The `dataset=streaming` splits (see the module docstring)."""
    scale = _check_options(image_size, resize_size, augment, "none", 0.0, crop_scale)
    remote, meta, cache, limit = open_shard_set(remote, local, cache_limit, "image_folder")
    size = int(image_size)
    base_size = int(resize_size) or round(size / 0.875)
    crop = RandomResizedCrop(size, scale, random_hflip) if augment == "cpu" else None
    train_view = {"cpu": "random", "device": "base", "none": "center"}[augment]
    splits = {}
    for name in SPLITS:
        info = meta["splits"].get(name)
        if not info or not info.get("samples"):
            splits[name] = None
            continue
        check_shards(remote, name, int(info["samples"]))
        view = train_view if name == "train" else "center"
        decoder = _Decoder(base_size, size, view, crop, seed, f"{remote.rstrip('/')}/{name}")
        source = StreamingSource(remote, name, cache, limit, decoder)
        labels = torch.tensor(info["labels"], dtype=torch.int64)
        cls = StreamingTrainSplit if name == "train" else StreamingEvalSplit
        splits[name] = cls(source, labels)
    if splits["val"] is None:
        raise UserError(
            f"dataset.remote={remote}: the shard set has no val split. Write it with a "
            "validation share: `accel-data shard ... dataset.val_fraction=0.1`."
        )
    device_augment = (
        DeviceRandomResizedCrop(size, scale, random_hflip) if augment == "device" else None
    )
    return Splits(
        splits["train"],
        splits["val"],
        splits["test"],
        in_channels=3,
        image_size=size,
        num_classes=int(num_classes or len(meta["classes"])),
        device_augment=device_augment,
    )


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
            yield to_device(tuple(batch), self.device)

"""What `accel-data shard` wrote, checked before anything is read: the shard set's own index
(accel_train.index.json: its kind, classes, splits), each split's LitData index against its
chunk files, and the local cache folder and its size limit. Separate from reading so that the
writer and every streaming option (images, tokens, instruction rows) run the same checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from accel_train.data.shards.object_store import check_url, is_s3, s3_client, s3_error, split_url
from accel_train.errors import UserError

META = "accel_train.index.json"  # ends in index.json: LitData fetches such files with boto3
META_FORMAT = 1
SPLITS = ("train", "val", "test")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


# What each kind of shard set is written from and read with: the refusals name the other.
KINDS = {
    "image_folder": ("image", "dataset=image_folder dataset.root=<image folder>", "streaming"),
    "tokens": ("token", "dataset=tokens dataset.path=<token folder>", "streaming_tokens"),
    "video_folder": (
        "video",
        "dataset=video_folder dataset.root=<video folder>",
        "streaming_video",
    ),
    "sft": (
        "instruction",
        "dataset=sft dataset.path=<records> dataset.tokenizer=<model folder>",
        "streaming_sft",
    ),
    "preference": (
        "preference",
        "dataset=preference dataset.path=<pairs> dataset.tokenizer=<model folder>",
        "streaming_preference",
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
    instead of inside a loader worker mid-epoch. Returns the LitData index.

    Long because S3 and a local folder each read the index and list the files with their own
    errors, and the checks after them are a linear list, each with its own message."""
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


def require_litdata() -> None:
    try:
        import litdata  # noqa: F401
    except ImportError:
        raise UserError(
            "dataset=streaming and `accel-data shard` need LitData: `pip install "
            "'accel-train[stream]'`."
        ) from None


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

"""`accel-data shard`: an image, video or token folder -> a LitData shard set in a local
folder or an S3 bucket, the layout `dataset=streaming` (images, data/images/streaming.py) or
`dataset=streaming_tokens` (tokens, data/text/streaming_tokens.py) trains from (docs/streaming.md).

Each item is the image file's bytes as they are (JPEG/PNG, not decoded: shards stay the size of
the data set and the image size is chosen at training time), its label and its index. With
`max_side=N` (FFCV's max_resolution) an image whose longer side is above N is re-encoded as a
JPEG (`jpeg_quality`) with that side N: smaller shards and cheaper decoding, for sets that are
trained at a known resolution; `dataset=streaming` crops them as `dataset=image_folder` crops
the originals (data/images/decode.py). Every file's header is checked first, as training checks it.
The val split is held out from the training folder exactly as `dataset=image_folder` does
(stratified, seeded by dataset.seed), so both options train on the same samples. LitData's
`optimize` writes the chunks and their index.json; accel_train.index.json (the classes and labels)
is written last, so a shard set without it is incomplete and is refused by `dataset=streaming`.
A local `out` is written under a temporary name and moved into place (commands/outputs.py);
`overwrite=true` replaces only the files of a shard set that this command listed there
(written.py), never a folder of other files, a file the user added to a shard set, nor the data
being sharded.

A video folder or list (`dataset=video_folder`) gives one item a video, re-encoded smaller or
slower with `max_side` / `fps` (commands/shard_video.py), for `dataset=streaming_video`.

A token folder's train.bin and val.bin are written in LitData's token format
(`optimize(..., item_loader=TokensLoader())`, as litgpt does): each split's tokens in order, cut
into pieces of a fraction of a chunk, so LitData fills each chunk with consecutive tokens. Its
index records `kind: tokens` and the folder's meta.json (vocabulary, dtype, tokenizer; a BPE
tokenizer's tokenizer.json as text), so training and `accel-sample` need only the shard set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from accel_train.commands.outputs import (
    STAGING_PREFIX,
    partial_path,
    refuse_inside,
    remove_leftovers,
    resolved,
)
from accel_train.commands.shard_video import (
    DEFAULT_GOP,
    ReadVideo,
    check_crop,
    check_video_options,
    video_parts,
)
from accel_train.data.folder_tree import plan_layout
from accel_train.data.images.decode import check_images, unreadable
from accel_train.data.shards.object_store import (
    allow_plain_http,
    check_url,
    is_s3,
    s3_client,
    s3_error,
    split_url,
    storage_options,
)
from accel_train.data.shards.shard_set import META, META_FORMAT, SPLITS, parse_size, require_litdata
from accel_train.data.text.preference import preference_splits
from accel_train.data.text.sft import encode_rows, tokenizer_fingerprint
from accel_train.data.text.streaming_preference import pair_item
from accel_train.data.text.streaming_sft import row_item
from accel_train.data.text.tokenizer import TOKENIZER_FILE
from accel_train.data.text.tokenizer import read_meta as read_token_meta
from accel_train.data.text.tokens import token_count, token_folder
from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer
from accel_train.written import check_out_folder, install, names

log = logging.getLogger("accel_train")

COMMAND = "accel-data shard"  # who a shard set's manifest says wrote it
# The smallest max_side: the smallest images people train on (CIFAR's 32 px); a shard set of
# 1-px images was written with exit 0 before (issue 47).
MIN_SIDE = 32


class ReadItem:
    """One shard item (LitData's optimize calls this in its writer processes): the file's bytes,
    or with ``max_side`` > 0 and a longer side above it, the image re-encoded smaller."""

    def __init__(self, max_side: int = 0, quality: int = 90):
        self.max_side, self.quality = max_side, quality

    def __call__(self, entry: tuple[int, str, int]) -> dict:
        index, path, label = entry
        with open(path, "rb") as f:
            data = f.read()
        if self.max_side > 0:
            data = shrink(data, self.max_side, self.quality, path)
        return {"index": index, "image": data, "label": label}


def shrink(data: bytes, max_side: int, quality: int, path: str) -> bytes:
    """``data`` as it is when its longer side is at most ``max_side`` (no second JPEG
    generation), else an RGB JPEG of quality ``quality`` with that side ``max_side``: decoded
    at a reduced DCT scale where that stays above the target, then Lanczos-resized."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        w, h = im.size
        if max(w, h) <= max_side:
            return data
        scale = max_side / max(w, h)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        im.draft("RGB", size)  # JPEGs: libjpeg's DCT scaling, never below `size`
        try:
            rgb = im.convert("RGB").resize(size, Image.Resampling.LANCZOS)
        except OSError as err:
            raise unreadable(err, f"dataset.root: the image file {path}") from err
    out = io.BytesIO()
    rgb.save(out, "JPEG", quality=quality)
    return out.getvalue()


def shard(cfg: DictConfig) -> str:
    if OmegaConf.is_missing(cfg, "out"):
        raise UserError(
            "`out` is required: `accel-data shard dataset=image_folder dataset.root=<folder> "
            "out=<folder or s3://bucket/prefix>`."
        )
    check_url(str(cfg.out), "out")
    ds, out = cfg.dataset, str(cfg.out).rstrip("/")
    require_litdata()
    if ds.get("name") == "tokens":
        return _shard_tokens(cfg, out)
    if ds.get("name") == "sft":
        return _shard_sft(cfg, out)
    if ds.get("name") == "preference":
        return _shard_preference(cfg, out)
    if ds.get("name") == "video_folder":
        return _shard_videos(cfg, out)
    if ds.get("name") != "image_folder":
        raise UserError(
            f"dataset={ds.get('name')}: accel-data shard writes image folders "
            "(dataset=image_folder dataset.root=<folder>), video folders (dataset=video_folder "
            "dataset.root=<folder>), token folders (dataset=tokens "
            "dataset.path=<folder>), instruction records (dataset=sft dataset.path=<file> "
            "dataset.tokenizer=<model folder>) and preference pairs (dataset=preference, the "
            "same keys)."
        )
    return _shard_images(cfg, out)


def _shard_images(cfg: DictConfig, out: str) -> str:
    """dataset=image_folder: its splits (the same folders and held-out split as it trains on)
    as LitData chunks under `out`."""
    ds = cfg.dataset
    root = Path(str(ds.root)).expanduser()
    if not root.is_dir():
        raise UserError(
            f"dataset.root={ds.root}: no such folder. Point it at the folder that holds "
            f"`{ds.train_split}/<class>/*.jpg`."
        )
    _check_image_options(cfg, out, root)  # before the header check, which can take minutes
    # The same folders and held-out split as `dataset=image_folder` trains on (its rule).
    layout = plan_layout(
        root, ds.train_split, ds.get("val_split"), ds.get("test_split"),
        bool(ds.get("holdout", False)), float(ds.val_fraction),
    )  # fmt: skip
    train_folder, labels = layout.train, layout.train.labels
    train_idx, val_idx = layout.indices(float(ds.val_fraction), int(ds.seed))
    files = [str(train_folder.path / f) for f in train_folder.files]
    parts = {"train": [(files[i], int(labels[i])) for i in train_idx.tolist()]}
    if val_idx is not None:
        parts["val"] = [(files[i], int(labels[i])) for i in sorted(val_idx.tolist())]
    for name, folder in (("val", layout.val), ("test", layout.test)):
        if folder is not None:
            parts[name] = [
                (str(folder.path / f), int(y)) for f, y in zip(folder.files, folder.labels.tolist())
            ]
    parts = {name: parts[name] for name in ("train", "val", "test") if name in parts}
    reader = _image_reader(cfg, [path for items in parts.values() for path, _ in items])
    for name, items in parts.items():
        if not items:  # LitData refuses an empty input list with a bare ValueError
            raise UserError(
                f"dataset.root={ds.root}: the {name} split would hold no image "
                f"({len(labels)} training images, dataset.val_fraction={ds.val_fraction}). "
                "Shard a folder with more images per class, or raise `dataset.val_fraction`."
            )
    meta = {
        "format": META_FORMAT,
        "kind": "image_folder",
        "source": str(root.absolute()),
        "max_side": reader.max_side,
        "classes": train_folder.classes,
        "splits": {
            name: {"samples": len(items), "labels": [y for _, y in items]}
            for name, items in parts.items()
        },
    }
    inputs = {
        name: [(i, path, label) for i, (path, label) in enumerate(items)]
        for name, items in parts.items()
    }
    _write(cfg, out, reader, inputs, meta, None, (root, "dataset.root"))
    counts = ", ".join(f"{len(v):,} {k}" for k, v in parts.items())
    print(f"accel-data: {counts} images of {len(train_folder.classes)} classes -> {out}/")
    return out


def _check_image_options(cfg: DictConfig, out: str, root: Path) -> None:
    """`out` outside the image folder, `max_side` and `jpeg_quality` in range: every problem
    at once, in one paragraph."""
    problems = []
    if not is_s3(out):
        try:
            refuse_inside(Path(out), root, "out", "dataset.root")
        except UserError as err:
            problems.append(str(err))
    max_side, quality = int(cfg.max_side), int(cfg.jpeg_quality)
    if max_side < 0 or 0 < max_side < MIN_SIDE or not 1 <= quality <= 100:
        problems.append(
            f"max_side={max_side}, jpeg_quality={quality}: max_side is the longest side in "
            f"pixels images are shrunk to, at least {MIN_SIDE} (smaller images hold too little "
            "for any training crop; 0 keeps them as they are), jpeg_quality the JPEG quality "
            "they are re-encoded at (1-100). E.g. `max_side=512 jpeg_quality=90` (FFCV's "
            "ImageNet shards: 512)."
        )
    if int(cfg.get("min_side") or 0):
        problems.append(
            f"min_side={cfg.min_side} is for video folders; an image folder's images are "
            "shrunk by their longer side: `max_side=512`."
        )
    if problems:
        raise UserError(" ".join(problems))


def _image_reader(cfg: DictConfig, paths: list[str]) -> ReadItem:
    """The items' reader for `max_side` / `jpeg_quality` (checked already), after every file's
    header is checked as training checks it (a bad file is refused before anything is
    written)."""
    if cfg.dataset.get("check_images", True):
        check_images(paths, log=log)
    return ReadItem(int(cfg.max_side), int(cfg.jpeg_quality))


def _shard_videos(cfg: DictConfig, out: str) -> str:
    """A video folder or list -> one item a video (commands/shard_video.py), for
    `dataset=streaming_video`."""
    root = Path(str(cfg.dataset.root)).expanduser()
    max_side, fps, crf, gop = check_video_options(cfg, MIN_SIDE)
    min_side = int(cfg.get("min_side") or 0)
    if not is_s3(out) and root.is_dir():  # before the header check, which can take minutes
        refuse_inside(Path(out), root, "out", "dataset.root")
    inputs, splits, classes = video_parts(cfg, max_side, fps, gop, min_side)
    resize = f"max_side={max_side}" if max_side else f"min_side={min_side}"
    check_crop(inputs, int(cfg.dataset.get("image_size") or 0), resize)
    encode_gop = DEFAULT_GOP if gop is None else gop
    meta = {
        "format": META_FORMAT,
        "kind": "video_folder",
        "source": str(root.absolute()),
        "max_side": max_side,
        "min_side": min_side,
        "fps": fps,
        "crf": crf,
        "gop": encode_gop,
        "classes": classes,
        "splits": splits,
    }
    _write(cfg, out, ReadVideo(crf, encode_gop), inputs, meta, None, (root, "dataset.root"))
    counts = ", ".join(f"{len(v):,} {k}" for k, v in inputs.items())
    again = sum(1 for items in inputs.values() for p in items if p["frames"])
    print(f"accel-data: {counts} videos of {len(classes)} classes ({again} re-encoded) -> {out}/")
    return out


def read_tokens(entry: tuple[str, str, int, int]) -> np.ndarray:
    """One piece of a token split (LitData's optimize calls this in its writer processes)."""
    path, dtype, start, stop = entry
    return np.array(np.memmap(path, dtype=dtype, mode="r")[start:stop])


def _shard_tokens(cfg: DictConfig, out: str) -> str:
    """A token folder (train.bin, val.bin, meta.json) -> LitData token shards."""
    from litdata.streaming.item_loader import TokensLoader

    ds = cfg.dataset
    folder = token_folder(str(ds.path), None)
    folder_meta = read_token_meta(folder)
    dtype = np.dtype(folder_meta.get("dtype", "uint16"))
    # Pieces of 1/16 of a chunk: LitData closes a chunk at a piece boundary, so chunks stay
    # within ~6% of chunk_bytes, and a writer never holds more than a piece in memory.
    piece = max(1, parse_size(cfg.chunk_bytes, "chunk_bytes") // dtype.itemsize // 16)
    inputs, splits = {}, {}
    for name in ("train", "val"):
        file = folder / f"{name}.bin"
        if not file.is_file():
            raise UserError(f"{file} not found: a token folder holds train.bin and val.bin.")
        tokens = token_count(file, dtype.name)
        if tokens == 0:  # LitData refuses an empty input list with a bare ValueError
            raise UserError(f"{file} holds no tokens: tokenize more text into {folder}.")
        inputs[name] = [
            (str(file.absolute()), dtype.name, start, min(start + piece, tokens))
            for start in range(0, tokens, piece)
        ]
        splits[name] = {"samples": len(inputs[name]), "tokens": tokens}
    meta = {
        "format": META_FORMAT,
        "kind": "tokens",
        "source": str(folder.absolute()),
        "tokens": folder_meta,
        "splits": splits,
    }
    if folder_meta.get("tokenizer") == "bpe":  # its vocabulary lives in a file of its own
        bpe = folder / folder_meta.get("tokenizer_file", TOKENIZER_FILE)
        if not bpe.is_file():
            raise UserError(f"{bpe} not found: {folder / 'meta.json'} names a BPE tokenizer.")
        meta["tokenizer_json"] = bpe.read_text()
    _write(cfg, out, read_tokens, inputs, meta, TokensLoader(), (folder, "dataset.path"))
    counts = ", ".join(f"{v['tokens']:,} {k}" for k, v in splits.items())
    print(f"accel-data: {counts} tokens (vocabulary {folder_meta['vocab_size']:,}) -> {out}/")
    return out


def _shard_sft(cfg: DictConfig, out: str) -> str:
    """Instruction records -> the rows `dataset=sft` would train on (tokenized, masked, cut and
    packed by data/text/sft.py), one shard item a row, for `dataset=streaming_sft`."""
    ds = cfg.dataset
    # Training resolves these from trainer.seed and the task; a shard config has neither.
    seed = OmegaConf.select(ds, "seed", default=0, throw_on_resolution_failure=False)
    ignore = OmegaConf.select(ds, "ignore_index", default=-100, throw_on_resolution_failure=False)
    tokenizer = OmegaConf.select(ds, "tokenizer", default=None, throw_on_resolution_failure=False)
    rows, tok = encode_rows(
        str(ds.path),
        tokenizer,
        int(ds.max_length),
        bool(ds.pack),
        str(ds.train_on),
        int(ignore),
        ds.val_path,
        ds.test_path,
        float(ds.val_fraction),
        int(seed),
        ds.get("chat_template"),
    )
    inputs = {name: list(split.rows) for name, split in rows.items()}
    meta = {
        "format": META_FORMAT,
        "kind": "sft",
        "source": str(Path(str(ds.path)).expanduser().absolute()),
        "sft": {
            "tokenizer": str(Path(str(tokenizer)).expanduser().absolute()),
            "tokenizer_fingerprint": tokenizer_fingerprint(tok),
            "vocab_size": len(tok),
            "max_length": int(ds.max_length),
            "pack": bool(ds.pack),
            "train_on": str(ds.train_on),
            "ignore_index": int(ignore),
        },
        "splits": {name: {"samples": len(items)} for name, items in inputs.items()},
    }
    _write(cfg, out, row_item, inputs, meta, None, (Path(str(ds.path)), "dataset.path"))
    counts = ", ".join(f"{len(v):,} {k}" for k, v in inputs.items())
    print(f"accel-data: {counts} rows ({'packed' if ds.pack else 'one record a row'}) -> {out}/")
    return out


def _shard_preference(cfg: DictConfig, out: str) -> str:
    """Preference pairs -> the items `dataset=preference` would train on (rendered, cut and
    numbered by data/text/preference.py), one shard item a pair, for
    `dataset=streaming_preference`."""
    ds = cfg.dataset
    # Training resolves these from trainer.seed and the task; a shard config has neither.
    seed = OmegaConf.select(ds, "seed", default=0, throw_on_resolution_failure=False)
    ignore = OmegaConf.select(ds, "ignore_index", default=-100, throw_on_resolution_failure=False)
    tokenizer = OmegaConf.select(ds, "tokenizer", default=None, throw_on_resolution_failure=False)
    splits = preference_splits(
        str(ds.path), tokenizer, int(ds.max_length), ds.max_prompt_length, int(ignore),
        ds.val_path, ds.test_path, float(ds.val_fraction), int(seed), ds.get("chat_template"),
    )  # fmt: skip
    parts = {"train": splits.train, "val": splits.val, "test": splits.test}
    inputs = {k: [v[i] for i in range(len(v))] for k, v in parts.items() if v is not None}
    tok = load_tokenizer(str(tokenizer), chat_template=ds.get("chat_template"))
    meta = {
        "format": META_FORMAT,
        "kind": "preference",
        "source": str(Path(str(ds.path)).expanduser().absolute()),
        "preference": {
            "tokenizer": str(Path(str(tokenizer)).expanduser().absolute()),
            "fingerprint": tokenizer_fingerprint(tok),
            "vocab_size": len(tok),
            "pad_id": splits.train.pad_id,
            "max_length": int(ds.max_length),
            "max_prompt_length": ds.max_prompt_length,
            "ignore_index": int(ignore),
        },
        "splits": {name: {"samples": len(items)} for name, items in inputs.items()},
    }
    _write(cfg, out, pair_item, inputs, meta, None, (Path(str(ds.path)), "dataset.path"))
    counts = ", ".join(f"{len(v):,} {k}" for k, v in inputs.items())
    print(f"accel-data: {counts} preference pairs -> {out}/")
    return out


def _write(cfg: DictConfig, out: str, fn, inputs: dict, meta: dict, item_loader, source) -> None:
    if is_s3(out):
        _write_s3(cfg, out, fn, inputs, meta, item_loader)
    else:
        refuse_inside(Path(out), source[0], "out", source[1])
        _write_local(cfg, resolved(Path(out)), fn, inputs, meta, item_loader)


@contextlib.contextmanager
def _private_staging():
    """LitData stages the chunks of a remote `out` in one folder per machine ($TMPDIR/chunks)
    and uploads whatever it finds there: two shard jobs on one machine would upload each
    other's chunks, and a killed job's leftovers would join the next one's set. Each job
    stages in a folder of its own, removed afterwards (forked writers inherit the variables).
    LitData's other temporary files (its items list, `litdata-node-*-items-<pid>-*.pkl`, left
    behind by an interrupt) go there too: a killed job's are removed by the next
    (commands/outputs.py remove_leftovers)."""
    keys = ("DATA_OPTIMIZER_CACHE_FOLDER", "DATA_OPTIMIZER_DATA_CACHE_FOLDER")
    saved = {key: os.environ.get(key) for key in keys}
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
    os.environ[keys[0]] = str(staging / "chunks")
    os.environ[keys[1]] = str(staging / "data")
    (staging / "tmp").mkdir()
    saved_tempdir, tempfile.tempdir = tempfile.tempdir, str(staging / "tmp")
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _interrupts_raise():
    """LitData's SIGINT handler (DataProcessor._signal_handler) stops the writer processes and
    then calls `os._exit(0)`: Ctrl-C would end `accel-data shard` with exit 0, no word, and the
    partial folder left (`accel-data shard ... && accel-train ...` would train on). This one
    stops the writers the same way, then raises KeyboardInterrupt in the main process, so the
    partial folder is removed and the command exits 130 (commands/outputs.py)."""
    from litdata.processing.data_processor import DataProcessor

    main_pid = os.getpid()

    def handler(self, signum, frame):
        if os.getpid() != main_pid:  # a forked writer: the main process cleans up
            os._exit(130)
        for queue in getattr(self, "stop_queues", None) or []:
            queue.put(None)
        for worker in getattr(self, "workers", None) or []:
            worker.join(5)
            if worker.is_alive():
                worker.terminate()
                worker.join(5)
        raise KeyboardInterrupt

    original = DataProcessor._signal_handler
    DataProcessor._signal_handler = handler
    try:
        yield
    finally:
        DataProcessor._signal_handler = original
        signal.signal(signal.SIGINT, signal.default_int_handler)  # LitData leaves its own set


def _optimize(cfg: DictConfig, fn, inputs: list, output_dir: str, mode, item_loader) -> None:
    import litdata

    kwargs = {"mode": mode} if mode else {}
    if item_loader is not None:
        kwargs["item_loader"] = item_loader
    with _private_staging(), _interrupts_raise():
        litdata.optimize(
            fn=fn,
            inputs=inputs,
            output_dir=output_dir,
            chunk_bytes=str(cfg.chunk_bytes),
            num_workers=max(1, int(cfg.num_workers)),
            storage_options=storage_options(),
            # fork: a spawned writer would import accel-data's CLI and torch again (seconds each)
            start_method="fork",
            verbose=False,
            **kwargs,
        )


def _write_local(cfg: DictConfig, out: Path, fn, inputs: dict, meta: dict, item_loader) -> None:
    example = str(Path(str(cfg.out)) / "shards")
    check_out_folder(out, "out", COMMAND, bool(cfg.overwrite), example, shown=str(cfg.out))
    remove_leftovers(out)
    partial = partial_path(out)
    try:
        partial.mkdir(parents=True)
    except OSError as err:
        raise UserError(f"out={out}: cannot write there ({err.strerror or err}).") from None
    try:
        for name, items in inputs.items():
            _optimize(cfg, fn, items, str(partial / name), None, item_loader)
        (partial / META).write_text(json.dumps(meta) + "\n")
        install(partial, out, COMMAND, "out", last=META, shown=str(cfg.out))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _s3_foreign(client, bucket: str, prefix: str, out: str) -> list[str]:
    """The entries right under `prefix` that a shard set does not have (its split folders and
    its index): with any, the prefix is not a shard set, nor one whose write was interrupted."""
    from botocore.exceptions import BotoCoreError, ClientError

    base = f"{prefix}/" if prefix else ""
    try:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=base, Delimiter="/")
    except (BotoCoreError, ClientError, ConnectionError) as err:
        raise s3_error(err, out, "out") from None
    own = {f"{base}{split}/" for split in SPLITS} | {f"{base}{META}"}
    entries = [c["Prefix"] for c in listed.get("CommonPrefixes", [])]
    entries += [o["Key"] for o in listed.get("Contents", [])]
    foreign = [e.removeprefix(base) for e in entries if e not in own]
    for split in SPLITS:  # LitData's overwrite mode empties each split's prefix
        foreign += [f"{split}/{k}" for k in _s3_unlisted(client, bucket, f"{base}{split}/", out)]
    return foreign


def _s3_unlisted(client, bucket: str, split_base: str, out: str) -> list[str]:
    """The objects under a split's prefix that are not LitData's: its index.json and the chunks
    (chunk-*.bin, listed in that index or left by an interrupted write). A user's object
    there (train/extra/notes.txt) is not the shard set's to delete."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=split_base)
        keys = [o["Key"].removeprefix(split_base) for p in pages for o in p.get("Contents", [])]
    except (BotoCoreError, ClientError, ConnectionError) as err:
        raise s3_error(err, out, "out") from None
    return [k for k in keys if k != "index.json" and not _is_chunk(k)]


def _is_chunk(name: str) -> bool:
    return "/" not in name and name.startswith("chunk-") and name.endswith(".bin")


def _s3_remove(client, bucket: str, prefix: str) -> None:
    """Remove what an interrupted or failed write to an empty prefix uploaded."""
    base = f"{prefix}/" if prefix else ""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base)
    for page in pages:
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def _write_s3(cfg: DictConfig, out: str, fn, inputs: dict, meta: dict, item_loader) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    allow_plain_http()
    bucket, prefix = split_url(out)
    if not bucket:
        raise UserError(f"out={out}: name a bucket, e.g. `out=s3://my-bucket/imagenette`.")
    client = s3_client()
    try:
        listed = client.list_objects_v2(
            Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1
        )
    except (BotoCoreError, ClientError, ConnectionError) as err:
        raise s3_error(err, out, "out") from None
    if listed.get("KeyCount", 0) and not cfg.overwrite:
        raise UserError(
            f"out={out} holds objects already. Choose another prefix, or replace it with "
            "`overwrite=true`."
        )
    foreign = _s3_foreign(client, bucket, prefix, out) if listed.get("KeyCount", 0) else []
    if foreign:
        raise UserError(
            f"out={out} holds objects that are not a shard set ({names(foreign)}): accel-data "
            "shard replaces only a shard set it wrote (train/, val/, test/ and its index), with "
            "`overwrite=true` or not. Choose an empty prefix."
        )
    fresh = not listed.get("KeyCount", 0)
    try:
        _upload(cfg, client, bucket, prefix, out, fn, inputs, meta, item_loader)
    except BaseException:
        if fresh:  # nothing was there before: what was uploaded goes again
            with contextlib.suppress(BotoCoreError, ClientError, ConnectionError):
                _s3_remove(client, bucket, prefix)
        raise


def _upload(cfg, client, bucket, prefix, out, fn, inputs, meta, item_loader) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        if cfg.overwrite:  # the index goes first: a half-replaced set is never taken as whole
            with contextlib.suppress(ClientError):
                client.delete_object(Bucket=bucket, Key=f"{prefix}/{META}".lstrip("/"))
        mode = "overwrite" if cfg.overwrite else None
        for name, items in inputs.items():
            _optimize(cfg, fn, items, f"{out}/{name}", mode, item_loader)
        client.put_object(
            Bucket=bucket, Key=f"{prefix}/{META}".lstrip("/"), Body=json.dumps(meta).encode()
        )
    except (BotoCoreError, ClientError, ConnectionError) as err:
        raise s3_error(err, out, "out") from None

"""`accel-data tokenize`: a text file -> a token folder (`train.bin`, `val.bin`, `meta.json`),
the layout `dataset=tokens` trains from (nanoGPT's `prepare.py`, as a command).

The text is read twice in chunks that end at line ends, so a file larger than memory works: once
to learn the vocabulary (the characters, or a byte-level BPE) and count the characters, once to
encode. The first `1 - val_fraction` of the characters become train.bin, the rest val.bin. The
folder is written under a temporary name and renamed into place at the end, so an interrupted or
failed run leaves no half-written folder (a killed run's is removed by the next run:
commands/outputs.py). An existing `out` is written only when it is empty or, with
`overwrite=true`, a token folder of tokenize's own, and then only the files tokenize listed there
are replaced (written.py): the input text, a README or any other file of the user's, even one
named train.bin or tokenizer.json, is never removed.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from accel_train.commands.outputs import partial_path, remove_leftovers, resolved
from accel_train.data.text.tokenizer import (
    META,
    BpeTokenizer,
    CharTokenizer,
    token_dtype,
)
from accel_train.errors import UserError
from accel_train.written import check_out_folder, install

log = logging.getLogger("accel_train")

CHUNK_CHARS = 1 << 22  # ~4 M characters a chunk (cut at a line end): memory stays bounded
PROGRESS_BYTES = 8 << 20  # a progress bar for inputs from 8 MB on (on a terminal)
COMMAND = "accel-data tokenize"  # who the folder's manifest says wrote it


def tokenize(cfg: DictConfig) -> Path:
    for key in ("input", "out"):
        if OmegaConf.is_missing(cfg, key):
            raise UserError(
                f"`{key}` is required: `accel-data tokenize input=<text file> out=<folder>`."
            )
    source, out = Path(cfg.input), resolved(Path(cfg.out))
    size = _check_input(source)
    _check_options(cfg, out)
    remove_leftovers(out)
    with _progress(size) as progress:
        task = progress.add_task("reading", total=size)
        chars, seen = 0, set()
        for chunk in _chunks(source):
            chars += len(chunk)
            seen.update(chunk)
            progress.advance(task, len(chunk.encode("utf-8")))
        tokenizer = _tokenizer(cfg, source, seen)
        dtype = token_dtype(tokenizer.vocab_size)
        n_train = int(chars * (1 - cfg.val_fraction))  # nanoGPT: data[: int(n * 0.9)]
        partial = partial_path(out)
        try:
            partial.mkdir(parents=True)
        except OSError as err:
            raise UserError(f"out={cfg.out}: cannot write there ({err.strerror or err}).") from None
        try:
            progress.reset(task, description="encoding", total=size)
            counts = _encode(source, tokenizer, dtype, n_train, partial, progress, task)
            meta = {"vocab_size": tokenizer.vocab_size, "dtype": dtype, **tokenizer.meta()}
            if isinstance(tokenizer, BpeTokenizer):
                tokenizer.save(partial)
            (partial / META).write_text(json.dumps(meta, ensure_ascii=False) + "\n")
            install(partial, out, COMMAND, "out", last=META, shown=str(cfg.out))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    print(
        f"accel-data: {chars:,} characters -> {counts['train']:,} train + {counts['val']:,} val "
        f"tokens ({tokenizer.kind}, vocabulary {tokenizer.vocab_size:,}, {dtype}) in {cfg.out}/"
    )
    return out


def _check_input(path: Path) -> int:
    if path.is_dir():
        texts = sorted(p.name for p in path.glob("*.txt"))[:1]
        example = path / (texts[0] if texts else "input.txt")
        raise UserError(
            f"input={path} is a folder: pass the text file to tokenize, e.g. `input={example}`."
        )
    if not path.is_file():
        raise UserError(
            f"input={path}: no such file. Pass the text file to tokenize, e.g. "
            "`accel-data tokenize input=data/input.txt out=data/mytext`."
        )
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"input={path} is empty: there is no text to tokenize.")
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if b"\x00" in head:
        raise UserError(
            f"input={path} looks binary (it holds NUL bytes): accel-data tokenize reads UTF-8 "
            "text. Convert it to text first."
        )
    return size


def _check_options(cfg: DictConfig, out: Path) -> None:
    if not 0 < cfg.val_fraction < 1:
        raise UserError(f"val_fraction={cfg.val_fraction} must be between 0 and 1 (e.g. 0.1).")
    example = str(Path(cfg.out) / "tokens")
    check_out_folder(out, "out", COMMAND, bool(cfg.overwrite), example, shown=str(cfg.out))


def _chunks(path: Path) -> Iterator[str]:
    """The text in chunks of about CHUNK_CHARS characters, each ending at a line end."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            pending: list[str] = []
            length = 0
            for line in f:
                pending.append(line)
                length += len(line)
                if length >= CHUNK_CHARS:
                    yield "".join(pending)
                    pending, length = [], 0
            if pending:
                yield "".join(pending)
    except UnicodeDecodeError as err:
        raise UserError(
            f"input={path} is not UTF-8 text (byte {err.start} of a chunk: {err.reason}). "
            "Convert it to UTF-8 first (e.g. `iconv -t utf-8`)."
        ) from None


def _tokenizer(cfg: DictConfig, source: Path, seen: set[str]):
    kind = str(cfg.tokenizer)
    if kind == "char":
        return CharTokenizer(sorted(seen))
    if kind == "bpe":
        if cfg.vocab_size < 257:
            raise UserError(
                f"vocab_size={cfg.vocab_size}: a byte-level BPE needs at least 257 ids (the 256 "
                "bytes, then merges). Use e.g. vocab_size=8192."
            )
        return BpeTokenizer.train(_chunks(source), cfg.vocab_size)
    path = Path(kind)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise UserError(
                f"tokenizer={kind}: no such file. Pass char, bpe, or the path of a tokenizer.json."
            )
        return BpeTokenizer.from_file(path)
    raise UserError(
        f"tokenizer={kind} is not a tokenizer: use char (one id per character), bpe (a "
        "byte-level BPE learned from the input, with vocab_size) or the path of a tokenizer.json."
    )


def _encode(source, tokenizer, dtype, n_train, folder, progress, task) -> dict[str, int]:
    """Encode chunk by chunk, the first n_train characters into train.bin, the rest val.bin."""
    counts = {"train": 0, "val": 0}
    done = 0
    with open(folder / "train.bin", "wb") as train, open(folder / "val.bin", "wb") as val:
        for chunk in _chunks(source):
            cut = min(max(n_train - done, 0), len(chunk))
            for part, f, name in ((chunk[:cut], train, "train"), (chunk[cut:], val, "val")):
                if part:
                    ids = tokenizer.encode(part).astype(dtype)
                    ids.tofile(f)
                    counts[name] += len(ids)
            done += len(chunk)
            progress.advance(task, len(chunk.encode("utf-8")))
    if counts["val"] == 0 or counts["train"] == 0:
        raise UserError(
            f"input={source} is too short to split: {counts['train']} train and {counts['val']} "
            "val tokens. Give more text, or another val_fraction."
        )
    return counts


def _progress(size: int) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        disable=size < PROGRESS_BYTES or not sys.stderr.isatty(),
        console=Console(stderr=True),
        transient=True,
    )

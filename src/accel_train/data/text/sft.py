"""`dataset=sft`: instruction records -> token rows whose loss counts only what the model should
learn to write (supervised fine-tuning), for `task=language_model`.

Records (JSON Lines, a JSON list, or Parquet), one of two forms:
- `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`, as chat
  models take them, rendered with the model folder's chat template (or `dataset.chat_template`,
  a Jinja file, for a folder without one);
- `{"prompt": "...", "completion": "..."}`: a user and an assistant turn through the chat
  template, or, for a tokenizer without one, the prompt's tokens then the completion's and EOS;
or Alpaca's and ShareGPT's records, read as one of those (data/text/records.py).

Labels are the next token where the assistant wrote it and `ignore_index` everywhere else
(`train_on=all`: everywhere). The assistant's spans come from the template itself: the tokens
the template adds for turn i are those between rendering turns 0..i-1 with the generation
prompt and rendering turns 0..i (TRL's and torchtune's rule for templates without generation
markers), checked to be a prefix each time.

Rows: without packing, one record a row, right-padded to the longest record (at most
`max_length`): causal attention never looks right, so padding changes no real token's logits.
With `trim_padding=true` each batch is then cut after its last trained token (rounded up to a
multiple of 8), as Hugging Face's collators pad a batch to its longest row: the same loss, no
compute on columns that are padding in every row.
With `pack=true`, records are laid end to end into rows of exactly `max_length` tokens, each
record's positions starting again at 0 (`position_ids`): transformers keeps the attention inside
each record from those, so a packed run scores every token as an unpacked one does.

Tokenized once in each process at start-up (seconds for tens of thousands of records); the
loader's seeded order then makes resume exact mid-epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from accel_train.data.splits import Splits, held_out_indices
from accel_train.data.text.records import FORMS, as_chat
from accel_train.data.text.tokens import window_splits
from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer

log = logging.getLogger("accel_train")

TRAIN_ON = ("completion", "all")


@dataclass
class Encoded:
    ids: list[int]
    trained: list[bool]  # per token: does its prediction count in the loss


def read_records(path: str, key: str) -> list[tuple[str, dict]]:
    """(where, record) for each record of the file: where is `file:line` for JSON Lines."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise UserError(
            f"{key}={path}: no such file. Give a JSON Lines file of instruction records "
            '({"messages": [...]} or {"prompt": ..., "completion": ...} per line), a JSON list '
            "of them, or a Parquet file."
        )
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # only for Parquet files
        except ImportError:
            raise UserError(
                f"{key}={path}: reading Parquet needs pyarrow: `pip install pyarrow`."
            ) from None
        rows = pq.read_table(file).to_pylist()
        return [(f"{file} (row {i + 1})", r) for i, r in enumerate(rows)]
    text = _utf8_text(file, key, path)
    if file.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{key}={path}: not valid JSON ({err}).") from None
        if not isinstance(rows, list):
            raise UserError(f"{key}={path}: a .json file must hold a list of records.")
        return [(f"{file} (record {i + 1})", r) for i, r in enumerate(rows)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{file}:{n}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise UserError(
                f"{file}:{n}: not a JSON object ({err.msg}). Each line of a JSON Lines file is "
                "one record."
            ) from None
    if not out:
        raise UserError(f"{key}={path}: the file holds no records.")
    return out


def _utf8_text(file: Path, key: str, path: str) -> str:
    """The file as UTF-8 text (JSON is UTF-8); otherwise the line with the first bad byte."""
    data = file.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        fixed = file.with_name(f"{file.stem}.utf8{file.suffix}")
        raise UserError(
            f"{key}={path}: {file}:{line} is not UTF-8 (byte {data[err.start]:#04x} at offset "
            f"{err.start}: {err.reason}). Save the file as UTF-8, e.g. `iconv -f latin1 -t "
            f"utf-8 {file} > {fixed}` and give that file."
        ) from None


def _messages(where: str, record: Any) -> list[dict] | None:
    """The record's chat messages, or None for a prompt/completion pair."""
    record = as_chat(where, record)
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        msgs = record["messages"]
        for m in msgs:
            if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")):
                raise UserError(
                    f"{where}: every message needs a 'role' and a string 'content'; found {m!r}."
                )
        if not any(m["role"] == "assistant" for m in msgs):
            raise UserError(f"{where}: the messages have no assistant turn to learn from.")
        return msgs
    if isinstance(record, dict) and all(
        isinstance(record.get(k), str) for k in ("prompt", "completion")
    ):
        return None
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise UserError(f"{where}: a record needs {FORMS}; it has {keys}.")


class Encoder:
    """Records -> token ids and the mask of tokens trained on, with the folder's tokenizer."""

    def __init__(self, tokenizer: Any, folder: str, train_on: str):
        self.tok, self.folder, self.train_on = tokenizer, folder, train_on
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        out = self.tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=True
        )
        return list(out["input_ids"])

    def encode(self, where: str, record: Any) -> Encoded:
        record = as_chat(where, record)
        msgs = _messages(where, record)
        if msgs is None and not self.has_template:
            prompt = self.tok.encode(record["prompt"], add_special_tokens=True)
            answer = self.tok.encode(record["completion"], add_special_tokens=False)
            answer += [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
            return self._masked(prompt + answer, [(len(prompt), len(prompt) + len(answer))])
        if not self.has_template:
            raise UserError(
                f"{where}: chat messages need a chat template, and the tokenizer in "
                f"{self.folder} has none (no chat_template in tokenizer_config.json nor a "
                "chat_template.jinja). Give one with `dataset.chat_template=<file.jinja>`, use "
                "a chat model's folder, or records of prompt and completion."
            )
        if msgs is None:
            msgs = [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]},
            ]
        ids = self._render(msgs)
        spans = []
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(self._render(msgs[:i], generation_prompt=True)) if i else 0
            upto = self._render(msgs[: i + 1])
            if ids[: len(upto)] != upto:
                raise UserError(
                    f"{where}: the chat template of {self.folder} renders a conversation's "
                    "first turns differently from the whole conversation, so the assistant's "
                    "tokens cannot be told apart. Set dataset.train_on=all, or fix the template."
                )
            spans.append((start, len(upto)))
        return self._masked(ids, spans)

    def _masked(self, ids: list[int], spans: list[tuple[int, int]]) -> Encoded:
        trained = [self.train_on == "all"] * len(ids)
        for a, b in spans:
            trained[a:b] = [True] * (b - a)
        return Encoded(ids, trained)


class SFTRows(Dataset):
    """Rows of (inputs, labels); packed rows' inputs are {input_ids, position_ids}."""

    def __init__(
        self, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], records: int
    ):
        self.rows = rows
        self.records = records  # the records laid into the rows (more than the rows if packed)
        self.collate = None  # the loader's collate (TrimPadding), None = default_collate

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        x, y, pos = self.rows[i]
        x, y = x.long(), y.long()
        if pos is None:
            return x, y
        return {"input_ids": x, "position_ids": pos.long()}, y


class TrimPadding:
    """Collate: the rows stacked, then the columns after the batch's last trained token cut off
    (rounded up to a multiple of 8, the tensor cores' tile). A causal model's outputs at a
    position never depend on what follows it, so every loss term is unchanged. Runs on the host
    in the loader (workers): no device sync."""

    def __init__(self, ignore_index: int):
        self.ignore_index = ignore_index

    def __call__(self, items: list) -> Any:
        x, y = default_collate(items)
        trained = (y != self.ignore_index).any(dim=0).nonzero()
        end = int(trained[-1]) + 1 if len(trained) else 1
        end = min(-(-end // 8) * 8, y.shape[1])
        if end == y.shape[1]:
            return x, y
        if isinstance(x, dict):
            return {k: v[:, :end] for k, v in x.items()}, y[:, :end]
        return x[:, :end], y[:, :end]


def _pairs(enc: Encoded, ignore_index: int, limit: int) -> tuple[list[int], list[int]]:
    """(inputs, labels): the label of position t is token t+1 where it is trained on."""
    ids, trained = enc.ids[: limit + 1], enc.trained[: limit + 1]
    labels = [t if keep else ignore_index for t, keep in zip(ids[1:], trained[1:])]
    return ids[:-1], labels


def build_rows(
    pairs: list[tuple[list[int], list[int]]], length: int, pad_id: int, ignore: int, pack: bool
) -> SFTRows:
    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    rows = []
    if not pack:
        for x, y in pairs:
            pad = length - len(x)
            rows.append((tensor(x + [pad_id] * pad), tensor(y + [ignore] * pad), None))
        return SFTRows(rows, len(pairs))
    x_row: list[int] = []
    y_row: list[int] = []
    pos_row: list[int] = []

    def close() -> None:
        pad = length - len(x_row)
        # Padding is one more "record" of its own (positions from 0), never a target.
        rows.append(
            (
                tensor(x_row + [pad_id] * pad),
                tensor(y_row + [ignore] * pad),
                tensor(pos_row + list(range(pad))),
            )
        )
        x_row.clear(), y_row.clear(), pos_row.clear()

    for x, y in pairs:
        if len(x_row) + len(x) > length:
            close()
        x_row += x
        y_row += y
        pos_row += list(range(len(x)))
    if x_row:
        close()
    return SFTRows(rows, len(pairs))


def sft_splits(
    path: str,
    tokenizer: str,
    max_length: int = 1024,
    pack: bool = False,
    train_on: str = "completion",
    ignore_index: int = -100,
    val_path: str | None = None,
    test_path: str | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    trim_padding: bool = True,
    chat_template: str | None = None,
) -> Splits:
    """The instruction splits (see the module docstring); `tokenizer`: the model folder whose
    tokenizer and chat template render the records."""
    rows, tok = encode_rows(
        path,
        tokenizer,
        max_length,
        pack,
        train_on,
        ignore_index,
        val_path,
        test_path,
        val_fraction,
        seed,
        chat_template,
    )
    if trim_padding:
        for split in rows.values():
            split.collate = TrimPadding(ignore_index)
    return window_splits(rows["train"], rows["val"], len(tok), rows.get("test"))


def encode_rows(
    path: str,
    tokenizer: str,
    max_length: int,
    pack: bool,
    train_on: str,
    ignore_index: int,
    val_path: str | None,
    test_path: str | None,
    val_fraction: float,
    seed: int,
    chat_template: str | None = None,
) -> tuple[dict[str, SFTRows], Any]:
    """{split: rows} and the tokenizer: what `dataset=sft` trains on and what `accel-data shard
    dataset=sft` writes, row for row, for `dataset=streaming_sft`."""
    if train_on not in TRAIN_ON:
        raise UserError(f"dataset.train_on={train_on}: must be one of {', '.join(TRAIN_ON)}.")
    if max_length < 2:
        raise UserError(f"dataset.max_length={max_length}: must be at least 2 tokens.")
    if not tokenizer:
        raise UserError(
            "dataset.tokenizer is not set: name the model folder whose tokenizer and chat "
            "template render the records (model=hf sets it to model.path), e.g. "
            "`dataset.tokenizer=/models/qwen2.5-0.5b`."
        )
    tok = load_tokenizer(tokenizer, chat_template=chat_template)
    encoder = Encoder(tok, tokenizer, train_on)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    files = {"train": path, "val": val_path, "test": test_path}
    sets = split_files(
        files, lambda file, key: _encode_file(file, key, encoder, ignore_index, max_length),
        val_fraction, seed, "usable records",
    )  # fmt: skip
    rng = random.Random(seed)
    out = {}
    for name, pairs in sets.items():
        if pack:
            pairs = pairs[:]
            rng.shuffle(pairs)  # packed neighbours differ each run seed, not by file order
            length = max_length
        else:
            length = max(len(x) for x, _ in pairs)
        out[name] = build_rows(pairs, length, pad_id, ignore_index, pack)
    _report(sets, out, pack, max_length)
    return out, tok


def split_files(
    files: dict[str, str | None], encode, val_fraction: float, seed: int, what: str
) -> dict[str, list]:
    """{split: encode(file, key)} for the train/val/test files given (`dataset.path`,
    `dataset.val_path`, `dataset.test_path`); without a validation file, a seeded
    `val_fraction` of the training items is held out. `what` names the items in the error."""
    keys = {"train": "dataset.path", "val": "dataset.val_path", "test": "dataset.test_path"}
    sets = {name: encode(file, keys[name]) for name, file in files.items() if file}
    if "val" not in sets:
        n = len(sets["train"])
        # At least one held out, as datasets' train_test_split rounds the test share up: a
        # first try on a few records (5 % of 8) still validates.
        fraction = max(val_fraction, 1 / n) if val_fraction > 0 and n >= 2 else val_fraction
        train_idx, val_idx = held_out_indices(n, fraction, seed)
        if len(val_idx) == 0 or len(train_idx) == 0:
            raise UserError(
                f"dataset.path={files['train']}: {len(sets['train'])} {what} leave none for "
                f"validation at dataset.val_fraction={val_fraction}. Give dataset.val_path or "
                f"more {what.split()[-1]}."
            )
        every = sets["train"]
        sets["train"] = [every[i] for i in train_idx.tolist()]
        sets["val"] = [every[i] for i in val_idx.tolist()]
    for name in ("val", "test"):
        if files.get(name) and name in sets:
            _warn_seen_in_training(sets, name, files, keys, what)
    return sets


def _frozen(item: Any) -> Any:
    """An encoded item (lists of ids, or a dataclass of them) as a hashable value."""
    if dataclasses.is_dataclass(item):
        item = dataclasses.astuple(item)
    if isinstance(item, list | tuple):
        return tuple(_frozen(v) for v in item)
    return item


def _warn_seen_in_training(sets: dict, name: str, files: dict, keys: dict, what: str) -> None:
    """A validation (or test) file whose items are training items scores what the model
    learnt by heart: val/loss, and best.pt chosen by it, then say nothing about new data. Said
    once, with how many (a `dataset.val_path` naming the training file is the usual cause)."""
    seen = {hash(_frozen(item)) for item in sets["train"]}
    same = sum(hash(_frozen(item)) in seen for item in sets[name])
    if not same:
        return
    total, noun = len(sets[name]), what.split()[-1]
    share = "all" if same == total else f"{same} of"
    scored = "validation (val/loss, and best.pt chosen by it)" if name == "val" else "the test"
    instead = f", or leave {keys[name]} out" if name == "val" else ""
    log.warning(
        "%s=%s: %s its %d %s are also training %s (%s=%s), so %s scores what the model was "
        "trained on: it measures memorisation, not how the model does on new data. Give "
        "held-out %s%s",
        keys[name], files[name], share, total, what, noun, keys["train"], files["train"],
        scored, noun, instead,
    )  # fmt: skip


def tokenizer_fingerprint(tok: Any) -> str:
    """A hash of what turns records into ids (the vocabulary, the special tokens, the chat
    template): rows tokenized by one tokenizer are refused by a model folder with another."""
    described = {
        "vocab": sorted(tok.get_vocab().items()),
        "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
        "template": getattr(tok, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def _encode_file(
    file: str, key: str, encoder: Encoder, ignore_index: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    pairs, cut, empty = [], 0, 0
    for where, record in read_records(file, key):
        enc = encoder.encode(where, record)
        cut += len(enc.ids) > max_length + 1
        x, y = _pairs(enc, ignore_index, max_length)
        if all(t == ignore_index for t in y):
            empty += 1  # truncation left no assistant token: nothing to learn from it
            continue
        pairs.append((x, y))
    if cut or empty:
        log.warning(
            "%s: %d records longer than dataset.max_length=%d were cut%s",
            file,
            cut,
            max_length,
            f" ({empty} kept no assistant token and were dropped)" if empty else "",
        )
    if not pairs:
        raise UserError(
            f"{key}={file}: no record has an assistant token within dataset.max_length="
            f"{max_length}. Raise dataset.max_length."
        )
    return pairs


def _report(sets: dict, rows: dict, pack: bool, max_length: int) -> None:
    train = sets["train"]
    tokens = sum(len(x) for x, _ in train)
    width = len(rows["train"].rows[0][0])
    log.info(
        "sft: %d train / %d val records, %d tokens; %d rows of %d tokens (%s, %.0f %% real tokens)",
        len(train),
        len(sets["val"]),
        tokens,
        len(rows["train"]),
        width,
        "packed" if pack else "one record a row",
        100 * tokens / max(1, len(rows["train"]) * width),
    )

"""`dataset=preference`: pairs of a preferred (chosen) and a dispreferred (rejected) answer to
one prompt, for `task=preference` (DPO, IPO, SimPO, ORPO).

Records (JSON Lines, a JSON list, or Parquet: sft's `read_records`), in TRL's two preference
formats:
- plain text: `{"prompt": "...", "chosen": "...", "rejected": "..."}`, the prompt a user turn
  and each answer an assistant turn through the chat template (for a tokenizer without one: the
  prompt's tokens, then the answer's and EOS);
- conversational: `{"prompt": [messages], "chosen": [{"role": "assistant", ...}], "rejected":
  [...]}`, the prompt a list of chat messages, each answer a list of one assistant message.

The prompt's tokens are the template's rendering of the prompt messages with the generation
prompt; an answer's tokens are what rendering the prompt plus that answer adds after them
(checked to extend the prompt's tokens). Only the answer's tokens are scored.

Truncation keeps the answers: the prompt is cut from the left to `max_prompt_length` tokens,
then further from the left (down to one token) until prompt plus the longer answer fit in
`max_length`; only then are answers cut from the right. (TRL 1.16's `truncation_mode=
keep_start` cuts the whole sequence from the right, answer first; its older `max_prompt_length`
cut the prompt from the left as here.)

An item is one pair: `{"input_ids": (2, T), "labels": (2, T), "index": ()}`, the chosen row
first, both padded to the longer; labels are the next token inside the answer, `ignore_index`
elsewhere; `index` numbers the pair across the splits (train, then val, then test), which
`task.precompute_reference` keys its table by. The collate pads a batch to its longest row
(rounded up to a multiple of 8), so batches lead with the pairs: (B, 2, T).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from accel_train.data.splits import Splits
from accel_train.data.text.records import OneFamily, as_preference
from accel_train.data.text.sft import read_records, split_files
from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer

log = logging.getLogger("accel_train")

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class Parts:
    """One record, whatever its format: the prompt's messages (or text) and the two answers."""

    prompt: list[dict] | str
    chosen: str
    rejected: str


def record_parts(where: str, record: Any) -> Parts:
    """A record in either of TRL's preference formats -> its parts; a bad record refused in one
    paragraph naming `where` (file:line). The one place a record's format is read."""
    record = as_preference(where, record)  # Alpaca's and ShareGPT's preference records
    if not isinstance(record, dict) or any(k not in record for k in FIELDS):
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        missing = [k for k in FIELDS if not isinstance(record, dict) or k not in record]
        raise UserError(
            f"{where}: a preference record needs 'prompt', 'chosen' and 'rejected'; "
            f"{', '.join(missing)} missing (it has {have}). Give plain strings, or a list of chat "
            "messages for the prompt and a one-message assistant list for each answer."
        )
    prompt = record["prompt"]
    if isinstance(prompt, list):
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")):
                raise UserError(
                    f"{where}: every prompt message needs a 'role' and a string 'content'; "
                    f"found {m!r}."
                )
    elif not isinstance(prompt, str):
        raise UserError(f"{where}: 'prompt' must be a string or a list of chat messages.")
    chosen, rejected = (_answer(where, k, record[k]) for k in ("chosen", "rejected"))
    if chosen == rejected:
        raise UserError(
            f"{where}: 'chosen' and 'rejected' are the same answer, so the pair prefers "
            "nothing. Fix or drop the record."
        )
    return Parts(prompt, chosen, rejected)


def _answer(where: str, key: str, value: Any) -> str:
    if isinstance(value, list):  # conversational: one assistant message
        if not (
            len(value) == 1
            and isinstance(value[0], dict)
            and value[0].get("role") == "assistant"
            and isinstance(value[0].get("content"), str)
        ):
            raise UserError(
                f"{where}: '{key}' as a list must hold exactly one message "
                f'{{"role": "assistant", "content": "..."}}; found {value!r}.'
            )
        value = value[0]["content"]
    if not isinstance(value, str):
        raise UserError(f"{where}: '{key}' must be a string or a one-message assistant list.")
    if not value.strip():
        raise UserError(f"{where}: '{key}' is an empty answer: there is nothing to score. Fix it.")
    return value


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


class PairEncoder:
    """Parts -> token ids of the prompt and of each answer, with the folder's tokenizer."""

    def __init__(self, tokenizer: Any, folder: str):
        self.tok, self.folder = tokenizer, folder
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.warned = False  # the prompt/answer boundary warning, once

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        out = self.tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=True
        )
        return list(out["input_ids"])

    def encode(self, where: str, parts: Parts) -> Pair:
        if not self.has_template:
            if not isinstance(parts.prompt, str):
                raise UserError(
                    f"{where}: chat messages need a chat template, and the tokenizer in "
                    f"{self.folder} has none. Use a chat model's folder, or plain-text records."
                )
            eos = [self.tok.eos_token_id] if self.tok.eos_token_id is not None else []
            prompt = self.tok.encode(parts.prompt, add_special_tokens=True)
            if not prompt:  # the first answer token needs one before it to be predicted from
                raise UserError(
                    f"{where}: the prompt is empty and {self.folder}'s tokenizer adds no BOS "
                    "token, so the answer's first token has nothing to follow. Give a prompt."
                )
            answers = [
                self.tok.encode(a, add_special_tokens=False) + eos
                for a in (parts.chosen, parts.rejected)
            ]
            return Pair(prompt, *answers)
        msgs = parts.prompt
        if isinstance(msgs, str):
            msgs = [{"role": "user", "content": msgs}]
        prompt = self._render(msgs, generation_prompt=True)
        full = [self._render([*msgs, {"role": "assistant", "content": t}])
                for t in (parts.chosen, parts.rejected)]  # fmt: skip
        # TRL's rule: the answer starts where the prompt alone and prompt + answer diverge,
        # which is before the prompt's end when tokens merge across the boundary (a BPE
        # tokenizer's "\n" + indentation) or the template renders the prompt alone otherwise.
        shared = min(_common_prefix(prompt, f) for f in full)
        if shared == 0:
            raise UserError(
                f"{where}: the chat template of {self.folder} renders the prompt with an answer "
                "differently from its first token on, so the answer's tokens cannot be told "
                "apart from the prompt's. Fix the template (`dataset.chat_template=<file>`)."
            )
        if shared < len(prompt) and not self.warned:
            self.warned = True
            log.warning(
                "%s: the prompt's last %d token(s) %r merge with the answer's first when "
                "rendered together; the answer is scored from where they diverge (TRL's rule; "
                "shown once, likely true of other records too)",
                where, len(prompt) - shared, self.tok.decode(prompt[shared:]),
            )  # fmt: skip
        return Pair(prompt[:shared], *(f[shared:] for f in full))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def truncate(pair: Pair, max_length: int, max_prompt_length: int | None) -> tuple[Pair, bool]:
    """The pair cut to fit (the module docstring's rule); and whether anything was cut."""
    p, c, r = pair.prompt, pair.chosen, pair.rejected
    if max_prompt_length and len(p) > max_prompt_length:
        p = p[-max_prompt_length:]
    room = max_length - max(len(c), len(r))
    if len(p) > max(room, 1):
        p = p[-max(room, 1) :]
    answer_room = max_length - len(p)
    c, r = c[:answer_room], r[:answer_room]
    cut = (len(p), len(c), len(r)) != tuple(map(len, (pair.prompt, pair.chosen, pair.rejected)))
    return Pair(p, c, r), cut


def _rows(pair: Pair, ignore: int) -> tuple[list[list[int]], list[list[int]]]:
    """(inputs, labels) of the chosen and the rejected row: label t is token t+1 inside the
    answer, `ignore` in the prompt."""
    xs, ys = [], []
    for answer in (pair.chosen, pair.rejected):
        ids = pair.prompt + answer
        labels = [ignore] * (len(pair.prompt) - 1) + answer
        xs.append(ids[:-1]), ys.append(labels)
    return xs, ys


class PreferencePairs(Dataset):
    """One split's pairs (see the module docstring for an item)."""

    def __init__(self, pairs: list[Pair], pad_id: int, ignore: int, offset: int):
        self.pairs, self.pad_id, self.ignore, self.offset = pairs, pad_id, ignore, offset
        self.collate = PadPairs(pad_id, ignore)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        xs, ys = _rows(self.pairs[i], self.ignore)
        width = max(map(len, xs))
        x = torch.full((2, width), self.pad_id, dtype=torch.long)
        y = torch.full((2, width), self.ignore, dtype=torch.long)
        for row, (a, b) in enumerate(zip(xs, ys, strict=True)):
            x[row, : len(a)], y[row, : len(b)] = torch.tensor(a), torch.tensor(b)
        return {"input_ids": x, "labels": y, "index": torch.tensor(self.offset + i)}

    def fingerprint(self) -> str:
        """A hash of the split's token ids and its place among the splits (the precomputed
        reference log-probs belong to exactly these)."""
        digest = hashlib.sha256(f"{self.offset}:{len(self.pairs)}:{self.ignore}".encode())
        for p in self.pairs:
            digest.update(repr((p.prompt, p.chosen, p.rejected)).encode())
        return digest.hexdigest()[:16]


class PadPairs:
    """Collate: items padded to the batch's longest row, rounded up to a multiple of 8 (as
    Hugging Face's collators pad to the longest): causal attention never looks right, so
    padding changes no real token's log-prob. Runs on the host in the loader."""

    def __init__(self, pad_id: int, ignore: int):
        self.pad_id, self.ignore = pad_id, ignore

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        width = max(it["input_ids"].shape[1] for it in items)
        width = -(-width // 8) * 8
        x = torch.full((len(items), 2, width), self.pad_id, dtype=torch.long)
        y = torch.full((len(items), 2, width), self.ignore, dtype=torch.long)
        for i, it in enumerate(items):
            n = it["input_ids"].shape[1]
            x[i, :, :n], y[i, :, :n] = it["input_ids"], it["labels"]
        return {"input_ids": x, "labels": y, "index": torch.stack([it["index"] for it in items])}


def _encode_file(
    file: str, key: str, encoder: PairEncoder, max_length: int, max_prompt_length: int | None
) -> list[Pair]:
    pairs, cut, family = [], 0, OneFamily()
    for where, record in read_records(file, key):
        family.see(where, record)
        pair, was_cut = truncate(encoder.encode(where, record_parts(where, record)), max_length,
                                 max_prompt_length)  # fmt: skip
        cut += was_cut
        pairs.append(pair)
    if cut:
        log.warning(
            "%s: %d of %d pairs longer than dataset.max_length=%d (or a prompt longer than "
            "dataset.max_prompt_length) were cut, prompts from the left first",
            file, cut, len(pairs), max_length,
        )  # fmt: skip
    return pairs


def preference_splits(
    path: str,
    tokenizer: str,
    max_length: int = 1024,
    max_prompt_length: int | None = 512,
    ignore_index: int = -100,
    val_path: str | None = None,
    test_path: str | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    chat_template: str | None = None,
) -> Splits:
    """The preference splits (see the module docstring); `tokenizer`: the model folder whose
    tokenizer and chat template render the records."""
    if max_length < 2:
        raise UserError(f"dataset.max_length={max_length}: must be at least 2 tokens.")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise UserError(
            f"dataset.max_prompt_length={max_prompt_length}: must be at least 1 token, or null "
            "(the prompt is then cut only to fit dataset.max_length)."
        )
    if not tokenizer:
        raise UserError(
            "dataset.tokenizer is not set: name the model folder whose tokenizer and chat "
            "template render the records (model=hf sets it to model.path)."
        )
    tok = load_tokenizer(tokenizer, chat_template=chat_template)
    encoder = PairEncoder(tok, tokenizer)
    files = {"train": path, "val": val_path, "test": test_path}
    sets = split_files(
        files, lambda file, key: _encode_file(file, key, encoder, max_length, max_prompt_length),
        val_fraction, seed, "pairs",
    )  # fmt: skip
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    out, offset = {}, 0
    for name in ("train", "val", "test"):
        if name in sets:
            out[name] = PreferencePairs(sets[name], pad_id, ignore_index, offset)
            offset += len(sets[name])
    log.info("preference: %d train / %d val pairs", len(out["train"]), len(out["val"]))
    shape = {"in_channels": 0, "image_size": 0, "num_classes": 0}
    return Splits(
        out["train"],
        out["val"],
        out.get("test"),
        **shape,
        model_args={"vocab_size": len(tok)},
        only_task="preference",
    )

"""`dataset=prompts`: prompts for `task=grpo`, which samples the completions itself.

Records (JSON Lines, a JSON list, or Parquet: sft's `read_records`) in TRL's prompt-only
formats: `{"prompt": "..."}` (plain text: a user turn through the chat template, or, for a
tokenizer without one, the prompt's own tokens), or `{"prompt": [messages]}` (conversational:
rendered with the generation prompt). Every other column (e.g. `answer`) is kept as it is and
handed to the reward functions by name, as TRL does.

An item is `{"input_ids": (P,), "index": ()}`; the collate pads a batch's prompts on the LEFT
(generation appends to every row at once) and adds `attention_mask` and `records` (the batch's
records as read: the prompt as given plus the other columns). `index` numbers the prompts
across the splits (train, then val, then test).

`task.num_iterations > 1` (TRL's mu: several updates on one generated batch) needs each
optimizer step's window of batches again, mu times, in a row: `RepeatedOrder` (data/orders.py) gives
them, so the task finds the same prompts (and its kept completions) at the same place after a
resume.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils.data import Dataset

from accel_train.data.loaders import TorchLoader
from accel_train.data.orders import RepeatedOrder
from accel_train.data.splits import Splits
from accel_train.data.text.records import as_chat
from accel_train.data.text.sft import read_records, split_files
from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer

log = logging.getLogger("accel_train")


class Prompt:
    """A prompt's token ids and its record (the prompt as given and the other columns: the
    reward functions' inputs). Hashed by its tokens: a validation prompt that is also a
    training prompt is told apart by what the model sees (sft's split_files warns)."""

    def __init__(self, ids: list[int], record: dict):
        self.ids, self.record = ids, record

    def __hash__(self) -> int:
        return hash(tuple(self.ids))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Prompt) and self.ids == other.ids


def _check(where: str, record: Any) -> dict:
    record = (
        as_chat(where, record) if isinstance(record, dict) and "prompt" not in record else record
    )
    if isinstance(record, dict) and "prompt" not in record and "messages" in record:
        # sft's conversational form: its turns before the last assistant one are the prompt
        msgs = list(record["messages"])
        while msgs and msgs[-1].get("role") == "assistant":
            msgs.pop()
        record = {**{k: v for k, v in record.items() if k != "messages"}, "prompt": msgs}
    if not isinstance(record, dict) or "prompt" not in record:
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(
            f"{where}: a prompt record needs a 'prompt' (a string, or a list of chat messages); "
            f"it has {have}. Other keys (e.g. 'answer') are passed to the reward functions."
        )
    prompt = record["prompt"]
    if isinstance(prompt, list):
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")):
                raise UserError(
                    f"{where}: every prompt message needs a 'role' and a string 'content'; "
                    f"found {m!r}."
                )
        if not prompt:
            raise UserError(f"{where}: 'prompt' is an empty list of messages. Give a prompt.")
    elif not isinstance(prompt, str):
        raise UserError(f"{where}: 'prompt' must be a string or a list of chat messages.")
    return record


class PromptEncoder:
    """A record's prompt -> token ids, with the folder's tokenizer and chat template."""

    def __init__(self, tokenizer: Any, folder: str):
        self.tok, self.folder = tokenizer, folder
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, where: str, prompt: str | list[dict]) -> list[int]:
        if self.has_template:
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            out = self.tok.apply_chat_template(
                msgs, tokenize=True, add_generation_prompt=True, return_dict=True
            )
            return list(out["input_ids"])
        if not isinstance(prompt, str):
            raise UserError(
                f"{where}: chat messages need a chat template, and the tokenizer in "
                f"{self.folder} has none. Give one with `dataset.chat_template=<file.jinja>`, "
                "use a chat model's folder, or plain-text prompts."
            )
        ids = self.tok.encode(prompt, add_special_tokens=True)
        if not ids:
            raise UserError(
                f"{where}: the prompt is empty and {self.folder}'s tokenizer adds no BOS token, "
                "so the completion's first token has nothing to follow. Give a prompt."
            )
        return ids


class Prompts(Dataset):
    """One split's prompts (see the module docstring for an item)."""

    def __init__(self, prompts: list[Prompt], pad_id: int, offset: int, repeat: tuple[int, int]):
        self.prompts, self.offset, self.repeat = prompts, offset, repeat
        self.collate = LeftPad(pad_id, self)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.prompts[i].ids, dtype=torch.long)
        return {"input_ids": ids, "index": torch.tensor(self.offset + i)}

    def record(self, index: int) -> dict:
        return self.prompts[index - self.offset].record

    def make_loader(self, loader_cfg, *, device, seed, rank, world, limit, **_: Any):
        """The torch loader over a `RepeatedOrder` (task.num_iterations; 1: the plain order)."""
        order = RepeatedOrder(
            len(self), loader_cfg.batch_size, train=True, shuffle=loader_cfg.shuffle, seed=seed,
            rank=rank, world=world, drop_last=loader_cfg.drop_last, limit=limit,
            repeat=self.repeat,
        )  # fmt: skip
        loader = TorchLoader(self, order, loader_cfg, device, seed, 0, labelled=False)
        loader.order_depends_on = {"task.num_iterations": self.repeat[0]}
        return loader


class LeftPad:
    """Collate: the prompts padded on the left to the batch's longest, with their mask and
    records (a batch's first tensor is `input_ids`: its samples are the prompts)."""

    def __init__(self, pad_id: int, split: Prompts):
        self.pad_id, self.split = pad_id, split

    def __call__(self, items: list[dict]) -> dict[str, Any]:
        width = max(len(it["input_ids"]) for it in items)
        x = torch.full((len(items), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, it in enumerate(items):
            n = len(it["input_ids"])
            x[i, width - n :], mask[i, width - n :] = it["input_ids"], 1
        index = torch.stack([it["index"] for it in items])
        records = [self.split.record(int(i)) for i in index]
        return {"input_ids": x, "attention_mask": mask, "index": index, "records": records}


def _encode_file(file: str, key: str, encoder: PromptEncoder, max_len: int | None) -> list:
    prompts, cut = [], 0
    for where, record in read_records(file, key):
        record = _check(where, record)
        ids = encoder.encode(where, record["prompt"])
        if max_len and len(ids) > max_len:
            ids, cut = ids[-max_len:], cut + 1
        prompts.append(Prompt(ids, record))
    if cut:
        log.warning(
            "%s: %d of %d prompts longer than dataset.max_prompt_length=%d were cut from the "
            "left", file, cut, len(prompts), max_len,
        )  # fmt: skip
    return prompts


def prompt_splits(
    path: str,
    tokenizer: str,
    max_prompt_length: int | None = 512,
    val_path: str | None = None,
    test_path: str | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    chat_template: str | None = None,
    num_iterations: int = 1,
    accumulate_grad_batches: int = 1,
) -> Splits:
    """The prompt splits (see the module docstring); `tokenizer`: the model folder whose
    tokenizer and chat template render the prompts."""
    if max_prompt_length is not None and max_prompt_length < 1:
        raise UserError(
            f"dataset.max_prompt_length={max_prompt_length}: must be at least 1 token, or null."
        )
    if not tokenizer:
        raise UserError(
            "dataset.tokenizer is not set: name the model folder whose tokenizer and chat "
            "template render the prompts (model=hf sets it to model.path)."
        )
    tok = load_tokenizer(tokenizer, chat_template=chat_template)
    encoder = PromptEncoder(tok, tokenizer)
    files = {"train": path, "val": val_path, "test": test_path}
    encode = lambda file, key: _encode_file(file, key, encoder, max_prompt_length)  # noqa: E731
    sets = split_files(files, encode, val_fraction, seed, "prompts")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    out, offset = {}, 0
    for name in ("train", "val", "test"):
        if name in sets:
            repeat = (max(1, num_iterations), max(1, accumulate_grad_batches))
            out[name] = Prompts(sets[name], pad_id, offset, repeat if name == "train" else (1, 1))
            offset += len(sets[name])
    log.info("prompts: %d train / %d val prompts", len(out["train"]), len(out["val"]))
    shape = {"in_channels": 0, "image_size": 0, "num_classes": 0}
    return Splits(
        out["train"], out["val"], out.get("test"), **shape,
        model_args={"vocab_size": len(tok)}, only_task="grpo",
    )  # fmt: skip

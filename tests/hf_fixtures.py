"""A tiny Llama-style causal LM (and a tinier GPT-2) and a byte-level BPE tokenizer with a chat
template, built from a config and written with save_pretrained (tests never download), plus
instruction records."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|pad|>", "<|im_start|>", "<|im_end|>"]

QUESTIONS = [
    ("Reverse a list.", "def rev(xs):\n    return xs[::-1]"),
    ("Add two numbers.", "def add(a, b):\n    return a + b"),
    ("Square a number.", "def sq(x):\n    return x * x"),
    ("Say hello.", "print('hello')"),
    ("Return the length of a list.", "def n(xs):\n    return len(xs)"),
    ("Return the first item.", "def first(xs):\n    return xs[0]"),
    ("Negate a number.", "def neg(x):\n    return -x"),
    ("Double a number.", "def dbl(x):\n    return 2 * x"),
]


def write_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [q + "\n" + a for q, a in QUESTIONS] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>"
    )
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


def write_tiny_llama(folder: Path, *, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0):
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with its tokenizer, in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(folder, chat_template)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def write_tiny_gpt2(folder: Path, positions: int = 64):
    """A 1-layer GPT-2 (hidden 32, 2 heads) with learned positions, only `positions` of them,
    and the chat tokenizer, in `folder`: what a prompt past the positions breaks."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(folder)
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=len(tok),
        n_positions=positions,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def write_records(path: Path, n: int = 48, form: str = "messages") -> Path:
    with path.open("w") as f:
        for i in range(n):
            q, a = QUESTIONS[i % len(QUESTIONS)]
            if form == "messages":
                rec = {
                    "messages": [
                        {"role": "system", "content": "You write Python."},
                        {"role": "user", "content": q},
                        {"role": "assistant", "content": a},
                    ]
                }
            else:
                rec = {"prompt": q, "completion": a}
            f.write(json.dumps(rec) + "\n")
    return path


def write_preferences(path: Path, n: int = 48, form: str = "text", start: int = 0) -> Path:
    """Preference pairs whose preferred answer is learnable: the chosen answer is the rejected
    one in upper case. `form`: TRL's plain-text records, or "chat" (lists of messages)."""
    with path.open("w") as f:
        for i in range(start, start + n):
            q, a = QUESTIONS[i % len(QUESTIONS)]
            prompt, chosen, rejected = f"{q} (case {i})", a.upper(), a.lower()
            if form == "chat":
                rec = {
                    "prompt": [
                        {"role": "system", "content": "You write Python."},
                        {"role": "user", "content": prompt},
                    ],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            else:
                rec = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            f.write(json.dumps(rec) + "\n")
    return path


def write_gpt2_tokens(folder: Path, docs: int = 200, seed: int = 0) -> Path:
    """A token folder as `accel-data tokenize` writes one with GPT-2's tokenizer (uint16 ids
    below 50,257, meta.json), of short random documents each ended by <|endoftext|> (50256):
    what docs/long-context.md's `dataset.document_separator=50256` lines train on."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.bin", docs), ("val.bin", max(docs // 10, 4))):
        parts = [np.append(rng.integers(0, 50256, rng.integers(8, 40)), 50256) for _ in range(n)]
        np.concatenate(parts).astype(np.uint16).tofile(folder / name)
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 50257, "dtype": "uint16"}))
    return folder

"""Sampling from a causal language model: any module that maps token ids (batch, time) to
logits (batch, time, vocab). `accel-sample` and the language-model task's validation samples
call this; nanoGPT's `generate`, plus nucleus (top-p) sampling and a seeded generator so that the
same seed gives the same text."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Append `max_new_tokens` sampled tokens to each row of `idx` (batch, time). The model sees
    at most its last `block_size` tokens. temperature 0 = greedy."""
    pick = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float()
        idx = torch.cat([idx, _pick(logits, **pick)], dim=1)
    return idx


@torch.no_grad()
def generate_cached(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    block_size: int,
    valid: torch.Tensor | None = None,
    repeat: int = 1,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`generate` with the model's KV cache (`model.decode`, model=gpt's): the prompts `idx`
    (b, time; `valid` False on left padding) run forward once, their cache is repeated `repeat`
    times per row (each prompt's group of completions shares its prefill), then each step runs
    the new token only. Returns (b * repeat, time + max_new_tokens), rows in
    `repeat_interleave` order. Past `block_size` tokens the rest is sampled by `generate`'s
    sliding window (recomputed, as before). Same logits as `generate` up to float rounding,
    and the same random draws: the same seed gives the same tokens."""
    pick = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    logits, cache = model.decode(idx, None, valid)
    expand = lambda t: t.repeat_interleave(repeat, 0)  # noqa: E731
    idx, logits = expand(idx), expand(logits[:, -1].float())
    cache = [(expand(k), expand(v)) for k, v in cache]
    valid = None if valid is None else expand(valid)
    for done in range(max_new_tokens):
        nxt = _pick(logits, **pick)
        idx = torch.cat([idx, nxt], dim=1)
        if done + 1 == max_new_tokens:
            break
        if idx.shape[1] >= block_size:  # the cache is full: the sliding window from here
            rest = max_new_tokens - done - 1
            return generate(model, idx, rest, block_size=block_size, **pick)
        if valid is not None:
            valid = torch.cat([valid, torch.ones_like(nxt, dtype=torch.bool)], dim=1)
        out, cache = model.decode(nxt, cache, valid)
        logits = out[:, -1].float()
    return idx


def _pick(logits: torch.Tensor, *, temperature, top_k, top_p, generator) -> torch.Tensor:
    """The next token (b, 1) from the last position's fp32 logits (b, vocab)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        logits = _nucleus(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability adds up to top_p (at least one)."""
    ordered, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p  # mass before this token
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)

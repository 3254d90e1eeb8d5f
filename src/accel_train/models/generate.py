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
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if top_p < 1.0:
                logits = _nucleus(logits, top_p)
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability adds up to top_p (at least one)."""
    ordered, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p  # mass before this token
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)

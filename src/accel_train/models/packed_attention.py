"""Packed rows for the built-in GPT: several records laid end to end in one row, each attending
only to itself, with its positions starting again at 0 (`dataset=sft dataset.pack=true`,
`dataset=streaming_sft` over packed shards).

The rows carry `position_ids` (b, t); a record starts where its position is 0, so the document
of each token is the running count of those zeros. The attention is causal inside each
document and blind across them (block-diagonal causal):

- on CUDA, FlexAttention (`flex_attention` with a `create_block_mask` from the document ids,
  compiled once per process): the fully masked tiles are skipped, so a packed row costs what
  its records cost apart;
- elsewhere (and with attention dropout on, which FlexAttention does not do), SDPA with an
  explicit boolean mask (b, 1, t, t). FlexAttention has no CPU backward (torch 2.14: "does not
  support backward on CPU"), so a CPU run could not train with it.

The mask is built once per forward (`documents`) and handed to every block as an argument, not
kept in a module attribute: activation checkpointing's recompute in the backward runs after the
forward has returned and gets the same object back with the block's saved inputs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F


@dataclass
class Documents:
    """What the blocks of one packed forward share: the per-record positions (rotary angles are
    gathered at them) and the attention mask (a FlexAttention BlockMask when `flex`, else a
    boolean (b, 1, t, t), True where a query may look)."""

    positions: torch.Tensor
    mask: Any
    flex: bool


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(b, t) positions restarting at 0 per record -> (b, t) record index within the row."""
    return (position_ids == 0).cumsum(-1)


def documents(position_ids: torch.Tensor, *, flex: bool) -> Documents:
    """The mask of one packed batch (no host sync: the block mask is built on the device)."""
    doc = document_ids(position_ids)
    b, t = doc.shape
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask  # CUDA runs only

        def same_document(batch, head, q, kv):
            return (doc[batch, q] == doc[batch, kv]) & (q >= kv)

        mask = create_block_mask(same_document, b, None, t, t, device=doc.device)
    else:
        causal = torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
        mask = ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)
    return Documents(position_ids, mask, flex)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process: eager it runs the reference (dense) math.
    Inside a compiled model (trainer.compile) dynamo traces through it."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, dropout_p: float
) -> torch.Tensor:
    """Block-diagonal causal attention of (b, heads, t, head size) queries, keys and values."""
    if docs.flex:
        return _compiled_flex()(q, k, v, block_mask=docs.mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask, dropout_p=dropout_p)

"""`model=gpt`: a GPT-2-style decoder-only transformer in one file (nanoGPT's `model.py` shape).

Pre-LayerNorm blocks, causal self-attention through `scaled_dot_product_attention(is_causal=True)`
(flash / memory-efficient kernels where the device has them), a GELU MLP, the token embedding
tied to the output head, and GPT-2's initialisation: N(0, 0.02) everywhere, the residual
projections scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with
depth. The vocabulary size comes from the data (a token folder's meta.json), not from the user.

`forward(idx)` returns logits (batch, time, vocab); the language-model task computes the loss,
so every technique that wraps a task's step (accumulation, the normaliser, precision) applies.

The model is a chain of its children run in order, `embed` -> `blocks` (an nn.Sequential of
`Block`s) -> `head`, so that what cuts models generically finds the GPT's stages without knowing
it: strategy=pipeline puts whole blocks on stages (pipeline.chain), activation checkpointing and
FSDP wrap each `Block`. The tied embedding then lives in the first and the last stage; the
pipeline keeps the two copies equal by summing their gradients (Pipeline.sync_shared_grads).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        # q, k and v are separate layers so that tensor parallelism can shard each by heads
        # (a fused layer sharded by rows would give one rank all of q and half of k).
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (b, t, c) -> (b, heads, t, head size); under tensor parallelism this rank's heads only
        # (the projections' outputs hold n_head / tp heads), hence -1, not n_head.
        q, k, v = (
            lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the unit activation checkpointing and the pipeline
    strategy cut at."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    """Token plus position embeddings (then dropout): token ids (batch, time) -> (b, t, c)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than block_size={self.block_size}"
            )
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class Head(nn.Module):
    """The final LayerNorm and the output projection to the vocabulary."""

    def __init__(self, vocab_size: int, n_embd: int, bias: bool):
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


# Checkpoints written before the model was a chain: their keys, renamed on load.
_OLD_KEYS = {
    "wte.": "embed.wte.",
    "wpe.": "embed.wpe.",
    "ln_f.": "head.ln_f.",
    "lm_head.": "head.lm_head.",
}


class GPT(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        block_size: int = 256,
        n_layer: int = 6,
        n_head: int = 6,
        n_embd: int = 384,
        dropout: float = 0.0,
        bias: bool = False,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.embed = Embed(vocab_size, block_size, n_embd, dropout)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer)))
        self.head = Head(vocab_size, n_embd, bias)
        self.head.lm_head.weight = self.embed.wte.weight  # weight tying (Press & Wolf, 2017)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # the residual projections: GPT-2's scaled init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self._register_load_state_dict_pre_hook(_rename_old_keys)

    @property
    def wte(self) -> nn.Embedding:
        return self.embed.wte

    @property
    def wpe(self) -> nn.Embedding:
        return self.embed.wpe

    @property
    def lm_head(self) -> nn.Linear:
        return self.head.lm_head

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Tensor parallelism (strategy=tp, strategy.tp): q, k, v and the MLP's up projection
        column-wise (each rank its own heads and hidden units), the attention output and the MLP
        down projection row-wise (their outputs all-reduced). With sequence parallelism the
        residual stream between them is split along the sequence: the norms and dropouts run on
        1/tp of the tokens, and the row-wise layers reduce-scatter instead of all-reducing."""
        seq = Shard(1)
        out = seq if sequence_parallel else Replicate()
        plan: dict[str, ParallelStyle] = {}
        for part in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.*.{part}"] = ColwiseParallel()
        for part in ("attn.proj", "mlp.proj"):
            plan[f"blocks.*.{part}"] = RowwiseParallel(output_layouts=out)
        if not sequence_parallel:
            return plan
        gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        plan.update(
            {
                "embed": PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=seq
                ),
                "blocks.*.ln_1": SequenceParallel(),
                "blocks.*.ln_2": SequenceParallel(),
                "blocks.*.attn": gather,
                "blocks.*.mlp": gather,
                "head": PrepareModuleInput(
                    input_layouts=(seq,),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            }
        )
        return plan

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; the position embedding left out by default, as nanoGPT counts N for the
        FLOPs (the token embedding is tied to the head, which does matmul work)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6N + 12 * L * H * Q * T (nanoGPT's `estimate_mfu`, from the
        PaLM paper's appendix B): the weights' matmuls forward and backward, plus attention."""
        t = seq_len or self.block_size
        head = self.n_embd // self.n_head
        return 6 * self.num_params() + 12 * self.n_layer * self.n_head * head * t


def _rename_old_keys(state_dict, prefix, *_args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        head, _, tail = key.partition(".attn.qkv.")
        if tail in ("weight", "bias"):
            # Before tensor parallelism q, k and v were one fused layer: split it in three.
            for name, part in zip("qkv", state_dict.pop(key).chunk(3, dim=0), strict=True):
                state_dict[f"{head}.attn.{name}.{tail}"] = part
            continue
        for old, new in _OLD_KEYS.items():
            if rest.startswith(old):
                state_dict[prefix + new + rest[len(old) :]] = state_dict.pop(key)
                break

"""`model=gpt`: a GPT-2-style decoder-only transformer in one file (nanoGPT's `model.py` shape).

Pre-LayerNorm blocks, causal self-attention through `scaled_dot_product_attention(is_causal=True)`
(flash / memory-efficient kernels where the device has them), a GELU MLP, the token embedding
tied to the output head, and GPT-2's initialisation: N(0, 0.02) everywhere, the residual
projections scaled by 1/sqrt(2 * n_layer) so the residual stream's variance does not grow with
depth. The vocabulary size comes from the data (a token folder's meta.json), not from the user.

Options from the modded-nanogpt line of work, each a switch on `model=gpt` (off by default, so
`model=gpt` stays nanoGPT's model): `pos_embedding=rope` (rotary positions on the queries and
keys instead of a learned position table), `qk_norm=true` (RMS-normalised queries and keys per
head, which keeps attention logits bounded at high learning rates), `activation=relu2` (ReLU
squared in the MLP), `tie_embeddings=false` (an output head of its own).

`forward(idx)` returns logits (batch, time, vocab); the language-model task computes the loss,
so every technique that wraps a task's step (accumulation, the normaliser, precision) applies.
`forward(idx, position_ids)` takes packed rows (`dataset=sft dataset.pack=true`): positions
restart per record and each record attends only to itself (models/packed_attention.py).

The model is a chain of its children run in order, `embed` -> `blocks` (an nn.Sequential of
`Block`s) -> `head`, so that what cuts models generically finds the GPT's stages without knowing
it: strategy=pipeline puts whole blocks on stages (pipeline.chain), activation checkpointing and
FSDP wrap each `Block`. The tied embedding then lives in the first and the last stage; the
pipeline keeps the two copies equal by summing their gradients (Pipeline.sync_shared_grads).
Packed rows run the same blocks one by one, their mask passed to each as an argument;
strategy=pipeline refuses them (its stages hand each other one tensor).
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

from accel_train.losses import output_layer
from accel_train.models.packed_attention import Documents, attend, documents

POS_EMBEDDINGS = ("learned", "rope")
ACTIVATIONS = ("gelu", "relu2")


class Rotary(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021) of the queries and keys: each pair of
    channels (i, i + half) rotated by position x frequency. The angles are buffers that are not
    saved: a checkpoint's keys do not depend on the option."""

    def __init__(self, head_size: int, block_size: int, base: float):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"pos_embedding=rope needs an even head size, not {head_size}")
        freq = base ** (-torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
        angles = torch.outer(torch.arange(block_size, dtype=torch.float32), freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, z: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(b, heads, t, head size) -> the same, rotated by position: 0..t-1, or each token's
        own (packed rows: (b, t), restarting per record)."""
        if positions is None:
            t = z.shape[-2]
            cos, sin = self.cos[:t].to(z.dtype), self.sin[:t].to(z.dtype)
        else:  # (b, t, half) -> (b, 1, t, half): the same angles for every head
            cos = self.cos[positions].unsqueeze(1).to(z.dtype)
            sin = self.sin[positions].unsqueeze(1).to(z.dtype)
        a, b = z.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float,
        bias: bool,
        rotary: Rotary | None = None,
        qk_norm: bool = False,
    ):
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
        self.rotary, self.qk_norm = rotary, qk_norm

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        """`docs`: packed rows' records (models/packed_attention.py), each attending only to
        itself; None: one sequence a row, plain causal attention (no mask is built)."""
        b, t, _ = x.shape
        # (b, t, c) -> (b, heads, t, head size); under tensor parallelism this rank's heads only
        # (the projections' outputs hold n_head / tp heads), hence -1, not n_head.
        q, k, v = (
            lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        if self.qk_norm:  # unit-RMS queries and keys per head (no learned scale)
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        positions = docs.positions if docs is not None else None
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        dropout = self.dropout if self.training else 0.0
        if docs is None or docs.mask is None:  # (no mask: context parallelism's ring)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:
            y = attend(q, k, v, docs, dropout)
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_dropout(self.proj(y))

    def cached(self, x: torch.Tensor, kv: KV | None, step: Step) -> tuple[torch.Tensor, KV]:
        """Sampling with a KV cache (eval only): the new tokens' outputs attending to the cached
        keys and values `kv` ((b, heads, past, head size) each; None: none yet) and to
        themselves; the cache grown by the new tokens."""
        b, t, _ = x.shape
        q, k, v = (
            lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        if self.qk_norm:
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        if self.rotary is not None:
            q, k = self.rotary(q, step.positions), self.rotary(k, step.positions)
        if kv is not None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        causal = step.mask is None and kv is None  # a prefill without padding: SDPA's causal
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, is_causal=causal)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, -1)), (k, v)


KV = tuple[torch.Tensor, torch.Tensor]  # one layer's cached keys and values


class Step:
    """One forward of cached sampling: the new tokens' positions (b, t) and the attention mask
    (b, 1, t, past + t), None where plain causal attention (or a single new token attending to
    everything cached) is exact. `valid` (b, past + t): False on left padding."""

    def __init__(self, past: int, t: int, valid: torch.Tensor | None, device: torch.device):
        self.mask = None
        if valid is None:
            self.positions = (past + torch.arange(t, device=device)).unsqueeze(0)
            if past and t > 1:
                keys = torch.arange(past + t, device=device)
                self.mask = (keys <= self.positions.T)[None, None]
            return
        # a left-padded row's positions count its real tokens only (as its unpadded run's)
        self.positions = (valid.long().cumsum(1) - 1).clamp(min=0)[:, past:]
        keys = torch.arange(past + t, device=device)
        queries = past + torch.arange(t, device=device)
        allowed = (keys <= queries[:, None])[None] & valid[:, None, :]
        # a padding query attends to itself (its output is never used; no all-masked row)
        self.mask = (allowed | (keys == queries[:, None])[None]).unsqueeze(1)


class ReLU2(nn.Module):
    """ReLU squared (So et al. 2021, "Primer"): modded-nanogpt's MLP activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool, activation: str = "gelu"):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = ReLU2() if activation == "relu2" else nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the unit activation checkpointing and the pipeline
    strategy cut at."""

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        dropout: float,
        bias: bool,
        rotary: Rotary | None = None,
        qk_norm: bool = False,
        activation: str = "gelu",
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, rotary, qk_norm)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias, activation)

    def forward(self, x: torch.Tensor, docs: Documents | None = None) -> torch.Tensor:
        # docs by keyword: tensor parallelism's input preparation of `attn` lays out its
        # positional input (the residual stream) only.
        x = x + self.attn(self.ln_1(x), docs=docs)
        return x + self.mlp(self.ln_2(x))

    def cached(self, x: torch.Tensor, kv: KV | None, step: Step) -> tuple[torch.Tensor, KV]:
        """The block with a KV cache (CausalSelfAttention.cached)."""
        a, kv = self.attn.cached(self.ln_1(x), kv, step)
        x = x + a
        return x + self.mlp(self.ln_2(x)), kv


class Embed(nn.Module):
    """Token plus position embeddings (then dropout): token ids (batch, time) -> (b, t, c).
    With rotary positions (`learned_positions=False`) there is no position table."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        n_embd: int,
        dropout: float,
        learned_positions: bool = True,
    ):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd) if learned_positions else None
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than block_size={self.block_size}"
            )
        x = self.wte(idx)
        if self.wpe is not None:
            pos = torch.arange(t, device=idx.device) if position_ids is None else position_ids
            x = x + self.wpe(pos)
        return self.drop(x)


class Head(nn.Module):
    """The final LayerNorm and the output projection to the vocabulary.

    `head_loss` (task.chunked_loss): instead of the logits, `head_loss(hidden, weight, bias)`,
    the loss computed from the output layer's weight without the (tokens, vocab) logits. It
    runs inside this forward (the model's) so that FSDP's pre-forward hook has gathered the
    weight: read outside it, a sharded weight would be one rank's shard."""

    def __init__(self, vocab_size: int, n_embd: int, bias: bool):
        super().__init__()
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, head_loss=None) -> torch.Tensor:
        if head_loss is None:
            return self.lm_head(self.ln_f(x))
        return head_loss(self.ln_f(x), *output_layer(self.lm_head, "the GPT's head.lm_head"))


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
        pos_embedding: str = "learned",
        rope_base: float = 10000.0,
        qk_norm: bool = False,
        activation: str = "gelu",
        tie_embeddings: bool = True,
    ):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        for key, value, allowed in (
            ("pos_embedding", pos_embedding, POS_EMBEDDINGS),
            ("activation", activation, ACTIVATIONS),
        ):
            if value not in allowed:
                raise ValueError(f"{key}={value}: must be one of {', '.join(allowed)}")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.dropout = dropout
        rope = pos_embedding == "rope"
        self.embed = Embed(vocab_size, block_size, n_embd, dropout, learned_positions=not rope)

        def rotary() -> Rotary | None:  # each block its own (small) angle table
            return Rotary(n_embd // n_head, block_size, rope_base) if rope else None

        self.blocks = nn.Sequential(
            *(
                Block(n_embd, n_head, dropout, bias, rotary(), qk_norm, activation)
                for _ in range(n_layer)
            )
        )
        # The blocks, named (a capability): activation checkpointing and FSDP take them at any
        # depth, where finding blocks as a class that repeats would miss a one-block GPT's.
        self.block_names = tuple(f"blocks.{i}" for i in range(n_layer))
        self.head = Head(vocab_size, n_embd, bias)
        if tie_embeddings:  # weight tying (Press & Wolf, 2017)
            self.head.lm_head.weight = self.embed.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # the residual projections: GPT-2's scaled init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self._register_load_state_dict_pre_hook(_rename_old_keys)

    @property
    def wte(self) -> nn.Embedding:
        return self.embed.wte

    @property
    def wpe(self) -> nn.Embedding | None:
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

    def forward(
        self,
        idx: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        packed: bool = True,
        head_loss=None,
    ) -> torch.Tensor:
        """Token ids (b, t) -> logits (b, t, vocab). `position_ids` (b, t): packed rows, whose
        positions restart at 0 with each record; every record then attends only to itself
        (models/packed_attention.py) and is scored as it would be alone. `packed=False`: the
        positions of one sequence a row (context parallelism hands each process a part of each
        row, strategies/context_parallel.py): plain causal attention at those positions.
        `head_loss` (task.chunked_loss): the loss instead of the logits, see Head."""
        x = self.embed(idx, position_ids)
        if position_ids is None:  # the plain chain the generic cutters see
            return self.head(self.blocks(x), head_loss=head_loss)
        # One mask for all blocks, passed to each (a checkpointed block's recompute gets it back
        # with its saved inputs). FlexAttention on CUDA; it has no dropout: SDPA then.
        dropout = self.training and self.dropout > 0
        if packed:
            docs = documents(position_ids, flex=position_ids.is_cuda and not dropout)
        else:
            docs = Documents(position_ids, mask=None, flex=False)
        for block in self.blocks:
            x = block(x, docs=docs)
        return self.head(x, head_loss=head_loss)

    @torch.no_grad()
    def decode(
        self, idx: torch.Tensor, cache: list[KV] | None = None, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[KV]]:
        """Sampling with a KV cache: the new tokens `idx` (b, t) after the `cache` (one (keys,
        values) per block, None: nothing yet) -> (the new tokens' logits (b, t, vocab), the
        cache grown by them). `valid` (b, past + t): False on left padding (rows of prompts of
        different lengths). The same arithmetic as `forward`, without recomputing the past:
        models/generate.py's `generate_cached` samples with it."""
        past = 0 if cache is None else cache[0][0].shape[2]
        step = Step(past, idx.shape[1], valid, idx.device)
        x = self.embed.drop(self.embed.wte(idx))
        if self.embed.wpe is not None:
            x = x + self.embed.wpe(step.positions)
        new = []
        for i, block in enumerate(self.blocks):
            x, kv = block.cached(x, None if cache is None else cache[i], step)
            new.append(kv)
        return self.head(x), new

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
        FLOPs (a tied token embedding is the head, which does matmul work; an untied one is a
        lookup, left out too)."""
        n = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return n
        if self.wpe is not None:
            n -= self.wpe.weight.numel()
        if self.lm_head.weight is not self.wte.weight:
            n -= self.wte.weight.numel()
        return n

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

"""The long-context switches' CUDA paths in one process (issue 41; scripts/gpu_check.sh runs it
on a GPU): packed rows through FlexAttention score each record as it scores alone (losses and
gradients, also under checkpointed blocks), and activation offloading lowers the step's peak
GPU memory without changing its gradients. Prints one line per check; exit 1 when one fails.

    python scripts/gpu_long_context.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from accel_train.models.gpt import GPT
from accel_train.models.packed_attention import documents
from accel_train.techniques.activation_checkpointing import OffloadActivations

DEV = "cuda"


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=512, **kw).to(DEV)


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def packed_flex_matches_alone(checkpointed: bool) -> str:
    model = _gpt(block_size=1024, n_layer=2, n_head=4, n_embd=128, pos_embedding="rope")
    if checkpointed:
        for i, block in enumerate(model.blocks):
            impl = CheckpointImpl.NO_REENTRANT
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
    lengths = (300, 1, 500, 223)  # 1,024 tokens: one row
    gen = torch.Generator().manual_seed(1)
    records = [torch.randint(0, 512, (n + 1,), generator=gen).to(DEV) for n in lengths]
    x = torch.cat([r[:-1] for r in records])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(DEV)
    assert documents(pos, flex=True).flex  # the path a CUDA forward takes
    y = torch.cat([r[1:] for r in records])
    packed = F.cross_entropy(model(x, position_ids=pos)[0], y, reduction="none")
    packed.sum().backward()
    g_packed = _grads(model)
    alone = torch.cat(
        [F.cross_entropy(model(r[None, :-1])[0], r[1:], reduction="none") for r in records]
    )
    alone.sum().backward()
    g_alone = _grads(model)
    loss_diff = (packed - alone).abs().max().item()
    grad_diff = max((g_packed[n] - g_alone[n]).abs().max().item() for n in g_alone)
    assert loss_diff < 1e-4 and grad_diff < 1e-4, (loss_diff, grad_diff)
    return f"loss max diff {loss_diff:.1e}, grad max diff {grad_diff:.1e}"


def offload_lowers_peak_memory() -> str:
    model = _gpt(block_size=2048, n_layer=4, n_head=8, n_embd=512)
    x = torch.randint(0, 512, (8, 2048), device=DEV)

    def step(offload: OffloadActivations | None):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if offload is None:
            logits = model(x)
        else:
            with offload:
                logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
        loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, _grads(model)

    step(None)  # warm-up: kernels, the caching allocators (device and pinned host)
    plain, g_plain = step(None)
    offload = OffloadActivations()
    moved, g_moved = step(offload)
    diff = max((g_plain[n] - g_moved[n]).abs().max().item() for n in g_plain)
    assert moved < 0.8 * plain and diff < 1e-5, (moved, plain, diff)
    return (
        f"peak {plain / 2**20:,.0f} MiB -> {moved / 2**20:,.0f} MiB with {offload.offloaded} "
        f"tensors offloaded; grad max diff {diff:.1e}"
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_long_context: no CUDA device here: nothing to check")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons
    failed = 0
    checks = {
        "packed_flex": lambda: packed_flex_matches_alone(False),
        "packed_flex_checkpointed": lambda: packed_flex_matches_alone(True),
        "activation_offload": offload_lowers_peak_memory,
    }
    for name, check in checks.items():
        try:
            print(f"{name}: ok, {check()}")
        except Exception as err:  # report every check, then fail
            failed += 1
            print(f"{name}: FAILED: {type(err).__name__}: {err}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Why LoRA GRPO's peak RSS exceeds full GRPO's on CPU (scripts/bench/grpo.py --parts memory):
glibc heap fragmentation under trainer.tune_malloc, not the autograd graph.

In-process, no accel-train loop: finetune_lora's 111 M-parameter Llama (or --arch tiny), full
fine-tuning or PEFT LoRA (rank 8, every projection), a batch of 32 rows x 140 tokens (GRPO's
4 prompts x 8 completions), per iteration one no-grad forward (the reference), one forward +
backward + AdamW step. Prints VmRSS/VmHWM after the forward and after the step, and the bytes
the autograd graph saves (unique storages), under an allocator setting:
  tune     trainer.tune_malloc's mallopt: mmap only >= 32 MiB, never trim (the default run)
  mmap4    the same, mmap from 4 MiB
  default  glibc's own (dynamic mmap threshold)

    python scripts/bench/lora_heap.py --mode lora --malloc tune
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, value = line.split(":", 1)
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) // 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", default="111m", choices=["111m", "tiny"])
    p.add_argument("--mode", default="lora", choices=["lora", "full"])
    p.add_argument("--malloc", default="tune", choices=["tune", "mmap4", "default"])
    p.add_argument("--iters", type=int, default=2)
    a = p.parse_args()
    if a.malloc != "default":  # before torch allocates anything
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        mallopt(M_MMAP_THRESHOLD, (4 if a.malloc == "mmap4" else 32) << 20)
        mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from finetune_lora import MEM_MODEL, RACE_MODEL

    torch.manual_seed(0)
    arch = MEM_MODEL if a.arch == "111m" else RACE_MODEL
    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, max_position_embeddings=1024, **arch))
    if a.mode == "lora":
        from peft import LoraConfig, inject_adapter_in_model

        model.requires_grad_(False)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
        model = inject_adapter_in_model(cfg, model)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    print(f"{a.arch} {a.mode} malloc={a.malloc}: start {status()}")
    for it in range(a.iters):
        seq = torch.randint(0, 4096, (32, 140))
        with torch.no_grad():
            model(input_ids=seq, use_cache=False).logits.float().log_softmax(-1)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(input_ids=seq, use_cache=False).logits
        fwd = status()
        logits.float().logsumexp(-1).mean().backward()
        del logits
        opt.step()
        opt.zero_grad(set_to_none=True)
        graph = f"graph saves {sum(saved.values()) / 2**20:,.0f} MiB ({len(saved)} tensors)"
        print(f"iter {it}: {graph}; after forward {fwd}; after step {status()}", flush=True)


if __name__ == "__main__":
    main()

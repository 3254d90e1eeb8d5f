"""task=grpo's sampling and scoring costs (issue 61, C.15 and C.13), on the CPU.

Sampling: model=gpt's completions per CPU second, nanoGPT's loop (each group's rows recompute
the whole sequence for every token: the loop before C.15) against the KV cache with each
prompt's prefill shared by its group (`nano_sample`), 1 intra-op thread. Then a tiny Llama
(model=hf) with the group's prompt repeated against the shared prefill (`generate_ids(repeat=)`).

Scoring memory: the peak resident memory (ru_maxrss, each mode in a fresh process) of the
per-token log-probs, forward and backward, of a 150k-vocabulary model: the whole sequence's
logits, the completion positions' only, and those in chunks (task.chunked_loss).

    python scripts/bench/grpo_sampling.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import torch

from accel_train.models.generate import generate
from accel_train.models.gpt import GPT
from accel_train.tasks.grpo_generation import nano_sample

G, PROMPTS, PROMPT, NEW = 8, 2, 96, 32


def _cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def sampling() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=2048, block_size=256, n_layer=4, n_head=4, n_embd=128).eval()
    ids = torch.randint(0, 2048, (PROMPTS, PROMPT)).repeat_interleave(G, 0)
    mask = torch.ones_like(ids)
    tokens = ids.shape[0] * NEW

    def before():
        for start in range(0, ids.shape[0], G):
            generate(model, ids[start : start + G], NEW, block_size=256, top_k=50)

    after = lambda: nano_sample(model, ids, mask, G, NEW, top_k=50)  # noqa: E731
    with torch.no_grad():
        after()  # warm-up
        old, new = _cpu(before), _cpu(after)
    print(f"model=gpt 4x128, prompt {PROMPT} + {NEW} new, {PROMPTS} prompts x G={G}: "
          f"no cache {tokens / old:.0f} tok/CPU-s, KV cache + shared prefill "
          f"{tokens / new:.0f} tok/CPU-s ({old / new:.1f}x)")  # fmt: skip


def hf_sampling() -> None:
    from pathlib import Path
    from tempfile import TemporaryDirectory

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from hf_fixtures import write_tiny_llama

    from accel_train.models.hf import hf_model

    with TemporaryDirectory() as tmp:
        model = hf_model(path=str(write_tiny_llama(Path(tmp) / "llama"))).eval()
    ids = torch.randint(3, 300, (PROMPTS, 4 * PROMPT))
    mask = torch.ones_like(ids)
    args = dict(temperature=1.0, top_k=50, top_p=1.0, eos_token_id=None)
    rep = lambda: model.generate_ids(ids.repeat_interleave(G, 0), NEW, **args)  # noqa: E731
    shared = lambda: model.generate_ids(ids, NEW, attention_mask=mask, repeat=G, **args)  # noqa: E731
    shared()
    old, new = _cpu(rep), _cpu(shared)
    tokens = PROMPTS * G * NEW
    print(f"model=hf tiny Llama, prompt {4 * PROMPT} + {NEW} new: repeated prompts "
          f"{tokens / old:.0f} tok/CPU-s, shared prefill {tokens / new:.0f} tok/CPU-s "
          f"({old / new:.1f}x)")  # fmt: skip


def scoring(mode: str) -> None:
    from accel_train.tasks.grpo import GRPO

    rewards = [{"_target_": "accel_train.rewards.length_penalty", "max_tokens": 3}]
    torch.manual_seed(0)
    model = GPT(vocab_size=151_936, block_size=512, n_layer=2, n_head=2, n_embd=64)
    task = GRPO(num_generations=4, max_completion_length=64, rewards=rewards,
                chunked_loss=mode == "chunked", loss_chunk_tokens=128)  # fmt: skip
    task.eos, task.pad, task.head_loss = 1, 0, mode != "whole logits"
    ids = torch.randint(2, 1000, (8, 192))
    roll = task._layout(ids, torch.ones_like(ids), torch.randint(2, 1000, (8, 64)))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    logps, _ = task._logps(model, roll)
    logps.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": mode, "peak_mb": round((peak - base) / 1024)}))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        scoring(sys.argv[1])
        sys.exit()
    torch.set_num_threads(1)
    sampling()
    hf_sampling()
    print("scoring 8 rows of 192 prompt + 64 completion tokens, vocabulary 151,936, fp32:")
    for mode in ("whole logits", "completion positions", "chunked"):
        out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"  {row['mode']}: peak resident memory above the model's +{row['peak_mb']} MB")

"""Long-context memory on this CPU (issue 41): the peak memory and the time of one training step
with the loss chunked (task.chunked_loss) and plain, at 2k, 4k and 8k tokens.

python scripts/bench/long_context_memory.py            # the whole table (hours on 2 cores)
python scripts/bench/long_context_memory.py --lengths 256 --n-layer 1 --steps 2   # a quick try
python scripts/bench/long_context_memory.py --models llama --lengths 2048,8192

Models: the 124 M GPT (`gpt`: 12 layers, 12 heads, 768 channels, GPT-2's 50,257-token
vocabulary) and a tiny Llama-style Hugging Face model (`llama`: 2 layers of 256 channels,
Llama 2's 32,000-token vocabulary, so the logits dominate), batch 1. Variants: the loss plain or
chunked (task.loss_chunk_tokens=--chunk), fp32 or bf16 autocast, activation checkpointing off or
`mode=full` (the GPT only). The step is the task's own (LanguageModel.step: the model's
forward, the summed loss), its backward and an AdamW step, as a run trains.

Method: each variant runs in a fresh child process (so no variant inherits another's heap), with
glibc's mmap threshold fixed at 128 KiB, so that every large tensor is its own mapping and
leaves the RSS when freed. One warm-up step (it allocates AdamW's state), then the peak RSS
(VmHWM, reset through /proc/self/clear_refs) over --steps timed steps: `step peak` is that peak
minus the RSS before them (what a step adds on top of the weights and the optimizer state: the
activations, the logits, the gradients), `process peak` the whole VmHWM. The time is the median
CPU and wall seconds per step; on a machine others share, compare the CPU seconds (the wall
time follows the neighbours' load). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from _common import load_avg, machine, table

GPT_124M = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257}
LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000}  # fmt: skip


def _kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _model(spec: dict):
    """In the child: the model of `spec` (its vocabulary too)."""
    import torch
    from omegaconf import OmegaConf

    torch.manual_seed(0)
    length = spec["tokens"]
    if spec["model"] == "gpt":
        from accel_train.models.gpt import GPT

        kw = {**GPT_124M, "n_layer": spec["n_layer"] or GPT_124M["n_layer"]}
        model, vocab = GPT(block_size=length, **kw), kw["vocab_size"]
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        from accel_train.models.hf import HFModel

        kw = {**LLAMA, "num_hidden_layers": spec["n_layer"] or LLAMA["num_hidden_layers"]}
        config = LlamaConfig(max_position_embeddings=length, attn_implementation="sdpa", **kw)
        model, vocab = HFModel(LlamaForCausalLM(config), "llama", "causal_lm"), kw["vocab_size"]
    if spec["ac"] != "off":
        from accel_train.techniques.activation_checkpointing import ActivationCheckpointing

        ctx = SimpleNamespace(
            cfg=OmegaConf.create({"trainer": {"compile": False}}),
            env=SimpleNamespace(is_main=False),
        )
        classes = ["Block"] if spec["model"] == "gpt" else None  # (one layer repeats nothing)
        model = ActivationCheckpointing(spec["ac"], classes=classes).transform(model, ctx)
    return model, vocab


def child(spec: dict) -> dict:
    """In the child: one warm-up step, then `steps` measured ones."""
    import torch

    from accel_train.tasks.language_model import LanguageModel

    model, vocab = _model(spec)
    task = LanguageModel(chunked_loss=spec["loss"] == "chunked", loss_chunk_tokens=spec["chunk"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (1, spec["tokens"]), generator=gen)
    y = torch.randint(0, vocab, (1, spec["tokens"]), generator=gen)
    bf16 = spec["precision"] == "bf16"

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, tokens = task.step(model, (x, y))
        (loss / tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss) / int(tokens)

    first = step()  # warm-up: AdamW's state
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _kib("VmRSS")
    cpu, wall = [], []
    for _ in range(spec["steps"]):
        c, w = time.process_time(), time.perf_counter()
        step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return {
        **spec,
        "first_loss": first,
        "step_peak_mib": (_kib("VmHWM") - base) / 1024,
        "process_peak_mib": _kib("VmHWM") / 1024,
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
    }


def variants(a: argparse.Namespace) -> list[dict]:
    out = []
    for model in a.models.split(","):
        for tokens in map(int, a.lengths.split(",")):
            for precision in a.precisions.split(","):
                for ac in ("off", "full") if model == "gpt" and a.ac else ("off",):
                    for loss in ("plain", "chunked"):
                        out.append({"model": model, "tokens": tokens, "precision": precision,
                                    "ac": ac, "loss": loss, "chunk": a.chunk,
                                    "n_layer": a.n_layer, "steps": a.steps})  # fmt: skip
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt,llama", help="gpt, llama or both")
    parser.add_argument("--lengths", default="2048,4096,8192", help="tokens per row")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--no-ac", dest="ac", action="store_false",
                        help="leave out the activation checkpointing rows")  # fmt: skip
    parser.add_argument("--chunk", type=int, default=1024, help="task.loss_chunk_tokens")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    parser.add_argument("--n-layer", type=int, default=0, help="0 = the model's own depth")
    parser.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    a = parser.parse_args()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    rows, results = [], {}
    started = time.perf_counter()
    for spec in variants(a):
        cmd = [sys.executable, __file__, "child", json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.exit(f"{spec}: the child failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        key = (r["model"], r["tokens"], r["precision"], r["ac"])
        results.setdefault(key, {})[r["loss"]] = r
        print(f"{json.dumps(r)}  load {load_avg()}", flush=True)
        if r["loss"] == "chunked":
            p = results[key]["plain"]
            rows.append([
                r["model"], str(r["tokens"]), r["precision"], r["ac"],
                f"{p['step_peak_mib']:,.0f}", f"{r['step_peak_mib']:,.0f}",
                f"{p['step_peak_mib'] - r['step_peak_mib']:,.0f}",
                f"{p['process_peak_mib']:,.0f}", f"{r['process_peak_mib']:,.0f}",
                f"{p['cpu_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['cpu_s'] / p['cpu_s'] - 1:+.1%}",
                f"{p['wall_s']:.2f}", f"{r['wall_s']:.2f}",
            ])  # fmt: skip
    layers = f", {a.n_layer} layers" if a.n_layer else ""
    took = time.perf_counter() - started
    print(f"\nbatch 1, chunk {a.chunk} tokens, {a.steps} measured steps a variant{layers}; "
          f"{machine()}; load after: {load_avg()}; {took:.0f} s in all")  # fmt: skip
    headers = ["model", "tokens", "precision", "AC", "step peak MiB plain", "chunked", "saved",
               "process peak MiB plain", "chunked", "CPU s/step plain", "chunked", "CPU time",
               "wall s/step plain", "chunked"]  # fmt: skip
    print(table(headers, rows))


if __name__ == "__main__":
    main()

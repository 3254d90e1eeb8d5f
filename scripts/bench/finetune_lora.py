#!/usr/bin/env python
"""LoRA fine-tuning (issue 28): accel-train against a hand-written PEFT + PyTorch loop, memory of
full fine-tuning vs LoRA vs QLoRA, and tokens/s with and without packing.

Nothing is downloaded. The script builds, in a temporary folder:
- a byte-level BPE tokenizer (4,096 ids) trained on ../shared/data/pycode/input.txt, with a
  ChatML-style chat template, and a Llama-architecture causal LM from a config, written with
  `save_pretrained` (the "pretrained" folder: its weights are random, which is all a speed and
  memory comparison needs);
- instruction records from the same text: "Complete this Python code:" + 300 characters as the
  user turn, the next 300 characters as the assistant's.

1. The race (--rounds, alternated A B / B A): `accel-train +experiment=sft_lora` against this
   script's --hand-worker: transformers' AutoModelForCausalLM + PEFT's get_peft_model, AdamW and
   a warm-up + cosine LambdaLR by hand, the same rows in the same order (accel-train's own
   dataset=sft rows and loader, so both sides take the same steps), the same validation at the
   end. Wall time launch to exit, and the final validation loss of each side.
2. Memory: peak RSS of `accel-train` training the larger model (--mem-*) for a few steps with
   every weight trained (lora.rank=0), LoRA, QLoRA (lora.base_dtype=nf4) and an int8 base.
3. Packing: real (non-padding) training tokens per second of one epoch, dataset.pack=false vs
   true.

    bash scripts/bench/top_priority.sh python scripts/bench/finetune_lora.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    DEFAULT_DATA_DIR,
    console_script,
    load_avg,
    machine,
    median,
    table,
)

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RACE_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
MEM_MODEL = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
}


def make_folder(root: Path, text: str, arch: dict, name: str) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = root / name
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text[i : i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id,
        **arch,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def make_records(text: str, path: Path, n: int, start: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            chunk = text[start + 600 * i : start + 600 * (i + 1)]
            msgs = [
                {"role": "user", "content": "Complete this Python code:\n" + chunk[:300]},
                {"role": "assistant", "content": chunk[300:]},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def accel_args(a, model: Path, train: Path, val: Path) -> list[str]:
    return [
        "+experiment=sft_lora",
        f"model.path={model}",
        f"dataset.path={train}",
        f"dataset.val_path={val}",
        f"dataset.max_length={a.max_length}",
        f"dataset.pack={str(a.pack).lower()}",
        f"lora.rank={a.rank}",
        "lora.dropout=0.0",
        f"loader.batch_size={a.batch}",
        f"trainer.max_steps={a.steps}",
        "trainer.max_epochs=100",
        f"scheduler.warmup_steps={a.warmup}",
        "trainer.val_check_interval=100000",  # validate at the end only, as the hand loop does
        "trainer.test_after_fit=false",
        "trainer.progress=none",
        "logger=none",
        "trainer.plot_curves=false",
        f"precision={a.precision}",
    ]


# A parent of its own for each run: RUSAGE_CHILDREN's ru_maxrss is the largest child a process
# has waited for, so each run's peak needs a fresh parent.
PEAK_RSS = (
    "import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
    "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
    "sys.exit(rc)"
)


def run_accel(args: list[str], run_dir: Path) -> tuple[float, float, int]:
    """(wall s, final val loss, peak RSS KiB) of one accel-train run, launch to exit."""
    cmd = [
        sys.executable,
        "-c",
        PEAK_RSS,
        console_script("accel-train"),
        *args,
        f"hydra.run.dir={run_dir}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    peak = int(proc.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0])
    val = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loss = [r["val/loss"] for r in val if "val/loss" in r][-1]
    return wall, loss, peak


def hand_worker(a: argparse.Namespace) -> None:
    """The hand-written loop: transformers + PEFT + torch, the rows and order accel-train uses."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from accel_train.data.loaders import build_loader
    from accel_train.data.text.sft import sft_splits

    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_pretrained(
        a.model, local_files_only=True, dtype=torch.float32
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        model, LoraConfig(r=a.rank, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
    )
    splits = sft_splits(
        a.train, a.model, max_length=a.max_length, pack=a.pack, val_path=a.val, seed=42
    )
    loader_cfg = _loader_cfg(a.batch)
    loader = build_loader(
        splits.train,
        loader_cfg,
        train=True,
        device=torch.device("cpu"),
        seed=42,
        rank=0,
        world=1,
        limit=0,
        num_classes=0,
        labelled=False,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.0, betas=(0.9, 0.999))

    def lr_at(step: int) -> float:
        if step < a.warmup:
            return (step + 1) / a.warmup
        progress = (step - a.warmup) / max(1, a.steps - a.warmup)
        return 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)

    def forward(x):
        if isinstance(x, dict):
            return model(**x, use_cache=False).logits
        return model(input_ids=x, use_cache=False).logits

    step, epoch = 0, 0
    while step < a.steps:
        for x, y in loader.epoch(epoch):
            logits = forward(x)
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum"
                )
                / (y != -100).sum()
            )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step >= a.steps:
                break
        epoch += 1
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(len(splits.val)):
            x, y = splits.val[i]
            x = {k: v[None] for k, v in x.items()} if isinstance(x, dict) else x[None]
            logits = forward(x)
            total += float(
                F.cross_entropy(
                    logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="sum"
                )
            )
            count += int((y != -100).sum())
    print(json.dumps({"val_loss": total / count}))


def _loader_cfg(batch: int):
    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import composed

    cfg = composed([f"loader.batch_size={batch}"])
    return OmegaConf.create(OmegaConf.to_container(cfg.loader, resolve=True))


def run_hand(a, model: Path, train: Path, val: Path) -> tuple[float, float]:
    cmd = [
        sys.executable,
        __file__,
        "--hand-worker",
        "--model",
        str(model),
        "--train",
        str(train),
        "--val",
        str(val),
        "--steps",
        str(a.steps),
        "--batch",
        str(a.batch),
        "--rank",
        str(a.rank),
        "--max-length",
        str(a.max_length),
        "--warmup",
        str(a.warmup),
    ]
    if a.pack:
        cmd.append("--pack")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])["val_loss"]


def race(a, root: Path, model: Path, train: Path, val: Path) -> None:
    rows, walls = [], {"accel": [], "hand": []}
    for r in range(a.rounds):
        order = ("accel", "hand") if r % 2 == 0 else ("hand", "accel")
        for side in order:
            if side == "accel":
                wall, loss, _ = run_accel(accel_args(a, model, train, val), root / f"race{r}")
            else:
                wall, loss = run_hand(a, model, train, val)
            walls[side].append(wall)
            rows.append([str(r + 1), side, f"{wall:.1f}", f"{loss:.4f}"])
            print(f"round {r + 1} {side}: {wall:.1f} s, val loss {loss:.4f}", flush=True)
    print(table(["round", "side", "wall s", "final val loss"], rows))
    ratio = median(walls["accel"]) / median(walls["hand"])
    print(
        f"median wall: accel {median(walls['accel']):.1f} s, hand {median(walls['hand']):.1f} s,"
        f" accel/hand {ratio:.2f}"
    )


def memory(a, root: Path, text: str, train: Path, val: Path) -> None:
    big = make_folder(root, text, MEM_MODEL, "mem-model")
    rows = []
    variants = {
        "full": ("full fine-tuning (every weight trained)", ["lora.rank=0"]),
        "lora": ("LoRA rank 16", ["lora.rank=16"]),
        "nf4": ("QLoRA rank 16 (nf4 base)", ["lora.rank=16", "lora.base_dtype=nf4"]),
        "int8": ("LoRA rank 16 on an int8 base", ["lora.rank=16", "lora.base_dtype=int8"]),
    }
    for label, extra in (variants[v] for v in a.mem_variants.split(",")):
        b = argparse.Namespace(**{**vars(a), "steps": a.mem_steps, "warmup": 0, "rank": 16})
        args = [*accel_args(b, big, train, val), *extra]
        wall, loss, peak = run_accel(args, root / f"mem-{len(rows)}")
        rows.append([label, f"{peak / 1024:.0f}", f"{wall:.1f}"])
        print(rows[-1], flush=True)
    print(table(["run", "peak RSS MiB", "wall s"], rows))


def packing(a, root: Path, model: Path, train: Path, val: Path) -> None:
    rows = []
    for pack in (False, True):
        b = argparse.Namespace(**{**vars(a), "pack": pack, "steps": 100000})
        args = [
            *accel_args(b, model, train, val),
            "trainer.max_epochs=1",
            "trainer.max_steps=-1",
            "trainer.log_every_n_steps=1000",
        ]
        run_dir = root / f"pack-{pack}"
        run_accel(args, run_dir)
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        epoch_s = [m["train/epoch_s"] for m in metrics if "train/epoch_s" in m][-1]
        tokens = _real_tokens(train, model, a.max_length)
        rows.append([f"pack={str(pack).lower()}", f"{epoch_s:.1f}", f"{tokens / epoch_s:.0f}"])
        print(rows[-1], flush=True)
    print(table(["rows", "epoch s", "real tokens/s"], rows))


def _real_tokens(train: Path, model: Path, max_length: int) -> int:
    """The training records' tokens (padding left out): the same with and without packing."""
    from accel_train.data.text.sft import sft_splits
    from accel_train.models.hf import load_tokenizer

    pad = load_tokenizer(str(model)).pad_token_id
    splits = sft_splits(str(train), str(model), max_length=max_length, val_path=str(train))
    return sum(int((x != pad).sum()) for x, _, _ in splits.train.rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--pack", action="store_true")
    p.add_argument("--precision", default="fp32")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--mem-variants", default="full,lora,nf4,int8")
    p.add_argument("--parts", default="race,memory,packing")
    p.add_argument("--hand-worker", action="store_true")
    p.add_argument("--model"), p.add_argument("--train"), p.add_argument("--val")
    a = p.parse_args()
    if a.hand_worker:
        return hand_worker(a)
    text = (Path(a.data_dir) / "pycode" / "input.txt").read_text()
    print(f"machine: {machine()}; load {load_avg()}")
    with tempfile.TemporaryDirectory(prefix="accel_ft_") as tmp:
        root = Path(tmp)
        model = make_folder(root, text, RACE_MODEL, "model")
        train = make_records(text, root / "train.jsonl", 512, 0)
        val = make_records(text, root / "val.jsonl", 64, 600 * 600)
        parts = a.parts.split(",")
        if "race" in parts:
            race(a, root, model, train, val)
        if "memory" in parts:
            memory(a, root, text, train, val)
        if "packing" in parts:
            packing(a, root, model, train, val)


if __name__ == "__main__":
    main()

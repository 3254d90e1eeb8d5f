#!/usr/bin/env python
"""Preference tuning: accel-train's task=preference against TRL 1.x (issue 40).

Both sides train the same small pretrained Llama folder (built offline by
finetune_lora.make_folder: a 4,096-id BPE tokenizer, 5.6 M parameters; its chat template ends
each turn with the EOS token, so TRL's CPO/ORPO trainers, which append EOS to an answer that
lacks it, score the same tokens as everyone else) on the same conversational preference pairs
(a prompt of code, the chosen answer its continuation, the rejected one the continuation's
lines in reverse order), fp32, no dropout, weight decay 0, a constant learning rate and no
gradient clipping.

Part `parity`: every side trains on ALL the pairs in every step (batch = the number of pairs),
so both see the same pairs in the same order whatever their samplers do, from the same weights
(full fine-tuning: DPO and IPO with a frozen reference copy, as TRL makes one), for --steps
steps. Per step: the loss and rewards/margins of each side and their largest difference. The
issue's goal: within 1e-4 for the first 20 steps.
    dpo, ipo: TRL's DPOTrainer (loss_type sigmoid / ipo)
    simpo:    TRL's CPOTrainer with loss_type="simpo", cpo_alpha=0 (trl.experimental.cpo)
    orpo:     TRL's ORPOTrainer (trl.experimental.orpo)
Part `speed`: LoRA DPO (rank 8 on every linear layer, the reference = the adapters off on both
sides), batch --batch, --speed-steps steps, launch to exit, --rounds rounds alternated.
Part `memory`: accel-train's peak RSS for LoRA DPO (adapters off as the reference) against full
DPO with a frozen copy, the same batch and steps (the process's VmHWM via /usr/bin/time's %M).

    bash scripts/bench/top_priority.sh python scripts/bench/dpo_vs_trl.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DATA_DIR, console_script, load_avg, machine, median, table  # noqa: E402
from finetune_lora import MEM_MODEL, RACE_MODEL, make_folder  # noqa: E402

# Each turn ends with the EOS token (<|im_end|>) and nothing after it.
EOS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LOSSES = {"dpo": "sigmoid", "ipo": "ipo", "simpo": "simpo", "orpo": "orpo"}
BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}


def make_pairs(text: str, path: Path, n: int, start: int, chars: int = 240) -> Path:
    with path.open("w") as f:
        for i in range(n):
            chunk = text[start + chars * i : start + chars * (i + 1)]
            cut = chars // 2
            answer = chunk[cut:]
            lines = answer.split("\n")
            rejected = "\n".join(reversed(lines)) if len(lines) > 1 else answer[::-1]
            if rejected == answer:
                rejected = answer + "\npass"
            rec = {
                "prompt": [{"role": "user", "content": "Continue this code:\n" + chunk[:cut]}],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
            f.write(json.dumps(rec) + "\n")
    return path


# ---- TRL's side ------------------------------------------------------------------------------


def trl_worker(a: argparse.Namespace) -> None:
    """TRL's side, in a process of its own (what a user writes from TRL's docs)."""
    t0 = time.perf_counter()
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    train = load_dataset("json", data_files=a.train, split="train")
    common = dict(
        output_dir=a.out,
        per_device_train_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=a.log_every,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        max_length=1024,
    )
    if a.optim == "sgd":  # (else the Trainer's default AdamW, fused as accel-train's is)
        common["optim"] = "sgd"
    peft_config = None
    if a.rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0)
        peft_config.target_modules = "all-linear"
    if a.loss in ("dpo", "ipo"):
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(loss_type=[LOSSES[a.loss]], beta=BETA[a.loss], **common)
        trainer = DPOTrainer(model=model, args=args, train_dataset=train, processing_class=tok,
                             peft_config=peft_config)  # fmt: skip
    elif a.loss == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        args = CPOConfig(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=a.gamma,
                         beta=BETA["simpo"], **common)  # fmt: skip
        trainer = CPOTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(beta=BETA["orpo"], **common)
        trainer = ORPOTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    trainer.train()
    steps = [
        {"step": h["step"], "loss": h["loss"], "margins": h.get("rewards/margins")}
        for h in trainer.state.log_history
        if "loss" in h
    ]
    print(json.dumps({"steps": steps, "wall": time.perf_counter() - t0}))


def run_trl(a, loss: str, model: Path, train: Path, steps: int, batch: int, rank: int, lr: float):
    cmd = [sys.executable, __file__, "--trl-worker", "--loss", loss, "--model", str(model)]
    cmd += ["--train", str(train), "--steps", str(steps), "--batch", str(batch)]
    cmd += ["--rank", str(rank), "--lr", str(lr), "--gamma", str(a.gamma), "--out", a.tmp + "/trl"]
    cmd += ["--optim", a.optim, "--log-every", str(1 if steps <= a.steps else 10)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


# ---- accel-train's side ----------------------------------------------------------------------


def accel_args(a, loss, model, train, val, steps, batch, rank, lr) -> list[str]:
    return [
        "+experiment=dpo_lora",
        f"model.path={model}",
        f"dataset.path={train}",
        f"dataset.val_path={val}",
        f"task.loss={loss}",
        f"task.beta={BETA[loss]}",
        f"task.gamma={a.gamma}",
        f"lora.rank={rank}",
        f"lora.alpha={2.0 * rank}",
        "lora.dropout=0.0",
        f"loader.batch_size={batch}",
        f"optimizer.lr={lr}",
        "optimizer.weight_decay=0.0",
        *(
            ["optimizer=sgd", "optimizer.momentum=0.0", "optimizer.nesterov=false"]
            if a.optim == "sgd"
            else []
        ),  # fmt: skip
        "scheduler=none",
        "scheduler.warmup_steps=0",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=100000",
        "trainer.val_check_interval=100000",
        "trainer.log_every_n_steps=1",
        "trainer.test_after_fit=false",
        "trainer.progress=none",
        "logger=none",
        "trainer.plot_curves=false",
    ]


def run_accel(args: list[str], run_dir: Path, rss: bool = False) -> tuple[float, list, float]:
    cmd = [console_script("accel-train"), *args, f"hydra.run.dir={run_dir}"]
    if rss:  # the process's peak resident set, KiB
        cmd = ["/usr/bin/time", "-f", "maxrss_kib=%M", *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [
        {"step": r["step"], "loss": r["train/loss"], "margins": r.get("train/rewards/margins")}
        for r in rows
        if "train/loss" in r
    ]
    peak = 0.0
    if rss:
        line = [x for x in proc.stderr.splitlines() if x.startswith("maxrss_kib=")][-1]
        peak = int(line.split("=")[1]) / 1024
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return wall, steps, peak


# ---- the parts -------------------------------------------------------------------------------


def parity(a, root: Path, model: Path, text: str) -> None:
    train = make_pairs(text, root / "parity.jsonl", a.pairs, 0)
    val = make_pairs(text, root / "parity_val.jsonl", 4, 240 * a.pairs)
    rows = []
    for loss in a.losses.split(","):
        _, theirs = run_trl(a, loss, model, train, a.steps, a.pairs, 0, a.lr)
        args = accel_args(a, loss, model, train, val, a.steps, a.pairs, 0, a.lr)
        _, ours, _ = run_accel(args, root / f"parity_{loss}")
        theirs = theirs["steps"]
        n = min(len(ours), len(theirs))
        dl = max(abs(o["loss"] - t["loss"]) for o, t in zip(ours[:n], theirs[:n], strict=True))
        margins = [(o["margins"], t["margins"]) for o, t in zip(ours[:n], theirs[:n], strict=True)]
        dm = max((abs(o - t) for o, t in margins if o is not None and t is not None), default=None)
        for o, t in zip(ours[:n], theirs[:n], strict=True):
            shown = f"loss {o['loss']:.6f} / {t['loss']:.6f}"
            print(f"{loss} step {o['step']}: {shown}; margins {o['margins']} / {t['margins']}")
        trainer = {"dpo": "DPOTrainer", "ipo": "DPOTrainer", "simpo": "CPOTrainer",
                   "orpo": "ORPOTrainer"}[loss]  # fmt: skip
        rows.append([loss, trainer, str(n), f"{ours[0]['loss']:.4f}", f"{ours[n - 1]['loss']:.4f}",
                     f"{dl:.1e}", "-" if dm is None else f"{dm:.1e}"])  # fmt: skip
    print(table(["loss", "TRL", "steps", "first loss", "last loss", "max |d loss|",
                 "max |d margins|"], rows))  # fmt: skip


def speed(a, root: Path, model: Path, text: str) -> None:
    train = make_pairs(text, root / "speed.jsonl", a.speed_pairs, 0)
    val = make_pairs(text, root / "speed_val.jsonl", 8, 240 * a.speed_pairs)
    walls: dict[str, list[float]] = {"accel-train": [], "TRL": []}
    last = {}
    for r in range(a.rounds):
        for side in walls if r % 2 == 0 else list(reversed(walls)):
            if side == "TRL":
                wall, res = run_trl(a, "dpo", model, train, a.speed_steps, a.batch, 8, 5e-5)
                last[side] = res["steps"][-1]["loss"]
            else:
                args = accel_args(a, "dpo", model, train, val, a.speed_steps, a.batch, 8, 5e-5)
                args[args.index("trainer.log_every_n_steps=1")] = "trainer.log_every_n_steps=10"
                wall, steps, _ = run_accel(args, root / f"speed{r}")
                last[side] = steps[-1]["loss"]
            walls[side].append(wall)
            print(f"round {r + 1} {side}: {wall:.1f} s, mean loss of the last 10 steps "
                  f"{last[side]:.4f}", flush=True)  # fmt: skip
    ratio = median(walls["TRL"]) / median(walls["accel-train"])
    rows = [[s, f"{median(w):.1f}", ", ".join(f"{x:.1f}" for x in w)] for s, w in walls.items()]
    print(table(["side", "median launch to exit (s)", "rounds"], rows))
    print(f"accel-train's speed: {ratio:.2f}x TRL's (LoRA DPO, {a.speed_steps} steps)")


def memory(a, root: Path, model: Path, text: str) -> None:
    """At finetune_lora's 111 M-parameter size, where the weights (444 MB in fp32) and the
    optimizer's state, not a tiny model's activations, set the peak."""
    model = make_folder(root, text, MEM_MODEL, "model_111m")
    _eos_template(model)
    train = make_pairs(text, root / "mem.jsonl", 64, 0)
    val = make_pairs(text, root / "mem_val.jsonl", 8, 240 * 64)
    rows = []
    for name, rank in (("LoRA DPO (adapters off)", 8), ("full DPO (frozen copy)", 0)):
        args = accel_args(a, "dpo", model, train, val, 4, a.batch, rank, 5e-5)
        _, _, peak = run_accel(args, root / f"mem{rank}", rss=True)
        rows.append([name, f"{peak:,.0f}"])
    print(table(["accel-train", "peak RSS (MiB)"], rows))


def _eos_template(folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = EOS_TEMPLATE
    tok.save_pretrained(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--parts", default="parity,speed,memory")
    p.add_argument("--losses", default="dpo,ipo,simpo,orpo")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--optim", default="adamw", help="adamw, or sgd (no momentum): parity only")
    p.add_argument("--gamma", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--speed-pairs", type=int, default=256)
    p.add_argument("--speed-steps", type=int, default=60)
    p.add_argument("--trl-worker", action="store_true")
    p.add_argument("--loss"), p.add_argument("--model"), p.add_argument("--train")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    text = (Path(a.data_dir) / "pycode" / "input.txt").read_text()
    print(f"machine: {machine()}; load {load_avg()}; fp32")
    with tempfile.TemporaryDirectory(prefix="accel_dpo_trl_") as tmp:
        a.tmp = tmp
        root = Path(tmp)
        model = make_folder(root, text, RACE_MODEL, "model")
        _eos_template(model)
        parts = a.parts.split(",")
        for name, part in (("parity", parity), ("speed", speed), ("memory", memory)):
            if name in parts:
                part(a, root, model, text)


if __name__ == "__main__":
    main()

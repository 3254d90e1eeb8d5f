#!/usr/bin/env python
"""LoRA SFT: accel-train against Hugging Face's Trainer + PEFT, launch to exit (issue 41).

Both sides fine-tune the same small pretrained Llama folder (built offline by
finetune_lora.make_folder: a 4,096-id BPE tokenizer and a 5.6 M-parameter model), on the same
instruction records rendered with its chat template, rank 8 on every linear layer (PEFT's
"all-linear"), batch 8, the same learning rate and warm-up + cosine schedule, loss on every
token, one validation at the end.

- accel-train: `+experiment=sft_lora` with those keys (its defaults otherwise: it writes its
  checkpoints, which the Trainer is not asked to).
- Trainer: this script's --trainer-worker, what a user writes from the transformers and PEFT
  docs: AutoModelForCausalLM, get_peft_model(LoraConfig(target_modules="all-linear")),
  Trainer(TrainingArguments(...)) with DataCollatorForLanguageModeling (padding to the
  longest row of each batch), then trainer.evaluate().

Part `race`: the records one to a row (dataset.pack=false), --steps steps, rounds alternated
(A B / B A); wall time launch to exit and the final validation loss of each side, and each
side's start-up phases (accel-train: from its log's timestamps; the Trainer: timed inside).
Part `rows`: long records (--long-length tokens a row), the training phase only: real
(non-padding) training tokens per second, the Trainer padding each batch against accel-train
packing rows (`dataset.pack=true`) with and without the chunked loss.

    bash scripts/bench/top_priority.sh python scripts/bench/sft_vs_trainer.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_DATA_DIR, console_script, load_avg, machine, median, table  # noqa: E402
from finetune_lora import RACE_MODEL, make_folder  # noqa: E402

LR, WARMUP = 2e-4, 10


def make_records(text: str, path: Path, n: int, start: int, chars: int, vary: bool = False) -> Path:
    """n records of `chars` characters of code each (`vary`: 20 to 100 % of it, evenly
    spread): the first 30 % the user's turn."""
    with path.open("w") as f:
        at = start
        for i in range(n):
            size = int(chars * (0.2 + 0.8 * ((i * 7) % n) / max(n - 1, 1))) if vary else chars
            chunk, at = text[at : at + size], at + size
            cut = int(0.3 * size)
            msgs = [
                {"role": "user", "content": "Complete this Python code:\n" + chunk[:cut]},
                {"role": "assistant", "content": chunk[cut:]},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


# ---- the Trainer side ------------------------------------------------------------------------


def trainer_worker(a: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    phases = {}
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
    )

    phases["imports"] = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(a.model)
    phases["tokenizer"] = time.perf_counter() - t0 - sum(phases.values())

    def rows(path: str) -> list[dict]:
        out = []
        for line in Path(path).read_text().splitlines():
            messages = json.loads(line)["messages"]
            ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            out.append({"input_ids": list(ids)[: a.max_length]})
        return out

    train, val = rows(a.train), rows(a.val)
    phases["data"] = time.perf_counter() - t0 - sum(phases.values())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    lora = LoraConfig(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0)
    lora.target_modules = "all-linear"  # PEFT's every linear layer but the output head
    model = get_peft_model(model, lora)
    phases["model"] = time.perf_counter() - t0 - sum(phases.values())
    args = TrainingArguments(
        output_dir=a.out,
        per_device_train_batch_size=a.batch,
        per_device_eval_batch_size=a.batch,
        max_steps=a.steps,
        learning_rate=LR,
        warmup_steps=WARMUP,
        lr_scheduler_type="cosine",
        weight_decay=0.0,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
        bf16=a.precision == "bf16",
    )
    collate = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = Trainer(
        model=model, args=args, train_dataset=train, eval_dataset=val, data_collator=collate
    )
    phases["trainer"] = time.perf_counter() - t0 - sum(phases.values())
    start = time.perf_counter()
    trainer.train()
    phases["train"] = time.perf_counter() - start
    real = sum(min(len(r["input_ids"]), a.max_length) for r in train)  # one epoch's tokens
    steps_per_epoch = -(-len(train) // a.batch)
    epochs = a.steps / steps_per_epoch
    val_loss = trainer.evaluate()["eval_loss"]
    phases["validate"] = time.perf_counter() - start - phases["train"]
    result = {"val_loss": val_loss, "phases": phases, "train_tokens": real * epochs}
    print(json.dumps(result))


def run_trainer(a, model: Path, train: Path, val: Path, steps: int, length: int, out: Path):
    cmd = [sys.executable, __file__, "--trainer-worker", "--model", str(model)]
    cmd += ["--train", str(train), "--val", str(val), "--steps", str(steps)]
    cmd += ["--batch", str(a.batch), "--rank", str(a.rank), "--max-length", str(length)]
    cmd += ["--precision", a.precision, "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the accel-train side --------------------------------------------------------------------


def accel_args(a, model: Path, train: Path, val: Path, steps: int, length: int) -> list[str]:
    return [
        "+experiment=sft_lora",
        f"model.path={model}",
        f"dataset.path={train}",
        f"dataset.val_path={val}",
        f"dataset.max_length={length}",
        "dataset.train_on=all",  # the Trainer's collator: loss on every token
        f"lora.rank={a.rank}",
        f"lora.alpha={2.0 * a.rank}",
        "lora.dropout=0.0",
        f"loader.batch_size={a.batch}",
        f"optimizer.lr={LR}",
        f"scheduler.warmup_steps={WARMUP}",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=1000",
        "trainer.val_check_interval=100000",  # validate at the end only, as the Trainer does
        "trainer.log_every_n_steps=10",
        "trainer.test_after_fit=false",
        "trainer.progress=none",
        "logger=none",
        "trainer.plot_curves=false",
        f"precision={a.precision}",
    ]


STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[accel_train\]\[\w+\] - (.*)$")
# The log line that ends each start-up phase (its first words), in order.
MARKS = [
    ("imports + compose", "run dir:"),
    ("tokenizer + data", "sft:"),
    ("model + adapters", "lora:"),
    ("optimizer + checks", "model hf"),
]


def accel_phases(log: str, started: float) -> dict[str, float]:
    """Start-up phases from the log's timestamps (wall clock, ms resolution)."""
    times = []
    for line in log.splitlines():
        m = STAMP.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            times.append((t, m.group(2)))
    phases, last = {}, started
    for name, mark in MARKS:
        t = next((t for t, text in times if text.startswith(mark)), None)
        if t is not None:
            phases[name], last = t - last, t
    done = next((t for t, text in times if text.startswith("done:")), None)
    if done is not None:
        phases["train + validate + save"] = done - last
    return phases


def run_accel(args: list[str], run_dir: Path) -> tuple[float, dict, dict]:
    cmd = [console_script("accel-train"), *args, f"hydra.run.dir={run_dir}"]
    started = time.time()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    phases = accel_phases(proc.stdout + proc.stderr, started)
    phases["exit"] = wall - sum(phases.values())
    real = re.search(r"(\d+) % real tokens", proc.stdout + proc.stderr)  # the sft line's share
    extra = {"_summary": summary, "_real": int(real.group(1)) / 100 if real else 1.0}
    return wall, {"val_loss": [r["val/loss"] for r in rows if "val/loss" in r][-1]}, phases | extra


# ---- the parts -------------------------------------------------------------------------------


def race(a, root: Path, model: Path, train: Path, val: Path) -> None:
    walls, rows, phases = {"accel": [], "trainer": []}, [], {"accel": [], "trainer": []}
    for r in range(a.rounds):
        for side in ("accel", "trainer") if r % 2 == 0 else ("trainer", "accel"):
            if side == "accel":
                args = accel_args(a, model, train, val, a.steps, a.max_length)
                args.append("dataset.pack=false")  # one record a row, as the Trainer's
                wall, res, ph = run_accel(args, root / f"race{r}")
                ph.pop("_summary"), ph.pop("_real")
            else:
                wall, res = run_trainer(a, model, train, val, a.steps, a.max_length, root / "hf")
                ph = res["phases"] | {"exit": wall - sum(res["phases"].values())}
            walls[side].append(wall)
            phases[side].append(ph)
            rows.append([str(r + 1), side, f"{wall:.1f}", f"{res['val_loss']:.4f}"])
            print(f"round {r + 1} {side}: {wall:.1f} s, val loss {res['val_loss']:.4f}", flush=True)
    print(table(["round", "side", "wall s", "final val loss"], rows))
    ratio = median(walls["trainer"]) / median(walls["accel"])
    print(
        f"median launch to exit: accel-train {median(walls['accel']):.1f} s, Trainer "
        f"{median(walls['trainer']):.1f} s; accel-train's speed {ratio:.2f}x the Trainer's"
    )
    for side in ("accel", "trainer"):
        names = list(phases[side][0])
        cells = [f"{name} {median([p.get(name, 0.0) for p in phases[side]]):.2f}" for name in names]
        print(f"{side} phases (median s): " + ", ".join(cells))


def long_rows(a, root: Path, model: Path, text: str) -> None:
    """Real (non-padding) training tokens per second, the training phase only, at rows of
    --long-length tokens and records of 20 to 100 % of that."""
    chars = int(a.long_length * 3.2)  # ~3.2 characters a token for this tokenizer on code
    train = make_records(text, root / "long_train.jsonl", a.long_records, 0, chars, vary=True)
    val = make_records(text, root / "long_val.jsonl", 8, chars * a.long_records, chars)
    variants = {
        "accel-train, pack": ["dataset.pack=true"],
        "accel-train, pack + chunked loss": ["dataset.pack=true", "task.chunked_loss=true"],
    }
    speeds: dict[str, list[float]] = {name: [] for name in [*variants, "Trainer, padded"]}
    for r in range(a.rounds):
        for name in speeds if r % 2 == 0 else list(reversed(speeds)):
            if name == "Trainer, padded":
                out = root / "hf_long"
                _, res = run_trainer(a, model, train, val, a.long_steps, a.long_length, out)
                speeds[name].append(res["train_tokens"] / res["phases"]["train"])
            else:
                args = accel_args(a, model, train, val, a.long_steps, a.long_length)
                _, _, ph = run_accel([*args, *variants[name]], root / f"long{r}{len(name)}")
                # the fit's tokens per second (the rows' positions) x the rows' real share
                speeds[name].append(ph["_summary"]["train_tokens_per_s"] * ph["_real"])
            print(f"round {r + 1} {name}: {speeds[name][-1]:,.0f} tokens/s", flush=True)
    base = median(speeds["Trainer, padded"])
    rows = [[n, f"{median(v):,.0f}", f"{median(v) / base:.2f}"] for n, v in speeds.items()]
    print(table(["side", "training tokens/s (median)", "vs Trainer"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--long-length", type=int, default=1024)
    p.add_argument("--long-records", type=int, default=96)
    p.add_argument("--long-steps", type=int, default=12)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--parts", default="race,rows")
    p.add_argument("--trainer-worker", action="store_true")
    p.add_argument("--model"), p.add_argument("--train"), p.add_argument("--val")
    p.add_argument("--out")
    a = p.parse_args()
    if a.trainer_worker:
        return trainer_worker(a)
    text = (Path(a.data_dir) / "pycode" / "input.txt").read_text()
    print(f"machine: {machine()}; load {load_avg()}; precision {a.precision}")
    with tempfile.TemporaryDirectory(prefix="accel_sft_trainer_") as tmp:
        root = Path(tmp)
        model = make_folder(root, text, RACE_MODEL, "model")
        train = make_records(text, root / "train.jsonl", 512, 0, 600)
        val = make_records(text, root / "val.jsonl", 64, 600 * 600, 600)
        if "race" in a.parts.split(","):
            race(a, root, model, train, val)
        if "rows" in a.parts.split(","):
            long_rows(a, root, model, text)


if __name__ == "__main__":
    main()

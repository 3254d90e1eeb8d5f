#!/usr/bin/env python
"""GRPO (issue 50): accel-train's task=grpo against TRL 1.16's GRPOTrainer (use_vllm=False).

Both sides train the same small pretrained Llama folder (built offline by
finetune_lora.make_folder: a 4,096-id BPE tokenizer with a ChatML template, 5.6 M parameters)
with LoRA (rank 8 on every linear layer, no dropout) on the same conversational prompts ("Continue
this code:" + 200 characters of ../shared/data/pycode) scored by the same reward
(_grpo_reward.lines), fp32, the same number of optimizer steps, prompts per step,
num_generations, max_completion_length, temperature 1, top_p 1, beta 0, loss_type dapo,
num_iterations 1, a constant learning rate, gradient clipping at 1.0, no validation, no
checkpoint.

Part `speed`: launch to exit of each side, --rounds rounds alternated (A B, B A, ...), medians.
Generation is timed separately on both sides the same way: each process wraps transformers'
`GenerationMixin.generate` (which both tools call, TRL through PEFT's wrapper, accel-train
through HFModel.generate_ids) with a timer and reports the sum; "train" is the rest of the
training call (scoring, log-probs, the loss, backward, the optimizer; accel-train's: its epochs'
train/epoch_s), "start + exit" the rest of launch to exit (accel-train's includes one final
validation batch of prompts, which it cannot skip; TRL's runs none). Mean completion lengths
are printed too: both sides must generate about the same number of tokens for the comparison to
hold (a random model rarely stops early).
The issue's goal: accel-train at least 1.3x faster launch to exit.
Part `memory`: accel-train's peak RSS (the process's VmHWM, /usr/bin/time's %M) for LoRA GRPO
(beta > 0: the reference is the adapters off) against full GRPO with a frozen reference copy
(lora.rank=0, the same beta), the same batch and steps, at finetune_lora's 111 M-parameter size
(--mem-arch tiny: the race's model, for a smoke run).

    bash scripts/bench/top_priority.sh python scripts/bench/grpo.py --rounds 3
    python scripts/bench/grpo.py --rounds 1 --steps 2 --prompts 2 --num-generations 2 \\
        --max-completion-length 8 --mem-arch tiny --mem-steps 1   # a smoke run, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import DEFAULT_DATA_DIR, console_script, load_avg, machine, median, table  # noqa: E402
from finetune_lora import MEM_MODEL, RACE_MODEL, make_folder  # noqa: E402

# Run in each side's process before the tool starts: the seconds of each call of transformers'
# generate (re-entrant calls counted once), written to $GRPO_BENCH_TIMES at exit.
GENERATE_TIMER = """
import atexit, json, os, time
from transformers.generation.utils import GenerationMixin
_calls, _depth, _generate = [], [0], GenerationMixin.generate
def _timed(self, *args, **kwargs):
    _depth[0] += 1
    t0 = time.perf_counter()
    try:
        return _generate(self, *args, **kwargs)
    finally:
        _depth[0] -= 1
        if _depth[0] == 0:
            _calls.append(time.perf_counter() - t0)
GenerationMixin.generate = _timed
atexit.register(lambda: open(os.environ["GRPO_BENCH_TIMES"], "w").write(json.dumps(_calls)))
"""
# accel-train's console script, after the timer (sys.argv: the overrides).
ACCEL_MAIN = (
    "import sys; from accel_train.cli import main; sys.argv[0] = 'accel-train'; sys.exit(main())"
)


def make_prompts(text: str, path: Path, n: int, chars: int = 200) -> Path:
    with path.open("w") as f:
        for i in range(n):
            chunk = text[chars * i : chars * (i + 1)]
            msgs = [{"role": "user", "content": "Continue this code:\n" + chunk}]
            f.write(json.dumps({"prompt": msgs}) + "\n")
    return path


def _env(times: Path) -> dict[str, str]:
    env = dict(os.environ, GRPO_BENCH_TIMES=str(times))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


# ---- TRL's side ------------------------------------------------------------------------------


def trl_worker(a: argparse.Namespace) -> None:
    """TRL's side, in a process of its own (what a user writes from TRL's GRPO docs)."""
    t0 = time.perf_counter()
    exec(GENERATE_TIMER, {})
    import torch
    from _grpo_reward import lines
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    train = load_dataset("json", data_files=a.train, split="train")
    args = GRPOConfig(
        output_dir=a.out,
        per_device_train_batch_size=a.prompts * a.num_generations,  # completions per step
        num_generations=a.num_generations,
        max_completion_length=a.max_completion_length,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        max_steps=a.steps,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        use_vllm=False,
        dataloader_num_workers=0,
        seed=0,
        log_completions=False,
    )
    peft = LoraConfig(
        r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, target_modules="all-linear"
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[lines], args=args, train_dataset=train,
                          processing_class=tok, peft_config=peft)  # fmt: skip
    t1 = time.perf_counter()
    trainer.train()
    t2 = time.perf_counter()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    length = [h["completions/mean_length"] for h in logs if "completions/mean_length" in h]
    print(json.dumps({"train_s": t2 - t1, "before_s": t1 - t0, "mean_length": length,
                      "reward": [h["reward"] for h in logs]}))  # fmt: skip


def run_trl(a, root: Path, model: Path, train: Path, r: int) -> dict:
    times = root / f"trl_times{r}.json"
    cmd = [sys.executable, __file__, "--trl-worker", "--model", str(model), "--train", str(train)]
    cmd += ["--out", str(root / "trl"), "--steps", str(a.steps), "--prompts", str(a.prompts)]
    cmd += ["--num-generations", str(a.num_generations), "--rank", str(a.rank), "--lr", str(a.lr)]
    cmd += ["--max-completion-length", str(a.max_completion_length)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(times))
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    calls = json.loads(times.read_text())
    return {"wall": wall, "generate": sum(calls), "train": res["train_s"] - sum(calls),
            "calls": len(calls), "length": median(res["mean_length"])}  # fmt: skip


# ---- accel-train's side ----------------------------------------------------------------------


def accel_args(a, model: Path, train: Path, steps: int, rank: int, beta: float) -> list[str]:
    return [
        "+experiment=grpo_lora",
        f"model.path={model}",
        f"dataset.path={train}",
        "dataset.val_fraction=0.01",  # (a hold-out is required: one batch of it is scored
        "trainer.limit_val_batches=1",  # at the end, counted in accel-train's "start + exit")
        "task.rewards=[{_target_: _grpo_reward.lines}]",
        f"task.num_generations={a.num_generations}",
        f"task.max_completion_length={a.max_completion_length}",
        "task.temperature=1.0",
        "task.top_p=1.0",
        f"task.beta={beta}",
        "task.loss_type=dapo",
        "task.num_iterations=1",
        "task.log_completions=false",
        f"lora.rank={rank}",
        f"lora.alpha={2.0 * max(rank, 1)}",
        "lora.dropout=0.0",
        f"loader.batch_size={a.prompts}",
        f"optimizer.lr={a.lr}",
        "optimizer.weight_decay=0.0",
        "scheduler=none",
        "scheduler.warmup_steps=0",
        "trainer.gradient_clip_val=1.0",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=100000",
        "trainer.val_check_interval=100000",
        "trainer.log_every_n_steps=1",
        "trainer.test_after_fit=false",
        "trainer.progress=none",
        "logger=none",
        "trainer.plot_curves=false",
    ]


def run_accel(args: list[str], run_dir: Path, steps: int, rss: bool = False) -> dict:
    times = run_dir.parent / f"{run_dir.name}_times.json"
    cmd = [sys.executable, "-c", GENERATE_TIMER + ACCEL_MAIN, *args, f"hydra.run.dir={run_dir}"]
    if rss:  # the process's peak resident set, KiB (the accel-train console script: no timer)
        cmd = ["/usr/bin/time", "-f", "maxrss_kib=%M", console_script("accel-train"), *args,
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(times))
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {"wall": wall, "rows": rows}
    out["length"] = median([r["train/completions/mean_length"] for r in rows
                            if "train/completions/mean_length" in r])  # fmt: skip
    train_s = [r["train/epoch_s"] for r in rows if "train/epoch_s" in r]
    if not rss:  # one generate call a training step, then the final validation's
        calls = json.loads(times.read_text())[:steps]
        out.update(generate=sum(calls), calls=len(calls), train=sum(train_s) - sum(calls))
    else:
        line = [x for x in proc.stderr.splitlines() if x.startswith("maxrss_kib=")][-1]
        out["peak_mib"] = int(line.split("=")[1]) / 1024
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return out


# ---- the parts -------------------------------------------------------------------------------


def speed(a, root: Path, model: Path, text: str) -> None:
    train = make_prompts(text, root / "prompts.jsonl", a.num_prompts)
    got: dict[str, list[dict]] = {"accel-train": [], "TRL": []}
    for r in range(a.rounds):
        for side in got if r % 2 == 0 else list(reversed(got)):
            if side == "TRL":
                res = run_trl(a, root, model, train, r)
            else:
                args = accel_args(a, model, train, a.steps, a.rank, 0.0)
                res = run_accel(args, root / f"speed{r}", a.steps)
            got[side].append(res)
            print(f"round {r + 1} {side}: {res['wall']:.1f} s launch to exit, generate "
                  f"{res['generate']:.1f} s ({res['calls']} calls), train {res['train']:.1f} s, "
                  f"mean completion length {res['length']:.1f}", flush=True)  # fmt: skip
    rows = []
    for side, runs in got.items():
        wall, gen, train = (median([x[k] for x in runs]) for k in ("wall", "generate", "train"))
        rows.append([side, f"{wall:.1f}", f"{gen:.1f}", f"{train:.1f}",
                     f"{wall - gen - train:.1f}", f"{median([x['length'] for x in runs]):.1f}",
                     ", ".join(f"{x['wall']:.1f}" for x in runs)])  # fmt: skip
    print(table(["side", "launch to exit (s)", "generate (s)", "train (s)", "start + exit (s)",
                 "mean completion tokens", "rounds (s)"], rows))  # fmt: skip
    ratio = median([x["wall"] for x in got["TRL"]]) / median(
        [x["wall"] for x in got["accel-train"]]
    )
    gen = median([x["generate"] for x in got["TRL"]]) / median(
        [x["generate"] for x in got["accel-train"]]
    )
    print(f"accel-train's speed: {ratio:.2f}x TRL's launch to exit ({gen:.2f}x in generation); "
          f"LoRA GRPO, {a.steps} steps of {a.prompts} prompts x {a.num_generations} "
          f"completions of <= {a.max_completion_length} tokens")  # fmt: skip


def memory(a, root: Path, text: str) -> None:
    """Where the weights and the optimizer's state, not a tiny model's activations, set the
    peak (the default 111 M parameters, 444 MB in fp32)."""
    arch = RACE_MODEL if a.mem_arch == "tiny" else MEM_MODEL
    model = make_folder(root, text, arch, f"model_{a.mem_arch}")
    train = make_prompts(text, root / "mem.jsonl", 64)
    rows = []
    variants = (("LoRA GRPO (reference: the adapters off)", a.rank),
                ("full GRPO (a frozen reference copy)", 0))  # fmt: skip
    for name, rank in variants:
        args = accel_args(a, model, train, a.mem_steps, rank, a.mem_beta)
        res = run_accel(args, root / f"mem{rank}", a.mem_steps, rss=True)
        rows.append([name, f"{res['peak_mib']:,.0f}", f"{res['wall']:.1f}"])
    print(table(["accel-train, beta=" + str(a.mem_beta), "peak RSS (MiB)", "wall (s)"], rows))
    lora, full = (float(r[1].replace(",", "")) for r in rows)
    print(f"LoRA / full: {lora / full:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--parts", default="speed,memory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps of every run")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256, help="prompts in the file")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--mem-arch", default="111m", help="111m (finetune_lora's) or tiny")
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--mem-beta", type=float, default=0.04, help="DeepSeekMath's KL weight")
    p.add_argument("--trl-worker", action="store_true")
    p.add_argument("--model"), p.add_argument("--train"), p.add_argument("--out")
    a = p.parse_args()
    if a.trl_worker:
        return trl_worker(a)
    text = (Path(a.data_dir) / "pycode" / "input.txt").read_text()
    print(f"machine: {machine()}; load {load_avg()}; fp32")
    with tempfile.TemporaryDirectory(prefix="accel_grpo_") as tmp:
        root = Path(tmp)
        parts = a.parts.split(",")
        if "speed" in parts:
            speed(a, root, make_folder(root, text, RACE_MODEL, "model"), text)
        if "memory" in parts:
            memory(a, root, text)


if __name__ == "__main__":
    main()

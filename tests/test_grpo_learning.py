"""task=grpo end to end through the real CLI (issue 50): a tiny model learns a rule from reward
alone, and the `+experiment=grpo_lora` recipe's own command trains, resumes, logs its sampled
completions with their rewards, exports and evaluates.

The learning problem: "answer with the digit that the prompt's last word names" ("two seven" ->
"7"), prompts of 1 to 3 number words, a 1-layer Llama of width 32 over a 22-word vocabulary
(tests/grpo_fixtures.py), and a reward function of the test's own (a module on PYTHONPATH, by
`_target_`, reading the records' `answer` column by name: how a user's reward works). The
untrained model names the right digit about one time in 20; GRPO with 8 completions per prompt
gets it right more than 8 times in 10 within 120 steps (~2 s of CPU), and the run stopped at
step 60 (mid-epoch: 31 steps an epoch) and resumed ends with the same weights, having sampled
the same completions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from grpo_fixtures import (
    REWARD_MODULE,
    docs_reward_module,
    user_code,
    write_digit_prompts,
    write_word_model,
)
from helpers import assert_same_weights, check_ok, read_jsonl

LEARN = [
    "model=hf",
    "task=grpo",
    "dataset=prompts",
    "task.rewards=[{_target_: digit_rewards.names_the_digit}]",
    "task.num_generations=8",
    "task.max_completion_length=2",  # the digit, then <eos> (only the first word counts)
    "lora.rank=0",  # every weight trained: a model this small learns fast in full
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "optimizer.weight_decay=0.0",
    "scheduler=none",  # a constant rate: the first half of the resumed run trains as the whole
    "loader.batch_size=8",  # prompts per step: 64 completions
    "trainer.max_steps=120",
    "trainer.max_epochs=100",
    "trainer.log_every_n_steps=1",
    "trainer.progress=none",
    "logger=none",
]


def _metric(run: Path, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in read_jsonl(run / "metrics.jsonl") if key in m}


def test_grpo_learns_a_rule_from_reward_alone_and_resumes_exactly(tmp_path, run_cli):
    model = write_word_model(tmp_path / "model")
    prompts = write_digit_prompts(tmp_path / "prompts.jsonl", 256)
    env = user_code(tmp_path / "user_code", {"digit_rewards.py": REWARD_MODULE})
    base = [*LEARN, f"model.path={model}", f"dataset.path={prompts}"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    check_ok(run_cli([*base, f"hydra.run.dir={whole}"], env=env))

    reward = _metric(whole, "train/reward")
    assert sorted(reward) == list(range(1, 121))
    untrained = sum(reward[s] for s in range(1, 6)) / 5  # (the model hardly moves in 5 steps)
    learnt = sum(reward[s] for s in range(111, 121)) / 10
    assert untrained < 0.25, reward  # chance: 1 word in 22 (a digit first: 1 in 10 of those)
    assert learnt >= 0.8, reward
    # held out: the 5 % of prompts the run validates on, sampled at the end
    val = _metric(whole, "val/reward")
    assert val[120] >= 0.8 and val[120] > val[min(val)], val
    # the reward's own metric, in TRL's name
    assert _metric(whole, "train/rewards/names_the_digit/mean") == reward

    first = ["trainer.max_steps=60", "trainer.ckpt_every_n_steps=60"]
    check_ok(run_cli([*base, *first, f"hydra.run.dir={resumed}"], env=env))
    check_ok(run_cli([*base, "resume=auto", f"hydra.run.dir={resumed}"], env=env))
    assert_same_weights(resumed / "checkpoints" / "last.pt", whole / "checkpoints" / "last.pt")
    for key in ("train/reward", "train/completions/mean_length", "train/loss"):
        assert _metric(resumed, key) == _metric(whole, key), key  # the same completions sampled
    # the last validation samples the held-out prompts' completions alike in either process
    assert _metric(resumed, "val/reward")[120] == val[120]


# ---- the recipe's own command ------------------------------------------------------------

# What a reader appends to try the recipe on a laptop: 2 prompts a step, 8 completions of at
# most 4 tokens each, 3 steps, every step logged (the TensorBoard table of completions too).
# (8 completions: the untrained model's last digit is the answer about 1 time in 10, so some
# group's rewards differ, its advantages are not 0, and the adapters move.)
SHRUNK = [
    "task.num_generations=8",
    "task.max_completion_length=4",
    "loader.batch_size=2",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.progress=none",
    "logger=tensorboard",
    "optimizer.lr=0.01",  # (the adapters move enough in 3 steps to be seen in the export)
]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, run_cli_in):
    """`accel-train +experiment=grpo_lora model.path=DIR dataset.path=prompts.jsonl
    'task.rewards=[{_target_: my.rewards.correct}]'` on the digit rule's tiny Llama, shrunk: the
    whole run, and the same run stopped after step 2 and resumed."""
    root = tmp_path_factory.mktemp("grpo-recipe")
    model = write_word_model(root / "models" / "tiny-llama")
    env = user_code(root / "user_code", {"my/rewards.py": docs_reward_module()})  # the page's
    write_digit_prompts(root / "prompts.jsonl", 24)
    command = ["+experiment=grpo_lora", f"model.path={model}", "dataset.path=prompts.jsonl",
               "task.rewards=[{_target_: my.rewards.correct}]"]  # fmt: skip
    runs = {"whole": root / "whole", "resumed": root / "resumed"}
    procs = {"whole": run_cli_in([*command, *SHRUNK, f"hydra.run.dir={runs['whole']}"], root,
                                 env=env)}  # fmt: skip
    part = [*command, *SHRUNK, f"hydra.run.dir={runs['resumed']}"]
    procs["part"] = run_cli_in([*part, "trainer.max_steps=2", "trainer.ckpt_every_n_steps=2"],
                               root, env=env)  # fmt: skip
    procs["resumed"] = run_cli_in([*part, "resume=auto"], root, env=env)
    return root, runs, procs, env


def test_the_recipe_trains_resumes_and_logs_completions_with_rewards(recipe):
    root, runs, procs, _ = recipe
    for proc in procs.values():
        check_ok(proc)
    said = procs["whole"].stdout + procs["whole"].stderr
    assert "task=grpo: 8 completions per prompt, loss_type=dapo" in said
    rows = [m for m in read_jsonl(runs["whole"] / "metrics.jsonl") if "train/reward" in m]
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:  # TRL's names
        assert {"train/rewards/correct/mean", "train/completions/mean_length", "train/entropy",
                "train/clip_ratio/region_mean", "train/frac_reward_zero_std"} <= set(m)  # fmt: skip
        assert 0.0 <= m["train/reward"] <= 1.0
    assert_same_weights(
        runs["resumed"] / "checkpoints" / "last.pt", runs["whole"] / "checkpoints" / "last.pt"
    )
    # the LoRA recipe's checkpoint: the adapters, not the base (read again from model.path)
    weights = torch.load(runs["whole"] / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert weights and all("lora_" in k for k in weights), sorted(weights)[:4]

    # the completions table, with each reward function's column, at every logging step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs["whole"] / "tensorboard")).Reload()
    tags = [t for t in events.Tags()["tensors"] if t.startswith("completions")]
    assert tags, events.Tags()
    logged = events.Tensors(tags[0])
    assert [e.step for e in logged] == [1, 2, 3]
    text = logged[-1].tensor_proto.string_val[0].decode()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()]
    assert cells[0] == ["step", "prompt", "completion", "correct", "advantage"], text
    prompts = {r["prompt"] for r in read_jsonl(root / "prompts.jsonl")}
    for row in cells[2:]:
        assert row[0] == "3" and row[1] in prompts and row[3] in ("0.0", "1.0"), text


def test_the_recipe_exports_and_evaluates(recipe, run_cli_in):
    root, runs, _, env = recipe
    last = runs["whole"] / "checkpoints" / "last.pt"
    out = root / "exported"
    check_ok(run_cli_in([f"ckpt_path={last}", "format=hf", f"out_path={out}"], root,
                        prog="accel-export", env=env))  # fmt: skip
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    base = AutoModelForCausalLM.from_pretrained(root / "models" / "tiny-llama").state_dict()
    assert exported.keys() == base.keys()  # merged: no adapter left
    assert any(not torch.equal(exported[k], base[k]) for k in base)  # ... and trained

    # accel-eval on the result: the held-out prompts' completions, sampled and rewarded
    # (sampled with the same seed as the run's last validation: the same reward)
    result = root / "eval.json"
    proc = run_cli_in([f"ckpt_path={last}", "split=val", f"out_path={result}"], root,
                      prog="accel-eval", env=env)  # fmt: skip
    check_ok(proc)
    scored = json.loads(result.read_text())
    final = json.loads((runs["whole"] / "summary.json").read_text())["final_val_reward"]
    assert scored["split"] == "val" and scored["val/reward"] == pytest.approx(final, abs=1e-6)

"""task=grpo, dataset=prompts and the reward functions: parity with TRL 1.16's GRPOTrainer (the
same tiny model, prompts, completions and rewards fed to both: advantages, per-token log-probs
and losses, the loss and every gradient within 1e-5 in fp32, for each loss type, sequence-level
importance sampling and a KL to the reference); then the real CLI: LoRA GRPO of a tiny Llama
logs TRL's metrics and the completions table, and a run resumed mid-epoch (num_iterations=2
with gradient accumulation, stopped inside a window) ends with the same weights as one that was
never stopped; and the refusals and reward-function errors, one paragraph each."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_same_weights, check_ok, read_jsonl
from hf_fixtures import write_tiny_llama

from accel_train.data.text.prompts import prompt_splits
from accel_train.errors import UserError
from accel_train.rewards import build_rewards
from accel_train.tasks import grpo_loss as L
from accel_train.tasks.grpo import GRPO

G, C = 4, 6  # completions per prompt, max completion tokens
DIGITS = ["zero", "one", "two", "three"]


def _records(n: int) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"Say {i % 4}."}], "answer": str(i % 4)}
        for i in range(n)
    ]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


REWARDS = [
    {"_target_": "accel_train.rewards.exact_match", "pattern": r"(\d)"},
    {"_target_": "accel_train.rewards.length_penalty", "max_tokens": 3, "weight": 0.5},
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("grpo") / "llama")


# ---- parity with TRL ------------------------------------------------------------------------


def _completions(tok, n: int) -> torch.Tensor:
    """(n, C) fixed 'sampled' completions: random tokens, some with an EOS early (cut there),
    some with digits (so exact_match rewards differ inside a group)."""
    g = torch.Generator().manual_seed(3)
    out = torch.randint(3, len(tok), (n, C), generator=g)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(4)]
    for i in range(n):
        out[i, i % C] = digits[i % 4] if i % 3 else digits[(i + 1) % 4]
        if i % 2:
            out[i, (i % (C - 1)) + 1] = tok.eos_token_id
    out[out == tok.pad_token_id] = 3
    return out


def _trl(folder: Path, out_dir: Path, rewards, records, done, cfg: dict):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=len(done), num_generations=G,
        max_completion_length=C, report_to=[], use_cpu=True, bf16=False,
        reward_weights=[r.weight for r in rewards], **cfg,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[r.fn for r in rewards], args=args,
        train_dataset=Dataset.from_list(records),
        processing_class=AutoTokenizer.from_pretrained(folder),
    )  # fmt: skip
    tok, eos = trainer.processing_class, trainer.processing_class.eos_token_id
    cut = [row[: (row == eos).nonzero()[0, 0] + 1 if (row == eos).any() else C].tolist()
           for row in done]  # fmt: skip
    trainer._generate_single_turn = lambda *a, **k: (cut, None)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    inputs = [r for r in records for _ in range(G)]
    return trainer, trainer._generate_and_score_completions(inputs), tok


def _ours(folder: Path, rewards_cfg, batch, done, tok, cfg: dict):
    from accel_train.models.hf import hf_model

    model = hf_model(path=str(folder))
    task = GRPO(num_generations=G, max_completion_length=C, rewards=rewards_cfg, **cfg)
    task.tok, task.eos, task.pad = tok, tok.eos_token_id, tok.pad_token_id
    if task.beta:
        task.ref_model = copy.deepcopy(model).requires_grad_(False)
    task._sample = lambda *a: done
    model.train()
    return model, task, task._rollout_for(model, task.prepare(batch, train=True))


CASES = [
    {"loss_type": "grpo"},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo"},
    {"loss_type": "bnpo", "scale_rewards": "batch"},
    {"loss_type": "dapo", "importance_sampling_level": "sequence", "scale_rewards": "none"},
    {"loss_type": "grpo", "beta": 0.1, "epsilon_high": 0.28},
    {"loss_type": "dapo", "beta": 0.1, "chunked_loss": True, "loss_chunk_tokens": 5},
]
OURS_ONLY = ("chunked_loss", "loss_chunk_tokens")


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_parity_with_trl(cfg, llama, tmp_path):
    records = _records(2)
    splits = prompt_splits(str(_write(tmp_path / "p.jsonl", records * 2)), str(llama),
                           val_path=str(_write(tmp_path / "v.jsonl", records)))  # fmt: skip
    rewards = build_rewards(REWARDS)
    trl_cfg = {**{k: v for k, v in cfg.items() if k not in OURS_ONLY}, "temperature": 0.7}
    batch = splits.val.collate([splits.val[i] for i in range(2)])
    done = _completions(splits_tok := _tok(llama), 2 * G)
    trainer, theirs, _ = _trl(llama, tmp_path / "trl", rewards, records, done, trl_cfg)
    model, task, roll = _ours(llama, REWARDS, batch, done, splits_tok, {**cfg, "temperature": 0.7})

    # the same rows, masks, rewards and advantages
    assert torch.equal(theirs["prompt_ids"], batch["input_ids"].repeat_interleave(G, 0))
    width = theirs["completion_mask"].shape[1]
    torch.testing.assert_close(roll["mask"][:, :width], theirs["completion_mask"].float())
    assert roll["mask"][:, width:].sum() == 0
    torch.testing.assert_close(roll["adv"], theirs["advantages"], atol=1e-5, rtol=1e-5)
    assert roll["adv"].abs().sum() > 0  # the rewards differ inside the groups

    # the same small step taken on both policies (so the KL to the reference is not 0), and
    # off-policy old log-probs (num_iterations > 1's): the ratios clip; the same for both
    g = torch.Generator().manual_seed(7)
    trl_params = dict(trainer.model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            step = torch.randn(p.shape, generator=g) * 0.02
            p.add_(step), trl_params[name.removeprefix("hf.")].add_(step)
        logps = task._logps(model, roll)[0]
    noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(5)) * 0.3
    roll["old"] = logps + noise
    theirs["old_per_token_logps"] = (logps + noise)[:, :width]

    ids = torch.cat([theirs["prompt_ids"], theirs["completion_ids"]], 1)
    mask = torch.cat([theirs["prompt_mask"], theirs["completion_mask"]], 1)
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)[0]
    m = theirs["completion_mask"].bool()
    torch.testing.assert_close(logps[:, :width][m], trl_logps[m], atol=1e-5, rtol=1e-5)
    if cfg.get("beta"):
        torch.testing.assert_close(roll["ref"][:, :width][m], theirs["ref_per_token_logps"][m],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip

    # the loss (its per-token terms reduced four ways), and every gradient
    out = task._loss(model, roll, task.train_metrics, train=True)
    ours = out[0] / out[1] if isinstance(out, tuple) else out
    theirs_loss = trainer._compute_loss(trainer.model, theirs)
    torch.testing.assert_close(ours, theirs_loss, atol=1e-5, rtol=1e-5)
    ours.backward()
    theirs_loss.backward()
    clipped = task.train_metrics.sums["clip_ratio/region_mean"]
    assert clipped > 0 or cfg.get("importance_sampling_level") == "sequence"
    if cfg.get("beta"):
        assert task.train_metrics.sums["kl"] > 0
    compared = 0
    for name, p in model.named_parameters():
        q = trl_params[name.removeprefix("hf.")]
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
        compared += 1
    assert compared == len(trl_params)


def _tok(folder: Path):
    from accel_train.models.hf import load_tokenizer

    return load_tokenizer(str(folder))


def test_advantages_and_reduce_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, float("nan"), 2.0])
    adv, zero = L.advantages(rewards, 3, "group")
    group = torch.tensor([1.0, 0.0, 1.0])
    want = (group - group.mean()) / (group.std() + 1e-4)
    torch.testing.assert_close(adv[:3], want)
    assert adv[4] == 0 and not zero.any()  # a reward no function gave: no advantage
    adv, _ = L.advantages(rewards, 3, "none")
    torch.testing.assert_close(adv[3:], torch.tensor([-0.5, 0.0, 0.5]))
    per_token = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert L.reduce("grpo", per_token, mask, 4)[0] == pytest.approx((1.5 + 3) / 2)
    assert L.reduce("bnpo", per_token, mask, 4)[0] == pytest.approx(6 / 3)
    assert L.reduce("dr_grpo", per_token, mask, 4)[0] == pytest.approx(6 / 8)
    total, items = L.reduce("dapo", per_token, mask, 4)
    assert (total.item(), items.item()) == (6.0, 3.0)


# ---- through the CLI ---------------------------------------------------------------------

RUN = [
    "task=grpo",
    "dataset=prompts",
    "model=hf",
    "lora.rank=4",
    "lora.dropout=0.0",
    f"task.num_generations={G}",
    f"task.max_completion_length={C}",
    "optimizer.lr=0.01",
    "scheduler=none",
    "loader.batch_size=2",
    "trainer.max_steps=6",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=3",
    "trainer.progress=none",
]
TRL_METRICS = [
    "reward", "reward_std", "rewards/exact_match/mean", "rewards/exact_match/std",
    "rewards/length_penalty/mean", "rewards/format_match/mean", "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
]  # fmt: skip


def _rewards_arg(extra: str = "") -> str:
    return (
        "task.rewards=[{_target_: accel_train.rewards.exact_match, pattern: '(\\d)'}, "
        "{_target_: accel_train.rewards.format_match, pattern: '[a-m]', full: false}, "
        f"{{_target_: accel_train.rewards.length_penalty, max_tokens: 3, weight: 0.5}}{extra}]"
    )


def test_lora_grpo_logs_trl_metrics_and_completions_then_resumes_exactly(llama, tmp_path, run_cli):
    """num_iterations=2 with 2 micro-batches a step: the uninterrupted run logs TRL's metrics
    and the completions table; one stopped after step 3, inside a window (step 3 sampled, step
    4 trains again on what it kept), and resumed is the same run."""
    data = _write(tmp_path / "prompts.jsonl", _records(16))
    mu = [*RUN, f"model.path={llama}", f"dataset.path={data}", _rewards_arg(),
          "task.num_iterations=2", "trainer.accumulate_grad_batches=2",
          "logger=tensorboard"]  # fmt: skip
    runs = {k: tmp_path / k for k in ("whole", "resumed")}
    check_ok(run_cli([*mu, f"hydra.run.dir={runs['whole']}"]))
    rows = read_jsonl(runs["whole"] / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for name in TRL_METRICS:  # the sampling's metrics at the steps that sample (each other)
        every = train if name.startswith(("entropy", "clip_ratio")) else train[::2]
        assert all(f"train/{name}" in r for r in every), name
    assert all(-1.5 <= r["train/reward"] <= 2 for r in train[::2])
    assert any(r["train/frac_reward_zero_std"] < 1 for r in train[::2])  # something to learn
    assert any(r["train/grad_norm"] > 0 for r in train)
    # the window's second pass trains on the kept completions with their old log-probs: the
    # ratios move off 1 and some clip; the first pass is on-policy (ratio exactly 1)
    clip = [r["train/clip_ratio/region_mean"] for r in train]
    assert clip[0] == 0 and clip[1] > 0
    val = [r for r in rows if "val/reward" in r]
    assert [r["step"] for r in val] == [3, 6]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs["whole"] / "tensorboard")).Reload()
    assert any(t.startswith("completions") for t in events.Tags()["tensors"])

    # completions.jsonl: every sampling step's rows, each reward and the advantage
    table = read_jsonl(runs["whole"] / "completions.jsonl")
    assert sorted({r["step"] for r in table}) == [1, 3, 5]
    assert set(table[0]) == {"step", "prompt", "completion", "exact_match", "format_match",
                             "length_penalty", "advantage"}  # fmt: skip

    check_ok(run_cli([*mu, "trainer.max_steps=3", "trainer.ckpt_every_n_steps=3",
                      f"hydra.run.dir={runs['resumed']}"]))  # fmt: skip
    # as if the first part had gone on past its checkpoint and been killed: the resume drops
    # the rows after step 3 (they are sampled again)
    with (runs["resumed"] / "completions.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in table if r["step"] > 3)
    check_ok(run_cli([*mu, "resume=auto", f"hydra.run.dir={runs['resumed']}"]))
    assert read_jsonl(runs["resumed"] / "completions.jsonl") == table  # the same completions
    losses = {k: {r["step"]: r["train/loss"] for r in read_jsonl(v / "metrics.jsonl")
                  if "train/loss" in r} for k, v in runs.items()}  # fmt: skip
    assert losses["resumed"] == losses["whole"] and len(losses["whole"]) == 6
    rewards = {k: [r["val/reward"] for r in read_jsonl(v / "metrics.jsonl") if "val/reward" in r]
               for k, v in runs.items()}  # fmt: skip
    assert rewards["resumed"] == rewards["whole"]  # (the first part validated at step 3 too)
    ckpt = "checkpoints/last.pt"
    assert_same_weights(runs["whole"] / ckpt, runs["resumed"] / ckpt)


# ---- refusals and reward-function errors, one paragraph each -------------------------------


CLI_REFUSED = [
    (["strategy=pipeline", "lora.rank=0"], ["task=grpo with strategy=pipeline", "strategy=ddp"]),
    (["task.generation=vllm"], ["task.generation=vllm is not implemented"]),
    (["model=mlp"], ["task=grpo with model=mlp", "no generate_ids method"]),
    (["task.rewards=[{_target_: nowhere.rewards.correct}]"],
     ["task.rewards[0]._target_=nowhere.rewards.correct: there is no module nowhere"]),
]  # fmt: skip


@pytest.mark.parametrize(("args", "needles"), CLI_REFUSED, ids=lambda a: str(a)[:30])
def test_combinations_that_cannot_work_are_refused(args, needles, llama, tmp_path, run_cli):
    """Through the CLI, exit 2, one paragraph, before training (no checkpoint)."""
    data = _write(tmp_path / "prompts.jsonl", _records(4))
    model = [f"dataset.tokenizer={llama}"] if "model=mlp" in args else [f"model.path={llama}"]
    rewards = [] if any(a.startswith("task.rewards") for a in args) else [_rewards_arg()]
    base = [*RUN, *model, f"dataset.path={data}", *rewards]
    proc = run_cli([*base, *args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["strategy=tp", "lora.rank=0"], "task=grpo with strategy=tp"),
        (["strategy=fsdp", "strategy.tp=2", "lora.rank=0"], "strategy=fsdp strategy.tp=2"),
        (["task.num_generations=1"], "task.num_generations=1"),
        (["task.loss_type=ppo"], "task.loss_type=ppo: must be one of grpo, dr_grpo, dapo"),
        (["task.scale_rewards=yes"], "task.scale_rewards=yes"),
        (["task.importance_sampling_level=seq"], "task.importance_sampling_level=seq"),
        (["task.epsilon=1.5"], "the clip range"),
        (["task.temperature=0"], "temperature must be > 0"),
        (["task.chunked_loss=true", "task.loss_chunk_tokens=0"], "task.loss_chunk_tokens=0"),
        (["task.generation_batch_size=0"], "task.generation_batch_size=0"),
        (["strategy=fsdp", "lora.rank=0", "task.beta=0.04"], "whole unsharded frozen copy"),
    ],
)  # fmt: skip
def test_keys_and_choices_refused_in_the_config_checks(args, needle, compose_cfg):
    cfg = compose_cfg(["task=grpo", "dataset=prompts", "model=hf", "model.path=x",
                       "dataset.path=p.jsonl", "lora.rank=4", *args])  # fmt: skip
    why = GRPO.config_refusal(cfg)
    assert why is not None and needle in why, why
    fine = compose_cfg(["task=grpo", "dataset=prompts", "model=hf", "model.path=x",
                        "dataset.path=p.jsonl", "lora.rank=4", "task.beta=0.04"])  # fmt: skip
    assert GRPO.config_refusal(fine) is None
    with pytest.raises(UserError, match="task=grpo needs reward functions"):
        build_rewards([])


def _raises(prompts, completions, **columns):
    raise ValueError("no answer column")


def _short(prompts, completions, **columns):
    return [1.0] * (len(completions) - 1)


def _nan(prompts, completions, answer, **columns):
    return [float("nan") if a == "2" else 1.0 for a in answer]


def _none_applies(prompts, completions, **columns):
    return [None] * len(completions)


@pytest.mark.parametrize(
    ("fn", "needles"),
    [
        (_raises, ["'_raises'", "raised ValueError: no answer column", "indices [5, 6]"]),
        (_short, ["'_short'", "returned 7 values for 8 completions"]),
        (_nan, ["'_nan'", "returned nan for completion 4", "data set index 6"]),
    ],
)  # fmt: skip
def test_a_failing_reward_function_is_named_with_the_prompt(fn, needles):
    reward = build_rewards([{"_target_": f"test_grpo.{fn.__name__}"}])[0]
    prompts, completions = ["Say 1."] * 8, ["1"] * 8
    columns = {"answer": ["1"] * 4 + ["2"] * 4}
    with pytest.raises(UserError) as err:
        reward(prompts, completions, columns, [5] * 4 + [6] * 4)
    for needle in needles:
        assert needle in str(err.value)
    assert "task.rewards[0]._target_=test_grpo." in str(err.value)
    # None is TRL's "does not apply": no error, and no advantage
    none = build_rewards([{"_target_": "test_grpo._none_applies"}])[0]
    assert none(prompts, completions, columns, [0] * 8) == [None] * 8
    per_func = torch.full((8, 1), float("nan"))
    adv, _ = L.advantages(L.weighted_rewards(per_func, torch.ones(1)), 4)
    assert adv.abs().sum() == 0


def test_builtin_gpt_samples_with_its_own_loop_and_the_chunked_loss(llama, tmp_path, run_cli):
    """model=gpt (no generate_ids: nanoGPT's sampling loop, one group at a time) trains with
    task.chunked_loss through its head_loss capability; with logger=csv the completions are in
    completions.jsonl and on the console; tokens/s counts prompt and completion tokens; a
    context too short is refused."""
    data = _write(tmp_path / "prompts.jsonl", _records(8))
    base = [*RUN[:2], "model=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
            f"dataset.tokenizer={llama}", f"dataset.path={data}", _rewards_arg(), *RUN[5:],
            "task.chunked_loss=true", "task.loss_chunk_tokens=7", "trainer.max_steps=2",
            "logger=csv"]  # fmt: skip
    proc = run_cli([*base, "model.block_size=32", f"hydra.run.dir={tmp_path / 'gpt'}"])
    check_ok(proc)
    train = [r for r in read_jsonl(tmp_path / "gpt" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["train/completions/max_length"] == C for r in train)  # sampled to the end
    table = read_jsonl(tmp_path / "gpt" / "completions.jsonl")
    assert [r["step"] for r in table] == [1] * 8 + [2] * 8  # (num_completions_to_print)
    shown = (
        f"step 2 completions: prompt={table[8]['prompt']!r}  completion={table[8]['completion']!r}"
    )
    assert shown in proc.stdout + proc.stderr
    # tokens/s over samples/s: each prompt's G rows of prompt + completion tokens, no padding
    prompt = len(prompt_splits(str(data), str(llama)).train.prompts[0].ids)
    for r in train:
        per_prompt = r["train/tokens_per_s"] / r["train/samples_per_s"]
        assert per_prompt == pytest.approx(G * (prompt + r["train/completions/mean_length"]))
    proc = run_cli([*base, "model.block_size=16", f"hydra.run.dir={tmp_path / 'short'}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "positions, and the model has 16" in proc.stderr


def test_fsdp_two_processes_sample_their_own_prompts(llama, tmp_path, run_cli):
    """strategy=fsdp, 2 processes (gloo), LoRA: each samples its own prompts with the model
    gathered for generation, and trains; logger=none still keeps completions.jsonl (rank 0's);
    a reward's std is over both processes' completions (a 0/1 reward over n values with mean
    p: sqrt(p (1 - p) n / (n - 1)), n = 2 processes x 2 prompts x G)."""
    data = _write(tmp_path / "prompts.jsonl", _records(8))  # 2 steps of 2 x 2 prompts
    val = _write(tmp_path / "val.jsonl", _records(2))
    run = tmp_path / "fsdp"
    args = [*RUN, f"model.path={llama}", f"dataset.path={data}", f"dataset.val_path={val}",
            _rewards_arg(),
            "strategy=fsdp", "launcher.nproc_per_node=2", "trainer.max_steps=2",
            "trainer.val_check_interval=2", "logger=none", f"hydra.run.dir={run}"]  # fmt: skip
    check_ok(run_cli(args, timeout=600))
    train = [r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert any(r["train/grad_norm"] > 0 for r in train)
    n = 2 * 2 * G
    assert any(0 < r["train/rewards/format_match/mean"] < 1 for r in train)  # a spread
    for r in train:
        p = r["train/rewards/format_match/mean"]
        want = (p * (1 - p) * n / (n - 1)) ** 0.5
        assert r["train/rewards/format_match/std"] == pytest.approx(want, abs=1e-5), r
    assert sorted({r["step"] for r in read_jsonl(run / "completions.jsonl")}) == [1, 2]

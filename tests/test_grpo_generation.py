"""task=grpo's sampling and scoring costs (issue 61, C.15 and C.13): model=gpt's KV cache gives
the logits and tokens of its recomputing loop (greedy, and sampled with one seed), with left
padding when prompts of different lengths sample together; model=hf's shared prefill (each
prompt's KV cache computed once and repeated to its group) samples the tokens the repeated
prompts did; the completion-only scoring (the head on the completion positions' hidden
states, whole or chunked) gives the per-token log-probs and entropies of the whole logits; and a
GRPO run of model=gpt through the CLI samples several prompts together with padding."""

from __future__ import annotations

import pytest
import torch
from helpers import check_ok, read_jsonl
from hf_fixtures import write_tiny_llama
from test_grpo import REWARDS, RUN, _records, _rewards_arg, _write

from accel_train.models.generate import generate, generate_cached
from accel_train.models.gpt import GPT
from accel_train.tasks.grpo import GRPO


def _gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=50, block_size=32, n_layer=2, n_head=2, n_embd=16, **kw).eval()


@pytest.mark.parametrize(
    "kw", [{}, {"pos_embedding": "rope", "qk_norm": True}], ids=["wpe", "rope"]
)
def test_gpt_kv_cache_gives_the_recomputed_logits_and_tokens(kw):
    model = _gpt(**kw)
    prompt = torch.randint(0, 50, (1, 5))
    greedy = generate(model, prompt.repeat(3, 1), 20, block_size=32, temperature=0)
    cached = generate_cached(model, prompt, 20, block_size=32, repeat=3, temperature=0)
    assert torch.equal(greedy, cached)
    # the cache's logits, token by token, are the whole sequence's
    logits, cache = model.decode(cached[:, :5])
    steps = [logits]
    for t in range(5, cached.shape[1]):
        out, cache = model.decode(cached[:, t : t + 1], cache)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), model(cached), atol=1e-5, rtol=1e-5)
    # sampled, one seed: the same tokens (past block_size: the sliding window, as before)
    torch.manual_seed(3)
    want = generate(model, prompt.repeat(4, 1), 40, block_size=32, top_k=10, top_p=0.9)
    torch.manual_seed(3)
    got = generate_cached(model, prompt, 40, block_size=32, repeat=4, top_k=10, top_p=0.9)
    assert torch.equal(want, got)
    # two prompts of different lengths together, the short one left-padded: each row's
    # completion is its prompt's alone
    short, long = torch.randint(1, 50, (1, 3)), torch.randint(1, 50, (1, 6))
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    valid = torch.tensor([[False] * 3 + [True] * 3, [True] * 6])
    both = generate_cached(model, ids, 10, block_size=32, valid=valid, repeat=2, temperature=0)
    for row, alone in zip(both[::2], (short, long), strict=True):
        assert torch.equal(
            row[6:], generate(model, alone, 10, block_size=32, temperature=0)[0, -10:]
        )


def test_hf_shared_prefill_samples_the_tokens_of_the_repeated_prompts(tmp_path):
    from accel_train.models.hf import hf_model

    model = hf_model(path=str(write_tiny_llama(tmp_path / "llama"))).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    args = dict(temperature=1.0, top_k=20, top_p=1.0, eos_token_id=None)
    torch.manual_seed(1)
    want = model.generate_ids(
        ids.repeat_interleave(4, 0), 8, attention_mask=mask.repeat_interleave(4, 0), **args
    )
    torch.manual_seed(1)
    got = model.generate_ids(ids, 8, attention_mask=mask, repeat=4, **args)
    assert torch.equal(want, got) and want.shape == (8, 14)


@pytest.mark.parametrize("chunk", [0, 5], ids=["whole", "chunked"])
def test_completion_only_scoring_equals_the_whole_logits(chunk):
    model = _gpt()
    task = GRPO(num_generations=2, max_completion_length=6, temperature=0.7, rewards=REWARDS,
                chunked_loss=bool(chunk), loss_chunk_tokens=chunk or 1)  # fmt: skip
    task.eos, task.pad = 1, 0
    ids = torch.tensor([[0, 7, 8, 9], [0, 7, 8, 9], [3, 4, 5, 6], [3, 4, 5, 6]])
    pmask = (ids != 0).long()
    done = torch.randint(2, 50, (4, 6))
    done[1, 2] = 1  # one completion stops early
    roll = task._layout(ids, pmask, done)
    task.head_loss = False
    want = task._logps(model, roll)
    task.head_loss = True
    got = task._logps(model, roll)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a * roll["shown"], b * roll["shown"], atol=1e-5, rtol=1e-5)


def test_gpt_grpo_samples_prompts_together_through_the_cli(tmp_path, run_cli):
    """Prompts of different lengths (left-padded) two at a time with model=gpt's cache."""
    records = _records(4)
    records[1]["prompt"][0]["content"] = "Say 1, please, and nothing but 1."
    data = _write(tmp_path / "prompts.jsonl", records)
    llama = write_tiny_llama(tmp_path / "llama")
    args = [*RUN[:2], "model=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=32",
            "model.block_size=64", f"dataset.tokenizer={llama}", f"dataset.path={data}",
            _rewards_arg(), *RUN[5:], "task.generation_batch_size=2", "trainer.max_steps=1",
            "loader.batch_size=4", "task.num_completions_to_print=null",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    check_ok(run_cli(args))
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(train) == 1 and train[0]["train/completions/mean_length"] > 0
    table = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert any("nothing but 1" in r["prompt"] for r in table)

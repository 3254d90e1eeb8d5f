"""task=preference and dataset=preference: the four losses against TRL's own code on random
log-probs, the record formats, truncation and refusals in-process; then one LoRA DPO run through
the real CLI on a learnable preference set (held-out rewards/accuracies above 0.5 and rising,
exact mid-epoch resume, the precomputed reference agreeing with the adapters-off one and reused
on resume, accel-data shard + dataset=streaming_preference reading the same pairs, accel-export
format=hf), and a combination refused before the run."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from helpers import check_ok, read_jsonl
from hf_fixtures import write_preferences, write_tiny_llama

from accel_train.data.text.preference import (
    Pair,
    PairEncoder,
    preference_splits,
    record_parts,
    truncate,
)
from accel_train.errors import UserError
from accel_train.tasks.preference import adapters_off, answer_logps, pair_losses


def _trl_self(loss_type: str, beta: float, **extra):
    """The attributes TRL's CPO and ORPO loss methods read from their trainer."""
    acc = types.SimpleNamespace(device=torch.device("cpu"))
    return types.SimpleNamespace(
        loss_type=loss_type, beta=beta, alpha=0.0, label_smoothing=0.0, accelerator=acc, **extra
    )


def test_losses_match_trl():
    """DPO (and cDPO), IPO, SimPO and ORPO per pair, against TRL 1.16's loss code: CPO's
    `cpo_loss` (its sigmoid and ipo branches are DPO's and IPO's formulas once given the
    log-ratios instead of the log-probs; its simpo branch is SimPO) and ORPO's
    `odds_ratio_loss`."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    g = torch.Generator().manual_seed(0)
    n_c, n_r = torch.randint(1, 40, (16,), generator=g), torch.randint(1, 40, (16,), generator=g)
    c, r = -torch.rand(16, generator=g) * n_c * 3, -torch.rand(16, generator=g) * n_r * 3
    ref_c, ref_r = c + torch.randn(16, generator=g), r + torch.randn(16, generator=g)

    for eps in (0.0, 0.2):  # DPO, then cDPO
        ours, rc, rr, _, _ = pair_losses("dpo", c, r, n_c, n_r, ref_c, ref_r, beta=0.3,
                                         label_smoothing=eps)  # fmt: skip
        trl = _trl_self("sigmoid", 0.3)
        trl.label_smoothing = eps
        theirs, trc, trr = CPOTrainer.cpo_loss(trl, c - ref_c, r - ref_r)
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close((rc, rr), (trc, trr))

    ours = pair_losses("ipo", c, r, n_c, n_r, ref_c, ref_r, beta=0.3)[0]
    theirs = CPOTrainer.cpo_loss(_trl_self("ipo", 0.3), (c - ref_c) / n_c, (r - ref_r) / n_r)[0]
    torch.testing.assert_close(ours, theirs)

    ours, rc, rr, _, _ = pair_losses("simpo", c, r, n_c, n_r, beta=2.5, gamma=1.375)
    trl = _trl_self("simpo", 2.5, simpo_gamma=1.375)
    theirs, trc, trr = CPOTrainer.cpo_loss(trl, c / n_c, r / n_r)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close((rc, rr), (trc, trr))

    ours, rc, rr, _, _ = pair_losses("orpo", c, r, n_c, n_r, lam=0.25)
    ratio, trc, trr = ORPOTrainer.odds_ratio_loss(_trl_self("orpo", 0.25), c / n_c, r / n_r)[:3]
    # TRL's loss: nll - mean(beta * logsigmoid(log odds)); ours per pair with the chosen NLL
    torch.testing.assert_close(ours, -c / n_c - ratio)
    torch.testing.assert_close((rc, rr), (trc, trr))


def test_answer_logps_score_only_labelled_tokens():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 1, 2, 0, 6]])
    total, count = answer_logps(logits, labels, -100)
    logp = logits.log_softmax(-1)
    want = [logp[0, 2, 3] + logp[0, 3, 4], logp[1, 1, 1] + logp[1, 2, 2] + logp[1, 3, 0]
            + logp[1, 4, 6]]  # fmt: skip
    torch.testing.assert_close(total, torch.stack(want))
    assert count.tolist() == [2, 4]


def test_adapters_off_is_the_base_model():
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    base = model(x)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["0", "1"], init_lora_weights=False),
                            model)  # fmt: skip
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    assert not torch.allclose(model(x), base)
    with adapters_off(layers):
        torch.testing.assert_close(model(x), base)
    assert not torch.allclose(model(x), base)  # back on
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("pref") / "llama")


def test_formats_render_alike_and_truncation_keeps_the_answers(llama, tmp_path):
    from accel_train.models.hf import load_tokenizer

    enc = PairEncoder(load_tokenizer(str(llama)), str(llama))
    text = {"prompt": "Say hello.", "chosen": "HELLO", "rejected": "hello"}
    chat = {
        "prompt": [{"role": "user", "content": "Say hello."}],
        "chosen": [{"role": "assistant", "content": "HELLO"}],
        "rejected": [{"role": "assistant", "content": "hello"}],
    }
    a, b = (enc.encode("x", record_parts("x", r)) for r in (text, chat))
    assert a == b and a.chosen != a.rejected and a.prompt
    whole = enc.tok.apply_chat_template(
        [chat["prompt"][0], chat["chosen"][0]], tokenize=True, return_dict=True
    )["input_ids"]
    assert a.prompt + a.chosen == list(whole)

    pair = Pair(list(range(10)), [100, 101, 102], [200, 201])
    cut, was_cut = truncate(pair, max_length=8, max_prompt_length=6)
    assert was_cut and cut == Pair([5, 6, 7, 8, 9], [100, 101, 102], [200, 201])
    cut, _ = truncate(pair, max_length=3, max_prompt_length=None)  # the answer cut only last
    assert cut == Pair([9], [100, 101], [200, 201])

    path = write_preferences(tmp_path / "p.jsonl", 8, form="chat")
    splits = preference_splits(str(path), str(llama), max_length=96, val_fraction=0.25)
    item = splits.train[0]
    assert item["input_ids"].shape[0] == 2 and item["index"].item() == 0
    assert splits.val[0]["index"].item() == len(splits.train)  # numbered across the splits
    batch = splits.train.collate([splits.train[i] for i in range(3)])
    assert batch["input_ids"].shape[:2] == (3, 2) and batch["input_ids"].shape[2] % 8 == 0
    # the labels are the answer's tokens, shifted by one
    ids, labels = batch["input_ids"][0, 0], batch["labels"][0, 0]
    at = (labels != -100).nonzero().flatten()
    assert len(at) and torch.equal(labels[at[:-1]], ids[at[:-1] + 1])  # (the last: not an input)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "rejected missing"),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "the same answer"),
        ({"prompt": "q", "chosen": " ", "rejected": "b"}, "'chosen' is an empty answer"),
        ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         "exactly one message"),
    ],
)  # fmt: skip
def test_bad_records_are_refused_naming_the_line(llama, tmp_path, record, message):
    path = tmp_path / "bad.jsonl"
    good = {"prompt": "q", "chosen": "A", "rejected": "a"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError, match=message) as err:
        preference_splits(str(path), str(llama))
    assert f"{path}:2" in str(err.value)


# ---- through the CLI ---------------------------------------------------------------------

DPO = [
    "+experiment=dpo_lora",
    "dataset.max_length=96",
    "lora.rank=4",
    "lora.dropout=0.0",
    "optimizer.lr=0.003",
    "scheduler=step",  # a schedule independent of the run's length: resume compares
    "scheduler.step_size=100",
    "scheduler.warmup_steps=0",
    "loader.batch_size=8",
    "trainer.max_epochs=2",
    "trainer.max_steps=10",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "trainer.progress=none",
    "logger=none",
]


def _metric(run: Path, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in read_jsonl(run / "metrics.jsonl") if key in m}


def test_dpo_lora_learns_resumes_and_exports(llama, tmp_path, run_cli):
    train = write_preferences(tmp_path / "train.jsonl", 64)
    val = write_preferences(tmp_path / "val.jsonl", 16, form="chat", start=64)  # held out
    base = [*DPO, f"model.path={llama}", f"dataset.path={train}", f"dataset.val_path={val}"]
    runs = {k: tmp_path / k for k in ("whole", "resumed", "table")}
    check_ok(run_cli([*base, f"hydra.run.dir={runs['whole']}"]))
    acc = _metric(runs["whole"], "val/rewards/accuracies")
    margins = _metric(runs["whole"], "val/rewards/margins")
    assert sorted(acc) == [2, 4, 6, 8, 10]
    assert acc[10] > 0.5 and margins[10] > margins[2] > 0  # held out: learnt, and rising
    # from the start: fresh adapters are the reference, every reward 0, no pair ranked right
    start = {k: _metric(runs["whole"], f"train/rewards/{k}")[1] for k in ("accuracies", "margins")}
    assert start == {"accuracies": 0.0, "margins": 0.0}

    # stopped mid-epoch at step 5 (8 steps an epoch), resumed: the same run
    first = ["trainer.max_steps=5", "trainer.ckpt_every_n_steps=5"]
    check_ok(run_cli([*base, *first, f"hydra.run.dir={runs['resumed']}"]))
    check_ok(run_cli([*base, "resume=auto", f"hydra.run.dir={runs['resumed']}"]))
    assert _metric(runs["resumed"], "train/loss") == _metric(runs["whole"], "train/loss")
    for key in ("val/loss", "val/rewards/margins"):  # (the first part also validated at 5)
        resumed, whole = _metric(runs["resumed"], key), _metric(runs["whole"], key)
        assert {s: resumed[s] for s in whole} == whole, key

    # the precomputed reference: the adapters-off one; written once, reused on resume
    table = [*base, "task.precompute_reference=true", f"hydra.run.dir={runs['table']}"]
    check_ok(run_cli([*table, "trainer.max_steps=2", "trainer.ckpt_every_n_steps=2"]))
    saved = runs["table"] / "reference_logps.pt"
    written = saved.stat().st_mtime_ns
    check_ok(run_cli([*table, "trainer.max_steps=3", "resume=auto"]))
    assert saved.stat().st_mtime_ns == written
    other = run_cli([*table, "trainer.max_steps=3", "dataset.max_length=80"])  # other tokens
    assert other.returncode != 0 and "holds reference log-probs of other pairs" in other.stderr
    assert saved.stat().st_mtime_ns == written
    ours, want = _metric(runs["table"], "train/loss"), _metric(runs["whole"], "train/loss")
    assert list(ours) == [1, 2, 3]
    assert [ours[s] for s in ours] == pytest.approx([want[s] for s in ours], rel=1e-5)

    # sharded once, streamed: the same pairs (the base model's val log-probs, from the table)
    shards = tmp_path / "shards"
    shard = ["shard", "dataset=preference", f"dataset.path={train}", f"dataset.val_path={val}",
             f"dataset.tokenizer={llama}", "dataset.max_length=96", f"out={shards}"]  # fmt: skip
    check_ok(run_cli(shard, prog="accel-data"))
    stream = [*DPO, f"model.path={llama}", "dataset=streaming_preference",
              f"dataset.remote={shards}", "optimizer.lr=1e-12", "trainer.max_steps=1",
              f"hydra.run.dir={tmp_path / 'stream'}"]  # fmt: skip
    check_ok(run_cli(stream))
    base_logps = torch.load(saved, weights_only=True)["logps"][64:, 0].mean().item()
    assert _metric(tmp_path / "stream", "val/logps/chosen")[1] == pytest.approx(base_logps, 1e-5)

    out = tmp_path / "hf"
    last = runs["whole"] / "checkpoints" / "last.pt"
    check_ok(run_cli([f"ckpt_path={last}", "format=hf", f"out_path={out}"], prog="accel-export"))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in exported.state_dict())


def test_preference_with_a_model_that_is_not_hf_is_refused(tmp_path, run_cli):
    proc = run_cli(["task=preference", "model=gpt", "dataset=tokens", "dataset.path=x"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "task=preference with model=gpt" in proc.stderr + proc.stdout


# Issue 47's careless preference inputs: each one paragraph naming the key or file, exit 2.
CHUNKED = ["task.chunked_loss with task=preference", "does not support the chunked loss"]


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        # a reference-free loss with a reference option: was ignored silently
        ("orpo-precompute", ["task.precompute_reference=true with task.loss=orpo",
                             "reference-free"]),
        # was "not a key of task yet ... `+task.chunked_loss`", which then failed on
        # task.loss_chunk_tokens, a key the user never typed
        ("chunked", CHUNKED),
        ("chunked-added", CHUNKED),
        # asked of the strategy (shards_parameters), not its name (issue 47 E.24)
        ("fsdp-copy", ["with strategy=fsdp and lora.rank=0", "whole unsharded frozen copy"]),
        # a TRL record beside an Alpaca one: was read silently
        ("mixed-formats", ["mixes preference record formats", "mixed.jsonl:1 is TRL's",
                           "mixed.jsonl:3 is Alpaca's"]),
    ],
)  # fmt: skip
def test_careless_preference_inputs_are_one_paragraph(case, needles, llama, tmp_path, run_cli):
    prefs = write_preferences(tmp_path / "prefs.jsonl", 8)
    args = ["+experiment=dpo_lora", f"model.path={llama}", f"dataset.path={prefs}"]
    prog = "accel-train"
    if case == "orpo-precompute":
        args += ["task.loss=orpo", "task.precompute_reference=true"]
    elif case == "fsdp-copy":
        args += ["strategy=fsdp", "lora.rank=0"]
    elif case in ("chunked", "chunked-added"):
        args.append(f"{'+' if case == 'chunked-added' else ''}task.chunked_loss=true")
    else:  # refused as the records are read: accel-data shard reads them with the same code
        mixed = tmp_path / "mixed.jsonl"
        lines = [{"prompt": "q", "chosen": "A", "rejected": "a"},
                 {"prompt": "r", "chosen": "B", "rejected": "b"},
                 {"instruction": "s", "chosen": "C", "rejected": "c"}]  # fmt: skip
        mixed.write_text("".join(json.dumps(r) + "\n" for r in lines))
        prog = "accel-data"
        args = ["shard", "dataset=preference", f"dataset.path={mixed}",
                f"dataset.tokenizer={llama}", f"out={tmp_path / 'shards'}"]  # fmt: skip
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], prog=prog)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]
    assert "+task.chunked_loss" not in proc.stderr and "loss_chunk_tokens" not in proc.stderr

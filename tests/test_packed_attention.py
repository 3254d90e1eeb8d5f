"""Packed rows on the built-in GPT (issue 41, item 2): several records in one row, positions
restarting per record, each record scored as it is alone: in-process on the model (learned and
rotary positions, the gradients too, under activation checkpointing), and through the real CLI
(`model=gpt dataset=sft dataset.pack=true`); what cannot take packed rows refuses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_ok, read_jsonl
from hf_fixtures import write_records, write_tokenizer
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from accel_train.checkpoint import load_checkpoint
from accel_train.data.text.sft import encode_rows
from accel_train.errors import UserError
from accel_train.models.gpt import GPT
from accel_train.models.packed_attention import document_ids, documents
from accel_train.strategies.pipeline_schedule import build_pipeline, check_pipeline
from accel_train.tasks.language_model import _check_named_inputs

LENGTHS = (5, 11, 1, 7)  # a one-token record: it attends to itself only


def _records(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n + 1,), generator=gen) for n in LENGTHS]


@pytest.mark.parametrize("pos_embedding", ["learned", "rope"])
def test_a_packed_row_scores_each_record_as_alone(pos_embedding):
    """Per-token losses and the gradients of their sum, packed against one record at a time
    (plain causal attention, no mask), to 1e-5 in fp32; rope also under checkpointed blocks,
    whose recompute in the backward must get the row's mask back."""
    torch.manual_seed(0)
    model = GPT(
        vocab_size=40, block_size=32, n_layer=2, n_head=2, n_embd=32,
        pos_embedding=pos_embedding, qk_norm=pos_embedding == "rope",
    )  # fmt: skip
    if pos_embedding == "rope":
        for i, block in enumerate(model.blocks):
            impl = CheckpointImpl.NO_REENTRANT
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=impl)
    records = _records(40)
    # Two rows: the records end to end, then padding as one more record (as dataset=sft packs).
    x = torch.cat([r[:-1] for r in records] + [torch.zeros(8, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.arange(8)])
    x, pos = torch.stack([x, x.flip(0)]), torch.stack([pos, pos])  # row 2: other records
    y = torch.cat([r[1:] for r in records])

    packed = F.cross_entropy(model(x, position_ids=pos)[0, : len(y)], y, reduction="none")
    packed.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = torch.cat(
        [F.cross_entropy(model(r[None, :-1])[0], r[1:], reduction="none") for r in records]
    )
    alone.sum().backward()
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-5, msg=name)
    unmasked = F.cross_entropy(model(x)[0, : len(y)], y, reduction="none")
    assert (unmasked - alone).abs().max() > 1e-3  # the check can fail: records do leak then


def test_the_document_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert document_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3]]
    mask = documents(pos, flex=False).mask[0, 0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


def test_what_cannot_take_packed_rows_refuses_them(compose_cfg, tmp_path):
    """strategy=pipeline: from the config (dataset.pack=true) and from the rows themselves
    (packed shards); a model whose forward takes no position_ids."""
    cfg = compose_cfg(
        ["strategy=pipeline", "dataset=sft", "dataset.path=x.jsonl", "dataset.pack=true"]
        + ["model=gpt", f"paths.output_dir={tmp_path}"]
    )
    with pytest.raises(UserError, match=r"dataset.pack=true with strategy=pipeline"):
        check_pipeline(cfg, None, None)
    packed = {"input_ids": torch.zeros(1, 4), "position_ids": torch.zeros(1, 4)}
    with pytest.raises(UserError, match=r"packed rows \(input_ids, position_ids\)"):
        build_pipeline(nn.Linear(1, 1), cfg, None, packed, None, None, None)

    class OnlyIds(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(UserError, match=r"takes no position_ids.*model=gpt or model=hf"):
        _check_named_inputs(OnlyIds(), packed, "custom")
    _check_named_inputs(GPT(vocab_size=8, n_layer=1, n_head=1, n_embd=8), packed, "gpt")


GPT_SIZE = {"block_size": 256, "n_layer": 1, "n_head": 2, "n_embd": 32}
RUN = [*(f"model.{k}={v}" for k, v in GPT_SIZE.items()), "model=gpt", "trainer.max_steps=2"]
RUN += ["loader.batch_size=2", "trainer.progress=none", "logger=none"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A chat tokenizer folder and records: 16 to train on, 8 to validate (packed three or four
    to a row of 256 tokens)."""
    root = tmp_path_factory.mktemp("chat")
    tok = write_tokenizer(root / "tok")
    (root / "tok" / "config.json").write_text("{}")  # a tokenizer folder is a model's layout
    write_records(root / "t.jsonl", 16), write_records(root / "v.jsonl", 8)
    return root, len(tok)


def _val_loss_alone(run, chat) -> tuple[float, float]:
    """(the run's last validation loss, the loss of its validation records run one at a time
    in-process on the run's last weights)."""
    root, vocab = chat
    val_loss = [m["val/loss"] for m in read_jsonl(run / "metrics.jsonl") if "val/loss" in m][-1]
    model = GPT(vocab_size=vocab, **GPT_SIZE)
    model.load_state_dict(load_checkpoint(run / "checkpoints" / "last.pt")["model"])
    # The same validation records, one a row (ignore_index -1: the task's default).
    val, tok = str(root / "v.jsonl"), str(root / "tok")
    rows, _ = encode_rows(val, tok, 256, False, "completion", -1, val, None, 0, 0)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y, _pos in rows["val"].rows:  # one record a row, right-padded (causal: no effect)
            y = y.long()
            logits = model(x.long()[None])[0]
            total += F.cross_entropy(logits, y, ignore_index=-1, reduction="sum").item()
            count += int((y != -1).sum())
    return val_loss, total / count


def test_cli_packed_gpt_scores_each_record_as_alone(chat, run_cli, tmp_path):
    """`model=gpt dataset=sft dataset.pack=true` trains (the vocabulary: the tokenizer's), and
    its validation loss is the loss of the same records run one at a time, to 1e-5."""
    root, run = chat[0], tmp_path / "run"
    sft = [
        "dataset=sft",
        f"dataset.path={root / 't.jsonl'}",
        f"dataset.val_path={root / 'v.jsonl'}",
    ]
    sft += [f"dataset.tokenizer={root / 'tok'}", "dataset.max_length=256", "dataset.pack=true"]
    proc = run_cli([*sft, *RUN, f"hydra.run.dir={run}"])
    check_ok(proc)
    assert "rows of 256 tokens (packed" in proc.stdout
    val_loss, alone = _val_loss_alone(run, chat)
    assert abs(val_loss - alone) < 1e-5


def test_cli_packed_shards_stream_to_the_gpt(chat, run_cli, tmp_path):
    """`accel-data shard dataset=sft dataset.pack=true`, then `dataset=streaming_sft` with
    model=gpt: the rows arrive packed (positions and all), scored as the records alone."""
    root, run = chat[0], tmp_path / "run"
    shard = ["shard", "dataset=sft", f"dataset.path={root / 't.jsonl'}"]
    shard += [f"dataset.val_path={root / 'v.jsonl'}", f"dataset.tokenizer={root / 'tok'}"]
    shard += ["dataset.max_length=256", "dataset.pack=true", f"out={tmp_path / 'shards'}"]
    proc = run_cli(shard, prog="accel-data")
    check_ok(proc)
    assert "val rows (packed)" in proc.stdout + proc.stderr
    stream = ["dataset=streaming_sft", f"dataset.remote={tmp_path / 'shards'}"]
    stream.append(f"dataset.tokenizer={root / 'tok'}")
    check_ok(run_cli([*stream, *RUN, f"hydra.run.dir={run}"]))
    val_loss, alone = _val_loss_alone(run, chat)
    assert abs(val_loss - alone) < 1e-5

"""task.chunked_loss (issue 41): the output layer and the token loss computed in chunks of
tokens, so the (tokens, vocab) logits never exist; task.z_loss and task.label_smoothing on both
paths. In process: the loss and its gradients (hidden states, weight, bias) against the plain
F.cross_entropy path in fp32 and bf16, ignored targets and chunks that do not divide the tokens;
no (tokens, vocab) tensor in the forward or the backward of a GPT step; the built-in GPT and a
tiny HF Llama (packed rows' position_ids) through their `head_loss` capability; the refusals.
Through the real CLI: a tiny GPT under DDP, FSDP and TP (2 processes) trains with the same
losses as one process on the plain path. (model=hf under FSDP: tests/test_finetune.py's two-process
test runs its FSDP case chunked.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_ok, read_jsonl
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from accel_train.config.checks import validate
from accel_train.errors import UserError
from accel_train.losses import TokenLoss, linear_cross_entropy, output_layer
from accel_train.models.gpt import GPT
from accel_train.tasks.base import TaskContext
from accel_train.tasks.language_model import LanguageModel

N, C, V = 45, 24, 101  # tokens, channels, vocabulary: no chunk size below divides 45


def _inputs(dtype=torch.float32, bias=True):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, C, generator=gen, dtype=dtype)
    w = (torch.randn(V, C, generator=gen) * 0.3).to(dtype)
    b = torch.randn(V, generator=gen).to(dtype) if bias else None
    y = torch.randint(0, V, (N,), generator=gen)
    y[::4] = -100  # ignored targets
    return h, w, b, y


def _loss_and_grads(fn, h, w, b, autocast=False):
    leaves = [t.clone().requires_grad_() for t in (h, w, b) if t is not None]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(*leaves, *([None] if b is None else []))
    (loss * 0.7).backward()  # an incoming gradient other than 1 (the loop's 1 / tokens)
    return [loss.detach(), *(t.grad for t in leaves)]


def _plain_and_chunked(h, w, b, y, opts, autocast=False):
    """[loss, d/d h, d/d w, d/d b] of the plain path, then of the chunked one."""

    def plain(h, w, b):
        return opts.on_logits(F.linear(h, w, b), y)

    def chunked(h, w, b):
        return linear_cross_entropy(h, w, b, y, opts)

    return _loss_and_grads(plain, h, w, b, autocast), _loss_and_grads(chunked, h, w, b, autocast)


@pytest.mark.parametrize("chunk", [7, 16, 45, 1000])
def test_chunked_loss_and_grads_match_the_plain_path_in_fp32(chunk):
    """Loss, d/d hidden, d/d weight, d/d bias within 1e-5 (relative) of the plain path, with
    and without label smoothing and the z-loss, with and without a bias; and the same loss
    under no_grad (validation's path)."""
    for smoothing, z in ((0.0, 0.0), (0.1, 1e-4), (0.3, 0.05)):
        for bias in (True, False):
            h, w, b, y = _inputs(bias=bias)
            opts = TokenLoss(-100, smoothing, z, chunk)
            plain, fused = _plain_and_chunked(h, w, b, y, opts)
            for name, a, c in zip(("loss", "hidden", "weight", "bias"), plain, fused, strict=False):
                torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6, msg=f"{name} {opts}")
            with torch.no_grad():
                assert torch.allclose(linear_cross_entropy(h, w, b, y, opts), plain[0], rtol=1e-5)
    # (the plain path is torch's own loss: smoothing as torch defines it, z-loss as PaLM's)
    h, w, b, y = _inputs()
    logits = F.linear(h, w, b)
    ref = F.cross_entropy(logits, y, ignore_index=-100, label_smoothing=0.1, reduction="sum")
    ref = ref + 1e-3 * (torch.logsumexp(logits, -1)[y != -100] ** 2).sum()
    torch.testing.assert_close(TokenLoss(-100, 0.1, 1e-3).on_logits(logits, y), ref)


def test_chunked_loss_matches_in_bf16():
    """bf16 autocast (fp32 weights) and bf16 weights (bf16_true): the same loss to bf16's
    precision; the chunks make the logits as the plain path does (the matmul in bf16, then
    fp32), the weight's gradient summed in fp32 (the plain path rounds it to bf16 once)."""
    opts = TokenLoss(-100, 0.1, 1e-4, 16)
    for dtype, autocast in ((torch.float32, True), (torch.bfloat16, False)):
        h, w, b, y = _inputs(dtype)
        plain, fused = _plain_and_chunked(h, w, b, y, opts, autocast)
        for a, c in zip(plain, fused, strict=True):
            assert c.dtype == a.dtype
            torch.testing.assert_close(c.float(), a.float(), rtol=2e-2, atol=2e-2 * a.abs().max())


class _LargestLogits(TorchDispatchMode):
    """The most elements of any tensor with `vocab` columns that an op returns."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


def _gpt_and_batch(vocab=97, tie=True):
    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, block_size=32, n_layer=1, n_head=2, n_embd=32,
                tie_embeddings=tie)  # fmt: skip
    x = torch.randint(0, vocab, (2, 32))
    y = torch.randint(0, vocab, (2, 32))
    y[0, :5] = -1
    return model, x, y


def test_no_tokens_by_vocab_tensor_in_the_forward_or_the_backward():
    """Every op of a GPT training step (forward and backward) watched: chunked, no tensor with
    the vocabulary's columns is larger than one chunk of logits; plain, the (tokens, vocab)
    logits are there (what the watch would see)."""
    model, x, y = _gpt_and_batch()
    # 64 tokens in chunks of 40 and 24; 40 is above n_embd (32), so that the weight's own
    # (vocab, channels) tensors (e.g. its transpose, seen by the watch) stay under one chunk
    tokens, chunk = y.numel(), 40
    for chunked, bound in ((True, chunk * 97), (False, None)):
        task = LanguageModel(chunked_loss=chunked, loss_chunk_tokens=chunk, z_loss=1e-4)
        with _LargestLogits(97) as watch:
            loss, counted = task.step(model, (x, y))
            loss.backward()
        assert counted == tokens - 5
        if bound is not None:
            assert 0 < watch.largest <= bound, watch.largest
        else:
            assert watch.largest >= tokens * 97


def _grads(model, fn):
    model.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _same_step(model, inputs, y, opts):
    """The task's step, plain then chunked: the same loss and the same gradient of every
    parameter (within 1e-5 of the largest)."""
    plain_task = LanguageModel(ignore_index=opts.ignore_index, label_smoothing=0.1, z_loss=1e-3)
    chunked_task = LanguageModel(
        ignore_index=opts.ignore_index, label_smoothing=0.1, z_loss=1e-3, chunked_loss=True,
        loss_chunk_tokens=opts.chunk_tokens,
    )  # fmt: skip
    a = _grads(model, lambda: plain_task.step(model, (inputs, y))[0])
    b = _grads(model, lambda: chunked_task.step(model, (inputs, y))[0])
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=0)
    for name, g in a[1].items():
        torch.testing.assert_close(b[1][name], g, rtol=1e-5, atol=1e-5 * g.abs().max(), msg=name)


def test_the_gpt_and_a_hf_llama_train_the_same_chunked():
    """The built-in GPT (tied and untied head) and a tiny HF Llama fed packed rows (named
    position_ids restarting per record): the chunked step's loss and every parameter's gradient
    equal the plain step's."""
    for tie in (True, False):
        model, x, y = _gpt_and_batch(tie=tie)
        _same_step(model, x, y, TokenLoss(-1, chunk_tokens=13))
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel_train.models.hf import HFModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=150, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")  # fmt: skip
    model = HFModel(LlamaForCausalLM(cfg), "tiny", "causal_lm")
    ids = torch.randint(0, 150, (2, 24))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # two records a row
    y = torch.randint(0, 150, (2, 24))
    y[:, 9] = -100
    _same_step(model, {"input_ids": ids, "position_ids": positions}, y, TokenLoss(-100, 0, 0, 11))
    # A model whose logits are not its output layer's alone is refused by name.
    model.hf.config.final_logit_softcapping = 30.0
    task = LanguageModel(ignore_index=-100, chunked_loss=True)
    with pytest.raises(UserError, match="final_logit_softcapping=30.0"):
        task.step(model, ({"input_ids": ids, "position_ids": positions}, y))


def test_a_model_without_the_capability_or_a_wrapped_head_is_refused():
    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(11, 11)

        def forward(self, idx):
            return self.table(idx)

    x = torch.randint(0, 11, (2, 8))
    cfg = OmegaConf.create({"task": {}, "dataset": {"name": "tokens"}, "model": {"name": "bigram"}})
    ctx = TaskContext(cfg, torch.device("cpu"), {}, None, Bigram(), (x, x))
    with pytest.raises(UserError, match="takes no `head_loss=` argument") as refused:
        LanguageModel(chunked_loss=True).setup(ctx)
    assert "task.chunked_loss=false" in str(refused.value)
    model, x, y = _gpt_and_batch()
    model.head.lm_head.register_forward_pre_hook(lambda *a: None)  # as pruning's mask does
    with pytest.raises(UserError, match="head.lm_head has forward hooks"):
        LanguageModel(chunked_loss=True).step(model, (x, y))
    with pytest.raises(UserError, match="is a Bilinear, not a plain Linear"):
        output_layer(torch.nn.Bilinear(2, 2, 2), "the head")


REFUSALS = {
    "z_loss": (["task.z_loss=-0.1"], "task.z_loss=-0.1 must be >= 0"),
    "smoothing": (["task.label_smoothing=1.0"], "task.label_smoothing=1.0 must be in [0, 1)"),
    "chunk": (
        ["task.chunked_loss=true", "task.loss_chunk_tokens=0"],
        "task.loss_chunk_tokens=0 must be >= 1",
    ),
    "pipeline": (
        ["task.chunked_loss=true", "strategy=pipeline"],
        "task.chunked_loss=true with strategy=pipeline",
    ),
}


def test_refusals_name_the_key(compose_cfg, tmp_path):
    base = ["task=language_model", "model=gpt", "dataset=tokens", "dataset.path=tokens"]
    base.append(f"paths.output_dir={tmp_path}")
    for name, (overrides, text) in REFUSALS.items():
        cfg = compose_cfg([*base, *overrides])
        with pytest.raises(UserError) as refused:
            validate(cfg)
        assert text in str(refused.value), (name, str(refused.value))
    for ok in (["strategy=fsdp", "strategy.tp=2"], ["strategy=tp"]):
        validate(compose_cfg([*base, "task.chunked_loss=true", "task.z_loss=1e-4", *ok]))


TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(100))
GPT_RUN = [
    "task=language_model",
    "model=gpt",
    "model.n_layer=2",  # (FSDP shards the two blocks; one block is no unit of its own)
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "dataset=tokens",
    "dataset.path=tokens",
    "dataset.windows_per_epoch=16",
    "dataset.eval_windows=8",
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "task.z_loss=1e-3",
    "task.label_smoothing=0.1",
    "task.loss_chunk_tokens=50",  # 4 rows of 32 tokens a process: chunks of 50, 50 and 28
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "checkpoint.save_last=false",
    "trainer.progress=none",
    "logger=none",
]


def test_two_processes_chunked_train_as_one_plain(run_cli, tmp_path):
    """1 process x 8 rows on the plain path = 2 processes x 4 rows chunked, under DDP and
    under FSDP (the tied head gathered inside the model's forward), and 2 tensor-parallel
    processes x 8 rows with sequence parallelism (the head's input gathered from the sequence
    shards): the same training and validation losses within 1e-5."""
    (tmp_path / "input.txt").write_text(TEXT)
    check_ok(run_cli(["tokenize", "input=input.txt", "out=tokens"], prog="accel-data"))
    runs = {
        "plain": ["loader.batch_size=8"],
        "ddp": ["loader.batch_size=4", "strategy=ddp", "launcher.nproc_per_node=2"],
        "fsdp": ["loader.batch_size=4", "strategy=fsdp", "launcher.nproc_per_node=2"],
        "tp": [
            "loader.batch_size=8",
            "strategy=tp",
            "strategy.sequence_parallel=true",
            "launcher.nproc_per_node=2",
        ],  # fmt: skip
    }
    losses = {}
    for name, extra in runs.items():
        chunked = [] if name == "plain" else ["task.chunked_loss=true"]
        proc = run_cli([*GPT_RUN, *extra, *chunked, f"hydra.run.dir={name}"])
        check_ok(proc)
        assert ("task.chunked_loss: PyTorch, 50 tokens a chunk" in proc.stderr) == bool(chunked)
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        losses[name] = [r[k] for r in rows for k in ("train/loss", "val/loss") if k in r]
    assert len(losses["plain"]) == 3
    for name in ("ddp", "fsdp", "tp"):
        assert losses[name] == pytest.approx(losses["plain"], rel=1e-5), name

"""task=language_model: next-token prediction. A batch is `(inputs, targets)`, token ids of
shape (batch, time), the targets the inputs shifted by one (`dataset=tokens` makes them); the
model maps ids to logits (batch, time, vocab).

The step returns the *summed* token loss and the number of target tokens (targets of
`ignore_index` do not count), so the loop's normaliser divides once by the tokens of the whole
accumulated and all-reduced batch: cross-entropy, with `task.label_smoothing` and PaLM's
`task.z_loss` when set (accel_train.losses.TokenLoss). Validation logs the mean token
cross-entropy (neither of those terms, so runs compare) and its perplexity.

`task.chunked_loss=true`: the model is called with `head_loss=` (a capability: the built-in
GPT and model=hf take it) and returns the loss computed from its last hidden states and its
output layer's weight, `task.loss_chunk_tokens` tokens at a time: the (tokens, vocab) logits,
the largest tensor of a long-context step, are never built (Liger's fused kernel on CUDA when
liger-kernel is installed)."""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from accel_train.config import task_facts as facts
from accel_train.config.schema import LanguageModelTaskConfig
from accel_train.data.text.dataset_tokenizer import dataset_tokenizer, tokenizer_data
from accel_train.data.text.tokenizer import tokenizer_from_meta
from accel_train.errors import UserError
from accel_train.losses import TokenLoss, liger_available
from accel_train.models.generate import generate
from accel_train.plugins import register_task
from accel_train.tasks.base import Task, TaskContext, evaluating

log = logging.getLogger("accel_train")
HEAD_LOSS = "head_loss"  # the model capability task.chunked_loss calls: forward(..., head_loss=)


@register_task("language_model", LanguageModelTaskConfig)
class LanguageModel(facts.LanguageModel, Task):
    def __init__(
        self,
        ignore_index: int = -1,
        sample_lines: int = 0,
        sample_tokens: int = 64,
        chunked_loss: bool = False,
        loss_chunk_tokens: int = 1024,
        z_loss: float = 0.0,
        label_smoothing: float = 0.0,
    ):
        super().__init__()
        self.ignore_index = ignore_index
        self.chunked = chunked_loss
        self.loss = TokenLoss(
            ignore_index, label_smoothing, z_loss, loss_chunk_tokens if chunked_loss else 0
        )
        self.sample_lines, self.sample_tokens = sample_lines, sample_tokens
        self.tokenizer = None  # task.sample_lines: the token folder's, to decode the samples
        self.block_size = 0
        self.seed = 0
        self.kept_tokenizer: dict | None = None  # checkpoint_data(): see _keep_tokenizer

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        self._keep_tokenizer(ctx)
        if self.sample_lines > 0:
            self._setup_samples(ctx)
        batch = ctx.prepared(self)
        if not (isinstance(batch, list | tuple) and len(batch) == 2):
            raise UserError(
                f"task=language_model: a batch is {type(batch).__name__}, but it needs (inputs, "
                "targets) pairs of token ids, e.g. from `dataset=tokens`."
            )
        x, y = batch
        if isinstance(x, Mapping):
            _check_named_inputs(ctx.model, x, ctx.cfg.model.get("name"))
        if isinstance(x, torch.Tensor) and (x.dim() != 2 or x.is_floating_point()):
            raise UserError(
                f"task=language_model trains on token ids of shape (batch, time), but "
                f"dataset={ctx.cfg.dataset.get('name', 'custom')} gives {x.dtype} inputs of "
                f"shape {tuple(x.shape)}. Train it on tokens: `dataset=tokens "
                "dataset.path=<folder>` (made by `accel-data tokenize input=<text> "
                "out=<folder>`) with `model=gpt`."
            )
        if self.chunked:
            self._setup_chunked(ctx, x, y)
            return
        with evaluating(ctx.model):
            logits = call(ctx.model, x)
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != y.shape:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
            raise UserError(
                f"model._target_={ctx.cfg.model._target_} with task=language_model returned "
                f"{got} for token ids of shape {tuple(y.shape)}; it must return logits of shape "
                "(batch, time, vocab)."
            )

    def _setup_chunked(self, ctx: TaskContext, x: Any, y: torch.Tensor) -> None:
        """task.chunked_loss: the model takes `head_loss` (its capability) and returns the
        loss through it on the sample; Liger's kernel where it runs (CUDA, liger-kernel)."""
        params = inspect.signature(ctx.model.forward).parameters
        if HEAD_LOSS not in params:
            raise UserError(
                f"task.chunked_loss=true with model={ctx.cfg.model.get('name', 'custom')}: the "
                "chunked loss needs the model's last hidden states and output layer, and this "
                f"model's forward takes no `{HEAD_LOSS}=` argument to hand them over (the "
                "built-in model=gpt and model=hf do). Set `task.chunked_loss=false`."
            )
        liger = ctx.device.type == "cuda" and liger_available()
        self.loss = replace(self.loss, liger=liger)
        if ctx.warn:
            log.info(
                "task.chunked_loss: %s",
                "Liger's fused linear cross-entropy (liger-kernel)"
                if liger
                else f"PyTorch, {self.loss.chunk_tokens} tokens a chunk",
            )
        with evaluating(ctx.model):
            loss = call(ctx.model, x, head_loss=self.loss.plain().on_head(y))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(
                f"task.chunked_loss=true with model._target_={ctx.cfg.model._target_}: its "
                f"forward(..., {HEAD_LOSS}=f) returned {got}; it must return f(hidden states, "
                "output weight, output bias), the summed loss. Set `task.chunked_loss=false`."
            )

    def _keep_tokenizer(self, ctx: TaskContext) -> None:
        """The data's tokenizer as plain data, kept in every checkpoint (checkpoint_data), so
        accel-sample needs neither the token folder nor the shards. A data set without one this
        version reads (the user's own, a folder with only a vocab_size) keeps none: accel-sample
        then looks for it where the data was."""
        ds = ctx.cfg.dataset
        if not (ds.get("path") or ds.get("remote")):
            return
        try:
            meta, bpe_json, where = tokenizer_data(ds, ctx.cfg.paths.data_dir)
            tokenizer_from_meta(meta, where, bpe_json)  # one this version can rebuild
        except UserError:
            return
        self.kept_tokenizer = {"meta": meta, "bpe_json": bpe_json}

    def checkpoint_data(self) -> dict[str, Any]:
        return {"tokenizer": self.kept_tokenizer} if self.kept_tokenizer else {}

    def resume_conflict(self, saved: dict[str, Any]) -> str | None:
        """The data re-tokenized since the checkpoint (same size, other ids) would train on
        silently remapped ids, and its tokenizer would replace the checkpoint's."""
        old, new = saved.get("tokenizer"), self.kept_tokenizer
        if not old or not new or old == new:
            return None
        a, b = _describe(old["meta"]), _describe(new["meta"])
        if a == b:
            b += ", the same size but other ids"
        return f"was trained on data with a {a}, and this run's data has a {b}"

    def _setup_samples(self, ctx: TaskContext) -> None:
        path = ctx.cfg.dataset.get("path") or ctx.cfg.dataset.get("remote")
        block = ctx.cfg.model.get("block_size") or getattr(ctx.model, "block_size", 0)
        if not path or not block:
            raise UserError(
                f"task.sample_lines={self.sample_lines}: sampling at validation decodes with a "
                "token folder's tokenizer (`dataset=tokens dataset.path=...` or "
                "`dataset=streaming_tokens dataset.remote=...`) and needs the model's context "
                "(`model.block_size`); this run has "
                f"{'no dataset.path' if not path else 'no model.block_size'}. Set "
                "`task.sample_lines=0` or train on a token folder."
            )
        self.tokenizer, _ = dataset_tokenizer(ctx.cfg.dataset, ctx.cfg.paths.data_dir)
        self.block_size, self.seed = int(block), int(ctx.cfg.trainer.seed)

    def validation_text(self, model: nn.Module, autocast) -> list[str]:
        """task.sample_lines samples of task.sample_tokens tokens from the first token (a
        newline for a char tokenizer), the same seed each time: validations compare."""
        if self.tokenizer is None:
            return []

        device = next(iter(self.eval_metrics.sums.values())).device
        start = torch.zeros((self.sample_lines, 1), dtype=torch.long, device=device)
        generator = torch.Generator(device=device).manual_seed(self.seed)
        was = model.training
        model.eval()
        try:  # HOST SYNC (validation): each sampled token is read to draw the next
            with autocast():
                out = generate(
                    model,
                    start,
                    self.sample_tokens,
                    block_size=self.block_size,
                    generator=generator,
                )
        finally:
            model.train(was)
        texts = [self.tokenizer.decode(row[1:].tolist()) for row in out]
        return [f"sample {i + 1}: {text!r}" for i, text in enumerate(texts)]

    def inputs(self, batch: Any) -> torch.Tensor:
        return batch[0]

    def forward(self, model: nn.Module, batch: Any) -> Any:
        if self.chunked:  # (FLOP counting: the same matmuls, without the full logits)
            return call(model, batch[0], head_loss=self.loss.on_head(batch[1]))
        return call(model, batch[0])

    def tokens_in(self, batch: Any) -> int:
        return batch[1].numel()  # the targets' (batch, time): a shape, no host sync

    def step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._summed(model, batch, self.loss)

    def eval_output(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation's score: the bare cross-entropy (chunked when the step's is)."""
        return self._summed(model, batch, self.loss.plain())

    def _summed(self, model: nn.Module, batch: Any, loss: TokenLoss):
        x, y = batch
        if self.chunked:
            out = call(model, x, head_loss=loss.on_head(y))
        else:  # fp32 (under autocast too), summed: the loop divides by the tokens
            out = loss.on_logits(call(model, x), y)
        return out, (y != self.ignore_index).sum()

    def loss_split(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): the pipeline runs the model over its stages, the loss at the end."""
        return batch[0], batch[1]

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean token loss of one pipeline micro-batch (fp32)."""
        counted = (targets != self.ignore_index).sum().clamp(min=1)
        return self.loss.on_logits(logits, targets) / counted

    def sequence_buffers(self, batch: Any) -> tuple[Any, list[torch.Tensor]]:
        """Context parallelism (strategies/context_parallel.py): the batch with explicit
        positions, so that each process's part of a row keeps its true positions, and the
        tensors to split along the sequence (inputs, positions, targets)."""
        x, y = batch
        if isinstance(x, Mapping):  # packed rows: refused before the run (a causal ring)
            raise UserError("strategy.cp cannot split packed rows: set dataset.pack=false.")
        positions = torch.arange(x.shape[1], device=x.device).expand_as(x).contiguous()
        inputs = {"input_ids": x, "position_ids": positions, "packed": False}
        return (inputs, y), [x, positions, y]

    def derived(self, metrics: dict[str, float]) -> dict[str, float]:
        """Perplexity from the mean token loss (a mean of perplexities would be wrong)."""
        if "loss" in metrics:
            metrics["ppl"] = math.exp(min(metrics["loss"], 50.0))
        return metrics


def call(model: nn.Module, inputs: Any, **extra: Any) -> torch.Tensor:
    """The model on a batch's inputs: token ids, or named tensors (packed instruction rows:
    `input_ids` and the per-record `position_ids`): the ids first, as every model takes them
    (model=gpt's `idx`, transformers' `input_ids`), the others by name; `extra` by name too."""
    if not isinstance(inputs, Mapping):
        return model(inputs, **extra)
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}
    return model(inputs["input_ids"], **rest, **extra)


def _check_named_inputs(model: nn.Module, inputs: Mapping, name: str | None) -> None:
    """Packed rows pass `position_ids` by name: the model's forward must take them (it is what
    keeps each record's attention to itself)."""
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    missing = [k for k in inputs if k != "input_ids" and k not in params and not takes_any]
    if missing:
        raise UserError(
            f"model={name}: its forward takes no {', '.join(missing)}, which packed rows "
            "(dataset.pack=true) pass so that each record attends only to itself. Set "
            "dataset.pack=false, or use a model that takes them: model=gpt or model=hf "
            "(transformers models take position_ids)."
        )


def _describe(meta: dict[str, Any]) -> str:
    return f"{meta.get('tokenizer', 'custom')} tokenizer of {meta.get('vocab_size')} ids"

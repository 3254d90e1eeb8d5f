"""The loss by ``_target_``: torch's CrossEntropyLoss by default, or the user's own module,
called as ``loss(logits, targets)`` -> the batch's mean loss. And task=language_model's token
loss (`TokenLoss`): plain on the logits, or chunked through the output layer so that the
(tokens, vocab) logits never exist (`task.chunked_loss=true`, `linear_cross_entropy`)."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from accel_train.errors import UserError
from accel_train.targets import build, locate


def build_loss(lc: DictConfig, num_classes: int, reduction: str | None = None) -> nn.Module | None:
    """The loss. With `reduction` (e.g. "none" for per-sample losses): built with that
    argument, or None when the loss's constructor takes no `reduction`."""
    runtime: dict[str, object] = {"num_classes": num_classes}
    if reduction is not None:
        try:
            params = inspect.signature(locate(str(lc._target_), "loss._target_")).parameters
            takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            if "reduction" not in params and not takes_any:
                return None
        except (TypeError, ValueError):  # no signature to read: try it
            pass
        runtime["reduction"] = reduction
    return build(lc, "loss", runtime=runtime)


# ---- the language model's token loss: plain, or chunked through the output layer ------------


@dataclass(frozen=True)
class TokenLoss:
    """task=language_model's summed token loss: cross-entropy with label smoothing (torch's
    definition: (1 - s) * nll + s * the mean of -log p over the vocabulary) plus PaLM's z-loss,
    `z_loss * logsumexp(logits)^2` per token, which keeps the softmax normaliser near 1. Targets
    of `ignore_index` count for nothing. `chunk_tokens > 0`: `on_head` computes the output layer
    and the loss chunk by chunk (see `linear_cross_entropy`)."""

    ignore_index: int = -1
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    chunk_tokens: int = 0
    liger: bool = False  # Liger's fused kernel instead of the chunks (CUDA, liger-kernel)

    def plain(self) -> TokenLoss:
        """The bare cross-entropy (validation's score: comparable across these options)."""
        return replace(self, label_smoothing=0.0, z_loss=0.0)

    def on_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The summed loss of (..., vocab) logits, in fp32 (under autocast too)."""
        flat, y = logits.flatten(0, -2).float(), targets.flatten()
        loss = F.cross_entropy(
            flat, y, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            reduction="sum",
        )  # fmt: skip
        if self.z_loss:
            lse = torch.logsumexp(flat, dim=-1)
            loss = loss + self.z_loss * torch.where(y != self.ignore_index, lse.square(), 0).sum()
        return loss

    def on_head(self, targets: torch.Tensor) -> Callable[..., torch.Tensor]:
        """What a model's `forward(..., head_loss=)` calls with its last hidden states and its
        output layer's weight and bias: the summed loss against `targets`."""

        def head_loss(hidden, weight, bias=None):
            return linear_cross_entropy(hidden, weight, bias, targets, self)

        return head_loss


def output_layer(layer: nn.Module, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a plain Linear output layer, for task.chunked_loss, which computes
    x @ W.T + b itself: a layer that computes more (LoRA adapters, fake quantization) or whose
    forward hooks make its weight (pruning's mask) is refused by name."""
    hooked = bool(layer._forward_pre_hooks or layer._forward_hooks)
    if type(layer) is not nn.Linear or hooked:
        kind = "has forward hooks" if hooked else f"is a {type(layer).__name__}"
        raise UserError(
            f"task.chunked_loss=true computes the output layer from its weight and bias, but "
            f"{what} {kind}, not a plain Linear: what it adds (LoRA adapters, quantization, "
            "pruning's mask) would be skipped. Leave the head out of lora.target, quant and "
            "prune, or set `task.chunked_loss=false`."
        )
    return layer.weight, layer.bias


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    opts: TokenLoss,
) -> torch.Tensor:
    """`opts.on_logits(F.linear(hidden, weight, bias), targets)` without the (tokens, vocab)
    logits: hidden (..., C), weight (V, C), targets (...). Under grad, the chunks' gradients are
    computed in the forward (_ChunkedLinearCE); under no_grad (validation), the loss only."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if opts.liger:
        return _liger(h, weight, bias, y, opts)
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    if grads:
        return _ChunkedLinearCE.apply(h, weight, bias, y, opts)
    return _chunks(h, weight, bias, y, opts, (False, False, False))[0]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul's dtype as F.linear would pick it here (autocast's, or the input's)."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def _chunks(h, weight, bias, y, opts: TokenLoss, want: tuple[bool, bool, bool]):
    """(summed loss, d loss/d h, d/d weight, d/d bias), one chunk of logits at a time; the
    gradients that `want` does not ask for are None. The logits are made as the plain path
    makes them (the matmul in the autocast dtype, then fp32); the weight's gradient is summed
    in fp32 over the chunks."""
    dtype, n = _compute_dtype(h), h.shape[0]
    step = opts.chunk_tokens if opts.chunk_tokens > 0 else n
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    grad_h = torch.empty_like(h) if want[0] else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want[1] else None
    want_b = want[2] and bias is not None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=h.device) if want_b else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    with torch.autocast(h.device.type, enabled=False):  # the dtypes are explicit here
        for start in range(0, n, step):
            hc = h[start : start + step].to(dtype)
            logits = F.linear(hc, w, b).float()
            loss, g = _chunk_loss(logits, y[start : start + step], opts, any(want))
            total += loss
            if g is None:
                continue
            g = g.to(dtype)
            if grad_h is not None:
                grad_h[start : start + step] = g @ w
            if grad_w is not None and g.dtype == grad_w.dtype:
                grad_w.addmm_(g.t(), hc)  # (no (vocab, channels) temporary)
            elif grad_w is not None:
                grad_w += g.t() @ hc  # bf16 products, summed in fp32
            if grad_b is not None:
                grad_b += g.float().sum(0)
    return total, grad_h, grad_w, grad_b


def _chunk_loss(z: torch.Tensor, y: torch.Tensor, opts: TokenLoss, grad: bool):
    """One chunk's summed loss and, with `grad`, its gradient w.r.t. the fp32 logits `z`,
    softmax * (1 + 2 z_loss lse) - (1 - s) onehot - s / V, zero on ignored targets. Computed
    over `z` in place: a chunk holds one (tokens, vocab) tensor (torch.logsumexp would make a
    second)."""
    s, vocab = opts.label_smoothing, z.shape[-1]
    valid = y != opts.ignore_index
    safe = torch.where(valid, y, 0).unsqueeze(1)
    picked = z.gather(1, safe).squeeze(1)
    mean = z.mean(dim=-1) if s else None
    top = z.amax(dim=-1, keepdim=True)
    total = z.sub_(top).exp_().sum(dim=-1)  # z := exp(z - max)
    lse = top.squeeze(1) + total.log()
    per_token = (1 - s) * (lse - picked)
    if s:
        per_token = per_token + s * (lse - mean)
    if opts.z_loss:
        per_token = per_token + opts.z_loss * lse.square()
    loss = torch.where(valid, per_token, 0).sum()
    if not grad:
        return loss, None
    scale = 1 / total
    if opts.z_loss:
        scale = scale * (1 + 2 * opts.z_loss * lse)
    g = z.mul_(scale.unsqueeze(1))  # the softmax (times the z-loss's factor)
    g.scatter_add_(1, safe, torch.full_like(safe, s - 1, dtype=g.dtype))
    if s:
        g.sub_(s / vocab)
    return loss, g.mul_(valid.unsqueeze(1))


class _ChunkedLinearCE(torch.autograd.Function):
    """The loss of `linear_cross_entropy`, its gradients computed chunk by chunk in the forward
    (Liger's approach): the loss is a scalar, so its gradients are the forward's times the
    incoming gradient. Recomputing each chunk's logits in the backward instead would keep the
    memory the same and add a fourth vocabulary-sized matmul to the output layer's three (by
    FLOPs 4 to 9 % of a 124 M GPT's step, from 8k down to 1k tokens a row)."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, opts):
        want = tuple(ctx.needs_input_grad[:3])
        loss, grad_h, grad_w, grad_b = _chunks(h, weight, bias, y, opts, want)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.grads
        ctx.grads = None  # the buffers are handed on, not kept
        w_dtype, b_dtype = ctx.dtypes
        # Multiplied, never compared with 1 first: that would read the device on the host.
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out).to(w_dtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(grad_out).to(b_dtype)
        return grad_h, grad_w, grad_b, None, None


def liger_available() -> bool:
    """liger-kernel importable (its fused kernels are Triton: CUDA only)."""
    try:
        return importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        return False


def _liger(h, weight, bias, y, opts: TokenLoss) -> torch.Tensor:
    """Liger's fused linear cross-entropy (its own chunks, Triton kernels), summed; the inputs
    cast as autocast would cast them (Liger's kernel takes one dtype)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # optional, CUDA

    dtype = _compute_dtype(h)
    loss_fn = LigerFusedLinearCrossEntropyLoss(
        ignore_index=opts.ignore_index,
        lse_square_scale=opts.z_loss,
        label_smoothing=opts.label_smoothing,
        reduction="sum",
    )
    b = bias.to(dtype) if bias is not None else None
    out = loss_fn(weight.to(dtype), h.to(dtype), y, b)
    return (out[0] if isinstance(out, tuple) else out).float()

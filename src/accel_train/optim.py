"""Optimizers and learning-rate schedules from torch; schedules step once per optimizer step.

`optimizer=muon` is torch's own `torch.optim.Muon` (momentum orthogonalised by Newton-Schulz
iterations, Jordan et al. 2024) on the hidden weight matrices, and `torch.optim.AdamW` on
everything else (embeddings, the output head, norms, biases, convolutions), as Muon's authors
use it. The two run as one optimizer (:class:`MuonWithAdamW`): one list of param groups for the
schedulers and the GradScaler, one state dict for checkpoints. torch's Muon orthogonalises in
bf16, which a CPU without bf16 instructions emulates ~25x slower than fp32: :class:`Muon` is
torch's with the Newton-Schulz iteration in a dtype chosen per device (`optimizer.ns_dtype`).
"""

from __future__ import annotations

import logging
import math
import warnings

import torch
from omegaconf import DictConfig
from torch.optim import lr_scheduler

from accel_train.errors import UserError
from accel_train.precision import cpu_has_fast_bf16, emulated_bf16_text, fastest_half_or_fp32

log = logging.getLogger(__name__)


def scaled_lr(opt_cfg: DictConfig, global_batch: int) -> float:
    """optimizer.lr, times global_batch / reference_batch_size under the linear scaling rule."""
    if not opt_cfg.scale_lr_with_batch:
        return opt_cfg.lr
    factor = global_batch / opt_cfg.reference_batch_size
    log.info(
        "linear lr scaling: lr %.4g x (global batch %d / reference %d) = %.4g",
        opt_cfg.lr,
        global_batch,
        opt_cfg.reference_batch_size,
        opt_cfg.lr * factor,
    )
    return opt_cfg.lr * factor


def build_optimizer(
    model: torch.nn.Module,
    opt_cfg: DictConfig,
    lr: float,
    device: torch.device,
    bare: torch.nn.Module | None = None,
):
    """The optimizer of the model's trained parameters (frozen ones get no state).
    ``optimizer.layer_decay``: timm's layer-wise groups of ``bare`` (the unwrapped model, whose
    parameter names its group_matcher reads; default ``model``), see :func:`layer_decay_groups`."""
    params = [p for p in model.parameters() if p.requires_grad]
    if opt_cfg.get("layer_decay") is not None:
        groups = layer_decay_groups(bare or model, opt_cfg, lr)
        fused = opt_cfg.fused if opt_cfg.fused is not None else fusable(params)
        kwargs = {"lr": lr, "weight_decay": 0.0, "fused": fused or None}  # set per group
        if opt_cfg.name == "sgd":
            return torch.optim.SGD(
                groups, momentum=opt_cfg.momentum, nesterov=opt_cfg.nesterov, **kwargs
            )
        cls = torch.optim.Adam if opt_cfg.name == "adam" else torch.optim.AdamW
        return cls(groups, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps, **kwargs)
    if opt_cfg.name == "muon":
        matrices = hidden_matrices(model)
        return MuonWithAdamW(
            [p for p in params if id(p) in matrices],
            [p for p in params if id(p) not in matrices],
            opt_cfg,
            lr,
            fusable(params) if opt_cfg.fused is None else opt_cfg.fused,
            device,
        )
    fused = opt_cfg.fused if opt_cfg.fused is not None else fusable(params)
    kwargs = {"lr": lr, "weight_decay": opt_cfg.weight_decay, "fused": fused or None}
    if opt_cfg.name == "sgd":
        return torch.optim.SGD(
            params, momentum=opt_cfg.momentum, nesterov=opt_cfg.nesterov, **kwargs
        )
    cls = torch.optim.Adam if opt_cfg.name == "adam" else torch.optim.AdamW
    return cls(params, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps, **kwargs)


def layer_decay_groups(model: torch.nn.Module, opt_cfg: DictConfig, lr: float) -> list[dict]:
    """timm's ``param_groups_layer_decay`` as timm's ``create_optimizer_v2`` calls it: the
    model's layer groups (its ``group_matcher``) get lr x layer_decay^(depth below the head);
    1-D parameters (norms, biases) and the model's ``no_weight_decay()`` names get no weight
    decay; frozen parameters (model.freeze, a LoRA base) are left out. Each group keeps timm's
    ``lr_scale``, and its ``lr`` starts at lr x lr_scale, so torch's schedules (which scale each
    group's own lr) scale every group alike."""
    if not callable(getattr(model, "group_matcher", None)):
        raise UserError(
            f"optimizer.layer_decay={opt_cfg.layer_decay} needs the model's layer groups, which "
            f"timm models declare (`group_matcher`), and {type(model).__name__} does not. Use a "
            "timm model (`model=timm model.name=vit_small_patch16_224`, or your own model with "
            "a timm-style `group_matcher(coarse=False)`), or `optimizer.layer_decay=null`."
        )
    from timm.optim import param_groups_layer_decay

    skip = getattr(model, "no_weight_decay", lambda: set())()
    groups = param_groups_layer_decay(
        model,
        weight_decay=opt_cfg.weight_decay,
        no_weight_decay_list=skip,
        layer_decay=opt_cfg.layer_decay,
    )
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    return groups


def hidden_matrices(model: torch.nn.Module) -> set[int]:
    """ids of the weights Muon updates: every 2-D weight of a Linear layer but the output layer
    (the last Linear, as LoRA's default leaves it out) and any weight shared with an embedding
    (a tied head): those, like the embeddings, norms and biases, are AdamW's."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return {
        id(m.weight)
        for m in linears[:-1]
        if m.weight.ndim == 2 and m.weight.requires_grad and id(m.weight) not in embedded
    }


NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def muon_ns_dtype(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """optimizer.ns_dtype -> (the dtype Muon's Newton-Schulz runs in, why): auto is bf16 on CUDA
    and on a CPU with bf16 instructions (torch's own choice, and as fast there), fp32 on any
    other CPU (bf16 is emulated there: 50 s against 17 s for 30 steps of gpt_char_fast on an
    AVX2-only EPYC, issue 62, at the same loss); bf16 or fp32 forces one."""
    if setting != "auto":
        slow = optimizer_emulation({"name": "muon", "ns_dtype": setting}, device.type)
        if slow:
            log.warning("%s", slow)
        return NS_DTYPES[setting], "optimizer.ns_dtype"
    dtype = fastest_half_or_fp32(device)
    where = "this CPU" if device.type == "cpu" else f"this {device.type} device"
    return dtype, f"auto: {where} has {'' if dtype == torch.bfloat16 else 'no '}native bf16"


def optimizer_emulation(opt_cfg, device_type: str) -> str | None:
    """The warning an optimizer config gets on this machine's `device_type`: Muon's
    Newton-Schulz forced to bf16 on a CPU without bf16 instructions; else None."""
    forced = opt_cfg.get("name") == "muon" and opt_cfg.get("ns_dtype") == "bf16"
    if forced and device_type == "cpu" and not cpu_has_fast_bf16():
        return emulated_bf16_text(
            "optimizer=muon optimizer.ns_dtype=bf16 (its Newton-Schulz iteration)",
            "`optimizer.ns_dtype=auto` runs it in fp32 there, at the same loss (issue 62).",
        )
    return None


def newton_schulz(
    grad: torch.Tensor, coefficients: tuple, steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz (the quintic iteration of Jordan et al.)
    with the dtype as an argument instead of its fixed bfloat16; the same operations in the
    same order, so in bf16 it is torch's update bit for bit."""
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.to(dtype, copy=True)  # (never the momentum buffer itself: divided in place below)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon (same arguments, param groups and state dict) whose orthogonaliser is
    an attribute: `orthogonalise(update, coefficients, steps, eps)`, by default
    :func:`newton_schulz` in `ns_dtype`. The step is torch's `_single_tensor_muon` with that
    one call replaced (torch 2.14 has no hook for it)."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.orthogonalise = lambda g, coefficients, steps, eps: newton_schulz(
            g, coefficients, steps, eps, self.ns_dtype
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, momentum = float(group["lr"]), group["momentum"]
            for param, grad, buf in zip(params, grads, bufs, strict=True):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = self.orthogonalise(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def adjusted_lr(lr: float, fn: str | None, shape: torch.Size) -> float:
    """torch.optim._muon._adjust_lr: Muon's learning rate scaled by the matrix's shape."""
    rows, cols = shape[:2]
    if fn is None or fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if fn == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    return lr


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on `matrices`, torch.optim.AdamW on `others`, as one optimizer. The
    param groups and the per-parameter state are shared objects: this optimizer's
    `param_groups` are the two optimizers' group dicts (Muon's first), and all three hold the
    same `state` dict (their parameters are disjoint). So schedulers, the GradScaler, clipping
    and checkpoints see one ordinary optimizer, in torch's own state-dict format."""

    def __init__(
        self,
        matrices: list,
        others: list,
        cfg: DictConfig,
        lr: float,
        fused: bool,
        device: torch.device | None = None,
    ):
        if not matrices:
            raise UserError(
                "optimizer=muon: the model has no hidden weight matrix for Muon to update (it "
                "updates the 2-D weights of Linear layers other than the output layer; the "
                "rest go to AdamW). Use `optimizer=adamw` for this model."
            )
        scale = lr / cfg.lr  # the linear scaling rule's factor, the same for both
        setting = cfg.get("ns_dtype", "auto")
        self.ns_dtype, self.ns_why = muon_ns_dtype(setting, device or matrices[0].device)
        self.muon = Muon(
            matrices,
            ns_dtype=self.ns_dtype,
            lr=lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps,
            adjust_lr_fn=cfg.adjust_lr_fn,
        )
        self.adamw = torch.optim.AdamW(
            others or [torch.nn.Parameter(torch.zeros(0))],  # (an optimizer needs a parameter)
            lr=cfg.adamw_lr * scale,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
            weight_decay=cfg.adamw_weight_decay,
            fused=fused or None,
        )
        self._muon_groups = len(self.muon.param_groups)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share()

    def describe(self) -> str:
        """The start-up line's words for the orthogonalisation's dtype and why."""
        kind = "bf16" if self.ns_dtype == torch.bfloat16 else "fp32"
        return f"muon: Newton-Schulz in {kind} ({self.ns_why})"

    def _share(self) -> None:
        """Point both optimizers at this one's groups and state (again after a load, which
        replaces them)."""
        self.muon.param_groups = self.param_groups[: self._muon_groups]
        self.adamw.param_groups = self.param_groups[self._muon_groups :]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()


def base_learning_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each param group's learning rate as build_optimizer set it (before any schedule): what a
    rebuilt schedule starts from. MuonWithAdamW's two optimizers have one each."""
    if isinstance(optimizer, MuonWithAdamW):
        parts = (optimizer.muon, optimizer.adamw)
        return [o.defaults["lr"] for o in parts for _ in o.param_groups]
    # optimizer.layer_decay: each group at its share (layer_decay_groups)
    return [optimizer.defaults["lr"] * g.get("lr_scale", 1.0) for g in optimizer.param_groups]


def fusable(params: list) -> bool:
    """optimizer.fused=null: the fused kernels wherever every parameter is a plain floating
    tensor on the CPU or CUDA. Torch 2.14's own default is foreach on CUDA and the single-tensor
    loop on the CPU (its foreach kernels list no CPU); fused on the CPU measured 0.73 ms against
    2.83 ms a step on gpt_char's model (BENCHMARKS.md section 16), bf16 parameters and the CPU
    GradScaler included. FSDP's DTensor parameters (and anything else unusual) keep torch's
    default rather than trust a path this project has not measured."""
    return bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and p.device.type in ("cpu", "cuda")
        and torch.is_floating_point(p)
        for p in params
    )


def build_scheduler(
    optimizer,
    sched_cfg: DictConfig,
    total_steps: int,
    lr_scale: float = 1.0,
    start_step: int = 0,
    steps_per_epoch: int = 0,
):
    """A torch scheduler (or None for a constant lr), with an optional linear warmup in front.
    `steps_per_epoch`: this run's optimizer steps an epoch, which `scheduler.warmup_epochs` and
    `scheduler.step_epochs` are converted with (schedule_steps).

    A warm-up as long as the run (a recipe's, on a run shortened for a quick try) is cut to a
    tenth of the run with one warning line (Lightning's fast_dev_run runs its batch whatever the
    schedule).

    `start_step` > 0 builds the schedule for `total_steps` and fast-forwards it to that step
    (what a resume does when the run's length or schedule changed): the optimizer's param groups
    must hold the base lr and no `initial_lr` (torch keeps an existing `initial_lr`, which would
    anchor the new schedule to the old one). It steps the schedule rather than computing the lr
    in closed form, so the lr at every later step is bit-identical to that of a run planned for
    `total_steps` from the start (torch's chainable formulas depend on the order of the steps).
    """
    scheduler = _build_scheduler(optimizer, sched_cfg, total_steps, lr_scale, steps_per_epoch)
    if scheduler is not None and start_step > 0:
        with warnings.catch_warnings():
            # No optimizer step precedes these: torch would warn that the first lr is skipped.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
            for _ in range(start_step):
                scheduler.step()
    return scheduler


def schedule_steps(sched_cfg: DictConfig, steps_per_epoch: int) -> tuple[int, int | None]:
    """(warm-up steps, StepLR's step_size) of this run: `warmup_epochs` and `step_epochs`, where
    set, in optimizer steps of this run's epoch (its data, global batch, world size and
    accumulation: torchvision's reference derives them from len(data_loader) the same way), so
    the schedule per epoch is the same on 1 or 8 processes; else warmup_steps and step_size."""
    warmup, step_size = int(sched_cfg.warmup_steps), sched_cfg.get("step_size")
    epochs = {k: sched_cfg.get(k) for k in ("warmup_epochs", "step_epochs")}
    if any(v is not None for v in epochs.values()) and steps_per_epoch < 1:
        raise UserError(
            "scheduler.warmup_epochs / scheduler.step_epochs need the run's steps per epoch, "
            "which this run does not know (a data set without a length). Give "
            "`scheduler.warmup_steps` / `scheduler.step_size` in optimizer steps instead."
        )
    if epochs["warmup_epochs"] is not None:
        warmup = round(float(epochs["warmup_epochs"]) * steps_per_epoch)
    if epochs["step_epochs"] is not None:
        step_size = max(round(float(epochs["step_epochs"]) * steps_per_epoch), 1)
    return warmup, step_size


def _build_scheduler(
    optimizer, sched_cfg: DictConfig, total_steps: int, lr_scale: float, steps_per_epoch: int
):
    warmup, step_size = schedule_steps(sched_cfg, steps_per_epoch)
    if sched_cfg.name == "onecycle":
        if warmup:
            raise UserError(
                "scheduler=onecycle with scheduler.warmup_steps>0: OneCycle has its own warmup "
                "(scheduler.pct_start). Set `scheduler.warmup_steps=0`."
            )
        return lr_scheduler.OneCycleLR(
            optimizer,
            # (each layer-decay group at its share: layer_decay_groups)
            max_lr=[
                sched_cfg.max_lr * lr_scale * g.get("lr_scale", 1.0) for g in optimizer.param_groups
            ],
            total_steps=total_steps,
            pct_start=sched_cfg.pct_start,
            # .get: a schedule built in code (tests, the resume checks) may give only the above.
            anneal_strategy=sched_cfg.get("anneal_strategy", "cos"),
            div_factor=sched_cfg.get("div_factor", 25.0),
            final_div_factor=sched_cfg.get("final_div_factor", 1.0e4),
        )
    if warmup >= total_steps and warmup > 0:
        # A recipe's warm-up on a run shortened for a quick try (trainer.max_steps, fewer
        # epochs, limit_train_batches): cut to a tenth of the run, as HF's Trainer would go
        # ahead. Two contradicting numbers the user gave are refused before this
        # (config/option_checks.py: check_warmup).
        short = total_steps // 10
        log.warning(
            "scheduler.warmup_steps=%d shortened to %d: this run has only %d optimizer step(s) "
            "(a warm-up of a tenth of them)",
            warmup, short, total_steps,
        )  # fmt: skip
        warmup = short
    after = total_steps - warmup
    if sched_cfg.name == "step":
        main = lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=sched_cfg.gamma)
    elif sched_cfg.name == "cosine":
        main = _cosine(optimizer, max(after, 1), sched_cfg.min_lr)
    elif warmup:
        main = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    else:
        return None
    if not warmup:
        return main
    ramp = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [ramp, main], milestones=[warmup])


def _cosine(optimizer, steps: int, min_lr: float):
    """torch's cosine schedule; with layer-decay groups (lr_scale) and a floor, the floor scaled
    per group as timm's schedulers scale the whole schedule (lr_scale x (min_lr + ...)): the
    same curve in closed form, since CosineAnnealingLR has one eta_min for all groups."""
    scales = [g.get("lr_scale", 1.0) for g in optimizer.param_groups]
    if min_lr == 0 or all(s == 1.0 for s in scales):
        return lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=min_lr)

    def factor(base: float, floor: float):
        return lambda t: (
            (floor + (base - floor) * (1 + math.cos(math.pi * min(t, steps) / steps)) / 2) / base
        )

    bases = [g["lr"] for g in optimizer.param_groups]
    return lr_scheduler.LambdaLR(
        optimizer, [factor(b, min_lr * s) for b, s in zip(bases, scales, strict=True)]
    )

"""`lora.rank=N`: low-rank adapters (LoRA) on a frozen base, for any model, through PEFT.

PEFT's `inject_adapter_in_model` swaps each targeted `nn.Linear` for its LoRA layer in place (the
base weight frozen, `lora_A`/`lora_B` trained); the model keeps its class and forward, so every
other part of the run (the task, DDP/FSDP, compile, the checkpoint) sees an ordinary module.
`lora.base_dtype=nf4` stores the targeted base weights as torchao's NF4Tensor (QLoRA): 4 bits per
weight plus a scale per 64, dequantized block by block in the forward. `lora.base_dtype=int8`
stores them as torchao's Int8Tensor (weight-only int8, a scale per output row; PEFT wraps such a
layer in its TorchaoLoraLinear).

A head built fresh over the pretrained weights (`model.head=sequence_classification`, or a
classifier whose shape `model.weights` replaced: the model's `fresh_head`) is trained in full
beside the adapters, as PEFT's `modules_to_save` does.

What a checkpoint holds (hooks on the model, so the loop's save, DCP, resume, accel-eval,
accel-sample and accel-export all follow the same rule), when the base is read from a file
(`model=hf`'s `model.path`, `model.weights`): the trainable parameters (the adapters, and any
layer the user did not freeze), every buffer, and `lora_base_fingerprint`: a hash of the base
weights (their names, shapes and a strided sample of each tensor's values, rounded to bf16 so
that a fp32 and a bf16 load of the same folder agree). Loading into a model whose base differs
is refused, naming both fingerprints; the base itself is read again from that file. A base the
run initialised itself (a fresh `model=gpt`, a user's constructor) cannot be read again, so
checkpoints keep it whole.

Applied by the model builder's callers through `apply_lora` (training, accel-eval,
accel-sample, accel-export: each rebuilds the same module), and first in the transform order
(before activation checkpointing, FSDP and compile) as a technique.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import warnings

import torch
from omegaconf import DictConfig
from torch import nn

from accel_train.errors import UserError
from accel_train.techniques import PREPARE, BuildContext, Technique

log = logging.getLogger("accel_train")

FINGERPRINT = "lora_base_fingerprint"
NF4_BLOCK = 64  # weights per NF4 scale (QLoRA's)


def _adaptable(module: nn.Module) -> bool:
    """A Linear, or transformers' Conv1D (GPT-2's layers: a Linear whose weight is stored
    transposed), which PEFT adapts with fan_in_fan_out."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def target_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    """The names of the Linear layers LoRA wraps: `patterns` (module names, name suffixes such as
    `q_proj`, or globs), else every Linear but the output layer (the last one: a causal LM's
    vocabulary projection, a classifier's head), which PEFT's `all-linear` leaves out too:
    adapting it costs much and helps little."""
    linears = [n for n, m in model.named_modules() if _adaptable(m) and n]
    if not patterns:
        return linears[:-1]
    chosen = [n for n in linears if any(_matches(n, str(p)) for p in patterns)]
    if not chosen:
        raise UserError(
            f"lora.target={list(patterns)} names no Linear layer of the model. Its Linear "
            f"layers are {', '.join(linears[:8])}{', ...' if len(linears) > 8 else ''}: give "
            "full names, name endings (q_proj) or globs ('*.mlp.*'), or leave lora.target empty "
            "for every Linear but the output head."
        )
    return chosen


def _check_rank(model: nn.Module, names: list[str], rank: int) -> None:
    """A rank above a layer's smaller side adds more parameters than the layer has, and adapts
    nothing a full update would not: refused, naming the layer, before PEFT allocates it."""
    for name in names:
        side = min(model.get_submodule(name).weight.shape)
        if rank > side:
            raise UserError(
                f"lora.rank={rank} is larger than layer {name}'s smaller side ({side}): a "
                "low-rank update cannot have a rank above that (it would hold more parameters "
                f"than the layer). Use a rank well below it, e.g. `lora.rank={min(16, side)}`, "
                "or leave that layer out with lora.target."
            )


def _matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def base_fingerprint(model: nn.Module) -> torch.Tensor:
    """32 bytes (uint8) naming the frozen base: see the module docstring."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            continue
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 1024)][:1024]
        digest.update(f"{name}:{tuple(p.shape)}".encode())
        digest.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
    return torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8).clone()


def _quantize_base(model: nn.Module, names: list[str], dtype: str) -> int:
    """The targeted layers' base weights as NF4 or int8 (torchao), the layers left as they were
    named (_report_quantized). Returns the bytes saved."""
    try:  # the quant extra; only for a quantized base
        from torchao.quantization import Int8WeightOnlyConfig, quantize_, to_nf4
    except ImportError:
        raise UserError(
            f"lora.base_dtype={dtype} stores the base weights with torchao, and torchao is not "
            'installed: `pip install "accel-train[quant]"`.'
        ) from None
    saved, kept = 0, {}
    for name in names:
        layer = model.get_submodule(name)
        w = layer.weight
        if not isinstance(layer, nn.Linear):
            kept[name] = f"a {type(layer).__name__}, not a Linear"
            continue
        if dtype == "int8":  # int8 values plus a scale per output row
            quantize_(layer, Int8WeightOnlyConfig())  # the layer's weight, in place
            saved += w.numel() * (w.element_size() - 1) - w.shape[0] * w.element_size()
            continue
        blocks = w.numel() // NF4_BLOCK
        if w.numel() % NF4_BLOCK or blocks == 0:  # NF4's blocks must divide the weight
            kept[name] = f"{w.numel()} weights, not a multiple of {NF4_BLOCK}"
            continue
        scaler_block = next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % b == 0)
        q = to_nf4(w.detach(), block_size=NF4_BLOCK, scaler_block_size=scaler_block)
        saved += w.numel() * w.element_size() - w.numel() // 2
        layer.weight = nn.Parameter(q, requires_grad=False)
    _report_quantized(names, kept, dtype)
    return saved


def _report_quantized(names: list[str], kept: dict[str, str], dtype: str) -> None:
    """Which layers a quantized base covers, and why the others stay as they are; none at all
    is refused: the run would save no memory and say it was QLoRA."""
    if len(kept) == len(names):
        first = next(iter(kept.items()))
        raise UserError(
            f"lora.base_dtype={dtype} quantizes none of the {len(names)} adapted layers (e.g. "
            f"{first[0]}: {first[1]}), so the base would stay in full precision. Use "
            "`lora.base_dtype=int8`, adapt Linear layers whose weights divide into blocks of "
            f"{NF4_BLOCK} (lora.target), or drop lora.base_dtype."
        )
    if kept:
        shown = "; ".join(f"{n} ({why})" for n, why in list(kept.items())[:4])
        more = f"; and {len(kept) - 4} more" if len(kept) > 4 else ""
        log.warning(
            "lora: base stored as %s in %d of %d adapted layers; left in the run's precision: %s%s",
            dtype, len(names) - len(kept), len(names), shown, more,
        )  # fmt: skip


def _dense(weight: torch.Tensor) -> torch.Tensor:
    """A quantized base weight (NF4Tensor, Int8Tensor) back to fp32; a dense one as it is."""
    kind = type(weight).__name__
    if kind == "NF4Tensor":
        return weight.get_original_weight().to(torch.float32)
    if kind != "Tensor" and hasattr(weight, "dequantize"):
        return weight.dequantize().to(torch.float32)
    return weight


def base_is_reloadable(model_cfg: DictConfig) -> bool:
    """Whether the base can be read again from where the config says (a pretrained folder, a
    weights file): only then do checkpoints leave it out. A base the run initialised itself
    (a fresh model, a user's constructor) is kept in them."""
    pretrained_folder = model_cfg.get("path") and model_cfg.get("pretrained", True)
    return bool(model_cfg.get("weights") or pretrained_folder)


def apply_lora(model: nn.Module, cfg: DictConfig, keep_base: bool = False) -> nn.Module:
    """Adapters on `model` in place (see the module docstring); returns it. `keep_base`: the
    checkpoints hold the frozen base too (it is not read from a file)."""
    if cfg.base_dtype and keep_base:
        raise UserError(
            f"lora.base_dtype={cfg.base_dtype} quantizes a pretrained base that the run reads "
            "from a file (model=hf's model.path, or model.weights), and this model's weights "
            "are initialised by the run itself, so its checkpoints would have to keep the "
            "quantized base (a tensor type a safe load refuses). Load pretrained weights with "
            "`model.weights=<file>`, or drop lora.base_dtype."
        )
    try:
        from peft import LoraConfig, inject_adapter_in_model  # the hf extra
    except ImportError:
        raise UserError(
            'lora.rank needs the peft package, which is not installed: `pip install "accel-train'
            '[hf]"`.'
        ) from None
    names = target_modules(model, list(cfg.target))
    for p in model.parameters():  # the whole base frozen, the adapters alone trained...
        p.requires_grad_(False)
    head = getattr(model, "fresh_head", None)
    names = [n for n in names if n != head]
    if head:  # (a fresh head is trained, so not part of the base's fingerprint)
        model.get_submodule(head).requires_grad_(True)
    _check_rank(model, names, int(cfg.rank))
    fingerprint = base_fingerprint(model)
    saved = _quantize_base(model, names, cfg.base_dtype) if cfg.base_dtype else 0
    config = LoraConfig(
        r=int(cfg.rank),
        lora_alpha=float(cfg.alpha),
        lora_dropout=float(cfg.dropout),
        target_modules=names,
        # GPT-2's Conv1D layers store the weight transposed (PEFT's fan_in_fan_out)
        fan_in_fan_out=any(type(model.get_submodule(n)).__name__ == "Conv1D" for n in names),
    )
    with warnings.catch_warnings():  # an int8 base's "cannot merge": merge_lora merges it
        warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass")
        inject_adapter_in_model(config, model)  # (which leaves only the adapters trainable)
    if head:  # ...but a head built fresh over the pretrained body (PEFT's modules_to_save)
        model.get_submodule(head).requires_grad_(True)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    for n, p in model.named_parameters():
        if "lora_" in n and dtype is not None:
            p.data = p.data.to(dtype)  # the adapters in the base's dtype (bf16_true: bf16)
    model.register_buffer(FINGERPRINT, fingerprint)
    if not keep_base:  # (a kept base is loaded with the adapters: nothing to compare)
        model.register_load_state_dict_pre_hook(_check_fingerprint)
        model.register_state_dict_post_hook(_drop_frozen)
        model.register_load_state_dict_post_hook(_frozen_not_missing)
    _log_adapters(model, names, cfg, saved, keep_base)
    return model


def _log_adapters(model: nn.Module, names: list[str], cfg: DictConfig, saved: int, keep_base: bool):
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        "lora: rank %d on %d Linear layers (%s); %s trainable parameters%s",
        cfg.rank,
        len(names),
        ", ".join(sorted({n.rsplit(".", 1)[-1] for n in names})),
        f"{trained:,}",
        f"; base stored as {cfg.base_dtype} ({saved / 2**20:.1f} MiB saved)" if saved else "",
    )
    if keep_base:
        log.info(
            "lora: the base is not read from a file (model.weights, model=hf's model.path), so "
            "checkpoints keep it beside the adapters"
        )


def _frozen(module: nn.Module) -> set[str]:
    """Every name of a frozen parameter (a tied one under each of its names)."""
    params = module.named_parameters(remove_duplicate=False)
    return {n for n, p in params if not p.requires_grad}


def _drop_frozen(module, state_dict, prefix, local_metadata) -> None:
    """state_dict(): the frozen base stays out of checkpoints."""
    for name in _frozen(module):
        state_dict.pop(prefix + name, None)


def _check_fingerprint(module, state_dict, prefix, *args) -> None:
    theirs = state_dict.get(prefix + FINGERPRINT)
    ours = getattr(module, FINGERPRINT)
    if theirs is None:
        raise UserError(
            "lora: these weights hold no LoRA base fingerprint: they were not written by a run "
            "with lora.rank > 0. Load them with the lora settings of the run that wrote them."
        )
    if not torch.equal(theirs.cpu(), ours.cpu()):
        raise UserError(
            "lora: the checkpoint's adapters were trained on other base weights (fingerprint "
            f"{bytes(theirs.cpu().tolist()).hex()[:16]}) than the ones this run loaded "
            f"({bytes(ours.cpu().tolist()).hex()[:16]}): the model folder (`model.path`), "
            "`model.weights` or the seed changed. Point them at the base the adapters were "
            "trained on."
        )


def _frozen_not_missing(module, incompatible) -> None:
    """The frozen base is read from its own source, not from the checkpoint."""
    frozen = _frozen(module)
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in frozen]


class Lora(Technique):
    """The build-time transform (first in the order: the adapters exist before activation
    checkpointing, FSDP and compile see the model)."""

    name = "lora"
    order = PREPARE - 5

    def __init__(self, cfg: DictConfig, keep_base: bool):
        self.cfg, self.keep_base = cfg, keep_base

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        return apply_lora(model, self.cfg, self.keep_base)


def lora_for_run(model: nn.Module, cfg: DictConfig) -> nn.Module:
    """What every tool that rebuilds a run's model from its config does after build_model
    (accel-eval, accel-sample, accel-export): the adapters, when the run trained some."""
    lora = cfg.get("lora")
    if lora is None or lora.rank <= 0:
        return model
    return apply_lora(model, lora, keep_base=not base_is_reloadable(cfg.model))


def merge_lora(model: nn.Module) -> nn.Module:
    """The adapters folded into their base weights (a quantized base dequantized first), each
    LoRA layer replaced by its plain Linear, the fingerprint buffer dropped: the architecture as
    it was built, for export."""
    # the hf extra (a LoRA checkpoint needs it anyway)
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    for name, layer in list(model.named_modules()):
        if not isinstance(layer, LoraLayer):
            continue
        base = layer.get_base_layer()
        base.weight = nn.Parameter(_dense(base.weight), requires_grad=False)
        # PEFT's int8 layer would quantize the merged weight again: merged as a plain Linear
        LoraLinear.merge(layer) if isinstance(layer, LoraLinear) else layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, base)
    if FINGERPRINT in model._buffers:
        del model._buffers[FINGERPRINT]
    return model

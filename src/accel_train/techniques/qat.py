"""quant=qat: quantization-aware training with torchao (`accel-train[quant]`).

At build time (PREPARE, before DDP/compile) every ``nn.Linear`` becomes torchao's
``FakeQuantizedLinear``: the forward rounds the activations (int8, per token, asymmetric,
dynamic) and the weights (``quant.weight_bits`` bits, symmetric, per output channel or per
``quant.group_size`` group) and trains through the rounding. Convolutions stay float: torchao's
QAT fake-quantizes Linear (and Embedding) layers only.

The fake quantizers are dynamic (no learned ranges), so a prepared model's state_dict has
exactly the keys of the float one: checkpoints stay plain tensors (safe loading, exact resume,
`accel-eval` of the float weights). `accel-export` rebuilds the model from the checkpoint's
config, prepares it again, loads the weights and applies torchao's *convert* step (real int8
weights, quantize/dequantize ops) before exporting: see accel_train.export.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from accel_train.errors import UserError
from accel_train.techniques import PREPARE, BuildContext, Technique

EXTRA = "quant"  # the pip extra that installs torchao: pip install 'accel-train[quant]'


def _torchao():
    """torchao's QAT API, imported on first use (an optional extra)."""
    # torchao registers Enums with torch's pytree at import, which torch 2.14 logs a
    # deprecation warning for, per Enum: not the user's concern.
    pytree_log = logging.getLogger("torch.utils._pytree")
    level = pytree_log.level
    pytree_log.setLevel(logging.ERROR)
    try:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
        from torchao.quantization.granularity import PerAxis, PerGroup
        from torchao.quantization.qat import QATConfig
    except ImportError as err:
        raise UserError(
            f"quant=qat needs torchao, which is not installed ({err}). Install the extra: "
            f"`pip install 'accel-train[{EXTRA}]'`."
        ) from None
    finally:
        pytree_log.setLevel(level)
    return quantize_, Int8DynamicActivationIntxWeightConfig, PerAxis, PerGroup, QATConfig


def _base_config(quant: DictConfig):
    _, Int8DynActIntx, PerAxis, PerGroup, _ = _torchao()
    granularity = PerGroup(quant.group_size) if quant.group_size > 0 else PerAxis(0)
    return Int8DynActIntx(
        weight_dtype=getattr(torch, f"int{quant.weight_bits}"), weight_granularity=granularity
    )


def check_qat(quant: DictConfig) -> None:
    if not 2 <= quant.weight_bits <= 8:
        raise UserError(
            f"quant.weight_bits={quant.weight_bits}: torchao's QAT fake-quantizes weights to "
            "2..8 bits. Use e.g. `quant.weight_bits=8` or `quant.weight_bits=4`."
        )
    if quant.group_size < 0:
        raise UserError(
            f"quant.group_size={quant.group_size} must be >= 0 (0 = one scale per output "
            "channel), e.g. `quant.group_size=32`."
        )


def linear_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def prepare_qat(model: nn.Module, quant: DictConfig, target: str) -> nn.Module:
    """Swap the model's Linear layers for torchao's fake-quantized ones (in place)."""
    check_qat(quant)
    layers = linear_layers(model)
    if not layers:
        raise UserError(
            f"quant=qat: the model (model._target_={target}) has no nn.Linear layer, and "
            "torchao's QAT fake-quantizes only Linear (and Embedding) layers, so there is "
            "nothing to train for quantization. Drop quant=qat (or use `accel-export "
            "quantize=int8`, which quantizes convolutions too)."
        )
    quantize_, *_, QATConfig = _torchao()
    in_features = {n: m.in_features for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if quant.group_size > 0:
        bad = [n for n, f in in_features.items() if f % quant.group_size]
        if bad:
            raise UserError(
                f"quant.group_size={quant.group_size} does not divide the input size of "
                f"Linear layer(s) {', '.join(f'{n} ({in_features[n]})' for n in bad[:3])}. "
                "Use a divisor, or `quant.group_size=0` (per output channel)."
            )
    quantize_(model, QATConfig(_base_config(quant), step="prepare"))
    return model


def convert_qat(model: nn.Module, quant: DictConfig) -> nn.Module:
    """torchao's convert step: fake-quantized Linear -> Linear with int8 weights (in place)."""
    quantize_, *_, QATConfig = _torchao()
    quantize_(model, QATConfig(_base_config(quant), step="convert"))
    return model


def describe(quant: DictConfig) -> dict[str, Any]:
    """What the card says about a QAT model's quantization."""
    group = f"groups of {quant.group_size}" if quant.group_size > 0 else "per output channel"
    return {
        "method": "qat (torchao QATConfig + Int8DynamicActivationIntxWeightConfig)",
        "layers": "nn.Linear (convolutions stay float)",
        "weights": f"int{quant.weight_bits} symmetric, {group}",
        "activations": "int8 asymmetric, per token, dynamic",
    }


class QAT(Technique):
    name = "qat"
    order = PREPARE  # change the modules before channels_last, DDP/FSDP and compile

    def __init__(self, quant: DictConfig):
        self.quant = quant

    def transform(self, model: nn.Module, ctx: BuildContext) -> nn.Module:
        # (quant=qat with strategy=fsdp is refused at compose: config/combinations.py)
        return prepare_qat(model, self.quant, ctx.cfg.model._target_)

"""Turn `precision=<name>` into what the loop needs on this device: autocast, scaler, dtypes."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch

from accel_train.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    name: str  # the configured option
    device_type: str  # "cuda" or "cpu"
    autocast_dtype: torch.dtype | None  # None = no autocast
    param_dtype: torch.dtype  # bf16 for bf16_true, else fp32
    use_scaler: bool  # dynamic loss scaling (fp16 only)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device_type, enabled=self.use_scaler)

    def describe(self) -> str:
        if self.param_dtype == torch.bfloat16:
            return f"{self.name}: weights and compute in bf16 on {self.device_type}"
        if self.autocast_dtype is None:
            why = " (no native bf16 on this CPU)" if self.name == "amp" else ""
            return f"{self.name}: fp32 on {self.device_type}{why}"
        kind = str(self.autocast_dtype).removeprefix("torch.")
        scaler = " + GradScaler" if self.use_scaler else ""
        return f"{self.name}: {kind} autocast{scaler} on {self.device_type}"


# Overrides the CPU's own answer to "does it have native bf16?" ("0" or "1"): a test (or a user
# who measured otherwise) can take the path a CPU without bf16 instructions takes, on any CPU.
NATIVE_BF16_ENV = "ACCEL_TRAIN_CPU_NATIVE_BF16"


def cpu_has_fast_bf16() -> bool:
    """Native bf16 matmul/conv instructions on this CPU (what oneDNN's bf16 kernels need):
    AVX512-BF16 or AMX, as torch reports them; $ACCEL_TRAIN_CPU_NATIVE_BF16=0/1 overrides."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def fastest_half_or_fp32(device: torch.device) -> torch.dtype:
    """The dtype an internal speed choice (Muon's Newton-Schulz, ...) should compute in on
    `device`: bf16 on CUDA and on a CPU with bf16 instructions, fp32 on any other CPU, where bf16
    is emulated and a bf16 matmul ran ~25-37x slower than fp32 (BENCHMARKS.md); fp32 on a GPU
    without bf16 units (before Ampere) too."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    if device.type == "cpu" and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def emulated_bf16_text(what: str, fix: str) -> str:
    """The one warning for bf16 on a CPU without bf16 instructions, whichever switch asked for
    it (precision, optimizer.ns_dtype; accel-report lists them before it measures): `what` is
    the switch, `fix` what to switch to."""
    return (
        f"{what} on a CPU without bf16 instructions (AVX512-BF16 or AMX): bf16 is emulated "
        f"there, several to tens of times slower than fp32 (convolutions most). {fix}"
    )


AMP_FIX = "`precision=amp` picks bf16 only where the CPU has it, fp32 elsewhere."
FP16_ON_CPU = (
    "precision=fp16 on the CPU: fp16 autocast has few fast CPU kernels and runs several "
    "times slower than fp32. `precision=amp` picks bf16 on the CPU."
)


def precision_emulation(name: str, device_type: str) -> str | None:
    """The warning `precision=<name>` gets on this machine's `device_type` ("cpu"/"cuda"), or
    None where it runs at the device's speed (what accel-report lists before it measures)."""
    if device_type != "cpu":
        return None
    if name == "fp16":
        return FP16_ON_CPU
    if name in ("bf16", "bf16_true") and not cpu_has_fast_bf16():
        return emulated_bf16_text(f"precision={name}", AMP_FIX)
    return None


def resolve_precision(name: str, device: torch.device, tf32: bool = True) -> Precision:
    dev = device.type
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        if name in ("bf16", "bf16_true") and not torch.cuda.is_bf16_supported():
            raise UserError(
                f"precision={name}: this GPU ({torch.cuda.get_device_name(device)}) has no bf16 "
                "support. Use `precision=amp` (fp16 autocast + GradScaler) or `precision=fp32`."
            )
    if name == "amp":
        # fp16 on CUDA (tensor cores, needs loss scaling). On a CPU, bf16 where it has bf16
        # instructions (AVX512-BF16 or AMX: ~1.5x faster than fp32); elsewhere (AVX2 only) bf16
        # autocast is emulated and ~5x SLOWER than fp32 (BENCHMARKS.md), so amp means fp32 there.
        # fp16 autocast has no fast CPU kernels at all.
        cpu_choice = "bf16" if cpu_has_fast_bf16() else "fp32"
        name_used = "fp16" if dev == "cuda" else cpu_choice
        resolved = resolve_precision(name_used, device, tf32)
        return Precision("amp", dev, resolved.autocast_dtype, torch.float32, resolved.use_scaler)
    slow = precision_emulation(name, dev)
    if slow:
        log.warning("%s", slow)
    if name == "fp32":
        return Precision(name, dev, None, torch.float32, False)
    if name == "fp16":
        return Precision(name, dev, torch.float16, torch.float32, True)
    if name == "bf16":
        return Precision(name, dev, torch.bfloat16, torch.float32, False)
    assert name == "bf16_true", name
    return Precision(name, dev, None, torch.bfloat16, False)

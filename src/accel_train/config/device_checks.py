"""Switches that only a CUDA run can use (issue 41): activation offloading
(`activation_checkpointing.offload`) and Liger's fused kernels (`model.liger`). Each is refused
before any process starts, in one paragraph that says where it applies, when the run's device is
the CPU (trainer.device=cpu, or no usable CUDA device with trainer.device=auto), and where it
cannot work at all (Liger for a model type it has no kernels for, or not installed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from accel_train.errors import UserError

# model_type (a folder's config.json) -> Liger's `apply_liger_kernel_to_<model_type>` exists
# (liger_kernel.transformers.monkey_patch); models/hf.py calls it.
LIGER_MODEL_TYPES = ("llama", "qwen2", "mistral", "gemma", "gemma2")


def cpu_run(cfg: DictConfig) -> str | None:
    """Why the run's device is the CPU (None: it is a CUDA device)."""
    if cfg.trainer.device == "cpu":
        return "trainer.device=cpu"
    import torch  # only for these switches: a refused config should not wait for torch

    if not torch.cuda.is_available():
        return (
            f"this machine has no usable CUDA device (torch {torch.__version__}, "
            "torch.cuda.is_available() is False)"
        )
    return None


def check_activation_offload(cfg: DictConfig) -> None:
    if not OmegaConf.select(cfg, "activation_checkpointing.offload"):
        return
    if cfg.strategy.name == "pipeline":
        raise UserError(
            "activation_checkpointing.offload=true with strategy=pipeline is not supported: the "
            "pipeline schedule runs each micro-batch's forward itself, outside the step the "
            "offloading wraps. Use `strategy=ddp` or `strategy=fsdp`, or set `activation_"
            "checkpointing.offload=false` (activation_checkpointing.mode=full works with the "
            "pipeline)."
        )
    why = cpu_run(cfg)
    if why:
        raise UserError(
            "activation_checkpointing.offload=true moves what the forward saves for the "
            "backward from GPU memory to pinned host memory and back, which only means "
            f"something on a CUDA device, but {why}. Set `activation_checkpointing.offload="
            "false` here (activation_checkpointing.mode=full saves memory on the CPU too), or "
            "run on a machine with a CUDA GPU."
        )


def check_liger(cfg: DictConfig) -> None:
    if not OmegaConf.select(cfg, "model.liger"):
        return
    kind = _model_type(cfg.model.get("path"))
    if kind is not None and kind not in LIGER_MODEL_TYPES:
        raise UserError(
            f"model.liger=true: model.path={cfg.model.path} is model_type={kind}, and "
            "accel-train applies Liger's kernels to model types "
            f"{', '.join(LIGER_MODEL_TYPES)} only (Llama, Qwen2, Mistral, Gemma). Set "
            "`model.liger=false` for this model."
        )
    why = cpu_run(cfg)
    if why:
        raise UserError(
            "model.liger=true swaps a Hugging Face model's RMSNorm, rotary embedding and "
            "SwiGLU/GeGLU MLP for Liger's Triton kernels, which run on CUDA devices only, but "
            f"{why}. Set `model.liger=false` here, or run on a machine with a CUDA GPU."
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError(
            "model.liger=true needs the liger-kernel package, which is not installed: "
            "`pip install liger-kernel` (CUDA machines), or set `model.liger=false`."
        )


def _model_type(path) -> str | None:
    """config.json's model_type of a model folder (None when it cannot be read here: the
    build reports a missing or broken folder with its own message)."""
    try:
        config = json.loads((Path(str(path)).expanduser() / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    kind = config.get("model_type") if isinstance(config, dict) else None
    return str(kind) if kind else None

"""`accel-export format=peft`: the LoRA adapters of a `model=hf` run alone, as PEFT writes them
(`adapter_model.safetensors`, `adapter_config.json`), for `PeftModel.from_pretrained(base,
folder)` over the base folder the run trained on: megabytes to share instead of the whole model.

The run injected its adapters with PEFT's `inject_adapter_in_model` into the model it wraps
(`HFModel.hf`), so PEFT's own `get_peft_model_state_dict` reads them; only the names change,
from the run's (`hf.model.layers.0...`) to a PeftModel's (`base_model.model.model.layers.0...`).
Before the folder is put in place, transformers loads the base, PEFT loads the adapters onto it,
and its logits are compared with the checkpoint's model on seeded ids (the card's
`max_abs_diff`, fp32): the same check, and the same folder rules, as `format=hf`
(export_hf.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from accel_train.errors import UserError
from accel_train.export_hf import (
    CARD,
    HF_TARGET,
    MAX_ABS_DIFF,
    export_folder,
    probe_ids,
    refuse_non_hf,
    refuse_read_folders,
)
from accel_train.models.hf import HFModel
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.written import check_out_folder, install

log = logging.getLogger("accel_train")

COMMAND = "accel-export format=peft"  # who the folder's manifest says wrote it
ADAPTERS = "adapter_model.safetensors"
RUN_PREFIX, PEFT_PREFIX = "hf.", "base_model.model."  # HFModel's attribute; PeftModel's


def _refuse_without_adapters(ckpt_path: Path, cfg: DictConfig) -> None:
    lora = cfg.get("lora")
    if lora is None or int(lora.rank) <= 0:
        raise UserError(
            f"ckpt_path={ckpt_path}: format=peft writes a run's LoRA adapters, and this run "
            "trained none (lora.rank=0: every weight was trained). Export the whole model with "
            "`format=hf`."
        )
    if cfg.model.get("head", "causal_lm") != "causal_lm":
        raise UserError(
            f"ckpt_path={ckpt_path}: format=peft writes adapters for a causal LM, and this run "
            f"trained a fresh model.head={cfg.model.head} beside them, which an adapter folder "
            "does not hold. Export the whole model with `format=hf`."
        )


def export_peft(ecfg: DictConfig, ckpt_path: Path) -> dict[str, Any]:
    opened = RunCheckpoint(ckpt_path)
    cfg = opened.cfg
    if str(cfg.model.get("_target_")) != HF_TARGET:  # before a model is built for nothing
        raise refuse_non_hf(ckpt_path, cfg, "format=peft writes a run's LoRA adapters, which needs")
    _refuse_without_adapters(ckpt_path, cfg)
    out = export_folder(ecfg, ckpt_path)
    given = str(ecfg.out_path or out)  # as the user spelled it
    refuse_read_folders(out, cfg, ckpt_path, given, "peft")
    check_out_folder(out, "out_path", COMMAND, bool(ecfg.overwrite), "exports/my-adapters", given)
    model = opened.model({}, torch.float32)
    ids = probe_ids(model)
    with torch.no_grad():  # the checkpoint's model as trained: adapters beside the base
        reference = model(ids)
    t0 = time.perf_counter()
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir()
        _write_adapters(model, partial)
        diff = _verify(model, partial, ids, reference)
        card = {
            "format": "peft",
            "ckpt_path": str(ckpt_path),
            "out_path": str(out),
            "base": model.path,
            "base_dtype_in_training": cfg.lora.get("base_dtype"),
            "max_abs_diff": diff,
            "export_s": round(time.perf_counter() - t0, 3),
        }
        (partial / CARD).write_text(json.dumps(card, indent=2) + "\n")
        _check_faithful(diff, cfg, out)
        install(partial, out, COMMAND, "out_path", last=CARD, shown=given)
    except OSError as err:  # the folder checked writable, then not (a full disk, a race)
        raise UserError(
            f"out_path={out}: the adapters could not be written ({err.strerror or err}). Give a "
            "writable folder with `out_path=...`."
        ) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info(
        "format=peft: %s (adapters for %s; PEFT's logits match to %.1e)", out, model.path, diff
    )
    return card


def _write_adapters(model: HFModel, folder: Path) -> None:
    """The adapter weights under a PeftModel's names and PEFT's config for them, relative to the
    transformers model (the run's target names start at HFModel)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model, adapter_name="default")
    tensors = {
        PEFT_PREFIX + k.removeprefix(RUN_PREFIX): v.detach().float().contiguous().cpu()
        for k, v in state.items()
    }
    config = model.peft_config["default"]
    config.target_modules = sorted(str(n).removeprefix(RUN_PREFIX) for n in config.target_modules)
    config.base_model_name_or_path = str(model.path)
    config.task_type = "CAUSAL_LM"
    config.inference_mode = True
    config.save_pretrained(folder)
    save_file(tensors, folder / ADAPTERS, metadata={"format": "pt"})


def _verify(model: HFModel, folder: Path, ids: torch.Tensor, reference: torch.Tensor) -> float:
    """Max abs difference of the logits: the base folder with PEFT's load of the adapters vs
    the checkpoint's model."""
    from peft import PeftModel

    base = type(model.hf).from_pretrained(
        model.path, local_files_only=True, trust_remote_code=False, dtype=torch.float32
    )
    loaded = PeftModel.from_pretrained(base, folder, is_trainable=False).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=ids, use_cache=False).logits
    return float((reference - theirs).abs().max())


def _check_faithful(diff: float, cfg: DictConfig, out: Path) -> None:
    """A quantized base (QLoRA) trained against its dequantized weights: PEFT loads the adapters
    onto the full-precision base, so the logits differ by the quantization; said, not refused."""
    if cfg.lora.get("base_dtype"):
        log.warning(
            "format=peft: the adapters were trained on a %s base; over the full-precision base "
            "folder PEFT's logits differ from the run's by %.2e (format=hf merges them into the "
            "dequantized base instead)",
            cfg.lora.base_dtype,
            diff,
        )
        return
    if diff > MAX_ABS_DIFF:
        raise UserError(
            f"format=peft: PEFT's logits over the base folder differ from the checkpoint's "
            f"model by {diff:.2e} (more than {MAX_ABS_DIFF:g} in fp32): the adapters would not "
            f"reproduce the run, so nothing was written to {out}. Report this with the model's "
            "architecture; `format=hf` exports the merged model."
        )

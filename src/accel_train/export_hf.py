"""`accel-export format=hf`: a `model=hf` checkpoint -> a Hugging Face folder (config.json,
model.safetensors, the tokenizer and its chat template) that `from_pretrained` loads, with the
LoRA adapters folded into the weights (an NF4 base dequantized first).

The folder is written beside its final name and renamed into place when complete, so a failed
export leaves no half-written folder. Before that it is loaded back by transformers and run next
to the checkpoint's model on seeded token ids: the max abs difference of the logits (fp32) goes
into the card (`accel_export.json` in the folder), and an export above `MAX_ABS_DIFF` fails. An
existing folder is replaced only with `overwrite=true` and only when it is an earlier export
(its card is there), never a folder of other files.
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
from accel_train.models.hf import HFModel, load_tokenizer
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.techniques.lora import merge_lora

log = logging.getLogger("accel_train")

MAX_ABS_DIFF = 1e-4  # fp32 logits of the folder vs the checkpoint's model
CARD = "accel_export.json"


def _refuse_non_hf(ckpt_path: Path, cfg: DictConfig):
    def check(model) -> None:
        if not isinstance(model, HFModel):
            raise UserError(
                f"ckpt_path={ckpt_path}: format=hf writes a Hugging Face folder, which needs a "
                f"model=hf checkpoint; this one's model is {cfg.model.get('name')} "
                f"({cfg.model._target_}). Use format=torch_export or format=onnx."
            )

    return check


def export_hf(ecfg: DictConfig, ckpt_path: Path) -> dict[str, Any]:
    opened = RunCheckpoint(ckpt_path)
    cfg = opened.cfg
    out = _out_folder(ecfg, ckpt_path)
    model = opened.model({}, torch.float32, before_load=_refuse_non_hf(ckpt_path, cfg))
    ids = _probe_ids(model)
    with torch.no_grad():  # the checkpoint's model as trained: adapters beside the base
        reference = model(ids)
    model = merge_lora(model)
    tokenizer = load_tokenizer(model.path, "model.path")
    t0 = time.perf_counter()
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        model.hf.save_pretrained(partial, safe_serialization=True)
        tokenizer.save_pretrained(partial)
        diff = _verify(model, partial, ids, reference)
        card = {
            "format": "hf",
            "ckpt_path": str(ckpt_path),
            "out_path": str(out),
            "lora_merged": bool(cfg.get("lora") and cfg.lora.rank > 0),
            "base": model.path,
            "max_abs_diff": diff,
            "export_s": round(time.perf_counter() - t0, 3),
        }
        (partial / CARD).write_text(json.dumps(card, indent=2) + "\n")
        if diff > MAX_ABS_DIFF:
            raise UserError(
                f"format=hf: the folder's logits differ from the checkpoint's model by {diff:.2e} "
                f"(more than {MAX_ABS_DIFF:g} in fp32): the export is not faithful, so nothing "
                f"was written to {out}. Report this with the model's architecture."
            )
        _move_into_place(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("format=hf: %s (merged weights and tokenizer; logits match to %.1e)", out, diff)
    return card


def _out_folder(ecfg: DictConfig, ckpt_path: Path) -> Path:
    out = Path(ecfg.out_path).expanduser() if ecfg.out_path else None
    out = out or ckpt_path.with_name(f"{ckpt_path.name.split('.')[0]}-hf")
    if out.exists() and not (ecfg.overwrite and (out / CARD).is_file()):
        fix = (
            "it is not a folder this command wrote (no accel_export.json in it), so it is never "
            "replaced"
            if ecfg.overwrite
            else "replace it with `overwrite=true` if it is an earlier format=hf export"
        )
        raise UserError(
            f"out_path={out} already exists: {fix}. Remove it or give another out_path."
        )
    if not out.parent.is_dir():
        raise UserError(f"out_path={out}: its parent folder {out.parent} does not exist.")
    return out


def _move_into_place(partial: Path, out: Path) -> None:
    """The complete folder takes the name; an earlier export there (overwrite=true) is moved
    aside first and removed only once the new one is in place."""
    old = out.with_name(f".{out.name}.old")
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _probe_ids(model: HFModel) -> torch.Tensor:
    vocab = int(model.hf.config.vocab_size)
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))


def _verify(model: HFModel, folder: Path, ids: torch.Tensor, reference: torch.Tensor) -> float:
    """Max abs difference of the logits: the folder loaded by transformers vs the checkpoint's
    model before its adapters were merged."""
    loaded = (
        type(model.hf)
        .from_pretrained(
            folder, local_files_only=True, trust_remote_code=False, dtype=torch.float32
        )
        .eval()
    )
    with torch.no_grad():
        theirs = loaded(input_ids=ids, use_cache=False).logits
    return float((reference - theirs).abs().max())

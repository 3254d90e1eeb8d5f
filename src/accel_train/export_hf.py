"""`accel-export format=hf`: a `model=hf` checkpoint -> a Hugging Face folder (config.json,
model.safetensors, the tokenizer and its chat template) that `from_pretrained` loads, with the
LoRA adapters folded into the weights (an NF4 base dequantized first).

The folder is written beside its final name and moved into place when complete, so a failed
export leaves no half-written folder. Before that it is loaded back by transformers and run next
to the checkpoint's model on seeded token ids: the max abs difference of the logits (fp32) goes
into the card (`accel_export.json` in the folder), and an export above `MAX_ABS_DIFF` fails. An
existing folder is written only with `overwrite=true` and only when it is an earlier export,
and then only the files the export listed there are replaced (written.py): a README or anything
else the user put in it stays. The folders the checkpoint reads (its base model, its tokenizer)
are never written, nor a folder inside or around them, whatever `overwrite` says.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from accel_train.command_checks import default_export_path
from accel_train.errors import UserError
from accel_train.models.hf import HFModel, hf_model, load_tokenizer
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.techniques.lora import merge_lora
from accel_train.written import check_out_folder, install

log = logging.getLogger("accel_train")

MAX_ABS_DIFF = 1e-4  # fp32 logits of the folder vs the checkpoint's model
CARD = "accel_export.json"
COMMAND = "accel-export format=hf"  # who the folder's manifest says wrote it
HF_TARGET = f"{hf_model.__module__}.{hf_model.__name__}"
# The folders a model=hf checkpoint reads: its base model and its data's tokenizer.
READS = ("model.path", "dataset.tokenizer")


WRITES_FOLDER = (
    "format=hf writes a Hugging Face folder (config.json, model.safetensors, the tokenizer), "
    "which needs"
)


def refuse_non_hf(ckpt_path: Path, cfg: DictConfig, what: str = WRITES_FOLDER) -> UserError:
    """format=hf/peft on another model: what it needs, and what exports this run instead (a
    language model's torch.export or ONNX artifact takes token ids)."""
    name = cfg.model.get("name") or cfg.model.get("_target_")
    return UserError(
        f"ckpt_path={ckpt_path}: {what} a model=hf checkpoint (a model loaded from a Hugging "
        f"Face folder); this one's model is {name} ({cfg.model.get('_target_')}), which has no "
        "such layout. Export this run with `format=torch_export` or `format=onnx`."
    )


def _refuse_non_hf(ckpt_path: Path, cfg: DictConfig):
    def check(model) -> None:
        if not isinstance(model, HFModel):
            raise refuse_non_hf(ckpt_path, cfg)

    return check


def refuse_read_folders(
    out: Path, cfg: DictConfig, ckpt_path: Path, given: str, fmt: str = "hf"
) -> None:
    """`out` is never the checkpoint, its base model or its tokenizer, nor a folder inside or
    around one of them: the base's weights would be replaced, and with them every run and
    LoRA checkpoint built on it (whatever `overwrite` says)."""
    at = out.expanduser().resolve()
    reads = [(key, str(OmegaConf.select(cfg, key))) for key in READS if OmegaConf.select(cfg, key)]
    reads.append(("ckpt_path", str(ckpt_path)))
    default = default_export_path(ckpt_path, fmt)
    for key, value in reads:
        folder = Path(value).expanduser().resolve()
        if at == folder or at in folder.parents or folder in at.parents:
            where = "is" if at == folder else "holds" if at in folder.parents else "is inside"
            raise UserError(
                f"out_path={given} {where} {key}={value}, which the checkpoint being exported "
                "reads (its base model, tokenizer or weights): writing there would replace "
                "them, and every run and checkpoint built on them, so it is never done, "
                "whatever `overwrite` says. Write the export elsewhere, e.g. leave out_path "
                f"out (the folder then goes beside the checkpoint: {default})."
            )


def export_hf(ecfg: DictConfig, ckpt_path: Path) -> dict[str, Any]:
    opened = RunCheckpoint(ckpt_path)
    cfg = opened.cfg
    if str(cfg.model.get("_target_")) != HF_TARGET:  # before a model is built for nothing
        raise refuse_non_hf(ckpt_path, cfg)
    out = export_folder(ecfg, ckpt_path)
    given = str(ecfg.out_path or out)  # as the user spelled it
    refuse_read_folders(out, cfg, ckpt_path, given)
    check_out_folder(out, "out_path", COMMAND, bool(ecfg.overwrite), "exports/my-model", given)
    model = opened.model({}, torch.float32, before_load=_refuse_non_hf(ckpt_path, cfg))
    ids = probe_ids(model)
    with torch.no_grad():  # the checkpoint's model as trained: adapters beside the base
        reference = model(ids)
    model = merge_lora(model)
    # with the chat template the run trained with (dataset.chat_template), when not the folder's
    tokenizer = load_tokenizer(model.path, "model.path", cfg.dataset.get("chat_template"))
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
        install(partial, out, COMMAND, "out_path", last=CARD, shown=given)
    except OSError as err:  # the folder checked writable, then not (a full disk, a race)
        raise UserError(
            f"out_path={out}: the export could not be written ({err.strerror or err}). Give a "
            "writable folder with `out_path=...`."
        ) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("format=hf: %s (merged weights and tokenizer; logits match to %.1e)", out, diff)
    return card


def export_folder(ecfg: DictConfig, ckpt_path: Path) -> Path:
    """out_path, or beside the checkpoint (checkpoints/best-hf, best-peft)."""
    out = Path(ecfg.out_path).expanduser() if ecfg.out_path else None
    out = out or default_export_path(ckpt_path, ecfg.format)
    if not out.parent.is_dir():
        raise UserError(f"out_path={out}: its parent folder {out.parent} does not exist.")
    return out


def probe_ids(model: HFModel) -> torch.Tensor:
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

"""`accel-eval harness.tasks=[...]`: a run's checkpoint (`ckpt_path`, LoRA merged in memory) or a
Hugging Face folder (`model_path`: the base, to compare a fine-tuned run with) scored by
lm-evaluation-harness (models/harness.py); its table printed, its JSON results written beside
the checkpoint (`harness_<ckpt name>.json`) or, for a folder, in the current directory
(`harness_<folder name>.json`), or at `out_path`. A file there that accel-eval did not write is
never replaced."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from accel_train.command_checks import check_sources as check_sources
from accel_train.config.text_checks import check_harness_keys
from accel_train.errors import UserError
from accel_train.models.harness import HarnessTasks, run_harness, table
from accel_train.models.harness_lm import harness_lm
from accel_train.models.hf import hf_model, load_tokenizer
from accel_train.precision import resolve_precision
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.techniques.lora import merge_lora
from accel_train.written import make_parents, remove_empty

log = logging.getLogger("accel_train")

MARK = "accel_eval"  # the key that makes a JSON file one of ours (replaceable)


def evaluate_harness(ecfg: DictConfig, device: torch.device) -> dict[str, Any]:
    """The body of `accel-eval harness.tasks=[...]`."""
    h = ecfg.harness
    check_harness_keys(h, "harness")
    out = _out_path(ecfg)
    if out.exists():
        _refuse_foreign(out, given=bool(ecfg.out_path))
    # The tasks first: a misspelt task or missing data fails before the model is loaded.
    tasks = HarnessTasks(list(h.tasks), h.include_path, "harness.tasks")
    model, tok, autocast, source = _open_model(ecfg, device)
    generate = _greedy(model, tok)
    lm = harness_lm(
        model, generate, tok, device, max_length=model.block_size or 2048,
        batch_size=h.batch_size, autocast=autocast,
    )  # fmt: skip
    results = run_harness(lm, tasks, limit=h.limit, num_fewshot=h.num_fewshot, chat=h.chat)
    print(table(results))  # the result first: a failed write below still leaves it on screen
    results[MARK] = source
    _write(results, out, given=bool(ecfg.out_path))
    log.info("harness results -> %s", out)
    return results


def _greedy(model, tok):
    def generate(ids: torch.Tensor, new: int) -> torch.Tensor:
        # transformers' generate with the KV cache, stopping at the tokenizer's eos
        return model.generate_ids(
            ids, new, temperature=0.0, top_k=None, top_p=1.0, eos_token_id=tok.eos_token_id
        )

    return generate


def _open_model(ecfg: DictConfig, device: torch.device):
    """(model, tokenizer, autocast, what it is) for a folder or a run's checkpoint."""
    if ecfg.model_path:  # the base: fp32 weights, no autocast
        tok = load_tokenizer(str(ecfg.model_path), "model_path")
        model = hf_model(path=str(ecfg.model_path)).to(device).eval()
        precision = resolve_precision("fp32", device)
        return model, tok, precision.autocast, {"model_path": str(ecfg.model_path)}
    ckpt_path = Path(ecfg.ckpt_path).expanduser()
    opened = RunCheckpoint(ckpt_path, redo="Evaluate it with the version that wrote it.")
    cfg = opened.cfg
    if not cfg.dataset.get("tokenizer"):
        raise UserError(
            f"ckpt_path={ckpt_path}: harness.tasks scores a model fine-tuned from a Hugging "
            "Face folder (model=hf with dataset=sft, whose dataset.tokenizer names the "
            f"tokenizer), and this run trained {cfg.model.get('name') or cfg.model._target_} "
            f"on dataset={cfg.dataset.get('name') or 'custom'}, which has none. Score its own "
            "split without harness.tasks (e.g. `split=val`)."
        )
    tok = load_tokenizer(
        str(cfg.dataset.tokenizer),
        "the checkpoint's dataset.tokenizer",
        cfg.dataset.get("chat_template"),  # the template the run trained with
    )
    precision = resolve_precision(cfg.precision.name, device, cfg.precision.tf32)
    model = opened.model({"vocab_size": len(tok)}, precision.param_dtype, device)
    if cfg.lora.rank > 0:
        model = merge_lora(model)  # one plain Linear per layer: the model as exported
    source = {"ckpt_path": str(ckpt_path), "step": opened.state["progress"]["step"]}
    return model, tok, precision.autocast, source


def _out_path(ecfg: DictConfig) -> Path:
    if ecfg.out_path:
        return Path(ecfg.out_path).expanduser()
    if ecfg.model_path:
        return Path(f"harness_{Path(str(ecfg.model_path)).expanduser().resolve().name}.json")
    ckpt = Path(ecfg.ckpt_path).expanduser()
    folder = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return folder / f"harness_{ckpt.name.split('.')[0]}.json"


def _refuse_foreign(out: Path, given: bool) -> None:
    try:
        earlier = json.loads(out.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        earlier = None
    if not (isinstance(earlier, dict) and MARK in earlier):
        key = "out_path" if given else "out_path (by default beside the checkpoint)"
        raise UserError(
            f"{key}={out} exists and is not an accel-eval harness result: accel-eval replaces "
            "only its own result files. Choose another `out_path` (e.g. "
            "`out_path=harness_result.json`)."
        )


def _write(results: dict[str, Any], out: Path, given: bool) -> None:
    from lm_eval.utils import handle_non_serializable  # (imported by run_harness already)

    made: list[Path] = []
    try:
        made = make_parents(out)
        text = json.dumps(results, indent=2, default=handle_non_serializable)
        out.write_text(text + "\n")
    except OSError as err:
        remove_empty(made)
        key = "out_path" if given else "out_path (by default beside the checkpoint)"
        raise UserError(
            f"{key}={out}: the results could not be written ({err.strerror or err}); the table "
            "is printed above. Give a writable file path with `out_path=...`."
        ) from None

"""The body of `accel-sample`: text from a language-model checkpoint.

The checkpoint is read with the safe loader (weights and plain data only: nothing in it runs);
the model is rebuilt from the config stored in it and the tokenizer from the copy the checkpoint
keeps (the task's checkpoint_data); a checkpoint without one (written before) falls back to its
token folder's meta.json or, for token shards (dataset=streaming_tokens), the copy the shard
index keeps (JSON only either way). The same seed gives the same text.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from accel_train.checkpoint import load_checkpoint
from accel_train.config.run_config import typed
from accel_train.data.streaming_tokens import dataset_tokenizer
from accel_train.data.tokenizer import CharTokenizer, tokenizer_from_meta
from accel_train.data.tokens import window_splits
from accel_train.errors import UserError
from accel_train.models import build_model
from accel_train.models.generate import generate
from accel_train.parallel import resolve_device
from accel_train.precision import resolve_precision
from accel_train.targets import locate
from accel_train.train.evaluate import _load_weights

log = logging.getLogger("accel_train")


def sample_checkpoint(scfg: DictConfig) -> list[str]:
    ckpt_path = _check(scfg)
    state = load_checkpoint(ckpt_path, key="ckpt_path")
    cfg = typed(state["config"])
    task_class = locate(str(cfg.task._target_), "task._target_")
    if not getattr(task_class, "generates_text", False):
        raise UserError(
            f"ckpt_path={ckpt_path} is not a language model's checkpoint (its task is "
            f"{cfg.task.get('name') or cfg.task._target_}): accel-sample samples text from runs "
            "trained with task=language_model (e.g. `+experiment=gpt_char`)."
        )
    kept = (state.get("task") or {}).get("tokenizer")
    if kept:  # the checkpoint's own copy: no data needed
        where = f"kept in {ckpt_path}"
        tokenizer = tokenizer_from_meta(kept["meta"], where, kept.get("bpe_json"))
    else:  # written before checkpoints kept it, or data without a tokenizer file
        tokenizer, where = dataset_tokenizer(cfg.dataset, scfg.data_dir or cfg.paths.data_dir)
    device = resolve_device(scfg.device, key="device")
    # What the token data told the model in training.
    model = build_model(cfg.model, window_splits(None, None, tokenizer.vocab_size).data_args)
    precision = resolve_precision(cfg.precision.name, device, cfg.precision.tf32)
    model = model.to(device, dtype=precision.param_dtype)
    _load_weights(model, state["model"], ckpt_path, cfg)
    model.eval()
    block_size = int(cfg.model.get("block_size", getattr(model, "block_size", 0)) or 0)
    if block_size < 1:
        raise UserError(
            f"ckpt_path={ckpt_path}: its model config names no block_size (the context length)."
        )

    prompt = str(scfg.prompt)
    if isinstance(tokenizer, CharTokenizer) and tokenizer.unknown(prompt):
        missing = "".join(tokenizer.unknown(prompt)[:20])
        raise UserError(
            f"prompt: the character(s) {missing!r} are not in this model's vocabulary (a char "
            f"tokenizer of {tokenizer.vocab_size} characters, {where}). Leave "
            "them out of the prompt."
        )
    ids = tokenizer.encode(prompt).tolist() if prompt else []
    if not ids:  # an empty prompt: start from the first token of the vocabulary (a newline)
        ids = [0]
    if len(ids) > block_size:
        log.warning(
            "prompt: %d tokens, longer than the model's context (block_size=%d): only its last "
            "%d tokens are seen.",
            len(ids),
            block_size,
            block_size,
        )
    generator = torch.Generator(device=device).manual_seed(scfg.seed)
    start = torch.tensor([ids] * scfg.num_samples, dtype=torch.long, device=device)
    with precision.autocast():
        out = generate(
            model,
            start,
            scfg.max_new_tokens,
            block_size=block_size,
            temperature=scfg.temperature,
            top_k=scfg.top_k or None,
            top_p=scfg.top_p,
            generator=generator,
        )
    texts = [tokenizer.decode(row.tolist()) for row in out]
    for i, text in enumerate(texts):
        if scfg.num_samples > 1:
            print(f"---------- sample {i + 1}")
        print(text)
    return texts


def _check(scfg: DictConfig) -> Path:
    if OmegaConf.is_missing(scfg, "ckpt_path") or not scfg.ckpt_path:
        raise UserError(
            "ckpt_path is required: a language model's checkpoint, e.g. `accel-sample "
            "ckpt_path=outputs/<run>/checkpoints/best.pt prompt='def '`."
        )
    path = Path(scfg.ckpt_path).expanduser()
    if not path.is_file():
        raise UserError(
            f"ckpt_path={path}: no such file. Give a .pt written by accel-train, e.g. "
            "outputs/<run>/checkpoints/best.pt."
        )
    for key, ok, rule in (
        ("max_new_tokens", scfg.max_new_tokens >= 1, ">= 1"),
        ("temperature", scfg.temperature >= 0, ">= 0 (0 = greedy)"),
        ("top_k", scfg.top_k >= 0, ">= 0 (0 = off)"),
        ("top_p", 0 < scfg.top_p <= 1, "in (0, 1] (1 = off)"),
        ("num_samples", scfg.num_samples >= 1, ">= 1"),
    ):
        if not ok:
            raise UserError(f"{key}={scfg[key]} must be {rule}.")
    return path

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

from accel_train.data.text.dataset_tokenizer import dataset_tokenizer
from accel_train.data.text.tokenizer import CharTokenizer, tokenizer_from_meta
from accel_train.data.text.tokens import window_splits
from accel_train.errors import UserError
from accel_train.models.generate import generate
from accel_train.models.hf import load_tokenizer
from accel_train.parallel import resolve_device
from accel_train.precision import resolve_precision
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.targets import locate

log = logging.getLogger("accel_train")


def sample_checkpoint(scfg: DictConfig, texts: dict[str, str] | None = None) -> list[str]:
    """`texts`: the free-text keys (prompt, system) as the command line gave them, verbatim
    (the CLI takes them out of the overrides: config/free_text.py); absent ones: the config's."""
    texts = texts or {}
    prompt = texts.get("prompt", str(scfg.prompt))
    ckpt_path = _check(scfg)
    # A sharded checkpoint (FSDP, TP, FSDP x TP: a .dcp directory) is consolidated into this
    # one process's model; its meta.pt holds the rest.
    opened = RunCheckpoint(ckpt_path)
    cfg = opened.cfg
    task_class = locate(str(cfg.task._target_), "task._target_")
    if not getattr(task_class, "generates_text", False):
        raise UserError(
            f"ckpt_path={ckpt_path} is not a language model's checkpoint (its task is "
            f"{cfg.task.get('name') or cfg.task._target_}): accel-sample samples text from runs "
            "trained with task=language_model (e.g. `+experiment=gpt_char`)."
        )
    if cfg.dataset.get("tokenizer"):  # dataset=sft: the model folder's own tokenizer
        system = texts.get("system", scfg.system)
        return _sample_chat_model(scfg, opened, prompt, system)
    return _sample_token_model(scfg, opened, prompt, ckpt_path)


def _sample_token_model(
    scfg: DictConfig, opened: RunCheckpoint, prompt: str, ckpt_path: Path
) -> list[str]:
    """A model trained on a token folder: the checkpoint's own tokenizer (else the data's),
    the prompt encoded and sampled `scfg.num_samples` times."""
    cfg, state = opened.cfg, opened.state
    kept = (state.get("task") or {}).get("tokenizer")
    if kept:  # the checkpoint's own copy: no data needed
        where = f"kept in {ckpt_path}"
        tokenizer = tokenizer_from_meta(kept["meta"], where, kept.get("bpe_json"))
    else:  # written before checkpoints kept it, or data without a tokenizer file
        tokenizer, where = dataset_tokenizer(cfg.dataset, scfg.data_dir or cfg.paths.data_dir)
    if scfg.chat:
        raise UserError(
            f"chat=true renders the prompt with a chat template, and ckpt_path={ckpt_path} was "
            f"trained on a token folder ({where}), whose tokenizer has none. Drop chat=true."
        )
    device = resolve_device(scfg.device, key="device")
    precision = resolve_precision(cfg.precision.name, device, cfg.precision.tf32)
    # What the token data told the model in training.
    data_args = window_splits(None, None, tokenizer.vocab_size).data_args
    model = opened.model(data_args, precision.param_dtype, device)
    block_size = int(cfg.model.get("block_size", getattr(model, "block_size", 0)) or 0)
    if block_size < 1:
        raise UserError(
            f"ckpt_path={ckpt_path}: its model config names no block_size (the context length)."
        )

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
    start = torch.tensor([ids] * scfg.num_samples, dtype=torch.long, device=device)
    with precision.autocast():
        out = _sampled(model, start, scfg, block_size)
    return _show([tokenizer.decode(row.tolist()) for row in out], scfg)


def _sample_chat_model(
    scfg: DictConfig, opened: RunCheckpoint, prompt: str, system: str | None
) -> list[str]:
    """A model fine-tuned on instruction records: its folder's tokenizer, the chat template with
    chat=true, and the model's own generate where it has one (model=hf: a KV cache)."""
    cfg = opened.cfg
    tok = load_tokenizer(
        str(cfg.dataset.tokenizer),
        "the checkpoint's dataset.tokenizer",
        cfg.dataset.get("chat_template"),  # the template the run trained with
    )
    device = resolve_device(scfg.device, key="device")
    precision = resolve_precision(cfg.precision.name, device, cfg.precision.tf32)
    model = opened.model({"vocab_size": len(tok)}, precision.param_dtype, device)
    if scfg.chat:
        if not getattr(tok, "chat_template", None):
            raise UserError(
                f"chat=true: the tokenizer of {cfg.dataset.tokenizer} has no chat template. "
                "Drop chat=true to continue the prompt as plain text."
            )
        messages = [{"role": "system", "content": str(system)}] if system else []
        messages.append({"role": "user", "content": prompt})
        ids = list(
            tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
    else:
        ids = tok.encode(prompt, add_special_tokens=True) or [tok.bos_token_id or 0]
    if hasattr(model, "generate_ids"):  # a KV cache: the prompt and the reply share positions
        ids = _fit_positions(ids, int(getattr(model, "block_size", 0) or 0), scfg.max_new_tokens)
    start = torch.tensor([ids] * scfg.num_samples, dtype=torch.long, device=device)
    torch.manual_seed(scfg.seed)  # transformers' sampling draws from the global generator
    with precision.autocast():
        if hasattr(model, "generate_ids"):
            out = model.generate_ids(
                start,
                scfg.max_new_tokens,
                temperature=scfg.temperature,
                top_k=scfg.top_k,
                top_p=scfg.top_p,
                eos_token_id=tok.eos_token_id,
            )
        else:
            block = int(cfg.model.get("block_size") or 0) or start.shape[1] + scfg.max_new_tokens
            out = _sampled(model, start, scfg, block)
    # chat: the assistant's reply alone; otherwise the prompt and its continuation.
    rows = [row[len(ids) :] if scfg.chat else row for row in out]
    return _show([tok.decode(row.tolist(), skip_special_tokens=True) for row in rows], scfg)


def _fit_positions(ids: list[int], positions: int, max_new_tokens: int) -> list[int]:
    """The prompt's last tokens that leave room for max_new_tokens within the model's
    positions (max_position_embeddings; 0: unknown), as nanoGPT and HF's left truncation keep
    them: a model with learned positions fails on an index past its table."""
    if positions < 1 or len(ids) + max_new_tokens <= positions:
        return ids
    if max_new_tokens >= positions:
        raise UserError(
            f"max_new_tokens={max_new_tokens}: the model reads at most {positions} positions "
            "(its max_position_embeddings), the prompt's included, so the reply cannot be that "
            f"long. Use e.g. `max_new_tokens={max(1, positions // 2)}`."
        )
    keep = positions - max_new_tokens
    log.warning(
        "prompt: %d tokens, and with max_new_tokens=%d more than the model's %d positions: "
        "only its last %d tokens are seen.",
        len(ids),
        max_new_tokens,
        positions,
        keep,
    )
    return ids[-keep:]


def _sampled(model, start: torch.Tensor, scfg: DictConfig, block_size: int) -> torch.Tensor:
    """`generate` with the command's sampling keys and a generator seeded by `seed`."""
    generator = torch.Generator(device=start.device).manual_seed(scfg.seed)
    return generate(
        model,
        start,
        scfg.max_new_tokens,
        block_size=block_size,
        temperature=scfg.temperature,
        top_k=scfg.top_k or None,
        top_p=scfg.top_p,
        generator=generator,
    )


def _show(texts: list[str], scfg: DictConfig) -> list[str]:
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
    if not path.is_file() and not (path / "meta.pt").is_file():
        raise UserError(
            f"ckpt_path={path}: no such file. Give a .pt (or a sharded .dcp directory) written "
            "by accel-train, e.g. outputs/<run>/checkpoints/best.pt."
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

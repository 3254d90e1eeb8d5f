"""Checks of the model, fine-tuning, optimizer and loss keys (LoRA, the GPT's options, Muon's,
the warm-up, the language model's loss) that types alone cannot express: each raises a
UserError naming the key and the fix, before any process starts. What needs the built model (a
rank larger than a layer, an NF4 base that does not divide into blocks) is checked where the
adapters are attached: accel_train.techniques.lora."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from accel_train.config.run_config import command_line_keys
from accel_train.errors import UserError

# The values torch.optim.Muon takes for adjust_lr_fn (None: its "original").
MUON_ADJUST_LR = ("original", "match_rms_adamw", "spectral_unclamped")
LORA_BASE_DTYPES = ("nf4", "int8")
MUON_NS_DTYPES = ("auto", "bf16", "fp32")  # optimizer.ns_dtype (optim.py: muon_ns_dtype)


def check_lora(cfg: DictConfig) -> None:
    """lora.rank, alpha, dropout and base_dtype: their ranges, and base_dtype without adapters."""
    lora = cfg.lora
    if lora.rank < 0:
        raise UserError(
            f"lora.rank={lora.rank} must be >= 0: the adapters' rank (0 turns LoRA off and "
            "trains every parameter). Use e.g. `lora.rank=16`."
        )
    if lora.base_dtype is not None and lora.base_dtype not in LORA_BASE_DTYPES:
        raise UserError(
            f"lora.base_dtype={lora.base_dtype}: must be null (the run's precision), nf4 (QLoRA: "
            "4-bit NormalFloat base weights) or int8 (8-bit base weights)."
        )
    if lora.rank == 0:
        if lora.base_dtype is not None:
            raise UserError(
                f"lora.base_dtype={lora.base_dtype} stores the frozen base under LoRA's adapters, "
                "and lora.rank=0 turns LoRA off (every parameter trained, in the run's "
                f"precision): set a rank (`lora.rank=16 lora.base_dtype={lora.base_dtype}`, "
                "QLoRA) or drop `lora.base_dtype`."
            )
        return
    if not 0 <= lora.dropout < 1:
        raise UserError(
            f"lora.dropout={lora.dropout} must be in [0, 1): the dropout on the adapters' input "
            "(1 would zero it). Use e.g. `lora.dropout=0.05`."
        )
    if lora.alpha <= 0:
        raise UserError(
            f"lora.alpha={lora.alpha} must be > 0: the adapters are scaled by alpha / rank (0 "
            f"would switch them off). Use e.g. `lora.alpha={2 * lora.rank}` (twice the rank)."
        )


def check_gpt_options(cfg: DictConfig) -> None:
    """The built-in GPT's rotary base, and rows longer than its positions."""
    model = cfg.model
    if OmegaConf.select(cfg, "model.rope_base") is not None and model.rope_base <= 0:
        raise UserError(
            f"model.rope_base={model.rope_base} must be > 0: rotary positions turn by "
            "base^(-2i/d), and a base <= 0 gives NaN from the first step. Use the usual "
            "`model.rope_base=10000`."
        )
    block, length = model.get("block_size"), cfg.dataset.get("max_length")
    if isinstance(block, int) and isinstance(length, int) and length > block:
        raise UserError(
            f"dataset.max_length={length} is longer than model.block_size={block}: the model "
            "has positions for block_size tokens, so a longer row cannot go through it. Set "
            f"`dataset.max_length={block}`, or a larger `model.block_size`."
        )


def check_muon(cfg: DictConfig) -> None:
    fn = OmegaConf.select(cfg, "optimizer.adjust_lr_fn")
    if fn is not None and fn not in MUON_ADJUST_LR:
        raise UserError(
            f"optimizer.adjust_lr_fn={fn!r} is not one torch.optim.Muon takes: pick "
            f"{', '.join(MUON_ADJUST_LR)}, or null (torch's default, original)."
        )
    ns = OmegaConf.select(cfg, "optimizer.ns_dtype")
    if ns is not None and ns not in MUON_NS_DTYPES:
        raise UserError(
            f"optimizer.ns_dtype={ns!r}: pick auto (bf16 on CUDA and on a CPU with native bf16, "
            "fp32 elsewhere), bf16 (torch's own choice everywhere) or fp32."
        )


def check_warmup(cfg: DictConfig) -> None:
    """A warm-up as long as the run: refused only when the user gave both numbers; a recipe's
    warm-up on a run the user shortened is cut to a tenth of it at build (optim.py), as
    Hugging Face's Trainer and Lightning users expect a quick try to go ahead."""
    warmup, steps = cfg.scheduler.warmup_steps, cfg.trainer.max_steps
    if not (warmup and 0 < steps <= warmup):
        return
    if {"scheduler.warmup_steps", "trainer.max_steps"} <= command_line_keys():
        raise UserError(
            f"scheduler.warmup_steps={warmup} is not below trainer.max_steps={steps}: the run "
            "would end before its learning rate finished warming up. Lower "
            f"`scheduler.warmup_steps` (e.g. to {max(steps // 10, 0)}) or raise trainer.max_steps."
        )


def check_lm_loss(cfg: DictConfig) -> None:
    """task=language_model's loss keys: z_loss, label_smoothing and the chunked loss's chunk
    size; the chunked loss under every strategy but the pipeline."""
    task = cfg.task
    if "z_loss" in task and not 0 <= task.z_loss < float("inf"):
        raise UserError(
            f"task.z_loss={task.z_loss} must be >= 0: the weight of PaLM's z-loss, "
            "z_loss * logsumexp(logits)^2 per token (a negative one rewards large logits). Use "
            "e.g. `task.z_loss=1e-4`, or 0 for none."
        )
    if "label_smoothing" in task and not 0 <= task.label_smoothing < 1:
        raise UserError(
            f"task.label_smoothing={task.label_smoothing} must be in [0, 1): the share of each "
            "target spread over the whole vocabulary (1 would train towards the uniform "
            "distribution). Use e.g. `task.label_smoothing=0.1`, or 0 for none."
        )
    if not task.get("chunked_loss"):
        return
    if task.loss_chunk_tokens < 1:
        raise UserError(
            f"task.loss_chunk_tokens={task.loss_chunk_tokens} must be >= 1: the tokens whose "
            "logits task.chunked_loss computes at a time. Use e.g. `task.loss_chunk_tokens=1024`."
        )
    if cfg.strategy.name == "pipeline":
        raise UserError(
            "task.chunked_loss=true with strategy=pipeline is not supported: the pipeline cuts "
            "the model into stages and computes the loss on the last stage's logits, while the "
            "chunked loss needs the last hidden states and the output layer in the model's own "
            "forward. Use `strategy=fsdp` (or ddp, tp) with task.chunked_loss, or "
            "`task.chunked_loss=false`."
        )

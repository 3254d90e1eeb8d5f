"""Checks of the keys that make a run show text while it trains: trainer.sample_* (generation
samples) and trainer.harness_* (lm-evaluation-harness), and accel-eval's harness block. Each
raises a UserError naming the key and the fix, before any process starts; a missing task or
task file fails as the run starts (techniques/harness.py loads the tasks then)."""

from __future__ import annotations

import importlib.util

from omegaconf import DictConfig

from accel_train.config.combinations import strategy_key
from accel_train.errors import UserError

# Strategies under which the model cannot be run on a whole prompt by every rank: why, the fix.
TEXT_REFUSED = {
    "pipeline": (
        "strategy=pipeline: each rank holds some of the layers and the pipeline schedule runs "
        "the forward itself, so the model cannot generate or score text on its own"
    ),
    "tp": (
        "strategy=tp (or strategy.tp > 1 under fsdp): generation through transformers' "
        "generate over tensor-parallel (DTensor) layers is not supported here"
    ),
}


def check_harness_keys(h: DictConfig, prefix: str) -> None:
    """The harness block's ranges (`prefix`: harness, trainer.harness)."""
    if h.batch_size < 1:
        raise UserError(
            f"{prefix}.batch_size={h.batch_size} must be >= 1, e.g. `{prefix}.batch_size=8`."
        )
    limit = h.limit
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0
    ):
        raise UserError(
            f"{prefix}.limit={limit}: give a number of documents per task (an int >= 1), a "
            f"fraction in (0, 1), or null for all of them, e.g. `{prefix}.limit=100`."
        )
    if isinstance(limit, float) and limit >= 1 and not limit.is_integer():
        raise UserError(f"{prefix}.limit={limit}: a fraction must be in (0, 1); a count, an int.")
    if h.num_fewshot is not None and h.num_fewshot < 0:
        raise UserError(f"{prefix}.num_fewshot={h.num_fewshot} must be >= 0 (or null).")
    if h.tasks and importlib.util.find_spec("lm_eval") is None:
        raise UserError(
            f"{prefix}.tasks runs lm-evaluation-harness, and the lm-eval package is not "
            f"installed. Install the evaluation extra: `pip install 'accel-train[eval]'` "
            f"(lm-eval >= 0.4), or drop {prefix}.tasks."
        )


def check_text_in_training(cfg: DictConfig) -> None:
    """trainer.sample_* and trainer.harness_*: ranges, what they need, and the strategy."""
    t = cfg.trainer
    for key in ("sample_every_n_steps", "harness_every_n_steps"):
        if t[key] < 0:
            raise UserError(
                f"trainer.{key}={t[key]} must be >= 0 (0 = off), e.g. `trainer.{key}=100`."
            )
    on = [k for k in ("sample_every_n_steps", "harness_every_n_steps") if t[k] > 0]
    if not on:
        return
    key = f"trainer.{on[0]}"
    if t.sample_every_n_steps > 0:
        if not t.sample_prompts:
            raise UserError(
                "trainer.sample_every_n_steps is on but trainer.sample_prompts is empty: give "
                'prompts, e.g. `trainer.sample_prompts=["Reverse a list."]`, or a .txt/.jsonl file.'
            )
        if t.sample_max_new_tokens < 1:
            raise UserError(
                f"trainer.sample_max_new_tokens={t.sample_max_new_tokens} must be >= 1."
            )
        if t.sample_temperature < 0:
            raise UserError(
                f"trainer.sample_temperature={t.sample_temperature} must be >= 0 (0 = greedy)."
            )
    if t.harness_every_n_steps > 0:
        if not t.harness.tasks:
            raise UserError(
                "trainer.harness_every_n_steps is on but trainer.harness.tasks is empty: name the "
                "tasks, e.g. `trainer.harness.tasks=[my_task] trainer.harness.include_path=DIR`."
            )
        check_harness_keys(t.harness, "trainer.harness")
    if not cfg.dataset.get("tokenizer"):
        raise UserError(
            f"{key} generates text with a Hugging Face model folder's tokenizer (model=hf with "
            f"dataset=sft, whose dataset.tokenizer names it), and dataset="
            f"{cfg.dataset.get('name') or 'custom'} has none. For a model trained on a token "
            "folder (model=gpt), `task.sample_lines=N` samples text at each validation; or set "
            f"`{key}=0`."
        )
    why = TEXT_REFUSED.get(strategy_key(cfg))
    if why is not None:
        raise UserError(f"{key} with {why}. Use `strategy=ddp` or `strategy=fsdp`, or `{key}=0`.")

"""task=grpo's refusals, found before anything is built: its own keys out of range, and the
model, strategy and generation choices it cannot run with (each one paragraph naming the key)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from accel_train.targets import locate
from accel_train.tasks.grpo_loss import IS_LEVELS, LOSS_TYPES, SCALE_REWARDS

GENERATIONS = ("hf", "vllm")


def refusal(task: Mapping[str, Any], cfg: DictConfig | None = None, strategies=None) -> str | None:
    """Why these task keys (and, given `cfg`, the run's other choices) cannot work; None: they
    can. `strategies`: name -> the strategy class (its capabilities)."""
    return _keys(task) or (_combination(task, cfg, strategies) if cfg is not None else None)


def _keys(task: Mapping[str, Any]) -> str | None:
    choices = {
        "loss_type": LOSS_TYPES,
        "scale_rewards": SCALE_REWARDS,
        "importance_sampling_level": IS_LEVELS,
        "generation": GENERATIONS,
    }
    for key, allowed in choices.items():
        if task.get(key) is not None and task.get(key) not in allowed:
            return f"task.{key}={task.get(key)}: must be one of {', '.join(allowed)}."
    if int(task.get("num_generations", 8)) < 2:
        return (
            f"task.num_generations={task.get('num_generations')}: GRPO compares the completions "
            "of one prompt with each other, so it needs at least 2 per prompt (TRL's default 8)."
        )
    if int(task.get("max_completion_length", 512)) < 1:
        return "task.max_completion_length must be at least 1 token."
    if int(task.get("num_iterations", 1)) < 1:
        return "task.num_iterations must be at least 1 (updates per generated batch)."
    if float(task.get("beta", 0.0)) < 0:
        return f"task.beta={task.get('beta')}: the KL weight must be >= 0 (0 = no reference)."
    eps, high = task.get("epsilon", 0.2), task.get("epsilon_high")
    if not 0 < float(eps) < 1 or (high is not None and float(high) <= 0):
        return (
            f"task.epsilon={eps}, task.epsilon_high={high}: the clip range must be in (0, 1) "
            "below 1 (PPO's 0.2), and epsilon_high > 0 (or null: epsilon)."
        )
    if float(task.get("temperature", 1.0)) <= 0 or not 0 < float(task.get("top_p", 1.0)) <= 1:
        return (
            f"task.temperature={task.get('temperature')}, task.top_p={task.get('top_p')}: GRPO "
            "samples its completions, so temperature must be > 0 and top_p in (0, 1]."
        )
    limit = task.get("reward_timeout_s")
    if limit is not None and not float(limit) > 0:
        return (
            f"task.reward_timeout_s={limit}: the seconds a reward function may take must be "
            "> 0 (null: no limit)."
        )
    if task.get("generation") == "vllm":
        return (
            "task.generation=vllm is not implemented in accel-train (TRL's colocate mode needs "
            "vLLM beside the training process on a GPU). Use `task.generation=hf`: the policy's "
            "own generate with a KV cache."
        )
    return None


def _combination(task: Mapping[str, Any], cfg: DictConfig, strategies) -> str | None:
    model = cfg.model.get("name")
    if model not in ("hf", "gpt") and not _has_generate(cfg):
        return (
            f"task=grpo with model={model}: GRPO samples completions with the policy, and "
            f"model._target_={cfg.model.get('_target_')} has no generate_ids method (model=hf "
            "has one with a KV cache; model=gpt samples with its own loop). Use model=hf "
            "model.path=<folder>, or give your model a generate_ids(ids, max_new_tokens, *, "
            "temperature, top_k, top_p, eos_token_id, attention_mask) method."
        )
    if model == "hf" and cfg.model.get("head", "causal_lm") != "causal_lm":
        return f"task=grpo with model.head={cfg.model.head}: it needs `model.head=causal_lm`."
    name = cfg.strategy.name
    # Asked of the strategy, not its name (as task=preference does).
    strategy = strategies(name) if strategies is not None else None
    if strategy is not None and not strategy.runs_whole_model(cfg.strategy):
        tp = int(cfg.strategy.get("tp", 1) or 1) > 1
        shown = f"strategy={name}" + (f" strategy.tp={cfg.strategy.tp}" if tp else "")
        return (
            f"task=grpo with {shown}: sampling completions runs the whole model on each "
            "process's own prompts, which a pipeline (stages on different processes) or tensor "
            "parallelism (each layer split across processes) does not give. Use "
            "`strategy=ddp`, or `strategy=fsdp` without strategy.tp."
        )
    if task.get("chunked_loss") and int(task.get("loss_chunk_tokens", 1024)) < 1:
        return (
            f"task.loss_chunk_tokens={task.get('loss_chunk_tokens')}: the tokens of one chunk "
            "of task.chunked_loss must be at least 1, e.g. `task.loss_chunk_tokens=1024`."
        )
    together = task.get("generation_batch_size")
    if together is not None and int(together) < 1:
        return (
            f"task.generation_batch_size={together}: the prompts sampled together must be at "
            "least 1, or null for all of the micro-batch's, e.g. `task.generation_batch_size=4`."
        )
    sharded = strategy is not None and strategy.shards_parameters
    if sharded and float(task.get("beta", 0.0)) > 0 and cfg.lora.rank <= 0:
        return (
            f"task=grpo task.beta={task.get('beta')} with strategy={name} and lora.rank=0: the "
            "reference model would be a whole unsharded frozen copy on every process, which "
            "defeats sharding the parameters. Train LoRA adapters (`lora.rank=16`: the "
            "reference is the model with its adapters off), or set `task.beta=0`."
        )
    return None


def _has_generate(cfg: DictConfig) -> bool:
    """A user's model class that declares generate_ids (asked of the class, not its name)."""
    target = cfg.model.get("_target_")
    if not target:
        return False
    try:
        return hasattr(locate(str(target), "model._target_"), "generate_ids")
    except Exception:  # a wrong target is reported by the model's own build
        return True

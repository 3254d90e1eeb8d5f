"""The reward both sides of scripts/bench/grpo.py score completions with, by `_target_` for
accel-train (`_grpo_reward.lines`, this folder on PYTHONPATH) and as a function for TRL's
GRPOTrainer. Cheap and deterministic: the bench times the tools, not the reward."""


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content", "") for m in completion)
    return completion


def lines(prompts, completions, **kwargs):
    """Up to 1.0 for completions that break into lines as code does: newlines / 8, capped."""
    return [min(_text(c).count("\n") / 8, 1.0) for c in completions]

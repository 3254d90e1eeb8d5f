"""Reward functions for `task=grpo`, and the set of them a run scores completions with.

A reward function has TRL's signature: `f(prompts, completions, **columns) -> list[float]`,
one reward per completion. `prompts` and `completions` are lists as long as the batch's
completions (each prompt repeated once per completion of its group): strings for plain-text
prompts, for chat prompts the prompt's messages and `[{"role": "assistant", "content": ...}]`.
`columns` are the data set's other columns, repeated the same way (e.g. `answer`), plus
`completion_ids` (token ids). A function that takes no `**kwargs` gets only the columns it
names. `None` for a completion means "does not apply" (TRL's rule): it counts in no mean.

`task.rewards` lists them: `[{_target_: my.rewards.correct, weight: 1.0}, ...]`; a `_target_`
that names a function is used as it is, one that names a class (or takes the node's other
keys) is called with those keys and must return the function. The built-ins below take their
settings that way, e.g. `{_target_: accel_train.rewards.exact_match, pattern: "#### (.*)"}`.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accel_train.errors import UserError
from accel_train.targets import locate

RewardFn = Callable[..., Sequence[float | None]]


def _text(completion: Any) -> str:
    """A completion's text, plain or conversational."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def exact_match(pattern: str | None = None, column: str = "answer", strip: bool = True):
    """1.0 when the completion's answer equals the record's `column`, else 0.0. The answer is
    the regex `pattern`'s first group (the whole match without a group) at its LAST match in
    the completion (a model that restates the question still answers last); without a pattern,
    the whole completion. No match: 0.0."""
    regex = re.compile(pattern, re.DOTALL) if pattern else None

    def exact_match(prompts, completions, **columns):
        if column not in columns:
            raise KeyError(
                f"the data set has no column {column!r} (it has: {', '.join(sorted(columns))})"
            )
        out = []
        for completion, want in zip(completions, columns[column], strict=True):
            text = _text(completion)
            if regex is not None:
                found = list(regex.finditer(text))
                if not found:
                    out.append(0.0)
                    continue
                last = found[-1]
                text = last.group(1) if last.groups() else last.group(0)
            got, want = (text.strip(), str(want).strip()) if strip else (text, str(want))
            out.append(1.0 if got == want else 0.0)
        return out

    return exact_match


def format_match(pattern: str, full: bool = True):
    """1.0 when the completion matches the regex `pattern` (the whole completion with
    `full=true`, else anywhere in it), else 0.0: a format kept, e.g. `<think>.*</think>.*`."""
    regex = re.compile(pattern, re.DOTALL)

    def format_match(prompts, completions, **columns):
        test = regex.fullmatch if full else regex.search
        return [1.0 if test(_text(c).strip() if full else _text(c)) else 0.0 for c in completions]

    return format_match


def length_penalty(max_tokens: int, penalty: float = 1.0):
    """0.0 for a completion of at most `max_tokens` tokens, else -penalty times the share of
    tokens over it: -penalty * (n - max_tokens) / max_tokens (a soft limit)."""
    if max_tokens < 1:
        raise UserError(
            f"accel_train.rewards.length_penalty: max_tokens={max_tokens} must be >= 1."
        )

    def length_penalty(prompts, completions, completion_ids, **columns):
        return [-penalty * max(0, len(ids) - max_tokens) / max_tokens for ids in completion_ids]

    return length_penalty


for _factory in (exact_match, format_match, length_penalty):
    _factory.reward_factory = True  # built from its node's keys (build_rewards), not called


# ---- the run's set of reward functions --------------------------------------------------------


class Reward:
    """One reward function, its name (TRL's: the function's __name__) and its weight."""

    def __init__(self, fn: RewardFn, name: str, weight: float, key: str):
        self.fn, self.name, self.weight, self.key = fn, name, weight, key
        params = inspect.signature(fn).parameters
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.params = set(params)

    def __call__(
        self, prompts: list, completions: list, columns: Mapping[str, list], indices: list
    ) -> list:
        """The rewards of the completions; `indices`: each completion's prompt's data set
        index (an error names it)."""
        given = (
            columns if self.takes_all else {k: v for k, v in columns.items() if k in self.params}
        )
        try:
            out = self.fn(prompts=prompts, completions=completions, **given)
        except UserError:
            raise
        except Exception as err:
            raise UserError(
                f"the reward function {self.name!r} ({self.key}) raised {type(err).__name__}: "
                f"{' '.join(str(err).split())[:400]}, scoring the completions of the prompts at "
                f"data set indices {sorted(set(indices))[:8]}. Fix the function (it is called "
                "as f(prompts=[...], completions=[...], **columns), one reward per completion)."
            ) from None
        return self._checked(out, len(completions), indices)

    def _checked(self, out: Any, n: int, indices: list) -> list:
        try:
            values = list(out)
        except TypeError:
            values = None
        if values is None or len(values) != n:
            got = f"{len(values)} values" if values is not None else type(out).__name__
            raise UserError(
                f"the reward function {self.name!r} ({self.key}) returned {got} for {n} "
                "completions: it must return one float (or None: does not apply) per "
                "completion, in the order given."
            )
        for i, v in enumerate(values):
            bad = not (v is None or isinstance(v, int | float)) or (
                isinstance(v, float) and not math.isfinite(v)
            )
            if bad:
                raise UserError(
                    f"the reward function {self.name!r} ({self.key}) returned {v!r} for "
                    f"completion {i} (of the prompt at data set index {indices[i]}): a reward must "
                    "be a finite float, or None where the function does not apply. Fix it."
                )
        return values


def build_rewards(nodes: Any, key: str = "task.rewards") -> list[Reward]:
    """`task.rewards` -> the Reward list, each refused by name if it cannot be used."""
    if isinstance(nodes, DictConfig | Mapping):  # one function given without a list
        nodes = [nodes]
    out = []
    for i, node in enumerate(nodes or []):
        where = f"{key}[{i}]"
        if isinstance(node, str):
            node = {"_target_": node}
        node = OmegaConf.to_container(node) if isinstance(node, DictConfig) else dict(node)
        if not isinstance(node, dict) or "_target_" not in node:
            raise UserError(
                f"{where}: each reward is {{_target_: module.function, weight: 1.0}}; got {node!r}."
            )
        weight = float(node.pop("weight", 1.0))
        target = str(node.pop("_target_"))
        fn = locate(target, f"{where}._target_")
        if (
            node or isinstance(fn, type) or getattr(fn, "reward_factory", False)
        ):  # settings for a factory (the built-ins), or a class
            try:
                fn = fn(**node)
            except UserError:
                raise
            except Exception as err:
                raise UserError(
                    f"{where}: {target}({', '.join(f'{k}=...' for k in node)}) raised "
                    f"{type(err).__name__}: {err}. Fix its keys (`{where}.*`)."
                ) from None
        if not callable(fn):
            raise UserError(f"{where}: {target} did not give a callable reward function.")
        name = getattr(fn, "__name__", None) or type(fn).__name__
        out.append(Reward(fn, name, weight, f"{where}._target_={target}"))
    if not out:
        raise UserError(
            "task=grpo needs reward functions: set `task.rewards=[{_target_: my.rewards.correct}]`"
            " (TRL's signature: f(prompts, completions, **columns) -> list[float]), or a built-in"
            " such as `{_target_: accel_train.rewards.exact_match, pattern: '#### (.*)'}`."
        )
    names = [r.name for r in out]
    for r in out:  # TRL names the metrics by function name: two of one name would mix
        if names.count(r.name) > 1:
            r.name = f"{r.name}_{names[: out.index(r)].count(r.name)}"
    return out

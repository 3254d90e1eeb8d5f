"""Reward functions for `task=grpo`, and the set of them a run scores completions with.

A reward function has TRL's signature: `f(prompts, completions, **columns) -> list[float]`,
one reward per completion. `prompts` and `completions` are lists as long as the batch's
completions (each prompt repeated once per completion of its group): strings for plain-text
prompts, for chat prompts the prompt's messages and `[{"role": "assistant", "content": ...}]`.
`columns` are the data set's other columns, repeated the same way (e.g. `answer`), plus
`completion_ids` (token ids) and `trainer_state` (RewardState: global_step, max_steps, epoch),
as TRL passes them. A function that takes no `**kwargs` gets only the arguments it names. A
reward is any finite real number (Python or numpy ints, floats, bools, 0-d tensors); `None` for
a completion means "does not apply" (TRL's rule): it counts in no mean. `async def` functions
run concurrently on one event loop, as TRL runs them; `task.reward_timeout_s` bounds each.

`task.rewards` lists them: `[{_target_: my.rewards.correct, weight: 1.0}, ...]`; a `_target_`
that names a function is used as it is, one that names a class (or takes the node's other
keys) is called with those keys and must return the function. The built-ins below take their
settings that way, e.g. `{_target_: accel_train.rewards.exact_match, pattern: "#### (.*)"}`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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


@dataclass
class RewardState:
    """What TRL's `trainer_state` keyword gives a reward function, in transformers'
    `TrainerState` names: the optimizer steps done, the run's limit (-1: none) and the epoch."""

    global_step: int = 0
    max_steps: int = -1
    epoch: float = 0.0


class Reward:
    """One reward function, its name (TRL's: the function's __name__) and its weight."""

    def __init__(self, fn: RewardFn, name: str, weight: float, key: str):
        self.fn, self.name, self.weight, self.key = fn, name, weight, key
        params = inspect.signature(fn).parameters
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.params = set(params)
        # TRL runs `async def` functions concurrently (asyncio.gather): so do we (score())
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__  # (an instance whose __call__ is async)
        )

    def __call__(
        self, prompts: list, completions: list, columns: Mapping[str, Any], indices: list
    ) -> list:
        """The rewards of the completions (a plain function's, no time limit); `indices`:
        each completion's prompt's data set index (an error names it)."""
        return score([self], prompts, completions, columns, indices)[0]

    def kwargs(self, prompts: list, completions: list, columns: Mapping[str, Any]) -> dict:
        every = {"prompts": prompts, "completions": completions, **columns}
        return every if self.takes_all else {k: v for k, v in every.items() if k in self.params}

    def raised(self, err: BaseException, indices: list) -> UserError:
        if isinstance(err, UserError):
            return err
        return UserError(
            f"the reward function {self.name!r} ({self.key}) raised {type(err).__name__}: "
            f"{' '.join(str(err).split())[:400]}, scoring the completions of the prompts at "
            f"data set indices {sorted(set(indices))[:8]}. Fix the function (it is called "
            "as f(prompts=[...], completions=[...], **columns), one reward per completion)."
        )

    def timed_out(self, timeout: float, indices: list) -> UserError:
        return UserError(
            f"the reward function {self.name!r} ({self.key}) did not return within "
            f"task.reward_timeout_s={timeout:g} s, scoring the completions of the prompts at data "
            f"set indices {sorted(set(indices))[:8]}: it was stopped and the run with it. Make it "
            "return sooner (a time limit of its own on what it waits for), or raise "
            "task.reward_timeout_s (null: no limit)."
        )

    def checked(self, out: Any, n: int, indices: list) -> list:
        """The values as floats (None kept): any real number TRL's torch.tensor(...) takes
        (Python and numpy ints, floats and bools, 0-d tensors and arrays), finite."""
        try:
            values = list(out)
        except TypeError:
            values = None
        if values is None or len(values) != n:
            got = f"{len(values)} values" if values is not None else type(out).__name__
            raise UserError(
                f"the reward function {self.name!r} ({self.key}) returned {got} for {n} "
                "completions: it must return one number (or None: does not apply) per "
                "completion, in the order given."
            )
        out = []
        for i, v in enumerate(values):
            number = _real(v)
            if number is None and v is not None:
                raise UserError(
                    f"the reward function {self.name!r} ({self.key}) returned {v!r} for "
                    f"completion {i} (of the prompt at data set index {indices[i]}): a reward must "
                    "be a finite real number (int, float, bool, a numpy scalar or a 0-d tensor), "
                    "or None where the function does not apply. Fix it."
                )
            out.append(number)
        return out


def _real(v: Any) -> float | None:
    """`v` as a finite float, or None (None given, or not a finite real number)."""
    if v is None:
        return None
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # numpy scalars, 0-d tensors
        v = v.item()
    if not isinstance(v, numbers.Real):
        return None
    number = float(v)
    return number if math.isfinite(number) else None


# ---- scoring: the sync functions in turn, the async ones together, each under the time limit --


_LOOP: asyncio.AbstractEventLoop | None = None


def _loop() -> asyncio.AbstractEventLoop:
    """One event loop for the run's async reward functions, in a daemon thread (TRL's
    `async_reward_loop`): a client a function keeps between calls stays on its loop."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="rewards", daemon=True).start()
    return _LOOP


def _call_sync(reward: Reward, kwargs: dict, timeout: float | None, indices: list) -> Any:
    """A plain function's output; under a time limit, called in a daemon thread the run
    leaves behind if it hangs (a Python thread cannot be killed; the process ends after)."""
    if timeout is None:
        try:
            return reward.fn(**kwargs)
        except Exception as err:
            raise reward.raised(err, indices) from None
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = reward.fn(**kwargs)
        except BaseException as err:  # noqa: BLE001 (handed to the training thread)
            box["err"] = err

    thread = threading.Thread(target=run, name=f"reward {reward.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise reward.timed_out(timeout, indices)
    if "err" in box:
        raise reward.raised(box["err"], indices) from None
    return box["out"]


def score(
    rewards: Sequence[Reward],
    prompts: list,
    completions: list,
    columns: Mapping[str, Any],
    indices: list,
    timeout: float | None = None,
) -> list[list]:
    """Each function's checked rewards, in order: the plain ones called in turn, the `async`
    ones run concurrently on one event loop (TRL's asyncio.gather); `timeout` (seconds, None:
    no limit) bounds each function, and one past it stops the run naming it."""
    n = len(completions)
    out: list[list | None] = [None] * len(rewards)
    waiting = [(j, r) for j, r in enumerate(rewards) if r.is_async]
    for j, r in enumerate(rewards):
        if not r.is_async:
            raw = _call_sync(r, r.kwargs(prompts, completions, columns), timeout, indices)
            out[j] = r.checked(raw, n, indices)
    if waiting:

        async def one(r: Reward) -> Any:
            try:
                return await asyncio.wait_for(r.fn(**r.kwargs(prompts, completions, columns)),
                                              timeout)  # fmt: skip
            except (asyncio.TimeoutError, TimeoutError):
                raise r.timed_out(timeout or 0, indices) from None
            except Exception as err:
                raise r.raised(err, indices) from None

        async def together() -> list:
            return await asyncio.gather(*(one(r) for _, r in waiting))

        results = asyncio.run_coroutine_threadsafe(together(), _loop()).result()
        for (j, r), raw in zip(waiting, results, strict=True):
            out[j] = r.checked(raw, n, indices)
    return out  # type: ignore[return-value]


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

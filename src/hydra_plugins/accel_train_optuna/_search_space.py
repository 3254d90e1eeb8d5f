"""The search space: `hydra.sweeper.params` and the command line's sweeps, parsed with Hydra's
override parser (the syntax users know from `-m` sweeps), as Optuna distributions.

    choice(a, b, ...) / a,b       CategoricalDistribution (config group options too)
    range(start, stop[, step])    IntDistribution (FloatDistribution for floats) with that step
    interval(low, high)           FloatDistribution; int(interval(...)): IntDistribution
    tag(log, interval(...))       the same on a log scale
    a plain value                 not searched: every trial gets it

A sampled value goes back to the trial as an override (`key=value`) in Hydra's syntax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override
from hydra.errors import HydraException
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from accel_train.errors import UserError

FORMS = (
    "choice(a, b, ...), range(start, stop[, step]), interval(low, high), "
    "tag(log, interval(low, high)), int(interval(low, high)) or a single value"
)


@dataclass
class SearchSpace:
    distributions: dict[str, BaseDistribution] = field(default_factory=dict)
    # name -> the override's key as written (`+key` adds a key the config lacks)
    keys: dict[str, str] = field(default_factory=dict)
    # where each searched name was given, for error messages
    origin: dict[str, str] = field(default_factory=dict)
    # overrides every trial gets: plain values in `params`, then the command line's own
    fixed: list[str] = field(default_factory=list)

    def overrides(self, values: dict[str, Any]) -> list[str]:
        return [*self.fixed, *(f"{self.keys[k]}={as_override(v)}" for k, v in values.items())]

    def grid(self) -> dict[str, list[Any]]:
        """GridSampler's search space: every value of each parameter (choices and ranges)."""
        grid: dict[str, list[Any]] = {}
        for name, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                grid[name] = list(dist.choices)
            elif isinstance(dist, IntDistribution) and not dist.log:
                grid[name] = list(range(dist.low, dist.high + 1, dist.step))
            elif isinstance(dist, FloatDistribution) and dist.step is not None:
                n = round((dist.high - dist.low) / dist.step) + 1
                grid[name] = [dist.low + i * dist.step for i in range(n)]
            else:
                raise UserError(
                    f"sampler GridSampler tries every value, but {self.origin[name]} is an "
                    "interval. Give a choice(...) or range(...) there, or pick another sampler "
                    "(hydra.sweeper.sampler._target_=optuna.samplers.TPESampler)."
                )
        return grid


def as_override(value: Any) -> str:
    """A value in Hydra's override syntax (strings quoted where they need it)."""
    return Override._get_value_element_as_str(value)


def parse_search_space(params: dict[str, Any] | None, arguments: list[str]) -> SearchSpace:
    """`params` from the sweeper config, then the command line's arguments: a sweep on the
    command line replaces the config's entry for that key, a plain value removes it."""
    parser = OverridesParser.create()
    space = SearchSpace()
    for key, expression in (params or {}).items():
        text = expression if isinstance(expression, str) else as_override(expression)
        where = f"hydra.sweeper.params.{key}={text!r}"
        try:
            (override,) = parser.parse_overrides([f"{key}={text}"])
        except HydraException as err:
            raise UserError(
                f"{where} is not a search space Hydra can parse ({_first_line(err)}). Write "
                f"one of {FORMS}; quote values that hold spaces or commas."
            ) from None
        _add(space, override, where)
    for override in parser.parse_overrides(list(arguments)):
        name = override.key_or_group
        _drop(space, name)  # the command line wins over the config's params
        if override.is_sweep_override():
            _add(space, override, f"the command line's {override.input_line!r}")
        else:
            space.fixed.append(override.input_line)
    return space


def _add(space: SearchSpace, override: Override, where: str) -> None:
    name = override.key_or_group
    if override.is_delete():
        raise UserError(f"{where}: a deletion (~key) cannot be searched.")
    if not override.is_sweep_override():
        space.fixed.append(f"{override.get_key_element()}={override.get_value_element_as_str()}")
        return
    space.distributions[name] = _distribution(override, where)
    space.keys[name] = override.get_key_element()
    space.origin[name] = where


def _drop(space: SearchSpace, name: str) -> None:
    space.distributions.pop(name, None)
    space.keys.pop(name, None)
    space.fixed = [f for f in space.fixed if _key(f) != name]


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _distribution(override: Override, where: str) -> BaseDistribution:
    if isinstance(override.value(), Glob):  # config group options by pattern: not a space
        raise UserError(f"{where}: Optuna cannot search a glob(...); write one of {FORMS}.")
    try:
        if override.is_interval_sweep():
            sweep = override.value()
            log = "log" in sweep.tags
            if isinstance(sweep.start, int) and isinstance(sweep.end, int):
                return IntDistribution(sweep.start, sweep.end, log=log)
            return FloatDistribution(float(sweep.start), float(sweep.end), log=log)
        if override.is_range_sweep():
            values = list(override.sweep_iterator())
            if not values:
                raise ValueError("the range is empty")
            low, high = min(values), max(values)
            step = abs(values[1] - values[0]) if len(values) > 1 else 1
            if all(isinstance(v, int) for v in values):
                return IntDistribution(low, high, step=step)
            return FloatDistribution(float(low), float(high), step=float(step))
        if override.is_choice_sweep():
            choices = list(override.sweep_iterator())
            for choice in choices:
                if not (choice is None or isinstance(choice, (bool, int, float, str))):
                    raise ValueError(f"choice {choice!r} is not a number, string, boolean or null")
                if isinstance(choice, float) and math.isnan(choice):
                    raise ValueError("nan is not a choice")
            return CategoricalDistribution(choices)
    except ValueError as err:  # Optuna's own checks: low > high, log of a value <= 0, ...
        raise UserError(
            f"{where} is not a valid search space: {err}. Write one of {FORMS}."
        ) from None
    raise UserError(f"{where}: Optuna cannot search this sweep; write one of {FORMS}.")


def _first_line(err: Exception) -> str:
    return " ".join(str(err).split())

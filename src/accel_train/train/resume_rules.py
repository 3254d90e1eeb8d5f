"""What may change between a checkpoint's config and the config of the run that resumes it.

What may differ from the checkpoint's config (RULES, checked by `config_changes`):

- Refused, naming the first such key, both values and the fix (set it back, or start a fresh
  run in a new run dir): what the weights, the optimizer state or the checkpoint's place in the
  data belong to. model.*, dataset.* (but dataset.download/cache/cache_dir/metadata_cache: how
  the data is fetched, not what it is), loss.*, optimizer.name, optimizer.momentum between zero
  and non-zero (SGD's momentum buffers), what a step and the data order are made of
  (loader.batch_size, loader.drop_last, loader.shuffle, trainer.accumulate_grad_batches,
  trainer.limit_train_batches, trainer.seed: the checkpoint's step and batch_in_epoch count
  batches of that size in that order), the validation set the best scores were measured on
  (trainer.limit_val_batches), strategy.name into or out of pipeline (its optimizer layout) and
  precision.name into or out of bf16_true (bf16 parameters). A key no rule names is refused.
- Applied, and logged as one line per key, "changed on resume: KEY OLD -> NEW" (rank 0), and in
  the {"event": "resume"} row of metrics.jsonl: everything else. The run's length
  (trainer.max_epochs/max_steps), intervals, device, progress display, techniques, paths.*,
  launcher.*, logger.*, callbacks.*, name, objective, the other loader/strategy/precision keys,
  optimizer hyperparameters (lr, weight_decay, betas, eps, momentum, nesterov, fused: the
  restored optimizer state would keep the old ones, so the new values are written into its param
  groups) and scheduler.*.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_train.config.run_config import DEFAULT_TASK, flatten
from accel_train.errors import UserError
from accel_train.strategies import strategy_class

# ---- what may change between the checkpoint's config and this run's -------------------------

_STEP = (
    "a step and the checkpoint's place in the epoch (step, batch_in_epoch) are counted in "
    "batches of that size, so the run's progress would no longer match the data it has seen"
)
_ORDER = "the data order is drawn from it: mid-epoch the resumed run would repeat or skip samples"

# (key or group, why it may not change; None: it may). The first rule that names the key, or
# a group it is in, decides.
RULES: list[tuple[str, str | None]] = [
    ("resume", None),
    ("resume_new_tokenizer", None),
    ("name", None),
    ("objective", None),
    ("model", "the checkpoint's weights belong to that model"),
    ("dataset.download", None),
    ("dataset.cache", None),
    ("dataset.cache_dir", None),
    ("dataset.metadata_cache", None),  # where video metadata is kept, not what the videos are
    ("dataset.local", None),  # where remote shards are cached, and how much of them
    ("dataset.cache_limit", None),
    ("dataset", "the checkpoint's weights, progress and best scores belong to that data"),
    ("loss", "the weights and best scores were trained and selected on that loss"),
    ("task.monitor", None),  # checkpoint.monitor's default: checkpoint.* rules decide
    ("task.monitor_mode", None),
    ("task.objective", None),
    ("task.top_k", None),  # which accuracies are logged
    ("task.metrics", None),  # which metrics are declared
    ("task", "the weights were trained on that task's step and loss"),
    ("optimizer.name", "the optimizer state (moments, momentum buffers) belongs to that optimizer"),
    ("optimizer", None),  # hyperparameters: written into the restored param groups
    ("scheduler", None),  # the schedule is rebuilt for the new config
    ("loader.batch_size", _STEP),
    ("loader.drop_last", _STEP),
    ("loader.shuffle", _ORDER),
    ("loader", None),
    ("trainer.accumulate_grad_batches", _STEP),
    ("trainer.limit_train_batches", _STEP),
    ("trainer.seed", _ORDER),
    ("trainer.limit_val_batches", "the best scores were measured on that validation set"),
    ("trainer", None),
    ("early_stopping", None),
    ("checkpoint", None),  # but monitor/mode: _transition
    ("ema", None),  # a new decay applies from the resumed step; switched on: averaging starts there
    ("activation_checkpointing", None),  # recomputes the same values: the math is unchanged
    ("strategy", None),
    ("precision", None),
    ("launcher", None),
    ("logger", None),
    ("tags", None),
    ("paths", None),
    ("callbacks", None),
    # Techniques: a new schedule or teacher applies from the resumed step (prune masks are in
    # the checkpoint and only ever grow).
    ("distill", None),
    ("prune", None),
    ("selective_backprop", None),
]
_NO_RULE = "accel-train has no rule saying it may change on resume"

# checkpoint.* keys that rank checkpoints, with what checkpoints before them ranked by.
CHECKPOINT_RANKING = {"checkpoint.monitor": "val/acc", "checkpoint.mode": "max"}
# Optimizer config keys -> the param-group key the restored optimizer state would keep.
HYPERPARAMETERS = {
    f"optimizer.{k}": k for k in ("weight_decay", "betas", "eps", "momentum", "nesterov", "fused")
}
# What the base lr (the schedule's anchor) is made of.
LR_KEYS = ("optimizer.lr", "optimizer.scale_lr_with_batch", "optimizer.reference_batch_size")
# Groups whose `name` picks an option: the fix is `group=option`, not `group.name=option`.
_OPTION_GROUPS = (
    "model",
    "dataset",
    "loss",
    "precision",
    "strategy",
    "launcher",
    "loader",
    "optimizer",
    "scheduler",
    "logger",
)


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()  # a key one of the two configs does not have


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any


def _by_name(strategy: str) -> bool:
    """Whether a strategy keeps its optimizer state per stage, keyed by parameter name."""
    return strategy_class(strategy).optimizer_state_by_name


def _transition(key: str, old: Any, new: Any) -> str | None:
    """Changes refused only between certain values of a key that may otherwise change."""
    if key == "strategy.name" and _by_name(old) != _by_name(new):
        # (Between single, DDP, FSDP, TP and FSDP x TP a checkpoint moves either way: a sharded
        # one is re-cut at any world size, a single file is cut into shards; docs/distributed.md.)
        return (
            "pipeline checkpoints hold each stage's optimizer state keyed by parameter name, "
            "the other strategies' one optimizer over the whole model"
        )
    if key == "precision.name" and (old == "bf16_true") != (new == "bf16_true"):
        return (
            "bf16_true keeps the parameters themselves in bf16, so the weights would be rounded "
            "or the optimizer state retyped"
        )
    if key in CHECKPOINT_RANKING:
        default = CHECKPOINT_RANKING[key]  # a checkpoint from before checkpoint.*: val/acc, max
        if (default if old is UNSET else old) != new:
            return (
                "the best value so far and the kept checkpoints were ranked by it (best.pt would "
                "mix two rankings)"
            )
    if key == "optimizer.momentum" and (old in (0, UNSET)) != (new in (0, UNSET)):
        return "SGD keeps momentum buffers only with momentum > 0: they would appear or vanish"
    return None


def refusal_reason(key: str, old: Any, new: Any) -> str | None:
    """Why `key` may not change from `old` to `new` on resume (None: it may)."""
    for rule, reason in RULES:
        if key == rule or key.startswith(rule + "."):
            return reason or _transition(key, old, new)
    return _NO_RULE


def config_changes(
    old_cfg: dict[str, Any], new_cfg: dict[str, Any], wanted: str, path: Path
) -> list[Change]:
    """The keys in which this run's config differs from the checkpoint's (first by group, a
    group's `name` first), all of which may change; raises the UserError of the first that may
    not."""
    if ("task" in old_cfg) != ("task" in new_cfg):  # one written before tasks: it classified
        old_cfg = {"task": dict(DEFAULT_TASK), **old_cfg}
        new_cfg = {"task": dict(DEFAULT_TASK), **new_cfg}
    old, new = _leaves(old_cfg), _leaves(with_recorded_batch(old_cfg, new_cfg))
    keys = list(new) + [k for k in old if k not in new]
    group_at: dict[str, int] = {}
    for i, key in enumerate(keys):
        group_at.setdefault(key.split(".")[0], i)

    def report_order(item: tuple[int, str]) -> tuple[int, int, int]:
        i, key = item
        group = key.split(".")[0]
        return group_at[group], 0 if key == f"{group}.name" else 1, i

    differing = [
        key
        for _, key in sorted(enumerate(keys), key=report_order)
        if old.get(key, UNSET) != new.get(key, UNSET)
    ]
    changes = [Change(k, old.get(k, UNSET), new.get(k, UNSET)) for k in differing]
    for change in changes:
        reason = refusal_reason(change.key, change.old, change.new)
        if reason:
            raise UserError(_refusal(change, reason, wanted, path))
    return changes


def with_recorded_batch(old_cfg: dict[str, Any], new_cfg: dict[str, Any]) -> dict[str, Any]:
    """`loader.batch_size=auto` on resume means the size the checkpoint's run probed (and the
    accumulation it derived): never a new probe, whose answer could differ with the machine's
    load and break the exact resume."""
    if new_cfg.get("loader", {}).get("batch_size") != "auto":
        return new_cfg
    recorded = old_cfg.get("loader", {}).get("batch_size")
    if recorded in (None, "auto"):
        return new_cfg
    loader = {**new_cfg["loader"], "batch_size": recorded}
    trainer = dict(new_cfg["trainer"])
    trainer["accumulate_grad_batches"] = old_cfg["trainer"]["accumulate_grad_batches"]
    return {**new_cfg, "loader": loader, "trainer": trainer}


def _leaves(cfg: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys -> values; an empty group (`callbacks: {}`) has no keys, so removing the last
    callback reads as its keys going, not as a new key `callbacks`."""
    return {k: v for k, v in flatten(cfg).items() if v != {}}


def _refusal(change: Change, reason: str, wanted: str, path: Path) -> str:
    key, old, new = change.key, fmt_value(change.old), fmt_value(change.new)
    group, _, leaf = key.partition(".")
    if change.old is UNSET:
        fix = f"drop the `{key}` override"
    elif leaf == "name" and group in _OPTION_GROUPS:
        fix = f"set `{group}={old}` back"
    else:
        fix = f"set `{key}={old}` back"
    return (
        f"resume={wanted}: the checkpoint {path} was trained with {key}={old} but this run has "
        f"{key}={new}, and {key} cannot change on resume: {reason}. To continue that run, "
        f"{fix}; to train with {key}={new}, start a fresh run in a new run dir (no `resume`)."
    )


def fmt_value(value: Any) -> str:
    """A value as it is written in an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(fmt_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def plain(value: Any) -> Any:
    return "<unset>" if value is UNSET else value


def length_changed(changed: set[str]) -> bool:
    return bool(changed & {"trainer.max_epochs", "trainer.max_steps"})


def check_world_size(
    progress: dict[str, Any], world_size: int, width: str, wanted: str, path: Path
) -> None:
    """Mid-epoch, the checkpoint's place in the data (batch_in_epoch) counts batches of each
    data-parallel rank's shard: another number of ranks shards the epoch differently, so the
    resumed run would repeat or skip samples. At an epoch boundary the number may change (the
    global batch, and with it the steps per epoch, change too: train/resume.resumed_length).
    `world_size`: this run's data-parallel ranks; `width`: how its processes make them
    (Strategy.describe_width), as the checkpoint's `width` says of its own."""
    saved = progress.get("world_size")  # None: a checkpoint from before it was recorded
    if saved is None or saved == world_size or not progress["batch_in_epoch"]:
        return
    saved_width = progress.get("width") or f"{saved} data-parallel rank(s)"
    raise UserError(
        f"resume={wanted}: the checkpoint {path} was written by {saved_width} in the middle of "
        f"epoch {progress['epoch']} (batch {progress['batch_in_epoch']} of each data-parallel "
        f"rank's share), and this run has {width}. Mid-epoch, each rank's share of the data "
        f"depends on the number of data-parallel ranks, so the run would repeat or skip samples. "
        f"Resume with {saved_width} as the checkpoint was written (its strategy and launcher "
        "settings), let that run reach the end of an epoch first, or start a fresh run in a new "
        "run dir."
    )


def check_loader_order(progress: dict[str, Any], loader: Any, wanted: str, path: Path) -> None:
    """A loader whose order depends on more than the seed and epoch (`order_depends_on`, e.g.
    a streaming loader's worker count) must resume mid-epoch with the same settings, or the
    resumed epoch would repeat or skip samples."""
    saved = progress.get("order_depends_on") or {}
    now = dict(getattr(loader, "order_depends_on", {}))
    if not progress["batch_in_epoch"] or saved == now:
        return
    key = next(k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k))
    raise UserError(
        f"resume={wanted}: the checkpoint {path} was written in the middle of epoch "
        f"{progress['epoch']} with {key}={saved.get(key)}, and this run has {key}={now.get(key)}. "
        f"This data set's sample order depends on {key}, so mid-epoch the run would repeat or "
        f"skip samples. Resume with `{key}={saved.get(key)}`, let that run reach the end of an "
        "epoch first, or start a fresh run in a new run dir."
    )

"""Checks of a composed training config that types alone cannot express: each raises a UserError
that names the key and the fix. `validate` runs them all, in the order of CHECKS, before any
process starts. (What the real data makes pointless is checked by the build:
accel_train.train.data_checks; accel-export's and accel-eval's keys: accel_train.command_checks.)"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from accel_train.config.combinations import (
    STRATEGY_NEEDS_TASK,
    STRATEGY_REFUSED,
    check_strategy_transforms,
)
from accel_train.config.device_checks import check_activation_offload, check_liger, cpu_run
from accel_train.config.facts import OBJECTIVES, parse_target, task_class, validation_metrics
from accel_train.config.option_checks import (
    check_gpt_options,
    check_lm_loss,
    check_lora,
    check_muon,
    check_warmup,
)
from accel_train.config.recipe_checks import check_recipe
from accel_train.config.schema import LOGGER_SCHEMAS, OPTION_SCHEMAS
from accel_train.config.text_checks import check_text_in_training
from accel_train.errors import UserError

log = logging.getLogger("accel_train")
_warned: set[str] = set()


def warn_once(text: str) -> None:
    """Each warning once per process (a sweep job validates its config twice; the build's data
    checks warn through it too)."""
    if text not in _warned:
        _warned.add(text)
        log.warning(text)


# Groups whose option is chosen by `name` (the others build user code by `_target_`).
NAMED_GROUPS = ("precision", "strategy", "launcher", "loader", "optimizer", "scheduler")

# Keys with a fixed set of values.
CHOICES: dict[str, tuple[str, ...]] = {
    "strategy.backend": ("auto", "nccl", "gloo"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "trainer.progress": ("auto", "rich", "plain", "none"),
    "trainer.on_nonfinite": ("stop", "skip_step"),
    "prune.method": ("unstructured", "structured"),
    "prune.scope": ("global", "layer"),
    "prune.schedule.ramp": ("cubic", "linear"),
    "activation_checkpointing.mode": ("off", "full", "selective"),
}


# Loggers that are optional extras: the module each imports.
TRACKER_MODULES = {"mlflow": "mlflow", "wandb": "wandb"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        return False


def check_loggers(cfg: DictConfig) -> None:
    """`logger` maps each chosen logger to its settings (logger=[csv,mlflow])."""
    loggers = cfg.get("logger")
    if loggers is None:  # `~logger` or logger=null: no logger besides metrics.jsonl
        return
    if not isinstance(loggers, DictConfig):
        raise UserError(
            f"logger={loggers!r}: pick loggers by option, e.g. `logger=csv` or "
            f"`logger=[csv,tensorboard,mlflow]` (options: {', '.join(LOGGER_SCHEMAS)}, none)."
        )
    for name in loggers:
        if name not in LOGGER_SCHEMAS:
            raise UserError(
                f"logger.{name} is not a logger accel-train knows: pick from "
                f"{', '.join(LOGGER_SCHEMAS)} (several at once: `logger=[csv,mlflow]`), or "
                "`logger=none`."
            )
        if name in TRACKER_MODULES and not _installed(TRACKER_MODULES[name]):
            raise UserError(
                f"logger={name} needs the {TRACKER_MODULES[name]} package, which is not "
                f'installed. Install it with `pip install "accel-train[{name}]"` (or `pip '
                f"install {TRACKER_MODULES[name]}`), or pick other loggers (e.g. `logger=csv`)."
            )
    mode = OmegaConf.select(cfg, "logger.wandb.mode")
    if mode is not None and mode not in ("offline", "online", "disabled"):
        raise UserError(
            f"logger.wandb.mode={mode!r} is not one of offline, online, disabled (online needs "
            "`wandb login` or $WANDB_API_KEY)."
        )


# key: (minimum, what the key means) for integers that must be at least that.
MINIMUMS: dict[str, tuple[int, str]] = {
    "loader.batch_size": (1, "samples per device per micro-batch"),
    "loader.eval_batch_size": (0, "0 means the same as loader.batch_size"),
    "loader.max_batch_size": (1, "the largest batch size loader.batch_size=auto probes"),
    "trainer.global_batch_size": (0, "0 keeps trainer.accumulate_grad_batches as set"),
    "ema.every_n_steps": (1, "optimizer steps between EMA updates"),
    "ema.start_step": (0, "the optimizer step the EMA starts averaging at"),
    "activation_checkpointing.every": (1, "with mode=selective, every n-th block"),
    "loader.num_workers": (0, "0 loads in the main process"),
    "trainer.accumulate_grad_batches": (1, "1 means no accumulation"),
    "trainer.log_every_n_steps": (0, "optimizer steps between metric lines; 0 = auto"),
    "trainer.val_every_n_epochs": (1, "epochs between validations"),
    "trainer.ckpt_every_n_steps": (0, "0 saves only at the end of each epoch"),
    "trainer.profile_steps": (1, "steps recorded by the profiler"),
    "scheduler.warmup_steps": (0, "0 means no warmup"),
    "scheduler.step_size": (1, "optimizer steps between decays"),
    "optimizer.reference_batch_size": (1, "the global batch the lr was tuned for"),
    "dataset.random_shift": (0, "max shift in pixels; 0 = off"),
    "dataset.num_train": (1, "images generated for training and validation"),
    "dataset.num_test": (1, "images generated for the test split"),
    "dataset.in_channels": (1, "image channels"),
    "prune.schedule.every_n_steps": (1, "optimizer steps between mask updates"),
    "selective_backprop.interrupt": (0, "0 = never a full-batch step inside [start, end)"),
}

# A gradient norm clipped below this leaves (plain SGD) steps that barely move the weights.
TINY_CLIP = 1e-3


def check_task(cfg: DictConfig) -> None:
    """Every feature works with every task or is refused here, naming the feature and the
    task: what a feature needs of a task is plain data on the task's class."""
    cls = task_class(cfg)
    if cls is None:
        return  # not importable here: the build names task._target_
    name = cfg.task.get("name", cls.__name__)
    needs = []
    if cfg.selective_backprop.keep < 1 and not getattr(cls, "per_sample_loss", False):
        needs.append(
            f"selective_backprop.keep={cfg.selective_backprop.keep} with task={name}: selective "
            "backprop ranks the samples of a batch by their own loss, and this task gives no "
            "per-sample loss (classification and regression do). Turn it off with "
            "`selective_backprop.keep=1`."
        )
    if cfg.distill.teacher is not None and not getattr(cls, "class_logits", False):
        needs.append(
            f"distill.teacher with task={name}: distillation matches the student's class logits "
            "to the teacher's (a softened KL divergence), and this task's model outputs no class "
            "logits (only task=classification does). Turn it off with `distill.teacher=null`."
        )
    refusal = getattr(cls, "config_refusal", None)
    why_not = refusal(cfg) if callable(refusal) else None
    if why_not:
        needs.append(why_not)
    capability, why = STRATEGY_NEEDS_TASK.get(cfg.strategy.name, (None, ""))
    if capability is not None and not getattr(cls, capability, False):
        needs.append(why.format(task=name))
    loss = cfg.get("loss")
    if (
        not getattr(cls, "uses_loss_group", False)
        and isinstance(loss, DictConfig)
        and (loss.get("name") != "cross_entropy" or loss.get("label_smoothing", 0.0) != 0.0)
    ):
        needs.append(
            f"loss={loss.get('name')} with task={name}: the `loss` group is read by "
            "task=classification only; this task computes its own loss (task=regression: "
            "`task.loss=mse|l1|huber`; task=custom: in your step). Drop the loss override."
        )
    acc_objectives = ("best_val_acc", "final_val_acc", "test_acc")
    if cfg.get("objective") in acc_objectives and "val/acc" not in validation_metrics(cfg):
        needs.append(
            f"objective={cfg.objective} with task={name}: this task logs no accuracy, so every "
            "job would return nothing to the sweeper. Use `objective=final_val_loss`."
        )
    if needs:
        raise UserError(needs[0])


def _is_fraction(value) -> bool:
    return isinstance(value, float) and 0 < value <= 1


def check_loop_intervals(cfg: DictConfig) -> None:
    """Batch limits, the validation interval, the stop target and early stopping."""
    t = cfg.trainer
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        value = t[key]
        if not (isinstance(value, int) and value >= 0) and not _is_fraction(value):
            raise UserError(
                f"trainer.{key}={value!r} must be a number of batches (an int >= 0; 0 = all) or a "
                f"fraction of them (a float in (0, 1]), e.g. `trainer.{key}=10` or "
                f"`trainer.{key}=0.25`."
            )
    interval = t.val_check_interval
    if not (isinstance(interval, int) and interval >= 1) and not _is_fraction(interval):
        raise UserError(
            f"trainer.val_check_interval={interval!r} must be a fraction of an epoch (a float in "
            "(0, 1], e.g. 0.25 validates 4 times an epoch) or a number of optimizer steps (an "
            "int >= 1)."
        )
    metrics = validation_metrics(cfg)
    known = ", ".join(metrics)
    if t.stop_at is not None and t.target is not None and t.stop_at != t.target:
        # (Equal ones are one target: stop_at records it too. An experiment may set a target
        # that a user's stop_at then takes over.)
        raise UserError(
            f"trainer.stop_at={t.stop_at!r} and trainer.target={t.target!r} differ: stop_at "
            "records the time to its target and stops there, target only records it. Keep one "
            "(e.g. `trainer.target=null`)."
        )
    for key in ("stop_at", "target"):
        if t[key] is None:
            continue
        metric, _, _ = parse_target(t[key], f"trainer.{key}")
        if metric not in metrics:
            raise UserError(
                f"trainer.{key}={t[key]!r} watches {metric!r}, which validation does not "
                f"log: name one of {known}."
            )
    es = cfg.early_stopping
    if es.monitor is not None:
        if es.monitor not in metrics:
            raise UserError(
                f"early_stopping.monitor={es.monitor!r} is not a validation metric: name one of "
                f"{known} (or null to turn early stopping off)."
            )
        if es.mode not in ("min", "max"):
            raise UserError(f"early_stopping.mode={es.mode!r} must be min or max.")
        if es.mode != metrics[es.monitor]:
            raise UserError(
                f"early_stopping.mode={es.mode} with monitor={es.monitor}: {es.monitor} improves "
                f"when it goes {'up' if metrics[es.monitor] == 'max' else 'down'}. "
                f"Set `early_stopping.mode={metrics[es.monitor]}`."
            )
        if es.patience < 1 or es.min_delta < 0:
            raise UserError(
                f"early_stopping.patience={es.patience} must be >= 1 and "
                f"early_stopping.min_delta={es.min_delta} >= 0."
            )


def check_memory_techniques(cfg: DictConfig) -> None:
    """loader.batch_size (an int or auto), EMA and the auto batch size's keys."""
    bs, t = cfg.loader.batch_size, cfg.trainer
    if bs != "auto" and (isinstance(bs, bool) or not isinstance(bs, int)):
        raise UserError(
            f"loader.batch_size={bs!r} is not a whole number or `auto`: give the samples per "
            "device per micro-batch (e.g. `loader.batch_size=64`), or `loader.batch_size=auto` "
            "to probe for one before training."
        )
    if t.global_batch_size and bs != "auto":
        raise UserError(
            f"trainer.global_batch_size={t.global_batch_size} only works with "
            f"loader.batch_size=auto (it raises the accumulation to keep the global batch "
            f"whatever size the probe picks); with loader.batch_size={bs} set "
            "`trainer.accumulate_grad_batches` yourself, or `trainer.global_batch_size=0`."
        )
    if t.global_batch_size and t.accumulate_grad_batches != 1:
        raise UserError(
            f"trainer.global_batch_size={t.global_batch_size} sets the accumulation itself, but "
            f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} was also given: drop one."
        )
    if not 0 < t.memory_fraction <= 1:
        raise UserError(
            f"trainer.memory_fraction={t.memory_fraction} must be in (0, 1]: the share of the "
            "memory a probed batch size may use, e.g. `trainer.memory_fraction=0.9`."
        )
    if not 0 <= cfg.ema.decay < 1:
        raise UserError(
            f"ema.decay={cfg.ema.decay} must be in [0, 1) (ema = decay * ema + (1 - decay) * "
            "weights; 1 would never move), e.g. `ema.decay=0.999`."
        )


def check_optimizer(cfg: DictConfig) -> None:
    """Values torch's optimizers refuse with a traceback, refused here naming the key."""
    opt = cfg.optimizer
    if opt.weight_decay < 0:
        raise UserError(
            f"optimizer.weight_decay={opt.weight_decay} must be >= 0 (a negative decay grows the "
            "weights every step). Use e.g. `optimizer.weight_decay=0`."
        )
    betas = opt.get("betas")
    if betas is not None and (len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
        raise UserError(
            f"optimizer.betas={list(betas)} must be two values in [0, 1), e.g. "
            "`optimizer.betas=[0.9,0.999]`."
        )
    if opt.get("eps") is not None and opt.eps < 0:
        raise UserError(f"optimizer.eps={opt.eps} must be >= 0, e.g. `optimizer.eps=1e-8`.")
    if opt.get("momentum") is not None:
        if opt.momentum < 0:
            raise UserError(f"optimizer.momentum={opt.momentum} must be >= 0 (0 = plain SGD).")
        if opt.nesterov and opt.momentum == 0:
            raise UserError(
                "optimizer.nesterov=true needs momentum, but optimizer.momentum=0. Set "
                "`optimizer.momentum=0.9` or `optimizer.nesterov=false`."
            )


def check_compression(cfg: DictConfig) -> None:
    """distill, prune and selective_backprop: value ranges, the teacher's file, combinations."""
    d, p, sb = cfg.distill, cfg.prune, cfg.selective_backprop
    if d.teacher is not None:
        if not 0 <= d.alpha <= 1:
            raise UserError(
                f"distill.alpha={d.alpha} must be in [0, 1]: the weight of the hard-label loss "
                "(the soft loss gets 1 - alpha), e.g. `distill.alpha=0.5`."
            )
        if d.temperature <= 0:
            raise UserError(
                f"distill.temperature={d.temperature} must be > 0 (logits are divided by it), "
                "e.g. `distill.temperature=4`."
            )
        if isinstance(d.teacher, str):
            teacher = Path(d.teacher).expanduser()
            found = (teacher, teacher / "meta.pt", teacher / "config.json")  # (timm's folder)
            if not any(p.is_file() for p in found):
                raise UserError(
                    f"distill.teacher={d.teacher!r}: no such checkpoint. Give the path of a .pt "
                    "file (or an FSDP .dcp dir) written by accel-train, or a timm folder, e.g. "
                    "`distill.teacher=outputs/<run>/checkpoints/best.pt`, or a model by "
                    "`+distill.teacher._target_=pkg.module.make_teacher`."
                )
        elif not isinstance(d.teacher, DictConfig) or "_target_" not in d.teacher:
            raise UserError(
                f"distill.teacher={d.teacher!r} is neither a checkpoint path nor a model node "
                "with a _target_. Use `distill.teacher=path/to/best.pt` or "
                "`+distill.teacher._target_=pkg.module.make_teacher`."
            )
    if p.amount != 0:
        if not 0 < p.amount < 1:
            raise UserError(
                f"prune.amount={p.amount} must be in [0, 1): the final share of pruned weights "
                "(0 = off), e.g. `prune.amount=0.5`."
            )
        sch = p.schedule
        if sch.start < 0 or sch.end <= sch.start:
            raise UserError(
                f"prune.schedule.start={sch.start} and prune.schedule.end={sch.end}: need 0 <= "
                "start < end (fractions of the run if <= 1, else optimizer steps), e.g. "
                "`prune.schedule.start=0.1 prune.schedule.end=0.7`."
            )
        if p.method == "structured" and p.scope == "global":
            raise UserError(
                "prune.method=structured with prune.scope=global: torch.nn.utils.prune ranks "
                "channels only within a layer (ln_structured). Set `prune.scope=layer`."
            )
    if sb.keep != 1:
        if not 0 < sb.keep < 1:
            raise UserError(
                f"selective_backprop.keep={sb.keep} must be in (0, 1]: the share of each batch "
                "trained on (1 = off), e.g. `selective_backprop.keep=0.5`."
            )
        if not 0 <= sb.start < sb.end <= 1:
            raise UserError(
                f"selective_backprop.start={sb.start} and .end={sb.end} must be fractions of the "
                "run with 0 <= start < end <= 1, e.g. `selective_backprop.start=0.5 "
                "selective_backprop.end=0.9`."
            )


def check_scheduler(cfg: DictConfig) -> None:
    """Schedules that would drive the learning rate to zero (or the wrong way)."""
    sched, lr = cfg.scheduler, cfg.optimizer.lr
    if sched.name == "onecycle":
        if sched.max_lr <= 0:
            raise UserError(
                f"scheduler.max_lr={sched.max_lr} must be > 0: OneCycle's peak learning rate "
                "(it replaces optimizer.lr), e.g. `scheduler.max_lr=0.01`."
            )
        if not 0 < sched.pct_start < 1:
            raise UserError(
                f"scheduler.pct_start={sched.pct_start} must be in (0, 1): the share of the run "
                "spent raising the lr, e.g. `scheduler.pct_start=0.3`."
            )
        if sched.anneal_strategy not in ("cos", "linear"):
            raise UserError(
                f"scheduler.anneal_strategy={sched.anneal_strategy!r} is not cos or linear: the "
                "shape of OneCycle's rise and fall (torch's OneCycleLR), e.g. "
                "`scheduler.anneal_strategy=linear`."
            )
        if sched.div_factor < 1 or sched.final_div_factor < 1:
            raise UserError(
                f"scheduler.div_factor={sched.div_factor} and scheduler.final_div_factor="
                f"{sched.final_div_factor} must be >= 1: OneCycle starts at max_lr / div_factor "
                "and ends at that / final_div_factor, e.g. `scheduler.div_factor=25`."
            )
    if sched.name == "cosine":
        if sched.min_lr < 0:
            raise UserError(f"scheduler.min_lr={sched.min_lr} must be >= 0.")
        if sched.min_lr > lr and not cfg.optimizer.scale_lr_with_batch:
            raise UserError(
                f"scheduler.min_lr={sched.min_lr} is above optimizer.lr={lr}: the cosine "
                "schedule would raise the learning rate instead of lowering it. Set "
                "`scheduler.min_lr` below optimizer.lr (e.g. `scheduler.min_lr=0`)."
            )
    _check_epochs(sched)
    if sched.name == "step":
        if sched.gamma <= 0:
            raise UserError(
                f"scheduler.gamma={sched.gamma} must be > 0: the lr would be "
                f"{sched.gamma} after scheduler.step_size steps. Use e.g. `scheduler.gamma=0.1`."
            )
        if sched.gamma > 1:
            warn_once(
                f"scheduler.gamma={sched.gamma} > 1: the step schedule raises the learning rate "
                f"every {sched.step_size} steps (it usually decays it: gamma < 1)"
            )


def _check_epochs(sched: DictConfig) -> None:
    """scheduler.warmup_epochs / step_epochs: in range, and the warm-up given one way."""
    for key, low in (("warmup_epochs", 0.0), ("step_epochs", None)):
        value = sched.get(key)
        if value is not None and not (value >= low if low is not None else value > 0):
            raise UserError(
                f"scheduler.{key}={value} must be {'>= 0' if low is not None else '> 0'} "
                "(epochs of this run, converted to optimizer steps at start-up), or null."
            )
    if sched.get("warmup_epochs") is not None and sched.warmup_steps:
        raise UserError(
            f"scheduler.warmup_epochs={sched.warmup_epochs} and scheduler.warmup_steps="
            f"{sched.warmup_steps}: give the warm-up one way (`scheduler.warmup_steps=0`, or "
            "`scheduler.warmup_epochs=null`)."
        )


def check_pointless(cfg: DictConfig) -> None:
    """Settings that make a run pointless (refused) or probably not what was meant (warned),
    from the config alone; the ones that need the data sizes are in train/data_checks.py."""
    t, ds, loss = cfg.trainer, cfg.dataset, cfg.loss
    if 0 < t.gradient_clip_val < TINY_CLIP:
        warn_once(
            f"trainer.gradient_clip_val={t.gradient_clip_val:g} clips every gradient to a tiny "
            "norm: SGD steps barely move the weights (Adam rescales them back). Typical values "
            "are 0.5-5."
        )
    if 0 < t.max_epochs < t.val_every_n_epochs and t.max_steps < 1:
        warn_once(
            f"trainer.val_every_n_epochs={t.val_every_n_epochs} > trainer.max_epochs="
            f"{t.max_epochs}: validation runs only once, after the last epoch (best.pt is that "
            "epoch's weights)"
        )
    num_classes = ds.get("num_classes")
    if num_classes is not None and num_classes < 2:
        raise UserError(
            f"dataset.num_classes={num_classes}: a classifier needs at least 2 classes (with one, "
            "the loss is 0 and the accuracy 1 whatever the weights)."
        )
    std = ds.get("std")
    if std is not None and any(s <= 0 for s in std):
        raise UserError(
            f"dataset.std={list(std)}: every value must be > 0 (inputs are divided by it; 0 "
            "makes them infinite). Use the data's per-channel std, e.g. `dataset.std=[0.5]`."
        )
    smoothing = loss.get("label_smoothing")
    if smoothing is not None and not 0 <= smoothing < 1:
        raise UserError(
            f"loss.label_smoothing={smoothing} must be in [0, 1) (1 makes every target uniform: "
            "the loss no longer depends on the label). Use e.g. `loss.label_smoothing=0.1`."
        )
    dropout = cfg.model.get("dropout")
    if isinstance(dropout, int | float) and not 0 <= dropout < 1:
        raise UserError(
            f"model.dropout={dropout} must be in [0, 1) (1 zeroes every activation). Use e.g. "
            "`model.dropout=0.1`."
        )
    eps = cfg.optimizer.get("eps")
    if eps == 0:
        warn_once(
            "optimizer.eps=0: Adam divides by sqrt(v) + eps, so a parameter whose gradient is "
            "exactly 0 gets 0/0 = NaN. Keep a small eps (1e-8)."
        )


# ---- validate: the checks above and the small ones below, run in order ----------------------


def check_strategy_supported(cfg: DictConfig) -> None:
    why = STRATEGY_REFUSED.get(cfg.strategy.name)
    if why is not None:
        raise UserError(why)


def check_required_keys(cfg: DictConfig) -> None:
    """Keys left ??? in the config (a `_target_` of the user's own, say)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        raise UserError(
            f"{key} is required (it is ??? in the config) but was not given. Set it on the "
            f"command line, e.g. `{key}=...`"
            + (" (the dotted path of your class or function)." if key.endswith("_target_") else ".")
        )


def check_named_groups(cfg: DictConfig) -> None:
    """Each NAMED_GROUPS option names one of the options accel-train builds itself."""
    for group in NAMED_GROUPS:
        allowed = tuple(OPTION_SCHEMAS[group])
        if not isinstance(cfg[group], DictConfig) or "name" not in cfg[group]:
            # A user's own YAML in the group (hydra.searchpath) with a `_target_` of its own.
            raise UserError(
                f"{group}: the chosen {group} option sets no {group}.name. accel-train builds "
                f"the {group} itself, picked by name ({', '.join(allowed)}), so an option of "
                f"your own in the {group} group starts from one of those and changes its keys: "
                f"`defaults: [{allowed[0]}, _self_]` at its top. (Classes of your own by "
                "`_target_` go under model, dataset, loss and callbacks.)"
            )
        if cfg[group].name not in allowed:
            raise UserError(
                f"{group}.name={cfg[group].name!r} is not one of {', '.join(allowed)}. "
                f"Pick a {group} option, e.g. `{group}={allowed[0]}`."
            )


def check_choices(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}.")


def check_minimums(cfg: DictConfig) -> None:
    for key, (minimum, meaning) in MINIMUMS.items():
        value = OmegaConf.select(cfg, key, default=minimum)
        if isinstance(value, int | float) and value < minimum:
            fix = f"`{key}={max(minimum, 1)}`"
            raise UserError(f"{key}={value} must be >= {minimum} ({meaning}). Set e.g. {fix}.")


def check_targets(cfg: DictConfig) -> None:
    """The groups built by `_target_` name what builds them."""
    for group in ("model", "dataset", "loss"):
        if not isinstance(cfg[group], DictConfig) or "_target_" not in cfg[group]:
            raise UserError(
                f"{group} has no _target_: every {group} option names the class or factory that "
                f"builds it. Pick an option (`{group}=custom {group}._target_=my_pkg.module.Name`)."
            )


def check_run_length(cfg: DictConfig) -> None:
    t = cfg.trainer
    if t.max_epochs < 1 and t.max_steps < 1:
        raise UserError(
            f"trainer.max_epochs={t.max_epochs} and trainer.max_steps={t.max_steps}: nothing to "
            "train. Set `trainer.max_epochs=1` or more, or `trainer.max_steps=1` or more."
        )


def check_step_size(cfg: DictConfig) -> None:
    """The gradient clip and the learning rate."""
    t = cfg.trainer
    if t.gradient_clip_val < 0:
        raise UserError(
            f"trainer.gradient_clip_val={t.gradient_clip_val} must be >= 0 (0 turns clipping off)."
        )
    if cfg.optimizer.lr <= 0:
        raise UserError(f"optimizer.lr={cfg.optimizer.lr} must be > 0, e.g. `optimizer.lr=1e-3`.")


def check_ray_loader(cfg: DictConfig) -> None:
    """loader=ray's own keys, and the splits that cannot travel to its workers."""
    lc = cfg.loader
    if lc.name != "ray":
        return
    for key, low, what in (
        ("num_workers", 1, "Ray data workers per training process"),
        ("prefetch", 1, "batches in flight per data worker"),
        ("retries", 0, "times a batch is sent again after its worker died"),
        ("max_restarts", -1, "restarts of a dead worker; -1 = without limit"),
    ):
        if lc[key] < low:
            raise UserError(f"loader.{key}={lc[key]} must be >= {low} ({what}).")
    for key in ("cpus_per_worker", "timeout_s"):
        if not lc[key] > 0:
            raise UserError(f"loader.{key}={lc[key]} must be > 0.")
    if cfg.dataset.get("decode") == "gpu":
        raise UserError(
            "dataset.decode=gpu with loader=ray: decode=gpu hands the encoded JPEG bytes (or "
            "the video files' frame lists) to the GPU, which decodes and crops them there, so "
            "there is nothing for Ray's CPU workers to do. Use `dataset.decode=cpu` to decode on "
            "the Ray cluster's CPUs, or `loader=torch` to keep decoding on the GPU."
        )


def check_loader(cfg: DictConfig) -> None:
    check_ray_loader(cfg)
    if cfg.loader.name == "torch" and cfg.loader.prefetch_factor < 1:
        raise UserError("loader.prefetch_factor must be >= 1 (batches loaded ahead per worker).")
    context = cfg.loader.get("multiprocessing_context")
    if context is not None and context not in ("fork", "spawn", "forkserver"):
        raise UserError(
            f"loader.multiprocessing_context={context!r} is not a start method: use fork, spawn, "
            "forkserver or null (Python's default)."
        )


def check_val_fraction(cfg: DictConfig) -> None:
    if not 0 <= cfg.dataset.get("val_fraction", 0.1) < 1:
        raise UserError(
            f"dataset.val_fraction={cfg.dataset.val_fraction} must be in [0, 1): the share of the "
            "training data held out for validation, e.g. `dataset.val_fraction=0.1`."
        )


def check_objective(cfg: DictConfig) -> None:
    if cfg.objective not in OBJECTIVES:
        raise UserError(
            f"objective={cfg.objective!r} is not a summary.json metric: pick one of "
            f"{', '.join(OBJECTIVES)} (e.g. `objective=best_val_acc`)."
        )


def check_resume(cfg: DictConfig) -> None:
    # A checkpoint is a .pt file, or (FSDP) a .dcp directory holding meta.pt.
    if cfg.resume not in (None, "auto") and not (
        Path(cfg.resume).is_file() or (Path(cfg.resume) / "meta.pt").is_file()
    ):
        raise UserError(
            f"resume={cfg.resume!r}: no such checkpoint. Give a path to a .pt file (or an FSDP "
            ".dcp directory) written by accel-train, or `resume=auto` to continue from the run "
            "directory's last checkpoint."
        )


def check_gpu_decode(cfg: DictConfig) -> None:
    """dataset.decode=gpu (image folders: nvJPEG on the CUDA device; video folders: NVDEC
    through torchcodec) needs that device."""
    if OmegaConf.select(cfg, "dataset.decode") != "gpu":
        return
    why = cpu_run(cfg)
    if why:
        raise UserError(
            f"dataset.decode=gpu decodes the JPEGs on the CUDA device with nvJPEG (videos: with "
            f"NVDEC, torchcodec's CUDA decoder), but {why}. Use `dataset.decode=cpu` (the "
            "loader workers decode: libjpeg-turbo for images, FFmpeg for videos) or run on a "
            "machine with a CUDA GPU."
        )


# In this order: when a config breaks several rules, the first check's error is the one shown
# (the tests match it), so a check that needs keys another one vets comes after that one.
CHECKS = (
    check_strategy_supported,
    check_required_keys,
    check_named_groups,
    check_loggers,
    check_choices,
    check_minimums,
    check_targets,
    check_strategy_transforms,
    check_memory_techniques,
    check_task,
    check_run_length,
    check_step_size,
    check_optimizer,
    check_muon,
    check_lora,
    check_gpt_options,
    check_lm_loss,
    check_scheduler,
    check_warmup,
    check_compression,
    check_pointless,
    check_loop_intervals,
    check_loader,
    check_val_fraction,
    check_objective,
    check_resume,
    check_gpu_decode,
    check_activation_offload,
    check_liger,
    check_recipe,
    check_text_in_training,
)


def validate(cfg: DictConfig) -> None:
    """Raises UserError naming the key and the fix (the first of CHECKS that fails)."""
    for check in CHECKS:
        check(cfg)

"""Checks of the recipe switches of issue 38 (docs/vision.md "Recipe switches"), before any
process starts: the dataset's batch switches (random erasing, mixup/cutmix), the task they need,
optimizer.layer_decay and trainer.progressive_resize. Each refusal names the key and the fix.
(What needs the built model or data, a timm model's layer groups or a split that crops each
sample, is checked where they are built: optim.py, data/images/sample_recipe.py.)"""

from __future__ import annotations

import re
from dataclasses import fields

from omegaconf import DictConfig, OmegaConf

from accel_train.config.facts import task_class
from accel_train.config.schema import ProgressiveResizeConfig
from accel_train.errors import UserError

ERASING_MODES = ("pixel", "rand", "const")
MIXUP_MODES = ("batch", "pair", "elem")
PROB = "a probability in [0, 1]"
# timm's auto_augment_transform policy names (timm/data/auto_augment.py auto_augment_policy).
POLICIES = ("original", "originalr", "v0", "v0r", "3a")
# The sections each policy family's parser reads (timm/data/auto_augment.py: a key and a number,
# e.g. `m9`). timm skips a section without a number silently (`rand-bogus` ran as plain `rand`),
# so every section is checked here first. RandAugment also takes `t<set>`: one of RAND_SETS
# (timm's rand_augment_choices, which falls back to the default set for any other name).
RAND_SETS = ("weights", "3aw", "3a")
SECTIONS = {
    "rand": {"m": "magnitude", "n": "ops per image", "p": "op probability",
             "mstd": "magnitude noise", "mmax": "magnitude ceiling", "inc": "increasing ops"},
    "augmix": {"m": "severity", "w": "chain width", "d": "chain depth", "a": "alpha",
               "b": "blend", "mstd": "magnitude noise"},
    "auto": {"mstd": "magnitude noise"},
}  # fmt: skip


def check_recipe(cfg: DictConfig) -> None:
    ds = cfg.dataset
    if "mixup_alpha" in ds:  # the options with the recipe keys (image_folder)
        _check_values(ds)
        _check_task(cfg, ds)
        if ds.auto_augment and ds.get("decode") == "gpu":
            raise UserError(
                f"dataset.auto_augment={ds.auto_augment} runs on each decoded sample in the "
                "loader workers, and dataset.decode=gpu decodes on the device, after the loader. "
                "Use `dataset.decode=cpu` with auto_augment, or drop `dataset.auto_augment`."
            )
        _check_policy(ds.auto_augment)
    _check_layer_decay(cfg.optimizer)
    resize = cfg.trainer.get("progressive_resize")
    if resize is not None:
        _check_progressive(resize)


def recipe_switches(cfg: DictConfig) -> list[str]:
    """The recipe switches a run has on, as the `techniques:` line names them (they are not
    Technique objects: the loader, the task's batch mixing and the optimizer run them)."""
    ds, on = cfg.dataset, []
    if ds.get("auto_augment"):
        on.append(f"auto_augment={ds.auto_augment}")
    if ds.get("random_erasing"):
        on.append(f"random_erasing={ds.random_erasing}")
    if ds.get("mixup_alpha"):
        on.append(f"mixup={ds.mixup_alpha}")
    if ds.get("cutmix_alpha"):
        on.append(f"cutmix={ds.cutmix_alpha}")
    if cfg.optimizer.get("layer_decay") is not None:
        on.append(f"layer_decay={cfg.optimizer.layer_decay}")
    return on


def policy_sections_problem(spec: str) -> str | None:
    """What is wrong with the sections of a timm policy string (None: nothing): an unknown
    family, or a section timm's parser would skip silently or refuse."""
    name, *sections = spec.split("-")
    if spec == "trivial":
        return None
    family = name if name in ("rand", "augmix") else "auto" if name in POLICIES else None
    if family is None:
        return f"unknown policy {name!r}"
    keys = SECTIONS[family]
    for section in sections:
        if family == "rand" and section.startswith("t"):
            if section[1:] in RAND_SETS:
                continue
            return f"the section {section!r} names no transform set of timm's: t" + ", t".join(
                RAND_SETS
            )
        key, *value = re.split(r"(\d.*)", section)
        if key not in keys or not value:
            known = ", ".join(f"{k}<number> ({what})" for k, what in keys.items())
            sets = f", t<set> (one of {', '.join(RAND_SETS)})" if family == "rand" else ""
            return f"the section {section!r} is not one of {name}'s: {known}{sets}"
    return None


def _check_policy(spec) -> None:
    problem = policy_sections_problem(str(spec)) if spec else None
    if problem:
        raise UserError(
            f"dataset.auto_augment={spec!r}: {problem}. timm would skip or refuse it; use "
            "timm's spelling, e.g. `rand-m9-mstd0.5-inc1` (RandAugment), `augmix-m5-w3`, "
            "`original-mstd0.5`, `trivial`, or null (off)."
        )


def _check_values(ds: DictConfig) -> None:
    for key, ok, what, example in (
        ("random_erasing", 0 <= ds.random_erasing <= 1, PROB, 0.25),
        ("random_erasing_count", ds.random_erasing_count >= 1, "the most boxes per image, >= 1", 1),
        ("mixup_alpha", ds.mixup_alpha >= 0, "Beta's alpha, >= 0 (0 = off)", 0.8),
        ("cutmix_alpha", ds.cutmix_alpha >= 0, "Beta's alpha, >= 0 (0 = off)", 1.0),
        ("mixup_prob", 0 <= ds.mixup_prob <= 1, PROB, 1.0),
        ("mixup_switch_prob", 0 <= ds.mixup_switch_prob <= 1, PROB, 0.5),
        ("random_erasing_mode", ds.random_erasing_mode in ERASING_MODES,
         f"one of {', '.join(ERASING_MODES)} (timm's --remode)", "pixel"),
        ("mixup_mode", ds.mixup_mode in MIXUP_MODES,
         f"one of {', '.join(MIXUP_MODES)} (timm's --mixup-mode)", "batch"),
    ):  # fmt: skip
        if not ok:
            raise UserError(
                f'dataset.{key}={ds[key]!r} must be {what}: docs/vision.md "Recipe switches" '
                f"says what each switch does, in timm's terms. Set e.g. `dataset.{key}={example}`."
            )


def _check_task(cfg: DictConfig, ds: DictConfig) -> None:
    mixing = ds.mixup_alpha > 0 or ds.cutmix_alpha > 0
    if not mixing and ds.random_erasing == 0:
        return
    key = "dataset.mixup_alpha/cutmix_alpha" if mixing else "dataset.random_erasing"
    cls = task_class(cfg)
    if cls is not None and not getattr(cls, "soft_targets", False):
        name = cfg.task.get("name", cls.__name__)
        raise UserError(
            f"{key} with task={name}: the batch switches mix or erase a classifier's training "
            "images and train on soft targets (mixup/cutmix), which only task=classification "
            f"understands. Use `task=classification`, or turn them off (`{key.split('/')[0]}=0`)."
        )
    if mixing and ds.mixup_mode == "pair":
        loader = cfg.loader
        if loader.batch_size % 2 if isinstance(loader.batch_size, int) else True:
            raise UserError(
                f"dataset.mixup_mode=pair mixes sample i with sample B-1-i, so every batch must "
                f"be even, and loader.batch_size={loader.batch_size} is not (or is probed: auto). "
                "Set an even `loader.batch_size` (with `loader.drop_last=true`), or use "
                "`dataset.mixup_mode=batch` or `elem`, which mix any batch."
            )
        if not loader.drop_last:
            raise UserError(
                "dataset.mixup_mode=pair needs even batches, and an epoch's short last batch may "
                "be odd. Set `loader.drop_last=true` (timm's loader drops it too), or use "
                "`dataset.mixup_mode=batch` or `elem`."
            )


def _check_layer_decay(opt: DictConfig) -> None:
    decay = opt.get("layer_decay")
    if decay is None:
        return
    if not 0 < decay <= 1:
        raise UserError(
            f"optimizer.layer_decay={decay} must be in (0, 1]: the head's lr is optimizer.lr and "
            "each layer group below it gets layer_decay times the one above (timm's; ViT "
            "fine-tuning uses 0.65-0.75). Set e.g. `optimizer.layer_decay=0.65`, or null (off)."
        )
    if opt.name == "muon":
        raise UserError(
            "optimizer.layer_decay with optimizer=muon: Muon splits the parameters into its own "
            "two groups (hidden matrices, the rest). Use `optimizer=adamw` (or adam, sgd) for "
            "layer-wise lr decay, or `optimizer.layer_decay=null`."
        )


def _check_progressive(node) -> None:
    """trainer.progressive_resize: ProgressiveResizeConfig's keys (a missing one at its
    default), each an int, 1 <= sizes and step, 0 <= start_epoch <= end_epoch."""
    key = "trainer.progressive_resize"
    defaults = {f.name: f.default for f in fields(ProgressiveResizeConfig)}
    given = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    ok = isinstance(given, dict) and set(given) <= set(defaults)
    values = {**defaults, **given} if ok else {}
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in values.values())
    sizes_ok = ok and min(values["start_size"], values["end_size"], values["step"]) >= 1
    if sizes_ok and 0 <= values["start_epoch"] <= values["end_epoch"]:
        return
    raise UserError(
        f"{key}={given!r}: give a dict of {', '.join(defaults)} (ints; defaults "
        f"{', '.join(f'{k}={v}' for k, v in defaults.items())}) with start_size, end_size, "
        "step >= 1 and 0 <= start_epoch <= end_epoch: the training images are start_size px "
        "up to start_epoch, end_size px from end_epoch, in between rounded to a multiple of "
        f"step (FFCV's schedule). E.g. `{key}={{start_size:160,end_size:192,start_epoch:10,"
        "end_epoch:13}` (or null: off)."
    )

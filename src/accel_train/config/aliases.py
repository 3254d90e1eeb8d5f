"""lightning-hydra-template's command-line spellings, as aliases of ours (issue 22, section 5).

`alias_overrides(argv)` rewrites the overrides before Hydra sees them, so both spellings work
and the composed config, config.yaml and the checks only ever know ours (the "Coming from
Lightning" table of docs/configuration.md lists each). Imports nothing heavy: the CLI calls it
before composing.

  experiment=X, debug=X              +experiment=X, +debug=X
  debug=fdr|profiler|limit|default   +debug=fast_dev_run | +debug=profile | a few limited
                                     epochs | one epoch, one CPU process, anomaly detection
  task_name=X, data=X                name=X, dataset=X
  trainer.accelerator=gpu|cpu|auto   trainer.device=cuda|cpu|auto
  trainer.devices=N                  launcher.nproc_per_node=N
  trainer.precision=16-mixed|...     precision=fp16 | bf16 (bf16-mixed) | bf16_true | fp32
  trainer.fast_dev_run=true          +debug=fast_dev_run
  trainer.check_val_every_n_epoch=N  trainer.val_every_n_epochs=N
  callbacks.model_checkpoint.every_n_train_steps=N   trainer.ckpt_every_n_steps=N
  seed=N                             trainer.seed=N
  ckpt_path=P                        resume=P
  test=true|false                    trainer.test_after_fit=...
  train=false (with ckpt_path=P)     no training: accel-eval ckpt_path=P (the test split)
  train=true                         (the default)
  trainer=cpu|gpu|ddp|ddp_sim        trainer.device=cpu | trainer.device=cuda |
                                     strategy=ddp launcher.nproc_per_node=auto |
                                     strategy=ddp launcher.nproc_per_node=2 trainer.device=cpu
  trainer.detect_anomaly=true        autograd's anomaly mode (techniques/anomaly.py)
  callbacks=default                  (our defaults: checkpoints kept, early stopping as set)
  callbacks=none                     no early stopping, no checkpoint files
  callbacks=model_checkpoint         checkpoints kept, no early stopping
  callbacks=early_stopping           early stopping on the task's monitored metric (and mode);
                                     checkpoints kept (Lightning's default checkpoint)
  callbacks.early_stopping.K=V       early_stopping.K=V
  callbacks.model_checkpoint.K=V     checkpoint.K=V
  logger=many_loggers                logger=[csv,tensorboard] and each installed tracker
  logger=aim                         refused: how to get the runs into Aim instead
  extras.print_config=true|false     the start-up config tree shown (or not)
  extras.ignore_warnings=true        Python warnings silenced in every process of the run
  extras.enforce_tags=true           refused unless the run has tags (tags=[...])
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field

from accel_train.errors import UserError

_TRUE, _FALSE = ("true", "True", "1", "yes"), ("false", "False", "0", "no")

# Simple renames: LHT key -> ours (the value is kept).
RENAMED = {
    "seed": "trainer.seed",
    "ckpt_path": "resume",
    "test": "trainer.test_after_fit",
    "task_name": "name",
    "data": "dataset",
    "trainer.devices": "launcher.nproc_per_node",
    "trainer.check_val_every_n_epoch": "trainer.val_every_n_epochs",
    "callbacks.model_checkpoint.every_n_train_steps": "trainer.ckpt_every_n_steps",
}
# LHT's debug configs whose name differs from ours, and the one with no twin here.
DEBUGS = {
    "fdr": ["+debug=fast_dev_run"],
    "profiler": ["+debug=profile"],
    # LHT's debug=default: one epoch, one CPU process, anomaly detection, no loader workers.
    "default": [
        "trainer.max_epochs=1",
        "trainer.device=cpu",
        "launcher.nproc_per_node=1",
        "loader.num_workers=0",
        "logger=none",
        "+callbacks.detect_anomaly._target_=accel_train.techniques.anomaly.DetectAnomaly",
    ],
}
DEBUG_LIMIT = [  # LHT's debug=limit: a few epochs on a sliver of each split
    "trainer.max_epochs=3",
    "trainer.limit_train_batches=0.01",
    "trainer.limit_val_batches=0.05",
    "trainer.limit_test_batches=0.05",
]
ACCELERATORS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "auto": "auto"}
PRECISIONS = {  # Lightning's trainer.precision -> our precision option
    "32": "fp32",
    "32-true": "fp32",
    "16": "fp16",
    "16-mixed": "fp16",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16_true",
}
# LHT's trainer configs (configs/trainer/*.yaml there) -> our overrides.
TRAINERS = {
    "cpu": ["trainer.device=cpu"],
    "gpu": ["trainer.device=cuda"],
    "ddp": ["strategy=ddp", "launcher.nproc_per_node=auto"],
    "ddp_sim": ["strategy=ddp", "launcher.nproc_per_node=2", "trainer.device=cpu"],
}
CALLBACK_KEYS = {"early_stopping": "early_stopping", "model_checkpoint": "checkpoint"}
CALLBACKS_NONE = [
    "early_stopping.monitor=null",
    "checkpoint.save_top_k=0",
    "checkpoint.save_last=false",
]
# LHT's callback groups (configs/callbacks/*.yaml there) -> our overrides.
CALLBACK_GROUPS = {
    "default": [],
    "none": CALLBACKS_NONE,
    "model_checkpoint": ["early_stopping.monitor=null"],
    "early_stopping": [
        "early_stopping.monitor=${task.monitor}",
        "early_stopping.mode=${task.monitor_mode}",
    ],
}
TRACKERS = ("mlflow", "wandb")  # in many_loggers when installed
_ANOMALY = "accel_train.techniques.anomaly.DetectAnomaly"  # trainer.detect_anomaly=true


@dataclass
class Aliased:
    """The rewritten overrides, and what the CLI does besides composing them."""

    argv: list[str]
    test_only: str | None = None  # train=false: the checkpoint to test instead of training
    ignore_warnings: bool = False
    enforce_tags: bool = False
    renamed: list[str] = field(default_factory=list)  # "there -> here", for the log


def _bool(key: str, value: str) -> bool:
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UserError(f"{key}={value!r} must be true or false.")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def alias_overrides(argv: list[str]) -> Aliased:
    """`argv` with lightning-hydra-template's spellings rewritten as ours (the module docstring
    lists them); the rest is kept as given."""
    out = Aliased(argv=[])
    train, ckpt = True, None
    for arg in argv:
        key, eq, value = arg.partition("=")
        if arg.startswith("-") or not eq:
            out.argv.append(arg)  # a flag (-m, --cfg job), or the value of one
            continue
        if key == "train":  # no override: it picks between training and testing
            train, new = _bool(key, value), []
        else:
            new = _rewritten(key, value, out)
        if key == "ckpt_path":
            ckpt = value
        if new is None:
            out.argv.append(arg)
        else:
            out.argv.extend(new)
            out.renamed.append(f"{arg} -> {' '.join(new) or '(our default)'}")
    if not train:
        out.test_only = _checkpoint_to_test(ckpt, out.argv)
    return out


def _rewritten(key: str, value: str, out: Aliased) -> list[str] | None:
    """Our overrides for one LHT `key=value`; None when it is ours already. The spellings'
    keys do not overlap, except that RENAMED's callbacks.model_checkpoint key comes before the
    callbacks.model_checkpoint.K rule."""
    for spelling in (_debug, _trainer, _renamed, _callbacks, _logger):
        new = spelling(key, value)
        if new is not None:
            return new
    return _extras(key, value, out)


def _debug(key: str, value: str) -> list[str] | None:
    if key == "debug" and value in DEBUGS:
        return list(DEBUGS[value])
    if key == "debug" and value == "limit":
        return list(DEBUG_LIMIT)
    if key in ("experiment", "debug"):
        return [f"+{key}={value}"]
    return None


def _trainer(key: str, value: str) -> list[str] | None:
    """Lightning's Trainer arguments and LHT's trainer configs."""
    if key == "trainer.accelerator":
        if value not in ACCELERATORS:
            raise UserError(
                f"trainer.accelerator={value}: accel-train trains on CUDA GPUs or the CPU: "
                "`trainer.device=cuda`, `cpu` or `auto` (trainer.accelerator=gpu|cpu|auto)."
            )
        return [f"trainer.device={ACCELERATORS[value]}"]
    if key == "trainer.precision" and value in PRECISIONS:
        return [f"precision={PRECISIONS[value]}"]
    if key == "trainer.fast_dev_run":
        return ["+debug=fast_dev_run"] if _bool(key, value) else None
    if key == "trainer" and value == "mps":
        raise UserError(
            "trainer=mps: accel-train trains on CUDA GPUs or the CPU (Apple's MPS is not "
            "supported). Use `trainer=cpu` (or `trainer.device=cpu`)."
        )
    if key == "trainer" and value in TRAINERS:
        return list(TRAINERS[value])
    if key == "trainer.detect_anomaly":
        return [f"+callbacks.detect_anomaly._target_={_ANOMALY}"] if _bool(key, value) else []
    return None


def _renamed(key: str, value: str) -> list[str] | None:
    return [f"{RENAMED[key]}={value}"] if key in RENAMED else None


def _callbacks(key: str, value: str) -> list[str] | None:
    """LHT's callback groups, and the keys of its two callbacks that we have as our own."""
    if key == "callbacks" and value in CALLBACK_GROUPS:
        return list(CALLBACK_GROUPS[value])
    if key.startswith("callbacks.") and key.split(".")[1] in CALLBACK_KEYS:
        _, lht, rest = key.split(".", 2) if key.count(".") >= 2 else (*key.split("."), "")
        if not rest:
            raise UserError(
                f"{key}: set its keys one by one, e.g. `callbacks.{lht}.patience=3` "
                f"(= `{CALLBACK_KEYS[lht]}.patience=3`)."
            )
        return [f"{CALLBACK_KEYS[lht]}.{rest}={value}"]
    return None


def _logger(key: str, value: str) -> list[str] | None:
    if key == "logger" and value == "many_loggers":
        loggers = ["csv", "tensorboard", *(t for t in TRACKERS if _installed(t))]
        return [f"logger=[{','.join(loggers)}]"]
    if key == "logger" and "aim" in re.split(r"[\[\],\s]+", value):
        raise UserError(
            "logger=aim: Aim is not one of accel-train's loggers (csv, tensorboard, mlflow, "
            "wandb). Log with `logger=tensorboard` (or mlflow) and let Aim read the runs: "
            "`pip install aim`, then `aim init` and `aim convert tensorboard --logdir "
            "outputs/` (or `aim convert mlflow`), and `aim up` to browse them."
        )
    return None


def _extras(key: str, value: str, out: Aliased) -> list[str] | None:
    """LHT's `extras`: what the CLI does besides composing (kept in `out`)."""
    if key == "extras.print_config":
        return [] if _bool(key, value) else ["trainer.progress=none"]
    if key == "extras.ignore_warnings":
        out.ignore_warnings = _bool(key, value)
        return []
    if key == "extras.enforce_tags":
        out.enforce_tags = _bool(key, value)
        return []
    return None


def _checkpoint_to_test(ckpt: str | None, argv: list[str]) -> str:
    """train=false: the checkpoint to test instead of training (it needs one, and a test)."""
    if ckpt is None:
        raise UserError(
            "train=false tests a checkpoint without training (lightning-hydra-template's "
            "spelling): give it, `train=false ckpt_path=outputs/<run>/checkpoints/best.pt`, "
            "or run `accel-eval ckpt_path=...`."
        )
    if "trainer.test_after_fit=false" in argv or any(
        a == f"trainer.test_after_fit={v}" for v in _FALSE for a in argv
    ):
        raise UserError("train=false with test=false: nothing to do. Drop one of them.")
    return ckpt


def apply_process_wide(aliased: Aliased) -> None:
    """What an alias changes for the whole run, child processes included."""
    if aliased.ignore_warnings:
        import warnings

        warnings.filterwarnings("ignore")
        os.environ["PYTHONWARNINGS"] = "ignore"  # torchrun's workers inherit it


def eval_argv(aliased: Aliased) -> list[str]:
    """train=false: accel-eval's overrides for the checkpoint (and the device, if set)."""
    argv = [f"ckpt_path={aliased.test_only}"]
    for arg in aliased.argv:
        if arg.startswith("trainer.device="):
            argv.append(f"device={arg.partition('=')[2]}")
        if arg.startswith("paths.data_dir="):
            argv.append(f"data_dir={arg.partition('=')[2]}")
    return argv

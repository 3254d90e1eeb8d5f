"""Scoring a model on a split, and `accel-eval`: rebuild a model from a checkpoint's own config
and score it on the data set's test split."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import default_collate

from accel_train.command_checks import (
    check_ckpt_path,
    check_device_name,
    check_eval_keys,
    check_sources,
)
from accel_train.data.batch import to_device
from accel_train.data.build import build_splits
from accel_train.data.builtin import hints_for
from accel_train.data.loaders import build_loader
from accel_train.data.transform import BatchTransform
from accel_train.errors import UserError
from accel_train.loggers import json_safe
from accel_train.parallel import DistEnv, resolve_device
from accel_train.precision import Precision, resolve_precision
from accel_train.run_checkpoint import RunCheckpoint
from accel_train.tasks import Predictions, Task, TaskContext, build_task
from accel_train.techniques.channels_last import to_channels_last
from accel_train.train.batchnorm_stats import warn_if_unsettled
from accel_train.train.eval_predictions import (
    class_names,
    confusion,
    draw_confusion,
    foreign_file,
    per_class_accuracy,
    prediction_paths,
    write_csv,
)
from accel_train.train.harness_eval import evaluate_harness
from accel_train.written import make_parents, remove_empty

log = logging.getLogger("accel_train")


@torch.no_grad()
def score(model, loader, task: Task, precision: Precision, env: DistEnv) -> dict[str, float]:
    """The task's metrics (loss, accuracy, ...) over the whole split, each example counted once
    across ranks: {name: mean}.

    Padding samples (so that every rank runs the same number of batches) sit at the end of a
    rank's last batches; the host knows how many, so the task slices them off without a sync."""
    model.eval()
    warn_if_unsettled(model)  # BatchNorm statistics of a few batches (train/batchnorm_stats.py)
    task.eval_metrics.reset()
    for b, batch in enumerate(loader.epoch(0)):
        with precision.autocast():
            batch = task.prepare(batch, train=False)
        task.evaluate(model, batch, loader.order.valid_len(b), precision.autocast)
    on_device, on_host = task.eval_metrics.pack()
    device = torch.stack([t.double() for t in on_device]) if on_device else None
    host = torch.tensor(on_host, dtype=torch.float64, device=env.device)
    totals = torch.cat([device, host]) if device is not None else host
    # HOST SYNC: the one read of the pass.
    values = env.all_reduce_sum(totals).tolist()
    k = len(on_device)
    return task.derived(task.eval_metrics.read(values[:k], values[k:]))


# accel-eval's own keys, as its messages name them.


def evaluate_checkpoint(ecfg: DictConfig) -> dict[str, Any]:
    """The body of `accel-eval`. Every failure the user can fix is a UserError naming
    accel-eval's own keys (ckpt_path, data_dir, out_path, batch_size, device); with
    harness.tasks, lm-evaluation-harness scores the checkpoint or model_path instead."""
    check_sources(ecfg)
    if ecfg.harness.tasks:
        if not ecfg.model_path:
            check_ckpt_path(ecfg)
        return evaluate_harness(ecfg, _check_device(ecfg))
    ckpt_path, device = _check_eval_config(ecfg)
    opened = RunCheckpoint(ckpt_path, redo="Evaluate it with the version that wrote it.")
    cfg, state = opened.cfg, opened.state
    if ecfg.data_dir:
        cfg.paths.data_dir = ecfg.data_dir
    if ecfg.batch_size:
        cfg.loader.eval_batch_size = ecfg.batch_size
    if ecfg.data_path:
        _score_file(ecfg, cfg)
    precision = resolve_precision(cfg.precision.name, device, cfg.precision.tf32)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device)

    task = build_task(cfg)
    with hints_for("accel-eval"):  # data errors name `data_dir=`, not paths.data_dir
        splits = build_splits(cfg.dataset, cfg.paths.data_dir, task.labelled_data)
    split = _chosen_split(ecfg, splits, ckpt_path, cfg)
    data = getattr(splits, split)
    model = opened.model(splits.data_args, precision.param_dtype, device)
    if cfg.trainer.channels_last:
        model = to_channels_last(model)  # (channels_last_3d for a video model's Conv3d)
    loader = _eval_loader(data, cfg, device, splits, task)
    transform = BatchTransform(cfg.dataset, splits, device, precision.param_dtype, seed=0, rank=0)
    batch = sample_batch(splits, device)
    task.setup(TaskContext(cfg, device, splits.data_args, transform, model, batch, splits=splits))
    out = Path(ecfg.out_path) if ecfg.out_path else _default_out(ckpt_path, split)
    keep_cases = getattr(task, "keep_cases", None)  # a task's per-case table and predictions
    if keep_cases is not None:
        keep_cases(out.parent / f"{out.stem}_cases", data)
    kept = task.keep_predictions()  # a classifier's per-item predictions (None: no classes)
    scored = score(model, loader, task, precision, env)
    cases = task.write_cases() if keep_cases is not None else []
    result = {
        "ckpt_path": str(ckpt_path),
        "dataset": cfg.dataset.get("name", "custom"),
        "task": cfg.task.get("name") or str(cfg.task._target_),
        "split": split,
        **({"data_path": str(ecfg.data_path)} if ecfg.data_path else {}),
        "num_samples": len(data),
        **({"num_records": data.records} if hasattr(data, "records") else {}),
        **{f"{split}/{name}": value for name, value in scored.items()},
        "step": state["progress"]["step"],
        "epoch": state["progress"]["epoch"],
        "precision": precision.describe(),
        **({"cases": cases} if cases else {}),
        **_per_class(kept, splits),
    }
    # The result first: a failed write below still leaves it on the screen.
    shown = "  ".join(f"{split}/{name}={value:.4f}" for name, value in scored.items())
    log.info("%s  (%s)  -> %s", shown, _counted(data), out)
    _write_outputs(result, out, bool(ecfg.out_path), kept, data, class_names(splits))
    return result


def _per_class(kept: Predictions | None, splits) -> dict[str, Any]:
    """The result's per_class_acc where the task kept predictions (a classifier)."""
    if kept is None:
        return {}
    return {"per_class_acc": per_class_accuracy(kept, class_names(splits))}


def _write_outputs(result, out: Path, given: bool, kept: Predictions | None, data, names) -> None:
    """The result JSON, and beside it a classifier's predictions (a file of another's at their
    names refused before anything is written)."""
    if kept is not None:
        _refuse_foreign(out)
    _write_result(result, out, given=given)
    if kept is not None:
        _write_predictions(kept, data, names, out, given, f"{result['split']} split")


def _refuse_foreign(out: Path) -> None:
    """The predictions' names beside the result are accel-eval's: a file there of another's
    is never replaced (checked before anything is written)."""
    foreign = foreign_file(out)
    if foreign is not None:
        raise UserError(
            f"{foreign} exists and is not one accel-eval wrote: accel-eval writes a classifier's "
            f"predictions there, beside its result {out.name}, and replaces only its own. Move "
            "that file or choose another `out_path` (the result is printed above)."
        )


def _write_predictions(kept, data, names: list[str], out: Path, given: bool, what: str) -> None:
    """The predictions CSV and the confusion matrix beside the result JSON (written by then,
    so its folder exists), named after it (train/eval_predictions.py)."""
    table, picture = prediction_paths(out)
    try:
        write_csv(kept, data, names, table)
        drawn = draw_confusion(confusion(kept, len(names)), names, picture, f"{out.stem}: {what}")
    except OSError as err:
        key = "out_path" if given else "out_path (by default beside the checkpoint)"
        raise UserError(
            f"{key}={out}: the result was written but its predictions could not be "
            f"({type(err).__name__}: {err.strerror or err}). Give a writable folder with "
            "`out_path=...`."
        ) from None
    log.info("per-item predictions -> %s%s", table, f", confusion matrix -> {picture}" * drawn)


def _eval_loader(data: Any, cfg: DictConfig, device: torch.device, splits: Any, task: Any):
    """The loader of the scored split: one process, in order, every batch."""
    return build_loader(
        data,
        cfg.loader,
        train=False,
        device=device,
        seed=0,
        rank=0,
        world=1,
        limit=0,
        num_classes=splits.num_classes,
        labelled=task.labelled_data,
    )


def _counted(data: Any) -> str:
    """What was scored, as the user counts it: packed instruction rows hold several records
    each (a split's `records`), so "10 packed rows (143 records)", not "10 samples"."""
    records = getattr(data, "records", None)
    if records is None:
        return f"{len(data)} samples"
    if records == len(data):
        return f"{records} records"
    return f"{len(data)} packed rows ({records} records)"


def sample_batch(splits, device: torch.device) -> Any:
    """Two real training items collated as the loader does, on the device (what a task's
    contract is checked on)."""
    items = [splits.train[i] for i in range(min(2, len(splits.train)))]
    batch = (getattr(splits.train, "collate", None) or default_collate)(items)
    return to_device(tuple(batch) if isinstance(batch, list) else batch, device)


def _check_eval_config(ecfg: DictConfig) -> tuple[Path, torch.device]:
    """accel-eval's own keys, before anything is loaded (the CLI checked those that need no
    torch already: command_checks.check_eval_config)."""
    ckpt_path = check_ckpt_path(ecfg)
    check_eval_keys(ecfg)
    return ckpt_path, _check_device(ecfg)


def _check_device(ecfg: DictConfig) -> torch.device:
    check_device_name(ecfg)
    if ecfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError(
            "device=cuda but this machine has no usable CUDA device (torch.cuda.is_available() "
            "is False). Use `device=cpu` or `device=auto`."
        )
    return resolve_device(ecfg.device)


def _score_file(ecfg: DictConfig, cfg: DictConfig) -> None:
    """data_path=FILE: the file becomes the checkpoint's data set's test split (a data set
    that reads its test split from a file: dataset=sft's test_path)."""
    if "test_path" not in cfg.dataset:
        name = cfg.dataset.get("name") or "custom"
        raise UserError(
            f"data_path={ecfg.data_path}: the checkpoint's data set (dataset={name}) reads no "
            "split from a file of records (dataset=sft does), so there is nothing to put it in. "
            "Score one of the data set's own splits instead: `split=val` (or test, train)."
        )
    if ecfg.split not in (None, "test"):
        raise UserError(
            f"data_path with split={ecfg.split}: the file is scored as a test split of its own. "
            "Drop `split=` (or drop data_path to score the checkpoint's own split)."
        )
    cfg.dataset.test_path = str(Path(ecfg.data_path).expanduser().absolute())


def _chosen_split(ecfg: DictConfig, splits, ckpt_path: Path, cfg: DictConfig) -> str:
    """`split` as given; unset: test, or val where the data set has no test split (an
    ImageNet-style train/ + val/ folder), as timm's validate.py scores the val folder."""
    if ecfg.split is not None:
        if getattr(splits, ecfg.split) is None:
            raise UserError(_no_split(ckpt_path, cfg, splits, ecfg.split))
        return ecfg.split
    if splits.test is not None:
        return "test"
    if splits.val is not None:
        log.info("accel-eval: the data set has no test split: scoring its validation split")
        return "val"
    raise UserError(_no_split(ckpt_path, cfg, splits, "test"))


def _no_split(ckpt_path: Path, cfg: DictConfig, splits, asked: str) -> str:
    name = cfg.dataset.get("name") or "custom"
    held = [n for n in ("train", "val") if getattr(splits, n, None) is not None]
    fix = (
        "Return (train, val, test) from your dataset function to score a test split, or score "
        "its validation split: `split=val`"
        if name == "custom"
        else f"dataset={name} has {' and '.join(held)} splits only: score one of them with "
        "`split=val`"
        + (", or a file of records with `data_path=<file>`" if "test_path" in cfg.dataset else "")
    )
    return (
        f"ckpt_path={ckpt_path}: split={asked} asked for a split the checkpoint's data set "
        f"({name}) does not have. {fix}."
    )


def _write_result(result: dict[str, Any], out: Path, given: bool) -> None:
    key = "out_path" if given else "out_path (by default beside the checkpoint)"
    made: list[Path] = []
    try:
        made = make_parents(out)
        out.write_text(json.dumps(json_safe(result), indent=2, allow_nan=False) + "\n")
    except OSError as err:
        remove_empty(made)  # a result that could not be written leaves no folder behind
        blocked = next((p for p in (out.parent, *out.parent.parents) if p.is_file()), None)
        if blocked is not None:
            reason = f"{blocked} is a file, not a folder"
        elif out.is_dir():
            reason = "it is a directory; give a file name"
        else:
            reason = f"{type(err).__name__}: {err.strerror or err}"
        raise UserError(
            f"{key}={out}: the result could not be written ({reason}); it is printed above. "
            "Give a writable file path with `out_path=...`."
        ) from None


def _default_out(ckpt_path: Path, split: str) -> Path:
    folder = ckpt_path.parent
    if folder.name == "checkpoints":
        folder = folder.parent  # the run dir
    suffix = "" if split == "test" else f"_{split}"  # (eval_best.json stays the test split's)
    return folder / f"eval_{ckpt_path.name.split('.')[0]}{suffix}.json"

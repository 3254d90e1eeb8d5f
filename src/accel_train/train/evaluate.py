"""Scoring a model on a split, and `accel-eval`: rebuild a model from a checkpoint's own config
and score it on the data set's test split."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from accel_train.checkpoint import load_checkpoint, load_sharded, load_sharded_meta
from accel_train.config.run_config import typed
from accel_train.data.build import build_splits
from accel_train.data.loaders import build_loader
from accel_train.data.transform import BatchTransform
from accel_train.errors import UserError
from accel_train.losses import build_loss
from accel_train.models import build_model
from accel_train.parallel import DistEnv, resolve_device
from accel_train.precision import Precision, resolve_precision

log = logging.getLogger("accel_train")


@torch.no_grad()
def score(model, loader, transform, precision: Precision, loss_fn, env: DistEnv):
    """(mean loss, accuracy) over the whole split, each example counted once across ranks.

    Padding samples (so that every rank runs the same number of batches) sit at the end of a
    rank's last batches; the host knows how many, so they are sliced off without a sync."""
    model.eval()
    stats = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, correct
    count = 0
    for b, (images, labels) in enumerate(loader.epoch(0)):
        with precision.autocast():
            logits = model(transform(images, train=False))
        k = loader.order.valid_len(b)
        if k == 0:
            continue  # all padding: the forward still ran, as collectives in it require
        logits, labels = logits[:k].float(), labels[:k]
        stats[0] += loss_fn(logits, labels).double() * k
        stats[1] += (logits.argmax(1) == labels).sum()
        count += k
    totals = torch.cat([stats, torch.tensor([count], dtype=torch.float64, device=env.device)])
    # HOST SYNC: the one read of the pass.
    loss_sum, correct, total = env.all_reduce_sum(totals).tolist()
    return loss_sum / max(total, 1), correct / max(total, 1)


def evaluate_checkpoint(ecfg: DictConfig) -> dict[str, Any]:
    """The body of `accel-eval`."""
    ckpt_path = Path(ecfg.ckpt_path)
    sharded = ckpt_path.is_dir()  # an FSDP checkpoint (torch.distributed.checkpoint)
    if sharded:
        state = load_sharded_meta(ckpt_path, key="ckpt_path")
    else:
        state = load_checkpoint(ckpt_path, key="ckpt_path")
    cfg = typed(state["config"])
    if ecfg.data_dir:
        cfg.paths.data_dir = ecfg.data_dir
    if ecfg.batch_size:
        cfg.loader.eval_batch_size = ecfg.batch_size
    device = resolve_device(ecfg.device)
    precision = resolve_precision(cfg.precision.name, device, cfg.precision.tf32)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device)

    splits = build_splits(cfg.dataset, cfg.paths.data_dir)
    if splits.test is None:
        raise UserError(
            f"ckpt_path={ckpt_path}: the checkpoint's data set ({cfg.dataset.get('name')}) has "
            "no test split to score. Give it one (for dataset=custom: return (train, val, test))."
        )
    model = build_model(cfg.model, splits.in_channels, splits.image_size, splits.num_classes)
    model = model.to(device, dtype=precision.param_dtype)
    if sharded:
        load_sharded(model, None, ckpt_path)
    else:
        model.load_state_dict(state["model"])
    if cfg.trainer.channels_last:
        model = model.to(memory_format=torch.channels_last)
    loader = build_loader(
        splits.test,
        cfg.loader,
        train=False,
        device=device,
        seed=0,
        rank=0,
        world=1,
        limit=0,
        num_classes=splits.num_classes,
    )
    transform = BatchTransform(cfg.dataset, splits, device, precision.param_dtype, seed=0, rank=0)
    loss_fn = build_loss(cfg.loss, splits.num_classes).to(device)
    loss, acc = score(model, loader, transform, precision, loss_fn, env)
    result = {
        "ckpt_path": str(ckpt_path),
        "dataset": cfg.dataset.get("name", "custom"),
        "split": "test",
        "num_samples": len(splits.test),
        "test/loss": loss,
        "test/acc": acc,
        "step": state["progress"]["step"],
        "epoch": state["progress"]["epoch"],
        "precision": precision.describe(),
    }
    out = Path(ecfg.out_path) if ecfg.out_path else _default_out(ckpt_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("test/loss=%.4f  test/acc=%.4f  (%d samples)  -> %s", loss, acc, len(splits.test), out)
    return result


def _default_out(ckpt_path: Path) -> Path:
    folder = ckpt_path.parent
    if folder.name == "checkpoints":
        folder = folder.parent  # the run dir
    return folder / f"eval_{ckpt_path.name.split('.')[0]}.json"

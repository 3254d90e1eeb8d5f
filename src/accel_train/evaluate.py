"""`accel-eval`: rebuild a model from a checkpoint's own config and score it on the test split."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from accel_train.checkpoint import load_checkpoint, load_sharded, load_sharded_meta
from accel_train.config import TrainConfig
from accel_train.data import BatchTransform, build_loader, load_split
from accel_train.distributed import DistEnv, resolve_device
from accel_train.models import build_model
from accel_train.precision import resolve_precision
from accel_train.train import evaluate

log = logging.getLogger("accel_train")


def evaluate_checkpoint(ecfg: DictConfig) -> dict[str, Any]:
    ckpt_path = Path(ecfg.ckpt_path)
    sharded = ckpt_path.is_dir()  # an FSDP checkpoint (torch.distributed.checkpoint)
    if sharded:
        state = load_sharded_meta(ckpt_path, key="ckpt_path")
    else:
        state = load_checkpoint(ckpt_path, key="ckpt_path")
    cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), state["config"])
    if ecfg.data_dir:
        cfg.paths.data_dir = ecfg.data_dir
    if ecfg.batch_size:
        cfg.loader.eval_batch_size = ecfg.batch_size
    device = resolve_device(ecfg.device)
    precision = resolve_precision(cfg.precision.name, device, cfg.precision.tf32)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device)

    model = build_model(cfg.model, cfg.dataset).to(device, dtype=precision.param_dtype)
    if sharded:
        load_sharded(model, None, ckpt_path)
    else:
        model.load_state_dict(state["model"])
    test_set = load_split(cfg.dataset, cfg.paths.data_dir, train=False)
    # The device loader works for any split that fits in memory, and evaluation is one pass.
    cfg.loader.name = "device"
    loader = build_loader(
        test_set, cfg.loader, train=False, device=device, seed=0, rank=0, world=1, limit=0
    )
    transform = BatchTransform(
        cfg.dataset, device, precision.param_dtype, cfg.trainer.channels_last, 0, 0
    )
    loss, acc = evaluate(model, loader, transform, precision, env)
    result = {
        "ckpt_path": str(ckpt_path),
        "dataset": cfg.dataset.name,
        "split": "test",
        "num_samples": len(test_set),
        "test/loss": loss,
        "test/acc": acc,
        "step": state["progress"]["step"],
        "epoch": state["progress"]["epoch"],
        "precision": precision.describe(),
    }
    out = Path(ecfg.out_path) if ecfg.out_path else _default_out(ckpt_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log.info("test/loss=%.4f  test/acc=%.4f  (%d samples)  -> %s", loss, acc, len(test_set), out)
    return result


def _default_out(ckpt_path: Path) -> Path:
    folder = ckpt_path.parent
    if folder.name == "checkpoints":
        folder = folder.parent  # the run dir
    return folder / f"eval_{ckpt_path.name.split('.')[0]}.json"

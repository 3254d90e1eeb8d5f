"""A run's checkpoint opened as a ready model, the one way every tool does it (accel-eval,
accel-export in every format, accel-sample, distillation's teacher): the checkpoint read with
the safe loader (a sharded .dcp directory's meta, or the one file), its stored config typed,
the model rebuilt from that config, the run's LoRA adapters attached, and the weights loaded
(a .dcp consolidated into this one process's model). Nothing in the checkpoint is executed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from accel_train.checkpoint_formats import format_of
from accel_train.config.run_config import typed
from accel_train.errors import UserError
from accel_train.models import build_model
from accel_train.techniques.lora import lora_for_run


class RunCheckpoint:
    """The checkpoint at `path` and its run's config (`cfg`, which the caller may adjust, e.g.
    its data_dir, before it builds the model with `model()`). `key`: the command's key that
    named the file (ckpt_path, distill.teacher), `redo`: what the config-version error advises
    (e.g. "Evaluate it with the version that wrote it.")."""

    def __init__(self, path: Path, key: str = "ckpt_path", redo: str = ""):
        self.path, self.key = path, key
        self.format = format_of(path)  # one file, or a sharded .dcp directory (FSDP, TP...)
        self.state: dict[str, Any] = self.format.read(path, key=key)
        advice = f" {redo}" if redo else ""
        try:
            self.cfg: DictConfig = typed(self.state["config"])
        except Exception as err:  # a config this version's schema does not know
            raise UserError(
                f"{key}={path}: its stored config does not fit this version of accel-train "
                f"({type(err).__name__}: {' '.join(str(err).split())[:200]}).{advice}"
            ) from None

    def model(
        self,
        data_args: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        before_load: Callable[[nn.Module], Any] | None = None,
        weights: Callable[[dict], dict] | None = None,
        fit_error: Callable[[RuntimeError], UserError] | None = None,
        build_error: Callable[[UserError], UserError] | None = None,
    ) -> nn.Module:
        """The run's model (adapters included) with the checkpoint's weights, in eval mode.
        `before_load`: a change the weights were saved after (QAT's prepare step); `weights`: a
        change of a saved state dict held in the state (pruning's masks made permanent; a
        sharded checkpoint's are loaded into the model as saved); `fit_error`: the
        caller's own message when the weights do not fit, `build_error` when the model cannot
        be built."""
        try:
            built = build_model(self.cfg.model, data_args or {}, dtype)
        except UserError as err:
            if build_error is None:
                raise
            raise build_error(err) from None
        model = lora_for_run(built, self.cfg)
        model = model.to(device or torch.device("cpu"), dtype=dtype)
        if before_load is not None:
            before_load(model)
        state = self.state
        if weights is not None and self.format.state_holds_weights:
            state = {**state, "model": weights(state["model"])}
        self._load(model, state, fit_error)
        return model.eval()

    def _load(self, model: nn.Module, state: dict, fit_error) -> None:
        try:
            self.format.load_model(model, self.path, state)
        except RuntimeError as err:  # missing/unexpected keys, size mismatches
            if fit_error is not None:
                raise fit_error(err) from None
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"{self.key}={self.path}: its weights do not fit the model its config builds "
                f"(model._target_={self.cfg.model._target_}; {first[:200]}). Has the model's "
                "code changed since the checkpoint was written, or does data_dir hold a data "
                "set of another shape?"
            ) from None

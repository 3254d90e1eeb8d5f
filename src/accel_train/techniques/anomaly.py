"""`trainer.detect_anomaly=true` (Lightning's spelling, config/aliases.py): autograd's anomaly
mode, which names the forward op whose backward produced a NaN (slow: for debugging only)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from accel_train.techniques import Technique

log = logging.getLogger("accel_train")


class DetectAnomaly(Technique):
    name = "detect_anomaly"

    def before_build(self) -> None:
        # Process-wide, before the model exists: every forward records its stack for backward.
        torch.autograd.set_detect_anomaly(True)
        log.warning("autograd anomaly detection is on (trainer.detect_anomaly): training is slow")

    def on_fit_end(self, loop: Any) -> None:
        torch.autograd.set_detect_anomaly(False)

"""strategy=dp: torch.nn.DataParallel, refused at compose (config/combinations.py says why).
The class exists so that the option composes and its refusal is the one the user reads."""

from __future__ import annotations

from accel_train.strategies.base import Strategy


class DataParallel(Strategy):
    name = "dp"

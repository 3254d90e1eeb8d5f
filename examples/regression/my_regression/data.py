"""Synthetic tabular data: 8 features, a smooth nonlinear target with noise."""

import torch
from torch.utils.data import Dataset


class Houses(Dataset):
    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=gen)
        w = torch.linspace(-1.0, 1.0, 8)
        y = self.x @ w + 0.5 * torch.sin(2 * self.x[:, 0]) + 0.3 * self.x[:, 1] * self.x[:, 2]
        self.y = (y + 0.05 * torch.randn(n, generator=gen))[:, None]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def build_sets(seed: int = 0):
    """(train, val, test): accel-train passes `seed` because the signature names it."""
    return Houses(2048, seed + 1), Houses(256, seed + 2), Houses(256, seed + 3)

"""Sequences that follow a simple rule (each token is the previous one + 1, modulo the
vocabulary), right-padded to a fixed length with a mask of the valid tokens."""

import torch
from torch.utils.data import Dataset

VOCAB, LENGTH = 32, 24


class Counting(Dataset):
    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        self.tokens = (start + torch.arange(LENGTH)) % VOCAB
        lengths = torch.randint(4, LENGTH + 1, (n,), generator=gen)  # uneven: padding varies
        self.mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
        self.tokens = torch.where(self.mask, self.tokens, 0)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[i], "mask": self.mask[i]}


def build_sets(seed: int = 0):
    return Counting(1024, seed + 1), Counting(128, seed + 2), Counting(128, seed + 3)

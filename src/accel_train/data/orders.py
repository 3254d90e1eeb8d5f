"""The orders every loader draws its batches from: which sample indices each rank sees, batch
by batch, in a given epoch. :class:`ShardedOrder` is every loader's (loader=torch, device, ray:
the same seed gives the same batches); :class:`RepeatedOrder` gives each optimizer step's window
of batches several times in a row (`task=grpo`'s `num_iterations`, data/text/prompts.py).
Both yield (epoch, index) keys: the epoch lets a split seed its per-sample augmentation."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from accel_train.config.facts import limited_batches


class ShardedOrder:
    """Which sample indices this rank sees, batch by batch, in a given epoch.

    Training: a permutation seeded by ``seed + epoch`` (like DistributedSampler), truncated to a
    multiple of the world size and strided by rank, so the union of the ranks' k-th batches is the
    k-th batch of the single-process run. Evaluation: all indices in order, padded with -1 to a
    multiple of the world size; the padding is at the end of each rank's list.
    """

    def __init__(self, n, batch_size, *, train, shuffle, seed, rank, world, drop_last, limit):
        self.n, self.batch_size, self.train, self.shuffle = n, batch_size, train, shuffle
        self.seed, self.rank, self.world, self.drop_last = seed, rank, world, drop_last
        self.per_rank = (n // world) if train else -(-n // world)
        self.real_per_rank = len(range(rank, n, world)) if not train else self.per_rank
        full, rest = divmod(self.per_rank, batch_size)
        self.num_batches = full + (1 if rest and not (train and drop_last) else 0)
        whole = self.num_batches
        self.num_batches = limited_batches(limit, self.num_batches)
        self.cut = self.num_batches < whole  # trainer.limit_*_batches left batches out
        self.epoch, self.start_batch = 0, 0

    def batch_len(self, b: int) -> int:
        """Samples in this rank's batch b (the last batch of an epoch may be short)."""
        return max(0, min(self.batch_size, self.per_rank - b * self.batch_size))

    def valid_len(self, b: int) -> int:
        """Samples of evaluation batch b that are real (not padding): a prefix of the batch."""
        return max(0, min(self.batch_size, self.real_per_rank - b * self.batch_size))

    def window_len(self, b: int, accum: int) -> int:
        """Samples in the accumulation window (optimizer step) that batch b belongs to."""
        first = b - b % accum
        return sum(self.batch_len(i) for i in range(first, min(first + accum, self.num_batches)))

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def indices(self) -> torch.Tensor:
        if self.train:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.n, generator=gen)
            else:
                order = torch.arange(self.n)
            order = order[: self.n - self.n % self.world]
        else:
            padded = -(-self.n // self.world) * self.world
            order = torch.cat([torch.arange(self.n), torch.full((padded - self.n,), -1)])
        return order[self.rank :: self.world]

    def __len__(self) -> int:
        return self.num_batches - self.start_batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        """Batches of (epoch, index) keys: the epoch lets a split seed per-sample augmentation."""
        mine = self.indices().tolist()  # host indices, once per epoch
        bs, epoch = self.batch_size, self.epoch
        for b in range(self.start_batch, self.num_batches):
            yield [(epoch, i) for i in mine[b * bs : (b + 1) * bs]]


class RepeatedOrder(ShardedOrder):
    """ShardedOrder with each window of `accumulate` batches given `mu` times in a row (TRL's
    RepeatSampler with `repeat_count=num_iterations`): batch j of the epoch is the plain
    order's batch (j // (accumulate * mu)) * accumulate + j % accumulate."""

    def __init__(self, *args, repeat: tuple[int, int] = (1, 1), **kwargs):
        self.mu, self.accum = repeat
        super().__init__(*args, **kwargs)
        self.plain_batches = self.num_batches
        if self.mu > 1:
            full, rest = divmod(self.plain_batches, self.accum)
            self.num_batches = full * self.accum * self.mu + rest * self.mu

    def plain(self, b: int) -> int:
        """The plain order's batch that batch b of this order gives again."""
        window = self.accum * self.mu
        full = self.plain_batches // self.accum * window
        if b >= full:  # the short last window: its `rest` batches, mu times
            rest = self.plain_batches % self.accum
            return self.plain_batches - rest + (b - full) % rest
        return (b // window) * self.accum + b % self.accum

    def batch_len(self, b: int) -> int:
        return super().batch_len(self.plain(b)) if self.mu > 1 else super().batch_len(b)

    def __iter__(self):
        mine = self.indices().tolist()
        bs, epoch = self.batch_size, self.epoch
        for b in range(self.start_batch, self.num_batches):
            p = self.plain(b) if self.mu > 1 else b
            yield [(epoch, i) for i in mine[p * bs : (p + 1) * bs]]

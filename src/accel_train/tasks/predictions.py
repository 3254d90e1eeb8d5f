"""Each evaluated item's predicted class, kept on the host for accel-eval's predictions file,
per-class accuracy and confusion matrix (train/eval_predictions.py writes them).

A task that predicts classes hands one out from `Task.keep_predictions()` (None: it predicts
none) and adds each evaluation batch's real items to it, in the loader's order. Reading the
predictions to the host is a sync per batch: accel-eval asks for it; training never does."""

from __future__ import annotations

import torch


class Predictions:
    """The true label, predicted class and its probability of every item added, in order."""

    def __init__(self) -> None:
        self._labels: list[torch.Tensor] = []
        self._predicted: list[torch.Tensor] = []
        self._probability: list[torch.Tensor] = []

    def add(self, scores: torch.Tensor, labels: torch.Tensor) -> None:
        """scores: (items, classes) logits or log-probabilities (softmax gives the same
        probabilities for both); labels: (items,) class indices."""
        probability, predicted = scores.float().softmax(1).max(1)
        # HOST SYNC: accel-eval only (module docstring).
        self._labels.append(labels.detach().long().cpu())
        self._predicted.append(predicted.cpu())
        self._probability.append(probability.cpu())

    def __len__(self) -> int:
        return sum(len(t) for t in self._labels)

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(labels int64, predicted int64, probability float32), each (items,)."""
        if not self._labels:
            empty = torch.zeros(0, dtype=torch.long)
            return empty, empty, torch.zeros(0)
        return torch.cat(self._labels), torch.cat(self._predicted), torch.cat(self._probability)

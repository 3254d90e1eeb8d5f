"""A user's training step for in-process tests (tests/ is on sys.path): classification written
as a custom task, in the normaliser form with a metric of its own."""

import torch.nn.functional as F


def summed_step(model, batch):
    x, y = batch
    logits = model(x.float() / 255)
    loss_sum = F.cross_entropy(logits, y, reduction="sum")
    return loss_sum, y.shape[0], {"acc": (logits.argmax(1) == y).float().mean()}

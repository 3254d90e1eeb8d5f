"""The training step accel-train calls as step(model, batch)."""

import torch.nn.functional as F


def step(model, batch):
    """Predict each next token. Returns (loss summed over the valid targets, their count,
    metrics): accel-train divides by the valid targets of the whole optimizer step."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens[:, :-1])
    targets, valid = tokens[:, 1:], mask[:, 1:]
    loss_sum = F.cross_entropy(logits[valid], targets[valid], reduction="sum")
    n_valid = valid.sum()
    token_acc = (logits[valid].argmax(-1) == targets[valid]).float().mean()
    return loss_sum, n_valid, {"token_acc": token_acc}

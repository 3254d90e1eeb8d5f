"""How language-model rows are shaped (issue 41): instruction batches cut after their last
trained token (`dataset.trim_padding`), and token windows split into documents
(`dataset.document_separator`). Both must leave every loss term as it was."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from accel_train.data.text.sft import TrimPadding
from accel_train.data.text.tokens import document_positions
from accel_train.models.gpt import GPT

IGNORE = -100


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=40, block_size=32, n_layer=1, n_head=2, n_embd=16, pos_embedding="rope")


def _token_losses(gpt: GPT, x, y, **kw) -> torch.Tensor:
    logits = gpt(x, **kw)
    flat = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none", ignore_index=IGNORE)
    return flat.view(y.shape)


def test_a_batch_is_cut_after_its_last_trained_token_and_scores_the_same():
    lengths = (5, 11, 3)  # real tokens per row; the rest is padding (pad id 0, label IGNORE)
    items = []
    for n in lengths:
        x = torch.zeros(32, dtype=torch.long)
        y = torch.full((32,), IGNORE)
        x[:n] = torch.randint(1, 40, (n,))
        y[: n - 1] = x[1:n]
        items.append((x, y))
    x_full, y_full = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
    x, y = TrimPadding(IGNORE)(items)
    assert x.shape == y.shape == (3, 16)  # the longest row's 10 labels, rounded up to 8s
    gpt = _gpt()
    full = _token_losses(gpt, x_full, y_full)
    trimmed = _token_losses(gpt, x, y)
    assert torch.allclose(full.sum(), trimmed.sum(), atol=1e-5)
    assert torch.equal(full[:, 16:], torch.zeros(3, 16))  # what was cut counted for nothing
    # packed rows keep their positions in step with the ids
    packed = [({"input_ids": x, "position_ids": torch.arange(32)}, y) for x, y in items]
    inputs, _ = TrimPadding(IGNORE)(packed)
    assert inputs["input_ids"].shape == inputs["position_ids"].shape == (3, 16)


def test_documents_of_a_token_window_are_scored_as_alone():
    """dataset.document_separator: positions restart after each separator, and the GPT keeps
    each document's attention to itself, so every document's loss is its loss alone."""
    sep = 39
    a, b, c = torch.randint(0, 39, (6,)), torch.randint(0, 39, (9,)), torch.randint(0, 39, (5,))
    window = torch.cat([a, torch.tensor([sep]), b, torch.tensor([sep]), c])
    x, y = window[:-1].unsqueeze(0), window[1:].unsqueeze(0)
    positions = document_positions(x[0], sep).unsqueeze(0)
    assert positions[0].tolist() == [*range(7), *range(10), *range(4)]
    gpt = _gpt()
    together = _token_losses(gpt, x, y, position_ids=positions)[0]
    start = 0
    for doc in (torch.cat([a, torch.tensor([sep])]), torch.cat([b, torch.tensor([sep])]), c[:-1]):
        n = len(doc)
        alone = _token_losses(gpt, x[:, start : start + n], y[:, start : start + n])[0]
        assert torch.allclose(together[start : start + n], alone, atol=1e-5)
        start += n

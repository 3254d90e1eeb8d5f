"""A tiny next-token model: an embedding, one hidden layer, logits over the vocabulary."""

from torch import nn

from my_tokens.data import VOCAB


class TinyLM(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, VOCAB))

    def forward(self, tokens):
        return self.mlp(self.embed(tokens))

"""`models/gpt.py` and `models/generate.py` in-process (issue 18): the parts the language-model
runs build on. The CLI runs (tokenize -> train -> sample) test them end to end."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from accel_train.models.generate import generate
from accel_train.models.gpt import GPT

TINY = {"vocab_size": 11, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}


def test_shapes_tying_and_gpt2_init():
    torch.manual_seed(0)
    model = GPT(**TINY)
    idx = torch.randint(0, 11, (3, 16))
    assert model(idx).shape == (3, 16, 11)
    assert model.lm_head.weight is model.wte.weight
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - 0.02 / math.sqrt(4)) < 0.004
    # 6N + 12 L H Q T, N without the position embedding
    n = sum(p.numel() for p in model.parameters()) - 16 * 16
    assert model.flops_per_token() == 6 * n + 12 * 2 * 2 * 8 * 16


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    a = torch.randint(0, 11, (1, 10))
    b = a.clone()
    b[0, 6:] = (b[0, 6:] + 1) % 11  # change only the future of position 5
    assert torch.allclose(model(a)[0, :6], model(b)[0, :6], atol=1e-6)


def test_a_checkpoint_with_the_fused_qkv_layer_loads_into_separate_q_k_v():
    """Checkpoints from before tensor parallelism hold one `attn.qkv` layer (q, k, v stacked):
    they load into the separate layers and compute the same logits."""
    torch.manual_seed(0)
    model = GPT(**TINY, bias=True).eval()
    old = {}
    for key, value in model.state_dict().items():
        if ".attn.q." in key:
            head, _, tail = key.partition(".attn.q.")
            parts = [model.state_dict()[f"{head}.attn.{n}.{tail}"] for n in "qkv"]
            old[f"{head}.attn.qkv.{tail}"] = torch.cat(parts, dim=0)
        elif ".attn.k." not in key and ".attn.v." not in key:
            old[key] = value
    assert any(".attn.qkv.weight" in k for k in old) and not any(".attn.q." in k for k in old)
    fresh = GPT(**TINY, bias=True).eval()
    fresh.load_state_dict(old)
    idx = torch.randint(0, 11, (2, 16))
    assert torch.equal(fresh(idx), model(idx))


def test_it_learns_a_repeating_sequence():
    torch.manual_seed(0)
    model = GPT(**TINY)
    data = torch.arange(64) % 11
    x, y = data[:-1].view(1, -1)[:, :16], data[1:].view(1, -1)[:, :16]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first
    out = generate(model.eval(), x[:, :3], 8, block_size=16, temperature=0)
    assert out[0].tolist() == list(range(11))


def test_sampling_is_seeded_and_top_k_1_or_tiny_top_p_is_greedy():
    torch.manual_seed(0)
    model = GPT(**TINY).eval()
    start = torch.zeros((2, 1), dtype=torch.long)

    def sample(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate(model, start, 20, block_size=16, generator=g, **kw)

    assert torch.equal(sample(1), sample(1)) and not torch.equal(sample(1), sample(2))
    greedy = generate(model, start, 20, block_size=16, temperature=0)
    assert torch.equal(sample(3, top_k=1), greedy)
    assert torch.equal(sample(4, top_p=1e-6), greedy)
    assert sample(5, top_k=3, top_p=0.9).shape == (2, 21)  # past block_size: cropped context

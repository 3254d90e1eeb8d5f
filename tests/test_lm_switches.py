"""The language-model speed switches (issue 31): `optimizer=muon` (torch's Muon on the hidden
matrices, AdamW on the rest, as one optimizer) and `model=gpt`'s options (rotary positions,
QK-norm, ReLU², an untied head): Muon's update against a written reference, the combined
optimizer against the two run side by side, each model option's forward and checkpoint, and
through the real CLI: a tiny GPT with every switch on trains, resumes exactly with Muon, and is
read by accel-sample and accel-export; Muon with FSDP is refused before any process starts.
Muon's Newton-Schulz in fp32 where the CPU has no native bf16 (issue 62): torch's update within
bf16's rounding, and the start-up line says the choice.
(The recipes gpt_char_fast and gpt2_small run shrunken in tests/test_new_user.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import check_ok, read_jsonl
from omegaconf import OmegaConf

from accel_train import optim
from accel_train.checkpoint import load_checkpoint
from accel_train.models.gpt import GPT
from accel_train.optim import MuonWithAdamW, build_optimizer, hidden_matrices
from accel_train.precision import NATIVE_BF16_ENV

NS = (3.4445, -4.7750, 2.0315)  # the quintic's coefficients (Jordan et al.)


def reference_orthogonalise(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's Newton-Schulz iteration as its authors published it (bf16, as they run it)."""
    a, b, c = NS
    x = g.bfloat16()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def test_torch_muon_matches_the_reference_update():
    torch.manual_seed(0)
    w0 = torch.randn(12, 8)
    grads = [torch.randn(12, 8) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon([p], lr=0.02, weight_decay=0.1, momentum=0.95)
    w, buf, plain = w0.clone(), torch.zeros_like(w0), w0.clone()
    for g in grads:
        p.grad = g.clone()
        opt.step()
        buf = 0.95 * buf + 0.05 * g  # momentum, then Nesterov's look-ahead
        update = reference_orthogonalise(0.05 * g + 0.95 * buf)
        w = w * (1 - 0.02 * 0.1) - 0.02 * (12 / 8) ** 0.5 * update
        plain = plain * (1 - 0.02 * 0.1) - 0.02 * (0.05 * g + 0.95 * buf)
    moved = (w - w0).norm()
    # Both orthogonalise in bf16, in another order of operations: a few % apart, where
    # momentum without the orthogonalisation lands nowhere near.
    assert (p.detach() - w).norm() < 0.05 * moved
    assert (plain - w).norm() > 0.5 * moved
    singular = torch.linalg.svdvals(reference_orthogonalise(torch.randn(12, 8)))
    assert singular.min() > 0.6 and singular.max() < 1.3  # (what "orthogonalised" means here)


def _muon_cfg(**over):
    base = OmegaConf.load("configs/optimizer/muon.yaml")
    base.pop("defaults")
    return OmegaConf.merge(base, over)


def test_combined_optimizer_is_muon_plus_adamw_side_by_side():
    torch.manual_seed(0)
    model = GPT(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)
    twin = GPT(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)
    twin.load_state_dict(model.state_dict())
    cfg = _muon_cfg(adamw_weight_decay=0.01, weight_decay=0.05, fused=False)
    combined = build_optimizer(model, cfg, cfg.lr, torch.device("cpu"))
    assert isinstance(combined, MuonWithAdamW)
    matrices = hidden_matrices(twin)
    names = {n for n, p in model.named_parameters() if id(p) in hidden_matrices(model)}
    # Every block's projections, never the embeddings or the tied head.
    assert names and all(".attn." in n or ".mlp." in n for n in names)
    params = list(twin.parameters())
    muon = torch.optim.Muon([p for p in params if id(p) in matrices], lr=cfg.lr, weight_decay=0.05)
    adamw = torch.optim.AdamW(
        [p for p in params if id(p) not in matrices],
        lr=cfg.adamw_lr,
        betas=(0.9, 0.95),
        weight_decay=0.01,
    )
    for step in range(3):
        x = torch.randint(0, 40, (4, 16), generator=torch.Generator().manual_seed(step))
        for m, steps in ((model, [combined]), (twin, [muon, adamw])):
            m(x).square().mean().backward()
            for opt in steps:
                opt.step()
                opt.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # torch's state-dict format, and it loads back (the shared state re-pointed).
    state = combined.state_dict()
    assert {"state", "param_groups"} <= set(state) and len(state["param_groups"]) == 2
    combined.load_state_dict(state)
    assert combined.muon.state is combined.state is combined.adamw.state


@pytest.mark.parametrize("native", ["0", "1"])
def test_muon_orthogonalises_in_fp32_without_native_bf16(native, monkeypatch):
    """On a CPU without native bf16 (the detection overridden: this test machine has it), the
    combined optimizer's Newton-Schulz sees and computes fp32 tensors, and 3 steps land within
    bf16's rounding of torch.optim.Muon's; with native bf16 it is torch's update bit for bit."""
    monkeypatch.setenv(NATIVE_BF16_ENV, native)
    seen = []
    real = optim.newton_schulz

    def recording(g, coefficients, steps, eps, dtype):
        out = real(g, coefficients, steps, eps, dtype)
        seen.append((g.dtype, dtype, out.dtype))
        return out

    monkeypatch.setattr(optim, "newton_schulz", recording)
    torch.manual_seed(0)
    model = GPT(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16)
    cfg = _muon_cfg(nesterov=False, weight_decay=0.1, fused=False)  # the buffer orthogonalised
    combined = build_optimizer(model, cfg, cfg.lr, torch.device("cpu"))
    want = torch.float32 if native == "0" else torch.bfloat16
    assert combined.ns_dtype == want
    kind = "fp32" if native == "0" else "bf16"
    no = "no " if native == "0" else ""
    assert (
        combined.describe() == f"muon: Newton-Schulz in {kind} (auto: this CPU has {no}native bf16)"
    )
    matrices = [p for p in model.parameters() if id(p) in hidden_matrices(model)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in matrices]
    start = [p.detach().clone() for p in matrices]
    reference = torch.optim.Muon(twins, lr=cfg.lr, weight_decay=0.1, nesterov=False)
    for _ in range(3):
        for p, twin in zip(matrices, twins, strict=True):
            p.grad = torch.randn_like(p)
            twin.grad = p.grad.clone()
        combined.step()
        reference.step()
    assert seen and all(s == (torch.float32, want, want) for s in seen)
    for p, twin, p0 in zip(matrices, twins, start, strict=True):
        buf, ref_buf = (
            combined.state[p]["momentum_buffer"],
            reference.state[twin]["momentum_buffer"],
        )
        assert torch.equal(buf, ref_buf)  # the momentum is never touched by the iteration
        if native == "1":
            assert torch.equal(p, twin)
        else:  # bf16 keeps 8 bits of mantissa: ~0.4 % an element, ~1 % after 5 iterations
            moved = (twin - p0).norm()
            assert 0 < (p - twin).norm() < 0.03 * moved


OPTIONS = {
    "rope": {"pos_embedding": "rope"},
    "qk_norm": {"qk_norm": True},
    "relu2": {"activation": "relu2"},
    "untied": {"tie_embeddings": False},
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_model_option_changes_the_model_and_round_trips(option):
    torch.manual_seed(0)
    shape = {"vocab_size": 40, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}
    model = GPT(**shape, **OPTIONS[option])
    torch.manual_seed(0)
    plain = GPT(**shape)
    x = torch.randint(0, 40, (2, 16))
    assert not torch.allclose(model(x), plain(x))  # the option does something
    model(x).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    again = GPT(**shape, **OPTIONS[option])
    again.load_state_dict(model.state_dict())  # strict: the keys are the option's own
    assert torch.equal(again(x), model(x))
    if option == "rope":  # no position table: a token's logits depend on its place by rotation
        assert model.wpe is None and "embed.wpe.weight" not in model.state_dict()
    if option == "untied":
        assert model.lm_head.weight is not model.wte.weight


TEXT = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300))
TINY_GPT = [
    "task=language_model",
    "model=gpt",
    "dataset=tokens",
    "dataset.path=tokens",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "model.pos_embedding=rope",
    "model.qk_norm=true",
    "model.activation=relu2",
    "model.tie_embeddings=false",
    "optimizer=muon",
    "loader.batch_size=8",
    "dataset.eval_windows=8",
    "dataset.windows_per_epoch=64",
    # A schedule that does not depend on the run's length: a run stopped at step 4 and resumed
    # to 8 steps is then the same run as the uninterrupted one.
    "scheduler=step",
    "scheduler.step_size=3",
    "scheduler.warmup_steps=0",
    "trainer.max_steps=8",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=8",
    "trainer.progress=none",
    "logger=none",
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, run_cli_in):
    root = tmp_path_factory.mktemp("lm-switches")
    (root / "input.txt").write_text(TEXT)
    check_ok(run_cli_in(["tokenize", "input=input.txt", "out=tokens"], root, prog="accel-data"))
    return root


def test_every_switch_trains_resumes_exactly_samples_and_exports(workspace, run_cli_in):
    whole, resumed = workspace / "whole", workspace / "resumed"
    check_ok(run_cli_in([*TINY_GPT, f"hydra.run.dir={whole}"], workspace))
    first = [*TINY_GPT, "trainer.max_steps=4", "trainer.ckpt_every_n_steps=4"]
    check_ok(run_cli_in([*first, f"hydra.run.dir={resumed}"], workspace))
    check_ok(run_cli_in([*TINY_GPT, "resume=auto", f"hydra.run.dir={resumed}"], workspace))

    def losses(run):
        return [m["train/loss"] for m in read_jsonl(run / "metrics.jsonl") if "train/loss" in m]

    assert len(losses(whole)) == 8 and losses(whole)[-1] < losses(whole)[0]
    assert losses(resumed) == losses(whole)  # Muon's momentum and AdamW's moments restored
    a = load_checkpoint(whole / "checkpoints" / "last.pt")
    b = load_checkpoint(resumed / "checkpoints" / "last.pt")
    for k, v in a["model"].items():
        assert torch.equal(b["model"][k], v), k
    assert len(a["optimizer"]["param_groups"]) == 2  # Muon's group and AdamW's

    ckpt = whole / "checkpoints" / "last.pt"
    sample = [f"ckpt_path={ckpt}", "prompt=def", "max_new_tokens=12", "seed=1"]
    proc = run_cli_in(sample, workspace, prog="accel-sample")
    check_ok(proc)
    assert proc.stdout.strip().startswith("def")
    check_ok(run_cli_in([f"ckpt_path={ckpt}"], workspace, prog="accel-export"))
    assert (whole / "checkpoints" / "last.onnx").is_file()


def test_the_start_up_line_says_muons_dtype_on_a_cpu_without_bf16(workspace, run_cli_in):
    """auto: fp32 on a CPU without native bf16, said in the start-up line; ns_dtype=bf16 forces
    torch's bf16 there, with the precision switch's one warning about emulated bf16."""
    short = [*TINY_GPT, "trainer.max_steps=2", "trainer.val_check_interval=2"]
    env = {NATIVE_BF16_ENV: "0"}
    auto = run_cli_in([*short, f"hydra.run.dir={workspace / 'ns-auto'}"], workspace, env=env)
    check_ok(auto)
    said = auto.stdout + auto.stderr
    assert "; muon: Newton-Schulz in fp32 (auto: this CPU has no native bf16); data" in said
    assert "emulated" not in said
    forced = [*short, "optimizer.ns_dtype=bf16", f"hydra.run.dir={workspace / 'ns-bf16'}"]
    proc = run_cli_in(forced, workspace, env=env)
    check_ok(proc)
    said = proc.stdout + proc.stderr
    assert "muon: Newton-Schulz in bf16 (optimizer.ns_dtype); data" in said
    assert said.count("bf16 is emulated there") == 1
    assert "`optimizer.ns_dtype=auto` runs it in fp32 there" in said


def test_muon_with_fsdp_is_refused_before_any_process(workspace, run_cli_in):
    args = [*TINY_GPT, "strategy=fsdp", "launcher.nproc_per_node=2"]
    proc = run_cli_in([*args, f"hydra.run.dir={workspace / 'fsdp'}"], workspace)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "optimizer=muon with strategy=fsdp" in proc.stderr
    assert not (workspace / "fsdp" / "metrics.jsonl").exists()

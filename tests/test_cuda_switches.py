"""The CUDA-only switches of issue 41, where there is no GPU: activation offloading
(`activation_checkpointing.offload`) and Liger's kernels (`model.liger`). Their logic runs here
with the device as a parameter (the offloading hooks on CPU tensors, Liger's apply functions
from a stand-in module); the CLI refuses each on a CPU run in one paragraph. The CUDA paths
themselves: scripts/gpu_check.sh."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from accel_train.config import device_checks
from accel_train.config.device_checks import LIGER_MODEL_TYPES, check_activation_offload
from accel_train.errors import UserError
from accel_train.models import hf
from accel_train.models.gpt import GPT
from accel_train.techniques import activation_checkpointing as ac


class Recording:
    """save_on_cpu's stand-in: records what it packs and hands the backward a copy (so a
    gradient that matches proves the backward used what was offloaded)."""

    packed: list[torch.Tensor] = []

    def __init__(self, pin_memory: bool, device_type: str):
        def pack_hook(t):
            Recording.packed.append(t)
            return t.device, t.detach().clone()

        self.pack_hook, self.unpack_hook = pack_hook, lambda packed: packed[1]


def _step(model, x):
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


def test_offload_sends_what_the_step_saves_and_composes_with_checkpointing(monkeypatch):
    """The technique wraps each micro-batch's forward in the offloading hooks (the device
    given by the loop: here the CPU). Every saved activation goes through save_on_cpu, no
    parameter does; the gradients are unchanged; with every block checkpointed only the blocks'
    inputs and what is outside the blocks are saved, so fewer tensors go."""
    monkeypatch.setattr(ac, "save_on_cpu", Recording)
    torch.manual_seed(0)
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, 64, (4, 16))
    plain = _step(model, x)

    technique = ac.ActivationCheckpointing("off", offload=True)
    assert technique.transform(model, None) is model  # mode=off: nothing to wrap
    loop = SimpleNamespace(env=SimpleNamespace(device=torch.device("cpu"), is_main=False))
    offloaded = technique.wrap_loss(loop, lambda batch: _step(model, batch))
    Recording.packed.clear()
    grads = offloaded(x)
    every = list(Recording.packed)
    assert technique.offloader.offloaded == len(every) > 0
    params = {p.data_ptr() for p in model.parameters()}
    assert not any(t.data_ptr() in params for t in every)
    assert all(t.numel() * t.element_size() >= 1024 for t in every)
    for name, g in plain.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)

    for i, block in enumerate(model.blocks):  # what mode=full does to the GPT's blocks
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    Recording.packed.clear()
    grads = offloaded(x)
    shapes = [tuple(t.shape) for t in Recording.packed]
    assert 0 < len(shapes) < len(every)
    assert shapes.count((4, 16, 32)) >= 2  # the two blocks' inputs (the residual stream)
    for name, g in plain.items():
        name = name.replace("blocks.0.", "blocks.0._checkpoint_wrapped_module.")
        name = name.replace("blocks.1.", "blocks.1._checkpoint_wrapped_module.")
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-6, msg=name)


def test_offload_is_refused_where_it_cannot_work(compose_cfg, tmp_path, run_cli):
    """On a CPU run (the real CLI, one paragraph, nothing written) and under strategy=pipeline,
    whose schedule runs the forward outside the step the offloading wraps."""
    run = tmp_path / "run"
    offload = ["activation_checkpointing.offload=true", "trainer.device=cpu"]
    proc = run_cli([*FAST, *offload, f"hydra.run.dir={run}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    error = proc.stderr.split("accel-train: error: ")[1].split("\n")[0]
    assert "activation_checkpointing.offload=true" in error and "CUDA device" in error
    assert not run.exists()
    cfg = compose_cfg(
        [
            "strategy=pipeline",
            "activation_checkpointing.offload=true",
            f"paths.output_dir={tmp_path}",
        ]
    )
    with pytest.raises(UserError, match="offload=true with strategy=pipeline"):
        check_activation_offload(cfg)


def test_liger_is_refused_on_cpu_for_other_models_and_when_missing(
    compose_cfg, tmp_path, run_cli, monkeypatch
):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"model_type": "llama"}')
    args = ["model=hf", f"model.path={llama}", "model.liger=true", "dataset=sft"]
    args.append(f"dataset.path={tmp_path / 'records.jsonl'}")
    cpu = ["trainer.device=cpu", "trainer.progress=none"]
    proc = run_cli([*args, *cpu, f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model.liger=true" in proc.stderr and "CUDA devices only" in proc.stderr

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text('{"model_type": "gpt2"}')
    cfg = compose_cfg([*args[:1], f"model.path={gpt2}", *args[2:], f"paths.output_dir={tmp_path}"])
    with pytest.raises(UserError, match="model_type=gpt2.*llama, qwen2, mistral, gemma"):
        device_checks.check_liger(cfg)
    monkeypatch.setattr(device_checks, "cpu_run", lambda cfg: None)  # as on a CUDA machine
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not installed
    cfg.model.path = str(llama)
    with pytest.raises(UserError, match="pip install liger-kernel"):
        device_checks.check_liger(cfg)


def test_liger_applies_the_model_types_function_before_the_model_is_built(tmp_path, monkeypatch):
    """Each supported model_type calls Liger's own `apply_liger_kernel_to_<type>` with the
    norm, rotary and MLP kernels on and its losses off (the task computes the loss); model=hf
    calls it before it builds the model, and refuses a type Liger has no kernels for."""
    calls = []

    def fake(name):
        return lambda **kwargs: calls.append((name, kwargs))

    kernels = types.ModuleType("liger_kernel.transformers")
    for kind in LIGER_MODEL_TYPES:
        setattr(kernels, f"apply_liger_kernel_to_{kind}", fake(kind))
        assert hf.apply_liger(kind, kernels) == f"apply_liger_kernel_to_{kind}"
    assert [c[0] for c in calls] == list(LIGER_MODEL_TYPES)
    assert all(
        c[1] == {"rope": True, "rms_norm": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}
        for c in calls
    )  # fmt: skip
    with pytest.raises(UserError, match="model_type=phi3.*llama, qwen2"):
        hf.apply_liger("phi3", kernels)

    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    ).save_pretrained(tmp_path)  # fmt: skip
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", kernels)
    order = []
    monkeypatch.setattr(kernels, "apply_liger_kernel_to_llama", lambda **kw: order.append("liger"))
    tf = hf._transformers()
    real = tf.AutoModelForCausalLM.from_config
    monkeypatch.setattr(
        tf.AutoModelForCausalLM,
        "from_config",
        lambda *a, **kw: order.append("build") or real(*a, **kw),
    )
    model = hf.hf_model(path=str(tmp_path), pretrained=False, liger=True)
    assert order == ["liger", "build"] and isinstance(model, hf.HFModel)

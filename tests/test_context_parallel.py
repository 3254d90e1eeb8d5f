"""Context parallelism (`strategy=fsdp strategy.cp=N`, issue 41): PyTorch's ring attention runs
on CUDA only, so this machine checks what does not need it: the mesh (built for real on a
single-process fake process group of 8 ranks), the data coordinates, the normaliser's
bookkeeping, the task's split of a batch, and the refusals, through the CLI where a user meets
them. scripts/gpu_check.sh trains with it on two GPUs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from accel_train.config.checks import validate
from accel_train.config.run_config import resolve
from accel_train.errors import UserError
from accel_train.launchers.world import check_strategy
from accel_train.parallel import DistEnv
from accel_train.strategies.fsdp import FSDP
from accel_train.strategies.mesh import MeshLayout, build_mesh
from accel_train.tasks.language_model import LanguageModel

GPT = ["model=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "dataset=tokens"]
GPT += ["dataset.path=tok", "model.block_size=32"]


def test_the_layout_puts_cp_between_the_shards_and_tp():
    lay = MeshLayout(dp_shard=2, cp=2, tp=2)
    assert lay.dims() == (("dp_shard", 2), ("cp", 2), ("tp", 2))
    assert lay.data_world == 2
    # ranks 0-3 (a cp pair of TP pairs) read one batch, ranks 4-7 the other
    assert [lay.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.fixture
def fake_world():
    """A process group of 8 ranks in this one process (torch's fake backend): meshes are built
    as on 8 GPUs, collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_fsdp_shards_over_dp_shard_times_cp(fake_world, compose_cfg, tmp_path):
    cfg = compose_cfg([*GPT, "strategy=fsdp", "strategy.cp=2", f"paths.output_dir={tmp_path}"])
    strategy = FSDP(cfg)
    env = DistEnv(rank=5, local_rank=5, world_size=8, device=torch.device("cpu"))
    lay = strategy.layout(8)
    assert (lay.dp_shard, lay.cp, lay.tp) == (4, 2, 1)
    assert strategy.data_coords(env) == (2, 4)  # ranks 4 and 5 hold parts of batch 2
    mesh = build_mesh(lay, "cpu", 8)
    assert mesh.mesh_dim_names == ("dp_shard", "cp")
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # what FSDP shards over
    assert flat.size() == 8
    assert mesh["cp"].size() == 2 and mesh["cp"].get_local_rank() == 1


def test_the_language_model_hands_over_rows_with_their_positions():
    x = torch.arange(12).view(2, 6)
    y = x + 1
    (inputs, targets), buffers = LanguageModel().sequence_buffers((x, y))
    assert targets is y and inputs["input_ids"] is x and inputs["packed"] is False
    assert torch.equal(inputs["position_ids"], torch.arange(6).expand(2, 6))
    assert buffers[0] is x and buffers[1] is inputs["position_ids"] and buffers[2] is y


@pytest.mark.parametrize(
    ("overrides", "nproc", "said"),
    [
        (["strategy.cp=2"], 3, "strategy.cp=2 must divide the 3 processes"),
        (["strategy.cp=2", "strategy.tp=2"], 2, "strategy.cp=2 x strategy.tp=2"),
        (["strategy.cp=2"], 2, "ring attention, which PyTorch implements for CUDA"),
    ],
)
def test_impossible_context_parallel_is_refused(overrides, nproc, said, compose_cfg, tmp_path):
    cfg = compose_cfg(
        [*GPT, "strategy=fsdp", *overrides, f"launcher.nproc_per_node={nproc}"]
        + [f"paths.output_dir={tmp_path}"]
    )
    with pytest.raises(UserError) as refused:
        validate(cfg)
        check_strategy(resolve(cfg), nproc)
    message = str(refused.value)
    assert said in message and "`" in message and "\n" not in message


def test_a_cpu_run_with_cp_is_one_paragraph_before_any_process_starts(run_cli, tmp_path):
    """One process and a CPU: both refusals in the one paragraph (issue 47 B.13), not the
    process count first and the CPU once that is fixed."""
    proc = run_cli(
        [*GPT, "strategy=fsdp", "strategy.cp=2", "launcher.nproc_per_node=1", "hydra.run.dir=r"]
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "for 2 reasons: (1) strategy.cp=2 must divide the 1 process " in proc.stderr
    assert "(2) strategy.cp=2 splits each sequence over 2 GPUs" in proc.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.parametrize("pos_embedding", ["learned", "rope"])
def test_the_gpt_at_explicit_unpacked_positions_is_the_plain_gpt(pos_embedding):
    """What a CP rank runs: its tokens at their true positions, causal attention, no mask
    (the ring patches SDPA's causal kernel; a mask would not go through it)."""
    from accel_train.models.gpt import GPT

    torch.manual_seed(0)
    gpt = GPT(
        vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=16, pos_embedding=pos_embedding
    )
    x = torch.randint(0, 50, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    assert torch.equal(gpt(x, position_ids=positions, packed=False), gpt(x))
    # a later part of the rows, at its own positions, is the plain forward's prefix-free view:
    # the first 8 tokens at positions 0-7 give what the whole row gives there (causal)
    assert torch.allclose(
        gpt(x[:, :8], position_ids=positions[:, :8], packed=False), gpt(x)[:, :8], atol=1e-6
    )

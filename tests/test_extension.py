"""The extension points a user reaches without editing accel-train: their own YAML options on
Hydra's search path, their own loop hooks (callbacks, whose state rides in the checkpoints),
and FSDP's documented sharding policy for any model."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import FAST, check_ok, read_jsonl
from torch import nn

from accel_train.checkpoint import load_checkpoint
from accel_train.errors import UserError
from accel_train.strategies.fsdp import shard_units

NET = """
from torch import nn


class Tiny(nn.Sequential):
    def __init__(self, in_channels, image_size, num_classes, width=8):
        flat = in_channels * image_size * image_size
        super().__init__(
            nn.Flatten(), nn.Linear(flat, width), nn.ReLU(), nn.Linear(width, num_classes)
        )
"""

HOOK = '''
from accel_train.techniques import Technique


class CountSteps(Technique):
    """Counts optimizer steps on the device; the count is saved in every checkpoint."""

    def __init__(self, start=0):
        self.count = start

    def on_train_step_end(self, loop):
        self.count += 1

    def on_log(self, loop, metrics):
        metrics["hook/steps_seen"] = self.count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project: a package and a config dir of their own, outside src/."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(NET)
    (tmp_path / "mypkg" / "hooks.py").write_text(HOOK)
    (tmp_path / "my_configs" / "model").mkdir(parents=True)
    (tmp_path / "my_configs" / "model" / "my_net.yaml").write_text(
        "# A user's own model option.\n_target_: mypkg.nets.Tiny  # the class\nwidth: 16\n"
    )
    return tmp_path


def test_a_users_own_yaml_option_from_the_search_path(project, run_cli):
    run_dir = project / "run"
    proc = run_cli(
        [
            *FAST,
            "hydra.searchpath=[file://my_configs]",
            "model=my_net",
            "trainer.max_steps=3",
            f"hydra.run.dir={run_dir}",
        ]
    )
    check_ok(proc)
    weights = load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    assert weights["1.weight"].shape[0] == 16  # the YAML's width reached the constructor
    assert "_target_: mypkg.nets.Tiny" in (run_dir / "config.yaml").read_text()


def test_a_callbacks_state_is_checkpointed_and_resumed(project, run_cli):
    run_dir = project / "run"
    common = [
        *FAST,
        "+callbacks.counter._target_=mypkg.hooks.CountSteps",
        "trainer.log_every_n_steps=1",
        f"hydra.run.dir={run_dir}",
    ]
    check_ok(run_cli([*common, "trainer.max_epochs=1"]))
    steps = load_checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"]
    saved = load_checkpoint(run_dir / "checkpoints" / "last.pt")["techniques"]["counter"]
    assert saved == {"count": steps} and steps > 0
    check_ok(run_cli([*common, "trainer.max_epochs=2", "resume=auto"]))
    logged = [
        r["hook/steps_seen"]
        for r in read_jsonl(run_dir / "metrics.jsonl")
        if "hook/steps_seen" in r
    ]
    # The count went on from the checkpoint (not from 0) and was logged at every step.
    assert logged == list(range(1, 2 * steps + 1))


def test_a_callback_that_is_not_a_technique_is_refused(project, run_cli):
    (project / "mypkg" / "plain.py").write_text("class Plain:\n    pass\n")
    proc = run_cli([*FAST, "+callbacks.p._target_=mypkg.plain.Plain", "hydra.run.dir=run"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "callbacks.p._target_=mypkg.plain.Plain" in proc.stderr and "Technique" in proc.stderr


# ---- FSDP's sharding units -------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x):
        return x + self.ff(x)


class UserNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 2)


def test_fsdp_shards_the_outermost_repeated_blocks():
    model = UserNet()
    assert shard_units(model, []) == list(model.blocks)  # not the Linears in and around them
    assert shard_units(model, ["Block"]) == list(model.blocks)
    assert shard_units(model, ["torch.nn.Linear"]) == [
        model.embed,
        *(b.ff[i] for b in model.blocks for i in (0, 2)),
        model.head,
    ]


def test_fsdp_keeps_tied_weights_in_one_group(tmp_path):
    """A one-block GPT has no repeated block: the fallback units are its repeated layers, and
    the embedding and the head, which tie one weight, would be two units (FSDP2 refuses that
    at the first forward). They stay with the root; FSDP2 then runs the model, forward and
    backward, in a one-process gloo group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from accel_train.models.gpt import GPT

    model = GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8)
    units = shard_units(model, [])
    assert units and model.head.lm_head not in units and model.embed.wte not in units
    held = [id(p) for u in units for p in u.parameters()]
    assert len(held) == len(set(held))
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
        model(torch.randint(0, 11, (2, 8))).sum().backward()
    finally:
        dist.destroy_process_group()


def test_fsdp_wrap_classes_that_match_nothing_are_refused():
    with pytest.raises(UserError, match=r"strategy.wrap_classes=\['Transformer'\].*Block"):
        shard_units(UserNet(), ["Transformer"])


def test_fsdp_shards_a_torchvision_resnet_by_stage():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10)
    units = shard_units(model, [])
    assert units == [model.layer1, model.layer2, model.layer3, model.layer4]
    blocks = shard_units(model, ["BasicBlock"])
    assert len(blocks) == 8 and sum(p.numel() for b in blocks for p in b.parameters()) > 0.9 * sum(
        p.numel() for p in model.parameters()
    )


def test_fsdp_shards_a_flat_sequential_by_its_repeated_layers():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten())
    assert shard_units(model, []) == [model[0], model[2]]

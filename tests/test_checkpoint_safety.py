"""Loading a checkpoint never runs code from it.

Every file a loader reads (a .pt, and a .dcp directory's .metadata, shard file and meta.pt) gets a
pickle payload planted in it, one file at a time; the loaders must raise UserError and the
payload's marker file must never appear. The control tests show that the same payloads do run
through torch's own loaders, so the marker's absence means something.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import check_ok
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from accel_train.checkpoint import (
    FORMAT_VERSION,
    load_checkpoint,
    load_sharded,
    load_sharded_meta,
)
from accel_train.errors import UserError

SHARD = "__0_0.distcp"  # the one shard file of a single-process dcp.save


class Touch:
    """Unpickling this calls Path.touch(marker): it stands for any code a crafted file runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


class System:
    """The classic payload: os.system("touch marker")."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# ---- a small, real sharded checkpoint ---------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    # BatchNorm adds an int64 buffer (num_batches_tracked): a second dtype in the metadata.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def dcp_save(state: dict, path: Path) -> None:
    with warnings.catch_warnings():  # no process group: one process writes every shard
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=str(path))


def write_sharded(path: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    """<path> as save_sharded writes it, without a process group."""
    model, optimizer = trained()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp_save({"model": model_sd, "optimizer": optim_sd}, path)
    meta = {"format": FORMAT_VERSION, "config": {"model": "test"}, "progress": {"step": 1}}
    torch.save(meta, path / "meta.pt")
    assert sorted(p.name for p in path.iterdir()) == [".metadata", SHARD, "meta.pt"]
    return model, optimizer


def assert_same(a, b, where: str = "") -> None:
    """Recursive equality for state dicts: tensors bit for bit, everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_a_real_sharded_checkpoint_still_loads(tmp_path):
    ckpt = tmp_path / "last.dcp"
    model, optimizer = write_sharded(ckpt)

    meta = load_sharded_meta(ckpt, key="resume")
    assert meta["format"] == FORMAT_VERSION and meta["progress"] == {"step": 1}

    # Resume: model and optimizer (Adam state tensors and every param_groups value).
    model2 = make_model(seed=1)
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    assert not torch.equal(model2[0].weight, model[0].weight)
    load_sharded(model2, optimizer2, ckpt)
    assert_same(model.state_dict(), model2.state_dict(), "model")
    assert_same(optimizer.state_dict(), optimizer2.state_dict(), "optimizer")

    # Evaluation: the model alone.
    model3 = make_model(seed=2)
    load_sharded(model3, None, ckpt)
    assert_same(model.state_dict(), model3.state_dict(), "model")


# ---- payloads, one file at a time ------------------------------------------------------------


def read_metadata_trusted(ckpt: Path):
    # The test's own, just-written file: plain pickle is fine here.
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def write_metadata(ckpt: Path, md) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def replace_entries(ckpt: Path, new: dict[str, bytes]) -> None:
    """Rewrite the shard file with some entries' bytes replaced, and the offsets in .metadata to
    match: a shard file that looks right except for those entries."""
    md = read_metadata_trusted(ckpt)
    old, out = (ckpt / SHARD).read_bytes(), bytearray()
    assert {info.relative_path for info in md.storage_data.values()} == {SHARD}
    assert set(new) <= {index.fqn for index in md.storage_data}
    for index, info in sorted(md.storage_data.items(), key=lambda kv: kv[1].offset):
        data = new.get(index.fqn, old[info.offset : info.offset + info.length])
        info.offset, info.length = len(out), len(data)
        out += data
    (ckpt / SHARD).write_bytes(bytes(out))
    write_metadata(ckpt, md)


def metadata_referencing(ckpt: Path, marker: Path) -> None:
    """The real metadata, with the payload hung where a loader that trusts it would not look."""
    md = read_metadata_trusted(ckpt)
    md.planner_data["model.0.weight"] = Touch(marker)
    write_metadata(ckpt, md)


def metadata_deep_inside(ckpt: Path, marker: Path) -> None:
    """The payload as a tensor's dtype, deep in state_dict_metadata."""
    md = read_metadata_trusted(ckpt)
    md.state_dict_metadata["model.0.weight"].properties.dtype = Touch(marker)
    write_metadata(ckpt, md)


@dataclass
class Plant:
    file: str  # the file of the .dcp directory that holds the payload
    plant: Callable[[Path, Path], None]  # plant(ckpt, marker)
    read_by_eval: bool = True  # does loading the model alone (accel-eval) read it?


PLANTS = {
    # .metadata: read by dcp.load with plain pickle.load.
    "metadata=pickle(Touch)": Plant(
        ".metadata", lambda c, m: (c / ".metadata").write_bytes(pickle.dumps(Touch(m)))
    ),
    "metadata=pickle(os.system)": Plant(
        ".metadata", lambda c, m: (c / ".metadata").write_bytes(pickle.dumps(System(m)))
    ),
    "metadata=real+payload in planner_data": Plant(".metadata", metadata_referencing),
    "metadata=real+payload as a dtype": Plant(".metadata", metadata_deep_inside),
    # The shard file, whole: read by slices at the offsets in .metadata.
    "shard=pickle(Touch)": Plant(
        SHARD, lambda c, m: (c / SHARD).write_bytes(pickle.dumps(Touch(m)))
    ),
    "shard=torch.save(Touch)": Plant(
        SHARD, lambda c, m: (c / SHARD).write_bytes(torch_saved(Touch(m)))
    ),
    # One entry of the shard file: a tensor (read by torch with weights_only=True) and a
    # non-tensor (read by dcp's DefaultLoadPlanner with weights_only=False).
    "shard entry model.0.weight=torch.save(Touch)": Plant(
        SHARD, lambda c, m: replace_entries(c, {"model.0.weight": torch_saved(Touch(m))})
    ),
    "shard entry optimizer lr=torch.save(Touch)": Plant(
        SHARD,
        lambda c, m: replace_entries(c, {"optimizer.param_groups.0.lr": torch_saved(Touch(m))}),
        read_by_eval=False,  # accel-eval loads the model's entries only
    ),
    # meta.pt: progress and config, read by load_checkpoint.
    "meta.pt=pickle(Touch)": Plant(
        "meta.pt", lambda c, m: (c / "meta.pt").write_bytes(pickle.dumps(Touch(m)))
    ),
    "meta.pt=torch.save(dict with Touch)": Plant(
        "meta.pt",
        lambda c, m: torch.save(
            {"format": FORMAT_VERSION, "config": Touch(m), "progress": {}}, c / "meta.pt"
        ),
    ),
}


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "payload-ran"
    yield path
    assert not path.exists(), "a payload in the checkpoint ran"


def check_refusal(err: UserError, file: Path) -> None:
    msg = str(err)
    assert str(file) in msg, msg  # names the file
    assert "\n" not in msg, msg  # one paragraph
    assert "refused" in msg and "would run code" in msg, msg


@pytest.mark.parametrize("how", ["resume", "eval"])
@pytest.mark.parametrize("name", PLANTS)
def test_a_payload_in_any_file_of_a_sharded_checkpoint_is_refused(tmp_path, marker, name, how):
    plant = PLANTS[name]
    ckpt = tmp_path / "bad.dcp"
    write_sharded(ckpt)
    plant.plant(ckpt, marker)

    def load() -> None:  # what `accel-train resume=` / `accel-eval ckpt_path=` do
        load_sharded_meta(ckpt, key="resume" if how == "resume" else "ckpt_path")
        model = make_model(seed=1)
        optimizer = torch.optim.Adam(model.parameters()) if how == "resume" else None
        load_sharded(model, optimizer, ckpt)

    if how == "eval" and not plant.read_by_eval:
        load()  # never reads the file: fine, as long as nothing ran (the marker fixture)
        return
    with pytest.raises(UserError) as info:
        load()
    assert not marker.exists()
    assert str(ckpt / plant.file) in str(info.value), str(info.value)
    assert "\n" not in str(info.value)
    # A whole shard file replaced is read at the wrong offsets: refused or unreadable, both ok.
    if not name.startswith("shard="):
        check_refusal(info.value, ckpt / plant.file)


def test_a_shard_outside_the_checkpoint_directory_is_refused(tmp_path, marker):
    ckpt = tmp_path / "bad.dcp"
    write_sharded(ckpt)
    (tmp_path / "elsewhere.distcp").write_bytes(pickle.dumps(Touch(marker)))
    md = read_metadata_trusted(ckpt)
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    write_metadata(ckpt, md)
    with pytest.raises(UserError, match=r"outside the checkpoint"):
        load_sharded(make_model(seed=1), None, ckpt)


def test_metadata_cannot_change_the_allowed_classes(tmp_path):
    """Allowed globals alone are not enough: BUILD on an allowed class (not an instance of it)
    would set an attribute on torch's own class, for the rest of the process."""
    from torch.distributed.checkpoint.metadata import Metadata

    ckpt = tmp_path / "bad.dcp"
    write_sharded(ckpt)
    # GLOBAL Metadata; MARK None {"version": "changed"} TUPLE; BUILD; STOP
    (ckpt / ".metadata").write_bytes(
        b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\n"
        b"(N}X\x07\x00\x00\x00versionX\x07\x00\x00\x00changedstb."
    )
    with pytest.raises(UserError, match="refused"):
        load_sharded(make_model(seed=1), None, ckpt)
    assert Metadata.version is None
    (ckpt / ".metadata").write_bytes(b"\x80\x02\x82\x01.")  # EXT1 1: a copyreg extension code
    with pytest.raises(UserError, match="refused"):
        load_sharded(make_model(seed=1), None, ckpt)


@pytest.mark.parametrize(
    "content",
    [
        lambda m: torch_saved({"format": FORMAT_VERSION, "config": {}, "model": Touch(m)}),
        lambda m: torch_saved(System(m)),
        lambda m: pickle.dumps(Touch(m)),
        lambda m: pickle.dumps(System(m)),
    ],
    ids=[
        "torch.save(dict with Touch)",
        "torch.save(os.system)",
        "pickle(Touch)",
        "pickle(os.system)",
    ],
)
def test_a_payload_in_a_pt_checkpoint_is_refused_with_torchs_whole_reason(
    tmp_path, marker, content
):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(content(marker))
    with pytest.raises(UserError) as info:
        load_checkpoint(bad, key="ckpt_path")
    assert not marker.exists()
    check_refusal(info.value, bad)
    msg = str(info.value)
    assert msg.startswith(f"ckpt_path={str(bad)!r}")
    # torch's reason in full, not cut at 200 characters: the part that explains the danger
    # and what torch refused.
    assert "Weights only load failed" in msg and "arbitrary code execution" in msg, msg


def test_torchs_reason_names_the_refused_function(tmp_path, marker):
    bad = tmp_path / "bad.pt"
    torch.save({"format": FORMAT_VERSION, "model": Touch(marker)}, bad)
    with pytest.raises(UserError) as info:
        load_checkpoint(bad)
    # Past torch's first 200 characters (the old message's cut): what torch refused to call.
    # (torch.save pickles with protocol 2, where Path.touch is getattr(Path, "touch").)
    assert str(info.value).index("GLOBAL getattr was not an allowed global") > 200


def test_a_damaged_pt_is_unreadable_not_refused(tmp_path):
    good = tmp_path / "good.pt"
    torch.save({"format": FORMAT_VERSION, "model": {}}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[:100])
    text = tmp_path / "text.pt"
    text.write_text("hello world\n")
    for path in (cut, text):
        with pytest.raises(UserError, match="is not a readable checkpoint") as info:
            load_checkpoint(path)
        assert "\n" not in str(info.value)


# ---- controls: the payloads do run through torch's own loaders --------------------------------


@pytest.mark.parametrize(
    "name", ["metadata=real+payload in planner_data", "shard entry optimizer lr=torch.save(Touch)"]
)
def test_control_dcp_load_runs_the_payload(tmp_path, name):
    """dcp.load as load_sharded used to call it runs a payload in .metadata (plain pickle.load)
    or in a non-tensor entry (DefaultLoadPlanner: torch.load(weights_only=False))."""
    ckpt, ran = tmp_path / "bad.dcp", tmp_path / "payload-ran"
    model, optimizer = write_sharded(ckpt)
    PLANTS[name].plant(ckpt, ran)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Suppressed: the .metadata payload leaves None where dcp expects Metadata.
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(ckpt))
    assert ran.exists()


def test_control_torch_load_without_weights_only_runs_the_payload(tmp_path):
    ckpt, ran = tmp_path / "bad.dcp", tmp_path / "payload-ran"
    write_sharded(ckpt)
    PLANTS["meta.pt=torch.save(dict with Touch)"].plant(ckpt, ran)
    torch.load(ckpt / "meta.pt", weights_only=False)
    assert ran.exists()


# ---- through the CLI, as a user would ----------------------------------------------------------

TRAIN = [
    "model=mlp",
    "dataset=synthetic",
    "dataset.num_train=256",
    "dataset.num_test=64",
    "loader.num_workers=0",
    "trainer.max_steps=2",
    "trainer.progress=none",
    "trainer.test_after_fit=false",
]


@pytest.fixture(scope="module")
def cli_ckpt(run_cli_in, tmp_path_factory) -> Path:
    """checkpoints/last.pt of a real two-step run."""
    root = tmp_path_factory.mktemp("cli-ckpt")
    check_ok(run_cli_in([*TRAIN, f"hydra.run.dir={root / 'run'}"], root))
    return root / "run" / "checkpoints" / "last.pt"


def sharded_from(last_pt: Path, dest: Path) -> Path:
    """A sharded checkpoint accel-eval accepts, without FSDP: meta.pt from a real run's last.pt
    (its config and progress) and the model's weights written by dcp.save."""
    ckpt = torch.load(last_pt, map_location="cpu", weights_only=True)
    dcp_save({"model": ckpt["model"]}, dest)
    torch.save({k: v for k, v in ckpt.items() if k not in ("model", "optimizer")}, dest / "meta.pt")
    return dest


def check_refused_by_cli(proc, marker: Path, file: Path) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    assert not marker.exists()
    assert str(file) in proc.stderr and "refused" in proc.stderr, out


def test_cli_control_the_sharded_checkpoint_evaluates(cli_ckpt, run_cli, tmp_path):
    """The good twin of the next test's checkpoint: accel-eval gets through load_sharded."""
    good = sharded_from(cli_ckpt, tmp_path / "good.dcp")
    check_ok(
        run_cli([f"ckpt_path={good}", f"out_path={tmp_path / 'eval.json'}"], prog="accel-eval")
    )
    assert (tmp_path / "eval.json").is_file()


def test_cli_refuses_a_payload_in_dcp_metadata(cli_ckpt, run_cli, tmp_path, marker):
    bad = sharded_from(cli_ckpt, tmp_path / "bad.dcp")
    (bad / ".metadata").write_bytes(pickle.dumps(Touch(marker)))
    proc = run_cli([f"ckpt_path={bad}", f"out_path={tmp_path / 'eval.json'}"], prog="accel-eval")
    check_refused_by_cli(proc, marker, bad / ".metadata")


@pytest.mark.parametrize("pickled", [False, True], ids=["torch.save", "pickle"])
def test_cli_refuses_a_payload_in_a_pt(cli_ckpt, run_cli, tmp_path, marker, pickled):
    bad = tmp_path / "bad.pt"
    if pickled:
        bad.write_bytes(pickle.dumps(Touch(marker)))
    else:
        ckpt = torch.load(cli_ckpt, map_location="cpu", weights_only=True)
        torch.save({**ckpt, "model": Touch(marker)}, bad)
    proc = run_cli([f"ckpt_path={bad}", f"out_path={tmp_path / 'eval.json'}"], prog="accel-eval")
    check_refused_by_cli(proc, marker, bad)

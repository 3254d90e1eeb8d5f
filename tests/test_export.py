"""accel-export (torch.export / ONNX / TorchScript artifacts, verified in their consumer, with a
card), post-training int8 (ONNX Runtime) and quantization-aware training (quant=qat, torchao).

Each test runs the real CLIs on a tiny model; the artifacts are also loaded back here, by
torch.export / onnxruntime / torch.jit, and compared with the checkpoint's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import check_ok, load_weights
from torch import nn
from torch.nn.utils import prune

from accel_train.models import mlp

# A tiny MLP on tiny synthetic data: 2 optimizer steps.
TINY = [
    "model=mlp",
    "model.hidden_dims=[24]",
    "dataset.num_train=96",
    "dataset.num_test=48",
    "loader.batch_size=32",
    "trainer.max_steps=2",
    "trainer.progress=none",
    "logger=none",
]


def tiny_model(weights: dict[str, torch.Tensor]) -> nn.Module:
    model = mlp(in_channels=1, image_size=28, num_classes=10, hidden_dims=[24]).eval()
    model.load_state_dict(weights)
    return model


@pytest.fixture(scope="module")
def trained(tmp_path_factory, run_cli_in) -> Path:
    """A run dir of a 2-step run, plus checkpoints/pruned.pt: its best.pt pruned with
    torch.nn.utils.prune (50% of each Linear's weights, masks made permanent)."""
    cwd = tmp_path_factory.mktemp("export")
    check_ok(run_cli_in([*TINY, "hydra.run.dir=run"], cwd))
    ckpts = cwd / "run" / "checkpoints"
    state = torch.load(ckpts / "best.pt", map_location="cpu", weights_only=True)
    model = tiny_model(state["model"])
    for m in model.modules():
        if isinstance(m, nn.Linear):
            prune.l1_unstructured(m, "weight", amount=0.5)
            prune.remove(m, "weight")
    torch.save({**state, "model": model.state_dict()}, ckpts / "pruned.pt")
    return cwd / "run"


def _card(artifact: Path) -> dict:
    return json.loads(artifact.with_name(artifact.name + ".json").read_text())


def _errors(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("fmt", ["torch_export", "onnx", "torchscript"])
def test_export_of_a_pruned_checkpoint_matches_the_model(trained, run_cli, fmt):
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    ckpt = trained / "checkpoints" / "pruned.pt"
    proc = run_cli([f"ckpt_path={ckpt}", f"format={fmt}"], prog="accel-export")
    check_ok(proc)
    suffix = {"torch_export": ".pt2", "onnx": ".onnx", "torchscript": ".torchscript.pt"}[fmt]
    artifact = trained / "checkpoints" / f"pruned{suffix}"
    card = _card(artifact)
    check = card["verification"]
    assert "argmax agreement 100.0000%" in proc.stdout + proc.stderr
    assert check["samples"] == 48 and check["argmax_agreement"] == 1.0
    assert check["max_abs_diff"] < 1e-4
    assert card["input"]["shape"] == ["batch", 1, 28, 28]
    assert card["normalisation"]["mean"] == [0.5] and card["classes"] == 10
    assert card["sparsity"]["fraction"] == pytest.approx(0.5, abs=0.01)
    assert card["accuracy_in_run_summary"]["test_acc"] >= 0
    assert card["source"]["config"] == str(trained / "config.yaml")
    assert len(card["source"]["checkpoint_sha256"]) == 64

    # Independently: the artifact, loaded by its consumer, computes the checkpoint's model.
    model = tiny_model(load_weights(ckpt))
    x = torch.randn(5, 1, 28, 28)  # another batch size than the export's example
    if fmt == "torch_export":
        out = torch.export.load(artifact).module()(x)
    elif fmt == "torchscript":
        out = torch.jit.load(str(artifact))(x)
    else:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(artifact), providers=["CPUExecutionProvider"])
        out = torch.from_numpy(session.run(None, {"input": x.numpy()})[0])
    torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)


def test_int8_static_quantization_reports_accuracy_before_and_after(trained, run_cli):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = trained.parent / "exported" / "model.onnx"
    proc = run_cli(
        [
            f"ckpt_path={trained / 'checkpoints' / 'best.pt'}",
            "quantize=int8",
            "calib_batches=1",
            f"out_path={out}",
        ],
        prog="accel-export",
    )
    check_ok(proc)
    int8 = out.with_name("model.int8.onnx")
    card = _card(int8)
    q = card["quantization"]
    assert q["calibration"].startswith("1 validation batches")
    assert 0 <= q["test_acc_before"] <= 1 and 0 <= q["test_acc_after"] <= 1
    assert q["test_acc_before"] == _card(out)["verification"]["pytorch_test_acc"]
    assert f"test acc {q['test_acc_before']:.4f} -> {q['test_acc_after']:.4f}" in proc.stdout
    assert int8.stat().st_size < out.stat().st_size / 2  # int8 weights (plus QDQ scales)
    import onnx

    ops = {node.op_type for node in onnx.load(str(int8)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops


def test_qat_trains_converts_and_exports_int8(run_cli, tmp_path):
    pytest.importorskip("torchao")
    proc = run_cli([*TINY, "quant=qat", "hydra.run.dir=run"])
    check_ok(proc)
    assert "techniques: tune_malloc, qat" in proc.stdout + proc.stderr
    ckpt = tmp_path / "run" / "checkpoints" / "best.pt"
    weights = load_weights(ckpt)
    # Fake quantization keeps the float model's keys: a plain, safely loadable state_dict.
    assert set(weights) == {"1.weight", "1.bias", "4.weight", "4.bias"}
    proc = run_cli([f"ckpt_path={ckpt}", "format=torch_export"], prog="accel-export")
    check_ok(proc)
    artifact = ckpt.with_name("best.pt2")
    card = _card(artifact)
    assert card["verification"]["argmax_agreement"] >= 0.999
    assert card["quantization"]["layers"].startswith("nn.Linear")
    # torchao's convert step ran: the exported program's Linear weights are int8 (torchao's
    # tensor subclass, whose `qdata` holds the integers).
    program = torch.export.load(artifact)
    weights = {k: getattr(v, "qdata", v).dtype for k, v in program.state_dict.items()}
    assert weights["1.weight"] == weights["4.weight"] == torch.int8
    # TorchScript cannot trace torchao's tensors; QAT + int8 PTQ twice over: both refused.
    err = _errors(run_cli([f"ckpt_path={ckpt}", "format=torchscript"], prog="accel-export"))
    assert "format=torch_export" in err
    err = _errors(
        run_cli([f"ckpt_path={ckpt}", "format=onnx", "quantize=int8"], prog="accel-export")
    )
    assert "quant=qat" in err and "quantize=int8" in err


def test_qat_resume_is_exact(run_cli, tmp_path):
    pytest.importorskip("torchao")
    common = [*TINY, "quant=qat", "trainer.max_steps=-1", "trainer.deterministic=true"]
    check_ok(run_cli([*common, "trainer.max_epochs=2", "hydra.run.dir=straight"]))
    check_ok(run_cli([*common, "trainer.max_epochs=1", "hydra.run.dir=resumed"]))
    check_ok(run_cli([*common, "trainer.max_epochs=2", "hydra.run.dir=resumed", "resume=auto"]))
    a = load_weights(tmp_path / "straight" / "checkpoints" / "last.pt")
    b = load_weights(tmp_path / "resumed" / "checkpoints" / "last.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_sharded_checkpoint_is_consolidated(trained, run_cli, tmp_path):
    import torch.distributed.checkpoint as dcp

    state = torch.load(trained / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    dest = tmp_path / "best.dcp"
    dcp.save({"model": state["model"]}, checkpoint_id=str(dest))
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    torch.save(meta, dest / "meta.pt")
    check_ok(run_cli([f"ckpt_path={dest}", "format=torchscript"], prog="accel-export"))
    card = _card(tmp_path / "best.torchscript.pt")
    assert card["verification"]["argmax_agreement"] == 1.0
    assert card["source"]["checkpoint"] == str(dest)


def test_export_errors(trained, run_cli, tmp_path):
    ckpt = trained / "checkpoints" / "best.pt"
    err = _errors(run_cli([f"ckpt_path={ckpt}", "format=tflite"], prog="accel-export"))
    assert "format='tflite'" in err and "torch_export, onnx, torchscript" in err
    err = _errors(
        run_cli([f"ckpt_path={ckpt}", "format=torch_export", "quantize=int8"], prog="accel-export")
    )
    assert "needs format=onnx" in err
    err = _errors(run_cli([f"ckpt_path={trained / 'checkpoints'}"], prog="accel-export"))
    assert "is a directory, not a checkpoint" in err
    # A missing optional extra names it: onnxruntime made unimportable.
    (tmp_path / "no_ort").mkdir()
    (tmp_path / "no_ort" / "onnxruntime.py").write_text("raise ImportError('hidden')\n")
    proc = run_cli(
        [f"ckpt_path={ckpt}", "format=onnx"],
        prog="accel-export",
        env={"PYTHONPATH": str(tmp_path / "no_ort")},
    )
    assert "pip install 'accel-train[onnx]'" in _errors(proc)


def test_out_path_never_replaces_a_checkpoint_nor_an_existing_file(trained, run_cli, tmp_path):
    """out_path=<run>/checkpoints/best.pt wrote the artifact (or accel-eval's result) over the
    checkpoint it read (and last.pt: resume=auto then refused the run); any existing file was
    replaced (issue 32)."""
    ckpts = Path(shutil.copytree(trained, tmp_path / "run")) / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckpts.iterdir()}
    best = ckpts / "best.pt"
    for target, what in ((best, "the checkpoint being read"), (ckpts / "last.pt", "a run's")):
        for extra in ([], ["overwrite=true"]):
            args = [f"ckpt_path={best}", "format=torch_export", f"out_path={target}", *extra]
            err = _errors(run_cli(args, prog="accel-export"))
            assert f"out_path={target} is {what}" in err
    # accel-eval's result file neither.
    err = _errors(run_cli([f"ckpt_path={best}", f"out_path={best}"], prog="accel-eval"))
    assert "is the checkpoint being read" in err
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    err = _errors(run_cli([f"ckpt_path={best}", f"out_path={notes}"], prog="accel-eval"))
    assert "is not an accel-eval result" in err and notes.read_text() == "mine"
    assert {p.name: p.read_bytes() for p in ckpts.iterdir()} == before
    mine = tmp_path / "model.pt2"
    mine.write_bytes(b"mine")
    args = [f"ckpt_path={best}", "format=torch_export", f"out_path={mine}"]
    err = _errors(run_cli(args, prog="accel-export"))
    assert "exists already" in err and "overwrite=true" in err and mine.read_bytes() == b"mine"
    # Nor with overwrite=true: a file at the artifact's name is not an earlier export (issue 39).
    err = _errors(run_cli([*args, "overwrite=true"], prog="accel-export"))
    assert "not an earlier accel-export's artifact" in err and mine.read_bytes() == b"mine"
    ours = tmp_path / "ours.pt2"
    args = [f"ckpt_path={best}", "format=torch_export", f"out_path={ours}"]
    check_ok(run_cli(args, prog="accel-export"))
    check_ok(run_cli([*args, "overwrite=true"], prog="accel-export"))  # its own: replaced
    assert torch.export.load(ours) is not None and _card(ours)["source"]["checkpoint"] == str(best)


def test_qat_refuses_impossible_combinations(run_cli, tmp_path):
    pytest.importorskip("torchao")
    (tmp_path / "convnet.py").write_text(
        "from torch import nn\n\n\n"
        "def net(in_channels, num_classes):\n"
        "    return nn.Sequential(nn.Conv2d(in_channels, num_classes, 3), "
        "nn.AdaptiveAvgPool2d(1), nn.Flatten())\n"
    )
    small = [a for a in TINY if not a.startswith("model")]
    proc = run_cli(
        [*small, "model=custom", "model._target_=convnet.net", "quant=qat", "hydra.run.dir=r"],
        env={"PYTHONPATH": str(tmp_path)},
    )
    err = _errors(proc)
    assert "quant=qat" in err and "no nn.Linear layer" in err
    err = _errors(run_cli([*TINY, "quant=qat", "quant.weight_bits=1", "hydra.run.dir=r2"]))
    assert "quant.weight_bits=1" in err
    err = _errors(run_cli([*TINY, "quant=qat", "strategy=fsdp", "hydra.run.dir=r3"]))
    assert "quant=qat with strategy=fsdp" in err

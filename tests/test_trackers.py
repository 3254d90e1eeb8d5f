"""Experiment trackers and several loggers at once: a sweep into MLflow read back with MLflow's own
client, an offline W&B run read back from its run file, and the error for a missing extra."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from helpers import FAST, check_ok, read_jsonl

from accel_train.config.checks import validate
from accel_train.errors import UserError

# fast_dev_run keeps no checkpoint; these tests check that trackers record best.pt.
TINY = [
    *FAST,
    "+debug=fast_dev_run",
    "trainer.limit_train_batches=2",
    "checkpoint.save_top_k=1",
    "trainer.deterministic=true",
]


def test_a_sweep_with_csv_tensorboard_and_mlflow(run_cli, tmp_path):
    """Two sweep jobs, three loggers each, one MLflow experiment; every logger has the rows."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    proc = run_cli(
        [
            "-m",
            *TINY,
            "logger=[csv,tensorboard,mlflow]",
            "tags=[smoke,t2]",
            "optimizer.lr=0.001,0.002",
            "hydra.sweep.dir=sweep",
        ],
        timeout=400,
    )
    check_ok(proc)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'outputs' / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("train")  # the run's `name`: one experiment
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 2
    assert sorted(r.data.params["optimizer.lr"] for r in runs) == ["0.001", "0.002"]
    for run in runs:
        job = Path(run.data.tags["run_dir"])
        assert job.parent == tmp_path / "sweep" and run.info.run_name == f"sweep/{job.name}"
        assert run.info.status == "FINISHED"
        params = run.data.params
        assert params["trainer.limit_train_batches"] == "2" and params["model.name"] == "mlp"
        assert params["logger.mlflow.experiment_name"] == "train"
        assert run.data.tags["smoke"] == "true" and run.data.tags["tags"] == "smoke,t2"
        assert run.data.tags["best_checkpoint"] == str(job / "checkpoints" / "best.pt")
        rows = read_jsonl(job / "metrics.jsonl")
        logged = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert [m.step for m in history] == [s for s, _ in logged] == [1, 2]
        assert [m.value for m in history] == pytest.approx([v for _, v in logged])
        summary = json.loads((job / "summary.json").read_text())
        assert run.data.metrics["test/acc"] == pytest.approx(summary["test_acc"])
        assert summary["tags"] == ["smoke", "t2"]
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert artifacts == {"config.yaml", "summary.json"}
        # The other two loggers of the list wrote theirs too (none overwrote another).
        assert (job / "metrics.csv").read_text().count("train/loss") == 2
        assert list((job / "tensorboard").glob("events.out.tfevents.*"))


def _wandb_records(path: Path):
    """The records of a W&B run file (.wandb): a 7-byte header, then LevelDB-log records in
    32 KiB blocks (crc32, length, type: full / first / middle / last), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if length == 0 and kind == 0:
            break
        pending += chunk
        if kind in (1, 4):  # full or last
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_has_config_metrics_tags_and_files(run_cli, tmp_path):
    pytest.importorskip("wandb")
    proc = run_cli([*TINY, "logger=[csv,wandb]", "tags=[smoke]", "hydra.run.dir=run"])
    check_ok(proc)
    run_dir = tmp_path / "run"
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (log_file,) = offline.glob("run-*.wandb")
    records = list(_wandb_records(log_file))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert list(run.tags) == ["smoke"] and run.run_group == "train" and run.display_name == "run"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["trainer"]["limit_train_batches"] == 2
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    logged = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
    seen = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert [s for s, _ in seen] == [s for s, _ in logged] == [1, 2]
    assert [v for _, v in seen] == pytest.approx([v for _, v in logged])
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({i.key: json.loads(i.value_json) for i in r.summary.update})
    assert summary["best_checkpoint"] == str(run_dir / "checkpoints" / "best.pt")
    assert summary["test_acc"] == json.loads((run_dir / "summary.json").read_text())["test_acc"]
    for name in ("config.yaml", "summary.json"):  # saved as run files, beside wandb's own
        assert (offline / "files" / "run" / name).read_text() == (run_dir / name).read_text()
    assert (run_dir / "metrics.csv").exists()


def test_a_missing_tracker_names_its_extra(compose_cfg, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = compose_cfg(["logger=[csv,wandb]", f"paths.output_dir={tmp_path}"])
    with pytest.raises(UserError, match=r'pip install "accel-train\[wandb\]"'):
        validate(cfg)
    with pytest.raises(UserError, match="logger.mlfow is not a logger"):
        validate(compose_cfg(["+logger.mlfow.x=1", f"paths.output_dir={tmp_path}"]))

"""Bad input through the real CLI: non-zero exit, a message naming the key, no traceback."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch
from helpers import FAST

from accel_train.checkpoint import FORMAT_VERSION, load_checkpoint
from accel_train.errors import UserError


def _check_error(proc, *expected: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    for text in expected:
        assert text in proc.stderr, f"{text!r} not in stderr:\n{proc.stderr}"
    assert "Traceback" not in output, output


def _truncated_checkpoint(path):
    """The first half of a real torch.save zip file: what a torn write would leave."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, "model": {"w": torch.randn(256, 256)}}, buffer)
    data = buffer.getvalue()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # Hydra's own compose-time errors, from the typed schema and the config groups.
        (["loader.batchsize=3"], ["loader.batchsize"]),
        (["loader.batch_size=abc"], ["loader.batch_size", "abc"]),
        (["model=foo"], ["model/foo", "mnist_cnn"]),  # lists the available options
        # accel-train's semantic checks.
        (["loader.batch_size=0"], ["loader.batch_size=0", "loader.batch_size=1"]),
        (["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches=0"]),
        (["resume=/no/such/file"], ["resume='/no/such/file'", "resume=auto"]),
    ],
    ids=["typo", "type", "option", "batch_size", "accumulate", "resume-missing"],
)
def test_config_errors(args, expected, run_cli):
    _check_error(run_cli([*args, "trainer.progress=none"]), *expected)


def test_cuda_on_a_cpu_machine(run_cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = run_cli(["trainer.device=cuda", "trainer.progress=none"])
    _check_error(proc, "trainer.device=cuda", "trainer.device=cpu")
    assert "nproc_per_node=0" not in proc.stderr  # not a fix that cannot work


def test_missing_dataset(run_cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli(
        ["dataset=mnist", f"paths.data_dir={empty}", "dataset.download=false", *FAST[3:]]
    )
    _check_error(proc, "dataset=mnist", str(empty / "MNIST"), "paths.data_dir", "dataset=synthetic")


def test_corrupt_checkpoint_for_eval(run_cli, tmp_path):
    bad = _truncated_checkpoint(tmp_path / "best.pt")
    proc = run_cli([f"ckpt_path={bad}"], prog="accel-eval")
    _check_error(proc, "ckpt_path=", str(bad), "not a readable checkpoint")


def test_corrupt_checkpoint_for_resume(run_cli, tmp_path):
    bad = tmp_path / "last.pt"
    bad.write_bytes(b"\x00not a checkpoint at all" * 100)
    proc = run_cli([*FAST, "+debug=fast_dev_run", f"resume={bad}", "hydra.run.dir=run"])
    _check_error(proc, "resume=", str(bad), "not a readable checkpoint")


def test_full_error_shows_the_traceback(run_cli):
    proc = run_cli(["loader.batch_size=0"], env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "UserError" in proc.stderr
    assert "loader.batch_size=0" in proc.stderr


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_load_checkpoint_rejects_every_kind_of_bad_file(tmp_path):
    """In-process: each bad file becomes a UserError naming the key, never a raw exception."""
    foreign = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}}, foreign)
    pickled = tmp_path / "pickled.pt"
    pickled.write_bytes(pickle.dumps({"format": FORMAT_VERSION}))
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    zipped = tmp_path / "zipped.pt"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("hello.txt", "not torch")
    bad_files = [
        _truncated_checkpoint(tmp_path / "torn.pt"),
        foreign,
        pickled,
        empty,
        zipped,
        tmp_path / "missing.pt",
        tmp_path,  # a directory
    ]
    for path in bad_files:
        with pytest.raises(UserError, match="resume="):
            load_checkpoint(path, key="resume")

"""Bad input through the real CLI: non-zero exit, a message naming the key, no traceback."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import zipfile

import pytest
import torch
from helpers import BIN, FAST
from omegaconf import OmegaConf

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


# ---- Hydra's and OmegaConf's errors, every entry point (issue 22): config/hydra_errors.py ----

# (program, arguments, texts the one paragraph must hold)
CONFIG_ERRORS = {
    "plus-unknown": ("accel-train", ["+trainer.no_such_key=1"], ["trainer.no_such_key", "added"]),
    "plus-top": ("accel-train", ["+no_such_key=1"], ["no_such_key is not a key"]),
    "typo-suggests": ("accel-train", ["trainer.max_step=3"], ["`trainer.max_steps`"]),
    "model-arg-needs-plus": ("accel-train", ["model.width=3"], ["`+model.width=...`"]),
    "delete-typed": ("accel-train", ["~trainer.max_steps"], ["~trainer.max_steps", "deleted"]),
    "delete-group": ("accel-train", ["~loader"], ["loader is required"]),
    "bad-interpolation": ("accel-train", ["name=${nope}"], ["name=${nope}", "\\${...}"]),
    "env-interpolation": ("accel-train", ["name=${oc.env:ACCEL_NO_SUCH_VAR}"], ["ACCEL_NO_SUCH"]),
    "missing-option": ("accel-train", ["trainer=nosuch"], ["trainer=nosuch", "default"]),
    "option-in-list": ("accel-train", ["logger=[csv,nosuch]"], ["logger=nosuch", "tensorboard"]),
    "lht-key-added": ("accel-train", ["+seed=3"], ["accel-train's is trainer.seed"]),
    "group-twice": (
        "accel-train",
        ["+experiment=mnist_amp", "experiment=mnist_amp"],
        ["experiment appears more than once"],
    ),
    "unparsable": ("accel-train", ["trainer.max_steps=[1"], ["could not be parsed", "Quote"]),
    "wrong-type": ("accel-train", ["trainer.seed=abc"], ["trainer.seed=abc", "Integer"]),
    "sweep-bad-value": ("accel-train", ["-m", "trainer.seed=1,abc"], ["trainer.seed=abc"]),
    "eval-plus": ("accel-eval", ["ckpt_path=x.pt", "+nokey=1"], ["nokey", "ckpt_path"]),
    "eval-delete": ("accel-eval", ["ckpt_path=x.pt", "~ckpt_path"], ["ckpt_path", "deleted"]),
    "eval-interpolation": ("accel-eval", ["ckpt_path=${nope}"], ["ckpt_path=${nope}"]),
    "export-unknown": ("accel-export", ["ckpt_path=x.pt", "nokey=1"], ["nokey", "format"]),
    "report-plus": ("accel-report", ["+trainer.nokey=1"], ["trainer.nokey", "added"]),
    "report-option": ("accel-report", ["model=nosuch"], ["model=nosuch", "mnist_cnn"]),
}


def _one_paragraph(proc, prog: str, *expected: str) -> None:
    _check_error(proc, *expected)
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "(Set HYDRA_FULL_ERROR=1 for the traceback.)", proc.stderr
    assert lines[-2].startswith(f"{prog}: error: "), proc.stderr  # the paragraph is one line


@pytest.mark.parametrize("name", sorted(CONFIG_ERRORS))
def test_hydra_and_omegaconf_errors_are_one_paragraph(name, run_cli, tmp_path):
    prog, args, expected = CONFIG_ERRORS[name]
    extra = ["hydra.run.dir=run", "hydra.sweep.dir=sweep"] if prog == "accel-train" else []
    if prog == "accel-report":
        extra = ["--out", "report"]
    proc = run_cli([*args, *extra], prog=prog)
    _one_paragraph(proc, prog, *expected)
    assert not (tmp_path / "run").exists()  # a refused config leaves no run dir behind


def test_a_users_own_options_without_a_schema(run_cli, tmp_path):
    """Option YAMLs in the user's config dir that set only `_target_` and its arguments, as in
    lightning-hydra-template, get the group's defaults; a named group's option without a name
    is refused, saying how to start it from one of ours."""
    (tmp_path / "mine.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.utils.data import TensorDataset\n\n\n"
        "def net(in_channels, image_size, num_classes, width=8):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size**2, width),\n"
        "                         nn.ReLU(), nn.Linear(width, num_classes))\n\n\n"
        "def data(n=96):\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    ds = TensorDataset(torch.rand(n, 1, 8, 8, generator=g), torch.arange(n) % 4)\n"
        "    ds.classes = list(range(4))\n"
        "    return ds\n"
    )
    own = tmp_path / "my_configs"
    for group, text in {
        "model": "_target_: mine.net\nwidth: 16\n",
        "dataset": "_target_: mine.data\nn: 64\n",
        "loss": "_target_: torch.nn.CrossEntropyLoss\nlabel_smoothing: 0.1\n",
        "optimizer": "_target_: torch.optim.SGD\nlr: 0.1\n",
    }.items():
        (own / group).mkdir(parents=True)
        (own / group / "mine.yaml").write_text(text)
    common = [
        f"hydra.searchpath=[file://{own}]",
        "model=mine",
        "dataset=mine",
        "loss=mine",
        "loader.batch_size=16",
        "trainer.max_steps=2",
        "trainer.progress=none",
        "logger=none",
    ]
    env = {"PYTHONPATH": str(tmp_path)}
    proc = run_cli([*common, "hydra.run.dir=run"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert run.model.width == 16 and run.dataset.n == 64 and run.dataset.val_fraction == 0.1
    assert run.loss.label_smoothing == 0.1
    proc = run_cli([*common, "optimizer=mine", "hydra.run.dir=run2"], env=env)
    _one_paragraph(proc, "accel-train", "optimizer.name", "defaults: [sgd, _self_]")
    # An experiment ported from lightning-hydra-template, with its top-level seed.
    (own / "experiment").mkdir()
    (own / "experiment" / "lht.yaml").write_text("# @package _global_\nseed: 5\n")
    proc = run_cli([*common, "experiment=lht", "hydra.run.dir=run3"], env=env)
    _one_paragraph(proc, "accel-train", "experiment/lht.yaml", "`trainer: {seed: ...}`")


def test_a_sweep_whose_every_trial_fails(run_cli, tmp_path):
    """Optuna with every trial failing (no data where paths.data_dir points): the summary is
    written, each trial's reason is in the paragraph, and the exit is non-zero."""
    pytest.importorskip("optuna")
    sweep = tmp_path / "sweep"
    proc = run_cli(
        [
            "hparams_search=mnist_optuna",
            "hydra.sweeper.n_trials=2",
            "dataset=mnist",
            "dataset.download=false",
            f"paths.data_dir={tmp_path / 'no-such-dir'}",
            "trainer.progress=none",
            f"hydra.sweep.dir={sweep}",
        ]
    )
    _one_paragraph(proc, "accel-train", "2 of 2 sweep jobs failed", "jobs 0, 1: dataset=mnist")
    assert "the sweep stopped" in proc.stderr and "sweep_summary.csv" in proc.stderr
    rows = json.loads((sweep / "sweep_summary.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["failed", "failed"]
    assert all("no-such-dir" in r["error"] for r in rows)


# Refusals that need no tensor, each in a fresh interpreter of the real console script (never
# a fork of a warm parent that imported torch already): one paragraph, a non-zero exit, and torch
# never imported (BENCHMARKS.md section 38: a refusal costs ~0.7 CPU s, not ~3). Python's import
# profiler (PYTHONPROFILEIMPORTTIME) lists every module the process imported on stderr.
FRESH_REFUSALS = [
    ("accel-train", ["trainer.max_epochs=0", "trainer.max_steps=0"], "nothing to train"),
    ("accel-train", ["optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
    ("accel-train", ["loader.batch_size=0"], "loader.batch_size=0 must be >= 1"),
    # A check that reads the task's facts (config/task_facts.py), and one that reads its metrics.
    ("accel-train", ["task=regression", "distill.teacher=t.pt"], "distill.teacher with task="),
    ("accel-train", ["early_stopping.monitor=val/nope"], "early_stopping.monitor='val/nope'"),
    # Hydra's own: an option that does not exist, a key that does not exist.
    ("accel-train", ["strategy=fdsp"], "fdsp"),
    ("accel-train", ["trainer.nope=1"], "trainer.nope"),
    ("accel-eval", ["nope=1"], "nope"),
    ("accel-eval", ["ckpt_path=x.pt", "split=bogus"], "split='bogus' is not one of"),
    ("accel-export", ["ckpt_path=x.pt", "format=bogus"], "format='bogus' is not one of"),
]


def _imported(stderr: str) -> set[str]:
    """The modules a process imported, from PYTHONPROFILEIMPORTTIME's lines on its stderr."""
    return {
        line.rsplit("|", 1)[-1].strip()
        for line in stderr.splitlines()
        if line.startswith("import time:")
    }


@pytest.mark.fresh
@pytest.mark.parametrize(("prog", "args", "expected"), FRESH_REFUSALS, ids=str)
def test_a_refusal_imports_no_torch(prog, args, expected, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPROFILEIMPORTTIME="1", ACCEL_TRAIN_DATA_DIR=str(tmp_path / "no-data"))
    proc = subprocess.run(
        [str(BIN / prog), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    paragraph = "\n".join(
        line for line in proc.stderr.splitlines() if not line.startswith("import time:")
    )
    assert proc.returncode != 0, paragraph
    assert f"{prog}: error:" in paragraph and expected in paragraph, paragraph
    assert "Traceback" not in paragraph, paragraph
    imported = _imported(proc.stderr)
    assert "omegaconf" in imported, "the import profiler's lines are missing"
    assert "torch" not in imported, f"{prog} {' '.join(args)} imported torch to refuse"
    assert not (tmp_path / "outputs").exists()  # a refused run leaves no run dir

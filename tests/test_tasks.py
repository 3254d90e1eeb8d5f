"""Tasks other than classification, through the real CLI (issue 17): the user's own step over
dict batches (one process, 2 DDP processes, exact mid-epoch resume, accel-eval), a model that
returns its own loss, task=regression with a built-in loss option and the device loader, the
loss normaliser, selective backprop on a regression, a sweep over a custom task's val/loss, and
each contract error and refusal.

The user's code is a package `my_project` written into the test's working directory (importable
from there, as for a user who runs accel-train from their project)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import check_ok, load_weights, read_jsonl

from accel_train.config.checks import validate
from accel_train.errors import UserError

PACKAGE = {
    "__init__.py": "",
    "data.py": """
        import torch
        from torch.utils.data import Dataset, TensorDataset


        def _draw(n, seed):
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, 8, generator=g)
            y = (x @ torch.linspace(-1, 1, 8))[:, None] + 0.05 * torch.randn(n, 1, generator=g)
            return x, y


        class Pairs(Dataset):
            # Dict items: the input under "x", the target under "y".
            def __init__(self, n, seed):
                self.x, self.y = _draw(n, seed)

            def __len__(self):
                return len(self.x)

            def __getitem__(self, i):
                return {"x": self.x[i], "y": self.y[i]}


        def build_sets():
            return Pairs(256, 1), Pairs(64, 2), Pairs(64, 3)


        def tensor_sets():
            # (x, y) pairs in TensorDatasets: what loader=device holds on the device.
            return tuple(TensorDataset(*_draw(n, s)) for n, s in ((256, 1), (64, 2), (64, 3)))


        class Tokens(Dataset):
            # Token sequences with an uneven number of valid tokens (the rest is padding).
            def __init__(self, n, seed, length=12, vocab=16):
                g = torch.Generator().manual_seed(seed)
                self.tokens = torch.randint(0, vocab, (n, length), generator=g)
                valid = torch.randint(1, length + 1, (n,), generator=g)
                self.mask = torch.arange(length)[None, :] < valid[:, None]

            def __len__(self):
                return len(self.tokens)

            def __getitem__(self, i):
                return {"tokens": self.tokens[i], "mask": self.mask[i]}


        def token_sets():
            return Tokens(64, 1), Tokens(16, 2)
        """,
    "nets.py": """
        from types import SimpleNamespace

        import torch.nn.functional as F
        from torch import nn


        class Net(nn.Module):
            def __init__(self, hidden=16):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))

            def forward(self, x):
                return self.net(x)


        class Wrapped(Net):
            # The Hugging Face habit: called with the batch's keys, returns an object with .loss.
            def forward(self, x, y=None):
                pred = self.net(x)
                loss = F.mse_loss(pred, y) if y is not None else None
                return SimpleNamespace(loss=loss, prediction=pred)


        class NoLoss(Net):
            # Takes the batch's keys but returns only the prediction.
            def forward(self, x, y=None):
                return self.net(x)


        class Flat(Net):
            # (batch,) where the target is (batch, 1).
            def forward(self, x):
                return self.net(x).squeeze(1)


        class TokenNet(nn.Module):
            def __init__(self, vocab=16, width=8):
                super().__init__()
                self.embed = nn.Embedding(vocab, width)
                self.head = nn.Linear(width, vocab)

            def forward(self, tokens):
                return self.head(self.embed(tokens).relu())
        """,
    "steps.py": """
        import torch.nn.functional as F


        def step(model, batch):
            pred = model(batch["x"])
            loss = F.mse_loss(pred, batch["y"])
            return loss, {"mae": (pred - batch["y"]).abs().mean()}


        def eval_step(model, batch):
            pred = model(batch["x"])
            return F.mse_loss(pred, batch["y"]), {"mae": (pred - batch["y"]).abs().mean()}


        def _token_losses(model, batch):
            logits = model(batch["tokens"])
            mask = batch["mask"]
            return F.cross_entropy(logits[mask], batch["tokens"][mask], reduction="sum"), mask.sum()


        def token_step(model, batch):
            # The normaliser form: the loop divides by the valid tokens of the whole step.
            return _token_losses(model, batch)


        def token_mean_step(model, batch):
            # The mean of micro-batch means (the bug the normaliser avoids), for comparison.
            loss_sum, items = _token_losses(model, batch)
            return loss_sum / items


        def detached(model, batch):
            return F.mse_loss(model(batch["x"]), batch["y"]).detach()


        def one_argument(model):
            return model
        """,
}

CUSTOM = [
    "task=custom",
    "task.step=my_project.steps.step",
    "+task.metrics={mae: min}",
    "dataset=custom",
    "dataset._target_=my_project.data.build_sets",
    "model=custom",
    "model._target_=my_project.nets.Net",
    "loader.batch_size=32",
    "optimizer.lr=0.01",
    "trainer.log_every_n_steps=1",
    "trainer.progress=none",
    "trainer.deterministic=true",
    "logger=none",
]


def write_package(root: Path) -> Path:
    pkg = root / "my_project"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, text in PACKAGE.items():
        (pkg / name).write_text(textwrap.dedent(text))
    return root


def _metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def _values(run_dir: Path, key: str) -> dict[int, float]:
    return {m["step"]: m[key] for m in _metrics(run_dir) if key in m}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return write_package(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def custom_run(project, run_cli_in):
    """The user's step over dict batches, 2 epochs of 8 steps (the reference of the resume)."""
    run_dir = project / "custom_run"
    proc = run_cli_in([*CUSTOM, "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"], project)
    check_ok(proc)
    return run_dir


def test_custom_step_over_dict_batches_logs_its_metrics(custom_run):
    logged = set().union(*(m.keys() for m in _metrics(custom_run)))
    for key in ("train/loss", "train/mae", "val/loss", "val/mae", "test/loss", "test/mae"):
        assert key in logged, key
    assert "train/acc" not in logged and "val/acc" not in logged
    val = list(_values(custom_run, "val/loss").values())
    assert len(val) == 2 and val[-1] < val[0]  # it learns
    summary = json.loads((custom_run / "summary.json").read_text())
    assert summary["monitor"] == "val/loss"  # the task's default monitor
    assert summary["final_val_mae"] == pytest.approx(_values(custom_run, "val/mae")[16])
    config = (custom_run / "config.yaml").read_text()
    assert "step: my_project.steps.step" in config  # recorded: workers and resume rebuild it


def test_accel_eval_prints_the_custom_tasks_test_metrics(custom_run, project, run_cli_in):
    best = custom_run / "checkpoints" / "best.pt"
    out = project / "eval.json"
    proc = run_cli_in([f"ckpt_path={best}", f"out_path={out}"], project, prog="accel-eval")
    check_ok(proc)
    result = json.loads(out.read_text())
    assert "test/mae" in proc.stdout + proc.stderr
    assert result["task"] == "custom"
    test = {k: v for m in _metrics(custom_run) for k, v in m.items() if k.startswith("test/")}
    assert result["test/loss"] == pytest.approx(test["test/loss"], rel=1e-6)
    assert result["test/mae"] == pytest.approx(test["test/mae"], rel=1e-6)


def test_custom_step_resumes_mid_epoch_exactly(custom_run, project, run_cli_in, tmp_path):
    run_dir = tmp_path / "run"
    common = [*CUSTOM, "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"]
    check_ok(run_cli_in([*common, "trainer.max_steps=3", "trainer.ckpt_every_n_steps=2"], project))
    proc = run_cli_in([*common, "resume=auto"], project)
    check_ok(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    ref, resumed = _values(custom_run, "train/loss"), _values(run_dir, "train/loss")
    assert sorted(resumed) == list(range(1, 17))
    assert all(resumed[s] == ref[s] for s in resumed)
    ref_w = load_weights(custom_run / "checkpoints" / "last.pt")
    got_w = load_weights(run_dir / "checkpoints" / "last.pt")
    assert all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)


def test_custom_step_with_eval_step_in_two_ddp_processes(project, run_cli_in, tmp_path):
    run_dir = tmp_path / "ddp"
    proc = run_cli_in(
        [
            *CUSTOM,
            "task.eval_step=my_project.steps.eval_step",
            "strategy=ddp",
            "launcher.nproc_per_node=2",
            "trainer.max_epochs=1",
            f"hydra.run.dir={run_dir}",
        ],
        project,
        timeout=300,
    )
    check_ok(proc)
    val = _values(run_dir, "val/mae")
    assert val and all(v == v and v < 10 for v in val.values())
    assert _values(run_dir, "train/mae")
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2


def test_model_loss_task_with_a_module_that_returns_loss(project, run_cli_in, tmp_path):
    run_dir = tmp_path / "model_loss"
    args = [a for a in CUSTOM if not a.startswith(("task", "+task", "model"))]
    proc = run_cli_in(
        [
            *args,
            "task=model_loss",
            "model=custom",
            "model._target_=my_project.nets.Wrapped",
            "trainer.max_epochs=2",
            f"hydra.run.dir={run_dir}",
        ],
        project,
    )
    check_ok(proc)
    val = list(_values(run_dir, "val/loss").values())
    assert len(val) == 2 and val[-1] < val[0]
    assert (run_dir / "checkpoints" / "best.pt").is_file()


def test_regression_with_huber_loss_device_loader_and_selective_backprop(
    project, run_cli_in, tmp_path
):
    run_dir = tmp_path / "regression"
    proc = run_cli_in(
        [
            "task=regression",
            "task.loss=huber",
            "dataset=custom",
            "dataset._target_=my_project.data.tensor_sets",
            "model=custom",
            "model._target_=my_project.nets.Net",
            "loader=device",
            "loader.batch_size=32",
            "optimizer.lr=0.01",
            "selective_backprop.keep=0.5",
            "selective_backprop.start=0",
            "selective_backprop.end=1",
            "trainer.max_epochs=2",
            "trainer.progress=none",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ],
        project,
    )
    check_ok(proc)
    logged = set().union(*(m.keys() for m in _metrics(run_dir)))
    assert {"val/loss", "val/mse", "val/mae", "test/mse"} <= logged
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["selective_backprop"]["selected_batches"] > 0  # per-sample losses worked
    assert (
        summary["selective_backprop"]["kept_samples"] * 2
        == summary["selective_backprop"]["seen_samples"]
    )


# ---- the normaliser ----------------------------------------------------------------------

TOKENS = [
    "task=custom",
    "dataset=custom",
    "dataset._target_=my_project.data.token_sets",
    "model=custom",
    "model._target_=my_project.nets.TokenNet",
    "optimizer=sgd",
    "optimizer.momentum=0",
    "optimizer.nesterov=false",
    "optimizer.lr=5",
    "optimizer.fused=false",
    "trainer.max_steps=1",
    "trainer.log_every_n_steps=1",
    "trainer.test_after_fit=false",
    "trainer.limit_val_batches=1",
    "trainer.progress=none",
    "logger=none",
]


def test_the_normaliser_divides_by_the_items_of_the_whole_step(project, run_cli_in, tmp_path):
    """A token loss with an uneven number of valid tokens per micro-batch: one batch of 16,
    accumulation 4 x 4, and 2 DDP processes x 8 take the same optimizer step (the same 16
    samples: ShardedOrder makes the ranks' and the micro-batches' union the big batch)."""
    runs = {
        "one_batch": ["task.step=my_project.steps.token_step", "loader.batch_size=16"],
        "accumulate_4": [
            "task.step=my_project.steps.token_step",
            "loader.batch_size=4",
            "trainer.accumulate_grad_batches=4",
        ],
        "ddp_2": [
            "task.step=my_project.steps.token_step",
            "loader.batch_size=8",
            "strategy=ddp",
            "launcher.nproc_per_node=2",
        ],
        "mean_of_means": [
            "task.step=my_project.steps.token_mean_step",
            "loader.batch_size=4",
            "trainer.accumulate_grad_batches=4",
        ],
    }
    weights = {}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        proc = run_cli_in([*TOKENS, *extra, f"hydra.run.dir={run_dir}"], project, timeout=300)
        check_ok(proc)
        weights[name] = load_weights(run_dir / "checkpoints" / "last.pt")
    ref = weights["one_batch"]
    for name in ("accumulate_4", "ddp_2"):
        for key in ref:
            torch.testing.assert_close(weights[name][key], ref[key], rtol=1e-5, atol=1e-6)
    # The uneven items matter: averaging the micro-batch means takes another step.
    assert any(
        not torch.allclose(weights["mean_of_means"][k], ref[k], rtol=1e-3, atol=1e-4) for k in ref
    )


# ---- a sweep over a custom task's val/loss -----------------------------------------------


def test_sweep_over_a_custom_tasks_val_loss(project, run_cli_in, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = run_cli_in(
        [
            "-m",
            *CUSTOM,
            "trainer.max_epochs=1",
            "optimizer.lr=0.001,0.05",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        project,
        timeout=400,
    )
    check_ok(proc)
    data = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert data["objective"] == "final_val_loss" and data["failed"] == 0
    values = {r["job"]: r["objective"] for r in data["rows"]}
    for job, value in values.items():
        summary = json.loads((sweep_dir / str(job) / "summary.json").read_text())
        assert value == summary["final_val_loss"]
    assert data["best"]["job"] == min(values, key=values.get)  # minimised


# ---- contracts (at build, before the first step) and refusals (at compose) ---------------

CONTRACTS = {
    "not_importable": (
        ["task.step=my_project.nope.step"],
        ["task.step", "no module my_project.nope"],
    ),
    "wrong_signature": (
        ["task.step=my_project.steps.one_argument"],
        ["task.step=my_project.steps.one_argument", "(model, batch)"],
    ),
    "no_gradient": (
        ["task.step=my_project.steps.detached"],
        ["task.step=my_project.steps.detached", "without a gradient"],
    ),
    "model_returns_no_loss": (
        ["task=model_loss", "model._target_=my_project.nets.NoLoss"],
        ["task=model_loss", "holds no loss", "model._target_=my_project.nets.NoLoss"],
    ),
    "regression_shape": (
        ["task=regression", "model._target_=my_project.nets.Flat"],
        ["task=regression", "target's shape (2, 1)", "model._target_=my_project.nets.Flat"],
    ),
}


@pytest.mark.parametrize("case", sorted(CONTRACTS))
def test_contract_errors_name_the_key(case, project, run_cli_in, tmp_path):
    extra, expected = CONTRACTS[case]
    args = [a for a in CUSTOM if not a.startswith(("task.step", "+task.metrics"))]
    if case in ("model_returns_no_loss", "regression_shape"):
        args = [a for a in args if a != "task=custom"]
    proc = run_cli_in([*args, *extra, f"hydra.run.dir={tmp_path / 'run'}"], project)
    assert proc.returncode == 2, proc.stderr[-2000:]
    text = " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    for part in expected:
        assert part in text, (part, text[-1500:])


REFUSALS = {
    "selective_backprop": (
        ["task=model_loss", "selective_backprop.keep=0.5"],
        ["selective_backprop.keep=0.5 with task=model_loss", "per-sample loss"],
    ),
    "distill": (
        ["task=regression", "distill.teacher=some/teacher.pt"],
        ["distill.teacher with task=regression", "class logits"],
    ),
    "pipeline": (
        ["task=regression", "strategy=pipeline"],
        ["strategy=pipeline with task=regression"],
    ),
    "loss_group": (
        ["task=regression", "loss.label_smoothing=0.1"],
        ["loss=cross_entropy with task=regression", "task.loss"],
    ),
    "objective": (
        ["task=regression", "objective=best_val_acc"],
        ["objective=best_val_acc with task=regression", "objective=final_val_loss"],
    ),
    "early_stopping": (
        ["task=regression", "early_stopping.monitor=val/acc"],
        ["early_stopping.monitor='val/acc'", "val/mse"],
    ),
    "checkpoint_monitor": (
        ["task=custom", "task.step=x.y", "+task.metrics={mae: min}", "trainer.stop_at='val/r2>=1'"],
        ["trainer.stop_at", "val/r2", "val/mae"],
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_features_a_task_cannot_serve_are_refused_at_compose(case, compose_cfg, tmp_path):
    extra, expected = REFUSALS[case]
    cfg = compose_cfg([*extra, f"paths.output_dir={tmp_path}"])
    with pytest.raises(UserError) as err:
        validate(cfg)
    text = str(err.value)
    assert "\n" not in text.strip()
    for part in expected:
        assert part in text, (part, text)


def test_accel_export_refuses_a_task_without_class_predictions(custom_run, project, run_cli_in):
    best = custom_run / "checkpoints" / "best.pt"
    proc = run_cli_in([f"ckpt_path={best}"], project, prog="accel-export")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "task=custom" in proc.stderr and "argmax agreement" in proc.stderr


def test_the_reports_quality_guard_uses_the_tasks_monitor(tmp_path):
    """A task without accuracy: the guard compares the monitored best (val/loss, lower is
    better), so a faster switch that raises the loss is not combined."""
    from accel_train.commands.report import Run, combination

    def run(variant: str, speed: float, loss: float) -> Run:
        values = {"samples_per_s": speed, "best_val_acc": -1.0, "test_acc": None}
        values |= {"best_score": loss, "monitor_mode": "min"}
        return Run(variant, 0, 1, tmp_path, 0.0, "done", values)

    runs = [run("baseline", 10, 0.30), run("channels_last", 12, 0.301), run("ema", 13, 0.9)]
    kept = ["baseline", "channels_last", "ema"]
    assert combination(runs, kept, 1.02, 0.005) == ["channels_last"]


def test_classification_top_k_is_logged_and_monitorable(run_cli, tmp_path):
    run_dir = tmp_path / "topk"
    proc = run_cli(
        [
            "model=mlp",
            "dataset.num_train=256",
            "dataset.num_test=64",
            "trainer.max_epochs=1",
            "task.top_k=[1,3]",
            "checkpoint.monitor=val/acc_top3",
            "trainer.progress=none",
            "logger=none",
            f"hydra.run.dir={run_dir}",
        ]
    )
    check_ok(proc)
    rows = _metrics(run_dir)
    val = next(m for m in rows if "val/acc_top3" in m)
    assert val["val/acc_top3"] >= val["val/acc"]
    assert any("test/acc_top3" in m for m in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["monitor"] == "val/acc_top3" and summary["best_val_acc"] >= 0

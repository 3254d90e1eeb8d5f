"""Bring your own model, dataset and loss by `_target_`, through the real console scripts.

The user's code is a package `my_project` written into a temp dir that is NOT under src/ and
NOT installed: the CLI runs with that dir as its working directory (which is importable, like
torchtune's), or with the package's parent dir on PYTHONPATH. Every user callable appends one
JSON line to `user_code_calls.jsonl` in the working directory (what it was called with, by which
program, in which process), so the tests can see what accel-train passed to it.

All CLI runs but the DDP one start together (`launched`), 3 at a time. Module layout:
- e2e: user model + user dataset factory (train, val, test) + user focal loss, trained 2
  epochs, resumed to epoch 3, evaluated with accel-eval (one chain of runs);
- pythonpath: the package on PYTHONPATH, a factory that returns one Dataset (accel-train holds
  out dataset.val_fraction), a **kwargs model, uint8 inputs and 0-d tensor targets, and the
  built-in loss with label smoothing, next to an identical run without smoothing;
- contract errors: each bad piece of user code exits 2 with one paragraph naming the key;
- build_splits in-process: every return form of a factory;
- ddp: the same user code in 2 torchrun workers (on its own: three processes).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import check_ok, read_jsonl
from omegaconf import OmegaConf

from accel_train.targets import build

RECORD = "user_code_calls.jsonl"

# ---- the user's package ------------------------------------------------------------------------

PACKAGE = {
    "__init__.py": '"""A user project outside accel-train."""\n',
    "_record.py": '''
        import json
        import os
        import sys
        from pathlib import Path


        def record(name, **info):
            """One JSON line per call: what accel-train passed, from which program and process."""
            entry = {"name": name, "prog": Path(sys.argv[0]).name, "pid": os.getpid(), **info}
            with open(os.environ.get("USER_CODE_RECORD", "user_code_calls.jsonl"), "a") as f:
                f.write(json.dumps(entry, default=str) + "\\n")
        ''',
    "nets.py": """
        from torch import nn

        from ._record import record


        class WideCNN(nn.Module):
            # No image_size and no **kwargs: accel-train must pass only what this accepts.
            def __init__(self, width, in_channels, num_classes):
                super().__init__()
                record("WideCNN", width=width, in_channels=in_channels, num_classes=num_classes)
                self.features = nn.Sequential(
                    nn.Conv2d(in_channels, width, 3, padding=1),
                    nn.ReLU(),
                    nn.AdaptiveAvgPool2d(4),
                    nn.Flatten(),
                )
                self.head = nn.Linear(width * 16, num_classes)

            def forward(self, x):
                return self.head(self.features(x))


        class KwargsMLP(nn.Module):
            # **kwargs: gets in_channels, image_size and num_classes.
            def __init__(self, hidden=16, **kwargs):
                super().__init__()
                record("KwargsMLP", hidden=hidden, **kwargs)
                c, s, k = kwargs["in_channels"], kwargs["image_size"], kwargs["num_classes"]
                self.net = nn.Sequential(
                    nn.Flatten(), nn.Linear(c * s * s, hidden), nn.ReLU(), nn.Linear(hidden, k)
                )

            def forward(self, x):
                return self.net(x)


        class ThreeLogits(nn.Module):
            # (batch, 3) whatever the number of classes.
            def __init__(self, in_channels):
                super().__init__()
                self.fc = nn.Linear(in_channels, 3)

            def forward(self, x):
                return self.fc(x.mean(dim=(2, 3)))


        class FeatureMaps(nn.Module):
            # (batch, num_classes, H, W): 4-d, not logits.
            def __init__(self, in_channels, num_classes):
                super().__init__()
                self.conv = nn.Conv2d(in_channels, num_classes, 1)

            def forward(self, x):
                return self.conv(x)
        """,
    "data.py": """
        import torch
        from torch.utils.data import Dataset

        from ._record import record


        def draw(n, k, size, channels, seed, dtype=torch.float32):
            # Learnable: class c is a bright block at grid cell c of a noisy image.
            gen = torch.Generator().manual_seed(seed)
            labels = (torch.arange(n) % k)[torch.randperm(n, generator=gen)]
            images = torch.rand(n, channels, size, size, generator=gen) * 0.3
            b = size // 4
            for i, c in enumerate(labels.tolist()):
                r, col = (c // 4) * b, (c % 4) * b
                images[i, :, r : r + b, col : col + b] += 0.7
            if dtype == torch.uint8:
                images = (images * 255).round().to(torch.uint8)
            return images, labels


        class Blocks(Dataset):
            def __init__(self, images, labels, classes=None, tensor_targets=False):
                self.images, self.labels, self.tensor_targets = images, labels, tensor_targets
                if classes is not None:
                    self.classes = classes

            def __len__(self):
                return len(self.labels)

            def __getitem__(self, i):
                y = self.labels[i]
                return self.images[i], (y.clone() if self.tensor_targets else int(y))


        QUADRANTS = ["top-left", "top-mid", "top-right", "top-far"]


        def build_sets(n_train=256, n_val=48, n_test=40, data_dir=None, seed=0):
            # float [3, 16, 16] inputs, int targets, .classes: (train, val, test).
            record("build_sets", n_train=n_train, data_dir=data_dir, seed=seed)
            return tuple(
                Blocks(*draw(n, 4, 16, 3, seed + offset), classes=QUADRANTS)
                for n, offset in ((n_train, 0), (n_val, 1000), (n_test, 2000))
            )


        def build_pool(n=200, seed=0):
            # uint8 [1, 12, 12] inputs, 0-d int64 tensor targets, 5 classes, no .classes: ONE set.
            record("build_pool", n=n, seed=seed)
            return Blocks(*draw(n, 5, 12, 1, seed, torch.uint8), tensor_targets=True)


        def build_forms(form, data_dir, seed, val_fraction):
            # Every return form; float [1, 8, 8], 4 classes with .classes.
            kw = dict(form=form, data_dir=data_dir, seed=seed, val_fraction=val_fraction)
            record("build_forms", **kw)

            def make(n, offset):
                return Blocks(*draw(n, 4, 8, 1, 100 + offset), classes=QUADRANTS)

            train, val, test = make(120, 0), make(30, 1), make(20, 2)
            return {
                "single": make(200, 3),
                "pair": (train, val),
                "triple": (train, val, test),
                "dict2": {"train": train, "val": val},
                "dict3": {"train": train, "val": val, "test": test},
            }[form]


        class ImagesOnly(Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                return torch.rand(1, 12, 12)


        def images_only():
            return ImagesOnly()


        class Triples(Blocks):
            def __getitem__(self, i):
                return self.images[i], int(self.labels[i]), i


        def triples():
            return Triples(*draw(64, 5, 12, 1, 0))


        def bad_labels():
            images, labels = draw(64, 10, 12, 1, 0)
            labels[5] = 12  # outside [0, 10)
            return Blocks(images, labels)


        def not_a_dataset():
            return 42
        """,
    "losses.py": """
        import torch
        import torch.nn.functional as F
        from torch import nn

        from ._record import record


        class FocalLoss(nn.Module):
            def __init__(self, gamma=2.0, num_classes=None):
                super().__init__()
                record("FocalLoss", gamma=gamma, num_classes=num_classes)
                self.gamma, self.num_classes, self.called = gamma, num_classes, False

            def forward(self, logits, targets):
                if not self.called:
                    self.called = True
                    record(
                        "FocalLoss.forward",
                        logits=list(logits.shape),
                        targets=list(targets.shape),
                        targets_dtype=str(targets.dtype),
                    )
                ce = F.cross_entropy(logits.float(), targets, reduction="none")
                return ((1 - torch.exp(-ce)) ** self.gamma * ce).mean()
        """,
}


def write_package(root: Path, name: str = "my_project") -> Path:
    """root/<name>/{__init__,_record,nets,data,losses}.py; returns root."""
    pkg = root / name
    pkg.mkdir(parents=True, exist_ok=True)
    for filename, source in PACKAGE.items():
        (pkg / filename).write_text(textwrap.dedent(source).lstrip())
    return root


def records(cwd: Path, name: str, prog: str | None = None) -> list[dict]:
    path = cwd / RECORD
    found = read_jsonl(path) if path.exists() else []
    return [r for r in found if r["name"] == name and (prog is None or r["prog"] == prog)]


def override(base: list[str], *changes: str) -> list[str]:
    """base with the keys of `changes` replaced (Hydra refuses a key given twice); a change
    `!key` only drops the key."""

    def key(arg: str) -> str:
        return arg.split("=", 1)[0].lstrip("+!")

    dropped = {key(c) for c in changes}
    return [a for a in base if key(a) not in dropped] + [c for c in changes if c[0] != "!"]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # runs that share the two cores
PYTHONPATH_RUNS = ("smooth", "plain")


@pytest.fixture(scope="module")
def launched(tmp_path_factory, run_cli_in):
    """Every CLI run of this module (but the DDP one), started together when the first test
    needs one, 3 at a time: most of a run is starting Python and importing torch, and the 2
    cores stay busy. name -> Future of its result; "cwd:<name>" -> a working directory."""
    pool = ThreadPoolExecutor(max_workers=3)
    launched = {}
    e2e_cwd = write_package(tmp_path_factory.mktemp("e2e"))
    launched["e2e"] = pool.submit(_e2e_chain, run_cli_in, e2e_cwd)  # the longest chain first
    for name, (args, cwd, kw) in {
        **_pythonpath_jobs(tmp_path_factory),
        **_error_jobs(tmp_path_factory),
    }.items():
        launched[name] = pool.submit(run_cli_in, args, cwd, **kw)
        launched.setdefault("cwd:" + (name if name in PYTHONPATH_RUNS else "errors"), cwd)
    try:
        yield launched
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ---- end to end: train, resume, evaluate ------------------------------------------------------

USER_MODEL = ["model=custom", "model._target_=my_project.nets.WideCNN", "+model.width=8"]
USER_DATA = [
    "dataset=custom",
    "dataset._target_=my_project.data.build_sets",
    "+dataset.n_train=256",
]
USER_LOSS = ["loss=custom", "loss._target_=my_project.losses.FocalLoss", "+loss.gamma=2"]
E2E = [
    *USER_MODEL,
    *USER_DATA,
    *USER_LOSS,
    "optimizer.lr=0.01",
    "loader.batch_size=32",  # 256 / 32 = 8 steps per epoch
    "trainer.log_every_n_steps=4",
    "trainer.progress=none",
]
E2E_STEPS_PER_EPOCH, E2E_TEST = 8, 40


def _e2e_chain(run_cli_in, cwd: Path) -> dict:
    """Train 2 epochs, resume to 3, evaluate best.pt: one after the other, in one thread. What
    the tests need from the first run is read before the resume changes it."""
    run_dir, data_dir = cwd / "run", cwd / "userdata"
    args = [*E2E, f"paths.data_dir={data_dir}", f"hydra.run.dir={run_dir}"]
    out = {"cwd": cwd, "run_dir": run_dir, "data_dir": data_dir}
    out["proc"] = run_cli_in([*args, "trainer.max_epochs=2"], cwd, env=ONE_THREAD)
    if out["proc"].returncode != 0:
        return out
    out["summary"] = summary(run_dir)
    out["metrics"] = read_jsonl(run_dir / "metrics.jsonl")
    out["config"] = OmegaConf.load(run_dir / "config.yaml")
    out["records"] = read_jsonl(cwd / RECORD)
    resume = [*args, "trainer.max_epochs=3", "resume=auto"]
    out["resume_proc"] = run_cli_in(resume, cwd, env=ONE_THREAD)
    if out["resume_proc"].returncode == 0:
        best = run_dir / "checkpoints" / "best.pt"
        evaluate = [f"ckpt_path={best}"]
        out["eval_proc"] = run_cli_in(evaluate, cwd, prog="accel-eval", env=ONE_THREAD)
    return out


@pytest.fixture(scope="module")
def trained(launched):
    chain = launched["e2e"].result()
    check_ok(chain["proc"])
    return chain


@pytest.fixture(scope="module")
def resumed(trained):
    check_ok(trained["resume_proc"])
    return trained["resume_proc"]


@pytest.fixture(scope="module")
def evaluated(trained, resumed):
    check_ok(trained["eval_proc"])
    return trained["eval_proc"]


def test_user_model_gets_its_keys_and_only_the_shape_args_it_accepts(trained):
    """Spec 1: WideCNN(width, in_channels, num_classes) gets width=8 from `+model.width=8`,
    in_channels=3 from the first training item [3, 16, 16], num_classes=4 from train.classes,
    and no image_size (its signature does not name it)."""
    built = [r for r in trained["records"] if r["name"] == "WideCNN"]
    assert built, trained["records"]
    for r in built:
        assert {k: r[k] for k in ("width", "in_channels", "num_classes")} == {
            "width": 8,
            "in_channels": 3,
            "num_classes": 4,
        }


def test_user_factory_gets_its_keys_data_dir_and_seed(trained):
    """Spec 2: build_sets(n_train, n_val, n_test, data_dir, seed) is called with the key given
    by `+dataset.n_train=256` plus data_dir and seed (named in its signature), not val_fraction
    (not named: passing it would raise a TypeError)."""
    calls = [r for r in trained["records"] if r["name"] == "build_sets"]
    assert calls, trained["records"]
    for r in calls:
        assert r["n_train"] == 256 and r["seed"] == 0
        assert Path(r["data_dir"]).resolve() == trained["data_dir"].resolve()


def test_user_loss_is_built_with_num_classes_and_used(trained):
    """Spec 3: FocalLoss(gamma, num_classes) gets gamma=2 and num_classes=4, and it is the loss
    the training calls, as loss(logits (batch, 4), int64 targets (batch,))."""
    built = [r for r in trained["records"] if r["name"] == "FocalLoss"]
    assert built and all(r["gamma"] == 2 and r["num_classes"] == 4 for r in built), built
    calls = [r for r in trained["records"] if r["name"] == "FocalLoss.forward"]
    assert calls, "the user loss was built but never called"
    first = calls[0]
    assert first["logits"][1:] == [4] and first["targets"] == first["logits"][:1]
    assert first["targets_dtype"] == "torch.int64"


def test_user_code_trains(trained):
    """Spec 6: the user model on the user data learns (4 classes: chance is 0.25), on the user's
    own splits: 256 training items at 32 per batch are 8 steps per epoch (nothing held out of a
    factory that returns its own val split)."""
    s, metrics = trained["summary"], trained["metrics"]
    assert s["epochs"] == 2
    assert s["steps"] == 2 * E2E_STEPS_PER_EPOCH
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert losses and all(math.isfinite(x) for x in losses)
    val = [m["val/acc"] for m in metrics if "val/acc" in m]
    assert len(val) == 2
    assert s["best_val_acc"] == max(val) and s["best_val_acc"] > 0.6
    # The factory returned a test split: it is scored after training.
    assert s.get("test_acc") is not None and 0 <= s["test_acc"] <= 1


def test_config_records_the_targets(trained):
    """Spec 4: config.yaml holds the dotted paths and the user's keys, so that workers, resume
    and accel-eval rebuild the same objects."""
    cfg = trained["config"]
    assert cfg.model._target_ == "my_project.nets.WideCNN" and cfg.model.width == 8
    assert cfg.dataset._target_ == "my_project.data.build_sets" and cfg.dataset.n_train == 256
    assert cfg.loss._target_ == "my_project.losses.FocalLoss" and cfg.loss.gamma == 2
    text = (trained["run_dir"] / "config.yaml").read_text()
    assert "_target_: my_project.nets.WideCNN" in text


def test_resume_continues_the_user_run(trained, resumed):
    """Spec 6: `resume=auto` in the same run dir with trainer.max_epochs=3 continues at step 16
    and trains epoch 3 only, rebuilding the user model from the config."""
    run_dir = trained["run_dir"]
    assert "resumed from" in resumed.stdout + resumed.stderr
    s = summary(run_dir)
    assert s["epochs"] == 3 and s["steps"] == 3 * E2E_STEPS_PER_EPOCH
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = [m for m in metrics if m.get("event") == "resume"]
    assert [m["step"] for m in events] == [2 * E2E_STEPS_PER_EPOCH]
    after = metrics[metrics.index(events[0]) + 1 :]
    assert [m["step"] for m in after if "train/loss" in m] == [20, 24]
    assert len([m for m in metrics if "val/acc" in m]) == 3
    resumer = [r for r in read_jsonl(trained["cwd"] / RECORD) if r["name"] == "WideCNN"]
    assert len(resumer) > len([r for r in trained["records"] if r["name"] == "WideCNN"])


def test_eval_rebuilds_user_model_and_scores_the_user_test_split(trained, resumed, evaluated):
    """Spec 6: accel-eval on best.pt rebuilds WideCNN and build_sets from the checkpoint's config
    and scores the factory's 40-item test split; it equals the run's own test_acc (same
    checkpoint, same split)."""
    run_dir = trained["run_dir"]
    result = json.loads((run_dir / "eval_best.json").read_text())
    assert result["num_samples"] == E2E_TEST
    assert 0 <= result["test/acc"] <= 1 and math.isfinite(result["test/loss"])
    assert result["test/acc"] == summary(run_dir)["test_acc"]
    by_eval = records(trained["cwd"], "WideCNN", prog="accel-eval")
    assert by_eval and by_eval[-1]["width"] == 8 and by_eval[-1]["num_classes"] == 4
    assert records(trained["cwd"], "build_sets", prog="accel-eval")


# ---- PYTHONPATH, a single Dataset, **kwargs, uint8, the built-in loss --------------------------

POOL = [
    "model=custom",
    "model._target_=my_project.nets.KwargsMLP",
    "+model.hidden=12",
    "dataset=custom",
    "dataset._target_=my_project.data.build_pool",
    "+dataset.n=200",
    "dataset.num_classes=5",  # build_pool's set has no .classes
    "dataset.seed=3",
    "loader.batch_size=20",
    "trainer.log_every_n_steps=1",
    "trainer.deterministic=true",
    "trainer.progress=none",
]


def _pythonpath_jobs(tmp_path_factory) -> dict[str, tuple[list[str], Path, dict]]:
    """The package only on PYTHONPATH (not in the working directory). `smooth`: one epoch with
    `loss=cross_entropy loss.label_smoothing=0.1`; `plain`: the same run for one step with the
    default loss, to compare the first step's loss."""
    lib = write_package(tmp_path_factory.mktemp("lib"))
    jobs = {}
    for name, extra in (
        ("smooth", ["loss=cross_entropy", "loss.label_smoothing=0.1", "trainer.max_epochs=1"]),
        ("plain", ["trainer.max_steps=1"]),
    ):
        cwd = tmp_path_factory.mktemp(name)
        env = {"PYTHONPATH": str(lib), **ONE_THREAD}
        jobs[name] = ([*POOL, *extra, f"hydra.run.dir={cwd / 'run'}"], cwd, {"env": env})
    return jobs


@pytest.fixture(scope="module")
def pythonpath_runs(launched):
    """name -> (cwd, result); each test checks the runs it reads."""
    return {name: (launched["cwd:" + name], launched[name].result()) for name in PYTHONPATH_RUNS}


def test_package_on_pythonpath_with_kwargs_model(pythonpath_runs):
    """Spec 1 + PYTHONPATH: a **kwargs model gets its key (hidden=12) and all of in_channels,
    image_size, num_classes, from the first uint8 item [1, 12, 12] and dataset.num_classes=5."""
    cwd, proc = pythonpath_runs["smooth"]
    check_ok(proc)
    assert not (cwd / "my_project").exists()
    built = records(cwd, "KwargsMLP", prog="accel-train")
    assert built
    for r in built:
        assert (r["hidden"], r["in_channels"], r["image_size"], r["num_classes"]) == (12, 1, 12, 5)
        assert "_target_" not in r
    calls = records(cwd, "build_pool")
    assert calls and all((r["n"], r["seed"]) == (200, 3) for r in calls)


def test_single_dataset_is_split_by_val_fraction(pythonpath_runs):
    """Spec 2: a factory that returns one Dataset of 200 items: 10% (dataset.val_fraction) is
    held out, 180 train at 20 per batch = 9 steps (200 would be 10); no test split, so no
    test_acc; the 0-d tensor targets and uint8 inputs train."""
    cwd, proc = pythonpath_runs["smooth"]
    check_ok(proc)
    s = summary(cwd / "run")
    assert s["epochs"] == 1 and s["steps"] == 9
    assert s.get("test_acc") is None
    val = [m for m in read_jsonl(cwd / "run" / "metrics.jsonl") if "val/acc" in m]
    assert len(val) == 1 and 0 <= val[0]["val/acc"] <= 1
    n_val = 20  # validation over the 20 held-out items: accuracy is a multiple of 1/20
    assert abs(val[0]["val/acc"] * n_val - round(val[0]["val/acc"] * n_val)) < 1e-4


def test_builtin_loss_label_smoothing_is_applied(pythonpath_runs):
    """Spec 3: `loss=cross_entropy loss.label_smoothing=0.1` changes the loss: two deterministic
    runs identical up to the first step's forward pass log different step-1 losses; the default
    is cross_entropy without smoothing."""
    first = {}
    for name, (cwd, proc) in pythonpath_runs.items():
        check_ok(proc)
        cfg = OmegaConf.load(cwd / "run" / "config.yaml")
        first[name] = (
            cfg.loss.label_smoothing,
            next(
                m["train/loss"]
                for m in read_jsonl(cwd / "run" / "metrics.jsonl")
                if m.get("step") == 1 and "train/loss" in m
            ),
        )
    assert first["smooth"][0] == 0.1 and first["plain"][0] == 0.0
    cfg = OmegaConf.load(pythonpath_runs["plain"][0] / "run" / "config.yaml")
    assert cfg.loss.name == "cross_entropy"
    assert math.isfinite(first["smooth"][1]) and math.isfinite(first["plain"][1])
    assert abs(first["smooth"][1] - first["plain"][1]) > 1e-6, first


# ---- contract errors --------------------------------------------------------------------------

ERR_BASE = [
    "model=custom",
    "model._target_=my_project.nets.WideCNN",
    "+model.width=4",
    "dataset=custom",
    "dataset._target_=my_project.data.build_pool",
    "dataset.num_classes=10",
    "trainer.max_steps=2",
    "trainer.limit_val_batches=1",
    "trainer.progress=none",
]
# name: (changes to ERR_BASE, strings stderr must contain)
ERRORS = {
    "model-module-missing": (["model._target_=my_project.nope.Net"], ["model._target_"]),
    "model-unknown-key": (["+model.bogus=1"], ["model", "bogus"]),
    "model-3-logits": (
        ["model._target_=my_project.nets.ThreeLogits", "!model.width"],
        ["model._target_"],
    ),
    "model-4d-output": (
        ["model._target_=my_project.nets.FeatureMaps", "!model.width"],
        ["model._target_"],
    ),
    "items-image-only": (["dataset._target_=my_project.data.images_only"], ["dataset._target_"]),
    "items-triples": (["dataset._target_=my_project.data.triples"], ["dataset._target_"]),
    "label-out-of-range": (
        ["dataset._target_=my_project.data.bad_labels"],
        ["dataset.num_classes", "12"],
    ),
    "loss-module-missing": (
        ["loss=custom", "loss._target_=my_project.nope.Loss"],
        ["loss._target_"],
    ),
    "factory-returns-int": (
        ["dataset._target_=my_project.data.not_a_dataset"],
        ["dataset._target_"],
    ),
}
SHAPE_ERRORS = {"model-3-logits", "model-4d-output"}
SENTINELS = {"last.pt": b"a previous run's last.pt", "best.pt": b"a previous run's best.pt"}


def _error_jobs(tmp_path_factory) -> dict[str, tuple[list[str], Path, dict]]:
    """One run per error, each into a run dir that already holds checkpoints."""
    cwd = write_package(tmp_path_factory.mktemp("errors"))
    jobs = {}
    for name, (changes, _) in ERRORS.items():
        run_dir = cwd / name
        (run_dir / "checkpoints").mkdir(parents=True)
        for filename, content in SENTINELS.items():
            (run_dir / "checkpoints" / filename).write_bytes(content)
        args = override(ERR_BASE, *changes, f"hydra.run.dir={run_dir}")
        jobs[name] = (args, cwd, {"env": ONE_THREAD})
    return jobs


@pytest.fixture(scope="module")
def error_runs(launched):
    return launched["cwd:errors"], {name: launched[name].result() for name in ERRORS}


# (batch, num_classes) spelled in any usual way, with the number of classes or its name.
EXPECTED_SHAPE = re.compile(
    r"[(\[]\s*(batch(_size)?|n|b|bs|B|N)\s*,\s*(num_classes|10)\s*[)\]]", re.IGNORECASE
)


@pytest.mark.parametrize("name", list(ERRORS))
def test_contract_error(name, error_runs):
    """Spec 5: exit 2, one paragraph on stderr naming the key, no traceback, and the checkpoints
    already in the run dir are neither replaced nor joined by new ones."""
    cwd, results = error_runs
    proc = results[name]
    args = " ".join(proc.args[1:])
    output = proc.stdout + proc.stderr
    where = f"accel-train {args}\nexit {proc.returncode}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2, where
    assert "Traceback" not in output, where
    for text in ERRORS[name][1]:
        assert text in proc.stderr, f"{text!r} not in stderr\n{where}"
    # One paragraph: accel-train's `error:` line and what follows it, no blank line inside.
    assert "error:" in proc.stderr, where
    message = proc.stderr[proc.stderr.index("error:") :].strip()
    assert "\n\n" not in message, where
    ckpts = cwd / name / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(SENTINELS), where
    for filename, content in SENTINELS.items():
        assert (ckpts / filename).read_bytes() == content, f"{filename} overwritten\n{where}"

    if name == "model-module-missing":
        # The module that is not found, named as such (not only inside the echoed value).
        assert "my_project.nope" in proc.stderr.replace("my_project.nope.Net", ""), where
        search_path = (str(cwd), "sys.path", "working directory")
        assert any(s in proc.stderr for s in search_path), where
    if name in SHAPE_ERRORS:
        # The shape is checked before training: the expected shape is named, nothing trained.
        assert EXPECTED_SHAPE.search(proc.stderr), f"no expected (batch, 10) shape\n{where}"
        metrics = cwd / name / "metrics.jsonl"
        assert not metrics.exists() or not [m for m in read_jsonl(metrics) if "train/loss" in m], (
            where
        )


# ---- build_splits in-process: every return form ----------------------------------------------


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """my_project importable in this process (and its records written under tmp_path)."""
    write_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for module in [m for m in sys.modules if m == "my_project" or m.startswith("my_project.")]:
        del sys.modules[module]


@pytest.mark.parametrize(
    ("form", "sizes"),
    [
        ("single", (180, 20, None)),  # 200 items, 10% held out
        ("pair", (120, 30, None)),
        ("triple", (120, 30, 20)),
        ("dict2", (120, 30, None)),
        ("dict3", (120, 30, 20)),
    ],
)
def test_every_factory_return_form(form, sizes, user_package, compose_cfg):
    """Spec 2, in-process: one Dataset (10% held out, disjoint), (train, val),
    (train, val, test) and dicts all become train/val[/test] splits with the shape taken from
    the first training item and num_classes from train.classes; the factory gets data_dir, seed
    and val_fraction because its signature names them."""
    from accel_train.data.build import build_splits

    data_dir = user_package / "data"
    cfg = compose_cfg(
        [
            "dataset=custom",
            "dataset._target_=my_project.data.build_forms",
            f"+dataset.form={form}",
            "dataset.seed=5",
            f"paths.data_dir={data_dir}",
            f"paths.output_dir={user_package / 'out'}",
        ]
    )
    OmegaConf.resolve(cfg)
    splits = build_splits(cfg.dataset, cfg.paths.data_dir)
    got = (len(splits.train), len(splits.val), None if splits.test is None else len(splits.test))
    assert got == sizes
    assert (splits.in_channels, splits.image_size, splits.num_classes) == (1, 8, 4)
    [call] = records(user_package, "build_forms")
    assert (call["form"], call["seed"], call["val_fraction"]) == (form, 5, 0.1)
    assert Path(call["data_dir"]).resolve() == data_dir.resolve()
    if form == "single":
        train_images = {splits.train[i][0].numpy().tobytes() for i in range(len(splits.train))}
        val_images = {splits.val[i][0].numpy().tobytes() for i in range(len(splits.val))}
        assert len(train_images) == 180 and len(val_images) == 20
        assert not train_images & val_images


# ---- DDP ----------------------------------------------------------------------------------------


def test_ddp_two_processes_with_user_code(tmp_path, run_cli):
    """Spec 6: the same user model, factory and loss in 2 torchrun workers (gloo on the CPU):
    each worker imports my_project from the working directory and rebuilds it from config.yaml;
    exit 0, one summary.json. 256 items / (2 x 16) = 8 steps."""
    cwd = write_package(tmp_path)
    run_dir = cwd / "run"
    args = override(
        E2E,
        "loader.batch_size=16",
        "trainer.max_epochs=1",
        "strategy=ddp",
        "launcher.nproc_per_node=2",
        f"paths.data_dir={cwd / 'userdata'}",
        f"hydra.run.dir={run_dir}",
    )
    proc = run_cli(args, timeout=480, env=ONE_THREAD)
    check_ok(proc)
    assert "Traceback" not in proc.stdout + proc.stderr
    s = summary(run_dir)
    assert s["epochs"] == 1 and s["steps"] == 8
    assert 0 <= s["best_val_acc"] <= 1
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.model._target_ == "my_project.nets.WideCNN"
    assert cfg.dataset._target_ == "my_project.data.build_sets"
    assert cfg.loss._target_ == "my_project.losses.FocalLoss"
    # Both workers built the user's model and loss (the launcher may build them too).
    assert len({r["pid"] for r in records(cwd, "WideCNN")}) >= 2
    assert len({r["pid"] for r in records(cwd, "FocalLoss.forward")}) >= 2
    assert os.path.isfile(run_dir / "checkpoints" / "last.pt")


class LossWithoutInit(torch.nn.Module):
    """A user loss that only defines forward: torch's Module.__init__ takes *args, **kwargs."""

    def forward(self, logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels)


def test_a_module_without_init_gets_no_runtime_arguments():
    node = OmegaConf.create({"_target_": "test_user_code.LossWithoutInit"})
    loss = build(node, "loss", runtime={"num_classes": 10})
    assert isinstance(loss, LossWithoutInit)

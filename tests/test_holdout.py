"""Validation held out of the training data; the test split scored once, after training.

- `held_out_indices` in-process: sizes, disjointness, stratification, seeding;
- `build_splits` in-process on the tiny IDX MNIST (256 train, 64 test);
- the real CLI: `+experiment=mnist_amp` validates on the held-out part, writes test_acc from
  best.pt, and `accel-eval` on best.pt agrees; `dataset.val_fraction` and
  `trainer.test_after_fit`; the synthetic default's `num_train` / `num_test`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import MNIST_TEST, MNIST_TRAIN, check_ok, make_digits, read_jsonl
from omegaconf import OmegaConf

# ---- held_out_indices --------------------------------------------------------------------------


def _as_list(indices) -> list[int]:
    return torch.as_tensor(indices).flatten().tolist()


@pytest.mark.parametrize(("n", "fraction"), [(100, 0.1), (257, 0.2), (1000, 0.37), (50, 0.0)])
def test_held_out_indices_sizes_and_disjointness(n, fraction):
    from accel_train.data.splits import held_out_indices

    train, val = map(_as_list, held_out_indices(n, fraction, seed=0))
    assert len(val) == round(n * fraction)
    assert len(set(val)) == len(val) and len(set(train)) == len(train)
    assert not set(train) & set(val)
    assert sorted(train + val) == list(range(n))


def test_held_out_indices_are_seeded():
    from accel_train.data.splits import held_out_indices

    labels = torch.arange(300) % 3
    for kw in ({}, {"labels": labels}):
        a = [_as_list(x) for x in held_out_indices(300, 0.1, seed=7, **kw)]
        b = [_as_list(x) for x in held_out_indices(300, 0.1, seed=7, **kw)]
        c = [_as_list(x) for x in held_out_indices(300, 0.1, seed=8, **kw)]
        assert a == b, "the same seed must give the same split"
        assert set(a[1]) != set(c[1]), "another seed must give another split"


def test_held_out_indices_stratified_by_label():
    """Each class contributes round(class_count * fraction) (no .5 ties here)."""
    from accel_train.data.splits import held_out_indices

    gen = torch.Generator().manual_seed(0)
    counts = {0: 50, 1: 33, 2: 17, 3: 104}  # 5, 3.3 -> 3, 1.7 -> 2, 10.4 -> 10
    labels = torch.cat([torch.full((k,), c) for c, k in counts.items()])
    labels = labels[torch.randperm(len(labels), generator=gen)]
    n = len(labels)
    train, val = map(_as_list, held_out_indices(n, 0.1, seed=1, labels=labels))
    assert not set(train) & set(val) and sorted(train + val) == list(range(n))
    per_class = Counter(labels[val].tolist())
    assert per_class == {c: round(k * 0.1) for c, k in counts.items()}
    assert len(val) == 5 + 3 + 2 + 10


def test_held_out_indices_of_class_ordered_data_come_mixed():
    """Data stored by class (an ImageFolder tree): validation's first batch, all that
    `trainer.limit_val_batches=1` reads, must not be one class."""
    from accel_train.data.splits import held_out_indices

    labels = torch.arange(10).repeat_interleave(100)  # 0 x100, 1 x100, ...: sorted by class
    _, val = held_out_indices(1000, 0.1, seed=0, labels=labels)
    assert len(set(labels[val[:16]].tolist())) >= 5


# ---- build_splits on the tiny IDX MNIST --------------------------------------------------------


def _mnist_splits(compose_cfg, mnist_dir, tmp_path, *overrides):
    from accel_train.data.build import build_splits

    cfg = compose_cfg(
        [
            "dataset=mnist",
            f"paths.data_dir={mnist_dir}",
            f"paths.output_dir={tmp_path / 'out'}",
            *overrides,
        ]
    )
    OmegaConf.resolve(cfg)
    return build_splits(cfg.dataset, cfg.paths.data_dir)


def _rows(images: torch.Tensor) -> list[bytes]:
    return [row.numpy().tobytes() for row in images.reshape(len(images), -1)]


def _expected_val(fraction: float) -> int:
    _, labels = make_digits(MNIST_TRAIN, 1)
    return sum(round(k * fraction) for k in Counter(labels.tolist()).values())


def test_build_splits_holds_out_a_stratified_val_split(compose_cfg, mnist_dir, tmp_path):
    """256 training images -> 230 train + 26 val (classes of 26/25 images give 3/2 each); the
    val images are not training images, together they are the training file; the test split is
    the t10k file."""
    splits = _mnist_splits(compose_cfg, mnist_dir, tmp_path)
    assert len(splits.train) + len(splits.val) == MNIST_TRAIN
    assert len(splits.val) == _expected_val(0.1) == 26
    train_rows, val_rows = _rows(splits.train.images), _rows(splits.val.images)
    assert not set(train_rows) & set(val_rows)
    file_images, file_labels = make_digits(MNIST_TRAIN, 1)
    assert sorted(train_rows + val_rows) == sorted(_rows(file_images))
    # Labels follow their images, and each class gives round(count * 0.1) to val.
    by_row = dict(zip(_rows(file_images), file_labels.tolist(), strict=True))
    assert [by_row[r] for r in val_rows] == splits.val.labels.tolist()
    counts = Counter(file_labels.tolist())
    assert Counter(splits.val.labels.tolist()) == {c: round(k * 0.1) for c, k in counts.items()}

    test_images, test_labels = make_digits(MNIST_TEST, 2)
    assert len(splits.test) == MNIST_TEST
    assert torch.equal(splits.test.images[:, 0], test_images)
    assert torch.equal(splits.test.labels, test_labels.long())
    assert (splits.in_channels, splits.image_size, splits.num_classes) == (1, 28, 10)


def test_build_splits_val_fraction_and_seed(compose_cfg, mnist_dir, tmp_path):
    """dataset.val_fraction sets the share; dataset.seed (not trainer.seed) picks the images."""
    default = _mnist_splits(compose_cfg, mnist_dir, tmp_path)
    again = _mnist_splits(compose_cfg, mnist_dir, tmp_path, "trainer.seed=1")
    assert torch.equal(default.val.images, again.val.images)
    other = _mnist_splits(compose_cfg, mnist_dir, tmp_path, "dataset.seed=1")
    assert len(other.val) == len(default.val)
    assert set(_rows(other.val.images)) != set(_rows(default.val.images))
    fifth = _mnist_splits(compose_cfg, mnist_dir, tmp_path, "dataset.val_fraction=0.2")
    assert len(fifth.val) == _expected_val(0.2) == 50
    assert len(fifth.train) == MNIST_TRAIN - 50


# ---- through the CLI ----------------------------------------------------------------------------

ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # runs that share the two cores
BATCH = 16  # 230 train images -> 15 steps per epoch; 206 -> 13; all 256 would be 16
# fp32: the held-out split does not depend on the precision, and bf16 autocast is ~8x slower
# than fp32 on a CPU without bf16 instructions (the 2-core test machine).
MNIST = [
    "+experiment=mnist_amp",
    "precision=fp32",
    "trainer.progress=none",
    f"loader.batch_size={BATCH}",
]
SYNTHETIC = [
    "model=mlp",
    "dataset.num_train=300",  # ~30 held out -> ~270 train: 9 steps of 32 (300 would be 10)
    "dataset.num_test=50",
    "loader.batch_size=32",
    "trainer.max_epochs=1",
    "trainer.progress=none",
]


def _run_and_evaluate(run_cli_in, args, cwd, run_dir: Path | None) -> dict:
    """One run, then (with a run dir, if it succeeded) accel-eval on its best.pt."""
    out = {"run": run_cli_in(args, cwd, env=ONE_THREAD)}
    if run_dir is not None and out["run"].returncode == 0:
        best = f"ckpt_path={run_dir / 'checkpoints' / 'best.pt'}"
        out["eval"] = run_cli_in([best], cwd, prog="accel-eval", env=ONE_THREAD)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_cli_in, mnist_dir):
    """The independent runs started together (3 at a time), two of them followed by accel-eval;
    each test checks the results it reads."""
    cwd = tmp_path_factory.mktemp("holdout")
    data = f"paths.data_dir={mnist_dir}"
    jobs = {
        "main": ([*MNIST, data, "trainer.max_epochs=2"], True),
        "synthetic": (SYNTHETIC, True),
        "fifth": (
            [
                *MNIST,
                data,
                "dataset.val_fraction=0.2",
                "trainer.test_after_fit=false",
                "trainer.max_epochs=1",
            ],
            False,
        ),
        "num_val": (["dataset.num_val=64", *SYNTHETIC, "trainer.max_steps=1"], False),
    }
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            name: pool.submit(
                _run_and_evaluate,
                run_cli_in,
                [*args, f"hydra.run.dir={cwd / name}"],
                cwd,
                cwd / name if evaluate else None,
            )
            for name, (args, evaluate) in jobs.items()
        }
        results = {}
        for name, future in futures.items():
            out = future.result()
            results[name] = out["run"]
            if "eval" in out:
                results[f"eval_{name}"] = out["eval"]
    return cwd, results


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _is_multiple_of(acc: float, n: int) -> bool:
    return abs(acc * n - round(acc * n)) < 1e-4


def test_cli_validates_on_held_out_part_and_tests_best_checkpoint(runs):
    """summary.json: best/final val acc from the val lines, test_acc and test_loss reported
    separately; metrics.jsonl has the test line; 230 train images at 16 per batch are 15
    steps per epoch; val accuracies are counts over the 26 held-out images."""
    cwd, results = runs
    check_ok(results["main"])
    run_dir = cwd / "main"
    s = _summary(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    val = [m for m in metrics if "val/acc" in m]
    assert len(val) == 2 and s["epochs"] == 2
    assert s["steps"] == 2 * 15
    assert s["best_val_acc"] == max(m["val/acc"] for m in val)
    assert s["final_val_acc"] == val[-1]["val/acc"]
    assert all(_is_multiple_of(m["val/acc"], 26) for m in val), val
    for key in ("test_acc", "test_loss"):
        assert isinstance(s.get(key), float) and math.isfinite(s[key]), s
    assert 0 <= s["test_acc"] <= 1 and _is_multiple_of(s["test_acc"], MNIST_TEST)
    tests = [m for m in metrics if "test/acc" in m]
    assert len(tests) == 1 and "test/loss" in tests[0]
    assert tests[0]["test/acc"] == s["test_acc"]
    assert tests[0]["test/loss"] == pytest.approx(s["test_loss"])


def test_eval_of_best_matches_the_runs_test_acc(runs):
    """accel-eval on best.pt scores the 64 test images: the same number as summary test_acc."""
    cwd, results = runs
    check_ok(results["main"])
    check_ok(results["eval_main"])
    result = json.loads((cwd / "main" / "eval_best.json").read_text())
    assert result["num_samples"] == MNIST_TEST
    s = _summary(cwd / "main")
    assert result["test/acc"] == s["test_acc"]
    assert result["test/loss"] == pytest.approx(s["test_loss"], rel=1e-4)


def test_val_fraction_and_no_test_after_fit(runs):
    """dataset.val_fraction=0.2: 50 held out, 206 train -> 13 steps of 16 (0.1 gives 15);
    trainer.test_after_fit=false: no test_acc and no test line."""
    cwd, results = runs
    check_ok(results["fifth"])
    s = _summary(cwd / "fifth")
    assert s["epochs"] == 1 and s["steps"] == 13
    assert s.get("test_acc") is None and s.get("test_loss") is None
    metrics = read_jsonl(cwd / "fifth" / "metrics.jsonl")
    assert not [m for m in metrics if "test/acc" in m]
    val = [m for m in metrics if "val/acc" in m]
    assert len(val) == 1 and _is_multiple_of(val[0]["val/acc"], 50)


def test_synthetic_num_train_pool_and_num_test(runs):
    """The default data set: num_train is the pool that train and val come from (~10% held
    out: 9 steps of 32 instead of 10), num_test the separate test draw (50 images)."""
    cwd, results = runs
    check_ok(results["synthetic"])
    s = _summary(cwd / "synthetic")
    assert s["epochs"] == 1 and s["steps"] == 9
    assert isinstance(s.get("test_acc"), float) and _is_multiple_of(s["test_acc"], 50)
    check_ok(results["eval_synthetic"])
    result = json.loads((cwd / "synthetic" / "eval_best.json").read_text())
    assert result["num_samples"] == 50 and result["test/acc"] == s["test_acc"]


def test_synthetic_num_val_is_gone(runs):
    """num_test replaced num_val: the old key is refused, naming it, without a traceback."""
    _, results = runs
    proc = results["num_val"]
    assert proc.returncode != 0
    assert "dataset.num_val" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr

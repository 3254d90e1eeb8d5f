"""A language model end to end through the real console scripts (issue 18): `accel-data
tokenize` a tiny text -> `accel-train task=language_model model=gpt dataset=tokens` ->
`accel-sample`. The corpus is the test's own (a few KB); the shared one is for benchmarks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import check_ok, read_jsonl, run_cli

from accel_train.data.text.tokens import token_splits

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300))
# Characters Hydra's override grammar would parse (the prompts of test_the_prompt_is_verbatim).
TEXT += "x = f(a, [b]) $y print('hi', \"yo\")\n"
TINY_GPT = [
    "task=language_model",
    "model=gpt",
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "dataset=tokens",
    "dataset.path=tokens",
    "dataset.windows_per_epoch=64",
    "dataset.eval_windows=16",
    "loader.batch_size=8",
    "optimizer=adamw",
    "optimizer.lr=0.003",
    "trainer.progress=none",
    "logger=csv",
]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """One tokenized corpus and one short training run, shared by the tests below."""
    cwd = tmp_path_factory.mktemp("lm")
    (cwd / "input.txt").write_text(TEXT)
    check_ok(run_cli(["tokenize", "input=input.txt", "out=tokens"], cwd, prog="accel-data"))
    proc = run_cli([*TINY_GPT, "trainer.max_epochs=3", "hydra.run.dir=run"], cwd)
    check_ok(proc)
    return cwd, proc


def test_a_tiny_gpt_trains_on_a_token_folder(lm_run):
    cwd, proc = lm_run
    rows = read_jsonl(cwd / "run/metrics.jsonl")
    val = [r for r in rows if "val/loss" in r]
    assert len(val) == 3
    assert val[-1]["val/loss"] < val[0]["val/loss"] < np.log(len(set(TEXT))) + 0.5
    assert val[-1]["val/ppl"] == pytest.approx(np.exp(val[-1]["val/loss"]), rel=1e-6)
    summary = json.loads((cwd / "run/summary.json").read_text())
    assert (
        summary["monitor"] == "val/loss"
        and summary.get("best_val_acc") is None
        and summary["best_val_loss"] == summary["best_score"]
    )
    assert "vocab" not in proc.stderr.lower() or "Traceback" not in proc.stderr


def test_sampling_is_seeded(lm_run):
    cwd, _ = lm_run
    best = f"ckpt_path={cwd / 'run/checkpoints/best.pt'}"
    args = [best, "prompt=def", "max_new_tokens=40", "top_k=5"]
    first = run_cli([*args, "seed=3"], cwd, prog="accel-sample")
    check_ok(first)
    again = run_cli([*args, "seed=3"], cwd, prog="accel-sample")
    other = run_cli([*args, "seed=4"], cwd, prog="accel-sample")
    assert first.stdout == again.stdout and first.stdout != other.stdout
    assert first.stdout.startswith("def") and len(first.stdout.strip()) >= 30
    assert set(first.stdout) <= set(TEXT) | {"\n"}


# Prompts Hydra's grammar trims or cannot parse: a trailing space, `=`, commas, brackets,
# quotes, `$`, a newline.
PROMPTS = ["def ", "x = f(a, [b]) ", "print('hi', \"yo\")", "a=$y,\n  b"]


def test_the_prompt_is_verbatim(lm_run, tmp_path):
    """Whatever the shell passes after prompt= reaches the model unchanged (the text printed
    starts with it), and prompt_file=PATH and prompt=- (standard input) take long prompts."""
    cwd, _ = lm_run
    best = f"ckpt_path={cwd / 'run/checkpoints/best.pt'}"
    args = [best, "max_new_tokens=3", "temperature=0"]
    for prompt in PROMPTS[:3]:
        proc = run_cli([*args, f"prompt={prompt}"], cwd, prog="accel-sample")
        check_ok(proc)
        assert proc.stdout.startswith(prompt) and len(proc.stdout) == len(prompt) + 4, prompt
    (tmp_path / "prompt.txt").write_text(PROMPTS[3])
    from_file = run_cli([*args, f"prompt_file={tmp_path / 'prompt.txt'}"], cwd, prog="accel-sample")
    from_stdin = run_cli([*args, "prompt=-"], cwd, prog="accel-sample", input=PROMPTS[3])
    for proc in (from_file, from_stdin):
        check_ok(proc)
        assert proc.stdout.startswith(PROMPTS[3]), proc.stdout
    assert from_file.stdout == from_stdin.stdout
    twice = run_cli([*args, "prompt=a", "prompt_file=prompt.txt"], cwd, prog="accel-sample")
    missing = run_cli([*args, "prompt_file=nowhere.txt"], cwd, prog="accel-sample")
    for proc, message in ((twice, "prompt is given twice"), (missing, "no such file")):
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_checkpoint_samples_without_its_token_folder(lm_run, tmp_path):
    """The checkpoint keeps its tokenizer (plain JSON data): copied elsewhere, with no token
    folder at dataset.path or under paths.data_dir, it samples the same text."""
    cwd, _ = lm_run
    copy = tmp_path / "best.pt"
    copy.write_bytes((cwd / "run/checkpoints/best.pt").read_bytes())
    args = ["prompt=def", "max_new_tokens=40", "top_k=5", "seed=3"]
    here = run_cli(
        [f"ckpt_path={cwd / 'run/checkpoints/best.pt'}", *args], cwd, prog="accel-sample"
    )
    elsewhere = run_cli(
        [f"ckpt_path={copy}", *args, "data_dir=nowhere"], tmp_path, prog="accel-sample"
    )
    check_ok(here)
    check_ok(elsewhere)
    assert elsewhere.stdout == here.stdout and not (tmp_path / "tokens").exists()


def test_sampling_refusals_are_one_paragraph(lm_run, tmp_path):
    cwd, _ = lm_run
    best = f"ckpt_path={cwd / 'run/checkpoints/best.pt'}"
    cases = [
        ([best, "prompt=Q"], "not in this model's vocabulary"),  # no capital Q in TEXT
        ([best, "top_p=0"], "top_p=0.0 must be"),
        (["ckpt_path=missing.pt"], "no such file"),
    ]
    for args, message in cases:
        proc = run_cli(args, cwd, prog="accel-sample")
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # A long prompt is cropped to the context, with a warning.
    long = run_cli([best, f"prompt={'x' * 40}", "max_new_tokens=2"], cwd, prog="accel-sample")
    check_ok(long)
    assert "longer than the model's context" in long.stdout + long.stderr


def test_a_classifier_checkpoint_is_not_sampled(run_cli_in, tmp_path):
    proc = run_cli_in(
        [
            "model=mlp",
            "dataset.num_train=64",
            "dataset.num_test=16",
            "trainer.max_steps=1",
            "trainer.progress=none",
            "hydra.run.dir=cls",
        ],
        tmp_path,
    )
    check_ok(proc)
    proc = run_cli_in(
        [f"ckpt_path={tmp_path / 'cls/checkpoints/last.pt'}"], tmp_path, prog="accel-sample"
    )
    assert proc.returncode == 2 and "not a language model" in proc.stderr


def _write_tokens(folder: Path, n: int) -> None:
    folder.mkdir()
    np.arange(n, dtype=np.uint16).tofile(folder / "train.bin")
    np.arange(n // 4, dtype=np.uint16).tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 65535, "dtype": "uint16"}))


def test_windows_are_seeded_by_epoch_and_fixed_for_validation(tmp_path):
    """(In-process.) The training windows of an epoch depend only on (seed, epoch, index): a
    resumed run reads the same ones; validation windows never change."""
    _write_tokens(tmp_path / "t", 5000)
    a = token_splits(str(tmp_path / "t"), block_size=16, windows_per_epoch=50, seed=7)
    b = token_splits(str(tmp_path / "t"), block_size=16, windows_per_epoch=50, seed=7)
    x, y = a.train.getitem(3, 0)
    assert x.tolist() == list(range(int(x[0]), int(x[0]) + 16)) and (y == x + 1).all()
    assert all(
        a.train.getitem(i, e)[0].tolist() == b.train.getitem(i, e)[0].tolist()
        for e in (0, 1)
        for i in (0, 17, 49)
    )
    assert a.train.getitem(3, 0)[0].tolist() != a.train.getitem(3, 1)[0].tolist()
    assert [a.val[i][0][0].item() for i in range(3)] == [b.val[i][0][0].item() for i in range(3)]
    assert a.model_args == {"vocab_size": 65535} and a.test is None


@pytest.mark.parametrize("workers", [0, 2])
def test_token_ids_outside_the_vocabulary_are_one_paragraph(lm_run, tmp_path, workers):
    """A token folder whose meta.json undercounts its vocabulary (another tokenizer's ids, the
    wrong dtype, a damaged file) would index past the embedding: an IndexError inside the
    forward on the CPU, a device-side assert on CUDA. Refused as one paragraph naming the file,
    also when a loader worker reads it."""
    cwd, _ = lm_run
    bad = tmp_path / "tokens"
    bad.mkdir()
    for name in ("train.bin", "val.bin"):
        (bad / name).write_bytes((cwd / "tokens" / name).read_bytes())
    meta = json.loads((cwd / "tokens/meta.json").read_text())
    meta["vocab_size"] = 5  # the text's ids go well above 5
    (bad / "meta.json").write_text(json.dumps(meta))
    args = [
        *TINY_GPT,
        f"dataset.path={bad}",
        "trainer.max_steps=2",
        f"loader.num_workers={workers}",
    ]
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "train.bin" in proc.stderr and "vocab_size" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Original" not in proc.stderr, proc.stderr


def test_resume_on_data_tokenized_again_with_other_ids_is_refused(lm_run, tmp_path):
    """The token folder tokenized again with another mapping of the same size: the resume
    trained on silently remapped ids and replaced the checkpoint's tokenizer (issue 32). It is
    refused naming both, unless resume_new_tokenizer=true."""
    cwd, _ = lm_run
    shutil.copytree(cwd / "run", tmp_path / "run")
    (tmp_path / "other.txt").write_text(TEXT.translate(str.maketrans("def", "DEF")))
    check_ok(run_cli(["tokenize", "input=other.txt", "out=tokens"], tmp_path, prog="accel-data"))
    old = json.loads((cwd / "tokens/meta.json").read_text())
    new = json.loads((tmp_path / "tokens/meta.json").read_text())
    assert new["vocab_size"] == old["vocab_size"] and new["itos"] != old["itos"]
    last = tmp_path / "run/checkpoints/last.pt"
    before = last.read_bytes()
    args = [*TINY_GPT, "trainer.max_epochs=4", "hydra.run.dir=run", "resume=auto"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    size = old["vocab_size"]
    assert f"char tokenizer of {size} ids, the same size but other ids" in proc.stderr
    assert "dataset.path=tokens" in proc.stderr and "resume_new_tokenizer=true" in proc.stderr
    assert last.read_bytes() == before
    check_ok(run_cli([*args, "resume_new_tokenizer=true"], tmp_path))
    kept = torch.load(last, map_location="cpu", weights_only=True)["task"]["tokenizer"]
    assert kept["meta"]["itos"] == new["itos"]

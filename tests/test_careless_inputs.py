"""Careless inputs to the newer tools (accel-data, a language model's training, accel-sample,
accel-eval) found by issue 32's trials: each is one paragraph naming the key or file and a fix
that works, exit 2, no traceback. Tiny token folders and one 2-step GPT of the test's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import check_ok, run_cli

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(100))
GPT = [
    "task=language_model",
    "model=gpt",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    "model.block_size=16",
    "dataset=tokens",
    "dataset.windows_per_epoch=16",
    "dataset.eval_windows=4",
    "loader.batch_size=8",
    "trainer.max_steps=2",
    "trainer.progress=none",
    "logger=none",
]


@pytest.fixture(scope="module")
def cwd(tmp_path_factory) -> Path:
    """tok/ (a token folder), odd/ (its train.bin one byte short), neg/ (meta.json's
    vocab_size negative) and run/ (a 2-step GPT trained on tok/, its blocks checkpointed; its
    output in run.out)."""
    root = tmp_path_factory.mktemp("careless")
    (root / "input.txt").write_text(TEXT)
    check_ok(run_cli(["tokenize", "input=input.txt", "out=tok"], root, prog="accel-data"))
    for name in ("odd", "neg"):
        (root / name).mkdir()
        for file in ("train.bin", "val.bin", "meta.json"):
            (root / name / file).write_bytes((root / "tok" / file).read_bytes())
    train = (root / "tok" / "train.bin").read_bytes()
    (root / "odd" / "train.bin").write_bytes(train[:-1])
    meta = json.loads((root / "tok" / "meta.json").read_text())
    (root / "neg" / "meta.json").write_text(json.dumps({**meta, "vocab_size": -5}))
    # Every block checkpointed: a one-block GPT's Block is found by name (issue 47 B.10).
    ac = "activation_checkpointing.mode=full"
    proc = run_cli([*GPT, "dataset.path=tok", ac, "hydra.run.dir=run"], root)
    check_ok(proc)
    (root / "run.out").write_text(proc.stdout + proc.stderr)
    return root


def test_a_one_block_gpt_checkpoints_its_block(cwd):
    """Was: "no class repeats as a block ... name the class" (issue 47 B.10)."""
    assert "activation checkpointing (full): 1 of 1 blocks (Block)" in (cwd / "run.out").read_text()


CKPT = "ckpt_path=run/checkpoints/last.pt"
FAKE_S3 = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}
SHARD = ["shard", "dataset=tokens", "dataset.path=tok"]

CASES = {
    # A LitData traceback from its writer process.
    "shard-odd-bytes": (
        "accel-data",
        ["shard", "dataset=tokens", "dataset.path=odd", "out=shards"],
        ["odd/train.bin holds", "uint16", "overwrite=true"],
    ),
    # "Fix the arguments (`dataset.*`) or the code", naming no file.
    "train-odd-bytes": ("accel-train", [*GPT, "dataset.path=odd"], ["odd/train.bin holds"]),
    # Blamed the model ("negative dimension").
    "negative-vocab": ("accel-train", [*GPT, "dataset.path=neg"], ["neg/meta.json: vocab_size=-5"]),
    # A traceback inside the CNN's forward.
    "lm-on-images": (
        "accel-train",
        ["task=language_model", "trainer.max_steps=1"],
        ["task=language_model trains on token ids", "dataset=tokens dataset.path="],
    ),
    # Suggested `+model.vocab_size=...`, which then failed in the forward.
    "gpt-without-tokens": (
        "accel-train",
        ["model=gpt", "trainer.max_steps=1"],
        ["needs vocab_size, which a token data set gives", "dataset=tokens"],
    ),
    # Wrote a local folder named `s3:` and exited 0.
    "s3-no-bucket": ("accel-data", [*SHARD, "out=s3://"], ["out=s3://: it names no bucket"]),
    # botocore's ParamValidationError with its regexes.
    "s3-bad-bucket": ("accel-data", [*SHARD, "out='s3://a b/x'"], ["'a b' is not a bucket name"]),
    # Suggested `trainer.device=cpu`, a key accel-sample refuses.
    "sample-cuda": ("accel-sample", [CKPT, "device=cuda"], ["`device=cpu`"]),
    # Suggested a fix for dataset=custom only (without split=, accel-eval now scores val there).
    "eval-no-test-split": (
        "accel-eval",
        [CKPT, "split=test"],
        ["dataset=tokens has train and val splits only"],
    ),
    # Said "Train it on tokens" to a run trained on tokens (issue 39).
    "hf-export-of-a-gpt": (
        "accel-export",
        [CKPT, "format=hf", "out_path=gpt-hf"],
        ["needs a model=hf checkpoint", "this one's model is gpt", "`format=torch_export`"],
    ),
    "peft-export-of-a-gpt": (
        "accel-export",
        [CKPT, "format=peft"],
        ["LoRA adapters, which needs a model=hf checkpoint", "this one's model is gpt"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_careless_input_is_one_paragraph(cwd, case):
    prog, args, needles = CASES[case]
    proc = run_cli([*args, f"hydra.run.dir=runs/{case}"] if prog == "accel-train" else args, cwd,
                   prog=prog, env=FAKE_S3)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "trainer.device" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr
    assert not (cwd / "s3:").exists()

"""Issue 39's careless model and fine-tuning inputs, through the real CLI: LoRA/QLoRA options,
folders that are not causal LMs, GPT-2's Conv1D layers, the GPT's and Muon's options, a
recipe's warm-up on a shortened run, resnet18's stem under ImageNet weights, a dataset option
of the user's own, and what the end of a run prints. Each refusal is one paragraph naming the
key or file, exit 2, no traceback; most stop at the config check, before any data is read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import check_ok, read_jsonl
from hf_fixtures import write_records, write_tiny_llama, write_tokenizer

from accel_train.checkpoint import load_checkpoint

SFT = [
    "+experiment=sft_lora",
    "dataset.max_length=64",
    "lora.rank=4",
    "loader.batch_size=4",
    "trainer.max_steps=1",
    "trainer.progress=none",
    "logger=none",
]
TINY_GPT = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16"]


def _write_folder(folder: Path, config: str, model: str, **dims) -> Path:
    """A tiny transformers model (`config`, `model`: class names) and the chat tokenizer."""
    import transformers

    tok = write_tokenizer(folder)
    ids = {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    cfg = getattr(transformers, config)(vocab_size=len(tok), **ids, **dims)
    getattr(transformers, model)(cfg).save_pretrained(folder)
    return folder


# A Llama whose weight matrices hold no multiple of 64 values (hidden 36): NF4 quantizes none.
ODD_LLAMA = {
    "hidden_size": 36, "intermediate_size": 72, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128,
}  # fmt: skip
# A masked LM: bidirectional.
BERT = {
    "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "intermediate_size": 64, "max_position_embeddings": 128,
}  # fmt: skip
# A Llama body saved from AutoModel: no lm_head, the embeddings not tied.
HEADLESS = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip
# GPT-2: its attention and MLP layers are transformers' Conv1D, not nn.Linear.
GPT2 = {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 128}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("careless_models")
    return {
        "root": root,
        "llama": write_tiny_llama(root / "llama"),
        "odd": _write_folder(root / "odd", "LlamaConfig", "LlamaForCausalLM", **ODD_LLAMA),
        "bert": _write_folder(root / "bert", "BertConfig", "BertForMaskedLM", **BERT),
        "headless": _write_folder(root / "headless", "LlamaConfig", "LlamaModel", **HEADLESS),
        "gpt2": _write_folder(root / "gpt2", "GPT2Config", "GPT2LMHeadModel", **GPT2),
        "train": write_records(root / "train.jsonl", 16),
    }


def _sft(folders, model: str = "llama") -> list[str]:
    return [*SFT, f"model.path={folders[model]}", f"dataset.path={folders['train']}"]


# case: (arguments, what the paragraph must say). `{sft}` cases fine-tune a tiny folder.
CASES = {
    # Ran full fine-tuning, silently.
    "lora-rank-negative": (["lora.rank=-4"], ["lora.rank=-4 must be >= 0"]),
    # Ran fp32 full fine-tuning and never mentioned nf4.
    "nf4-without-rank": (["lora.base_dtype=nf4"], ["lora.rank=0 turns LoRA off"]),
    # A traceback from PEFT.
    "lora-dropout": (["lora.rank=4", "lora.dropout=1.5"], ["lora.dropout=1.5 must be in [0, 1)"]),
    # 518 M trainable parameters, 4.5 minutes a step.
    "lora-rank-huge": ("llama:lora.rank=100000", ["lora.rank=100000 is larger than layer"]),
    # Quantized nothing and said nothing.
    "nf4-nothing-quantized": (
        "odd:lora.base_dtype=nf4",
        ["quantizes none of the", "not a multiple of 64"],
    ),
    # Trained bidirectionally, no warning.
    "masked-lm-folder": ("bert:", ["BertForMaskedLM", "not a causal language model"]),
    # Loaded with a random head, no warning.
    "folder-without-head": ("headless:", ["lack lm_head.weight", "AutoModelForCausalLM"]),
    # A traceback from torch.optim.Muon.
    "muon-adjust-lr": (
        ["optimizer=muon", "optimizer.adjust_lr_fn=match_rms"],
        ["optimizer.adjust_lr_fn='match_rms'", "match_rms_adamw"],
    ),
    # A KeyError in optim.py (issue 62's key).
    "muon-ns-dtype": (
        ["optimizer=muon", "optimizer.ns_dtype=fp16"],
        ["optimizer.ns_dtype='fp16'", "auto", "fp32"],
    ),
    # NaN at step 1, with advice to lower the learning rate.
    "rope-base-zero": (
        ["model=gpt", "model.pos_embedding=rope", "model.rope_base=0"],
        ["model.rope_base=0.0 must be > 0"],
    ),
    # An IndexError inside the GPT's position table.
    "sft-rows-longer-than-gpt": (
        ["model=gpt", "dataset=sft", "dataset.path=chat.jsonl", "dataset.max_length=512"],
        ["dataset.max_length=512 is longer than model.block_size=256"],
    ),
    # Said "Remove `+drop_pathrate`", a key that does not exist (issue 47 B.12).
    "timm-unknown-kwarg": (
        [
            "model=timm",
            "model.name=resnet10t",
            "+model.drop_pathrate=0.1",
            "dataset=synthetic",
            "dataset.num_train=32",
            "dataset.num_test=8",
            "trainer.max_steps=1",
        ],
        ["model.drop_pathrate: timm's resnet10t does not take it", "Remove `+model.drop_pathrate`"],
    ),  # fmt: skip
    # Both numbers given by the user contradict each other: the one refusal left.
    "warmup-over-max-steps": (
        ["trainer.max_steps=5", "scheduler=cosine", "scheduler.warmup_steps=10"],
        ["scheduler.warmup_steps=10 is not below trainer.max_steps=5"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_careless_model_option_is_one_paragraph(case, folders, run_cli, tmp_path):
    args, needles = CASES[case]
    if isinstance(args, str):  # "<folder>:<extra>": a fine-tuning run of that folder
        model, _, extra = args.partition(":")
        args = [*_sft(folders, model), *([extra] if extra else [])]
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_lora_adapts_gpt2_conv1d_layers(folders, run_cli, tmp_path):
    """PEFT adapts transformers' Conv1D with fan_in_fan_out: GPT-2 fine-tunes like Llama."""
    run_dir = tmp_path / "run"
    proc = run_cli([*_sft(folders, "gpt2"), "trainer.max_steps=2", f"hydra.run.dir={run_dir}"])
    check_ok(proc)
    assert "c_attn" in proc.stderr + proc.stdout  # the log names the adapted layers
    model = load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"]
    adapters = [k for k in model if "lora_" in k]
    assert adapters and all(torch.isfinite(model[k]).all() for k in adapters)


def test_resnet18_imagenet_weights_on_small_images_name_the_stem(run_cli, tmp_path):
    """The small-image stem is chosen at 64 pixels or less; ImageNet weights need the other."""
    import torchvision

    file = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), file)
    proc = run_cli(
        ["model=resnet18", f"model.weights={file}", "dataset.in_channels=3",
         "trainer.max_steps=1", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "small-image stem" in proc.stderr and "`model.stem=imagenet`" in proc.stderr


def test_a_dataset_option_of_the_users_own_gets_its_own_defaults(run_cli, tmp_path):
    """A config-group file naming torchvision's FakeData: accel-train's unset num_classes
    (null) is not passed over FakeData's own default."""
    group = tmp_path / "conf" / "dataset"
    group.mkdir(parents=True)
    (group / "fake.yaml").write_text(
        "_target_: torchvision.datasets.FakeData\nsize: 48\nimage_size: [1, 12, 12]\n"
        "transform:\n  _target_: torchvision.transforms.ToTensor\n"
    )
    proc = run_cli(
        [f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "dataset=fake", "model=mlp",
         "trainer.max_steps=1", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]
    )  # fmt: skip
    check_ok(proc)


def test_a_shortened_recipe_runs_and_says_tokens_per_s(run_cli, tmp_path):
    """`+experiment=gpt_char trainer.max_steps=4`: the recipe's 100-step warm-up is cut to a
    tenth of the run with one warning (not refused); the end of the run reads in tokens/s, the
    checkpoint path is printed whole, and curves.png has no empty accuracy panel."""
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(100))
    (tmp_path / "input.txt").write_text(text)
    check_ok(run_cli(["tokenize", "input=input.txt", "out=tok"], prog="accel-data"))
    run_dir = tmp_path / "a-run-dir-with-a-name-long-enough-to-be-cut-by-an-eighty-column-table"
    proc = run_cli(
        ["+experiment=gpt_char", "dataset.path=tok", *TINY_GPT, "dataset.windows_per_epoch=32",
         "dataset.eval_windows=4", "loader.batch_size=8", "trainer.max_steps=4",
         "trainer.log_every_n_steps=1", "trainer.progress=plain", "logger=none",
         f"hydra.run.dir={run_dir}"]
    )  # fmt: skip
    check_ok(proc)
    out = proc.stdout + proc.stderr
    assert "scheduler.warmup_steps=100 shortened to 0" in out
    done = next(line for line in out.splitlines() if "done:" in line)
    assert "tokens/s" in done and "samples/s" not in done, done
    assert "train tokens/s" in proc.stdout
    assert f"checkpoints: {run_dir}/checkpoints/" in proc.stdout.splitlines()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    logged = [r for r in rows if "train/tokens_per_s" in r]
    # 8 windows of 16 tokens a step: tokens/s is 128 x steps/s, never a rounded 0 or 1.
    assert logged and all(r["train/tokens_per_s"] > 0 for r in logged)
    summary = json.loads((run_dir / "summary.json").read_text())
    ratio = summary["train_tokens_per_s"] / summary["train_samples_per_s"]
    assert ratio == pytest.approx(16.0)
    png = run_dir / "curves.png"
    if png.exists():  # loss and perplexity, two panels of 500 px
        assert png.read_bytes()[16:24] == (1000).to_bytes(4, "big") + (400).to_bytes(4, "big")


def test_best_checkpoint_score_is_the_same_everywhere(run_cli, tmp_path):
    """checkpoint.every_n_epochs ranks only some epochs: the `done:` line and the table both
    give best.pt's score, and a higher validation in between is named as such."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["model=mlp", "dataset.num_train=256", "dataset.num_test=32", "trainer.max_epochs=3",
         "checkpoint.every_n_epochs=2", "trainer.progress=plain", "logger=none",
         f"hydra.run.dir={run_dir}"]
    )  # fmt: skip
    check_ok(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    done = re.search(r"done: .* best\.pt val/acc ([0-9.]+)", proc.stdout + proc.stderr)
    table = re.search(r"best\.pt val/acc\s*│?\s*([0-9.]+)", proc.stdout)
    assert done and table, proc.stdout[-3000:]
    assert float(done.group(1)) == float(table.group(1)) == round(summary["best_score"], 4)
    if summary["best_val_acc"] != summary["best_score"]:
        assert "highest val/acc (any validation)" in proc.stdout

"""What a new user of the language-model and task features hits first (issue 27), through the
real console scripts: every experiment's smoke run, a GPT on tokens without naming the task,
user data sets without `.classes`, sweep tables in the task's metric, lightning-hydra-template's
callback groups. Each data set is the test's own and tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grpo_fixtures import docs_reward_module, user_code, write_question_prompts
from helpers import FAST, check_ok, write_mnist
from hf_fixtures import write_preferences, write_records, write_tiny_llama
from omegaconf import OmegaConf

from accel_train.config import CONFIG_DIR

TEXT = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(100))


def _tokens(cwd: Path, run_cli) -> list[str]:
    (cwd / "input.txt").write_text(TEXT)
    check_ok(run_cli(["tokenize", "input=input.txt", "out=tokens"], cwd=cwd, prog="accel-data"))
    return ["dataset.path=tokens"]


def _mnist(cwd: Path, run_cli) -> list[str]:
    return [f"paths.data_dir={write_mnist(cwd / 'data')}"]


def _grpo(cwd: Path, run_cli) -> list[str]:
    # docs/fine-tuning.md's prompts and its my/rewards.py (imported from the run's directory).
    user_code(cwd, {"my/rewards.py": docs_reward_module()})
    prompts = write_question_prompts(cwd / "prompts.jsonl", 8)
    return [
        f"model.path={write_tiny_llama(cwd / 'llama')}",
        f"dataset.path={prompts}",
        "task.rewards=[{_target_: my.rewards.correct}]",
        "task.num_generations=2",
        "task.max_completion_length=8",
        "lora.rank=4",
    ]


def _cifar_shaped(cwd: Path, run_cli) -> list[str]:
    # torchvision's CIFAR10 checks each file's MD5, so no tiny CIFAR-10 of a test's own loads:
    # the recipe runs on synthetic 3 x 32 x 32 images (its model, precision, loader, optimizer
    # and schedule are what the smoke run checks). Batches of 16, not the recipe's 256: bf16 is
    # emulated on CPUs without AVX512-BF16 or AMX, ~40x slower than fp32 in convolutions, and
    # one batch of 256 took ~110 CPU s there.
    cifar = ["dataset=synthetic", "dataset.in_channels=3", "dataset.image_size=32"]
    return [*cifar, "loader.batch_size=16"]


def _tiny_llama(cwd: Path, train: Path, val: Path) -> list[str]:
    # A 2-layer Llama and its chat tokenizer, written with save_pretrained (never downloaded).
    return [
        f"model.path={write_tiny_llama(cwd / 'llama')}",
        f"dataset.path={train}",
        f"dataset.val_path={val}",
        "dataset.max_length=96",
        "lora.rank=4",
    ]


def _sft(cwd: Path, run_cli) -> list[str]:
    train, val = write_records(cwd / "train.jsonl", 16), write_records(cwd / "val.jsonl", 4)
    return _tiny_llama(cwd, train, val)


def _prefs(cwd: Path, run_cli) -> list[str]:
    # Preference pairs: plain text to train on, chat to validate.
    train = write_preferences(cwd / "train.jsonl", 8)
    val = write_preferences(cwd / "val.jsonl", 4, form="chat", start=8)
    return _tiny_llama(cwd, train, val)


def _gpt2_shrunk(cwd: Path, run_cli) -> list[str]:
    # The GPU recipe shrunk for 2 CPU cores: its schedule, optimizer and data path as they are;
    # no compile (minutes here), fp32, a tiny model.
    shrunk = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32"]
    return [*_tokens(cwd, run_cli), *shrunk, "trainer.compile=false", "precision=fp32"]


def _gpt2_long_shrunk(cwd: Path, run_cli) -> list[str]:
    # The long-context recipe at 64 tokens, 2 blocks: its chunked loss (chunks of 16), checkpointed
    # blocks and document separator (the char tokenizer's newline, id 0) as they are.
    shrunk = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=64"]
    shrunk += ["task.loss_chunk_tokens=16", "dataset.document_separator=0", "precision=fp32"]
    return [*_tokens(cwd, run_cli), *shrunk]


def _photos(cwd: Path, run_cli) -> list[str]:
    # FFCV's ResNet-50 recipe shrunk: a tiny JPEG folder, 32-pixel sizes, a ResNet-18 (the same
    # builder), a batch the folder fills.
    from test_image_folder import write_image_folder

    root = write_image_folder(cwd / "photos", 4, 1)
    where = [f"dataset.root={root}", "dataset.val_fraction=0.25"]  # (the recipe's 1 %: none here)
    sizes = ["dataset.image_size=32", "dataset.eval_image_size=32"]
    sizes += [f"trainer.progressive_resize.{k}=32" for k in ("start_size", "end_size")]
    return [
        *where,
        *sizes,
        "model.name=resnet18",
        "loader.batch_size=4",
        "loader.num_workers=0",
    ]


def _vit(cwd: Path, run_cli) -> list[str]:
    # MAE's fine-tuning recipe on timm's tiny test ViT, saved as timm saves it for the hub.
    import timm
    from timm.models import save_for_hf

    folder = cwd / "vit"
    save_for_hf(timm.create_model("test_vit", num_classes=3), folder, safe_serialization=True)
    photos = _photos(cwd, run_cli)[:3]  # the folder, val_fraction, image_size
    return [*photos, f"model.weights={folder}", "loader.batch_size=4", "loader.num_workers=0"]


def _videos(cwd: Path, run_cli) -> list[str]:
    # torchvision's R(2+1)D reference shrunk: tests/test_video.py's moving squares (32 px, 16
    # frames at 15 fps: the recipe's fps=15 takes every frame), 8-frame clips, 2 views.
    from test_video import write_tree

    root = write_tree(cwd / "videos", {"train": 4, "val": 1})
    return [
        f"dataset.root={root}",
        "dataset.val_fraction=0.25",  # (the recipe's 1 %: none here)
        "dataset.frames=8",
        "dataset.image_size=32",
        "dataset.resize_size=32",
        "dataset.eval_clips=2",
        "loader.batch_size=4",
        "loader.num_workers=0",
    ]


def _sounds(cwd: Path, run_cli) -> list[str]:
    # tests/test_signals_data.py's rising and falling chirps, 0.5-s windows, small features.
    import numpy as np
    import soundfile as sf
    from test_signals_data import RATE, chirp

    rng = np.random.default_rng(0)
    for name, rising in (("rising", True), ("falling", False)):
        (cwd / "sounds" / name).mkdir(parents=True)
        for i in range(4):
            sf.write(cwd / "sounds" / name / f"{i}.wav", chirp(rising, 1.0, rng), RATE)
    return [
        f"dataset.root={cwd / 'sounds'}",
        f"dataset.sample_rate={RATE}",
        "dataset.clip_seconds=0.5",
        "dataset.val_fraction=0.25",
        "dataset.features.n_fft=256",
        "dataset.features.hop_length=64",
        "dataset.features.n_mels=32",
        "loader.batch_size=4",
        "loader.num_workers=0",
    ]


def _radio(cwd: Path, run_cli) -> list[str]:
    # tests/test_signals_data.py's generated modulations in RadioML 2018's HDF5 layout.
    from test_signals_data import write_radio

    path = write_radio(cwd / "radio.hdf5", per_cell=4, length=128)
    return [f"dataset.path={path}", "dataset.val_fraction=0.25", "loader.batch_size=8"]


# Each experiment's data, made by the test: a new experiment must say what it needs here.
def _volumes(cwd: Path, run_cli) -> list[str]:
    # MONAI's fast spleen program shrunk: tests/test_medical.py's generated CT-like organ cases
    # (32^3), 16^3 patches (the UNet's 4 strides still fit) and 32^3 windows.
    from test_medical import write_decathlon

    root = write_decathlon(cwd / "Task01_Organ")
    return [
        f"dataset.root={root}",
        f"dataset.cache_dir={cwd / 'volume-cache'}",
        "dataset.patch_size=[16,16,16]",
        "task.roi_size=[32,32,32]",
        "loader.num_workers=0",
    ]


def _shapes(cwd: Path, run_cli) -> list[str]:
    # tests/test_medical_2d.py's generated shapes and masks (48 px: 32 px crops, not the 64).
    from test_medical_2d import write_masks

    root = write_masks(cwd / "shapes", "train", 8, seed=0)
    return [f"dataset.root={root}", "dataset.crop_size=32", "loader.num_workers=0"]


EXPERIMENT_DATA = {
    "cifar10_resnet18_bf16": _cifar_shaped,
    "dpo_lora": _prefs,
    "simpo_lora": _prefs,
    "gpt_char": _tokens,
    "gpt_char_fast": _tokens,
    "gpt2_small": _gpt2_shrunk,
    "gpt2_long": _gpt2_long_shrunk,
    "grpo_lora": _grpo,
    "imagenet_resnet50": _photos,
    "mnist_amp": _mnist,
    "sft_lora": _sft,
    "vit_finetune": _vit,
    "video_r2plus1d": _videos,
    "spleen_unet": _volumes,
    "seg2d_unet": _shapes,
    "audio_spec_cnn": _sounds,
    "radio_resnet1d": _radio,
}
# The experiments whose warm-up is longer than the smoke run's one step.
WARMUP = {"gpt_char": 100, "gpt_char_fast": 20, "gpt2_small": 200, "sft_lora": 10}
WARMUP["dpo_lora"] = WARMUP["simpo_lora"] = 10
WARMUP["gpt2_long"] = 200
WARMUP["radio_resnet1d"] = 500
WARMUP["audio_spec_cnn"] = 200
WARMUP["vit_finetune"] = 6250
WARMUP["video_r2plus1d"] = 10  # warmup_epochs=10 of its 1-step epochs


def test_every_experiment_names_its_test_data():
    assert {p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml")} == set(EXPERIMENT_DATA)


@pytest.mark.parametrize("experiment", sorted(EXPERIMENT_DATA))
def test_fast_dev_run_works_with_every_experiment(experiment, run_cli, tmp_path):
    """A smoke run is never refused for a schedule sized for the full run (gpt_char's 100
    warm-up steps against fast_dev_run's one step): the warm-up is shortened, said in the log."""
    data = EXPERIMENT_DATA[experiment](tmp_path, run_cli)
    # +debug first: it applies after the experiment whatever the order (one step, not 2,000).
    args = ["+debug=fast_dev_run", f"+experiment={experiment}", *data, "trainer.progress=none"]
    proc = run_cli([*args, "hydra.run.dir=run"])
    check_ok(proc)
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["steps"] == 1
    if experiment in WARMUP:
        shortened = f"scheduler.warmup_steps={WARMUP[experiment]} shortened to 0"
        assert shortened in proc.stdout + proc.stderr
    # A warm-up the user gave that their own max_steps cannot finish is still refused (a
    # recipe's on a shortened run is cut: test_careless_models).
    if experiment == "gpt_char":
        both = ["trainer.max_steps=50", "scheduler.warmup_steps=100"]
        long = run_cli([args[1], *data, *both, "hydra.run.dir=long"])
        assert long.returncode == 2 and "warmup_steps=100 is not below" in long.stderr
        assert "Traceback" not in long.stderr


TINY_GPT = [
    "model=gpt",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=16",
    "model.block_size=16",
    "dataset.windows_per_epoch=32",
    "dataset.eval_windows=8",
    "loader.batch_size=8",
    "trainer.max_epochs=1",
    "trainer.progress=none",
]


def test_the_gpt_on_a_token_folder_is_a_language_model(run_cli, tmp_path):
    """dataset=tokens picks task=language_model; a task that cannot read token windows, asked
    for by name, is one paragraph naming the fix."""
    data = _tokens(tmp_path, run_cli)
    proc = run_cli([*TINY_GPT, "dataset=tokens", *data, "hydra.run.dir=run"])
    check_ok(proc)
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["monitor"] == "val/loss" and summary["best_val_loss"] > 0
    for task in ("classification", "regression"):
        args = [*TINY_GPT, "dataset=tokens", *data, f"task={task}", f"hydra.run.dir={task}"]
        refused = run_cli(args)
        assert refused.returncode == 2, refused.stderr
        assert "`task=language_model`" in refused.stderr and "Traceback" not in refused.stderr
        assert not (tmp_path / task).exists()  # a refused run leaves no run dir behind


USER_SETS = '''
import torch
from torch.utils.data import Dataset


class Plain(Dataset):
    """(image, int) items: no .classes, no .targets."""

    def __init__(self, n=200, k=3):
        self.n, self.k = n, k

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((1, 8, 8), float(i % self.k)), i % self.k


class WithTargets(Plain):
    """The labels kept apart (torchvision's `targets`), still no .classes."""

    def __init__(self, n=600, k=4):
        super().__init__(n, k)
        self.targets = [i % k for i in range(n)]
'''


def test_user_datasets_without_classes_count_them(run_cli, tmp_path):
    """A user Dataset without `.classes` trains: its classes are counted from the labels where
    that is cheap (a `targets` list; a small set's items), said in one log line; a large set
    with neither is one paragraph asking for dataset.num_classes."""
    (tmp_path / "my_sets.py").write_text(USER_SETS)
    base = ["dataset=custom", "model=mlp", "trainer.max_epochs=1", "trainer.progress=none"]
    for target, extra, classes in (("Plain", [], 3), ("WithTargets", [], 4)):
        args = [*base, f"dataset._target_=my_sets.{target}", *extra, f"hydra.run.dir={target}"]
        proc = run_cli(args)
        check_ok(proc)
        assert f"{classes} classes counted from its labels" in proc.stdout + proc.stderr
        assert json.loads((tmp_path / target / "summary.json").read_text())["steps"] > 0
    large = run_cli([*base, "dataset._target_=my_sets.Plain", "+dataset.n=600", "hydra.run.dir=l"])
    assert large.returncode == 2 and "dataset.num_classes=N" in large.stderr, large.stderr
    assert "Traceback" not in large.stderr


def test_lht_callback_groups(run_cli, tmp_path):
    """lightning-hydra-template's `callbacks=early_stopping` (early stopping on the task's
    monitored metric) and `callbacks=model_checkpoint` (checkpoints, no early stopping)."""
    base = [*FAST, "trainer.max_epochs=2", "logger=none"]
    for group, monitor in (("early_stopping", "val/acc"), ("model_checkpoint", None)):
        proc = run_cli([*base, f"callbacks={group}", f"hydra.run.dir={group}"])
        check_ok(proc)
        cfg = OmegaConf.load(tmp_path / group / "config.yaml")
        assert cfg.early_stopping.monitor == monitor
        assert cfg.early_stopping.mode == "max"
        assert (tmp_path / group / "checkpoints/best.pt").is_file()


def test_sweep_summaries_speak_the_tasks_metric(run_cli, tmp_path):
    """An Optuna search of a language model: the table, sweep_summary.csv/json and
    optimization_results.yaml show val/loss (min) and the objective final_val_loss, not
    accuracy columns."""
    data = _tokens(tmp_path, run_cli)
    search = [
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "optimizer.lr=interval(1e-3,1e-2)",
    ]
    args = ["-m", *search, *TINY_GPT, "task=language_model", "dataset=tokens", *data]
    proc = run_cli([*args, "hydra.sweep.dir=sweep"])
    check_ok(proc)
    out = proc.stdout + proc.stderr
    assert "best val/loss" in out and "(min)" in out and "final val/loss" in out
    assert "final_val_loss" in out and "best acc" not in out
    assert "Best value: final_val_loss=" in out
    summary = json.loads((tmp_path / "sweep/sweep_summary.json").read_text())
    assert (summary["monitor"], summary["monitor_mode"]) == ("val/loss", "min")
    assert (summary["objective"], summary["direction"]) == ("final_val_loss", "minimize")
    for row in summary["rows"]:
        assert row["best_val_loss"] > 0 and row["objective"] == row["final_val_loss"]
        assert "best_val_acc" not in row
    header = (tmp_path / "sweep/sweep_summary.csv").read_text().splitlines()[0].split(",")
    assert {"objective", "best_val_loss", "final_val_loss"} <= set(header)
    assert "best_val_acc" not in header
    results = OmegaConf.load(tmp_path / "sweep/optimization_results.yaml")
    assert results.objectives == ["final_val_loss"] and results.monitor == "val/loss"

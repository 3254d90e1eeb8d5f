"""Compose every option of every config group, every experiment and every debug mode with Hydra's
compose API, validate it, and instantiate the model, optimizer, scheduler and precision."""

from __future__ import annotations

import re
from importlib.util import find_spec

import pytest
import torch
from omegaconf import OmegaConf

from accel_train.config import CONFIG_DIR
from accel_train.config.checks import validate
from accel_train.config.run_config import resolve
from accel_train.errors import UserError
from accel_train.losses import build_loss
from accel_train.models import build_model
from accel_train.optim import build_optimizer, build_scheduler, scaled_lr
from accel_train.precision import cpu_has_fast_bf16, resolve_precision

# Groups selected with `group=option` (hydra/ is Hydra's own; experiment/debug are `+group=`).
PLAIN_GROUPS = sorted(
    p.name
    for p in CONFIG_DIR.iterdir()
    if p.is_dir() and p.name not in ("hydra", "experiment", "debug")
)
ADDED_GROUPS = ("experiment", "debug")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


# Options that refuse (with an explanation) until the user gives more: validate must raise,
# naming the key.
REFUSED = {
    "strategy=dp": "strategy=dp",
    "model=custom": "model._target_",
    "dataset=custom": "dataset._target_",
    "loss=custom": "loss._target_",
    "task=custom": "task.step",
    "dataset=image_folder": "dataset.root",
    "dataset=video_folder": "dataset.root",
    "dataset=volume_folder": "dataset.root",
    "model=monai": "model.name",
    "+experiment=spleen_unet": "dataset.root",
    "dataset=mask_folder": "dataset.root",
    "model=smp": "model.name",
    "+experiment=seg2d_unet": "dataset.root",
    "dataset=streaming": "dataset.remote",
    "dataset=streaming_video": "dataset.remote",
    # Fine-tuning needs a model folder and records on disk (tests/test_finetune.py runs them).
    "model=hf": "model.path",
    # A model by name needs the name: its architecture (tests/test_vision_models.py builds them).
    "model=timm": "model.name",
    "model=torchvision": "model.name",
    "dataset=sft": "dataset.path",
    "dataset=streaming_sft": "dataset.remote",
    "+experiment=sft_lora": ".path",
    # Preference tuning scores a chat model's answers (tests/test_preference.py runs it).
    "task=preference": "task=preference with model=",
    "dataset=preference": "dataset.path",
    "dataset=streaming_preference": "dataset.remote",
    "+experiment=dpo_lora": ".path",
    "+experiment=simpo_lora": ".path",
    # GRPO samples completions with a causal LM (tests/test_grpo.py runs it).
    "task=grpo": "task=grpo with model=",
    "dataset=prompts": "dataset.path",
    "+experiment=grpo_lora": ".path",
    "+experiment=imagenet_resnet50": "dataset.root",
    "+experiment=vit_finetune": "dataset.root",
    "+experiment=video_r2plus1d": "dataset.root",
    # Signals need their files (tests/test_signals_data.py and test_new_user run them).
    "dataset=audio_folder": "dataset.root",
    "dataset=signal_arrays": "dataset.path",
    "+experiment=audio_spec_cnn": "dataset.root",
    "+experiment=radio_resnet1d": "dataset.path",
}
# Trackers that are optional extras are refused, naming the extra, where not installed.
REFUSED.update(
    {f"logger={m}": f"accel-train[{m}]" for m in ("mlflow", "wandb") if not find_spec(m)}
)

# Options that only make sense together (a language model): each is composed with the others.
LANGUAGE_MODEL = ["task=language_model", "model=gpt", "dataset=tokens", "dataset.path=tokens"]
COMPANIONS = {o: [c for c in LANGUAGE_MODEL if c != o] for o in LANGUAGE_MODEL[:3]}
COMPANIONS["+experiment=gpt_char"] = ["dataset.path=tokens"]
COMPANIONS["+experiment=gpt_char_fast"] = ["dataset.path=tokens"]
COMPANIONS["+experiment=gpt2_small"] = ["dataset.path=tokens"]
COMPANIONS["+experiment=gpt2_long"] = ["dataset.path=tokens"]
COMPANIONS["dataset=streaming_tokens"] = [*LANGUAGE_MODEL[:2], "dataset.remote=shards"]

# Models of clips (N, C, T, H, W) rather than images.
VIDEO_MODELS = {"model=video_cnn"}
# Models of windows (N, C, L): a signal's channels and samples.
SIGNAL_MODELS = {"model=resnet1d"}

OVERRIDES = [f"{g}={o}" for g in PLAIN_GROUPS for o in _options(g)] + [
    f"+{g}={o}" for g in ADDED_GROUPS for o in _options(g)
]


def test_every_group_has_options():
    expected = {"model", "dataset", "precision", "strategy", "loader", "optimizer", "scheduler"}
    expected |= {"trainer", "logger", "paths", "launcher"}
    assert expected <= set(PLAIN_GROUPS)
    assert {"mnist_cnn", "small_cnn", "mlp", "resnet18"} <= set(_options("model"))
    assert {"mnist", "fashion_mnist", "cifar10", "synthetic"} <= set(_options("dataset"))
    assert {"fp32", "amp", "fp16", "bf16", "bf16_true"} <= set(_options("precision"))
    assert {"torch", "device"} <= set(_options("loader"))
    assert {"sgd", "adam", "adamw"} <= set(_options("optimizer"))
    assert {"none", "step", "cosine", "onecycle"} <= set(_options("scheduler"))
    assert {"tensorboard", "csv", "none"} <= set(_options("logger"))
    assert {"fast_dev_run", "overfit", "profile"} <= set(_options("debug"))
    assert "mnist_amp" in _options("experiment")
    assert any("cifar10" in e for e in _options("experiment"))


@pytest.mark.parametrize("override", OVERRIDES)
def test_compose_validate_instantiate(override, compose_cfg, tmp_path):
    cfg = compose_cfg([override, *COMPANIONS.get(override, []), f"paths.output_dir={tmp_path}"])
    group, _, option = override.lstrip("+").partition("=")
    named = "name" in cfg.get(group, {}) and not OmegaConf.is_missing(cfg[group], "name")
    if named and group in PLAIN_GROUPS:
        assert cfg[group].name == option, f"{group}/{option}.yaml sets name={cfg[group].name}"

    if override in REFUSED:
        with pytest.raises(UserError, match=re.escape(REFUSED[override])):
            validate(cfg)
        return
    validate(cfg)
    # Compose once, resolve once: nothing left that needs Hydra's runtime.
    resolved = resolve(cfg)
    assert "${" not in OmegaConf.to_yaml(resolved)

    device = torch.device("cpu")
    if override in COMPANIONS:  # token ids in, logits per position out; the data's vocab
        model = build_model(resolved.model, {"vocab_size": 7}).eval()
        with torch.no_grad():
            assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 7)
    else:
        # The data shape comes from the data set at run time; a 3-channel 32x32 stand-in here.
        model = build_model(resolved.model, {"in_channels": 3, "image_size": 32, "num_classes": 7})
        model.eval()
        # A video model's clips (N, C, T, H, W): 4 frames.
        shape = (2, 3, 4, 32, 32) if override in VIDEO_MODELS else (2, 3, 32, 32)
        shape = (2, 3, 64) if override in SIGNAL_MODELS else shape
        with torch.no_grad():
            assert model(torch.zeros(shape)).shape == (2, 7)
    assert build_loss(resolved.loss, 7)(torch.zeros(2, 7), torch.tensor([1, 2])) > 0

    global_batch = resolved.loader.batch_size * resolved.trainer.accumulate_grad_batches
    lr = scaled_lr(resolved.optimizer, global_batch)
    optimizer = build_optimizer(model, resolved.optimizer, lr, device)
    total_steps = max(100, 2 * resolved.scheduler.get("warmup_steps", 0))  # past any warmup
    scheduler = build_scheduler(
        optimizer, resolved.scheduler, total_steps, lr / resolved.optimizer.lr
    )
    assert optimizer.param_groups[0]["lr"] > 0 or resolved.scheduler.name == "onecycle"
    if scheduler is not None:
        for _ in range(3):
            optimizer.step()
            scheduler.step()
        assert optimizer.param_groups[0]["lr"] > 0

    precision = resolve_precision(resolved.precision.name, device, resolved.precision.tf32)
    assert precision.param_dtype in (torch.float32, torch.bfloat16)
    assert resolved.precision.name in precision.describe()


def test_experiment_mnist_amp_choices(compose_cfg, tmp_path):
    cfg = compose_cfg(["+experiment=mnist_amp", f"paths.output_dir={tmp_path}"])
    assert cfg.name == "mnist_amp"
    assert (cfg.dataset.name, cfg.model.name) == ("mnist", "small_cnn")
    assert (cfg.precision.name, cfg.loader.name) == ("amp", "device")
    prec = resolve_precision("amp", torch.device("cpu"))
    # bf16 on a CPU that has bf16 instructions, fp32 on one that would emulate it
    assert prec.autocast_dtype == (torch.bfloat16 if cpu_has_fast_bf16() else None)
    assert not prec.use_scaler


def test_overrides_apply_after_experiment(compose_cfg, tmp_path):
    cfg = compose_cfg(
        [
            "+experiment=mnist_amp",
            "precision=bf16",
            "loader.batch_size=256",
            "trainer.max_epochs=3",
            f"paths.output_dir={tmp_path}",
        ]
    )
    assert (cfg.precision.name, cfg.loader.batch_size, cfg.trainer.max_epochs) == ("bf16", 256, 3)
    assert cfg.loader.name == "device"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("loader.batch_size=0", "loader.batch_size"),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val"),
        ("resume=/no/such/file.pt", "resume"),
        ("loader.num_workers=-1", "loader.num_workers"),
    ],
)
def test_semantic_checks_name_the_key(override, key, compose_cfg, tmp_path):
    cfg = compose_cfg([override, f"paths.output_dir={tmp_path}"])
    with pytest.raises(UserError, match=re.escape(key)):
        validate(cfg)


def test_every_yaml_value_is_commented():
    """The issue asks for each default to be commented: every `key: value` line has a `#`."""
    missing = []
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        in_hydra = path.parent.name == "hydra"  # Hydra's own settings, not accel-train defaults
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if line[:1].isalpha() and path.parent.name != "hydra":
                in_hydra = line.startswith("hydra:")
            if not stripped or stripped.startswith(("#", "-")) or stripped.endswith(":"):
                continue
            if stripped.startswith("name:") or in_hydra:
                continue
            if "#" not in line:
                missing.append(f"{path.relative_to(CONFIG_DIR)}:{n}: {stripped}")
    assert not missing, "uncommented defaults:\n" + "\n".join(missing)

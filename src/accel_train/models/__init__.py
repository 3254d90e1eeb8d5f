"""The built-in models, and any model by ``_target_``: built with the data's shape, checked
against the classification contract (logits of shape (batch, num_classes)) before training."""

from __future__ import annotations

import logging
import os

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from accel_train.errors import UserError
from accel_train.models.weights import freeze, load_weights
from accel_train.targets import build, locate

log = logging.getLogger("accel_train")
# From this side on, an image is a photo rather than a digit: mnist_cnn warns (issue 47).
PHOTO_SIZE = 128


def mnist_cnn(
    *, in_channels: int, image_size: int, num_classes: int, dropout=0.25, hidden_dim=128
) -> nn.Module:
    flat = 64 * ((image_size - 4) // 2) ** 2
    if image_size >= PHOTO_SIZE and os.environ.get("RANK", "0") == "0":
        # Its first Linear layer grows with the image's area: 99 M parameters at 224 px.
        log.warning(
            "model=mnist_cnn at %d px has %.0f M parameters and trains slowly: it is made for "
            "28-px digits. For photos pick a model made for them, e.g. `model=timm "
            "model.name=resnet18` (or convnext_atto, vit_tiny_patch16_224)",
            image_size, (flat * hidden_dim) / 1e6,
        )  # fmt: skip
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3),
        nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Dropout(dropout),
        nn.Flatten(),
        nn.Linear(flat, hidden_dim),
        nn.ReLU(inplace=True),
        nn.Dropout(min(2 * dropout, 0.9)),
        nn.Linear(hidden_dim, num_classes),
    )


def small_cnn(
    *, in_channels: int, image_size: int, num_classes: int, dropout=0.25, hidden_dim=256
) -> nn.Module:
    """LeNet-5's shape, wider: two 5x5 conv + max-pool stages, then one hidden layer. About a
    third of mnist_cnn's FLOPs (its second conv runs at 8x8 instead of 24x24), 0.32 M parameters
    on MNIST."""
    side = ((image_size - 4) // 2 - 4) // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * side * side, hidden_dim),
        nn.ReLU(inplace=True),
        nn.Dropout(dropout),
        nn.Linear(hidden_dim, num_classes),
    )


def mlp(
    *, in_channels: int, image_size: int, num_classes: int, dropout=0.1, hidden_dims=(512, 256)
) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * image_size * image_size
    for hidden in hidden_dims:
        layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout)]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


STEMS = ("auto", "small", "imagenet")


def resnet18(
    *, in_channels: int, image_size: int, num_classes: int, stem: str = "auto"
) -> nn.Module:
    import torchvision  # 3 s to import: only when this model is used

    if stem not in STEMS:
        raise UserError(f"model.stem={stem}: must be one of {', '.join(STEMS)}.")
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    if stem == "small" or (stem == "auto" and image_size <= 64):
        # The ImageNet stem (7x7 stride 2 + max-pool) would shrink a 32x32 image to 8x8 at once.
        model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        why = f"dataset.image_size={image_size} <= 64" if stem == "auto" else "model.stem=small"
        log.info("model=resnet18: the small-image stem (3x3 stride-1 conv1, no max-pool): %s", why)
        # Read by model.weights when a file does not fit (models/weights.py).
        model.weights_hint = (
            f"model=resnet18 built its small-image stem (a 3x3 stride-1 conv1, no max-pool) "
            f"because {why}, and ImageNet weights (torchvision's resnet18-*.pth) have the "
            "ImageNet stem (7x7 stride 2): set `model.stem=imagenet`, or a "
            "`dataset.image_size` above 64 (224 is what they were trained at)."
        )
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return model


# Constructor arguments the data set gives (Splits.data_args), with the fix when it gives none:
# `+model.vocab_size=...` on image data would only fail later, inside the forward.
DATA_GIVEN = {
    "vocab_size": (
        "which a token data set gives (its meta.json), and this data set has no vocabulary. "
        "Train it on tokens: `task=language_model dataset=tokens dataset.path=<folder>` (a "
        "folder made by `accel-data tokenize input=<text> out=<folder>`)."
    ),
}


def build_model(
    model_cfg: DictConfig, data_args: dict, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The model, given what the data tells it (Splits.data_args: in_channels, image_size,
    num_classes, a token folder's vocab_size, ...) and the run's parameter dtype where its
    constructor names them (model=hf loads its weights straight in it); then `model.weights`
    loaded and `model.freeze` applied, the same for every model."""
    model = build(
        model_cfg,
        "model",
        runtime={**data_args, "dtype": dtype},
        # `name` is the option's, or the architecture a model source builds (model=timm).
        optional={"name": model_cfg.get("name")} if _is_source(model_cfg) else None,
        exclude=("name", "weights", "freeze"),
        hints=DATA_GIVEN,
    )
    if not isinstance(model, nn.Module):
        raise UserError(
            f"model._target_={model_cfg._target_} built a {type(model).__name__}, not a "
            "torch.nn.Module."
        )
    if model_cfg.get("weights"):
        load_weights(model, str(model_cfg.weights))
    if model_cfg.get("freeze"):
        n = freeze(model, list(model_cfg.freeze))
        log.info("model.freeze: %d parameter tensors frozen (no gradient, no optimizer state)", n)
    return model


def _is_source(model_cfg: DictConfig) -> bool:
    """A model source of ours that builds an architecture by name (model=timm, torchvision):
    it has a launch-time step (prepare_config)."""
    target = str(model_cfg.get("_target_") or "")
    return target.startswith(OURS) and hasattr(locate(target, "model._target_"), "prepare_config")


def prepare_model_config(cfg: DictConfig) -> None:
    """The model source's own step in the launching process, before config.yaml is written
    (models/timm.py: the name checked, the weights checked, the pretrained data config given
    to the dataset). Only our own sources are imported here: a user's model is imported by the
    workers alone."""
    if OmegaConf.is_missing(cfg.model, "_target_") or not _is_source(cfg.model):
        return
    locate(str(cfg.model._target_), "model._target_").prepare_config(cfg)


OURS = "accel_train.models."


def check_output(model: nn.Module, sample: torch.Tensor, num_classes: int, target: str) -> None:
    """One forward of two real samples on the CPU: the logits must be (batch, num_classes).
    A model that declares its `input_rank` (4: images, 5: clips; model=torchvision) is refused
    data of another rank, naming both; its `input_hint` says what else it needs."""
    rank = getattr(model, "input_rank", None)
    if rank is not None and sample.dim() != rank:
        kinds = {4: "images (batch, channels, height, width)",
                 5: "clips (batch, channels, frames, height, width)"}  # fmt: skip
        fix = (
            "Train it on videos (`dataset=video_folder dataset.root=<folder of class folders "
            "of videos>`, docs/video.md), or pick an image model."
            if rank == 5
            else "Pick a video model (model=torchvision model.name=r3d_18, r2plus1d_18, ...; "
            "docs/video.md), or train it on images."
        )
        raise UserError(
            f"model._target_={target}: the model takes {kinds.get(rank, f'{rank}-D inputs')}, "
            f"and the data set gives batches of shape {tuple(sample.shape)}. {fix}"
        )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(sample)
    except Exception as err:  # the user's forward on the data's real shape
        hint = getattr(model, "input_hint", None) or "Make the model accept the dataset's inputs."
        raise UserError(
            f"model._target_={target}: its forward failed on a batch of shape "
            f"{tuple(sample.shape)} from the data set: {type(err).__name__}: "
            f"{' '.join(str(err).split())[:400]}. {hint}"
        ) from None
    finally:
        model.train(was_training)
    expected = (sample.shape[0], num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(
            f"model._target_={target}: for a batch of {sample.shape[0]} it returned {got}, but "
            f"classification needs logits of shape (batch, num_classes) = {expected}. Make the "
            "last layer output num_classes values per sample (the model gets `num_classes` as a "
            "keyword argument when its constructor names it)."
        )


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

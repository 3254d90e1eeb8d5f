"""`model=torchvision model.name=<builder>`: any image classifier of torchvision.models, or video
classifier of torchvision.models.video (r3d_18, mc3_18, r2plus1d_18, s3d, mvit_v1_b, mvit_v2_s,
swin3d_t/s/b), by name, through torchvision.models.get_model (weights=None: nothing is
downloaded).

- Pretrained weights come from `model.weights` (a state dict file, e.g. torchvision's own
  `resnet50-*.pth`); the head (the last Linear layer) starts fresh when the data's classes
  differ, as for every model (models/weights.py).
- The builder's own keyword arguments pass through (`+model.dropout=0.2`); the data gives
  `num_classes`, and a model built for a fixed input size (torchvision's ViTs) the data's
  `image_size`. Images of other than 3 channels get a first convolution of that many input
  channels (fresh weights: the log says so).
- A video builder takes clips (N, C, T, H, W), an image builder images: the model declares its
  `input_rank` (5 or 4), which the forward check on the data's first batch compares (an image
  builder is refused at once where the data gives `frames`). torchvision's MViT builders take
  only their own clip size (16 frames of 224 px): other crops are refused when the model is
  built, other clip lengths by the forward check, naming that size (`input_hint`).
- The head is the last Linear layer or 1x1 convolution with the classes as outputs (s3d's is a
  1x1x1 Conv3d): the model names it in `head_modules` for models/weights.py.
- `prepare_config` (the launching process, before config.yaml): the name checked, unknown ones
  refused with the closest builders, the weights' names checked, and the preprocessing of the
  builder's default weights (`transforms()`: mean, std, crop_size / resize_size as crop_pct,
  interpolation) handed to the dataset (models/data_config.py).

torchvision is imported on first use.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from accel_train.errors import UserError
from accel_train.models.data_config import apply_data_config
from accel_train.models.weights import check_fits, file_shapes, refuse_download, weights_file

log = logging.getLogger("accel_train")

CONVS = (nn.Conv2d, nn.Conv3d)  # a stem's first convolution: images, clips


def _models():
    import torchvision  # 3 s to import: only when this model is used

    return torchvision.models


def families(models=None) -> dict[str, list[str]]:
    """The classifiers model=torchvision builds: images (torchvision.models) and clips
    (torchvision.models.video)."""
    models = models or _models()
    return {
        "image": models.list_models(module=models),
        "video": models.list_models(module=models.video),
    }


def check_name(name: str) -> str:
    """A classification builder of torchvision.models or torchvision.models.video (returns
    its family: image or video), else the closest names."""
    models = _models()
    found = families(models)
    for family, names in found.items():
        if name in names:
            return family
    if name in models.list_models():
        raise UserError(
            f"model.name={name}: that torchvision builder is not a classifier (it is a "
            "detection, segmentation or optical-flow model), and model=torchvision trains "
            "classifiers (logits per class). Pick one of torchvision.models.list_models("
            "module=torchvision.models) (images) or module=torchvision.models.video (clips)."
        )
    every = found["image"] + found["video"]
    close = difflib.get_close_matches(name, every, n=5, cutoff=0.5)
    hint = f" The closest: {', '.join(close)}." if close else ""
    raise UserError(
        f"model.name={name}: torchvision has no image or video classifier of that name.{hint} "
        'List them with `python -c "import torchvision as t; '
        "print(t.models.list_models(module=t.models), t.models.list_models(module=t.models."
        "video))\"` (model=timm for timm's architectures)."
    )


def _check_family(name: str, family: str, frames: int | None) -> None:
    """Where the data says it gives clips (`frames`), an image builder is refused at once (the
    forward check refuses the other way round: models/__init__.py, the model's `input_rank`)."""
    if family == "image" and frames:
        video = ", ".join(families()["video"])
        raise UserError(
            f"model.name={name} is an image classifier, and this data set gives clips of "
            f"{frames} frames. Pick a video classifier: model.name= one of {video} "
            "(docs/video.md)."
        )


def torchvision_model(
    *,
    name: str,
    num_classes: int,
    in_channels: int = 3,
    image_size: int = 224,
    frames: int | None = None,  # a clip's frames, where the data gives them (None: unsaid)
    dtype: torch.dtype | None = None,  # (the builder moves the model to it)
    **kwargs: Any,
) -> nn.Module:
    """torchvision.models.get_model(name, weights=None) for this data (module docstring)."""
    family = check_name(name)
    _check_family(name, family, frames)
    refuse_download(kwargs, "<torchvision's .pth>")
    args = {"num_classes": num_classes, **kwargs}
    with torch.device("meta"):  # (no memory) whether it is built for an input size
        probe = _get_model(name, args)
    sized = _input_size_args(name, probe, kwargs, image_size, frames)
    model = _get_model(name, {**args, **sized})
    # Capabilities read by the forward check (models/__init__.py check_output): the input's
    # rank, and what a builder of one clip size takes.
    model.input_rank = 5 if family == "video" else 4
    fixed = _fixed_clip(probe)
    if fixed is not None:
        model.input_hint = (
            f"torchvision builds {name} for clips of {fixed[0]} frames of {fixed[1]} px only "
            f"(its position embeddings have that size): set `dataset.frames={fixed[0]} "
            f"dataset.image_size={fixed[1]}`, or pick a video classifier that takes any clip "
            "size (r3d_18, r2plus1d_18, mc3_18, swin3d_t)."
        )
    if in_channels != 3:
        _first_conv_for(model, in_channels, name)
    head = head_module(model, num_classes)
    if head is not None:  # read by models/weights.py (s3d's head is no Linear layer)
        model.head_modules = (head,)
    return model


def _get_model(name: str, args: dict) -> nn.Module:
    try:
        return _models().get_model(name, weights=None, **args)
    except (TypeError, ValueError) as err:
        raise UserError(
            f"model.name={name}: torchvision could not build it with {sorted(args)} "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}). Remove or fix the "
            "`+model.*` arguments it does not take."
        ) from None


def _fixed_clip(probe: nn.Module) -> tuple[int, int] | None:
    """(frames, side) of a builder made for one clip size (torchvision's MViTs: the builder
    passes spatial_size and temporal_size itself), else None."""
    pos = getattr(probe, "pos_encoding", None)
    if getattr(pos, "temporal_size", None) is None:
        return None
    conv = probe.conv_proj  # (the embeddings' grid is the input's over the patch stride)
    return pos.temporal_size * conv.stride[0], pos.spatial_size[0] * conv.stride[1]


def _input_size_args(
    name: str, probe: nn.Module, given: dict, image_size: int, frames: int | None
) -> dict:
    """The size arguments of a builder made for one input size (its meta-device `probe`): the
    image ViTs' `image_size` from the data unless given. A fixed-clip builder (an MViT) on
    clips of another size is refused here where the data gives its frames (else by the
    forward check, with the model's `input_hint`)."""
    fixed = _fixed_clip(probe)
    if fixed is not None and (image_size != fixed[1] or (frames and frames != fixed[0])):
        got = f"{frames} frames of {image_size} px" if frames else f"{image_size} px frames"
        raise UserError(
            f"model.name={name}: torchvision builds it for clips of {fixed[0]} frames of "
            f"{fixed[1]} px only (its position embeddings and attention have that size), and "
            f"the data gives {got}. Set `dataset.frames={fixed[0]} dataset.image_size="
            f"{fixed[1]}`, or pick a video classifier that takes any clip size (r3d_18, "
            "r2plus1d_18, mc3_18, swin3d_t)."
        )
    if getattr(probe, "image_size", None) is not None and "image_size" not in given:
        return {"image_size": image_size}
    return {}


def head_module(model: nn.Module, num_classes: int | None = None) -> str | None:
    """The classification head: the last Linear layer, or 1x1 convolution (a fully
    convolutional head: s3d, squeezenet), with `num_classes` outputs when given."""
    head = None
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            outputs = m.out_features
        elif isinstance(m, nn.Conv2d | nn.Conv3d) and all(k == 1 for k in m.kernel_size):
            outputs = m.out_channels
        else:
            continue
        if num_classes is None or outputs == num_classes:
            head = name
    return head


def _first_conv_for(model: nn.Module, in_channels: int, name: str) -> None:
    """The first Conv2d or Conv3d (every torchvision classifier's stem) rebuilt for
    `in_channels`."""
    found = next(((n, m) for n, m in model.named_modules() if isinstance(m, CONVS)), None)
    if found is None:
        return
    path, conv = found
    parent = model.get_submodule(path.rpartition(".")[0])
    new = type(conv)(
        in_channels,
        conv.out_channels,
        conv.kernel_size,
        stride=conv.stride,
        padding=conv.padding,
        dilation=conv.dilation,
        groups=1 if conv.groups == conv.in_channels else conv.groups,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
    )
    setattr(parent, path.rpartition(".")[2], new)
    # Read by model.weights when a file does not fit (models/weights.py).
    model.weights_hint = (
        f"model=torchvision {name} has its first convolution ({path}) rebuilt for the data's "
        f"{in_channels} channel(s), and weights made for 3 channels do not fit it: train on "
        "3-channel inputs (or use model=timm, which converts a pretrained stem)."
    )
    log.info(
        "model=torchvision %s: its first convolution (%s) takes the data's %d channel(s), "
        "not 3 (fresh weights)",
        name,
        path,
        in_channels,
    )


# ---- the launching process ----------------------------------------------------------------


def prepare_config(cfg: DictConfig) -> None:
    """The name and the weights' names checked; the default weights' preprocessing applied to
    the dataset (see the module docstring)."""
    name = str(cfg.model.name)
    check_name(name)
    weights = cfg.model.get("weights")
    if weights:
        _check_weights(name, str(weights))
    apply_data_config(
        cfg, data_config(name), f"model=torchvision {name}", "from its weights' transforms()"
    )


def data_config(name: str) -> dict[str, Any]:
    """The preprocessing of the builder's DEFAULT weights (a description: nothing downloaded),
    as timm names its keys; ImageNet's mean and std for a builder with no weights."""
    models = _models()
    try:
        weights = models.get_model_weights(name).DEFAULT
        t = weights.transforms()
    except (ValueError, AttributeError, TypeError):
        return {"mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
    crop = int(getattr(t, "crop_size", [224])[0])
    resize = int(getattr(t, "resize_size", [crop])[0])
    return {
        "mean": tuple(t.mean),
        "std": tuple(t.std),
        "crop_pct": round(crop / resize, 4),
        "interpolation": t.interpolation.value,
        "input_size": (3, crop, crop),
    }


def _check_weights(name: str, weights: str) -> None:
    """Names and shapes against the builder's model on the meta device, its first conv and
    head aside (the data decides those; the worker checks them)."""
    file, shapes = file_shapes(weights_file(weights))
    try:
        with torch.device("meta"):
            model = _models().get_model(name, weights=None)
    except Exception:  # noqa: BLE001 - the worker's build names the problem in full
        return
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    named = list(model.named_modules())
    conv = next((n for n, m in named if isinstance(m, CONVS)), None)
    head = head_module(model)
    skip = {k for k in own for m in (conv, head) if m and k.startswith(m + ".")}
    check_fits(
        own,
        shapes,
        skip,
        f"model.weights={weights}",
        f"Give weights of torchvision's {name} ({file.name} holds another architecture's, or "
        "the same one built with other arguments); only the last Linear layer, the head, may "
        "differ in shape: it then starts from fresh weights.",
    )


torchvision_model.prepare_config = prepare_config  # type: ignore[attr-defined]

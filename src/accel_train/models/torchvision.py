"""`model=torchvision model.name=<builder>`: any image classifier of torchvision.models by name,
through torchvision.models.get_model (weights=None: nothing is downloaded).

- Pretrained weights come from `model.weights` (a state dict file, e.g. torchvision's own
  `resnet50-*.pth`); the head (the last Linear layer) starts fresh when the data's classes
  differ, as for every model (models/weights.py).
- The builder's own keyword arguments pass through (`+model.dropout=0.2`); the data gives
  `num_classes`, and a model built for a fixed input size (torchvision's ViTs) the data's
  `image_size`. Images of other than 3 channels get a first convolution of that many input
  channels (fresh weights: the log says so).
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


def _models():
    import torchvision  # 3 s to import: only when this model is used

    return torchvision.models


def check_name(name: str) -> None:
    """A classification builder of torchvision.models, else the closest names."""
    models = _models()
    classifiers = models.list_models(module=models)
    if name in classifiers:
        return
    if name in models.list_models():
        raise UserError(
            f"model.name={name}: that torchvision builder is not an image classifier (it is "
            "a detection, segmentation, video or optical-flow model), and model=torchvision "
            "trains classifiers (logits per class). Pick one of "
            "torchvision.models.list_models(module=torchvision.models)."
        )
    close = difflib.get_close_matches(name, classifiers, n=5, cutoff=0.5)
    hint = f" The closest: {', '.join(close)}." if close else ""
    raise UserError(
        f"model.name={name}: torchvision has no image classifier of that name.{hint} List "
        'them with `python -c "import torchvision as t; '
        "print(t.models.list_models(module=t.models))\"` (model=timm for timm's architectures)."
    )


def torchvision_model(
    *,
    name: str,
    num_classes: int,
    in_channels: int = 3,
    image_size: int = 224,
    dtype: torch.dtype | None = None,  # (the builder moves the model to it)
    **kwargs: Any,
) -> nn.Module:
    """torchvision.models.get_model(name, weights=None) for this data (module docstring)."""
    models = _models()
    check_name(name)
    refuse_download(kwargs, "<torchvision's .pth>")
    args = {"num_classes": num_classes, **kwargs}
    try:
        with torch.device("meta"):  # (no memory) whether it is built for an input size
            fixed = getattr(models.get_model(name, weights=None, **args), "image_size", None)
        if fixed is not None and "image_size" not in kwargs:
            args["image_size"] = image_size
        model = models.get_model(name, weights=None, **args)
    except (TypeError, ValueError) as err:
        raise UserError(
            f"model.name={name}: torchvision could not build it with {sorted(args)} "
            f"({type(err).__name__}: {' '.join(str(err).split())[:300]}). Remove or fix the "
            "`+model.*` arguments it does not take."
        ) from None
    if in_channels != 3:
        _first_conv_for(model, in_channels, name)
    return model


def _first_conv_for(model: nn.Module, in_channels: int, name: str) -> None:
    """The first Conv2d (every torchvision classifier's stem) rebuilt for `in_channels`."""
    found = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)
    if found is None:
        return
    path, conv = found
    parent = model.get_submodule(path.rpartition(".")[0])
    new = nn.Conv2d(
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
        "3-channel images (or use model=timm, which converts a pretrained stem)."
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
    conv = next((n for n, m in named if isinstance(m, nn.Conv2d)), None)
    head = next((n for n, m in reversed(named) if isinstance(m, nn.Linear)), None)
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

"""`model=smp model.name=<architecture> model.encoder=<encoder>`: segmentation-models-pytorch's
2-D networks by name (smp.create_model: Unet, UnetPlusPlus, FPN, PSPNet, DeepLabV3Plus, ...).

Never a download: `encoder_weights=None` always; pretrained weights come from `model.weights`
(a state dict file of the same architecture; models/weights.py). The model names its
`segmentation_head` as the head (`head_modules`), so a file made for other classes loads with
the head started fresh for this run's. The data gives `in_channels` and the classes; smp's own
keyword arguments pass through (`+model.encoder_depth=3`). smp is imported on first use."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig
from torch import nn

from accel_train.errors import UserError
from accel_train.models.weights import refuse_download

# What the data gives every model that smp does not take.
DATA_ONLY = ("dtype", "image_size", "spatial_dims", "frames")


def _smp():
    try:
        import segmentation_models_pytorch as smp
    except ImportError:
        raise UserError(
            "model=smp needs segmentation-models-pytorch, which is not installed: "
            "`pip install segmentation-models-pytorch`."
        ) from None
    return smp


def check_name(name: str) -> None:
    smp = _smp()
    known = [getattr(a, "__name__", str(a)) for a in getattr(smp, "_MODEL_ARCHITECTURES", [])]
    if known and name.lower() not in {k.lower() for k in known}:
        raise UserError(
            f"model.name={name}: segmentation-models-pytorch has no such architecture; one of "
            f"{', '.join(known)}, e.g. `model.name=Unet`."
        )


def prepare_config(cfg: DictConfig) -> None:
    """In the launching process, before config.yaml is written: the name checked."""
    check_name(str(cfg.model.name))


def smp_model(
    *, name: str, num_classes: int, in_channels: int = 3, encoder: str = "resnet34",
    **kwargs: Any,
) -> nn.Module:  # fmt: skip
    """smp.create_model(name, encoder, encoder_weights=None) for this data's channels and
    classes."""
    smp = _smp()
    kwargs = {k: v for k, v in kwargs.items() if k not in DATA_ONLY}
    refuse_download(kwargs, "<a state dict file>")
    if kwargs.pop("encoder_weights", None) is not None:
        raise UserError(
            "model.encoder_weights would download the encoder's weights, and accel-train never "
            "downloads: give a state dict file of the whole model, `model.weights=<file>`."
        )
    for key in ("classes", "in_channels", "encoder_name", "arch"):
        if key in kwargs:
            raise UserError(
                f"model.{key}: model=smp takes the classes and channels from the data and the "
                "architecture and encoder from model.name and model.encoder. Remove it."
            )
    try:
        model = smp.create_model(
            arch=str(name), encoder_name=str(encoder), encoder_weights=None,
            in_channels=in_channels, classes=num_classes, **kwargs,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"model=smp model.name={name} model.encoder={encoder}: building it failed: "
            f"{type(err).__name__}: {' '.join(str(err).split())[:300]}. Check the name, the "
            "encoder (smp.encoders.get_encoder_names()) and the `+model.<key>` arguments."
        ) from None
    model.head_modules = ("segmentation_head",)  # models/weights.py: the head may differ
    return model


smp_model.prepare_config = prepare_config  # type: ignore[attr-defined]

"""`model=monai model.name=<network>`: any of MONAI's networks (monai.networks.nets) by name,
e.g. UNet, SegResNet, DynUNet, UNETR, SwinUNETR, AttentionUnet.

The data gives what a network asks for under MONAI's own names: `spatial_dims` (3 for
volumes), `in_channels` (the image channels), `out_channels` (the classes, background
included) and, for a network of a fixed input size (UNETR), `img_size` (the patch). The
network's own arguments are `model.args` (a mapping: `model.args={channels: [16,32,64],
strides: [2,2]}` for a UNet), or `+model.<key>=` one by one. MONAI is
imported on first use."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from omegaconf import DictConfig
from torch import nn

from accel_train.errors import UserError

# The data's values under MONAI's argument names.
FROM_DATA = {"spatial_dims", "in_channels", "out_channels", "img_size"}


def _nets():
    try:
        from monai.networks import nets
    except ImportError:
        raise UserError(
            "model=monai needs MONAI, which is not installed. Install the medical extra: "
            '`pip install "accel-train[medical]"`.'
        ) from None
    return nets


def network(name: str) -> type[nn.Module]:
    """The class monai.networks.nets.<name>, or a UserError with the closest names."""
    nets = _nets()
    cls = getattr(nets, str(name), None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        known = [n for n in dir(nets) if isinstance(getattr(nets, n), type)
                 and issubclass(getattr(nets, n), nn.Module)]  # fmt: skip
        close = difflib.get_close_matches(str(name), known, n=5, cutoff=0.4)
        hint = f" The closest: {', '.join(close)}." if close else ""
        raise UserError(
            f"model.name={name}: monai.networks.nets has no network of that name.{hint} E.g. "
            "`model.name=UNet` (or SegResNet, DynUNet, UNETR, SwinUNETR, AttentionUnet)."
        )
    return cls


def prepare_config(cfg: DictConfig) -> None:
    """In the launching process, before config.yaml is written: the name checked."""
    network(str(cfg.model.name))


def monai_model(
    *, name: str, in_channels: int, num_classes: int, image_size: int = 0,
    spatial_dims: int = 3, args: dict | None = None, **kwargs: Any,
) -> nn.Module:  # fmt: skip
    """The network `name` with the data's shape and `args` (and any `+model.<key>`)."""
    cls = network(name)
    kwargs = {**(args or {}), **kwargs}
    params = inspect.signature(cls).parameters
    data = {"spatial_dims": spatial_dims, "in_channels": in_channels,
            "out_channels": num_classes, "img_size": [image_size] * spatial_dims}  # fmt: skip
    given = {k: v for k, v in data.items() if k in params}
    taken = sorted(set(kwargs) & FROM_DATA)
    if taken:
        raise UserError(
            f"model.args.{taken[0]}: model=monai takes it from the data (spatial_dims, "
            "in_channels, out_channels = the classes, img_size = the patch). Remove it."
        )
    kwargs = {k: v for k, v in kwargs.items() if k not in ("dtype", "image_size")}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [] if open_ended else [k for k in kwargs if k not in params]
    if unknown:
        raise UserError(
            f"model.args.{unknown[0]}: monai.networks.nets.{name} takes no argument "
            f"{unknown[0]!r} (it takes: {', '.join(p for p in params if p not in FROM_DATA)})."
        )
    try:
        return cls(**given, **kwargs)
    except (TypeError, ValueError, AssertionError, KeyError) as err:
        raise UserError(
            f"model=monai model.name={name}: building it failed: {type(err).__name__}: "
            f"{' '.join(str(err).split())[:300]}. Check its arguments (`model.args`)."
        ) from None


monai_model.prepare_config = prepare_config  # type: ignore[attr-defined]

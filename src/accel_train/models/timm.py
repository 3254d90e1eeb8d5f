"""`model=timm model.name=<architecture>`: any timm model by name, through timm.create_model.

- Never a download: `pretrained=False` always. Pretrained weights come from `model.weights`: a
  folder as timm's `save_for_hf` / `push_to_hub` writes it (config.json naming the
  `architecture`, beside model.safetensors or pytorch_model.bin), or a bare state dict file.
  A folder's config.json also gives the architecture when `model.name` is left out.
- timm's own keyword arguments pass straight through (`+model.drop_path_rate=0.1`); the data
  gives `num_classes`, `in_chans` and, for a model of a fixed input size (a ViT), `img_size`.
- The model carries what the rest of accel-train asks a model (capabilities, never its name):
  `head_modules` (timm's `pretrained_cfg['classifier']`: what `model.weights` re-initialises
  when the classes differ) and `block_names` (timm's coarse `group_matcher` groups: a ViT's
  blocks, a ConvNeXt's or EfficientNet's stages: FSDP's shard units and the blocks selective
  activation checkpointing wraps).
- `prepare_config` runs in the launching process, once, before config.yaml is written: the name
  checked (an unknown one refused with timm's closest names), the weights checked against the
  architecture, and the model's pretrained data config (mean, std, crop_pct, interpolation)
  handed to the dataset (models/data_config.py).

timm is imported on first use: only runs that pick model=timm pay its import.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from accel_train.errors import UserError
from accel_train.models.data_config import apply_data_config
from accel_train.models.weights import check_fits, file_shapes, refuse_download, weights_file

log = logging.getLogger("accel_train")


def _timm():
    try:
        import timm  # seconds to import: only when model=timm is used
    except ImportError:
        raise UserError(
            "model=timm needs the timm package, which is not installed. Install the vision "
            'extra: `pip install "accel-train[vision]"`.'
        ) from None
    return timm


def check_name(name: str) -> None:
    """A name timm.create_model knows (`arch` or `arch.tag`), else the closest ones."""
    timm = _timm()
    if timm.is_model(name):
        return
    arch = str(name).split(".")[0]
    close = difflib.get_close_matches(arch, timm.list_models(), n=5, cutoff=0.5)
    hint = f" The closest: {', '.join(close)}." if close else ""
    raise UserError(
        f"model.name={name}: timm {timm.__version__} has no architecture of that name.{hint} "
        f"List them with `python -c \"import timm; print(timm.list_models('*{arch[:4]}*'))\"` "
        "(model=torchvision for torchvision's builders)."
    )


def read_folder_config(path: str | None) -> dict[str, Any]:
    """The config.json of a timm weights folder ({} for a file, or a folder without one)."""
    folder = Path(str(path)).expanduser() if path else None
    if folder is None or not (folder / "config.json").is_file():
        return {}
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(
            f"model.weights={path}: its config.json is not readable JSON ({err}). Write the "
            "folder again with timm's `save_for_hf(model, folder)`."
        ) from None
    return config if isinstance(config, dict) else {}


POS_EMBED = "pos_embed"  # a ViT's absolute position table, as timm names it


def timm_model(
    *,
    name: str,
    num_classes: int,
    in_channels: int = 3,
    image_size: int = 224,
    dtype: torch.dtype | None = None,  # (the builder moves the model to it)
    **kwargs: Any,
) -> nn.Module:
    """timm.create_model(name) for this data, never pretrained (see the module docstring)."""
    timm = _timm()
    check_name(name)
    refuse_download(kwargs, "<folder timm's save_for_hf wrote>")
    args: dict[str, Any] = {"num_classes": num_classes, "in_chans": in_channels, **kwargs}
    cfg = timm.get_pretrained_cfg(name)
    if cfg is not None and cfg.fixed_input_size and "img_size" not in kwargs:
        args["img_size"] = image_size  # a ViT's position table is sized to its input
    try:
        model = timm.create_model(name, pretrained=False, **args)
    except TypeError as err:  # a keyword argument the architecture does not take
        bad = re.search(r"argument '(\w+)'", str(err))
        key = f"model.{bad.group(1)}" if bad else "model.*"
        raise UserError(
            f"{key}: timm's {name} does not take it ({err}). Remove `+{key}` from the "
            "command line, or check the spelling against the architecture's constructor."
        ) from None
    except (ValueError, AssertionError, RuntimeError) as err:
        raise UserError(
            f"model.name={name}: timm could not build it for this data ({num_classes} classes, "
            f"{in_channels} channels, {image_size}-pixel images): {type(err).__name__}: "
            f"{' '.join(str(err).split())[:300]}. Change the data's size "
            "(`dataset.image_size`) or the model's arguments."
        ) from None
    model.head_modules = _head_modules(model)
    model.block_names = _block_names(model)
    model.adapt_weights = functools.partial(_adapt_weights, model)
    return model


def _adapt_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What timm converts when it loads pretrained weights into a model built otherwise: the
    stem for other input channels, a ViT's position table for another image size."""
    return _adapt_pos_embed(model, _adapt_stem(model, state))


def _adapt_pos_embed(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ViT's absolute position table for another grid (fine-tuning at another image size):
    resampled as timm's vision_transformer.checkpoint_filter_fn does (bicubic, antialiased)."""
    own, given = model.state_dict().get(POS_EMBED), state.get(POS_EMBED)
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if own is None or given is None or own.shape == given.shape or grid is None:
        return state
    from timm.layers import resample_abs_pos_embed  # (timm's own resampling)

    prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
    table = resample_abs_pos_embed(given, new_size=list(grid), num_prefix_tokens=prefix)
    log.info(
        "model.weights: %s resampled from %d to %d positions for this image size (as timm does)",
        POS_EMBED,
        given.shape[1],
        table.shape[1],
    )
    return {**state, POS_EMBED: table}


def _adapt_stem(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights of a stem for other input channels (ImageNet's 3 on grayscale data) converted
    as timm converts them when it loads pretrained weights (`adapt_input_conv`)."""
    from timm.models import adapt_input_conv  # (timm's own conversion)

    stem = (model.pretrained_cfg or {}).get("first_conv")
    key = f"{stem}.weight"
    own = model.state_dict().get(key)
    given = state.get(key)
    if own is None or given is None or given.dim() != 4 or given.shape[1] == own.shape[1]:
        return state
    if given.shape[0] != own.shape[0] or given.shape[2:] != own.shape[2:]:
        return state  # another layer altogether: the fit check names it
    log.info(
        "model.weights: the stem %s takes %d input channels in the file and %d here: converted "
        "as timm does (adapt_input_conv)",
        key,
        given.shape[1],
        own.shape[1],
    )
    return {**state, key: adapt_input_conv(own.shape[1], given)}


def _head_modules(model: nn.Module) -> tuple[str, ...]:
    """The classifier's module name(s), as the model's pretrained config records them."""
    classifier = (getattr(model, "pretrained_cfg", None) or {}).get("classifier") or ()
    names = (classifier,) if isinstance(classifier, str) else tuple(classifier)
    modules = dict(model.named_modules())
    return tuple(n for n in names if n in modules)


def _block_names(model: nn.Module) -> tuple[str, ...]:
    """The modules timm's coarse `group_matcher` (the grouping layer-wise lr decay uses) names
    as blocks: a ViT's blocks, a ConvNeXt's, EfficientNet's or ResNet's stages. () when the
    model has no matcher."""
    matcher = getattr(model, "group_matcher", None)
    if matcher is None:
        return ()
    spec = matcher(coarse=True).get("blocks") or ()
    # A pattern, or (pattern, ordinal) pairs; those with a fixed ordinal are single layers
    # (a final norm) that timm files with the last block.
    patterns = [spec] if isinstance(spec, str) else [p for p, order in spec if order is None]
    found = []
    for name, _ in model.named_modules():
        if name and any((m := re.match(p, name)) and m.end() == len(name) for p in patterns):
            found.append(name)
    return tuple(found)


# ---- the launching process: name, weights and data config, before config.yaml -------------


def prepare_config(cfg: DictConfig) -> None:
    """model.name (from the weights folder when left out) checked, model.weights checked
    against it, and the data config applied to cfg.dataset (see the module docstring)."""
    weights = cfg.model.get("weights")
    folder = read_folder_config(weights)
    if OmegaConf.is_missing(cfg.model, "name"):
        if not folder.get("architecture"):
            raise UserError(
                "model.name is required with model=timm: the architecture, e.g. "
                "`model.name=convnext_atto` (any of timm.list_models()), or `model.weights=` a "
                "folder timm's save_for_hf wrote, whose config.json names it."
            )
        cfg.model.name = folder["architecture"]
    name = str(cfg.model.name)
    check_name(name)
    _sizes_for_schedule(cfg, name)
    if weights:
        _check_weights(cfg, name, str(weights), folder)
    data = folder.get("pretrained_cfg") or _registry_data_config(name)
    apply_data_config(
        cfg,
        data,
        f"model=timm {name}",
        "from model.weights' config.json"
        if folder.get("pretrained_cfg")
        else "from timm's pretrained config",
    )


def _sizes_for_schedule(cfg: DictConfig, name: str) -> None:
    """trainer.progressive_resize changes the training size per epoch, and a model of a fixed
    input size (a ViT's position table) takes one size only: timm's `dynamic_img_size=True`
    (its position table resampled to each input) is set where the architecture takes it, and
    the schedule is refused in one paragraph where it does not. (Every size the schedule uses
    is then tried on the built model: techniques/progressive_resize.py.)"""
    if OmegaConf.select(cfg, "trainer.progressive_resize", default=None) is None:
        return
    pretrained = _timm().get_pretrained_cfg(name)
    if pretrained is None or not pretrained.fixed_input_size or "dynamic_img_size" in cfg.model:
        return
    size = OmegaConf.select(cfg, "dataset.image_size", default=None) or pretrained.input_size[-1]
    try:
        with torch.device("meta"):  # no memory: only whether the constructor takes it
            _timm().create_model(name, pretrained=False, img_size=size, dynamic_img_size=True)
    except TypeError:
        raise UserError(
            f"trainer.progressive_resize trains at several image sizes, and timm's {name} takes "
            f"one input size only (its pretrained config's fixed_input_size) and has no "
            "`dynamic_img_size` argument to take others. Drop `trainer.progressive_resize` "
            "for this model, or pick one that takes any size: a CNN (resnet50, convnext_tiny) "
            "or a ViT that timm builds with dynamic_img_size (vit_*, deit_*, eva_*)."
        ) from None
    except Exception:  # noqa: BLE001 - anything else: the worker's build names it in full
        return
    with open_dict(cfg.model):
        cfg.model.dynamic_img_size = True
    log.info(
        "model=timm %s: model.dynamic_img_size=true, as trainer.progressive_resize trains at "
        "several image sizes (timm resamples the position table to each input)",
        name,
    )


def _registry_data_config(name: str) -> dict[str, Any]:
    cfg = _timm().get_pretrained_cfg(name)
    return cfg.to_dict() if cfg is not None else {}


def _check_weights(cfg: DictConfig, name: str, weights: str, folder: dict) -> None:
    """The weights' names and shapes against the architecture built on the meta device (no
    memory, no data yet): the body only, as the head and the stem depend on the data's classes
    and channels, which the worker checks when it loads the weights."""
    file, shapes = file_shapes(weights_file(weights))
    timm = _timm()
    pretrained = timm.get_pretrained_cfg(name)
    args: dict[str, Any] = {}
    if pretrained is not None and pretrained.fixed_input_size:
        size = OmegaConf.select(cfg, "dataset.image_size", default=None)
        args["img_size"] = size or pretrained.input_size[-1]
    extra = {
        k: v for k, v in cfg.model.items() if k not in ("_target_", "name", "weights", "freeze")
    }
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, **{**extra, **args})
    except Exception:  # noqa: BLE001 - the worker's build names the problem in full
        return
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    skip = {k for m in _head_modules(model) for k in own if k.startswith(m + ".")}
    stem = (model.pretrained_cfg or {}).get("first_conv")
    skip |= {k for k in own if stem and k.startswith(stem + ".")}
    skip |= {POS_EMBED}  # resampled to the image size on load (_adapt_pos_embed)
    check_fits(own, shapes, skip, f"model.weights={weights}", _arch_hint(file, name, folder))


def _arch_hint(file: Path, name: str, folder: dict) -> str:
    arch = folder.get("architecture")
    if arch and arch.split(".")[0] != name.split(".")[0]:
        return (
            f"Its config.json says the weights are timm's {arch}, not {name}: set "
            f"`model.name={arch}` (or leave model.name out to take it from the folder), or give "
            f"{name}'s weights."
        )
    return (
        f"Give weights of timm's {name} ({file.name} holds another architecture's, or the same "
        "one built with other arguments); only the classifier may differ in shape: it then "
        "starts from fresh weights."
    )


timm_model.prepare_config = prepare_config  # type: ignore[attr-defined]

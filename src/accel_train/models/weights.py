"""`model.weights` and `model.freeze`: one step of the model builder, for every model.

- `model.weights=PATH`: a state dict (a torchvision `.pth`, a `torch.save`d state dict, a
  `.safetensors` file, an accel-train checkpoint's `model`, or a folder as timm's `save_for_hf`
  writes it: model.safetensors or pytorch_model.bin beside config.json) loaded into the freshly
  built model before training, safely (tensors and plain data only: nothing in the file runs).
  A classification head whose shape differs from the data's classes (or that the file lacks)
  keeps its fresh weights (the run names its keys); any other missing, unexpected or misshapen
  key is an error listing the first few. The head is what the model names in `head_modules`
  (model=timm: its pretrained config's classifier), else its last Linear layer.
- `model.freeze=[...]`: parameters whose name starts with one of the prefixes (or matches a
  glob pattern, `layer1.*.weight`) get `requires_grad=False`: no gradient, no optimizer state.
"""

from __future__ import annotations

import fnmatch
import logging
from pathlib import Path

import torch
from torch import nn

from accel_train.errors import UserError
from accel_train.safe_load import torch_load_error

log = logging.getLogger("accel_train")


# A folder's weights file, in the order they are taken (timm's save_for_hf writes either or both).
FOLDER_FILES = ("model.safetensors", "pytorch_model.bin")


def weights_file(path: str, key: str = "model.weights") -> Path:
    """The file `path` names, or a weights folder's file (FOLDER_FILES)."""
    given = Path(str(path)).expanduser()
    if not given.is_dir():
        return given
    for name in FOLDER_FILES:
        if (given / name).is_file():
            return given / name
    raise UserError(
        f"{key}={path}: the folder holds no {' or '.join(FOLDER_FILES)}. Give a folder as timm's "
        "`save_for_hf(model, folder)` writes it (the weights beside config.json), or the "
        "weights file itself."
    )


def file_shapes(file: Path, key: str = "model.weights") -> tuple[Path, dict[str, tuple]]:
    """The names and shapes of a weights file's tensors, without reading their data where the
    format allows (safetensors' header; torch files memory-mapped)."""
    if file.suffix == ".safetensors" and file.is_file():
        from safetensors import safe_open  # only for .safetensors files

        try:
            with safe_open(str(file), framework="pt") as f:
                return file, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        except Exception as err:  # a damaged or foreign file: name it
            raise UserError(f"{key}={file}: not a readable safetensors file ({err}).") from None
    state = read_state_dict(str(file), key, mmap=True)
    return file, {k: tuple(v.shape) for k, v in state.items()}


def refuse_download(kwargs: dict, weights: str) -> None:
    """`+model.pretrained=true` for a library's model by name: it would download, and nothing
    is downloaded; `weights` says what to give instead (popped from kwargs otherwise)."""
    if kwargs.pop("pretrained", False):
        raise UserError(
            "model.pretrained=true would download weights, and accel-train never downloads: "
            f"give them as a local folder or file, `model.weights={weights}`."
        )


def read_state_dict(
    path: str, key: str = "model.weights", mmap: bool = False
) -> dict[str, torch.Tensor]:
    file = weights_file(path, key)
    if not file.is_file():
        raise UserError(
            f"{key}={path}: no such file. Give a state dict saved with torch.save (e.g. "
            "torchvision's resnet18-*.pth) or a .safetensors file."
        )
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file  # only for .safetensors files

        try:
            return load_file(str(file))
        except Exception as err:  # a damaged or foreign file: name it
            raise UserError(f"{key}={path}: not a readable safetensors file ({err}).") from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch's reason, as one paragraph naming the file
        raise torch_load_error(file, err, key) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # an accel-train (or Lightning-like) checkpoint
    elif isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(
            f"{key}={path}: the file holds a {type(state).__name__}, not a state dict (names -> "
            "tensors). Save `model.state_dict()`, not the model."
        )
    return state


def _head_keys(model: nn.Module) -> set[str]:
    """The classification head's tensors: the modules the model names in `head_modules` (a
    capability, model=timm's), else its last Linear layer."""
    named = getattr(model, "head_modules", None)
    if named is None:
        last = None
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                last = name
        named = () if last is None else (last,)
    keys = set()
    for name in named:
        prefix = f"{name}." if name else ""
        keys |= {prefix + k for k in model.get_submodule(name).state_dict()}
    return keys


def check_fits(
    own: dict[str, tuple], given: dict[str, tuple], skip: set[str], what: str, hint: str
) -> list[str]:
    """The keys of `skip` (the head) that the file lacks or has in another shape; any other
    difference between the model's and the file's names and shapes is an error."""
    fresh = sorted(k for k in skip if k not in given or given[k] != own[k])
    misshapen = [
        f"{k} {given[k]} vs {own[k]}"
        for k in own
        if k in given and k not in skip and given[k] != own[k]
    ]
    missing = [k for k in own if k not in given and k not in skip]
    unexpected = [k for k in given if k not in own]
    if misshapen or missing or unexpected:
        parts = [
            f"{label} ({len(keys)}): {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
            for label, keys in (
                ("different shapes (file vs model)", misshapen),
                ("missing from the file", missing),
                ("not in the model", unexpected),
            )
            if keys
        ]
        raise UserError(f"{what}: the file does not fit the model; {'; '.join(parts)}. {hint}")
    return fresh


def load_weights(model: nn.Module, path: str) -> None:
    """Load `path` into `model` (see the module docstring for the rules)."""
    state = read_state_dict(path)
    own = model.state_dict()
    adapt = getattr(model, "adapt_weights", None)  # a model's own conversion (timm's stem)
    if adapt is not None:
        state = adapt(state)
    hint = getattr(model, "weights_hint", None) or (  # a model's own word on why (resnet18's stem)
        "Give the weights of the same architecture (only the classification head may differ "
        "in shape: it is then trained from fresh weights)."
    )
    fresh = check_fits(
        {k: tuple(v.shape) for k, v in own.items()},
        {k: tuple(v.shape) for k, v in state.items()},
        _head_keys(model),
        f"model.weights={path} (for model={type(model).__name__} as built for this data)",
        hint,
    )
    if fresh:
        head = fresh[0].rsplit(".", 1)[0]
        before = f"{state[fresh[0]].shape[0]} outputs" if fresh[0] in state else "none"
        log.info(
            "model.weights: loaded %s; the head (%s) has %s in the file and %d here (the "
            "data's classes): it starts from fresh weights; keys skipped: %s",
            path,
            head,
            before,
            own[fresh[0]].shape[0],
            ", ".join(fresh),
        )
    else:
        log.info("model.weights: loaded %s (%d tensors)", path, len(own))
    model.load_state_dict({**state, **{k: own[k] for k in fresh}})  # the fresh head kept
    if fresh:  # LoRA trains a fresh head in full (techniques/lora.py)
        model.fresh_head = fresh[0].rsplit(".", 1)[0]


def freeze(model: nn.Module, patterns: list[str]) -> int:
    """requires_grad=False on every parameter a prefix or glob of `patterns` names; returns how
    many tensors were frozen. A pattern that names nothing is an error (a typo would otherwise
    train everything)."""
    names = [n for n, _ in model.named_parameters()]
    frozen = 0
    for pattern in patterns:
        hits = [n for n in names if _matches(n, str(pattern))]
        if not hits:
            near = sorted({n.split(".")[0] for n in names})[:12]
            raise UserError(
                f"model.freeze: {pattern!r} names no parameter of the model. Give a name prefix "
                f"(a module: {', '.join(near)}, ...) or a glob pattern such as 'layer1.*'."
            )
        for name, p in model.named_parameters():
            if name in hits and p.requires_grad:
                p.requires_grad_(False)
                frozen += 1
    return frozen


def _matches(name: str, pattern: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern.rstrip(".") + ".")

"""`model.weights` and `model.freeze`: one step of the model builder, for every model.

- `model.weights=PATH`: a state dict (a torchvision `.pth`, a `torch.save`d state dict, a
  `.safetensors` file, or an accel-train checkpoint's `model`) loaded into the freshly built
  model before training, safely (tensors and plain data only: nothing in the file runs). A
  classification head whose shape differs from the data's classes keeps its fresh weights (the
  run says so); any other missing, unexpected or misshapen key is an error listing the first few.
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


def read_state_dict(path: str, key: str = "model.weights") -> dict[str, torch.Tensor]:
    file = Path(str(path)).expanduser()
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
        state = torch.load(file, map_location="cpu", weights_only=True)
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
    """The parameters of the model's last Linear layer (the classification head)."""
    last = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = name
    if last is None:
        return set()
    return {f"{last}.{p}" if last else p for p, _ in model.get_submodule(last).named_parameters()}


def load_weights(model: nn.Module, path: str) -> None:
    """Load `path` into `model` (see the module docstring for the rules)."""
    state = read_state_dict(path)
    own = model.state_dict()
    head = _head_keys(model)
    replaced = sorted(k for k in head if k in state and state[k].shape != own[k].shape)
    misshapen = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and k not in head and state[k].shape != own[k].shape
    ]
    missing = [k for k in own if k not in state and k not in replaced]
    unexpected = [k for k in state if k not in own]
    if misshapen or missing or unexpected:
        parts = [
            f"{label} ({len(keys)}): {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
            for label, keys in (
                ("different shapes", misshapen),
                ("missing from the file", missing),
                ("not in the model", unexpected),
            )
            if keys
        ]
        raise UserError(
            f"model.weights={path}: the file does not fit model={model.__class__.__name__} as "
            f"built for this data; {'; '.join(parts)}. "
            + (
                getattr(model, "weights_hint", None)  # a model's own word on why (resnet18's stem)
                or "Give the weights of the same architecture (only the last Linear layer, the "
                "classification head, may differ in shape: it is then trained from fresh weights)."
            )
        )
    if replaced:
        log.info(
            "model.weights: loaded %s; the head (%s) has %d outputs in the file and %d here "
            "(the data's classes): it starts from fresh weights",
            path,
            ", ".join(replaced),
            state[replaced[0]].shape[0],
            own[replaced[0]].shape[0],
        )
    else:
        log.info("model.weights: loaded %s (%d tensors)", path, len(own))
    model.load_state_dict({**state, **{k: own[k] for k in replaced}})  # the fresh head kept
    if replaced:  # LoRA trains a fresh head in full (techniques/lora.py)
        model.fresh_head = replaced[0].rsplit(".", 1)[0]


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

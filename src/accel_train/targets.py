"""Build the user's own code (and ours) from a config node's ``_target_``.

``hydra.utils.instantiate`` does the call; this module adds what a launcher needs around it:
the working directory is importable (like torchtune), runtime values such as the data shape
are passed only to constructors that accept them, and every failure (module not found, wrong
argument, an exception in the constructor) is a one-paragraph UserError naming the key.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from accel_train.errors import UserError
from accel_train.installation import broken_install


def make_cwd_importable() -> None:
    """`model._target_=my_project.nets.Net` resolves from the directory the user runs in, as it
    does for `python -m`. torchrun workers and SLURM jobs start in the same directory."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def locate(target: str, key: str) -> Callable[..., Any]:
    """The object a dotted path names, or a UserError saying which part is missing."""
    make_cwd_importable()
    parts = target.split(".")
    module, missing = None, None
    for i in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:i])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            if err.name and not name.startswith(err.name):
                raise UserError(  # the user's module itself imports something missing
                    f"{key}={target}: importing {name} failed: {err}. Install the missing "
                    "package in this environment."
                ) from None
            missing = missing or name  # the longest module path that does not exist
            continue
        except Exception as err:  # a bug in the user's module, e.g. a SyntaxError
            broken = broken_install(err, f"{key}={target}: importing {name}")
            if broken is not None:  # torchvision built for another torch, ...
                raise broken from None
            raise UserError(
                f"{key}={target}: importing {name} raised {type(err).__name__}: {err}. Fix that "
                "module, then run again."
            ) from None
    if module is None:
        raise _no_module(key, target, ".".join(parts[:-1]) or target)
    obj: Any = module
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            if missing and inspect.ismodule(obj):  # my_pkg imports, my_pkg.nope does not
                raise _no_module(key, target, missing)
            raise UserError(
                f"{key}={target}: {obj.__name__ if inspect.ismodule(obj) else obj!r} has no "
                f"attribute {attr!r}. Check the spelling of the class or function name."
            )
        obj = getattr(obj, attr)
    if not callable(obj):
        raise UserError(f"{key}={target} is not a class or function.")
    return obj


def _no_module(key: str, target: str, module: str) -> UserError:
    search = [p or os.getcwd() for p in sys.path[:4]]
    return UserError(
        f"{key}={target}: there is no module {module}. Python searched the working directory "
        f"and PYTHONPATH ({', '.join(search)}, ...). Check the spelling, run from the directory "
        "that holds your package, add it to PYTHONPATH, or `pip install` it."
    )


def build(
    node: DictConfig,
    key: str,
    *,
    runtime: Mapping[str, Any] | None = None,
    optional: Mapping[str, Any] | None = None,
    exclude: tuple[str, ...] = ("name",),
    hints: Mapping[str, str] | None = None,
    recursive: bool = True,
) -> Any:
    """Call ``node._target_`` with the node's keys (less ``exclude``).

    ``runtime`` values (e.g. the data shape) are added when the target names them or takes
    ``**kwargs``; ``optional`` ones (accel-train's own keys such as ``seed``) only when it names
    them. `recursive=False`: nested `_target_` nodes stay data (a task's list of reward
    functions, built by the task itself). A key the target does not take is an error naming
    ``key`` and the key; a missing one is an error with ``hints[name]`` as its fix when given
    (a value the data should provide)."""
    target = str(node._target_)
    fn = locate(target, f"{key}._target_")
    params = _parameters(fn)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = {k: v for k, v in node.items() if k != "_target_" and k not in exclude}
    for name in given:
        if name not in params and not takes_any:
            raise UserError(
                f"{key}.{name}: {target}() takes no argument {name!r} (it takes: "
                f"{', '.join(p for p in params if params[p].kind not in _VAR) or 'none'}). "
                f"Remove `{key}.{name}` or rename it."
            )
    extra = {k: v for k, v in (runtime or {}).items() if k in params or takes_any}
    extra.update({k: v for k, v in (optional or {}).items() if k in params})
    missing = [
        name
        for name, p in params.items()
        if p.default is p.empty and p.kind not in _VAR and name not in given and name not in extra
    ]
    if missing and missing[0] in (hints or {}):  # a value the data gives, not the user
        raise UserError(f"{key}: {target}() needs {missing[0]}, {hints[missing[0]]}")
    if missing:
        raise UserError(
            f"{key}: {target}() needs {', '.join(missing)}. Add `+{key}.{missing[0]}=...` to the "
            "command line (or the option's YAML)."
        )
    clean = OmegaConf.create({"_target_": target, **given})
    try:
        return instantiate(clean, _convert_="all", _recursive_=recursive, **extra)
    except InstantiationException as err:
        cause = err.__cause__ or err
        if isinstance(cause, UserError):  # the target's own message names the problem
            raise cause from None
        broken = broken_install(cause, f"{key}._target_={target}: building it")
        if broken is not None:  # not the arguments: torch and torchvision do not match
            raise broken from None
        raise UserError(
            f"{key}._target_={target}: building it raised {type(cause).__name__}: "
            f"{' '.join(str(cause).split())}. Fix the arguments (`{key}.*`) or the code."
        ) from None


_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    init = getattr(fn, "__init__", None) if isinstance(fn, type) else None
    if init is object.__init__ or getattr(init, "__qualname__", "") == "Module.__init__":
        # A class with no __init__ of its own (e.g. an nn.Module loss that only defines
        # forward): torch's Module.__init__(*args, **kwargs) would look like it takes anything.
        return {}
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # some builtins have no signature: accept anything
        return {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}

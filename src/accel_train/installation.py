"""A broken installation told apart from the user's mistake.

A torchvision built for another torch fails as soon as it loads its C++ operators
(`RuntimeError: operator torchvision::nms does not exist`), and torchcodec or torchaudio the same
way, or with an ImportError/OSError out of their own modules (an undefined symbol in a shared
library). Reported where the user's `_target_` or our own data set was being built, that reads as
a mistake in the config; `broken_install` recognises it and names the installed versions and the
install line of a matching pair instead (PyTorch's table: torchvision 0.(N+15) goes with torch
2.N). Imports no torch: it reads the versions from the installed packages' metadata.
"""

from __future__ import annotations

import re
import traceback
from importlib import metadata

from accel_train.errors import UserError

# The packages built against one torch: their C++ operators and shared libraries load only
# with the torch they were built for.
COMPILED = ("torch", "torchvision", "torchaudio", "torchcodec")
_OPERATOR = re.compile(r"operator (torch\w*)::\w+ does not exist")
_LIBRARY = re.compile(
    r"lib(torch|torchvision|torchaudio|torchcodec)\w*\.(so|dylib|dll)"
    r"|(torch|torchvision|torchaudio|torchcodec)[/\\]\w+\.(so|pyd)"
)
_FILE = re.compile(r"[/\\](torch|torchvision|torchaudio|torchcodec)[/\\]")


def version(package: str) -> str | None:
    """The installed version of `package` (None: not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def matching_torchvision(torch_version: str) -> str | None:
    """The torchvision release series built for `torch_version` (2.N -> 0.(N+15)), e.g.
    '2.14.0+cu128' -> '0.29'; None for a version outside that rule."""
    found = re.match(r"2\.(\d+)", torch_version)
    return f"0.{int(found.group(1)) + 15}" if found else None


def is_broken_install(err: BaseException) -> bool:
    """Whether `err` is torch's compiled packages failing to load together: a missing
    operator of theirs, or an ImportError/OSError raised inside one of them or naming a shared
    library of theirs. Not the user's own `from torchvision import nope` (raised in the user's
    file) and not a package that is not installed (the caller's message names it)."""
    if isinstance(err, RuntimeError) and _OPERATOR.search(str(err)):
        return True
    if not isinstance(err, ImportError | OSError) or isinstance(err, ModuleNotFoundError):
        return False
    if _LIBRARY.search(str(err)):
        return True
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and bool(_FILE.search(frames[-1].filename))


def broken_install(err: BaseException, where: str) -> UserError | None:
    """The one paragraph for a broken installation (None: `err` is not one). `where`: what was
    being done, e.g. `dataset._target_=...: building it`."""
    if not is_broken_install(err):
        return None
    installed = {p: version(p) for p in COMPILED}
    listed = ", ".join(f"{p} {v}" for p, v in installed.items() if v is not None)
    torch = installed["torch"]
    vision = matching_torchvision(torch) if torch else None
    base = torch.split("+")[0] if torch else None
    line = f"`pip install torch=={base} torchvision=={vision}.*`" if base and vision else None
    fix = (
        f"Install the torchvision built for this torch: {line} (torchvision 0.N+15 goes with "
        "torch 2.N; with a CUDA build of torch, add the same --index-url you installed torch "
        "from)"
        if line
        else "Reinstall torch and torchvision together from one index (pip install torch "
        "torchvision)"
    )
    return UserError(
        f"{where} raised {type(err).__name__}: {' '.join(str(err).split())}. This is the "
        f"installation, not your config: torch's compiled packages do not match each other "
        f"(installed: {listed}). {fix}; torchcodec and torchaudio, where used, must be the "
        "releases built for that torch too."
    )

"""Free-text values of a command (`accel-sample prompt=...`), taken out of argv before Hydra.

Hydra's override grammar trims a value's trailing spaces and parses `=`, commas, brackets,
quotes and `$`: `prompt="def "` would sample from "def", `prompt="print('hi')"` would not parse.
A free-text key is therefore never an override: `take_free_text` removes it from argv and hands
its text back verbatim. Three spellings per key:

  KEY=TEXT          the text as the shell passed it (spaces, `=`, quotes, newlines kept)
  KEY=-             the text read from standard input (long prompts: `... prompt=- < file`)
  KEY_file=PATH     the text read from a file (UTF-8)

Imports nothing heavy: the CLI calls it before composing. A later command's free-text key
(a chat message, a system prompt) is one more name in the tuple its entry point passes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from accel_train.errors import UserError

STDIN = "-"  # KEY=- reads the text from standard input
FILE_SUFFIX = "_file"  # KEY_file=PATH reads it from a file


def take_free_text(argv: list[str], keys: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """(argv without the free-text keys, {key: text}) for the keys given on the command line."""
    rest: list[str] = []
    texts: dict[str, str] = {}
    for arg in argv:
        name, eq, value = arg.partition("=")
        name = name.lstrip("+")  # `+prompt=...` / `++prompt=...` mean the same here
        key = name.removesuffix(FILE_SUFFIX) if name.endswith(FILE_SUFFIX) else name
        if not eq or key not in keys or arg.startswith("-"):
            rest.append(arg)
            continue
        if key in texts:
            raise UserError(
                f"{key} is given twice ({key}=..., {key}{FILE_SUFFIX}=... or {key}=-): give "
                "it once."
            )
        if name != key:
            texts[key] = _read_file(name, value)
        elif value == STDIN:
            texts[key] = _read_stdin(key)
        else:
            texts[key] = value
    return rest, texts


def _read_file(name: str, value: str) -> str:
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{name}={value}: no such file. Give the path of a text file.") from None
    except IsADirectoryError:
        raise UserError(f"{name}={value} is a folder: give the path of a text file.") from None
    except UnicodeDecodeError:
        raise UserError(f"{name}={value} is not UTF-8 text: save it as UTF-8.") from None
    except OSError as err:
        raise UserError(f"{name}={value}: cannot read it ({err.strerror}).") from None


def _read_stdin(key: str) -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise UserError(
            f"{key}=- reads the text from standard input, but none is piped in: "
            f"`... {key}=- < text.txt`, or give `{key}{FILE_SUFFIX}=text.txt`."
        )
    try:
        return sys.stdin.read()
    except UnicodeDecodeError:
        raise UserError(f"{key}=-: standard input is not UTF-8 text.") from None

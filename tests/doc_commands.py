"""The `accel-*` commands a reader would copy from README.md and docs/**/*.md: extracted from the
fenced code blocks (a line, or several joined by a trailing `\\`; each `&&`-separated part that
starts with an accel-* program), with the `<!-- needs: ... -->` mark of their block."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = (
    "accel-train",
    "accel-eval",
    "accel-export",
    "accel-sample",
    "accel-data",
    "accel-report",
)
NEEDS = re.compile(r"<!--\s*needs:\s*(.+?)\s*-->")


@dataclass(frozen=True)
class DocCommand:
    source: str  # file:line
    text: str  # the command as written (without its trailing comment)
    needs: str | None  # the block's `<!-- needs: ... -->` mark

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def program(self) -> str:
        return self.argv[0]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _strip_comment(line: str) -> str:
    """A shell comment (` # ...` outside quotes) removed."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def extract(path: Path) -> list[DocCommand]:
    commands: list[DocCommand] = []
    lines = path.read_text().splitlines()
    rel = path.relative_to(ROOT)
    in_block, needs, prev = False, None, ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            if not in_block:
                match = NEEDS.search(prev)
                needs = match.group(1) if match else None
            in_block = not in_block
            i += 1
            continue
        if line.strip():
            prev = line if not in_block else prev
        if not in_block:
            i += 1
            continue
        start = i
        text = line.strip()
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        text = _strip_comment(text.removeprefix("$ "))
        for part in text.split("&&"):
            part = part.strip()
            if part.split(" ", 1)[0] in PROGRAMS:
                commands.append(DocCommand(f"{rel}:{start + 1}", part, needs))
    return commands


def all_commands() -> list[DocCommand]:
    return [c for path in doc_files() for c in extract(path)]


if __name__ == "__main__":
    for c in all_commands():
        print(f"{c.source:32} {'[' + c.needs + '] ' if c.needs else ''}{c.text}")

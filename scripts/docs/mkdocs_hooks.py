"""MkDocs hooks (mkdocs.yml `hooks:`): BENCHMARKS.md, kept at the top of the repository where the
benchmark scripts and reviewers read it, is published as the page `benchmarks.md`, with an anchor
per numbered section (`benchmarks.md#section-13`) for the other pages to link to."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]


def benchmarks_page() -> str:
    text = (ROOT / "BENCHMARKS.md").read_text()
    # "## 13. `+experiment=mnist_amp`: ..." -> the same heading with the id section-13.
    return re.sub(r"^(## (\d+)\. .*)$", r"\1 { #section-\2 }", text, flags=re.M)


def on_files(files, config):
    files.append(File.generated(config, "benchmarks.md", content=benchmarks_page()))
    return files

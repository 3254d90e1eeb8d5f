"""MkDocs hooks (mkdocs.yml `hooks:`).

- BENCHMARKS.md, kept at the top of the repository where the benchmark scripts and reviewers read
  it, is published as the page `benchmarks.md`, with an anchor per numbered section
  (`benchmarks.md#section-13`) for the other pages to link to.
- A page line `<!-- bench: "HEADING" -->` becomes, at build time, the command and the first table
  that follow that heading in BENCHMARKS.md, with a link to its section: the docs show measured
  tables without copying a number by hand.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r'^<!-- bench: "(?P<heading>.+?)" -->$', re.M)


def benchmarks_text() -> str:
    return (ROOT / "BENCHMARKS.md").read_text()


def benchmarks_page() -> str:
    # "## 13. `+experiment=mnist_amp`: ..." -> the same heading with the id section-13.
    return re.sub(r"^(## (\d+)\. .*)$", r"\1 { #section-\2 }", benchmarks_text(), flags=re.M)


def bench_excerpt(heading: str) -> str:
    """The first fenced command block and the first table after `heading` in BENCHMARKS.md."""
    lines = benchmarks_text().splitlines()
    start = next((i for i, x in enumerate(lines) if x.strip() == heading), None)
    if start is None:
        raise ValueError(f"BENCHMARKS.md has no heading {heading!r}")
    section = next(
        re.match(r"## (\d+)\.", x).group(1)
        for x in reversed(lines[: start + 1])
        if re.match(r"## \d+\.", x)
    )
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    body = lines[start + 1 : end]
    command: list[str] = []
    if "```" in [x.strip() for x in body]:
        a = [x.strip() for x in body].index("```")
        b = next(i for i in range(a + 1, len(body)) if body[i].strip() == "```")
        if not any(x.startswith("|") for x in body[a + 1 : b]):
            command = body[a : b + 1]
    first = next(i for i, x in enumerate(body) if x.startswith("|"))
    table = []
    for x in body[first:]:
        if not x.startswith("|"):
            break
        table.append(x)
    link = f"[Benchmarks, section {section}](benchmarks.md#section-{section})"
    return "\n".join(
        [*command, "", *table, "", f"*From {link}: the machine, precision and load are there.*"]
    )


def on_files(files, config):
    files.append(File.generated(config, "benchmarks.md", content=benchmarks_page()))
    return files


def on_page_markdown(markdown, page, config, files):
    return MARK.sub(lambda m: bench_excerpt(m.group("heading")), markdown)

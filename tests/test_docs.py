"""The manual: the docs site builds strictly (no broken links or anchors, no page outside the
nav), the generated config reference is up to date, and the README stays a front door."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent


def _nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move manual content to docs/"


def test_the_readme_names_every_extra():
    """The install line's list of extras is pyproject.toml's (issue 47: [eval] and [stream] were
    missing), but for `dev`, the tests' own."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    # An empty extra (`plot = []`, kept for old install lines) installs nothing worth naming.
    extras = set(re.findall(r"^(\w+) = \[(?!\])", section.split("\n[")[0], re.M)) - {"dev"}
    named = set(re.findall(r"\[(\w+)\]", (ROOT / "README.md").read_text()))
    assert extras and extras <= named, extras - named


def test_every_page_is_in_the_nav():
    # mkdocs.yml's `validation.nav.omitted_files: warn` fails the strict build on an orphan; this
    # names it without a build.
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    nav = set(_nav_pages(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages <= nav, f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--quiet", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()


def test_config_reference_is_up_to_date(tmp_path):
    out = tmp_path / "config.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs" / "config_reference.py"), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    committed = (DOCS / "reference" / "config.md").read_text()
    assert out.read_text() == committed, (
        "docs/reference/config.md is out of date with configs/ or config/schema/: run "
        "python scripts/docs/config_reference.py"
    )


def test_pictures_are_small_and_shown():
    pages = "".join(p.read_text() for p in DOCS.rglob("*.md"))
    for png in (DOCS / "images").glob("*.png"):
        assert png.stat().st_size < 100_000, f"{png.name}: keep docs pictures under 100 KB"
        assert f"images/{png.name}" in pages, f"{png.name} is shown on no page"


# A measured claim: a number with a unit of speed, time or share (1.39x, 98.99 %, 34 s, 48 ms).
MEASURED = re.compile(r"\b(\d+(?:\.\d+)?)\s?(?:x\b|%|s\b|ms\b)")


def test_every_measured_number_in_the_docs_is_in_benchmarks():
    """Nothing in the README or docs/ claims a number that BENCHMARKS.md does not hold (where
    its command, precision and machine are). A mechanical guard: the number must occur there;
    small counts (0-9 and 100) are left out, they are rarely measurements."""
    bench = (ROOT / "BENCHMARKS.md").read_text()
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    missing = []
    for page in pages:
        if "reference" in page.parts:  # generated from the configs: defaults, not claims
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for match in MEASURED.finditer(line):
                number = match.group(1)
                if re.fullmatch(r"\d|100", number) or number in bench:
                    continue
                missing.append(f"{page.relative_to(ROOT)}:{n}: {match.group(0)}")
    assert not missing, "numbers not in BENCHMARKS.md:\n" + "\n".join(missing)


# Paths of the machines the project was built on (spelled in pieces: this file is tracked too).
MACHINE_PATHS = ("/" + "work/", "/" + "root/", "/tmp/" + "pytest-of")


def test_no_path_of_the_build_machines_in_tracked_files():
    """Every tracked file writes paths relative to the repository (`../shared/data`) or as
    placeholders (`<repo>`), never one of the machine it was written on."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    found = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if not path.is_file() or path.is_symlink():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if any(p in line for p in MACHINE_PATHS):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "paths of this machine in tracked files:\n" + "\n".join(found)

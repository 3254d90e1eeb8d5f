"""What a command wrote: the one rule behind every `overwrite=true`. Nothing a command did not
write is ever removed or replaced (docs/reliability.md, "What each command may overwrite").

A command that writes a folder (accel-data tokenize and shard, accel-export format=hf) builds it
under a temporary name, lists its files in MANIFEST with each one's size and mtime (`record`),
and only then puts it in place (`install`). A later run with `overwrite=true` replaces or
removes only the files that are listed and unchanged since: a file with an output's name is not
proof that the command wrote it, and a file the user added or edited (a README, notes, a folder
of their own) is theirs. A folder that holds files but no manifest is never the command's.

Also here, because a refused command writes nothing: whether a path can be written at all, asked
before the work (`unwritable`), and the folders a command made for an output (`make_parents`),
removed again when they stayed empty (`remove_empty`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from accel_train.errors import UserError

MANIFEST = "accel_train.written.json"
_SHOWN = 5  # names listed in a refusal


def names(paths: Iterable[str]) -> str:
    """At most _SHOWN names for a message, then how many more."""
    items = sorted(paths)
    shown = ", ".join(items[:_SHOWN])
    return shown + (f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")


def _stat(path: Path) -> dict[str, int]:
    st = path.lstat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def _files(folder: Path) -> dict[str, dict[str, int]]:
    """Every file under `folder` (links not followed), but the manifest: relative POSIX path ->
    its size and mtime."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            path = Path(root, name)
            rel = path.relative_to(folder).as_posix()
            if rel != MANIFEST:
                found[rel] = _stat(path)
    return found


def _write(folder: Path, command: str, files: dict[str, dict[str, int]]) -> None:
    lines = [f"  {json.dumps(rel)}: {json.dumps(stat)}" for rel, stat in sorted(files.items())]
    body = ",\n".join(lines)
    text = f'{{\n "written_by": {json.dumps(command)},\n "files": {{\n{body}\n }}\n}}\n'
    (folder / MANIFEST).write_text(text)


def record(folder: Path, command: str) -> None:
    """List every file of the finished `folder` as written by `command`."""
    _write(folder, command, _files(folder))


def _listed(folder: Path, command: str) -> dict[str, dict[str, int]] | None:
    """The files the manifest of `folder` lists, or None when `command` wrote no manifest there.
    Entries that leave the folder ("..", absolute) are ignored: they can name nothing of ours."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
        files = data["files"] if data.get("written_by") == command else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None
    if not isinstance(files, dict):
        return None
    safe = {}
    for rel, stat in files.items():
        parts = PurePosixPath(rel).parts
        if parts and ".." not in parts and not PurePosixPath(rel).is_absolute():
            safe[rel] = stat
    return safe


def _unchanged(folder: Path, listed: dict[str, dict[str, int]]) -> tuple[set[str], set[str]]:
    """(listed files still as written, listed files changed since). A missing one is neither."""
    same, changed = set(), set()
    for rel, stat in listed.items():
        path = folder / rel
        if not path.is_file() and not path.is_symlink():
            continue
        (same if _stat(path) == stat else changed).add(rel)
    return same, changed


def check_out_folder(
    out: Path, key: str, command: str, overwrite: bool, example: str, shown: str | None = None
) -> None:
    """Before the work: `out` must be new, empty, or (with overwrite=true) a folder `command`
    wrote, whose listed files are unchanged. `example`: a value of `key` to suggest; `shown`:
    `out` as the user spelled it."""
    given = shown or str(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{key}={given} is a file, not a folder: choose another `{key}`.")
    held = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if not held:
        return
    listed = _listed(out, command)
    if listed is None:
        raise UserError(
            f"{key}={given} holds files {command} did not write ({names(held)}): it writes into "
            f"a new or empty folder, and replaces (overwrite=true) only the files it listed in "
            f"{MANIFEST} of its own earlier output, so nothing else is ever lost, with "
            f"`overwrite=true` or not. Write to a folder of its own, e.g. `{key}={example}` (an "
            f"output of an older accel-train, which kept no {MANIFEST}, you delete yourself)."
        )
    if not overwrite:
        raise UserError(
            f"{key}={given} holds an earlier output of {command} (its files are listed in "
            f"{MANIFEST}). Choose another folder, or replace those files with `overwrite=true` "
            "(any other file there is kept)."
        )
    _, changed = _unchanged(out, listed)
    if changed:
        raise UserError(
            f"{key}={given}: {names(changed)} changed since {command} wrote "
            f"{'them' if len(changed) > 1 else 'it'} (size or time differ from {MANIFEST}): "
            "an edited file is yours and is never replaced. Move it out of the folder, or write "
            f"to another one, e.g. `{key}={example}`."
        )


def install(
    partial: Path, out: Path, command: str, key: str, last: str, shown: str | None = None
) -> None:
    """Put the finished folder `partial` in place at `out`. A new `out` takes its name. Into an
    existing `out` (empty, or checked by `check_out_folder`) the files go one by one: only
    listed, unchanged files are replaced or removed, and a new file whose name the user holds is
    refused before anything moves. `last` (the file that makes the set whole: meta.json, the
    shard index, the export's card) goes first and comes back last, so an interrupted
    replacement is never taken for a complete one; meanwhile the manifest lists the old and the
    new files, so the next run may still replace them all."""
    record(partial, command)
    if not out.exists():
        os.replace(partial, out)
        return
    new = _listed(partial, command) or {}
    listed = _listed(out, command) or {}
    ours, _ = _unchanged(out, listed)
    clash = sorted(rel for rel in new if rel not in ours and _taken(out, rel))
    if clash:
        raise UserError(
            f"{key}={shown or out} holds {names(clash)}, which {command} did not write (or which "
            f"changed since): it would have replaced {'them' if len(clash) > 1 else 'it'}, so "
            f"nothing was written. Move {'them' if len(clash) > 1 else 'it'} away, or choose "
            "another folder."
        )
    both = {**{rel: listed[rel] for rel in ours}, **new}
    _write(out, command, both)
    with contextlib.suppress(FileNotFoundError):
        if last in ours:
            (out / last).unlink()
    for rel in sorted(set(new) - {last}):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial / rel, out / rel)
    for rel in sorted(ours - set(new)):
        with contextlib.suppress(FileNotFoundError):
            (out / rel).unlink()
        _prune(out, (out / rel).parent)
    if last in new:
        os.replace(partial / last, out / last)
    os.replace(partial / MANIFEST, out / MANIFEST)
    shutil.rmtree(partial, ignore_errors=True)


def _taken(out: Path, rel: str) -> bool:
    """Whether writing `rel` into `out` would replace something: the file itself, or a file
    where one of its folders goes."""
    path = out / rel
    if path.exists() or path.is_symlink():
        return True
    return any(p.exists() and not p.is_dir() for p in path.parents if out in p.parents)


def _prune(out: Path, folder: Path) -> None:
    """Remove `folder` and its parents below `out` while they are empty (what a removed file
    of ours leaves; a folder holding anything of the user's stays)."""
    while folder != out and out in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


# ---- writing anything at all -----------------------------------------------------------------


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be created, or None: its nearest existing folder takes no new file
    (read-only, /proc, /sys, no permission; root passes where the kernel lets it) or a file
    stands where a folder must be. Probed with an unnamed temporary file: nothing is left."""
    for folder in [path.parent, *path.parent.parents] if path.parent != path else [path]:
        if folder.exists() or folder.is_symlink():
            break
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"{folder} takes no new file: {err.strerror or err}"
    return None


def make_parents(path: Path) -> list[Path]:
    """Make the missing folders above `path`; returns those made, the outermost first."""
    missing = [p for p in reversed(path.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove those of `folders` (made by this command) that are still empty, innermost
    first: a refused or failed command leaves nothing behind."""
    for folder in reversed(folders):
        with contextlib.suppress(OSError):
            folder.rmdir()

"""The official splits of audio sets, kept as their authors made them (reshuffling them gives
wrong results: clips cut from one recording land on both sides).

In order of precedence:

- ``dataset.fold=K``: the recordings of fold K validate, every other fold trains (ESC-50's 5
  folds, UrbanSound8K's 10). The fold of a recording is the list file's ``fold`` column, or the
  ``fold<K>`` folder its path starts with (UrbanSound8K's ``audio/fold3/...``: a folder
  ``fold3`` anywhere in the path relative to root).
- Speech Commands' lists: ``validation_list.txt`` / ``testing_list.txt`` in ``dataset.root``
  (paths relative to root, one a line). Listed recordings validate / test; the rest trains.
- ``dataset.group=COLUMN`` (a list file's column: the speaker, the subject): a seeded
  ``val_fraction`` of the groups validates, so one speaker is never on both sides.
- Otherwise a seeded ``val_fraction`` held out, stratified by class.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from accel_train.data.splits import held_out_indices
from accel_train.errors import UserError

FOLD_DIR = re.compile(r"^fold(\d+)$", re.IGNORECASE)
LISTS = ("validation_list.txt", "testing_list.txt")  # Speech Commands' split files


def fold_of(rel: str, column: str | None) -> str | None:
    """A recording's fold: the list's fold column, else a ``fold<K>`` folder in its path."""
    if column not in (None, ""):
        return str(column).strip()
    for part in Path(rel).parts[:-1]:
        match = FOLD_DIR.match(part)
        if match:
            return match[1]
    return None


def split_indices(root: Path, rels: list[str], labels: torch.Tensor, *, fold, folds: list,
                  groups: list | None, group_key: str | None, val_fraction: float,
                  seed: int):  # fmt: skip
    """(train, validation, test or None) indices and a line saying which split was used."""
    n = len(rels)
    if fold is not None:
        want = str(fold).strip()
        known = sorted({f for f in folds if f is not None}, key=lambda f: (len(f), f))
        if not known:
            raise UserError(
                f"dataset.fold={fold}: the recordings of {root} have no folds (no `fold` column "
                "in dataset.list_file and no fold<K> folders). Drop dataset.fold, or give the "
                "list a fold column."
            )
        if want not in known:
            raise UserError(
                f"dataset.fold={fold} is not one of the folds of {root}: {', '.join(known)}."
            )
        val = [i for i, f in enumerate(folds) if f == want]
        train = [i for i, f in enumerate(folds) if f is not None and f != want]
        return _t(train), _t(val), None, f"fold {want} of {', '.join(known)}"
    listed = [_read_list(root / name) for name in LISTS]
    if any(listed):
        val_set, test_set = listed
        val = [i for i, r in enumerate(rels) if r in val_set]
        test = [i for i, r in enumerate(rels) if r in test_set]
        train = [i for i, r in enumerate(rels) if r not in val_set and r not in test_set]
        return _t(train), _t(val), _t(test) if test else None, " and ".join(
            n for n, s in zip(LISTS, listed, strict=True) if s)  # fmt: skip
    if group_key:
        if groups is None:
            raise UserError(
                f"dataset.group={group_key}: the groups are a column of dataset.list_file; "
                "these recordings have no list. Give a list with that column."
            )
        names = sorted(set(groups))
        order = torch.randperm(len(names), generator=torch.Generator().manual_seed(seed))
        held = {names[i] for i in order[: round(len(names) * val_fraction)].tolist()}
        val = [i for i, g in enumerate(groups) if g in held]
        train = [i for i, g in enumerate(groups) if g not in held]
        shown = ", ".join(sorted(held)[:5]) + (", ..." if len(held) > 5 else "")
        return _t(train), _t(val), None, f"{group_key} {shown}: {len(held)} of {len(names)}"
    train, val = held_out_indices(n, val_fraction, seed, labels)
    return train, val, None, "dataset.val_fraction, stratified by class"


def _t(indices: list[int]) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.int64)


def _read_list(file: Path) -> set[str]:
    if not file.is_file():
        return set()
    return {line.strip() for line in file.read_text(encoding="utf-8").splitlines() if line.strip()}

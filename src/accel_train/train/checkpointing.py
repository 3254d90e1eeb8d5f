"""Which checkpoint files a run keeps: the `checkpoint` config group, spelled as Lightning's
ModelCheckpoint (monitor, mode, save_top_k, filename, every_n_epochs, save_last).

- After each validation that is due (every `every_n_epochs` epochs, and the run's last one), the
  monitored metric ranks the weights: the `save_top_k` best are kept as files named by the
  `filename` pattern (`{epoch}`, `{step}` and metric fields such as `{val/acc:.4f}`), the ones
  pushed out of the top k are deleted. save_top_k=-1 keeps all, 0 none.
- `best.pt` always means "the best by the monitored metric" over every validation, due or not
  (written only when the monitored value improves): with the default filename (null) and
  save_top_k=1 it *is* the one kept file; otherwise it is a hard link (a copy across file
  systems) of the top file, put in place by a rename, or, for a best between two due
  validations, a file of its own.
- `last.pt` (save_last) is what `resume=auto` continues from.

The bookkeeping (best value so far, the kept files and their scores) rides in the checkpoint's
progress (`state_dict()`), so an exact resume keeps ranking against the same best. Checkpoints
written before this module carry only `best_val_acc`: read as the best of val/acc (max).
The loop only calls `plan()` (decide and update the bookkeeping, before the file is written, so
the file records itself) and `commit()` (rank 0: link best, delete what fell out).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from accel_train.config.facts import validation_metrics
from accel_train.errors import UserError

log = logging.getLogger("accel_train")

RESERVED = ("last", "best")
_FIELD = re.compile(r"\{([^{}:]*)(?::([^{}]*))?\}")


@dataclass
class Plan:
    """What one validation asks for: write `name` (a top-k file), then commit()."""

    name: str
    evicted: list[str]
    is_best: bool


def known_metrics(cfg: DictConfig, techniques: Iterable[Any] = ()) -> list[str]:
    """The metrics validation logs: the task's and the callbacks' declared ones (plain data,
    config/facts.validation_metrics), and any a built technique declares (`val_metrics`)."""
    declared = list(validation_metrics(cfg))
    names = ["val/loss", *(n for n in declared if n != "val/loss")]  # every task logs val/loss
    for technique in techniques:
        names += [m for m in getattr(technique, "val_metrics", ()) if m not in names]
    return names


def best_score(progress: dict[str, Any]) -> float | None:
    """The best monitored value a checkpoint's progress records (None: nothing validated)."""
    saved = progress.get("checkpointing")
    if saved is not None:
        return saved.get("best")
    acc = progress.get("best_val_acc", -1.0)  # before checkpoint.monitor: val/acc, max
    return acc if acc is not None and acc >= 0 else None


class Checkpointing:
    def __init__(
        self,
        cfg: DictConfig,
        ckpt_dir: Path,
        suffix: str,
        known: list[str],
        is_main: bool,
    ):
        self.monitor, self.mode = cfg.monitor, cfg.mode
        self.top_k, self.every_n_epochs = cfg.save_top_k, cfg.every_n_epochs
        self.save_last = cfg.save_last
        self.ckpt_dir, self.suffix, self.is_main = ckpt_dir, suffix, is_main
        self.known = known
        check(cfg, known)
        # filename null: with one file kept, that file is best.pt itself.
        self.pattern = cfg.filename or ("best" if self.top_k == 1 else "epoch{epoch}-step{step}")
        self.best: float | None = None
        self.kept: list[dict[str, Any]] = []  # {"name", "score"}, best first

    # ---- decisions ---------------------------------------------------------------------

    def due(self, epoch: int, final: bool) -> bool:
        """Whether a validation in (0-based) `epoch` may keep a file: as Lightning's
        every_n_epochs, every validation of every n-th epoch (mid-epoch ones too, with
        trainer.val_check_interval), and the run's last one."""
        return final or (epoch + 1) % self.every_n_epochs == 0

    def better(self, a: float, b: float | None) -> bool:
        if b is None:
            return True
        return a < b if self.mode == "min" else a > b

    def plan(self, metrics: dict[str, float], epoch: int, step: int, due: bool) -> Plan | None:
        """Rank this validation's weights; update the bookkeeping. None: write nothing.

        best.pt is considered at every validation, due or not: a new best writes it (alone,
        outside the periodic files' ranking when it is not due), so best.pt and summary.json's
        best_score are the best monitored value of the whole run. `due` (every_n_epochs, the
        last validation) only decides the top-k files."""
        if self.pattern == "best" and self.top_k == 1:
            due = True  # the one kept file is best.pt: any new best replaces it
        score = metrics.get(self.monitor)
        if (score is None or not math.isfinite(score)) and not due:
            return None
        if score is None or not math.isfinite(score):
            log.warning(
                "checkpoint.monitor=%s was not logged by this validation (logged: %s): no "
                "checkpoint ranked at step %d",
                self.monitor,
                ", ".join(sorted(metrics)),
                step,
            )
            return None
        is_best = self.better(score, self.best)
        if is_best:
            self.best = score
        if self.top_k == 0:
            return None
        if not due:  # between the periodic rankings: only a new best, as best.pt itself
            return Plan("best", [], True) if is_best else None
        if self.pattern == "best" and self.top_k == 1 and not is_best:
            # The one kept file is best.pt: only a new best replaces it (after a resume from
            # another run dir the best is that run's, with no file of ours in `kept` yet).
            return None
        worst = self.kept[-1]["score"] if self.kept else None
        if 0 < self.top_k <= len(self.kept) and not self.better(score, worst):
            return None
        name = self._unique(self.format(self.pattern, metrics, epoch, step))
        self.kept.append({"name": name, "score": score})
        # Stable: among equal scores the earlier file stays ahead (as Lightning's strict <).
        self.kept.sort(key=lambda e: e["score"], reverse=self.mode == "max")
        evicted = []
        if self.top_k > 0:
            evicted = [e["name"] for e in self.kept[self.top_k :]]
            self.kept = self.kept[: self.top_k]
        return Plan(name, evicted, is_best)

    def format(self, pattern: str, metrics: dict[str, float], epoch: int, step: int) -> str:
        values: dict[str, Any] = {**metrics, "epoch": epoch, "step": step}

        def field(match: re.Match) -> str:
            key, spec = match.group(1), match.group(2) or ""
            return format(values[key], spec)

        return _FIELD.sub(field, pattern)

    def _unique(self, name: str) -> str:
        """Lightning's `-v1`, `-v2` when a pattern gives a name a kept file already has."""
        if name == "best" and self.top_k == 1:
            return name  # the one kept file *is* best.pt: replaced in place, atomically
        taken = {e["name"] for e in self.kept} | set(RESERVED)
        candidate, version = name, 0
        while candidate in taken:
            version += 1
            candidate = f"{name}-v{version}"
        return candidate

    # ---- the files (rank 0) --------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.ckpt_dir / f"{name}{self.suffix}"

    def commit(self, plan: Plan, top: str | None = None) -> None:
        """After the planned file is written: best.pt points at the top file (a rename), then
        the files out of the top k go. A kill in between leaves at most an extra file. `top`:
        the top file's name when the plan was made (an asynchronous save commits later, after
        the next plan may have changed the ranking)."""
        if not self.is_main:
            return
        if plan.is_best and plan.name != "best":  # (a best written as best.pt: in place)
            top = top or self.kept[0]["name"]
            if top != "best":
                link_or_copy(self.path(top), self.path("best"))
        for name in plan.evicted:
            if name in RESERVED:
                continue
            path = self.path(name)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    # ---- resume ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best": self.best,
            "kept": [dict(e) for e in self.kept],
        }

    def carried_best(self) -> None:
        """Resumed from another run dir, whose best.pt was linked into ours: when best.pt is
        the one kept file, it is ours now (as in the uninterrupted run)."""
        if self.pattern == "best" and self.top_k == 1 and self.best is not None:
            self.kept = [{"name": "best", "score": self.best}]

    def load_state_dict(self, progress: dict[str, Any], own_dir: bool) -> None:
        """From a checkpoint's progress. Files kept by another run dir are not ours to delete:
        only the best value carries over from there."""
        self.best = best_score(progress)
        saved = progress.get("checkpointing") or {}
        kept = saved.get("kept", []) if own_dir else []
        self.kept = [e for e in kept if self.path(e["name"]).exists()]


def check(cfg: DictConfig, known: list[str]) -> None:
    """checkpoint.* against the metrics validation logs: a UserError naming the key."""
    if cfg.monitor not in known:
        raise UserError(
            f"checkpoint.monitor={cfg.monitor} is not a metric validation logs. The known ones: "
            f"{', '.join(known)}. Set e.g. `checkpoint.monitor=val/loss checkpoint.mode=min`."
        )
    if cfg.mode not in ("min", "max"):
        raise UserError(f"checkpoint.mode={cfg.mode} must be `min` or `max`.")
    if cfg.mode == "max" and "loss" in cfg.monitor:
        log.warning(
            "checkpoint.monitor=%s with checkpoint.mode=max keeps the checkpoints with the "
            "HIGHEST loss; add `checkpoint.mode=min`",
            cfg.monitor,
        )
    if cfg.save_top_k < -1:
        raise UserError(
            f"checkpoint.save_top_k={cfg.save_top_k}: -1 keeps every checkpoint, 0 none, k the k "
            "best."
        )
    if cfg.every_n_epochs < 1:
        raise UserError(
            f"checkpoint.every_n_epochs={cfg.every_n_epochs} must be >= 1 (epochs between "
            "checkpoint rankings; the run's last validation always ranks)."
        )
    if cfg.filename is None:
        return
    fields = ["epoch", "step", *known]
    example = f"{{{cfg.monitor}:.4f}}"  # the run's own metric, e.g. {val/loss:.4f}
    slug = cfg.monitor.replace("/", "_")
    stripped = _FIELD.sub("", cfg.filename)
    names = [m.group(1) for m in _FIELD.finditer(cfg.filename)]
    bad = next((n for n in names if n not in fields), None)
    if bad is not None:
        raise UserError(
            f"checkpoint.filename={cfg.filename!r} has the field {{{bad}}}; the fields it may use "
            f"are {', '.join('{' + f + '}' for f in fields)} (with a format, e.g. "
            f"{example})."
        )
    if "/" in stripped or "{" in stripped or "}" in stripped or not cfg.filename.strip():
        raise UserError(
            f"checkpoint.filename={cfg.filename!r} must be a file name (no `/` outside the "
            "{metric} fields, braces only around fields), e.g. "
            f"'epoch{{epoch}}-step{{step}}-{slug}{example}'."
        )
    if cfg.filename in ("last", "last.pt") or cfg.filename.endswith((".pt", ".dcp")):
        raise UserError(
            f"checkpoint.filename={cfg.filename!r}: give the name without a suffix and other than "
            "`last` (accel-train adds .pt, or .dcp under FSDP)."
        )
    for m in _FIELD.finditer(cfg.filename):
        try:
            format(1.0 if m.group(1) not in ("epoch", "step") else 1, m.group(2) or "")
        except ValueError:
            raise UserError(
                f"checkpoint.filename={cfg.filename!r}: `{m.group(0)}` has a format Python cannot "
                f"apply to a number; use e.g. {example} or {{epoch:03d}}."
            ) from None


# ---- files: hard link or copy, put in place by a rename -------------------------------------


def link_or_copy(src: Path, dst: Path) -> None:
    """Put `src` (a file or a .dcp directory) at `dst` atomically: built beside it, renamed. The
    temp names are the ones checkpoint saves use, so a kill here leaves what the next start
    already knows how to clear."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        _link_file(src, tmp)
        os.replace(tmp, dst)
        return
    tmp, old = dst.with_name(f".{dst.name}.tmp"), dst.with_name(f".{dst.name}.old")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_file)
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def _link_file(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not supported
        shutil.copy2(src, dst)

"""lm-evaluation-harness over our models: the tasks loaded offline, `lm_eval.simple_evaluate`
run on a `HarnessLM` (models/harness_lm.py), its table and its metrics as flat names. Shared by
`accel-eval harness.tasks=[...]` (train/harness_eval.py) and `trainer.harness_every_n_steps`
(techniques/harness.py).

Offline only: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before the harness (and `datasets`)
is imported, so a task reads local files (`dataset_path: json` with `dataset_kwargs.data_files`)
or the datasets cache, and never downloads. `include_path` left out is the package's own folder
of examples (`harness_tasks/`: `tiny_offline`, a multiple-choice and a generate-until task over
a few local lines, which any install can run). Tasks are looked up in `include_path` first without
the harness's own index (scanning its ~10k built-in YAML files costs ~8 CPU s); only a name not
found there builds that index. Relative `data_files` in a task's YAML resolve from
`include_path` (the tasks are loaded with it as the working directory), so a task folder works
from any directory."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
from typing import Any

from accel_train.errors import UserError

log = logging.getLogger("accel_train")

# The include_path when none is given: the tiny offline example task shipped in the package.
EXAMPLE_TASKS = Path(__file__).resolve().parents[1] / "harness_tasks"

MISSING_PACKAGE = (
    "{key} runs lm-evaluation-harness, and the lm-eval package is not installed. Install the "
    "evaluation extra: `pip install 'accel-train[eval]'` (lm-eval >= 0.4), or drop {key}."
)


def import_harness(key: str):
    """lm_eval, imported offline (see the module docstring); a missing package: UserError."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # never a download, whatever the environment says
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the harness's per-request bars
    try:
        import lm_eval
        import lm_eval.evaluator
        import lm_eval.tasks
    except ImportError:
        raise UserError(MISSING_PACKAGE.format(key=key)) from None
    # The harness records `git describe` of the working directory, which is not the model's
    # (and prints git's "not a git repository" outside one): it records none.
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    for name in ("lm-eval", "lm_eval"):  # its INFO lines (seeds, task lists) are not ours
        logging.getLogger(name).setLevel(logging.WARNING)
    return lm_eval


class HarnessTasks:
    """The tasks `names` (tasks, groups or tags), built once and reused (training runs them at
    every harness step). `key`: how the user named them (harness.tasks, trainer.harness.tasks)."""

    def __init__(self, names: list[str], include_path: str | None, key: str):
        self.names, self.key = [str(n) for n in names], key
        self.lm_eval = import_harness(key)
        manager = self.lm_eval.tasks.TaskManager
        self.include = Path(include_path).expanduser().absolute() if include_path else None
        if self.include is not None and not self.include.is_dir():
            raise UserError(
                f"{key.rsplit('.', 1)[0]}.include_path={include_path}: no such folder. Give the "
                f"folder of your task YAML files (e.g. {EXAMPLE_TASKS}, the example's)."
            )
        self.include = self.include or EXAMPLE_TASKS
        include = str(self.include)
        local = manager(include_path=include, include_defaults=False)
        missing = [n for n in self.names if n not in local.all_tasks]
        self.manager = manager(include_path=include) if missing else local
        unknown = [n for n in missing if n not in self.manager.all_tasks]
        if unknown:
            raise UserError(self._unknown(unknown))
        self.loaded = [item for n in self.names for item in self._load(n)]

    def _unknown(self, unknown: list[str]) -> str:
        where = f"in {self.include} nor "
        folder = f"{self.key.rsplit('.', 1)[0]}.include_path"
        return (
            f"{self.key}: {', '.join(unknown)} is not a task, group or tag {where}among "
            "lm-evaluation-harness's built-in tasks. Check the spelling (`lm-eval ls tasks` "
            f"lists the built-in ones), or point {folder} at the folder of your task YAML files."
        )

    def _load(self, name: str) -> list:
        """The task's (or group's, tag's) top-level objects, their data read now."""
        with _working_dir(self.include):
            try:
                loaded = self.manager.load([name])
            except Exception as err:  # datasets' offline, not-found and builder errors
                raise UserError(
                    f"{self.key}: the task {name} could not load its data offline "
                    f"({type(err).__name__}: {' '.join(str(err).split())[:300]}). accel-train "
                    "never downloads: give the task local files (`dataset_path: json` with "
                    "`dataset_kwargs: {data_files: {test: FILE.jsonl}}`, relative paths from "
                    "the include_path folder), or fetch a built-in task's data set into the "
                    "Hugging Face datasets cache once on a machine with network "
                    "(HF_DATASETS_CACHE), then run again."
                ) from None
        children = {c for kids in loaded["group_map"].values() for c in kids}
        groups = [g for n, g in loaded["groups"].items() if n not in children]
        return groups + [t for n, t in loaded["tasks"].items() if n not in children]


@contextlib.contextmanager
def _working_dir(path: Path):
    """The task files' folder as the working directory while `datasets` resolves data_files
    (relative to it): only around the loading, in the main thread."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_harness(
    lm, tasks: HarnessTasks, *, limit=None, num_fewshot=None, chat=False, seeded: bool = True
) -> dict[str, Any]:
    """simple_evaluate's results (its `results`, `groups`, `configs`, ... ; no per-sample
    logs). `seeded=False` (during training): the harness leaves the global random generators
    alone, so a run's data order and dropout do not depend on its harness steps. `chat`: the
    prompts rendered with the tokenizer's chat template (the harness's apply_chat_template;
    few-shot examples as turns of the conversation)."""
    keep = ("random_seed", "numpy_random_seed", "torch_random_seed")
    seeds = {} if seeded else dict.fromkeys(keep)
    results = tasks.lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks.loaded,
        task_manager=tasks.manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=False,
        apply_chat_template=bool(chat),
        fewshot_as_multiturn=bool(chat),
        bootstrap_iters=0 if not seeded else 1000,
        **seeds,
    )
    return results or {}


def table(results: dict[str, Any]) -> str:
    """The harness's own table (make_table), and its groups' table when there are groups."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def flat_metrics(results: dict[str, Any], prefix: str = "harness") -> dict[str, float]:
    """Every number of the results as `<prefix>/<task>/<metric>` (a filter other than `none`
    appended as `<metric>_<filter>`), for the loggers."""
    flat: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for name, value in values.items():
                if "," not in name or isinstance(value, bool):
                    continue
                if not isinstance(value, int | float) or not math.isfinite(value):
                    continue
                metric, _, filt = name.partition(",")
                suffix = "" if filt == "none" else f"_{filt}"
                flat[f"{prefix}/{task}/{metric}{suffix}"] = float(value)
    return flat

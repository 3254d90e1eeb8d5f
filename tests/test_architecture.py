"""The design rules the code must keep: imports go one way across the whole of src/, the Hydra
plugins included (each layer is imported in a fresh interpreter and must not load a module above
it, and the import graph has no cycle), inside data/ no modality importing another (issue 59),
no function-local imports hiding cycles, no function over 60 lines without its reason in its
docstring, one schema per option (a local run's config has no SLURM keys), and a training step
that never waits for the device outside the logging step."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST, count_host_reads
from omegaconf import OmegaConf

import accel_train
from accel_train.config.run_config import resolve
from accel_train.config.task_facts import BUILTIN_TASKS, TaskFacts
from accel_train.launchers.names import SUBMITTED
from accel_train.launchers.preflight import OUR_MODELS, PLAIN_MODELS
from accel_train.models import _is_source
from accel_train.parallel import process_group
from accel_train.plugins import class_for
from accel_train.targets import locate
from accel_train.tasks import Task
from accel_train.techniques import Technique
from accel_train.train.build import build_components
from accel_train.train.loop import Loop

SRC = Path(accel_train.__file__).parent
# Every package of the repository's src/: accel_train and the Hydra plugins, which Hydra finds in
# the hydra_plugins namespace. The plugins import accel_train, never the reverse.
PACKAGES = [SRC, SRC.parent / "hydra_plugins"]
OURS = tuple(p.name for p in PACKAGES)

# Lower layers never import higher ones: cli -> hydra_plugins -> commands -> launchers -> train ->
# techniques -> components -> plugins -> config -> errors. Components (data, models, ...) sit side
# by side on one layer. (cli imports no plugin either: Hydra finds the plugins by its own scan.)
# The plugin points (accel_train.plugins: the register_* decorators the components use) sit above
# config, which holds what it needs of them (config/plugin_points.py: the groups' bases and the
# entry-point scan) and the stores the decorators fill.
LAYERS = [
    ["accel_train.errors"],
    [
        "accel_train.config",
        "accel_train.environment",
        "accel_train.written",
        "accel_train.installation",
    ],
    ["accel_train.plugins"],
    [
        "accel_train.targets",
        "accel_train.data",
        "accel_train.models",
        "accel_train.losses",
        "accel_train.optim",
        "accel_train.precision",
        "accel_train.parallel",
        "accel_train.strategies",
        "accel_train.checkpoint_formats",
        "accel_train.async_save",
        "accel_train.state_copy",
        "accel_train.loggers",
        "accel_train.console",
        "accel_train.checkpoint",
        "accel_train.checkpoint_temps",
        "accel_train.safe_load",
        "accel_train.tasks",
        "accel_train.rewards",
        "accel_train.ray_cluster",
    ],
    ["accel_train.techniques"],
    # Opens a run's checkpoint (the model rebuilt, LoRA adapters included): above techniques,
    # which get a distillation teacher handed in from the build step (train/teacher.py).
    ["accel_train.run_checkpoint"],
    [
        "accel_train.train",
        "accel_train.export",
        "accel_train.export_hf",
        "accel_train.export_peft",
        "accel_train.command_checks",
    ],
    ["accel_train.launchers", "accel_train.worker", "accel_train.node"],
    ["accel_train.commands"],
    ["hydra_plugins"],
    ["accel_train.cli"],
]


def _layer(module: str) -> int:
    for level, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return level
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files() -> dict[str, Path]:
    """Every module of src/ (but the bare `accel_train` package) -> its file."""
    files = {}
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            if _module(path) != "accel_train":
                files[_module(path)] = path
    return files


def _modules() -> list[str]:
    return list(_files())


def test_every_module_has_a_layer():
    assert any(m.startswith("hydra_plugins.") for m in _modules())  # the plugins are read
    for name in _modules():
        _layer(name)


def _imports(path: Path) -> list[str]:
    """The modules of src/ a file imports (any depth in the file)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(OURS):
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(OURS)]
    modules = set(_modules())
    return [m for m in found if m in modules]


def test_imports_go_one_way_in_the_source():
    """No module imports a module of a higher layer (cli's deferred imports go downward too)."""
    violations = []
    for module, path in _files().items():
        for imported in _imports(path):
            if _layer(imported) > _layer(module):
                violations.append(f"{module} imports {imported}")
    assert not violations, "\n".join(violations)


def test_accel_train_imports_no_plugin():
    """The plugins depend on accel_train, never the reverse: what both need (the sweeper's
    config node) lives in accel_train.config and the plugin imports it."""
    found = [
        f"{module} imports {imported}"
        for module, path in _files().items()
        if module.startswith("accel_train.")
        for imported in _imports(path)
        if imported.startswith("hydra_plugins.")
    ]
    assert not found, "\n".join(found)


# data/ (issue 59): what every modality shares at its root (splits, loaders and their orders,
# batches, the device transform, crops, the class-folder tree), one sub-package per modality, and
# the sources any modality may read through. A modality imports no other modality (a piece two
# of them need moves to the root); a source imports no modality and no other source; the root
# imports no modality. A new modality is a new sub-package, named here.
DATA = "accel_train.data"
MODALITIES = ("images", "video", "text", "volumes", "signals")
SOURCES = ("shards", "remote")  # shard sets (every streaming option), Ray's loader


def _data_part(module: str) -> str | None:
    """ "root", a sub-package's name, or None outside data/."""
    if module != DATA and not module.startswith(DATA + "."):
        return None
    parts = module[len(DATA) + 1 :].split(".")
    return parts[0] if len(parts) > 1 or (SRC / "data" / parts[0]).is_dir() else "root"


def test_data_has_one_sub_package_per_modality():
    packages = {p.parent.name for p in (SRC / "data").glob("*/__init__.py")}
    assert packages == {*MODALITIES, *SOURCES}, "name a new sub-package of data/ above"
    assert _data_part("accel_train.data.images.folder") == "images"
    assert _data_part("accel_train.data.text") == "text"
    assert _data_part("accel_train.data.loaders") == "root"
    assert _data_part("accel_train.models.gpt") is None


def test_no_modality_imports_another():
    found = []
    for module, path in _files().items():
        mine = _data_part(module)
        if mine is None:
            continue
        for imported in _imports(path):
            theirs = _data_part(imported)
            if theirs in (None, "root", mine):
                continue
            if (
                mine == "root"
                and theirs in MODALITIES
                or mine in MODALITIES
                and theirs in MODALITIES
                or mine in SOURCES
            ):
                found.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert not found, "\n".join(found)


def _cycle(graph: dict[str, list[str]]) -> list[str]:
    """One import cycle of `graph` (module -> the modules it imports), or [] when none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for imported in graph[module]:
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in graph:
        cycle = visit(module)
        if cycle:
            return cycle
    return []


def _import_edges(path: Path) -> set[str]:
    """The modules of src/ a file needs loaded: `from pkg import sub` (a submodule) needs `sub`,
    not what pkg's __init__ defines; `from pkg import name` needs pkg's __init__."""
    modules = set(_modules())
    edges = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(OURS):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            edges |= subs if subs <= modules else subs | {node.module}
        elif isinstance(node, ast.Import):
            edges |= {a.name for a in node.names}
    return edges & modules


def test_no_import_cycle():
    """The module import graph of the whole src/, plugins included, has no cycle (one through
    a package's __init__ counts too)."""
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    graph = {m: sorted(_import_edges(path) - {m}) for m, path in _files().items()}
    assert _cycle(graph) == [], " -> ".join(_cycle(graph))


@pytest.mark.parametrize("level", range(len(LAYERS) - 1))
def test_a_layer_loads_nothing_above_it(level):
    """Every module of a layer, imported in a fresh interpreter, loads nothing from above."""
    mine = [m for m in _modules() if _layer(m) == level]
    script = (
        "import importlib, json, sys\n"
        "for mod in sys.argv[1:]: importlib.import_module(mod)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, *mine], capture_output=True, text=True, check=True
    )
    ours = set(_modules())  # (hydra_plugins also holds other projects' plugins)
    above = [m for m in json.loads(out.stdout) if m in ours and _layer(m) > level]
    assert not above, f"layer {level} ({', '.join(mine)}) loads {above}"


# What a function may import late besides cli.py's deferrals: the modules only a worker needs,
# which every command's start-up (a refused config, a submitted job, the torchrun parent) would
# otherwise pay: the loop and DTensor's tensor parallelism, ~1.4 s of imports on a 2-core CPU.
WORKER_ONLY = ("accel_train.train.loop", "accel_train.strategies.tensor_parallel")


def test_no_function_local_imports_of_accel_train():
    """Only cli.py defers imports (of lower layers, for start-up speed; see its docstring), and
    WORKER_ONLY's modules are imported where a worker starts to use them.
    (The plugins defer their own `_`-modules, which Hydra's plugin scan must not import.)"""
    found = []
    for path in _files().values():
        if path.name == "cli.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for inner in ast.walk(node):
                module = inner.module if isinstance(inner, ast.ImportFrom) else None
                if module and module.startswith("accel_train") and module not in WORKER_ONLY:
                    found.append(f"{path.relative_to(SRC.parent)}:{inner.lineno}")
                if isinstance(inner, ast.Import) and any(
                    a.name.startswith("accel_train") for a in inner.names
                ):
                    found.append(f"{path.relative_to(SRC.parent)}:{inner.lineno}")
    assert not found, found


# A function longer than this many lines (from its `def` to its last line, docstring included)
# says why in its docstring, on a line starting LONG_BECAUSE ("Long because it checks the keys
# one by one, in the order the user reads them."); else it is split by concern.
LONGEST_FUNCTION = 60
LONG_BECAUSE = "Long because"


def test_a_long_function_says_why():
    """No function of src/ is over LONGEST_FUNCTION lines without a line of its docstring
    starting LONG_BECAUSE: a long body is split by concern, or its docstring gives the reason
    (a linear list of checks, one table of cases, a constructor declaring the state)."""
    found = []
    for path in _files().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            reasoned = any(line.strip().startswith(LONG_BECAUSE) for line in doc.splitlines())
            if lines > LONGEST_FUNCTION and not reasoned:
                where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
                found.append(f"{where} {node.name} ({lines} lines)")
    assert not found, (
        f"over {LONGEST_FUNCTION} lines: split them by concern, or start a line of the "
        f"docstring with {LONG_BECAUSE!r} and the reason:\n" + "\n".join(found)
    )


def test_start_up_leaves_the_workers_imports_to_the_workers():
    """Every command's parent process (a refused config, a submitted job, torchrun's parent)
    imports neither the loop nor DTensor, FSDP or torch.distributed.checkpoint."""
    heavy = [*WORKER_ONLY, "torch.distributed.tensor", "torch.distributed.fsdp",
             "torch.distributed.checkpoint"]  # fmt: skip
    code = (
        "import sys, json, accel_train.cli, accel_train.launchers.launch\n"
        f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_help_and_a_misspelled_option_import_no_torch(run_cli):
    """`accel-train --help` and a config Hydra refuses end before torch is imported (3-4 s of
    CPU): Hydra's plugin scan imports hydra_plugins.accel_train_submitit, whose launcher module
    must not pull the launchers (and torch) in. PYTHONPROFILEIMPORTTIME lists every import."""
    env = {"PYTHONPROFILEIMPORTTIME": "1"}
    for args in (["--help"], ["model=no_such_model"]):
        proc = run_cli(args, env=env)
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()}
        assert "hydra" in imported and "torch" not in imported, (args, proc.returncode)
        if args == ["--help"]:
            assert proc.returncode == 0 and "strategy=" in proc.stdout
        else:
            assert proc.returncode != 0 and "no_such_model" in proc.stderr


def test_an_option_holds_only_its_own_keys(compose_cfg, tmp_path):
    local = compose_cfg(["launcher=local", f"paths.output_dir={tmp_path}"])
    assert "partition" not in local.launcher and "sbatch_extra" not in local.launcher
    assert "reshard_after_forward" not in compose_cfg([f"paths.output_dir={tmp_path}"]).strategy
    slurm = compose_cfg(["launcher=slurm", f"paths.output_dir={tmp_path}"])
    assert {"partition", "sbatch_extra", "nproc_per_node"} <= set(slurm.launcher)
    sgd = compose_cfg(["optimizer=sgd", f"paths.output_dir={tmp_path}"])
    assert "betas" not in sgd.optimizer and "momentum" in sgd.optimizer


# ---- the hot path: no device -> host sync between logging steps ---------------------------


class _StepMarks(Technique):
    """Records the sync count at each optimizer step (a callback, as users add them)."""

    name = "step_marks"

    def __init__(self, counter):
        self.counter, self.marks = counter, []

    def on_train_step_end(self, loop):
        self.marks.append((loop.step, len(self.counter)))


# A user's step in the normaliser form with its own metric (tests/task_steps.py): the task's
# metrics and the item count stay on the device too.
CUSTOM_STEP = [
    "task=custom",
    "task.step=task_steps.summed_step",
]


@pytest.mark.parametrize(
    "loader, task", [("device", []), ("torch", []), ("device", CUSTOM_STEP)], ids=str
)
def test_no_host_sync_between_logging_steps(loader, task, compose_cfg, tmp_path, monkeypatch):
    calls = count_host_reads(monkeypatch)
    marks = _StepMarks(calls)
    cfg = compose_cfg(
        [
            *FAST,
            *task,
            f"loader={loader}",
            "loader.batch_size=16",
            "trainer.max_steps=12",
            "trainer.log_every_n_steps=5",
            "trainer.limit_val_batches=2",
            "trainer.gradient_clip_val=1.0",
            "trainer.test_after_fit=false",
            "logger=none",
            f"paths.output_dir={tmp_path}",
        ]
    )
    cfg = resolve(cfg)
    with process_group("cpu") as env:
        parts = build_components(cfg, env)
        parts.techniques.append(marks)
        Loop(cfg, env, parts).fit()
    counts = dict(marks.marks)
    assert sorted(counts) == list(range(1, 13))
    per_step = {s: counts[s] - counts[s - 1] for s in range(2, 13)}
    # Steps 5 and 10 log (one .tolist() of the reduced stats); every other step reads nothing.
    # (Each mark is taken before that step's logging, so a logging step's sync shows up in the
    # count of the step after it.)
    quiet = {s: n for s, n in per_step.items() if s not in (6, 11)}
    assert all(n == 0 for n in quiet.values()), (
        str(sorted(quiet.items())),
        calls[counts[8] : counts[9]],
        parts.steps_per_epoch,
    )
    assert all(n == 0 for n in quiet.values()), (quiet, calls)


# ---- the loop never learns a task's name (issue 17) ---------------------------------------


def _task_names() -> set[str]:
    """The built-in tasks' option names and class names."""
    names = {p.stem for p in (SRC / "configs" / "task").glob("*.yaml")}
    for path in (SRC / "tasks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in (
                "Task",
                "Running",
                "TaskContext",
                "Predictions",  # (the interface's record of predicted classes)
            ):
                names.add(node.name)
    # `custom` is also a model, dataset and loss option (cfg.dataset.get("name", "custom")).
    return names - {"base", "custom"}


def test_the_loop_never_learns_a_tasks_name():
    """train/ talks to the task through accel_train.tasks' interface only: it imports no task
    module, names no task class or option, and branches on no task's type or name."""
    names = _task_names()
    assert {"classification", "regression", "model_loss", "Classification", "Custom"} <= names
    found = []
    for path in sorted((SRC / "train").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "accel_train.tasks."
            ):
                found.append(f"{where} imports {node.module}")
            if isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if name in names:
                    found.append(f"{where} names {name}")
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{where} spells {node.value!r}")
            is_isinstance = (
                isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance"
            )
            if is_isinstance and "task" in ast.unparse(node.args[0]):
                found.append(f"{where} branches on {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_no_import_cycle_inside_train():
    """loop -> auto_batch -> resume -> loop is gone: no module of train/ imports loop, not even
    for a type under TYPE_CHECKING (resume declares the Protocol it needs), and auto_batch does
    not import resume (the shared piece is train/found.py)."""
    for path in sorted((SRC / "train").glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        if path.stem != "loop":
            assert "accel_train.train.loop" not in imported, path.name
        if path.stem == "auto_batch":
            assert "accel_train.train.resume" not in imported


def test_the_config_groups_live_at_the_top_of_the_repository():
    """configs/ at the top is the one place the YAML groups are edited (as in
    lightning-hydra-template); the package reaches it through a link, so an editable install
    reads the same files (the wheel test checks that a wheel carries copies)."""
    repo = SRC.parents[1]
    link = SRC / "configs"
    assert link.is_symlink() and link.resolve() == (repo / "configs").resolve()
    assert (repo / "configs" / "train.yaml").is_file()
    from accel_train.config import CONFIG_DIR

    assert CONFIG_DIR.resolve() == (repo / "configs").resolve()


def test_every_config_group_uses_one_style():
    """Each group is an untyped slot of TrainConfig filled by its chosen option, and every
    option YAML names its own schema in `defaults:` (OPTION_SCHEMAS, or a logger's), so no
    group is typed one way and another group the other (issue 17)."""
    import dataclasses

    from accel_train.config import CONFIG_DIR
    from accel_train.config.schema import LOGGER_SCHEMAS, OPTION_SCHEMAS, TrainConfig, schema_name

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    groups = sorted(
        p.name
        for p in CONFIG_DIR.iterdir()
        if p.is_dir() and p.name not in ("hydra", "experiment", "debug", "hparams_search")
    )
    for group in groups:
        assert fields[group].type in ("Any", "dict[str, Any]"), group
        stores = {f"{name}_schema" for name in LOGGER_SCHEMAS}
        if group != "logger":
            assert group in OPTION_SCHEMAS, group
            stores = {schema_name(s) for s in OPTION_SCHEMAS[group].values()}
        for option in (CONFIG_DIR / group).glob("*.yaml"):
            text = option.read_text()
            named = [s for s in stores if f"- {s}" in text]
            assert named or option.stem == "none", f"{group}/{option.name} names no schema"


# ---- what the torch-free preflight knows without importing (launchers/preflight.py) ---------


def test_task_facts_are_the_task_classes_facts():
    """Each built-in task class inherits its facts (config/task_facts.py) and redeclares none:
    the config checks read the same data from the facts as from the class. Every task option
    is listed there, but the ones whose refusal asks more than the config (their own class)."""
    facts = [n for n in vars(TaskFacts) if not n.startswith("_")]
    for target, declared in BUILTIN_TASKS.items():
        cls = locate(target, "task._target_")
        assert issubclass(cls, declared) and cls.__name__ == declared.__name__, target
        for klass in cls.__mro__[: cls.__mro__.index(declared)]:
            assert not set(facts) & set(vars(klass)), f"{klass} redeclares a fact"
    assert not set(facts) & set(vars(Task))
    for path in sorted((SRC / "configs" / "task").glob("*.yaml")):
        target = str(OmegaConf.load(path)._target_)
        cls = locate(target, "task._target_")
        assert target in BUILTIN_TASKS or "config_refusal" in vars(cls), path.name


def test_preflight_knows_which_models_have_a_launch_time_step():
    """PLAIN_MODELS are exactly our model options' targets with no prepare_config."""
    options = [OmegaConf.to_container(OmegaConf.load(p)) for p in SRC.glob("configs/model/*.yaml")]
    ours = {o["_target_"] for o in options if o["_target_"].startswith(OUR_MODELS)}
    plain = {t for t in ours if not _is_source(OmegaConf.create({"_target_": t}))}
    assert plain == set(PLAIN_MODELS)


def test_the_lock_knows_which_launchers_submit():
    """launchers/names.SUBMITTED answers as each built-in launcher's submits_and_exits."""

    for name, answer in SUBMITTED.items():
        for submit in ("job", "train"):
            cfg = OmegaConf.create({"launcher": {"name": name, "submit": submit}})
            assert class_for("launcher", name)().submits_and_exits(cfg) == answer(cfg.launcher)

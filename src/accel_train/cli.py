"""Console entry points `accel-train`, `accel-eval` and `accel-export`: Hydra composes, errors
are reported as one paragraph (accel_train.errors).

Start-up speed: this module imports no torch. The launch and training packages (and torch,
3-4 s to import here) are imported inside the Hydra task functions, after Hydra has composed
the config and the checks that need no torch passed (launchers/preflight.py), so a misspelled
override or a refused config fails in well under a second. These deferred imports go
downward only (cli -> launch -> train); tests/test_architecture.py checks that nothing imports
cli.
"""

from __future__ import annotations

import shutil
import string
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from accel_train import plugins
from accel_train.command_checks import check_eval_config, check_export_config
from accel_train.commands import sweep_summary
from accel_train.commands.outputs import interrupts_exit
from accel_train.config import CONFIG_DIR, hydra_compose, hydra_errors
from accel_train.config.aliases import alias_overrides, apply_process_wide, eval_argv
from accel_train.config.free_text import take_free_text
from accel_train.config.hydra_errors import refuse_unknown_keys, report_config_errors
from accel_train.config.schema import (
    ConvertConfig,
    EvalConfig,
    ExportConfig,
    SampleConfig,
    ShardConfig,
    TokenizeConfig,
    register_configs,
)
from accel_train.environment import exit_without_teardown, register_resolvers
from accel_train.errors import UserError, report_user_errors
from accel_train.launchers.preflight import preflight
from accel_train.written import remove_empty, unwritable


def _check_config_dir() -> None:
    if not (CONFIG_DIR / "train.yaml").is_file():
        print(
            f"accel-train: error: the config directory {CONFIG_DIR} is missing: this "
            "installation of accel-train is incomplete (the configs ship inside the package). "
            "Reinstall it: `pip install --force-reinstall --no-deps accel-train` (or `pip install "
            ".` in the checkout).",
            file=sys.stderr,
        )
        sys.exit(2)


# Groups picked with `+group=NAME` (they have no default in train.yaml).
_ADDED_GROUPS = ("experiment", "debug")


def config_groups_help() -> str:
    """The config groups and their options for `accel-train --help`, the default starred.

    Read from the packaged config dir rather than Hydra's $APP_CONFIG_GROUPS, which would also
    list every option's typed schema (`mnist_cnn_schema`, ...) from the ConfigStore."""
    defaults: dict[str, Any] = {}
    for entry in OmegaConf.load(CONFIG_DIR / "train.yaml").get("defaults", []):
        if isinstance(entry, DictConfig):
            defaults.update(OmegaConf.to_container(entry))
    lines = []
    for group in sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        # The YAML options, and those the installed plugins registered (accel_train.plugins).
        registered = plugins.CLASSES.get(group.name, {})
        options = sorted({f.stem for f in group.glob("*.yaml")} | set(registered))
        marked = [f"{o}*" if defaults.get(group.name) == o else o for o in options]
        spelling = f"+{group.name}=" if group.name in _ADDED_GROUPS else f"{group.name}="
        lines.append(f"  {spelling:<17} {', '.join(marked)}")
        if len(options) > 1:  # each option with the first line of its file's comment
            lines += [f"      {o:<22} {_described(group / f'{o}.yaml')}" for o in marked]
    return "\n".join(lines)


def _described(path: Path, width: int = 70) -> str:
    """An option's one-line description: its YAML's first comment line, its first clause."""
    path = path.with_name(path.name.replace("*", ""))
    if not path.is_file():
        return "(a plugin's option)"
    comments = [ln for ln in path.read_text().splitlines() if ln.startswith("#")]
    first = next((ln for ln in comments if "@package" not in ln), "# ")
    text = first.lstrip("# ").strip()
    text = text.split(": `")[0].split(". ")[0].rstrip(":.")
    if text.count("(") > text.count(")"):  # a first line that ends inside its parenthesis
        text = text[: text.rfind("(")].rstrip(" ,:")
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


register_configs()
register_resolvers()
OmegaConf.register_new_resolver("accel_config_groups", config_groups_help, replace=True)
# Hydra's errors (composing, sweepers) as one paragraph: config/hydra_errors.py.
hydra_errors.install()
# Hydra composes a run's config twice (get_mode, then the run): once is enough.
hydra_compose.install()


def _sweep_failure(err: BaseException) -> str | None:
    """The paragraph for a sweeper that raised after its jobs ran (Optuna with every trial
    failed): the summary is written first, then what each job failed with."""
    if not sweep_summary.pending():
        return None
    sweep_summary.finish_pending()
    result = sweep_summary.last_result
    if result is None or not result.rows:
        return None
    return sweep_summary.failure_paragraph(result, stopped=err)


hydra_errors.sweep_failure = _sweep_failure


def _print_help(config_file: str) -> None:
    """`--help`: the `hydra.help.template` of our config, printed the way Hydra would, without
    Hydra's own `--help` path, which composes the whole config and lists every config group with
    every schema from the ConfigStore before it substitutes (seconds of CPU, thrown away)."""
    node = OmegaConf.load(CONFIG_DIR / config_file)
    template = node.hydra.help.template if "hydra" in node else node.help.template
    print(string.Template(template).safe_substitute())


def _wants_help(argv: list[str]) -> bool:
    return any(a in ("--help", "-h") for a in argv)


class FreshRunDir(Callback):
    """Before Hydra makes a single run's dir (it runs before the run dir lock,
    configs/hydra/default.yaml): refuses what it can refuse without the dir (tags that
    extras.enforce_tags wants, a run dir that cannot be made), and notes which folders Hydra is
    about to create, so that a config refused later takes them away again: a refused run
    leaves no folder behind (see _remove_fresh_run_dir). Its refusals exit from here: Hydra
    turns an exception of a callback into a warning and goes on."""

    @report_user_errors
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _fresh_run_dir
        hydra_errors.check_dir_resolves(config, "hydra.run.dir")
        if _enforce_tags and not config.get("tags"):
            _refuse_untagged()
        run_dir = OmegaConf.select(config, "hydra.run.dir")
        if run_dir is None:
            return
        _check_run_dir_writable(Path(run_dir))
        nodes = str(OmegaConf.select(config, "launcher.nnodes", default=1))
        # A multi-node run's dir is shared with the other nodes' launchers: never removed.
        if nodes == "1" and not Path(run_dir).exists():
            made = [p for p in reversed(Path(run_dir).absolute().parents) if not p.exists()]
            _fresh_run_dir = (Path(run_dir).absolute(), made)


def _check_run_dir_writable(run_dir: Path) -> None:
    """Hydra's own mkdir of an unwritable run dir (/proc/..., a read-only folder) ends in a
    traceback about its internals: refused here in one paragraph instead."""
    reason = None if run_dir.is_dir() else unwritable(run_dir)
    if reason is not None:
        raise UserError(
            f"hydra.run.dir={run_dir}: the run dir cannot be made there ({reason}). Set "
            "`hydra.run.dir` to a writable folder (or `paths.log_dir`, under which run dirs "
            "go by default)."
        )


# The run dir this process is about to create, and the folders above it it creates with it
# (outermost first), when the run dir is new.
_fresh_run_dir: tuple[Path, list[Path]] | None = None
# What a run dir holds before training writes anything: Hydra's files, the lock, the config.
_START_UP_FILES = {".lock", "config.yaml", "config_tree.txt", "train.log"}


def _remove_fresh_run_dir() -> None:
    """After a refusal: remove the run dir this process created, if it holds only start-up
    files, and the folders above it that this process created and that are left empty
    (outputs/<name>/, outputs/, or /runs/...: never one that was there before)."""
    if _fresh_run_dir is None or not _fresh_run_dir[0].is_dir():
        return
    run_dir, made = _fresh_run_dir
    names = {p.name for p in run_dir.iterdir()}
    if any(n not in _START_UP_FILES and not n.startswith(".hydra") for n in names):
        return  # something else was written: keep it for the user to see
    shutil.rmtree(run_dir, ignore_errors=True)
    remove_empty(made)


_enforce_tags = False  # extras.enforce_tags=true (an alias): a run must have tags


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="train")
def _train(cfg: DictConfig):
    if _enforce_tags and not cfg.get("tags"):  # a sweep's job (a single run: FreshRunDir)
        report_user_errors(_refuse_untagged)()
    if sweep_summary.in_multirun():
        from accel_train.commands.sweep import run_job  # deferred: see the module docstring

        # A sweep job: a failure is recorded in <job dir>/status.json and the sweep goes on.
        return run_job(cfg)
    return _train_single(cfg)


def _refuse_untagged() -> None:
    raise UserError(
        "extras.enforce_tags=true but the run has no tags: give some, e.g. "
        "`tags=[baseline,mnist]` (recorded in every logger and summary.json)."
    )


@report_user_errors
@report_config_errors
def _train_single(cfg: DictConfig):
    try:
        preflight(cfg)  # the refusals that need no torch (launchers/preflight.py)
        from accel_train.launchers.launch import launch  # deferred: see the module docstring

        return launch(cfg)
    except Exception as err:
        if hydra_errors.as_user_error(err) is not None:  # a UserError, or a config error
            _remove_fresh_run_dir()  # a refused config leaves no run dir behind
        raise


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="eval")
@report_user_errors
@report_config_errors
def _evaluate(cfg: DictConfig):
    refuse_unknown_keys(cfg, EvalConfig)
    check_eval_config(cfg)  # a wrong key fails before torch is imported
    from accel_train.train.evaluate import evaluate_checkpoint  # deferred: see the docstring

    evaluate_checkpoint(cfg)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="export")
@report_user_errors
@report_config_errors
def _export(cfg: DictConfig):
    refuse_unknown_keys(cfg, ExportConfig)
    check_export_config(cfg)  # a wrong key fails before torch is imported
    from accel_train.export import export_checkpoint  # deferred: see the module docstring

    export_checkpoint(cfg)


def train() -> None:
    global _enforce_tags
    _check_config_dir()
    report_user_errors(plugins.load_plugins)()  # their options exist before Hydra composes
    if _wants_help(sys.argv[1:]):
        _print_help("hydra/default.yaml")
        return
    # lightning-hydra-template's spellings (seed=, ckpt_path=, trainer=gpu, ...) become ours.
    aliased = report_user_errors(alias_overrides)(sys.argv[1:])
    sys.argv[1:] = aliased.argv
    apply_process_wide(aliased)
    _enforce_tags = aliased.enforce_tags
    if aliased.test_only is not None:  # train=false ckpt_path=...: test it, train nothing
        sys.argv[1:] = eval_argv(aliased)
        _evaluate()
        return
    sys.argv[1:] = debug_last(sys.argv[1:])
    report_user_errors(sweep_summary.check_plugins)(sys.argv[1:])
    try:
        _train()
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop (start-up, the test pass), where nothing is left to
        # save: one line and 130, as the loop's own stop exits (train/signals.py).
        print("accel-train: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        sweep_summary.finish_pending()  # the sweeper raised: still write the jobs' summary
    result = sweep_summary.last_result
    if result is not None and result.failed:
        print(f"accel-train: {sweep_summary.failure_paragraph(result)}", file=sys.stderr)
        sys.exit(1)


def debug_last(argv: list[str]) -> list[str]:
    """`+debug=NAME` moved just after the last `+experiment=NAME`: Hydra appends added groups
    in the order of the command line, so `+debug=fast_dev_run +experiment=gpt_char` would let
    the experiment's 2,000 steps override the smoke run's one batch. A debug mode applies after
    the experiment, whatever the order."""
    debug = [a for a in argv if a.startswith("+debug=")]
    rest = [a for a in argv if not a.startswith("+debug=")]
    experiments = [i for i, a in enumerate(rest) if a.startswith("+experiment=")]
    if not debug or not experiments:
        return argv
    at = experiments[-1] + 1
    return [*rest[:at], *debug, *rest[at:]]


def main() -> None:
    """The `accel-train` console script: `train()`, then, when it returned, the process ends
    without the interpreter's teardown (environment.exit_without_teardown: ~1.3 s of CPU after
    a fast_dev_run on a 2-core machine, BENCHMARKS.md section 9). Errors and interrupts
    (sys.exit) end the usual way; `train()` itself, called in-process (tests, scripts),
    returns as before. The other console scripts end the same way."""
    train()
    exit_without_teardown(0)


def _run_entry(task_function, config_file: str) -> None:
    """A plain entry point: the config dir checked, our own --help, else the Hydra task, and
    once it returned, the process ends without the interpreter's teardown (see main)."""
    _check_config_dir()
    report_user_errors(plugins.load_plugins)()  # a checkpoint may name a plugin's strategy
    if _wants_help(sys.argv[1:]):
        _print_help(config_file)
        return
    task_function()
    exit_without_teardown(0)


def evaluate() -> None:
    _run_entry(_evaluate, "eval.yaml")


def export() -> None:
    _run_entry(_export, "export.yaml")


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="tokenize")
@report_user_errors
@report_config_errors
def _tokenize(cfg: DictConfig):
    refuse_unknown_keys(cfg, TokenizeConfig)
    from accel_train.commands.tokenize import tokenize  # deferred: see the module docstring

    tokenize(cfg)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="sample")
@report_user_errors
@report_config_errors
def _sample(cfg: DictConfig):
    refuse_unknown_keys(cfg, SampleConfig)
    from accel_train.commands.sample import sample_checkpoint  # deferred: see the module docstring

    sample_checkpoint(cfg, _free_text)


# accel-sample's free-text keys: taken out of argv verbatim, never parsed as overrides
# (config/free_text.py): `prompt="def "` keeps its space, `prompt_file=PATH`, `prompt=-`; the
# same for chat=true's system message.
SAMPLE_FREE_TEXT = ("prompt", "system")
_free_text: dict[str, str] = {}  # this command's free-text values, by key


def sample() -> None:
    global _free_text
    if not _wants_help(sys.argv[1:]):
        argv, _free_text = report_user_errors(take_free_text)(sys.argv[1:], SAMPLE_FREE_TEXT)
        sys.argv[1:] = argv
    _run_entry(_sample, "sample.yaml")


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="shard")
@report_user_errors
@report_config_errors
def _shard(cfg: DictConfig):
    refuse_unknown_keys(cfg, ShardConfig)
    from accel_train.commands.shard import shard  # deferred: see the module docstring

    shard(cfg)


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="convert")
@report_user_errors
@report_config_errors
def _convert(cfg: DictConfig):
    refuse_unknown_keys(cfg, ConvertConfig)
    from accel_train.commands.convert import convert  # deferred: see the module docstring

    convert(cfg)


# `accel-data <command> key=value ...`: one Hydra config per command.
_DATA_COMMANDS = {
    "tokenize": (_tokenize, "tokenize.yaml"),
    "shard": (_shard, "shard.yaml"),
    "convert": (_convert, "convert.yaml"),
}


def data() -> None:
    argv = sys.argv[1:]
    command = argv[0] if argv else None
    if command not in _DATA_COMMANDS:
        if command in (None, "--help", "-h"):
            print("usage: accel-data COMMAND key=value ...   (accel-data COMMAND --help)")
            print(f"commands: {', '.join(_DATA_COMMANDS)}")
            return
        report_user_errors(_unknown_data_command)(command)
    run, config_file = _DATA_COMMANDS[command]
    sys.argv = [sys.argv[0], *argv[1:]]  # Hydra parses the overrides after the command
    with interrupts_exit("accel-data"):  # Ctrl-C: the partial output removed, then exit 130
        _run_entry(run, config_file)


def _unknown_data_command(command: str) -> None:
    raise UserError(
        f"{command!r} is not an accel-data command. The commands: {', '.join(_DATA_COMMANDS)} "
        "(e.g. `accel-data tokenize input=input.txt out=data/mytext`)."
    )

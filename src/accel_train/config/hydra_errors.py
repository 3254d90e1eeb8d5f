"""Hydra's and OmegaConf's errors as one-paragraph UserErrors: the one place that does it.

Hydra reports an error in composing the config (an unknown key, `~` of a typed key, a missing
option, an override it cannot parse) as several lines and exit 1, and an error raised in the
task function (an interpolation that does not resolve, a `+key` the schema does not have) as a
traceback. `as_user_error` turns each of these into a UserError that names the key and the fix;
`report_config_errors` wraps the task functions with it, and `install` puts `run_and_report`
in place of Hydra's own reporter, which handles what Hydra raises outside the task function
(composing, the sweepers). Anything else is reported the way Hydra would (a traceback for a
bug), and HYDRA_FULL_ERROR=1 still shows every traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from hydra.errors import (
    ConfigCompositionException,
    MissingConfigException,
    OverrideParseException,
    SearchPathException,
)
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    ConfigTypeError,
    GrammarParseError,
    InterpolationKeyError,
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from accel_train.config import CONFIG_DIR
from accel_train.config import schema as schema_module
from accel_train.config.aliases import RENAMED
from accel_train.config.facts import TASK_KEYS_REFUSED
from accel_train.errors import UserError


def _prog() -> str:
    prog = os.path.basename(sys.argv[0]) or "accel-train"
    return "accel-train" if prog.endswith(".py") or prog == "-m" else prog


# (accel-report has no --cfg: it takes accel-train's overrides)
_SHOWS_KEYS = _prog() if _prog() in ("accel-eval", "accel-export") else "accel-train"
SEE_KEYS = f"`{_SHOWS_KEYS} --cfg job` prints every key"


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def _message(err: OmegaConfBaseException) -> str:
    """OmegaConf's message without its `full_key: ... object_type=...` trailer."""
    msg = getattr(err, "msg", None) or str(err)
    return one_line(msg.split("\n    full_key:")[0])


def _with_value(full_key: str, err: OmegaConfBaseException) -> str:
    """`key=value` as written (the interpolation unresolved), where OmegaConf kept the node."""
    node = getattr(err, "child_node", None)
    try:
        raw = node._value() if node is not None else None  # noqa: SLF001 - no public accessor
    except Exception:  # noqa: BLE001 - only for the message
        raw = None
    return f"{full_key}={raw}" if isinstance(raw, str) else full_key


def _group_and_leaf(full_key: str) -> tuple[str, str]:
    group, _, leaf = full_key.rpartition(".")
    return group, leaf


def _schema_keys(err: OmegaConfBaseException) -> list[str]:
    """The keys the node the error is about may hold (its dataclass's fields)."""
    for candidate in (getattr(err, "object_type", None), getattr(err, "ref_type", None)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return [f.name for f in dataclasses.fields(candidate)]
    return []


def _unknown_key(
    full_key: str, err: OmegaConfBaseException | None, verb: str, keys: list[str] | None = None
) -> UserError:
    group, leaf = _group_and_leaf(full_key)
    keys = _schema_keys(err) if keys is None and err is not None else (keys or [])
    if leaf in keys:  # a key of the schema that is not there: deleted with `~`
        return UserError(
            f"{full_key} is missing from the config (deleted with `~{full_key}`?), but it is "
            f"part of the schema and is read. Set it instead (`{full_key}=...`; {SEE_KEYS} "
            "with its default)."
        )
    if (
        full_key in RENAMED and _prog() == "accel-train"
    ):  # an LHT key: its alias works on the command line only
        ours = RENAMED[full_key]
        nested = "..."
        for part in reversed(ours.split(".")):
            nested = f"{{{part}: {nested}}}"
        return UserError(
            f"{full_key} is lightning-hydra-template's key; accel-train's is {ours}. "
            f"`{full_key}=...` works on the command line (an alias), but in a YAML file write "
            f"`{nested[1:-1]}`."
        )
    where = group or "the top level of the config"
    prefix = f"{group}." if group else ""
    close = difflib.get_close_matches(leaf, keys, n=3, cutoff=0.6)
    if close:
        hint = f"Did you mean {', '.join(f'`{prefix}{k}`' for k in close)}? {SEE_KEYS}."
    elif 0 < len(keys) <= 15:
        hint = f"Its keys: {', '.join(keys)}."
    else:
        hint = f"{SEE_KEYS}."
    added = (
        " (`+key=value` adds only arguments of your own classes: under model, dataset, loss, "
        "task and callbacks)"
        if verb == "added"
        else ""
    )
    other_task = _other_task_key(err, group, leaf) if group == "task" else None
    if other_task:
        return UserError(other_task)
    if verb == "set" and group in ("model", "dataset", "loss", "task"):
        # Hydra's `+` adds the key; typed() lets these groups' extra keys through.
        return UserError(
            f"{full_key} is not a key of {group} yet: to pass a new argument to your "
            f"{group}'s class, add it with a `+`: `+{full_key}=...`. {hint}"
        )
    return UserError(
        f"{full_key} is not a key of {where}, whose keys are fixed by its schema, so it cannot "
        f"be {verb}{added}. {hint}"
    )


def _key_of_other_options(config: str, full_key: str, schema: Any) -> str | None:
    """A config file (a recipe: experiment/gpt_char) that sets a key which the run's option of
    the group lacks but other options have (dataset.windows_per_epoch: dataset=tokens, not
    dataset=streaming_tokens): the recipe is written for those options; say so."""
    group, leaf = _group_and_leaf(full_key)
    options = schema_module.OPTION_SCHEMAS.get(group, {})
    ours = next((name for name, cls in options.items() if cls is schema), None)
    having = sorted(
        name
        for name, cls in options.items()
        if _is_dataclass(cls) and leaf in {f.name for f in dataclasses.fields(cls)}
    )
    if ours is None or not having:
        return None
    written = ", ".join(f"{group}={name}" for name in having)
    return (
        f"{config}.yaml sets {full_key}, a key of {written} that this run's {group}={ours} "
        f"does not have: that line of the recipe is written for {written}, and {group}={ours} "
        f"has nothing it could mean. Run the recipe with {written} (its own), or, for "
        f"{group}={ours}, copy {config}.yaml into a config folder of your own without the "
        f"`{leaf}` line and run it from there (`hydra.searchpath=[file://<folder>]`)."
    )


def _other_task_key(err: OmegaConfBaseException | None, group: str, leaf: str) -> str | None:
    """`task.<leaf>` is a key of another built-in task than the run's: say so (and why the run's
    task refuses it, where TASK_KEYS_REFUSED knows), rather than suggest `+task.<leaf>`."""
    options = schema_module.OPTION_SCHEMAS.get("task", {})
    schema = getattr(err, "object_type", None) if err is not None else None
    ours = next((name for name, cls in options.items() if cls is schema), None)
    # The base schema (model_loss's) also types a task class of the user's own: its key may be
    # that class's own argument (`+task.<leaf>`), so the usual message stands there.
    base = any(cls is not schema and issubclass(cls, schema) for cls in options.values())
    having = [n for n, cls in options.items() if leaf in {f.name for f in dataclasses.fields(cls)}]
    if ours is None or base or not having:
        return None
    why = TASK_KEYS_REFUSED.get((ours, leaf))
    if why:
        return f"{group}.{leaf} with task={ours}: {why}"
    return (
        f"{group}.{leaf} is a key of task={', task='.join(having)}, not of task={ours} (this "
        f"run's task), which does not read it. Drop `{group}.{leaf}`, or pick a task that has "
        f"it (`task={having[0]}`)."
    )


def _is_dataclass(obj: Any) -> bool:
    return isinstance(obj, type) and dataclasses.is_dataclass(obj)


def _missing_option(err: MissingConfigException) -> UserError:
    text = str(err)
    found = re.search(r"Could not (?:find|load) '([^']+)'", text)
    options = re.findall(r"^\t(\S+)$", text.split("Config search path:")[0], re.M)
    if found and not options:  # `Could not load` (an option in a list) lists none
        group = found.group(1).rpartition("/")[0]
        options = [p.stem for p in (CONFIG_DIR / group).glob("*.yaml")] if group else []
    options = sorted(o for o in options if not o.endswith("_schema"))
    if found is None:
        return UserError(one_line(text.split("Config search path:")[0]))
    path = found.group(1)
    group, _, option = path.rpartition("/")
    if not group:
        return UserError(
            f"no config {path!r} in the config search path (hydra.searchpath, --config-dir). "
            "Check the name and the directories given."
        )
    listed = f" Options: {', '.join(options)}." if options else ""
    close = difflib.get_close_matches(option, options, n=3, cutoff=0.6)
    if close:  # a misspelling (strategy=fdsp): the nearest options first
        listed = f" Did you mean {' or '.join(f'`{group}={o}`' for o in close)}?{listed}"
    return UserError(
        f"{group}={option}: the config group {group} has no option {option} (no {path}.yaml in "
        f"the config search path).{listed} An option of your own goes into "
        f"<your config dir>/{group}/{option}.yaml with `hydra.searchpath=[file://<your config "
        "dir>]`."
    )


def _composition(err: ConfigCompositionException) -> UserError | None:
    text, cause = one_line(str(err)), err.__cause__
    override = re.search(r"(?:override|Could not override) '?([^'\s]+)'?", text)
    given = override.group(1) if override else None
    if isinstance(cause, OmegaConfBaseException):
        full_key = getattr(cause, "full_key", None) or (given or "").lstrip("+~")
        if isinstance(cause, ConfigTypeError) and "does not support deletion" in str(cause):
            return UserError(
                f"~{full_key}: {full_key} is part of its group's schema and cannot be deleted. "
                f"Set it to another value instead (`{full_key}=...`; {SEE_KEYS} with its "
                "default)."
            )
        if isinstance(cause, ConfigKeyError | ConfigAttributeError) and "not in" in str(cause):
            return _unknown_key(full_key, cause, "set")
        if isinstance(cause, ValidationError):
            return UserError(
                f"{given or full_key}: {_message(cause)}. Give {full_key} a value of its type "
                f"({SEE_KEYS} with its default)."
            )
        return UserError(f"{given or full_key}: {_message(cause)}. {SEE_KEYS}.")
    composing = re.search(
        r"In '([^']+)': \w+ raised while composing config: (.*?) full_key: (\S+)", text
    )
    if composing is not None:  # a key in a config file (an experiment, an option of the user's)
        config, _, full_key = composing.groups()
        schema_name = re.search(r"object_type=(\w+)", text)
        schema = getattr(schema_module, schema_name.group(1), None) if schema_name else None
        keys = [f.name for f in dataclasses.fields(schema)] if _is_dataclass(schema) else []
        other = _key_of_other_options(config, full_key, schema)
        if other:
            return UserError(other)
        return UserError(f"{config}.yaml: {_unknown_key(full_key, None, 'set', keys)}")
    if "appears more than once" in text:
        group = text.split(" appears")[0]
        return UserError(
            f"{text}: pick one option per config group, once (`{group}=...` or `+{group}=...`, "
            "not both)."
        )
    # Any other composition error: Hydra's own text, on one line.
    return UserError(f"{text}.".replace("..", "."))


def as_user_error(err: BaseException) -> UserError | None:
    """The one-paragraph error for a config error of Hydra's or OmegaConf's (None: not one)."""
    if isinstance(err, UserError):
        return err
    if isinstance(err, MissingConfigException):
        return _missing_option(err)
    if isinstance(err, OverrideParseException):
        return UserError(
            f"an override could not be parsed: {one_line(str(err).split('See https')[0])}. "
            "Quote a value with spaces, brackets or `$` for the shell (e.g. "
            "`'trainer.stop_at=val/acc>=0.99'`, `'tags=[a,b]'`); Hydra's override grammar: "
            "https://hydra.cc/docs/advanced/override_grammar/basic/."
        )
    if isinstance(err, SearchPathException):
        return UserError(f"{one_line(str(err))}. Check hydra.searchpath (file://<dir>).")
    if isinstance(err, ConfigCompositionException):
        return _composition(err)
    if not isinstance(err, OmegaConfBaseException):
        return None
    full_key = getattr(err, "full_key", None) or "the config"
    if isinstance(err, InterpolationKeyError | GrammarParseError) or (
        isinstance(err, InterpolationResolutionError) and not isinstance(err, ValidationError)
    ):
        return UserError(
            f"{_with_value(full_key, err)}: its value does not resolve ({_message(err)}). An "
            "interpolation "
            "`${a.b}` must name a key of the config (or a resolver such as `${oc.env:VAR}` with "
            "a set variable); to pass a literal `${...}` through (e.g. to a SLURM job's shell), "
            "escape it for the shell as `\\${...}` inside single quotes."
        )
    if isinstance(err, ConfigKeyError | ConfigAttributeError) and "not in" in _message(err):
        return _unknown_key(full_key, err, "added")
    if isinstance(err, MissingMandatoryValue):
        return UserError(
            f"{full_key} is required (it is ??? in the config) but was not given. Set it on the "
            f"command line, e.g. `{full_key}=...`."
        )
    if isinstance(err, ValidationError):
        return UserError(f"{full_key}: {_message(err)}. Give it a value of its type.")
    return UserError(f"{full_key}: {_message(err)}. {SEE_KEYS}.")


def check_dir_resolves(config: Any, key: str) -> None:
    """Before Hydra makes the run (or sweep) dir: if `key` (hydra.run.dir, hydra.sweep.dir)
    does not resolve, name the user's key that breaks it (the dir is made from `name`, ...)
    in one paragraph and exit 2, rather than Hydra's error about its own key."""
    from omegaconf import OmegaConf

    try:
        OmegaConf.select(config, key, throw_on_resolution_failure=True)
        return
    except OmegaConfBaseException as err:
        found: UserError | None = as_user_error(err)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    for top in config:
        if top == "hydra":
            continue
        try:
            OmegaConf.to_container(OmegaConf.masked_copy(config, [top]), resolve=True)
        except OmegaConfBaseException as err:
            if "HydraConfig was not set" not in str(err):  # ${hydra:...}: resolved later
                found = as_user_error(err)
                break
    if found is not None:
        print_user_error(found)


def report_config_errors(fn: Callable) -> Callable:
    """Raise a config error of Hydra's or OmegaConf's from `fn` as its UserError."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (OmegaConfBaseException, ConfigCompositionException) as err:
            user = as_user_error(err)
            if user is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            raise user from err

    return wrapper


def refuse_unknown_keys(cfg: Any, schema: type) -> None:
    """A key added with `+` to a config of fixed keys (accel-eval's, accel-export's), which
    Hydra's struct mode lets through: refused as an unknown key would be."""
    keys = [f.name for f in dataclasses.fields(schema)]
    for key in cfg:
        if key not in keys and key != "hydra":
            close = difflib.get_close_matches(str(key), keys, n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(f'`{k}`' for k in close)}?" if close else ""
            raise UserError(
                f"{key} is not a key of {_prog()}'s config, whose keys are fixed, so it cannot "
                f"be added.{hint} Its keys: {', '.join(keys)}."
            )


def print_user_error(err: UserError | str, code: int = 2) -> None:
    """One paragraph on stderr, as accel_train.errors.report_user_errors prints it, and exit."""
    print(f"{_prog()}: error: {err}\n(Set HYDRA_FULL_ERROR=1 for the traceback.)", file=sys.stderr)
    sys.exit(code)


# Called, when a sweeper raised, before the error is reported: returns the paragraph that says
# what the sweep's jobs did instead of the sweeper's traceback (set by the CLI; None: no sweep).
sweep_failure: Callable[[BaseException], str | None] | None = None


def run_and_report(func: Callable[[], Any]) -> Any:
    """Hydra's `run_and_report`, with config errors and failed sweeps as one paragraph."""
    try:
        return func()
    except Exception as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        paragraph = sweep_failure(err) if sweep_failure is not None else None
        if paragraph is not None:
            print_user_error(paragraph, code=1)
        user = as_user_error(err)
        if user is not None:
            print_user_error(user)
        failed = err
    return _hydra_run_and_report(functools.partial(_reraise, failed))


def _reraise(err: BaseException) -> None:
    raise err


_hydra_run_and_report: Callable[[Callable[[], Any]], Any]


def install() -> None:
    """Put run_and_report in place of Hydra's (hydra.main looks it up at each call)."""
    global _hydra_run_and_report
    import hydra._internal.utils as hydra_utils

    current = getattr(hydra_utils, "run_and_report", None)
    if current is None:  # another Hydra: its own reporting, with the task functions' paragraphs
        return
    if current is not run_and_report:
        _hydra_run_and_report = current
        hydra_utils.run_and_report = run_and_report

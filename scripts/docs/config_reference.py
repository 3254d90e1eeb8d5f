"""Write docs/reference/config.md: every config group, option, key, default and its one-line
comment, generated from the packaged configs, never edited by hand.

    python scripts/docs/config_reference.py            # rewrite docs/reference/config.md
    python scripts/docs/config_reference.py --out F    # write elsewhere (tests/test_docs.py)

Values come from Hydra composing each option with its schema (so a key the YAML leaves to the
schema's default is listed too, with that default); comments come from the option's YAML (the
comment on a key's line, else the comment lines right above it) and, for keys the YAML does not
comment, from config/schema/ (the comment on or right above the dataclass field). Groups are the
folders of configs/, whatever way each is typed (a TrainConfig field or OPTION_SCHEMAS).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from accel_train.config import CONFIG_DIR, schema
from accel_train.config.schema import register_configs
from accel_train.environment import register_resolvers

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "reference" / "config.md"
# Hydra's own settings (run dirs, logging, --help text): not training options.
SKIPPED_GROUPS = ("hydra",)
# The config files of the other entry points, with the command that reads each.
ENTRY_CONFIGS = {
    "eval.yaml": "accel-eval",
    "export.yaml": "accel-export",
    "sample.yaml": "accel-sample",
    "tokenize.yaml": "accel-data tokenize",
}

_KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[^\s#:][^:#]*?):(?P<rest>.*)$")


# ---- comments -------------------------------------------------------------------------------


def _split_comment(rest: str) -> tuple[str, str]:
    """`value  # comment` -> (value, comment); a '#' inside quotes is part of the value."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i].strip(), rest[i + 1 :].strip()
    return rest.strip(), ""


def yaml_comments(path: Path) -> tuple[str, dict[str, str]]:
    """The file's header comment and {dotted key: comment} for its keys (`defaults` and block
    scalars skipped)."""
    header: list[str] = []
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    above: list[str] = []
    in_header, block_indent = True, None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if block_indent is not None:  # inside a `|` block scalar
            if stripped and indent <= block_indent:
                block_indent = None
            else:
                continue
        if stripped.startswith("#"):
            text = stripped.lstrip("#").strip()
            if in_header and not text.startswith("@package"):
                header.append(text)
            elif not in_header:
                above.append(text)
            continue
        if not stripped:
            in_header = in_header and not header
            above = []
            continue
        in_header = False
        if stripped.startswith("- "):
            above = []
            continue
        match = _KEY.match(line)
        if not match:
            above = []
            continue
        key = match["key"].strip().strip("'\"")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value, comment = _split_comment(match["rest"])
        dotted = ".".join([k for _, k in stack] + [key])
        if not dotted.startswith(("defaults", "hydra.help")):
            comments[dotted] = comment or " ".join(above)
        above = []
        if value in ("|", "|-", ">", ">-"):
            block_indent = indent
        elif not value:
            stack.append((indent, key))
    return " ".join(header), comments


def schema_comments() -> dict[tuple[str, str], str]:
    """{(dataclass name, field): comment} from config/schema/: the comment on the field's line,
    else the comment lines directly above it."""
    found: dict[tuple[str, str], str] = {}
    for path in sorted(Path(schema.__file__).parent.glob("*.py")):
        found |= _module_comments(path)
    return found


def _module_comments(path: Path) -> dict[tuple[str, str], str]:
    lines = path.read_text().splitlines()
    found: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            _, inline = _split_comment(lines[item.lineno - 1].split(":", 1)[1])
            above, i = [], item.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            found[(node.name, item.target.id)] = inline or " ".join(above)
    return found


def _field_comment(node: Any, key: str, comments: dict[tuple[str, str], str]) -> str:
    """The schema comment of `key` in the dataclass that types `node` (or one of its bases)."""
    if not isinstance(node, DictConfig):
        return ""
    typ = OmegaConf.get_type(node)
    if not (isinstance(typ, type) and dataclasses.is_dataclass(typ)):
        return ""
    for cls in typ.__mro__:
        if comments.get((cls.__name__, key)):
            return comments[(cls.__name__, key)]
    return ""


# ---- values -----------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(value: Any) -> str:
    text = _fmt(value)
    return f"`{_cell(text)}`" if text else "`''`"


def _raw(node: DictConfig, key: Any) -> Any:
    """A value as written: interpolations unresolved, `???` for a required one."""
    child = node._get_node(key)
    if isinstance(child, (DictConfig, ListConfig)):
        return OmegaConf.to_container(child, resolve=False)
    return child._value()


def _rows(
    node: Any, prefix: str, yaml_notes: dict[str, str], notes, out: list[str], group_notes=None
) -> None:
    """Table rows of a composed node: nested mappings flattened to dotted keys."""
    group_notes = group_notes or {}
    for key in node:
        dotted = f"{prefix}{key}"
        child = node._get_node(key)
        if isinstance(child, DictConfig) and len(child) and not child._is_interpolation():
            _rows(child, f"{dotted}.", yaml_notes, notes, out, group_notes)
            continue
        note = (
            yaml_notes.get(dotted)
            or _field_comment(node, str(key), notes)
            or group_notes.get(dotted)
            or ("this option's name" if dotted == "name" else "")
        )
        out.append(f"| `{dotted}` | {_code(_raw(node, key))} | {_cell(note)} |")


def _table(rows: list[str]) -> list[str]:
    if not rows:
        return ["(no keys of its own)", ""]
    return ["| key | default | what it does |", "| --- | --- | --- |", *rows, ""]


# ---- the page ---------------------------------------------------------------------------------


def _is_global(path: Path) -> bool:
    return any(line.strip() == "# @package _global_" for line in path.read_text().splitlines()[:3])


def _defaults_list(path: Path) -> list[str]:
    """The `override /group: option` entries of a _global_ option, as `group=option`."""
    data = OmegaConf.load(path)
    picks = []
    for item in data.get("defaults", []):
        if isinstance(item, DictConfig):
            for k, v in item.items():
                picks.append(f"{str(k).replace('override ', '').lstrip('/')}={v}")
    return picks


def _global_option(path: Path, yaml_notes: dict[str, str]) -> list[str]:
    """An option that sets keys across groups (an experiment, a debug mode): what it sets."""
    data = OmegaConf.load(path)
    lines = []
    picks = _defaults_list(path)
    if picks:
        lines += ["Picks " + ", ".join(f"`{p}`" for p in picks) + ".", ""]
    rows: list[str] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for key in node:
            if prefix == "" and key == "defaults":
                continue
            value = node._get_node(key)
            dotted = f"{prefix}{key}"
            if isinstance(value, DictConfig) and len(value) and not dotted.endswith("params"):
                walk(value, f"{dotted}.")
                continue
            raw = (
                OmegaConf.to_container(value, resolve=False)
                if isinstance(value, (DictConfig, ListConfig))
                else value._value()
            )
            rows.append(f"| `{dotted}` | {_code(raw)} | {_cell(yaml_notes.get(dotted, ''))} |")

    walk(data, "")
    return lines + _table(rows)


def generate() -> str:
    register_configs()
    register_resolvers()
    notes = schema_comments()
    train_yaml = CONFIG_DIR / "train.yaml"
    out = [
        "# Config reference",
        "",
        "<!-- Generated by scripts/docs/config_reference.py from configs/ and "
        "src/accel_train/config/schema/: do not edit; run `python "
        "scripts/docs/config_reference.py`. -->",
        "",
        "Every config group of `accel-train` (the folders of `configs/`), every option, and each "
        "option's keys with their defaults and one-line descriptions. Pick an option with "
        "`group=option` (`+group=option` for the groups that are not in `train.yaml`'s defaults, "
        "`experiment` and `debug`), set a "
        "key with `group.key=value` ([Configuration](../configuration.md)). `???` marks a value "
        "you must give; `${...}` is an interpolation, resolved when the run starts.",
        "",
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
        base = compose(config_name="train")
        defaults = {}
        header, top_notes = yaml_comments(train_yaml)
        for item in OmegaConf.load(train_yaml).defaults:
            if isinstance(item, DictConfig):
                for k, v in item.items():
                    defaults[str(k)] = v
        groups = sorted(
            p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name not in SKIPPED_GROUPS
        )
        out += ["## `train.yaml`: the top-level keys", "", header, ""]
        rows = []
        for key in base:
            if key in groups:
                continue
            value = base._get_node(key)._value()
            raw = (
                OmegaConf.to_container(value, resolve=False)
                if isinstance(value, (DictConfig, ListConfig))
                else value
            )
            note = top_notes.get(str(key)) or _field_comment(base, str(key), notes)
            rows.append(f"| `{key}` | {_code(raw)} | {_cell(note)} |")
        out += _table(rows)
        # A key an option's YAML leaves uncommented takes its group's comment on that key from
        # another option (e.g. `dataset.mean`), if the schema has none either.
        group_notes: dict[str, dict[str, str]] = {}
        for group in groups:
            merged: dict[str, str] = {}
            for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
                for key, note in yaml_comments(path)[1].items():
                    if note and key not in merged:
                        merged[key] = note
            group_notes[group] = merged
        out += ["## Groups", "", "| group | options | default |", "| --- | --- | --- |"]
        for group in groups:
            options = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
            links = ", ".join(f"[`{o}`](#{group}-{o.replace('_', '-')})" for o in options)
            out.append(f"| [`{group}`](#{group}) | {links} | `{_fmt(defaults.get(group, '-'))}` |")
        out.append("")
        for group in groups:
            out += [f"## `{group}` {{ #{group} }}", ""]
            for path in sorted((CONFIG_DIR / group).glob("*.yaml")):
                option = path.stem
                header, yaml_notes = yaml_comments(path)
                anchor = f"{group}-{option.replace('_', '-')}"
                plus = "" if group in defaults else "+"
                out += [f"### `{plus}{group}={option}` {{ #{anchor} }}", ""]
                if header:
                    out += [header, ""]
                if _is_global(path):
                    out += _global_option(path, yaml_notes)
                    continue
                cfg = compose(config_name="train", overrides=[f"{plus}{group}={option}"])
                node = cfg.get(group)
                # Options that sit under their own name (logger=csv -> logger.csv.*).
                prefix = f"{group}."
                rows = []
                if isinstance(node, DictConfig):
                    _rows(node, "", yaml_notes, notes, rows, group_notes[group])
                out += _table([r.replace("| `", f"| `{prefix}", 1) for r in rows])
        for name, command in ENTRY_CONFIGS.items():
            path = CONFIG_DIR / name
            if not path.is_file():
                continue
            header, yaml_notes = yaml_comments(path)
            cfg = compose(config_name=path.stem)
            rows = []
            _rows(cfg, "", yaml_notes, notes, rows)
            anchor = path.stem
            out += [f"## `{name}`: `{command}` {{ #{anchor} }}", "", header, "", *_table(rows)]
    GlobalHydra.instance().clear()
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(generate())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

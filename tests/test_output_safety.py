"""What a command may write (issue 39), through the real console scripts: nothing a command did
not write is removed or replaced, whatever `overwrite` says (a file with an output's name is not
proof: the folder's manifest is); a refused command writes nothing; an output path nothing can
be written to is one paragraph; the careless inputs around model=hf name the file at fault.
Tiny data: a token folder, and one 1-step run of a 1-layer GPT-2 with 64 learned positions
(model=hf), shared by the module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import check_ok, run_cli
from hf_fixtures import write_records, write_tiny_gpt2
from omegaconf import OmegaConf

from accel_train.commands.sample import _fit_positions
from accel_train.errors import UserError
from accel_train.export_hf import refuse_read_folders

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60))
MANIFEST = "accel_train.written.json"


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """base/ (the GPT-2 folder, with the card an earlier accel-export leaves: a base that is
    itself an export), records.jsonl, run/ (one step of model=hf on them; its arguments in
    run.json) and tok/ (a BPE token folder of TEXT)."""
    root = tmp_path_factory.mktemp("output-safety")
    base = write_tiny_gpt2(root / "base")
    (base / "accel_export.json").write_text(json.dumps({"format": "hf"}) + "\n")
    records = write_records(root / "records.jsonl", 8)
    run = [
        "task=language_model",
        "model=hf",
        f"model.path={base}",  # absolute: a copy of the run elsewhere still finds it
        "dataset=sft",
        f"dataset.path={records}",
        f"dataset.val_path={records}",
        "dataset.max_length=48",
        "loader.batch_size=4",
        "trainer.max_steps=1",
        "trainer.progress=none",
        "logger=none",
    ]
    check_ok(run_cli([*run, "hydra.run.dir=run"], root))
    (root / "run.json").write_text(json.dumps(run))
    (root / "input.txt").write_text(TEXT)
    tokenize = ["tokenize", "input=input.txt", "out=tok", "tokenizer=bpe", "vocab_size=300"]
    check_ok(run_cli(tokenize, root, prog="accel-data"))
    return root


def files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


def _refused(proc, *expected: str) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for text in expected:
        assert text in proc.stderr, f"{text!r} not in:\n{proc.stderr[-3000:]}"


def _data(cwd: Path, *args: str):
    return run_cli(list(args), cwd, prog="accel-data")


def _export(cwd: Path, ws: Path, *args: str):
    ckpt = ws / "run" / "checkpoints" / "last.pt"
    return run_cli([f"ckpt_path={ckpt}", "format=hf", *args], cwd, prog="accel-export")


# ---- the user's files survive every command over every output kind ------------------------


def _token_folder(cwd: Path, ws: Path) -> tuple[Path, list]:
    out = Path(shutil.copytree(ws / "tok", cwd / "out"))  # copy2: the times the manifest holds
    # char this time: the BPE's tokenizer.json, tokenize's own, goes
    args = [f"input={ws / 'input.txt'}", "out=out", "overwrite=true"]
    return out, [lambda: _data(cwd, "tokenize", *args)]


def _shard_set(cwd: Path, ws: Path) -> tuple[Path, list]:
    shard = ["shard", "dataset=tokens", f"dataset.path={ws / 'tok'}", "out=out"]
    check_ok(_data(cwd, *shard, "chunk_bytes=1KB"))
    # Bigger chunks this time: fewer chunk files, the others (shard's own) go.
    return cwd / "out", [lambda: _data(cwd, *shard, "chunk_bytes=64KB", "overwrite=true")]


def _export_folder(cwd: Path, ws: Path) -> tuple[Path, list]:
    check_ok(_export(cwd, ws, "out_path=out"))
    return cwd / "out", [lambda: _export(cwd, ws, "out_path=out", "overwrite=true")]


def _run_dir(cwd: Path, ws: Path) -> tuple[Path, list]:
    run = Path(shutil.copytree(ws / "run", cwd / "out"))
    args = [*json.loads((ws / "run.json").read_text()), "hydra.run.dir=out"]
    return run, [lambda: run_cli([*args, "resume=auto", "trainer.max_steps=2"], cwd)]


KINDS = [_token_folder, _shard_set, _export_folder, _run_dir]


@pytest.mark.parametrize("kind", KINDS, ids=lambda f: f.__name__[1:])
def test_the_users_files_survive_every_command_over_every_output(kind, ws, tmp_path):
    """A README beside the output and a file in a folder of its own (where shard writes its
    splits): byte-identical after the command that wrote the output ran again over it with
    overwrite=true (resume=auto for a run dir), and the command did its work. tokenize, shard
    and format=hf removed them (issue 39)."""
    out, again = kind(tmp_path, ws)
    mine = {"README.md": b"# my notes\n", "train/extra/mine.txt": b"\x00mine\xff"}
    if kind is _run_dir:
        mine["checkpoints/mine.txt"] = b"keep"
    for rel, data in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    for command in again:
        check_ok(command())
        assert {rel: (out / rel).read_bytes() for rel in mine if (out / rel).is_file()} == mine
    if kind is not _run_dir:  # all of it the command's (listed) or the user's: stale ones gone
        listed = json.loads((out / MANIFEST).read_text())["files"]
        assert set(files(out)) == {*listed, *mine, MANIFEST}


# ---- a file with an output's name is not the command's --------------------------------------


def test_overwrite_never_takes_files_that_only_look_like_an_output(ws, tmp_path):
    """tokenize overwrite=true replaced a user's own tokenizer.json and train.bin (a folder of
    only those names) (issue 39). shard and format=hf decide by the same list (written.py)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text('{"my": "tokenizer"}')
    (mine / "train.bin").write_bytes(b"my tokens")
    tokenize = ["tokenize", f"input={ws / 'input.txt'}", "out=mine", "overwrite=true"]
    _refused(_data(tmp_path, *tokenize), "out=mine holds files accel-data tokenize did not write")
    assert files(mine) == {"tokenizer.json": b'{"my": "tokenizer"}', "train.bin": b"my tokens"}


def test_export_never_writes_onto_the_checkpoints_base(ws, tmp_path):
    """out_path=<model.path of the run> overwrite=true replaced the base's weights when the base
    was itself an earlier export (its card there) (issue 39)."""
    base = ws / "base"
    before = files(base)
    proc = _export(tmp_path, ws, f"out_path={base}", "overwrite=true")
    _refused(proc, f"out_path={base} is model.path={base}", "whatever `overwrite` says")
    assert files(base) == before


@pytest.mark.parametrize(
    ("out", "where"), [("base", "is"), (".", "holds"), ("base/merged", "is inside")]
)
def test_the_folders_around_the_base_are_refused_too(out, where, tmp_path, monkeypatch):
    """The same check as the CLI's above, for the folder holding the base and one inside it."""
    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"model": {"path": "base"}, "dataset": {}})
    with pytest.raises(UserError, match=f"out_path={out} {where} model.path=base"):
        refuse_read_folders(Path(out), cfg, Path("run/checkpoints/last.pt"), out)
    refuse_read_folders(Path("base-merged"), cfg, Path("run/checkpoints/last.pt"), "base-merged")


# ---- a refused command writes nothing; an unwritable output is one paragraph ----------------


def _refusals(tmp: Path, ws: Path) -> dict[str, tuple[str, list[str], list[str]]]:
    ckpt = f"ckpt_path={ws / 'run' / 'checkpoints' / 'last.pt'}"
    k8s = ["launcher=kubernetes", "launcher.image=img", "launcher.volume=pvc", "launcher.kind=bad"]
    k8s += [f"launcher.mount_path={tmp / 'mnt'}", f"hydra.run.dir={tmp / 'mnt/runs/a'}"]
    return {
        # Hydra's FileNotFoundError traceback about its own mkdir.
        "run-dir-in-proc": (
            "accel-train",
            ["hydra.run.dir=/proc/x/run"],
            ["hydra.run.dir=/proc/x/run: the run dir cannot be made there"],
        ),
        # The run dir was made and left: outputs/train/<time>/ with .hydra/ and train.log.
        "untagged": ("accel-train", ["extras.enforce_tags=true"], ["has no tags"]),
        # The run dir was removed, the folders made above it (like /runs) were not.
        "kubernetes": ("accel-train", k8s, ["launcher.kind='bad'"]),
        # save_pretrained's FileNotFoundError traceback (format=torch_export blamed the model,
        # after the export ran): both refused before the checkpoint is read.
        "export-to-proc": (
            "accel-export",
            [ckpt, "format=hf", "out_path=/proc/model-hf"],
            ["out_path=/proc/model-hf: nothing can be written there"],
        ),
    }


@pytest.mark.parametrize("case", ["run-dir-in-proc", "untagged", "kubernetes", "export-to-proc"])
def test_a_refused_command_writes_nothing(case, ws, tmp_path):
    prog, args, expected = _refusals(tmp_path, ws)[case]
    before = sorted(tmp_path.rglob("*"))
    proc = run_cli(
        [*args, "trainer.max_steps=1"] if prog == "accel-train" else args, tmp_path, prog=prog
    )
    _refused(proc, *expected)
    assert sorted(tmp_path.rglob("*")) == before


# ---- careless inputs around model=hf name the file at fault ----------------------------------


def test_a_corrupt_config_json_is_named(ws, tmp_path):
    """A config.json cut short was blamed on the tokenizer ("transformers could not read a
    tokenizer there") by training and accel-sample, which read the tokenizer first (issue 39).
    Both read the folder through models/hf.py's model_folder, which now reads config.json."""
    broken = Path(shutil.copytree(ws / "base", tmp_path / "broken"))
    (broken / "config.json").write_text('{"model_type": "gpt2", ')
    train = json.loads((ws / "run.json").read_text())
    train = [a if not a.startswith("model.path=") else f"model.path={broken}" for a in train]
    proc = run_cli(train, tmp_path)
    _refused(proc, f"{broken / 'config.json'} is not valid JSON (line 1")
    assert "tokenizer there" not in proc.stderr


def test_a_non_utf8_record_file_names_its_line(ws, tmp_path):
    """A UnicodeDecodeError that named no file or line (issue 39)."""
    records = tmp_path / "latin1.jsonl"
    good = (ws / "records.jsonl").read_text().splitlines()[0]
    records.write_bytes(
        f"{good}\n".encode() + '{"prompt": "caf\xe9", "completion": "x"}\n'.encode("latin-1")
    )
    train = json.loads((ws / "run.json").read_text())
    train = [a for a in train if not a.startswith("dataset.path=")] + [f"dataset.path={records}"]
    _refused(run_cli(train, tmp_path), f"{records}:2 is not UTF-8 (byte 0xe9", "iconv")


def test_a_chat_prompt_past_the_positions_keeps_its_end(ws, tmp_path):
    """accel-sample chat=true with a prompt longer than the model's 64 learned positions: an
    IndexError inside transformers (issue 39). Now its last tokens, as nanoGPT and HF's left
    truncation keep them, and one line that says so."""
    ckpt = f"ckpt_path={ws / 'run' / 'checkpoints' / 'last.pt'}"
    long = "Reverse a list. " * 40
    args = [ckpt, "chat=true", f"prompt={long}", "max_new_tokens=4", "temperature=0"]
    proc = run_cli(args, tmp_path, prog="accel-sample")
    check_ok(proc)
    assert "with max_new_tokens=4 more than the model's 64 positions" in proc.stdout + proc.stderr


def test_a_reply_longer_than_the_positions_is_refused():
    """The same fit, in process: a reply that cannot fit however the prompt is cut."""
    assert _fit_positions(list(range(10)), 64, 4) == list(range(10))
    assert _fit_positions(list(range(100)), 64, 4) == list(range(40, 100))
    with pytest.raises(UserError, match="max_new_tokens=64: the model reads at most 64"):
        _fit_positions([1], 64, 64)

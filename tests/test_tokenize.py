"""`accel-data tokenize`: a text file -> train.bin, val.bin, meta.json (issue 18), through the
real console script. Tiny texts of the tests' own; the shared corpus is for benchmarks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from helpers import check_ok, run_cli

from accel_train.data.text.tokenizer import load_tokenizer

TEXT = "def add(a, b):\n    return a + b\n\n" * 40 + "print(add(1, 2))\n" * 10


def tokenize(cwd: Path, *args: str):
    return run_cli(["tokenize", *args], cwd, prog="accel-data")


def read_folder(folder: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    meta = json.loads((folder / "meta.json").read_text())
    train = np.fromfile(folder / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(folder / "val.bin", dtype=meta["dtype"])
    return meta, train, val


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "input.txt"
    path.write_text(TEXT)
    return path


def test_char_folder_is_nanogpts_layout_and_decodes_back(tmp_path, text_file):
    proc = tokenize(tmp_path, f"input={text_file}", "out=data/c")
    check_ok(proc)
    meta, train, val = read_folder(tmp_path / "data/c")
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
    assert meta["itos"] == sorted(set(TEXT)) and meta["vocab_size"] == len(meta["itos"])
    assert len(train) == int(len(TEXT) * 0.9) and len(train) + len(val) == len(TEXT)
    tokenizer = load_tokenizer(tmp_path / "data/c")
    assert tokenizer.decode(train.tolist()) + tokenizer.decode(val.tolist()) == TEXT
    assert "vocabulary" in proc.stdout and "Traceback" not in proc.stderr


def test_bpe_is_learned_saved_and_reused_from_its_file(tmp_path, text_file):
    check_ok(tokenize(tmp_path, f"input={text_file}", "out=bpe", "tokenizer=bpe", "vocab_size=300"))
    meta, train, val = read_folder(tmp_path / "bpe")
    assert meta["tokenizer"] == "bpe" and (tmp_path / "bpe/tokenizer.json").is_file()
    assert 256 < meta["vocab_size"] <= 300
    assert len(train) < int(len(TEXT) * 0.9)  # merges: fewer tokens than characters
    tokenizer = load_tokenizer(tmp_path / "bpe")
    assert tokenizer.decode(train.tolist()) + tokenizer.decode(val.tolist()) == TEXT
    # The same tokenizer.json given by path encodes the same ids.
    again = tokenize(
        tmp_path, f"input={text_file}", "out=again", f"tokenizer={tmp_path / 'bpe/tokenizer.json'}"
    )
    check_ok(again)
    _, train2, val2 = read_folder(tmp_path / "again")
    assert train2.tolist() == train.tolist() and val2.tolist() == val.tolist()


def test_a_vocabulary_over_65535_is_stored_as_uint32(tmp_path):
    rng = random.Random(0)
    chars = [chr(c) for c in range(0x10000, 0x10000 + 66_000)]  # no surrogates
    rng.shuffle(chars)
    text = "".join(chars) + "\n" + "".join(chars[:8000]) + "\n"
    (tmp_path / "wide.txt").write_text(text)
    check_ok(tokenize(tmp_path, "input=wide.txt", "out=wide"))
    meta, train, val = read_folder(tmp_path / "wide")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 66_001  # + "\n"
    assert train.max() >= 65_536
    assert load_tokenizer(tmp_path / "wide").decode([*train.tolist(), *val.tolist()]) == text


def test_an_existing_folder_is_kept_unless_overwrite(tmp_path, text_file):
    check_ok(tokenize(tmp_path, f"input={text_file}", "out=data"))
    before = (tmp_path / "data/train.bin").read_bytes()
    proc = tokenize(tmp_path, f"input={text_file}", "out=data", "val_fraction=0.5")
    assert proc.returncode == 2 and "overwrite=true" in proc.stderr
    # A failing overwrite leaves the old folder whole (nothing is half-written).
    (tmp_path / "bad.bin").write_bytes(b"\x00\x01\x02")
    proc = tokenize(tmp_path, "input=bad.bin", "out=data", "overwrite=true")
    assert proc.returncode == 2 and (tmp_path / "data/train.bin").read_bytes() == before
    check_ok(
        tokenize(tmp_path, f"input={text_file}", "out=data", "overwrite=true", "val_fraction=0.5")
    )
    _, train, _ = read_folder(tmp_path / "data")
    assert len(train) == len(TEXT) // 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["input=missing.txt", "out=o"], "input=missing.txt: no such file"),
        ("", ["input=f.txt", "out=o"], "is empty"),
        (b"\x00\x00binary", ["input=f.txt", "out=o"], "looks binary"),
        (b"caf\xe9 latin-1\n" * 10, ["input=f.txt", "out=o"], "is not UTF-8 text"),
        ("a", ["input=f.txt", "out=o"], "too short to split"),
        (TEXT, ["input=f.txt", "out=o", "tokenizer=wordpiece"], "tokenizer=wordpiece is not"),
        (TEXT, ["input=f.txt", "out=o", "tokenizer=nope.json"], "tokenizer=nope.json: no such"),
        (TEXT, ["input=f.txt", "out=o", "tokenizer=bpe", "vocab_size=100"], "at least 257"),
        (TEXT, ["input=f.txt", "out=o", "val_fraction=1.5"], "val_fraction=1.5"),
        (TEXT, ["input=f.txt"], "`out` is required"),
    ],
)
def test_bad_input_is_one_paragraph(tmp_path, setup, args, message):
    if setup is not None:
        path = tmp_path / "f.txt"
        path.write_bytes(setup) if isinstance(setup, bytes) else path.write_text(setup)
    proc = tokenize(tmp_path, *args)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_an_unknown_command_names_the_commands(tmp_path):
    proc = run_cli(["tokenise", "input=x"], tmp_path, prog="accel-data")
    assert proc.returncode == 2 and "tokenize" in proc.stderr and "Traceback" not in proc.stderr


def test_overwrite_never_removes_the_input_or_other_files(tmp_path):
    """nanoGPT's layout keeps input.txt beside train.bin: `out=<that folder> overwrite=true`
    removed every file in it, the input included (issue 32)."""
    folder = tmp_path / "pycode"
    folder.mkdir()
    (folder / "input.txt").write_text(TEXT)
    (folder / "README.md").write_text("mine")
    for extra in ([], ["overwrite=true"]):
        proc = tokenize(tmp_path, "input=pycode/input.txt", "out=pycode", *extra)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "README.md, input.txt" in proc.stderr and "out=pycode/tokens" in proc.stderr
    # `out=.` where the user's files are: the same refusal, not a traceback.
    proc = tokenize(folder, "input=input.txt", "out=.", "overwrite=true")
    assert proc.returncode == 2 and "input.txt" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["README.md", "input.txt", "pycode"]
    assert (folder / "input.txt").read_text() == TEXT


def test_overwrite_replaces_a_token_folders_own_files(tmp_path, text_file):
    """A token folder of tokenize's own is replaced file by file (a BPE's tokenizer.json goes
    when the new one is char); `out=.` inside it works too."""
    check_ok(tokenize(tmp_path, f"input={text_file}", "out=tok", "tokenizer=bpe", "vocab_size=300"))
    check_ok(tokenize(tmp_path, f"input={text_file}", "out=tok", "overwrite=true"))
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == [
        "accel_train.written.json",  # what tokenize wrote: what the next overwrite may replace
        "meta.json",
        "train.bin",
        "val.bin",
    ]
    check_ok(tokenize(tmp_path / "tok", f"input={text_file}", "out=.", "overwrite=true"))
    meta, train, val = read_folder(tmp_path / "tok")
    assert meta["tokenizer"] == "char" and len(train) + len(val) == len(TEXT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.txt", "tok"]

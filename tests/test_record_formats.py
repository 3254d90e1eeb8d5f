"""The record formats users bring to dataset=sft besides `messages` (issue 40): Alpaca and
ShareGPT read as the chat they stand for, and `dataset.chat_template` for a folder without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import check_ok
from hf_fixtures import CHAT_TEMPLATE, QUESTIONS, write_tiny_llama, write_tokenizer

from accel_train.data.text.sft import encode_rows
from accel_train.errors import UserError


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _rows(path: Path, folder: Path, template: str | None = None) -> list:
    rows, _ = encode_rows(str(path), str(folder), 128, False, "completion", -100, str(path),
                          None, 0.0, 0, template)  # fmt: skip
    return [(x.tolist(), y.tolist()) for x, y, _ in rows["train"].rows]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    write_tokenizer(root / "chat")
    write_tokenizer(root / "plain", chat_template=None)
    for name in ("chat", "plain"):  # a tokenizer folder is a model's layout
        (root / name / "config.json").write_text("{}")
    (root / "template.jinja").write_text(CHAT_TEMPLATE)
    return root


def test_alpaca_and_sharegpt_read_as_the_chat_they_stand_for(folders):
    q, a = QUESTIONS[0]
    as_messages = [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": f"{q}\n\nxs = [1, 2]"},
                      {"role": "assistant", "content": a}]},
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]},
    ]  # fmt: skip
    theirs = [
        {"instruction": q, "input": "xs = [1, 2]", "output": a, "system": "Be brief."},
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]},
    ]
    ours = _rows(_write(folders / "ours.jsonl", as_messages), folders / "chat")
    assert _rows(_write(folders / "theirs.jsonl", theirs), folders / "chat") == ours
    # Alpaca without a system prompt is a prompt/completion pair: a template-less folder reads it.
    pc = _write(folders / "pc.jsonl", [{"prompt": q, "completion": a}])
    alpaca = _write(folders / "alpaca.jsonl", [{"instruction": q, "input": "", "output": a}])
    assert _rows(alpaca, folders / "plain") == _rows(pc, folders / "plain")


def test_a_bad_turn_or_template_is_named(folders):
    bad = _write(folders / "bad.jsonl", [{"conversations": [{"from": "robot", "value": "hi"}]}])
    with pytest.raises(UserError, match=r"bad.jsonl:1: turn 1 of 'conversations'.*'from'"):
        _rows(bad, folders / "chat")
    none = _write(folders / "none.jsonl", [{"text": "hello"}])
    with pytest.raises(UserError, match=r"none.jsonl:1: .*Alpaca.*ShareGPT.*it has \['text'\]"):
        _rows(none, folders / "chat")
    (folders / "not-a-template.jinja").write_text("hello {{ name }}")
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    chat = _write(folders / "chat.jsonl", [{"conversations": turns}])
    with pytest.raises(UserError, match="does not read `messages`"):
        _rows(chat, folders / "plain", str(folders / "not-a-template.jinja"))
    with pytest.raises(UserError, match="dataset.chat_template=<file.jinja>"):
        _rows(chat, folders / "plain")


def test_a_folder_without_a_template_trains_on_chat_with_one_given(run_cli, tmp_path):
    """dataset.chat_template renders ShareGPT chats for a base folder that has no template; the
    rows equal the chat folder's, and format=hf exports the template with the model."""
    base = write_tiny_llama(tmp_path / "base", chat_template=None)
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    data = _write(
        tmp_path / "chats.jsonl",
        [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
         for q, a in QUESTIONS],
    )  # fmt: skip
    run = tmp_path / "run"
    args = ["+experiment=sft_lora", f"model.path={base}", f"dataset.path={data}",
            f"dataset.chat_template={template}", "dataset.pack=false", "lora.rank=2",
            "loader.batch_size=2", "trainer.max_steps=2", "trainer.progress=none",
            "logger=none", "dataset.val_fraction=0.25", f"hydra.run.dir={run}"]  # fmt: skip
    check_ok(run_cli(args))
    out = tmp_path / "exported"
    ckpt = run / "checkpoints" / "last.pt"
    check_ok(run_cli([f"ckpt_path={ckpt}", "format=hf", f"out_path={out}"], prog="accel-export"))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template == CHAT_TEMPLATE


def test_preference_pairs_in_alpaca_and_sharegpt_form(folders):
    """dataset=preference reads LLaMA-Factory's Alpaca and ShareGPT pairs as TRL's chat pairs;
    a prompt whose last token merges with the answer's first is split where they diverge
    (TRL's rule), not refused."""
    from accel_train.data.text.preference import PairEncoder, record_parts
    from accel_train.models.hf import load_tokenizer

    folder = folders / "chat"
    enc = PairEncoder(load_tokenizer(str(folder)), str(folder))
    q, a = QUESTIONS[1]
    trl = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
        "chosen": [{"role": "assistant", "content": a}],
        "rejected": [{"role": "assistant", "content": a.upper()}],
    }
    alpaca = {"instruction": q, "system": "Be brief.", "chosen": a, "rejected": a.upper()}
    sharegpt = {
        "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": q}],
        "chosen": {"from": "gpt", "value": a},
        "rejected": {"from": "gpt", "value": a.upper()},
    }
    want = enc.encode("trl", record_parts("trl", trl))
    for name, record in (("alpaca", alpaca), ("sharegpt", sharegpt)):
        assert enc.encode(name, record_parts(name, record)) == want, name
    # A generation prompt that ends otherwise than the rendered answer's turn begins (a space,
    # not its newline): the prompt's last token is left out, the answer scored from there.
    tok = load_tokenizer(str(folder))
    tok.chat_template = CHAT_TEMPLATE.replace("<|im_start|>assistant\n", "<|im_start|>assistant ")
    merged = PairEncoder(tok, str(folder)).encode("m", record_parts("m", trl))
    alone = tok.apply_chat_template(trl["prompt"], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"]  # fmt: skip
    assert list(merged.prompt) == list(alone[: len(merged.prompt)])
    assert len(merged.prompt) < len(alone) and merged.chosen and merged.rejected

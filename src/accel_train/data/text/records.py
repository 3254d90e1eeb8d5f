"""The record formats users bring, as the chat messages `dataset=sft` renders.

Besides its own two forms (`messages`; `prompt` and `completion`), a record may be:
- **Alpaca** (`instruction`, optional `input`, `output`, optional `system`): the instruction
  and its input, separated by a blank line, as the user's turn; the output as the assistant's.
  Without a system prompt it becomes a prompt/completion pair, so a tokenizer without a chat
  template still reads it (the prompt's tokens, then the output's and EOS).
- **ShareGPT** (`conversations`: a list of `{"from": ..., "value": ...}`): the turns as
  messages, `human` as `user` and `gpt` as `assistant` (and `system`, `user`, `assistant` as
  themselves), which is how axolotl and LLaMA-Factory read it.

`as_chat` turns either into the project's own forms and leaves those as they are; anything it
cannot read is left for the caller's own message, which names every accepted form.

Preference pairs (`dataset=preference`) come in the same two families, as LLaMA-Factory reads
them: Alpaca's `instruction`/`input` (and `system`) with `chosen` and `rejected` answers, and
ShareGPT's `conversations` with `chosen` and `rejected` turns (`{"from": "gpt", "value": ...}`).
`as_preference` turns them into TRL's prompt/chosen/rejected form.
"""

from __future__ import annotations

from typing import Any

from accel_train.errors import UserError

# ShareGPT's speakers -> chat roles (axolotl's and FastChat's names).
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
FORMS = (
    "'messages' (a list of role/content dicts), 'prompt' and 'completion' strings, Alpaca's "
    "'instruction'/'input'/'output', or ShareGPT's 'conversations' (from/value turns)"
)


def as_chat(where: str, record: Any) -> Any:
    """`record` in one of dataset=sft's own forms (see the module docstring)."""
    if not isinstance(record, dict) or "messages" in record or "prompt" in record:
        return record
    if "instruction" in record and "output" in record:
        return _alpaca(where, record)
    if "conversations" in record:
        return {"messages": sharegpt_messages(where, record["conversations"])}
    return record


def _alpaca(where: str, record: dict) -> dict:
    fields = {k: record.get(k) for k in ("instruction", "input", "output", "system")}
    bad = [k for k, v in fields.items() if v is not None and not isinstance(v, str)]
    if bad:
        raise UserError(f"{where}: an Alpaca record's {', '.join(bad)} must be strings.")
    prompt = fields["instruction"]
    if fields["input"]:
        prompt = f"{prompt}\n\n{fields['input']}"
    if not fields["system"]:
        return {"prompt": prompt, "completion": fields["output"]}
    return {
        "messages": [
            {"role": "system", "content": fields["system"]},
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": fields["output"]},
        ]
    }


def sharegpt_messages(where: str, turns: Any) -> list[dict]:
    """ShareGPT turns -> chat messages, each speaker named or refused by its turn."""
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'conversations' must be a non-empty list of turns.")
    messages = []
    for i, turn in enumerate(turns):
        speaker = turn.get("from") if isinstance(turn, dict) else None
        value = turn.get("value") if isinstance(turn, dict) else None
        role = SHAREGPT_ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None or not isinstance(value, str):
            raise UserError(
                f"{where}: turn {i + 1} of 'conversations' is {turn!r}; each turn needs 'from' "
                f"(one of {', '.join(SHAREGPT_ROLES)}) and a string 'value'."
            )
        messages.append({"role": role, "content": value})
    return messages


def as_preference(where: str, record: Any) -> Any:
    """A preference record in TRL's form (`prompt`, `chosen`, `rejected`), from Alpaca's or
    ShareGPT's; TRL's own forms and anything unreadable are returned as they are."""
    if not isinstance(record, dict) or "prompt" in record:
        return record
    if "instruction" in record:
        chat = as_chat(where, {**record, "output": ""})  # the Alpaca prompt, as dataset=sft's
        prompt = chat.get("prompt", chat.get("messages", [])[:-1])
    elif "conversations" in record:
        prompt = sharegpt_messages(where, record["conversations"])
    else:
        return record
    out = {"prompt": prompt}
    for key in ("chosen", "rejected"):
        answer = record.get(key)
        if isinstance(answer, dict) and "value" in answer:  # a ShareGPT turn
            answer = answer["value"]
        if isinstance(prompt, list) and isinstance(answer, str):
            answer = [{"role": "assistant", "content": answer}]
        out[key] = answer
    return {**record, **out}


# The preference record families a file may hold (one per file), by the key that marks each.
PREFERENCE_FAMILIES = {
    "prompt": "TRL's (prompt, chosen, rejected)",
    "instruction": "Alpaca's (instruction, input, chosen, rejected)",
    "conversations": "ShareGPT's (conversations, chosen, rejected)",
}


class OneFamily:
    """Refuses a file that mixes preference record families (a TRL record beside an Alpaca
    one): each reads, but a file so assembled is usually two sets pasted together, with other
    prompts, templates or answer conventions, and TRL's and LLaMA-Factory's loaders (a column
    set per file) refuse it too. `see(where, record)` for each record in file order."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}  # family -> where its first record is

    def see(self, where: str, record: Any) -> None:
        family = next((k for k in PREFERENCE_FAMILIES if isinstance(record, dict) and k in record),
                      None)  # fmt: skip
        if family is None or family in self.first:
            return
        self.first[family] = where
        if len(self.first) > 1:
            (a, at), (b, bt) = self.first.items()
            raise UserError(
                f"{bt}: this file mixes preference record formats: {at} is "
                f"{PREFERENCE_FAMILIES[a]} and {bt} is {PREFERENCE_FAMILIES[b]}. One file holds "
                "one format; convert the records to one of them, or put each format in a file "
                "of its own."
            )

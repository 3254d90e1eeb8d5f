"""Fixtures of task=grpo's tests: a Llama-architecture model small enough to learn a rule from
reward alone in a few seconds of CPU, with a word-level tokenizer of that rule's words (built
from a config and written with save_pretrained: tests never download), prompts of the rule,
and the reward module a user would write, on PYTHONPATH."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
VOCAB = ["<pad>", "<eos>", *(str(d) for d in range(10)), *WORDS]

# The rule: answer with the digit that the prompt's last word names ("two seven" -> "7"). The
# reward reads the record's `answer` column by name, as a user's reward reads theirs.
REWARD_MODULE = '''
def names_the_digit(prompts, completions, answer, **kwargs):
    """1.0 where the completion's first word is the record's answer, else 0.0."""
    return [1.0 if completion.split()[:1] == [want] else 0.0
            for completion, want in zip(completions, answer)]
'''


def write_word_model(folder: Path, *, hidden: int = 32, layers: int = 1, seed: int = 0) -> Path:
    """A Llama of `layers` layers and width `hidden` over VOCAB (22 ids), with its tokenizer:
    one id a word, words joined by spaces when decoded, no chat template (prompts are their
    own tokens)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # (WordPiece's decoder: words, spaces between)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(folder)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def write_digit_prompts(path: Path, n: int, seed: int = 0) -> Path:
    """`n` records {"prompt": "<1 to 3 number words>", "answer": "<the last one's digit>"}."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
            rec = {"prompt": " ".join(words), "answer": str(WORDS.index(words[-1]))}
            f.write(json.dumps(rec) + "\n")
    return path


def user_code(root: Path, files: dict[str, str]) -> dict[str, str]:
    """Write a user's modules ({"my/rewards.py": source}, packages get an __init__.py) under
    root and return the env that puts root on PYTHONPATH, before the checkout's src/ a test
    already runs with: how a user's reward function is found by `_target_`."""
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(root).parents[:-1]:
            (root / folder / "__init__.py").touch()
        path.write_text(source.lstrip())
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


def docs_reward_module() -> str:
    """my/rewards.py as docs/fine-tuning.md writes it (its python block that starts with the
    line `# my/rewards.py`): the page's own code is what the tests import."""
    text = (ROOT / "docs" / "fine-tuning.md").read_text()
    found = re.search(r"```python\n# my/rewards\.py\n(.*?)```", text, re.DOTALL)
    assert found, "docs/fine-tuning.md has no ```python block starting with # my/rewards.py"
    return found.group(1)


def write_question_prompts(path: Path, n: int) -> Path:
    """Prompts as docs/fine-tuning.md shows them: a sum to work out, the answer in a column."""
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 7, (3 * i) % 5
            prompt = f"What is {a} + {b}? End with 'answer: N'."
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    return path

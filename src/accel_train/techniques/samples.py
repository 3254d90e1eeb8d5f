"""`trainer.sample_every_n_steps`: what the model says while it trains. At those optimizer steps
each of `trainer.sample_prompts` is rendered with the model folder's chat template (plain text
for a folder without one), `trainer.sample_max_new_tokens` tokens are generated with the KV cache
(transformers' generate, through HFModel.generate_ids; greedy at sample_temperature=0), and the
(step, prompt, completion) rows go to `samples.jsonl` in the run dir and to every logger that
takes text (TensorBoard, MLflow, W&B: MetricsLogger.log_table); the console shows each round's
first sample, naming samples.jsonl the first time.

Every rank generates (a sharded model needs each rank in every forward; greedy decoding of the
same prompts takes the same steps everywhere); rank 0 writes. The sampling draws from a generator
seeded by the step and leaves the run's own random state as it was, so a run with samples
trains exactly as one without. A resumed run first drops the rows written after its checkpoint
(they are sampled again)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import ListConfig

from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer
from accel_train.techniques import Technique

log = logging.getLogger("accel_train")

COLUMNS = ["step", "prompt", "completion"]


def read_prompts(value: Any) -> list[dict[str, Any]]:
    """trainer.sample_prompts as [{"prompt": str} | {"messages": [...]}]: a list of strings, or
    a .txt file (one prompt a line) or .jsonl file (one {"prompt"} or {"messages"} a line)."""
    key = "trainer.sample_prompts"
    if isinstance(value, list | tuple | ListConfig):
        prompts = [{"prompt": str(p)} for p in value]
    else:
        path = Path(str(value)).expanduser()
        if not path.is_file():
            raise UserError(
                f'{key}={value}: no such file. Give a list of prompts (`{key}=["Say hi."]`), a '
                '.txt file (one prompt a line) or a .jsonl file ({"prompt": ...} or '
                '{"messages": [...]} a line).'
            )
        lines = [(i, ln) for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
        if path.suffix == ".jsonl":
            prompts = [_record(path, i, line) for i, line in lines]
        else:
            prompts = [{"prompt": line} for _, line in lines]
    if not prompts:
        raise UserError(f"{key}={value} holds no prompt: give at least one.")
    return prompts


def _record(path: Path, line_no: int, line: str) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        rec = err
    ok = isinstance(rec, dict) and (
        isinstance(rec.get("prompt"), str) or isinstance(rec.get("messages"), list)
    )
    if not ok:
        raise UserError(
            f"trainer.sample_prompts={path}, line {line_no}: each line must be a JSON object "
            'with a "prompt" string or a "messages" list of {"role", "content"} (the chat '
            "records' format). Fix that line."
        )
    return {"messages": rec["messages"]} if "messages" in rec else {"prompt": rec["prompt"]}


@contextlib.contextmanager
def root_gathered(model):
    """transformers' generate calls the inner model, never our root's forward, so FSDP2's root
    pre-forward hook (which all-gathers the root's own parameters: the embeddings, the head)
    does not run: they are gathered here (FSDPModule.unshard; every rank joins), and the blocks
    gather their own as they run. A model that is not sharded: nothing to do."""
    unshard = getattr(model, "unshard", None)
    if unshard is None:
        yield
        return
    unshard()
    try:
        yield
    finally:
        model.reshard()


def require_generate(model, key: str) -> None:
    """The model generates with a KV cache (model=hf's HFModel.generate_ids): asked of the
    model, not of its name."""
    if not hasattr(model, "generate_ids"):
        raise UserError(
            f"{key}: the run's model ({type(model).__name__}) has no generate_ids (transformers' "
            "generate with a KV cache), which model=hf has. Train with model=hf, or set "
            f"`{key}=0`."
        )


class TrainingSamples(Technique):
    name = "samples"

    def __init__(self, every: int, prompts: Any, max_new_tokens: int, temperature: float,
                 tokenizer: tuple[str, str | None]):  # fmt: skip
        """`tokenizer`: the model folder and the run's dataset.chat_template (or None)."""
        self.every, self.max_new_tokens, self.temperature = every, max_new_tokens, temperature
        self.prompts = read_prompts(prompts)
        self.folder, self.template = tokenizer
        self.tok = None
        self.ids: list[list[int]] = []
        self.named = False  # samples.jsonl named on the console (once a process)

    def on_fit_start(self, loop) -> None:
        require_generate(loop.module, "trainer.sample_every_n_steps")
        self.tok = load_tokenizer(self.folder, "dataset.tokenizer", self.template)
        self.ids = [self._render(p) for p in self.prompts]
        self.path = loop.run_dir / "samples.jsonl"
        if loop.env.is_main and loop.step > 0 and self.path.is_file():
            _drop_after(self.path, loop.step)  # resumed: those steps are sampled again

    def _render(self, prompt: dict[str, Any]) -> list[int]:
        tok = self.tok
        if getattr(tok, "chat_template", None):
            messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
            out = tok.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True, return_dict=True
            )
            return list(out["input_ids"])
        if "messages" in prompt:
            raise UserError(
                f'trainer.sample_prompts: a {{"messages": ...}} prompt needs a chat template, '
                f"and the tokenizer of {self.folder} has none. Give plain prompts "
                '({"prompt": ...} lines, or a .txt file), or a template with '
                "`dataset.chat_template=<file.jinja>`."
            )
        return tok.encode(prompt["prompt"], add_special_tokens=True) or [tok.eos_token_id or 0]

    def on_train_step_end(self, loop) -> None:
        if loop.step % self.every:
            return
        rows = self.generate(loop)
        if not loop.env.is_main:
            return
        # The round's first sample on the console (the rest in the file, named once).
        _, prompt, completion = rows[0]
        where = "" if self.named else f" (every prompt's, every round: {self.path})"
        self.named = True
        log.info("step %d sample%s: %r -> %r", loop.step, where, prompt, completion)
        with self.path.open("a") as f:
            for step, prompt, completion in rows:
                f.write(
                    json.dumps({"step": step, "prompt": prompt, "completion": completion}) + "\n"
                )
        loop.metrics.log_table("samples", COLUMNS, rows, loop.step)

    @torch.no_grad()
    def generate(self, loop) -> list[list[Any]]:
        """The prompts' completions: [step, prompt, completion] rows."""
        model, rows = loop.module, []
        loop.model.eval()
        try:
            # HOST SYNC (sampling step): generate reads each new token on the host.
            with (
                torch.random.fork_rng(devices=_cuda(loop.env.device)),
                loop.precision.autocast(),
                root_gathered(model),
            ):
                torch.manual_seed(loop.step)  # the same step samples the same text
                for prompt, ids in zip(self.prompts, self.ids, strict=True):
                    start = torch.tensor([ids], dtype=torch.long, device=loop.env.device)
                    out = model.generate_ids(
                        start, self.max_new_tokens, temperature=self.temperature, top_k=None,
                        top_p=1.0, eos_token_id=self.tok.eos_token_id,
                    )  # fmt: skip
                    text = self.tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True)
                    shown = prompt.get("prompt") or prompt["messages"][-1].get("content", "")
                    rows.append([loop.step, str(shown), text])
        finally:
            loop.model.train()
        return rows


def _cuda(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _drop_after(path: Path, step: int) -> None:
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (json.JSONDecodeError, AttributeError):  # a line torn by a kill
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)

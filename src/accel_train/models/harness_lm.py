"""Our model and its tokenizer as lm-evaluation-harness's `LM`: what `lm_eval.simple_evaluate`
calls (accel-eval's `harness.tasks`, and `trainer.harness_every_n_steps` during training).

- loglikelihood: one forward per batch of (context, continuation) token rows, right-padded (a
  causal model's positions before the padding do not see it), the continuation's log-probs
  summed from the log-softmax at the positions that predict it; `is_greedy` when each of its
  tokens is the argmax there (the harness's own definition, HFLM's).
- loglikelihood_rolling: the harness's rolling windows (`get_rolling_token_windows`) scored the
  same way, summed per document.
- generate_until: the caller's `generate` (model=hf: transformers' generate, a KV cache), greedy,
  `max_gen_toks` new tokens, cut at the first stop string.

lm_eval is imported when the first such model is made (`harness_lm`): the class is our methods
(`HarnessMethods`) over the harness's `TemplateLM`, built then."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

# ids [B, T] -> logits [B, T, V]
Forward = Callable[[torch.Tensor], torch.Tensor]
# (ids [1, T], max_new_tokens) -> ids [1, T + new]: greedy, stops at the tokenizer's eos
Generate = Callable[[torch.Tensor, int], torch.Tensor]


def harness_lm(forward: Forward, generate: Generate, tokenizer, device: torch.device, **kw):
    """A HarnessLM (an lm_eval `LM`): see HarnessMethods. lm_eval must be importable (the
    caller has checked: models/harness.py import_harness)."""
    global _CLASS
    if _CLASS is None:
        from lm_eval.api.model import TemplateLM

        _CLASS = type("HarnessLM", (HarnessMethods, TemplateLM), {})
    return _CLASS(forward, generate, tokenizer, device, **kw)


_CLASS = None


class HarnessMethods:
    """What our LM adds to lm_eval's TemplateLM (which does the tokenizing of the requests).
    `forward` and `generate` run under `autocast` (the run's precision), without gradients;
    `max_length`: the model's positions (longer rows keep their last tokens, as HFLM does)."""

    def __init__(
        self,
        forward: Forward,
        generate: Generate,
        tokenizer,
        device: torch.device,
        *,
        max_length: int,
        batch_size: int = 8,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        super().__init__()
        self._forward, self._generate, self.tokenizer = forward, generate, tokenizer
        self._device, self.max_length = device, max_length
        self.batch_size, self.autocast = batch_size, autocast

    @property
    def eot_token_id(self) -> int:
        tok = self.tokenizer
        for token in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id):
            if token is not None:
                return int(token)
        return 0

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def tokenizer_name(self) -> str:
        """What the harness keys its request caches by (as HFLM names it)."""
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        """harness.chat=true: the prompts as the model folder's chat template renders them (the
        run's dataset.chat_template, when it had one), as HFLM does."""
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )  # fmt: skip

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)  # (its bar: not ours)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        out: list[tuple[float, bool]] = []
        for i in range(0, len(requests), self.batch_size):
            pairs = [(ctx, cont) for _, ctx, cont in requests[i : i + self.batch_size]]
            out.extend(self.score_tokens(pairs))
        return out

    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, greedy?) for each (context, continuation) of
        token ids: one forward for them all."""
        rows, spans = [], []
        for ctx, cont in pairs:
            whole = (ctx + cont)[-(self.max_length + 1) :]
            rows.append(whole[:-1])  # the inputs; position t predicts whole[t + 1]
            spans.append((len(whole) - 1 - len(cont), cont))
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.eot_token_id, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        with self.autocast():
            logits = self._forward(ids.to(self._device))
        logprobs = F.log_softmax(logits.float(), dim=-1)
        picked, greedy = [], []
        for r, (start, cont) in enumerate(spans):
            scores = logprobs[r, start : start + len(cont)]
            target = torch.tensor(cont, dtype=torch.long, device=scores.device)
            picked.append(scores.gather(1, target[:, None]).sum())
            greedy.append((scores.argmax(-1) == target).all())
        # HOST SYNC (harness step): the batch's scores read once
        sums, exact = torch.stack(picked).tolist(), torch.stack(greedy).tolist()
        return [(float(v), bool(g)) for v, g in zip(sums, exact, strict=True)]

    @torch.no_grad()
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        totals = []
        for (text,) in (req.args for req in requests):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            total = 0.0
            for i in range(0, len(windows), self.batch_size):
                total += sum(s for s, _ in self.score_tokens(windows[i : i + self.batch_size]))
            totals.append(total)
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        texts = []
        for context, kwargs in (req.args for req in requests):
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", 256))
            ids = self.tok_encode(context) or [self.prefix_token_id]
            ids = ids[-max(1, self.max_length - new) :]
            start = torch.tensor([ids], dtype=torch.long, device=self._device)
            with self.autocast():
                row = self._generate(start, new)[0, len(ids) :]
            text = self.tokenizer.decode(row.tolist(), skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            texts.append(text)
        return texts

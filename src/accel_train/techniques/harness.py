"""`trainer.harness_every_n_steps`: lm-evaluation-harness's `trainer.harness.tasks` run on the
training model at those optimizer steps (eval mode, no gradients, under the run's autocast; train
mode restored), every number of its results logged as `harness/<task>/<metric>`.

Every rank runs the whole harness on the same documents (a sharded model needs each rank in
every forward; lm_eval is told one process, so it splits nothing); rank 0 logs. The harness
leaves the run's random generators alone (a run trains the same with or without it). The
tasks are loaded once, at the start of the run (a missing task or file fails then, before the
first step)."""

from __future__ import annotations

import logging

import torch
from omegaconf import DictConfig

from accel_train.models.harness import HarnessTasks, flat_metrics, run_harness, table
from accel_train.models.harness_lm import harness_lm
from accel_train.models.hf import load_tokenizer
from accel_train.techniques import Technique
from accel_train.techniques.samples import require_generate, root_gathered

log = logging.getLogger("accel_train")


class HarnessEval(Technique):
    name = "harness"

    def __init__(self, every: int, harness: DictConfig, tokenizer: tuple[str, str | None]):
        """`tokenizer`: the model folder and the run's dataset.chat_template (or None)."""
        self.every, self.cfg = every, harness
        self.folder, self.template = tokenizer
        self.tasks: HarnessTasks | None = None

    def on_fit_start(self, loop) -> None:
        require_generate(loop.module, "trainer.harness_every_n_steps")
        h = self.cfg
        self.tasks = HarnessTasks(list(h.tasks), h.include_path, "trainer.harness.tasks")
        self.tok = load_tokenizer(self.folder, "dataset.tokenizer", self.template)

    def on_train_step_end(self, loop) -> None:
        if loop.step % self.every:
            return
        metrics = self.evaluate(loop)
        if loop.env.is_main:
            loop.metrics.log(metrics, loop.step, loop.epoch)

    @torch.no_grad()
    def evaluate(self, loop) -> dict[str, float]:
        tok, bare = self.tok, loop.module

        def generate(ids: torch.Tensor, new: int) -> torch.Tensor:
            with root_gathered(bare):
                return bare.generate_ids(
                    ids, new, temperature=0.0, top_k=None, top_p=1.0, eos_token_id=tok.eos_token_id
                )

        lm = harness_lm(
            loop.eval_model, generate, tok, loop.env.device,
            max_length=getattr(bare, "block_size", 0) or 2048, batch_size=self.cfg.batch_size,
            autocast=loop.precision.autocast,
        )  # fmt: skip
        loop.model.eval()
        try:
            # HOST SYNC (harness step): each request's scores are read on the host.
            results = run_harness(
                lm, self.tasks, limit=self.cfg.limit, num_fewshot=self.cfg.num_fewshot,
                chat=self.cfg.chat, seeded=False,
            )  # fmt: skip
        finally:
            loop.model.train()
        if loop.env.is_main:
            log.info("step %d lm-evaluation-harness:\n%s", loop.step, table(results))
        return flat_metrics(results)

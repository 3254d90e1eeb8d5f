"""task=grpo: online RL of a causal LM on reward functions of the user's own (dataset=prompts),
as TRL 1.16's GRPOTrainer does it, with its names and defaults (tasks/grpo_loss.py holds the
arithmetic and says where each formula comes from).

Each training micro-batch of B prompts (this process's own: a prompt's group is never split
across processes):
1. samples `num_generations` completions per prompt with the policy (eval mode, no gradient,
   the model's KV cache: model=hf's `generate_ids`, model=gpt's `decode`; each prompt's prefill
   once, repeated to its group's rows; `generation_batch_size` prompts per call),
   seeded by (task.seed, epoch, batch, rank): a resumed run samples the same completions;
2. scores them with `task.rewards` (accel_train/rewards.py) and turns the weighted rewards
   into group-relative advantages;
3. with `beta > 0`, the reference's log-probs (no gradient): the model with its LoRA adapters
   off under LoRA (as task=preference), else a frozen copy of the starting model;
4. returns the clipped policy-gradient loss of the completion tokens (`loss_type`).

`num_iterations` (TRL's mu) > 1: the loader gives each optimizer step's window of batches mu
times in a row (data/text/prompts.py, RepeatedOrder); the first time the task samples and keeps the
completions with their log-probs under the sampling policy (old log-probs), the next mu - 1 times
it trains on what it kept. What it keeps is in the checkpoint (`state_dict`), so a run resumed
inside such a window trains on the same completions.

Metrics (train/... and val/...) in TRL's names: reward, reward_std, rewards/<function>/mean and
/std, frac_reward_zero_std, completions/mean_length, min_length, max_length, clipped_ratio,
mean_terminated_length, entropy, kl (beta > 0), clip_ratio/low_mean, high_mean, region_mean;
reward_std and rewards/<function>/std over every process's rewards (_Spreads). At each logging
step a table `completions` (step, prompt, completion, each reward, advantage) is kept in
completions.jsonl in the run dir and goes to every logger that takes text
(`task.log_completions`).
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from accel_train.config.schema import GrpoTaskConfig
from accel_train.errors import UserError
from accel_train.models.hf import load_tokenizer
from accel_train.plugins import register_task
from accel_train.rewards import Reward, RewardState, build_rewards, score
from accel_train.strategies import strategy_class
from accel_train.tasks import grpo_loss as L
from accel_train.tasks.base import Running, Task, TaskContext, evaluating
from accel_train.tasks.grpo_checks import refusal
from accel_train.tasks.grpo_generation import gathered, nano_sample, unwrapped
from accel_train.tasks.language_model import HEAD_LOSS, call
from accel_train.tasks.preference import _lora_layers, adapters_off

log = logging.getLogger("accel_train")

TABLE = "completions"
COMPLETION_METRICS = ("mean_length", "min_length", "max_length", "clipped_ratio",
                      "mean_terminated_length")  # fmt: skip


class Rollout(dict):
    """One micro-batch's sampled completions and what the loss needs of them (tensors):
    seq (N, T) prompt + completion rows, right-padded; pos (N, C) the position whose logits
    predict each completion token; ids (N, C) and mask (N, C) the completion tokens;
    adv (N,); old (N, C) or absent; ref (N, C) or absent."""


@register_task("grpo", GrpoTaskConfig)
class GRPO(Task):
    name = "grpo"
    generates_text = True  # a causal LM: accel-sample may sample its checkpoints
    table_names = (TABLE,)  # kept in completions.jsonl in the run dir (loggers/)

    def __init__(
        self,
        num_generations: int = 8,
        max_completion_length: int = 512,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        beta: float = 0.0,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        importance_sampling_level: str = "token",
        num_iterations: int = 1,
        mask_truncated_completions: bool = False,
        use_bias_correction_kl: bool = True,
        rewards: Any = (),
        reward_timeout_s: float | None = None,
        log_completions: bool = True,
        num_completions_to_print: int | None = 8,
        generation: str = "hf",
        chunked_loss: bool = True,
        loss_chunk_tokens: int = 1024,
        generation_batch_size: int | None = None,
        seed: int = 0,
    ):
        super().__init__()
        why = refusal(dict(locals(), rewards=None))
        if why:
            raise UserError(why)
        self.G, self.max_len = int(num_generations), int(max_completion_length)
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.beta, self.eps = float(beta), float(epsilon)
        self.eps_high = float(epsilon_high) if epsilon_high is not None else self.eps
        self.loss_type, self.scale, self.level = loss_type, scale_rewards, importance_sampling_level
        self.mu, self.mask_truncated = int(num_iterations), bool(mask_truncated_completions)
        self.bias_correction_kl = bool(use_bias_correction_kl)
        self.rewards: list[Reward] = build_rewards(rewards)
        self.reward_timeout = float(reward_timeout_s) if reward_timeout_s is not None else None
        self.accumulate, self.max_steps, self.epoch = 1, -1, 0  # (setup: the trainer's)
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        self.train_metrics = _Spreads({std: mean for mean, std in self._reward_pairs()})
        self.log_completions, self.n_print = bool(log_completions), num_completions_to_print
        self.seed = int(seed)
        self.together = int(generation_batch_size) if generation_batch_size else None
        self.chunk_tokens = int(loss_chunk_tokens) if chunked_loss else 0
        self.head_loss = True  # the model takes forward(..., head_loss=) (setup asks)
        self.tok: Any = None
        self.eos: int | None = None
        self.model_stops: list[int] = []  # the model's generation_config eos ids (setup)
        self.pad = 0
        self.ref_model: nn.Module | None = None
        self._layers: list[nn.Module] | None = None
        self.kept: dict[tuple, list] = {}  # num_iterations > 1: (epoch, prompts) -> [uses, Rollout]
        self.table: list[list[Any]] = []  # the latest completions (log_completions)
        self.train_step = 0  # micro-batches trained (the seed's place without a position)
        self.warned_lost = False
        self.last_tokens = 0  # prompt + completion tokens of the latest rollout (tokens/s)
        self.reshard_after_forward = True  # strategy=fsdp's setting, put back after sampling

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        return {"loss": "min", "reward": "max", "completions/mean_length": "max"}

    @classmethod
    def config_refusal(cls, cfg: DictConfig) -> str | None:
        """What cannot work with this run's other choices, found before anything is built."""
        return refusal(dict(cfg.task), cfg, strategy_class)

    # ---- build time ----------------------------------------------------------------------

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        batch = ctx.prepared(self)
        if not (isinstance(batch, Mapping) and {"input_ids", "records"} <= set(batch)):
            raise UserError(
                "task=grpo samples completions for prompts, but dataset="
                f"{ctx.cfg.dataset.get('name', 'custom')} gives {type(batch).__name__} batches. "
                "Use `dataset=prompts dataset.path=<prompts.jsonl>` (records with a 'prompt')."
            )
        ds = ctx.cfg.dataset  # (dataset=prompts read its records with this tokenizer)
        self.tok = load_tokenizer(str(ds.tokenizer), chat_template=ds.get("chat_template"))
        self.eos = self.tok.eos_token_id
        bare = unwrapped(ctx.model)
        # Every id a turn ends on, as TRL stops: the tokenizer's EOS and the model's
        # generation_config eos_token_id (a chat model's end-of-turn token is often only there)
        self.model_stops = [int(i) for i in getattr(bare, "stop_token_ids", ())]
        self.reshard_after_forward = bool(ctx.cfg.strategy.get("reshard_after_forward", True))
        trainer = ctx.cfg.get("trainer") or {}
        self.accumulate = max(int(trainer.get("accumulate_grad_batches", 1) or 1), 1)
        limit = trainer.get("max_steps")
        self.max_steps = int(limit) if limit is not None else -1
        pad = self.tok.pad_token_id
        self.pad = pad if pad is not None else (self.eos if self.eos is not None else 0)
        if not hasattr(bare, "generate_ids") and not hasattr(bare, "block_size"):
            raise UserError(
                f"model._target_={ctx.cfg.model._target_} with task=grpo: the model has no "
                "generate_ids(ids, max_new_tokens, ...) (model=hf's, with a KV cache) nor a "
                "block_size (model=gpt's sampling loop), so the task cannot sample completions "
                "with it. Use model=hf or model=gpt, or give the model a generate_ids method."
            )
        self._check_context(ctx, bare)
        refused = getattr(bare, "head_loss_refusal", lambda: None)()
        self.head_loss = HEAD_LOSS in inspect.signature(bare.forward).parameters and not refused
        if refused and self.chunk_tokens and ctx.warn:
            log.warning("task=grpo scores with the whole logits: %s", refused)
        for name in self._train_metric_names():  # every rank packs the same sums, in one order
            self.train_metrics.declare(name, ctx.device)
        # (validation's too: a reward function that applies to no completion of a rank's
        # batches adds nothing there, and the ranks' sums must still line up)
        evaluated = ["loss", "reward", *(m for m, _ in self._reward_pairs()[1:])]
        for name in [*evaluated, "completions/mean_length"]:
            self.eval_metrics.declare(name, ctx.device)
        if self.beta != 0.0 and ctx.cfg.lora.rank <= 0:
            # The starting model, frozen (accel-eval sets up on a trained one: no KL is scored)
            self.ref_model = copy.deepcopy(ctx.model).eval().requires_grad_(False)
        if ctx.warn:
            ref = (
                "none" if self.beta == 0 else ("adapters off" if self.ref_model is None else "copy")
            )
            log.info(
                "task=grpo: %d completions per prompt, loss_type=%s, reference: %s, rewards: %s",
                self.G, self.loss_type, ref, ", ".join(r.name for r in self.rewards),
            )  # fmt: skip

    def _reward_pairs(self) -> list[tuple[str, str]]:
        """The reward metrics, (mean, std) in TRL's names: the weighted reward's, then each
        function's."""
        each = [(f"rewards/{r.name}/mean", f"rewards/{r.name}/std") for r in self.rewards]
        return [("reward", "reward_std"), *each]

    def _train_metric_names(self) -> list[str]:
        names = [name for pair in self._reward_pairs() for name in pair]
        names += ["frac_reward_zero_std", *(f"completions/{k}" for k in COMPLETION_METRICS)]
        names += ["entropy", *(["kl"] if self.beta else [])]
        names += [f"clip_ratio/{k}" for k in ("low_mean", "high_mean", "region_mean")]
        return [*names, "num_tokens"]

    # What a logging step's console line shows (metrics.jsonl and the loggers get them all).
    CONSOLE = ("reward", "reward_std", "completions/mean_length", "kl", "entropy",
               "clip_ratio/region_mean")  # fmt: skip

    def shown(self, metrics: dict[str, float]) -> dict[str, float]:
        return {k: metrics[k] for k in self.CONSOLE if k in metrics}

    def _check_context(self, ctx: TaskContext, bare: nn.Module) -> None:
        """The longest prompt plus a whole completion must fit the model's positions
        (model=gpt's block_size, a folder's max_position_embeddings): past them the sampling
        would crop the prompt and the scoring index past the position table."""
        block = int(getattr(bare, "block_size", 0) or 0)
        split = getattr(ctx.splits, "train", None) if ctx.splits is not None else None
        prompts = getattr(split, "prompts", None)
        if not block or not prompts:
            return
        longest = max(len(p.ids) for p in prompts)
        if longest + self.max_len > block:
            raise UserError(
                f"task.max_completion_length={self.max_len} after the longest prompt "
                f"({longest} tokens) needs {longest + self.max_len} positions, and the model "
                f"has {block}. Lower task.max_completion_length or dataset.max_prompt_length "
                f"(to at most {block - self.max_len} tokens), or use a model with a longer "
                "context."
            )

    # ---- the step ------------------------------------------------------------------------

    def prepare(self, batch: Any, *, train: bool, epoch: int = 0, index: int = 0) -> Any:
        """The batch with its place in the run (train: the sampling seed's epoch and batch)."""
        if train and isinstance(batch, Mapping):
            self.epoch = epoch  # (the reward functions' trainer_state.epoch)
            return {**batch, "position": (epoch, index)}
        return batch

    def inputs(self, batch: Any) -> torch.Tensor:
        return batch["input_ids"]

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return call(model, batch["input_ids"])

    def tokens_in(self, batch: Any) -> int:
        """The prompt and completion tokens (no padding) of the batch just trained on, as TRL
        counts num_tokens: read at the sampling's own host sync (`_layout`), no new one."""
        return self.last_tokens

    def step(self, model: nn.Module, batch: Any):
        self.train_step += 1
        roll = self._rollout_for(model, batch)
        # TRL's num_tokens: the prompt and completion tokens trained on (_Spreads adds them up)
        tokens = torch.tensor(float(self.last_tokens)).to(roll["seq"].device, non_blocking=True)
        self.train_metrics.add("num_tokens", tokens, 1)
        return self._loss(model, roll, self.train_metrics, train=True)

    def eval_output(self, model: nn.Module, batch: Any):
        metrics = _Collect()
        roll = self._rollout(model, batch, self._seed(batch, None), metrics)
        out = self._loss(model, roll, metrics, train=False)
        # dapo gives (sum, tokens) for the loop to divide once; the other loss types a mean.
        loss, items = out if isinstance(out, tuple) else (out, None)
        n = batch["input_ids"].shape[0]
        total, count = metrics.totals.get("reward", (0.0, 0))
        means = {"reward": torch.as_tensor(total / max(count, 1))}
        for name, _ in self._reward_pairs()[1:]:  # each function's, where it applied
            total, count = metrics.totals.get(name, (0.0, 0))
            if count:
                means[name] = torch.as_tensor(total / count)
        means["completions/mean_length"] = roll["mask"].sum() / roll["mask"].shape[0]
        if items is not None:  # dapo: the mean over this batch's tokens
            loss = loss / items.clamp(min=1)
        return loss, {k: v.to(loss.device) for k, v in means.items()} if n else {}

    # ---- sampling and scoring --------------------------------------------------------------

    def _seed(self, batch: Mapping, position: tuple | None) -> int:
        rank = _rank()
        # (a tuple of ints hashes the same in every process: no PYTHONHASHSEED salt)
        if position is None:  # evaluation: the batch's first prompt names it
            return hash((self.seed, -1, int(batch["index"][0]))) % 2**62
        return hash((self.seed, *position, rank)) % 2**62

    def _rollout_for(self, model: nn.Module, batch: Mapping) -> Rollout:
        """This micro-batch's completions: sampled now, or kept from the window's first pass
        (num_iterations > 1)."""
        position = batch.get("position", (0, self.train_step))
        if self.mu == 1:
            return self._rollout(model, batch, self._seed(batch, position), self.train_metrics)
        key = (position[0], tuple(batch["index"].tolist()))  # HOST SYNC: the prompts' indices
        if key in self.kept:
            entry = self.kept[key]
            entry[0] += 1
            if entry[0] >= self.mu:
                del self.kept[key]
            device = batch["input_ids"].device
            roll = {k: v if k == "tokens" else v.to(device)  # ("tokens": a host count)
                    for k, v in entry[1].items() if torch.is_tensor(v)}  # fmt: skip
            self.last_tokens = int(roll["tokens"])
            return Rollout(roll)
        if len(self.kept) >= 64 and not self.warned_lost:  # a window never finished
            self.warned_lost = True
            log.warning("task=grpo: %d sampled batches kept for num_iterations", len(self.kept))
        roll = self._rollout(model, batch, self._seed(batch, position), self.train_metrics)
        self.kept[key] = [1, roll]
        return roll

    @torch.no_grad()
    def _sample(self, model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, seed: int):
        """(N, C) completion tokens for the left-padded (N, P) prompts."""
        bare = unwrapped(model)
        devices = [ids.device.index or 0] if ids.device.type == "cuda" else []
        # FSDP2's root forward first (the module itself: no torch.compile of a 1-token shape)
        root_forward = lambda: call(bare, ids[:1, :1])  # noqa: E731
        with (
            torch.random.fork_rng(devices=devices),
            evaluating(model),
            gathered(bare, root_forward, self.reshard_after_forward),
        ):
            torch.manual_seed(seed)
            if hasattr(bare, "generate_ids"):
                return self._hf_sample(bare, ids, mask)
            return nano_sample(
                bare, ids, mask, self.G, self.max_len, self.together,
                temperature=self.temperature, top_k=self.top_k or None, top_p=self.top_p,
            )  # fmt: skip

    def _hf_sample(self, bare: nn.Module, ids: torch.Tensor, mask: torch.Tensor):
        """The model's generate_ids (model=hf's: transformers' generate), `generation_batch_size`
        prompts per call; given `repeat=` (a capability of its signature), each prompt once and
        its prefill shared by its group's rows. Each call's completions padded to
        max_completion_length with a stop id (cut off again by _layout)."""
        shares = "repeat" in inspect.signature(bare.generate_ids).parameters
        firsts, fmask = (ids[:: self.G], mask[:: self.G]) if shares else (ids, mask)
        per = 1 if not shares else self.G  # rows of `ids` each prompt stands for
        step = firsts.shape[0] if self.together is None else self.together * self.G // per
        parts = []
        for start in range(0, firsts.shape[0], step):
            chunk, extra = firsts[start : start + step], {"repeat": self.G} if shares else {}
            out = bare.generate_ids(
                chunk, self.max_len, temperature=self.temperature, top_k=self.top_k or None,
                top_p=self.top_p, eos_token_id=self._stop_arg(),
                attention_mask=fmask[start : start + step], **extra,
            )[:, chunk.shape[1] :]  # fmt: skip
            parts.append(F.pad(out, (0, self.max_len - out.shape[1]), value=self._filler()))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _filler(self) -> int:
        """What pads a finished call's completions: a stop id, else the pad id."""
        return self.stops[0] if self.stops else self.pad

    @property
    def stops(self) -> list[int]:
        """Every id a completion ends on: the tokenizer's EOS, then the model's."""
        own = [] if self.eos is None else [int(self.eos)]
        return list(dict.fromkeys([*own, *self.model_stops]))

    def _stop_arg(self) -> int | list[int] | None:
        """generate_ids' eos_token_id: one id as before, a list where several end a turn."""
        return None if not self.stops else self.stops[0] if len(self.stops) == 1 else self.stops

    def _rollout(self, model: nn.Module, batch: Mapping, seed: int, metrics) -> Rollout:
        ids = batch["input_ids"].repeat_interleave(self.G, 0)
        pmask = batch["attention_mask"].repeat_interleave(self.G, 0)
        done = self._sample(model, ids, pmask, seed)
        roll = self._layout(ids, pmask, done)
        records = batch["records"][: batch["input_ids"].shape[0]]
        index = batch["index"].tolist()
        rewards = self._score(records, index, roll)
        total = L.weighted_rewards(rewards, self.weights)
        std = _global_std(total) if self.scale == "batch" else None
        adv, zero_std = L.advantages(total, self.G, self.scale, std=std)
        roll["adv"] = adv.to(ids.device)
        self._log_rewards(metrics, rewards, zero_std, roll)
        with torch.no_grad():
            if self.mu > 1:  # the sampling policy's log-probs, kept for the later passes
                roll["old"] = self._logps(model, roll, grad=False)[0]
            if self.beta != 0.0:
                roll["ref"] = self._reference(model, roll)
        return roll

    def _layout(self, ids: torch.Tensor, pmask: torch.Tensor, done: torch.Tensor) -> Rollout:
        """The completions cut after their first stop id (`self.stops`), and the rows prompt +
        completion laid out from position 0 (no left padding: a causal model needs no
        attention mask)."""
        n, width = done.shape
        is_eos = torch.isin(done, torch.tensor(self.stops, dtype=done.dtype, device=done.device))
        first = torch.where(
            is_eos.any(1), is_eos.int().argmax(1), torch.full_like(done[:, 0], width)
        )
        cmask = torch.arange(width, device=done.device).expand(n, -1) <= first.unsqueeze(1)
        truncated = ~is_eos.any(1)
        lengths = cmask.sum(1)
        plen = pmask.sum(1)
        rows = plen + lengths
        # HOST SYNC: the rows' width (and their tokens for tokens/s, read in the same wait)
        total, tokens = (int(v) for v in torch.stack([rows.max(), rows.sum()]).tolist())
        self.last_tokens = tokens
        seq = torch.full((n, total), self.pad, dtype=torch.long, device=done.device)
        col = torch.arange(total, device=done.device).expand(n, -1)
        pstart = ids.shape[1] - plen  # left padding of each prompt
        src = (col + pstart.unsqueeze(1)).clamp(max=ids.shape[1] - 1)
        seq = torch.where(col < plen.unsqueeze(1), ids.gather(1, src), seq)
        ccol = (col - plen.unsqueeze(1)).clamp(min=0, max=width - 1)
        in_c = (col >= plen.unsqueeze(1)) & (col < (plen + lengths).unsqueeze(1))
        seq = torch.where(in_c, done.gather(1, ccol), seq)
        loss_mask = cmask & ~truncated.unsqueeze(1) if self.mask_truncated else cmask
        pos = (plen.unsqueeze(1) - 1 + torch.arange(width, device=done.device)).clamp(max=total - 1)
        ids_c = torch.where(cmask, done, torch.full_like(done, self.pad))
        return Rollout(
            seq=seq, pos=pos, ids=ids_c, mask=loss_mask.float(), shown=cmask,
            truncated=truncated, tokens=torch.tensor(tokens),
        )  # fmt: skip

    def _reward_state(self) -> RewardState:
        """TRL's `trainer_state` for the reward functions: the optimizer steps done before
        this micro-batch (micro-batches trained / accumulation), the limit and the epoch."""
        done = max(self.train_step - 1, 0) // self.accumulate
        return RewardState(global_step=done, max_steps=self.max_steps, epoch=float(self.epoch))

    def _score(self, records: list[dict], index: list[int], roll: Rollout) -> torch.Tensor:
        """(N, functions) rewards, NaN where a function does not apply."""
        shown = roll["shown"].cpu()
        ids = [row[m].tolist() for row, m in zip(roll["ids"].cpu(), shown, strict=True)]
        texts = self.tok.batch_decode(ids, skip_special_tokens=True)
        prompts, columns, where = [], {}, []
        for record, i in zip(records, index, strict=True):
            for _ in range(self.G):
                prompts.append(record["prompt"])
                where.append(i)
                for k, v in record.items():
                    if k != "prompt":
                        columns.setdefault(k, []).append(v)
        chat = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        columns["completion_ids"] = ids
        columns["trainer_state"] = self._reward_state()
        out = torch.empty(len(texts), len(self.rewards))
        each = score(self.rewards, prompts, completions, columns, where, self.reward_timeout)
        for j, values in enumerate(each):
            out[:, j] = torch.tensor([float("nan") if v is None else v for v in values])
        roll["texts"] = texts
        roll["prompts"] = prompts
        return out

    def _log_rewards(self, metrics, rewards: torch.Tensor, zero_std, roll: Rollout) -> None:
        """TRL's reward and completion metrics of one sampled batch (host values)."""
        total = L.weighted_rewards(rewards, self.weights)
        dev = roll["seq"].device
        one = lambda name, v: metrics.add(name, torch.nan_to_num(v.float(), 0.0).to(dev), 1)  # noqa: E731
        # each reward's sum and sum of squares over the values that apply (host counts): the
        # loop's one all-reduce makes them the mean and std over every process (_Spreads)
        for (mean, std), values in zip(self._reward_pairs(), [total, *rewards.T], strict=True):
            ok = values[~torch.isnan(values)].float()
            metrics.add(mean, ok.sum().to(dev), ok.numel())
            metrics.add(std, (ok * ok).sum().to(dev), ok.numel())
        one("frac_reward_zero_std", zero_std.float().mean())
        lengths = roll["shown"].sum(1).float()
        one("completions/mean_length", lengths.mean())
        one("completions/min_length", lengths.min())
        one("completions/max_length", lengths.max())
        one("completions/clipped_ratio", roll["truncated"].float().mean())
        term = lengths[~roll["truncated"]]  # none terminated: 0, as TRL logs it
        one("completions/mean_terminated_length", term.mean() if term.numel() else term.sum())
        if self.log_completions and metrics is self.train_metrics:
            self._keep_table(rewards, roll)

    def _keep_table(self, rewards: torch.Tensor, roll: Rollout) -> None:
        n = len(roll["texts"]) if self.n_print is None else min(self.n_print, len(roll["texts"]))
        adv = roll["adv"].tolist()
        self.table = [
            [_shown(roll["prompts"][i]), roll["texts"][i],
             *[None if torch.isnan(v) else float(v) for v in rewards[i]], adv[i]]
            for i in range(n)
        ]  # fmt: skip

    # ---- the loss ----------------------------------------------------------------------------

    def _logps(self, model: nn.Module, roll: Rollout, grad: bool = True):
        """(per-token log-probs (N, C), fp32; their entropies, no gradient) of the completion
        tokens under `model`, its logits divided by the sampling temperature (TRL's)."""
        if self.head_loss:  # the completion positions' hidden states only through the head
            out = call(model, roll["seq"], head_loss=self._chunked_head(roll))
            return (out[..., 0] if grad else out[..., 0].detach()), out[..., 1].detach()
        logits = call(model, roll["seq"])
        pos = roll["pos"]
        picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
        if self.temperature != 1.0:  # the sampled distribution's log-probs, as TRL scores them
            picked = picked / self.temperature
        lse = picked.logsumexp(-1)
        logps = picked.gather(-1, roll["ids"].unsqueeze(-1)).squeeze(-1) - lse
        with torch.no_grad():
            entropy = lse - (torch.softmax(picked, -1) * picked).sum(-1)
        return (logps if grad else logps.detach()), entropy

    def _chunked_head(self, roll: Rollout):
        """What the model's `forward(..., head_loss=)` calls with its last hidden states and
        output layer: the completion positions' log-probs and entropies, from those positions'
        hidden states only (the prompt's logits are never computed). task.chunked_loss:
        `loss_chunk_tokens` tokens at a time, each chunk's logits recomputed in the backward
        (activation checkpointing) instead of kept: the (tokens, vocab) logits never exist;
        off: one piece, kept for the backward."""
        pos, ids, temperature, chunk = roll["pos"], roll["ids"], self.temperature, self.chunk_tokens

        def head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
            n, c = pos.shape
            picked = hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            flat, targets = picked.reshape(n * c, -1), ids.reshape(-1)
            if not chunk:
                return _chunk_scores(flat, targets, weight, bias, temperature).view(n, c, 2)
            parts = [
                checkpoint(_chunk_scores, flat[i : i + chunk], targets[i : i + chunk], weight,
                           bias, temperature, use_reentrant=False)
                for i in range(0, n * c, chunk)
            ]  # fmt: skip
            return torch.cat(parts).view(n, c, 2)

        return head

    def _reference(self, model: nn.Module, roll: Rollout) -> torch.Tensor:
        if self.ref_model is not None:
            with evaluating(self.ref_model):
                return self._logps(self.ref_model, roll, grad=False)[0]
        if self._layers is None:
            self._layers = _lora_layers(unwrapped(model))
        with adapters_off(self._layers), torch.no_grad():
            return self._logps(model, roll, grad=False)[0]

    def _loss(self, model: nn.Module, roll: Rollout, metrics, train: bool):
        logps, entropy = self._logps(model, roll)
        old = roll.get("old")
        old = logps.detach() if old is None else old
        mask = roll["mask"]
        per_token, coef_1, kl = L.token_losses(
            logps, old, roll["adv"], mask, epsilon=self.eps, epsilon_high=self.eps_high,
            level=self.level, ref_logps=roll.get("ref"), beta=self.beta,
            bias_correction_kl=self.bias_correction_kl,
        )  # fmt: skip
        loss, items = L.reduce(self.loss_type, per_token, mask, self.max_len)
        tokens = mask.sum()
        metrics.add("entropy", (entropy * mask).sum(), tokens)
        if kl is not None:
            metrics.add("kl", (kl.detach() * mask).sum(), tokens)
        for name, (s, c) in L.clip_stats(coef_1.detach(), roll["adv"], mask, self.eps,
                                         self.eps_high).items():  # fmt: skip
            metrics.add(name, s, c.to(s.device))
        if items is None:
            return loss
        return loss, items

    # ---- logging and checkpoints -----------------------------------------------------------

    def tables(self) -> list[tuple[str, list[str], list[list[Any]]]]:
        """The latest sampled completions with their rewards, for the loggers (then cleared)."""
        if not self.table:
            return []
        columns = ["prompt", "completion", *[r.name for r in self.rewards], "advantage"]
        rows, self.table = self.table, []
        return [(TABLE, columns, rows)]

    def state_dict(self) -> dict[str, Any]:
        """num_iterations > 1: the completions each process kept for the window's later passes
        (host tensors), every process's gathered (the checkpoint is written once, every rank
        saves together: a collective here is safe), so each takes its own back on resume."""
        kept = [
            [key[0], list(key[1]), uses, {k: v.cpu() for k, v in r.items() if torch.is_tensor(v)}]
            for key, (uses, r) in self.kept.items()
        ]
        by_rank = [kept]
        if self.mu > 1 and dist.is_available() and dist.is_initialized():
            by_rank = [None] * dist.get_world_size()
            dist.all_gather_object(by_rank, kept)
        return {"kept_by_rank": by_rank, "train_step": self.train_step,
                "num_tokens": self.train_metrics.num_tokens}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.train_step = int(state.get("train_step", 0))
        self.train_metrics.num_tokens = float(state.get("num_tokens", 0.0))
        self.kept = {}
        by_rank = state.get("kept_by_rank") or [[]]
        rank = _rank()
        if rank >= len(by_rank):  # resumed on more processes: those sample the window again
            return
        for epoch, index, uses, roll in by_rank[rank]:
            self.kept[(epoch, tuple(index))] = [uses, Rollout(roll)]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _global_std(rewards: torch.Tensor) -> torch.Tensor | None:
    """scale_rewards=batch across processes: the std of every process's rewards (TRL gathers
    them), from one all-reduce of (count, sum, sum of squares); None in one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    ok = rewards[~torch.isnan(rewards)].double()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    stats = torch.stack([torch.tensor(float(ok.numel()), dtype=torch.float64), ok.sum(),
                         (ok * ok).sum()]).to(device)  # fmt: skip
    dist.all_reduce(stats)
    n, total, squares = stats.tolist()
    if n < 2:
        return torch.tensor(float("nan"))
    return torch.tensor(max(squares - total * total / n, 0.0) / (n - 1)).sqrt().float()


def _chunk_scores(h, targets, weight, bias, temperature: float) -> torch.Tensor:
    """(tokens, 2): each token's log-prob (with its gradient) and the entropy (none) under
    one chunk's logits, fp32, divided by the temperature."""
    logits = F.linear(h, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = logits.logsumexp(-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    with torch.no_grad():
        entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return torch.stack([logp, entropy], -1)


class _Collect:
    """Metric sums of one evaluation batch (Running's `add`, kept as (sum, count))."""

    def __init__(self):
        self.totals: dict[str, tuple[torch.Tensor, Any]] = {}

    def add(self, name: str, total: torch.Tensor, count: Any) -> None:
        s, c = self.totals.get(name, (0.0, 0))
        self.totals[name] = (total + s, count + c)


def _shown(prompt: Any) -> str:
    """A prompt as the table shows it: its text, or its last message's."""
    if isinstance(prompt, list):
        return str(prompt[-1].get("content", "")) if prompt else ""
    return str(prompt)


class _Spreads(Running):
    """The training metrics, where each std name of `pairs` (std -> mean) sums the squares of
    its mean's values, over the same count: `read` turns it into the std of every process's
    values since the last logging step, with Bessel's correction (TRL's nanstd of the rewards
    gathered from all processes), from the loop's one all-reduce. `num_tokens` is the running
    total of the tokens trained on (TRL's); `clip_ratio/low_min` and `high_max` the lowest and
    highest process's clip ratios (TRL's), one small collective at a logging step."""

    def __init__(self, pairs: dict[str, str]):
        super().__init__(torch.float32)
        self.pairs = pairs
        self.num_tokens = 0.0  # every process's, since the run began (kept in checkpoints)

    def _extremes(self) -> dict[str, float]:
        """clip_ratio/low_min and high_max over the processes (read before the sums reset)."""
        out = {}
        for mean, name, op in (("clip_ratio/low_mean", "clip_ratio/low_min", "min"),
                               ("clip_ratio/high_mean", "clip_ratio/high_max", "max")):  # fmt: skip
            if mean not in self.sums:
                continue
            n = self.device_counts[mean] + self.counts[mean]
            empty = float("inf") if op == "min" else float("-inf")
            local = torch.where(n > 0, self.sums[mean] / n.clamp(min=1), empty).double()
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(local, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
            value = float(local)  # (a logging step: the device has just synced)
            if math.isfinite(value):
                out[name] = value
        return out

    def read(self, device: list[float], host: list[float]) -> dict[str, float]:
        k = len(self.names)
        counts = {name: host[i] + device[k + i] for i, name in enumerate(self.names)}
        extremes = self._extremes()
        out = super().read(device, host)
        out.update(extremes)
        if "num_tokens" in out:  # the mean a micro-batch -> the run's running total
            self.num_tokens += out["num_tokens"] * counts["num_tokens"]
            out["num_tokens"] = self.num_tokens
        for std, mean in self.pairs.items():
            n, squares = counts.get(std, 0), out.pop(std, None)
            if squares is not None and mean in out and n > 1:
                out[std] = math.sqrt(max(squares - out[mean] ** 2, 0.0) * n / (n - 1))
        return out

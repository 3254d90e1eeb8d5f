"""task=preference: tune a causal LM on pairs of a chosen and a rejected answer (dataset=
preference), with one of four losses, each written from its paper:

- `dpo`: Rafailov et al. 2023, "Direct Preference Optimization" (arXiv:2305.18290), eq. 7:
  -log sigma(beta * [(log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))]), log-probs
  summed over the answer's tokens. `task.label_smoothing` > 0 is conservative DPO (cDPO,
  Mitchell 2023): the labels flipped with that probability.
- `ipo`: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
  Preferences" (arXiv:2310.12036), eq. 17: (h - 1/(2 beta))^2 with h the difference of the two
  log-ratios; as TRL does (agreed with IPO's authors), each log-ratio divided by its answer's
  token count.
- `simpo`: Meng et al. 2024, "SimPO" (arXiv:2405.14734), eq. 6: -log sigma(beta * (avg log pi
  (y_w) - avg log pi(y_l)) - gamma), the average log-prob per token, no reference. `task.gamma`
  is the margin gamma itself, TRL's CPOConfig `simpo_gamma` (the paper tunes gamma/beta).
- `orpo`: Hong et al. 2024, "ORPO" (arXiv:2403.07691), eqs. 6-7: NLL(y_w) - lambda * log sigma
  (log odds(y_w) - log odds(y_l)), odds = p / (1 - p) of the average log-prob p; no reference.
  `task.lambda` is lambda (TRL's ORPOConfig calls it `beta`); the NLL is over the chosen answer's
  tokens, as the paper's L_SFT (TRL's ORPOTrainer also counts the prompt's).

Chosen and rejected rows run in one forward pass (2B rows: the chosen first, TRL's order); only
answer tokens are scored. The reference log-probs (DPO, IPO), in this order of preference:
`task.precompute_reference=true`: one no-grad pass over every split before training, saved as
`reference_logps.pt` in the run dir and reused on resume; under LoRA (`lora.rank>0`): the same
model with its adapters off (no second copy); otherwise a frozen copy of the starting model
(as much memory again as the weights; accel-eval builds it again from model.path).

Metrics in TRL's names (train/... and val/...): rewards/chosen and rewards/rejected (beta times
the log-ratio for DPO and IPO, beta times the average log-prob for SimPO, lambda times it for
ORPO, as TRL logs them), rewards/accuracies (chosen reward above rejected), rewards/margins,
logps/chosen and logps/rejected (summed for DPO and IPO, averaged for SimPO and ORPO).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from accel_train.config.combinations import REFUSED, strategy_key
from accel_train.config.facts import TASK_KEYS_REFUSED
from accel_train.config.schema import PreferenceTaskConfig
from accel_train.data.batch import to_device
from accel_train.errors import UserError
from accel_train.models import build_model
from accel_train.plugins import register_task
from accel_train.strategies import strategy_class
from accel_train.tasks.base import Task, TaskContext, evaluating
from accel_train.tasks.language_model import call

log = logging.getLogger("accel_train")

LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
REFERENCE_FILE = "reference_logps.pt"
METRICS = {
    "rewards/chosen": "max",
    "rewards/rejected": "min",
    "rewards/accuracies": "max",
    "rewards/margins": "max",
    "logps/chosen": "max",
    "logps/rejected": "min",
}


# ---- the losses (per pair), from the papers' formulas --------------------------------------


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (Maechler 2012)."""
    return torch.where(
        x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


def pair_losses(
    loss: str,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    n_chosen: torch.Tensor,
    n_rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None = None,
    ref_rejected: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    gamma: float = 0.5,
    lam: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward, chosen logps, rejected logps as logged)
    from the policy's *summed* answer log-probs and answer token counts (and the reference's
    summed log-probs for dpo/ipo); all (B,), fp32."""
    eps = label_smoothing
    if loss in ("dpo", "ipo"):
        chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
        if loss == "dpo":
            z = beta * (chosen_ratio - rejected_ratio)
            out = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        else:
            h = chosen_ratio / n_chosen.clamp(min=1) - rejected_ratio / n_rejected.clamp(min=1)
            out = (h - 1 / (2 * beta)) ** 2
        return out, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen, rejected
    avg_c, avg_r = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
    if loss == "simpo":
        z = beta * (avg_c - avg_r) - gamma
        out = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return out, beta * avg_c.detach(), beta * avg_r.detach(), avg_c, avg_r
    log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
    out = -avg_c - lam * F.logsigmoid(log_odds)
    return out, lam * avg_c.detach(), lam * avg_r.detach(), avg_c, avg_r


def answer_logps(
    logits: torch.Tensor, labels: torch.Tensor, ignore: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each row's labelled tokens, their count), fp32: the label's logit
    minus the logsumexp, so no (rows, time, vocab) log-softmax is kept."""
    mask = labels != ignore
    index = torch.where(mask, labels, 0).unsqueeze(-1)
    picked = logits.gather(-1, index).squeeze(-1).float()
    token = (picked - logits.float().logsumexp(-1)) * mask
    return token.sum(-1), mask.sum(-1)


@contextlib.contextmanager
def adapters_off(layers: list[nn.Module]) -> Iterator[None]:
    """PEFT's LoRA layers compute their base layer alone. The flag is set directly: PEFT's
    `enable_adapters(False)` also turns the adapters' requires_grad off, and turning it back on
    (`set_adapter`) is not what an optimizer and DDP, built over those parameters, expect."""
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer  # the hf extra (lora.rank needs it)

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _flat(batch: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 2, T) pairs -> (2B, T) rows: the B chosen first, then the B rejected."""
    ids, labels = batch["input_ids"], batch["labels"]
    return ids.transpose(0, 1).flatten(0, 1), labels.transpose(0, 1).flatten(0, 1)


@register_task("preference", PreferenceTaskConfig)
class Preference(Task):
    name = "preference"
    generates_text = True  # a causal LM: accel-sample may sample its checkpoints

    def __init__(
        self,
        loss: str = "dpo",
        beta: float = 0.1,
        gamma: float = 0.5,
        label_smoothing: float = 0.0,
        precompute_reference: bool = False,
        ignore_index: int = -100,
        **rest: Any,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise UserError(f"task.loss={loss}: must be one of {', '.join(LOSSES)}.")
        self.loss, self.beta, self.gamma = loss, float(beta), float(gamma)
        self.lam = float(rest.pop("lambda", 0.1))  # `lambda`: a Python keyword, so by name
        if rest:
            raise UserError(f"task=preference takes no {', '.join(sorted(rest))}.")
        self.label_smoothing, self.ignore = float(label_smoothing), ignore_index
        self.precompute = bool(precompute_reference)
        self.ref_mode = "none"  # none | table | adapters | copy: set at setup
        self.ref_model: nn.Module | None = None
        self.ref_table: torch.Tensor | None = None  # (pairs of every split, 2) summed logps
        self._layers: list[nn.Module] | None = None

    @classmethod
    def metric_modes(cls, cfg: DictConfig) -> dict[str, str]:
        return {"loss": "min", **METRICS}

    @classmethod
    def config_refusal(cls, cfg: DictConfig) -> str | None:
        """What cannot work with this run's other choices, found before anything is built."""
        return _refused_keys(cfg.task) or _refused_combination(cfg)

    # ---- build time ----------------------------------------------------------------------

    def setup(self, ctx: TaskContext) -> None:
        super().setup(ctx)
        self._check_batch(ctx)
        if self.loss in REFERENCE_FREE:
            self.ref_mode = "none"
        elif self.precompute and ctx.val_samples > 0:
            self.ref_mode = "table"
            self.ref_table = self._reference_table(ctx).to(ctx.device)
        elif ctx.cfg.lora.rank > 0:
            self.ref_mode = "adapters"
        else:  # the starting model: training sets up on it (before any resume loads
            # weights); accel-eval sets up on the trained one, so it builds it again from model.path
            self.ref_mode = "copy"
            if ctx.val_samples > 0:
                self.ref_model = copy.deepcopy(ctx.model)
            else:
                self.ref_model = build_model(ctx.cfg.model, ctx.data_args, self.param_dtype)
            self.ref_model.to(ctx.device).eval().requires_grad_(False)
        if ctx.warn:
            log.info("task=preference: loss=%s, reference: %s", self.loss, self.ref_mode)

    def _check_batch(self, ctx: TaskContext) -> None:
        batch = ctx.prepared(self)
        ok = isinstance(batch, Mapping) and {"input_ids", "labels", "index"} <= set(batch)
        if not ok or batch["input_ids"].dim() != 3 or batch["input_ids"].shape[1] != 2:
            raise UserError(
                f"task=preference trains on pairs of a chosen and a rejected answer, but "
                f"dataset={ctx.cfg.dataset.get('name', 'custom')} gives "
                f"{type(batch).__name__} batches. Use `dataset=preference dataset.path=<pairs."
                "jsonl>` (records with prompt, chosen and rejected)."
            )
        ids, labels = _flat(batch)
        with evaluating(ctx.model):
            logits = call(ctx.model, ids)
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != labels.shape:
            raise UserError(
                f"model._target_={ctx.cfg.model._target_} with task=preference must return "
                f"logits (rows, time, vocab) for token ids of shape {tuple(ids.shape)}."
            )

    def _reference_table(self, ctx: TaskContext) -> torch.Tensor:
        """task.precompute_reference: the starting model's summed answer log-probs of every
        pair, read from the run dir when present there for these very pairs, else computed
        once (no grad) and written there."""
        splits = [s for s in (ctx.splits.train, ctx.splits.val, ctx.splits.test) if s]
        if not all(hasattr(s, "fingerprint") for s in splits):
            raise UserError(
                "task.precompute_reference=true keys the reference log-probs by pair, which "
                "dataset=preference numbers; this dataset does not. Use dataset=preference."
            )
        key = [s.fingerprint() for s in splits]
        path = Path(str(ctx.cfg.paths.output_dir)) / REFERENCE_FILE
        if path.is_file():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("data") != key or saved.get("loss_model") != str(ctx.cfg.model.path):
                raise UserError(
                    f"{path} holds reference log-probs of other pairs or another model than "
                    "this run's (the records, dataset.max_length or model.path changed since it "
                    "was written). Resume with the data and model it was written for, or start "
                    "a new run dir (it is never overwritten)."
                )
            log.info("task=preference: reference log-probs read from %s", path)
            return saved["logps"]
        table = self._compute_table(ctx, splits)
        if ctx.warn:  # one writer; written whole, then renamed into place
            tmp = path.with_name(f".{REFERENCE_FILE}.{os.getpid()}.tmp")
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"data": key, "loss_model": str(ctx.cfg.model.path), "logps": table}, tmp)
            os.replace(tmp, path)
            log.info("task=preference: reference log-probs of %d pairs -> %s", len(table), path)
        return table

    def _compute_table(self, ctx: TaskContext, splits: list) -> torch.Tensor:
        rows = []
        size = int(ctx.cfg.loader.batch_size)
        with evaluating(ctx.model):
            for split in splits:
                for start in range(0, len(split), size):
                    items = [split[i] for i in range(start, min(start + size, len(split)))]
                    batch = to_device(split.collate(items), ctx.device)
                    rows.append(self._policy_logps(ctx.model, batch)[0].view(2, -1).T)
        # HOST SYNC (before training): the table moves to the host to be saved
        return torch.cat(rows).float().cpu()

    # ---- the step ------------------------------------------------------------------------

    def inputs(self, batch: Any) -> torch.Tensor:
        return _flat(batch)[0]

    def forward(self, model: nn.Module, batch: Any) -> Any:
        return call(model, _flat(batch)[0])

    def tokens_in(self, batch: Any) -> int:
        return batch["input_ids"].numel()

    def _policy_logps(self, model: nn.Module, batch: Mapping):
        ids, labels = _flat(batch)
        return answer_logps(call(model, ids), labels, self.ignore)

    def _reference(self, model: nn.Module, batch: Mapping) -> torch.Tensor | None:
        """The reference's summed answer log-probs of the (2B,) rows, or None (SimPO, ORPO)."""
        if self.ref_mode == "none":
            return None
        if self.ref_mode == "table":
            pairs = self.ref_table[batch["index"]]  # (B, 2): chosen, rejected
            return torch.cat([pairs[:, 0], pairs[:, 1]])
        with torch.no_grad():
            if self.ref_mode == "copy":
                return self._policy_logps(self.ref_model, batch)[0]
            if self._layers is None:
                self._layers = _lora_layers(model)
            with adapters_off(self._layers):
                return self._policy_logps(model, batch)[0]

    def _score(self, model: nn.Module, batch: Mapping):
        sums, counts = self._policy_logps(model, batch)
        ref = self._reference(model, batch)
        b = batch["input_ids"].shape[0]
        ref_c, ref_r = (ref[:b], ref[b:]) if ref is not None else (None, None)
        out, r_c, r_r, lp_c, lp_r = pair_losses(
            self.loss, sums[:b], sums[b:], counts[:b], counts[b:], ref_c, ref_r,
            beta=self.beta, gamma=self.gamma, lam=self.lam,
            label_smoothing=self.label_smoothing,
        )  # fmt: skip
        metrics = {
            "rewards/chosen": r_c.sum(),
            "rewards/rejected": r_r.sum(),
            "rewards/accuracies": (r_c > r_r).float().sum(),
            "rewards/margins": (r_c - r_r).sum(),
            "logps/chosen": lp_c.detach().sum(),
            "logps/rejected": lp_r.detach().sum(),
        }
        return out.sum(), b, metrics

    def step(self, model: nn.Module, batch: Any):
        """The summed per-pair loss and the pairs: the loop divides once by the pairs of the
        whole accumulated batch. The metrics are summed on the device (no host sync)."""
        loss, b, metrics = self._score(model, batch)
        for name, total in metrics.items():
            self.train_metrics.add(name, total, b)
        return loss, b

    def eval_output(self, model: nn.Module, batch: Any):
        loss, b, metrics = self._score(model, batch)
        return loss, b, {k: v / b for k, v in metrics.items()}  # means: evaluate weighs by n


def _refused_keys(task: DictConfig) -> str | None:
    """The task's own keys out of range (or a loss that does not take them)."""
    if task.get("loss") not in LOSSES:
        return f"task.loss={task.get('loss')}: must be one of {', '.join(LOSSES)}."
    if task.get("beta", 0.1) <= 0 or task.get("lambda", 0.1) < 0:
        return (
            f"task.beta={task.get('beta')} must be > 0 and task.lambda={task.get('lambda')} "
            ">= 0: beta scales the reward (DPO's 0.1), lambda weighs ORPO's odds-ratio term."
        )
    if not 0 <= task.get("label_smoothing", 0.0) < 0.5:
        return (
            f"task.label_smoothing={task.label_smoothing}: the probability that a pair's "
            "preference is flipped (cDPO) must be in [0, 0.5); 0 = off."
        )
    if task.get("chunked_loss") is not None:  # (`+task.chunked_loss`: not in the schema)
        why = TASK_KEYS_REFUSED[("preference", "chunked_loss")]
        return f"task.chunked_loss with task=preference: {why}"
    if task.get("precompute_reference") and task.loss in REFERENCE_FREE:
        return (
            f"task.precompute_reference=true with task.loss={task.loss}: {task.loss} is "
            "reference-free (it scores the policy alone, no reference model), so there is "
            "nothing to precompute and the option would be ignored. Drop "
            "`task.precompute_reference=true`, or use a loss that compares with a reference "
            "(`task.loss=dpo` or `task.loss=ipo`)."
        )
    if task.get("label_smoothing", 0.0) and task.loss not in ("dpo", "simpo"):
        return (
            f"task.label_smoothing with task.loss={task.loss}: only dpo (cDPO) and simpo "
            "take it. Set `task.label_smoothing=0`."
        )
    return None


def _refused_combination(cfg: DictConfig) -> str | None:
    """The model and strategy choices preference tuning cannot run with."""
    model = cfg.model.get("name")
    if model != "hf":
        return (
            f"task=preference with model={model}: preference tuning scores a causal "
            "language model's answers rendered with its folder's tokenizer and chat "
            "template, which only model=hf provides (model=gpt has no chat template). Use "
            "`model=hf model.path=<folder>` (or `+experiment=dpo_lora`)."
        )
    if cfg.model.get("head", "causal_lm") != "causal_lm":
        return (
            f"task=preference with model.head={cfg.model.head}: it scores next-token "
            "log-probs; use `model.head=causal_lm`."
        )
    strategy = strategy_key(cfg)
    if (strategy, "lora") in REFUSED:  # LoRA's rows: pipeline, tp, fsdp with strategy.tp
        shown = f"strategy={cfg.strategy.name}"
        if strategy != cfg.strategy.name:
            shown += f" strategy.tp={cfg.strategy.tp}"
        return (
            f"task=preference with {shown}: the reference pass (the model with its LoRA "
            "adapters off, or a frozen copy beside it) is wired in only where LoRA works, "
            "and LoRA is refused with this strategy. Use `strategy=ddp`, or `strategy=fsdp` "
            "without strategy.tp."
        )
    # Asked of the strategy, not its name: one that shards the parameters over the processes
    # (FSDP) would hold the frozen copy whole on each. (Its TP rows were refused above.)
    sharded = strategy_class(cfg.strategy.name).shards_parameters
    needs_ref = cfg.task.get("loss", "dpo") not in REFERENCE_FREE
    copy = needs_ref and cfg.lora.rank <= 0 and not cfg.task.get("precompute_reference")
    if sharded and copy:
        return (
            f"task=preference task.loss={cfg.task.loss} with strategy={cfg.strategy.name} and "
            "lora.rank=0: the reference model would be a whole unsharded frozen copy on every "
            "process, which defeats sharding the parameters. Set "
            "`task.precompute_reference=true` (one pass before training, saved in the run "
            "dir), or train LoRA adapters (`lora.rank=16`: the reference is the model with its "
            "adapters off)."
        )
    return None

"""GRPO's arithmetic, as TRL 1.16's GRPOTrainer computes it (`_generate_and_score_completions`,
`_compute_loss`), written once here so the task and the parity test share it:

- `advantages`: the weighted rewards' group-relative advantages (Shao et al. 2024,
  "DeepSeekMath", arXiv:2402.03300, sec. 4.1.2): the reward minus its group's mean, divided by
  the group's std (`scale_rewards=group`), the batch's (`batch`), or not at all (`none`: Liu et
  al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO); NaN (no function applied) -> 0.
- `token_losses`: the clipped surrogate -min(r A, clip(r, 1-eps, 1+eps_high) A) per token, the
  ratio r per token or one per completion (`importance_sampling_level=sequence`: Zheng et al.
  2025, "GSPO", arXiv:2507.18071, the mean log-ratio over the completion's tokens), plus
  beta times the k3 estimator of the KL to the reference (Schulman 2020), times the ratio
  (`use_bias_correction_kl`, TRL 1.16's default: the unbiased reverse-KL gradient of
  DeepSeek-V3.2, arXiv:2512.02556).
- `reduce`: the token losses to the loss, by `loss_type`: grpo (each completion's token mean,
  then the mean over completions), bnpo (the mean over the micro-batch's tokens), dr_grpo (the
  sum over tokens / (completions x max_completion_length)), dapo (the sum over tokens, divided
  by the loop once by the tokens of the whole accumulated batch on every process: Yu et al.
  2025, "DAPO", arXiv:2503.14476).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
IS_LEVELS = ("token", "sequence")


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The std ignoring NaNs, with Bessel's correction (NaN for fewer than 2 values): TRL's."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = (var * corr).sqrt()
    return std if keepdim else (std.squeeze(dim) if dim is not None else std.reshape(()))


def weighted_rewards(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(completions, functions) rewards (NaN: does not apply) -> one reward per completion, the
    weighted sum of those that apply; NaN where none does."""
    total = (per_func * weights.unsqueeze(0)).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_func).all(dim=1), float("nan"))


def advantages(
    rewards: torch.Tensor, group: int, scale: str = "group", std: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, whether each completion's std is zero), from the (completions,) rewards
    laid out group by group (`group` completions of one prompt in a row). `std`: the batch's
    std when the batch spans several processes (scale=batch); None: these rewards'."""
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group)
    elif std is not None:  # batch, over every process's rewards
        std = std.to(rewards).expand_as(rewards)
    elif rewards.numel() > 1:  # batch
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = torch.zeros_like(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    level: str = "token",
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    bias_correction_kl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(per-token loss (N, C), the ratio coef_1 ((N, C), or (N, 1) per sequence), per-token KL
    or None) from the (N, C) log-probs of the policy, of the policy that sampled (old) and of
    the reference, the (N,) advantages and the (N, C) completion mask."""
    log_ratio = logps - old_logps
    if level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + epsilon_high)
    a = adv.unsqueeze(1)
    loss = -torch.min(coef_1 * a, coef_2 * a)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if bias_correction_kl:  # times the ratio: the unbiased reverse-KL gradient (TRL's)
            kl = kl * coef_1
        loss = loss + beta * kl
    return loss, coef_1, kl


def reduce(
    loss_type: str, per_token: torch.Tensor, mask: torch.Tensor, max_completion_length: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the micro-batch's loss, None) for a mean loss, or (summed loss, tokens) for dapo, which
    the loop divides once by the tokens of the whole accumulated batch over all processes
    (TRL's `num_items_in_batch`). `mask` is float."""
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), None
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0), None
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token.size(0) * max_completion_length), None
    return masked.sum(), mask.sum()


def clip_stats(
    coef_1: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, epsilon: float, epsilon_high: float
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """TRL's clip_ratio/low_mean, high_mean and region_mean: (sum, count) over the tokens (one
    value a completion at importance_sampling_level=sequence)."""
    a = adv.unsqueeze(1)
    low = (coef_1 < 1 - epsilon) & (a < 0)
    high = (coef_1 > 1 + epsilon_high) & (a > 0)
    out = {}
    for name, hit in (("low_mean", low), ("high_mean", high), ("region_mean", low | high)):
        hit = hit.float()
        if hit.shape[1] == 1:
            out[f"clip_ratio/{name}"] = (hit.sum(), torch.tensor(float(hit.shape[0])))
        else:
            out[f"clip_ratio/{name}"] = ((hit * mask).sum(), mask.sum())
    return out

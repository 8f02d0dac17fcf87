"""Training-inference drift estimators (pure torch, no Ray).

Samples come from the rollout (inference) policy, so with r = pi_train / pi_inference per token:
    K1 = E[log pi_inf - log pi_train]      unbiased KL(inf || train), can be negative per batch
    K2 = E[0.5 (log r)^2]                  low-variance, biased
    K3 = E[r - 1 - log r]                  unbiased and >= 0 for every sample (Schulman's k3)
    chi2 = E[r^2] - 1,  ess = (sum r)^2 / (n sum r^2)  in (0, 1]
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from moe_rl.core.metrics import jaccard, topk_sets_equal


def drift_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor,
                  mask: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """trainer_logp, rollout_logp: [B] (or any matching shape) log-probs of the *taken* actions.
    mask: same shape, True where the token counts. Returns k1, k2, k3, chi2, ess,
    max_abs_logp_diff, mean_abs_logp_diff, mean_abs_prob_diff and n."""
    t = trainer_logp.double().reshape(-1)
    r_ = rollout_logp.double().reshape(-1)
    if mask is not None:
        keep = mask.reshape(-1).bool()
        t, r_ = t[keep], r_[keep]
    n = t.numel()
    if n == 0:
        return {"n": 0}
    log_r = t - r_
    ratio = log_r.exp()
    diff = log_r.abs()
    return {
        "k1": (-log_r).mean().item(),
        "k2": (0.5 * log_r.pow(2)).mean().item(),
        "k3": (ratio - 1 - log_r).mean().item(),
        "chi2": (ratio.pow(2).mean() - 1).item(),
        "ess": (ratio.sum().pow(2) / (n * ratio.pow(2).sum())).item(),
        "max_abs_logp_diff": diff.max().item(),
        "mean_abs_logp_diff": diff.mean().item(),
        "mean_abs_prob_diff": (t.exp() - r_.exp()).abs().mean().item(),
        "n": n,
    }


def drift_by_position(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, positions: torch.Tensor,
                      bins) -> Dict[int, Dict[str, float]]:
    """drift_metrics per position bin: bins = ascending upper edges, e.g. [64, 128, 256]."""
    out, lo = {}, -1
    for hi in bins:
        m = (positions > lo) & (positions <= hi)
        if m.any():
            out[int(hi)] = drift_metrics(trainer_logp, rollout_logp, m)
        lo = hi
    return out


def routing_agreement(trainer_topk, rollout_topk) -> Dict[str, float]:
    """Per-layer agreement of top-k sets. Inputs: lists (one per layer) of [T, k] index tensors.
    Returns routing_agreement (mean over layers of the share of tokens with the same set),
    routing_jaccard, routing_flip_rate, first_divergent_layer (-1 if none) and per-layer values."""
    out, agree = {}, []
    first = -1
    for i, (a, b) in enumerate(zip(trainer_topk, rollout_topk)):
        a, b = a.long(), b.long()
        same = topk_sets_equal(a, b).double().mean().item() if a.numel() else 1.0
        agree.append(same)
        out[f"routing_agreement/layer{i}"] = same
        out[f"routing_jaccard/layer{i}"] = jaccard(a, b)
        if first < 0 and same < 1.0:
            first = i
    out["routing_agreement"] = sum(agree) / max(len(agree), 1)
    out["routing_jaccard"] = sum(out[f"routing_jaccard/layer{i}"] for i in range(len(agree))) / max(len(agree), 1)
    out["routing_flip_rate"] = 1.0 - out["routing_agreement"]
    out["first_divergent_layer"] = first
    return out


def policy_kl(old_logits: torch.Tensor, new_logits: torch.Tensor, discrete: bool) -> float:
    """Mean KL(old || new) per observation: exact for Categorical and diagonal Gaussian
    ([mean, log_std] halves), i.e. K3's expectation under the old policy."""
    old, new = old_logits.double(), new_logits.double()
    if discrete:
        lo, ln = torch.log_softmax(old, -1), torch.log_softmax(new, -1)
        return (lo.exp() * (lo - ln)).sum(-1).mean().item()
    mu0, ls0 = old.chunk(2, -1)
    mu1, ls1 = new.chunk(2, -1)
    kl = ls1 - ls0 + (torch.exp(2 * ls0) + (mu0 - mu1) ** 2) / (2 * torch.exp(2 * ls1)) - 0.5
    return kl.sum(-1).mean().item()


def format_breach(name: str, max_diff: float, threshold: float) -> str:
    """The log line form, e.g. `expert.3.w1: max_diff=0.47 (threshold=0.1)`."""
    return f"{name}: max_diff={max_diff:.4g} (threshold={threshold:g})"

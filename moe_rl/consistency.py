"""Training-inference drift estimators (pure torch, no Ray).

Samples come from the rollout (inference) policy, so with r = pi_train / pi_inference per token:
    K1 = E[log pi_inf - log pi_train]      unbiased KL(inf || train), can be negative per batch
    K2 = E[0.5 (log r)^2]                  low-variance, biased
    K3 = E[r - 1 - log r]                  unbiased and >= 0 for every sample (Schulman's k3)
    chi2 = E[r^2] - 1,  ess = (sum r)^2 / (n sum r^2)  in (0, 1]
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .metrics import jaccard, topk_sets_equal


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


def param_divergence(reference: Dict[str, torch.Tensor], other: Dict[str, torch.Tensor],
                     atol: float, rtol: float = 0.0):
    """Per-tensor max |delta| between two state dicts (e.g. learner vs rollout copy).
    A tensor breaches when max|delta| > atol + rtol * max|reference| (rtol covers a bf16 copy).
    Returns (worst max|delta|, {name: (max_diff, threshold)} over threshold, names in only one)."""
    breaches, worst = {}, 0.0
    mismatched = sorted(set(reference) ^ set(other))
    for name in sorted(set(reference) & set(other)):
        a, b = torch.as_tensor(reference[name]).double(), torch.as_tensor(other[name]).double()
        if a.shape != b.shape:
            mismatched.append(name)
            continue
        if not a.numel():
            continue
        d = (a - b).abs().max().item()
        worst = max(worst, d)
        thr = atol + rtol * a.abs().max().item()
        if d > thr:
            breaches[name] = (d, thr)
    return worst, breaches, mismatched


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




# --- the sync gate ---------------------------------------------------------------------------------
POLICIES = ("warn", "hold", "rollback")
DECISIONS = ("sync", "warn", "hold", "rollback")

# metric -> ("max" | "min", default threshold). A breach is metric > max or metric < min.
DEFAULT_THRESHOLDS = {
    "k3": ("max", 1e-3),                    # rollout vs trainer, on the batch just sampled
    "max_abs_logp_diff": ("max", 0.5),
    "routing_agreement": ("min", 0.95),
    "param_max_diff": ("max", 1e-5),        # absolute; a bf16 rollout copy adds 2^-8 * max|w| per tensor
    "replica_max_diff": ("max", 0.0),       # learners must hold bit-identical replicas
    "k3_old_new": ("max", 0.05),            # candidate vs current policy on the probe set
    "probe_flip_rate": ("max", 0.5),        # routing oscillation on the probe set
}

CONSISTENCY_DEFAULTS = {
    "enabled": True,
    "every": 1,               # check before every K-th weight sync
    "policy": "warn",         # warn | hold | rollback
    "thresholds": {},         # overrides of DEFAULT_THRESHOLDS (values only)
    "sample_size": 512,       # rollout steps per check given to the trainer-side forward
    "probe_size": 256,        # fixed probe observations kept for the whole run
    "position_bins": [8, 16, 32, 64, 128, 256, 512, 1024],
    "ledger_path": None,      # RUN_DIR/drift.parquet (the CLI sets it)
    "tis_cap": None,          # truncated importance sampling cap C on the PPO loss (e.g. 2.0)
}


def validate_consistency(c: dict) -> dict:
    from .settings import ConfigError
    unknown = sorted(set(c) - set(CONSISTENCY_DEFAULTS))
    if unknown:
        raise ConfigError(f"consistency.{unknown[0]}: unknown key, allowed: {', '.join(sorted(CONSISTENCY_DEFAULTS))}")
    c = {**CONSISTENCY_DEFAULTS, **c}

    def need(ok, field, allowed, got):
        if not ok:
            raise ConfigError(f"consistency.{field}: must be {allowed}, got {got!r}")

    need(isinstance(c["enabled"], bool), "enabled", "true or false", c["enabled"])
    need(isinstance(c["every"], int) and not isinstance(c["every"], bool) and c["every"] >= 1, "every",
         "an int >= 1", c["every"])
    need(c["policy"] in POLICIES, "policy", f"one of {POLICIES}", c["policy"])
    need(isinstance(c["thresholds"], dict), "thresholds", "a mapping", c["thresholds"])
    for k, v in c["thresholds"].items():
        need(k in DEFAULT_THRESHOLDS, f"thresholds.{k}", f"one of {sorted(DEFAULT_THRESHOLDS)}", k)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if DEFAULT_THRESHOLDS[k][0] == "min" or k.endswith("rate"):
            ok = ok and v <= 1
        need(ok, f"thresholds.{k}", "a finite number >= 0 (<= 1 for rates and agreements)", v)
    for f in ("sample_size", "probe_size"):
        need(isinstance(c[f], int) and not isinstance(c[f], bool) and c[f] >= 1, f, "an int >= 1", c[f])
    need(c["tis_cap"] is None or (isinstance(c["tis_cap"], (int, float)) and c["tis_cap"] >= 1), "tis_cap",
         "None or a number >= 1", c["tis_cap"])
    return c


def thresholds(overrides: Optional[dict] = None) -> Dict[str, tuple]:
    out = dict(DEFAULT_THRESHOLDS)
    for k, v in (overrides or {}).items():
        out[k] = (DEFAULT_THRESHOLDS[k][0], float(v))
    return out


def breaches(metrics: Dict[str, float], limits: Dict[str, tuple]):
    """[(metric, value, threshold)] for every metric present and outside its limit."""
    out = []
    for k, (kind, thr) in limits.items():
        v = metrics.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if (kind == "max" and v > thr) or (kind == "min" and v < thr):
            out.append((k, v, thr))
    return out


def gate_decision(policy: str, found, weights_finite: bool = True):
    """-> (decision, reason). Non-finite candidate weights never reach the rollouts."""
    if not weights_finite:
        return ("rollback" if policy == "rollback" else "hold"), "candidate weights are not finite"
    if not found:
        return "sync", ""
    reason = "; ".join(f"{k}={v:.4g} (threshold={t:g})" for k, v, t in found)
    return {"warn": "warn", "hold": "hold", "rollback": "rollback"}[policy], reason


PARAM_GROUPS = ("router", "shared_expert", "experts", "policy_head", "value_head", "other")


def param_group(name: str) -> str:
    """Parameter group by module path (tensors have no .name)."""
    if ".router." in name or ".gate.router." in name:
        return "router"
    if ".shared_expert." in name:
        return "shared_expert"
    if ".experts." in name:
        return "experts"
    if name.startswith(("pi.", "log_std")):
        return "policy_head"
    if name.startswith("vf."):
        return "value_head"
    return "other"


def update_size(old: Dict[str, torch.Tensor], new: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Relative update ||new - old|| / ||old|| per parameter group."""
    num, den = {}, {}
    for k in old.keys() & new.keys():
        g = param_group(k)
        a, b = torch.as_tensor(old[k]).double(), torch.as_tensor(new[k]).double()
        num[g] = num.get(g, 0.0) + (b - a).pow(2).sum().item()
        den[g] = den.get(g, 0.0) + a.pow(2).sum().item()
    return {f"update_size/{g}": math.sqrt(num[g]) / max(math.sqrt(den[g]), 1e-12) for g in num}

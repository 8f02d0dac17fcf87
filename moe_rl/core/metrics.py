"""Load-balance and routing health metrics (pure torch).

The raw figures of each layer: utilisation shares (min, max), CV of the expert counts, active
experts, router entropy (-sum p ln p, mean per state, in nats and normalised by ln N), and
`load_grade`, an LM pre-training utilisation table (docs/stability.md, "The load table"; N experts,
utilisation u_i = tokens_i / total), the worst of:

| metric | healthy  | warning      | danger   |
| min u  | > 0.8/N  | 0.3/N..0.8/N | < 0.3/N  |
| max u  | < 3/N    | 3/N..8/N     | > 8/N    |
| CV     | < 0.5    | 0.5..1.0     | > 1.0    |

The table is kept as a figure, not as the grade: in RL it reads specialisation (a narrowing state
distribution) as imbalance. `health`, the grade, is moe_rl.core.health's: dead experts or a
collapse, judged over consecutive updates.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from moe_rl.core.health import HealthWatch
from moe_rl.core.routing import RoutingRecord

GRADES = ("healthy", "warning", "danger")
# Utilisation-share bands in units of 1/N: healthy in [0.8/N, 3/N]; danger below 0.3/N or above 8/N.
DANGER_LOW, WARN_LOW, WARN_HIGH, DANGER_HIGH = 0.3, 0.8, 3.0, 8.0
CV_WARN, CV_DANGER = 0.5, 1.0
# Per-expert columns (utilisation share, logit mean/std) are logged up to this many experts: beyond
# it they would swamp metrics.parquet and TensorBoard (the layer-level figures remain).
PER_EXPERT_MAX = 64


def expert_counts(top_k_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] indices -> [N] int64 assignment counts."""
    return torch.bincount(top_k_indices.reshape(-1).long(), minlength=num_experts)


# A Soft MoE expert always receives some weight (softmax), so "no state selected it" becomes "its
# share of the combine weight fell below this fraction of an even share (1/N)": 1 % of even.
SOFT_IDLE_SHARE = 0.01


def graded_load(record, load: torch.Tensor) -> torch.Tensor:
    """The load the balance figures and the grade judge: a sparse layer's assignment counts as
    they are; a Soft MoE layer's combine weights with every expert below SOFT_IDLE_SHARE of an
    even share counted as idle (0)."""
    if not getattr(record, "soft", False):
        return load
    load = load.double()
    share = load / load.sum().clamp_min(1e-30)
    return load.masked_fill(share < SOFT_IDLE_SHARE / load.numel(), 0.0)


def _grade(value: float, healthy, danger, higher_is_better: bool) -> int:
    if higher_is_better:
        return 0 if value > healthy else (2 if value < danger else 1)
    return 0 if value < healthy else (2 if value > danger else 1)


def balance_metrics(counts: torch.Tensor) -> Dict[str, float]:
    """counts: [N] -> utilisation extremes, CV (population std / mean), active experts and the
    load table's grade `load_grade`: 0 healthy, 1 warning, 2 danger (GRADES names it)."""
    n = counts.numel()
    c = counts.double()
    total = c.sum().item()
    util = c / total if total > 0 else torch.zeros_like(c)
    mean = c.mean().item()
    cv = (c.std(unbiased=False).item() / mean) if mean > 0 else float("inf")
    min_u, max_u = util.min().item(), util.max().item()
    load_grade = max(_grade(min_u, WARN_LOW / n, DANGER_LOW / n, True),
                 _grade(max_u, WARN_HIGH / n, DANGER_HIGH / n, False),
                 _grade(cv, CV_WARN, CV_DANGER, False)) if total > 0 else 2
    return {"min_util": min_u, "max_util": max_u, "cv": cv,
            "active_experts": int((counts > 0).sum().item()), "load_grade": load_grade}


def router_entropy(router_probs: torch.Tensor) -> Dict[str, float]:
    """Mean per-token entropy -sum p ln p of [T, N] probabilities, in nats and / ln N."""
    p = router_probs.double()
    h = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean().item()
    n = p.shape[-1]
    return {"router_entropy": h, "router_entropy_norm": h / math.log(n) if n > 1 else 1.0}


def logit_stats(router_logits: torch.Tensor) -> Dict[str, List[float]]:
    """Per-expert router-logit mean and std: healthy routers have similar means and overlap."""
    l = router_logits.double()
    return {"logit_mean": l.mean(0).tolist(), "logit_std": l.std(0, unbiased=False).tolist()}


def topk_sets_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, k] x [T, k] -> [T] bool: the same set of experts (order ignored)."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def flip_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of tokens whose top-k *set* differs between two routing records of the same inputs."""
    if a.numel() == 0:
        return 0.0
    return 1.0 - topk_sets_equal(a, b).double().mean().item()


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean Jaccard overlap |A∩B| / |A∪B| of per-token top-k sets."""
    if a.numel() == 0:
        return 1.0
    inter = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum(-1).double()
    union = a.shape[-1] + b.shape[-1] - inter
    return (inter / union).mean().item()


def layer_health(record, counts: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """Scalar health metrics of one layer's routing record (the router's own choice). `counts`
    ([N], e.g. summed over an update's minibatches) replaces the record's own for the load figures.
    A Soft MoE layer: the load is the experts' combine weight, the per-state entropy that of each
    observation's combine shares over the experts, and dispatch_entropy_norm how many tokens a slot
    mixes (1: all of them alike)."""
    out = balance_metrics(graded_load(record, record.expert_load() if counts is None else counts))
    if getattr(record, "soft", False):
        h = float(record.state_entropy_norm())
        out.update({"router_entropy": h * math.log(record.num_experts), "router_entropy_norm": h,
                    "dispatch_entropy_norm": float(record.dispatch_entropy_norm()), "replay_divergence": 0.0})
        return out
    out.update(router_entropy(record.router_probs))
    # Under routing replay: the share of tokens whose own choice left the replayed experts.
    out["replay_divergence"] = flip_rate(record.top_k_indices, record.router_top_k)
    return out


# How the per-layer values fold into the headline "worst layer" value.
WORST_OF = {"min_util": min, "max_util": max, "cv": max, "active_experts": min, "load_grade": max,
            "health": max, "dead_experts": max, "idle_experts": max, "marginal_entropy_norm": min,
            "collapse_updates": max, "router_entropy": min, "router_entropy_norm": min, "replay_divergence": max,
            "dispatch_entropy_norm": min}


def per_expert(record, counts: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """`util/e{j}` (share of the assignments; Soft MoE: of the combine weight), `logit_mean/e{j}`,
    `logit_std/e{j}` (Soft MoE: of its slots' logits) of one layer."""
    counts = (record.expert_load() if counts is None else counts).double()
    share = (counts / counts.sum().clamp_min(1e-30)).tolist()
    if getattr(record, "soft", False):   # [B, m, N p] -> [B m p, N]: each expert's slot logits
        logits = record.logits.detach()
        logits = logits.reshape(-1, record.num_experts, record.slots_per_expert).transpose(1, 2)
        stats = logit_stats(logits.reshape(-1, record.num_experts))
    else:
        stats = logit_stats(record.router_logits.detach())
    out = {f"util/e{j}": v for j, v in enumerate(share)}
    for k in ("logit_mean", "logit_std"):
        out.update({f"{k}/e{j}": v for j, v in enumerate(stats[k])})
    return out


def health_summary(records: Iterable[RoutingRecord],
                   counts: Optional[Sequence[torch.Tensor]] = None,
                   watch: Optional[HealthWatch] = None) -> Dict[str, float]:
    """`moe/layer{i}/<metric>` for every layer (per expert too, up to PER_EXPERT_MAX experts) plus
    `moe/<metric>` for the worst layer. `counts`: per layer, the assignments to grade the load on
    (a whole update's; one minibatch of a few hundred tokens over dozens of experts leaves some
    experts with a handful of tokens by chance, which the utilisation bands read as danger).
    `watch`: the module's HealthWatch, fed this update (the grade `health` needs the updates
    before it); without one, the grade of this update alone (never `danger` for a dead expert)."""
    records = list(records)
    counts = list(counts) if counts is not None else [None] * len(records)
    counts = [r.expert_load() if c is None else c for r, c in zip(records, counts)]
    per_layer = [layer_health(r, c) for r, c in zip(records, counts)]
    graded = (watch or HealthWatch()).observe([graded_load(r, c) for r, c in zip(records, counts)],
                                              [m["router_entropy_norm"] for m in per_layer])
    for m, g in zip(per_layer, graded):
        m.update(g)
    out = {}
    for i, (m, r, c) in enumerate(zip(per_layer, records, counts)):
        out.update({f"moe/layer{i}/{k}": v for k, v in m.items()})
        if r.num_experts <= PER_EXPERT_MAX:
            out.update({f"moe/layer{i}/{k}": v for k, v in per_expert(r, c).items()})
    for key, worst in WORST_OF.items():
        values = [m[key] for m in per_layer if key in m]   # dispatch entropy: Soft MoE layers only
        if values:
            out[f"moe/{key}"] = worst(values)
    return out

"""Drift estimators chosen by what the policy is and how it routes (pure torch).

The consistency check compares the rollout copy with the trainer *at the same weights* on the steps
the rollout took (mismatch), the trainer at the synced weights with steps taken at older ones
(policy lag: recorded, never judged as mismatch), and a candidate with the last good weights on a
fixed probe set (how far an update moved the policy). What "compare" means depends on the policy:

| policy kind  | families   | per step, rollout and trainer      | mismatch figures                          |
| categorical  | PPO, APPO  | log-prob of the taken action       | K1/K2/K3, chi2, ESS, max |d logp| (drift) |
| q            | DQN        | Q-values of every action [A]       | greedy-action agreement, max and mean     |
|              |            |                                    | |dQ| over the Q scale (mean |Q|)          |

and on how it routes:

| routing kind | mixtures   | per step and MoE layer             | routing figures                           |
| sparse       | top-k      | the top-k experts                  | top-k set agreement per layer             |
| soft         | Soft MoE   | each expert's combine share [N]    | total variation of the shares per layer   |
| none         | dense      | -                                  | -                                         |

Per expert: the policy figure grouped by the experts a step used (sparse: its top-k; soft: the
expert carrying most of its output), so one drifting expert shows where the batch mean hides it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch

from moe_rl.core.drift import drift_metrics, policy_kl, routing_agreement
from moe_rl.core.metrics import topk_sets_equal
from moe_rl.core.routing import decode_top_k

POLICY_KINDS = ("categorical", "q")
ROUTING_KINDS = ("sparse", "soft", "none")


@dataclass(frozen=True)
class PolicyKind:
    policy: str = "categorical"   # POLICY_KINDS
    routing: str = "sparse"       # ROUTING_KINDS
    discrete: bool = True         # categorical: a Categorical (else a diagonal Gaussian) action distribution


def _layers(x) -> List[torch.Tensor]:
    """[T, L, ...] -> one [T, ...] tensor per layer."""
    t = torch.as_tensor(np.asarray(x))
    return [t[:, i] for i in range(t.shape[1])] if t.dim() > 1 else []


# --- value-based policies -----------------------------------------------------------------------
def q_scale(q: torch.Tensor) -> float:
    """What a Q-value gap is measured against: the mean |Q| (floored, so an untrained network's
    near-zero Q-values do not turn rounding into a large relative gap)."""
    return max(float(q.double().abs().mean()), 1e-3)


def q_figures(trainer_q, rollout_q) -> Dict[str, float]:
    """[T, A] Q-values of the same observations: greedy_agreement (share of steps whose greedy
    action is the same), q_gap_max_rel / q_gap_mean_rel (max and mean |dQ| over the trainer's Q
    scale) and q_scale."""
    t, r = torch.as_tensor(np.asarray(trainer_q)).double(), torch.as_tensor(np.asarray(rollout_q)).double()
    if not len(t):
        return {}
    gap = (t - r).abs()
    scale = q_scale(t)
    return {"greedy_agreement": float((t.argmax(-1) == r.argmax(-1)).double().mean()),
            "q_gap_max_rel": float(gap.max()) / scale, "q_gap_mean_rel": float(gap.mean()) / scale,
            "q_scale": scale}


def q_change(old_q, new_q, reference: float = 0.0) -> Dict[str, float]:
    """How far an update moved the Q-values on the probe set: q_change (max |dQ| over the larger of
    the old Q scale and `reference`, the run's recent Q scale: a Q blow-up is orders of magnitude)
    and greedy_flip_rate (share of probe states whose greedy action changed). Why the reference:
    early in a DQN run the Q-values pass near zero (mean |Q| 0.01-0.16 from one update to the next,
    before rewards arrive), and over the old scale alone an ordinary step read 2-17, a bad update
    by the run's own history."""
    o, n = torch.as_tensor(np.asarray(old_q)).double(), torch.as_tensor(np.asarray(new_q)).double()
    return {"q_change": float((n - o).abs().max()) / max(q_scale(o), reference),
            "greedy_flip_rate": float((o.argmax(-1) != n.argmax(-1)).double().mean())}


# --- soft routing -------------------------------------------------------------------------------
def combine_divergence(trainer_combine, rollout_combine) -> Dict[str, float]:
    """[T, L, N] each expert's combine share per step and Soft MoE layer: the total variation
    (half the L1 distance) between the trainer's and the rollout's shares, mean and max over the
    steps per layer, then combine_tv_mean / combine_tv_max over the layers."""
    out: Dict[str, float] = {}
    means, maxes = [], []
    for i, (a, b) in enumerate(zip(_layers(trainer_combine), _layers(rollout_combine))):
        tv = 0.5 * (a.double() - b.double()).abs().sum(-1)
        means.append(float(tv.mean()) if len(tv) else 0.0)
        maxes.append(float(tv.max()) if len(tv) else 0.0)
        out[f"combine_tv/layer{i}"] = means[-1]
    if means:
        out["combine_tv_mean"], out["combine_tv_max"] = sum(means) / len(means), max(maxes)
    return out


def soft_flip_rate(old_combine, new_combine, margin: float) -> float:
    """Share of probe observations (mean over layers) whose leading expert (largest combine share)
    changed where the old lead over the runner-up exceeded `margin`: the soft counterpart of a
    sparse layer's top-k flips (a near-even mix changes its lead at any step)."""
    rates = []
    for a, b in zip(_layers(old_combine), _layers(new_combine)):
        if not len(a):
            continue
        top2 = a.double().topk(min(2, a.shape[-1]), -1).values
        lead = top2[:, 0] - (top2[:, 1] if top2.shape[-1] > 1 else 0)
        changed = a.argmax(-1) != b.argmax(-1)
        rates.append(float((changed & (lead > margin)).double().mean()))
    return float(np.mean(rates)) if rates else 0.0


def sparse_flip_rate(old: Mapping[str, Any], new: Mapping[str, Any], margin: float) -> float:
    """Share of probe tokens (mean over layers) whose greedy top-k set changed *and* whose old top-k
    margin exceeded `margin`: a near-uniform router flips at tiny logit changes, which is not
    routing oscillation."""
    rates = []
    old_margin = np.asarray(old["margin"])
    for i, (a, b) in enumerate(zip(_layers(old["routing"]), _layers(new["routing"]))):
        changed = ~topk_sets_equal(decode_top_k(a)[0], decode_top_k(b)[0]).numpy()
        rates.append(float(np.mean(changed & (old_margin[:, i] > margin))) if len(changed) else 0.0)
    return float(np.mean(rates)) if rates else 0.0


# --- per expert ---------------------------------------------------------------------------------
def by_expert(values: torch.Tensor, routing, kind: str) -> Dict[int, Dict[int, float]]:
    """{layer: {expert: mean of `values` [T] over the steps that used the expert}}: sparse, the
    steps whose top-k held it; soft, the steps it led (the largest combine share)."""
    out: Dict[int, Dict[int, float]] = {}
    for layer, chosen in enumerate(_layers(routing)):
        experts = decode_top_k(chosen.long())[0] if kind == "sparse" else chosen.argmax(-1, keepdim=True)
        out[layer] = {int(e): float(values[(experts == e).any(-1)].mean()) for e in torch.unique(experts).tolist()}
    return out


def _by_expert_columns(name: str, values: torch.Tensor, routing, kind: str) -> Dict[str, Any]:
    grouped = by_expert(values, routing, kind)
    if not grouped:
        return {}
    where, worst = max(((f"layer{l}/e{e}", v) for l, d in grouped.items() for e, v in d.items()), key=lambda kv: kv[1])
    return {f"{name}_by_expert": json.dumps(grouped), f"{name}_expert_max": worst, f"{name}_expert_max_at": where}


# --- the check's figures ------------------------------------------------------------------------
def mismatch_figures(kind: PolicyKind, rollout: Mapping[str, Any], trainer: Mapping[str, Any]) -> Dict[str, Any]:
    """Same weights: the rollout copy's recorded figures against the trainer's on the same steps.
    rollout / trainer: {"logp" [T] | "q" [T, A], "routing": [T, L, k] top-k or [T, L, N] shares}."""
    out: Dict[str, Any] = {}
    routing = rollout.get("routing")
    if kind.policy == "q":
        out.update(q_figures(trainer["q"], rollout["q"]))
        per_step = (torch.as_tensor(np.asarray(trainer["q"])).double()
                    - torch.as_tensor(np.asarray(rollout["q"])).double()).abs().amax(-1) / out.get("q_scale", 1.0)
        name = "q_gap"
    else:
        t, r = torch.as_tensor(np.asarray(trainer["logp"])), torch.as_tensor(np.asarray(rollout["logp"]))
        out.update({k: v for k, v in drift_metrics(t, r).items() if k != "n"})
        log_r = t.double() - r.double()
        per_step, name = log_r.exp() - 1 - log_r, "k3"
    if kind.routing == "sparse" and routing is not None:
        out.update(routing_agreement(_layers(trainer["routing"]), _layers(routing)))
    elif kind.routing == "soft" and routing is not None:
        out.update(combine_divergence(trainer["routing"], routing))
    if kind.routing != "none" and routing is not None and len(per_step):
        out.update(_by_expert_columns(name, per_step, routing, kind.routing))
    return out


def lag_figures(kind: PolicyKind, rollout: Mapping[str, Any], trainer: Mapping[str, Any],
                prefix: str) -> Dict[str, float]:
    """Learners ahead of the rollout copy (never mismatch): `{prefix}_k3` (categorical) or
    `{prefix}_q_gap` (q: mean |dQ| over the Q scale) of the trainer's view of the rollout's steps."""
    if kind.policy == "q":
        return {f"{prefix}_q_gap": q_figures(trainer["q"], rollout["q"]).get("q_gap_mean_rel", math.nan)}
    return {f"{prefix}_k3": drift_metrics(torch.as_tensor(np.asarray(trainer["logp"])),
                                          torch.as_tensor(np.asarray(rollout["logp"])))["k3"]}


def probe_figures(kind: PolicyKind, old: Optional[Mapping[str, Any]], new: Optional[Mapping[str, Any]],
                  margin: float, q_reference: float = 0.0) -> Dict[str, float]:
    """The candidate against the last good weights on the probe set: how far the policy moved
    (k3_old_new, the exact KL; or q_change, over at least `q_reference`) and the routing flips
    (probe_flip_rate)."""
    if old is None or new is None:
        return {}
    if kind.policy == "q":
        out = q_change(old["q"], new["q"], q_reference)
    else:
        out = {"k3_old_new": policy_kl(torch.as_tensor(np.asarray(old["logits"])),
                                       torch.as_tensor(np.asarray(new["logits"])), kind.discrete)}
    if kind.routing == "sparse":
        out["probe_flip_rate"] = sparse_flip_rate(old, new, margin)
    elif kind.routing == "soft":
        out["probe_flip_rate"] = soft_flip_rate(old["routing"], new["routing"], margin)
    return out

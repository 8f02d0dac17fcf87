"""The health grade of an MoE layer's routing in RL: harm, not specialisation (pure torch).

docs/stability.md's LM load table (min/max utilisation share, CV; moe_rl.core.metrics,
`load_grade`) was written for LM pre-training, where every batch is i.i.d. tokens and any
imbalance is the router's fault. In RL
the state distribution narrows as the policy converges, so experts see unequal shares of the states:
that is specialisation, and the table read `warning` on 21 of 28 iterations of a healthy quickstart
that reached a return of 500 with every expert in use. The grade here looks for the two kinds of
harm instead, judged over consecutive updates (one update is one `learner_group.update`, i.e. one
training iteration):

  dead      an expert that no state selected (the router's own top-k, over every minibatch of the
            update) in DEAD_UPDATES updates in a row. It gets no gradient through its output; only
            the balancing can bring it back (under APPO's small updates with a weak balance loss
            such experts do return, iterations later: docs/stability.md, "Why this rule").
  collapse  the routing concentrates on a few experts *and* the router is sure of it:
            marginal entropy (of the update's selection shares, / ln N) below COLLAPSE_MARGINAL and
            per-state entropy (mean over states of the router's softmax entropy, / ln N) below
            COLLAPSE_STATE, in COLLAPSE_UPDATES updates in a row. A confident router over a spread
            of experts (low per-state, high marginal entropy) is specialisation; an unsure router
            whose top-k happens to agree (high per-state entropy) can still move.

A layer reads `danger` when either holds; `warning` in the update where one of them starts (an
expert idle in this update only, the collapse condition in this update only) or while the load is
concentrated (marginal entropy below COLLAPSE_MARGINAL) under an unsure router; `healthy`
otherwise. The window is short on purpose: an injected dead expert must read `danger` within two
iterations (BENCHMARKS.md, "Health grades").
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

HEALTHY, WARNING, DANGER = 0, 1, 2
DEAD_UPDATES = 2
COLLAPSE_UPDATES = 2
# Normalised entropies (1.0 = uniform over N). All selections on k of N experts, evenly, gives a
# marginal entropy of ln k / ln N (0.33 for top-2 of 8, 0.2 for top-2 of 32).
COLLAPSE_MARGINAL = 0.5
COLLAPSE_STATE = 0.3


def marginal_entropy_norm(counts: torch.Tensor) -> float:
    """Entropy of the selection shares counts / sum, divided by ln N (1.0: every expert alike)."""
    c = counts.double()
    n, total = c.numel(), c.sum().item()
    if n < 2 or total <= 0:
        return 1.0 if n < 2 else 0.0
    p = c / total
    return float(-(p * torch.log(p.clamp_min(1e-300))).sum().item() / math.log(n))


class LayerWatch:
    """One layer's streaks: per expert, the updates in a row it was idle; the collapse streak."""

    def __init__(self, num_experts: int):
        self.idle = torch.zeros(num_experts, dtype=torch.long)
        self.collapse = 0

    def observe(self, counts: torch.Tensor, state_entropy_norm: float) -> Dict[str, float]:
        counts = counts.reshape(-1)
        if counts.numel() != self.idle.numel():   # the layer changed size (a new model): start over
            self.idle = torch.zeros(counts.numel(), dtype=torch.long)
            self.collapse = 0
        self.idle = torch.where(counts > 0, torch.zeros_like(self.idle), self.idle + 1)
        marginal = marginal_entropy_norm(counts)
        collapsed_now = marginal < COLLAPSE_MARGINAL and state_entropy_norm < COLLAPSE_STATE
        self.collapse = self.collapse + 1 if collapsed_now else 0
        dead = int((self.idle >= DEAD_UPDATES).sum().item())
        if dead or self.collapse >= COLLAPSE_UPDATES:
            grade = DANGER
        elif bool((self.idle > 0).any()) or marginal < COLLAPSE_MARGINAL:
            grade = WARNING
        else:
            grade = HEALTHY
        return {"health": grade, "dead_experts": dead, "idle_experts": int((self.idle > 0).sum().item()),
                "marginal_entropy_norm": marginal, "collapse_updates": self.collapse}


class HealthWatch:
    """Per module: one LayerWatch per MoE layer, fed once per update.

    Not checkpointed: after a resume the streaks start again, so a fault present at the resume
    reads `danger` one update later than it would have (DEAD_UPDATES, COLLAPSE_UPDATES)."""

    def __init__(self):
        self.layers: List[LayerWatch] = []

    def observe(self, counts: Sequence[torch.Tensor], state_entropy_norm: Sequence[float]) -> List[Dict[str, float]]:
        """counts: per layer, the update's selections per expert (or shares); state_entropy_norm:
        per layer, the mean per-state router entropy / ln N. -> per layer, the grade and its figures."""
        if len(self.layers) != len(counts):
            self.layers = [LayerWatch(c.numel()) for c in counts]
        return [w.observe(c, float(h)) for w, c, h in zip(self.layers, counts, state_entropy_norm)]

"""Adaptive load balancing: a balance-loss weight that acts only while the load is unhealthy.

A fixed Switch balance loss pushes every router towards a uniform load all the time, also when the
load is already healthy, and that pressure costs return (BENCHMARKS.md, stability stress test).
`moe.balance: adaptive` makes `moe.aux_loss_coef` a ceiling: the weight rises geometrically while
the load's coefficient of variation (of the router's own top-k choice, smoothed over the last
optimizer steps) is above the healthy band of the health table (CV 0.5) and decays while it is
inside, so a healthy router trains without the balance loss and a collapsing one meets it at full
strength within a few steps.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from moe_rl.core.metrics import expert_counts
from moe_rl.core.routing import RoutingRecord

BALANCE_MODES = ("fixed", "adaptive")
HEALTHY_CV = 0.5      # the health table's healthy bound on the load's CV
RISE, DECAY = 1.5, 0.9  # per optimizer step: ~10 steps from the floor to the ceiling, ~7 to halve
FLOOR_SHARE = 0.01    # the first non-zero weight, as a share of the ceiling
SMOOTHING = 0.9       # EMA of the expert loads: ~10 minibatches, so Poisson noise of small
                      # minibatches does not read as imbalance


class AdaptiveBalance:
    """Per module: the balance-loss weight for the next step, from the loads of the last ones."""

    def __init__(self, ceiling: float, num_layers: int, num_experts: int):
        self.ceiling = float(ceiling)
        self.coef = 0.0
        self.loads = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.steps = 0

    def observe(self, records: List[RoutingRecord],
                all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> float:
        """After an applied step: fold in this minibatch's loads (summed over the data-parallel
        learners when `all_reduce` is given, so every learner keeps the same weight) and move the
        weight. Returns the smoothed worst-layer CV."""
        counts = torch.stack([expert_counts(r.router_top_k, self.loads.shape[1]) for r in records]).to(torch.float64)
        if all_reduce is not None:
            all_reduce(counts)
        share = counts / counts.sum(dim=1, keepdim=True).clamp_min(1)
        self.loads = share if self.steps == 0 else SMOOTHING * self.loads + (1 - SMOOTHING) * share
        self.steps += 1
        cv = float((self.loads.std(dim=1, unbiased=False) / self.loads.mean(dim=1).clamp_min(1e-12)).max())
        if cv > HEALTHY_CV:
            self.coef = min(self.ceiling, max(self.coef, FLOOR_SHARE * self.ceiling) * RISE)
        else:
            self.coef *= DECAY
        return cv

    def get_state(self) -> Dict[str, object]:
        return {"coef": self.coef, "loads": self.loads.clone(), "steps": self.steps}

    def set_state(self, state: Dict[str, object]) -> None:
        self.coef, self.steps = float(state["coef"]), int(state["steps"])
        self.loads = torch.as_tensor(state["loads"], dtype=torch.float64)

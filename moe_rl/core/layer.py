"""The Mixture-of-Experts layer (pure torch: no Ray, no DeepSpeed).

Shapes use T = tokens (flattened batch), d = model width, N = experts, k = top-k, F = expert hidden.

    layer = MoELayer(d_model=64, num_experts=8, top_k=2)
    y, routing = layer(x)                         # x: [T, d] (or [..., d]) -> y like x
    y2, _ = layer(x, replay_indices=routing.encoded_top_k())   # R3 routing replay

The routing record carries what losses, health metrics, drift checks and routing replay need.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from moe_rl.core.errors import need
from moe_rl.core.experts import ACTIVATIONS, DISPATCH_PATHS, Activation, Experts
from moe_rl.core.routers import build_router
from moe_rl.core.routing import capacity, decode_top_k, expert_dropout, queue_positions, sequence_queue_positions

# "auto" dispatch, from measured crossovers (BENCHMARKS.md, "MoE layer"): every expert on every
# token while that is cheap (two matrix products over weights small enough to stay in cache);
# a matmul pair per busy expert while there are fewer assignments than experts (the padded and
# dense paths would compute every expert); without autograd the chosen experts' weights gathered
# while they are few; then grouped (padded bmm) up to a couple of thousand assignments, sorted
# (a matmul pair per expert, no padding) beyond.
DENSE_MAX_MACS = 1 << 21          # T*N*d*F: multiply-adds of one dense pass
DENSE_MAX_WEIGHTS = 1 << 18       # N*d*F: elements of one stacked expert matrix the dense pass reads
GATHERED_MAX_ELEMENTS = 1 << 18   # T*k*d*F: weight elements the gathered path copies
GROUPED_MAX_ASSIGNMENTS = 2048    # T*k


class MoELayer(nn.Module):
    """Top-k routed feed-forward layer.

    Args:
        d_model: input/output width d.  num_experts: N >= 1.  top_k: 1 <= k <= N.
        d_ff: expert hidden width F (default 4d).  router: one of moe_rl.core.routers.ROUTERS.
        temperature: finite > 0, divides router logits.  router_init: normal|uniform|torch.
        shared_expert: add an always-on dense expert (residual across experts).
        expert_dropout: p in [0, 1): drop whole (token, expert) contributions in training.
        capacity_factor: None = dropless; else > 0 and each expert takes at most
            ceil(cf * T * k / N) assignments (later tokens over the limit are dropped). The limit
            depends on the batch, so a rollout's drops are recorded and replayed in training.
        dispatch: auto|dense|gathered|grouped|sorted (moe_rl.core.experts).
    forward(x [..., d], replay_indices [T, k] | None, task_ids [...] | None, explore) -> (y [..., d], RoutingRecord)
        replay_indices: a recorded top-k (RoutingRecord.encoded_top_k: dropped assignments negative)
        to dispatch instead of the router's own choice (rows of OWN_CHOICE keep the router's own);
        explore: let a sampling router sample.
    """

    PARAM_ROLES = {"shared_expert": "shared_expert"}   # the router and experts declare their own

    def __init__(self, d_model: int, num_experts: int, top_k: int = 2, d_ff: Optional[int] = None, *,
                 router: str = "topk", temperature: float = 1.0, router_init: str = "normal",
                 router_init_std: Optional[float] = None, shared_expert: bool = False,
                 expert_dropout: float = 0.0, capacity_factor: Optional[float] = None,
                 dispatch: str = "auto", activation: str = "gelu", normalize_gates: bool = True,
                 router_kwargs: Optional[dict] = None):
        super().__init__()
        need(isinstance(d_model, int) and d_model >= 1, "d_model", "an int >= 1", d_model)
        need(isinstance(num_experts, int) and num_experts >= 1, "num_experts", "an int >= 1", num_experts)
        need(isinstance(top_k, int) and 1 <= top_k <= num_experts, "top_k",
             f"an int in [1, num_experts={num_experts}]", top_k)
        need(isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0,
             "temperature", "a finite number > 0", temperature)
        need(capacity_factor is None or (isinstance(capacity_factor, (int, float))
                                         and math.isfinite(capacity_factor) and capacity_factor > 0),
             "capacity_factor", "None (dropless) or a finite number > 0", capacity_factor)
        need(isinstance(expert_dropout, (int, float)) and 0.0 <= expert_dropout < 1.0,
             "expert_dropout", "a number in [0, 1)", expert_dropout)
        need(dispatch in DISPATCH_PATHS, "dispatch", f"one of {DISPATCH_PATHS}", dispatch)
        d_ff = d_ff or 4 * d_model
        need(isinstance(d_ff, int) and d_ff >= 1, "d_ff", "an int >= 1", d_ff)
        self.d_model, self.num_experts, self.top_k, self.d_ff = d_model, num_experts, top_k, d_ff
        self.capacity_factor, self.expert_dropout, self.dispatch = capacity_factor, expert_dropout, dispatch
        self.router = build_router(router, d_model, num_experts, top_k, temperature=temperature,
                                   init=router_init, init_std=router_init_std,
                                   normalize_gates=normalize_gates, **(router_kwargs or {}))
        self.experts = Experts(num_experts, d_model, d_ff, activation)
        self.shared_expert = (nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
                              if shared_expert else None)

    def dispatch_path(self, num_tokens: int) -> str:
        if self.dispatch != "auto":
            return self.dispatch
        d_f = self.d_model * self.d_ff
        if num_tokens * self.num_experts * d_f <= DENSE_MAX_MACS and self.num_experts * d_f <= DENSE_MAX_WEIGHTS:
            return "dense"
        if num_tokens * self.top_k < self.num_experts:
            return "sorted"
        if not torch.is_grad_enabled() and num_tokens * self.top_k * d_f <= GATHERED_MAX_ELEMENTS:
            return "gathered"
        return "grouped" if num_tokens * self.top_k <= GROUPED_MAX_ASSIGNMENTS else "sorted"

    def forward(self, x: torch.Tensor, replay_indices: Optional[torch.Tensor] = None,
                task_ids: Optional[torch.Tensor] = None, explore: bool = False,
                seq_mask: Optional[torch.Tensor] = None):
        """seq_mask: [B, L] for x [B, L, d]: each sequence is its own capacity group over its True
        tokens (capacity ceil(cf * n * k / N) for its n of them), so a sequence's drops do not
        depend on the batch it came in; without it, the whole batch is one group."""
        need(x.shape[-1] == self.d_model, "x", f"a tensor of width d_model={self.d_model}", tuple(x.shape))
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.d_model)
        replay, replay_dropped = (None, None) if replay_indices is None else decode_top_k(replay_indices)
        rec = self.router(flat, replay_indices=replay, task_ids=task_ids, explore=explore)
        weights = rec.gate_weights
        if replay_dropped is not None:          # the rollout's own capacity drops, replayed
            rec.dropped = replay_dropped
        elif self.capacity_factor is not None and replay is None:
            if seq_mask is None:
                cap = capacity(self.capacity_factor, flat.shape[0], self.top_k, self.num_experts)
                rec.dropped = queue_positions(rec.top_k_indices, self.num_experts) >= cap
            else:
                valid = seq_mask.reshape(-1, seq_mask.shape[-1])
                B, L = valid.shape
                cap = capacity(self.capacity_factor, valid.sum(1), self.top_k, self.num_experts)
                pos = sequence_queue_positions(rec.top_k_indices.view(B, L, self.top_k), valid, self.num_experts)
                rec.dropped = ((pos >= cap.view(B, 1, 1)) & valid.unsqueeze(-1)).reshape(B * L, self.top_k)
        if rec.dropped is not None:
            weights = weights.masked_fill(rec.dropped, 0.0)
        if self.training:
            weights = expert_dropout(weights, self.expert_dropout)
        if flat.shape[0] == 0:
            y = torch.zeros_like(flat)
        else:
            path = self.dispatch_path(flat.shape[0])
            y = getattr(self.experts, f"{path}_dispatch")(flat, rec.top_k_indices, weights)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return y.reshape(*lead, self.d_model), rec


def dense_ffn_equal_active(d_model: int, d_ff: int, top_k: int, activation: str = "gelu") -> nn.Module:
    """The dense peer with the same *active* parameters as an MoE layer (k experts of width F)."""
    return nn.Sequential(nn.Linear(d_model, top_k * d_ff), Activation(activation), nn.Linear(top_k * d_ff, d_model))


__all__ = ["MoELayer", "dense_ffn_equal_active", "ACTIVATIONS", "DISPATCH_PATHS"]

"""What a router decided, and the routing maths every MoE layer shares (pure torch).

The core MoELayer and the DeepSpeed learner's gate (actors/deepspeed_moe.py) both import these
formulas, so the rollout copy and the trainer cannot drift apart by re-deriving them.

Shapes: T tokens, N experts, k experts per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


@dataclass
class RoutingRecord:
    """What one MoE layer decided for T tokens.

    top_k_indices: [T, k] int64  experts the tokens were dispatched to (a replay forces them).
    gate_weights:  [T, k] float  combine weights applied to each chosen expert's output.
    router_logits: [T, N] fp32   raw router scores (after temperature).
    router_top_k:  [T, k] int64  the router's *own* choice for these inputs now. It equals
                   top_k_indices unless a replay forced the dispatch. Balance statistics (the
                   load-balancing loss, health metrics) always use it: under routing replay the
                   dispatched experts are the rollout's and would freeze the load statistic.
    dropped:       [T, k] bool or None  assignments removed by a capacity limit.
    """

    top_k_indices: torch.Tensor
    gate_weights: torch.Tensor
    router_logits: torch.Tensor
    router_top_k: Optional[torch.Tensor] = None
    dropped: Optional[torch.Tensor] = None
    # REINFORCE router only: log-prob of the sampled experts [T] and the baseline value [T].
    selection_logp: Optional[torch.Tensor] = None
    baseline: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.router_top_k is None:
            self.router_top_k = self.top_k_indices

    @property
    def num_experts(self) -> int:
        return self.router_logits.shape[-1]

    @property
    def router_probs(self) -> torch.Tensor:
        """[T, N] softmax(router_logits), computed on demand (rollouts never need it)."""
        return self.router_logits.softmax(dim=-1)

    def _map(self, fn) -> "RoutingRecord":
        fields = ("top_k_indices", "gate_weights", "router_logits", "router_top_k", "dropped", "selection_logp",
                  "baseline")
        return replace(self, **{f: None if getattr(self, f) is None else fn(getattr(self, f)) for f in fields})

    def detach(self) -> "RoutingRecord":
        return self._map(lambda t: t.detach())

    def rows(self, index: torch.Tensor) -> "RoutingRecord":
        """The record of a subset of the tokens (every per-token field indexed alike)."""
        return self._map(lambda t: t[index])

    def expert_load(self) -> torch.Tensor:
        """[N] assignments per expert of the router's own choice (what the balance figures and the
        health grade read; a Soft MoE record gives its experts' combine weight instead)."""
        return torch.bincount(self.router_top_k.reshape(-1).long(), minlength=self.num_experts)

    def encoded_top_k(self) -> torch.Tensor:
        """[T, k] what the rollouts record per step: the dispatched experts, a dropped assignment e
        stored as -(e + 1) so a replay can drop it too (decode_top_k inverts it)."""
        return encode_top_k(self.top_k_indices, self.dropped)


# A replay code naming no expert: that token's assignment is left to the router (partial replay,
# moe.routing_replay "mismatched"). Any code >= N means the same; this one fits int32 columns.
OWN_CHOICE = 2 ** 31 - 1


def encode_top_k(indices: torch.Tensor, dropped: Optional[torch.Tensor]) -> torch.Tensor:
    return indices if dropped is None else torch.where(dropped, -indices - 1, indices)


def decode_top_k(code: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """-> (experts [T, k] int64, dropped [T, k] bool or None when nothing was dropped)."""
    code = code.long()
    dropped = code < 0
    if not bool(dropped.any()):
        return code, None
    return torch.where(dropped, -code - 1, code), dropped


def layer_disagreement(recorded_top_k: torch.Tensor, own_top_k: torch.Tensor) -> torch.Tensor:
    """[N, L] bool: per token and layer, the top-k expert *set* differs between a recorded
    (encoded) top-k [N, L, k] and a router's own choice [N, L, k]; the order within k does not count."""
    a = decode_top_k(recorded_top_k.long())[0].sort(-1).values
    return (a != own_top_k.long().sort(-1).values).any(-1)


def gate_weights(logits: torch.Tensor, indices: torch.Tensor, normalize: bool,
                 chosen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T, k] combine weights of the chosen experts from the router's softmax: renormalised over
    the chosen k (normalize and k > 1), else the raw probability (Switch: top-1 keeps a router
    gradient). Always a function of the logits, so replayed and sampled selections still train
    the router. chosen: logits.gather(1, indices) when the caller has it already."""
    if chosen is None:
        chosen = logits.gather(1, indices)
    if normalize and indices.shape[1] > 1:
        return chosen.softmax(dim=-1)
    return (chosen - logits.logsumexp(dim=-1, keepdim=True)).exp()


def capacity(capacity_factor: float, num_tokens, top_k: int, num_experts: int):
    """Assignments one expert may take: ceil(cf * T * k / N). num_tokens: an int, or a tensor of
    token counts (one capacity group each, e.g. per sequence) -> a float64 tensor of limits."""
    if isinstance(num_tokens, torch.Tensor):
        return torch.ceil(capacity_factor * num_tokens.double() * top_k / num_experts)
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def queue_positions(top_k_indices: torch.Tensor, num_experts: int,
                    order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[T, k] -> [T, k] position of each assignment in its expert's queue. All first choices queue
    before second choices (slot-major); within a slot, tokens queue in `order` (default: 0..T-1).
    An assignment is dropped by a capacity C exactly when its position is >= C."""
    T, k = top_k_indices.shape
    if order is None:
        order = torch.arange(T, device=top_k_indices.device)
    one_hot = F.one_hot(top_k_indices[order].t().reshape(-1), num_experts)
    position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1).view(k, T).t()
    return torch.empty_like(position).index_copy_(0, order, position)


def sequence_queue_positions(top_k_indices: torch.Tensor, valid: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[B, L, k] -> [B, L, k] queue positions with every row (sequence) its own capacity group:
    slot-major within the row, over its valid tokens only (invalid ones queue nowhere). A row's
    drops then depend on that sequence alone, never on the other sequences of the batch."""
    B, L, k = top_k_indices.shape
    one_hot = F.one_hot(top_k_indices.transpose(1, 2).reshape(B, k * L), num_experts)
    one_hot = one_hot * valid.repeat(1, k).unsqueeze(-1)
    return ((one_hot.cumsum(1) - 1) * one_hot).sum(-1).view(B, k, L).transpose(1, 2)


def expert_dropout(weights: torch.Tensor, p: float) -> torch.Tensor:
    """Drop whole (token, expert) contributions with probability p, rescaled by 1/(1-p)."""
    if p <= 0:
        return weights
    return weights * (torch.rand_like(weights) >= p) / (1.0 - p)


def sinkhorn_potentials(scores: torch.Tensor, top_k: int = 1, epsilon: float = 0.1, max_iters: int = 200,
                        tol: float = 1e-4) -> Tuple[torch.Tensor, torch.Tensor, float]:
    """Entropic optimal transport for balanced routing, in log space.

    scores: [T, N]. The plan P = exp(scores/eps + u[:, None] + v[None, :]) has column sums exactly
    T*k/N (every expert an equal share) and row sums k (every token places k units) up to the
    returned residual max_t |row_sum_t - k| / k, which is <= tol unless max_iters ran out first.
    Returns (u [T], v [N], residual). top-k of a row of P = top-k of scores + eps * v.
    """
    T, N = scores.shape
    log_k = scores.detach().float() / epsilon
    log_row, log_col = math.log(top_k), math.log(T * top_k / N)
    u = torch.zeros(T, dtype=torch.float32, device=scores.device)
    v = torch.zeros(N, dtype=torch.float32, device=scores.device)
    residual = math.inf
    for _ in range(max_iters):
        u = log_row - torch.logsumexp(log_k + v[None, :], dim=1)
        v = log_col - torch.logsumexp(log_k + u[:, None], dim=0)
        # Columns are exact after the v-step; stop when rows are close too.
        rows = torch.logsumexp(log_k + u[:, None] + v[None, :], dim=1).exp()
        residual = float((rows - top_k).abs().max()) / top_k
        if residual < tol:
            break
    return u, v, residual


def sinkhorn(scores: torch.Tensor, top_k: int = 1, epsilon: float = 0.1, max_iters: int = 200,
             tol: float = 1e-4) -> torch.Tensor:
    """The balanced plan P [T, N] (see sinkhorn_potentials for its marginals and their accuracy)."""
    u, v, _ = sinkhorn_potentials(scores, top_k, epsilon, max_iters, tol)
    return (scores.float() / epsilon + u[:, None] + v[None, :]).exp()

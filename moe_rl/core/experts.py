"""Experts and the ways tokens reach them (pure torch).

The N experts of a layer are stacked: one parameter each for w1 [N, d, F], b1 [N, F], w2 [N, F, d]
and b2 [N, d], so every dispatch path is a handful of batched kernels whatever N is. At the small
token counts of RL (8 tokens per rollout call, 256-token minibatches) per-op overhead, not FLOPs,
decides the speed (bench/bench_moe_layer.py).

Every path computes y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t]):

    dense     every expert on every token (two bmm), combined by the [T, N] gate matrix: N/k times
              the FLOPs, the fewest kernels; the choice while T*N*d*F is small
    gathered  each assignment's expert weights gathered, two bmm over the T*k assignments: rollouts
              (no autograd, few tokens)
    grouped   assignments sorted by expert and padded to the busiest expert's count: two bmm over
              [N, C, d]; large token batches

Towards DeepSpeed's per-expert modules and the checkpoints, the stacked tensors have a canonical
per-expert form (`experts.experts.{e}.fc1.weight` [F, d], ...; moe_rl.core.sharding).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.core.errors import need

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}
DISPATCH_PATHS = ("auto", "dense", "gathered", "grouped")


class Experts(nn.Module):
    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str = "gelu"):
        super().__init__()
        need(activation in ACTIVATIONS, "activation", f"one of {tuple(ACTIVATIONS)}", activation)
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.b1 = nn.Parameter(torch.empty(num_experts, d_ff))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        self.b2 = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert as torch initialises an nn.Linear (uniform +-1/sqrt(fan_in))."""
        for w, b, fan_in in ((self.w1, self.b1, self.d_model), (self.w2, self.b2, self.d_ff)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            nn.init.uniform_(b, -bound, bound)

    def __len__(self) -> int:
        return self.num_experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on tokens x [T, d] (the definition every path computes)."""
        return self.act(x @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]

    # --- dispatch paths ---------------------------------------------------------------------------
    def dense_dispatch(self, x, idx, w):
        T = x.shape[0]
        gates = torch.zeros(T, self.num_experts, dtype=x.dtype, device=x.device).scatter_add_(
            1, idx, w.to(x.dtype))                                                     # [T, N]
        h = self.act(torch.baddbmm(self.b1.unsqueeze(1), x.expand(self.num_experts, T, -1), self.w1))
        y = torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)                            # [N, T, d]
        return torch.einsum("ntd,tn->td", y, gates)

    def gathered_dispatch(self, x, idx, w):
        T, k = idx.shape
        flat = idx.reshape(-1)
        xr = x.repeat_interleave(k, dim=0).unsqueeze(1)                                # [T*k, 1, d]
        h = self.act(torch.baddbmm(self.b1[flat].unsqueeze(1), xr, self.w1[flat]))
        y = torch.baddbmm(self.b2[flat].unsqueeze(1), h, self.w2[flat]).squeeze(1)     # [T*k, d]
        return (y.view(T, k, -1) * w.unsqueeze(-1).to(x.dtype)).sum(1)

    def grouped_dispatch(self, x, idx, w):
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        cap = int(counts.max())
        starts = torch.cumsum(counts, 0) - counts
        expert_of = flat[order]
        slot = torch.arange(T * k, device=x.device) - starts[expert_of]               # position in its expert
        token_of = order // k
        xs = x.new_zeros(self.num_experts, cap, x.shape[1])
        xs[expert_of, slot] = x[token_of]
        h = self.act(torch.baddbmm(self.b1.unsqueeze(1), xs, self.w1))
        ys = torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)[expert_of, slot]          # [T*k, d]
        ys = ys * w.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

"""Experts and the ways tokens reach them (pure torch).

The N experts of a layer are stacked: one parameter each for w1 [N, F, d] (each expert's first
matrix in nn.Linear's layout), b1 [N, F], w2 [N, F, d] (its second, input-major) and b2 [N, d], so
every dispatch path is a handful of batched kernels whatever N is, and the dense path is two
matrix products over views: [T, d] x [d, N*F] and [T, N*F] x [N*F, d]. At the small
token counts of RL (8 tokens per rollout call, 256-token minibatches) per-op overhead, not FLOPs,
decides the speed (bench/bench_moe_layer.py).

Every path computes y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t]):

    dense     every expert on every token (two matmuls), combined by the [T, N] gate matrix: N/k times
              the FLOPs, the fewest kernels; the choice while T*N*d*F is small and the stacked
              weights fit in cache
    gathered  each assignment's expert weights gathered, two bmm over the T*k assignments: rollouts
              (no autograd, few tokens)
    grouped   assignments sorted by expert and padded to the busiest expert's count: two bmm over
              [N, C, d]
    sorted    assignments sorted by expert, one matmul pair per expert that received tokens: fewer
              assignments than experts (1-2-token rollout steps skip the sort), and large token
              batches with large experts (no padding)

Towards DeepSpeed's per-expert modules and the checkpoints, the stacked tensors have a canonical
per-expert form (`experts.experts.{e}.fc1.weight` [F, d], ...; moe_rl.core.sharding).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.core.errors import need

# torch's CPU tanh is much slower than its sigmoid, so from 16k fp32 elements on tanh(x) =
# 2 sigmoid(2x) - 1, with tanh's own backward, is faster; it stays within 2e-7 of torch.tanh.
# Forward + backward, torch 2.13 on a 2-core AMD EPYC (AVX-512), 1 thread (a learner's),
# median of 31 interleaved runs: the trunk's [256, 64] 50 -> 36 us, the grouped experts' hidden
# [8, 73, 64] (8 experts, 256 tokens) 99 -> 50 us, [32, 27, 64] (32 experts) 142 -> 61 us,
# [256, 512] 311 -> 127 us (2 threads: even at [256, 64], 1.4-1.8x on the others); a whole MoE layer
# (d 64, 8 / 32 experts, top-2, 256 tokens) 2-4 % / 11-15 % faster. The same formula through plain
# autograd (no Function) is 20-37 % slower than this.
# Smaller tensors (rollout steps) keep torch.tanh: there the extra ops cost more than they save.
FAST_TANH_MIN_ELEMENTS = 1 << 14


def _tanh_via_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x * 2).mul_(2).sub_(1)


class _SigmoidTanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = _tanh_via_sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch.ops.aten.tanh_backward(grad, y)   # grad * (1 - y^2), as torch.tanh's own


def tanh(x: torch.Tensor) -> torch.Tensor:
    """torch.tanh, computed through sigmoid for large fp32 CPU tensors (see above)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.numel() < FAST_TANH_MIN_ELEMENTS:
        return torch.tanh(x)
    if x.requires_grad and torch.is_grad_enabled():
        return _SigmoidTanh.apply(x)
    return _tanh_via_sigmoid(x)


ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": tanh}


class Activation(nn.Module):
    """One of ACTIVATIONS as a module (for nn.Sequential): the same function the experts apply."""

    def __init__(self, name: str):
        super().__init__()
        need(name in ACTIVATIONS, "activation", f"one of {tuple(ACTIVATIONS)}", name)
        self.name, self.fn = name, ACTIVATIONS[name]

    def forward(self, x):
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


DISPATCH_PATHS = ("auto", "dense", "gathered", "grouped", "sorted")


class Experts(nn.Module):
    PARAM_ROLE = "experts"   # moe_rl.core.param_groups

    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str = "gelu"):
        super().__init__()
        need(activation in ACTIVATIONS, "activation", f"one of {tuple(ACTIVATIONS)}", activation)
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        self.w1 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
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
        return self.act(F.linear(x, self.w1[e], self.b1[e])) @ self.w2[e] + self.b2[e]

    def slot_forward(self, xs: torch.Tensor) -> torch.Tensor:
        """xs [N, R, d]: R rows for each expert (a Soft MoE layer's slots) -> [N, R, d], expert e
        on its own rows: two batched matrix products whatever N is."""
        h = self.act(torch.baddbmm(self.b1.unsqueeze(1), xs, self.w1.transpose(1, 2)))
        return torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)

    # --- dispatch paths ---------------------------------------------------------------------------
    def dense_dispatch(self, x, idx, w):
        T, N, Fh = x.shape[0], self.num_experts, self.d_ff
        gates = torch.zeros(T, N, dtype=x.dtype, device=x.device).scatter_add_(1, idx, w.to(x.dtype))   # [T, N]
        h = self.act(F.linear(x, self.w1.reshape(N * Fh, -1), self.b1.reshape(N * Fh)))              # [T, N*F]
        h = (h.view(T, N, Fh) * gates.unsqueeze(-1)).view(T, N * Fh)
        return torch.addmm(gates @ self.b2, h, self.w2.reshape(N * Fh, -1))

    def gathered_dispatch(self, x, idx, w):
        T, k = idx.shape
        flat = idx.reshape(-1)
        xr = x.repeat_interleave(k, dim=0).unsqueeze(1)                                # [T*k, 1, d]
        h = self.act(torch.baddbmm(self.b1[flat].unsqueeze(1), xr, self.w1[flat].transpose(1, 2)))
        y = torch.baddbmm(self.b2[flat].unsqueeze(1), h, self.w2[flat]).squeeze(1)     # [T*k, d]
        return (y.view(T, k, -1) * w.unsqueeze(-1).to(x.dtype)).sum(1)

    def sorted_dispatch(self, x, idx, w):
        T, k = idx.shape
        if T * k <= 4 and not torch.is_grad_enabled():
            # A rollout step of one or two tokens: the sort, counts and scatter below would cost
            # more than the few matmul pairs themselves.
            rows = []
            for t, experts in enumerate(idx.tolist()):
                h = [self.expert(e, x[t:t + 1]) for e in experts]
                rows.append(sum(h[j] * w[t, j].to(x.dtype) for j in range(k)))
            return torch.cat(rows) if rows else torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        # split, not slices: a slice's backward writes its gradient into a zero-filled copy of
        # the whole input, once per expert; split's backward concatenates once.
        xs = x.index_select(0, token_of).split(counts)
        # With autograd, unbind: one view per expert, whose backward stacks the expert grads once
        # (indexing the stacked parameter per expert would allocate a full-size gradient per
        # expert). Without it, index only the busy experts (N views per call add up at N = 64).
        params = (self.w1, self.b1, self.w2, self.b2)
        w1, b1, w2, b2 = (t.unbind(0) for t in params) if torch.is_grad_enabled() else params
        outs = [torch.addmm(b2[e], self.act(F.linear(xs[e], w1[e], b1[e])), w2[e]) for e, n in enumerate(counts) if n]
        ys = torch.cat(outs) * w.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    def grouped_dispatch(self, x, idx, w):
        T, k = idx.shape
        N = self.num_experts
        with torch.no_grad():   # integer bookkeeping: each assignment's row in the padded [N, cap] layout
            flat = idx.reshape(-1)
            order = flat.argsort(stable=True)
            counts = torch.bincount(flat, minlength=N)
            cap = int(counts.max())
            starts = torch.cumsum(counts, 0) - counts
            expert_of = flat[order]
            row_sorted = expert_of * cap + torch.arange(T * k, device=x.device) - starts[expert_of]
            row = torch.empty_like(row_sorted).index_copy_(0, order, row_sorted)          # [T*k] in (t, j) order
            # the token in each padded row; T (a zero row appended to x) in the padding
            token = torch.full((N * cap,), T, dtype=torch.long, device=x.device).index_copy_(
                0, row, torch.arange(T * k, device=x.device) // k)
        # index_select, not advanced indexing: its backward is an index_add, where indexing's is an
        # accumulating index_put, 3-4x slower on 2 threads (BENCHMARKS.md, the PPO section).
        xs = torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, token).view(N, cap, -1)
        h = self.act(torch.baddbmm(self.b1.unsqueeze(1), xs, self.w1.transpose(1, 2)))
        ys = torch.baddbmm(self.b2.unsqueeze(1), h, self.w2).view(N * cap, -1).index_select(0, row)   # [T*k, d]
        return (ys.view(T, k, -1) * w.unsqueeze(-1).to(x.dtype)).sum(1)

"""Experts and the ways tokens reach them (pure torch).

Every dispatch path computes y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t]); they differ only in
how many ops that takes for a given token count (bench/bench_moe_layer.py measures them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.core.errors import need

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}
DISPATCH_PATHS = ("auto", "sorted", "batched", "gather", "dense")



class ExpertFFN(nn.Module):
    """One feed-forward expert: fc2(act(fc1(x)))."""

    def __init__(self, d_model: int, d_ff: int, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Experts(nn.Module):
    """N experts as separate modules (`experts.{e}.fc1.weight`): backward only touches the experts
    that received tokens, and the names map one-to-one onto expert-parallel shards."""

    def __init__(self, num_experts: int, d_model: int, d_ff: int, activation: str = "gelu"):
        super().__init__()
        need(activation in ACTIVATIONS, "activation", f"one of {tuple(ACTIVATIONS)}", activation)
        self.experts = nn.ModuleList(ExpertFFN(d_model, d_ff, ACTIVATIONS[activation])
                                     for _ in range(num_experts))

    def __len__(self):
        return len(self.experts)

    def stacked(self):
        """(w1 [N, d, F], b1 [N, F], w2 [N, F, d], b2 [N, d]). Without autograd the stack is cached
        until any expert parameter changes (in-place updates bump tensor versions)."""
        params = [t for e in self.experts for t in (e.fc1.weight, e.fc1.bias, e.fc2.weight, e.fc2.bias)]
        if torch.is_grad_enabled():
            return self._stack(params)
        key = tuple((p.data_ptr(), p._version) for p in params)
        if getattr(self, "_stack_key", None) != key:
            self._stack_cache, self._stack_key = self._stack(params), key
        return self._stack_cache

    @staticmethod
    def _stack(params):
        w1, b1, w2, b2 = (torch.stack(params[i::4]) for i in range(4))
        return w1.transpose(1, 2).contiguous(), b1, w2.transpose(1, 2).contiguous(), b2

    # --- dispatch paths: all compute y[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t]) ---------------
    def sorted_dispatch(self, x, idx, w):
        """Group assignments by expert (one argsort), one gather, one matmul pair per active expert,
        one scatter-add. Fast for large token batches."""
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // k
        xs = x.index_select(0, token_of)
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.experts[e](xs[start:start + n]))
                start += n
        ys = torch.cat(outs) * w.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    def gather_dispatch(self, x, idx, w):
        """Tiny batches (rollouts): one expert call per (token, slot) assignment, no sorting, no
        scatter — the fewest ops when T*k is a handful."""
        w = w.to(x.dtype)
        rows = []
        for t, experts in enumerate(idx.tolist()):
            xt = x[t:t + 1]
            ys = torch.cat([self.experts[e](xt) for e in experts])               # [k, d]
            rows.append(w[t:t + 1] @ ys)                                        # [1, d]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def batched_dispatch(self, x, idx, w):
        """Gather each assignment's expert weights (from the cached stack) and run one bmm pair:
        a fixed dozen ops whatever T and N, for rollout-sized batches."""
        T, k = idx.shape
        w1, b1, w2, b2 = self.stacked()
        flat = idx.reshape(-1)
        xr = x.repeat_interleave(k, dim=0).unsqueeze(1)                                 # [T*k, 1, d]
        h = self.experts[0].act(torch.baddbmm(b1[flat].unsqueeze(1), xr, w1[flat]))
        y = torch.baddbmm(b2[flat].unsqueeze(1), h, w2[flat]).squeeze(1)                # [T*k, d]
        return (y.view(T, k, -1) * w.unsqueeze(-1).to(x.dtype)).sum(1)

    def dense_dispatch(self, x, idx, w):
        """Run every expert on every token, then combine: the reference path (N/k times the work)."""
        y = torch.stack([e(x) for e in self.experts])                           # [N, T, d]
        T = x.shape[0]
        picked = y[idx, torch.arange(T, device=x.device).unsqueeze(1)]          # [T, k, d]
        return (picked * w.unsqueeze(-1).to(x.dtype)).sum(1)

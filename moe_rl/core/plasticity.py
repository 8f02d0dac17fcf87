"""Plasticity: the tau-dormant fraction of a policy's hidden units (Sokar et al., 2023).

A unit is tau-dormant on a batch when its mean absolute activation, divided by the mean of that over
its layer's units, is at most tau. A network that stops learning under a task shift (a known way
on-policy PPO loses plasticity) shows a rising dormant share long before its return says so.

Layers here are the feed-forward blocks of the policy trunk:
- an MoE block's units are its experts' hidden units (N x d_ff). An expert's unit is measured on the
  tokens routed to it (a Soft MoE expert: on its slots); an expert nobody routes to has zero
  activity (all its units dormant).
  Per block, the units are pooled over experts (normalised by the block's mean); per expert, by the
  expert's own mean (the expert is a small MLP of its own);
- a dense block's units are the hidden units of its FFN (nn.Sequential(Linear, Activation, Linear)).

    with DormantProbe(trunk) as probe:   # hooks on every MoE layer and dense FFN of the trunk
        trunk(obs)
    probe.figures(tau=0.0)               # {"layer{i}/dormant": f, "layer{i}/dormant/e{j}": f, "dormant": f}

tau = 0 counts units that never fire (exactly zero, e.g. ReLU); tanh and GELU units are rarely
exactly zero, so the default tau here is Sokar et al.'s 0.025 for bounded activations.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.core.experts import Activation
from moe_rl.core.layer import MoELayer
from moe_rl.core.param_groups import trained_modules
from moe_rl.core.soft_moe import SoftMoELayer

DEFAULT_TAU = 0.025


def dormant_mask(activity: torch.Tensor, tau: float) -> torch.Tensor:
    """activity: [units] mean |h| per unit. True where activity / mean(activity) <= tau."""
    mean = activity.mean()
    if not torch.isfinite(mean) or mean <= 0:
        return torch.ones_like(activity, dtype=torch.bool)
    return activity / mean <= tau


def expert_activity(layer: MoELayer, x: torch.Tensor, top_k_indices: torch.Tensor) -> torch.Tensor:
    """[N, d_ff] mean |hidden| of each expert's units over the tokens routed to it (0 for an expert
    with none). x: [T, d] the layer's input; top_k_indices: [T, k] (negative: a dropped assignment)."""
    ex = layer.experts
    out = torch.zeros(ex.num_experts, ex.d_ff, dtype=torch.float32)
    for e in range(ex.num_experts):
        tokens = (top_k_indices == e).any(dim=1)
        if tokens.any():
            h = ex.act(F.linear(x[tokens], ex.w1[e], ex.b1[e]))
            out[e] = h.abs().float().mean(0)
    return out


def soft_expert_activity(layer: SoftMoELayer, x: torch.Tensor) -> torch.Tensor:
    """[N, d_ff] mean |hidden| of each Soft MoE expert's units over its slots (every expert sees
    every observation's slots). x: the layer's input, [B, m, d] or [B, d]."""
    tokens = x if x.dim() == 3 else x.unsqueeze(1)
    B, _, d = tokens.shape
    ex, p = layer.experts, layer.slots_per_expert
    slots = layer.slot_logits(tokens).softmax(1).to(tokens.dtype).transpose(1, 2) @ tokens   # [B, N p, d]
    rows = slots.view(B, ex.num_experts, p, d).transpose(0, 1).reshape(ex.num_experts, B * p, d)
    h = ex.act(torch.baddbmm(ex.b1.unsqueeze(1), rows, ex.w1.transpose(1, 2)))
    return h.abs().float().mean(1)


class DormantProbe:
    """Forward hooks that record each feed-forward block's hidden activity during one forward."""

    def __init__(self, module: nn.Module):
        self.moe: List[Tuple[MoELayer, list]] = []
        self.dense: List[Tuple[nn.Module, list]] = []
        self._blocks: List[Tuple[str, object]] = []   # in forward order of registration (module order)
        self._handles = []
        for m in trained_modules(module):   # not a target network: it never runs here
            if isinstance(m, (MoELayer, SoftMoELayer)):
                seen: list = []
                self._blocks.append(("moe", (m, seen)))
                self._handles.append(m.register_forward_hook(self._moe_hook(seen)))
            elif isinstance(m, nn.Sequential) and any(isinstance(c, Activation) for c in m):
                act = next(c for c in m if isinstance(c, Activation))
                seen = []
                self._blocks.append(("dense", (act, seen)))
                self._handles.append(act.register_forward_hook(self._dense_hook(seen)))

    @staticmethod
    def _moe_hook(seen):
        def hook(layer, args, output):
            if isinstance(layer, SoftMoELayer):
                seen.append(soft_expert_activity(layer, args[0].detach()))
                return
            x = args[0].reshape(-1, layer.d_model).detach()
            seen.append(expert_activity(layer, x, output[1].top_k_indices.detach()))
        return hook

    @staticmethod
    def _dense_hook(seen):
        def hook(module, args, output):
            seen.append(output.detach().reshape(-1, output.shape[-1]).abs().float().mean(0))
        return hook

    def __enter__(self) -> "DormantProbe":
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def figures(self, tau: float = DEFAULT_TAU) -> Dict[str, float]:
        """Dormant shares of the last recorded forward: per block (layer{i}/dormant, i from 0), per
        expert of an MoE block (layer{i}/dormant/e{j}), and over all blocks' units (dormant)."""
        out: Dict[str, float] = {}
        pooled = []
        for i, (kind, (_, seen)) in enumerate(self._blocks):
            if not seen:
                continue
            activity = seen[-1]
            flat = activity.reshape(-1)
            mask = dormant_mask(flat, tau)
            out[f"layer{i}/dormant"] = float(mask.float().mean())
            pooled.append(mask)
            if kind == "moe":
                for e in range(activity.shape[0]):
                    out[f"layer{i}/dormant/e{e}"] = float(dormant_mask(activity[e], tau).float().mean())
        if pooled:
            out["dormant"] = float(torch.cat(pooled).float().mean())
        return out


def trunk_dormancy(trunk: nn.Module, forward, tau: float = DEFAULT_TAU) -> Dict[str, float]:
    """forward() runs the trunk once (no grad); the dormant figures of that pass."""
    with DormantProbe(trunk) as probe, torch.no_grad():
        forward()
    return probe.figures(tau)

"""Soft MoE (Puigcerver et al., 2023, "From Sparse to Soft Mixtures of Experts"): every token is
softly dispatched to every expert's slots and softly combined back (pure torch).

Shapes: B observations, m tokens per observation, d width, N experts, p slots per expert, S = N p.

    layer = SoftMoELayer(d_model=64, num_experts=8, slots_per_expert=1)
    y, record = layer(x)            # x: [B, m, d] (m tokens per observation) or [B, d] (one token)

Per observation X [m, d], with Φ [d, S] the slot parameters (the paper's Algorithm 1):

    logits = X Φ                               [m, S]; with the paper's normalisation (its section
                                               2.3) scale * l2n(X) l2n(Φ), l2n over d, scale a learned
                                               scalar starting at 1
    D = softmax over the m tokens, per slot    dispatch: slot s is the convex mix sum_t D[t, s] X[t]
    C = softmax over the S slots, per token    combine
    Y = C f(Dᵀ X)                              f: expert i on its p slots

Tokens mix only within their observation, never across the batch, so a rollout step of one
observation computes what a training minibatch of hundreds computes for it (a batch-wide mix would
be training-inference drift by construction). Nothing is dropped: no capacity, no top-k, no load
to balance. A flat observation is one token: dispatch is then 1 for every slot and the layer is a
softly gated sum of all experts on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.core.errors import need
from moe_rl.core.experts import Experts


def l2_normalize(x: torch.Tensor, dim: int, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim, keepdim=True) + eps)


@dataclass
class SoftRoutingRecord:
    """What one Soft MoE layer did for B observations of m tokens each.

    logits: [B, m, S] fp32 slot logits (S = num_experts * slots_per_expert), from which dispatch
    (softmax over m) and combine (softmax over S) follow. The figures the health grade, the
    metrics and the consistency check read are derived from them."""

    logits: torch.Tensor
    num_experts: int
    slots_per_expert: int

    soft = True   # the record kind; sparse RoutingRecord has none of these figures

    def combine(self) -> torch.Tensor:
        return self.logits.softmax(-1)

    def dispatch(self) -> torch.Tensor:
        return self.logits.softmax(1)

    def expert_combine(self) -> torch.Tensor:
        """[B, N] per observation, the share of its output each expert's slots carry (the combine
        weights summed over the expert's slots, averaged over the tokens): sums to 1."""
        B, m, _ = self.logits.shape
        return self.combine().view(B, m, self.num_experts, self.slots_per_expert).sum(-1).mean(1)

    def expert_load(self) -> torch.Tensor:
        """[N] the experts' combine weight summed over the observations: the soft counterpart of a
        sparse layer's assignment counts (what the balance figures and the health grade read)."""
        return self.expert_combine().sum(0)

    def state_entropy_norm(self) -> torch.Tensor:
        """Mean over observations of the entropy of expert_combine, / ln N (1: every expert weighs
        alike in each output)."""
        p = self.expert_combine().double().clamp_min(1e-30)
        n = self.num_experts
        return -(p * p.log()).sum(-1).mean() / math.log(n) if n > 1 else p.new_ones(())

    def dispatch_entropy_norm(self) -> torch.Tensor:
        """Mean over slots and observations of the entropy of a slot's dispatch over the tokens,
        / ln m: 1 where every slot averages all tokens, near 0 where each slot reads one token (1
        for a one-token observation)."""
        m = self.logits.shape[1]
        if m < 2:
            return self.logits.new_ones((), dtype=torch.float64)
        d = self.dispatch().double().clamp_min(1e-30)
        return -(d * d.log()).sum(1).mean() / math.log(m)

    def detach(self) -> "SoftRoutingRecord":
        return replace(self, logits=self.logits.detach())

    def rows(self, index: torch.Tensor) -> "SoftRoutingRecord":
        return replace(self, logits=self.logits[index])

    def encoded(self) -> torch.Tensor:
        """[B, N] what a rollout records per step: expert_combine (the consistency check compares
        the rollout copy's with the trainer's on the same observations)."""
        return self.expert_combine()


class SoftMoELayer(nn.Module):
    """Soft MoE feed-forward layer (see the module docstring).

    Args:
        d_model: token width d.  num_experts: N >= 1.  slots_per_expert: p >= 1.
        d_ff: expert hidden width F (default 4d).  activation: moe_rl.core.experts.ACTIVATIONS.
        normalize: the paper's l2 normalisation of tokens and slot parameters with a learned scale.
    forward(x [B, m, d] | [B, d]) -> (y like x, SoftRoutingRecord)
    """

    # The slot parameters decide how tokens reach the experts: a soft router (the experts declare theirs).
    PARAM_ROLES = {"slot_embed": "router", "scale": "router"}

    def __init__(self, d_model: int, num_experts: int, slots_per_expert: int = 1, d_ff: Optional[int] = None, *,
                 activation: str = "gelu", normalize: bool = True):
        super().__init__()
        need(isinstance(d_model, int) and d_model >= 1, "d_model", "an int >= 1", d_model)
        need(isinstance(num_experts, int) and num_experts >= 1, "num_experts", "an int >= 1", num_experts)
        need(isinstance(slots_per_expert, int) and slots_per_expert >= 1, "slots_per_expert", "an int >= 1",
             slots_per_expert)
        d_ff = d_ff or 4 * d_model
        self.d_model, self.num_experts, self.slots_per_expert, self.d_ff = d_model, num_experts, slots_per_expert, d_ff
        self.normalize = normalize
        # lecun-normal slot parameters, as the paper's (and the dense layers' fan-in scale)
        self.slot_embed = nn.Parameter(torch.randn(d_model, num_experts * slots_per_expert) / math.sqrt(d_model))
        self.scale = nn.Parameter(torch.ones(())) if normalize else None
        self.experts = Experts(num_experts, d_model, d_ff, activation)

    def slot_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[B, m, d] -> [B, m, S] in fp32, whatever the layer's dtype (as the sparse routers: a
        softmax in bf16 is a leading source of training-inference drift)."""
        x, phi = x.float(), self.slot_embed.float()
        if self.normalize:
            return self.scale.float() * (l2_normalize(x, -1) @ l2_normalize(phi, 0))
        return x @ phi

    def forward(self, x: torch.Tensor):
        need(x.shape[-1] == self.d_model, "x", f"a tensor of width d_model={self.d_model}", tuple(x.shape))
        one_token = x.dim() == 2
        tokens = x.unsqueeze(1) if one_token else x                          # [B, m, d]
        B, m, d = tokens.shape
        N, p = self.num_experts, self.slots_per_expert
        logits = self.slot_logits(tokens)                                     # [B, m, S]
        dispatch = logits.softmax(1).to(x.dtype)
        combine = logits.softmax(-1).to(x.dtype)
        slots = dispatch.transpose(1, 2) @ tokens                            # [B, S, d]
        per_expert = slots.view(B, N, p, d).transpose(0, 1).reshape(N, B * p, d)
        out = self.experts.slot_forward(per_expert)                          # [N, B p, d]
        out = out.view(N, B, p, d).transpose(0, 1).reshape(B, N * p, d)
        y = combine @ out                                                     # [B, m, d]
        record = SoftRoutingRecord(logits, N, p)
        return (y.squeeze(1) if one_token else y), record


def soft_moe_reference(x: torch.Tensor, phi: torch.Tensor, experts, slots_per_expert: int,
                       scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The paper's equations written out for one observation X [m, d], slot by slot, token by
    token (tests compare the layer with it). experts: callables, expert i on [p, d] -> [p, d]."""
    if scale is not None:
        logits = scale * (F.normalize(x, dim=1, eps=0) @ F.normalize(phi, dim=0, eps=0))
    else:
        logits = x @ phi
    m, S = logits.shape
    D = torch.stack([torch.softmax(logits[:, s], 0) for s in range(S)], 1)      # per slot, over tokens
    C = torch.stack([torch.softmax(logits[t], 0) for t in range(m)], 0)        # per token, over slots
    slots = torch.stack([sum(D[t, s] * x[t] for t in range(m)) for s in range(S)])
    outs = torch.cat([experts[i](slots[i * slots_per_expert:(i + 1) * slots_per_expert])
                      for i in range(len(experts))])
    return torch.stack([sum(C[t, s] * outs[s] for s in range(S)) for t in range(m)])

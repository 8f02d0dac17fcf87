"""DeepSpeed-MoE layers for the learner: expert parallelism with moe_rl's routers.

`DeepSpeedMoE` replaces a core `MoELayer` inside the learner's policy. Tokens travel to their
experts through DeepSpeed's MOELayer (sparse dispatch + all-to-all over the expert-parallel
group); the gate is `RoutedGate`, which runs the *same* moe_rl Router as the rollout copy, so
routing math is identical on both sides unless a trainer-only option below is switched on.

Trainer-only gating options (each a real training-inference mismatch, off by default so the
consistency checks can measure them one at a time):
    second_expert_sampling   DeepSpeed's default: Gumbel-sample the 2nd expert.
    capacity_factor          drop assignments beyond ceil(cf * T * k / N) per expert.
    random_token_selection   with a capacity, pick survivors at random instead of by position.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE
from torch import nn

from moe_rl.core.layer import MoELayer
from moe_rl.core.routers import Router
from moe_rl.core.routing import capacity, decode_top_k, expert_dropout, gate_weights, queue_positions


class RoutedGate(nn.Module):
    """DeepSpeed MOELayer gate (sparse-route contract of deepspeed 0.19) around a moe_rl Router.

    forward(x [S, d], used_token, sparse_routes, use_tutel) ->
        (l_aux, capacity, E, indices [k, S] int32 (-1 = dropped), locations [k, S], gates [k, S], counts [E])
    The RoutingRecord of the call is kept in `last_record` for losses, metrics and drift checks;
    moe-rl's learner computes the balance loss from it (l_aux returned to DeepSpeed is unused, 0).
    A replay (`replay`, an encoded top-k) dispatches the rollout's experts and drops the rollout's
    capacity-dropped assignments; a trainer capacity (`capacity_factor`) drops on top of that.
    """

    def __init__(self, router: Router, num_experts: int, *, capacity_factor: Optional[float] = None,
                 second_expert_sampling: bool = False, random_token_selection: bool = False,
                 expert_dropout: float = 0.0):
        super().__init__()
        self.router, self.num_experts = router, num_experts
        self.capacity_factor = capacity_factor
        self.second_expert_sampling = second_expert_sampling
        self.random_token_selection = random_token_selection
        self.expert_dropout = expert_dropout
        self.ep_group = None
        self.replay = self.task_ids = self.last_record = None

    def _set_ep_group(self, group) -> None:
        self.ep_group = group

    def _agree(self, value: torch.Tensor) -> torch.Tensor:
        """Max over the expert-parallel group: every rank must size its buffers alike."""
        if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.ep_group)
        return value

    def _sample_second_expert(self, rec) -> None:
        with torch.no_grad():
            u = torch.rand_like(rec.router_logits).clamp_(1e-9, 1 - 1e-9)
            noisy = rec.router_logits - torch.log(-torch.log(u))
            noisy = noisy.scatter(1, rec.top_k_indices[:, :1], float("-inf"))
            rest = noisy.topk(rec.top_k_indices.shape[1] - 1, dim=-1).indices
            rec.top_k_indices = torch.cat([rec.top_k_indices[:, :1], rest], 1)
        rec.gate_weights = gate_weights(rec.router_logits, rec.top_k_indices, self.router.normalize_gates)

    def forward(self, x, used_token=None, sparse_routes=True, use_tutel=False):
        replay, replay_dropped = (None, None) if self.replay is None else decode_top_k(self.replay)
        rec = self.router(x, replay_indices=replay, task_ids=self.task_ids)
        if self.second_expert_sampling and self.training and replay is None and rec.top_k_indices.shape[1] > 1:
            self._sample_second_expert(rec)
        idx, gates = rec.top_k_indices, rec.gate_weights
        S, k = idx.shape
        order = None
        if self.random_token_selection and self.capacity_factor is not None and self.training:
            order = torch.randperm(S, device=x.device)  # who gets a capacity slot first
        locations = queue_positions(idx, self.num_experts, order).t()          # [k, S]
        counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
        keep = torch.ones_like(locations, dtype=torch.bool) if replay_dropped is None else ~replay_dropped.t()
        if self.capacity_factor is None:   # dropless: the largest expert load in the group
            cap = self._agree(counts.max().clone())
        else:
            cap = self._agree(torch.tensor(capacity(self.capacity_factor, S, k, self.num_experts)))
            keep = keep & (locations < cap)
        if self.capacity_factor is not None or replay_dropped is not None:
            rec.dropped = ~keep.t()
        weights = gates * keep.t()
        if self.training:
            weights = expert_dropout(weights, self.expert_dropout)
        self.last_record = rec
        indices = torch.where(keep, idx.t(), torch.full_like(idx.t(), -1))
        return (x.new_zeros(()), cap, self.num_experts, indices.int(), (locations * keep).int(),
                weights.t().float(), counts)


class ExpertFFN(nn.Module):
    PARAM_ROLE = "experts"   # moe_rl.core.param_groups
    """One expert as DeepSpeed's MoE layer wants it (a module it deep-copies per local expert), in
    the canonical per-expert layout: fc2(act(fc1(x)))."""

    def __init__(self, d_model: int, d_ff: int, act):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class DeepSpeedMoE(nn.Module):
    """Expert-parallel stand-in for a core MoELayer: same forward contract
    (x, replay_indices, task_ids) -> (y, RoutingRecord), experts sharded over ep_size ranks."""

    def __init__(self, layer: MoELayer, ep_size: int, ep_rank: int, *, capacity_factor=None,
                 second_expert_sampling=False, random_token_selection=False):
        super().__init__()
        self.d_model, self.num_experts = layer.d_model, layer.num_experts
        self.num_local = layer.num_experts // ep_size
        experts = layer.experts
        template = ExpertFFN(layer.d_model, layer.d_ff, experts.act)
        self.ds = MoE(layer.d_model, template, num_experts=layer.num_experts, ep_size=ep_size, k=layer.top_k,
                      drop_tokens=capacity_factor is not None, use_rts=False, top2_2nd_expert_sampling=False)
        self.ds.deepspeed_moe.gate = RoutedGate(
            layer.router, layer.num_experts, capacity_factor=capacity_factor,
            second_expert_sampling=second_expert_sampling, random_token_selection=random_token_selection,
            expert_dropout=layer.expert_dropout)
        # This rank's experts start from the matching global experts of the layer it replaces.
        with torch.no_grad():
            for i, expert in enumerate(self.ds.deepspeed_moe.experts.deepspeed_experts):
                e = ep_rank * self.num_local + i
                expert.fc1.weight.copy_(experts.w1[e])
                expert.fc1.bias.copy_(experts.b1[e])
                expert.fc2.weight.copy_(experts.w2[e].t())
                expert.fc2.bias.copy_(experts.b2[e])
        self.shared_expert = layer.shared_expert

    @property
    def gate(self) -> RoutedGate:
        return self.ds.deepspeed_moe.gate

    @property
    def router(self) -> Router:
        return self.gate.router

    def forward(self, x, replay_indices=None, task_ids=None, explore=False, seq_mask=None):
        # seq_mask: DeepSpeed's gate keeps its own capacity over the whole batch (trainer_capacity_factor).
        flat = x.reshape(-1, self.d_model)
        gate = self.gate
        gate.replay, gate.task_ids = replay_indices, task_ids
        try:
            y = self.ds(flat)[0]
            rec = gate.last_record
        finally:
            gate.replay = gate.task_ids = gate.last_record = None
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return y.reshape(x.shape), rec


def shard_moe_layers(model: nn.Module, ep_size: int, ep_rank: int, **gating) -> int:
    """Replace every core MoELayer under `model` by a DeepSpeedMoE in place; returns the count."""
    replaced = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MoELayer):
                setattr(module, child_name, DeepSpeedMoE(child, ep_size, ep_rank, **gating))
                replaced += 1
    return replaced

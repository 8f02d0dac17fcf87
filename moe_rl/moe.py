"""Mixture-of-Experts layer and routers (pure torch: no Ray, no DeepSpeed).

Shapes use T = tokens (flattened batch), d = model width, N = experts, k = top-k, F = expert hidden.

    layer = MoELayer(d_model=64, num_experts=8, top_k=2)
    y, routing = layer(x)                         # x: [T, d] (or [..., d]) -> y like x
    y2, _ = layer(x, replay_indices=routing.top_k_indices)   # R3 routing replay

The routing record carries what losses, health metrics, drift checks and routing replay need.
Router math always runs in fp32, whatever the layer's dtype, because softmax/top-k ties in bf16
are a leading source of training-inference routing disagreement.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = ("topk", "sinkhorn", "bias", "task", "reinforce")
ROUTER_INITS = ("normal", "uniform", "torch")
DISPATCH_PATHS = ("auto", "sorted", "batched", "gather", "dense")
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh}

# "auto" dispatch (bench/bench_moe_layer.py): without autograd (rollouts), gather the chosen experts'
# weights from a cached stack and run one bmm pair while the gathered weights stay small; with
# autograd, a per-assignment loop for a handful of assignments, else sort-by-expert.
TINY_BATCH_ASSIGNMENTS = 4
BATCHED_MAX_ELEMENTS = 1 << 16   # T*k*d*F: gathered-weight elements the batched path may copy


def _check(cond: bool, name: str, allowed: str, got) -> None:
    if not cond:
        raise ValueError(f"{name}: must be {allowed}, got {got!r}")


@dataclass
class RoutingRecord:
    """What one MoE layer decided for T tokens.

    top_k_indices: [T, k] int64  chosen experts, best first.
    gate_weights:  [T, k] float  combine weights applied to each chosen expert's output.
    router_logits: [T, N] fp32   raw router scores (after temperature).
    router_probs:  [T, N] fp32   softmax(router_logits); the load-balancing loss uses it.
    dropped:       [T, k] bool or None  assignments removed by the capacity limit.
    """

    top_k_indices: torch.Tensor
    gate_weights: torch.Tensor
    router_logits: torch.Tensor
    dropped: Optional[torch.Tensor] = None
    # REINFORCE router only: log-prob of the sampled experts [T] and the baseline value [T].
    selection_logp: Optional[torch.Tensor] = None
    baseline: Optional[torch.Tensor] = None

    @property
    def num_experts(self) -> int:
        return self.router_logits.shape[-1]

    @property
    def router_probs(self) -> torch.Tensor:
        """[T, N] softmax(router_logits), computed on demand (rollouts never need it)."""
        return self.router_logits.softmax(dim=-1)

    def detach(self) -> "RoutingRecord":
        def d(t):
            return None if t is None else t.detach()
        return RoutingRecord(self.top_k_indices, d(self.gate_weights), d(self.router_logits), self.dropped,
                             d(self.selection_logp), d(self.baseline))

    def rows(self, index: torch.Tensor) -> "RoutingRecord":
        """The record of a subset of the tokens (every per-token field indexed alike)."""
        def take(t):
            return None if t is None else t[index]
        return RoutingRecord(self.top_k_indices[index], self.gate_weights[index], self.router_logits[index],
                             take(self.dropped), take(self.selection_logp), take(self.baseline))


def sinkhorn(scores: torch.Tensor, top_k: int = 1, epsilon: float = 0.1,
             max_iters: int = 200, tol: float = 1e-4) -> torch.Tensor:
    """Entropic optimal-transport plan for balanced routing.

    scores: [T, N]. Returns P: [T, N] >= 0 with row sums = top_k (each token places k units) and
    column sums = T*top_k/N (each expert receives an equal share). Runs in log space for stability.
    """
    T, N = scores.shape
    log_k = (scores.float() / epsilon)
    log_row = math.log(top_k)
    log_col = math.log(T * top_k / N)
    u = torch.zeros(T, dtype=torch.float32, device=scores.device)
    v = torch.zeros(N, dtype=torch.float32, device=scores.device)
    for _ in range(max_iters):
        u = log_row - torch.logsumexp(log_k + v[None, :], dim=1)
        v = log_col - torch.logsumexp(log_k + u[:, None], dim=0)
        # Columns are exact after the v-step; stop when rows are close too.
        row_err = (torch.logsumexp(log_k + u[:, None] + v[None, :], dim=1).exp() - top_k).abs().max()
        if row_err < tol * top_k:
            break
    return (log_k + u[:, None] + v[None, :]).exp()


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


class Router(nn.Module):
    """Linear (or MLP) router with fp32 math. Subclasses change how experts are *selected*.

    Gate weights always come from the softmax probabilities of the chosen experts, so the router
    gets gradients even when the selection itself is not differentiable (replay, Sinkhorn, bias).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, temperature: float = 1.0,
                 init: str = "normal", init_std: Optional[float] = None, normalize_gates: bool = True,
                 input_dim: Optional[int] = None, mlp_depth: int = 0, mlp_width: Optional[int] = None):
        super().__init__()
        _check(init in ROUTER_INITS, "router_init", f"one of {ROUTER_INITS}", init)
        _check(isinstance(mlp_depth, int) and mlp_depth >= 0, "router_mlp_depth", "an int >= 0", mlp_depth)
        self.num_experts, self.top_k = num_experts, top_k
        self.temperature = temperature
        self.normalize_gates = normalize_gates
        width = input_dim or d_model
        hidden = []
        for _ in range(mlp_depth):  # optional deeper router (seed 000's architecture finding)
            hidden += [nn.Linear(width, mlp_width or width), nn.ReLU()]
            width = mlp_width or width
        self.hidden = nn.Sequential(*hidden)
        self.gate = nn.Linear(width, num_experts)
        self.reset_gate(init, init_std)

    def reset_gate(self, init: str, init_std: Optional[float] = None) -> None:
        """normal: N(0, std) with std = 0.02/sqrt(N) unless given; uniform: +-sqrt(6/(d+N))."""
        w = self.gate.weight
        if init == "normal":
            nn.init.normal_(w, 0.0, init_std if init_std is not None else 0.02 / math.sqrt(self.num_experts))
            nn.init.zeros_(self.gate.bias)
        elif init == "uniform":
            bound = math.sqrt(6.0 / (w.shape[1] + self.num_experts))
            nn.init.uniform_(w, -bound, bound)
            nn.init.zeros_(self.gate.bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if len(self.hidden):
            with torch.autocast(x.device.type, enabled=False):
                for m in self.hidden:
                    h = F.linear(h, m.weight.float(), m.bias.float()) if isinstance(m, nn.Linear) else m(h)
        logits = F.linear(h, self.gate.weight.float(), self.gate.bias.float())
        return logits if self.temperature == 1.0 else logits / self.temperature

    def select(self, logits: torch.Tensor) -> torch.Tensor:
        """Chosen experts [T, k]: plain top-k (softmax is monotone, so top-k of the logits)."""
        return logits.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor, replay_indices: Optional[torch.Tensor] = None,
                task_ids: Optional[torch.Tensor] = None) -> RoutingRecord:
        logits = self.logits(x)
        if replay_indices is not None:
            idx = replay_indices.to(device=x.device, dtype=torch.long)
            _check(idx.shape == (x.shape[0], self.top_k), "replay_indices", f"shape {(x.shape[0], self.top_k)}",
                   tuple(idx.shape))
        else:
            with torch.no_grad():
                idx = self.select(logits)
        chosen = logits.gather(1, idx)
        if self.normalize_gates and self.top_k > 1:
            gates = chosen.softmax(dim=-1)     # = p_chosen / sum(p_chosen)
        else:                                  # raw probability (Switch): top-1 keeps a router gradient
            gates = (chosen - logits.logsumexp(dim=-1, keepdim=True)).exp()
        return RoutingRecord(idx, gates, logits)


class SinkhornRouter(Router):
    """Balanced selection from an optimal-transport plan (training only by default: at inference a
    single observation has no batch to balance, so plain top-k keeps rollouts deterministic)."""

    def __init__(self, *args, sinkhorn_epsilon: float = 0.1, sinkhorn_at_inference: bool = False, **kw):
        super().__init__(*args, **kw)
        self.epsilon, self.at_inference = sinkhorn_epsilon, sinkhorn_at_inference

    def select(self, logits):
        if not (self.training or self.at_inference) or logits.shape[0] < 2:
            return super().select(logits)
        plan = sinkhorn(logits, self.top_k, self.epsilon)
        return plan.topk(self.top_k, dim=-1).indices


class BiasBalancedRouter(Router):
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias shifts only the *selection*;
    after each training forward the bias moves by rate * sign(mean load - load)."""

    def __init__(self, *args, bias_update_rate: float = 1e-3, **kw):
        super().__init__(*args, **kw)
        self.bias_update_rate = bias_update_rate
        self.register_buffer("selection_bias", torch.zeros(self.num_experts))

    def select(self, logits):
        idx = (logits.softmax(-1) + self.selection_bias).topk(self.top_k, dim=-1).indices
        if self.training:
            self.update_bias(torch.bincount(idx.flatten(), minlength=self.num_experts))
        return idx

    @torch.no_grad()
    def update_bias(self, expert_counts: torch.Tensor) -> None:
        load = expert_counts.float()
        self.selection_bias += self.bias_update_rate * torch.sign(load.mean() - load)


class TaskConditionedRouter(Router):
    """Routes on [x, task_embedding(task_id)] so different tasks can prefer different experts."""

    def __init__(self, d_model, num_experts, top_k, *, num_tasks: int, task_dim: int = 16, **kw):
        _check(isinstance(num_tasks, int) and num_tasks >= 1, "num_tasks", "an int >= 1", num_tasks)
        super().__init__(d_model, num_experts, top_k, input_dim=d_model + task_dim, **kw)
        self.task_embedding = nn.Embedding(num_tasks, task_dim)

    def forward(self, x, replay_indices=None, task_ids=None):
        if task_ids is None:
            raise ValueError("task_ids: the task-conditioned router needs task ids ([T] int), got None")
        emb = self.task_embedding(task_ids.reshape(-1).long()).to(x.dtype)
        return super().forward(torch.cat([x, emb], dim=-1), replay_indices)


class ReinforceRouter(Router):
    """Policy-gradient routing: in training, experts are *sampled* from the router distribution
    (without replacement) and the record carries their log-prob and a learned baseline, so the
    learner can add -(advantage - baseline)·logp (moe_rl.losses.reinforce_router_loss).
    At inference it is greedy top-k."""

    def __init__(self, d_model, num_experts, top_k, **kw):
        super().__init__(d_model, num_experts, top_k, **kw)
        self.baseline = nn.Linear(d_model, 1)

    def select(self, logits):
        if not self.training:
            return super().select(logits)
        return torch.multinomial(logits.softmax(-1), self.top_k, replacement=False)

    def forward(self, x, replay_indices=None, task_ids=None):
        rec = super().forward(x, replay_indices)
        logp = torch.log_softmax(rec.router_logits, dim=-1)
        rec.selection_logp = logp.gather(1, rec.top_k_indices).sum(-1)
        rec.baseline = self.baseline(x.float()).squeeze(-1)
        return rec


def build_router(kind: str, d_model: int, num_experts: int, top_k: int, **kw) -> Router:
    _check(kind in ROUTERS, "router", f"one of {ROUTERS}", kind)
    cls = {"topk": Router, "sinkhorn": SinkhornRouter, "bias": BiasBalancedRouter,
           "task": TaskConditionedRouter, "reinforce": ReinforceRouter}[kind]
    return cls(d_model, num_experts, top_k, **kw)


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
        _check(activation in ACTIVATIONS, "activation", f"one of {tuple(ACTIVATIONS)}", activation)
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


class MoELayer(nn.Module):
    """Top-k routed feed-forward layer.

    Args:
        d_model: input/output width d.  num_experts: N >= 1.  top_k: 1 <= k <= N.
        d_ff: expert hidden width F (default 4d).  router: one of ROUTERS.
        temperature: finite > 0, divides router logits.  router_init: normal|uniform|torch.
        shared_expert: add an always-on dense expert (residual across experts).
        expert_dropout: p in [0, 1): drop whole (token, expert) contributions in training.
        capacity_factor: None = dropless; else > 0 and each expert takes at most
            ceil(cf * T * k / N) assignments (later tokens over the limit are dropped).
        dispatch: auto|sorted|dense|gather.
    forward(x [..., d], replay_indices [T, k] | None, task_ids [...] | None) -> (y [..., d], RoutingRecord)
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int = 2, d_ff: Optional[int] = None, *,
                 router: str = "topk", temperature: float = 1.0, router_init: str = "normal",
                 router_init_std: Optional[float] = None, shared_expert: bool = False,
                 expert_dropout: float = 0.0, capacity_factor: Optional[float] = None,
                 dispatch: str = "auto", activation: str = "gelu", normalize_gates: bool = True,
                 router_kwargs: Optional[dict] = None):
        super().__init__()
        _check(isinstance(d_model, int) and d_model >= 1, "d_model", "an int >= 1", d_model)
        _check(isinstance(num_experts, int) and num_experts >= 1, "num_experts", "an int >= 1", num_experts)
        _check(isinstance(top_k, int) and 1 <= top_k <= num_experts, "top_k",
               f"an int in [1, num_experts={num_experts}]", top_k)
        _check(isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0,
               "temperature", "a finite number > 0", temperature)
        _check(capacity_factor is None or (isinstance(capacity_factor, (int, float))
                                           and math.isfinite(capacity_factor) and capacity_factor > 0),
               "capacity_factor", "None (dropless) or a finite number > 0", capacity_factor)
        _check(isinstance(expert_dropout, (int, float)) and 0.0 <= expert_dropout < 1.0,
               "expert_dropout", "a number in [0, 1)", expert_dropout)
        _check(dispatch in DISPATCH_PATHS, "dispatch", f"one of {DISPATCH_PATHS}", dispatch)
        d_ff = d_ff or 4 * d_model
        _check(isinstance(d_ff, int) and d_ff >= 1, "d_ff", "an int >= 1", d_ff)
        self.d_model, self.num_experts, self.top_k, self.d_ff = d_model, num_experts, top_k, d_ff
        self.capacity_factor, self.expert_dropout, self.dispatch = capacity_factor, expert_dropout, dispatch
        self.router = build_router(router, d_model, num_experts, top_k, temperature=temperature,
                                   init=router_init, init_std=router_init_std,
                                   normalize_gates=normalize_gates, **(router_kwargs or {}))
        self.experts = Experts(num_experts, d_model, d_ff, activation)
        self.shared_expert = (nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
                              if shared_expert else None)

    def _capacity_mask(self, idx: torch.Tensor) -> torch.Tensor:
        """[T, k] bool: True where the assignment exceeds its expert's capacity (earlier tokens and
        higher-ranked slots win)."""
        T, k = idx.shape
        capacity = math.ceil(self.capacity_factor * T * k / self.num_experts)
        return queue_positions(idx, self.num_experts) >= capacity

    def dispatch_path(self, num_assignments: int) -> str:
        if self.dispatch != "auto":
            return self.dispatch
        if not torch.is_grad_enabled() and num_assignments * self.d_model * self.d_ff <= BATCHED_MAX_ELEMENTS:
            return "batched"
        return "gather" if num_assignments <= TINY_BATCH_ASSIGNMENTS else "sorted"

    def forward(self, x: torch.Tensor, replay_indices: Optional[torch.Tensor] = None,
                task_ids: Optional[torch.Tensor] = None):
        _check(x.shape[-1] == self.d_model, "x", f"a tensor of width d_model={self.d_model}", tuple(x.shape))
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.d_model)
        rec = self.router(flat, replay_indices=replay_indices, task_ids=task_ids)
        weights = rec.gate_weights
        if self.capacity_factor is not None:
            rec.dropped = self._capacity_mask(rec.top_k_indices)
            weights = weights.masked_fill(rec.dropped, 0.0)
        if self.training and self.expert_dropout > 0:
            keep = torch.rand_like(weights) >= self.expert_dropout
            weights = weights * keep / (1.0 - self.expert_dropout)
        path = self.dispatch_path(rec.top_k_indices.numel())
        y = getattr(self.experts, f"{path}_dispatch")(flat, rec.top_k_indices, weights)
        if self.shared_expert is not None:
            y = y + self.shared_expert(flat)
        return y.reshape(*lead, self.d_model), rec


def dense_ffn_equal_active(d_model: int, d_ff: int, top_k: int, activation: str = "gelu") -> nn.Module:
    """The dense peer with the same *active* parameters as an MoE layer (k experts of width F)."""
    return nn.Sequential(nn.Linear(d_model, top_k * d_ff),
                         {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "tanh": nn.Tanh}[activation](),
                         nn.Linear(top_k * d_ff, d_model))

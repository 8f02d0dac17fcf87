"""Routers: logits -> which k experts each token goes to (pure torch).

Every router here is RL-consistent by construction: its selection is a function of the token and
of synced state only (weights and buffers), never of the other tokens in the batch, so the rollout
copy (8 tokens per call) and the trainer (256-token minibatches) route alike. Balancing state
(`selection_bias`) moves only at optimizer steps (`balance_step`), from statistics of training
forwards, so a measurement (the trainer's view of rollout data) never changes it.

| router      | at rollout                       | in training                                  |
| topk        | top-k of the logits              | the same                                     |
| bias        | top-k of softmax + bias          | the same; bias += rate * sign(mean - load)  |
| sinkhorn    | top-k of logits + bias           | the same; bias tracks the Sinkhorn column    |
|             |                                  | potentials (the batch's balanced OT plan)    |
| task        | top-k of router([x, task emb])   | the same                                     |
| reinforce   | experts sampled (explore) or     | the rollout's sampled experts replayed;      |
|             | greedy top-k (evaluation)        | -(A - b) log p(draw) trains the router       |

Router math always runs in fp32, whatever the layer's dtype: softmax/top-k ties in bf16 are a
leading source of training-inference routing disagreement.
"""
from __future__ import annotations

import inspect
import math
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from moe_rl.core.errors import need
from moe_rl.core.param_groups import trained_modules
from moe_rl.core.routing import RoutingRecord, gate_weights, sinkhorn_potentials

ROUTERS = ("topk", "sinkhorn", "bias", "task", "reinforce")
ROUTER_INITS = ("normal", "uniform", "torch")
AllReduce = Callable[[torch.Tensor], torch.Tensor]   # in-place SUM over the data-parallel learners


class Router(nn.Module):
    """Linear (or MLP) router. Subclasses change how experts are *selected* (`select`) and may
    keep balancing state updated at optimizer steps (`observe` + `balance_step`).

    Gate weights always come from the softmax probabilities of the chosen experts, so the router
    gets gradients even when the selection itself is not differentiable (replay, bias, sampling).
    """

    samples_when_exploring = False   # True: exploring rollouts draw experts at random
    PARAM_ROLE = "router"            # moe_rl.core.param_groups

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, temperature: float = 1.0,
                 init: str = "normal", init_std: Optional[float] = None, normalize_gates: bool = True,
                 input_dim: Optional[int] = None, mlp_depth: int = 0, mlp_width: Optional[int] = None):
        super().__init__()
        need(init in ROUTER_INITS, "router_init", f"one of {ROUTER_INITS}", init)
        need(isinstance(mlp_depth, int) and mlp_depth >= 0, "router_kwargs.mlp_depth", "an int >= 0", mlp_depth)
        self.num_experts, self.top_k = num_experts, top_k
        self.temperature = temperature
        self.normalize_gates = normalize_gates
        width = input_dim or d_model
        hidden = []
        for _ in range(mlp_depth):  # optional deeper router (moe.router_kwargs: mlp_depth, mlp_width)
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
                    h = torch.nn.functional.linear(h, m.weight.float(), m.bias.float()) if isinstance(m, nn.Linear) \
                        else m(h)
        logits = torch.nn.functional.linear(h, self.gate.weight.float(), self.gate.bias.float())
        return logits if self.temperature == 1.0 else logits / self.temperature

    def selection_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, N] what a greedy selection ranks: the logits (softmax is monotone)."""
        return logits

    def select(self, logits: torch.Tensor, explore: bool = False) -> torch.Tensor:
        """Chosen experts [T, k]: top-k of the selection scores."""
        return self.selection_scores(logits).topk(self.top_k, dim=-1).indices

    def top_k_margin(self, logits: torch.Tensor) -> torch.Tensor:
        """[T] gap between the k-th and the (k+1)-th selection score: how far the greedy choice is
        from flipping (inf when k = N). A near-uniform router flips at tiny margins."""
        if self.top_k >= self.num_experts:
            return torch.full(logits.shape[:1], float("inf"))
        top = self.selection_scores(logits).topk(self.top_k + 1, dim=-1).values
        return top[:, -2] - top[:, -1]

    def observe(self, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        """Statistics of one training forward for the next balance_step (none by default)."""

    def balance_step(self, all_reduce: Optional[AllReduce] = None) -> None:
        """Update balancing state once per optimizer step (every data-parallel learner alike)."""

    def forward(self, x: torch.Tensor, replay_indices: Optional[torch.Tensor] = None,
                task_ids: Optional[torch.Tensor] = None, explore: bool = False) -> RoutingRecord:
        logits = self.logits(x)
        training_step = self.training and torch.is_grad_enabled()   # not a no-grad measurement
        chosen = None
        if replay_indices is None and self._greedy_on_logits:
            # The plain top-k: its values are the chosen logits (one op fewer per layer and step).
            chosen, own = logits.topk(self.top_k, dim=-1)
        else:
            with torch.no_grad():
                own = self.select(logits, explore)
        if training_step:
            self.observe(logits.detach(), own)
        idx = own
        if replay_indices is not None:
            idx = replay_indices.to(device=x.device, dtype=torch.long)
            need(idx.shape == (x.shape[0], self.top_k), "replay_indices", f"shape {(x.shape[0], self.top_k)}",
                   tuple(idx.shape))
            idx = torch.where(idx >= self.num_experts, own, idx)   # OWN_CHOICE: not replayed
        return RoutingRecord(idx, gate_weights(logits, idx, self.normalize_gates, chosen), logits, router_top_k=own)

    @property
    def _greedy_on_logits(self) -> bool:
        """Whether `select` is the top-k of the raw logits (no bias, no sampling)."""
        cls = type(self)
        return cls.select is Router.select and cls.selection_scores is Router.selection_scores


class _SelectionBiasRouter(Router):
    """A per-expert `selection_bias` buffer shifts only the selection (synced with the weights)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.register_buffer("selection_bias", torch.zeros(self.num_experts))
        self._stats: Optional[torch.Tensor] = None   # accumulated since the last optimizer step

    def _accumulate(self, stats: torch.Tensor) -> None:
        self._stats = stats.double() if self._stats is None else self._stats + stats.double()

    def _take_stats(self, all_reduce: Optional[AllReduce]) -> Optional[torch.Tensor]:
        stats, self._stats = self._stats, None
        if all_reduce is not None:   # every learner must hold the same bias: sum the statistics
            stats = all_reduce(stats if stats is not None else torch.zeros(self._stats_size(), dtype=torch.float64))
        return stats

    def _stats_size(self) -> int:
        return self.num_experts


class BiasBalancedRouter(_SelectionBiasRouter):
    """Aux-loss-free balancing (DeepSeek-V3): select top-k of softmax(logits) + bias; at every
    optimizer step the bias moves by rate * sign(mean load - load) over the step's training tokens."""

    def __init__(self, *args, bias_update_rate: float = 1e-3, **kw):
        super().__init__(*args, **kw)
        self.bias_update_rate = bias_update_rate

    def selection_scores(self, logits):
        return logits.softmax(-1) + self.selection_bias

    def observe(self, logits, chosen):
        self._accumulate(torch.bincount(chosen.reshape(-1), minlength=self.num_experts))

    @torch.no_grad()
    def balance_step(self, all_reduce=None):
        load = self._take_stats(all_reduce)
        if load is not None and load.sum() > 0:
            self.selection_bias += (self.bias_update_rate * torch.sign(load.mean() - load)).to(self.selection_bias)


class SinkhornRouter(_SelectionBiasRouter):
    """Balanced routing from optimal transport, batch-independent at both ends: top-k of
    logits + bias. On a training batch, the Sinkhorn plan of the biased logits has column
    potentials v, and top-k of a plan row = top-k of (logits + bias + eps * v): eps * v is the
    shift that would still balance that batch. At every optimizer step the bias moves by
    `sinkhorn_bias_rate` times the mean of those shifts (an integral controller: it settles where
    the biased logits need no further shift)."""

    def __init__(self, *args, sinkhorn_epsilon: float = 0.1, sinkhorn_bias_rate: float = 0.1,
                 sinkhorn_iters: int = 200, **kw):
        super().__init__(*args, **kw)
        need(sinkhorn_epsilon > 0, "router_kwargs.sinkhorn_epsilon", "a number > 0", sinkhorn_epsilon)
        need(0 < sinkhorn_bias_rate <= 1, "router_kwargs.sinkhorn_bias_rate", "a number in (0, 1]",
             sinkhorn_bias_rate)
        self.epsilon, self.rate, self.iters = sinkhorn_epsilon, sinkhorn_bias_rate, sinkhorn_iters

    def selection_scores(self, logits):
        return logits + self.selection_bias

    def observe(self, logits, chosen):
        if logits.shape[0] < 2:
            return
        _, v, _ = sinkhorn_potentials(logits + self.selection_bias, self.top_k, self.epsilon, self.iters)
        shift = self.epsilon * (v - v.mean())
        self._accumulate(torch.cat([shift, torch.ones(1)]))   # [shift..., batches]

    def _stats_size(self) -> int:
        return self.num_experts + 1

    @torch.no_grad()
    def balance_step(self, all_reduce=None):
        stats = self._take_stats(all_reduce)
        if stats is not None and stats[-1] > 0:
            self.selection_bias.add_((self.rate * stats[:-1] / stats[-1]).to(self.selection_bias))


class TaskConditionedRouter(Router):
    """Routes on [x, task_embedding(task_id)] so different tasks can prefer different experts."""

    def __init__(self, d_model, num_experts, top_k, *, num_tasks: int, task_dim: int = 16, **kw):
        need(isinstance(num_tasks, int) and num_tasks >= 1, "router_kwargs.num_tasks", "an int >= 1", num_tasks)
        super().__init__(d_model, num_experts, top_k, input_dim=d_model + task_dim, **kw)
        self.task_embedding = nn.Embedding(num_tasks, task_dim)

    def forward(self, x, replay_indices=None, task_ids=None, explore=False):
        if task_ids is None:
            raise ValueError("task_ids: the task-conditioned router needs task ids ([T] int), got None")
        emb = self.task_embedding(task_ids.reshape(-1).long()).to(x.dtype)
        return super().forward(torch.cat([x, emb], dim=-1), replay_indices, explore=explore)


def plackett_luce_logp(logits: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """[T] log-probability of the ordered draws [T, k] of softmax(logits) without replacement:
    sum_j log p_{i_j} - log(1 - sum_{l<j} p_{i_l}). (Sum of log p_i alone is not the probability of
    what multinomial(replacement=False) drew, and biases the router gradient for k >= 2.)"""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, draws)
    taken_before = chosen.exp().cumsum(-1) - chosen.exp()
    return (chosen - torch.log1p(-taken_before.clamp(max=1 - 1e-7))).sum(-1)


class ReinforceRouter(Router):
    """Policy-gradient routing. Exploring rollouts *sample* k experts from the router
    distribution (without replacement); the learner replays those draws (routing replay is on
    for this router by default) and adds -(advantage - baseline) * log p(draw) with a learned
    baseline (moe_rl.core.losses.reinforce_router_loss). Evaluation routes greedily."""

    samples_when_exploring = True

    def __init__(self, d_model, num_experts, top_k, **kw):
        super().__init__(d_model, num_experts, top_k, **kw)
        self.baseline = nn.Linear(d_model, 1)

    def select(self, logits, explore=False):
        if not explore:
            return super().select(logits)
        return torch.multinomial(logits.softmax(-1), self.top_k, replacement=False)

    def forward(self, x, replay_indices=None, task_ids=None, explore=False):
        rec = super().forward(x, replay_indices, explore=explore)
        rec.selection_logp = plackett_luce_logp(rec.router_logits, rec.top_k_indices)
        rec.baseline = self.baseline(x.float()).squeeze(-1)
        return rec


ROUTER_CLASSES = {"topk": Router, "sinkhorn": SinkhornRouter, "bias": BiasBalancedRouter,
                  "task": TaskConditionedRouter, "reinforce": ReinforceRouter}
_SET_BY_LAYER = {"self", "args", "kw", "kwargs", "d_model", "num_experts", "top_k", "temperature", "init",
                 "init_std", "normalize_gates", "input_dim"}


def router_options(kind: str) -> Dict[str, object]:
    """The `router_kwargs` a router accepts (name -> default), from the constructors themselves."""
    out: Dict[str, object] = {}
    for cls in reversed(ROUTER_CLASSES[kind].__mro__):
        if "__init__" in vars(cls) and issubclass(cls, Router):
            for name, p in inspect.signature(vars(cls)["__init__"]).parameters.items():
                if name not in _SET_BY_LAYER:
                    out[name] = None if p.default is inspect.Parameter.empty else p.default
    return out


def build_router(kind: str, d_model: int, num_experts: int, top_k: int, **kw) -> Router:
    need(kind in ROUTERS, "router", f"one of {ROUTERS}", kind)
    return ROUTER_CLASSES[kind](d_model, num_experts, top_k, **kw)


def balancing_routers(module: nn.Module) -> List[Router]:
    """The routers of `module` that keep balancing state (a plain Router's balance_step does nothing)."""
    return [m for m in trained_modules(module)
            if isinstance(m, Router) and type(m).balance_step is not Router.balance_step]


def balance_step(module: nn.Module, all_reduce: Optional[AllReduce] = None) -> None:
    """Apply every router's pending balancing update (call once per applied optimizer step)."""
    for m in balancing_routers(module):
        m.balance_step(all_reduce)

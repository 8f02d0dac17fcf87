"""The stability toolkit (pure torch: no Ray, no DeepSpeed).

One optimizer step of a learner, with the toolkit on:

    grads -> collective finiteness check (skip the step on every learner together)
          -> winsorize each tensor at quantile p -> project onto a low-rank subspace
          -> per-group norms (global over expert shards) -> per-group clipping
          -> router-only warm-up mask -> per-group LR -> optimizer.step()

Parameter groups are found by module path (tensors have no `.name`): router, shared_expert,
experts, policy_head, value_head, other (`moe_rl.core.param_groups`).

The learners (moe_rl.rllib.learner, actors.learner) own the optimizer and the collectives; this module
owns the math, so it is tested without Ray, and both learners behave identically.
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from moe_rl.core.gradients import Lamb, orthonormal_basis, project_, winsorize_
from moe_rl.core.lr_schedules import GroupLR, positive_int, validate_schedule
from moe_rl.core.param_groups import PARAM_GROUPS
from moe_rl.core.sections import DEFAULT_CLIP_FACTORS, StabilitySettings, defaults
from moe_rl.core.settings import _is_int, _is_num, _need

OPTIMIZERS = ("adam", "adamw", "lamb")

# Per-group clip factors (x grad_clip): routers are the most fragile part of an MoE, the experts'
# stacked tensors the largest (docs/stability.md, the toolkit table).

STABILITY_DEFAULTS: Dict[str, Any] = defaults(StabilitySettings)   # moe_rl.core.sections


# --- settings ---------------------------------------------------------------------------------------
def validate_stability(d: Mapping[str, Any]) -> StabilitySettings:
    """Defaults merged in and every `stability.*` field checked; returns the full settings, typed
    (a typed one was checked when it was made)."""
    if isinstance(d, StabilitySettings):
        return d
    unknown = sorted(set(d) - set(STABILITY_DEFAULTS))
    _need(not unknown, f"stability.{unknown[0] if unknown else ''}", f"one of {sorted(STABILITY_DEFAULTS)}",
          unknown[0] if unknown else None)
    s = {**copy.deepcopy(STABILITY_DEFAULTS), **copy.deepcopy(d)}
    _need(isinstance(s["lr_schedules"], dict), "stability.lr_schedules", "a mapping group -> schedule",
          s["lr_schedules"])
    for g, spec in list(s["lr_schedules"].items()):
        _need(g in PARAM_GROUPS + ("default",), "stability.lr_schedules", f"keys from {PARAM_GROUPS} or 'default'", g)
        s["lr_schedules"][g] = validate_schedule(g, spec)
    _need(s["grad_clip"] is None or (_is_num(s["grad_clip"]) and s["grad_clip"] > 0), "stability.grad_clip",
          "null (off) or a number > 0", s["grad_clip"])
    factors = s["grad_clip_factors"]
    _need(isinstance(factors, dict) and set(factors) <= set(PARAM_GROUPS), "stability.grad_clip_factors",
          f"a mapping with keys from {PARAM_GROUPS}", factors)
    s["grad_clip_factors"] = {**DEFAULT_CLIP_FACTORS, **factors}
    for g, v in s["grad_clip_factors"].items():
        _need(_is_num(v) and v > 0, f"stability.grad_clip_factors.{g}", "a number > 0", v)
    for f in ("skip_nonfinite", "anomaly_detection"):
        _need(isinstance(s[f], bool), f"stability.{f}", "true or false", s[f])
    p = s["winsorize_p"]
    _need(p is None or (_is_num(p) and 0 < p < 0.5), "stability.winsorize_p", "null or a number in (0, 0.5)", p)
    r = s["projection_rank"]
    _need(r is None or positive_int(r), "stability.projection_rank", "null or an int >= 1", r)
    pg = s["projection_groups"]
    _need(isinstance(pg, (list, tuple)) and all(g in PARAM_GROUPS for g in pg), "stability.projection_groups",
          f"a list from {PARAM_GROUPS}", pg)
    for f in ("projection_refresh", "router_warmup_steps"):
        _need(_is_int(s[f]) and s[f] >= 0, f"stability.{f}", "an int >= 0", s[f])
    ed = s["expert_dropout_schedule"]
    if ed is not None:
        _need(isinstance(ed, dict) and set(ed) == {"start", "end", "steps"}, "stability.expert_dropout_schedule",
              "null or {start, end, steps}", ed)
        for k in ("start", "end"):
            _need(_is_num(ed[k]) and 0 <= ed[k] < 1, f"stability.expert_dropout_schedule.{k}",
                  "a number in [0, 1)", ed[k])
        _need(positive_int(ed["steps"]), "stability.expert_dropout_schedule.steps", "an int >= 1", ed["steps"])
    _need(s["optimizer"] in OPTIMIZERS, "stability.optimizer", f"one of {OPTIMIZERS}", s["optimizer"])
    _need(_is_num(s["weight_decay"]) and s["weight_decay"] >= 0, "stability.weight_decay", "a number >= 0",
          s["weight_decay"])
    b = s["betas"]
    _need(isinstance(b, (list, tuple)) and len(b) == 2 and all(_is_num(x) and 0 <= x < 1 for x in b),
          "stability.betas", "[beta1, beta2] in [0, 1)", b)
    _need(_is_num(s["lamb_clamp"]) and s["lamb_clamp"] > 0, "stability.lamb_clamp", "a number > 0", s["lamb_clamp"])
    for f in ("anomaly_window", "anomaly_min_history"):
        _need(_is_int(s[f]) and s[f] >= 2, f"stability.{f}", "an int >= 2", s[f])
    _need(_is_int(s["health_warmup"]) and s["health_warmup"] >= 0, "stability.health_warmup", "an int >= 0",
          s["health_warmup"])
    for f in ("anomaly_z", "rss_growth_mb"):
        _need(_is_num(s[f]) and s[f] > 0, f"stability.{f}", "a number > 0", s[f])
    _need(_is_num(s["flip_rate_max"]) and 0 < s["flip_rate_max"] <= 1, "stability.flip_rate_max",
          "a number in (0, 1]", s["flip_rate_max"])
    for f in ("entropy_band", "grad_norm_band"):
        v = s[f]
        _need(isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_num(x) for x in v) and 0 <= v[0] < v[1],
              f"stability.{f}", "[low, high] with 0 <= low < high", v)
    return StabilitySettings(**s)


def expert_dropout_at(spec: Optional[Dict[str, Any]], step: int) -> Optional[float]:
    if spec is None:
        return None
    frac = min(step, spec["steps"]) / spec["steps"]
    return spec["start"] + (spec["end"] - spec["start"]) * frac


def set_expert_dropout(module: torch.nn.Module, p: float) -> int:
    """Set the expert-dropout rate of every MoE layer (core MoELayer or the DeepSpeed gate)."""
    n = 0
    for m in module.modules():
        if isinstance(getattr(m, "expert_dropout", None), float):
            m.expert_dropout = float(p)
            n += 1
    return n


@contextlib.contextmanager
def expert_dropout_off(module: torch.nn.Module):
    """No expert dropout inside the block (a measurement of what the trainer computes must not
    depend on the dropout draw), the rates restored after it."""
    layers = [m for m in module.modules() if isinstance(getattr(m, "expert_dropout", None), float)]
    saved = [m.expert_dropout for m in layers]
    for m in layers:
        m.expert_dropout = 0.0
    try:
        yield
    finally:
        for m, p in zip(layers, saved):
            m.expert_dropout = p


# --- the toolkit --------------------------------------------------------------------------------------
Collective = Callable[[torch.Tensor], torch.Tensor]   # in-place SUM over every learner; returns it


class StabilityToolkit:
    """Per-module gradient pipeline and per-group optimizer setup.

    named_params: (name, parameter) of the module (this learner's shard under expert parallelism).
    group_of: name -> parameter group, as the module declares it (moe_rl.core.param_groups.param_roles);
    an "experts" tensor is a shard under expert parallelism (its norm is summed over the shards).
    all_reduce_sum / world_size / ep_size: the learners' collective; None for a single learner.
    """

    def __init__(self, settings: StabilitySettings, named_params: Iterable[Tuple[str, torch.nn.Parameter]],
                 group_of: Mapping[str, str], all_reduce_sum: Optional[Collective] = None, world_size: int = 1,
                 ep_size: int = 1):
        self.s = settings
        self.named = [(n, p) for n, p in named_params if p.requires_grad]
        self.group_of = {n: group_of.get(n, "other") for n, _ in self.named}
        self.expert = {n: self.group_of[n] == "experts" for n, _ in self.named}
        self.groups = [g for g in PARAM_GROUPS if g in self.group_of.values()]
        # Each tensor's slot in the collective vector (see _process), fixed for the toolkit's life.
        self._slots = torch.tensor([1 + 2 * self.groups.index(self.group_of[n]) + int(self.expert[n])
                                    for n, _ in self.named], dtype=torch.long)
        self.all_reduce_sum, self.world, self.ep = all_reduce_sum, world_size, ep_size
        self.step_count = 0       # applied optimizer steps: what every schedule counts
        # One GroupLR per lr_schedules key; each group follows its own key's, else "default"'s, else
        # none (training.lr: RLlib's lr, passed in as base_lr).
        schedules = settings.lr_schedules
        self._schedules = {key: GroupLR(spec) for key, spec in schedules.items()}
        self._schedule_of = {g: g if g in schedules else "default" for g in self.groups
                             if g in schedules or "default" in schedules}
        self.skipped = 0          # lifetime skipped (non-finite) steps
        self.last_stats: Dict[str, float] = {}   # the latest step's figures (the learner logs them)
        self._bases: Dict[str, torch.Tensor] = {}

    # optimizer --------------------------------------------------------------------------------------
    def param_groups(self, base_lr: float) -> List[Dict[str, Any]]:
        """One optimizer param group per stability group, tagged with `moe_rl_group`."""
        out = []
        for g in self.groups:
            params = [p for n, p in self.named if self.group_of[n] == g]
            out.append({"params": params, "name": g, "moe_rl_group": g, "lr": self.lr_of(g, base_lr)})
        return out

    def make_optimizer(self, param_groups: List[Dict[str, Any]], base_lr: float) -> torch.optim.Optimizer:
        s = self.s
        if s.optimizer == "lamb":
            return Lamb(param_groups, lr=base_lr, betas=s.betas, weight_decay=s.weight_decay,
                        clamp=s.lamb_clamp)
        cls = torch.optim.AdamW if s.optimizer == "adamw" else torch.optim.Adam
        # Fused: one kernel per tensor instead of a foreach pass per param group (5 groups here):
        # 0.18 vs 0.51 ms per step for the quickstart's parameters on CPU.
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                    for g in param_groups for p in g["params"])
        return cls(param_groups, lr=base_lr, betas=tuple(s.betas), weight_decay=s.weight_decay,
                   **({"fused": True} if fused else {"foreach": True}))

    def lr_of(self, group: str, base_lr: float) -> float:
        """The group's LR for the next applied step: its schedule's, else base_lr (RLlib's lr)."""
        key = self._schedule_of.get(group)
        return base_lr if key is None else self._schedules[key].lr

    def set_lrs(self, optimizer: torch.optim.Optimizer, base_lr: float, scale: float = 1.0) -> Dict[str, float]:
        """Every tagged param group's LR for the next applied step, times `scale` (the sync gate's
        slower retry after a rollback scales every group)."""
        lrs = {g: self.lr_of(g, base_lr) * scale for g in self.groups}
        for pg in optimizer.param_groups:
            g = pg.get("moe_rl_group")
            if g is not None:
                pg["lr"] = lrs[g]
        return lrs

    # gradients --------------------------------------------------------------------------------------
    def process(self, base_lr: float, optimizer: torch.optim.Optimizer, scale: float = 1.0) -> bool:
        """Run the pipeline on the parameters' .grad in place; True: apply the step (the optimizer's
        groups then hold their LRs: set_lrs). Its figures update `last_stats`. Collective: every
        learner calls it once per step, in the same order."""
        apply, stats = self._process(base_lr, optimizer, scale)
        self.last_stats.update(stats)
        return apply

    def _process(self, base_lr: float, optimizer: torch.optim.Optimizer,
                 scale: float) -> Tuple[bool, Dict[str, float]]:
        s = self.s
        present = [i for i, (_, p) in enumerate(self.named) if p.grad is not None]
        grads = [(self.named[i][0], self.named[i][1].grad) for i in present]
        # One collective carries the non-finite flag and every group's squared norm, the latter
        # split into replicated tensors (slot 2i+1) and expert shards (slot 2i+2).
        vec = torch.zeros(1 + 2 * len(self.groups), dtype=torch.float64)
        if grads:
            sq = torch.stack(torch._foreach_norm([g for _, g in grads])).double().pow(2)
            finite = bool(torch.isfinite(sq).all())
            if finite and (s.winsorize_p is not None or s.projection_rank is not None):
                if s.winsorize_p is not None:
                    for _, g in grads:
                        winsorize_(g, s.winsorize_p)
                if s.projection_rank is not None:
                    self._project(grads)
                sq = torch.stack(torch._foreach_norm([g for _, g in grads])).double().pow(2)
            slots = self._slots if len(present) == len(self.named) else self._slots[present]
            vec.index_add_(0, slots, torch.nan_to_num(sq, nan=0.0, posinf=0.0))
            vec[0] = float(s.skip_nonfinite and not finite)
        if self.all_reduce_sum is not None and self.world > 1:
            self.all_reduce_sum(vec)
            # Replicated tensors were summed world times; each expert shard world/ep times.
            vec[1::2] /= self.world
            vec[2::2] /= self.world / self.ep
        stats: Dict[str, float] = {}
        values = vec.tolist()     # one conversion, not one .item() per group
        sq = {g: values[1 + 2 * i] + values[2 + 2 * i] for i, g in enumerate(self.groups)}
        if values[0] > 0:         # some learner saw a non-finite gradient: nobody steps
            self.skipped += 1
            for _, p in self.named:
                p.grad = None
            stats["stability/skipped_steps"] = float(self.skipped)
            return False, stats
        stats.update({f"stability/grad_norm/{g}": math.sqrt(v) for g, v in sq.items()})
        stats["stability/grad_norm/total"] = math.sqrt(sum(sq.values()))
        if s.grad_clip is not None:
            self._clip(sq, stats)
        if self.step_count < s.router_warmup_steps:
            for n, p in self.named:   # grad None: Adam/LAMB skip the tensor, moments included
                if self.group_of[n] != "router":
                    p.grad = None
        stats.update({f"stability/lr/{g}": lr for g, lr in self.set_lrs(optimizer, base_lr, scale).items()})
        stats["stability/skipped_steps"] = float(self.skipped)
        stats["stability/router_warmup"] = float(self.step_count < s.router_warmup_steps)
        self.step_count += 1
        for schedule in self._schedules.values():
            schedule.step()
        return True, stats

    def _clip(self, sq: Dict[str, float], stats: Dict[str, float]) -> None:
        base, factors = self.s.grad_clip, self.s.grad_clip_factors
        coef = {}
        for g, v in sq.items():
            limit, norm = base * factors[g], math.sqrt(v)
            coef[g] = min(1.0, limit / (norm + 1e-6))
            stats[f"stability/clip_coef/{g}"] = coef[g]
        for n, p in self.named:
            c = coef[self.group_of[n]]
            if p.grad is not None and c < 1.0:
                p.grad.mul_(c)

    def _project(self, grads: Sequence[Tuple[str, torch.Tensor]]) -> None:
        r, refresh = self.s.projection_rank, self.s.projection_refresh
        renew = refresh > 0 and self.step_count % refresh == 0
        for n, g in grads:
            if self.group_of[n] not in self.s.projection_groups or g.dim() not in (2, 3) or g.shape[-1] <= r:
                continue
            if n not in self._bases or renew:
                self._bases[n] = orthonormal_basis(g, r)
            project_(g, self._bases[n])

    # state --------------------------------------------------------------------------------------------
    def get_state(self) -> Dict[str, Any]:
        return {"step_count": self.step_count, "skipped": self.skipped,
                "bases": {n: b.clone() for n, b in self._bases.items()}}

    def set_state(self, state: Dict[str, Any]) -> None:
        self.step_count, self.skipped = int(state["step_count"]), int(state["skipped"])
        for schedule in self._schedules.values():
            schedule.seek(self.step_count)
        self._bases = {n: torch.as_tensor(b) for n, b in state.get("bases", {}).items()}

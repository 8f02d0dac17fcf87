"""Fault injection: the documented test hooks of the sync gate (tests/test_gate.py and
bench/bench_gate.py inject each fault the gate must catch).

    inject(algo, CorruptRolloutCopy(runner=1))   one tensor of a rollout actor's copy, right away
    inject(algo, NonFiniteCandidate())           a NaN in a learner's weights after the next update
    inject(algo, HarmfulUpdate(factor=1000))     the next update's first optimizer step at LR x factor
    inject(algo, PerturbReplica(rank=1))         one dense tensor of learner `rank` perturbed after the
                                                 next update (a gradient all-reduce gone wrong)
    inject(algo, DeadExpert(expert=0))           expert 0's router logit forced to -inf in every layer,
                                                 on the learners and the rollout actors, from now on
                                                 (the health grade must read danger: tests/test_health.py)

A genuine training-inference mismatch needs no hook: `moe.inference_dtype: bf16` with
`moe.trainer_capacity_factor` set is one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_rl.core.routers import Router
from moe_rl.rllib.learner_group import learner_index
from moe_rl.rllib.runner import runner_modules


def inject(algo, fault) -> None:
    """Apply `fault` now (stage "now") or at its point of the next iteration."""
    if fault.stage == "now":
        fault.apply(algo)
    else:
        algo._pending_faults.append(fault)


def _first_expert_weight(state) -> str:
    return next(k for k in state if k.endswith(".experts.w1"))


def _router_weight(state) -> str:
    return next(k for k in state if ".router." in k and k.endswith("gate.weight"))


@dataclass
class CorruptRolloutCopy:
    """Add `delta` to one tensor of rollout actor `runner` (default: expert 0's first weight matrix,
    i.e. `...experts.experts.0.fc1.weight` in the canonical per-expert form)."""
    runner: Optional[int] = None
    module_id: str = "default_policy"
    name: Optional[str] = None
    delta: float = 0.5
    stage: str = "now"

    def apply(self, algo) -> None:
        def corrupt(r):
            module = runner_modules(r)[self.module_id]
            state = module.state_dict()
            with torch.no_grad():
                target = state[self.name or _first_expert_weight(state)]
                (target if self.name else target[0]).add_(self.delta)
        ids = None if self.runner is None else [self.runner]
        algo.runner_call(corrupt, runner_ids=ids if algo.env_runner_group.num_remote_env_runners() else None)


class _BoostOneStep:
    """A learner gradient hook: the first optimizer step after it is installed runs at LR x factor."""

    def __init__(self, factor: float):
        self.factor, self.calls, self.saved = factor, 0, 1.0

    def __call__(self, learner, module_id) -> None:
        self.calls += 1
        if self.calls == 1:
            self.saved = learner.lr_scale
            learner.lr_scale = self.saved * self.factor
        else:
            learner.lr_scale = self.saved
            learner.grad_hooks.remove(self)


@dataclass
class HarmfulUpdate:
    factor: float = 1000.0
    stage: str = "before_update"

    def apply(self, algo) -> None:
        factor = self.factor
        algo.learner_group.foreach(lambda l: l.grad_hooks.append(_BoostOneStep(factor)))


@dataclass
class NonFiniteCandidate:
    """A NaN in the router weight of the first learner's module."""
    module_id: str = "default_policy"
    stage: str = "after_update"

    def apply(self, algo) -> None:
        mid = self.module_id

        def poison(learner):
            if learner_index(learner, 1 << 30) == 0:
                state = learner.plain_module(mid).state_dict()
                with torch.no_grad():
                    state[_router_weight(state)].view(-1)[0] = float("nan")
        algo.learner_group.foreach(poison)


@dataclass
class PerturbReplica:
    """Add `delta` to the router weight held by learner `rank` only."""
    rank: int = 1
    module_id: str = "default_policy"
    delta: float = 0.01
    stage: str = "after_update"

    def apply(self, algo) -> None:
        rank, mid, delta = self.rank, self.module_id, self.delta

        def perturb(learner):
            if learner_index(learner, 1 << 30) == rank:
                state = learner.plain_module(mid).state_dict()
                with torch.no_grad():
                    state[_router_weight(state)].add_(delta)
        algo.learner_group.foreach(perturb)


class _MaskedLogits:
    """Replaces one router's `logits` method: the wrapped logits with the dead experts' column at
    -inf, so top-k never selects them and the softmax gives them probability 0 (and gradient 0).
    An instance attribute, not a weight: the sync gate's finiteness check and the weight sync see
    ordinary weights, and loading new weights keeps the fault."""

    def __init__(self, logits, experts):
        self.inner, self.experts = logits, torch.tensor(list(experts), dtype=torch.long)

    def __call__(self, x):
        out = self.inner(x)
        return out.index_fill(-1, self.experts.to(out.device), float("-inf"))


def _kill_experts(module, experts, layers) -> int:
    routers = [m for m in module.modules() if isinstance(m, Router)]
    for i, router in enumerate(routers):
        if layers is None or i in layers:
            if not isinstance(router.logits, _MaskedLogits):
                router.logits = _MaskedLogits(router.logits, experts)
    return len(routers)


@dataclass
class DeadExpert:
    """Expert `expert` never selected from now on: its router logit is -inf in the MoE layers
    `layers` (None: all) of module `module_id`, on every learner and rollout actor."""
    expert: int = 0
    layers: Optional[tuple] = None
    module_id: str = "default_policy"
    stage: str = "now"

    def apply(self, algo) -> None:
        experts, layers, mid = (self.expert,), self.layers, self.module_id
        algo.learner_group.foreach(lambda l: _kill_experts(l.plain_module(mid), experts, layers))
        algo.runner_call(lambda r: _kill_experts(runner_modules(r)[mid], experts, layers))

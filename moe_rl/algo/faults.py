"""Fault injection: the documented test hooks of the sync gate (tests/test_gate.py and
bench/bench_gate.py inject each fault the gate must catch).

    inject(algo, CorruptRolloutCopy(runner=1))   one tensor of a rollout actor's copy, right away
    inject(algo, NonFiniteCandidate())           a NaN in a learner's weights after the next update
    inject(algo, HarmfulUpdate(factor=1000))     the next update's first optimizer step at LR x factor
    inject(algo, PerturbReplica(rank=1))         one dense tensor of learner `rank` perturbed after the
                                                 next update (a gradient all-reduce gone wrong)

A genuine training-inference mismatch needs no hook: `moe.inference_dtype: bf16` with
`moe.trainer_capacity_factor` set is one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

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

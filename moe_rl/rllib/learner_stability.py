"""The stability toolkit on an RLlib TorchLearner: one toolkit per registered optimizer (per-group
LRs and clipping, the non-finite skip, winsorizing, projections, router warm-up: moe_rl.core.
stability), gradient application through it, and the routers' balancing steps after it.

Learning rates, one system per parameter group: a group that `stability.lr_schedules` names (or
covers with "default") follows that schedule alone (torch's schedulers, counted in applied
optimizer steps); every other group follows RLlib's `lr`, a number or RLlib's own schedule over
sampled env steps (RLlib's Scheduler, updated once per update). The sync gate's rollback retry
scales every group (lr_scale). docs/stability.md, "Learning rates".

Nothing here assumes one optimizer or one loss: toolkits are kept per (module, optimizer name), as
RLlib registers them (SAC registers several per module). A learner that reduces gradients itself
(the DeepSpeed expert-parallel one) says how through `collectives()` and steps through
`optimizer_step()`; everything else is this one copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from moe_rl.core.errors import ConfigError
from moe_rl.core.param_groups import is_target, param_roles
from moe_rl.core.routers import balancing_routers
from moe_rl.core.stability import StabilityToolkit, expert_dropout_at, set_expert_dropout, validate_stability
from moe_rl.rllib import ray_private

ToolkitKey = Tuple[str, str]   # (module id, optimizer name)


@dataclass(frozen=True)
class Collectives:
    """How a learner's gradient figures are summed over the learners: none for one learner (or
    RLlib's data-parallel replicas, whose gradients DDP has already averaged)."""

    all_reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    world_size: int = 1
    ep_size: int = 1


class StabilityPart:
    """Mixed into an MoE learner (moe_rl.rllib.moe_learner.MoELearner)."""

    lr_scale = 1.0   # < 1 for the retry after a sync-gate rollback (set by the gate)

    def collectives(self) -> Collectives:
        return Collectives()

    def make_toolkit(self, module_id: str, params) -> StabilityToolkit:
        c = self.collectives()
        return StabilityToolkit(validate_stability(self.config.stability_settings),
                                [(n, p) for n, p in params if not is_target(n)], param_roles(self.module[module_id]),
                                all_reduce_sum=c.all_reduce_sum, world_size=c.world_size, ep_size=c.ep_size)

    def optimizer_param_groups(self, toolkit: StabilityToolkit, base_lr: float):
        return toolkit.param_groups(base_lr)

    def build_optimizer(self, module_id, toolkit, param_groups, base_lr):
        return toolkit.make_optimizer(param_groups, base_lr)

    def optimizer_step(self, module_id: str, optimizer) -> None:
        optimizer.step()

    def configure_optimizers_for_module(self, module_id, config=None):
        """One param group per stability group (router, experts, ...: own LR schedule and clip),
        Adam/AdamW with the multi-tensor (foreach) kernels — an MoE module has many small
        per-expert tensors, and the per-tensor loop PyTorch picks on CPU dominates the step — or
        LAMB. RLlib's `lr` is registered with the optimizer as RLlib does it (its Scheduler); the
        toolkit then gives each group its own LR (set_lrs)."""
        if ray_private.learner_lr_scheduler_classes(self):
            raise ConfigError("experimental._torch_lr_scheduler_classes: not supported; per-group LRs come "
                              "from stability.lr_schedules, the others from training.lr (docs/stability.md)")
        module = self.module[module_id]
        self.register_moe_optimizer(module_id, ray_private.DEFAULT_OPTIMIZER, module.named_parameters(), config.lr)

    def register_moe_optimizer(self, module_id: str, name: str, named_params, lr_or_schedule) -> None:
        """A toolkit and its optimizer over `named_params`, registered with RLlib under `name` (a
        family with several optimizers per module calls this once for each)."""
        named = list(named_params)
        toolkit = self.make_toolkit(module_id, named)
        self._toolkits[(module_id, name)] = toolkit
        base_lr = lr_or_schedule if isinstance(lr_or_schedule, (int, float)) else 1e-3   # replaced below
        optimizer = self.build_optimizer(module_id, toolkit, self.optimizer_param_groups(toolkit, base_lr), base_lr)
        self.register_optimizer(module_id=module_id, optimizer_name=name, optimizer=optimizer,
                                params=[p for _, p in named], lr_or_lr_schedule=lr_or_schedule)
        toolkit.set_lrs(optimizer, self.rllib_lr(optimizer), self.lr_scale)   # RLlib set every group alike
        self._set_expert_dropout(module_id)

    @property
    def _toolkits(self) -> Dict[ToolkitKey, StabilityToolkit]:
        if "_moe_toolkits" not in self.__dict__:
            self.__dict__["_moe_toolkits"] = {}
        return self.__dict__["_moe_toolkits"]

    def toolkits(self, module_id: Optional[str] = None) -> List[Tuple[ToolkitKey, StabilityToolkit]]:
        return [(k, t) for k, t in self._toolkits.items() if module_id is None or k[0] == module_id]

    def rllib_lr(self, optimizer) -> float:
        """RLlib's `lr` now: its Scheduler's current value (a fixed lr or RLlib's schedule). It drives
        the groups stability.lr_schedules leaves to it."""
        schedule = ray_private.learner_lr_schedule(self, optimizer)
        return float(schedule.get_current_value() if schedule is not None else self.config.lr)

    def _set_expert_dropout(self, module_id) -> None:
        for _, toolkit in self.toolkits(module_id)[:1]:   # the module's first optimizer counts its steps
            p = expert_dropout_at(toolkit.s.expert_dropout_schedule, toolkit.step_count)
            if p is not None:
                set_expert_dropout(self.module[module_id], p)
                toolkit.last_stats["stability/expert_dropout"] = p

    def step_allowed(self, module_id: str) -> bool:
        """Whether this minibatch's step may be taken at all (PPO's rollout correction says no when
        it kept no step). Collective under the DeepSpeed learner group."""
        return True

    def stability_step(self, module_id: str, name: str, optimizer) -> bool:
        """Run the gradient hooks and the toolkit on this optimizer's .grad; True: take the step.
        Its figures are logged once per update. Collective under the DeepSpeed learner group:
        every learner calls it once per step."""
        if not self.step_allowed(module_id):
            for p in self.module[module_id].parameters():   # no step: neither the aux losses alone
                p.grad = None                                # nor Adam's momentum move a weight
            return False
        for hook in self.grad_hooks:
            hook(self, module_id)
        return self._toolkits[(module_id, name)].process(self.rllib_lr(optimizer), optimizer, scale=self.lr_scale)

    def apply_gradients(self, gradients_dict) -> None:
        """Each optimizer's gradients through its toolkit, then its step (RLlib's TorchLearner sets
        every gradient and steps every optimizer; here the toolkit decides and shapes each step)."""
        for module_id in self.module.keys():
            for name, optimizer in self.get_optimizers_for_module(module_id):
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        grad = gradients_dict.get(self.get_param_ref(p))
                        if grad is not None and p.grad is not grad:
                            p.grad = grad
                if self.stability_step(module_id, name, optimizer):
                    self.optimizer_step(module_id, optimizer)
                    self.after_step(module_id)

    def after_step(self, module_id) -> None:
        """After an applied optimizer step: the routers' balancing state, then the dropout schedule."""
        cached = self._balancing.get(module_id)
        module = self.module[module_id]
        if cached is None or cached[0] is not module:   # not a walk over the module tree at every step
            cached = self._balancing[module_id] = (module, balancing_routers(module))
        for router in cached[1]:
            router.balance_step(self.collectives().all_reduce_sum)
        self.after_balance_step(module_id)
        self._set_expert_dropout(module_id)

    def after_balance_step(self, module_id) -> None:
        """The adaptive balance coefficient's step (moe_rl.rllib.moe_learner)."""

    def reset_group_lrs(self) -> Dict[str, Dict[str, float]]:
        """After RLlib moved its lr schedule on and set it on every param group: each group's own
        LR back, for the next step. Returns each module's toolkit figures of the update."""
        stats: Dict[str, Dict[str, float]] = {}
        for (module_id, name), toolkit in self._toolkits.items():
            toolkit.set_lrs(self.get_optimizer(module_id, name), self.rllib_lr(self.get_optimizer(module_id, name)),
                            self.lr_scale)
            stats.setdefault(module_id, {}).update(toolkit.last_stats)
        return stats

    def toolkit_state(self) -> Dict[str, Dict]:
        return {f"{mid}|{name}": tk.get_state() for (mid, name), tk in self._toolkits.items()}

    def set_toolkit_state(self, state: Dict[str, Dict]) -> None:
        for key, tk_state in state.items():
            # a checkpoint from before optimizers were named here keys its toolkits by module id alone
            mid, name = key.split("|", 1) if "|" in key else (key, ray_private.DEFAULT_OPTIMIZER)
            self._toolkits[(mid, name)].set_state(tk_state)
            self._set_expert_dropout(mid)

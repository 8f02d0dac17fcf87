"""MoELearner: what an MoE policy adds to any RLlib TorchLearner, as parts it composes:

    StabilityPart    (moe_rl.rllib.learner_stability) the stability toolkit per optimizer, gradient
                     application through it, the routers' balancing steps
    WeightPublisher  (moe_rl.rllib.weight_publishing) the weights as the rest of the system sees
                     them: under global names, per module, digested and sized where they live
    here             the router losses, health and plasticity metrics, the gate's kept state and
                     the trainer's view of rollout data

An algorithm's learner is this mixin before RLlib's own (moe_rl.rllib.learner: PPO,
appo_learner: APPO, dqn_learner: DQN); the DeepSpeed learner (actors/learner.py) goes before that
and overrides only how gradients are reduced and stepped (`collectives`, `optimizer_step`,
`build_optimizer`) and what its state is made of (`kept_parts`):

    class MoEPPOTorchLearner(MoELearner, PPOTorchLearner): ...
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch
import tree
from ray.rllib.core import COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from moe_rl.core.balance import AdaptiveBalance
from moe_rl.core.health import HealthWatch
from moe_rl.core.losses import moe_aux_losses, reinforce_router_loss, replay_anchor_loss
from moe_rl.core.metrics import health_summary
from moe_rl.core.state_copy import keep_state, restore_state
from moe_rl.rllib import ray_private
from moe_rl.rllib.learner_stability import StabilityPart
from moe_rl.rllib.replay import MismatchedReplay
from moe_rl.rllib.rl_module import MOE_ROUTING, MoEPolicyModule, module_dormancy
from moe_rl.rllib.weight_publishing import WeightPublisher

STABILITY_STATE = "moe_rl_stability"
KL_COEFFS = "moe_rl_kl_coeffs"
LR_SCALE = "moe_rl_lr_scale"
BALANCE_STATE = "moe_rl_balance"
OWN_STATE = (STABILITY_STATE, KL_COEFFS, LR_SCALE, BALANCE_STATE)


class MoELearner(StabilityPart, WeightPublisher):
    """Mixed in before an RLlib TorchLearner."""

    # The health grade and the dormant probe judge at least this many rows' routing since the last
    # grade. 0: every update, for PPO and APPO, whose updates are whole train batches; a learner of
    # small updates (DQN's 32 replayed transitions) sets more, so that a healthy expert idle by
    # chance in one small draw never reads as dead.
    health_min_rows = 0

    def build(self) -> None:
        self._last_routing: Dict[str, list] = {}
        self._last_obs: Dict[str, Any] = {}
        self._update_load: Dict[str, List[torch.Tensor]] = {}   # per layer, the update's expert load
        self._balance: Dict[str, AdaptiveBalance] = {}   # modules with moe.balance: adaptive
        self._health: Dict[str, HealthWatch] = {}   # per module: the grade's streaks over updates
        self._balancing: Dict[str, tuple] = {}   # module_id -> (module, its routers with balancing state)
        self._loss_stats: Dict[str, Dict[str, Any]] = {}   # the last minibatch's router-loss figures
        self._graded_rows: Dict[str, int] = {}   # rows the load to grade holds (health_min_rows)
        # fn(learner, module_id), run on the parameters' .grad before the stability toolkit:
        # custom gradient surgery, or fault injection in tests.
        self.grad_hooks: List[Callable] = []
        super().build()
        if any(isinstance(m, MoEPolicyModule) and m.replay_mode == "mismatched"
               for m in map(self.plain_module, self.module.keys())):
            ray_private.append_learner_connector(self, MismatchedReplay())   # before the correction's forward

    # --- the router losses ------------------------------------------------------------------------
    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        total = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)
        records = fwd_out.get(MOE_ROUTING)
        if records is None:   # not an MoE module (a multi-agent run's plain policy)
            return self.combine_losses(module_id, total, 0.0)
        # The last minibatch's observations (the dormant-unit probe, mixture dense too) and routing
        # (health: entropies, logit statistics); the load is summed over the minibatches graded.
        self._last_obs[module_id] = batch[Columns.OBS]
        self._graded_rows[module_id] = self._graded_rows.get(module_id, 0) + len(tree.flatten(batch[Columns.OBS])[0])
        if not records:   # mixture dense
            return self.combine_losses(module_id, total, 0.0)
        self._last_routing[module_id] = [r.detach() for r in records]
        loads = [r.expert_load().detach() for r in records]
        sums = self._update_load.get(module_id)
        self._update_load[module_id] = loads if sums is None else [a + b for a, b in zip(sums, loads)]
        # A Soft MoE drops nothing and has nothing to balance: no router loss.
        extra = 0.0 if getattr(records[0], "soft", False) else self.router_losses(module_id, records, batch)
        return self.combine_losses(module_id, total, extra)

    def router_losses(self, module_id: str, records, batch) -> torch.Tensor:
        """The balance and z losses, R3's anchor and the REINFORCE router's policy gradient; their
        values logged once per update (the metrics logger costs about 0.1 ms a call)."""
        module = self.plain_module(module_id)
        s = module.moe_settings   # a module's own (multi-agent overrides)
        aux_coef = self._balance_for(module_id, len(records)).coef if s.balance == "adaptive" else s.aux_loss_coef
        extra, aux, z = moe_aux_losses(records, aux_coef, s.z_loss_coef)
        stats = {"aux_loss": aux.detach(), "z_loss": z.detach(), "aux_loss_coef": aux_coef}
        if s.replay_anchor_coef > 0 and module.replay_mode == "full":
            anchor = replay_anchor_loss(records)
            extra = extra + s.replay_anchor_coef * anchor
            stats["replay_anchor_loss"] = anchor.detach()
        reinforce = [r for r in records if r.selection_logp is not None]
        if reinforce and Postprocessing.ADVANTAGES in batch:   # REINFORCE router: the advantage is the reward
            mask = batch.get(Columns.LOSS_MASK)   # rejected and phantom steps train no router either
            rl = sum(reinforce_router_loss(r, batch[Postprocessing.ADVANTAGES], mask) for r in reinforce)
            extra = extra + s.reinforce_loss_coef * rl
            stats["reinforce_router_loss"] = rl.detach()
        self._loss_stats[module_id] = stats
        return extra

    def combine_losses(self, module_id: str, total: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """The algorithm's loss plus the router losses (PPO's learner zeroes a minibatch its rollout
        correction emptied)."""
        return total + extra

    def _balance_for(self, module_id, num_layers: int) -> AdaptiveBalance:
        if module_id not in self._balance:
            s = self.plain_module(module_id).moe_settings
            self._balance[module_id] = AdaptiveBalance(s.aux_loss_coef, num_layers, s.num_experts)
        return self._balance[module_id]

    def after_balance_step(self, module_id) -> None:
        if module_id in self._balance and self._last_routing.get(module_id):
            self._balance[module_id].observe(self._last_routing[module_id], self.collectives().all_reduce_sum)

    # --- metrics, once per update -----------------------------------------------------------------
    def after_gradient_based_update(self, *, timesteps) -> None:
        """Once per update, not per minibatch: the toolkits' last figures (group norms, LRs, skipped
        steps); once at least health_min_rows rows were routed since the last grade, the health
        metrics: the load over those minibatches, entropy and logit statistics of the last one's
        routing, and the dormant share of the trunk's units.
        RLlib moves its lr schedule on first and sets it on every param group (its metric
        `default_optimizer_learning_rate` is that value); each group gets its own LR back."""
        super().after_gradient_based_update(timesteps=timesteps)
        for module_id, stats in self.reset_group_lrs().items():
            stats.update(self._loss_stats.pop(module_id, {}))
            if self._graded_rows.get(module_id, 0) < self.health_min_rows:   # DQN's updates of a few dozen rows
                self.metrics.log_dict(stats, key=module_id, window=1)
                continue
            self._graded_rows[module_id] = 0
            if self._last_routing.get(module_id):
                stats.update(health_summary(self._last_routing.pop(module_id), self._update_load.pop(module_id, None),
                                            self._health.setdefault(module_id, HealthWatch())))
            if module_id in self._last_obs:   # plasticity: moe/dormant, moe/layer{i}/dormant(/e{j})
                stats.update(module_dormancy(self.plain_module(module_id), self._last_obs.pop(module_id)))
            self.metrics.log_dict(stats, key=module_id, window=1)

    # --- state --------------------------------------------------------------------------------------
    def get_state(self, *args, **kwargs):
        state = super().get_state(*args, **kwargs)
        state[STABILITY_STATE] = self.toolkit_state()
        # PPO's and APPO's adaptive KL coefficients (RLlib's state leaves them out)
        kl = getattr(self, "curr_kl_coeffs_per_module", {})
        state[KL_COEFFS] = {mid: v.detach().cpu().clone() for mid, v in kl.items()}
        state[LR_SCALE] = self.lr_scale
        state[BALANCE_STATE] = {mid: b.get_state() for mid, b in self._balance.items()}
        return state

    def set_state(self, state) -> None:
        self.set_toolkit_state(state.get(STABILITY_STATE, {}))
        for mid, v in state.get(KL_COEFFS, {}).items():
            self.curr_kl_coeffs_per_module[mid].data.copy_(torch.as_tensor(v))
        self.lr_scale = float(state.get(LR_SCALE, self.lr_scale))
        for mid, b_state in state.get(BALANCE_STATE, {}).items():
            self._balance_for(mid, len(b_state["loads"])).set_state(b_state)
        super().set_state({k: v for k, v in state.items() if k not in OWN_STATE})

    def kept_parts(self):
        """({module_id: module}, {name: optimizer}): what the gate's last good state copies (the
        DeepSpeed learner's are its engines')."""
        modules = {mid: self.plain_module(mid) for mid in self.module.keys()}
        optimizers = {f"{mid}_{name}": opt for mid in self.module.keys()
                      for name, opt in self.get_optimizers_for_module(mid)}
        return modules, optimizers

    def keep_state(self) -> None:
        """The sync gate's last good state, kept in this process: weights, optimizer moments and the
        rest of the learner state, copied into the last copy's buffers (0.05 s per sync at 33.6 M
        parameters, where a deep copy of get_state took 0.3 s: BENCHMARKS.md)."""
        extra = self.kept_extra()
        self._kept = keep_state(*self.kept_parts(), extra, into=getattr(self, "_kept", None))

    def kept_extra(self) -> Dict[str, Any]:
        """The learner state besides weights and moments (counters, toolkits, KL coefficients)."""
        extra = self.get_state(not_components=[COMPONENT_RL_MODULE, COMPONENT_OPTIMIZER])
        extra.pop(WEIGHTS_SEQ_NO, None)   # the weights' sequence number moves on; only the state returns
        return extra

    def restore_kept_state(self) -> bool:
        """False where nothing was kept (a learner restarted since the snapshot)."""
        if getattr(self, "_kept", None) is None:
            return False
        self.set_state(restore_state(self._kept, *self.kept_parts()))
        return True

    # --- the trainer's view of rollout data -------------------------------------------------------
    def trainer_view(self, data: Mapping[str, Mapping[str, Any]], replay: Optional[bool] = None) -> Dict[str, Dict]:
        """data: {module_id: {"obs", optional "actions", optional "routing"}} (numpy, batch-major).
        The training path's own forward, with no gradient, per module as its kind defines it
        (MoEPolicyModule.check_view: action-dist inputs and log-probs; the Q-module's: Q-values),
        with its routing. replay None: as each module trains (its own routing_replay); False: the
        router's own choice (the probe set)."""
        return {mid: self.plain_module(mid).check_view(d, replay) for mid, d in data.items()}

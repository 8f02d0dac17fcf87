"""MoELearner: what an MoE policy adds to any RLlib TorchLearner: the router losses, health and
plasticity metrics, the stability toolkit (per-group LR and clipping, NaN-step skipping, ...:
moe_rl.core.stability), the sync gate's kept state and weight publishing. An algorithm's learner
is this mixin before RLlib's own (moe_rl.rllib.learner: PPO, moe_rl.rllib.appo_learner: APPO):

    class MoEPPOTorchLearner(MoELearner, PPOTorchLearner): ...

Learning rates, one system per parameter group: a group that `stability.lr_schedules` names (or
covers with "default") follows that schedule alone (torch's schedulers, counted in applied
optimizer steps); every other group follows RLlib's `lr`, a number or RLlib's own schedule over
sampled env steps (RLlib's Scheduler, updated once per update). The sync gate's rollback retry
scales every group (lr_scale). docs/stability.md, "Learning rates".

It also offers the weights the way the rest of the system sees them: under global names, as
numpy, per module (`shard`, `shard_digests`, `weight_stats`, `load_shards`), and the trainer's own
forward on rollout data (`trainer_view`). The DeepSpeed learner overrides the first ones with its
expert-parallel part; the learner groups (moe_rl.rllib.learner_group, actors.learner_group) call them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import numpy as np
import torch
import tree
from ray.rllib.core import COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from moe_rl.core.balance import AdaptiveBalance
from moe_rl.core.correction import active, correct, resolve_correction, sequence_ids
from moe_rl.core.errors import ConfigError
from moe_rl.core.health import HealthWatch
from moe_rl.core.losses import moe_aux_losses, reinforce_router_loss, replay_anchor_loss
from moe_rl.core.metrics import expert_counts, health_summary
from moe_rl.core.param_groups import is_target, trained_modules
from moe_rl.core.routers import Router, balancing_routers
from moe_rl.core.stability import (
    StabilityToolkit,
    expert_dropout_at,
    expert_dropout_off,
    set_expert_dropout,
    validate_stability,
)
from moe_rl.core.state_copy import keep_state, restore_state
from moe_rl.rllib.correction import SkippedSteps, routing_flags
from moe_rl.rllib.replay import MismatchedReplay
from moe_rl.rllib.rl_module import MOE_ROUTING, MOE_TOPK, MoEPolicyModule, module_dormancy
from moe_rl.rllib.weight_publishing import WeightPublisher, copied_tensor

STABILITY_STATE = "moe_rl_stability"
KL_COEFFS = "moe_rl_kl_coeffs"
LR_SCALE = "moe_rl_lr_scale"
BALANCE_STATE = "moe_rl_balance"
SKIPPED_STEPS = "moe_rl_skipped_steps"   # steps and updates skipped because the correction kept no step


class MoELearner(WeightPublisher):
    """Mixed in before an RLlib TorchLearner; it uses only RLlib's public Learner hooks."""

    def build(self) -> None:
        self._stability: Dict[str, StabilityToolkit] = {}
        self._last_routing: Dict[str, list] = {}
        self._last_obs: Dict[str, Any] = {}
        self._update_counts: Dict[str, List[torch.Tensor]] = {}   # per layer, the update's assignments
        self._balance: Dict[str, AdaptiveBalance] = {}   # modules with moe.balance: adaptive
        self._health: Dict[str, HealthWatch] = {}   # per module: the grade's streaks over updates
        self._balancing: Dict[str, tuple] = {}   # module_id -> (module, its routers with balancing state)
        self._loss_stats: Dict[str, Dict[str, Any]] = {}   # the last minibatch's router-loss figures
        # fn(learner, module_id), run on the parameters' .grad before the stability toolkit:
        # custom gradient surgery, or fault injection in tests.
        self.grad_hooks: List[Callable] = []
        self.lr_scale = 1.0   # < 1 for the retry after a sync-gate rollback
        self.skipped_steps = SkippedSteps()   # steps where the rollout correction kept nothing
        super().build()
        if self._learner_connector is not None and any(
                isinstance(m, MoEPolicyModule) and m.replay_mode == "mismatched"
                for m in map(self.plain_module, self.module.keys())):
            self._learner_connector.append(MismatchedReplay())   # before the correction's forward
        self.correction = resolve_correction(self.config.consistency_settings.correction)

    # --- optimizer and the stability toolkit -----------------------------------------------------
    def make_toolkit(self, module_id) -> StabilityToolkit:
        return StabilityToolkit(validate_stability(self.config.stability_settings),
                                [(n, p) for n, p in self._module[module_id].named_parameters() if not is_target(n)])

    def optimizer_param_groups(self, toolkit: StabilityToolkit, base_lr: float):
        return toolkit.param_groups(base_lr)

    def configure_optimizers_for_module(self, module_id, config=None):
        """One param group per stability group (router, experts, ...: own LR schedule and clip),
        Adam/AdamW with the multi-tensor (foreach) kernels — an MoE module has many small
        per-expert tensors, and the per-tensor loop PyTorch picks on CPU dominates the step — or LAMB.
        RLlib's `lr` is registered with the optimizer as RLlib does it (its Scheduler); the toolkit
        then gives each group its own LR (set_lrs)."""
        if self._lr_scheduler_classes:
            raise ConfigError("experimental._torch_lr_scheduler_classes: not supported; per-group LRs come "
                              "from stability.lr_schedules, the others from training.lr (docs/stability.md)")
        toolkit = self._stability[module_id] = self.make_toolkit(module_id)
        base_lr = config.lr if isinstance(config.lr, (int, float)) else 1e-3  # replaced below, before any step
        optimizer = self.build_optimizer(module_id, toolkit, self.optimizer_param_groups(toolkit, base_lr), base_lr)
        self.register_optimizer(module_id=module_id, optimizer=optimizer,
                                params=self.get_parameters(self._module[module_id]), lr_or_lr_schedule=config.lr)
        toolkit.set_lrs(optimizer, self.rllib_lr(optimizer), self.lr_scale)   # RLlib set every group alike
        self._set_expert_dropout(module_id)

    def rllib_lr(self, optimizer) -> float:
        """RLlib's `lr` now: its Scheduler's current value (a fixed lr or RLlib's schedule). It drives
        the groups stability.lr_schedules leaves to it."""
        lr_schedule = self._optimizer_lr_schedules.get(optimizer)
        return float(lr_schedule.get_current_value() if lr_schedule is not None else self.config.lr)

    def build_optimizer(self, module_id, toolkit, param_groups, base_lr):
        return toolkit.make_optimizer(param_groups, base_lr)

    def _set_expert_dropout(self, module_id) -> None:
        toolkit = self._stability[module_id]
        p = expert_dropout_at(toolkit.s.expert_dropout_schedule, toolkit.step_count)
        if p is not None:
            set_expert_dropout(self._module[module_id], p)
            toolkit.last_stats["stability/expert_dropout"] = p

    def stability_step(self, module_id, optimizer) -> bool:
        """Run the gradient hooks and the toolkit on this module's .grad; True: take the step.
        Its figures are logged once per update (after_gradient_based_update).
        Collective under the DeepSpeed learner group: every learner calls it once per step."""
        if active(self.correction) and not self.skipped_steps.anything_kept(module_id):
            for p in self._module[module_id].parameters():   # no step: neither the aux losses alone
                p.grad = None                                # nor Adam's momentum move a weight
            return False
        for hook in self.grad_hooks:
            hook(self, module_id)
        return self._stability[module_id].process(self.rllib_lr(optimizer), optimizer, scale=self.lr_scale)

    def after_step(self, module_id) -> None:
        """After an applied optimizer step: routers' balancing state, then the dropout schedule."""
        module = self._module[module_id]
        cached = self._balancing.get(module_id)
        if cached is None or cached[0] is not module:   # not a walk over the module tree at every step
            cached = self._balancing[module_id] = (module, balancing_routers(module))
        for router in cached[1]:
            router.balance_step(self.router_stats_all_reduce())
        if module_id in self._balance and self._last_routing.get(module_id):
            self._balance[module_id].observe(self._last_routing[module_id], self.router_stats_all_reduce())
        self._set_expert_dropout(module_id)

    def router_stats_all_reduce(self):
        """How routers sum their balancing statistics over the learners (one learner: no need)."""
        return None

    def apply_gradients(self, gradients_dict) -> None:
        for pid, grad in gradients_dict.items():
            if self._params[pid].grad is not grad:
                self._params[pid].grad = grad
        for module_id, names in self._module_optimizers.items():
            for name in names:
                optimizer = self.get_optimizer(module_id, name)
                if self.stability_step(module_id, optimizer):
                    optimizer.step()
                    self.after_step(module_id)

    def after_gradient_based_update(self, *, timesteps) -> None:
        """Once per update, not per minibatch: the toolkit's last figures (group norms, LRs,
        skipped steps) and the health metrics: the load over the whole update's minibatches,
        entropy and logit statistics of the last minibatch's routing."""
        for module_id in self._stability:   # before PPO's KL-coefficient update reads them
            if active(self.correction):
                self._loss_stats.setdefault(module_id, {}).update(self.skipped_steps.end_update(
                    module_id, warn=not self.config.consistency_settings.enabled))
        # RLlib moves its lr schedule on and sets it on every param group (its metric
        # `default_optimizer_learning_rate` is that value); each group gets its own LR back for the next step.
        super().after_gradient_based_update(timesteps=timesteps)
        for module_id, toolkit in self._stability.items():
            for _, optimizer in self.get_optimizers_for_module(module_id):
                toolkit.set_lrs(optimizer, self.rllib_lr(optimizer), self.lr_scale)
            stats = {**toolkit.last_stats, **self._loss_stats.pop(module_id, {})}
            if self._last_routing.get(module_id):
                stats.update(health_summary(self._last_routing.pop(module_id),
                                            self._update_counts.pop(module_id, None),
                                            self._health.setdefault(module_id, HealthWatch())))
            if module_id in self._last_obs:   # plasticity: moe/dormant, moe/layer{i}/dormant(/e{j})
                stats.update(module_dormancy(self.plain_module(module_id), self._last_obs.pop(module_id)))
            self.metrics.log_dict(stats, key=module_id, window=1)

    def get_state(self, *args, **kwargs):
        state = super().get_state(*args, **kwargs)
        state[STABILITY_STATE] = {mid: tk.get_state() for mid, tk in self._stability.items()}
        # PPO's and APPO's adaptive KL coefficients (RLlib's state leaves them out)
        kl = getattr(self, "curr_kl_coeffs_per_module", {})
        state[KL_COEFFS] = {mid: v.detach().cpu().clone() for mid, v in kl.items()}
        state[LR_SCALE] = self.lr_scale
        state[BALANCE_STATE] = {mid: b.get_state() for mid, b in self._balance.items()}
        state[SKIPPED_STEPS] = self.skipped_steps.get_state()
        return state

    def set_state(self, state) -> None:
        for mid, tk_state in state.get(STABILITY_STATE, {}).items():
            self._stability[mid].set_state(tk_state)
            self._set_expert_dropout(mid)
        for mid, v in state.get(KL_COEFFS, {}).items():
            self.curr_kl_coeffs_per_module[mid].data.copy_(torch.as_tensor(v))
        self.lr_scale = float(state.get(LR_SCALE, self.lr_scale))
        for mid, b_state in state.get(BALANCE_STATE, {}).items():
            self._balance_for(mid, len(b_state["loads"])).set_state(b_state)
        if SKIPPED_STEPS in state:
            self.skipped_steps.set_state(state[SKIPPED_STEPS])
        super().set_state({k: v for k, v in state.items()
                           if k not in (STABILITY_STATE, KL_COEFFS, LR_SCALE, BALANCE_STATE, SKIPPED_STEPS)})

    # --- the sync gate's last good state, kept in this process ------------------------------------
    def keep_state(self) -> None:
        """Weights, optimizer moments and the rest of the learner state, copied here into the last
        copy's buffers: 0.05 s per sync at 33.6 M parameters, where a deep copy of get_state (the
        moments converted to numpy, then everything copied again) took 0.3 s (BENCHMARKS.md)."""
        extra = self.get_state(not_components=[COMPONENT_RL_MODULE, COMPONENT_OPTIMIZER])
        extra.pop(WEIGHTS_SEQ_NO, None)   # the weights' sequence number moves on; only the state returns
        self._kept = keep_state(self._plain_modules(), self._named_optimizers, extra,
                                into=getattr(self, "_kept", None))

    def restore_kept_state(self) -> bool:
        """False where nothing was kept (a learner restarted since the snapshot)."""
        if getattr(self, "_kept", None) is None:
            return False
        self.set_state(restore_state(self._kept, self._plain_modules(), self._named_optimizers))
        return True

    def _plain_modules(self) -> Dict[str, torch.nn.Module]:
        return {mid: self.plain_module(mid) for mid in self.module.keys()}

    def _balance_for(self, module_id, num_layers: int) -> AdaptiveBalance:
        if module_id not in self._balance:
            s = self.plain_module(module_id).moe_settings
            self._balance[module_id] = AdaptiveBalance(s.aux_loss_coef, num_layers, s.num_experts)
        return self._balance[module_id]

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        records = fwd_out.get(MOE_ROUTING)
        if records and self.correction.mode == "bypass" and active(self.correction):
            self._bypass_rejection(module_id, batch, fwd_out, records)
        total = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch,
                                                fwd_out=fwd_out)
        kept = None
        if active(self.correction) and Columns.LOSS_MASK in batch:
            kept = self.skipped_steps.minibatch(module_id, int(batch[Columns.LOSS_MASK].sum()))
        if not records:
            return total
        module = self.plain_module(module_id)
        s = module.moe_settings   # a module's own (multi-agent overrides)
        aux_coef = (self._balance_for(module_id, len(records)).coef if s.balance == "adaptive"
                    else s.aux_loss_coef)
        extra, aux, z = moe_aux_losses(records, aux_coef, s.z_loss_coef)
        # The values of the last minibatch, like RLlib's own PPO loss stats (window=1). The health
        # metrics (dozens of keys) are computed once per update: the load from every minibatch's
        # assignments (summed here), the rest from the last minibatch's routing.
        self._last_routing[module_id] = [r.detach() for r in records]
        self._last_obs[module_id] = batch[Columns.OBS]   # the dormant-unit probe's batch (plasticity)
        counts = [expert_counts(r.router_top_k, r.num_experts) for r in records]
        sums = self._update_counts.get(module_id)
        self._update_counts[module_id] = counts if sums is None else [a + b for a, b in zip(sums, counts)]
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
        # Logged once per update (after_gradient_based_update), like the health metrics: the
        # metrics logger costs about 0.1 ms a call, per minibatch.
        self._loss_stats[module_id] = stats
        if kept == 0:
            # PPO's masked mean over no step is 0/0. The step is skipped (stability_step); the
            # backward pass still runs on every learner (DDP and DeepSpeed reduce collectively), so
            # the loss is a zero with the graph's shape: no NaN reaches a gradient.
            return torch.nan_to_num(total, nan=0.0) * 0.0 + extra * 0.0
        return total + extra

    def _bypass_rejection(self, module_id, batch, fwd_out, records) -> None:
        """Bypass mode (rollout = old): token rejection from the current policy against the
        rollout's log-probs, as a loss mask, on this minibatch."""
        module = self.plain_module(module_id)
        with torch.no_grad():
            logp = module.get_train_action_dist_cls().from_logits(
                fwd_out[Columns.ACTION_DIST_INPUTS]).logp(batch[Columns.ACTIONS])
        valid = batch.get(Columns.LOSS_MASK, torch.ones_like(logp, dtype=torch.bool)).bool()
        _, keep, figures = correct(logp - batch[Columns.ACTION_LOGP], valid, sequence_ids(valid), self.correction,
                                   routing_flags(self.correction, batch, records))
        batch[Columns.LOSS_MASK] = keep
        figures.pop("correction/seq_rejected_fraction", None)   # a shuffled minibatch has no sequences
        self.metrics.log_dict(figures, key=module_id, window=1)

    # --- weights, as the rest of the system sees them ---------------------------------------------
    # --- the trainer's view of rollout data -------------------------------------------------------
    def trainer_view(self, data: Mapping[str, Mapping[str, Any]], replay: Optional[bool] = None) -> Dict[str, Dict]:
        """data: {module_id: {"obs", optional "actions", optional "topk"}} (numpy, batch-major).
        forward_train, the real training path, with no gradient -> per module: action-dist inputs
        (`logits`), top-k per MoE layer (`topk`), the greedy top-k margin per layer (`margin`) and,
        given actions, their log-probs (`logp`). replay None: as each module trains (its own
        routing_replay); False: the router's own choice (the probe set)."""
        out = {}
        for mid, d in data.items():
            module = self.plain_module(mid)
            batch = {Columns.OBS: tree.map_structure(copied_tensor, d["obs"])}
            if (module.replay_routing if replay is None else replay) and d.get("topk") is not None:
                batch[MOE_TOPK] = copied_tensor(d["topk"])
            routers = [m for m in trained_modules(module) if isinstance(m, Router)]
            with torch.no_grad(), expert_dropout_off(module):   # dropout is a training perturbation
                fwd = module.forward_train(batch)
                logits = fwd[Columns.ACTION_DIST_INPUTS]
                records = fwd[MOE_ROUTING]
                view = {"logits": logits.float().numpy(), "topk": fwd[MOE_TOPK].numpy().astype(np.int16),
                        "margin": torch.stack([r.top_k_margin(rec.router_logits) for r, rec in zip(routers, records)],
                                              1).numpy() if records else np.zeros((len(logits), 0))}
                if d.get("actions") is not None:
                    dist = module.get_train_action_dist_cls().from_logits(logits)
                    view["logp"] = dist.logp(copied_tensor(d["actions"])).double().numpy()
            out[mid] = view
        return out

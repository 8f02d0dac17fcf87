"""MoEPPOTorchLearner: RLlib's PPO loss plus the MoE router losses, health metrics and the
stability toolkit (per-group LR and clipping, NaN-step skipping, ...: moe_rl.stability)."""
from __future__ import annotations

from typing import Callable, Dict, List

from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.evaluation.postprocessing import Postprocessing

from .losses import moe_aux_losses, reinforce_router_loss
from .metrics import health_summary
from .rl_module import MOE_ROUTING
from .stability import StabilityToolkit, expert_dropout_at, set_expert_dropout, validate_stability
from .tis import TIS_WEIGHT, TruncatedImportanceSampling

STABILITY_STATE = "moe_rl_stability"


class MoEPPOTorchLearner(PPOTorchLearner):
    def build(self) -> None:
        self._stability: Dict[str, StabilityToolkit] = {}
        self._last_routing: Dict[str, list] = {}
        # fn(learner, module_id), run on the parameters' .grad before the stability toolkit:
        # custom gradient surgery, or fault injection in tests.
        self.grad_hooks: List[Callable] = []
        super().build()
        cap = self.config.consistency_settings.get("tis_cap")
        if cap is not None and self._learner_connector is not None:
            # After PPO's GAE (appended by super().build()): reweights advantages, re-bases the ratio.
            self._learner_connector.append(TruncatedImportanceSampling(cap=cap))

    # --- optimizer and the stability toolkit -----------------------------------------------------
    def make_toolkit(self, module_id) -> StabilityToolkit:
        return StabilityToolkit(validate_stability(self.config.stability_settings),
                                self._module[module_id].named_parameters())

    def optimizer_param_groups(self, toolkit: StabilityToolkit, base_lr: float):
        return toolkit.param_groups(base_lr)

    def configure_optimizers_for_module(self, module_id, config=None):
        """One param group per stability group (router, experts, ...: own LR schedule and clip),
        Adam/AdamW with the multi-tensor (foreach) kernels — an MoE module has many small
        per-expert tensors, and the per-tensor loop PyTorch picks on CPU dominates the step — or LAMB."""
        toolkit = self._stability[module_id] = self.make_toolkit(module_id)
        base_lr = config.lr if isinstance(config.lr, (int, float)) else 1e-3  # schedules set it each step
        optimizer = self.build_optimizer(module_id, toolkit, self.optimizer_param_groups(toolkit, base_lr), base_lr)
        self.register_optimizer(module_id=module_id, optimizer=optimizer,
                                params=self.get_parameters(self._module[module_id]), lr_or_lr_schedule=config.lr)
        self._set_expert_dropout(module_id)

    def build_optimizer(self, module_id, toolkit, param_groups, base_lr):
        return toolkit.make_optimizer(param_groups, base_lr)

    def _set_expert_dropout(self, module_id) -> None:
        toolkit = self._stability[module_id]
        p = expert_dropout_at(toolkit.s["expert_dropout_schedule"], toolkit.step_count)
        if p is not None:
            set_expert_dropout(self._module[module_id], p)
            toolkit.last_stats["stability/expert_dropout"] = p

    def stability_step(self, module_id, optimizer) -> bool:
        """Run the gradient hooks and the toolkit on this module's .grad; True: take the step.
        Its figures are logged once per update (after_gradient_based_update).
        Collective under the DeepSpeed learner group: every learner calls it once per step."""
        for hook in self.grad_hooks:
            hook(self, module_id)
        lr_schedule = self._optimizer_lr_schedules.get(optimizer)
        base_lr = lr_schedule.get_current_value() if lr_schedule is not None else self.config.lr
        return self._stability[module_id].process(float(base_lr), optimizer)

    def after_step(self, module_id) -> None:
        self._set_expert_dropout(module_id)

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
        skipped steps) and the health metrics of the last minibatch's routing."""
        super().after_gradient_based_update(timesteps=timesteps)
        for module_id, toolkit in self._stability.items():
            stats = dict(toolkit.last_stats)
            if self._last_routing.get(module_id):
                stats.update(health_summary(self._last_routing.pop(module_id)))
            self.metrics.log_dict(stats, key=module_id, window=1)

    def get_state(self, *args, **kwargs):
        state = super().get_state(*args, **kwargs)
        state[STABILITY_STATE] = {mid: tk.get_state() for mid, tk in self._stability.items()}
        return state

    def set_state(self, state) -> None:
        for mid, tk_state in state.get(STABILITY_STATE, {}).items():
            self._stability[mid].set_state(tk_state)
            self._set_expert_dropout(mid)
        super().set_state({k: v for k, v in state.items() if k != STABILITY_STATE})

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        total = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch,
                                                fwd_out=fwd_out)
        records = fwd_out.get(MOE_ROUTING)
        if not records:
            return total
        s = config.moe_settings
        extra, aux, z = moe_aux_losses(records, s["aux_loss_coef"], s["z_loss_coef"])
        # window=1 like RLlib's own PPO loss stats: the values of the last minibatch. The health
        # metrics (dozens of keys) are computed once per update from the last minibatch's routing.
        self._last_routing[module_id] = [r.detach() for r in records]
        stats = {"aux_loss": aux.detach(), "z_loss": z.detach()}
        reinforce = [r for r in records if r.selection_logp is not None]
        if reinforce:  # REINFORCE router: the PPO advantage is the routing reward
            rl = sum(reinforce_router_loss(r, batch[Postprocessing.ADVANTAGES]) for r in reinforce)
            extra = extra + s["reinforce_loss_coef"] * rl
            stats["reinforce_router_loss"] = rl.detach()
        if TIS_WEIGHT in batch:  # truncated importance sampling is on (moe_rl.tis)
            w = batch[TIS_WEIGHT]
            stats.update({"tis/mean_weight": w.mean(), "tis/truncated_share": (w >= config.consistency_settings[
                "tis_cap"]).float().mean()})
        self.metrics.log_dict(stats, key=module_id, window=1)
        return total + extra

"""MoEPPOTorchLearner: RLlib's PPO loss and GAE with the MoE parts (moe_rl.rllib.moe_learner) and
what only PPO has: the rollout correction (moe_rl.core.correction) and the steps it empties.
"""
from __future__ import annotations

import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core.columns import Columns

from moe_rl.core.correction import active, correct, sequence_ids
from moe_rl.core.gate import validate_consistency
from moe_rl.rllib import ray_private
from moe_rl.rllib.correction import RolloutCorrection, SkippedSteps, routing_flags
from moe_rl.rllib.moe_learner import MoELearner
from moe_rl.rllib.rl_module import MOE_ROUTING

SKIPPED_STEPS = "moe_rl_skipped_steps"   # steps and updates skipped because the correction kept no step


class MoEPPOTorchLearner(ray_private.KeepKLCoeffOnSkippedUpdate, MoELearner, PPOTorchLearner):
    def build(self) -> None:
        self.skipped_steps = SkippedSteps()   # steps where the rollout correction kept nothing
        self.correction = validate_consistency(self.config.consistency_settings).correction
        self._kept_rows = {}   # module -> rows the correction kept in the current minibatch
        super().build()
        if active(self.correction) and self.correction.mode == "decoupled":
            # After PPO's GAE (appended by PPO's build): reweights advantages, re-bases the ratio on
            # the learner's own old policy, masks rejected steps.
            ray_private.append_learner_connector(self, RolloutCorrection(settings=self.correction))

    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        if active(self.correction):
            records = fwd_out.get(MOE_ROUTING)
            if records and self.correction.mode == "bypass":
                self._bypass_rejection(module_id, batch, fwd_out, records)
            if Columns.LOSS_MASK in batch:
                self._kept_rows[module_id] = self.skipped_steps.minibatch(module_id,
                                                                          int(batch[Columns.LOSS_MASK].sum()))
        return super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)

    def combine_losses(self, module_id, total, extra):
        if self._kept_rows.pop(module_id, None) == 0:
            # PPO's masked mean over no step is 0/0. The step is skipped (step_allowed); the backward
            # pass still runs on every learner (DDP and DeepSpeed reduce collectively), so the loss is
            # a zero with the graph's shape: no NaN reaches a gradient.
            return torch.nan_to_num(total, nan=0.0) * 0.0 + extra * 0.0
        return total + extra

    def step_allowed(self, module_id: str) -> bool:
        return not active(self.correction) or self.skipped_steps.anything_kept(module_id)

    def after_gradient_based_update(self, *, timesteps) -> None:
        """Before PPO's KL-coefficient update reads them: the correction's skipped-step figures."""
        if active(self.correction):
            for module_id in self.module.keys():
                figures = self.skipped_steps.end_update(module_id, warn=not self.config.consistency_settings.enabled)
                self.metrics.log_dict(figures, key=module_id, window=1)
        super().after_gradient_based_update(timesteps=timesteps)

    def kl_update_skipped(self, module_id: str, kl_loss: float) -> bool:
        """An update whose last minibatch kept no step has no KL (NaN): the coefficient stays, and
        RLlib's warning about a non-finite KL, which would blame the policy, is not given."""
        return kl_loss != kl_loss and bool(self.skipped_steps.last.get(module_id, {}).get("skipped"))

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

    def get_state(self, *args, **kwargs):
        state = super().get_state(*args, **kwargs)
        state[SKIPPED_STEPS] = self.skipped_steps.get_state()
        return state

    def set_state(self, state) -> None:
        if SKIPPED_STEPS in state:
            self.skipped_steps.set_state(state[SKIPPED_STEPS])
        super().set_state({k: v for k, v in state.items() if k != SKIPPED_STEPS})

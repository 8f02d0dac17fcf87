"""MoEPPOTorchLearner: RLlib's PPO loss and GAE with the MoE parts (moe_rl.rllib.moe_learner).

"""
from __future__ import annotations

from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from moe_rl.core.correction import active
from moe_rl.rllib.correction import RolloutCorrection
from moe_rl.rllib.moe_learner import MoELearner


class MoEPPOTorchLearner(MoELearner, PPOTorchLearner):
    def build(self) -> None:
        super().build()
        if active(self.correction) and self.correction.mode == "decoupled" and self._learner_connector is not None:
            # After PPO's GAE (appended by PPO's build): reweights advantages, re-bases the ratio on
            # the learner's own old policy, masks rejected steps.
            self._learner_connector.append(RolloutCorrection(settings=self.correction))

    def _update_module_kl_coeff(self, *, module_id, config, kl_loss) -> None:
        """An update whose last minibatch kept no step has no KL (NaN): the coefficient stays."""
        if kl_loss != kl_loss and self.skipped_steps.last.get(module_id, {}).get("skipped"):
            return
        super()._update_module_kl_coeff(module_id=module_id, config=config, kl_loss=kl_loss)

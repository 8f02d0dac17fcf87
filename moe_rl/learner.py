"""MoEPPOTorchLearner: RLlib's PPO loss plus the MoE router losses and health metrics."""
from __future__ import annotations

from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from .losses import moe_aux_losses
from .metrics import health_summary
from .rl_module import MOE_ROUTING


class MoEPPOTorchLearner(PPOTorchLearner):
    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        total = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch,
                                                fwd_out=fwd_out)
        records = fwd_out.get(MOE_ROUTING)
        if not records:
            return total
        s = config.moe_settings
        extra, aux, z = moe_aux_losses(records, s["aux_loss_coef"], s["z_loss_coef"])
        # window=1 like RLlib's own PPO loss stats: the values of the last minibatch.
        self.metrics.log_dict({"aux_loss": aux.detach(), "z_loss": z.detach(), **health_summary(records)},
                              key=module_id, window=1)
        return total + extra

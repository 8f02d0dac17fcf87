"""MoEPPOTorchLearner: RLlib's PPO loss plus the MoE router losses and health metrics."""
from __future__ import annotations

import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from .losses import moe_aux_losses
from .metrics import health_summary
from .rl_module import MOE_ROUTING
from .tis import TIS_WEIGHT, TruncatedImportanceSampling


class MoEPPOTorchLearner(PPOTorchLearner):
    def build(self) -> None:
        super().build()
        cap = self.config.consistency_settings.get("tis_cap")
        if cap is not None and self._learner_connector is not None:
            # After PPO's GAE (appended by super().build()): reweights advantages, re-bases the ratio.
            self._learner_connector.append(TruncatedImportanceSampling(cap=cap))
    def configure_optimizers_for_module(self, module_id, config=None):
        """RLlib's Adam, with the multi-tensor (foreach) kernels: an MoE module has many small
        per-expert tensors, and the per-tensor loop PyTorch picks on CPU dominates the step."""
        params = self.get_parameters(self._module[module_id])
        self.register_optimizer(module_id=module_id, optimizer=torch.optim.Adam(params, foreach=True),
                                params=params, lr_or_lr_schedule=config.lr)

    def apply_gradients(self, gradients_dict) -> None:
        """One fused finiteness check instead of one per tensor; RLlib's path when it fails."""
        grads = [g for g in gradients_dict.values() if g is not None]
        if self._lr_scheduler_classes is not None or not grads or not bool(
                torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
            return super().apply_gradients(gradients_dict)
        for pid, grad in gradients_dict.items():
            if self._params[pid].grad is not grad:
                self._params[pid].grad = grad
        for module_id, names in self._module_optimizers.items():
            for name in names:
                self.get_optimizer(module_id, name).step()
    def compute_loss_for_module(self, *, module_id, config, batch, fwd_out):
        total = super().compute_loss_for_module(module_id=module_id, config=config, batch=batch,
                                                fwd_out=fwd_out)
        records = fwd_out.get(MOE_ROUTING)
        if not records:
            return total
        s = config.moe_settings
        extra, aux, z = moe_aux_losses(records, s["aux_loss_coef"], s["z_loss_coef"])
        # window=1 like RLlib's own PPO loss stats: the values of the last minibatch.
        stats = {"aux_loss": aux.detach(), "z_loss": z.detach(), **health_summary(records)}
        if TIS_WEIGHT in batch:  # truncated importance sampling is on (moe_rl.tis)
            w = batch[TIS_WEIGHT]
            stats.update({"tis/mean_weight": w.mean(), "tis/truncated_share": (w >= config.consistency_settings[
                "tis_cap"]).float().mean()})
        self.metrics.log_dict(stats, key=module_id, window=1)
        return total + extra

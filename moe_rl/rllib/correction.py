"""Truncated importance sampling (TIS) for training-inference mismatch, as a learner connector.

The rollouts sampled from pi_inference; PPO's ratio should be taken against the *trainer's* old
policy. After GAE, for every step: trainer_logp = the learner's own pre-update log-prob, and
    w = min(pi_trainer_old / pi_inference, C)          (detached)
Then ACTION_LOGP := trainer_logp and ADVANTAGES *= w. Because w > 0,
    min(w A r, w A clip(r)) = w * min(A r, A clip(r)),
so RLlib's unchanged PPO loss computes exactly the TIS-corrected objective.
"""
from __future__ import annotations

import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

TIS_WEIGHT = "tis_weight"
ROLLOUT_LOGP = "rollout_logp"


class TruncatedImportanceSampling(ConnectorV2):
    def __init__(self, input_observation_space=None, input_action_space=None, *, cap: float = 2.0, **kwargs):
        super().__init__(input_observation_space, input_action_space, **kwargs)
        self.cap = cap

    def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None, metrics=None, **kwargs):
        for module_id, module_batch in batch.items():
            module = rl_module[module_id]
            module = module.unwrapped() if hasattr(module, "unwrapped") else module
            with torch.no_grad():  # the real training path (forward_train), before any update
                logits = module.forward_train(module_batch)[Columns.ACTION_DIST_INPUTS]
                trainer_logp = module.get_train_action_dist_cls().from_logits(logits).logp(
                    module_batch[Columns.ACTIONS])
            rollout_logp = module_batch[Columns.ACTION_LOGP]
            weight = torch.exp(trainer_logp - rollout_logp).clamp(max=self.cap)
            module_batch[ROLLOUT_LOGP] = rollout_logp
            module_batch[Columns.ACTION_LOGP] = trainer_logp
            module_batch[Postprocessing.ADVANTAGES] = module_batch[Postprocessing.ADVANTAGES] * weight
            module_batch[TIS_WEIGHT] = weight
        return batch

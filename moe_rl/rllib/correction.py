"""Rollout correction on MoE-PPO, as a learner connector after GAE (moe_rl.core.correction).

Decoupled mode: for every step the learner's own pre-update forward (forward_train, the real
training path, replaying the routing when the module does) gives the old policy's log-prob; then

    ACTION_LOGP := old log-prob       PPO's ratio is taken against the learner's own old policy
    ADVANTAGES  *= IS weight          min(w A r, w A clip(r)) = w min(A r, A clip(r)) for w > 0, so
                                      RLlib's unchanged PPO loss computes the corrected objective
    LOSS_MASK   &= kept               rejected steps leave the loss and its denominator

Bypass mode does no extra forward: the ratio stays against the rollout's log-probs and token
rejection is applied in the loss (MoEPPOTorchLearner.compute_loss_for_module).
"""
from __future__ import annotations

import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

from moe_rl.core.correction import correct, routing_disagreement, sequence_ids
from moe_rl.core.stability import expert_dropout_off
from moe_rl.rllib.rl_module import MOE_ROUTING, MOE_TOPK, MoEPolicyModule

IS_WEIGHT = "moe_rl_is_weight"
ROLLOUT_LOGP = "moe_rl_rollout_logp"


def routing_flags(settings, batch, records):
    """[N] bool: the trainer's own routing disagrees with the rollout's (None when routing RS is off)."""
    if settings["routing_rs"] == "off" or MOE_TOPK not in batch or not records:
        return None
    own = torch.stack([r.router_top_k for r in records], 1)
    return routing_disagreement(batch[MOE_TOPK], own, settings["routing_rs"], settings["routing_rs_share"])


class RolloutCorrection(ConnectorV2):
    def __init__(self, input_observation_space=None, input_action_space=None, *, settings=None, **kwargs):
        super().__init__(input_observation_space, input_action_space, **kwargs)
        self.s = settings

    def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None, metrics=None, **kwargs):
        for module_id, b in batch.items():
            module = rl_module[module_id]
            module = module.unwrapped() if hasattr(module, "unwrapped") else module
            if not isinstance(module, MoEPolicyModule):
                continue                  # a plain policy passes through untouched
            with torch.no_grad(), expert_dropout_off(module):   # the old policy: the learner before the update
                fwd = module.forward_train(b)
                old_logp = module.get_train_action_dist_cls().from_logits(
                    fwd[Columns.ACTION_DIST_INPUTS]).logp(b[Columns.ACTIONS])
            rollout_logp = b[Columns.ACTION_LOGP]
            valid = b.get(Columns.LOSS_MASK, torch.ones_like(rollout_logp, dtype=torch.bool)).bool()
            weights, keep, figures = correct(old_logp - rollout_logp, valid, sequence_ids(valid), self.s,
                                             routing_flags(self.s, b, fwd.get(MOE_ROUTING)))
            b[ROLLOUT_LOGP] = rollout_logp
            b[Columns.ACTION_LOGP] = old_logp
            b[Postprocessing.ADVANTAGES] = b[Postprocessing.ADVANTAGES] * weights
            b[IS_WEIGHT] = weights
            b[Columns.LOSS_MASK] = keep
            if metrics is not None:
                metrics.log_dict(figures, key=module_id, window=1)
        return batch

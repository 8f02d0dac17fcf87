"""Rollout correction on MoE-PPO, as a learner connector after GAE (moe_rl.core.correction).

Decoupled mode: for every step the learner's own pre-update forward (forward_train, the real
training path, replaying the routing when the module does) gives the old policy's log-prob; then

    ACTION_LOGP := old log-prob       PPO's ratio is taken against the learner's own old policy
    ACTION_DIST_INPUTS := old logits  and so is PPO's KL penalty (0 before the first step)
    ADVANTAGES  *= IS weight          min(w A r, w A clip(r)) = w min(A r, A clip(r)) for w > 0, so
                                      RLlib's unchanged PPO loss computes the corrected objective
    LOSS_MASK   &= kept               rejected steps leave the loss and its denominator

Bypass mode does no extra forward: the ratio stays against the rollout's log-probs and token
rejection is applied in the loss (MoEPPOTorchLearner.compute_loss_for_module).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns
from ray.rllib.evaluation.postprocessing import Postprocessing

from moe_rl.core.correction import correct, routing_disagreement, sequence_ids
from moe_rl.core.stability import expert_dropout_off
from moe_rl.rllib.rl_module import MOE_ROUTING, MOE_TOPK, MoEPolicyModule

logger = logging.getLogger("moe_rl")

IS_WEIGHT = "moe_rl_is_weight"
ROLLOUT_LOGP = "moe_rl_rollout_logp"


def routing_flags(settings, batch, records):
    """[N] bool: the trainer's own routing disagrees with the rollout's (None when routing RS is off)."""
    if settings.routing_rs == "off" or MOE_TOPK not in batch or not records:
        return None
    # A sampling router (REINFORCE) draws its experts at rollout and the learner replays the draw;
    # how likely the draw still is enters the log-ratio already. Its greedy choice would differ
    # from most draws and reject most steps, so only the layers of deterministic routers count.
    layers = [i for i, r in enumerate(records) if r.selection_logp is None]
    if not layers:
        return None
    own = torch.stack([records[i].router_top_k for i in layers], 1)
    return routing_disagreement(batch[MOE_TOPK][:, layers], own, settings.routing_rs, settings.routing_rs_share)


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
            # PPO's KL penalty (and its adaptive coefficient) measures against these logits: the
            # proximal policy's, like the ratio, not the rollout copy's (its mismatch is the IS/RS's).
            b[Columns.ACTION_DIST_INPUTS] = fwd[Columns.ACTION_DIST_INPUTS]
            b[Postprocessing.ADVANTAGES] = b[Postprocessing.ADVANTAGES] * weights
            b[IS_WEIGHT] = weights
            b[Columns.LOSS_MASK] = keep
            if metrics is not None:
                metrics.log_dict(figures, key=module_id, window=1)
        return batch


class SkippedSteps:
    """Steps where the correction kept no step of a minibatch, on any learner. PPO's masked mean
    over nothing is 0/0, and an optimizer step there would move the weights on the router's aux
    losses and Adam's momentum alone while the policy learns nothing: the learner skips it.

    minibatch(mid, kept)   this learner's kept rows of the minibatch (from the loss)
    anything_kept(mid)     at the step: collective over the learners (every learner calls it once
                           per step, in the same order), so all of them skip together
    end_update(mid)        once per update: the figures (lifetime counters, checkpointed)
    """

    def __init__(self):
        self._kept: Dict[str, int] = {}
        self._update: Dict[str, List[int]] = {}   # this update's [judged steps, skipped steps]
        self.counts: Dict[str, Dict[str, int]] = {}
        self.last: Dict[str, Dict[str, int]] = {}   # the last update's figures (the sync gate reads them)

    def minibatch(self, module_id: str, kept: int) -> int:
        self._kept[module_id] = kept
        return kept

    def anything_kept(self, module_id: str) -> bool:
        kept = self._kept.pop(module_id, None)
        flags = torch.tensor([float(kept or 0), float(kept is not None)], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            on_wire = flags.cuda() if dist.get_backend() == "nccl" else flags   # NCCL takes GPU tensors only
            dist.all_reduce(on_wire)
            flags = on_wire.cpu()
        if flags[1] == 0:   # the module had no rows in this minibatch on any learner: nothing to judge
            return True
        update = self._update.setdefault(module_id, [0, 0])
        update[0] += 1
        update[1] += int(flags[0] == 0)
        return bool(flags[0] > 0)

    def end_update(self, module_id: str, warn: bool = False) -> Dict[str, float]:
        steps, skipped = self._update.pop(module_id, [0, 0])
        c = self.counts.setdefault(module_id, {"skipped_steps": 0, "skipped_updates": 0, "in_a_row": 0})
        c["skipped_steps"] += skipped
        everything = bool(steps) and skipped == steps
        if steps:
            c["skipped_updates"] += everything
            c["in_a_row"] = c["in_a_row"] + 1 if everything else 0
        self.last[module_id] = {"steps": steps, "skipped": skipped, **c}
        if everything and warn:   # with the sync gate on, its check says it (cause all_rejected)
            logger.warning("moe-rl: %s: the rollout correction kept no step of this update (%d in a row), so "
                           "it was skipped; loosen consistency.correction or find the mismatch (correction/k3)",
                           module_id, c["in_a_row"])
        return {"correction/skipped_steps": float(c["skipped_steps"]),
                "correction/skipped_updates": float(c["skipped_updates"]),
                "correction/skipped_updates_in_a_row": float(c["in_a_row"])}

    def get_state(self) -> Dict[str, Any]:
        return {mid: dict(c) for mid, c in self.counts.items()}

    def set_state(self, state: Dict[str, Any]) -> None:
        self.counts = {mid: {k: int(v) for k, v in c.items()} for mid, c in state.items()}

"""Partial routing replay (`moe.routing_replay: mismatched`, and `auto` with a bf16 rollout copy),
as a learner connector after GAE.

Full replay (R3) pins every token to the rollout's experts for the whole update. That removes the
training-inference routing mismatch, but over many optimizer steps per rollout (PPO: epochs x
minibatches) the router keeps learning while the dispatch cannot follow it, and the next rollout
routes elsewhere than PPO trained (the quickstart at 6 epochs learns at 80 % of no replay).

Here the learner's own pre-update forward — at the rollout's weights, replaying, so every layer
sees the rollout's inputs — says which tokens its router would send elsewhere: exactly the ones
a numeric difference flipped (a bf16 rollout copy). Only those are replayed for this update; the
rest (all of them in fp32) follow the router as it learns, as without replay. At the rollout's
weights the trainer therefore computes the rollout's policy, as under full replay.
"""
from __future__ import annotations

import torch
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.columns import Columns

from moe_rl.core.routing import OWN_CHOICE, layer_disagreement
from moe_rl.core.stability import expert_dropout_off
from moe_rl.rllib.rl_module import MOE_REPLAY, MOE_ROUTING, MOE_TOPK, MoEPolicyModule


class MismatchedReplay(ConnectorV2):
    def __call__(self, *, rl_module, batch, episodes, explore=None, shared_data=None, metrics=None, **kwargs):
        for module_id, b in batch.items():
            module = rl_module[module_id]
            module = module.unwrapped() if hasattr(module, "unwrapped") else module
            if not isinstance(module, MoEPolicyModule) or module.replay_mode != "mismatched" \
                    or MOE_TOPK not in b:
                continue
            b.pop(MOE_REPLAY, None)
            with torch.no_grad(), expert_dropout_off(module):
                records = module.forward_train(b)[MOE_ROUTING]   # a full replay at the rollout's weights
            recorded = b[MOE_TOPK].long()
            # RLlib's bootstrap steps (LOSS_MASK False) have no recorded routing and no loss.
            in_loss = b[Columns.LOSS_MASK].bool() if Columns.LOSS_MASK in b else torch.ones(len(recorded), dtype=bool)
            flipped = layer_disagreement(recorded, torch.stack([r.router_top_k for r in records], 1))
            flipped &= in_loss[:, None]
            b[MOE_REPLAY] = torch.where(flipped[..., None], recorded, torch.full_like(recorded, OWN_CHOICE))
            if metrics is not None:   # the share of the (step, layer) pairs in the loss
                share = flipped.sum().item() / max(1, int(in_loss.sum()) * flipped.shape[1])
                metrics.log_value((module_id, "replay/replayed_fraction"), share, window=1)
        return batch

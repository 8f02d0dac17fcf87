"""MoEAPPOModule: the MoE policy with RLlib's TargetNetworkAPI, as APPO's loss needs it.

APPO's surrogate is clipped against an *old* policy, a target copy of the policy trunk and head
that RLlib's APPOLearner moves towards the trained one every `target_network_update_freq`
updates. The copies sit under `_target_*` attributes (moe_rl.core.param_groups.TARGET_PREFIX):
no optimizer group, balance step, dormancy probe or rollout copy ever sees them.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from ray.rllib.core.rl_module.apis import TARGET_NETWORK_ACTION_DIST_INPUTS, TargetNetworkAPI

from moe_rl.core.stability import expert_dropout_off
from moe_rl.rllib.rl_module import MoEPolicyModule


def make_target_network(net: torch.nn.Module) -> torch.nn.Module:
    """RLlib's make_target_network (a deep copy, not trainable), sharing what a copy cannot hold: an
    expert-parallel layer's process groups (DeepSpeed's learner), so the target's experts talk to
    the same ranks as the trained ones."""
    groups = {} if not dist.is_available() else {
        id(v): v for m in net.modules() for v in vars(m).values() if isinstance(v, dist.ProcessGroup)}
    target = copy.deepcopy(net, groups)
    for p in target.parameters():
        p.requires_grad = False
    return target


class MoEAPPOModule(MoEPolicyModule, TargetNetworkAPI):
    def make_target_networks(self) -> None:
        self._target_trunk = make_target_network(self.trunk)
        self._target_pi = make_target_network(self.pi)

    def get_target_network_pairs(self):
        return [(self.trunk, self._target_trunk), (self.pi, self._target_pi)]

    def forward_target(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """The old policy's action-dist inputs, routed as the trained trunk routes (the rollout's
        top-k under routing replay), with no expert dropout: a fixed reference, not a sample."""
        with torch.no_grad(), expert_dropout_off(self._target_trunk):
            logits, _ = self._policy(batch, self._training_replay(batch), trunk=self._target_trunk,
                                     pi=self._target_pi)
        return {TARGET_NETWORK_ACTION_DIST_INPUTS: logits}

    def get_non_inference_attributes(self) -> List[str]:
        return super().get_non_inference_attributes() + ["_target_trunk", "_target_pi"]

"""The trainer's view of rollout data: the learner group's own forward (forward_train: the real
training path — DeepSpeed layers, trainer dtype, trainer gating — with no gradient) on a sample of
what the rollouts just recorded. A plain-torch copy elsewhere would compute what the rollout
copy computes, so these numbers must come from the learners themselves.
"""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch
import tree
from ray.rllib.core.columns import Columns

from moe_rl.rl_module import MOE_TOPK

MODULE_ID = "default_policy"


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def view_on_learner(learner, slices: List[Dict[str, Any]], replay: bool = False) -> Dict[str, np.ndarray]:
    """Runs on one learner: forward_train on this rank's slice -> logp of the taken actions,
    action-distribution inputs and top-k per MoE layer."""
    data = slices[min(_rank(), len(slices) - 1)]
    module = learner.module[MODULE_ID]
    module = module.unwrapped() if hasattr(module, "unwrapped") else module
    batch = {Columns.OBS: tree.map_structure(torch.as_tensor, data["obs"])}
    if replay and "topk" in data:
        batch[MOE_TOPK] = torch.as_tensor(data["topk"])
    with torch.no_grad():
        out = module.forward_train(batch)
        logits = out[Columns.ACTION_DIST_INPUTS]
        out_np = {"logits": logits.float().numpy(), "topk": out[MOE_TOPK].numpy().astype(np.int16)}
        if "actions" in data:
            dist = module.get_train_action_dist_cls().from_logits(logits)
            out_np["logp"] = dist.logp(torch.as_tensor(data["actions"])).double().numpy()
    return out_np


def trainer_view(learner_group, data: Dict[str, Any], replay: bool = False) -> Dict[str, np.ndarray]:
    """data: {"obs", optional "actions", optional "topk"} (numpy, batch-major). The DeepSpeed group
    splits it over its learners (every rank must run the collective forward); RLlib's group runs it
    on its (first) learner."""
    if getattr(learner_group, "is_local", False):
        return view_on_learner(learner_group._learner, [data], replay)
    if hasattr(learner_group, "publish_weights"):
        n = len(learner_group)
        size = len(data["actions"]) if "actions" in data else len(tree.flatten(data["obs"])[0])
        bounds = np.linspace(0, size, n + 1).astype(int)
        slices = [tree.map_structure(lambda x: x[bounds[i]:bounds[i + 1]], data) for i in range(n)]
        parts = learner_group.foreach_learner(view_on_learner, slices=slices, replay=replay)
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return learner_group.foreach_learner(view_on_learner, slices=[data], replay=replay)[0]

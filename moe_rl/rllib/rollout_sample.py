"""The rollout side of a check: a sample of the steps the rollout actors recorded, read from
RLlib's episodes (single- or multi-agent) with what the inference copy logged per step."""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import tree
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from moe_rl.rllib.rl_module import MOE_TOPK


def _single_agent_episodes(episodes, default_module: str):
    """(module id, single-agent episode) of every agent in a batch of (multi-agent) episodes."""
    for ep in episodes:
        if isinstance(ep, MultiAgentEpisode):
            for sa in ep.agent_episodes.values():
                yield sa.module_id, sa
        else:
            yield default_module, ep


def rollout_sample(episodes, size: int, seed: int, modules=None,
                   default_module: str = DEFAULT_MODULE_ID) -> Dict[str, Dict[str, Any]]:
    """Up to `size` recorded steps per MoE module (uniformly over its steps): obs, actions, the
    rollout's log-probs and top-k, the weights version of each step, and the position for
    token-sequence observations. `modules`: the MoE module ids (None: every module)."""
    parts: Dict[str, list] = {}
    for mid, ep in _single_agent_episodes(episodes, default_module):
        n = len(ep)
        if n and (modules is None or mid in modules):
            parts.setdefault(mid, []).append({
                "obs": ep.get_observations(slice(0, n)), "actions": np.asarray(ep.get_actions(slice(0, n))),
                "logp": ep.get_extra_model_outputs(Columns.ACTION_LOGP, slice(0, n)),
                "topk": ep.get_extra_model_outputs(MOE_TOPK, slice(0, n)),
                "seq": ep.get_extra_model_outputs(WEIGHTS_SEQ_NO, slice(0, n))})
    out = {}
    for i, (mid, ps) in enumerate(sorted(parts.items())):
        data = tree.map_structure(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *ps)
        total = len(data["actions"])
        pick = np.sort(np.random.default_rng(seed + 7919 * i).choice(total, size=min(size, total), replace=False))
        data = tree.map_structure(lambda x: x[pick], data)
        data["logp"] = data["logp"].astype(np.float64)
        obs = data["obs"]
        data["positions"] = (np.asarray(obs["position"]).reshape(-1) if isinstance(obs, dict) and "position" in obs
                             else None)
        out[mid] = data
    return out

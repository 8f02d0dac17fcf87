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

from moe_rl.rllib.rl_module import MOE_COMBINE, MOE_Q, MOE_TOPK


def _single_agent_episodes(episodes, default_module: str):
    """(module id, single-agent episode) of every agent in a batch of (multi-agent) episodes."""
    for ep in episodes:
        if isinstance(ep, MultiAgentEpisode):
            for sa in ep.agent_episodes.values():
                yield sa.module_id, sa
        else:
            yield default_module, ep


# What a rollout copy records per step, by the name the check reads it under: the log-prob of the
# taken action (a categorical policy), the Q-values (a Q-policy), the routing (sparse top-k or soft
# combine shares), the weights version.
RECORDED = {"logp": Columns.ACTION_LOGP, "q": MOE_Q, "topk": MOE_TOPK, "combine": MOE_COMBINE, "seq": WEIGHTS_SEQ_NO}


def rollout_sample(episodes, size: int, seed: int, modules=None,
                   default_module: str = DEFAULT_MODULE_ID) -> Dict[str, Dict[str, Any]]:
    """Up to `size` recorded steps per MoE module (uniformly over its steps): obs, actions, what
    the rollout copy recorded (log-probs or Q-values, `routing`), the weights version of each step
    (`seq`), and the position for token-sequence observations. `modules`: the MoE module ids
    (None: every module)."""
    parts: Dict[str, list] = {}
    for mid, ep in _single_agent_episodes(episodes, default_module):
        n = len(ep)
        if n and (modules is None or mid in modules):
            part = {"obs": ep.get_observations(slice(0, n)), "actions": np.asarray(ep.get_actions(slice(0, n)))}
            for name, column in RECORDED.items():
                if column in ep.extra_model_outputs:
                    part["routing" if name in ("topk", "combine") else name] = ep.get_extra_model_outputs(
                        column, slice(0, n))
            parts.setdefault(mid, []).append(part)
    out = {}
    for i, (mid, ps) in enumerate(sorted(parts.items())):
        data = tree.map_structure(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *ps)
        total = len(data["actions"])
        pick = np.sort(np.random.default_rng(seed + 7919 * i).choice(total, size=min(size, total), replace=False))
        data = tree.map_structure(lambda x: x[pick], data)
        if "logp" in data:
            data["logp"] = data["logp"].astype(np.float64)
        obs = data["obs"]
        data["positions"] = (np.asarray(obs["position"]).reshape(-1) if isinstance(obs, dict) and "position" in obs
                             else None)
        out[mid] = data
    return out

"""Drop episodes that carry NaN or Inf in observations or rewards before they reach a learner.

A broken sensor or reward function must cost its samples, not the weights: one non-finite reward
turns every GAE advantage of its episode non-finite, and from there the PPO loss. The whole episode
chunk goes (its advantages are all tainted), and the count goes to the metrics.
"""
from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np


def _finite(x: Any) -> bool:
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    a = np.asarray(x)
    return not np.issubdtype(a.dtype, np.floating) or bool(np.isfinite(a).all())


def episode_is_finite(episode) -> bool:
    """Every agent's rewards and observations finite (a multi-agent episode: each agent's own)."""
    agents = getattr(episode, "agent_episodes", None)
    if agents is not None:
        return all(episode_is_finite(sa) for sa in agents.values())
    return _finite(episode.get_rewards()) and _finite(episode.get_observations())


def drop_nonfinite(episodes: List) -> Tuple[List, int, int]:
    """-> (finite episodes, episodes dropped, env steps dropped)."""
    kept, dropped, steps = [], 0, 0
    for ep in episodes:
        if episode_is_finite(ep):
            kept.append(ep)
        else:
            dropped += 1
            steps += len(ep)
    return kept, dropped, steps

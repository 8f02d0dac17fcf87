"""Gymnasium environments for MoE-RL (gymnasium + numpy only). Importing registers them."""
import gymnasium

from envs.multitask import MultiTaskEnv
from envs.token_sequence import TokenSequenceEnv

__all__ = ["MultiTaskEnv", "TokenSequenceEnv"]

_ENTRY_POINTS = {
    "moe_rl/MultiTask-v0": "envs.multitask:MultiTaskEnv",
    "moe_rl/TokenSequence-v0": "envs.token_sequence:TokenSequenceEnv",
}

# Guarded: re-importing (importlib.reload, Ray workers that import twice) must not warn or fail.
for _env_id, _entry_point in _ENTRY_POINTS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(id=_env_id, entry_point=_entry_point)

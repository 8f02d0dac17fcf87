"""Gymnasium environments for MoE-RL (gymnasium + numpy; minigrid, imported when a MiniGrid env is made).
Importing registers them, and MinAtar's five games (`MinAtar/Breakout-v1`, ...: minatar's own
gymnasium ids; -v1 the minimal action set, -v0 the full one; 10x10xC boolean images)."""
import gymnasium

from moe_rl.envs.minigrid_mt import MultiTaskMiniGrid
from moe_rl.envs.multitask import MultiTaskEnv
from moe_rl.envs.token_sequence import TokenSequenceEnv

__all__ = ["MultiTaskEnv", "MultiTaskMiniGrid", "TokenSequenceEnv"]

_ENTRY_POINTS = {
    "moe_rl/MultiTask-v0": ("moe_rl.envs.multitask:MultiTaskEnv", {}),
    "moe_rl/TokenSequence-v0": ("moe_rl.envs.token_sequence:TokenSequenceEnv", {}),
    # Multi-task MiniGrid (MOORE's suites; MiniGrid-MT-v0 takes env_config {tasks: [...]}).
    "moe_rl/MiniGrid-MT-v0": ("moe_rl.envs.minigrid_mt:MultiTaskMiniGrid", {}),
    "moe_rl/MiniGrid-MT3-v0": ("moe_rl.envs.minigrid_mt:MultiTaskMiniGrid", {"tasks": "MT3"}),
    "moe_rl/MiniGrid-MT5-v0": ("moe_rl.envs.minigrid_mt:MultiTaskMiniGrid", {"tasks": "MT5"}),
    "moe_rl/MiniGrid-MT7-v0": ("moe_rl.envs.minigrid_mt:MultiTaskMiniGrid", {"tasks": "MT7"}),
}

# Guarded: re-importing (importlib.reload, Ray workers that import twice) must not warn or fail.
for _env_id, (_entry_point, _kwargs) in _ENTRY_POINTS.items():
    if _env_id not in gymnasium.registry:
        gymnasium.register(id=_env_id, entry_point=_entry_point, kwargs=_kwargs)

try:   # minatar is a dependency; its games register themselves under MinAtar/
    from minatar import gym as _minatar_gym
except ImportError:   # pragma: no cover - a trimmed install without it
    _minatar_gym = None
if _minatar_gym is not None and "MinAtar/Breakout-v1" not in gymnasium.registry:
    _minatar_gym.register_envs()

"""moe-rl: train Mixture-of-Experts policies stably with RL on Ray.

Layers (imports point down): moe_rl.core (pure torch) <- moe_rl.rllib (RLlib plug-ins) <- actors
(Ray actors) <- moe_rl.algo (MoEPPOConfig, MoEPPO, MoEAPPOConfig, MoEAPPO, MoEDQNConfig, MoEDQN) <- moe_rl.app
(CLI, run directory, reports).
The algorithm's names load lazily here, so `import moe_rl.core.layer` never imports Ray.
"""
import importlib

__version__ = "0.1.0"

_LAZY = {"MoEPPOConfig": "moe_rl.algo.algorithm", "MoEPPO": "moe_rl.algo.algorithm",
         "MoEAPPOConfig": "moe_rl.algo.appo", "MoEAPPO": "moe_rl.algo.appo",
         "MoEDQNConfig": "moe_rl.algo.dqn", "MoEDQN": "moe_rl.algo.dqn",
         "MoEPolicyModule": "moe_rl.rllib.rl_module"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_rl' has no attribute {name!r}")


__all__ = list(_LAZY)

"""moe-rl: train Mixture-of-Experts policies stably with RL on Ray.

The core modules (moe, losses, metrics, consistency) are pure torch. Ray-facing names
(MoEPPOConfig, MoEPPO) load lazily so `import moe_rl.core.layer` never imports Ray.
"""
__version__ = "0.1.0"

_LAZY = {"MoEPPOConfig": "moe_rl.algo.algorithm", "MoEPPO": "moe_rl.algo.algorithm",
         "MoEPolicyModule": "moe_rl.rllib.rl_module"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moe_rl' has no attribute {name!r}")


__all__ = list(_LAZY)

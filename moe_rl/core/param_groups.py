"""Parameter groups by module path (pure python): tensors have no `.name`, their paths do.

The stability toolkit gives each group its own LR schedule and clip; the sync gate measures the
update size per group.
"""
from __future__ import annotations

PARAM_GROUPS = ("router", "shared_expert", "experts", "policy_head", "value_head", "other")
# A module's target networks (APPO's old policy) sit under attributes with this prefix: RLlib's
# Polyak copies move them, never the optimizer, and they are no rollout's weights.
TARGET_PREFIX = "_target_"


def is_target(name: str) -> bool:
    return name.split(".", 1)[0].startswith(TARGET_PREFIX)


def without_targets(state: dict) -> dict:
    return {k: v for k, v in state.items() if not is_target(k)}


def trained_modules(module):
    """Every submodule of `module` outside its target networks."""
    return [m for name, m in module.named_modules() if not is_target(name)]


def param_group(name: str) -> str:
    if ".router." in name or ".gate.router." in name:
        return "router"
    if ".shared_expert." in name:
        return "shared_expert"
    if ".experts." in name:
        return "experts"
    if name.startswith(("pi.", "log_std")):
        return "policy_head"
    if name.startswith("vf."):
        return "value_head"
    return "other"

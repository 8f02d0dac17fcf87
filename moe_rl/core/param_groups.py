"""Parameter groups by the role each module declares (pure python): tensors have no `.name`, and
a parameter's path says where it sits, not what it is.

A module declares the role of all its parameters with a class attribute `PARAM_ROLE` (a Router:
"router"; Experts: "experts"), or of some of its children and parameters with `PARAM_ROLES`
({name: role}; an MoE layer names its shared expert, an RLModule its heads). A deeper declaration
wins; a parameter nobody declared is "other". The stability toolkit gives each group its own LR
schedule and clip; the sync gate measures the update size per group.
"""
from __future__ import annotations

from typing import Dict

PARAM_GROUPS = ("router", "shared_expert", "experts", "policy_head", "value_head", "q_head", "other")

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


def param_roles(module) -> Dict[str, str]:
    """{parameter name: group} of `module`, target networks included (the caller leaves those out)."""
    roles: Dict[str, str] = {}

    def visit(m, prefix: str, inherited: str) -> None:
        own = getattr(m, "PARAM_ROLES", {})
        for name, _ in m.named_parameters(recurse=False):
            roles[prefix + name] = own.get(name, inherited)
        for name, child in m.named_children():
            visit(child, f"{prefix}{name}.", own.get(name, getattr(child, "PARAM_ROLE", inherited)))

    visit(module, "", getattr(module, "PARAM_ROLE", "other"))
    return roles

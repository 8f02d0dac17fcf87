"""Parameter groups by module path (pure python): tensors have no `.name`, their paths do.

The stability toolkit gives each group its own LR schedule and clip; the sync gate measures the
update size per group.
"""
from __future__ import annotations

PARAM_GROUPS = ("router", "shared_expert", "experts", "policy_head", "value_head", "other")


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

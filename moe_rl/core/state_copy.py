"""Copies of training state kept in memory (pure torch): the sync gate's last good state.

The gate snapshots the learner after every sync (weights, optimizer moments, the learner's own
state) so that a rollback can restore it exactly. At a realistic size that is three copies of the
model per iteration, so a snapshot reuses the buffers of the one before it.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

import torch
from torch import nn


def copy_state(value: Any, into: Any = None) -> Any:
    """A copy of `value` (nested dicts, lists and tuples of tensors and plain data). A tensor is
    written into the tensor at the same place in `into` (a previous copy) when shape, dtype and
    device agree, else cloned; anything else is deep-copied."""
    if isinstance(value, torch.Tensor):
        if (isinstance(into, torch.Tensor) and into.shape == value.shape and into.dtype == value.dtype
                and into.device == value.device):
            return into.copy_(value.detach())
        return value.detach().clone()
    if isinstance(value, dict):
        into = into if isinstance(into, dict) else {}
        return {k: copy_state(v, into.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(copy_state(v, b) for v, b in zip(value, into))
    return copy.deepcopy(value)


def keep_state(modules: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer], extra: Any,
               into: Optional[dict] = None) -> dict:
    """The exact training state, copied (into the buffers of `into`, the previous one): every
    module's weights, every optimizer's state (moments, step counts, param groups) and `extra`."""
    return copy_state({"weights": {k: m.state_dict() for k, m in modules.items()},
                       "optimizers": {k: o.state_dict() for k, o in optimizers.items()}, "extra": extra}, into)


def restore_state(kept: dict, modules: Mapping[str, nn.Module], optimizers: Mapping[str, torch.optim.Optimizer]) -> Any:
    """Load what keep_state copied back into the modules (in place) and optimizers -> a copy of its
    `extra` for the caller to apply. The kept copy stays intact for the next restore."""
    with torch.no_grad():
        for k, m in modules.items():
            for name, v in m.state_dict().items():
                v.copy_(kept["weights"][k][name])
    for k, o in optimizers.items():
        # A copy: load_state_dict keeps the tensors it is given, which the next steps update in place.
        o.load_state_dict(copy_state(kept["optimizers"][k]))
    return copy_state(kept["extra"])

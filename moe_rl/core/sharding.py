"""Expert-parallel name mapping and shard assembly (pure python/torch: no Ray, no DeepSpeed).

A learner with expert-parallel rank r holds num_local = N / ep_size experts of every MoE layer,
stored by DeepSpeed under local indices. The rollout copy (a plain MoEPolicyModule) names experts
globally. Global index = r * num_local + local index (DeepSpeed's own checkpoint convention).

    learner:  trunk.blocks.0.moe.ds.deepspeed_moe.experts.deepspeed_experts.1.fc1.weight   (rank 1, 2 local)
    global:   trunk.blocks.0.moe.experts.experts.3.fc1.weight
    learner:  trunk.blocks.0.moe.ds.deepspeed_moe.gate.router.gate.weight
    global:   trunk.blocks.0.moe.router.gate.weight
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, Mapping, Optional

_EXPERT = re.compile(r"^(.*)\.moe\.ds\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.*)$")
_ROUTER = re.compile(r"^(.*)\.moe\.ds\.deepspeed_moe\.gate\.router\.(.*)$")
_GLOBAL_EXPERT = re.compile(r"^(.*)\.moe\.experts\.experts\.(\d+)\.(.*)$")


def is_expert_param(name: str) -> bool:
    return bool(_EXPERT.match(name) or _GLOBAL_EXPERT.match(name))


def to_global_name(name: str, ep_rank: int, num_local: int) -> str:
    """Learner (DeepSpeed, local expert index) name -> rollout-copy (global) name."""
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.moe.experts.experts.{ep_rank * num_local + int(m.group(2))}.{m.group(3)}"
    m = _ROUTER.match(name)
    if m:
        return f"{m.group(1)}.moe.router.{m.group(2)}"
    return name


def to_local_name(name: str, ep_rank: int, num_local: int):
    """Global name -> learner name, or None if the expert lives on another expert-parallel rank."""
    m = _GLOBAL_EXPERT.match(name)
    if m:
        e = int(m.group(2))
        if e // num_local != ep_rank:
            return None
        return f"{m.group(1)}.moe.ds.deepspeed_moe.experts.deepspeed_experts.{e % num_local}.{m.group(3)}"
    m = re.match(r"^(.*)\.moe\.router\.(.*)$", name)
    if m:
        return f"{m.group(1)}.moe.ds.deepspeed_moe.gate.router.{m.group(2)}"
    return name


class ShardError(ValueError):
    """Shards that do not assemble into exactly the expected full state."""


def assemble_all(shards: Iterable[Mapping]) -> Dict:
    """assemble_shards when the shards themselves define the key set (duplicates still checked)."""
    shards = list(shards)
    return assemble_shards(shards, set().union(*shards))


def assemble_shards(shards: Iterable[Mapping], expected_keys: Iterable[str]) -> Dict:
    """Merge per-learner shards (global names) into one full state.

    Every expected key must come from exactly one shard (dense tensors from the first shard
    that carries them); unknown keys and missing keys are errors, never silently dropped.
    """
    expected = set(expected_keys)
    full: Dict = {}
    for shard in shards:
        for k, v in shard.items():
            if k not in expected:
                raise ShardError(f"shard key {k!r} is not a parameter of the rollout module")
            if k in full and is_expert_param(k):
                raise ShardError(f"expert tensor {k!r} arrived from two shards: wrong expert mapping")
            full.setdefault(k, v)
    missing = sorted(expected - set(full))
    if missing:
        raise ShardError(f"{len(missing)} tensors missing after assembly, e.g. {missing[0]!r}")
    return full


def assemble_modules(shards: Iterable[Mapping[str, Mapping]],
                     expected: Optional[Mapping[str, Iterable[str]]] = None) -> Dict[str, Dict]:
    """Per-module assembly of module-keyed shards ({module_id: {global name: tensor}} each):
    {module_id: full state}. `expected` (module_id -> key set) makes it strict against a module;
    without it the shards define the keys. A module missing from every shard is an error."""
    shards = list(shards)
    modules = set().union(*(s.keys() for s in shards)) if shards else set()
    if expected is not None:
        missing = sorted(set(expected) - modules)
        if missing:
            raise ShardError(f"module {missing[0]!r} missing from every shard")
        modules = set(expected)
    out = {}
    for mid in sorted(modules):
        parts = [s[mid] for s in shards if mid in s]
        out[mid] = assemble_shards(parts, expected[mid]) if expected is not None else assemble_all(parts)
    return out

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

import numpy as np
import torch

_EXPERT = re.compile(r"^(.*)\.moe\.ds\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.*)$")
_STACKED = re.compile(r"^(.*\.moe\.experts)\.(w1|b1|w2|b2)$")
_ROUTER = re.compile(r"^(.*)\.moe\.ds\.deepspeed_moe\.gate\.router\.(.*)$")
_GLOBAL_EXPERT = re.compile(r"^(.*)\.moe\.experts\.experts\.(\d+)\.(.*)$")


def is_expert_param(name: str) -> bool:
    return bool(_EXPERT.match(name) or _GLOBAL_EXPERT.match(name) or _STACKED.match(name))


# --- the stacked experts of a core MoE layer <-> their canonical per-expert form ---------------------
# experts.w1 [N, F, d] <-> experts.experts.{e}.fc1.weight [F, d] (nn.Linear's layout, as DeepSpeed's
# per-expert modules hold it), b1 [N, F] <-> fc1.bias, w2 [N, F, d] <-> fc2.weight [d, F], b2 <-> fc2.bias.
_CANONICAL = {"w1": ("fc1.weight", False), "b1": ("fc1.bias", False), "w2": ("fc2.weight", True),
              "b2": ("fc2.bias", False)}
_FROM_CANONICAL = {v[0]: (k, v[1]) for k, v in _CANONICAL.items()}


def _canonical_items(state: Mapping, sources: bool = False):
    """(canonical name, value, transpose) per entry: a stacked expert tensor as its N pieces
    (transpose: whether the canonical layout is the piece transposed), every other entry as is
    (transpose None). sources: the entry's own name last."""
    for name, value in state.items():
        m = _STACKED.match(name)
        if not m:
            yield (name, value, None, name) if sources else (name, value, None)
            continue
        suffix, transpose = _CANONICAL[m.group(2)]
        for e in range(value.shape[0]):
            canonical = f"{m.group(1)}.experts.{e}.{suffix}"
            yield (canonical, value[e], transpose, name) if sources else (canonical, value[e], transpose)


def unstack_experts(state: Mapping) -> Dict:
    """Stacked expert tensors -> their canonical per-expert entries (torch or numpy, copies made
    contiguous); every other entry as is."""
    out: Dict = {}
    for name, piece, transpose in _canonical_items(state):
        if transpose is None:
            out[name] = piece
        elif isinstance(piece, torch.Tensor):
            out[name] = (piece.transpose(0, 1) if transpose else piece).contiguous()
        else:
            out[name] = np.ascontiguousarray(piece.T if transpose else piece)
    return out


def canonical_views(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Like unstack_experts, but views into the (torch) tensors, never copies: writing a view
    writes the module's own storage (a collective sync receives into them)."""
    return {name: view for name, _, view in canonical_view_items(state)}


def canonical_view_items(state: Mapping[str, torch.Tensor]):
    """(canonical name, the entry's own name, view) per canonical entry (see canonical_views)."""
    for name, piece, transpose, source in _canonical_items(state, sources=True):
        yield name, source, (piece.transpose(0, 1) if transpose else piece)


def stack_experts(state: Mapping, stacked_names: Optional[Iterable[str]] = None) -> Dict:
    """Canonical per-expert entries -> the stacked tensors named in `stacked_names` (those a core
    module holds; None: every layer the entries name); every other entry as is. Strict: each
    stacked tensor needs all its experts."""
    if stacked_names is None:
        stacked_names = {f"{m.group(1)}.moe.experts.{_FROM_CANONICAL[m.group(3)][0]}"
                         for m in map(_GLOBAL_EXPERT.match, state) if m and m.group(3) in _FROM_CANONICAL}
    wanted = {n for n in stacked_names if _STACKED.match(n)}
    if not wanted:
        return dict(state)
    pieces: Dict[str, Dict[int, object]] = {}
    out: Dict = {}
    for name, value in state.items():
        m = _GLOBAL_EXPERT.match(name)
        key = None
        if m and m.group(3) in _FROM_CANONICAL:
            key = f"{m.group(1)}.moe.experts.{_FROM_CANONICAL[m.group(3)][0]}"
        if key in wanted:
            pieces.setdefault(key, {})[int(m.group(2))] = value
        else:
            out[name] = value
    for key in sorted(wanted):
        got = pieces.get(key, {})
        if not got or sorted(got) != list(range(len(got))):
            raise ShardError(f"{key}: experts {sorted(got)} do not make a complete stack")
        transpose = _CANONICAL[key.rsplit(".", 1)[1]][1]
        parts = [got[e] for e in range(len(got))]
        if isinstance(parts[0], torch.Tensor):
            out[key] = torch.stack([p.transpose(0, 1) if transpose else p for p in parts])
        else:
            out[key] = np.stack([np.asarray(p).T if transpose else np.asarray(p) for p in parts])
    return out


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

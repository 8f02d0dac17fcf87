"""Multi-agent runs: several policies, each an MoE (with its own `moe` overrides) or a plain
RLlib PPO module, mapped from agent ids by pattern or by an importable function.

Run config:

    env: ray.rllib.examples.envs.classes.multi_agent:MultiAgentCartPole   # an import path, or a gym id
    env_config: {num_agents: 2}
    multi_agent:
      policies: {p0: {}, p1: {moe: {num_experts: 4}}, p2: {dense: true}}
      mapping: {"0": p0, "1": p1, ".*": p2}      # agent id (a full-match regex, first match wins)
      # mapping_fn: mypkg.policies:map_agent     # or an importable policy_mapping_fn

Every MoE module goes through the whole path (routing records, trainer view, drift per module,
rollout correction, the expert-parallel learner group, the sharded sync, checkpoints); the gate
decides for the run as a whole: the weights of every module travel in one sync, so a bad update in
any module holds or rolls back all of them (the ledger names the module).
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Dict

from ray.rllib.algorithms.ppo.ppo_catalog import PPOCatalog
from ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module import DefaultPPOTorchRLModule
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from moe_rl.core.errors import ConfigError
from moe_rl.core.sections import plain
from moe_rl.core.settings import validate_moe


def import_path(path: str, field: str) -> Any:
    """`package.module:attribute` -> the object (ConfigError naming `field` if it does not import)."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{field}: must be an importable 'package.module:name', got {path!r} ({e})") from None


class PatternMapping:
    """policy_mapping_fn from {agent-id regex: policy}: the first full match wins (picklable, so
    every rollout actor gets it)."""

    def __init__(self, patterns: Dict[str, str]):
        self.patterns = dict(patterns)
        self._compiled = [(re.compile(p), m) for p, m in self.patterns.items()]

    def __call__(self, agent_id, episode=None, **kwargs) -> str:
        for rx, module in self._compiled:
            if rx.fullmatch(str(agent_id)):
                return module
        raise ValueError(f"agent {agent_id!r} matches no multi_agent.mapping pattern {list(self.patterns)}")

    def __reduce__(self):
        return PatternMapping, (self.patterns,)


def validate_multi_agent(section: Dict[str, Any], moe: Dict[str, Any], num_learners: int,
                         trust_code: bool = True) -> Dict[str, Any]:
    """Check the section; returns {policies: {id: {dense, moe}}, mapping_fn: callable}. trust_code
    false (a run directory's config.yaml, which may come from anyone): a mapping_fn is refused
    before anything is imported, since naming code in a file is running it."""
    if not isinstance(section, dict) or set(section) - {"policies", "mapping", "mapping_fn"}:
        bad = sorted(set(section) - {"policies", "mapping", "mapping_fn"}) if isinstance(section, dict) else section
        raise ConfigError(f"multi_agent: must be a mapping with policies and mapping (or mapping_fn), got {bad!r}")
    policies = section.get("policies")
    if not isinstance(policies, dict) or not policies:
        raise ConfigError(f"multi_agent.policies: must be a non-empty mapping policy -> settings, got {policies!r}")
    out = {}
    for pid, spec in policies.items():
        spec = spec or {}
        if not isinstance(spec, dict) or set(spec) - {"dense", "moe"} or (spec.get("dense") and "moe" in spec):
            raise ConfigError(f"multi_agent.policies.{pid}: must be {{}}, {{moe: {{...}}}} or {{dense: true}}, "
                              f"got {spec!r}")
        settings = None
        if not spec.get("dense"):
            try:
                settings = validate_moe({**plain(moe), **(spec.get("moe") or {})}, num_learners=num_learners)
            except ConfigError as e:
                raise ConfigError(f"multi_agent.policies.{pid}.{e}") from None
        out[str(pid)] = {"dense": bool(spec.get("dense")), "moe": settings}
    if ("mapping" in section) == ("mapping_fn" in section):
        raise ConfigError("multi_agent.mapping: give either mapping (agent-id pattern -> policy) or mapping_fn")
    if "mapping" in section:
        mapping = section["mapping"]
        if not isinstance(mapping, dict) or not mapping:
            raise ConfigError(f"multi_agent.mapping: must be a mapping agent-id pattern -> policy, got {mapping!r}")
        for pattern, pid in mapping.items():
            if str(pid) not in out:
                raise ConfigError(f"multi_agent.mapping.{pattern}: must name a policy from {sorted(out)}, got {pid!r}")
            try:
                re.compile(str(pattern))
            except re.error as e:
                raise ConfigError(f"multi_agent.mapping: {pattern!r} is not a regular expression ({e})") from None
        fn: Callable = PatternMapping({str(k): str(v) for k, v in mapping.items()})
    else:
        if not trust_code:
            raise ConfigError(f"multi_agent.mapping_fn: {section['mapping_fn']!r:.200} names code to import; a run "
                              "directory's config.yaml may come from anyone: pass --trust-env-code to import it")
        fn = import_path(section["mapping_fn"], "multi_agent.mapping_fn")
        if not callable(fn):
            raise ConfigError(f"multi_agent.mapping_fn: must name a callable, got {section['mapping_fn']!r}")
    return {"policies": out, "mapping_fn": fn}


def apply_multi_agent(config, resolved: Dict[str, Any]):
    """Set RLlib's multi_agent and per-module RLModule specs on a MoEPPOConfig."""
    specs = {}
    for pid, p in resolved["policies"].items():
        specs[pid] = (RLModuleSpec(module_class=DefaultPPOTorchRLModule, catalog_class=PPOCatalog) if p["dense"]
                      else RLModuleSpec(model_config={"moe": p["moe"]}))
    config.multi_agent(policies=set(resolved["policies"]), policy_mapping_fn=resolved["mapping_fn"])
    config.rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs=specs))
    return config

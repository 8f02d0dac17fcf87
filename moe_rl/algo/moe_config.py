"""MoEConfig: what every moe-rl AlgorithmConfig adds to RLlib's (MoEPPOConfig, MoEAPPOConfig).

The MoE sections (`.moe()`, `.deepspeed()`, `.weight_sync()`, `.stability()`, `.consistency()`:
moe_rl.algo.config_builders), the MoE policy module, the learner group (RLlib's, or the DeepSpeed
expert-parallel one) and the checks of every section before any actor starts. An algorithm's
config is this mixin before RLlib's:

    class MoEPPOConfig(MoEConfig, PPOConfig): ...
"""
from __future__ import annotations

import copy
from typing import Any, Dict

from ray.rllib.core.rl_module.rl_module import RLModuleSpec

import moe_rl.envs  # noqa: F401  registers moe_rl/ gymnasium ids in every process that loads a config
from moe_rl.actors.learner_group import DeepSpeedLearnerGroup
from moe_rl.algo.config_builders import MoESections
from moe_rl.core.gate import validate_consistency
from moe_rl.core.sections import DeepSpeedSettings, plain
from moe_rl.core.settings import (
    DEEPSPEED_DEFAULTS,
    MOE_DEFAULTS,
    resolve_deepspeed,
    validate_moe,
    validate_weight_sync,
)
from moe_rl.core.stability import validate_stability
from moe_rl.rllib import ray_private
from moe_rl.rllib.learner_group import MoELearnerGroup
from moe_rl.rllib.ray_private import ModelConfigCarriesMoE
from moe_rl.rllib.rl_module import MoEPolicyModule
from moe_rl.rllib.task_metrics import TaskEpisodeMetrics


class MoEConfig(ModelConfigCarriesMoE, MoESections):
    module_class = MoEPolicyModule   # an algorithm whose loss needs more APIs names its own

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class)
        self.moe_settings: Dict[str, Any] = copy.deepcopy(MOE_DEFAULTS)
        self.deepspeed_settings: Dict[str, Any] = copy.deepcopy(DEEPSPEED_DEFAULTS)
        self.stability_settings: Dict[str, Any] = {}
        self.consistency_settings: Dict[str, Any] = {}
        self.weight_sync_settings: Dict[str, Any] = {}
        # Per-task returns, success and routing for multi-task envs (nothing for the others). A
        # user's own `.callbacks(...)` replaces it, as in RLlib: list both to keep it.
        self.callbacks_class = TaskEpisodeMetrics

    @property
    def uses_deepspeed(self) -> bool:
        """Whether the DeepSpeed expert-parallel group trains: resolved once by validate() (a config
        not yet validated resolves it from its sections as they are)."""
        ds = self.deepspeed_settings
        if isinstance(ds, DeepSpeedSettings):
            return bool(ds.enabled)
        return bool(resolve_deepspeed(ds, plain(self.moe_settings).get("ep_size", 1), self.num_learners).enabled)

    def build_learner_group(self, *, env=None, spaces=None, rl_module_spec=None, placement_group=None):
        """RLlib's LearnerGroup (as MoELearnerGroup), or the DeepSpeed expert-parallel group: both
        offer the learner-group interface of moe_rl.rllib.learner_group."""
        if not ray_private.config_is_frozen(self):   # called directly (not by build_algo): check it first
            self.validate()
        if rl_module_spec is None:
            rl_module_spec = self.get_multi_rl_module_spec(env=env, spaces=spaces)
        if not self.uses_deepspeed:
            return MoELearnerGroup(config=self.copy(), module_spec=rl_module_spec, placement_group=placement_group)
        return DeepSpeedLearnerGroup(config=self.copy(), module_spec=rl_module_spec)

    def build_learner(self, **kwargs):
        """RLlib's, after the sections are checked and typed (as build_algo does): a learner reads
        them as attributes."""
        self.validate()
        return super().build_learner(**kwargs)

    def get_default_rl_module_spec(self) -> RLModuleSpec:
        return RLModuleSpec(module_class=self.module_class)

    def validate(self) -> None:
        """Every section checked once, before any actor starts, and kept typed (frozen): the
        learners, the module, the gate and the actors get the checked sections with the config
        and read them as they are (a typed section passes its validator unchecked). Ours first:
        a user's MoE setting is named before RLlib's own checks run."""
        typed = {"moe_settings": validate_moe(self.moe_settings, num_learners=self.num_learners),
                 "stability_settings": validate_stability(self.stability_settings),
                 "consistency_settings": validate_consistency(self.consistency_settings)}
        typed["deepspeed_settings"] = resolve_deepspeed(self.deepspeed_settings, typed["moe_settings"].ep_size,
                                                        self.num_learners)
        typed["weight_sync_settings"] = validate_weight_sync(   # evaluation: its own runners
            self.weight_sync_settings, uses_deepspeed=bool(typed["deepspeed_settings"].enabled),
            num_env_runners=None if self.in_evaluation else self.num_env_runners)
        if not ray_private.config_is_frozen(self):   # a frozen config was validated before it froze
            for name, section in typed.items():
                setattr(self, name, section)
        super().validate()

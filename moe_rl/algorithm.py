"""MoE-PPO on RLlib: MoEPPOConfig (a PPOConfig) and MoEPPO (a PPO).

    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2)
              .moe(num_experts=8, top_k=2, router="topk"))
    algo = config.build_algo()
    algo.train()
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

from ray.rllib.algorithms.algorithm_config import NotProvided
from ray.rllib.algorithms.ppo import PPO, PPOConfig
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from .settings import MOE_DEFAULTS, ConfigError, validate_moe


class MoEPPOConfig(PPOConfig):
    """PPOConfig plus `.moe(...)` (the MoE policy); `.stability(...)` and `.consistency(...)` keep
    their settings for the learner group and the consistency actor."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or MoEPPO)
        self.moe_settings: Dict[str, Any] = copy.deepcopy(MOE_DEFAULTS)
        self.stability_settings: Dict[str, Any] = {}
        self.consistency_settings: Dict[str, Any] = {}

    def moe(self, **kwargs) -> "MoEPPOConfig":
        """Set `moe.*` keys (see moe_rl.settings.MOE_DEFAULTS for every key and its default)."""
        unknown = sorted(set(kwargs) - set(MOE_DEFAULTS))
        if unknown:
            raise ConfigError(f"moe.{unknown[0]}: unknown key, allowed: {', '.join(sorted(MOE_DEFAULTS))}")
        self.moe_settings.update({k: v for k, v in kwargs.items() if v is not NotProvided})
        return self

    def stability(self, **kwargs) -> "MoEPPOConfig":
        self.stability_settings.update(kwargs)
        return self

    def consistency(self, **kwargs) -> "MoEPPOConfig":
        self.consistency_settings.update(kwargs)
        return self

    @property
    def _model_config_auto_includes(self) -> Dict[str, Any]:
        return super()._model_config_auto_includes | {"moe": dict(self.moe_settings)}

    def get_default_rl_module_spec(self) -> RLModuleSpec:
        from .rl_module import MoEPolicyModule
        return RLModuleSpec(module_class=MoEPolicyModule)

    def get_default_learner_class(self):
        from .learner import MoEPPOTorchLearner
        return MoEPPOTorchLearner

    def validate(self) -> None:
        super().validate()
        validate_moe(self.moe_settings, num_learners=self.num_learners)


class MoEPPO(PPO):
    """PPO whose policy is an MoE. One iteration: sample with the inference copy -> learner update
    (PPO + MoE aux/z losses + health metrics) -> weight sync to the rollout actors."""

    @classmethod
    def get_default_config(cls) -> MoEPPOConfig:
        return MoEPPOConfig()

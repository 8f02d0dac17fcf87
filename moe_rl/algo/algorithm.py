"""MoE-PPO on RLlib: MoEPPOConfig (a PPOConfig) and MoEPPO (a PPO).

    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2)
              .moe(num_experts=8, top_k=2, router="topk"))
    algo = config.build_algo()
    algo.train()
"""
from __future__ import annotations

from ray.rllib.algorithms.ppo import PPO, PPOConfig

from moe_rl.algo.moe_algorithm import Iteration, MoEAlgorithm
from moe_rl.algo.moe_config import MoEConfig
from moe_rl.algo.sync_gate import GateStop
from moe_rl.rllib.learner import MoEPPOTorchLearner

__all__ = ["MoEPPOConfig", "MoEPPO", "GateStop"]


class MoEPPOConfig(MoEConfig, PPOConfig):
    """PPOConfig plus `.moe(...)` (the MoE policy), `.deepspeed(...)` (the expert-parallel learner
    group), `.weight_sync(...)` (how the weights reach the rollout actors), `.stability(...)` and
    `.consistency(...)` (drift checks and the sync gate)."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or MoEPPO)

    def get_default_learner_class(self):
        return MoEPPOTorchLearner


class MoEPPO(MoEAlgorithm, PPO):
    """PPO whose policy is an MoE (moe_rl.algo.moe_algorithm: one training step), sampled
    synchronously: every rollout actor runs the synced weights, and waits for the next."""

    @classmethod
    def get_default_config(cls) -> MoEPPOConfig:
        return MoEPPOConfig()

    def training_plan(self) -> Iteration:
        return Iteration(sampling="synchronous", trains_on="fresh", passes=self.config.num_epochs)

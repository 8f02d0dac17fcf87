"""MoE-PPO on RLlib: MoEPPOConfig (a PPOConfig) and MoEPPO (a PPO).

    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2)
              .moe(num_experts=8, top_k=2, router="topk"))
    algo = config.build_algo()
    algo.train()
"""
from __future__ import annotations

from ray.rllib.algorithms.ppo import PPO, PPOConfig
from ray.rllib.execution.rollout_ops import synchronous_parallel_sample
from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS

from moe_rl.algo.moe_algorithm import MoEAlgorithm
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
    """PPO whose policy is an MoE (moe_rl.algo.moe_algorithm: one iteration), sampled
    synchronously: every rollout actor runs the synced weights."""

    rollouts_wait = True

    @classmethod
    def get_default_config(cls) -> MoEPPOConfig:
        return MoEPPOConfig()

    def sample_episodes(self):
        """Rollout actors step their envs with the inference copy (weights version v). A rollout
        actor that dies mid-sample costs only its in-flight request: the others fill the batch, the
        loss is counted (`faults/*`), and RLlib restarts the actor before the next iteration.
        Episodes with non-finite observations or rewards are dropped here and counted."""
        healthy = self.env_runner_group.num_healthy_remote_workers()
        by_agent = self.config.count_steps_by == "agent_steps"
        episodes, runner_results = synchronous_parallel_sample(
            worker_set=self.env_runner_group,
            max_agent_steps=self.config.total_train_batch_size if by_agent else None,
            max_env_steps=None if by_agent else self.config.total_train_batch_size,
            sample_timeout_s=self.config.sample_timeout_s,
            _uses_new_env_runners=True, _return_metrics=True)
        if episodes:
            self.metrics.aggregate(runner_results, key=ENV_RUNNER_RESULTS)
        return self.count_sampling_faults(healthy, episodes)


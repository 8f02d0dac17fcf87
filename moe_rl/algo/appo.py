"""MoE-APPO on RLlib: MoEAPPOConfig (an APPOConfig) and MoEAPPO (an APPO).

    config = (MoEAPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2)
              .moe(num_experts=4, top_k=2))
    algo = config.build_algo()
    algo.train()

Asynchronous as Ray users run APPO: the rollout actors always have a sample request in flight and
never wait for the learner, so a batch holds steps taken with older weights (policy lag, by
design). The MoE parts are PPO's (moe_rl.algo.moe_algorithm, moe_rl.rllib.moe_learner); the
ledger separates the lag from training-inference mismatch, and the gate acts on mismatch and bad
updates only (docs/consistency.md, "Asynchronous runs").
"""
from __future__ import annotations

from ray.rllib.algorithms.appo import APPO, APPOConfig

from moe_rl.algo.moe_algorithm import Iteration, MoEAlgorithm
from moe_rl.algo.moe_config import MoEConfig
from moe_rl.core.correction import active, resolve_correction
from moe_rl.core.errors import ConfigError
from moe_rl.rllib.appo_learner import MoEAPPOTorchLearner
from moe_rl.rllib.appo_module import MoEAPPOModule

__all__ = ["MoEAPPOConfig", "MoEAPPO"]

class MoEAPPOConfig(MoEConfig, APPOConfig):
    """APPOConfig plus the MoE sections of MoEPPOConfig: `.moe()`, `.deepspeed()`,
    `.weight_sync()`, `.stability()`, `.consistency()`."""

    module_class = MoEAPPOModule

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or MoEAPPO)
        # The synced weights reach the rollout actors from MoEAPPO (strictly assembled, versioned,
        # digested for the gate), never from RLlib's state server, which would swap them unchecked.
        self.use_env_runner_state_server = False

    def get_default_learner_class(self):
        return MoEAPPOTorchLearner

    def validate(self) -> None:
        super().validate()
        if self.moe_settings.router == "reinforce":
            raise ConfigError("moe.router: reinforce needs PPO's advantages in the batch; with algo appo one of "
                              "topk, sinkhorn, bias, task")
        if active(resolve_correction(self.consistency_settings.correction)):
            raise ConfigError("consistency.correction: off with algo appo (V-trace already corrects for the "
                              "rollout policy)")
        if self.num_aggregator_actors_per_learner:
            raise ConfigError("learners.num_aggregator_actors_per_learner: 0 with algo appo (MoEAPPO hands "
                              "the learner group its episodes itself)")


class MoEAPPO(MoEAlgorithm, APPO):
    """APPO whose policy is an MoE (moe_rl.algo.moe_algorithm: one training step). An RLlib
    iteration holds many steps (min_time_s_per_iteration), each one update and one sync."""

    @classmethod
    def get_default_config(cls) -> MoEAPPOConfig:
        return MoEAPPOConfig()

    def training_plan(self) -> Iteration:
        """Passes over each batch: APPO's circular buffer replays a batch this often."""
        c = self.config
        return Iteration(sampling="asynchronous", trains_on="fresh",
                         passes=c.circular_buffer_iterations_per_batch if c.use_circular_buffer else c.num_epochs)

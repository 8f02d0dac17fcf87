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
from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS

from moe_rl.algo.moe_algorithm import MoEAlgorithm
from moe_rl.algo.moe_config import MoEConfig
from moe_rl.core.correction import active, resolve_correction
from moe_rl.core.errors import ConfigError
from moe_rl.rllib.appo_learner import MoEAPPOTorchLearner
from moe_rl.rllib.appo_module import MoEAPPOModule

__all__ = ["MoEAPPOConfig", "MoEAPPO"]

SAMPLE_TAG = "moe_rl_sample"


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
    """APPO whose policy is an MoE (moe_rl.algo.moe_algorithm: one iteration)."""

    _updates_seen = -1   # training steps this process ran (consistency.every counts them)

    @classmethod
    def get_default_config(cls) -> MoEAPPOConfig:
        return MoEAPPOConfig()

    def check_due(self, every: int, ahead: int = 0) -> bool:
        """An APPO iteration is RLlib's (min_time_s_per_iteration: many updates and syncs): the
        check runs before every K-th update (ahead=1: before the next one)."""
        if not ahead:
            self._updates_seen += 1
        return (self._updates_seen + ahead) % every == 0

    @property
    def update_epochs(self) -> int:
        """Passes over each batch: APPO's circular buffer replays a batch this often."""
        c = self.config
        return c.circular_buffer_iterations_per_batch if c.use_circular_buffer else c.num_epochs

    def sample_episodes(self) -> list:
        """Whatever the rollout actors have finished, until a batch is full. Every rollout actor
        keeps a sample request in flight (max_requests_in_flight_per_env_runner), so it steps its
        envs while the learner updates and the gate checks; what it returns after a sync was
        partly sampled with the weights before it (policy lag)."""
        group = self.env_runner_group
        target = self.config.total_train_batch_size
        episodes, metrics, steps = [], [], 0
        if group.num_remote_env_runners() == 0:
            episodes, metrics = group.local_env_runner.sample(), [group.local_env_runner.get_metrics()]
            healthy = 0
        else:
            healthy = group.num_healthy_remote_workers()
            while steps < target and group.num_healthy_remote_workers():
                for eps, m in group.foreach_env_runner_async_fetch_ready(
                        _sample_with_metrics, tag=SAMPLE_TAG, timeout_seconds=0.05):
                    episodes.extend(eps)
                    metrics.append(m)
                    steps += sum(len(e) for e in eps)
        if metrics:
            self.metrics.aggregate(metrics, key=ENV_RUNNER_RESULTS)
        return self.count_sampling_faults(healthy, episodes)


def _sample_with_metrics(runner):
    return runner.sample(), runner.get_metrics()

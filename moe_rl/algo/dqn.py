"""MoE-DQN on RLlib: MoEDQNConfig (a DQNConfig) and MoEDQN (a DQN).

    config = (MoEDQNConfig().environment("CartPole-v1")
              .training(replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 50000},
                        n_step=(2, 5), double_q=True, dueling=True)
              .moe(num_experts=4, top_k=2))
    algo = config.build_algo()
    algo.train()

RLlib's own DQN machinery: its episode replay buffers (prioritized included), n-step returns,
double and dueling heads, the target network and the epsilon schedule. The Q-network's trunk is the
MoE one (moe_rl.rllib.q_module); a training step samples synchronously, stores the batch in the
replay buffer and, once `num_steps_sampled_before_learning_starts` steps were sampled, trains on
replay draws (moe_rl.algo.moe_algorithm), with the consistency check on what was just collected:
the rollout copy's Q-values against the trainer's at the same weights (docs/consistency.md).
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
from ray.rllib.algorithms.dqn import DQN, DQNConfig
from ray.rllib.algorithms.dqn.dqn import calculate_rr_weights
from ray.rllib.utils.metrics import REPLAY_BUFFER_RESULTS, TD_ERROR_KEY
from ray.rllib.utils.numpy import convert_to_numpy
from ray.rllib.utils.replay_buffers.utils import update_priorities_in_episode_replay_buffer

from moe_rl.algo.moe_algorithm import Iteration, MoEAlgorithm
from moe_rl.algo.moe_config import MoEConfig
from moe_rl.core.errors import ConfigError
from moe_rl.core.sections import CorrectionSettings
from moe_rl.rllib import ray_private
from moe_rl.rllib.dqn_learner import MoEDQNTorchLearner
from moe_rl.rllib.q_module import MoEQModule

__all__ = ["MoEDQNConfig", "MoEDQN"]


class MoEDQNConfig(MoEConfig, DQNConfig):
    """DQNConfig plus the MoE sections of MoEPPOConfig: `.moe()`, `.deepspeed()`, `.weight_sync()`,
    `.stability()`, `.consistency()`."""

    module_class = MoEQModule

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or MoEDQN)

    def get_default_learner_class(self):
        return MoEDQNTorchLearner

    def validate(self) -> None:
        """What DQN cannot run, refused by name (never silently ignored). A YAML list n_step is
        RLlib's (min, max) tuple (its replay buffer draws a random n only from a tuple)."""
        if isinstance(self.n_step, list) and not ray_private.config_is_frozen(self):
            self.n_step = tuple(self.n_step)
        super().validate()
        s = self.moe_settings
        refused = {
            "moe.router": (s.router == "reinforce", "one of topk, sinkhorn, bias, task with algo dqn (the REINFORCE "
                                                    "router learns from PPO's advantages)"),
            "moe.routing_replay": (s.routing_replay not in ("auto", False), "auto or false with algo dqn (a replay "
                                                                             "draw mixes steps of many weights)"),
            "moe.capacity_factor": (s.capacity_factor is not None, "null with algo dqn (a capacity limit drops by "
                                                                   "batch; only routing replay could carry a "
                                                                   "rollout's drops)"),
            "consistency.correction": (self.consistency_settings.correction != CorrectionSettings(),
                                       "unset with algo dqn (it reweights PPO's log-probs; a Q-policy has none)"),
            "training.noisy": (self.noisy, "false with the MoE Q-network (noisy layers are RLlib's default module's)"),
            "training.num_atoms": (self.num_atoms > 1, "1 with the MoE Q-network (distributional Q is RLlib's "
                                                       "default module's)"),
            "deepspeed.enabled": (self.uses_deepspeed, "false with algo dqn: the DeepSpeed learner group shards the "
                                                       "experts of one fresh batch; DQN's learner draws from a replay "
                                                       "buffer on the driver (docs/expert_parallelism.md)"),
        }
        for field, (bad, allowed) in refused.items():
            if bad:
                raise ConfigError(f"{field}: {allowed}")
        store, _ = calculate_rr_weights(self)
        if store > 1 and not self.in_evaluation:   # evaluation samples on runners of its own
            raise ConfigError(f"training.training_intensity: at least the native ratio with algo dqn (one update "
                              f"per sampled batch or more; {self.training_intensity!r} asks for one per {store})")


class MoEDQN(MoEAlgorithm, DQN):
    """DQN whose Q-network is an MoE (moe_rl.algo.moe_algorithm: one training step)."""

    @classmethod
    def get_default_config(cls) -> MoEDQNConfig:
        return MoEDQNConfig()

    def training_plan(self) -> Iteration:
        """Updates per step: RLlib's round-robin weight for `training_intensity` (1 by default)."""
        c = self.config
        return Iteration(sampling="synchronous", trains_on="replay", updates=calculate_rr_weights(c)[1],
                         learning_starts=c.num_steps_sampled_before_learning_starts)

    def store(self, episodes: list) -> None:
        self.local_replay_buffer.add(episodes)

    def draw(self) -> list:
        """A training batch of n-step transitions from the replay buffer (prioritized: with its
        importance weights), as RLlib's DQN draws it."""
        c = self.config
        episodes = self.local_replay_buffer.sample(
            num_items=c.total_train_batch_size, n_step=c.n_step, gamma=c.gamma,
            beta=c.replay_buffer_config.get("beta"), sample_episodes=True, batch_length_T=0, lookback=0)
        self.metrics.aggregate([self.local_replay_buffer.get_metrics()], key=REPLAY_BUFFER_RESULTS)
        return episodes

    def after_update(self, learner_results):
        """The TD errors leave the results (they are per sample: never logged) for the replay
        buffer's priorities."""
        td_errors = defaultdict(list)
        for result in learner_results:
            for module_id, figures in result.items():
                if TD_ERROR_KEY in figures:
                    td_errors[module_id].extend(convert_to_numpy(figures.pop(TD_ERROR_KEY).peek()))
        update_priorities_in_episode_replay_buffer(
            replay_buffer=self.local_replay_buffer,
            td_errors={mid: {TD_ERROR_KEY: np.concatenate(e, axis=0)} for mid, e in td_errors.items()})
        return learner_results

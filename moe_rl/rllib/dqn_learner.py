"""MoEDQNTorchLearner: RLlib's DQN loss (double Q, dueling, n-step, prioritized replay's weights,
the target network's updates) with the MoE parts (moe_rl.rllib.moe_learner)."""
from __future__ import annotations

from ray.rllib.algorithms.dqn.torch.dqn_torch_learner import DQNTorchLearner

from moe_rl.rllib.moe_learner import MoELearner


class MoEDQNTorchLearner(MoELearner, DQNTorchLearner):
    health_min_rows = 512   # every 8th update of 64 replayed transitions, every 16th of 32

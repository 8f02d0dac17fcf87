"""A rollout actor killed mid-iteration: the iteration completes with the others, the loss is
counted, and the restarted actor gets the current weights before it samples."""
import math
import os
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from ray import tune

from moe_rl import MoEPPOConfig


def runner_weights(algo, ids):
    states = algo.env_runner_group.foreach_env_runner(
        lambda r: {k: v.detach().numpy().copy() for k, v in r.module.state_dict().items()},
        remote_worker_ids=ids, local_env_runner=False)
    return dict(zip(ids, states))


class CrashingCartPole(gym.Wrapper):
    """CartPole whose rollout actor 2 dies (the process exits, as on a segfault) at its first step
    after the test drops a marker file. The death lands mid-sample by construction, on any machine
    and any load, and the marker is consumed: the restarted actor samples normally."""

    def __init__(self, config):
        super().__init__(gym.make("CartPole-v1"))
        self.marker = config["marker"] if config.worker_index == 2 else None

    def step(self, action):
        if self.marker and os.path.exists(self.marker):
            os.remove(self.marker)
            os._exit(1)
        return self.env.step(action)


# Long, so that an iteration that waited out the dead actor's sample stands apart from a slow one.
SAMPLE_TIMEOUT_S = 600


@pytest.mark.slow
def test_killed_rollout_actor_is_survived_counted_and_replaced_with_current_weights(ray_local, tmp_path):
    tune.register_env("CrashingCartPole", CrashingCartPole)
    marker = tmp_path / "crash"
    config = (MoEPPOConfig().environment("CrashingCartPole", env_config={"marker": str(marker)})
              .env_runners(num_env_runners=2, num_envs_per_env_runner=2, sample_timeout_s=SAMPLE_TIMEOUT_S)
              .fault_tolerance(restart_failed_env_runners=True)
              .training(train_batch_size_per_learner=2000, minibatch_size=500, num_epochs=1)
              .moe(num_experts=4, top_k=2, d_model=16, d_ff=16)
              .debugging(seed=0))
    algo = config.build_algo()
    try:
        algo.train()
        marker.touch()
        t0 = time.time()
        result = algo.train()        # actor 2 dies at its first step of this iteration's sampling
        assert not marker.exists(), "the victim consumed the marker"
        faults = {k: v for k, v in result["moe_rl"].items() if k.startswith("faults/")}
        assert result["env_runners"]["num_env_steps_sampled"] >= 2000, "the batch was filled by the survivor"
        assert faults["faults/env_runner_failures"] == 1 and faults["faults/lost_env_steps"] > 0, faults
        assert time.time() - t0 < SAMPLE_TIMEOUT_S   # the dead actor's sample was not waited out
        # RLlib restarts the actor before the next iteration; moe-rl syncs it from its healthy peer.
        deadline, restored = time.time() + 90, []
        while not restored and time.time() < deadline:   # Ray restarts the actor process first
            restored = algo.restore_env_runners(algo.env_runner_group)
            time.sleep(0.5)
        assert restored == [2]
        w = runner_weights(algo, [1, 2])
        assert w[1].keys() == w[2].keys() and all(np.array_equal(w[1][k], w[2][k]) for k in w[1])
        versions = algo.env_runner_group.foreach_env_runner(lambda r: r.get_state(components=["weights_seq_no"]).get(
            "weights_seq_no"), local_env_runner=False)
        assert len(set(versions)) == 1
        result = algo.train()
        assert result["moe_rl"]["faults/env_runners_restored"] == 1
        assert algo.env_runner_group.num_healthy_remote_workers() == 2
    finally:
        algo.stop()


class FaultyCartPole(gym.Wrapper):
    """CartPole whose observation (even steps) or reward (odd steps) turns NaN/Inf every `every` steps."""

    def __init__(self, config):
        super().__init__(gym.make("CartPole-v1"))
        self.every, self.t = config.get("every", 97), 0

    def step(self, action):
        obs, reward, term, trunc, info = self.env.step(action)
        self.t += 1
        if self.t % self.every == 0:
            if (self.t // self.every) % 2:
                reward = float("inf")
            else:
                obs = obs.copy()
                obs[0] = np.nan
        return obs, reward, term, trunc, info


def test_nan_and_inf_in_rewards_and_observations_are_dropped_and_counted(ray_local):
    tune.register_env("FaultyCartPole", FaultyCartPole)
    algo = (MoEPPOConfig().environment("FaultyCartPole", env_config={"every": 97})
            .env_runners(num_env_runners=1, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=1000, minibatch_size=250, num_epochs=2)
            .moe(num_experts=4, top_k=2, d_model=16, d_ff=16).debugging(seed=0)).build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        faults, learner = result["moe_rl"], result["learners"]["default_policy"]
        assert faults["faults/nonfinite_episodes_dropped"] > 0 and faults["faults/nonfinite_env_steps_dropped"] > 0
        assert math.isfinite(learner["policy_loss"]) and math.isfinite(learner["vf_loss"])
        assert learner["stability/skipped_steps"] == 0   # nothing non-finite got as far as a gradient
        weights = algo.learner_group.module_state(inference_only=False)["default_policy"]
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in weights.values())
    finally:
        algo.stop()

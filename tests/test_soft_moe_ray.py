"""Soft MoE through the real loop: RLlib EnvRunners stepping MinAtar with the rollout copy, the
learner training the same module, the consistency actor comparing the two before each sync."""
import math

import pytest

import envs  # noqa: F401  (registers MinAtar's games)
from moe_rl import MoEDQNConfig, MoEPPOConfig
from moe_rl.algo import faults
from moe_rl.algo.results import metrics_row

# The Soft MoE as Obando-Ceron et al.'s code sets it up over MinAtar's 49 tokens with 4 experts.
AUTHORS_SETTINGS = {"soft_normalize": False, "token_pool": "flatten", "slots_per_expert": 13}


def _soft_ppo(**moe):
    return (MoEPPOConfig().environment("MinAtar/Breakout-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=2)
            .training(lr=1e-3, train_batch_size_per_learner=256, minibatch_size=128, num_epochs=1)
            .moe(mixture="soft", num_experts=4, d_model=16, d_ff=16, num_layers=1, activation="relu", **moe)
            .consistency(policy="hold", sample_size=128)
            .debugging(seed=0))


@pytest.mark.parametrize("moe", [{}, AUTHORS_SETTINGS], ids=["defaults", "authors_settings"])
def test_a_tokenized_soft_moe_ppo_run_checks_clean_and_catches_a_corrupt_rollout_copy_at_once(ray_local, moe):
    """49 position tokens from MinAtar's 10x10 grid: at the same weights (fp32) the rollout copy and
    the trainer compute the same log-probs and the same combine shares, so under `hold` no check acts;
    a rollout copy corrupted after a sync is caught and repaired at the very next check."""
    algo = _soft_ppo(**moe).build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        rows = list(algo.sync_gate.ledger())
        assert rows and all(r["action"] == "" and r["cause"] == "" for r in rows), [r["reason"] for r in rows]
        assert max(r["k3"] for r in rows) < 1e-9 and max(r["combine_tv_max"] for r in rows) < 1e-5
        figures = metrics_row(result)
        assert 0 < figures["moe/dispatch_entropy_norm"] <= 1 and 0 <= figures["moe/dormant"] <= 1
        faults.inject(algo, faults.CorruptRolloutCopy(runner=1))
        algo.train()
        row = algo.sync_gate.ledger()[-1]
        assert "corrupt_copy" in row["cause"] and row["repairs"] >= 1, row["reason"]
    finally:
        algo.stop()


@pytest.mark.slow
def test_a_soft_moe_q_network_trains_under_dqn_with_clean_checks_and_no_gate_action(ray_local):
    """MoE-DQN with the authors' Soft MoE over MinAtar's tokens, checked at every update under
    `hold`: the loss is finite, the rollout copy and the trainer see the same Q-values, and no
    check acts. Before q_change was measured over the run's recent Q scale, this run's Q-values
    passing near zero read as bad updates (q_change 4.6-17) and the gate held it."""
    algo = (MoEDQNConfig().environment("MinAtar/Breakout-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=1)
            .training(num_steps_sampled_before_learning_starts=64, train_batch_size_per_learner=32,
                      replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 2000})
            .reporting(min_sample_timesteps_per_iteration=100)
            .moe(mixture="soft", num_experts=4, d_model=16, d_ff=16, num_layers=1, activation="relu", q_hiddens=[],
                 **AUTHORS_SETTINGS)
            .consistency(policy="hold", relative_warmup=3)
            .debugging(seed=0)).build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        assert math.isfinite(result["learners"]["default_policy"]["qf_loss"])
        rows = algo.sync_gate.ledger()
        same = [r for r in rows if r.get("q_gap_max_rel") is not None]
        assert len(rows) > 50 and same and max(r["q_gap_max_rel"] for r in same) < 1e-5
        assert [r["reason"] for r in rows if r["action"]] == []
    finally:
        algo.stop()

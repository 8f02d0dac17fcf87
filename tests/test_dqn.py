"""MoE-DQN: RLlib's DQN machinery with the MoE Q-network, its value-based consistency check, and
what DQN refuses by name. Real local Ray, real rollout actors, real RLlib replay buffers."""
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from moe_rl import MoEDQNConfig
from moe_rl.algo import faults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _moe_rl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "moe_rl.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_a_ppo_only_setting_under_algo_dqn_exits_2_naming_it(tmp_path):
    for setting, field in (("consistency.correction.mode=bypass", "consistency.correction"),
                           ("moe.router=reinforce", "moe.router"), ("moe.capacity_factor=1.0", "moe.capacity_factor")):
        out = _moe_rl("train", "--algo", "dqn", "--set", setting, "--output", str(tmp_path / "run"))
        assert out.returncode == 2 and not (tmp_path / "run").exists(), out.stderr
        assert out.stderr.strip().splitlines()[-1].startswith(f"moe-rl: error: {field}: "), out.stderr


def _dqn(**consistency):
    return (MoEDQNConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=2, num_envs_per_env_runner=1)
            .training(num_steps_sampled_before_learning_starts=100, train_batch_size_per_learner=32,
                      replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 5000},
                      n_step=(1, 3), epsilon=[(0, 1.0), (2000, 0.05)])
            .reporting(min_sample_timesteps_per_iteration=200)
            .moe(num_experts=4, top_k=2, d_model=16, d_ff=16, q_hiddens=[32])
            .consistency(policy="hold", **consistency))


def _train(algo, iterations):
    for _ in range(iterations):
        algo.train()
    return list(algo.sync_gate.ledger())


def test_a_healthy_moe_dqn_run_checks_q_values_records_lag_and_takes_no_action(ray_local):
    """Two rollout actors: the same-weights Q-value gap stays at fp32 rounding, the greedy actions
    agree, the lag is recorded, and under `hold` no check acts. The value-based figures reach
    metrics.parquet's drift/ columns too."""
    algo = _dqn(relative_warmup=3).build_algo()
    try:
        rows = _train(algo, 3)
        assert len(rows) >= 5
        same = [r for r in rows if r.get("q_gap_max_rel") is not None]
        assert same and max(r["q_gap_max_rel"] for r in same) < 1e-5
        assert min(r["greedy_agreement"] for r in same) == 1.0 and min(r["routing_agreement"] for r in same) == 1.0
        assert "k3" not in same[0] and "q_gap_by_expert" in same[0] and "q_change" in rows[-1]
        # Synchronous sampling: every collected step was taken at the synced weights (lag 0, recorded).
        assert all(r["lag_versions"] == 0 and r["policy_lag_mean"] == 0.0 for r in same)
        assert {r["decision"] for r in rows} == {"sync"} and not any(r["cause"] for r in rows)
        result = algo.train()
        assert result["moe_rl"]["drift/greedy_agreement"] == 1.0 and "qf_loss" in result["learners"]["default_policy"]
    finally:
        algo.stop()


@pytest.mark.slow
def test_a_bf16_copy_is_mismatch_a_corrupt_copy_is_repaired_and_a_q_blow_up_is_a_bad_update(ray_local):
    algo = _dqn(thresholds={"q_gap_max_rel": 1e-4}).moe(inference_dtype="bf16").build_algo()
    try:
        rows = _train(algo, 2)
        assert any(r["cause"] == "mismatch" for r in rows), [r.get("q_gap_max_rel") for r in rows]
        assert all("mismatch" in r["cause"] for r in rows if r.get("q_gap_max_rel", 0) > 1e-4)
        assert {r["decision"] for r in rows} == {"sync"}        # mismatch is reported, never stalls
        faults.inject(algo, faults.CorruptRolloutCopy(runner=1))
        seen = len(algo.sync_gate.ledger())
        algo.train()
        corrupt = [r for r in algo.sync_gate.ledger()[seen:] if "corrupt_copy" in r["cause"]]
        assert corrupt and corrupt[0]["repairs"] >= 1 and "rollout actor 1" in corrupt[0]["param_breach_lines"]
        seen = len(algo.sync_gate.ledger())
        faults.inject(algo, faults.HarmfulUpdate(factor=1000))
        algo.train()
        first, *later = algo.sync_gate.ledger()[seen:]
        assert first["decision"] == "hold" and "bad_update" in first["cause"], first["reason"]
        assert "update_size" in first["reason"] or "q_change" in first["reason"]
        # While held, the learners are ahead of the rollouts: lag, measured as lag, never mismatch.
        held = [r for r in later if r["lag_versions"] >= 1]
        assert held and all("lag_q_gap" in r and "q_gap_max_rel" not in r for r in held)
    finally:
        algo.stop()


@pytest.mark.slow
def test_algo_dqn_trains_from_the_cli_checkpoints_evaluates_greedily_and_resumes(tmp_path):
    run = tmp_path / "run"
    out = _moe_rl("train", "--algo", "dqn", "--iterations", "2", "--output", str(run), "--num-env-runners", "2",
                  "--set", "checkpoint_every=2", "--set", "consistency.every=10")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "drift dQ" in out.stdout
    rows = pq.read_table(run / "drift.parquet").to_pylist()
    assert rows and all(r["decision"] == "sync" for r in rows) and "greedy_agreement" in rows[0]
    metrics = pq.read_table(run / "metrics.parquet").to_pylist()
    assert [m["iteration"] for m in metrics] == [1, 2] and metrics[-1]["qf_loss"] == metrics[-1]["qf_loss"]
    evaluated = _moe_rl("evaluate", str(run), "--episodes", "2")
    assert evaluated.returncode == 0 and "mean return over 2 episodes" in evaluated.stdout, evaluated.stderr[-2000:]
    resumed = _moe_rl("train", "--resume", str(run), "--iterations", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [m["iteration"] for m in pq.read_table(run / "metrics.parquet").to_pylist()] == [1, 2, 3]

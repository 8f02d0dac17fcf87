"""MoE-APPO: the MoE stack under RLlib's asynchronous PPO. The ledger tells policy lag (steps
taken with older weights, by design) from mismatch (the rollout copy and the trainer at the same
weights), and the gate acts on mismatch and bad updates, never on the lag."""
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from helpers import PureCheck

from moe_rl import MoEAPPOConfig, MoEPPOConfig
from moe_rl.actors.learner_group import DeepSpeedLearnerGroup
from moe_rl.algo import faults
from moe_rl.algo.config_builders import MoESections
from moe_rl.core.drift_kinds import PolicyKind
from moe_rl.core.gate import validate_consistency
from moe_rl.core.settings import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("moe", "deepspeed", "weight_sync", "stability", "consistency")


# --- pure: the check -----------------------------------------------------------------------------
def _check(lagged_k3_shift: float, same_shift: float, policy: str = "hold"):
    """One check of a module whose sample has 64 steps at the synced weights and 64 taken one and
    two syncs before; the trainer's log-probs differ from the rollout's by `same_shift` on the
    first and by `lagged_k3_shift` on the others (the policy moved across the lag)."""
    rng = np.random.default_rng(0)
    check = PureCheck(validate_consistency({"policy": policy, "thresholds": {"max_abs_logp_diff": 1e-3}}),
                      {"default_policy": PolicyKind()})
    logp = np.log(rng.uniform(0.2, 0.8, 64))
    topk = rng.integers(0, 4, (64, 2, 2)).astype(np.int16)
    lagged_rollout = np.log(rng.uniform(0.2, 0.8, 64))
    verdict, rows = check.check(
        rollout={"default_policy": {"logp": logp, "routing": topk, "actions": np.zeros(64), "positions": None}},
        trainer={"default_policy": {"logp": logp + same_shift, "routing": topk}},
        policy_lag={"default_policy": {"versions": np.r_[np.zeros(64), np.ones(32), 2 * np.ones(32)],
                                       "rollout": {"logp": lagged_rollout},
                                       "trainer": {"logp": lagged_rollout + lagged_k3_shift}}})
    return verdict, rows[0]


@pytest.mark.pure
def test_lag_with_no_mismatch_syncs_and_is_recorded_as_lag():
    verdict, row = _check(lagged_k3_shift=0.5, same_shift=0.0)
    assert verdict["decision"] == "sync" and verdict["causes"] == [] and verdict["actions"] == []
    assert row["k3"] == 0.0 and row["routing_agreement"] == 1.0          # same weights: no mismatch
    assert row["policy_lag_mean"] == pytest.approx(0.75) and row["policy_lag_max"] == 2
    assert row["policy_lag_share"] == 0.5 and row["policy_lag_k3"] > 0.05  # the policy moved across the lag


@pytest.mark.pure
def test_mismatch_beside_lag_is_named_mismatch_not_lag():
    verdict, row = _check(lagged_k3_shift=0.0, same_shift=0.01)
    assert verdict["causes"] == ["mismatch"] and "max_abs_logp_diff" in verdict["reason"]
    assert verdict["decision"] == "sync"   # mismatch is reported, never stalls (as under PPO)
    assert row["policy_lag_k3"] == 0.0 and row["max_abs_logp_diff"] == pytest.approx(0.01)


# --- the config ------------------------------------------------------------------------------------
@pytest.mark.pure
def test_both_algorithms_take_the_same_moe_sections_with_every_key():
    for section in SECTIONS:
        ppo, appo = (getattr(c(), f"{section}_settings") for c in (MoEPPOConfig, MoEAPPOConfig))
        assert ppo == appo, section
        assert getattr(MoEAPPOConfig, section) is getattr(MoESections, section)
    with pytest.raises(ConfigError, match="moe.toppk: unknown key, allowed: .*top_k"):
        MoEAPPOConfig().moe(toppk=2)


@pytest.mark.pure
@pytest.mark.parametrize("build, field", [
    (lambda c: c.moe(router="reinforce"), "moe.router"),
    (lambda c: c.consistency(correction={"preset": "decoupled_is"}), "consistency.correction"),
])
def test_what_appo_cannot_run_is_refused_by_name(build, field):
    config = build(MoEAPPOConfig().environment("CartPole-v1"))
    with pytest.raises(ConfigError, match=f"^{field}"):
        config.validate()


def _moe_rl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "moe_rl.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_a_misspelt_algo_fails_fast_naming_the_allowed_ones(tmp_path):
    out = _moe_rl("train", "--algo", "apo", "--output", str(tmp_path / "run"))
    assert out.returncode == 2, out.stderr
    assert "algo: one of ppo, appo, dqn, got 'apo'" in out.stderr and not (tmp_path / "run").exists()


def test_another_algorithms_setting_the_user_wrote_is_refused_by_name_with_public_keys_only(tmp_path):
    out = _moe_rl("train", "--algo", "appo", "--config", os.path.join(ROOT, "configs", "cartpole.yaml"),
                  "--output", str(tmp_path / "run"))
    assert out.returncode == 2 and not (tmp_path / "run").exists()
    line = out.stderr.strip().splitlines()[-1]
    assert "training.vf_clip_param: a setting of algo ppo, not of algo appo" in line
    assert "circular_buffer_iterations_per_batch" in line and ", _" not in line and "(_" not in line


# --- real runs ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_algo_appo_from_the_defaults_survives_iterations_without_a_check(tmp_path):
    """`moe-rl train --algo appo` as a new user types it (APPO's own quickstart config), with the
    check rarer than the updates: only the first of three iterations holds one, so the later rows
    have no decision. Those rows once crashed the table writer (text, then NaN, in one column)."""
    run = tmp_path / "run"
    out = _moe_rl("train", "--algo", "appo", "--iterations", "3", "--output", str(run),
                  "--set", "consistency.every=100000", "--set", "checkpoint_every=3")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = pq.read_table(run / "metrics.parquet").to_pylist()
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert rows[0]["drift/decision"] == "sync" and [r["drift/decision"] for r in rows[1:]] == [None, None]
    assert pq.read_table(run / "drift.parquet").num_rows == 1


@pytest.mark.slow
def test_a_moe_appo_run_records_lag_and_mismatch_apart_and_hold_takes_no_action(tmp_path):
    """3 iterations, 2 rollout actors, consistency.policy hold: the ledger has steps one sync old
    (lag > 0) while the same-weights mismatch stays at fp32 rounding, and no check acts."""
    run = tmp_path / "run"
    out = _moe_rl("train", "--config", os.path.join(ROOT, "configs", "appo_cartpole.yaml"), "--iterations", "3",
                  "--output", str(run), "--set", "consistency.policy=hold", "--set", "consistency.every=1",
                  "--set", "checkpoint_every=3")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = pq.read_table(run / "drift.parquet").to_pylist()
    # a check per update; an iteration lasts 10 s, so how many updates it holds depends on the
    # machine's load (6 in three iterations on a busy one, dozens on a quiet one)
    assert len(rows) >= 3
    assert max(r["policy_lag_max"] for r in rows) >= 1 and any(r["policy_lag_share"] > 0 for r in rows)
    # A batch of 500 steps from samples of 200: the ones in flight at the sync were taken with the
    # weights before it, at least one after it with the synced ones (mismatch is measured there).
    same = [r for r in rows if r["k3"] is not None]
    assert len(same) >= 0.8 * len(rows) and all(r["mismatch_steps"] > 0 for r in same)
    assert max(r["k3"] for r in same) < 1e-9 and min(r["routing_agreement"] for r in same) == 1.0
    assert {r["decision"] for r in rows} == {"sync"} and not any(r["cause"] for r in rows)
    assert os.path.isdir(run / "checkpoints" / "iter_000003")
    evaluated = _moe_rl("evaluate", str(run), "--episodes", "2")
    assert evaluated.returncode == 0 and "mean return over 2 episodes" in evaluated.stdout, evaluated.stderr[-2000:]


def _appo(**moe):
    return (MoEAPPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=2, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=200).reporting(min_time_s_per_iteration=0)
            .moe(num_experts=4, top_k=2, d_model=16, d_ff=16, **moe)
            .consistency(policy="hold", thresholds={"max_abs_logp_diff": 1e-4}))


@pytest.mark.slow
def test_a_bf16_rollout_copy_is_caught_as_mismatch_while_the_lag_is_recorded_apart(ray_local):
    algo = _appo(inference_dtype="bf16").build_algo()
    try:
        for _ in range(4):
            algo.train()
        rows = algo.sync_gate.ledger()
        assert all("mismatch" in r["cause"] for r in rows if r.get("max_abs_logp_diff", 0) > 1e-4)
        assert any(r["cause"] == "mismatch" for r in rows) and {r["decision"] for r in rows} == {"sync"}
        assert any(r.get("policy_lag_max", 0) >= 1 for r in rows)   # lagged steps: never a cause
    finally:
        algo.stop()


@pytest.mark.parametrize("mixture", ["sparse", "soft"])
def test_a_corrupted_rollout_copy_is_repaired_at_the_next_check(ray_local, mixture):
    algo = _appo(mixture=mixture).build_algo()
    try:
        algo.train()
        faults.inject(algo, faults.CorruptRolloutCopy(runner=1))
        algo.train()
        row = algo.sync_gate.ledger()[-1]
        assert "corrupt_copy" in row["cause"] and row["repairs"] >= 1 and "rollout actor 1" in row["param_breach_lines"]
        algo.train()
        assert algo.sync_gate.ledger()[-1]["cause"] == ""
    finally:
        algo.stop()


def test_a_harmful_update_is_held_as_a_bad_update_while_healthy_ones_sync(ray_local):
    """The gate's other side under APPO's many small updates: one optimizer step at LR x 1000 is
    held (the rollouts keep the last good weights), the healthy updates before it all synced."""
    algo = _appo().consistency(relative_warmup=3).build_algo()
    try:
        for _ in range(4):
            algo.train()
        healthy = list(algo.sync_gate.ledger())
        assert len(healthy) >= 4 and {r["decision"] for r in healthy} == {"sync"}
        faults.inject(algo, faults.HarmfulUpdate(factor=1000))
        algo.train()
        first, *later = algo.sync_gate.ledger()[len(healthy):]
        assert first["decision"] == "hold" and first["cause"] == "bad_update", first["reason"]
        # The weights' update size always breaches; the probe KL (k3_old_new) is recorded but not
        # always over its limit: APPO's batches differ with the machine's load, and one boosted
        # step's KL on the probe states was 0.34 in one run (under its limit) and 525 in the one
        # moe_rl/core/gate.py cites; 3 of 4 runs of main at 697fca3 under load stayed under it.
        assert "update_size" in first["reason"] and "k3_old_new" in first, first["reason"]
        assert all(r["lag_versions"] >= 1 for r in later if r["decision"] == "hold")
    finally:
        algo.stop()


def test_the_deepspeed_expert_parallel_group_serves_appo(ray_local, tmp_path):
    """ep_size 2 over two DeepSpeed learners (gloo): APPO's own loss and target policy on sharded
    experts. The ledger's same-weights mismatch stays at fp32 rounding beside the lag, the
    learners' replicas (target policy included) agree at every check, and the group's checkpoint
    (every learner its own part) restores the whole state, target included. The target policy
    moves on: APPO clips its surrogate against it, and a target frozen at the initial policy holds
    the policy near it (CartPole then plateaus at a return of about 70)."""
    algo = (_appo().learners(num_learners=2).moe(ep_size=2)
            .training(target_network_update_freq=1, circular_buffer_num_batches=1,
                      circular_buffer_iterations_per_batch=1).build_algo())
    group = algo.learner_group

    def target(learner):
        module = learner.module["default_policy"]
        return (module._target_pi.weight.detach().clone(),
                any(p.requires_grad for p in module._target_trunk.parameters()))
    try:
        assert isinstance(group, DeepSpeedLearnerGroup)
        assert group.foreach(lambda l: type(l).__name__) == ["DeepSpeedMoEAPPOTorchLearner"] * 2
        initial, _ = group.foreach(target)[0]
        for _ in range(3):
            result = algo.train()
        assert result["learners"]["default_policy"]["num_target_updates"] >= 2
        now, trainable = group.foreach(target)[0]
        assert not torch.equal(now, initial) and not trainable
        rows = algo.sync_gate.ledger()
        same = [r for r in rows if r["k3"] is not None]
        assert same and max(r["k3"] for r in same) < 1e-9 and min(r["routing_agreement"] for r in same) == 1.0
        assert {r["decision"] for r in rows} == {"sync"} and not any(r["cause"] for r in rows)
        assert any(r["policy_lag_max"] >= 1 for r in rows)
        path = group.save_to_path(str(tmp_path / "group"))
        saved = group.module_state(inference_only=False)["default_policy"]
        target_experts = [k for k in saved if k.startswith("_target_trunk") and "expert" in k]
        assert target_experts, sorted(saved)[:5]
        algo.train()
        moved = group.module_state(inference_only=False)["default_policy"]
        assert any(not np.array_equal(moved[k], saved[k]) for k in target_experts)
        group.restore_from_path(path)
        restored = group.module_state(inference_only=False)["default_policy"]
        assert restored.keys() == saved.keys() and all(np.array_equal(restored[k], saved[k]) for k in saved)
    finally:
        algo.stop()

"""Drift estimators (pure torch) and the consistency actor + sync gate on real Ray / DeepSpeed."""
import math
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from moe_rl import MoEPPOConfig
from moe_rl.algo.results import write_table
from moe_rl.core.drift import drift_metrics, policy_kl, routing_agreement
from moe_rl.core.gate import validate_consistency
from moe_rl.core.settings import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- estimators, hand-computed --------------------------------------------------------------------


@pytest.mark.pure
def test_identical_inputs_give_zero_kl():
    lp = torch.log(torch.tensor([0.1, 0.5, 0.9]))
    m = drift_metrics(lp, lp)
    assert m["k1"] == m["k2"] == m["k3"] == 0.0 and m["chi2"] == pytest.approx(0.0) and m["ess"] == pytest.approx(1.0)
    assert m["max_abs_logp_diff"] == 0.0


@pytest.mark.pure
def test_hand_values_and_k3_nonnegative():
    t, r = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])  # ratio 2
    m = drift_metrics(t, r)
    assert m["k1"] == pytest.approx(-math.log(2)) and m["k2"] == pytest.approx(0.5 * math.log(2) ** 2)
    assert m["k3"] == pytest.approx(2 - 1 - math.log(2)) and m["chi2"] == pytest.approx(3.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        m = drift_metrics(torch.randn(100, generator=g) - 2, torch.randn(100, generator=g) - 2)
        assert m["k3"] >= 0 and 0 < m["ess"] <= 1


@pytest.mark.pure
def test_estimators_match_closed_form_kl_in_expectation():
    p_inf = torch.tensor([0.5, 0.3, 0.2])
    p_train = torch.tensor([0.4, 0.4, 0.2])
    kl = (p_inf * (p_inf / p_train).log()).sum().item()  # KL(inf || train)
    actions = torch.multinomial(p_inf, 400_000, replacement=True, generator=torch.Generator().manual_seed(1))
    m = drift_metrics(p_train.log()[actions], p_inf.log()[actions])
    assert m["k1"] == pytest.approx(kl, rel=0.05) and m["k3"] == pytest.approx(kl, rel=0.05)
    logits_inf, logits_train = p_inf.log()[None], p_train.log()[None]
    assert policy_kl(logits_inf, logits_train, discrete=True) == pytest.approx(kl, rel=1e-6)


@pytest.mark.pure
def test_routing_agreement_per_layer_and_first_divergent_layer():
    a = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 3]])]
    b = [torch.tensor([[1, 0], [3, 2]]), torch.tensor([[0, 1], [2, 0]])]
    m = routing_agreement(a, b)
    assert m["routing_agreement/layer0"] == 1.0 and m["routing_agreement/layer1"] == 0.5
    assert m["first_divergent_layer"] == 1 and m["routing_agreement"] == 0.75


@pytest.mark.pure
def test_bad_consistency_settings_name_the_field():
    for settings, field in [({"policy": "panic"}, "consistency.policy"), ({"every": 0}, "consistency.every"),
                            ({"thresholds": {"k9": 1}}, "consistency.thresholds.k9"),
                            ({"thresholds": {"routing_agreement": 1.5}}, "consistency.thresholds.routing_agreement"),
                            ({"thresholds": {"k3": -1}}, "consistency.thresholds.k3"),
                            ({"correction": {"preset": "tis"}}, "consistency.correction.preset"),
                            ({"max_holds": 0}, "consistency.max_holds"),
                            ({"rollback_lr_scale": 0}, "consistency.rollback_lr_scale"),
                            ({"nope": 1}, "consistency.nope")]:
        with pytest.raises(ConfigError, match=f"^{field}: "):
            validate_consistency(settings)


# --- the actor and the gate on real Ray + DeepSpeed -------------------------------------------------

def config(ep_size=2, policy="warn", th=None, **moe):
    return (MoEPPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=2)
            .training(lr=1e-3, train_batch_size_per_learner=300, minibatch_size=100, num_epochs=2,
                      vf_loss_coeff=0.5, vf_clip_param=1000.0)
            .learners(num_learners=2 if ep_size > 1 else 0)
            .moe(**{"num_experts": 4, "top_k": 2, "ep_size": ep_size, "d_model": 16, "d_ff": 16, **moe})
            .consistency(policy=policy, thresholds=th or {}, sample_size=256)
            .debugging(seed=0))


def last_row(algo):
    return algo.sync_gate.ledger()[-1]


def runner_state(algo):
    return algo.env_runner_group.foreach_env_runner(
        lambda r: {k: v.clone() for k, v in r.module.state_dict().items()}, local_env_runner=False)[0]


def test_exact_setup_shows_no_drift(ray_local, tmp_path):
    algo = config().build_algo()
    try:
        for _ in range(2):
            result = algo.train()
            assert [r["iteration"] for r in result["moe_rl_drift"]] == [algo.iteration]   # this iteration's rows
        write_table(str(tmp_path / "drift.parquet"), algo.sync_gate.ledger())
        row = last_row(algo)
        assert abs(row["k3"]) < 1e-6 and row["routing_agreement"] == 1.0 and row["lag_versions"] == 0
        assert row["param_breach_lines"] == "" and row["decision"] == "sync" and row["action"] == ""
        assert result["moe_rl"]["drift/decision"] == "sync"
        ledger = pq.read_table(tmp_path / "drift.parquet")
        assert ledger.num_rows == 2
        for col in ("k1", "k2", "k3", "chi2", "ess", "max_abs_logp_diff", "routing_agreement", "decision", "cause",
                    "action", "reason", "weights_version", "lag_versions", "sync_id", "iteration", "module_id",
                    "update_size/experts", "k3_old_new", "probe_flip_rate", "weights_finite"):
            assert col in ledger.column_names, col
    finally:
        algo.stop()


@pytest.mark.slow
def test_a_compiled_rollout_copy_computes_the_learners_policy(ray_local):
    """moe.rollout_compile: the rollout copy samples through torch.compile, and the ledger, which
    compares its recorded log-probs and routing with the learner's eager forward, shows no drift."""
    algo = config(ep_size=1, rollout_compile=True).build_algo()
    try:
        for _ in range(2):
            algo.train()
        compiled = algo.env_runner_group.foreach_env_runner(
            lambda r: r.module.__dict__.get("_compiled_step") is not None, local_env_runner=False)
        assert compiled == [True]
        row = last_row(algo)
        assert row["k3"] <= 1e-9 and row["routing_agreement"] == 1.0 and row["decision"] == "sync", row
    finally:
        algo.stop()


@pytest.mark.parametrize("policy", ["hold", "rollback"])
def test_bf16_inference_copy_is_reported_as_mismatch_and_never_stalls(ray_local, policy):
    algo = config(ep_size=1, policy=policy, th={"max_abs_logp_diff": 1e-5}, inference_dtype="bf16").build_algo()
    try:
        algo.train()
        row = last_row(algo)
        assert row["max_abs_logp_diff"] > 1e-5 and row["k3"] > 0
        assert row["param_breach_lines"] == ""  # a bf16 copy is the synced weights cast to bf16, bit for bit
        assert row["cause"] == "mismatch" and row["action"] == "report" and row["decision"] == "sync"
        assert "max_abs_logp_diff" in row["reason"] and algo.weights_version == 2
    finally:
        algo.stop()


def test_trainer_token_dropping_is_reported_as_mismatch(ray_local):
    # A fresh policy is near-uniform, so dropped expert outputs move log-probs only a little:
    # the threshold is set where an exact setup stays (|K3| < 1e-6, see above).
    algo = config(policy="hold", th={"k3": 1e-6}, trainer_capacity_factor=0.5).build_algo()
    try:
        algo.train()
        row = last_row(algo)
        assert row["k3"] > 1e-6 and row["max_abs_logp_diff"] > 1e-5 and row["routing_agreement"] < 1.0
        assert row["cause"] == "mismatch" and row["decision"] == "sync" and "k3" in row["reason"]
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.parametrize("replay", [False, True, "mismatched"])
def test_second_expert_sampling_lowers_agreement_and_r3_restores_it(ray_local, replay):
    algo = config(trainer_second_expert_sampling=True, routing_replay=replay).build_algo()
    try:
        algo.train()
        row = last_row(algo)
        if replay:   # "mismatched": at the rollout's weights the trainer replays what differs
            assert row["routing_agreement"] == 1.0 and row["k3"] < 1e-6 and row["cause"] == ""
        else:
            assert row["routing_agreement"] < 0.9 and row["first_divergent_layer"] == 0
            assert row["k3"] > 1e-6 and row["cause"] == "mismatch" and row["decision"] == "sync"
    finally:
        algo.stop()


def test_stale_rollout_copy_is_repaired(ray_local):
    """A sync that never arrived: the check names the tensors and re-sends the synced weights."""
    algo = config(policy="hold").build_algo()
    try:
        stale = runner_state(algo)
        algo.train()
        algo.env_runner_group.foreach_env_runner(lambda r: r.module.load_state_dict(stale), local_env_runner=False)
        algo.train()
        row = last_row(algo)
        assert row["cause"] == "corrupt_copy" and row["action"] == "repair" and row["decision"] == "sync"
        assert row["repairs"] == 1 and "rollout actor 1: trunk." in row["param_breach_lines"]
        assert "max_diff=" in row["param_breach_lines"]
        assert algo.sync_gate.weights.corrupt_copies() == {}    # verified after the repair
    finally:
        algo.stop()


def test_wrong_expert_mapping_on_a_rollout_actor_is_named_and_repaired(ray_local):
    algo = config(policy="rollback").build_algo()
    try:
        algo.train()

        def swap(runner):
            sd = runner.module.state_dict()
            for s in ("w1", "b1", "w2", "b2"):
                t = sd[f"trunk.blocks.0.moe.experts.{s}"]
                t[[0, 3]] = t[[3, 0]].clone()
            runner.module.load_state_dict(sd)
        algo.env_runner_group.foreach_env_runner(swap, local_env_runner=False)
        algo.train()
        row = last_row(algo)
        assert row["action"] == "repair"
        breach = "rollout actor 1: trunk.blocks.0.moe.experts.experts.0.fc1.weight: max_diff="
        assert breach in row["param_breach_lines"]
        assert algo.sync_gate.weights.corrupt_copies() == {}
    finally:
        algo.stop()


@pytest.mark.parametrize("preset", ["token_is", "geo_rs_veto"])
def test_rollout_correction_reweights_and_rejects_and_is_reported(ray_local, preset):
    """A bf16 copy, its routing flips not replayed: the learner's old log-probs differ from the
    rollout's, the IS weights differ from 1 but stay <= C, RS rejects some steps, and the same
    ledger measures the mismatch."""
    algo = config(ep_size=1, inference_dtype="bf16", routing_replay=False).consistency(
        correction={"preset": preset, "rs_threshold": 1.0001}).build_algo()
    try:
        learner = algo.train()["learners"]["default_policy"]
        assert 0.0 < learner["correction/k3"] and algo.sync_gate.ledger()[-1]["k3"] > 0
        if preset == "token_is":
            assert 0.5 < learner["correction/is_mean"] <= 2.0 and learner["correction/is_max"] <= 2.0
            assert learner["correction/rejected_fraction"] == 0.0
        else:
            assert 0.0 < learner["correction/rejected_fraction"] < 1.0
            assert learner["correction/is_mean"] == 1.0 and "correction/veto_fraction" in learner
    finally:
        algo.stop()


def test_drift_study_reports_k3_by_length(ray_local, tmp_path):
    from moe_rl.app.drift_study import run_study
    rows = run_study([8, 16], "bf16", [0], str(tmp_path))
    assert [r["seq_len"] for r in rows] == [8, 16]
    assert all(r["k3"] > 0 for r in rows)  # bf16 inference copy: measurable, non-zero
    assert pq.read_table(tmp_path / "drift_study.parquet").num_rows == 2
    assert (tmp_path / "drift_study.svg").read_text().startswith("<svg")


@pytest.mark.parametrize("moe", [{"router": "sinkhorn"}, {"router": "reinforce"}, {"router": "bias"},
                                 {"capacity_factor": 1.0}, {"router": "reinforce", "capacity_factor": 1.0}])
def test_every_router_and_capacity_option_is_consistent_by_construction(ray_local, moe):
    """Batch-dependent and sampled routing choices are replayed or made batch-independent, so in
    fp32 the learner computes exactly what the rollout copy ran (8 tokens per call vs 100-token
    minibatches)."""
    algo = config(ep_size=1, **moe).build_algo()
    try:
        for _ in range(3):
            algo.train()
        for row in algo.sync_gate.ledger():
            assert row["routing_agreement"] == 1.0 and abs(row["k3"]) <= 1e-6, (moe, row["iteration"])
    finally:
        algo.stop()


def test_token_trunk_with_a_capacity_limit_is_consistent_without_replay(ray_local):
    """Each sequence is its own capacity group: the rollout copy (2 sequences per call) and the
    trainer (100-step minibatches) drop the same history positions, so `auto` replays nothing and
    the learner still computes exactly the rollout's policy, about half of the assignments dropped."""
    from ray.rllib.core import DEFAULT_MODULE_ID
    cfg = (MoEPPOConfig().environment("moe_rl/TokenSequence-v0", env_config={"seq_len": 8, "prompt_len": 4,
                                                                             "vocab_size": 4})
           .env_runners(num_env_runners=1, num_envs_per_env_runner=2)
           .training(lr=1e-3, train_batch_size_per_learner=300, minibatch_size=100, num_epochs=2)
           .moe(num_experts=4, top_k=2, d_model=16, d_ff=16, num_layers=2, num_heads=2, max_seq_len=16,
                capacity_factor=0.5)
           .consistency(sample_size=256).debugging(seed=0))
    algo = cfg.build_algo()
    try:
        assert algo.learner_group._learner.module[DEFAULT_MODULE_ID].replay_mode is None
        for _ in range(3):
            algo.train()
        for row in algo.sync_gate.ledger():
            assert row["routing_agreement"] == 1.0 and abs(row["k3"]) <= 1e-6, row["iteration"]
    finally:
        algo.stop()


def test_expert_dropout_is_not_mismatch(ray_local):
    """Dropout perturbs training, not what the trainer computes: the same-weights check runs without it."""
    algo = config(ep_size=1, expert_dropout=0.3).build_algo()
    try:
        for _ in range(2):
            algo.train()
        assert all(r["routing_agreement"] == 1.0 and abs(r["k3"]) < 1e-6 for r in algo.sync_gate.ledger())
    finally:
        algo.stop()


@pytest.mark.slow
def test_drift_study_measures_a_trained_checkpoint_at_a_longer_length(ray_local, tmp_path):
    """`drift-study --checkpoint`: the run's own policy (relative positions, trained at 8 tokens)
    goes into the learners and the rollout copy of a 24-token study, and is what they measure."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from moe_rl.app.checkpoint import save_checkpoint
    from moe_rl.app.drift_study import load_trained_policy, run_study, study_config, trained_policy
    from moe_rl.app.run_config import apply_overrides, load_run_config, resolved, validate_run_config
    from moe_rl.app.run_dir import RunDir
    cfg = apply_overrides(load_run_config(os.path.join(ROOT, "configs/tokens_long.yaml")),
                          ["env_config.seq_len=8", "moe.d_model=16", "moe.d_ff=16", "moe.num_experts=4",
                           "training.train_batch_size_per_learner=64", "training.minibatch_size=32"])
    config = validate_run_config(cfg)
    algo = config.build_algo()
    try:
        algo.train()
        run = RunDir(str(tmp_path / "run"), resolved(cfg, config))
        save_checkpoint(algo, run.checkpoints, 1, run.resolved_config)
        trained_state = algo.learner_group.module_state(inference_only=False)[DEFAULT_MODULE_ID]
    finally:
        algo.stop()
    run_cfg, policy = trained_policy(str(tmp_path / "run"), [24])
    assert policy and not any(k.startswith("vf") for k in policy)
    study = study_config(24, "none", 0, run_cfg=run_cfg).build_algo()
    try:
        load_trained_policy(study, policy)
        loaded = study.learner_group.module_state(inference_only=False)[DEFAULT_MODULE_ID]
        assert all(np.array_equal(loaded[k], trained_state[k]) for k in policy)
    finally:
        study.stop()
    rows = run_study([24], "none", [0], str(tmp_path / "study"), (run_cfg, policy))
    assert rows[0]["routing_agreement"] == 1.0 and abs(rows[0]["k3"]) < 1e-9   # fp32 copy: no drift
    assert 0.0 <= rows[0]["episode_return"] <= 1.0
    # The same run with absolute (learned) positions could not run 24 tokens: refused up front.
    shutil.copytree(tmp_path / "run", tmp_path / "learned")
    (tmp_path / "learned" / "config.yaml").write_text(
        yaml.safe_dump({**run_cfg, "moe": {**run_cfg["moe"], "positions": "learned", "max_seq_len": 16}}))
    with pytest.raises(ConfigError, match="^--lengths: the run's policy has learned positions"):
        trained_policy(str(tmp_path / "learned"), [24])


def test_a_run_whose_correction_rejects_everything_says_so_and_moves_no_weight(ray_local):
    """A bf16 copy and geometric rejection with the interval [1, 1]: no sequence is kept.
    Every update is skipped (the weights stay those of the first sync), counted, and the gate
    reports cause all_rejected with its streak."""
    algo = config(ep_size=1, inference_dtype="bf16", routing_replay=False).consistency(
        correction={"rs_level": "geometric", "rs_threshold": 1.0}).build_algo()
    try:
        before = algo.learner_group.module_state()["default_policy"]
        results = [algo.train() for _ in range(2)]
        after = algo.learner_group.module_state()["default_policy"]
        assert [k for k in before if not np.array_equal(before[k], after[k])] == []
        learner = results[-1]["learners"]["default_policy"]
        assert learner["correction/rejected_fraction"] == 1.0
        assert learner["correction/skipped_updates"] == 2.0 and learner["correction/skipped_updates_in_a_row"] == 2.0
        rows = algo.sync_gate.ledger()[-2:]
        assert all("all_rejected" in r["cause"].split(";") and "skip" in r["action"].split(";") for r in rows)
        assert "2 updates in a row" in rows[-1]["reason"] and rows[-1]["correction_skipped_steps"] > 0
    finally:
        algo.stop()

"""The sync gate: decisions matched to causes (pure), and every injected fault caught at the first
check after it and recovered from, on real Ray, RLlib and DeepSpeed (moe_rl.algo.faults)."""
import copy
import math
import random
import statistics

import numpy as np
import pytest
import ray
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from moe_rl import MoEPPOConfig
from moe_rl.algo import faults
from moe_rl.algo.sync_gate import GateStop
from moe_rl.core.digests import differing, in_sample, sample_of, state_digests, tensor_digest
from moe_rl.core.drift_kinds import sparse_flip_rate
from moe_rl.core.gate import GateState, RelativeLimit, validate_consistency
from moe_rl.core.state_copy import keep_state, restore_state
from moe_rl.rllib.runner import runner_digests

# --- pure: the decisions ---------------------------------------------------------------------------


def gate(**kw):
    return GateState(validate_consistency({"relative_warmup": 3, **kw}))


@pytest.mark.pure
def test_relative_limit_waits_for_history_and_keeps_a_floor():
    lim = RelativeLimit(z=8, warmup=3, window=10, floor=0.02)
    for v in (0.0, 0.0):
        lim.accept(v)
    assert lim.limit() is None
    lim.accept(0.0)
    assert lim.limit() == pytest.approx(8 * 0.02)       # a flat history is not a hair trigger
    for v in (1.0, 1.1, 0.9, 1.0, 1.05):
        lim.accept(v)
    assert 1.0 < lim.limit() < 10.0


@st.composite
def healthy_updates(draw):
    """A run's per-update figures, generated: the expert group's update size and the probe set's
    KL old->new, each log-normal noise (bounded at 2.5 sigma) around a level that falls as the
    updates shrink (a quickstart's went 0.077 -> 0.040 and 0.039 -> 0.005 over 5 updates)."""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    size, kl, decay = draw(st.floats(0.02, 0.1)), draw(st.floats(0.003, 0.04)), draw(st.floats(0.0, 0.3))

    def noise(sigma):
        return math.exp(sigma * max(-2.5, min(2.5, rnd.gauss(0.0, 1.0))))

    return [{"p|update_size/experts": size * math.exp(-decay * i) * noise(0.3),
             "p|k3_old_new": kl * math.exp(-2 * decay * i) * noise(0.5)} for i in range(draw(st.integers(3, 40)))]


# An injected LR x 1000 step (moe_rl.algo.faults): its update size and KL old->new.
HARMFUL = {"p|update_size/experts": 3.9, "p|k3_old_new": 175.0}


@pytest.mark.pure
@given(history=healthy_updates())
@hypothesis_settings(max_examples=50, deadline=None)
def test_healthy_updates_pass_and_a_harmful_one_is_flagged_against_the_runs_own_limits(history):
    g = gate()
    for row in history:                      # each healthy update passes, given the ones before it
        assert g.update_breaches(row, lag=1) == []
        g.accept(row, lag=1)
    found = g.update_breaches(HARMFUL, 1)
    assert [k for k, _, _ in found] == list(HARMFUL)
    for key, value, limit in found:           # the limit is the run's own: above its median, below the fault
        assert statistics.median(row[key] for row in history) < limit < value
    g.accept(HARMFUL, 1, breached=[k for k, _, _ in found])
    assert g.update_breaches(HARMFUL, 1) == found       # a flagged update never raises its own bar
    # L updates ahead of the last good weights (a hold): the limits scale with the lag (the update
    # size with L, the KL with L^2), so what would breach one update ahead passes three ahead.
    limits = {key: limit for key, _, limit in found}
    ahead = {"p|update_size/experts": 2 * limits["p|update_size/experts"], "p|k3_old_new": 5 * limits["p|k3_old_new"]}
    assert [k for k, _, _ in g.update_breaches(ahead, 1)] == list(HARMFUL)
    assert g.update_breaches(ahead, 3) == []


@pytest.mark.pure
def test_mismatch_is_reported_and_never_stalls():
    for policy in ("warn", "hold", "rollback"):
        v = gate(policy=policy).decide(finite=True, bad_update=[], mismatch=[("k3", 0.1, 1e-3)], corrupt=[],
                                       replicas=[])
        assert (v.decision, v.causes, v.actions) == ("sync", ["mismatch"], ["report"])
        assert "k3=0.1 (threshold=0.001)" in v.reason


@pytest.mark.pure
def test_hold_escalates_to_rollback_and_rollbacks_to_a_stop():
    bad = [("update_size/router", 5.0, 0.1)]
    g = gate(policy="hold", max_holds=2, max_rollbacks=2, rollback_lr_scale=0.5)
    decisions = [g.decide(finite=True, bad_update=bad, mismatch=[], corrupt=[], replicas=[]) for _ in range(9)]
    assert [v.decision for v in decisions] == ["hold", "hold", "rollback"] * 2 + ["hold", "hold", "stop"]
    assert [v.lr_scale for v in decisions[2::3]] == [0.5, 0.25, 0.25]     # the retries run slower
    ok = g.decide(finite=True, bad_update=[], mismatch=[], corrupt=[], replicas=[])
    assert ok.decision == "sync" and ok.lr_scale == 1.0 and g.holds_in_a_row == g.rollbacks_in_a_row == 0


@pytest.mark.pure
def test_warn_syncs_a_bad_update_but_never_nonfinite_weights():
    g = gate(policy="warn")
    assert g.decide(finite=True, bad_update=[("k3_old_new", 9.0, 0.1)], mismatch=[], corrupt=[],
                    replicas=[]).decision == "warn"
    v = g.decide(finite=False, bad_update=[], mismatch=[], corrupt=[], replicas=[])
    assert v.decision == "rollback" and "not finite" in v.reason


@pytest.mark.pure
def test_corrupt_copies_and_replicas_have_their_own_actions():
    v = gate(policy="rollback").decide(finite=True, bad_update=[], mismatch=[], corrupt=["actor 1: w"],
                                       replicas=["learner 1 vs learner 0: b"])
    assert v.decision == "sync" and v.actions == ["repair", "resync"]
    assert v.causes == ["corrupt_copy", "replica_divergence"]


@pytest.mark.pure
def test_gate_state_round_trips():
    g = gate()
    for x in (0.1, 0.2, 0.3, 0.4):
        g.accept({"p|k3_old_new": x}, 1)
    g.decide(finite=True, bad_update=[("x", 1.0, 0.1)], mismatch=[], corrupt=[], replicas=[])
    h = gate()
    h.set_state(g.get_state())
    assert h.get_state() == g.get_state()
    assert h.update_breaches({"p|k3_old_new": 50.0}, 1) == g.update_breaches({"p|k3_old_new": 50.0}, 1) != []


@pytest.mark.pure
def test_probe_flips_count_only_above_the_margin():
    old = {"routing": np.array([[[0, 1]], [[2, 3]], [[0, 1]]]).reshape(3, 1, 2),
           "margin": np.array([[1e-4], [0.5], [0.5]])}
    new = {"routing": np.array([[[2, 3]], [[0, 1]], [[1, 0]]]).reshape(3, 1, 2), "margin": np.zeros((3, 1))}
    # token 0 flipped at a tiny margin (near-uniform router): not counted; token 1 counted;
    # token 2 kept its set (order does not matter).
    assert sparse_flip_rate(old, new, margin=0.05) == pytest.approx(1 / 3)
    assert sparse_flip_rate(old, new, margin=0.0) == pytest.approx(2 / 3)


@pytest.mark.pure
def test_the_kept_state_restores_weights_and_moments_exactly_and_reuses_its_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step():
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()

    step()
    kept = keep_state({"m": model}, {"m": opt}, {"extra": torch.ones(3), "n": 1})
    step()
    again = keep_state({"m": model}, {"m": opt}, {"extra": torch.ones(3), "n": 2}, into=kept)
    assert all(a.data_ptr() == b.data_ptr()
               for a, b in zip(again["weights"]["m"].values(), kept["weights"]["m"].values()))
    good = copy.deepcopy({"w": model.state_dict(), "o": opt.state_dict()})
    for _ in range(2):              # restored twice: the kept copy survives the steps after a restore
        step()
        step()
        extra = restore_state(again, {"m": model}, {"m": opt})
        assert extra["n"] == 2 and extra["extra"] is not again["extra"]["extra"]
        assert all(torch.equal(v, good["w"][k]) for k, v in model.state_dict().items())
        for pid, state in opt.state_dict()["state"].items():
            assert all(torch.equal(v, good["o"]["state"][pid][k]) for k, v in state.items())


@pytest.mark.pure
def test_the_finiteness_check_sees_every_nan_and_inf():
    from moe_rl.rllib.weight_publishing import all_finite
    assert all_finite([torch.randn(1000)]) and all_finite([torch.empty(0)]) and all_finite([])
    for n in (1, 17, 4097):
        for pos in {0, n // 2, n - 1}:
            for v in (float("nan"), float("inf"), -float("inf")):
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(n).to(dtype)
                    x[pos] = v
                    assert not all_finite([x]) and not all_finite([torch.ones(3), x]), (n, pos, v, dtype)


@pytest.mark.pure
def test_digests_are_exact_in_the_rollout_dtype():
    w = torch.randn(64, 64)
    assert tensor_digest(w, torch.bfloat16) == tensor_digest(w.to(torch.bfloat16))
    assert tensor_digest(w) != tensor_digest(w.to(torch.bfloat16))
    w2 = w.clone()
    w2[3, 3] += 1e-6
    assert differing(state_digests({"a": w, "b": w}), state_digests({"a": w, "b": w2})) == ["b"]
    assert differing(state_digests({"a": w}), state_digests({"a": w, "c": w})) == ["c"]



@pytest.mark.pure
def test_a_large_state_is_digested_on_threads_to_the_same_digests(monkeypatch):
    from moe_rl.core import digests
    state = {f"w{i}": torch.randn(256, 64) for i in range(6)}
    state["bf"] = state["w0"].to(torch.bfloat16)
    one_thread = digests.state_digests(state, {"w1": "torch.bfloat16"})
    monkeypatch.setattr(digests, "PARALLEL_MIN_NUMEL", 0)     # every state counts as large
    monkeypatch.setattr(digests, "DIGEST_THREADS", 2)
    assert digests.state_digests(state, {"w1": "torch.bfloat16"}) == one_thread
    assert digests._pool is not None

# --- the fault matrix on real Ray ------------------------------------------------------------------

def config(learners=0, policy="warn", **consistency):
    return (MoEPPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=4)
            .training(lr=1e-3, train_batch_size_per_learner=500, minibatch_size=125, num_epochs=2,
                      vf_loss_coeff=0.5, vf_clip_param=1000.0)
            .learners(num_learners=learners)
            .moe(num_experts=4, top_k=2, ep_size=2 if learners else 1, d_model=16, d_ff=16)
            .consistency(policy=policy, sample_size=256, relative_warmup=3, **consistency)
            .debugging(seed=0))


def run(algo, iterations, inject_at=None, fault=None):
    rows = []
    for i in range(iterations):
        if i == inject_at:
            faults.inject(algo, fault)
        algo.train()
        rows.append(algo.sync_gate.ledger()[-1])
    return rows


def synced_equals_learners(algo) -> bool:
    live = algo.learner_group.module_state()["default_policy"]
    synced = ray.get(algo.gate.weights.refs[0])["default_policy"]
    return all(np.array_equal(live[k], synced[k]) for k in synced)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["warn", "hold", "rollback"])
def test_a_healthy_run_sees_no_gate_action(ray_local, policy):
    algo = config(policy=policy).build_algo()
    try:
        rows = run(algo, 8)
        assert [r["action"] for r in rows] == [""] * 8, [r["reason"] for r in rows]
        assert algo.weights_version == 9   # every update reached the rollouts
    finally:
        algo.stop()


@pytest.mark.slow
def test_corrupt_rollout_copy_is_repaired_at_the_first_check(ray_local):
    algo = config(policy="warn").build_algo()
    try:
        rows = run(algo, 6, inject_at=4, fault=faults.CorruptRolloutCopy(delta=0.5))
        assert [r["cause"] for r in rows] == ["", "", "", "", "corrupt_copy", ""]
        assert "max_diff=0.5 (threshold=0)" in rows[4]["param_breach_lines"] and rows[4]["repairs"] == 1
        assert rows[4]["decision"] == "sync" and algo.sync_gate.weights.corrupt_copies() == {}
    finally:
        algo.stop()


def test_a_rotating_digest_share_catches_a_corrupt_copy_within_k_checks(ray_local):
    """consistency.param_sample 1/2: each check digests half of the tensors (the same half on the
    learners and the rollout actors). A copy corrupted outside the next check's half (again after
    every sync: a faulty load) is caught at the check after."""
    algo = config(policy="warn", param_sample=0.5).build_algo()
    try:
        algo.train()
        share = set(algo.gate.weights.digests["default_policy"])
        everything = set(algo.runner_call(runner_digests)[1][0]["default_policy"])
        assert 0 < len(share) < len(everything)
        # a dense tensor (the fault writes the module's own state) outside the next check's share
        outside = sorted(n for n in everything - share if ".experts.experts." not in n)[0]
        rows = []
        for _ in range(2):
            faults.inject(algo, faults.CorruptRolloutCopy(name=outside, delta=0.5))
            algo.train()
            rows.append(algo.sync_gate.ledger()[-1])
        assert [r["cause"] for r in rows] == ["", "corrupt_copy"], [r["cause"] for r in rows]
        assert f"{outside}: max_diff=0.5" in rows[1]["param_breach_lines"]
    finally:
        algo.stop()


@pytest.mark.pure
def test_the_rotating_shares_cover_every_tensor_once():
    names = [f"trunk.blocks.{b}.moe.experts.experts.{e}.fc1.weight" for b in range(2) for e in range(8)]
    for k in (2, 3, 8):
        shares = [{n for n in names if in_sample(n, (k, i))} for i in range(k)]
        assert set().union(*shares) == set(names) and sum(map(len, shares)) == len(names)
    assert sample_of(1.0, 5) is None and sample_of(0.125, 11) == (8, 3)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["warn", "hold"])
def test_nonfinite_candidate_never_reaches_the_rollouts(ray_local, policy):
    algo = config(policy=policy).build_algo()
    try:
        rows = run(algo, 6, inject_at=4, fault=faults.NonFiniteCandidate())
        assert rows[4]["decision"] == "rollback" and rows[4]["weights_finite"] is False
        assert rows[5]["decision"] == "sync" and rows[5]["lr_scale_next"] == 1.0
        assert synced_equals_learners(algo)
    finally:
        algo.stop()


@pytest.mark.slow
def test_harmful_update_is_rolled_back_exactly_with_a_slower_retry(ray_local):
    algo = config(policy="rollback").build_algo()
    try:
        run(algo, 5)
        before = copy.deepcopy(algo.learner_group.get_state())["learner"]
        rows = run(algo, 1, inject_at=0, fault=faults.HarmfulUpdate(factor=1000))
        assert rows[0]["decision"] == "rollback" and rows[0]["cause"] == "bad_update"
        assert "k3_old_new" in rows[0]["reason"] and rows[0]["lr_scale_next"] == 0.5
        after = algo.learner_group.get_state()["learner"]   # weights and Adam moments as before, exactly
        for mid, w in before["rl_module"].items():
            assert all(np.array_equal(w[k], after["rl_module"][mid][k]) for k in w)
        for name, opt in before["optimizer"].items():
            for pid, st in opt["state"]["state"].items():
                got = after["optimizer"][name]["state"]["state"][pid]
                assert all(np.array_equal(np.asarray(st[k]), np.asarray(got[k])) for k in st)
        rows = run(algo, 1)
        assert rows[0]["decision"] == "sync" and rows[0]["lr_scale_next"] == 1.0
    finally:
        algo.stop()


@pytest.mark.slow
def test_a_replica_restarted_since_the_snapshot_takes_a_restored_ones_state(ray_local):
    """Data-parallel RLlib learners each keep the last good state; one that lost it (a restart)
    is given a restored replica's state."""
    import gymnasium as gym
    group = config().learners(num_learners=2).build_learner_group(env=gym.make("CartPole-v1"))
    try:
        def head(learner):
            return learner.plain_module("default_policy").pi.weight.detach().clone()

        def perturb(learner):
            with torch.no_grad():
                learner.plain_module("default_policy").pi.weight.add_(1.0)
            learner.lr_scale = 0.25

        token = group.snapshot()
        good = group.foreach(head)
        group.foreach(perturb)
        restarted = group._worker_manager.actor_ids()[1:]
        group.foreach_learner(lambda learner: learner.__dict__.pop("_kept"), remote_actor_ids=restarted)
        group.restore(token)
        assert all(torch.equal(w, good[0]) for w in group.foreach(head))
        assert group.foreach(lambda learner: learner.lr_scale) == [1.0, 1.0]
    finally:
        group.shutdown()


@pytest.mark.slow
def test_hold_keeps_rollouts_on_last_good_then_escalates(ray_local):
    algo = config(policy="hold", max_holds=2).build_algo()
    try:
        rows = run(algo, 8, inject_at=4, fault=faults.HarmfulUpdate(factor=1000))
        decisions = [r["decision"] for r in rows[4:]]
        assert decisions[:3] == ["hold", "hold", "rollback"] and decisions[3] == "sync"
        assert [r["lag_versions"] for r in rows[4:7]] == [0, 1, 2]   # lag is reported, never mismatch
        assert all(r["cause"] == "bad_update" for r in rows[4:7])
        assert synced_equals_learners(algo)
    finally:
        algo.stop()


@pytest.mark.slow
def test_repeated_rollbacks_stop_the_run_cleanly(ray_local):
    algo = config(policy="rollback", max_rollbacks=1).build_algo()
    try:
        run(algo, 4)
        faults.inject(algo, faults.NonFiniteCandidate())
        algo.train()                                   # the first rollback
        faults.inject(algo, faults.NonFiniteCandidate())
        with pytest.raises(GateStop, match="not finite.*--resume"):
            algo.train()
        assert synced_equals_learners(algo)            # stopped holding the last good weights
    finally:
        algo.stop()


@pytest.mark.slow
def test_replica_divergence_is_resynced_under_expert_parallelism(ray_local):
    algo = config(learners=2, policy="rollback").build_algo()
    try:
        rows = run(algo, 5, inject_at=3, fault=faults.PerturbReplica(rank=1, delta=0.01))
        assert rows[3]["cause"] == "replica_divergence" and rows[3]["action"] == "resync"
        assert "learner 1 vs learner 0: trunk.blocks.0.moe.router.gate.weight: max_diff=0.01" in rows[3][
            "param_breach_lines"]
        assert rows[4]["cause"] == "" and algo.sync_gate.weights.diverged_replicas(algo.iteration) == []
    finally:
        algo.stop()


@pytest.mark.pure
def test_k3_by_expert_shows_the_drifting_expert():
    from moe_rl.core.drift_kinds import by_expert
    topk = np.array([[[0, 1]], [[0, 2]], [[3, 1]], [[3, 2]]])          # 4 tokens, 1 layer, top-2
    log_r = torch.tensor([0.0, 0.0, math.log(2.0), math.log(2.0)]).double()   # only tokens through expert 3 drift
    got = by_expert(log_r.exp() - 1 - log_r, topk, "sparse")[0]
    assert got[0] == 0.0 and got[3] == pytest.approx(2 - 1 - math.log(2))
    assert got[1] == pytest.approx((2 - 1 - math.log(2)) / 2)


@pytest.mark.pure
def test_q_change_is_measured_over_the_runs_recent_q_scale():
    """Early in a DQN run the Q-values pass near zero: over the old scale alone an ordinary step of
    0.02 reads 2.0 (a bad update by a history near 0.5); over the run's recent scale (0.07) it
    reads 0.3, and a blow-up still reads orders of magnitude."""
    from moe_rl.core.drift_kinds import q_change
    old = np.array([[0.01, -0.01, 0.01], [-0.01, 0.01, -0.01]])
    step = old + np.array([[0.02, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert q_change(old, step)["q_change"] == pytest.approx(2.0)
    assert q_change(old, step, reference=0.07)["q_change"] == pytest.approx(0.02 / 0.07)
    assert q_change(old, old * 1e4, reference=0.07)["q_change"] > 100
    grown = old * 100                                                    # mean |Q| 1.0, above the reference
    assert q_change(grown, grown + 0.02, reference=0.07)["q_change"] == pytest.approx(0.02)


# --- the edges: each test failed before its fix ----------------------------------------------------

def _actor(**kw):
    from helpers import PureCheck

    from moe_rl.core.drift_kinds import PolicyKind
    return PureCheck(validate_consistency({"relative_warmup": 3, "relative_z": 1.0, **kw}), {"p": PolicyKind()})


def _check(check, lag, size, skipped=None):
    """One check of module p's candidate: only its update size (sq_diff / sq_ref = size^2)."""
    return check.check(lag=lag, stats={"finite": True, "terms": {"p": {"experts": [size ** 2, 1.0]}}},
                       skipped=skipped)[0]


@pytest.mark.pure
def test_a_held_candidate_is_judged_and_kept_at_its_true_lag():
    """The sync gate passes the lag before the update; the candidate is one update further. After a
    hold (lag 1) it is 2 updates past the last good weights: limit x 2, history value / 2."""
    actor = _actor(policy="hold")
    for _ in range(3):
        assert _check(actor, 0, 0.05)["decision"] == "sync"         # limit 0.05 + 1 x 0.025 = 0.075
    assert _check(actor, 0, 0.1)["decision"] == "hold"              # one update: 0.1 > 0.075
    assert _check(actor, 1, 0.1)["decision"] == "sync"              # two updates: 0.1 < 0.15
    assert list(actor.state.limits["p|update_size/experts"].values)[-1] == pytest.approx(0.05)


@pytest.mark.pure
def test_an_update_the_correction_emptied_is_a_gate_cause_with_its_streak():
    actor = _actor()
    v = _check(actor, 0, 0.0, skipped={"p": {"steps": 8, "skipped": 8, "in_a_row": 3}})
    assert (v["decision"], v["causes"], v["actions"]) == ("sync", ["all_rejected"], ["skip"])
    assert "kept no step" in v["reason"] and "3 updates in a row" in v["reason"]
    assert actor.state.limits.get("p|update_size/experts") is None or not actor.state.limits[
        "p|update_size/experts"].values                              # its zero update size is no history
    v = _check(actor, 0, 0.05, skipped={"p": {"steps": 8, "skipped": 2, "in_a_row": 0}})
    assert v["causes"] == [] and actor.state.counts["all_rejected"] == 1


@pytest.mark.pure
def test_an_emptied_update_after_a_hold_still_has_the_held_update_judged():
    """The correction rejected all of this update, but the held one before it still separates the
    candidate from the synced weights: it is judged (at the updates actually applied), not waved
    through as all_rejected, and stays out of the history."""
    actor = _actor(policy="hold")
    for _ in range(3):
        assert _check(actor, 0, 0.05)["decision"] == "sync"
    assert _check(actor, 0, 5.0)["decision"] == "hold"
    v = _check(actor, 1, 5.0, skipped={"p": {"steps": 8, "skipped": 8, "in_a_row": 1}})
    assert v["decision"] == "hold" and set(v["causes"]) == {"bad_update", "all_rejected"}, v
    assert len(actor.state.limits["p|update_size/experts"].values) == 3


@pytest.mark.pure
def test_under_warn_a_breaching_value_never_raises_its_own_bar():
    actor = _actor(policy="warn")
    for _ in range(3):
        _check(actor, 0, 0.05)
    limit = actor.state.limits["p|update_size/experts"].limit()
    for _ in range(5):
        assert _check(actor, 0, 1.0)["decision"] == "warn"
    assert actor.state.limits["p|update_size/experts"].limit() == limit


@pytest.mark.pure
def test_alternating_rollback_and_pass_reaches_the_stop():
    """A retry at the slower LR passes, the next full-LR update fails again: a rollback is forgiven
    only after max_rollbacks passing checks in a row."""
    g = gate(policy="rollback", max_rollbacks=2)
    bad = [("update_size/router", 5.0, 0.1)]
    seq = [g.decide(finite=True, bad_update=b, mismatch=[], corrupt=[], replicas=[]).decision
           for b in (bad, [], bad, [], bad)]
    assert seq == ["rollback", "sync", "rollback", "sync", "stop"]
    g = gate(policy="rollback", max_rollbacks=2)
    seq = [g.decide(finite=True, bad_update=b, mismatch=[], corrupt=[], replicas=[]).decision
           for b in (bad, [], [], bad, [], [], bad)]
    assert seq == ["rollback", "sync", "sync", "rollback", "sync", "sync", "rollback"]   # forgiven


@pytest.mark.pure
def test_absolute_caps_scale_with_the_lag_like_the_relative_limits():
    g = gate(thresholds={"update_size": 0.1, "k3_old_new": 0.01})
    row = {"p|update_size/experts": 0.15, "p|k3_old_new": 0.03}
    assert [k for k, _, _ in g.update_breaches(row, 1)] == ["p|update_size/experts", "p|k3_old_new"]
    assert g.update_breaches(row, 2) == []                          # caps 0.2 and 0.04

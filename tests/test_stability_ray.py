"""The stability toolkit inside real learners: the DeepSpeed group (ep_size=2 over gloo) and MoE-PPO."""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import ENV, adam_moments, batch, ds_config, shard_loss

from moe_rl import MoEPPOConfig
from moe_rl.rllib.moe_learner import BALANCE_STATE, STABILITY_STATE

MID = "default_policy"


def step_on_every_learner(learner, data, poison_rank=None):
    """One collective step; rank `poison_rank` puts a NaN into one of its expert gradients first."""
    obs, actions = data[dist.get_rank()]
    module = learner.module[MID]
    grads = learner.compute_gradients({MID: shard_loss(module, obs, actions)})
    if dist.get_rank() == poison_rank:
        name = next(n for n, p in module.named_parameters() if "deepspeed_experts" in n)
        dict(module.named_parameters())[name].grad.view(-1)[0] = float("nan")
    named = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    learner.apply_gradients(grads)
    [(_, tk)] = learner.toolkits(MID)
    norms = {k: tk.last_stats[k] for k in ("stability/grad_norm/experts", "stability/grad_norm/total")}
    return {"skipped": tk.skipped, "steps": tk.step_count, "norms": norms, "grads": named,
            "ep_rank": learner.ep_rank}


def shards(group):
    return [dict(s) for s in group.foreach_learner(
        lambda l: l.shard(inference_only=False, everything=True)["default_policy"])]


def test_nan_on_one_learner_skips_the_step_on_all_and_weights_stay_bit_identical(ray_local):
    group = ds_config().build_learner_group(env=ENV)
    try:
        data = {r: batch(24) for r in range(2)}
        group.foreach_learner(step_on_every_learner, data=data)  # Adam moments exist from here on
        weights, moments = shards(group), adam_moments(group)
        out = group.foreach_learner(step_on_every_learner, data=data, poison_rank=1)
        assert [o["skipped"] for o in out] == [1, 1] and [o["steps"] for o in out] == [1, 1]
        for before, after in zip(weights, shards(group)):
            assert before.keys() == after.keys()
            assert all(np.array_equal(before[k], after[k]) for k in before)
        for before, after in zip(moments, adam_moments(group)):
            assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
        # The next clean step applies everywhere and no NaN ever reached the weights.
        out = group.foreach_learner(step_on_every_learner, data=data)
        assert [o["steps"] for o in out] == [2, 2]
        after = shards(group)
        assert all(np.isfinite(v).all() for s in after for v in s.values())
        assert any(not np.array_equal(weights[0][k], after[0][k]) for k in after[0])
    finally:
        group.shutdown()


def test_group_gradient_norms_are_global_and_identical_on_every_learner(ray_local):
    group = ds_config().build_learner_group(env=ENV)
    try:
        out = group.foreach_learner(step_on_every_learner, data={r: batch(16 + 8 * r) for r in range(2)})
        # Expert shards are disjoint across the two ep ranks: the global norm sums both.
        expert_sq = sum(float(g.pow(2).sum()) for o in out for n, g in o["grads"].items() if "deepspeed_experts" in n)
        dense_sq = sum(float(g.pow(2).sum()) for n, g in out[0]["grads"].items() if "deepspeed_experts" not in n)
        for o in out:
            assert o["norms"]["stability/grad_norm/experts"] == pytest.approx(math.sqrt(expert_sq), rel=1e-6)
            assert o["norms"]["stability/grad_norm/total"] == pytest.approx(math.sqrt(expert_sq + dense_sq), rel=1e-6)
        assert out[0]["norms"] == out[1]["norms"]   # bit-identical: same decision everywhere
    finally:
        group.shutdown()


def poison_rank1(learner, module_id):
    if dist.is_initialized() and dist.get_rank() == 1:
        next(p for p in learner.module[module_id].parameters() if p.grad is not None).grad.fill_(float("inf"))


@pytest.mark.slow
def test_moe_ppo_with_the_toolkit_skips_poisoned_iterations_and_reports_lrs(ray_local):
    config = (ds_config().env_runners(num_env_runners=1, num_envs_per_env_runner=2)
              .stability(lr_schedules={"router": {"schedule": "constant", "lr": 5e-6},
                                       "experts": {"schedule": "cosine", "lr": 3e-5, "eta_min": 1e-6, "t_max": 100}},
                         grad_clip=1.0, expert_dropout_schedule={"start": 0.05, "end": 0.2, "steps": 100}))
    algo = config.build_algo()
    try:
        r1 = algo.train()["learners"][MID]
        steps = (r1["stability/skipped_steps"],
                 algo.learner_group.foreach_learner(lambda l: l.toolkits(MID)[0][1].step_count))
        assert steps[0] == 0 and steps[1][0] == steps[1][1] > 0
        n = steps[1][0]
        assert r1["stability/lr/router"] == pytest.approx(5e-6)
        cosine = (1 + math.cos(math.pi * (n - 1) / 100)) / 2
        assert r1["stability/lr/experts"] == pytest.approx(1e-6 + (3e-5 - 1e-6) * cosine)
        assert r1["stability/expert_dropout"] == pytest.approx(0.05 + 0.15 * n / 100)
        before = algo.learner_group.module_state(inference_only=False)["default_policy"]
        algo.learner_group.foreach_learner(lambda l: l.grad_hooks.append(poison_rank1))
        r2 = algo.train()["learners"][MID]
        assert r2["stability/skipped_steps"] == n   # every step of the iteration, counted once per learner
        after = algo.learner_group.module_state(inference_only=False)["default_policy"]
        assert all(np.array_equal(before[k], after[k]) for k in before)
    finally:
        algo.stop()


def test_local_learner_router_warmup_and_lamb(ray_local):
    """The single-process learner (num_learners=0) runs the same toolkit: LAMB + router warm-up."""
    config = (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
              .training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1)
              .moe(num_experts=4, top_k=2, d_model=16, d_ff=16, policy_head="dual")
              .stability(optimizer="lamb", router_warmup_steps=1000).debugging(seed=0))
    algo = config.build_algo()
    try:
        learner = algo.learner_group._learner
        before = {n: p.detach().clone() for n, p in learner.module[MID].named_parameters()}
        result = algo.train()["learners"][MID]
        assert result["stability/router_warmup"] == 1.0
        changed = {n for n, p in learner.module[MID].named_parameters() if not torch.equal(before[n], p)}
        assert changed and all(".router." in n for n in changed)
        assert type(learner.get_optimizer(MID)).__name__ == "Lamb"
        assert "pi.mlp.0.weight" in before   # the dual-branch head
    finally:
        algo.stop()


def test_reinforce_router_is_trained_by_its_policy_gradient_loss(ray_local):
    config = (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
              .training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1)
              .moe(num_experts=4, top_k=2, d_model=16, d_ff=16, router="reinforce", reinforce_loss_coef=0.5)
              .debugging(seed=0))
    algo = config.build_algo()
    try:
        def baseline(learner):
            return learner.module[MID].trunk.blocks[0].moe.router.baseline.weight.detach().clone()
        before = algo.learner_group.foreach(baseline)[0]
        result = algo.train()["learners"][MID]
        assert math.isfinite(result["reinforce_router_loss"]) and result["reinforce_router_loss"] != 0
        assert not torch.equal(before, algo.learner_group.foreach(baseline)[0])
    finally:
        algo.stop()


def toolkit_steps(learner) -> int:
    [state] = [v for k, v in learner.get_state()[STABILITY_STATE].items() if k.split("|")[0] == MID]
    return state["step_count"]


def test_schedules_continue_after_a_checkpoint_restore(ray_local, tmp_path):
    """The toolkit's step count (what every schedule counts) is learner state: it survives a restore."""
    def build():
        return (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
                .training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1)
                .moe(num_experts=4, top_k=2, d_model=16, d_ff=16)
                .stability(lr_schedules={"experts": {"schedule": "cosine", "lr": 1e-3, "t_max": 50}})
                .debugging(seed=0)).build_algo()
    algo = build()
    try:
        algo.train()
        steps = algo.learner_group.foreach(toolkit_steps)[0]
        algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    algo = build()
    try:
        algo.restore_from_path(str(tmp_path / "ckpt"))
        assert steps > 0 and algo.learner_group.foreach(toolkit_steps)[0] == steps
    finally:
        algo.stop()


def test_adaptive_balance_weight_is_logged_bounded_and_kept_in_learner_state(ray_local, tmp_path):
    """moe.balance: adaptive trains end to end: the weight it used is in the learner results,
    never above aux_loss_coef, and survives a checkpoint restore."""
    def build():
        return (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
                .training(train_batch_size_per_learner=200, minibatch_size=50, num_epochs=2)
                .moe(num_experts=8, top_k=2, d_model=16, d_ff=16, aux_loss_coef=0.05, balance="adaptive")
                .debugging(seed=0)).build_algo()

    def balance_state(learner):
        return learner.get_state()[BALANCE_STATE][MID]
    algo = build()
    try:
        coefs = [algo.train()["learners"][MID]["aux_loss_coef"] for _ in range(2)]
        state = algo.learner_group.foreach(balance_state)[0]
        algo.save_to_path(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    assert all(0.0 <= c <= 0.05 for c in coefs) and state["steps"] >= 2 * 2 * 4   # every applied step observed
    algo = build()
    try:
        algo.restore_from_path(str(tmp_path / "ckpt"))
        restored = algo.learner_group.foreach(balance_state)[0]
        assert restored["coef"] == state["coef"] and torch.equal(restored["loads"], state["loads"])
    finally:
        algo.stop()

"""DeepSpeed-MoE learner group: real Ray actors, real DeepSpeed engines, ep_size=2 over gloo."""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import ENV, adam_moments, batch, ds_config, shard_loss
from ray.rllib.core.columns import Columns

from moe_rl.actors.learner_group import KEPT
from moe_rl.core.settings import ConfigError
from moe_rl.core.sharding import ShardError, assemble_shards, stack_experts, to_global_name, unstack_experts
from moe_rl.rllib.rl_module import MOE_ROUTING, MOE_TOPK, MoEPolicyModule


def learner_step(learner, data):
    """On every learner: its shard's loss -> DeepSpeed backward (reductions) -> engine step."""
    obs, actions = data[dist.get_rank()]
    module = learner.module["default_policy"]
    grads = learner.compute_gradients({"default_policy": shard_loss(module, obs, actions)})
    named = {to_global_name(n, learner.ep_rank, learner.num_local["default_policy"]): p.grad.clone()
             for n, p in module.named_parameters() if p.grad is not None}
    learner.apply_gradients(grads)
    return named, learner.shard(inference_only=False, everything=True)["default_policy"]


@pytest.fixture(scope="module")
def group(ray_local):
    g = ds_config().build_learner_group(env=ENV)
    yield g
    g.shutdown()


def reference_module(config, state):
    """A single-process module holding `state` (canonical per-expert form, as published)."""
    ref = MoEPolicyModule(observation_space=ENV.observation_space, action_space=ENV.action_space,
                          model_config=config.model_config)
    ref.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in stack_experts(
        state, ref.state_dict().keys()).items()}, strict=True)
    return ref


@pytest.mark.parametrize("sizes", [(32, 32), (37, 19)])
def test_gradients_and_update_match_single_process_reference(ray_local, sizes):
    config = ds_config()
    group = config.build_learner_group(env=ENV)  # fresh: Adam's first step from zero moments
    try:
        _compare_with_reference(config, group, sizes)
    finally:
        group.shutdown()


def _compare_with_reference(config, group, sizes):
    before = group.module_state(inference_only=False)["default_policy"]
    data = {r: batch(n) for r, n in enumerate(sizes)}
    results = group.foreach_learner(learner_step, data=data)
    ref = reference_module(config, before)
    # DeepSpeed's scaling: the gradient of the mean of the learners' (per-shard mean) losses.
    loss = sum(shard_loss(ref, *data[r]) for r in data) / len(data)
    loss.backward()
    ref_grads = unstack_experts({n: p.grad for n, p in ref.named_parameters()})
    grads = {}
    for named, _ in results:
        for n, g in named.items():
            if n in grads and "experts.experts" not in n:  # dense grads: identical on every learner
                assert torch.equal(grads[n], g), n
            grads[n] = g
    assert set(grads) == set(ref_grads)
    for n, g in grads.items():
        err = (g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)
        assert err <= 1e-5, (n, float(err))
    opt = torch.optim.Adam(ref.parameters(), lr=config.lr)
    opt.step()
    after = assemble_shards([{k: v for k, v in shard.items() if "experts.experts" in k or r == 0}
                             for r, (_, shard) in enumerate(results)], before.keys())
    for n, p in unstack_experts({n: p.detach() for n, p in ref.named_parameters()}).items():
        err = np.abs(after[n] - p.numpy()).max() / max(np.abs(p.numpy()).max(), 1e-12)
        assert err <= 1e-5, (n, err)


def test_each_learner_holds_half_of_the_experts(group):
    stats = group.memory_stats()
    state = group.module_state(inference_only=False)["default_policy"]
    full = sum(v.size * 4 for k, v in state.items() if "experts.experts" in k)
    assert [s["expert_param_bytes"] for s in stats] == [full / 2, full / 2]
    assert all(s["peak_rss_mb"] > 0 for s in stats)


def test_uneven_token_counts_drop_exactly_what_the_groups_capacity_leaves_out(ray_local):
    """trainer_capacity_factor 1.0 on learners holding 50 and 7 tokens: every rank sizes its buffers
    alike, by the larger capacity ceil(1.0 * 50 * 2 / 4) = 25 assignments per expert, so each rank
    drops what its experts' loads exceed 25 by (counted here from the router's own choices). The
    7 tokens are one state 7 times, all on the same 2 experts: with a capacity of its own (4) the
    small rank would drop 6."""
    g = ds_config(trainer_capacity_factor=1.0).build_learner_group(env=ENV)
    rng = np.random.default_rng(1)
    obs = {0: torch.as_tensor(rng.uniform(-1, 1, (50, 4)), dtype=torch.float32),
           1: torch.as_tensor(np.repeat(rng.uniform(-1, 1, (1, 4)), 7, axis=0), dtype=torch.float32)}
    try:
        def forward(learner, obs):
            out = learner.module["default_policy"].forward_train({Columns.OBS: obs[dist.get_rank()]})
            return out[Columns.ACTION_DIST_INPUTS].shape[0], [(rec.top_k_indices.clone(), int(rec.dropped.sum()))
                                                              for rec in out[MOE_ROUTING]]
        results = g.foreach_learner(forward, obs=obs)
    finally:
        g.shutdown()
    capacity = math.ceil(1.0 * 50 * 2 / 4)
    assert [n for n, _ in results] == [50, 7]
    dropped = [[d for _, d in layers] for _, layers in results]
    expected = [[int((torch.bincount(topk.reshape(-1), minlength=4) - capacity).clamp_min(0).sum())
                 for topk, _ in layers] for _, layers in results]
    assert dropped == expected and len(dropped[0]) == 2      # both MoE layers
    assert min(dropped[0]) > 0 and dropped[1] == [0, 0]      # the 50 overfill an expert; the 7 fit


def test_deepspeed_learners_replay_the_token_trunks_capacity_drops(ray_local):
    """The token trunk's capacity groups are its sequences, so a single-process learner needs no
    replay for them; DeepSpeed's gate keeps a capacity of its own (trainer_capacity_factor), so
    the DeepSpeed learners replay the rollout's drops."""
    from moe_rl.envs.token_sequence import TokenSequenceEnv
    env = TokenSequenceEnv(seq_len=8, prompt_len=4, vocab_size=4)
    config = ds_config(capacity_factor=1.0, num_heads=2, max_seq_len=16)
    local = MoEPolicyModule(observation_space=env.observation_space, action_space=env.action_space,
                            model_config=config.model_config)
    assert local.replay_mode is None
    g = config.build_learner_group(env=env)
    try:
        assert g.foreach_learner(lambda learner: learner.module["default_policy"].replay_mode) == ["full", "full"]
    finally:
        g.shutdown()


def test_shard_assembly_is_strict(group):
    shards = [s["default_policy"] for s in __import__("ray").get(group.publish_weights())]
    expected = set().union(*shards)
    assert set(assemble_shards(shards, expected)) == expected
    with pytest.raises(ShardError, match="missing"):
        assemble_shards(shards[:1], expected)
    with pytest.raises(ShardError, match="two shards"):
        assemble_shards([shards[0], shards[0]], expected)


def test_wrong_expert_mapping_is_caught(group):
    """Swapping two experts' names gives a complete, well-shaped state — only the outputs betray
    it. The rollout copy built from it disagrees with the learner's own forward."""
    config = ds_config()
    state = group.module_state(inference_only=False)["default_policy"]
    obs = batch(64)[0]
    learner_logits = group.foreach_learner(
        lambda l: l.module["default_policy"].forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS])[0]
    good = reference_module(config, state).forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
    assert (good - learner_logits).abs().max() <= 1e-6
    swapped = dict(state)
    for suffix in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        a, b = f"trunk.blocks.0.moe.experts.experts.0.{suffix}", f"trunk.blocks.0.moe.experts.experts.2.{suffix}"
        swapped[a], swapped[b] = state[b], state[a]
    bad = reference_module(config, swapped).forward_inference({Columns.OBS: obs})[Columns.ACTION_DIST_INPUTS]
    assert (bad - learner_logits).abs().max() > 1e-4


def test_deepspeed_config_is_passed_through(ray_local):
    g = (ds_config().deepspeed(config={"gradient_clipping": 0.25, "zero_optimization": {"stage": 1}})
         .build_learner_group(env=ENV))
    try:
        assert g.foreach_learner(lambda l: (l._engines["default_policy"].gradient_clipping(),
                                            l._engines["default_policy"].zero_optimization_stage())) == [(0.25, 1)] * 2
        # ZeRO-1 partitions the optimizer state: the gate's snapshot goes through DeepSpeed's checkpoints
        snapshot = g.snapshot()
        assert snapshot != KEPT and __import__("os").path.isfile(f"{snapshot}/group_state.json")
        g.restore(snapshot)
    finally:
        g.shutdown()


def test_checkpoint_round_trip_is_bit_exact_on_every_rank(group, tmp_path):
    group.foreach_learner(learner_step, data={0: batch(16), 1: batch(16)})  # non-zero Adam moments
    path = group.save_to_path(str(tmp_path / "ckpt"))
    saved_weights = __import__("ray").get(group.publish_weights(inference_only=False))
    saved_moments = adam_moments(group)
    group.foreach_learner(learner_step, data={0: batch(16), 1: batch(16)})  # move away
    group.restore_from_path(path)
    assert_state_is(group, saved_weights, saved_moments)


def assert_state_is(group, weights, moments):
    """Every rank's weights and Adam moments equal the given ones, bit for bit."""
    for a, b in zip(weights, __import__("ray").get(group.publish_weights(inference_only=False))):
        a, b = a["default_policy"], b["default_policy"]
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    for rank_a, rank_b in zip(moments, adam_moments(group)):
        assert len(rank_a) == len(rank_b) > 0
        for a, b in zip(rank_a, rank_b):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_gate_snapshot_is_kept_in_memory_and_restores_bit_exactly(group):
    """The last good state per sync: each learner copies its weights, Adam moments and learner
    state in memory (no checkpoint write), restored exactly on every rank, and restorable twice."""
    ray = __import__("ray")
    group.foreach_learner(learner_step, data={0: batch(16), 1: batch(16)})  # non-zero Adam moments
    token = group.snapshot()
    assert token == KEPT
    saved_weights, saved_moments = ray.get(group.publish_weights(inference_only=False)), adam_moments(group)
    for _ in range(2):
        group.foreach_learner(learner_step, data={0: batch(16), 1: batch(16)})  # move away
        group.restore(token)
        assert_state_is(group, saved_weights, saved_moments)


def test_training_with_ep2_syncs_rollouts_exactly(ray_local):
    algo = ds_config().build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        assert result["moe_rl"]["learner/expert_param_bytes/rank0"] > 0
        obs = batch(32)[0]
        runner = algo.env_runner_group.foreach_env_runner(
            lambda er: er.module.forward_inference({Columns.OBS: obs}), local_env_runner=False)[0]
        learner = algo.learner_group.foreach_learner(
            lambda l: l.module["default_policy"].forward_inference({Columns.OBS: obs}))[0]
        a = torch.log_softmax(runner[Columns.ACTION_DIST_INPUTS].double(), -1)
        b = torch.log_softmax(learner[Columns.ACTION_DIST_INPUTS].double(), -1)
        assert (a - b).abs().max() <= 1e-6
        assert torch.equal(runner[MOE_TOPK].long(), learner[MOE_TOPK].long())
    finally:
        algo.stop()


@pytest.mark.parametrize("kwargs, field", [
    ({"num_learners": 3}, "moe.ep_size"), ({"num_learners": 0}, "moe.ep_size"),
])
def test_ep_size_must_divide_learners(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}: must be"):
        ds_config().learners(**kwargs).validate()


def test_ep_size_must_divide_experts():
    with pytest.raises(ConfigError, match="^moe.ep_size: must be a divisor of moe.num_experts=4"):
        ds_config(ep_size=3).learners(num_learners=3).validate()


def test_a_group_that_cannot_be_placed_gives_up_in_time_and_leaves_nothing_behind(ray_local):
    """After a lost host the rest of the cluster may have no room for the rebuilt group: it gives up
    after cluster.wait_timeout_s (LearnerPlacementTimeout, one line), its placement group removed,
    instead of waiting forever (found by tests/test_two_hosts.py)."""
    import time

    from ray.util import placement_group_table

    from moe_rl.actors.learner_group import DeepSpeedLearnerGroup, LearnerPlacementTimeout
    config = ds_config().learners(custom_resources_per_learner={"a_host_that_is_gone": 1})
    config.validate()
    before = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    t0 = time.monotonic()
    with pytest.raises(LearnerPlacementTimeout, match=r"could not be placed within 2s \(cluster.wait_timeout_s\)"):
        DeepSpeedLearnerGroup(config=config, module_spec=config.get_multi_rl_module_spec(env=ENV),
                              placement_timeout_s=2.0)
    assert time.monotonic() - t0 < 30
    left = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    assert left <= before

"""weight_sync.transport: collective: buckets (pure), then real Ray: DeepSpeed learners (ep_size 2)
broadcasting their parts over gloo to real RLlib EnvRunners, a refused header, a killed and
restarted rollout actor."""
import time

import numpy as np
import pytest
import ray
import torch
from helpers import ds_config

from moe_rl.actors.weight_transport import receive, send
from moe_rl.algo import faults
from moe_rl.core.buckets import bucket_bytes_of, pack, plan_buckets, plan_id, unpack
from moe_rl.core.digests import differing
from moe_rl.core.sharding import canonical_views, unstack_experts
from moe_rl.rllib.runner import runner_digests, synced_state

ENTRIES = [("m", "a", (4, 3), "torch.float32"), ("m", "b", (5,), "torch.bfloat16"),
           ("m", "c", (2, 2), "torch.float32"), ("n", "d", (100,), "torch.float32")]


@pytest.mark.pure
def test_buckets_hold_at_most_the_limit_and_a_large_tensor_alone():
    buckets = plan_buckets(ENTRIES, bucket_bytes=64)
    assert [[e[1] for e in b] for b in buckets] == [["a", "b"], ["c"], ["d"]]   # 48+10, 16, 400 (alone)
    assert plan_buckets(ENTRIES, bucket_bytes=10**6) == [ENTRIES]


@pytest.mark.pure
def test_pack_unpack_round_trips_in_the_wire_dtype():
    values = [torch.randn(e[2]) for e in ENTRIES]
    for bucket in plan_buckets(ENTRIES, 64):
        vals = [values[ENTRIES.index(e)] for e in bucket]
        buf = pack(vals, bucket, out=torch.empty(1000, dtype=torch.uint8))
        assert buf.dtype == torch.uint8 and buf.numel() == bucket_bytes_of(bucket)
        for (e, got), want in zip(unpack(buf, bucket), vals):
            assert got.shape == e[2] and str(got.dtype) == e[3]
            assert torch.equal(got, want.to(got.dtype))     # bf16: the same rounding as a cast


@pytest.mark.pure
def test_mixed_dtypes_pack_into_one_bucket_aligned():
    """Two bf16 modules then float32 ones (a multi-agent bf16 rollout copy): each entry starts at a
    multiple of its item size, so a float32 after 5 bf16 values is a valid view (this
    raised "storage_offset() must be divisible by 4" and the sync fell back after the gloo timeout)."""
    (bucket,) = plan_buckets(ENTRIES, bucket_bytes=10**6)
    values = [torch.randn(e[2]) for e in bucket]
    buf = pack(values, bucket, out=torch.empty(1000, dtype=torch.uint8))
    for (e, got), want in zip(unpack(buf.clone(), bucket), values):
        assert torch.equal(got, want.to(got.dtype))
    assert bucket_bytes_of(bucket) == buf.numel() == 48 + 10 + 2 + 16 + 400   # two padding bytes before "c"


@pytest.mark.pure
def test_plan_id_names_shape_and_dtype():
    assert plan_id(ENTRIES) == plan_id(list(ENTRIES))
    assert plan_id(ENTRIES) != plan_id([ENTRIES[0][:2] + ((3, 4), "torch.float32")] + ENTRIES[1:])
    assert plan_id(ENTRIES) != plan_id([ENTRIES[0]] + [ENTRIES[1][:3] + ("torch.float32",)] + ENTRIES[2:])


@pytest.mark.pure
def test_canonical_views_write_through_to_stacked_experts():
    state = {"t.moe.experts.w1": torch.randn(3, 4, 2), "t.moe.experts.w2": torch.randn(3, 4, 2), "x": torch.ones(2)}
    views, copies = canonical_views(state), unstack_experts(state)
    assert views.keys() == copies.keys() and all(torch.equal(views[k], copies[k]) for k in views)
    views["t.moe.experts.experts.1.fc2.weight"].copy_(torch.arange(8.0).view(2, 4))   # fc2 is w2[e] transposed
    assert torch.equal(state["t.moe.experts.w2"][1], torch.arange(8.0).view(2, 4).T)


def _collective(**moe):
    return (ds_config(**moe).env_runners(num_env_runners=2, num_envs_per_env_runner=2)
            .weight_sync(transport="collective", bucket_mb=0.002, timeout_s=20))   # several buckets per source


def _copies_match(algo):
    ids, digests = algo.runner_call(runner_digests)
    versions = algo.runner_call(lambda r: r._weights_seq_no)[1]
    return all(not differing(algo.gate.weights.digests[m], d[m]) for d in digests for m in d), versions


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_collective_sync_loads_every_copy_exactly(ray_local, dtype):
    algo = _collective(inference_dtype=dtype).build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        ws = algo.gate.weights.transport
        assert ws.fallbacks == 0 and ws.last_seconds > 0
        assert len(ws.sources) == 2                       # both expert-parallel ranks send their part
        wire = {e[3] for es in ws.sources.values() for e in es}
        assert wire == {"torch.bfloat16" if dtype == "bf16" else "torch.float32"}   # the copy's dtype on the wire
        assert result["moe_rl"]["sync/collective_fallbacks"] == 0
        exact, versions = _copies_match(algo)
        assert exact and versions == [algo.weights_version] * 2
    finally:
        algo.stop()


def test_a_refused_header_writes_nothing_then_the_object_store_repairs(ray_local):
    algo = _collective().build_algo()
    try:
        algo.train()
        ws = algo.gate.weights.transport
        before = algo.runner_call(runner_digests)[1]
        v = algo.weights_version
        # The driver announces v + 1, the learners send v + 2: a mixed-version load.
        tag = ws._runners_async(receive, ws.runner_ids, sources=ws.sources, version=v + 1,
                                bucket_bytes=ws.bucket_bytes, backend="gloo")
        refs = [ws._learners.foreach_async(send, ranks=[r], group=g, version=v + 2, entries=ws.sources[g],
                                           bucket_bytes=ws.bucket_bytes, backend="gloo")[0]
                for g, r in ws.source_rank.items()]
        deadline = time.monotonic() + 20
        ws._wait_learners(refs, deadline)
        results = ws._wait_runners(tag, 2, deadline)
        assert all(not r["ok"] and f"refused version {v + 2} (announced {v + 1})" in r["error"]
                   for r in results.values()), results
        assert algo.runner_call(runner_digests)[1] == before                  # nothing was written
        assert algo.runner_call(lambda r: r._weights_seq_no)[1] == [v, v]    # the version stays
        algo.train()                                                           # and the groups still work
        exact, versions = _copies_match(algo)
        assert exact and versions == [algo.weights_version] * 2 and ws.fallbacks == 0
    finally:
        algo.stop()


def test_the_gate_works_from_the_parts_the_learners_kept(ray_local):
    """Under the collective transport the learners keep the synced part (no publish per sync): the
    update size is computed against it, and a corrupt copy is repaired from parts published on demand."""
    algo = _collective().build_algo()
    try:
        for _ in range(2):
            algo.train()
        assert algo.gate.weights.published_refs is None                       # nothing published
        row = algo.sync_gate.ledger()[-1]
        sizes = [v for k, v in row.items() if k.startswith("update_size/")]
        assert sizes and all(0 < v < 1 for v in sizes), row
        faults.inject(algo, faults.CorruptRolloutCopy(runner=2, delta=0.5))
        algo.train()
        row = algo.sync_gate.ledger()[-1]
        assert row["cause"] == "corrupt_copy" and row["repairs"] == 1, row
        assert "rollout actor 2: " in row["param_breach_lines"] and "max_diff=0.5" in row["param_breach_lines"]
        exact, versions = _copies_match(algo)
        assert exact and versions == [algo.weights_version] * 2 and algo.gate.weights.transport.fallbacks == 0
    finally:
        algo.stop()


def test_without_the_gate_nothing_is_kept_and_the_object_store_serves_from_the_weights(ray_local):
    algo = _collective().consistency(enabled=False).build_algo()
    try:
        algo.train()
        assert algo.gate.weights.published_refs is None and algo.gate.weights.transport.fallbacks == 0
        assert algo.learner_group.foreach(lambda l: hasattr(l, "_synced_part")) == [False, False]
        algo.gate.push_synced_weights(force=True)          # what a repair or a restarted actor gets
        learners = {k: v for k, v in algo.learner_group.module_state()["default_policy"].items()}
        copies = algo.runner_call(lambda r: {k: v.numpy() for k, v in synced_state(r.module).items()})[1]
        for copy in copies:
            assert copy.keys() == learners.keys() and all(np.array_equal(copy[k], learners[k]) for k in copy)
    finally:
        algo.stop()


@pytest.mark.slow
def test_a_restarted_rollout_actor_rejoins(ray_local):
    algo = _collective().fault_tolerance(restart_failed_env_runners=True).build_algo()
    try:
        algo.train()
        ray.kill(algo.env_runner_group._worker_manager._actors[2], no_restart=False)
        deadline = time.time() + 120
        while time.time() < deadline and not (algo.gate.weights.transport.runner_ids == [1, 2] and algo.iteration >= 4
                                             and algo.env_runner_group.num_healthy_remote_workers() == 2):
            algo.train()
        ws = algo.gate.weights.transport
        assert ws.runner_ids == [1, 2] and ws.generation >= 2, (ws.runner_ids, ws.generation)
        result = algo.train()                       # a collective sync with the restarted actor in the group
        assert result["moe_rl"]["sync/collective_fallbacks"] == ws.fallbacks
        fallbacks = ws.fallbacks
        algo.train()
        assert ws.fallbacks == fallbacks
        exact, versions = _copies_match(algo)
        assert exact and versions == [algo.weights_version] * 2
    finally:
        algo.stop()

"""Property tests (Hypothesis) of the remedies at their edges: the rollout correction over its
settings x inputs, the sync gate's decision function, and the weight-sync buckets."""
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moe_rl.core.buckets import bucket_bytes_of, pack, plan_buckets, unpack
from moe_rl.core.correction import correct, resolve_correction
from moe_rl.core.errors import ConfigError
from moe_rl.core.gate import GateState, validate_consistency
from moe_rl.core.losses import reinforce_router_loss
from moe_rl.core.routing import RoutingRecord

pytestmark = pytest.mark.pure
FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

thresholds = st.floats(1e-12, 1e6, allow_nan=False, allow_infinity=False)


@st.composite
def correction_settings(draw):
    """Any combination of the settings, including ones they must refuse (see `resolved`)."""
    mode = draw(st.sampled_from(["decoupled", "bypass"]))
    d = {"mode": mode,
         "is_level": draw(st.sampled_from([None, "token", "sequence"])),
         "is_threshold": draw(thresholds), "is_batch_normalize": draw(st.booleans()),
         "rs_level": draw(st.sampled_from([None, "token", "sequence", "geometric"])),
         "rs_threshold": draw(thresholds), "rs_threshold_lower": draw(st.none() | thresholds),
         "veto_threshold": draw(st.none() | thresholds),
         "routing_rs": draw(st.sampled_from(["off", "any", "share"]))}
    return d


def resolved(d):
    """The resolved setting, or None where resolve_correction refuses it."""
    try:
        return resolve_correction(d)
    except ConfigError:
        return None


log_ratios = st.floats(-800, 800, allow_nan=False) | st.sampled_from([math.inf, -math.inf, math.nan, 0.0])


@st.composite
def rollout_batch(draw):
    """Log-ratios, a loss mask whose masked rows end each sequence (PPO's phantom rows), sequence ids."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    valid, seq = [], []
    for i, n in enumerate(lengths):
        valid += [True] * n + [False]
        seq += [i] * (n + 1)
    lr = draw(st.lists(log_ratios, min_size=len(valid), max_size=len(valid)))
    return torch.tensor(lr, dtype=torch.float64), torch.tensor(valid), torch.tensor(seq)


ZEROS = (torch.zeros(2, dtype=torch.float64), torch.tensor([True, False]), torch.tensor([0, 0]))


@FAST
@given(correction_settings(), rollout_batch())
@example({"rs_level": "token", "rs_threshold": 0.5}, ZEROS)   # accepted on e14abeb: rejected everything
def test_a_valid_setting_never_rejects_a_step_whose_ratio_is_one(d, batch):
    s = resolved(d)
    if s is None:
        return
    _, valid, seq = batch
    _, keep, _ = correct(torch.zeros(len(valid), dtype=torch.float64), valid, seq, s)
    assert torch.equal(keep, valid)


@FAST
@given(correction_settings(), rollout_batch())
def test_the_correction_is_the_identity_when_rollout_equals_trainer(d, batch):
    s = resolved(d)
    if s is None:
        return
    _, valid, seq = batch
    w, keep, m = correct(torch.zeros(len(valid), dtype=torch.float64), valid, seq, s)
    assert torch.all(w[valid] == 1.0) or (s.is_threshold < 1 and torch.allclose(w[valid], w[valid][0]))
    assert m["correction/rejected_fraction"] == 0.0 and m["correction/k3"] == 0.0


@FAST
@given(correction_settings(), rollout_batch())
def test_weights_are_finite_and_masked_rows_never_kept(d, batch):
    s = resolved(d)
    if s is None:
        return
    lr, valid, seq = batch
    w, keep, m = correct(lr, valid, seq, s)
    assert torch.isfinite(w).all() and not (keep & ~valid).any()
    assert all(math.isfinite(v) for k, v in m.items() if k != "correction/k3")


@FAST
@given(rollout_batch(), st.integers(0, 2 ** 31))
def test_the_loss_is_finite_or_nothing_is_kept_and_masked_rows_get_no_gradient(batch, seed):
    """PPO's masked mean and the REINFORCE router's loss on kept rows: finite whenever a row is
    kept (else the learner skips the step: tests/test_correction.py), zero gradient on masked rows."""
    lr, valid, _ = batch
    _, keep, _ = correct(lr, valid, torch.cumsum((~valid).long(), 0) - (~valid).long(),
                         resolve_correction({"preset": "token_is_rs"}))
    g = torch.Generator().manual_seed(seed)
    n = len(keep)
    logits = torch.randn(n, 4, generator=g, requires_grad=True)
    adv = torch.randn(n, generator=g)
    logp = torch.log_softmax(logits, -1)[:, 0]
    ppo = torch.sum((adv * logp)[keep]) / keep.sum()
    record = RoutingRecord(top_k_indices=torch.zeros(n, 1, dtype=torch.long), gate_weights=torch.ones(n, 1),
                           router_logits=logits, selection_logp=torch.log_softmax(logits, -1)[:, 1],
                           baseline=logits[:, 2])
    router = reinforce_router_loss(record, adv, keep)
    if not keep.any():
        assert not torch.isfinite(ppo) and router.item() == 0.0
        return
    assert torch.isfinite(ppo) and torch.isfinite(router)
    (ppo + router).backward()
    assert torch.all(logits.grad[~keep] == 0)


@st.composite
def histories(draw):
    return draw(st.lists(st.floats(1e-4, 1.0), min_size=3, max_size=12))


@FAST
@given(histories(), st.floats(1e-4, 10.0), st.integers(2, 6), st.sampled_from(["update_size", "k3_old_new",
                                                                            "probe_flip_rate"]),
       st.none() | st.floats(1e-3, 1.0))
def test_a_candidate_never_breaches_at_its_true_lag_where_a_lag_one_candidate_passes(history, size, lag, signal, cap):
    """A candidate `lag` updates ahead, each of the same per-update size as one that passes at lag
    1, has at most lag x (update size, flips) or lag^2 x (KL) that value: it passes too."""
    s = validate_consistency({"relative_warmup": 3, **({"thresholds": {signal: cap}} if cap else {})})
    g = GateState(s)
    key = f"p|{signal}/g" if signal == "update_size" else f"p|{signal}"
    for v in history:
        g.accept({key: v}, 1)
    if g.update_breaches({key: size}, 1):
        return
    grown = size * (lag if signal != "k3_old_new" else lag ** 2)
    assert g.update_breaches({key: grown}, lag) == []


dtypes = st.sampled_from(["torch.float32", "torch.bfloat16", "torch.float16", "torch.float64", "torch.int64",
                          "torch.int32", "torch.int16", "torch.int8", "torch.uint8", "torch.bool"])
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@FAST
@given(st.lists(st.tuples(shapes, dtypes), min_size=1, max_size=8), st.integers(1, 256), st.integers(0, 2 ** 31))
def test_pack_then_unpack_is_the_identity_for_any_mix_of_dtypes_and_shapes(specs, bucket_bytes, seed):
    from moe_rl.core.digests import DTYPES
    entries = [("m", f"t{i}", shape, dtype) for i, (shape, dtype) in enumerate(specs)]
    g = torch.Generator().manual_seed(seed)
    values = {e[1]: (torch.randn(e[2], generator=g) * 100).to(DTYPES[e[3]]) for e in entries}
    buckets = plan_buckets(entries, bucket_bytes)
    assert [e for b in buckets for e in b] == entries
    out = torch.empty(max(bucket_bytes_of(b) for b in buckets), dtype=torch.uint8)
    for bucket in buckets:
        assert len(bucket) == 1 or bucket_bytes_of(bucket) <= bucket_bytes
        buf = pack([values[e[1]] for e in bucket], bucket, out).clone()   # as received: a buffer of its own
        for e, got in unpack(buf, bucket):
            assert got.dtype == DTYPES[e[3]] and got.shape == e[2]
            assert torch.equal(got, values[e[1]])

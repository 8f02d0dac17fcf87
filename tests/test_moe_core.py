"""Pure-torch core: MoE layer, routers, losses, health metrics (no Ray)."""
import math

import pytest
import torch

from moe_rl.core.experts import FAST_TANH_MIN_ELEMENTS, tanh
from moe_rl.core.health import HealthWatch
from moe_rl.core.layer import DISPATCH_PATHS, MoELayer
from moe_rl.core.losses import load_balancing_loss, moe_aux_losses, replay_anchor_loss, router_z_loss
from moe_rl.core.metrics import balance_metrics, expert_counts, flip_rate, health_summary, jaccard, router_entropy
from moe_rl.core.routers import balance_step, balancing_routers, plackett_luce_logp
from moe_rl.core.routing import (
    OWN_CHOICE,
    RoutingRecord,
    gate_weights,
    layer_disagreement,
    queue_positions,
    sequence_queue_positions,
    sinkhorn,
    sinkhorn_potentials,
)

pytestmark = pytest.mark.pure


def naive_reference(layer: MoELayer, x: torch.Tensor, rec: RoutingRecord) -> torch.Tensor:
    """Per-token, per-slot loop: the definition of the MoE output."""
    ex = layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(rec.top_k_indices.shape[1]):
            e = int(rec.top_k_indices[t, j])
            h = ex.act(ex.w1[e] @ x[t] + ex.b1[e]) @ ex.w2[e] + ex.b2[e]
            out[t] += rec.gate_weights[t, j] * h
    return out


def test_uniform_top1_routing_gives_aux_loss_one_and_cv_zero():
    n, t = 4, 8
    probs = torch.full((t, n), 1.0 / n)
    idx = (torch.arange(t) % n).unsqueeze(1)
    assert load_balancing_loss(probs, idx).item() == pytest.approx(1.0, abs=1e-7)
    m = balance_metrics(expert_counts(idx, n))
    assert m["cv"] == 0.0 and m["load_grade"] == 0 and m["active_experts"] == n


def test_all_tokens_on_one_expert_is_danger():
    m = balance_metrics(expert_counts(torch.zeros(32, 1, dtype=torch.long), 8))
    assert m["load_grade"] == 2 and m["active_experts"] == 1 and m["min_util"] == 0.0 and m["max_util"] == 1.0
    assert m["cv"] == pytest.approx(math.sqrt(7.0))  # population std of (32,0,...,0) / 4


def test_warning_grade_band():
    # u = (0.2, 0.2, 0.2, 0.2, 0.1, 0.1): min 0.1 = 0.6/N -> warning; CV = 0.35 healthy.
    m = balance_metrics(torch.tensor([2, 2, 2, 2, 1, 1]))
    assert m["load_grade"] == 1


def test_z_loss_and_entropy_hand_values():
    logits = torch.zeros(3, 4)
    assert router_z_loss(logits).item() == pytest.approx(math.log(4) ** 2)
    h = router_entropy(torch.full((3, 4), 0.25))
    assert h["router_entropy"] == pytest.approx(math.log(4)) and h["router_entropy_norm"] == pytest.approx(1.0)
    assert router_entropy(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))["router_entropy"] == pytest.approx(0.0)


def test_logit_stats_per_expert():
    from moe_rl.core.metrics import logit_stats
    s = logit_stats(torch.tensor([[1.0, -1.0], [3.0, -1.0]]))
    assert s["logit_mean"] == [2.0, -1.0] and s["logit_std"] == [1.0, 0.0]


def test_flip_rate_and_jaccard():
    a = torch.tensor([[0, 1], [2, 3], [1, 2]])
    b = torch.tensor([[1, 0], [2, 0], [3, 0]])
    assert flip_rate(a, b) == pytest.approx(2 / 3)
    assert jaccard(a, b) == pytest.approx((1.0 + 1 / 3 + 0.0) / 3)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sinkhorn_meets_both_marginals(k):
    torch.manual_seed(0)
    scores = torch.randn(64, 8) * 3
    plan = sinkhorn(scores, top_k=k, epsilon=0.1, max_iters=500, tol=1e-5)
    assert torch.allclose(plan.sum(1), torch.full((64,), float(k)), atol=1e-3)
    assert torch.allclose(plan.sum(0), torch.full((8,), 64 * k / 8), atol=1e-3)
    # The iteration cap is reported, not hidden: the residual says how far the rows are off.
    _, _, residual = sinkhorn_potentials(scores, k, 0.01, max_iters=3)
    assert residual > 1e-4


def test_sinkhorn_router_learns_a_balancing_bias_and_routes_alike_at_both_ends():
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 2, router="sinkhorn", router_kwargs={"sinkhorn_bias_rate": 0.5})
    layer.router.gate.bias.data[0] = 5.0  # everyone would pick expert 0 under plain top-k
    x = torch.randn(256, 16)
    _, before = layer(x)
    assert balance_metrics(expert_counts(before.top_k_indices, 8))["max_util"] >= 0.45
    for _ in range(40):                    # training forwards, one balancing step after each
        layer(x)
        balance_step(layer)
    _, rec = layer(x)
    assert balance_metrics(expert_counts(rec.top_k_indices, 8))["cv"] < 0.5
    layer.eval()                           # rollouts: 8 tokens per call, the same choice per token
    greedy = torch.cat([layer(x[i:i + 8])[1].top_k_indices for i in range(0, 256, 8)])
    assert torch.equal(greedy, rec.top_k_indices)


def test_measuring_never_moves_a_balancing_bias():
    torch.manual_seed(0)
    for router in ("bias", "sinkhorn"):
        layer = MoELayer(8, 4, 2, router=router)
        layer.router.gate.bias.data[0] = 3.0
        with torch.no_grad():              # a trainer-side view of rollout data
            layer(torch.randn(64, 8))
        balance_step(layer)
        assert layer.router.selection_bias.abs().sum() == 0, router


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_output_matches_naive_reference(k):
    torch.manual_seed(1)
    layer = MoELayer(12, 6, k, d_ff=20, dispatch="grouped")
    x = torch.randn(40, 12)
    y, rec = layer(x)
    assert torch.allclose(y, naive_reference(layer, x, rec), atol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "no_grad"])  # no_grad: rollout branches
@pytest.mark.parametrize("tokens", [1, 2, 3, 64, 300])
def test_every_dispatch_path_gives_the_same_output(tokens, grad):
    torch.manual_seed(2)
    layer = MoELayer(16, 8, 2, d_ff=24, shared_expert=True).eval()
    x = torch.randn(tokens, 16)
    outs = {}
    for path in DISPATCH_PATHS:
        layer.dispatch = path
        with torch.set_grad_enabled(grad):
            outs[path] = layer(x)[0]
    for path, y in outs.items():
        assert torch.allclose(y, outs["dense"], atol=1e-5), path


def test_replay_reproduces_output_and_keeps_router_gradient():
    torch.manual_seed(3)
    layer = MoELayer(8, 4, 2, d_ff=16)
    x = torch.randn(20, 8)
    y, rec = layer(x)
    y2, rec2 = layer(x, replay_indices=rec.top_k_indices.clone())
    assert torch.equal(y, y2) and torch.equal(rec2.top_k_indices, rec.top_k_indices)
    # A replayed routing that differs from what the router would pick still trains the router.
    forced = torch.stack([torch.zeros(20, dtype=torch.long), torch.ones(20, dtype=torch.long)], 1)
    layer.zero_grad()
    y3, _ = layer(x, replay_indices=forced)
    y3.pow(2).sum().backward()
    assert layer.router.gate.weight.grad is not None and layer.router.gate.weight.grad.abs().sum() > 0
    assert torch.allclose(y3, naive_reference(layer, x, layer.router(x, replay_indices=forced)), atol=1e-5)


def test_partial_replay_leaves_own_choice_rows_to_the_router():
    """routing_replay "mismatched": OWN_CHOICE rows route as without replay, the others are forced."""
    torch.manual_seed(3)
    layer = MoELayer(8, 4, 2, d_ff=16)
    x = torch.randn(10, 8)
    y_own, own = layer(x)
    forced = torch.tensor([[3, 2]]).expand(10, 2)
    replay = torch.where(torch.arange(10)[:, None] % 2 == 0, torch.full_like(forced, OWN_CHOICE), forced)
    y, rec = layer(x, replay_indices=replay)
    assert torch.equal(rec.top_k_indices[::2], own.top_k_indices[::2]) and torch.equal(y[::2], y_own[::2])
    assert torch.equal(rec.top_k_indices[1::2], forced[1::2])
    assert torch.equal(rec.router_top_k, own.top_k_indices)
    # Which rows a partial replay pins: the top-k *set* differs in a layer (order does not count).
    recorded = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [2, 3]], [[0, 1], [3, 1]]])
    ours = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [1, 2]]])
    assert layer_disagreement(recorded, ours).tolist() == [[False, False], [False, False], [False, True]]


def test_capacity_factor_drops_overflow_tokens():
    layer = MoELayer(8, 4, 1, capacity_factor=1.0)
    layer.router.gate.bias.data[:] = torch.tensor([10.0, 0, 0, 0])  # all to expert 0
    x = torch.randn(16, 8)
    y, rec = layer(x)
    assert rec.dropped.sum().item() == 16 - 4  # capacity = ceil(1.0 * 16 * 1 / 4) = 4
    assert torch.all(y[rec.dropped[:, 0]] == 0)


def test_sequence_capacity_groups_count_each_sequences_valid_tokens_only():
    idx = torch.tensor([[[0, 1], [0, 2], [0, 1], [3, 2]],
                        [[0, 1], [0, 1], [1, 0], [0, 1]]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    pos = sequence_queue_positions(idx, valid, 4)
    # first choices queue before second choices; an invalid token queues nowhere
    assert pos[0].tolist() == [[0, 0], [1, 0], [2, 1], [0, 0]]
    assert torch.equal(pos[1], queue_positions(idx[1], 4))         # a full sequence: the flat rule
    layer = MoELayer(8, 4, 1, capacity_factor=1.0)
    layer.router.gate.bias.data[:] = torch.tensor([10.0, 0, 0, 0])  # all to expert 0
    x = torch.randn(2, 8, 8)
    filled = torch.arange(8)[None] < torch.tensor([[8], [4]])
    _, rec = layer(x, seq_mask=filled)
    # capacity ceil(1.0 * n * 1 / 4) per sequence: 2 of 8, 1 of 4; padding is never counted as dropped
    assert rec.dropped.view(2, 8).sum(1).tolist() == [6, 3]
    _, alone = layer(x[1:], seq_mask=filled[1:])
    assert torch.equal(alone.dropped, rec.dropped[8:])


def test_bias_router_moves_bias_against_load_at_optimizer_steps():
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 1, router="bias", router_kwargs={"bias_update_rate": 0.01})
    layer.router.gate.bias.data[:] = torch.tensor([3.0, 0, 0, 0])
    layer(torch.randn(64, 8))
    assert layer.router.selection_bias.abs().sum() == 0     # not before the step
    balance_step(layer)
    b = layer.router.selection_bias
    assert b[0] < 0 and (b[1:] > 0).all()


def test_only_routers_with_balancing_state_take_balance_steps():
    layers = [MoELayer(8, 4, 1, router=r) for r in ("topk", "bias", "sinkhorn", "reinforce")]
    model = torch.nn.ModuleList(layers)
    assert balancing_routers(model) == [layers[1].router, layers[2].router]


def test_the_plain_routers_gates_are_the_softmax_of_its_chosen_logits():
    torch.manual_seed(0)
    for normalize in (True, False):
        layer = MoELayer(8, 6, 2, normalize_gates=normalize)
        rec = layer(torch.randn(40, 8))[1]
        assert torch.equal(rec.gate_weights, gate_weights(rec.router_logits, rec.top_k_indices, normalize))
        assert torch.equal(rec.top_k_indices, rec.router_logits.topk(2).indices)


def test_fast_tanh_is_tanh():
    """Large fp32 CPU tensors take tanh through sigmoid (torch's CPU tanh is scalar code): the
    values within 2e-7 of torch.tanh and the gradient is tanh's own; small tensors and other
    dtypes get torch.tanh itself."""
    torch.manual_seed(0)
    x = (torch.randn(FAST_TANH_MIN_ELEMENTS + 5) * 4).requires_grad_()
    y = tanh(x)
    assert (y - torch.tanh(x)).abs().max().item() < 2.5e-7 and y.abs().max().item() <= 1.0
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    (ref,) = torch.autograd.grad(torch.tanh(x), x, torch.ones_like(y))
    assert (g - ref).abs().max().item() < 1e-6
    with torch.no_grad():
        assert torch.equal(tanh(x), y.detach())
    small = torch.randn(64, 8)
    assert torch.equal(tanh(small), torch.tanh(small))
    bf = torch.randn(FAST_TANH_MIN_ELEMENTS, dtype=torch.bfloat16)
    assert torch.equal(tanh(bf), torch.tanh(bf))


def test_balance_statistics_use_the_routers_own_choice_under_replay():
    """R3 regression: the rollout's replayed experts drive dispatch and gates, but the load
    balancing loss and health metrics count what the router itself picks now."""
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 2)
    x = torch.randn(64, 8)
    forced = torch.tensor([[0, 1]]).expand(64, 2)           # a frozen, maximally unbalanced replay
    y, rec = layer(x, replay_indices=forced)
    own = layer(x)[1]
    assert torch.equal(rec.top_k_indices, forced) and torch.equal(rec.router_top_k, own.top_k_indices)
    assert load_balancing_loss(rec.router_probs, rec.router_top_k).item() == pytest.approx(
        moe_aux_losses([rec], 1.0, 0.0)[1].item())
    assert moe_aux_losses([rec], 1.0, 0.0)[1].item() == pytest.approx(moe_aux_losses([own], 1.0, 0.0)[1].item())
    assert health_summary([rec])["moe/active_experts"] == health_summary([own])["moe/active_experts"] == 4


def test_layers_aux_losses_taken_together_equal_the_per_layer_sums():
    """moe_aux_losses computes every layer at once; value and router gradient are the per-layer
    definitions summed (and the layer-by-layer fallback for records of other shapes agrees too)."""
    torch.manual_seed(0)
    logits = [torch.randn(50, 6, requires_grad=True) for _ in range(3)]
    records = [RoutingRecord(lg.topk(2).indices, torch.ones(50, 2), lg) for lg in logits]
    records[1].router_top_k = torch.zeros(50, 2, dtype=torch.long)      # one collapsed layer
    total, aux, z = moe_aux_losses(records, 0.01, 0.001)
    aux_ref = sum(load_balancing_loss(r.router_probs, r.router_top_k) for r in records)
    z_ref = sum(router_z_loss(r.router_logits) for r in records)
    assert aux.item() == pytest.approx(aux_ref.item(), rel=1e-6) and z.item() == pytest.approx(z_ref.item(), rel=1e-6)
    grads = torch.autograd.grad(total, logits)
    refs = torch.autograd.grad(0.01 * aux_ref + 0.001 * z_ref, logits)
    assert all(torch.allclose(g, r, atol=1e-8) for g, r in zip(grads, refs))
    mixed = records[:2] + [RoutingRecord(torch.zeros(7, 2, dtype=torch.long), torch.ones(7, 2), torch.randn(7, 6))]
    assert moe_aux_losses(mixed, 1.0, 1.0)[1].item() == pytest.approx(
        sum(load_balancing_loss(r.router_probs, r.router_top_k) for r in mixed).item(), rel=1e-6)


def test_replay_anchor_is_the_router_mass_off_the_replayed_experts_where_it_drifted_and_pulls_it_back():
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 2)
    x = torch.randn(32, 8)
    forced = torch.tensor([[2, 3]]).expand(32, 2)
    _, rec = layer(x, replay_indices=forced)
    probs = torch.softmax(rec.router_logits, -1)
    drifted = torch.tensor([set(row) != {2, 3} for row in rec.router_top_k.tolist()])
    assert 0 < drifted.sum() < 32                             # both kinds of token are present
    expected = (-(probs[:, 2] + probs[:, 3]).log() * drifted).sum() / 32
    loss = replay_anchor_loss([rec])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    _, own = layer(x, replay_indices=rec.router_top_k)       # replaying the router's own choice
    assert replay_anchor_loss([own]).item() == 0.0          # nothing to pull back, nothing sharpened
    loss.backward()
    step = -layer.router.gate.bias.grad                      # a gradient step on the bias
    assert step[2] > 0 and step[3] > 0 and step[0] < 0 and step[1] < 0
    sampled = layer(x, replay_indices=forced)[1]
    sampled.selection_logp = torch.zeros(32)                 # a REINFORCE record: its own loss trains it
    assert replay_anchor_loss([sampled]).item() == 0.0


def test_replay_carries_capacity_drops():
    layer = MoELayer(8, 4, 1, capacity_factor=1.0)
    layer.router.gate.bias.data[:] = torch.tensor([10.0, 0, 0, 0])
    x = torch.randn(16, 8)
    y, rec = layer(x)                      # 12 of 16 dropped at this batch size
    code = rec.encoded_top_k()
    assert (code < 0).sum().item() == 12
    y_replay, rec_replay = layer(torch.cat([x, torch.randn(48, 8)]), replay_indices=torch.cat(
        [code, torch.zeros(48, 1, dtype=torch.long)]))
    assert torch.equal(rec_replay.dropped[:16], rec.dropped) and torch.allclose(y_replay[:16], y)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_reinforce_selection_logp_is_the_probability_of_the_draw(k):
    """Exact probability of an ordered draw without replacement, enumerated for N = 4."""
    import itertools
    torch.manual_seed(0)
    logits = torch.randn(1, 4)
    p = logits.softmax(-1)[0]
    total = 0.0
    for draw in itertools.permutations(range(4), k):
        prob, left = 1.0, 1.0
        for e in draw:
            prob *= p[e].item() / left
            left -= p[e].item()
        got = plackett_luce_logp(logits, torch.tensor([draw])).exp().item()
        assert got == pytest.approx(prob, rel=1e-5)
        total += got
    assert total == pytest.approx(1.0, rel=1e-5)
    # The empirical frequency of multinomial(replacement=False) draws matches it.
    draws = torch.multinomial(p.expand(20000, 4), k, replacement=False)
    first = tuple(draws[0].tolist())
    freq = (draws == torch.tensor(first)).all(-1).double().mean().item()
    assert freq == pytest.approx(plackett_luce_logp(logits, torch.tensor([first])).exp().item(), abs=0.015)


def test_reinforce_router_samples_only_when_exploring():
    torch.manual_seed(0)
    layer = MoELayer(8, 8, 2, router="reinforce")
    x = torch.randn(64, 8)
    assert torch.equal(layer(x)[1].top_k_indices, layer(x)[1].top_k_indices)        # greedy
    assert not torch.equal(layer(x, explore=True)[1].top_k_indices, layer(x, explore=True)[1].top_k_indices)


@pytest.mark.parametrize("path", [p for p in DISPATCH_PATHS if p != "auto"])
def test_empty_batch(path):
    layer = MoELayer(8, 4, 2, dispatch=path, capacity_factor=1.0)
    y, rec = layer(torch.randn(0, 8))
    assert y.shape == (0, 8) and rec.top_k_indices.shape == (0, 2)


def test_task_router_uses_task_ids():
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 1, router="task", router_kwargs={"num_tasks": 3})
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match="task_ids"):
        layer(x)
    layer.router.task_embedding.weight.data[1] += 5.0
    a = layer(x, task_ids=torch.zeros(6, dtype=torch.long))[1].router_logits
    b = layer(x, task_ids=torch.ones(6, dtype=torch.long))[1].router_logits
    assert not torch.allclose(a, b)


def test_expert_dropout_only_in_training():
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 2, expert_dropout=0.5)
    x = torch.randn(32, 8)
    layer.eval()
    assert torch.equal(layer(x)[0], layer(x)[0])
    layer.train()
    assert not torch.equal(layer(x)[0], layer(x)[0])


def test_router_init_schemes():
    layer = MoELayer(64, 16, 2, router_init="normal")
    assert layer.router.gate.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)
    assert layer.router.gate.bias.abs().sum() == 0
    layer = MoELayer(64, 16, 2, router_init="uniform")
    assert layer.router.gate.weight.abs().max().item() <= math.sqrt(6 / (64 + 16))


def test_router_math_is_fp32_in_bf16_layer():
    layer = MoELayer(8, 4, 2).to(torch.bfloat16)
    y, rec = layer(torch.randn(5, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and rec.router_logits.dtype == torch.float32


def test_health_summary_reports_worst_layer():
    torch.manual_seed(0)
    good = MoELayer(8, 4, 1)(torch.randn(400, 8))[1]
    bad = RoutingRecord(torch.zeros(400, 1, dtype=torch.long), torch.ones(400, 1), torch.zeros(400, 4))
    s = health_summary([good, bad])
    assert s["moe/load_grade"] == 2 and s["moe/layer1/load_grade"] == 2 and s["moe/active_experts"] == 1
    assert s["moe/health"] == 1 and s["moe/layer1/health"] == 1 and s["moe/layer1/idle_experts"] == 3
    watch = HealthWatch()
    health_summary([good, bad], watch=watch)
    s = health_summary([good, bad], watch=watch)     # three experts idle for a second update: dead
    assert s["moe/health"] == 2 and s["moe/layer1/dead_experts"] == 3 and s["moe/layer0/dead_experts"] == 0
    assert s["moe/cv"] == s["moe/layer1/cv"]
    total, aux, z = moe_aux_losses([good, bad], 0.01, 0.001)
    assert total.item() == pytest.approx(0.01 * aux.item() + 0.001 * z.item())


def test_health_grades_the_load_of_the_counts_given():
    """The learner grades an update's load on the assignments of all its minibatches: one minibatch
    that leaves an expert idle by chance is not 'danger' when the update as a whole is balanced,
    and an expert idle over the whole update still is."""
    one_minibatch = RoutingRecord(torch.tensor([[0], [1], [2], [0]]), torch.ones(4, 1), torch.zeros(4, 4))
    assert health_summary([one_minibatch])["moe/load_grade"] == 2          # expert 3 idle in this one
    balanced = torch.tensor([100, 98, 103, 99])
    s = health_summary([one_minibatch], [balanced])
    assert s["moe/health"] == 0 and s["moe/load_grade"] == 0 and s["moe/active_experts"] == 4 and s["moe/cv"] < 0.05
    assert s["moe/layer0/util/e3"] == pytest.approx(99 / 400)
    dead = health_summary([one_minibatch], [torch.tensor([134, 133, 133, 0])])
    assert dead["moe/load_grade"] == 2 and dead["moe/min_util"] == 0 and dead["moe/active_experts"] == 3
    assert dead["moe/health"] == 1 and dead["moe/idle_experts"] == 1   # idle one update: not dead yet


@pytest.mark.parametrize("kwargs, field", [
    ({"num_experts": 0}, "num_experts"), ({"top_k": 0}, "top_k"), ({"top_k": 9}, "top_k"),
    ({"capacity_factor": 0.0}, "capacity_factor"), ({"capacity_factor": -1.0}, "capacity_factor"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 0.0}, "temperature"), ({"router": "nope"}, "router"), ({"dispatch": "x"}, "dispatch"),
    ({"expert_dropout": 1.0}, "expert_dropout"), ({"router_init": "xavier"}, "router_init"),
])
def test_bad_layer_arguments_name_the_field(kwargs, field):
    args = {"d_model": 8, "num_experts": 8, "top_k": 2} | kwargs
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        MoELayer(**args)


def test_wrong_input_width_is_refused():
    with pytest.raises(ValueError, match="^x: must be a tensor of width d_model=8"):
        MoELayer(8, 4, 2)(torch.randn(3, 7))

"""Soft MoE over tokens (moe_rl.core.soft_moe), the tokenized encoder, their signals, and the
value-based and soft drift estimators (pure torch)."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from moe_rl.core.drift_kinds import PolicyKind, combine_divergence, mismatch_figures, probe_figures, q_figures
from moe_rl.core.encoders import ObservationEncoder, uses_position_tokens
from moe_rl.core.errors import ConfigError
from moe_rl.core.health import HealthWatch
from moe_rl.core.metrics import health_summary
from moe_rl.core.param_groups import param_roles
from moe_rl.core.plasticity import trunk_dormancy
from moe_rl.core.policy import MoEMLPTrunk
from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
from moe_rl.core.soft_moe import SoftMoELayer, soft_moe_reference

pytestmark = pytest.mark.pure


def soft(**kw):
    return validate_moe({**MOE_DEFAULTS, "mixture": "soft", "num_experts": 4, "d_model": 16, "d_ff": 16, **kw})


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("B, m, N, p", [(3, 5, 4, 2), (2, 1, 3, 1), (1, 7, 8, 1)])
def test_the_layer_computes_the_papers_equations_and_their_gradients(normalize, B, m, N, p):
    torch.manual_seed(0)
    layer = SoftMoELayer(6, N, p, d_ff=5, activation="relu", normalize=normalize)
    x = torch.randn(B, m, 6, requires_grad=True)
    y, record = layer(x)
    experts = [lambda s, e=e: layer.experts.expert(e, s) for e in range(N)]
    ref = torch.stack([soft_moe_reference(x[b], layer.slot_embed, experts, p, layer.scale if normalize else None)
                       for b in range(B)])
    assert torch.allclose(y, ref, atol=1e-5)
    g = torch.randn_like(y)
    wrt = [x, layer.slot_embed, layer.experts.w1, layer.experts.b2]
    for got, want in zip(torch.autograd.grad((y * g).sum(), wrt), torch.autograd.grad((ref * g).sum(), wrt)):
        assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(record.expert_combine().sum(-1), torch.ones(B))   # every output a convex mix
    assert record.dispatch().sum(1).allclose(torch.ones(B, N * p))          # every slot a convex mix


def test_tokens_mix_only_within_their_observation():
    """A rollout step of one observation computes what a minibatch computes for it."""
    torch.manual_seed(0)
    layer = SoftMoELayer(8, 4, 2)
    x = torch.randn(5, 9, 8)
    together, _ = layer(x)
    alone = torch.cat([layer(x[i:i + 1])[0] for i in range(5)])
    assert torch.allclose(together, alone, atol=1e-6)


def test_an_image_becomes_one_token_per_position_flattened_after_the_blocks():
    space = gym.spaces.Box(0, 1, (10, 10, 4), bool)   # MinAtar's shape
    assert uses_position_tokens("auto", "soft", space) and not uses_position_tokens("auto", "sparse", space)
    assert not uses_position_tokens("auto", "soft", gym.spaces.Box(-1, 1, (4,)))
    encoder = ObservationEncoder(space, "auto", tokens=True)
    obs = torch.rand(3, 10, 10, 4) > 0.5
    tokens, _ = encoder(obs)
    assert tokens.shape == (3, 49, 64) and encoder.num_tokens == 49   # 7 x 7 positions of 64 channels
    trunk = MoEMLPTrunk(encoder, soft())
    features, records = trunk(obs)
    assert features.shape == (3, 49 * 16) and len(records) == 2 and records[0].logits.shape == (3, 49, 4)
    with pytest.raises(ConfigError, match="moe.tokens"):
        ObservationEncoder(gym.spaces.Box(-1, 1, (4,)), "auto", tokens=True)


def test_token_pool_flatten_keeps_every_position_and_soft_normalize_false_gives_raw_logits():
    """Obando-Ceron et al.'s code: the tokens concatenated after the mixture, raw slot logits X Phi."""
    torch.manual_seed(0)
    space = gym.spaces.Box(0, 1, (10, 10, 4), bool)
    obs = torch.rand(3, 10, 10, 4) > 0.5
    reference = dict(soft_normalize=False, slots_per_expert=13, num_layers=1)
    trunk = MoEMLPTrunk(ObservationEncoder(space, "auto", tokens=True), soft(token_pool="flatten", **reference))
    features, records = trunk(obs)
    assert trunk.out_dim == 49 * 16 and features.shape == (3, 49 * 16)
    layer = trunk.blocks[0].moe
    assert not layer.normalize and layer.scale is None and records[0].logits.shape == (3, 49, 4 * 13)
    mean_trunk = MoEMLPTrunk(ObservationEncoder(space, "auto", tokens=True), soft(token_pool="mean", **reference))
    mean_trunk.load_state_dict(trunk.state_dict())   # the same parameters: only the pooling differs
    assert mean_trunk.out_dim == 16
    assert torch.allclose(features.view(3, 49, 16).mean(1), mean_trunk(obs)[0], atol=1e-6)
    # one token: flatten is the mean (nothing to pool)
    flat = MoEMLPTrunk(4, soft())
    assert flat.out_dim == 16 and flat(torch.randn(2, 4))[0].shape == (2, 16)
    for key, value, allowed in (("token_pool", "max", "one of"), ("soft_normalize", "no", "true or false")):
        with pytest.raises(ConfigError, match=f"^moe.{key}: must be {allowed}"):
            soft(**{key: value})
    with pytest.raises(ConfigError, match="^moe.soft_normalize: .*mixture sparse"):
        validate_moe({**MOE_DEFAULTS, "soft_normalize": False})


@pytest.mark.parametrize("grid", ["minatar", "minigrid_mt"])
@pytest.mark.parametrize("normalize", [True, False])
def test_after_a_mean_pool_the_trunk_is_blind_to_where_a_feature_is_and_after_flatten_it_is_not(grid, normalize):
    """No position embedding, and a Soft MoE mixes tokens by content: shuffling the encoder's
    positions leaves the mean-pooled features unchanged (why flatten is the default). MinAtar's
    10x10 grid (49 tokens); MiniGrid's 7x7 view with the task vector on every token (16)."""
    torch.manual_seed(0)
    if grid == "minatar":
        space, obs = gym.spaces.Box(0, 1, (10, 10, 4), bool), torch.rand(8, 10, 10, 4) > 0.7
    else:
        space = gym.spaces.Dict({"image": gym.spaces.Box(0, 10, (7, 7, 3)), "task": gym.spaces.Box(0, 1, (5,))})
        obs = {"image": torch.randint(0, 11, (8, 7, 7, 3)), "task": torch.eye(5)[torch.randint(0, 5, (8,))]}
    shuffle = torch.randperm(ObservationEncoder(space, "auto", tokens=True).num_tokens)
    for pool, blind in (("mean", True), ("flatten", False)):
        trunk = MoEMLPTrunk(ObservationEncoder(space, "auto", tokens=True),
                            soft(token_pool=pool, soft_normalize=normalize, num_layers=2))
        with torch.no_grad():
            features = trunk(obs)[0]
            handle = trunk.encoder.cnn.register_forward_hook(lambda module, args, out: out[:, shuffle])
            shuffled = trunk(obs)[0]
            handle.remove()
        assert torch.allclose(features, shuffled, atol=1e-5) == blind, pool


def test_what_a_soft_mixture_cannot_take_is_refused_by_name():
    for key, value in (("router", "reinforce"), ("routing_replay", True), ("capacity_factor", 1.0),
                       ("expert_dropout", 0.1), ("ep_size", 2), ("shared_expert", True)):
        with pytest.raises(ConfigError, match=f"^moe.{key}: .*mixture soft"):
            soft(**{key: value})
    with pytest.raises(ConfigError, match="^moe.tokens: must be one or auto with mixture sparse"):
        validate_moe({**MOE_DEFAULTS, "tokens": "positions"})


def test_the_slot_parameters_are_the_soft_router_and_the_experts_experts():
    roles = param_roles(MoEMLPTrunk(4, soft()))
    assert roles["blocks.0.moe.slot_embed"] == "router" and roles["blocks.0.moe.scale"] == "router"
    assert roles["blocks.0.moe.experts.w1"] == "experts" and roles["embed.weight"] == "other"


def _graded(records, updates=3):
    watch = HealthWatch()
    for _ in range(updates):
        out = health_summary([r.detach() for r in records], None, watch)
    return out


def test_the_health_grade_reads_a_healthy_soft_mixture_as_healthy_and_a_dead_expert_as_danger():
    torch.manual_seed(0)
    trunk = MoEMLPTrunk(ObservationEncoder(gym.spaces.Box(0, 1, (10, 10, 4)), "auto", tokens=True), soft())
    obs = torch.rand(64, 10, 10, 4)
    _, records = trunk(obs)
    healthy = _graded(records)
    assert healthy["moe/health"] == 0 and healthy["moe/dead_experts"] == 0 and healthy["moe/active_experts"] == 4
    assert 0.9 < healthy["moe/router_entropy_norm"] <= 1.0 and 0.9 < healthy["moe/dispatch_entropy_norm"] <= 1.0
    with torch.no_grad():   # expert 2's slots can no longer win any token's combine weight
        layer = trunk.blocks[0].moe
        layer.scale.fill_(50.0)
        layer.slot_embed[:, 2] = -layer.slot_embed[:, [0, 1, 3]].sum(1)
    _, records = trunk(obs)
    dead = _graded(records)
    assert dead["moe/health"] == 2 and dead["moe/dead_experts"] >= 1, dead


def test_the_dormant_share_moves_with_relu_experts_and_stays_zero_when_every_unit_fires():
    torch.manual_seed(0)
    trunk = MoEMLPTrunk(4, soft(activation="relu"))
    obs = torch.randn(256, 4)
    assert trunk_dormancy(trunk, lambda: trunk(obs))["dormant"] < 0.2
    with torch.no_grad():   # every expert's hidden units pushed below zero: ReLU never fires
        for block in trunk.blocks:
            block.moe.experts.b1.fill_(-100.0)
    figures = trunk_dormancy(trunk, lambda: trunk(obs))
    assert figures["dormant"] == 1.0 and figures["layer0/dormant/e0"] == 1.0


# --- the drift estimators ---------------------------------------------------------------------------
def test_value_based_drift_is_zero_at_identical_weights_and_named_for_a_perturbed_copy():
    rng = np.random.default_rng(0)
    q = rng.normal(10, 3, (256, 6))
    same = q_figures(q, q.copy())
    assert same["greedy_agreement"] == 1.0 and same["q_gap_max_rel"] == 0.0 and same["q_gap_mean_rel"] == 0.0
    bf16 = torch.as_tensor(q).to(torch.bfloat16).double().numpy()      # a bf16 rollout copy's rounding
    rounded = q_figures(q, bf16)
    assert 0 < rounded["q_gap_max_rel"] < 0.01
    flipped = q.copy()
    flipped[:64, 0] += 100.0                                           # a corrupted copy prefers action 0
    broken = q_figures(q, flipped)
    assert broken["greedy_agreement"] < 0.8 and broken["q_gap_max_rel"] > 1.0
    from moe_rl.core.gate import breaches, mismatch_limits
    assert {k for k, _, _ in breaches(broken, mismatch_limits())} == {"greedy_agreement", "q_gap_max_rel"}
    assert breaches(same, mismatch_limits()) == []


def test_combine_divergence_is_zero_for_the_same_shares_and_grows_with_a_shift():
    rng = np.random.default_rng(0)
    shares = rng.dirichlet(np.ones(4), (100, 2))                       # [T, L, N]
    assert combine_divergence(shares, shares.copy())["combine_tv_max"] == 0.0
    shifted = shares.copy()
    shifted[:, 1] = np.roll(shifted[:, 1], 1, -1)
    out = combine_divergence(shares, shifted)
    assert out["combine_tv/layer0"] == 0.0 and out["combine_tv/layer1"] > 0.1 and out["combine_tv_max"] > 0.1


def test_the_figures_follow_the_policy_and_routing_kind():
    rng = np.random.default_rng(1)
    q, shares = rng.normal(0, 1, (50, 3)), rng.dirichlet(np.ones(4), (50, 2))
    rows = mismatch_figures(PolicyKind("q", "soft"), {"q": q, "routing": shares}, {"q": q, "routing": shares})
    assert rows["greedy_agreement"] == 1.0 and rows["combine_tv_max"] == 0.0 and "k3" not in rows
    assert "q_gap_by_expert" in rows and "routing_agreement" not in rows
    moved = probe_figures(PolicyKind("q", "soft"), {"q": q, "routing": shares}, {"q": q * 1000, "routing": shares},
                          margin=0.05)
    assert moved["q_change"] > 100 and moved["probe_flip_rate"] == 0.0    # a Q blow-up, routing unmoved

"""The tau-dormant fraction: near zero on a fresh network, exactly the share of units made silent."""
import pytest
import torch

from moe_rl.core.layer import MoELayer, dense_ffn_equal_active
from moe_rl.core.plasticity import DormantProbe, dormant_mask, trunk_dormancy

pytestmark = pytest.mark.pure


def test_mask_is_relative_to_the_layer_mean():
    activity = torch.tensor([1.0, 1.0, 0.01, 0.0])   # mean 0.5025: 0.01 is 0.02 of it
    assert dormant_mask(activity, 0.025).tolist() == [False, False, True, True]
    assert dormant_mask(activity, 0.0).tolist() == [False, False, False, True]
    assert dormant_mask(torch.zeros(3), 0.1).all()   # a silent layer is all dormant


def test_a_fresh_moe_layer_has_no_dormant_units_and_silenced_units_are_counted():
    torch.manual_seed(0)
    layer = MoELayer(16, 4, 2, 8, activation="gelu")
    x = torch.randn(512, 16)
    fresh = trunk_dormancy(layer, lambda: layer(x))
    assert fresh["dormant"] == 0.0 and all(fresh[f"layer0/dormant/e{e}"] == 0.0 for e in range(4))
    with torch.no_grad():   # expert 1's first 4 of 8 units never fire: weights 0, bias 0 -> gelu(0) = 0
        layer.experts.w1[1, :4] = 0.0
        layer.experts.b1[1, :4] = 0.0
    silenced = trunk_dormancy(layer, lambda: layer(x))
    assert silenced["layer0/dormant/e1"] == 0.5
    assert silenced["layer0/dormant/e0"] == 0.0
    assert silenced["layer0/dormant"] == pytest.approx(4 / 32)


def test_an_expert_nobody_routes_to_is_dormant():
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 1, 8, activation="tanh")
    with torch.no_grad():   # the router never picks expert 3
        layer.router.gate.weight[3] = 0.0
        layer.router.gate.bias[3] = -1e4
    x = torch.randn(256, 8)
    figures = trunk_dormancy(layer, lambda: layer(x))
    assert figures["layer0/dormant/e3"] == 1.0 and figures["layer0/dormant"] >= 0.25


def test_a_dense_ffn_block_is_measured_too():
    torch.manual_seed(0)
    ffn = dense_ffn_equal_active(8, 8, 2, "gelu")
    with torch.no_grad():
        ffn[0].weight[:4] = 0.0
        ffn[0].bias[:4] = 0.0
    with DormantProbe(ffn) as probe:
        ffn(torch.randn(128, 8))
    assert probe.figures(0.0) == {"layer0/dormant": 4 / 16, "dormant": 4 / 16}

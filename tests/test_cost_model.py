"""bench/cost_model.py: the analytic scaling model (pure python; no Ray, no DeepSpeed)."""
import dataclasses
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "cost_model.py"
_spec = importlib.util.spec_from_file_location("cost_model", SCRIPT)
cm = importlib.util.module_from_spec(_spec)
sys.modules["cost_model"] = cm          # dataclasses look their module up by name
_spec.loader.exec_module(cm)
sys.path.insert(0, str(SCRIPT.parent))
import cost_model_report as report  # noqa: E402  (its `import cost_model` finds the module above)

BASE = cm.Setup()


def test_expert_bytes_per_learner_halve_when_ep_size_doubles():
    s = dataclasses.replace(BASE, gpus=256, num_experts=256)
    sizes = [cm.memory(dataclasses.replace(s, ep_size=str(ep)))["expert_param_bytes"] for ep in (1, 2, 4, 8, 16)]
    assert all(a == 2 * b for a, b in itertools.pairwise(sizes))
    states = [cm.memory(dataclasses.replace(s, ep_size=str(ep)))["expert_state_bytes"] for ep in (1, 2)]
    assert states[0] == 2 * states[1]


def test_memory_at_the_calibration_point_equals_the_measured_expert_bytes():
    # BENCHMARKS.md, "DeepSpeed learner group: ep_size 1 vs 2": expert-param bytes per learner.
    for ep, measured in ((1, 134_545_408), (2, 67_272_704)):
        s = cm.Setup(**report.BENCH_LEARNER, gpus=ep, ep_size=str(ep))
        assert cm.memory(s)["expert_param_bytes"] == measured
    rows = report.calibrate()
    exact = [r for r in rows if r["what"].startswith("expert-param bytes")]
    assert len(exact) == 2 and all(r["model"] == r["measured"] for r in exact)


def test_parameter_counts_match_the_real_trunk():
    from moe_rl.core.policy import MoEMLPTrunk
    from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
    from moe_rl.core.sharding import is_expert_param
    shape = report.BENCH_LEARNER
    trunk = MoEMLPTrunk(4, validate_moe(dict(MOE_DEFAULTS, num_experts=shape["num_experts"], top_k=shape["top_k"],
                                             num_layers=shape["num_layers"], d_model=shape["d_model"],
                                             d_ff=shape["d_ff"])))
    named = dict(trunk.named_parameters())
    p = cm.params(cm.Setup(**shape))
    assert sum(v.numel() for n, v in named.items() if is_expert_param(f"trunk.{n}")) == p["experts"]
    assert sum(v.numel() for n, v in named.items() if ".router." in n) == p["routers"]


def test_all_to_all_bytes_scale_with_top_k_and_tokens():
    s = dataclasses.replace(BASE, gpus=64, ep_size="16")
    a = cm.step(s)["a2a_bytes"]
    assert cm.step(dataclasses.replace(s, tokens=2 * s.tokens))["a2a_bytes"] == pytest.approx(2 * a)
    assert cm.step(dataclasses.replace(s, top_k=1))["a2a_bytes"] == pytest.approx(a / 2)
    # 4 all-to-alls per MoE layer, (ep-1)/ep of the T k d buffer leaves the rank
    assert a == pytest.approx(4 * s.num_layers * s.tokens * s.top_k * s.d_model * 2 * 15 / 16)
    assert cm.step(dataclasses.replace(s, ep_size="1"))["a2a_bytes"] == 0
    # inside a node the all-to-all never touches the inter-node fabric; past it, it does
    assert cm.step(dataclasses.replace(s, ep_size="8"))["a2a_inter_bytes"] == 0
    assert cm.step(s)["a2a_inter_bytes"] > 0


def test_gradient_all_reduce_uses_the_ring_factor_and_the_expert_data_parallel_group():
    s = dataclasses.replace(BASE, gpus=64, ep_size="8")
    st, p = cm.step(s), cm.params(s)
    assert st["dense_ar_bytes"] == pytest.approx(2 * 63 / 64 * p["nonexpert"] * 2)
    assert st["expert_ar_bytes"] == pytest.approx(2 * 7 / 8 * p["experts"] / 8 * 2)   # group of 64/8
    assert cm.step(dataclasses.replace(s, gpus=8))["expert_ar_bytes"] == 0          # ep == gpus: no replicas


def test_the_object_store_sync_grows_with_the_cluster():
    small, big = (cm.evaluate(dataclasses.replace(BASE, gpus=n)) for n in (64, 512))
    assert big["network_bytes"] == 8 * small["network_bytes"]       # one full model per rollout node
    assert big["sync_object_store_s"] > 4 * small["sync_object_store_s"]
    assert small["sync_bf16_s"] < small["sync_fp32_s"]


def test_the_collective_sync_and_the_check_at_the_source_do_not_grow_with_the_cluster():
    small, big = (cm.evaluate(dataclasses.replace(BASE, gpus=n)) for n in (64, 1024))
    # NCCL: each rollout actor's link carries the model once; only a latency hop per member grows.
    assert big["sync_collective_s"] - small["sync_collective_s"] < 0.01
    assert big["check_s"] == small["check_s"] and big["check_actor_gb"] < 1   # digests, not models
    # bf16 on the wire halves the broadcast; a 1/8 digest share divides the digest terms by 8
    bf16 = cm.evaluate(dataclasses.replace(BASE, inference_dtype="bf16"))
    assert bf16["sync_collective_s"] == pytest.approx(small["sync_collective_s"] / 2, rel=0.05)
    share = cm.evaluate(dataclasses.replace(BASE, param_sample=0.125))
    assert share["check_rollout_s"] == pytest.approx(small["check_rollout_s"] / 8)


def test_cli_json_emits_the_sweep():
    out = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    rep = json.loads(out)
    assert [r["gpus"] for r in rep["sweep_gpus"]] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert [r["experts"] for r in rep["sweep_experts"]] == [8, 16, 32, 64, 128, 256]
    assert [r["ep"] for r in rep["sweep_ep"]][-1] == 256
    assert set(rep["break_points"]) == set(cm.TERMS)
    cal = json.loads(subprocess.run([sys.executable, str(SCRIPT), "--calibrate", "--json"], capture_output=True,
                                    text=True, timeout=60, check=True).stdout)
    assert cal["calibration"][0]["model"] == 134_545_408

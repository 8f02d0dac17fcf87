"""Multi-agent: several MoE policies (and a plain one beside them) through the whole system, from
the run config and CLI: RLlib's MultiAgentCartPole, two agents."""
import os

import pyarrow.parquet as pq
import pytest
import ray

from moe_rl.algo.multi_agent import PatternMapping, validate_multi_agent
from moe_rl.app.cli import main
from moe_rl.app.evaluate import evaluate_run
from moe_rl.core.settings import MOE_DEFAULTS, ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "multiagent.yaml")
TINY = ["--set", "stop_return=null", "--set", "training.train_batch_size_per_learner=400",
        "--set", "training.minibatch_size=100", "--set", "training.num_epochs=1", "--set", "moe.d_model=16",
        "--set", "moe.d_ff=16", "--set", "checkpoint_every=1", "--set", "checkpoint_verify_every_s=0",
        "--set", "env_runners.num_envs_per_env_runner=1"]


@pytest.mark.pure
def test_mapping_by_pattern_and_bad_sections():
    m = PatternMapping({"0": "p0", "[1-9]": "p1"})
    assert [m(0), m(3)] == ["p0", "p1"]
    with pytest.raises(ValueError, match="matches no"):
        m("x")
    for section, field in [({"policies": {}}, "multi_agent.policies"),
                           ({"policies": {"a": {}}, "mapping": {".*": "b"}}, "multi_agent.mapping..*"),
                           ({"policies": {"a": {"moe": {"num_experts": 0}}}, "mapping": {".*": "a"}},
                            "multi_agent.policies.a.moe.num_experts"),
                           ({"policies": {"a": {}}}, "multi_agent.mapping"),
                           ({"policies": {"a": {}}, "mapping_fn": "no.such:fn"}, "multi_agent.mapping_fn")]:
        with pytest.raises(ConfigError, match=f"^{field}"):
            validate_multi_agent(section, dict(MOE_DEFAULTS), 0)


def run(tmp_path, *flags, name="run"):
    out = tmp_path / name
    assert main(["train", "--config", CONFIG, "--output", str(out), *TINY, *flags]) == 0
    assert not ray.is_initialized()
    return out, pq.read_table(out / "metrics.parquet").to_pylist(), pq.read_table(out / "drift.parquet").to_pylist()


@pytest.mark.slow
@pytest.mark.parametrize("learners", [0, 2])
def test_two_moe_policies_train_with_the_gate_on_and_evaluate(tmp_path, learners):
    flags = ["--iterations", "2"] + (["--num-learners", "2", "--ep-size", "2"] if learners else [])
    out, metrics, drift = run(tmp_path, *flags)
    assert [m["iteration"] for m in metrics] == [1, 2]
    assert {"p0/moe/cv", "p1/moe/cv", "p0/policy_loss", "p1/policy_loss", "moe/cv"} <= set(metrics[-1])
    assert [(r["iteration"], r["module_id"]) for r in drift] == [(1, "p0"), (1, "p1"), (2, "p0"), (2, "p1")]
    assert all(r["routing_agreement"] == 1.0 and abs(r["k3"]) < 1e-6 and r["action"] == "" for r in drift)
    assert all(m["checkpoint/verified"] == 1 for m in metrics)          # both modules reloaded exactly
    mean, returns = evaluate_run(str(out), episodes=2)
    assert len(returns) == 2 and mean > 0


@pytest.mark.slow
def test_an_moe_policy_beside_a_plain_one(tmp_path):
    out, metrics, drift = run(tmp_path, "--iterations", "2", "--set", "multi_agent.policies.p1={dense: true}")
    assert "p0/moe/cv" in metrics[-1] and "p1/moe/cv" not in metrics[-1] and "p1/policy_loss" in metrics[-1]
    p0 = [r for r in drift if r["module_id"] == "p0"]
    p1 = [r for r in drift if r["module_id"] == "p1"]
    assert len(p0) == 2 and all(r["routing_agreement"] == 1.0 for r in p0)
    assert len(p1) == 2 and all(r.get("routing_agreement") is None and r["update_size/other"] > 0 for r in p1)
    assert all(m["checkpoint/verified"] == 1 for m in metrics)
    assert evaluate_run(str(out), episodes=1)[0] > 0


@pytest.mark.slow
def test_a_multi_agent_run_resumes(tmp_path):
    out, _, _ = run(tmp_path, "--iterations", "2")
    assert main(["train", "--resume", str(out), "--iterations", "3"]) == 0
    metrics = pq.read_table(out / "metrics.parquet").to_pylist()
    drift = pq.read_table(out / "drift.parquet").to_pylist()
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert [(r["iteration"], r["module_id"]) for r in drift][-2:] == [(3, "p0"), (3, "p1")] and len(drift) == 6
    assert drift[-1]["weights_version"] > drift[1]["weights_version"]

"""The routing health grade (moe_rl.core.health): specialisation stays healthy, dead experts and
collapse read danger; the anomaly watch alerts on danger, not on the seeds' load bands."""
import math

import pytest
import torch

from moe_rl.core.anomaly import AnomalyDetector
from moe_rl.core.health import COLLAPSE_MARGINAL, HealthWatch, marginal_entropy_norm
from moe_rl.core.metrics import GRADES, health_summary
from moe_rl.core.routing import RoutingRecord
from moe_rl.core.stability import validate_stability

N, K = 8, 2


def record(logits: torch.Tensor) -> RoutingRecord:
    """The router's own top-k of the given logits, as the learner records it."""
    top = logits.topk(K, dim=-1).indices
    return RoutingRecord(top, torch.ones(top.shape), logits, router_top_k=top)


def specialised(seed: int, shares) -> RoutingRecord:
    """States in N clusters of unequal frequency (`shares`), each routed confidently to its own
    expert (and a second one by the next logit): what a converging RL policy's router does."""
    g = torch.Generator().manual_seed(seed)
    cluster = torch.multinomial(torch.tensor(shares, dtype=torch.float64), 4000, replacement=True, generator=g)
    logits = torch.randn(4000, N, generator=g)
    logits[torch.arange(4000), cluster] += 8.0
    return record(logits)


def grades(watch, records):
    return [GRADES[int(health_summary([r], watch=watch)["moe/health"])] for r in records]


@pytest.mark.pure
def test_specialisation_with_an_uneven_load_stays_healthy():
    """Shares from 0.16/N to 3.5/N with a confident router: the load table (docs/stability.md) reads danger (min
    share below 0.3/N), the grade healthy: every expert in use, the load spread."""
    shares = [0.44, 0.2, 0.12, 0.08, 0.06, 0.05, 0.03, 0.02]   # 3.5/N .. 0.16/N
    watch = HealthWatch()
    summaries = [health_summary([specialised(s, shares)], watch=watch) for s in range(10)]
    assert all(s["moe/load_grade"] >= 1 for s in summaries)          # the LM table cries wolf
    assert all(s["moe/health"] == 0 for s in summaries), [s["moe/health"] for s in summaries]
    assert all(s["moe/router_entropy_norm"] < 0.3 for s in summaries)   # confident per state
    assert all(s["moe/marginal_entropy_norm"] > COLLAPSE_MARGINAL for s in summaries)


@pytest.mark.pure
def test_a_dead_expert_reads_warning_then_danger_and_recovers():
    shares = [1 / N] * N
    watch = HealthWatch()
    healthy = [specialised(s, shares) for s in range(3)]
    dead = []
    for s in range(3):
        r = specialised(10 + s, shares)
        logits = r.router_logits.index_fill(-1, torch.tensor([5]), float("-inf"))   # expert 5 never chosen
        dead.append(record(logits))
    back = [specialised(20 + s, shares) for s in range(2)]
    assert grades(watch, healthy + dead + back) == ["healthy"] * 3 + ["warning", "danger", "danger"] + [
        "healthy", "healthy"]
    s = health_summary([dead[0]], watch=HealthWatch())
    assert s["moe/idle_experts"] == 1 and s["moe/dead_experts"] == 0 and s["moe/active_experts"] == N - 1


@pytest.mark.pure
def test_collapse_needs_both_entropies_low_for_two_updates():
    g = torch.Generator().manual_seed(0)
    # Every state confidently on experts 0 and 1: marginal ln2/ln8 = 0.33, per-state near 0.
    confident = torch.randn(4000, N, generator=g)
    confident[:, :2] += 12.0
    # The same top-2 but a router that is almost uniform per state: not (yet) a collapse.
    unsure = torch.randn(4000, N, generator=g) * 0.01
    unsure[:, :2] += 0.05
    # 1 of 4000 states on each other expert, so none of them is dead: only the collapse rule fires.
    for logits in (confident, unsure):
        logits[2:8, 2:8] += torch.eye(6) * 100
    watch = HealthWatch()
    got = [health_summary([record(confident)], watch=watch) for _ in range(3)]
    assert [s["moe/health"] for s in got] == [1, 2, 2] and got[1]["moe/collapse_updates"] == 2
    assert got[0]["moe/dead_experts"] == 0 and got[0]["moe/marginal_entropy_norm"] < COLLAPSE_MARGINAL
    watch = HealthWatch()
    got = [health_summary([record(unsure)], watch=watch) for _ in range(3)]
    assert [s["moe/health"] for s in got] == [1, 1, 1]               # concentrated, unsure: warning
    assert got[0]["moe/router_entropy_norm"] > 0.9


@pytest.mark.pure
def test_marginal_entropy_hand_values():
    assert marginal_entropy_norm(torch.tensor([5, 5, 5, 5])) == pytest.approx(1.0)
    assert marginal_entropy_norm(torch.tensor([5, 5, 0, 0])) == pytest.approx(0.5)
    assert marginal_entropy_norm(torch.tensor([7, 0, 0, 0])) == 0.0
    assert marginal_entropy_norm(torch.tensor([0.25, 0.25, 0.25, 0.25])) == pytest.approx(1.0)   # shares too


@pytest.mark.pure
def test_the_watch_alerts_on_danger_once_and_not_on_the_seeds_load_bands():
    d = AnomalyDetector(validate_stability({}), num_experts=N)
    alerts = []
    for i in range(1, 30):
        row = {"iteration": i, "moe/cv": 1.4, "moe/active_experts": 5, "moe/router_entropy_norm": 0.6,
               "moe/health_level": 0, "moe/marginal_entropy_norm": 0.9}
        if 10 <= i < 15:
            row.update({"moe/health_level": 2, "moe/dead_experts": 1})
        alerts += d.observe(row)
    assert [(a["iteration"], a["metric"], a["kind"]) for a in alerts] == [(10, "moe/health_level", "breach")]
    assert "1 dead expert" in alerts[0]["message"] and "cv=1.4" in alerts[0]["message"]


def test_an_injected_dead_expert_reads_danger_within_two_iterations(ray_local):
    """A real run (CartPole, real EnvRunner and learner): expert 0's router logit at -inf in every
    layer after iteration 1; the grade reads danger by iteration 3, and the watch alerts."""
    from moe_rl import MoEPPOConfig
    from moe_rl.algo.faults import DeadExpert, inject
    from moe_rl.algo.results import metrics_row

    algo = (MoEPPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=4)
            .training(lr=3e-4, train_batch_size_per_learner=500, minibatch_size=250, num_epochs=2)
            .moe(num_experts=4, top_k=2, d_model=32, d_ff=32).debugging(seed=0)).build_algo()
    try:
        rows, alerts = [], []
        for i in range(3):
            result = algo.train()
            rows.append(metrics_row(result))
            alerts += result["moe_rl_alerts"]
            if i == 0:
                inject(algo, DeadExpert(expert=0))
        assert rows[0]["moe/health"] != "danger"
        assert rows[1]["moe/layer0/util/e0"] == 0 and rows[1]["moe/idle_experts"] >= 1
        assert rows[2]["moe/health"] == "danger" and rows[2]["moe/dead_experts"] >= 1, rows[2]["moe/health"]
        assert all(r["moe/layer1/util/e0"] == 0 for r in rows[1:])    # every layer
        assert all(math.isfinite(r["policy_loss"]) for r in rows)
        # the anomaly watch judges after its warm-up (stability.health_warmup: 3 iterations)
        assert not [a for a in alerts if a["metric"] in ("moe/cv", "moe/active_experts")]
    finally:
        algo.stop()

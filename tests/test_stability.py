"""The stability toolkit's core (pure torch, no Ray): schedules, clipping, NaN-step skipping,
router warm-up, winsorizing, projection, LAMB, anomaly detection, settings."""
import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from torch import nn

from moe_rl.core.anomaly import AnomalyDetector
from moe_rl.core.balance import AdaptiveBalance
from moe_rl.core.gradients import EXACT_QUANTILE_MAX, Lamb, abs_quantile, orthonormal_basis, project_, winsorize_
from moe_rl.core.layer import MoELayer
from moe_rl.core.param_groups import param_roles
from moe_rl.core.routing import RoutingRecord
from moe_rl.core.settings import ConfigError
from moe_rl.core.stability import StabilityToolkit, expert_dropout_at, set_expert_dropout, validate_stability

pytestmark = pytest.mark.pure


class TinyPolicy(nn.Module):
    """Module paths like the real policy: trunk.*.moe.{router,experts,shared_expert}, pi, vf, and its
    roles (moe_rl.core.param_groups): the MoE layer's router, experts and shared expert declare theirs."""

    PARAM_ROLES = {"pi": "policy_head", "vf": "value_head"}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.ModuleDict({"embed": nn.Linear(4, 8),
                                    "moe": MoELayer(8, 4, 2, 8, shared_expert=True, expert_dropout=0.1)})
        self.pi = nn.Linear(8, 2)
        self.vf = nn.Linear(4, 1)

    def loss(self, x):
        y, rec = self.trunk["moe"](torch.tanh(self.trunk["embed"](x)))
        return self.pi(y).pow(2).mean() + self.vf(x).pow(2).mean() + rec.router_logits.pow(2).mean()


def toolkit(model, **settings):
    return StabilityToolkit(validate_stability(settings), model.named_parameters(), param_roles(model))


def process(tk, lr, opt):
    """One toolkit step -> (apply?, the step's figures)."""
    return tk.process(lr, opt), tk.last_stats


def backward(model, scale=1.0):
    model.zero_grad(set_to_none=True)
    (scale * model.loss(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)))).backward()


# --- schedules ---------------------------------------------------------------------------------------
def test_per_group_lrs_reach_the_optimizer_and_advance_only_on_applied_steps():
    model = TinyPolicy()
    tk = toolkit(model, lr_schedules={"router": {"schedule": "constant", "lr": 5e-6},
                                      "experts": {"schedule": "cosine", "lr": 3e-5, "eta_min": 1e-6, "t_max": 4}})
    opt = tk.make_optimizer(tk.param_groups(1e-3), 1e-3)
    lrs = []
    for step in range(3):
        backward(model)
        ok, stats = process(tk, 1e-3, opt)
        assert ok
        by_group = {pg["moe_rl_group"]: pg["lr"] for pg in opt.param_groups}
        assert by_group["router"] == 5e-6 and by_group["other"] == 1e-3 and by_group["policy_head"] == 1e-3
        assert stats["stability/lr/experts"] == by_group["experts"]
        lrs.append(by_group["experts"])
        opt.step()
    assert lrs == pytest.approx([3e-5, 1e-6 + (3e-5 - 1e-6) * (1 + math.cos(math.pi / 4)) / 2,
                                 1e-6 + (3e-5 - 1e-6) / 2])


def test_expert_dropout_schedule_reaches_every_moe_layer():
    spec = {"start": 0.05, "end": 0.2, "steps": 100}
    assert [expert_dropout_at(spec, t) for t in (0, 50, 100, 500)] == pytest.approx([0.05, 0.125, 0.2, 0.2])
    model = TinyPolicy()
    assert set_expert_dropout(model, 0.125) == 1 and model.trunk["moe"].expert_dropout == 0.125


# --- clipping, skipping, warm-up ---------------------------------------------------------------------
def test_per_group_clipping_respects_each_groups_threshold():
    model = TinyPolicy()
    tk = toolkit(model, grad_clip=0.01)  # small base: every group is over its threshold
    opt = tk.make_optimizer(tk.param_groups(1e-3), 1e-3)
    backward(model, scale=100.0)
    ok, stats = process(tk, 1e-3, opt)
    assert ok
    factors = validate_stability({}).grad_clip_factors
    for g in tk.groups:
        pre = stats[f"stability/grad_norm/{g}"]
        post = math.sqrt(sum(float(p.grad.pow(2).sum()) for n, p in model.named_parameters()
                             if tk.group_of[n] == g and p.grad is not None))
        limit = 0.01 * factors[g]
        assert pre > limit and post == pytest.approx(limit, rel=1e-4), g
    # Distinct thresholds: the router gets 0.5x the base, experts 3x.
    assert stats["stability/clip_coef/router"] < 1 and factors["router"] == 0.5 and factors["experts"] == 3.0


def test_groups_under_their_threshold_are_left_alone():
    model = TinyPolicy()
    tk = toolkit(model, grad_clip=1e6)
    opt = tk.make_optimizer(tk.param_groups(1e-3), 1e-3)
    backward(model)
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    process(tk, 1e-3, opt)
    assert all(torch.equal(before[n], p.grad) for n, p in model.named_parameters() if n in before)


def test_a_non_finite_gradient_skips_the_step_and_keeps_weights_optimizer_and_schedule():
    model = TinyPolicy()
    tk = toolkit(model, lr_schedules={"experts": {"schedule": "cosine", "lr": 1e-2, "t_max": 10}})
    opt = tk.make_optimizer(tk.param_groups(1e-3), 1e-3)
    backward(model)
    assert process(tk, 1e-3, opt)[0]
    opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}
    backward(model)
    model.trunk["moe"].router.gate.weight.grad[0, 0] = float("nan")
    ok, stats = process(tk, 1e-3, opt)
    assert not ok and stats["stability/skipped_steps"] == 1 and tk.step_count == 1
    assert all(p.grad is None for p in model.parameters())   # nothing for an optimizer to apply
    opt.step()  # even a stray step is a no-op: every .grad is None
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    after = opt.state_dict()["state"]
    assert all(torch.equal(moments[k][kk], after[k][kk]) for k in moments for kk in moments[k])


def test_router_only_warmup_leaves_every_other_parameter_unchanged():
    model = TinyPolicy()
    tk = toolkit(model, router_warmup_steps=3)
    opt = tk.make_optimizer(tk.param_groups(1e-2), 1e-2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        backward(model)
        ok, stats = process(tk, 1e-2, opt)
        assert ok and stats["stability/router_warmup"] == 1.0
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(start[n], p) == (".router." not in n), n
    backward(model)
    assert process(tk, 1e-2, opt)[1]["stability/router_warmup"] == 0.0
    opt.step()
    assert not torch.equal(start["pi.weight"], model.pi.weight)


# --- gradient surgery ----------------------------------------------------------------------------------
def test_winsorize_clamps_outliers_even_on_tensors_torch_quantile_refuses():
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    g[3] = 1e6
    hi = abs_quantile(g, 0.99)
    winsorize_(g, 0.01)
    assert g.abs().max() == pytest.approx(float(hi)) and g[3] == pytest.approx(float(hi))
    big = torch.randn(EXACT_QUANTILE_MAX + 1, generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError):
        torch.quantile(big.abs(), 0.99)
    big[0] = 1e9
    winsorize_(big, 0.01)
    # |N(0,1)| 99th percentile is 2.576; the sampled estimate lands close to it.
    assert big.abs().max() == pytest.approx(2.576, rel=0.02)


def test_projection_is_an_orthogonal_projection():
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    basis = orthonormal_basis(g, 4)
    assert torch.allclose(basis @ basis.T, torch.eye(4), atol=1e-5)
    h = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    once = project_(h.clone(), basis)
    assert torch.allclose(project_(once.clone(), basis), once, atol=1e-5)   # idempotent
    assert torch.allclose((h - once) @ basis.T, torch.zeros(16, 4), atol=1e-4)  # residual orthogonal
    assert once.norm() <= h.norm()


def test_projection_in_the_toolkit_keeps_expert_gradients_in_their_subspace():
    model = TinyPolicy()
    tk = toolkit(model, projection_rank=2, projection_groups=["experts"])
    opt = tk.make_optimizer(tk.param_groups(1e-3), 1e-3)
    backward(model)
    process(tk, 1e-3, opt)
    name = "trunk.moe.experts.w1"                      # stacked: one basis per expert's matrix
    g = dict(model.named_parameters())[name].grad
    assert g.dim() == 3 and all(torch.linalg.matrix_rank(m) <= 2 for m in g) and name in tk.get_state()["bases"]


def test_lamb_descends_and_bounds_the_trust_ratio():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(64) * 5)  # ||w|| ~ 40, above the clamp
    opt = Lamb([w], lr=0.5, weight_decay=0.0, clamp=10.0)
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = (w - 1).pow(2).sum()
        loss.backward()
        before = w.detach().clone()
        opt.step()
        # The step length is lr * clamp / ||u|| * ||u|| = lr * min(||w||, clamp).
        assert (w.detach() - before).norm() <= 0.5 * 10.0 + 1e-4
        losses.append(loss.item())
    assert losses[-1] < 0.01 * losses[0]


# --- anomaly detection ---------------------------------------------------------------------------------
def clean_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        noise = torch.randn(4, generator=g).tolist()
        yield {"iteration": i + 1, "episode_return_mean_100": 20 + 4 * i + noise[0], "policy_loss": 0.1 * noise[1],
               "vf_loss": 5 + 0.5 * i + noise[2], "moe/cv": 0.3 + 0.02 * noise[3], "moe/active_experts": 8,
               "moe/router_entropy_norm": 0.9, "stability/grad_norm/total": 1.0 + 0.1 * abs(noise[0]),
               "learner/rss_mb/rank0": 500 + 0.1 * i}


def detector(**kw):
    return AnomalyDetector(validate_stability(kw), num_experts=8)


def test_anomaly_checker_stays_quiet_on_a_clean_run():
    d = detector()
    assert [a for row in clean_rows(300) for a in d.observe(row)] == []


def test_anomaly_checker_fires_on_a_planted_spike_and_drop_once_the_next_iteration_confirms_them():
    d = detector()
    alerts = []
    for row in clean_rows(70):
        if row["iteration"] in (40, 41):
            row["vf_loss"] *= 50
        if row["iteration"] >= 50:
            row["episode_return_mean_100"] = 5.0
        if row["iteration"] == 60:
            row["vf_loss"] *= 200                       # one iteration's blip, gone the next: no alert
        alerts += d.observe(row)
    assert [(a["iteration"], a["metric"], a["kind"]) for a in alerts] == [
        (41, "vf_loss", "spike"), (51, "episode_return_mean_100", "drop")]


def test_a_planned_task_change_restarts_the_watched_series_and_a_later_drop_still_alerts():
    """A sequential task schedule's next block: the return falls because the task changed. After
    restart_series that fall is a new series' start (no alert); a drop inside the block still is."""
    rows = list(clean_rows(80))
    for row in rows[40:]:
        row["episode_return_mean_100"] -= 150          # the next task: the return starts again, lower
    for row in rows[65:]:
        row["episode_return_mean_100"] = -200.0        # a fault inside the block
    def drops(restart_at):
        d, out = detector(), []
        for row in rows:
            if row["iteration"] == restart_at:
                d.restart_series()
            out += [a["iteration"] for a in d.observe(dict(row)) if a["metric"] == "episode_return_mean_100"]
        return out
    assert drops(restart_at=None) == [42, 67]          # without the schedule's figure: two drops
    assert drops(restart_at=41) == [67]                # with it: only the fault


def test_the_latest_segment_only_moves_on():
    from moe_rl.algo.monitoring import latest_segment
    assert latest_segment(-math.inf, 3.0) == 3.0       # the first figure: where the run starts
    assert latest_segment(3.0, 2.0) == 3.0             # an env copy lagging behind: no change
    assert latest_segment(3.0, 4.0) == 4.0
    assert latest_segment(3.0, None) == 3.0 and latest_segment(3.0, math.nan) == 3.0


def test_small_relative_moves_on_a_smooth_history_are_not_spikes():
    """A healthy quickstart's aux_loss went 2.004 -> 2.054 (z = 6.4 on its smooth history)."""
    d = detector()
    alerts = []
    for row in clean_rows(40):
        row["aux_loss"] = 2.0 + 0.001 * (row["iteration"] % 2)
        if row["iteration"] == 17:
            row["aux_loss"] = 2.05
        if row["iteration"] >= 30:
            row["aux_loss"] = 4.0                                # a collapse-sized jump still alerts
        alerts += d.observe(row)
    assert [(a["iteration"], a["metric"]) for a in alerts] == [(31, "aux_loss")]


def test_policy_loss_swings_of_healthy_ppo_are_not_spikes():
    """PPO's surrogate changes sign between healthy iterations (measured on the quickstart: -0.15 ->
    +0.16 after a quiet history); a jump past the floor still alerts."""
    d = detector()
    alerts = []
    for row in clean_rows(30):
        row["policy_loss"] = 0.01 * (row["iteration"] % 3)        # a quiet history: tiny MAD
        if row["iteration"] == 20:
            row["policy_loss"] = 0.31
        if row["iteration"] >= 25:
            row["policy_loss"] = 3.0
        alerts += d.observe(row)
    assert [(a["iteration"], a["metric"]) for a in alerts] == [(26, "policy_loss")]


def converging_run(seed, n=100):
    """A healthy run that converges, generated (seeded; noise bounded at 2.5 sigma): the figures a
    quickstart at its small, frequent updates shows over 100 iterations to a return of 490, which
    the detector must not alert on (the former detector raised 7 alerts on a recorded one):
      - the return (a mean over 100 episodes) rising 20 -> 490 along a logistic, the value loss
        10 -> 15 with it, each moving by less than 10 % an iteration;
      - the pre-clip gradient norm: log-normal (sigma 0.5) around a level that falls 75x as the
        policy converges, so the norm ends far below the run's median; outliers at 6x the level
        while it falls (1.3 -> 13.6 in one iteration, at iteration 50 of 98);
      - the mean KL: log-normal around 0.01, with 3x blips (0.0057 -> 0.034); the CV around 0.14,
        with swings of 0.1 (0.116 -> 0.222, z = 6.1); PPO's surrogate swinging around 0;
      - the value loss: three one-iteration jumps of 200x after 40 iterations, never in adjacent
        ones (seeds 3 and 4 of the same bench: at 50 and 70).
    Noisier figures early in a run are left out on purpose: with 10-30 iterations of history the
    robust scale is itself noisy, and a value loss moving by more than 10 % an iteration there
    alerts on a fraction of healthy seeds (clean_rows' N(0, 1) around 5 + 0.5 i: about 0.3 % of
    seeds, at iterations 13-30, e.g. clean_rows(100, 62) at 13; i.i.d. log-normal noise of sigma 0.5:
    15 %). The detector's early iterations are a known gap, not a property stated here.
    """
    rnd = random.Random(seed)

    def noise():
        return max(-2.5, min(2.5, rnd.gauss(0.0, 1.0)))

    blips = set(rnd.sample(range(40, n - 1, 3), 3))
    rows = []
    for i in range(n):
        converged = 1 / (1 + math.exp(-12 * (i / n - 0.55)))      # 0 -> 1 as the policy converges
        level = 1.5 * (0.02 / 1.5) ** converged
        outlier = 30 <= i < 60 and rnd.random() < 0.1
        rows.append({
            "iteration": i + 1, "episode_return_mean_100": (20 + 470 * converged) * math.exp(0.01 * noise()),
            "policy_loss": 0.1 * noise(),
            "vf_loss": 10 * (1 + 0.5 * converged) * math.exp(0.01 * noise()) * (200 if i + 1 in blips else 1),
            "stability/grad_norm/total": 6 * level if outlier else level * math.exp(0.5 * noise()),
            "mean_kl_loss": 0.01 * math.exp(0.5 * noise()) * (3 if rnd.random() < 0.05 else 1),
            "moe/cv": 0.14 + 0.01 * noise() + (0.1 if rnd.random() < 0.05 else 0.0), "moe/active_experts": 8,
            "moe/router_entropy_norm": 0.9 + 0.02 * noise(), "learner/rss_mb/rank0": 500 + 0.1 * i})
    return rows


def alerts_of(rows):
    d = detector()
    return [(a["iteration"], a["metric"], a["kind"]) for row in rows for a in d.observe(row)]


@given(seed=st.integers(0, 2**32 - 1), at=st.integers(20, 99))
@hypothesis_settings(max_examples=30, deadline=None)
def test_a_converging_run_is_quiet_and_a_fault_that_persists_alerts_where_it_starts(seed, at):
    """Whatever the seed: no alert on the healthy run; from iteration `at` on, a gradient norm 30x
    the largest before it breaches at `at` (its band is relative to the run's median); a KL of 0.5
    and a CV 0.5 higher (a bf16 rollout copy's 0.14 -> 0.63) spike at `at` and alert at `at` + 1,
    when the next iteration confirms them."""
    rows = converging_run(seed)
    assert alerts_of(rows) == []
    largest = max(r["stability/grad_norm/total"] for r in rows[:at - 1])
    for metric, faulty, expected in (
            ("stability/grad_norm/total", lambda v: 30 * largest, (at, "breach")),
            ("mean_kl_loss", lambda v: 0.5, (at + 1, "spike")),
            ("moe/cv", lambda v: v + 0.5, (at + 1, "spike"))):
        run = [dict(r) for r in rows]
        for row in run[at - 1:]:
            row[metric] = faulty(row[metric])
        assert alerts_of(run) == [(expected[0], metric, expected[1])]


def test_health_breaches_alert_when_they_start_and_memory_growth_is_caught():
    d = detector(rss_growth_mb=100)
    alerts = []
    for row in clean_rows(40):
        i = row["iteration"]
        if 10 <= i < 20:
            row["moe/health_level"] = 2             # a dead expert or a collapse (moe_rl.core.health)
            row["moe/active_experts"] = 5           # the LM load table's band alone no longer alerts
        if i == 30:
            row["drift/probe_flip_rate"] = 0.9      # routing oscillation
        row["learner/rss_mb/rank0"] = 500 + (20 * (i - 20) if i > 20 else 0)
        alerts += d.observe(row)
    got = [(a["iteration"], a["metric"], a["kind"]) for a in alerts]
    assert (10, "moe/health_level", "breach") in got
    assert sum(m == "moe/health_level" for _, m, _ in got) == 1   # once per breach, not every iteration
    assert not [m for _, m, _ in got if m == "moe/active_experts"]
    assert (30, "drift/probe_flip_rate", "oscillation") in got
    assert [k for _, m, k in got if m == "learner/rss_mb/rank0"] == ["memory"]


def test_memory_watch_ignores_the_warm_up_and_peaks_but_catches_a_rising_floor():
    """The driver-hosted learner of a healthy token run (configs/tokens_long.yaml, 2026-12-01): RSS
    grew 1.3 -> 1.9 GB over the first iterations and swung by 0.5 GB after (it alerted twice
    before); the same readings plus a 40 MB/iteration leak alert once."""
    healthy = [1317, 1668, 1814, 1929, 1877, 1981, 1951, 1909, 2000, 2166, 2065, 1965, 1965, 1966, 1505, 1693,
               1822, 1860, 1869, 1889, 1899, 1901, 1901, 1902, 1911, 1912]
    for leak, expected in ((0, []), (40, ["memory"])):
        d = detector()
        alerts = []
        for row, rss in zip(clean_rows(len(healthy)), healthy):
            alerts += d.observe({**row, "learner/rss_mb/rank0": rss + leak * row["iteration"]})
        assert [a["kind"] for a in alerts] == expected


# --- settings ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, field", [
    ({"grad_clip": -1}, "stability.grad_clip"),
    ({"lr_schedules": {"experts": {"schedule": "linear", "lr": 1e-3}}}, "stability.lr_schedules.experts.schedule"),
    ({"lr_schedules": {"experts": {"schedule": "cosine", "lr": 1e-3}}}, "stability.lr_schedules.experts.t_max"),
    ({"lr_schedules": {"experts": {"schedule": "constant", "lr": -1.0}}}, "stability.lr_schedules.experts.lr"),
    ({"lr_schedules": {"decoder": {"schedule": "constant", "lr": 1e-3}}}, "stability.lr_schedules"),
    ({"winsorize_p": 0.7}, "stability.winsorize_p"),
    ({"optimizer": "sgd"}, "stability.optimizer"),
    ({"router_warmup_steps": -5}, "stability.router_warmup_steps"),
    ({"expert_dropout_schedule": {"start": 0.05, "end": 1.5, "steps": 10}}, "stability.expert_dropout_schedule.end"),
    ({"grad_clip_factors": {"router": 0}}, "stability.grad_clip_factors.router"),
    ({"entropy_band": [0.9, 0.1]}, "stability.entropy_band"),
    ({"nan_policy": "skip"}, "stability.nan_policy"),
])
def test_bad_stability_settings_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        validate_stability(settings)


# --- model options -------------------------------------------------------------------------------------
@pytest.mark.parametrize("token_policy", [False, True])
def test_activation_checkpointing_gives_the_same_outputs_and_gradients(token_policy):
    from moe_rl.core.policy import MoEMLPTrunk, MoETransformerTrunk
    from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        s = validate_moe({**MOE_DEFAULTS, "d_model": 16, "d_ff": 16, "num_experts": 4,
                          "activation_checkpointing": ckpt, "expert_dropout": 0.1})
        if token_policy:
            trunk = MoETransformerTrunk(5, s)
            obs = {"tokens": torch.randint(0, 5, (6, 8)), "position": torch.randint(0, 8, (6,))}
        else:
            trunk = MoEMLPTrunk(4, s)
            obs = torch.randn(6, 4)
        h, records = trunk(obs)
        (h.pow(2).sum() + sum(r.router_logits.pow(2).sum() for r in records)).backward()
        grads.append({n: p.grad.clone() for n, p in trunk.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


@pytest.mark.parametrize("positions,length,capacity_factor", [("learned", 12, None), ("relative", 40, None),
                                                              ("relative", 40, 0.5), ("learned", 12, 1.0)])
def test_token_trunk_features_do_not_depend_on_the_rest_of_the_batch(positions, length, capacity_factor):
    """Each row's features and routing are what it gives alone (the relative path drops the
    padding mask: trailing padding must stay hidden by causality; under a capacity factor each
    sequence is its own capacity group); relative positions run past max_seq_len."""
    from moe_rl.core.policy import MoETransformerTrunk
    from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
    torch.manual_seed(0)
    s = validate_moe({**MOE_DEFAULTS, "d_model": 16, "d_ff": 16, "num_experts": 4, "max_seq_len": 12,
                      "positions": positions, "capacity_factor": capacity_factor})
    trunk = MoETransformerTrunk(5, s).eval()
    position = torch.tensor([3, length - 1, 7])
    tokens = torch.randint(0, 5, (3, length)).masked_fill(torch.arange(length)[None] >= position[:, None], -1)
    with torch.no_grad():
        together, records = trunk({"tokens": tokens, "position": position})
        rows = [trunk({"tokens": tokens[i:i + 1], "position": position[i:i + 1]}) for i in range(3)]
    assert torch.allclose(together, torch.cat([h for h, _ in rows]), atol=1e-5)
    for layer, rec in enumerate(records):
        assert torch.equal(rec.encoded_top_k(), torch.cat([recs[layer].encoded_top_k() for _, recs in rows]))
    if capacity_factor is not None:   # the limit bites: without it the features differ
        trunk_dropless = MoETransformerTrunk(5, s.replace(capacity_factor=None)).eval()
        trunk_dropless.load_state_dict(trunk.state_dict())
        with torch.no_grad():
            assert not torch.allclose(trunk_dropless({"tokens": tokens, "position": position})[0], together, atol=1e-3)
    if positions == "relative":
        assert trunk.pos is None
        trunk({"tokens": tokens, "position": position})[0].pow(2).sum().backward()
        assert trunk.attns[0].rel_bias.grad.abs().sum() > 0   # offsets reach the loss


def test_reinforce_router_records_survive_token_selection():
    from moe_rl.core.losses import reinforce_router_loss
    from moe_rl.core.policy import MoETransformerTrunk
    from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
    s = validate_moe({**MOE_DEFAULTS, "d_model": 16, "d_ff": 16, "num_experts": 4, "router": "reinforce"})
    trunk = MoETransformerTrunk(5, s)
    _, records = trunk({"tokens": torch.randint(0, 5, (6, 8)), "position": torch.randint(0, 8, (6,))})
    loss = sum(reinforce_router_loss(r, torch.randn(6)) for r in records)
    loss.backward()
    assert records[0].selection_logp.shape == (6,)
    assert trunk.blocks[0].moe.router.gate.weight.grad.abs().sum() > 0
    assert trunk.blocks[0].moe.router.baseline.weight.grad.abs().sum() > 0


def test_anomaly_checker_ignores_float_noise_in_drift_figures():
    d = detector()
    alerts = []
    for i, row in enumerate(clean_rows(40)):
        row["drift/max_abs_logp_diff"] = 2.384e-07 if i != 30 else 4.768e-07   # one ulp-scale step
        row["drift/k3"] = 0.0 if i < 35 else 0.5                              # a real jump, and it stays
        alerts += d.observe(row)
    assert [(a["metric"], a["kind"]) for a in alerts] == [("drift/k3", "spike")]


# --- adaptive balance ------------------------------------------------------------------------------
def routed(choice: torch.Tensor) -> RoutingRecord:
    t = choice.shape[0]
    return RoutingRecord(top_k_indices=choice, gate_weights=torch.full(choice.shape, 0.5),
                         router_logits=torch.zeros(t, 8))


def test_adaptive_balance_acts_only_while_the_load_is_unhealthy():
    g = torch.Generator().manual_seed(0)
    b = AdaptiveBalance(ceiling=0.05, num_layers=2, num_experts=8)
    uniform = [routed(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(64)])) for _ in range(2)]
    for _ in range(30):
        cv = b.observe(uniform)
    assert b.coef == 0.0 and cv < 0.5                      # a healthy router never meets the loss
    collapsed = [uniform[0], routed(torch.tensor([[0, 1]] * 64))]  # one layer on 2 of 8 experts
    rises = []
    for _ in range(20):
        b.observe(collapsed)
        rises.append(b.coef)
    # the smoothed CV leaves the band within 5 steps; then ~12 steps from the floor to the ceiling
    assert rises[4] > 0 and rises[-1] == 0.05
    assert all(x <= y for x, y in zip(rises, rises[1:]))
    for _ in range(200):
        b.observe(uniform)
    assert b.coef < 0.05 * 0.01                              # back in the band: it fades
    state = b.get_state()
    other = AdaptiveBalance(ceiling=0.05, num_layers=2, num_experts=8)
    other.set_state(state)
    assert other.coef == b.coef and torch.equal(other.loads, b.loads) and other.steps == b.steps

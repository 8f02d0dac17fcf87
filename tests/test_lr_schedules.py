"""One LR system per parameter group: a group stability.lr_schedules names follows that schedule
alone, computed by torch's own schedulers; every other group follows training.lr (RLlib's lr or
RLlib's schedule). The pure tests drive the toolkit and compare each group's LR at every applied
step with torch's schedulers stepped on an optimizer of their own; the last test is a training run
with both kinds of schedule (docs/stability.md, "Learning rates")."""
import math

import pytest
import torch
from torch.optim import lr_scheduler

from moe_rl.core.errors import ConfigError
from moe_rl.core.lr_schedules import GroupLR
from moe_rl.core.settings import resolve_deepspeed
from moe_rl.core.stability import StabilityToolkit, validate_stability

# One tensor per parameter group, under the module paths the policy uses.
NAMES = {"router": "trunk.blocks.0.moe.router.gate.weight", "shared_expert": "trunk.blocks.0.moe.shared_expert.w1",
         "experts": "trunk.blocks.0.moe.experts.w1", "policy_head": "pi.weight", "value_head": "vf.weight",
         "other": "trunk.embed.weight"}


def toolkit(**settings):
    params = [(name, torch.nn.Parameter(torch.zeros(2))) for name in NAMES.values()]
    groups = {name: group for group, name in NAMES.items()}   # each tensor stands for its group
    return StabilityToolkit(validate_stability(settings), params, groups), [p for _, p in params]


def group_lrs(optimizer):
    return {pg["moe_rl_group"]: pg["lr"] for pg in optimizer.param_groups}


def run_toolkit(steps, base_lr=lambda t: 1e-3, scale=1.0, skip=(), **settings):
    """Drive the toolkit as the learner does: per step, gradients, process (the LRs are set), the
    optimizer step. -> per applied step, each group's LR in the optimizer and in the step's figures."""
    tk, params = toolkit(**settings)
    opt = tk.make_optimizer(tk.param_groups(base_lr(0)), base_lr(0))
    out, t = [], 0
    for i in range(steps):
        for p in params:
            p.grad = torch.full_like(p, float("nan") if i in skip else 1e-3)
        if tk.process(base_lr(t), opt, scale=scale):
            lrs = group_lrs(opt)
            assert lrs == {g: tk.last_stats[f"stability/lr/{g}"] for g in lrs}   # what the run reports
            out.append(lrs)
            opt.step()
            t += 1
    return out


def torch_reference(schedule_cls, lr, steps, **kwargs):
    """LR of every step 0..steps-1 of one torch scheduler on an optimizer of its own."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = schedule_cls(opt, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def with_warmup(lr, w, after):
    """torch's LinearLR from lr/w for the first w steps, then `after` from its own step 0."""
    if not w:
        return after
    ramp = torch_reference(lr_scheduler.LinearLR, lr, w, start_factor=1 / w, end_factor=1.0,
                           total_iters=max(w - 1, 1))
    return ramp + after


STEPS = 160
CASES = {
    "constant": ({"schedule": "constant", "lr": 5e-6},
                 lambda s, n: [s["lr"]] * n),
    "cosine": ({"schedule": "cosine", "lr": 3e-4, "eta_min": 3e-5, "t_max": 60},
               # torch's CosineAnnealingLR over t_max, then eta_min held (torch's would rise again)
               lambda s, n: torch_reference(lr_scheduler.CosineAnnealingLR, s["lr"], s["t_max"], T_max=s["t_max"],
                                            eta_min=s["eta_min"]) + [s["eta_min"]] * n),
    "cyclic": ({"schedule": "cyclic", "lr": 1e-5, "max_lr": 1e-4, "step_size": 20},
               lambda s, n: torch_reference(lr_scheduler.CyclicLR, s["lr"], n, base_lr=s["lr"], max_lr=s["max_lr"],
                                            step_size_up=s["step_size"], mode="triangular", cycle_momentum=False)),
    "cosine_restarts": ({"schedule": "cosine_restarts", "lr": 1e-3, "eta_min": 1e-6, "t_0": 10, "t_mult": 2},
                        lambda s, n: torch_reference(lr_scheduler.CosineAnnealingWarmRestarts, s["lr"], n,
                                                     T_0=s["t_0"], T_mult=s["t_mult"], eta_min=s["eta_min"])),
}


@pytest.mark.pure
@pytest.mark.parametrize("warmup", [0, 1, 7])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_scheduled_groups_lr_is_torchs_schedule_at_every_applied_step(kind, warmup):
    spec, reference = CASES[kind]
    expected = with_warmup(spec["lr"], warmup, reference(spec, STEPS))[:STEPS]
    got = run_toolkit(STEPS, lr_schedules={"experts": {**spec, "warmup_steps": warmup}})
    assert [lrs["experts"] for lrs in got] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # the other groups: training.lr alone
    assert all(lrs[g] == 1e-3 for lrs in got for g in lrs if g != "experts")


@pytest.mark.pure
def test_every_group_follows_its_own_schedule_and_the_rest_follow_rllibs_lr():
    """Four schedules at once, "default" for the unnamed groups but one, RLlib's lr moving under the
    groups left to it; a skipped (non-finite) step advances nothing, lr_scale scales every group."""
    rllib = [1e-3 * 0.9 ** t for t in range(STEPS)]   # e.g. RLlib's piecewise schedule, as it moves
    schedules = {g: CASES[k][0] for g, k in (("router", "constant"), ("experts", "cosine"),
                                             ("policy_head", "cyclic"), ("shared_expert", "cosine_restarts"))}
    got = run_toolkit(STEPS + 3, base_lr=lambda t: rllib[t], scale=0.5, skip={5, 6, 40}, lr_schedules=schedules)
    assert len(got) == STEPS
    for g, spec in schedules.items():
        expected = CASES[spec["schedule"]][1](spec, STEPS)[:STEPS]
        assert [lrs[g] for lrs in got] == pytest.approx([0.5 * v for v in expected], rel=1e-9, abs=1e-15), g
    for g in ("value_head", "other"):
        assert [lrs[g] for lrs in got] == pytest.approx([0.5 * v for v in rllib], rel=1e-12), g
    # "default" covers every group without a schedule of its own: none is left to training.lr
    got = run_toolkit(4, lr_schedules={"router": CASES["constant"][0], "default": CASES["cosine"][0]})
    cosine = CASES["cosine"][1](CASES["cosine"][0], 4)
    assert all(got[t][g] == pytest.approx(cosine[t]) for t in range(4) for g in got[t] if g != "router")
    assert all(lrs["router"] == 5e-6 for lrs in got)


@pytest.mark.pure
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_restored_toolkit_continues_the_schedule_and_a_rollback_returns_to_its_step(kind):
    spec = {**CASES[kind][0], "warmup_steps": 5}
    settings = validate_stability({"lr_schedules": {"experts": spec}})
    expected = with_warmup(spec["lr"], 5, CASES[kind][1](spec, STEPS))
    schedule = GroupLR(settings.lr_schedules["experts"])
    for t in range(90):
        assert schedule.lr == pytest.approx(expected[t], rel=1e-9, abs=1e-15)
        schedule.step()
    for t in (90, 37, 37, 120, 0, 64):   # a checkpoint restore, a rollback to the kept step, ...
        schedule.seek(t)
        assert schedule.t == t and schedule.lr == pytest.approx(expected[t], rel=1e-9, abs=1e-15)
    tk, _ = toolkit(**{"lr_schedules": {"experts": spec}})
    tk.set_state({"step_count": 64, "skipped": 0})   # a checkpoint holds the step count only
    assert tk.lr_of("experts", 1e-3) == pytest.approx(expected[64], rel=1e-9)


@pytest.mark.pure
def test_the_templates_schedules_keep_their_meaning():
    """The closed forms the templates were written against (configs/finetune*.yaml, pretrain*.yaml,
    stable.yaml): cosine from lr to eta_min over t_max then held, a triangle between lr and max_lr
    with half-period step_size, SGDR restarts at t_0, t_0 (1 + t_mult), ..., a linear warm-up
    lr (t+1)/w before the schedule starts at its own step 0."""
    def lrs(spec, ts):
        schedule = GroupLR(validate_stability({"lr_schedules": {"experts": spec}}).lr_schedules["experts"])
        out = []
        for t in ts:
            schedule.seek(t)
            out.append(schedule.lr)
        return out

    cos = {"schedule": "cosine", "lr": 3e-5, "eta_min": 1e-6, "t_max": 10000}
    assert lrs(cos, (0, 2500, 5000, 10000, 20000)) == pytest.approx(
        [3e-5, 1e-6 + (3e-5 - 1e-6) * (1 + math.cos(math.pi / 4)) / 2, 1e-6 + (3e-5 - 1e-6) / 2, 1e-6, 1e-6])
    cyc = {"schedule": "cyclic", "lr": 1e-5, "max_lr": 1e-4, "step_size": 2000}
    assert lrs(cyc, (0, 1000, 2000, 3000, 4000, 6000)) == pytest.approx([1e-5, 5.5e-5, 1e-4, 5.5e-5, 1e-5, 1e-4])
    sgdr = {"schedule": "cosine_restarts", "lr": 1e-3, "eta_min": 1e-6, "t_0": 2000, "t_mult": 2}
    assert lrs(sgdr, (0, 1000, 2000, 4000, 6000, 14000)) == pytest.approx(
        [1e-3, 1e-6 + (1e-3 - 1e-6) / 2, 1e-3, 1e-6 + (1e-3 - 1e-6) / 2, 1e-3, 1e-3])
    # a restart exactly where a floating-point log would put it one period early (3 + 9 + ... + 243)
    assert lrs({"schedule": "cosine_restarts", "lr": 1e-3, "eta_min": 0.0, "t_0": 3, "t_mult": 3}, (363,)) == [1e-3]
    warm = {"schedule": "constant", "lr": 5e-6, "warmup_steps": 1000}
    assert lrs(warm, (0, 499, 999, 1000, 5000)) == pytest.approx([5e-9, 2.5e-6, 5e-6, 5e-6, 5e-6])
    pre = {"schedule": "cosine", "lr": 6e-4, "eta_min": 6e-5, "t_max": 200, "warmup_steps": 20}   # pretrain.yaml
    assert lrs(pre, (0, 19, 20, 120, 220, 260)) == pytest.approx([3e-5, 6e-4, 6e-4, 3.3e-4, 6e-5, 6e-5])


@pytest.mark.pure
def test_schedule_combinations_that_would_be_two_lr_systems_are_refused():
    with pytest.raises(ConfigError, match=r"stability.lr_schedules.experts.eta_min"):
        validate_stability({"lr_schedules": {"experts": {"schedule": "cosine", "lr": 1e-4, "eta_min": 1e-3,
                                                         "t_max": 10}}})
    with pytest.raises(ConfigError, match=r"deepspeed.config.scheduler"):
        resolve_deepspeed({"config": {"scheduler": {"type": "WarmupLR"}}}, 1, 2)


# --- a training run ---------------------------------------------------------------------------------
MID = "default_policy"
RLLIB_LR = [[0, 1e-3], [400, 1e-4]]   # RLlib's own schedule: piecewise linear over sampled env steps


def test_a_run_reports_each_groups_lr_as_configured_beside_rllibs_lr_schedule(ray_local):
    from moe_rl import MoEPPOConfig

    config = (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
              .training(lr=RLLIB_LR, train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1)
              .moe(num_experts=4, top_k=2, d_model=16, d_ff=16)
              .stability(lr_schedules={"router": {"schedule": "constant", "lr": 5e-6},
                                       "experts": {"schedule": "cosine", "lr": 3e-4, "eta_min": 3e-5, "t_max": 8}})
              .debugging(seed=0))
    algo = config.build_algo()
    try:
        learner = algo.learner_group._learner
        optimizer = learner.get_optimizer(MID)
        rllib_lrs = []
        for _ in range(3):
            r = algo.train()
            [(_, toolkit)] = learner.toolkits(MID)
            steps = toolkit.step_count
            res = r["learners"][MID]
            # RLlib's lr as it stands after this update (its Scheduler over sampled env steps) ...
            sampled = r["env_runners"]["num_env_steps_sampled_lifetime"]
            rllib_now = 1e-3 + (1e-4 - 1e-3) * min(sampled, 400) / 400
            assert learner.rllib_lr(optimizer) == pytest.approx(rllib_now)
            assert res["default_optimizer_learning_rate"] == pytest.approx(rllib_now)   # RLlib's metric
            # ... drove the groups left to it in this update (the value set after the previous one)
            assert res["stability/lr/other"] == pytest.approx(rllib_lrs[-1] if rllib_lrs else 1e-3)
            assert res["stability/lr/policy_head"] == res["stability/lr/other"]
            # the named groups: their schedule alone, at the update's last applied step
            assert res["stability/lr/router"] == pytest.approx(5e-6)
            cosine = (1 + math.cos(math.pi * min(steps - 1, 8) / 8)) / 2
            assert res["stability/lr/experts"] == pytest.approx(3e-5 + (3e-4 - 3e-5) * cosine)
            # between updates the optimizer holds each group's LR for its next step
            lrs = group_lrs(optimizer)
            assert lrs["router"] == 5e-6 and lrs["other"] == pytest.approx(rllib_now)
            rllib_lrs.append(rllib_now)
        assert rllib_lrs[0] > rllib_lrs[-1]   # RLlib's schedule moved
    finally:
        algo.stop()

"""MoE-PPO vs RLlib's stock PPO (dense MLP of about equal *active* parameters) on CartPole-v1.

Same env-runner layouts, batch sizes, PPO settings and seeds, in one process and one run:
    .venv/bin/python bench/bench_ppo.py [--max-iterations 40] [--target 450] [--layouts 1x1,1x8,2x4] [--json OUT]
    .venv/bin/python bench/bench_ppo.py --size large --layouts 1x8 --max-iterations 4

--size large: a realistic learner (2 MoE layers, d 256, 64 experts, top-2, expert hidden 512;
4096-step minibatches of a 16 384-step batch, 1 epoch) against the stock MLP of equal active
parameters; the stock default model is left out there (it is far smaller).

Per layout (runners x envs per runner) and algorithm it reports env steps/s (training included)
and the env steps at which the mean training return first reached the target (every run goes on
for --max-iterations). The layout's algorithms are built together and alternate iteration by
iteration, so a change in the machine's speed during the run hits all of them alike. Speeds are
the steady state: medians over iterations 2.. of the iteration, its sampling and its learner
update (timed around the calls themselves; RLlib's `timers` are exponential averages that still
weigh the first, warm-up iteration at about 0.9 after 15 iterations) and the rest (MoE-PPO's
consistency check and weight sync, bookkeeping).
"""
import argparse
import contextlib
import json
import math
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
import ray.rllib.algorithms.ppo.ppo as stock_ppo_module  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig  # noqa: E402

from moe_rl import MoEPPOConfig  # noqa: E402
from moe_rl.algo import algorithm as moe_ppo_module  # noqa: E402
from moe_rl.core.sharding import is_expert_param  # noqa: E402

LAYOUTS = [(1, 1), (1, 8), (2, 4)]
TRAINING = dict(lr=3e-4, gamma=0.99, lambda_=0.95, train_batch_size_per_learner=4000, minibatch_size=256,
                num_epochs=6, vf_loss_coeff=0.5, vf_clip_param=1000.0)
SIZES = {   # moe settings, training overrides, the algorithms compared
    "quickstart": (dict(num_experts=8, top_k=2, num_layers=2, d_model=64, d_ff=64), {},
                   ("moe_ppo", "stock_ppo", "stock_default")),
    "large": (dict(num_experts=64, top_k=2, num_layers=2, d_model=256, d_ff=512),
              dict(train_batch_size_per_learner=16384, minibatch_size=4096, num_epochs=1), ("moe_ppo", "stock_ppo")),
}
OBS_DIM, NUM_ACTIONS = 4, 2   # CartPole


def policy_params(algo):
    """Active policy parameters: all but the value network, experts counted at k of N."""
    module = algo.learner_group._learner.module["default_policy"]
    total = sum(p.numel() for n, p in module.named_parameters() if not n.startswith(("vf", "encoder.critic")))
    experts = sum(p.numel() for n, p in module.named_parameters() if is_expert_param(n))
    if not experts:
        return total
    s = module.moe_settings
    return total - experts + experts * s.top_k // s.num_experts


def equal_active_hidden(active: int) -> int:
    """Width h of a 2-hidden-layer MLP policy with about `active` parameters:
    h^2 + h (obs + actions + 2) + actions = active."""
    b = OBS_DIM + NUM_ACTIONS + 2
    return math.ceil((-b + math.sqrt(b * b + 4 * (active - NUM_ACTIONS))) / 2)


PHASES = {"sample_s": 0.0, "learn_s": 0.0}


def timing(phase, fn):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[phase] += time.perf_counter() - t0
    return timed


@contextlib.contextmanager
def phase_timers():
    """Time the sampling and learner-update calls of both algorithms' training_step."""
    saved = [(m, m.synchronous_parallel_sample) for m in (stock_ppo_module, moe_ppo_module)]
    for m, fn in saved:
        m.synchronous_parallel_sample = timing("sample_s", fn)
    try:
        yield
    finally:
        for m, fn in saved:
            m.synchronous_parallel_sample = fn


class Run:
    """One algorithm of a layout, trained an iteration at a time (the layout's algorithms alternate)."""

    def __init__(self, config, target):
        self.algo = config.build_algo()
        self.active = policy_params(self.algo)
        self.algo.learner_group.update = timing("learn_s", self.algo.learner_group.update)
        self.target, self.steps, self.steps_to_target, self.per_iter = target, 0, None, []

    def iterate(self):
        PHASES.update(sample_s=0.0, learn_s=0.0)
        t_iter = time.perf_counter()
        r = self.algo.train()
        new_steps = r["env_runners"]["num_env_steps_sampled_lifetime"] - self.steps
        self.steps += new_steps
        self.per_iter.append({"iter_s": time.perf_counter() - t_iter, "steps": new_steps, **PHASES})
        if self.steps_to_target is None and r["env_runners"].get("episode_return_mean", 0) >= self.target:
            self.steps_to_target = self.steps   # every run goes on to max_iterations: equal footing for speed

    def summary(self):
        steady = self.per_iter[1:] or self.per_iter

        def median(key):
            return statistics.median(it[key] for it in steady)
        return {"env_steps": self.steps, "steps_per_s": statistics.median(it["steps"] / it["iter_s"] for it in steady),
                "steps_to_target": self.steps_to_target, "active_policy_params": self.active,
                "iterations": len(self.per_iter), "sample_s": median("sample_s"), "learn_s": median("learn_s"),
                # the rest of the iteration: the consistency check and the weight sync (MoE-PPO), bookkeeping
                "rest_s": statistics.median(it["iter_s"] - it["sample_s"] - it["learn_s"] for it in steady),
                "per_iteration": self.per_iter}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-iterations", type=int, default=40)
    ap.add_argument("--target", type=float, default=450)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default=",".join(f"{r}x{e}" for r, e in LAYOUTS))
    ap.add_argument("--size", choices=tuple(SIZES), default="quickstart")
    ap.add_argument("--json")
    args = ap.parse_args()
    moe, training, algos = SIZES[args.size]
    layouts = [tuple(int(v) for v in x.split("x")) for x in args.layouts.split(",")]
    # A layout's algorithms are alive together and each env runner reserves one logical CPU: declare
    # enough of them (logical only: one algorithm runs at a time, the machine's cores are shared).
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=max(os.cpu_count() or 1, len(algos) * max(r for r, _ in layouts)))
    rows = []
    for runners, envs in layouts:
        runs = {}
        for name in algos:   # moe_ppo first: the equal-active width follows its parameter count
            if name == "moe_ppo":
                cfg = MoEPPOConfig().moe(**moe)
            elif name == "stock_ppo":
                hidden = equal_active_hidden(runs["moe_ppo"].active)
                cfg = PPOConfig().rl_module(model_config=DefaultModelConfig(
                    fcnet_hiddens=[hidden, hidden], fcnet_activation="tanh"))
            else:   # the model a user gets by default: 256 x 256 tanh
                cfg = PPOConfig()
            cfg = (cfg.environment("CartPole-v1").training(**{**TRAINING, **training})
                   .env_runners(num_env_runners=runners, num_envs_per_env_runner=envs).debugging(seed=args.seed))
            runs[name] = Run(cfg, args.target)
        try:
            with phase_timers():
                for _ in range(args.max_iterations):   # alternate: a slow spell of the machine hits every algorithm
                    for run in runs.values():
                        run.iterate()
        finally:
            for run in runs.values():
                run.algo.stop()
        for name, run in runs.items():
            r = {"layout": f"{runners}x{envs}", "algo": name, **run.summary()}
            rows.append(r)
            print(f"{r['layout']:>5} {name:>13}  active policy params {r['active_policy_params']:>7}  "
                  f"{r['steps_per_s']:8.0f} env steps/s  sample {r['sample_s']:.2f}s learn {r['learn_s']:.2f}s "
                  f"rest {r['rest_s']:.2f}s  "
                  f"steps to {args.target:g}: {r['steps_to_target']}", flush=True)
    print("\nlayout  peer           moe/peer env steps/s  sample moe/peer  learn moe/peer")
    for runners, envs in layouts:
        by = {r["algo"]: r for r in rows if r["layout"] == f"{runners}x{envs}"}
        m = by["moe_ppo"]
        for peer in algos[1:]:
            p = by[peer]
            print(f"{runners}x{envs:<4}  {peer:13}  {m['steps_per_s'] / p['steps_per_s']:20.2f}"
                  f"  {m['sample_s'] / p['sample_s']:15.2f}  {m['learn_s'] / p['learn_s']:14.2f}")
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

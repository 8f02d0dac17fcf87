"""MoE-PPO vs RLlib's stock PPO (dense MLP of about equal *active* parameters) on CartPole-v1.

Same env-runner layouts, batch sizes, PPO settings and seeds, in one process and one run:
    .venv/bin/python bench/bench_ppo.py [--max-iterations 40] [--target 450] [--layouts 1x1,1x8,2x4] [--json OUT]

Per layout (runners x envs per runner) and algorithm it reports env steps/s (training included)
and the env steps at which the mean training return first reached the target.
"""
import argparse
import json
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig  # noqa: E402

from moe_rl import MoEPPOConfig  # noqa: E402
from moe_rl.core.sharding import is_expert_param  # noqa: E402

LAYOUTS = [(1, 1), (1, 8), (2, 4)]
TRAINING = dict(lr=3e-4, gamma=0.99, lambda_=0.95, train_batch_size_per_learner=4000, minibatch_size=256,
                num_epochs=6, vf_loss_coeff=0.5, vf_clip_param=1000.0)
MOE = dict(num_experts=8, top_k=2, num_layers=2, d_model=64, d_ff=64)
DENSE_HIDDEN = 184  # 2 x 184 tanh MLP ~ the MoE policy's active parameters (printed below)
ALGOS = ("stock_ppo", "stock_default", "moe_ppo")


def policy_params(algo):
    module = algo.learner_group._learner.module["default_policy"]
    total = sum(p.numel() for n, p in module.named_parameters() if not n.startswith(("vf", "encoder.critic")))
    experts = sum(p.numel() for n, p in module.named_parameters() if is_expert_param(n))
    return total - experts + experts * MOE["top_k"] // MOE["num_experts"] if experts else total


def run(config, max_iterations, target):
    algo = config.build_algo()
    active = policy_params(algo)
    steps_to_target, t0, steps = None, time.perf_counter(), 0
    timers = []
    try:
        for _ in range(max_iterations):
            r = algo.train()
            steps = r["env_runners"]["num_env_steps_sampled_lifetime"]
            t = r.get("timers", {})
            timers.append((t.get("env_runner_sampling_timer"), t.get("learner_update_timer")))
            if steps_to_target is None and r["env_runners"].get("episode_return_mean", 0) >= target:
                steps_to_target = steps
                break
        wall = time.perf_counter() - t0
    finally:
        algo.stop()
    # RLlib's timers are smoothed over iterations: the last value, first iteration excluded by it.
    return {"env_steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "steps_to_target": steps_to_target,
            "active_policy_params": active, "sample_s": timers[-1][0], "learn_s": timers[-1][1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-iterations", type=int, default=40)
    ap.add_argument("--target", type=float, default=450)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layouts", default=",".join(f"{r}x{e}" for r, e in LAYOUTS))
    ap.add_argument("--json")
    args = ap.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    layouts = [tuple(int(v) for v in x.split("x")) for x in args.layouts.split(",")]
    for runners, envs in layouts:
        for name in ALGOS:
            if name == "moe_ppo":
                cfg = MoEPPOConfig().moe(**MOE)
            elif name == "stock_ppo":
                cfg = PPOConfig().rl_module(model_config=DefaultModelConfig(
                    fcnet_hiddens=[DENSE_HIDDEN, DENSE_HIDDEN], fcnet_activation="tanh"))
            else:   # the model a user gets by default: 256 x 256 tanh
                cfg = PPOConfig()
            cfg = (cfg.environment("CartPole-v1").training(**TRAINING)
                   .env_runners(num_env_runners=runners, num_envs_per_env_runner=envs).debugging(seed=args.seed))
            r = {"layout": f"{runners}x{envs}", "algo": name, **run(cfg, args.max_iterations, args.target)}
            rows.append(r)
            print(f"{r['layout']:>5} {name:>13}  active policy params {r['active_policy_params']:>6}  "
                  f"{r['steps_per_s']:8.0f} env steps/s  sample {r['sample_s']:.2f}s learn {r['learn_s']:.2f}s  "
                  f"steps to {args.target:g}: {r['steps_to_target']}", flush=True)
    print("\nlayout  moe/stock(equal active)  moe/stock(default)  sample moe/stock  learn moe/stock")
    for runners, envs in layouts:
        by = {r["algo"]: r for r in rows if r["layout"] == f"{runners}x{envs}"}
        m, s, d = by["moe_ppo"], by["stock_ppo"], by["stock_default"]
        print(f"{runners}x{envs:<4}  {m['steps_per_s'] / s['steps_per_s']:23.2f}"
              f"  {m['steps_per_s'] / d['steps_per_s']:18.2f}"
              f"  {m['sample_s'] / s['sample_s']:16.2f}  {m['learn_s'] / s['learn_s']:15.2f}")
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

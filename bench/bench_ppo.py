"""MoE-PPO vs RLlib's stock PPO (dense MLP of about equal *active* parameters) on CartPole-v1.

Same env-runner layouts, batch sizes, PPO settings and seeds, in one process and one run:
    .venv/bin/python bench/bench_ppo.py [--max-iterations 40] [--target 450] [--json OUT]

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


def policy_params(algo):
    module = algo.learner_group._learner.module["default_policy"]
    total = sum(p.numel() for n, p in module.named_parameters() if not n.startswith(("vf", "encoder.critic")))
    experts = sum(p.numel() for n, p in module.named_parameters() if is_expert_param(n))
    return total - experts + experts * MOE["top_k"] // MOE["num_experts"] if experts else total


def run(config, max_iterations, target):
    algo = config.build_algo()
    active = policy_params(algo)
    steps_to_target, t0, steps = None, time.perf_counter(), 0
    try:
        for _ in range(max_iterations):
            r = algo.train()
            steps = r["env_runners"]["num_env_steps_sampled_lifetime"]
            if steps_to_target is None and r["env_runners"].get("episode_return_mean", 0) >= target:
                steps_to_target = steps
                break
        wall = time.perf_counter() - t0
    finally:
        algo.stop()
    return {"env_steps": steps, "wall_s": wall, "steps_per_s": steps / wall, "steps_to_target": steps_to_target,
            "active_policy_params": active}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-iterations", type=int, default=40)
    ap.add_argument("--target", type=float, default=450)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    for runners, envs in LAYOUTS:
        for name in ("stock_ppo", "moe_ppo"):
            if name == "moe_ppo":
                cfg = MoEPPOConfig().moe(**MOE)
            else:
                cfg = PPOConfig().rl_module(model_config=DefaultModelConfig(
                    fcnet_hiddens=[DENSE_HIDDEN, DENSE_HIDDEN], fcnet_activation="tanh"))
            cfg = (cfg.environment("CartPole-v1").training(**TRAINING)
                   .env_runners(num_env_runners=runners, num_envs_per_env_runner=envs).debugging(seed=args.seed))
            r = {"layout": f"{runners}x{envs}", "algo": name, **run(cfg, args.max_iterations, args.target)}
            rows.append(r)
            print(f"{r['layout']:>5} {name:>9}  active policy params {r['active_policy_params']:>6}  "
                  f"{r['steps_per_s']:8.0f} env steps/s  steps to {args.target:g}: {r['steps_to_target']}", flush=True)
    print("\nlayout  throughput moe/stock  steps-to-target moe/stock")
    for runners, envs in LAYOUTS:
        s, m = [r for r in rows if r["layout"] == f"{runners}x{envs}"]
        eff = (m["steps_to_target"] / s["steps_to_target"]) if m["steps_to_target"] and s["steps_to_target"] else None
        print(f"{runners}x{envs:<4}  {m['steps_per_s'] / s['steps_per_s']:20.2f}  {eff if eff is None else round(eff, 2)!s:>25}")
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

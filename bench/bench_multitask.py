"""MultiTask env: MoE-PPO (task-conditioned router) vs RLlib's stock PPO with a dense MLP of about
equal active parameters. Same env runners, batch sizes and seed, one process, one run.

    .venv/bin/python bench/bench_multitask.py [--iterations 25] [--json OUT]

Reports greedy per-task returns (max = episode_length) and, for the MoE policy, each task's share
of assignments per expert (does routing specialise by task?).
"""
import argparse
import importlib
import json
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.core.columns import Columns  # noqa: E402
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig  # noqa: E402

import moe_rl.envs  # noqa: E402,F401
from moe_rl import MoEPPOConfig  # noqa: E402
from moe_rl.rllib.rl_module import MOE_TOPK  # noqa: E402

NUM_TASKS, EXPERTS = 4, 8
TRAINING = dict(lr=1e-3, gamma=0.0, lambda_=1.0, train_batch_size_per_learner=4096, minibatch_size=512,
                num_epochs=6, vf_loss_coeff=0.5, vf_clip_param=1000.0, entropy_coeff=0.003)


def evaluate(module, episodes=8):
    env = gym.make("moe_rl/MultiTask-v0", num_tasks=NUM_TASKS).unwrapped
    per_task, usage = {}, {}
    for task in range(NUM_TASKS):
        total, routes = [], []
        for ep in range(episodes):
            obs, _ = env.reset(seed=1000 + ep, options={"task_id": task})
            done, ret = False, 0.0
            while not done:
                with torch.no_grad():
                    out = module.forward_inference({Columns.OBS: torch.as_tensor(obs)[None]})
                if MOE_TOPK in out:
                    routes.append(out[MOE_TOPK][0].long())
                obs, r, term, trunc, _ = env.step(int(out[Columns.ACTION_DIST_INPUTS][0].argmax()))
                ret += r
                done = term or trunc
            total.append(ret)
        per_task[task] = float(np.mean(total))
        if routes:
            counts = torch.bincount(torch.stack(routes)[:, 0].reshape(-1), minlength=EXPERTS).double()
            usage[task] = (counts / counts.sum()).round(decimals=2).tolist()  # layer 0
    return per_task, usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args()
    from moe_rl.app.train import start_local_ray
    start_local_ray()
    # Stock PPO's EnvRunners never import moe_rl: register the env with Ray's registry, which
    # ships the creator to them (MoEPPOConfig registers the moe_rl/ ids itself).
    from ray.tune.registry import register_env
    register_env("moe_rl/MultiTask-v0", lambda c: importlib.import_module("moe_rl.envs").MultiTaskEnv(**c))
    rows = []
    for name in ("stock_ppo", "moe_ppo"):
        if name == "moe_ppo":
            cfg = MoEPPOConfig().moe(num_experts=EXPERTS, top_k=2, num_layers=2, d_model=64, d_ff=64, router="task",
                                     router_kwargs={"num_tasks": NUM_TASKS}, task_slice=[8, NUM_TASKS])
        else:
            cfg = PPOConfig().rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[184, 184],
                                                                        fcnet_activation="tanh"))
        cfg = (cfg.environment("moe_rl/MultiTask-v0", env_config={"num_tasks": NUM_TASKS}).training(**TRAINING)
               .env_runners(num_env_runners=1, num_envs_per_env_runner=8).debugging(seed=0))
        algo = cfg.build_algo()
        curve = [algo.train()["env_runners"]["episode_return_mean"] for _ in range(args.iterations)]
        per_task, usage = evaluate(algo.learner_group._learner.module["default_policy"])
        algo.stop()
        rows.append({"algo": name, "train_return_curve": curve, "eval_return_per_task": per_task,
                     "expert_usage_layer0_per_task": usage})
        print(f"{name:>9}: final train return {curve[-1]:.2f}/32, greedy eval per task {per_task}", flush=True)
        for task, u in usage.items():
            print(f"           task {task} expert shares (layer 0, both top-2 assignments): {u}")
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

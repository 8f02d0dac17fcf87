"""One learner minibatch step of the quickstart MoE policy vs RLlib's stock PPO module of equal
active parameters (2x184 tanh), forward + backward, same process, same run, interleaved.

    .venv/bin/python bench/bench_train_step.py [--threads 1,2] [--tokens 256] [--json OUT]

The step is what the learner repeats per minibatch, without RLlib's loop around it: the policy's
forward_train, the value function, a loss over both (plus the MoE router losses) and backward.
Blocks of the two alternate, so a slower spell of the machine hits both; reported are the minimum
and the median over blocks (ms per step) and their ratio. Forward-only (no autograd) too.
"""
import argparse
import json
import statistics
import time

import gymnasium as gym
import torch
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

from moe_rl.core.losses import moe_aux_losses
from moe_rl.rllib.rl_module import MOE_ROUTING, MoEPolicyModule

QUICKSTART = dict(num_experts=8, top_k=2, num_layers=2, d_model=64, d_ff=64)
EQUAL_ACTIVE = DefaultModelConfig(fcnet_hiddens=[184, 184], fcnet_activation="tanh")


def modules():
    env = gym.make("CartPole-v1")
    moe = MoEPolicyModule(observation_space=env.observation_space, action_space=env.action_space,
                          model_config={"moe": QUICKSTART})
    spec = PPOConfig().rl_module(model_config=EQUAL_ACTIVE).get_default_rl_module_spec()
    spec.observation_space, spec.action_space, spec.model_config = env.observation_space, env.action_space, EQUAL_ACTIVE
    return {"moe": moe, "stock": spec.build()}


def train_step(module, obs):
    out = module.forward_train({Columns.OBS: obs})
    loss = out[Columns.ACTION_DIST_INPUTS].logsumexp(-1).mean() + module.compute_values({Columns.OBS: obs}).mean()
    if MOE_ROUTING in out:
        loss = loss + moe_aux_losses(out[MOE_ROUTING], 0.01, 0.001)[0]
    loss.backward()


def forward_only(module, obs):
    with torch.no_grad():
        module.forward_train({Columns.OBS: obs})
        module.compute_values({Columns.OBS: obs})


def interleaved(fns, blocks=40, per_block=15):
    times = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            for _ in range(3):
                fn()
            t0 = time.perf_counter()
            for _ in range(per_block):
                fn()
            times[name].append((time.perf_counter() - t0) / per_block * 1e3)
    return {name: {"min_ms": min(v), "median_ms": statistics.median(v)} for name, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    mods = modules()
    obs = torch.randn(args.tokens, 4)
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for kind, step in (("fwd+bwd", train_step), ("fwd", forward_only)):
            r = interleaved({name: (lambda m=m: step(m, obs)) for name, m in mods.items()})
            row = {"threads": threads, "step": kind, "tokens": args.tokens, **{f"{n}_{k}": v for n, d in r.items()
                                                                                for k, v in d.items()}}
            row["ratio_min"] = row["moe_min_ms"] / row["stock_min_ms"]
            row["ratio_median"] = row["moe_median_ms"] / row["stock_median_ms"]
            rows.append(row)
            print(f"threads {threads}  {kind:8}  moe {row['moe_min_ms']:.3f} / {row['moe_median_ms']:.3f} ms  "
                  f"stock {row['stock_min_ms']:.3f} / {row['stock_median_ms']:.3f} ms (min / median)  "
                  f"moe/stock {row['ratio_min']:.2f} / {row['ratio_median']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

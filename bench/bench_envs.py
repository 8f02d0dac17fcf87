"""Single-threaded env.step throughput of the moe_rl environments under uniform random actions.

    .venv/bin/python bench/bench_envs.py [--steps N] [--json OUT]

Actions are drawn up front so the figure is the env's cost, resets included. The
"gymnasium.make" row adds the wrappers make() applies (order enforcing, passive env checker),
which is what rollout workers step.
"""
import argparse
import json
import platform
import time

import gymnasium as gym
import numpy as np

from moe_rl.envs import MultiTaskEnv, TokenSequenceEnv


def steps_per_second(env, steps, seed=0):
    actions = np.random.default_rng(seed).integers(env.action_space.n, size=steps).tolist()
    env.reset(seed=seed)
    start = time.perf_counter()
    for action in actions:
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()
    return steps / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200_000, help="steps per case")
    parser.add_argument("--json", metavar="OUT", help="also write the results to this file")
    args = parser.parse_args()

    cases = [
        ("MultiTask", "defaults (4 tasks, obs 8+4, 4 actions, 32 steps)", MultiTaskEnv()),
        ("MultiTask", "defaults, via gymnasium.make", gym.make("moe_rl/MultiTask-v0")),
        ("TokenSequence", "seq_len=16 (max_len 32), copy", TokenSequenceEnv(seq_len=16)),
        ("TokenSequence", "seq_len=256 (max_len 512), copy", TokenSequenceEnv(seq_len=256)),
    ]
    results = []
    print(f"{'env':<14} {'config':<50} {'steps':>8} {'steps/s':>11}")
    for name, config, env in cases:
        rate = steps_per_second(env, args.steps)
        results.append({"env": name, "config": config, "steps": args.steps, "steps_per_s": rate})
        print(f"{name:<14} {config:<50} {args.steps:>8} {rate:>11,.0f}")

    if args.json:
        meta = {"python": platform.python_version(), "numpy": np.__version__,
                "gymnasium": gym.__version__, "machine": platform.processor() or platform.machine()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

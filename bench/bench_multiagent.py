"""Multi-agent MoE-PPO vs RLlib's stock multi-agent PPO, same env, policies, layout and PPO settings.

    .venv/bin/python bench/bench_multiagent.py [--iterations 8] [--seed 0] [--json OUT]

The MoE run is configs/multiagent.yaml as a user runs it (two MoE policies, p1 with 4 experts,
consistency checks on); `moe_no_check` is the same with the consistency checks off; the stock
runs are RLlib's PPO with the same two policies and mapping, its default 256x256 model and a
2x184 model of about the MoE policy's active parameters. Reported: env steps/s over the
iterations after the first (the first builds and warms up), and the last mean return.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig  # noqa: E402
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole  # noqa: E402

from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE_HIDDEN = 184   # as bench_ppo.py: about the MoE policy's active parameters


def raw_config(seed: int, check: bool):
    return apply_overrides(load_run_config(os.path.join(HERE, "configs/multiagent.yaml")),
                           [f"seed={seed}", "stop_return=null", f"consistency.enabled={str(check).lower()}"])


def stock_config(seed: int, hidden, raw):
    """RLlib PPO with the run config's env, layout, PPO settings and policy mapping."""
    cfg = PPOConfig() if hidden is None else PPOConfig().rl_module(
        model_config=DefaultModelConfig(fcnet_hiddens=[hidden, hidden], fcnet_activation="tanh"))
    mapping = {int(k): v for k, v in raw["multi_agent"]["mapping"].items()}
    return (cfg.environment(MultiAgentCartPole, env_config=raw["env_config"])
            .multi_agent(policies=set(raw["multi_agent"]["policies"]),
                         policy_mapping_fn=lambda agent_id, episode, **kw: mapping[agent_id])
            .training(**raw["training"]).env_runners(**raw["env_runners"]).debugging(seed=seed))


def run(config, iterations: int):
    algo = config.build_algo()
    try:
        r = algo.train()
        t0, s0 = time.perf_counter(), r["env_runners"]["num_env_steps_sampled_lifetime"]
        for _ in range(iterations - 1):
            r = algo.train()
        wall = time.perf_counter() - t0
        steps = r["env_runners"]["num_env_steps_sampled_lifetime"] - s0
    finally:
        algo.stop()
    return {"steps_per_s": steps / wall, "return_last": r["env_runners"].get("episode_return_mean")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    from moe_rl.app.train import start_local_ray
    start_local_ray()
    raw = raw_config(args.seed, check=True)
    arms = {"moe": lambda: validate_run_config(raw_config(args.seed, check=True)),
            "moe_no_check": lambda: validate_run_config(raw_config(args.seed, check=False)),
            "stock_default": lambda: stock_config(args.seed, None, raw),
            "stock_equal_active": lambda: stock_config(args.seed, DENSE_HIDDEN, raw)}
    rows = []
    for name, make in arms.items():
        rows.append({"arm": name, **run(make(), args.iterations)})
        print(f"{name:>18}  {rows[-1]['steps_per_s']:7.0f} env steps/s  "
              f"return {rows[-1]['return_last']:.1f}", flush=True)
    by = {r["arm"]: r["steps_per_s"] for r in rows}
    print(f"\nmoe/stock_default {by['moe'] / by['stock_default']:.2f}  "
          f"moe/stock_equal_active {by['moe'] / by['stock_equal_active']:.2f}  "
          f"moe_no_check/stock_default {by['moe_no_check'] / by['stock_default']:.2f}")
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""The rollout copy's forward, eager against compiled (moe.rollout_compile), one process, one thread.

    .venv/bin/python bench/bench_rollout_compile.py [--calls 2000] [--json OUT]

For each shipped config's model (the quickstart, the token task, MiniGrid MT3) at the rollout's own
batch (num_envs_per_env_runner observations): the compile's cost (the first call), microseconds per
exploring forward after it (median of 5 blocks), and how far the compiled copy is from the eager one
on 4 096 observations at the same weights: max |logit difference|, K3 of the sampled actions'
log-probs and the routing agreement. End to end, in a training run, the consistency ledger is the
judge (BENCHMARKS.md, "time to target").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import gymnasium as gym
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import moe_rl.envs  # noqa: E402,F401  (registers the moe_rl/ env ids)
from moe_rl.app.run_config import load_run_config  # noqa: E402
from moe_rl.core.drift import drift_metrics, routing_agreement  # noqa: E402
from moe_rl.core.settings import MOE_DEFAULTS  # noqa: E402

CONFIGS = ("cartpole", "tokens", "minigrid_mt3")


def build(cfg: dict, compiled: bool):
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from moe_rl.rllib.rl_module import MoEPolicyModule
    env = gym.make(cfg["env"], **cfg.get("env_config", {}))
    moe = {**MOE_DEFAULTS, **cfg.get("moe", {}), "rollout_compile": compiled}
    module = RLModuleSpec(module_class=MoEPolicyModule, observation_space=env.observation_space,
                          action_space=env.action_space, inference_only=True, model_config={"moe": moe}).build()
    return module, env


def observations(env, n: int, seed: int):
    env.observation_space.seed(seed)
    samples = [env.observation_space.sample() for _ in range(n)]
    if isinstance(samples[0], dict):
        return {k: torch.as_tensor(np.stack([s[k] for s in samples])) for k in samples[0]}
    return torch.as_tensor(np.stack(samples))


def measure(name: str, calls: int) -> dict:
    from ray.rllib.core.columns import Columns

    from moe_rl.rllib.rl_module import MOE_TOPK
    cfg = load_run_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                       "configs", f"{name}.yaml"))
    rows = (cfg.get("env_runners") or {}).get("num_envs_per_env_runner", 8)
    eager, env = build(cfg, False)
    compiled, _ = build(cfg, True)
    compiled.set_state(eager.get_state())
    obs = observations(env, rows, 0)
    out = {"config": name, "rows": rows}
    for label, module in (("eager", eager), ("compiled", compiled)):
        with torch.no_grad():
            t0 = time.perf_counter()
            module.forward_exploration({Columns.OBS: obs})
            out[f"{label}_first_call_s"] = time.perf_counter() - t0
            blocks = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls // 5):
                    module.forward_exploration({Columns.OBS: obs})
                blocks.append((time.perf_counter() - t0) / (calls // 5) * 1e6)
        out[f"{label}_us_per_call"] = statistics.median(blocks)
    # Agreement on many observations, in rollout-sized calls (the shape the compiled graph serves).
    big = observations(env, 4096 // rows * rows, 1)
    logits, topk = {}, {}
    for label, module in (("eager", eager), ("compiled", compiled)):
        parts = []
        with torch.no_grad():
            for i in range(0, 4096 // rows * rows, rows):
                chunk = {k: v[i:i + rows] for k, v in big.items()} if isinstance(big, dict) else big[i:i + rows]
                parts.append(module.forward_exploration({Columns.OBS: chunk}))
        logits[label] = torch.cat([p[Columns.ACTION_DIST_INPUTS] for p in parts]).double()
        topk[label] = torch.cat([p[MOE_TOPK] for p in parts]).long()
    dist = torch.distributions.Categorical(logits=logits["eager"])
    actions = dist.sample()
    lp = {k: torch.log_softmax(v, -1).gather(1, actions[:, None]).squeeze(1) for k, v in logits.items()}
    per_layer = {k: [v[:, i] for i in range(v.shape[1])] for k, v in topk.items()}
    out.update(max_abs_logit_diff=float((logits["eager"] - logits["compiled"]).abs().max()),
               k3=drift_metrics(lp["compiled"], lp["eager"])["k3"],
               routing_agreement=routing_agreement(per_layer["eager"], per_layer["compiled"])["routing_agreement"],
               speedup=out["eager_us_per_call"] / out["compiled_us_per_call"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)   # as on a rollout actor
    results = [measure(name, args.calls) for name in args.configs.split(",")]
    for r in results:
        print(f"{r['config']:>14} ({r['rows']} rows): eager {r['eager_us_per_call']:.0f} us, compiled "
              f"{r['compiled_us_per_call']:.0f} us ({r['speedup']:.2f}x) after a {r['compiled_first_call_s']:.1f} s "
              f"first call; max |dlogit| {r['max_abs_logit_diff']:.1e}, K3 {r['k3']:.1e}, "
              f"routing agreement {r['routing_agreement']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

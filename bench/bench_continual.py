"""Continual multi-task MiniGrid, pre-registered twice in BENCHMARKS.md: "Does MoE-PPO keep learning
when tasks come one after another?" (sparse MoE, tanh units) and "Does a Soft MoE keep continual PPO
plastic?" (Soft MoE over tokens against dense, ReLU units). The hypotheses and the analyses are
fixed there.

    .venv/bin/python bench/bench_continual.py --arms dense,moe_task,moe_topk --seeds 0-2   # resumable
    .venv/bin/python bench/bench_continual.py --report                                     # the tables
    .venv/bin/python bench/bench_continual.py --arms dense_relu,soft_relu_flat --seeds 0-2 \
        --results bench/results/continual_soft                                             # the second

MT5's tasks in sequence (env_config schedule: sequential), 100 k env steps a task, 3 cycles; after
every segment each task is evaluated (8 episodes, sampled actions); after every iteration the
policy trunk's tau-dormant fraction on a fixed probe set. One JSON per (arm, seed) under --results;
a run that is there is not run again.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_minigrid import _write_json, build_config, missing_runs  # noqa: E402

ARMS = ("dense", "moe_task", "moe_topk", "dense_relu", "soft_relu", "soft_relu_flat")
# The second registration's arms: MoE-PPO's own loop for both, ReLU units, equal mixture parameters
# (a dense layer of width 4 x 64 against 4 experts of width 64), the Soft MoE over the CNN's 16
# position tokens (moe.tokens auto) mean-pooled after it (moe.token_pool's default when this was
# registered; now flatten), the dense layer over the flattened feature map.
ARM_OVERRIDES = {
    "dense_relu": ["moe.mixture=dense", "moe.router=topk", "moe.router_kwargs={}", "moe.task_slice=null",
                   "moe.top_k=4", "moe.activation=relu"],
    "soft_relu": ["moe.mixture=soft", "moe.router=topk", "moe.router_kwargs={}", "moe.task_slice=null",
                  "moe.num_experts=4", "moe.top_k=1", "moe.activation=relu", "moe.token_pool=mean"],
}
# S2's amendment (BENCHMARKS.md, registered before any S2 run): soft_relu with the tokens
# flattened after the mixture, so the heads can tell where a feature is (mean-pooled, they cannot).
ARM_OVERRIDES["soft_relu_flat"] = [o for o in ARM_OVERRIDES["soft_relu"] if not o.startswith("moe.token_pool=")] + [
    "moe.token_pool=flatten"]
# baseline -> its challengers
COMPARED = {"dense": ("moe_task", "moe_topk"), "dense_relu": ("soft_relu", "soft_relu_flat")}
SUITE, TASKS = "MT5", ("DoorKey-6x6", "LavaGapS7", "RedBlueDoors-6x6", "DistShift1", "MemoryS11")
RESULTS = os.path.join(HERE, "results", "continual")
EVAL_EPISODES, PROBE_PER_TASK, TAU = 8, 200, 0.025
T_95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31}


def schedule(steps_per_task: int, cycles: int, copies=None) -> dict:
    out = {"tasks": list(TASKS), "schedule": "sequential", "steps_per_task": steps_per_task, "cycles": cycles}
    return {**out, "copies": copies} if copies else out


def probe_set(seed: int = 0):
    """PROBE_PER_TASK observations of every task from random play: the same for every arm and run."""
    import numpy as np
    import torch

    from moe_rl.envs.minigrid_mt import MultiTaskMiniGrid
    env = MultiTaskMiniGrid(list(TASKS))
    env.action_space.seed(seed)
    obs_list = []
    for task in range(len(TASKS)):
        obs, _ = env.reset(seed=seed + task, options={"task_id": task})
        for _ in range(PROBE_PER_TASK):
            obs_list.append(obs)
            obs, _, term, trunc, _ = env.step(env.action_space.sample())
            if term or trunc:
                obs, _ = env.reset(options={"task_id": task})
    return {k: torch.as_tensor(np.stack([o[k] for o in obs_list])) for k in obs_list[0]}


def evaluate_sampled(module, seed: int) -> dict:
    """Each task's mean return over EVAL_EPISODES episodes with sampled actions."""
    import gymnasium as gym
    import torch

    from moe_rl.app.evaluate import play_episode
    env = gym.make("moe_rl/MiniGrid-MT-v0", tasks=list(TASKS))
    out = {}
    for task, name in enumerate(TASKS):
        generator = torch.Generator().manual_seed(seed + task)
        out[name] = statistics.fmean(play_episode(module, env, seed + ep, {"task_id": task}, generator)[0]
                                     for ep in range(EVAL_EPISODES))
    env.close()
    return out


def run_one(arm: str, seed: int, out: str, steps_per_task: int, cycles: int) -> None:
    import ray
    import torch
    from ray.rllib.core.columns import Columns

    from moe_rl.algo.results import metrics_row
    from moe_rl.app.train import start_local_ray
    from moe_rl.core.plasticity import trunk_dormancy

    torch.set_num_threads(1)
    start = time.time()
    overrides = [f"env_config={json.dumps(schedule(steps_per_task, cycles))}", *ARM_OVERRIDES.get(arm, [])]
    cfg, config = build_config(arm, SUITE, seed, overrides=overrides)
    if arm == "dense":   # stock PPO's env is the registered creator: the schedule and its copies by hand
        copies = max(1, config.num_env_runners) * config.num_envs_per_env_runner
        config.environment("minigrid_mt", env_config=schedule(steps_per_task, cycles, copies))
    probe = probe_set()
    segments, total = len(TASKS) * cycles, len(TASKS) * cycles * steps_per_task
    start_local_ray(num_cpus=3)
    try:
        algo = config.build_algo()
        curve, evaluations = [], []
        while not curve or curve[-1]["env_steps"] < total:
            row = metrics_row(algo.train())
            module = algo.get_module().eval()
            dormancy = trunk_dormancy(module, lambda: module.forward_inference({Columns.OBS: probe}), TAU)
            module.train()
            curve.append({"time_s": time.time() - start, "env_steps": row["env_steps_total"],
                          "dormant": dormancy.get("dormant", math.nan),
                          **{f"dormant/{k}": v for k, v in dormancy.items() if k != "dormant"},
                          **{k: v for k, v in row.items() if k.startswith("task/") and "/experts/" not in k}})
            while len(evaluations) < segments and curve[-1]["env_steps"] >= (len(evaluations) + 1) * steps_per_task:
                evaluations.append({"segment": len(evaluations) + 1, "env_steps": curve[-1]["env_steps"],
                                    "returns": evaluate_sampled(algo.get_module().eval(), 10_000 + seed)})
                algo.get_module().train()
            _write_json(out + ".partial", {"arm": arm, "seed": seed, "curve": curve, "evaluations": evaluations})
            print(f"{arm} seed {seed}: steps {curve[-1]['env_steps']} dormant {curve[-1]['dormant']:.3f} "
                  f"segments evaluated {len(evaluations)} {curve[-1]['time_s']:.0f}s", flush=True)
        algo.stop()
    finally:
        ray.shutdown()
    _write_json(out, {"arm": arm, "seed": seed, "suite": SUITE, "tasks": list(TASKS), "steps_per_task": steps_per_task,
                      "cycles": cycles, "tau": TAU, "train_s": time.time() - start, "curve": curve,
                      "evaluations": evaluations, "command": " ".join(sys.argv)})
    if os.path.exists(out + ".partial"):
        os.unlink(out + ".partial")


# --- the pre-registered analysis -------------------------------------------------------------------
def mean_ci(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    if len(values) == 1:
        return values[0], math.nan
    return statistics.fmean(values), T_95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def welch_ci(a, b):
    """(mean(a) - mean(b), its 95 % half-width), Welch's degrees of freedom."""
    if len(a) < 2 or len(b) < 2:
        return statistics.fmean(a) - statistics.fmean(b), math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb > 0 else 1
    # The t quantile at the exact (fractional) degrees of freedom: rounding them (2.09 -> 2) widened
    # the first registration's CI from [-0.367, +0.822] to [-0.392, +0.846].
    from scipy import stats  # scipy comes with minatar
    return statistics.fmean(a) - statistics.fmean(b), float(stats.t.ppf(0.975, dof)) * math.sqrt(va + vb)


def figures(run: dict) -> dict:
    """One run's pre-registered figures: A_c, forgetting per cycle, re-learning steps, cycle-3 dormant."""
    n, cycles, steps = len(run["tasks"]), run["cycles"], run["steps_per_task"]
    E = {e["segment"]: e["returns"] for e in run["evaluations"]}
    seg = lambda t, c: c * n + t + 1   # t, c from 0
    out = {}
    for c in range(cycles):
        if seg(n - 1, c) not in E:
            break
        own = [E[seg(t, c)][run["tasks"][t]] for t in range(n)]
        out[f"A{c + 1}"] = statistics.fmean(own)
        out[f"forgetting{c + 1}"] = statistics.fmean(own[t] - E[seg(n - 1, c)][run["tasks"][t]] for t in range(n))
    curve = run["curve"]
    for c in range(1, cycles):
        waits = []
        for t, name in enumerate(run["tasks"]):
            key = f"task/{name}/return"
            hi1 = seg(t, 0) * steps
            level = [r[key] for r in curve if hi1 - 10_000 <= r["env_steps"] <= hi1 and key in r]
            lo, hi = (seg(t, c) - 1) * steps, seg(t, c) * steps
            rows = [r for r in curve if lo < r["env_steps"] <= hi and key in r]
            if not level or not rows:
                continue
            target, waited = statistics.fmean(level), float(steps)
            for i in range(len(rows)):
                window = [r[key] for r in rows[max(0, i - 2): i + 1]]
                if statistics.fmean(window) >= target:
                    waited = rows[i]["env_steps"] - lo
                    break
            waits.append(waited)
        if waits:
            out[f"relearn{c + 1}"] = statistics.fmean(waits)
    last = [r["dormant"] for r in curve if r["env_steps"] > (cycles - 1) * n * steps]
    out["dormant_c3"] = statistics.fmean(last) if last else math.nan
    by_cycle = [[r["dormant"] for r in curve if c * n * steps < r["env_steps"] <= (c + 1) * n * steps]
                for c in range(cycles)]
    out["dormant_by_cycle"] = [statistics.fmean(x) if x else math.nan for x in by_cycle]
    return out


def report(results: str) -> str:
    runs = {}
    for name in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        if name.endswith(".json"):
            with open(os.path.join(results, name)) as f:
                run = json.load(f)
            runs.setdefault(run["arm"], []).append(figures(run))
    if not runs:
        return f"no finished runs under {results}"
    keys = ["A1", "A2", "A3", "forgetting1", "forgetting3", "relearn2", "relearn3", "dormant_c3"]
    lines = ["| arm | seeds | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for arm, figs in runs.items():
        cells = []
        for k in keys:
            m, h = mean_ci([f.get(k, math.nan) for f in figs])
            cells.append(f"{m:.3f} ± {h:.3f}" if not math.isnan(h) else f"{m:.3f}")
        lines.append(f"| {arm} | {len(figs)} | " + " | ".join(cells) + " |")
    for base, challengers in COMPARED.items():
        for arm in (a for a in challengers if a in runs and base in runs):
            for k in ("A3", "dormant_c3"):
                a, b = [f[k] for f in runs[arm] if k in f], [f[k] for f in runs[base] if k in f]
                if not a or not b:
                    continue
                d, h = welch_ci(a, b)
                lines.append(f"\n{arm} - {base}, {k}: {d:+.3f} (95 % CI half-width {h:.3f})")
    lines.append("\ndormant fraction by cycle (mean over seeds): " + "; ".join(
        f"{arm} " + ", ".join(f"{statistics.fmean(x):.3f}" for x in zip(*(f['dormant_by_cycle'] for f in figs)))
        for arm, figs in runs.items()))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="0-2")
    p.add_argument("--steps-per-task", type=int, default=100_000)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    if args.report:
        print(report(args.results))
        return
    os.makedirs(args.results, exist_ok=True)
    for arm, seed, out in missing_runs(args.seeds, args.arms, ARMS,
                                       lambda a, s: os.path.join(args.results, f"{a}-seed{s}.json")):
        run_one(arm, seed, out, args.steps_per_task, args.cycles)


if __name__ == "__main__":
    main()

"""MoE-APPO vs RLlib's stock APPO, the same encoder and equal active parameters, in one run.

    .venv/bin/python bench/bench_appo.py --suite cartpole --seeds 0-1            # resumable
    .venv/bin/python bench/bench_appo.py --suite mt3 --seeds 0-1 --budget 300000
    .venv/bin/python bench/bench_appo.py --report

Arms (each from the suite's config, configs/appo_cartpole.yaml or appo_minigrid_mt3.yaml):
  moe_appo          MoEAPPO with the consistency check before every update (consistency.every 1)
  moe_appo_every10  the same, checked before every 10th update (the configs' setting)
  moe_appo_nocheck  the same with consistency.enabled false: what the check costs
  stock_appo        stock RLlib APPO (APPOConfig, its own learner and training_step) with
                    DenseAPPOPeerModule: the MoE policy's encoder and blocks, each MoE layer a dense
                    one of the same active width (moe_rl.rllib.dense_peer)
Every run trains until --budget env steps. Per run: env steps/s over the whole run (training
included; building the algorithm not), the wall seconds and env steps at which the mean
training return first reached --target, the final return, and the env steps trained per env step
sampled (on 2 cores the rollout actors and the learner share the CPU: an arm whose learner trains
less samples faster, so read throughput beside it). One JSON per (suite, arm, seed)
under bench/results/appo/; the arms of a seed run one after another, seeds in turn.
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
from bench_minigrid import _write_json, missing_runs  # noqa: E402

ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "appo")
# (config, target return for the time to target, env-step budget): targets both arms reach within
# the budget on this machine (CartPole's 450 takes RLlib's tuned APPO up to 2 M steps).
SUITES = {"cartpole": ("appo_cartpole.yaml", 150.0, 200_000), "mt3": ("appo_minigrid_mt3.yaml", 0.5, 600_000)}
ARMS = ("moe_appo", "moe_appo_every10", "moe_appo_nocheck", "stock_appo")


def build(arm: str, suite: str, seed: int):
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.tune.registry import register_env

    from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config
    from moe_rl.envs.minigrid_mt import MultiTaskMiniGrid
    from moe_rl.rllib.dense_peer import DenseAPPOPeerModule
    from moe_rl.rllib.task_metrics import TaskEpisodeMetrics

    cfg = apply_overrides(load_run_config(os.path.join(ROOT, "configs", SUITES[suite][0])), [f"seed={seed}"])
    if arm != "stock_appo":
        every = {"moe_appo": 1, "moe_appo_every10": 10}.get(arm)
        cfg["consistency"] = {**(cfg.get("consistency") or {}), **(
            {"every": every} if every else {"enabled": False})}
        return validate_run_config(cfg)
    env, env_config = cfg["env"], cfg.get("env_config") or {}
    if env.startswith("moe_rl/MiniGrid"):   # stock env runners never import moe_rl: a registered creator
        import gymnasium as gym
        register_env("minigrid_mt", lambda c: MultiTaskMiniGrid(**c))
        env, env_config = "minigrid_mt", {"tasks": gym.spec(cfg["env"]).kwargs["tasks"]}
    return (APPOConfig().environment(env, env_config=env_config)
            .env_runners(**cfg["env_runners"]).learners(**cfg["learners"]).training(**cfg["training"])
            .rl_module(rl_module_spec=RLModuleSpec(module_class=DenseAPPOPeerModule, model_config={"moe": cfg["moe"]}))
            .callbacks(TaskEpisodeMetrics).debugging(seed=seed))


def run_one(arm: str, suite: str, seed: int, out: str, budget: int, target: float) -> None:
    import ray

    from moe_rl.app.train import start_local_ray
    config = build(arm, suite, seed)
    start_local_ray(num_cpus=max(os.cpu_count() or 1, config.num_env_runners + 1))
    try:
        algo = config.build_algo()
        start, curve, steps = time.time(), [], 0
        while steps < budget:
            r = algo.train()
            steps = r["env_runners"]["num_env_steps_sampled_lifetime"]
            curve.append({"time_s": time.time() - start, "env_steps": steps,
                          "return": r["env_runners"].get("episode_return_mean"),
                          "trained_steps": r["learners"]["__all_modules__"].get("num_env_steps_trained_lifetime")})
            print(f"{suite} {arm} seed {seed}: {steps} steps, return {curve[-1]['return']}, "
                  f"{curve[-1]['time_s']:.0f}s", flush=True)
        algo.stop()
    finally:
        ray.shutdown()
    hit = next((c for c in curve if c["return"] is not None and c["return"] >= target), None)
    _write_json(out, {"suite": suite, "arm": arm, "seed": seed, "budget": budget, "target": target,
                      "steps_per_s": curve[-1]["env_steps"] / curve[-1]["time_s"],
                      "time_to_target_s": hit and hit["time_s"], "steps_to_target": hit and hit["env_steps"],
                      "final_return": curve[-1]["return"], "curve": curve, "command": " ".join(sys.argv)})


def _trained_per_sampled(by_seed: dict) -> str:
    """The median over seeds of the env steps trained per step sampled, from each run's last
    point (runs made before the curve recorded trained_steps have none)."""
    values = [c["trained_steps"] / c["env_steps"] for c in (r["curve"][-1] for r in by_seed.values())
              if c.get("trained_steps")]
    return f"{statistics.median(values):.2f}" if values else "-"


def report(results: str) -> str:
    runs = {}
    for name in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        if name.endswith(".json"):
            with open(os.path.join(results, name)) as f:
                r = json.load(f)
            runs.setdefault((r["suite"], r["arm"]), {})[r["seed"]] = r
    lines = ["| suite | arm | seeds | env steps/s (median) | vs stock APPO (median of per-seed ratios) | "
             "time to target s (median; reached) | final return (median) | trained per sampled step (median) |",
             "|---" * 8 + "|"]
    for (suite, arm), by_seed in sorted(runs.items()):
        stock = runs.get((suite, "stock_appo"), {})
        ratios = [r["steps_per_s"] / stock[s]["steps_per_s"] for s, r in by_seed.items() if s in stock] or [math.nan]
        hits = [r["time_to_target_s"] for r in by_seed.values() if r["time_to_target_s"] is not None]
        speed = statistics.median(r["steps_per_s"] for r in by_seed.values())
        lines.append(f"| {suite} | {arm} | {len(by_seed)} | {speed:.0f} | {statistics.median(ratios):.2f} | "
                     f"{(f'{statistics.median(hits):.0f}' if hits else '-')} ({len(hits)}/{len(by_seed)}) | "
                     f"{statistics.median(r['final_return'] for r in by_seed.values()):.3g} | "
                     f"{_trained_per_sampled(by_seed)} |")
    for suite in sorted({s for s, _ in runs}):
        on, off = runs.get((suite, "moe_appo"), {}), runs.get((suite, "moe_appo_nocheck"), {})
        every10 = runs.get((suite, "moe_appo_every10"), {})
        for name, arm in (("every update", on), ("every 10th update", every10)):
            costs = [1 - arm[s]["steps_per_s"] / off[s]["steps_per_s"] for s in arm if s in off]
            if costs:
                lines.append(f"\n{suite}: the check before {name} costs {100 * statistics.median(costs):.1f} % of "
                             f"MoE-APPO's env steps/s (median over {len(costs)} seeds; per seed "
                             + ", ".join(f"{100 * c:.1f}" for c in costs) + ")")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=tuple(SUITES), default="cartpole")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="0-2")
    p.add_argument("--budget", type=int)
    p.add_argument("--target", type=float)
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    if args.report:
        print(report(args.results))
        return
    os.makedirs(args.results, exist_ok=True)
    _, target, budget = SUITES[args.suite]
    for arm, seed, out in missing_runs(args.seeds, args.arms, ARMS,
                                       lambda a, s: os.path.join(args.results, f"{args.suite}-{a}-seed{s}.json")):
        run_one(arm, args.suite, seed, out, args.budget or budget, args.target or target)


if __name__ == "__main__":
    main()

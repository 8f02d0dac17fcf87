"""MoE-APPO against the APPO a user would run, by BENCHMARKS.md's fair-peer rule, in one run.

    .venv/bin/python bench/bench_appo.py --seeds 0-4            # resumable; seeds in turn, arms interleaved
    .venv/bin/python bench/bench_appo.py --report

Arms (CartPole-v1, the same rollout actors and learners for all: configs/appo_cartpole.yaml's 2
env runners x 4 envs, the learner in the driver):
  stock_appo   RLlib's own tuned CartPole APPO (rllib/examples/algorithms/appo/cartpole_appo.py on
               Ray's master): APPOConfig with circular_buffer_iterations_per_batch 2, vf_loss_coeff
               0.05, entropy_coeff 0.0, lambda_ 0.95, DefaultModelConfig(vf_share_layers=True) (its
               256x256 model, value layers shared); everything else APPO's defaults
  moe_appo     MoE-APPO, configs/appo_cartpole.yaml as it is (8 experts, top-2, bias router, the
               check before every 10th update)
  dense_appo   the same MoE-APPO loop and config with each MoE layer a dense one of the same active
               width (moe.mixture dense, router topk): what the loop does without the mixture
The metric, fixed before the runs: the mean training return over the 20 k..200 k env-step grid
(the curve's value at each 20 k mark, the last point at or before it), and the env steps and wall
seconds at which the return first reached 150; env steps/s over the whole run (training included);
env steps trained per step sampled. One JSON per (arm, seed) under bench/results/appo_fair/.
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
RESULTS = os.path.join(HERE, "results", "appo_fair")
ARMS = ("stock_appo", "moe_appo", "dense_appo")
BUDGET, TARGET, GRID = 200_000, 150.0, range(20_000, 200_001, 20_000)


def build(arm: str, seed: int):
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config

    cfg = apply_overrides(load_run_config(os.path.join(ROOT, "configs", "appo_cartpole.yaml")), [f"seed={seed}"])
    if arm == "moe_appo":
        return validate_run_config(cfg)
    if arm == "dense_appo":
        return validate_run_config(apply_overrides(cfg, ["moe.mixture=dense", "moe.router=topk"]))
    return (APPOConfig().environment("CartPole-v1")
            .env_runners(**cfg["env_runners"]).learners(**cfg["learners"])
            .training(circular_buffer_iterations_per_batch=2, vf_loss_coeff=0.05, entropy_coeff=0.0, lambda_=0.95)
            .rl_module(model_config=DefaultModelConfig(vf_share_layers=True))
            .debugging(seed=seed))


def run_one(arm: str, seed: int, out: str) -> None:
    import ray

    from moe_rl.app.train import start_local_ray
    config = build(arm, seed)
    start_local_ray(num_cpus=max(os.cpu_count() or 1, config.num_env_runners + 1))
    try:
        algo = config.build_algo()
        start, curve, steps = time.time(), [], 0
        while steps < BUDGET:
            r = algo.train()
            steps = r["env_runners"]["num_env_steps_sampled_lifetime"]
            curve.append({"time_s": time.time() - start, "env_steps": steps,
                          "return": r["env_runners"].get("episode_return_mean"),
                          "trained_steps": r["learners"]["__all_modules__"].get("num_env_steps_trained_lifetime")})
            print(f"{arm} seed {seed}: {steps} steps, return {curve[-1]['return']}, {curve[-1]['time_s']:.0f}s",
                  flush=True)
        algo.stop()
    finally:
        ray.shutdown()
    _write_json(out, {"arm": arm, "seed": seed, "curve": curve, "command": " ".join(sys.argv)})


def figures(run: dict) -> dict:
    """The registered figures of one run, from its curve."""
    curve = [c for c in run["curve"] if c["return"] is not None]
    at = [next((c["return"] for c in reversed(curve) if c["env_steps"] <= mark), math.nan) for mark in GRID]
    hit = next((c for c in curve if c["return"] >= TARGET), None)
    last = run["curve"][-1]
    return {"grid_mean": statistics.fmean(v for v in at if v == v) if any(v == v for v in at) else math.nan,
            "steps_to_target": hit and hit["env_steps"], "time_to_target_s": hit and hit["time_s"],
            "steps_per_s": last["env_steps"] / last["time_s"],
            "trained_per_sampled": (last["trained_steps"] or 0) / last["env_steps"],
            "final": curve[-1]["return"] if curve else math.nan}


def _ci(values):
    """Mean and the 95 % t half-width."""
    t95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
    m = statistics.fmean(values)
    return m, (t95.get(len(values) - 1, 2.0) * statistics.stdev(values) / math.sqrt(len(values))
               if len(values) > 1 else math.nan)


def report(results: str) -> str:
    runs = {}
    for name in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        if name.endswith(".json"):
            with open(os.path.join(results, name)) as f:
                r = json.load(f)
            runs.setdefault(r["arm"], {})[r["seed"]] = figures(r)
    lines = ["| arm | seeds | return over the 20-200 k grid (mean ± 95 % CI) | reached 150 | env steps to 150 "
             "(median) | env steps/s (median) | trained per sampled step | final return (median) |",
             "|---" * 8 + "|"]
    for arm in ARMS:
        by_seed = runs.get(arm)
        if not by_seed:
            continue
        m, h = _ci([f["grid_mean"] for f in by_seed.values()])
        hits = [f["steps_to_target"] for f in by_seed.values() if f["steps_to_target"] is not None]
        lines.append(f"| {arm} | {len(by_seed)} | {m:.1f} ± {h:.1f} | {len(hits)}/{len(by_seed)} | "
                     f"{statistics.median(hits) if hits else '-'} | "
                     f"{statistics.median(f['steps_per_s'] for f in by_seed.values()):.0f} | "
                     f"{statistics.median(f['trained_per_sampled'] for f in by_seed.values()):.2f} | "
                     f"{statistics.median(f['final'] for f in by_seed.values()):.0f} |")
    for a, b in (("moe_appo", "stock_appo"), ("moe_appo", "dense_appo"), ("dense_appo", "stock_appo")):
        seeds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
        if len(seeds) > 1:
            m, h = _ci([runs[a][s]["grid_mean"] - runs[b][s]["grid_mean"] for s in seeds])
            lines.append(f"\n{a} - {b}, grid mean, paired over seeds {seeds}: {m:+.1f} (95 % CI "
                         f"[{m - h:+.1f}, {m + h:+.1f}])")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="0-4")
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    if args.report:
        print(report(args.results))
        return
    os.makedirs(args.results, exist_ok=True)
    for arm, seed, out in missing_runs(args.seeds, args.arms, ARMS,
                                       lambda a, s: os.path.join(args.results, f"cartpole-{a}-seed{s}.json")):
        run_one(arm, seed, out)


if __name__ == "__main__":
    main()

"""Learning curves of an MoE arm against its peers, by BENCHMARKS.md's fair-peer rule: one run per
(arm, seed), arms interleaved within a seed, every figure read off the curve by a metric fixed
before the runs. bench_appo.py and bench_dqn.py are this with their own arms.

A curve point is one `algo.train()`: wall seconds since the algorithm was built, env steps sampled,
the training return, env steps trained, and (moe-rl arms) the iteration's check seconds.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_minigrid import _write_json, missing_runs  # noqa: E402
from bench_minigrid_report import mean_ci  # noqa: E402


@dataclass(frozen=True)
class Metric:
    budget: int                 # env steps per run
    grid: Sequence[int]         # the return is read at each mark (the last point at or before it)
    target: float               # the return whose first crossing gives steps and seconds to target
    pairs: Sequence[Tuple[str, str]]   # (a, b): a - b on the grid mean, paired over seeds


def config_at_seed(config_file: str, seed: int) -> dict:
    """A config of configs/ as a run would read it, at `seed`: what the MoE arm and the dense arm
    start from, and where the stock arm takes its rollout actors and learners."""
    from moe_rl.app.run_config import apply_overrides, load_run_config
    return apply_overrides(load_run_config(os.path.join(ROOT, "configs", config_file)), [f"seed={seed}"])


def through_our_loop(cfg: dict, dense: bool):
    """The MoE arm (the config as it is) or the dense arm: the same loop and config with each MoE
    layer a dense one of the same active width, which separates the mixture's effect from the loop's."""
    from moe_rl.app.run_config import apply_overrides, validate_run_config
    return validate_run_config(apply_overrides(cfg, ["moe.mixture=dense", "moe.router=topk"]) if dense else cfg)


def run_one(build: Callable, arm: str, seed: int, out: str, budget: int) -> None:
    """Trains one arm for `budget` env steps on a local Ray of its own and writes its curve."""
    import ray

    from moe_rl.app.train import start_local_ray
    config = build(arm, seed)
    start_local_ray(num_cpus=max(os.cpu_count() or 1, config.num_env_runners + 1))
    try:
        algo = config.build_algo()
        start, curve, steps = time.time(), [], 0
        while steps < budget:
            r = algo.train()
            if "num_env_steps_sampled_lifetime" not in r.get("env_runners", {}):
                continue   # stock APPO on a busy machine: an iteration in which no sample came back
            steps = r["env_runners"]["num_env_steps_sampled_lifetime"]
            curve.append({"time_s": time.time() - start, "env_steps": steps,
                          "return": r["env_runners"].get("episode_return_mean"),
                          "trained_steps": r.get("learners", {}).get("__all_modules__", {}).get(
                              "num_env_steps_trained_lifetime"),
                          "check_s": r.get("moe_rl", {}).get("check_s", 0.0)})
            print(f"{arm} seed {seed}: {steps} steps, return {curve[-1]['return']}, {curve[-1]['time_s']:.0f}s",
                  flush=True)
            # an interrupted run's curve so far, never counted (a run starts again from the beginning)
            _write_json(out + ".partial", {"arm": arm, "seed": seed, "curve": curve})
        algo.stop()
    finally:
        ray.shutdown()
    _write_json(out, {"arm": arm, "seed": seed, "curve": curve, "command": " ".join(sys.argv)})
    os.unlink(out + ".partial")


def figures(run: dict, metric: Metric) -> dict:
    """The registered figures of one run, from its curve."""
    curve = [c for c in run["curve"] if c["return"] is not None]
    at = [next((c["return"] for c in reversed(curve) if c["env_steps"] <= mark), math.nan) for mark in metric.grid]
    hit = next((c for c in curve if c["return"] >= metric.target), None)
    last = run["curve"][-1]
    return {"grid_mean": statistics.fmean(v for v in at if v == v) if any(v == v for v in at) else math.nan,
            "steps_to_target": hit and hit["env_steps"], "time_to_target_s": hit and hit["time_s"],
            "steps_per_s": last["env_steps"] / last["time_s"],
            "trained_per_sampled": (last["trained_steps"] or 0) / last["env_steps"],
            "check_share": (sum(c["check_s"] for c in run["curve"]) / last["time_s"]
                            if all("check_s" in c for c in run["curve"]) else math.nan),   # not recorded
            "final": curve[-1]["return"] if curve else math.nan}


def report(results: str, arms: Sequence[str], metric: Metric) -> str:
    runs: Dict[str, Dict[int, dict]] = {}
    for name in sorted(os.listdir(results)) if os.path.isdir(results) else []:
        if name.endswith(".json"):
            with open(os.path.join(results, name)) as f:
                r = json.load(f)
            runs.setdefault(r["arm"], {})[r["seed"]] = figures(r, metric)
    lo, hi, t = metric.grid[0] // 1000, metric.grid[-1] // 1000, f"{metric.target:g}"
    lines = [f"| arm | seeds | return over the {lo}-{hi} k grid (mean ± 95 % CI) | reached {t} | env steps to {t} "
             f"(median) | seconds to {t} (median) | env steps/s (median) | trained per sampled step | "
             "check share of wall | final return (median) |", "|---" * 10 + "|"]
    for arm in arms:
        by_seed = runs.get(arm)
        if not by_seed:
            continue
        m, h = mean_ci([f["grid_mean"] for f in by_seed.values()])
        hits = [f for f in by_seed.values() if f["steps_to_target"] is not None]
        def med(key, rows=tuple(by_seed.values())):
            return statistics.median(f[key] for f in rows)
        steps_to = f"{med('steps_to_target', hits):.0f}" if hits else "-"
        time_to = f"{med('time_to_target_s', hits):.0f}" if hits else "-"
        lines.append(f"| {arm} | {len(by_seed)} | {m:.1f} ± {h:.1f} | {len(hits)}/{len(by_seed)} | {steps_to} | "
                     f"{time_to} | {med('steps_per_s'):.0f} | {med('trained_per_sampled'):.2f} | "
                     f"{med('check_share'):.3f} | {med('final'):.0f} |")
    for a, b in metric.pairs:
        seeds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
        if len(seeds) > 1:
            m, h = mean_ci([runs[a][s]["grid_mean"] - runs[b][s]["grid_mean"] for s in seeds])
            lines.append(f"\n{a} - {b}, grid mean, paired over seeds {seeds}: {m:+.1f} (95 % CI "
                         f"[{m - h:+.1f}, {m + h:+.1f}])")
    return "\n".join(lines)


def main(doc: str, arms: Sequence[str], build: Callable, metric: Metric, results: str, file_of: Callable,
         seeds: str = "0-4") -> None:
    import argparse
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--arms", default=",".join(arms))
    p.add_argument("--seeds", default=seeds)
    p.add_argument("--results", default=results)
    p.add_argument("--report", action="store_true")
    args = p.parse_args()
    if args.report:
        print(report(args.results, arms, metric))
        return
    os.makedirs(args.results, exist_ok=True)
    for arm, seed, out in missing_runs(args.seeds, args.arms, arms,
                                       lambda a, s: os.path.join(args.results, file_of(a, s))):
        run_one(build, arm, seed, out, metric.budget)

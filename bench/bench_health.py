"""Health-grade benchmark: false alarms on healthy runs, detection of real and injected faults.

    .venv/bin/python bench/bench_health.py [--groups healthy,off,dead] [--configs cartpole,stable,...]
        [--iterations 30] [--seeds 5] [--first-seed 0] [--off-seeds 10] [--off-first-seed 0]
        [--off-iterations 20] [--json OUT]     run, record every iteration's row, print the table
    .venv/bin/python bench/bench_health.py --regrade OUT.json [OUT2.json ...]
                                               the table again from recorded rows (no training)

Groups:
  healthy  the quickstart (configs/cartpole.yaml) at seeds 0..--seeds-1, configs/stable.yaml,
           configs/multitask.yaml, configs/tokens.yaml (and configs/minigrid_mt3.yaml when it exists),
           each up to min(its own `iterations`, --iterations) or its stop_return.
           Reported: the share of iterations after the warm-up (stability.health_warmup) that read
           `healthy`, `danger`, and the load alerts (breaches of moe/health, moe/cv, moe/active_experts).
  off      bench/bench_stability.py's `off` CartPole runs (32 experts, lr 3e-3, no toolkit), seeds
           0..--off-seeds-1, 20 iterations. Each run is classified as bench_stability does; the crash
           iteration is the first at which that classification holds. Detected: `danger` at or before it.
  dead     the quickstart with expert 0 killed in every layer (moe_rl.algo.faults.DeadExpert) after
           iteration 3; detected: `danger` within 2 iterations of the injection.

The grade comes from the learner (moe/health); --regrade replays the recorded per-update figures
(selection shares, per-state entropy) through moe_rl.core.health.HealthWatch, which is what the
learner runs, to check a rule change without training again (the load alerts are not replayed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import bench_stability as stab  # noqa: E402
import ray  # noqa: E402

import moe_rl.envs  # noqa: E402,F401  registers the moe_rl/ envs
from moe_rl.algo.results import metrics_row  # noqa: E402
from moe_rl.app.run_config import load_run_config, validate_run_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEALTHY = ["cartpole", "stable", "multitask", "tokens", "minigrid_mt3"]
LOAD_ALERTS = ("moe/health", "moe/health_level", "moe/cv", "moe/active_experts")
INJECT_AFTER = 3     # the dead expert is injected after this many iterations
KEEP = ("iteration", "episode_return_mean", "episodes", "episode_return_mean_100", "policy_loss", "vf_loss",
        "aux_loss")


def _slim(row):
    """What the table and a regrade need: the headline figures and every moe/ column."""
    return {k: v for k, v in row.items() if k in KEEP or k.startswith("moe/") or k.startswith("stability/skipped")}


def _train(algo, iterations, stop_return=None, after=None):
    rows, alerts = [], []
    try:
        for _ in range(iterations):
            result = algo.train()
            row = metrics_row(result)
            rows.append(_slim(row))
            alerts += [{k: a[k] for k in ("iteration", "metric", "kind", "message")}
                       for a in result.get("moe_rl_alerts", [])]
            if after is not None:
                after(algo, row["iteration"])
            if stop_return is not None and row["episode_return_mean_100"] >= stop_return:
                break
            if not all(math.isfinite(row.get(k, 0.0)) for k in ("policy_loss", "vf_loss")):
                break
    finally:
        algo.stop()
    return rows, alerts


def healthy_runs(args):
    for name in args.configs.split(","):
        path = os.path.join(ROOT, "configs", f"{name}.yaml")
        if not os.path.exists(path):
            print(f"{name}: no {path}, skipped", flush=True)
            continue
        seeds = range(args.first_seed, args.first_seed + args.seeds) if name == "cartpole" else [0]
        for seed in seeds:
            cfg = load_run_config(path)
            cfg["seed"] = seed
            config = validate_run_config(cfg)
            t = time.time()
            rows, alerts = _train(config.build_algo(), min(cfg.get("iterations", 50), args.iterations),
                                  cfg.get("stop_return"))
            warmup = config.stability_settings.health_warmup
            yield {"group": "healthy", "name": name, "seed": seed, "warmup": warmup, "rows": rows,
                   "alerts": alerts, "seconds": time.time() - t}


def off_runs(args):
    setting = stab.SETTINGS["cartpole"]
    for seed in range(args.off_first_seed, args.off_first_seed + args.off_seeds):
        t = time.time()
        rows, alerts = _train(stab.config(setting, "off", seed).build_algo(),
                              min(setting["iterations"], args.off_iterations))
        yield {"group": "off", "name": "cartpole-off", "seed": seed, "rows": rows, "alerts": alerts,
               "seconds": time.time() - t}


def dead_runs(args):
    from moe_rl.algo.faults import DeadExpert, inject

    def kill(algo, iteration):
        if iteration == INJECT_AFTER:
            inject(algo, DeadExpert(expert=0))
    for seed in range(args.dead_seeds):
        cfg = load_run_config(os.path.join(ROOT, "configs", "cartpole.yaml"))
        cfg["seed"] = seed
        t = time.time()
        rows, alerts = _train(validate_run_config(cfg).build_algo(), INJECT_AFTER + args.dead_iterations,
                              after=kill)
        yield {"group": "dead", "name": "cartpole-dead-expert", "seed": seed, "injected_after": INJECT_AFTER,
               "rows": rows, "alerts": alerts, "seconds": time.time() - t}


def crash_iteration(rows):
    """The first iteration at which bench_stability classifies the run as crashed (None: never)."""
    for i in range(1, len(rows) + 1):
        if stab.crashed(rows[:i], stab.SETTINGS["cartpole"]["moe"]["num_experts"],
                        stab.SETTINGS["cartpole"]["target"]):
            return rows[i - 1]["iteration"]
    return None


def regraded(run):
    """The run's rows with moe/health replayed through the current rule: every layer's recorded
    selection shares (moe/layer{i}/util/e{j}) and per-state entropy through a HealthWatch, as the
    learner feeds it the update's counts."""
    import torch

    from moe_rl.core.health import HealthWatch
    from moe_rl.core.metrics import GRADES
    watch, out = HealthWatch(), []
    for row in run["rows"]:
        layers = sorted({int(k.split("/")[1][5:]) for k in row if k.startswith("moe/layer") and "/util/e" in k})
        shares = [torch.tensor([row[f"moe/layer{i}/util/e{j}"] for j in range(
            sum(k.startswith(f"moe/layer{i}/util/e") for k in row))], dtype=torch.float64) for i in layers]
        graded = watch.observe(shares, [row[f"moe/layer{i}/router_entropy_norm"] for i in layers])
        level = max(g["health"] for g in graded)
        out.append({**row, "moe/health": GRADES[level], "moe/health_level": level,
                    "moe/dead_experts": max(g["dead_experts"] for g in graded),
                    "moe/marginal_entropy_norm": min(g["marginal_entropy_norm"] for g in graded)})
    return out


def first_danger(rows):
    return next((r["iteration"] for r in rows if r.get("moe/health") == "danger"), None)


def table(runs, regrade=False):
    lines = ["| group | run | iterations judged | healthy | warning | danger | load table healthy | load alerts "
             "| detail |", "|---|---|---|---|---|---|---|---|---|"]
    healthy_judged = healthy_ok = 0
    off_detected = off_crashed = dead_detected = dead_runs_n = 0
    for run in runs:
        rows = regraded(run) if regrade else run["rows"]
        if run["group"] == "healthy":
            judged = [r for r in rows if r["iteration"] > run["warmup"]]
            grades = [r.get("moe/health") for r in judged]
            load = [a for a in run["alerts"] if a["metric"] in LOAD_ALERTS]
            healthy_judged += len(judged)
            healthy_ok += grades.count("healthy")
            seeds_table = sum(r.get("moe/load_grade") == 0 for r in judged)
            lines.append(f"| healthy | {run['name']} seed {run['seed']} | {len(judged)} | {grades.count('healthy')} "
                         f"| {grades.count('warning')} | {grades.count('danger')} | {seeds_table} | {len(load)} "
                         f"| final return {rows[-1]['episode_return_mean']:.2f}, CV "
                         f"{min((r.get('moe/cv', math.nan) for r in judged), default=math.nan):.2f}-"
                         f"{max((r.get('moe/cv', math.nan) for r in judged), default=math.nan):.2f} |")
        elif run["group"] == "off":
            crash, danger = crash_iteration(rows), first_danger(rows)
            detected = crash is not None and danger is not None and danger <= crash
            off_crashed += crash is not None
            off_detected += detected
            reason = stab.crashed(rows, stab.SETTINGS["cartpole"]["moe"]["num_experts"],
                                  stab.SETTINGS["cartpole"]["target"])
            lines.append(f"| off | seed {run['seed']} | {len(rows)} | | | | | | crash {reason} at {crash}, "
                         f"first danger {danger}: {'detected' if detected else 'MISSED' if crash else 'no crash'} |")
        elif run["group"] == "dead":
            danger = first_danger([r for r in rows if r["iteration"] > run["injected_after"]])
            detected = danger is not None and danger <= run["injected_after"] + 2
            dead_runs_n += 1
            dead_detected += detected
            before = [r.get("moe/health") for r in rows if r["iteration"] <= run["injected_after"]]
            lines.append(f"| dead | seed {run['seed']} | {len(rows)} | | | | | | "
                         f"injected after {run['injected_after']}, "
                         f"first danger {danger}: {'detected' if detected else 'MISSED'}; before: {before} |")
    lines.append("")
    if healthy_judged:
        lines.append(f"healthy runs: {healthy_ok}/{healthy_judged} judged iterations read healthy "
                     f"({100 * healthy_ok / healthy_judged:.0f} %)")
    if off_crashed:
        lines.append(f"off runs: danger at or before the crash in {off_detected}/{off_crashed} crashed runs")
    if dead_runs_n:
        lines.append(f"dead expert: danger within 2 iterations in {dead_detected}/{dead_runs_n} runs")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--groups", default="healthy,off,dead")
    p.add_argument("--iterations", type=int, default=30, help="cap on a healthy run's iterations")
    p.add_argument("--configs", default=",".join(HEALTHY), help="healthy runs: names of configs/*.yaml")
    p.add_argument("--seeds", type=int, default=5, help="quickstart seeds")
    p.add_argument("--first-seed", type=int, default=0, help="the first quickstart seed")
    p.add_argument("--off-seeds", type=int, default=10)
    p.add_argument("--off-first-seed", type=int, default=0)
    p.add_argument("--off-iterations", type=int, default=20,
                   help="cap on an off run's iterations (bench_stability's crash needs 5 in a row)")
    p.add_argument("--dead-seeds", type=int, default=2)
    p.add_argument("--dead-iterations", type=int, default=3, help="iterations after the injection")
    p.add_argument("--json", help="write the recorded runs here (after every run)")
    p.add_argument("--regrade", nargs="+", help="--json files: print their table with the current rule, no training")
    p.add_argument("--table", nargs="+", help="--json files: print their table as recorded (the learner's grades)")
    args = p.parse_args()
    if args.regrade or args.table:
        runs = []
        for path in args.regrade or args.table:
            with open(path) as f:
                runs += json.load(f)["runs"]
        print(table(runs, regrade=bool(args.regrade)))
        return
    groups = {"healthy": healthy_runs, "off": off_runs, "dead": dead_runs}
    chosen = args.groups.split(",")
    bad = [g for g in chosen if g not in groups]
    if bad:
        raise SystemExit(f"--groups: {bad[0]!r} is not one of {', '.join(groups)}")
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=4)
    runs, t0 = [], time.time()
    try:
        for g in chosen:
            for run in groups[g](args):
                runs.append(run)
                print(f"{run['group']} {run['name']} seed {run['seed']}: {len(run['rows'])} iterations, "
                      f"grades {[r.get('moe/health') for r in run['rows']]}, alerts "
                      f"{[(a['iteration'], a['metric']) for a in run['alerts']]} ({time.time() - t0:.0f}s)",
                      flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"args": vars(args), "runs": runs}, f)
    finally:
        ray.shutdown()
    print(table(runs))


if __name__ == "__main__":
    main()

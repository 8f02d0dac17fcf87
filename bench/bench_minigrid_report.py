"""The table and the figure of bench/bench_minigrid.py, from its saved result files.

Headline: the average over tasks of the sampled-action evaluation return (MOORE's "average return"),
mean and 95 % CI (Student t) over seeds. Beside it the final training return (the last SMOOTH
iterations' mean return over tasks, thousands of episodes a run against the evaluation's 16 a task:
far less evaluation noise in each seed's figure). Time to the dense arm's final return: the target is the
median over dense seeds of the training return averaged over tasks over each run's last SMOOTH
iterations; a run reaches it at the first iteration where the rolling mean of SMOOTH iterations does;
wall-clock from process start (Ray start and build included), median over seeds.
"""
from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict

from bench_minigrid import HERE, saved

from moe_rl.app.plots import xy_plot_svg

# Two-sided 95 % Student t quantiles by degrees of freedom (a table: no scipy dependency).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def mean_ci(values):
    n = len(values)
    m = statistics.fmean(values)
    if n < 2:
        return m, math.nan
    return m, T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)


def _avg(evaluation, mode="sampled"):
    return statistics.fmean(f[f"{mode}_return"] for f in evaluation.values())


SMOOTH = 5   # iterations: the final return is the mean of the last SMOOTH, crossings use a rolling mean


def _finite_curve(run):
    return [p for p in run["curve"] if not math.isnan(p["task_return_mean"])]


def final_return(run) -> float:
    """The mean training return over tasks of the last SMOOTH iterations that have one."""
    tail = _finite_curve(run)[-SMOOTH:]
    return statistics.fmean(p["task_return_mean"] for p in tail) if tail else math.nan


def time_to(run, target: float):
    """Seconds from process start to the first iteration whose rolling mean (SMOOTH iterations)
    of the training return reaches `target`; None if it never does."""
    points = _finite_curve(run)
    for i in range(len(points)):
        window = points[max(0, i - SMOOTH + 1):i + 1]
        if statistics.fmean(p["task_return_mean"] for p in window) >= target:
            return points[i]["time_s"]
    return None


def mean_curve(runs):
    """Training return averaged over tasks, then over the arm's seeds, per iteration (an arm's
    runs share one env-step grid: a fixed batch an iteration); iterations without a figure skipped."""
    points = []
    for i in range(min(len(r["curve"]) for r in runs)):
        values = [r["curve"][i]["task_return_mean"] for r in runs]
        values = [v for v in values if not math.isnan(v)]
        if values:
            points.append((runs[0]["curve"][i]["env_steps"], statistics.fmean(values)))
    return points


def report(results: str, suite: str) -> str:
    runs = list(saved(results, suite))
    if not runs:
        return f"no results under {os.path.join(results, suite)}"
    arms = defaultdict(list)
    for r in runs:
        arms[r["arm"]].append(r)
    singles = defaultdict(dict)                      # seed -> task -> evaluation of its single-task run
    for r in arms.pop("single", []):
        singles[r["seed"]].update(r["evaluation"])
    dense_final = [final_return(r) for r in arms.get("dense", [])]
    dense_final = [v for v in dense_final if not math.isnan(v)]
    target = statistics.median(dense_final) if dense_final else math.nan
    tasks = list(next(iter(arms.values()))[0]["evaluation"]) if arms else list(next(iter(singles.values())))
    lines = [f"### MiniGrid {suite} ({', '.join(tasks)}): {len(runs)} runs",
             "",
             "| arm | seeds | avg return, sampled (mean ± 95 % CI) | final training return (mean ± 95 % CI) | "
             "greedy | success (sampled) | "
             + " | ".join(tasks) + " | train wall-clock s, median (of it the consistency check) | env steps/s | "
             f"s to dense's final training return {target:.3f} (median; reached/seeds) | "
             "policy parameters, total / active |",
             "|" + "---|" * (10 + len(tasks))]
    curves = {}
    for arm, rs in sorted(arms.items()):
        rs.sort(key=lambda r: r["seed"])
        m, ci = mean_ci([_avg(r["evaluation"]) for r in rs])
        train_m, train_ci = mean_ci([final_return(r) for r in rs])
        greedy = statistics.fmean(_avg(r["evaluation"], "greedy") for r in rs)
        success = statistics.fmean(statistics.fmean(f["sampled_success"] for f in r["evaluation"].values()) for r in rs)
        per_task = [statistics.fmean(r["evaluation"][t]["sampled_return"] for r in rs) for t in tasks]
        wall = statistics.median(r["train_s"] for r in rs)
        check = statistics.median(sum(c for p in r["curve"] if (c := p.get("check_s") or 0.0) == c) for r in rs)
        sps = statistics.median(r["env_steps"] / r["train_s"] for r in rs)
        reach = [time_to(r, target) for r in rs]
        hit = [t for t in reach if t is not None]
        reach_txt = f"{statistics.median(hit):.0f} ({len(hit)}/{len(rs)})" if hit else f"never (0/{len(rs)})"
        lines.append(f"| {arm} | {','.join(str(r['seed']) for r in rs)} | {m:.3f} ± {ci:.3f} | "
                     f"{train_m:.3f} ± {train_ci:.3f} | {greedy:.3f} | "
                     f"{success:.2f} | " + " | ".join(f"{v:.3f}" for v in per_task)
                     + f" | {wall:.0f} ({check:.0f}) | {sps:.0f} | {reach_txt} | "
                     f"{rs[0]['policy_parameters']['total']} / {rs[0]['policy_parameters']['active']} |")
        curves[f"{arm} ({len(rs)} seed{'s' if len(rs) > 1 else ''})"] = mean_curve(rs)
    if singles:
        per_seed = [statistics.fmean(f["sampled_return"] for f in ev.values()) for ev in singles.values()
                    if len(ev) == len(tasks)]
        m, ci = mean_ci(per_seed) if per_seed else (math.nan, math.nan)
        per_task = [statistics.fmean(ev[t]["sampled_return"] for ev in singles.values() if t in ev) for t in tasks]
        lines.append(f"| single (one task per run) | {','.join(str(s) for s in sorted(singles))} | {m:.3f} ± {ci:.3f} "
                     "| | | | " + " | ".join(f"{v:.3f}" for v in per_task) + " | | | | |")
    if curves:
        # Results kept elsewhere (--results bench/results/minigrid_narrow) get a figure of their own.
        extra = os.path.basename(os.path.normpath(results)).removeprefix("minigrid").lstrip("_")
        fig = os.path.join(HERE, "figures", f"minigrid_{suite.lower()}{'_' + extra if extra else ''}.svg")
        os.makedirs(os.path.dirname(fig), exist_ok=True)
        with open(fig, "w") as f:
            f.write(xy_plot_svg(curves, f"MiniGrid {suite}: training return averaged over tasks and seeds", "env steps",
                                "return", width=720, height=360,
                                hlines=[(target, "#888888", "dense final")] if dense_final else ()))
        lines += ["", f"Curves: bench/figures/{os.path.basename(fig)}"]
    return "\n".join(lines)

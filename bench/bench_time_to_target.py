"""Time to a good policy: seconds from typing the command to the first iteration whose mean training
return reaches the target, for `moe-rl train` and the PPO a user would run instead.

    .venv/bin/python bench/bench_time_to_target.py [--tasks cartpole,acrobot] [--seeds 0-4]
        [--peers moe_rl,rllib_tuned,sb3_zoo] [--sb3 DIR] [--variant NAME=KEY=VALUE,KEY=VALUE ...]
        [--json OUT]
    .venv/bin/python bench/bench_time_to_target.py --table OUT.json      the tables again, no runs

Every peer is a fresh process timed from its start (imports, Ray start-up and build included), as a
user sees it; they run interleaved seed by seed (seed 0 of every peer, then seed 1, ...), so a change
in the machine's speed hits all of them alike. The return is each tool's own mean over the last 100
training episodes (RLlib's smoothing window, SB3's ep_rew_mean).

Peers:
  moe_rl       `moe-rl train --config <task config> --set stop_return=<target> --seed S`
               (--variant adds more moe-rl rows: the same command with extra --set overrides)
  rllib_tuned  bench/peers/rllib_tuned_ppo.py: RLlib's tuned CartPole example settings
  sb3_zoo      bench/peers/sb3_zoo_ppo.py: Stable-Baselines3 with RL Zoo's settings
               (needs `pip install --target DIR --no-deps stable-baselines3` and --sb3 DIR)

For moe-rl rows the breakdown comes from its own console: Python start and imports (to its first
line), Ray start, building the algorithm, and per iteration up to the target its sampling, learning,
consistency check and weight sync as the progress line reports them; `rest` is the wall-clock
between progress lines that none of those account for (metrics and ledger writes, checkpoints).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

from bench_minigrid import seeds_of  # "0-4" or "0,2,5"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
TASKS = {   # name: (gymnasium id, moe-rl config, target mean training return, step cap for the peers)
    "cartpole": ("CartPole-v1", "configs/cartpole.yaml", 450.0, 300_000),
    "acrobot": ("Acrobot-v1", "configs/acrobot.yaml", -100.0, 500_000),
}
PROGRESS = re.compile(r"iter\s+(\d+)\s+steps\s+(\d+)\s+return\s+(\S+)")
TIMERS = re.compile(r"sample ([\d.]+)s learn ([\d.]+)s check ([\d.]+)s sync ([\d.]+)s")
PHASE = re.compile(r"moe-rl: (starting a local Ray|building the algorithm).*: done in ([\d.]+)s")


def command(peer: str, task: str, seed: int, args, overrides=()) -> list[str]:
    env_id, config, target, cap = TASKS[task]
    if peer == "moe_rl":
        cmd = [os.path.join(os.path.dirname(PY), "moe-rl"), "train", "--config", os.path.join(ROOT, config),
               "--seed", str(seed), "--set", f"stop_return={target:g}", "--set", "iterations=1000",
               "--output", os.path.join(args.work, f"{task}-{seed}-{time.time_ns()}")]
        for o in overrides:
            cmd += ["--set", o]
        return cmd
    script = {"rllib_tuned": "rllib_tuned_ppo.py", "sb3_zoo": "sb3_zoo_ppo.py"}[peer]
    return [PY, os.path.join(ROOT, "bench", "peers", script), "--env", env_id, "--seed", str(seed),
            "--target", f"{target:g}", "--max-steps", str(cap)]


def run_one(cmd, target: float, cap_steps: int, timeout: float, env) -> dict:
    """Run a command, timestamp its lines; stop it once a progress line meets the target."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    out = {"seconds_to_target": None, "steps_to_target": None, "iterations": 0, "phases": {},
           "first_line_s": None, "timers": {"sample": 0.0, "learn": 0.0, "check": 0.0, "sync": 0.0},
           "first_iteration_s": None, "lines_tail": []}
    last_progress = None
    for line in proc.stdout:
        now = time.monotonic() - t0
        out["lines_tail"] = (out["lines_tail"] + [line.rstrip()])[-5:]
        if out["first_line_s"] is None and line.startswith("moe-rl:"):
            out["first_line_s"] = now
        if m := PHASE.search(line):
            out["phases"]["ray_start" if m.group(1).startswith("starting") else "build"] = float(m.group(2))
        if not (m := PROGRESS.search(line)):
            if now > timeout:
                break
            continue
        out["iterations"] = int(m.group(1))
        steps, ret = int(m.group(2)), float(m.group(3))
        if out["first_iteration_s"] is None:
            out["first_iteration_s"] = now
        if t := TIMERS.search(line):
            for k, v in zip(("sample", "learn", "check", "sync"), t.groups()):
                out["timers"][k] += float(v)
        last_progress = now
        if ret >= target:
            out["seconds_to_target"], out["steps_to_target"] = now, steps
            break
        if steps >= cap_steps or now > timeout:
            break
    out["last_progress_s"] = last_progress
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return out


def breakdown(r: dict) -> dict:
    """moe-rl's seconds to target split by where they went (see the module docstring)."""
    if r["seconds_to_target"] is None or r["first_line_s"] is None:
        return {}
    ray_start, build = r["phases"].get("ray_start", 0.0), r["phases"].get("build", 0.0)
    iterations = r["seconds_to_target"] - r["first_line_s"] - ray_start - build
    timers = r["timers"]
    return {"imports": r["first_line_s"], "ray_start": ray_start, "build": build, **timers,
            "rest": iterations - sum(timers.values())}


def median_of(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, 0
    return statistics.median(values), len(values)


def seconds_median(secs) -> float:
    """The median over every seed, a seed that never reached the target counted as never (inf):
    what a user waits for, not the median of the lucky seeds."""
    return statistics.median(math.inf if s is None else s for s in secs) if secs else math.inf


def ratio(mine: float, peer: float) -> str:
    if math.isinf(peer):
        return "-" if math.isinf(mine) else "< 1 (peer never)"
    return "never" if math.isinf(mine) else f"{mine / peer:.2f}x"


def tables(data) -> str:
    lines = []
    for task in data["tasks"]:
        runs = [r for r in data["runs"] if r["task"] == task]
        rows = sorted({r["row"] for r in runs}, key=[r["row"] for r in runs].index)
        ref = {row: seconds_median([r["seconds_to_target"] for r in runs if r["row"] == row]) for row in rows}
        lines += [f"### {task}: seconds to a mean training return of {TASKS[task][2]:g}", "",
                  "| run | seconds per seed | median (never: did not reach) | vs rllib_tuned | vs sb3_zoo "
                  "| env steps (median of those that reached) | reached |", "|---|---|---|---|---|---|---|"]
        for row in rows:
            mine = [r for r in runs if r["row"] == row]
            secs = [r["seconds_to_target"] for r in mine]
            med, n = ref[row], sum(s is not None for s in secs)
            steps, _ = median_of([r["steps_to_target"] for r in mine])
            vs = [ratio(med, ref[p]) if p in ref else "-" for p in ("rllib_tuned", "sb3_zoo")]
            lines.append(f"| {row} | {', '.join('-' if s is None else f'{s:.0f}' for s in secs)} | "
                         f"{'never' if math.isinf(med) else f'{med:.0f}'} | {vs[0]} | {vs[1]} | "
                         f"{'-' if steps is None else f'{steps:.0f}'} | {n}/{len(mine)} |")
        moe_rows = [row for row in rows if row.startswith("moe_rl")]
        if moe_rows:
            keys = ("imports", "ray_start", "build", "sample", "learn", "check", "sync", "rest")
            lines += ["", "Where moe-rl's seconds go (medians over the seeds that reached the target):", "",
                      "| run | " + " | ".join(keys) + " | iterations |", "|---|" + "---|" * (len(keys) + 1)]
            for row in moe_rows:
                parts = [breakdown(r) for r in runs if r["row"] == row]
                parts = [p for p in parts if p]
                its = median_of([r["iterations"] for r in runs if r["row"] == row and r["seconds_to_target"]])[0]
                cells = [f"{statistics.median(p[k] for p in parts):.1f}" if parts else "-" for k in keys]
                lines.append(f"| {row} | " + " | ".join(cells) + f" | {its if its is not None else '-'} |")
        lines.append("")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", default="cartpole")
    p.add_argument("--seeds", default="0-4")
    p.add_argument("--peers", default="moe_rl,rllib_tuned,sb3_zoo")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=KEY=VALUE[,KEY=VALUE]: one more moe-rl row with these --set overrides")
    p.add_argument("--sb3", help="a directory holding stable_baselines3 (pip install --target DIR --no-deps)")
    p.add_argument("--timeout", type=float, default=900.0, help="give a run up this many seconds")
    p.add_argument("--work", default="/tmp/moe-rl-time-to-target", help="moe-rl run directories")
    p.add_argument("--json")
    p.add_argument("--table", nargs="+", help="print the tables of these --json files (no runs)")
    args = p.parse_args()
    if args.table:
        for path in args.table:
            with open(path) as f:
                print(tables(json.load(f)))
        return
    tasks = args.tasks.split(",")
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise SystemExit(f"--tasks: {bad[0]!r} is not one of {', '.join(TASKS)}")
    rows = [(peer, peer, ()) for peer in args.peers.split(",")]
    for v in args.variant:
        name, _, sets = v.partition("=")
        rows.append((f"moe_rl {name}", "moe_rl", tuple(s for s in sets.split(",") if s)))
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    if args.sb3:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(args.sb3), env.get("PYTHONPATH")]))
    os.makedirs(args.work, exist_ok=True)
    data = {"args": vars(args), "tasks": tasks, "runs": []}
    for task in tasks:
        for seed in seeds_of(args.seeds):
            for row, peer, overrides in rows:
                cmd = command(peer, task, seed, args, overrides)
                r = run_one(cmd, TASKS[task][2], TASKS[task][3], args.timeout, env)
                data["runs"].append({"task": task, "seed": seed, "row": row, "command": " ".join(cmd), **r})
                secs = r["seconds_to_target"]
                print(f"{task} seed {seed} {row}: " + (f"{secs:.1f}s, {r['steps_to_target']} steps" if secs
                      else f"target not reached ({r['lines_tail'][-1:] })"), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(data, f, indent=1)
    print(tables(data))


if __name__ == "__main__":
    main()

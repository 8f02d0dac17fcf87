"""MiniGrid multi-task (MOORE's protocol): MoE-PPO against dense PPO, seeds, curves, a table.

    .venv/bin/python bench/bench_minigrid.py --suite MT3 --arms moe_task,dense --seeds 0-4
    .venv/bin/python bench/bench_minigrid.py --suite MT3 --report          # table + figure from the files

Arms (each one process per seed, its own local Ray, timed from process start):
    moe_task   MoE-PPO, configs/minigrid_<suite>.yaml (task-conditioned router)
    moe_topk   the same with the plain top-k router (the task id reaches the experts, not the router)
    dense      stock RLlib PPO with DensePeerModule: the same CNN, task input and blocks, each MoE
               layer a dense FFN of equal active width; the same PPO settings and env runners
    single     dense PPO on one task at a time, 200 k steps each (MOORE's single-task reference)
    --variant NAME=KEY=VALUE[,KEY=VALUE]   one more arm: moe_task with these run-config overrides
               (e.g. moe_k4=moe.top_k=4: every expert active), to find out what moves the result

Budget: 200 k env steps per task (MT3 600 k). After training: 16 episodes per task with sampled
actions (MOORE's "average return") and 16 greedy. The comparison's headline is the final training
return (the last iterations' episodes): the 16 evaluation episodes are seeded by the run's seed, so
a memoryless policy's guesses on MemoryS11 decide their sign (BENCHMARKS.md). Each run's result is one JSON file
under --results (arm, suite, seed): an interrupted bench resumes by running only what is missing.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time

START = time.time()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ARMS = ("moe_task", "moe_topk", "dense", "single")
PER_TASK_BUDGET = 200_000


def config_path(suite: str) -> str:
    return os.path.join(ROOT, "configs", f"minigrid_{suite.lower()}.yaml")


def build_config(arm: str, suite: str, seed: int, tasks=None, overrides=()):
    """The algorithm config of one arm (MoEPPOConfig or stock PPOConfig), from the suite's YAML;
    overrides (KEY=VALUE, as `moe-rl train --set`) make a variant of the moe_task arm."""
    import gymnasium as gym
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.tune.registry import register_env

    from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config
    from moe_rl.envs.minigrid_mt import MultiTaskMiniGrid
    from moe_rl.rllib.dense_peer import DensePeerModule
    from moe_rl.rllib.task_metrics import TaskEpisodeMetrics

    cfg = apply_overrides(load_run_config(config_path(suite)), [f"seed={seed}", *overrides])
    if arm == "moe_topk":
        cfg["moe"] = {k: v for k, v in cfg["moe"].items() if k not in ("router_kwargs", "task_slice")}
        cfg["moe"]["router"] = "topk"
    if arm not in ("dense", "single"):   # moe_task, moe_topk and the --variant arms
        return cfg, validate_run_config(cfg)
    # Stock RLlib's way to name an env it does not know: a registered creator (the moe_rl/ ids exist
    # only in processes that import envs, which a stock PPO env runner never does).
    register_env("minigrid_mt", lambda env_config: MultiTaskMiniGrid(**env_config))
    env_config = {"tasks": list(tasks) if tasks else gym.spec(cfg["env"]).kwargs["tasks"]}
    training = dict(cfg["training"])
    if tasks:   # one task: MOORE's single-task runs, 2 000 steps and minibatch 256 per update
        training.update(train_batch_size_per_learner=2000, minibatch_size=256)
    config = (PPOConfig().environment("minigrid_mt", env_config=env_config)
              .env_runners(**cfg["env_runners"]).learners(**cfg["learners"]).training(**training)
              .rl_module(rl_module_spec=RLModuleSpec(module_class=DensePeerModule, model_config={"moe": cfg["moe"]}))
              .callbacks(TaskEpisodeMetrics).debugging(seed=seed))
    return cfg, config


def run_one(arm: str, suite: str, seed: int, out: str, budget_per_task: int, task=None, overrides=()) -> None:
    """One training run, then the per-task evaluation; writes `out` (JSON)."""
    import gymnasium as gym
    import ray
    import torch

    import moe_rl.envs  # noqa: F401
    from moe_rl.algo.results import metrics_row
    from moe_rl.app.evaluate import evaluate_module_tasks
    from moe_rl.app.train import start_local_ray

    torch.set_num_threads(1)
    cfg, config = build_config(arm, suite, seed, [task] if task else None, overrides)
    num_tasks = 1 if task else len(gym.make(cfg["env"]).unwrapped.task_names)
    budget = budget_per_task * num_tasks
    start_local_ray(num_cpus=3)   # never another head
    try:
        algo = config.build_algo()
        curve = []
        while not curve or curve[-1]["env_steps"] < budget:
            row = metrics_row(algo.train())
            curve.append({"time_s": time.time() - START, "env_steps": row["env_steps_total"],
                          "task_return_mean": row.get("task_return_mean", math.nan),
                          "check_s": row.get("check_s", 0.0),
                          **{k: v for k, v in row.items() if k.startswith("task/") and "/experts/" not in k}})
            _write_json(out + ".partial", {"arm": arm, "suite": suite, "seed": seed, "task": task, "curve": curve})
            print(f"{arm} seed {seed}{' ' + task if task else ''}: steps {row['env_steps_total']} "
                  f"avg {curve[-1]['task_return_mean']:.3f} {curve[-1]['time_s']:.0f}s", flush=True)
        train_s = time.time() - START
        module = algo.get_module().eval()
        env = gym.make("moe_rl/MiniGrid-MT-v0", tasks=[task]) if task else gym.make(cfg["env"])
        evaluation = evaluate_module_tasks(module, env, 16, 10_000 + seed)
        routing = {k: v for k, v in row.items() if "/experts/" in k}
        algo.stop()
    finally:
        ray.shutdown()
    result = {"arm": arm, "suite": suite, "seed": seed, "task": task, "budget": budget, "train_s": train_s,
              "env_steps": curve[-1]["env_steps"], "curve": curve, "evaluation": evaluation,
              "routing_last_iteration": routing, "policy_parameters": policy_parameters(module),
              "overrides": list(overrides),
              "command": " ".join(sys.argv)}
    _write_json(out, result)
    if os.path.exists(out + ".partial"):
        os.unlink(out + ".partial")


def _write_json(path: str, data) -> None:
    """Atomically: a run cut off mid-way leaves its curve so far in OUT.partial, never a torn file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def policy_parameters(module) -> dict:
    """The policy's parameters (the value network left out): all of them, and those one observation
    uses (top_k of the num_experts experts of each MoE layer)."""
    total = active = 0
    s = getattr(module, "moe_settings", None)
    for name, p in module.named_parameters():
        if name.startswith("vf"):
            continue
        total += p.numel()
        active += p.numel() * (s.top_k / s.num_experts if s and ".experts." in name else 1)
    return {"total": total, "active": int(active)}


def result_path(results: str, suite: str, arm: str, seed: int, task=None) -> str:
    return os.path.join(results, suite, f"{arm}{'-' + task if task else ''}-seed{seed}.json")


def seeds_of(text: str):
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def missing_runs(seeds: str, arms: str, allowed, path_of):
    """(arm, seed, result path) of every run of --seeds x --arms whose result is not there yet: a
    resumable bench runs only these. A misspelt arm ends the bench, naming the allowed ones."""
    for seed in seeds_of(seeds):
        for arm in arms.split(","):
            if arm not in allowed:
                raise SystemExit(f"--arms: each one of {tuple(allowed)}, got {arm!r}")
            out = path_of(arm, seed)
            if not os.path.exists(out):
                yield arm, seed, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="MT3", choices=("MT3", "MT5", "MT7"))
    ap.add_argument("--arms", default="moe_task,dense")
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--results", default=os.path.join(HERE, "results", "minigrid"))
    ap.add_argument("--budget-per-task", type=int, default=PER_TASK_BUDGET)
    ap.add_argument("--report", action="store_true", help="only the table and the figure from the saved runs")
    ap.add_argument("--one", nargs=3, metavar=("ARM", "SEED", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                    help="one more arm NAME (list it in --arms): moe_task with these overrides")
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        arm, seed, out = args.one
        return run_one(arm, args.suite, int(seed), out, args.budget_per_task, args.task, args.set)
    if not args.report:
        run_missing(args)
    from bench_minigrid_report import report  # noqa: E402  (bench/ is on sys.path as the script's folder)
    print(report(args.results, args.suite))


def run_missing(args) -> None:
    """Seed-major, arms interleaved: a change in the machine's speed hits every arm alike."""
    import gymnasium as gym

    import moe_rl.envs  # noqa: F401
    from moe_rl.envs.minigrid_mt import short_name
    tasks = gym.make(f"moe_rl/MiniGrid-{args.suite}-v0").unwrapped.task_ids
    variants = {}
    for v in args.variant:
        name, _, sets = v.partition("=")
        if not sets or name in ARMS:
            raise SystemExit(f"--variant: NAME=KEY=VALUE[,KEY=VALUE] with a NAME not in {ARMS}, got {v!r}")
        variants[name] = sets.split(",")
    for seed in seeds_of(args.seeds):
        for arm in args.arms.split(","):
            if arm not in ARMS and arm not in variants:
                raise SystemExit(f"--arms: each one of {ARMS} or a --variant NAME, got {arm!r}")
            for task in (tasks if arm == "single" else [None]):
                out = result_path(args.results, args.suite, arm, seed, task and short_name(task))
                if os.path.exists(out):
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--suite", args.suite, "--one", arm, str(seed),
                       out, "--budget-per-task", str(args.budget_per_task)] + (["--task", task] if task else [])
                cmd += [f"--set={kv}" for kv in variants.get(arm, ())]
                print("running", " ".join(cmd), flush=True)
                done = subprocess.run(cmd)
                if done.returncode != 0:
                    print(f"{arm} seed {seed}: exit {done.returncode} (no result file; rerun to retry)", flush=True)


def saved(results: str, suite: str):
    for path in sorted(glob.glob(os.path.join(results, suite, "*.json"))):
        with open(path) as f:
            yield json.load(f)


if __name__ == "__main__":
    main()

"""`moe-rl` command line: train, evaluate.

    moe-rl train [--config FILE] [--env ID] [--iterations N] [--output DIR] [--seed S]
                 [--num-env-runners N] [--num-learners N] [--ep-size N] [--set dotted.key=value ...]
    moe-rl evaluate RUN_DIR [--episodes N]

Exit codes: 0 done, 2 bad flag / bad config value / unusable output directory (one line on stderr
naming the field), 1 anything that failed while training.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import List, Optional

from .settings import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-rl", description="Train Mixture-of-Experts policies with RL on Ray.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an MoE policy with PPO (embedded Ray, or RAY_ADDRESS)")
    t.add_argument("--config", help="run config YAML (default: the CartPole quickstart)")
    t.add_argument("--env", help="gymnasium env id")
    t.add_argument("--iterations", type=int, help="training iterations")
    t.add_argument("--output", help="run directory (default: runs/<env>-<time>)")
    t.add_argument("--seed", type=int)
    t.add_argument("--num-env-runners", type=int)
    t.add_argument("--num-learners", type=int)
    t.add_argument("--ep-size", type=int)
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. moe.num_experts=16 or training.lr=1e-4")
    d = sub.add_parser("drift-study", help="K3 between rollout copy and trainer by sequence length")
    d.add_argument("--source", default="bf16", help="mismatch source: none, bf16, capacity, second_expert")
    d.add_argument("--lengths", default="64,128,256,512,1024", help="comma-separated sequence lengths (8..1024)")
    d.add_argument("--seeds", default="0", help="comma-separated seeds (repeats per length)")
    d.add_argument("--output", default="runs/drift-study")
    e = sub.add_parser("evaluate", help="load a run's last checkpoint and report the mean return")
    e.add_argument("run_dir")
    e.add_argument("--episodes", type=int, default=10)
    return p


def _fail(msg: str) -> int:
    print(f"moe-rl: error: {msg}", file=sys.stderr)
    return 2


def _flag_overrides(args) -> List[str]:
    flags = {"env": args.env, "iterations": args.iterations, "seed": args.seed,
             "env_runners.num_env_runners": args.num_env_runners,
             "learners.num_learners": args.num_learners, "moe.ep_size": args.ep_size}
    return [f"{k}={v}" for k, v in flags.items() if v is not None]


def cmd_train(args) -> int:
    from .run_config import apply_overrides, load_run_config, resolved, validate_run_config
    from .run_dir import RunDir

    try:
        cfg = apply_overrides(load_run_config(args.config), _flag_overrides(args) + args.set)
        if args.env is not None:  # flags keep their string type even when YAML would read a number
            cfg["env"] = args.env
        config = validate_run_config(cfg)
    except ConfigError as e:
        return _fail(str(e))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg["env"]) + time.strftime("-%Y%m%d-%H%M%S")
    out = args.output or os.path.join(cfg.get("output", "runs"), name)
    try:
        run = RunDir(out, resolved(cfg, config))
    except OSError as e:
        return _fail(str(e))
    if config.consistency_settings.get("ledger_path") is None:
        config.consistency(ledger_path=os.path.join(run.path, "drift.parquet"))
    return train_loop(config, cfg, run)


def train_loop(config, cfg, run) -> int:
    import ray

    started_ray = ensure_ray(logical_cpus_needed(config))
    from .run_dir import metrics_row

    algo = config.build_algo()
    iterations, every = cfg.get("iterations", 50), cfg.get("checkpoint_every", 10)
    stop_return = cfg.get("stop_return")
    print(f"moe-rl: run directory {run.path}", flush=True)
    try:
        for i in range(1, iterations + 1):
            row = metrics_row(algo.train())
            run.log(row)
            print(f"iter {row['iteration']:4d}  steps {row['env_steps_total']:8d}  "
                  f"return {row['episode_return_mean']:8.2f}  health {row.get('moe/health', '-'):8s}  "
                  f"cv {row.get('moe/cv', float('nan')):.2f}  "
                  f"drift k3 {row.get('drift/k3', float('nan')):.2g}  {row['time_s']:.0f}s", flush=True)
            done = i == iterations or (stop_return is not None and row["episode_return_mean"] >= stop_return)
            if done or i % every == 0:
                algo.save_to_path(os.path.join(run.checkpoints, f"iter_{row['iteration']:06d}"))
            if done:
                break
    finally:
        run.close()
        algo.stop()
        if started_ray:
            ray.shutdown()
    print(f"moe-rl: done; metrics in {os.path.join(run.path, 'metrics.parquet')}", flush=True)
    return 0


def ensure_ray(min_cpus: int) -> bool:
    """Connect to RAY_ADDRESS (as under `ray job submit`) or start an embedded Ray on loopback
    offering at least `min_cpus` logical CPUs (actors then share the cores; a smaller head would
    wait forever). Returns whether this call started/connected Ray (the caller shuts it down)."""
    import ray
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(os.cpu_count() or 1, min_cpus))
    return True


def logical_cpus_needed(config) -> int:
    def cpus(v):
        return 1 if v == "auto" else v
    return int(1 + config.num_env_runners * cpus(config.num_cpus_per_env_runner)
               + config.num_learners * cpus(config.num_cpus_per_learner))


def cmd_evaluate(args) -> int:
    from .evaluate import evaluate_run

    try:
        mean, returns = evaluate_run(args.run_dir, args.episodes)
    except ConfigError as e:
        return _fail(str(e))
    print(f"mean return over {len(returns)} episodes: {mean:.2f}")
    return 0


def cmd_drift_study(args) -> int:
    from .drift_study import SOURCES, run_study
    if args.source not in SOURCES:
        return _fail(f"--source: must be one of {tuple(SOURCES)}, got {args.source!r}")
    try:
        lengths = [int(v) for v in args.lengths.split(",")]
        seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError:
        return _fail(f"--lengths/--seeds: must be comma-separated ints, got {args.lengths!r} / {args.seeds!r}")
    if not all(8 <= L <= 1024 for L in lengths):
        return _fail(f"--lengths: must be in [8, 1024], got {lengths}")
    import ray
    started = ensure_ray(4)  # a study config needs at most 1 runner + 2 learners
    try:
        run_study(lengths, args.source, seeds, args.output)
    finally:
        if started:
            ray.shutdown()
    print(f"moe-rl: drift study in {args.output}/drift_study.parquet and drift_study.svg")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    return {"train": cmd_train, "evaluate": cmd_evaluate, "drift-study": cmd_drift_study}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

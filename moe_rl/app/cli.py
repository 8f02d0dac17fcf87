"""`moe-rl` command line: train, evaluate, report, drift-study.

    moe-rl train [--config FILE] [--env ID] [--iterations N] [--output DIR] [--seed S]
                 [--num-env-runners N] [--num-learners N] [--ep-size N] [--set dotted.key=value ...]
    moe-rl train --resume RUN_DIR [--iterations N] [--set key=value ...]
    moe-rl evaluate RUN_DIR [--episodes N]
    moe-rl report RUN_DIR                     # RUN_DIR/report.html
    moe-rl drift-study [--source S] [--lengths L,...] [--checkpoint RUN_DIR]

Exit codes: 0 done, 2 bad flag / bad config value / unusable output directory, also a checkpoint
that cannot be written (one line on stderr naming the field or path), 1 anything that failed while
training (a dead learner with restore_on_learner_failure false: one line saying how to --resume).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import List, Optional

import psutil
import ray

from moe_rl.algo.resources import check_memory, gib, model_memory, needs, run_demand
from moe_rl.app import checkpoint as ck
from moe_rl.app import console
from moe_rl.app.cluster_address import cluster_address
from moe_rl.app.drift_study import SOURCES, run_study, trained_policy
from moe_rl.app.evaluate import evaluate_run, evaluate_tasks
from moe_rl.app.report import write_report
from moe_rl.app.resume import model_conflicts, resume_config
from moe_rl.app.run_config import (
    apply_overrides,
    default_config_path,
    load_run_config,
    resolved,
    validate_run_config,
)
from moe_rl.app.run_dir import RunDir, check_output
from moe_rl.app.run_lock import check_not_busy
from moe_rl.app.run_signature import check_user_key, not_users_own, read_signed_file
from moe_rl.app.train import connect_first, ensure_ray, fail, train_loop
from moe_rl.core.settings import ConfigError, saved_run_config

TRUST_RUN_HELP = ("open a run directory that is not signed with your key (another user's, another machine's, or "
                  "an edited one); only its data is read (YAML, Parquet, tensors)")
TRUST_ENV_CODE_HELP = ("import the env a run directory's config.yaml names by import path (module:Class): that runs "
                       "the code it names, which a run from elsewhere may have chosen")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-rl", description="Train Mixture-of-Experts policies with RL on Ray.")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show every dependency's log line too (moe-rl drops a few named ones: moe_rl/app/console.py)")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train an MoE policy with PPO, APPO or DQN (embedded Ray, or RAY_ADDRESS)")
    t.add_argument("--config", help="run config YAML (default: the CartPole quickstart)")
    t.add_argument("--algo", help="ppo (default) | appo | dqn: the RLlib algorithm (`algo:` in the config); without "
                   "--config, that algorithm's own CartPole config (configs/cartpole.yaml, appo_cartpole.yaml, "
                   "dqn_cartpole.yaml)")
    t.add_argument("--env", help="gymnasium env id")
    t.add_argument("--iterations", type=int, help="training iterations")
    t.add_argument("--output", help="run directory (default: runs/<env>-<time>)")
    t.add_argument("--seed", type=int)
    t.add_argument("--num-env-runners", type=int)
    t.add_argument("--num-learners", type=int)
    t.add_argument("--ep-size", type=int)
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. moe.num_experts=16 or training.lr=1e-4")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest good checkpoint with its config.yaml (flags and "
                        "--set may extend it, e.g. --iterations, but not change the model)")
    t.add_argument("--trust-run", action="store_true",
                   help="--resume a run directory that is not signed with your key (from another user or machine, "
                        "or edited): its pickled files and any env code its config.yaml names will run")
    t.add_argument("--dry-run", action="store_true",
                   help="check the config and say what the run needs and where it would write; start nothing")
    d = sub.add_parser("drift-study", help="K3 between rollout copy and trainer by sequence length")
    d.add_argument("--source", default="bf16", help=f"mismatch source: {', '.join(SOURCES)}")
    d.add_argument("--lengths", default="64,128,256,512,1024", help="comma-separated sequence lengths (8..1024)")
    d.add_argument("--seeds", default="0", help="comma-separated seeds (repeats per length)")
    d.add_argument("--checkpoint", metavar="RUN_DIR",
                   help="measure the trained policy of a token-sequence run (its newest good checkpoint) "
                        "instead of an untrained one")
    d.add_argument("--output", default="runs/drift-study")
    d.add_argument("--trust-run", action="store_true", help=TRUST_RUN_HELP)
    d.add_argument("--trust-env-code", action="store_true", help=TRUST_ENV_CODE_HELP)
    r = sub.add_parser("report", help="write RUN_DIR/report.html (self-contained plots of a run)")
    r.add_argument("run_dir")
    r.add_argument("--trust-run", action="store_true", help=TRUST_RUN_HELP)
    e = sub.add_parser("evaluate", help="load a run's last checkpoint and report the mean return (greedy), "
                                        "or per task with sampled and greedy actions for a multi-task env")
    e.add_argument("run_dir")
    e.add_argument("--episodes", type=int, default=None,
                   help="episodes (default 10); per task and mode for a multi-task env (default 16)")
    e.add_argument("--trust-run", action="store_true", help=TRUST_RUN_HELP)
    e.add_argument("--trust-env-code", action="store_true", help=TRUST_ENV_CODE_HELP)
    return p


def _flag_overrides(args) -> List[str]:
    flags = {"algo": args.algo, "env": args.env, "iterations": args.iterations, "seed": args.seed,
             "env_runners.num_env_runners": args.num_env_runners,
             "learners.num_learners": args.num_learners, "moe.ep_size": args.ep_size}
    return [f"{k}={v}" for k, v in flags.items() if v is not None]


def cmd_train(args) -> int:

    def build(base, trust_env_code=True):
        cfg = apply_overrides(base, _flag_overrides(args) + args.set)
        if args.env is not None:  # flags keep their string type even when YAML would read a number
            cfg["env"] = args.env
        return cfg, validate_run_config(cfg, trust_env_code)

    resume = None
    try:
        if args.resume:
            saved, resume = _resume_source(args)
            try:   # the run's own file first, so its faults are named as its own, not a flag's
                validate_run_config(resume_config(saved))
            except ConfigError as e:
                raise ConfigError(f"--resume: {args.resume!r} config.yaml: {e}") from None
            cfg, config = build(resume_config(saved))   # authenticated (or trusted): its env code too
            _check_resume(args, saved, resolved(cfg, config),
                          lambda: resolved(*build(load_run_config(args.config))) if args.config else None)
        else:
            cfg, config = build(load_run_config(args.config or default_config_path(args.algo)))
        local = cluster_address() is None
        if local:   # a cluster's memory is known once connected: train_loop checks it there
            check_memory(config, psutil.virtual_memory().total, "this machine")
    except ConfigError as e:
        return fail(str(e))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg["env"]) + time.strftime("-%Y%m%d-%H%M%S")
    out = args.resume or args.output or os.path.join(cfg.get("output", "runs"), name)
    try:   # it writes only a new, empty or moe-rl's own directory that no live run writes, signed with a safe key
        check_output(out, resume=bool(args.resume))
        check_user_key()
    except ConfigError as e:
        return fail(str(e))
    if args.dry_run:
        memory = gib(model_memory(config)["bytes"])
        print(f"moe-rl: dry run: the config is valid; {needs(run_demand(config))}; the model takes about {memory} "
              f"of memory; the run would write {out}")
        return 0
    try:
        connected = connect_first()   # a cluster (RAY_ADDRESS) is reached before anything is written
        run = RunDir(out, resolved(cfg, config), resume=bool(args.resume))
    except (OSError, ConfigError) as e:
        if ray.is_initialized():
            ray.shutdown()
        return fail(str(e), getattr(e, "exit_code", 2))   # a signal while reaching a cluster: 128 + it
    try:
        return train_loop(config, cfg, run, resume, args.trust_run)
    finally:
        run.release()
        if connected:
            ray.shutdown()


def _resume_source(args):
    """--resume RUN_DIR: its config.yaml and its newest good checkpoint (ConfigError if none), both
    checked to be the user's own (signed with the user's key) before anything is unpickled or any
    env code is imported, unless --trust-run."""
    check_not_busy(args.resume)   # a live run's directory: refused before anything is read
    if not os.path.isfile(os.path.join(args.resume, "config.yaml")):
        raise ConfigError(f"--resume: must be a moe-rl run directory with config.yaml, got {args.resume!r}")
    if args.output and os.path.abspath(args.output) != os.path.abspath(args.resume):
        raise ConfigError(f"--output: a resumed run continues in its own directory {args.resume!r}; leave --output out")
    config_yaml = os.path.join(args.resume, "config.yaml")
    try:   # config.yaml read once: its signature is checked on the bytes that are parsed
        ckpt = ck.latest_good_checkpoint(args.resume, refuse=True)
        if ckpt is None:
            raise ConfigError(f"--resume: {args.resume!r} has no good checkpoint under checkpoints/ to continue from")
        data, unsigned = read_signed_file(config_yaml)
        if not args.trust_run:
            ck.authenticate(ckpt, args.resume, unsigned)
    except (ck.CheckpointError, OSError) as e:
        raise ConfigError(f"--resume: {args.resume!r}: {e}") from None
    saved = load_run_config(config_yaml, flag=f"--resume {args.resume!r} config.yaml", data=data)
    return saved_run_config(saved), ckpt


def _check_resume(args, saved, new, other_config) -> None:
    """Flags and --set may change how the run goes on (iterations, checkpointing, runners, ...),
    never the model or the learner layout the checkpoint holds; nor may a --config."""
    conflicts = model_conflicts(saved, new)
    if conflicts:
        flags = (("algo", "--algo", args.algo), ("env", "--env", args.env),
                 ("learners.num_learners", "--num-learners", args.num_learners),
                 ("moe.ep_size", "--ep-size", args.ep_size))
        given = {field: flag for field, flag, value in flags if value is not None}
        given.update({item.split("=", 1)[0]: f"--set {item.split('=', 1)[0]}" for item in args.set})

        def flag_of(field):  # the flag that asked for it (a --set may name a whole section)
            return given.get(field) or next((v for k, v in given.items() if field.startswith(k + ".")), None)
        field, old, got = next((c for c in conflicts if flag_of(c[0])), conflicts[0])
        flag = flag_of(field) or f"--set {field}"
        raise ConfigError(f"{flag}: --resume cannot change the model: {field} is {old!r} in the run's "
                          f"config.yaml, got {got!r}")
    other = other_config()
    conflicts = model_conflicts(saved, other) if other else []
    if conflicts:
        field, old, got = conflicts[0]
        raise ConfigError(f"--config: conflicts with the run being resumed: {field} is {old!r} in its "
                          f"config.yaml, {got!r} in {args.config!r} (--resume uses the run's own config)")


def users_own_run(run_dir: str, flag: str, trust_run: bool) -> bool:
    """Whether RUN_DIR is signed with the user's key; a run that is not is refused (ConfigError)
    unless --trust-run. Either way the caller reads only data from it."""
    reason = not_users_own(run_dir)
    if reason and not trust_run:
        raise ConfigError(f"{flag}: {run_dir!r} is not your own run ({reason}): a run from elsewhere or an edited "
                          "one; pass --trust-run to open it (only its data is read: YAML, Parquet and tensors)")
    return reason is None


def cmd_report(args) -> int:
    try:
        users_own_run(args.run_dir, "RUN_DIR", args.trust_run)
        path = write_report(args.run_dir)
    except ConfigError as e:
        return fail(str(e))
    except (FileNotFoundError, NotADirectoryError) as e:
        return fail(str(e))
    print(f"moe-rl: report in {path}")
    return 0


def tasks_table(tasks, episodes: int) -> str:
    """Per-task evaluation as a table; its last row is the average over tasks (MOORE's headline)."""
    lines = [f"{'task':24s} {'sampled return':>15s} {'success':>8s} {'greedy return':>14s} {'success':>8s}"
             f"   ({episodes} episodes per task and mode)"]
    for name, f in tasks.items():
        lines.append(f"{name:24s} {f['sampled_return']:15.3f} {f['sampled_success']:8.2f} "
                     f"{f['greedy_return']:14.3f} {f['greedy_success']:8.2f}")
    avg = {k: sum(f[k] for f in tasks.values()) / len(tasks) for k in next(iter(tasks.values()))}
    lines.append(f"{'average over tasks':24s} {avg['sampled_return']:15.3f} {avg['sampled_success']:8.2f} "
                 f"{avg['greedy_return']:14.3f} {avg['greedy_success']:8.2f}")
    return "\n".join(lines)


def cmd_evaluate(args) -> int:

    try:
        n = args.episodes
        # The user's own run may import the env code its config.yaml names (None: decided on the
        # config.yaml bytes that are read, by their signature): the user wrote it.
        users_own_run(args.run_dir, "RUN_DIR", args.trust_run)
        trust_env_code = args.trust_env_code or None
        tasks = evaluate_tasks(args.run_dir, 16 if n is None else n, trust_env_code, args.trust_run)
        if tasks:
            print(tasks_table(tasks, 16 if n is None else n))
            return 0
        mean, returns = evaluate_run(args.run_dir, 10 if n is None else n, trust_env_code, args.trust_run)
    except ConfigError as e:
        return fail(str(e))
    print(f"mean return over {len(returns)} episodes: {mean:.2f}")
    return 0


def cmd_drift_study(args) -> int:
    if args.source not in SOURCES:
        return fail(f"--source: must be one of {tuple(SOURCES)}, got {args.source!r}")
    try:
        lengths = [int(v) for v in args.lengths.split(",")]
        seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError:
        return fail(f"--lengths/--seeds: must be comma-separated ints, got {args.lengths!r} / {args.seeds!r}")
    if not all(8 <= L <= 1024 for L in lengths):
        return fail(f"--lengths: must be in [8, 1024], got {lengths}")
    try:
        trained = None
        if args.checkpoint:
            users_own_run(args.checkpoint, "--checkpoint", args.trust_run)
            trained = trained_policy(args.checkpoint, lengths, args.trust_env_code or None, args.trust_run)
    except ConfigError as e:
        return fail(str(e))
    started = ensure_ray(4)  # a study config needs at most 1 runner + 2 learners
    try:
        run_study(lengths, args.source, seeds, args.output, trained)
    finally:
        if started:
            ray.shutdown()
    print(f"moe-rl: drift study in {args.output}/drift_study.parquet and drift_study.svg")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.verbose:
        console.verbose()
    return {"train": cmd_train, "evaluate": cmd_evaluate, "drift-study": cmd_drift_study,
            "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

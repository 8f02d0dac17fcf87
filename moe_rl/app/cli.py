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
import math
import os
import re
import sys
import time
from typing import List, Optional

import ray

from moe_rl.algo.resources import (
    ResourceWait,
    WaitWatch,
    cluster_view,
    describe,
    fmt_bundle,
    needs,
    run_demand,
    shortfall,
    suggestion,
)
from moe_rl.algo.results import metrics_row
from moe_rl.algo.sync_gate import GateStop
from moe_rl.app import checkpoint as ck
from moe_rl.app import console
from moe_rl.app.drift_study import SOURCES, run_study, trained_policy
from moe_rl.app.evaluate import evaluate_run, evaluate_tasks
from moe_rl.app.guardian import Guardian
from moe_rl.app.lost_cluster import EmbeddedRayWatch, cluster_lost, mark_lost
from moe_rl.app.report import write_report
from moe_rl.app.run_config import apply_overrides, load_run_config, resolved, validate_run_config
from moe_rl.app.run_dir import RunDir
from moe_rl.app.stop_signals import NAMES as SIGNAL_NAMES
from moe_rl.app.stop_signals import StopSignals, stop_after_iteration
from moe_rl.app.wandb_logger import WandbLogger
from moe_rl.core.settings import ConfigError, saved_run_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-rl", description="Train Mixture-of-Experts policies with RL on Ray.")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show every dependency's log line too (moe-rl drops a few named ones: moe_rl/app/console.py)")
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
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its newest good checkpoint with its config.yaml (flags and "
                        "--set may extend it, e.g. --iterations, but not change the model)")
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
    r = sub.add_parser("report", help="write RUN_DIR/report.html (self-contained plots of a run)")
    r.add_argument("run_dir")
    e = sub.add_parser("evaluate", help="load a run's last checkpoint and report the mean return (greedy), "
                                        "or per task with sampled and greedy actions for a multi-task env")
    e.add_argument("run_dir")
    e.add_argument("--episodes", type=int, default=None,
                   help="episodes (default 10); per task and mode for a multi-task env (default 16)")
    return p


def _fail(msg: str, code: int = 2) -> int:
    print(f"moe-rl: error: {msg}", file=sys.stderr, flush=True)
    return code


def _flag_overrides(args) -> List[str]:
    flags = {"env": args.env, "iterations": args.iterations, "seed": args.seed,
             "env_runners.num_env_runners": args.num_env_runners,
             "learners.num_learners": args.num_learners, "moe.ep_size": args.ep_size}
    return [f"{k}={v}" for k, v in flags.items() if v is not None]


def cmd_train(args) -> int:

    def build(base):
        cfg = apply_overrides(base, _flag_overrides(args) + args.set)
        if args.env is not None:  # flags keep their string type even when YAML would read a number
            cfg["env"] = args.env
        return cfg, validate_run_config(cfg)

    resume = None
    try:
        if args.resume:
            saved, resume = _resume_source(args)
            cfg, config = build(ck.resume_config(saved))
            _check_resume(args, saved, resolved(cfg, config),
                          lambda: resolved(*build(load_run_config(args.config))) if args.config else None)
        else:
            cfg, config = build(load_run_config(args.config))
    except ConfigError as e:
        return _fail(str(e))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg["env"]) + time.strftime("-%Y%m%d-%H%M%S")
    out = args.resume or args.output or os.path.join(cfg.get("output", "runs"), name)
    if args.dry_run:
        print(f"moe-rl: dry run: the config is valid; {needs(run_demand(config))}; the run would write {out}")
        return 0
    try:
        run = RunDir(out, resolved(cfg, config))
    except OSError as e:
        return _fail(str(e))
    return train_loop(config, cfg, run, resume)


def _resume_source(args):
    """--resume RUN_DIR: its config.yaml and its newest good checkpoint (ConfigError if none)."""
    if not os.path.isfile(os.path.join(args.resume, "config.yaml")):
        raise ConfigError(f"--resume: must be a moe-rl run directory with config.yaml, got {args.resume!r}")
    if args.output and os.path.abspath(args.output) != os.path.abspath(args.resume):
        raise ConfigError(f"--output: a resumed run continues in its own directory {args.resume!r}; leave --output out")
    ckpt = ck.latest_good_checkpoint(args.resume)
    if ckpt is None:
        raise ConfigError(f"--resume: {args.resume!r} has no good checkpoint under checkpoints/ to continue from")
    return saved_run_config(load_run_config(os.path.join(args.resume, "config.yaml"))), ckpt


def _check_resume(args, saved, new, other_config) -> None:
    """Flags and --set may change how the run goes on (iterations, checkpointing, runners, ...),
    never the model or the learner layout the checkpoint holds; nor may a --config."""
    conflicts = ck.model_conflicts(saved, new)
    if conflicts:
        flags = (("env", "--env", args.env), ("learners.num_learners", "--num-learners", args.num_learners),
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
    conflicts = ck.model_conflicts(saved, other) if other else []
    if conflicts:
        field, old, got = conflicts[0]
        raise ConfigError(f"--config: conflicts with the run being resumed: {field} is {old!r} in its "
                          f"config.yaml, {got!r} in {args.config!r} (--resume uses the run's own config)")


def train_loop(config, cfg, run, resume_from=None) -> int:
    """Train with a guardian beside the process (it reports a trainer that dies with its Ray
    cluster) and Ctrl-C / SIGTERM turned into a clean stop after the current iteration."""
    guardian = Guardian(run.path, run.location)

    def first(signum):  # in a signal handler: os.write, never print (a print may be under way)
        os.write(2, f"moe-rl: {SIGNAL_NAMES[signum]}: stopping after the running iteration, with a checkpoint "
                    "(again to quit at once)\n".encode())

    def second(signum):
        newest = ck.newest_checkpoint(run.path)
        reason = (f"stopped at once by a second {SIGNAL_NAMES[signum]}; nothing saved since the last checkpoint; "
                  + (f"`moe-rl train --resume {run.location}` continues from {os.path.basename(newest)}" if newest
                     else "no checkpoint yet: start the run again"))
        guardian.progress("done")
        run.mark_incomplete(reason)
        os.write(2, f"moe-rl: error: {reason}\n".encode())

    try:
        with StopSignals(first, second) as stop:
            return _train_loop(config, cfg, run, resume_from, stop, guardian)
    except BaseException as e:   # a bug, or a lost cluster not recognised: the run directory says it stopped
        if not os.path.exists(os.path.join(run.path, "INCOMPLETE")):
            run.mark_incomplete(f"stopped by {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        raise
    finally:
        guardian.finish()


def _train_loop(config, cfg, run, resume_from, stop, guardian) -> int:
    demand = run_demand(config)
    started_ray = ensure_ray(math.ceil(demand.total().get("CPU", 0)) + 1)   # + the driver's own work
    stop.take_back()   # from ray.init(), whose own SIGTERM handler would exit mid-iteration
    algo = None
    try:
        algo = _build_within_the_cluster(config, cfg, demand)
    except ResourceWait as e:
        run.mark_incomplete(str(e))
        if started_ray:
            ray.shutdown()   # ends this job: its half-started actors and placement groups go with it
        return _fail(str(e), 1)
    algo.monitoring.run = os.path.basename(os.path.normpath(run.location))   # names the Prometheus series
    iterations, every = cfg.get("iterations", 50), cfg.get("checkpoint_every", 10)
    keep, verify_every = cfg.get("checkpoint_keep", 3), cfg.get("checkpoint_verify_every_s", 7200)
    stop_return = cfg.get("stop_return")
    print(f"moe-rl: run directory {run.location}" + (f" (staged in {run.path})" if run.mirror else ""),
          flush=True)
    last_verified, failures_in_a_row = -math.inf, 0
    stopped = None   # (exit code, reason) when a signal or a lost cluster ends the run early
    watch = EmbeddedRayWatch(guardian)
    running = algo.iteration + 1
    wandb = None
    if cfg.get("wandb") is not None:
        wandb = WandbLogger(cfg["wandb"], run.resolved_config, run.path, os.path.basename(run.location))
    try:
        if resume_from:
            try:
                phase = Phase(f"verifying and restoring {resume_from}")
                ck.restore_checkpoint(algo, resume_from)
                phase.done()
            except (OSError, RuntimeError, ValueError, KeyError, ray.exceptions.RayError) as e:
                # e.g. a learner state file that is not plain data (refused by the weights-only load)
                lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
                return _fail(f"--resume: cannot restore {resume_from}: {lines[-1].strip()}", 1)
            _continue_run(algo, run, resume_from)
            print(f"moe-rl: resumed from {resume_from} (iteration {algo.iteration})", flush=True)
        restarts = int((run.rows[-1].get("faults/learner_restarts") or 0) if run.rows else 0)
        while algo.iteration < iterations:
            if stop.requested:   # Ctrl-C / SIGTERM: the iteration that was running has finished
                stopped = stop_after_iteration(algo, run, stop, keep,
                                               lambda a, path: _verify(a, path, run.resolved_config))
                break
            running = algo.iteration + 1
            guardian.progress(f"running {running}")
            try:  # one iteration: train, log, checkpoint (a learner may die in any of them)
                result = algo.train()
                row = metrics_row(result)
                row["faults/learner_restarts"] = restarts
                run.log(row, result.get("moe_rl_drift", ()), result.get("moe_rl_alerts", ()))
                if wandb is not None:
                    wandb.log(row, result.get("moe_rl_alerts", []))
                print(progress_line(row), flush=True)
                for a in result.get("moe_rl_alerts", []):
                    print(f"  alert: {a['kind']} {a['message']}", flush=True)
                i = row["iteration"]
                done = i >= iterations or (stop_return is not None and row["episode_return_mean"] >= stop_return)
                if done or i % every == 0:
                    path = ck.save_checkpoint(algo, run.checkpoints, i, run.resolved_config)
                    if time.monotonic() - last_verified >= verify_every:
                        last_verified = time.monotonic()
                        run.amend_last(_verify(algo, path, run.resolved_config))
                    ck.prune(run.checkpoints, keep)  # after verifying: a quarantined one keeps older ones
                run.sync()   # a storage URI trails the local run by at most this iteration
                guardian.progress(f"finished {i}")
            except ray.exceptions.RayError as e:
                failures_in_a_row += 1
                if failures_in_a_row > MAX_LEARNER_RESTARTS_IN_A_ROW:
                    raise
                good, who = ck.recover_learners(algo, e, run.path, cfg.get("restore_on_learner_failure", True))
                _continue_run(algo, run, good)
                restarts += 1
                print(f"moe-rl: {who} died; rebuilt the learner group and restored {good} "
                      f"(iteration {algo.iteration}); learner restarts: {restarts}", flush=True)
                continue
            failures_in_a_row = 0
            if done:
                break
    except ck.CheckpointWriteError as e:
        run.mark_incomplete(str(e))
        return _fail(str(e))
    except GateStop as e:
        # The learners hold the last good weights: keep them as the checkpoint to resume from.
        ck.save_checkpoint(algo, run.checkpoints, algo.iteration, run.resolved_config)
        run.mark_incomplete(str(e).replace("RUN_DIR", run.location))
        return _fail(str(e).replace("RUN_DIR", run.location), 1)
    except ck.LearnerFailure as e:
        run.mark_incomplete(str(e))
        return _fail(str(e), 1)
    except Exception as e:
        lost = cluster_lost()
        if lost is None:
            raise
        stopped = 1, mark_lost(run, lost, running, e)
    finally:
        watch.close()
        run.close()
        if wandb is not None:
            wandb.close()
        try:
            algo.stop()
        except Exception:
            if stopped is None or stopped[0] != 1:   # with the cluster gone, its actors are gone too
                raise
        if started_ray:
            ray.shutdown()
    report = os.path.relpath(write_report(run.path), run.path)
    run.sync()
    if stopped is not None:
        return _fail(stopped[1], stopped[0])
    print(f"moe-rl: done; run in {run.location} (metrics.parquet, {report})", flush=True)
    run.clear_incomplete()   # a resumed run that reached its end is complete
    return 0


MAX_LEARNER_RESTARTS_IN_A_ROW = 3


def progress_line(row) -> str:
    """One iteration on the console; a multi-task env adds the average over tasks and the worst task."""
    tasks = ""
    if row.get("task_return_mean") is not None:
        worst = min((k for k in row if k.startswith("task/") and k.endswith("/return") and row[k] == row[k]),
                    key=row.get)
        tasks = f"  tasks avg {row['task_return_mean']:.2f} worst {worst.split('/')[1]} {row[worst]:.2f}"
    return (f"iter {row['iteration']:4d}  steps {row['env_steps_total']:8d}  "
            f"return {row['episode_return_mean']:8.2f}{tasks}  health {row.get('moe/health', '-'):8s}  "
            f"cv {row.get('moe/cv', float('nan')):.2f}  "
            f"drift k3 {row.get('drift/k3', float('nan')):.2g}  "
            f"{row.get('env_steps_per_s', float('nan')):5.0f} steps/s (sample {row.get('sample_s', 0):.1f}s "
            f"learn {row.get('learn_s', 0):.1f}s check {row.get('check_s', 0):.1f}s "
            f"sync {row.get('sync_s', 0):.1f}s)  {row['time_s']:.0f}s")


def _continue_run(algo, run, checkpoint) -> None:
    """Tables continue from the restored iteration (later rows are trained again); checkpoints
    newer than the restored one failed verification: out of the iter_* namespace with them."""
    run.continue_from(algo.iteration)
    algo.continue_ledgers(run.drift, len(run.alerts))
    for name in ck.checkpoint_names(run.checkpoints):
        if ck.checkpoint_iteration(name) > ck.checkpoint_iteration(os.path.basename(checkpoint)):
            moved = ck.quarantine(os.path.join(run.checkpoints, name))
            print(f"moe-rl: {name} is not a good checkpoint; moved to {os.path.basename(moved)}",
                  file=sys.stderr, flush=True)


def _verify(algo, path, resolved_config):
    """Periodic check: the manifest re-hashed and the reloaded policy's outputs equal the live
    learner module's; a failure quarantines the checkpoint (resume and evaluate never use it)."""
    try:
        ck.verify_checkpoint(path)
        ok, diff = ck.verify_weights(algo, path, resolved_config)
        reason = f"max abs diff {diff:.3g} between the reloaded policy and the live one"
    except ck.CheckpointError as e:
        ok, diff, reason = False, math.inf, str(e)
    if not ok:
        moved = ck.quarantine(path)
        print(f"moe-rl: checkpoint {os.path.basename(path)} failed verification ({reason}); moved to {moved}",
              file=sys.stderr, flush=True)
    return {"checkpoint/verified": int(ok), "checkpoint/verify_max_abs_diff": diff}


def _build_within_the_cluster(config, cfg, demand):
    """Say what the run needs and what the cluster has, refuse a run a fixed cluster can never
    hold, and build the algorithm with a progress line every 30 s while actors wait; give up after
    cluster.wait_timeout_s (default: 120 s on a fixed cluster, no limit with an autoscaler)."""
    view = cluster_view()
    total, _, scaler = view
    print(describe(demand, view), flush=True)
    never = shortfall(demand.total(), total)
    if never and not scaler:
        raise ResourceWait(f"this fixed cluster can never hold the run: it lacks {fmt_bundle(never)} in total; "
                           f"the smallest change that fits: {suggestion(config, never, total)}")
    section = cfg.get("cluster") or {}
    timeout = section.get("wait_timeout_s", None if scaler else DEFAULT_WAIT_TIMEOUT_S)
    phase = Phase(f"building the algorithm ({config.num_env_runners} env runners, {config.num_learners} learners)")
    try:
        with WaitWatch(demand, timeout):
            algo = config.build_algo()
    except ResourceWait:
        _, free, _ = cluster_view()
        missing = shortfall(demand.total(), free) or demand.total()
        raise ResourceWait(f"gave up after {timeout:g}s waiting for {fmt_bundle(missing)} (cluster.wait_timeout_s); "
                           f"the smallest change that fits: {suggestion(config, missing, free)}") from None
    phase.done()
    return algo


DEFAULT_WAIT_TIMEOUT_S = 120.0


class Phase:
    """A long phase says what it does: one start line, one done line with the time taken."""

    def __init__(self, what: str):
        self.what, self.t0 = what, time.monotonic()
        print(f"moe-rl: {what} ...", flush=True)

    def done(self, note: str = "") -> None:
        print(f"moe-rl: {self.what}: done in {time.monotonic() - self.t0:.1f}s{note}", flush=True)


def ensure_ray(min_cpus: int) -> bool:
    """Connect to RAY_ADDRESS (as under `ray job submit`) or start an embedded Ray on loopback
    offering at least `min_cpus` logical CPUs (actors then share the cores; a smaller head would
    wait forever). Returns whether this call started/connected Ray (the caller shuts it down)."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        phase = Phase(f"connecting to the Ray cluster at {os.environ['RAY_ADDRESS']}")
        # The actors' output reaches this console (log_to_driver): the same named filters there.
        ray.init(runtime_env=None if not console.is_quiet() else
                 {"worker_process_setup_hook": "moe_rl.app.console.quiet_worker"})
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        cpus = max(os.cpu_count() or 1, min_cpus)
        phase = Phase(f"starting a local Ray on 127.0.0.1 ({cpus} logical CPUs)")
        # address="local": a new Ray of our own, never another user's head that ray.init() would
        # otherwise find on this host (it then also refuses num_cpus)
        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=cpus)
    phase.done()
    return True


def cmd_report(args) -> int:
    try:
        path = write_report(args.run_dir)
    except (FileNotFoundError, NotADirectoryError) as e:
        return _fail(f"RUN_DIR: must be a run directory ({e})")
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
        tasks = evaluate_tasks(args.run_dir, 16 if n is None else n)
        if tasks:
            print(tasks_table(tasks, 16 if n is None else n))
            return 0
        mean, returns = evaluate_run(args.run_dir, 10 if n is None else n)
    except ConfigError as e:
        return _fail(str(e))
    print(f"mean return over {len(returns)} episodes: {mean:.2f}")
    return 0


def cmd_drift_study(args) -> int:
    if args.source not in SOURCES:
        return _fail(f"--source: must be one of {tuple(SOURCES)}, got {args.source!r}")
    try:
        lengths = [int(v) for v in args.lengths.split(",")]
        seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError:
        return _fail(f"--lengths/--seeds: must be comma-separated ints, got {args.lengths!r} / {args.seeds!r}")
    if not all(8 <= L <= 1024 for L in lengths):
        return _fail(f"--lengths: must be in [8, 1024], got {lengths}")
    try:
        trained = trained_policy(args.checkpoint, lengths) if args.checkpoint else None
    except ConfigError as e:
        return _fail(str(e))
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

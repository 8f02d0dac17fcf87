"""`moe-rl train`'s loop: build the algorithm within what the cluster holds, train iteration by
iteration (log, checkpoint, verify), and end cleanly on every path: done, Ctrl-C / SIGTERM after the
running iteration, a lost cluster, a dead learner, the sync gate's stop. The embedded Ray is started
here too (ensure_ray). The command line (moe_rl.app.cli) parses and validates, then calls train_loop.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Optional

import psutil
import ray

from moe_rl.algo.resources import (
    ResourceWait,
    WaitWatch,
    check_memory,
    cluster_view,
    describe,
    fmt_bundle,
    run_demand,
    shortfall,
    suggestion,
)
from moe_rl.algo.results import metrics_row
from moe_rl.algo.sync_gate import GateStop
from moe_rl.app import checkpoint as ck
from moe_rl.app import console
from moe_rl.app.cluster_address import cluster_address, connect, reach
from moe_rl.app.guardian import Guardian
from moe_rl.app.lost_cluster import EmbeddedRayWatch, cluster_lost, mark_lost
from moe_rl.app.report import write_report
from moe_rl.app.stop_signals import NAMES as SIGNAL_NAMES
from moe_rl.app.stop_signals import StopSignals, stop_after_iteration
from moe_rl.app.wandb_logger import WandbLogger
from moe_rl.core.errors import ConfigError
from moe_rl.rllib.ray_private import LOGGER_NOISE, keep_local_ray_on_loopback, require_token_auth


def fail(msg: str, code: int = 2) -> int:
    print(f"moe-rl: error: {msg}", file=sys.stderr, flush=True)
    return code


def train_loop(config, cfg, run, resume_from=None, trust_run: bool = False) -> int:
    """Train with a guardian beside the process (it reports a trainer that dies with its Ray
    cluster) and Ctrl-C / SIGTERM turned into a clean stop after the current iteration.
    trust_run: resume_from is restored without its signature (--resume --trust-run)."""
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
            return _train_loop(config, cfg, run, resume_from, stop, guardian, trust_run)
    except BaseException as e:   # a bug, or a lost cluster not recognised: the run directory says it stopped
        if not os.path.exists(os.path.join(run.path, "INCOMPLETE")):
            run.mark_incomplete(f"stopped by {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")
        raise
    finally:
        guardian.finish()


def _train_loop(config, cfg, run, resume_from, stop, guardian, trust_run=False) -> int:
    demand = run_demand(config)
    started_ray = ensure_ray(math.ceil(demand.total().get("CPU", 0)) + 1)   # + the driver's own work
    stop.take_back()   # from ray.init(), whose own SIGTERM handler would exit mid-iteration
    algo = None
    if cluster_address():   # the machine's memory was checked before Ray; a cluster's is known now
        try:
            check_memory(config, ray.cluster_resources().get("memory", math.inf), "the cluster")
        except ConfigError as e:
            run.mark_incomplete(str(e))
            if started_ray:
                ray.shutdown()
            return fail(str(e))
    try:
        algo = _build_within_the_cluster(config, cfg, demand)
    except ResourceWait as e:
        run.mark_incomplete(str(e))
        if started_ray:
            ray.shutdown()   # ends this job: its half-started actors and placement groups go with it
        return fail(str(e), 1)
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
                if trust_run:
                    ck.restore_checkpoint(algo, resume_from, require_signature=False)
                else:
                    ck.restore_checkpoint(algo, resume_from)   # the signature checked on the bytes loaded
                phase.done()
            except (ck.CheckpointError, ConfigError) as e:   # changed since it was checked, or not signed now
                hint = "" if isinstance(e, ck.CheckpointError) else \
                    "; pass --trust-run to resume it anyway (it will unpickle the run's files)"
                return fail(f"--resume: cannot restore {resume_from}: {e}{hint}")
            except (OSError, RuntimeError, ValueError, KeyError, ray.exceptions.RayError) as e:
                # e.g. a learner state file that is not plain data (refused by the weights-only load)
                lines = [line for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
                return fail(f"--resume: cannot restore {resume_from}: {lines[-1].strip()}", 1)
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
                ret = row.get("episode_return_mean_100", row["episode_return_mean"])
                done = i >= iterations or (stop_return is not None and ret >= stop_return)
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
                good, who = ck.recover_learners(algo, e, run.path, cfg.get("restore_on_learner_failure", True),
                                                wait_timeout(cfg))
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
        return fail(str(e))
    except GateStop as e:
        # The learners hold the last good weights: keep them as the checkpoint to resume from.
        ck.save_checkpoint(algo, run.checkpoints, algo.iteration, run.resolved_config)
        run.mark_incomplete(str(e).replace("RUN_DIR", run.location))
        return fail(str(e).replace("RUN_DIR", run.location), 1)
    except ck.LearnerFailure as e:
        run.mark_incomplete(str(e))
        return fail(str(e), 1)
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
        return fail(stopped[1], stopped[0])
    print(f"moe-rl: done; run in {run.location} (metrics.parquet, {report})", flush=True)
    run.clear_incomplete()   # a resumed run that reached its end is complete
    return 0


MAX_LEARNER_RESTARTS_IN_A_ROW = 3


def drift_headline(row) -> str:
    """The check's same-weights mismatch as the policy kind measures it: K3 of the log-probs, or the
    largest Q-value gap over the Q scale (a Q-policy)."""
    if row.get("drift/q_gap_max_rel") is not None:
        return f"dQ {row['drift/q_gap_max_rel']:.2g}"
    return f"k3 {row.get('drift/k3', float('nan')):.2g}"


def progress_line(row) -> str:
    """One iteration on the console; a multi-task env adds the average over tasks and the worst task."""
    tasks = ""
    if row.get("task_return_mean") is not None:
        worst = min((k for k in row if k.startswith("task/") and k.endswith("/return") and row[k] == row[k]),
                    key=row.get)
        tasks = f"  tasks avg {row['task_return_mean']:.2f} worst {worst.split('/')[1]} {row[worst]:.2f}"
    health = row.get("moe/health")   # NaN in an iteration without a grade (DQN grades every few updates)
    return (f"iter {row['iteration']:4d}  steps {row['env_steps_total']:8d}  "
            f"return {row.get('episode_return_mean_100', row['episode_return_mean']):8.2f}{tasks}  "
            f"health {health if isinstance(health, str) else '-':8s}  "
            f"cv {row.get('moe/cv', float('nan')):.2f}  "
            f"drift {drift_headline(row)}  "
            f"{row.get('env_steps_per_s', float('nan')):5.0f} steps/s (sample {row.get('sample_s', 0):.1f}s "
            f"learn {row.get('learn_s', 0):.1f}s check {row.get('check_s', 0):.1f}s "
            f"sync {row.get('sync_s', 0):.1f}s)  {row['time_s']:.0f}s")


def _continue_run(algo, run, checkpoint) -> None:
    """Tables continue from the restored iteration (later rows are trained again); checkpoints
    newer than the restored one failed verification: out of the iter_* namespace with them."""
    run.continue_from(algo.iteration)
    algo.continue_ledgers(run.drift, len(run.alerts), run.rows)
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
    timeout = wait_timeout(cfg, scaler)
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


def wait_timeout(cfg, scaler: Optional[bool] = None) -> Optional[float]:
    """cluster.wait_timeout_s: how long actors may wait to be placed (default 120 s on a fixed
    cluster, no limit with an autoscaler). scaler None: ask the cluster."""
    if scaler is None:
        scaler = cluster_view()[2]
    return (cfg.get("cluster") or {}).get("wait_timeout_s", None if scaler else DEFAULT_WAIT_TIMEOUT_S)


class Phase:
    """A long phase says what it does: one start line, one done line with the time taken."""

    def __init__(self, what: str):
        self.what, self.t0 = what, time.monotonic()
        print(f"moe-rl: {what} ...", flush=True)

    def done(self, note: str = "") -> None:
        print(f"moe-rl: {self.what}: done in {time.monotonic() - self.t0:.1f}s{note}", flush=True)


EMBEDDED_RAY_SYSTEM_CONFIG = {"worker_niceness": 0}
LOOPBACK = "127.0.0.1"


def ensure_ray(min_cpus: int) -> bool:
    """Connect to RAY_ADDRESS (as under `ray job submit`) or start an embedded Ray on loopback
    offering at least `min_cpus` logical CPUs (actors then share the cores; a smaller head would
    wait forever). Returns whether this call started/connected Ray (the caller shuts it down)."""
    if ray.is_initialized():
        return False
    address = cluster_address()   # RAY_ADDRESS=local: the embedded Ray below, loopback and all
    if address:
        phase = Phase(f"connecting to the Ray cluster at {address}")
        # The actors' output reaches this console (log_to_driver): the same named filters there.
        # Bounded, and a loopback address stays loopback (cluster_address.connect).
        connect(address, lambda: ray.init(address=address, runtime_env=None if not console.is_quiet() else
                                          {"worker_process_setup_hook": "moe_rl.app.console.quiet_worker"}))
    else:
        # Loopback whatever the environment holds (a local Ray is ours, not a cluster), and Ray's
        # token auth said explicitly rather than left to Ray's default for new local clusters.
        console.also_drop(LOGGER_NOISE)
        cpus = max(os.cpu_count() or 1, min_cpus)
        phase = Phase(f"starting a local Ray ({cpus} logical CPUs)")
        start_local_ray(cpus)
    phase.done(f"; Ray listens on {listening_on()}")
    return True


def connect_first() -> bool:
    """RAY_ADDRESS names a cluster: reach it and connect now, before the run directory is written
    (ConfigError naming the address within cluster_address.REACH_TIMEOUT_S; a port that answers but
    never accepts the driver ends the process within CONNECT_TIMEOUT_S). Nothing to do for an
    embedded Ray (the train loop starts it). Returns whether this connected (the caller shuts Ray down)."""
    address = cluster_address()
    if not address or ray.is_initialized():
        return False
    phase = Phase(f"reaching the Ray cluster at {address}")
    reach(address)
    phase.done()
    return ensure_ray(0)


def start_local_ray(num_cpus: "int | None" = None, **init_kwargs) -> None:
    """A new Ray of our own on loopback, whatever the environment holds: the run's, the benches' and
    the tests'. Ray's token auth is said explicitly rather than left to Ray's default for new local
    clusters. address="local": never another user's head that ray.init() would otherwise find on
    this host (it then also refuses num_cpus). worker_niceness 0: Ray starts workers at nice 15, and
    here the workers (rollout actors, learners) are the training, not background work: at 15, any
    other process on a shared machine starves them."""
    keep_local_ray_on_loopback()
    require_token_auth()
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = {c.pid for c in psutil.Process().children()}
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=num_cpus,
                     _node_ip_address=LOOPBACK, _system_config=EMBEDDED_RAY_SYSTEM_CONFIG, **init_kwargs)
            return
        except Exception as e:   # Ray raises a bare Exception when its node does not register in time
            if attempt == RAY_START_ATTEMPTS or RAY_NODE_TIMEOUT not in str(e):
                raise
            # Ray gives its raylet a fixed 30 s to register with the GCS (ray/_private/node.py), which a
            # machine whose cores are busy with other work can overrun. The half-started node's
            # processes are this process's new children: stopped before the next try.
            for child in psutil.Process().children():
                if child.pid not in before:
                    child.kill()
            ray.shutdown()
            print(f"moe-rl: Ray's node did not register within Ray's 30 s (a busy machine); starting it again "
                  f"(try {attempt + 1} of {RAY_START_ATTEMPTS})", flush=True)


# A busy machine's slow start is retried; a third timeout is a machine that cannot run Ray now.
RAY_START_ATTEMPTS = 3
RAY_NODE_TIMEOUT = "timed out during startup"


def listening_on() -> str:
    """Where this driver's Ray listens, as Ray reports it: the GCS and the node's address."""
    gcs = ray.get_runtime_context().gcs_address
    nodes = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")})
    return f"{', '.join(nodes)} (GCS {gcs})"



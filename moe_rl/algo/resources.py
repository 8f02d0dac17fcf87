"""What a run needs from the cluster, what the cluster has, and no silent waits.

    demand = run_demand(config)                  # the bundles RLlib's own resource request uses
    print(describe(demand, cluster_view()))      # once, before any actor starts
    with WaitWatch(demand, timeout_s):           # a progress line every 30 s: what it waits for;
        algo = config.build_algo()               # after timeout_s unplaced: ResourceWait

The demand is computed with RLlib's own bundle functions (the same ones `Algorithm.
default_resource_request` gives Tune, and the DeepSpeed learner group requests its placement
group with), so what is printed is exactly what is asked for.
"""
from __future__ import annotations

import _thread
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import ray
from ray.autoscaler.v2.utils import is_autoscaler_v2

from moe_rl.actors.startup import read_steps
from moe_rl.core.errors import ConfigError
from moe_rl.rllib.learner_group import learner_bundles
from moe_rl.rllib.ray_private import autoscaler_status, env_runner_bundles, job_actors, main_process_bundle

Bundle = Dict[str, float]
STATUS_WAIT_S = 15


class ResourceWait(RuntimeError):
    """The run's actors could not be placed in time; str() is one line: what is missing and the
    smallest change that fits."""


@dataclass
class Demand:
    parts: List[Tuple[str, int, Bundle]] = field(default_factory=list)   # (what, how many, each)

    def total(self) -> Bundle:
        out: Bundle = {}
        for _, n, bundle in self.parts:
            for k, v in bundle.items():
                if v:
                    out[k] = out.get(k, 0.0) + n * float(v)
        return out


def run_demand(config, in_tune: bool = False) -> Demand:
    """Rollout actors and learners as Ray schedules them. The driver (the main process, where a
    local learner trains) is not a Ray task under `moe-rl train` or `ray job submit`, so it asks for
    nothing; a Tune trial reserves the main process's bundle for it. The consistency actor asks
    for nothing (num_cpus=0)."""
    main = {k: float(v) for k, v in main_process_bundle(config).items() if v} if in_tune else {}
    runners = env_runner_bundles(config)
    learners = learner_bundles(config)
    d = Demand([("driver", 1, main)])
    if runners:
        d.parts.append(("env runner", len(runners), {k: float(v) for k, v in runners[0].items() if v}))
    if learners:
        d.parts.append(("learner", len(learners), learners[0]))
    d.parts.append(("consistency actor", 1, {}))
    return d


def fmt_bundle(bundle: Bundle) -> str:
    keys = sorted(k for k in bundle if not k.startswith(("node:", "memory", "object_store_memory", "accelerator_type")))
    return ", ".join(f"{k} {bundle[k]:g}" for k in keys) or "nothing"


def autoscaler_attached() -> bool:
    """Whether an autoscaler can add nodes. Autoscaler v2 (KubeRay) always can; v1 writes its
    status to the GCS: a manually started cluster runs a read-only one whose node types are the
    nodes themselves (`node_<id>`), a real one names its types (`ray.head.default`, `learner`, ...)."""
    try:
        if is_autoscaler_v2():
            return True
        status = None
        for _ in range(STATUS_WAIT_S):   # a head that just started writes its first status within seconds
            status = autoscaler_status()
            if status:
                break
            time.sleep(1)
        report = (status or {}).get("autoscaler_report") or {}
        types = (report.get("node_type_mapping") or {}).values()
        return bool(report.get("pending_launches") or report.get("pending_nodes")
                    or (report.get("node_availability_summary") or {}).get("node_availabilities")
                    or any(not str(t).startswith("node_") for t in types))
    except Exception:   # no status (an old head, a client connection): a fixed cluster
        return False


def cluster_view() -> Tuple[Bundle, Bundle, bool]:
    return dict(ray.cluster_resources()), dict(ray.available_resources()), autoscaler_attached()


def shortfall(need: Bundle, have: Bundle) -> Bundle:
    return {k: v - have.get(k, 0.0) for k, v in need.items() if v > have.get(k, 0.0) + 1e-9}


def needs(demand: Demand) -> str:
    """`this run needs CPU 1: 1 x env runner (CPU 1) (the driver ... ask for none)`."""
    asking = "; ".join(f"{n} x {what} ({fmt_bundle(b)})" for what, n, b in demand.parts if b)
    free_riders = " and the ".join(what for what, _, b in demand.parts if not b)
    return (f"this run needs {fmt_bundle(demand.total())}: {asking or 'nothing'}"
            + (f" (the {free_riders} ask for none)" if free_riders else ""))


def describe(demand: Demand, view) -> str:
    total, free, scaler = view
    return (f"moe-rl: {needs(demand)}"
            + f". The cluster has {fmt_bundle(total)} in total, {fmt_bundle(free)} free now"
            + (", and an autoscaler that can add nodes." if scaler else " (no autoscaler: a fixed cluster)."))


def suggestion(config, missing: Bundle, total: Bundle) -> str:
    """The smallest change that fits, for the resource that is short."""
    n, ep = config.num_learners, config.moe_settings.ep_size
    hints = []
    if missing.get("CPU"):
        cpu_per = learner_bundles(config)[0].get("CPU", 0) if n else 0
        spare = total.get("CPU", 0) - (run_demand(config).total().get("CPU", 0) - n * cpu_per)
        if n and spare > 0:
            hints.append(f"learners.num_cpus_per_learner={math.floor(100 * spare / n) / 100:g}")
        if n > max(ep, 1):
            hints.append(f"learners.num_learners={max(ep, 1)} (moe.ep_size={ep} must divide it)")
        if config.num_env_runners > 1:
            hints.append(f"env_runners.num_env_runners={config.num_env_runners - 1}")
        if ep > 1 and n > 1:
            hints.append("moe.ep_size=1 with learners.num_learners=0 (one process)")
    for k in missing:
        if k not in ("CPU",):
            hints.append(f"a node with {k}, or drop it from the per-learner / per-runner resources")
    return "; or ".join(hints[:3]) if hints else "a bigger cluster"


def fmt_free(bundle: Bundle) -> str:
    """A cluster's free resources without the per-placement-group ones (CPU_group_<id>, ...)."""
    return fmt_bundle({k: v for k, v in bundle.items() if "_group_" not in k and not k.startswith("bundle_group")})


@dataclass
class Startup:
    """What a building run waits for: actors and placement groups the scheduler has not placed
    (a wait for resources), and what is placed but still starting (a worker process, an actor's
    constructor, a learner joining its process group, building its engines or compiling)."""
    unplaced: List[str] = field(default_factory=list)
    starting: List[str] = field(default_factory=list)


PENDING_ACTOR_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "RESTARTING")


def startup_state(job_id: str) -> Startup:
    """This job's placement groups and actors as the GCS sees them (no dashboard needed), plus the
    steps its starting learners report (actors.startup). An actor has a worker address once its
    worker is leased (resources granted, process up); until then it counts as not placed, which
    includes the few seconds a new worker process takes to start."""
    state = Startup()
    for pg_id, pg in ray.util.placement_group_table().items():
        if pg_id.endswith(job_id) and pg.get("state") in ("PENDING", "RESCHEDULING"):
            need: Bundle = {}
            for b in pg.get("bundles", {}).values():
                for k, v in b.items():
                    need[k] = need.get(k, 0.0) + float(v)
            state.unplaced.append(f"a placement group ({fmt_bundle(need)})")
    waiting: Dict[str, int] = {}
    for info in job_actors(job_id):
        if info["State"] not in PENDING_ACTOR_STATES:
            continue
        name = info["ActorClassName"]
        if info["Address"]["Port"]:
            state.starting.append(f"{name} (its process and constructor)")
        else:
            waiting[name] = waiting.get(name, 0) + 1
    state.unplaced += [f"{n} x {name}" for name, n in sorted(waiting.items())]
    for who, (doing, secs) in sorted(read_steps(job_id).items(), key=lambda kv: -kv[1][1]):
        state.starting.append(f"{who}: {doing} ({secs:.0f}s)")
    return state


# Set while a WaitWatch interrupts the main thread to give up: its simulated SIGINT is not a user's
# Ctrl-C (moe_rl.app.stop_signals lets it through as a KeyboardInterrupt).
_GIVING_UP = threading.Event()


def giving_up() -> bool:
    return _GIVING_UP.is_set()


class WaitWatch:
    """While the main thread builds the algorithm, poll what it waits for and print a progress
    line every `every_s` that says which: resources not placed yet, or actors placed and still
    starting (the slowest first, with what it is doing: a compile says so). Only the time something
    cannot be placed counts towards `timeout_s` (None: never): a slow start is not a missing
    resource. At the timeout, interrupt the main thread, which raises ResourceWait from the block."""

    def __init__(self, demand: Demand, timeout_s: Optional[float], every_s: float = 30.0, printer=print,
                 poll_s: float = 2.0):
        self.demand, self.timeout_s, self.every_s, self.printer = demand, timeout_s, every_s, printer
        self.poll_s = poll_s
        self._done = threading.Event()
        self._expired = False
        self._interrupts = 0
        self.t0 = 0.0
        self.unplaced_s = 0.0   # time during which something of the run could not be placed

    def _line(self, state: Startup, waited: float) -> str:
        total, free, scaler = cluster_view()
        if state.unplaced:
            return (f"moe-rl: waiting {waited:.0f}s for resources: not placed yet: {', '.join(state.unplaced)} "
                    f"(the run needs {fmt_bundle(self.demand.total())}; free now: {fmt_free(free)} of "
                    f"{fmt_free(total)}); "
                    + ("an autoscaler is attached: waiting is right" if scaler else "no autoscaler")
                    + ("" if self.timeout_s is None else
                       f"; giving up in {max(0, self.timeout_s - self.unplaced_s):.0f}s"))
        if state.starting:
            return (f"moe-rl: {waited:.0f}s: the run's actors are placed, still starting: {'; '.join(state.starting)}"
                    " (no time limit: cluster.wait_timeout_s counts only resources that cannot be placed)")
        return f"moe-rl: {waited:.0f}s: building the algorithm (nothing waits for resources)"

    def _watch(self) -> None:
        job = ray.get_runtime_context().get_job_id()
        last = next_line = time.monotonic()
        next_line += self.every_s
        while not self._done.wait(self.poll_s):
            now = time.monotonic()
            try:
                state = startup_state(job)
            except Exception:   # a progress line is never worth the give-up: count the time as before
                state = Startup(unplaced=["(unknown: the cluster state could not be read)"])
            if state.unplaced:
                self.unplaced_s += now - last
            last = now
            expired = self.timeout_s is not None and self.unplaced_s >= self.timeout_s
            if now >= next_line or expired:   # the give-up says first what it waited for
                next_line = now + self.every_s
                try:
                    self.printer(self._line(state, now - self.t0), flush=True)
                except Exception:
                    pass
            if expired:
                self._expired = True
                _GIVING_UP.set()
                # The main thread sits in a blocking Ray call: interrupt it, again if one is lost.
                while not self._done.wait(0 if not self._interrupts else 2.0) and self._interrupts < 30:
                    self._interrupts += 1
                    _thread.interrupt_main()
                return

    def __enter__(self) -> "WaitWatch":
        self.t0 = time.monotonic()
        # interrupt_main() does nothing while SIGINT is ignored, as it is in a script's background job
        # (`moe-rl train ... &`) or a pytest-xdist worker: the give-up would wait forever. A handler
        # for the watch's time (only the main thread may set one).
        self._ignored_sigint = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) in (
                signal.SIG_IGN, signal.SIG_DFL, None):
            self._ignored_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Thread(target=self._watch, daemon=True, name="moe-rl-wait-watch").start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._done.set()
        _GIVING_UP.clear()
        if self._ignored_sigint is not None:
            signal.signal(signal.SIGINT, self._ignored_sigint)
        if self._expired and exc_type is KeyboardInterrupt:
            raise ResourceWait(f"gave up after {self.timeout_s:g}s waiting for resources") from None
        return False


# --- memory: refuse a model that cannot fit before anything starts ------------------------------
FP32 = 4


def model_memory(config) -> Dict[str, float]:
    """An estimate in bytes (a floor: the encoder and heads are left out) of what the MoE policy
    takes: its parameters, every copy of them the run holds, and one minibatch's activations.

    params      num_layers x (experts x (2 d_model d_ff + d_ff + d_model) + router d_model x experts)
    learners    weights + gradients + Adam's two moments: 4 copies per learner (experts split over ep)
    copies      one inference copy per env runner, plus the driver's probe copy
    activations minibatch x num_layers x (top_k d_ff + 4 d_model), kept for backward
    """
    m = config.moe_settings   # validated: typed
    n, d, f, layers = m.num_experts, m.d_model, m.d_ff, m.num_layers
    per_layer_experts = n * (2 * d * f + f + d)
    params = layers * (per_layer_experts + d * n)
    learners = max(1, config.num_learners)
    ep = max(1, m.ep_size)
    learner_bytes = learners * 4 * FP32 * (params - layers * per_layer_experts * (1 - 1 / ep))
    copies = (config.num_env_runners + 1) * FP32 * params
    minibatch = config.minibatch_size or config.train_batch_size_per_learner
    activations = learners * minibatch * layers * (m.top_k * f + 4 * d) * FP32
    return {"params": float(params), "bytes": float(learner_bytes + copies + activations)}


def gib(b: float) -> str:
    return f"{b / 2**30:.3g} GiB"


def check_memory(config, have_bytes: float, where: str) -> Dict[str, float]:
    """A ConfigError naming the model settings when the estimate exceeds
    `have_bytes` (the machine's memory for an embedded Ray, the cluster's otherwise)."""
    est = model_memory(config)
    if est["bytes"] > have_bytes:
        m = config.moe_settings
        raise ConfigError(f"moe: the model cannot fit: {est['params']:.3g} parameters need at least "
                         f"{gib(est['bytes'])} (weights, gradients and Adam moments on each learner, a copy per "
                         f"env runner, activations), {where} has {gib(have_bytes)} (num_experts "
                         f"{m.num_experts}, d_model {m.d_model}, d_ff {m.d_ff}, num_layers {m.num_layers})")
    return est

"""What a run needs from the cluster, what the cluster has, and no silent waits.

    demand = run_demand(config)                  # the bundles RLlib's own resource request uses
    print(describe(demand, cluster_view()))      # once, before any actor starts
    with WaitWatch(demand, timeout_s):           # a progress line every 30 s while actors wait;
        algo = config.build_algo()               # at the timeout the wait ends with ResourceWait

The demand is computed with RLlib's own bundle functions (the same ones `Algorithm.
default_resource_request` gives Tune, and the DeepSpeed learner group requests its placement
group with), so what is printed is exactly what is asked for.
"""
from __future__ import annotations

import _thread
import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import ray
from ray._private import ray_constants
from ray.autoscaler.v2.utils import is_autoscaler_v2
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized
from ray.rllib.algorithms.utils import _get_env_runner_bundles, _get_main_process_bundle

from moe_rl.rllib.learner_group import learner_bundles

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
    main = {k: float(v) for k, v in _get_main_process_bundle(config).items() if v} if in_tune else {}
    runners = _get_env_runner_bundles(config)
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
        if not _internal_kv_initialized():
            return False
        raw = None
        for _ in range(STATUS_WAIT_S):   # a head that just started writes its first status within seconds
            raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
            if raw:
                break
            time.sleep(1)
        report = (json.loads(raw).get("autoscaler_report") or {}) if raw else {}
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


def describe(demand: Demand, view) -> str:
    total, free, scaler = view
    asking = "; ".join(f"{n} x {what} ({fmt_bundle(b)})" for what, n, b in demand.parts if b)
    free_riders = " and the ".join(what for what, _, b in demand.parts if not b)
    return (f"moe-rl: this run needs {fmt_bundle(demand.total())}: {asking or 'nothing'}"
            + (f" (the {free_riders} ask for none)" if free_riders else "")
            + f". The cluster has {fmt_bundle(total)} in total, {fmt_bundle(free)} free now"
            + (", and an autoscaler that can add nodes." if scaler else " (no autoscaler: a fixed cluster)."))


def suggestion(config, missing: Bundle, total: Bundle) -> str:
    """The smallest change that fits, for the resource that is short."""
    n, ep = config.num_learners, config.moe_settings.get("ep_size", 1)
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


class WaitWatch:
    """While the main thread builds the algorithm (actors and placement groups waiting for
    resources), print a progress line every `every_s`; after `timeout_s` (None: never) interrupt
    the main thread, which raises ResourceWait from the `with` block."""

    def __init__(self, demand: Demand, timeout_s: Optional[float], every_s: float = 30.0, printer=print):
        self.demand, self.timeout_s, self.every_s, self.printer = demand, timeout_s, every_s, printer
        self._done = threading.Event()
        self._expired = False
        self._interrupts = 0
        self.t0 = 0.0

    def _watch(self) -> None:
        while not self._done.wait(self.every_s if self.timeout_s is None else min(
                self.every_s, max(0.0, self.timeout_s - (time.monotonic() - self.t0)))):
            waited = time.monotonic() - self.t0
            try:
                total, free, scaler = cluster_view()
                self.printer(f"moe-rl: waiting {waited:.0f}s for the run's actors to be placed (it needs "
                             f"{fmt_bundle(self.demand.total())}; free now: {fmt_bundle(free)} of "
                             f"{fmt_bundle(total)}); "
                             + ("an autoscaler is attached: waiting is right" if scaler else "no autoscaler")
                             + ("" if self.timeout_s is None else
                                f"; giving up in {max(0, self.timeout_s - waited):.0f}s"), flush=True)
            except Exception:   # a progress line is never worth the give-up
                pass
            if self.timeout_s is not None and waited >= self.timeout_s:
                self._expired = True
                # The main thread sits in a blocking Ray call: interrupt it, again if one is lost.
                while not self._done.wait(0 if not self._interrupts else 2.0) and self._interrupts < 30:
                    self._interrupts += 1
                    _thread.interrupt_main()
                return

    def __enter__(self) -> "WaitWatch":
        self.t0 = time.monotonic()
        threading.Thread(target=self._watch, daemon=True, name="moe-rl-wait-watch").start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._done.set()
        if self._expired and exc_type is KeyboardInterrupt:
            raise ResourceWait(f"gave up after {self.timeout_s:g}s waiting for resources") from None
        return False

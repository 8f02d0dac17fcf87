"""Anomaly detection over the iteration metrics (pure python).

A rolling window (default 100 iterations) per metric. Three kinds of check:
  - spike / drop: the latest *change* of a metric against the window's changes (robust z-score,
    median and MAD). Changes, not levels, so a metric that grows smoothly (a learning curve, a
    value loss that follows the return) stays quiet while a sudden jump does not. A jump alerts
    when the next iteration confirms it (still that far from the value before the jump): PPO's
    per-iteration figures blip for one iteration on healthy runs (the quickstart's value loss
    0.044 -> 12.2 -> 0.08, 0.047 -> 9.0 -> 0.03), a fault persists.
  - breach: the health tables, with bands that fit the run — normalised router entropy out of
    band, the routing health grade at danger (moe_rl.core.health: a dead expert or a collapse; the
    LM load table's CV and active-expert bands, docs/stability.md, read RL specialisation as harm, so
    they are figures, not alerts), the pre-clip gradient norm outside `grad_norm_band` times this run's own median (RL
    value losses put absolute norms anywhere), new non-finite (skipped) steps — and routing
    oscillation (the margin-aware probe-set flip rate). Breaches are judged only after
    `health_warmup` iterations (the run's own history says nothing before), and alert when they
    start, not on every iteration they last.
  - memory: an actor's RSS floor (the least of its last 3 readings) rising by more than
    `rss_growth_mb` over the window, after the warm-up (leak watch).
"""
from __future__ import annotations

import math
import os
import re
import resource
import statistics
from collections import deque
from typing import Any, Deque, Dict, List

from moe_rl.core.sections import StabilitySettings

# metric -> (which direction is an anomaly, smallest change that can be one). The floors keep
# noise quiet: a K3 or |dlogp| moving by 1e-7 is rounding, whatever its z-score; PPO's clipped
# surrogate over normalised advantages swings by a few tenths between healthy iterations (the
# quickstart went -0.15 -> +0.16, z = 6.6, after 11 iterations of history), so only a change
# beyond 0.5 can be a policy-loss spike.
# The return is the mean over the last 100 or more episodes: RLlib's own figure covers only the
# episodes that ended in the iteration (with 1 000-step iterations it fell 452 -> 217 in a healthy
# run). With the quickstart's small, frequent updates (1 000 env steps an iteration) healthy runs'
# mean KL moved 0.006 -> 0.034 (z = 7.8) and 0.015 -> 0.075 (z = 9.3), the pre-clip gradient norm
# 1.3 -> 13.6 (z = 9.9), in one iteration: a KL change below 0.25 is not a spike (the gate's own KL
# limit is at least 0.24 over the run's median), and the gradient norm has no spike check (its
# breach below, 10x the run's median, and the gate's update-size check judge harmful updates).
# A drift spike is a K3 change past the gate's own mismatch limit (1e-3) or a log-prob change past
# 0.1 (the gate's limit is 1.0; a healthy quickstart's top-k tie flipped at 0.0056).
# A load shift is a CV jump past 0.25 (a bf16 rollout copy's 0.14 -> 0.63); a healthy quickstart's
# CV swings by 0.1 (0.116 -> 0.222, z = 6.1).
WATCHED = {"episode_return_mean_100": ("drop", 0.0), "policy_loss": ("spike", 0.5), "vf_loss": ("spike", 0.0),
           "mean_kl_loss": ("spike", 0.25), "aux_loss": ("spike", 0.0), "z_loss": ("spike", 0.0),
           "drift/k3": ("spike", 1e-3), "drift/max_abs_logp_diff": ("spike", 0.1), "moe/cv": ("spike", 0.25)}
# Nor is a change within 10 % of the previous value: on a smooth history its robust z can still be
# large (a healthy quickstart: aux_loss 2.004 -> 2.054, z = 6.4, at iteration 17).
RELATIVE_FLOOR = 0.1
RSS_KEY = re.compile(r"(^|/)rss_mb(/|$)")
RSS_RECENT = 3


def rss_mb() -> float:
    """This process's resident set size now (not the peak: a leak shows as growth)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _danger_reason(row: Dict[str, Any]) -> str:
    """What made the grade danger, with the figures beside it."""
    dead, streak = row.get("moe/dead_experts"), row.get("moe/collapse_updates")
    why = []
    if _finite(dead) and dead > 0:
        why.append(f"{dead:g} dead expert(s)")
    if _finite(streak) and streak > 0:
        why.append(f"collapse for {streak:g} updates")
    figures = ", ".join(f"{k[4:]}={row[k]:.3g}" for k in ("moe/marginal_entropy_norm", "moe/router_entropy_norm",
                                                             "moe/cv", "moe/min_util") if _finite(row.get(k)))
    return f"(danger: {' and '.join(why) or 'see moe/layer*/health'}; {figures})"


class AnomalyDetector:
    def __init__(self, settings: StabilitySettings, num_experts: int, top_k: int = 1):
        self.s, self.num_experts, self.top_k = settings, num_experts, top_k
        self.window = settings.anomaly_window
        self._last: Dict[str, float] = {}
        self._jumps: Dict[str, tuple] = {}   # key -> (value before the jump, jump value, med, scale, z)
        self._changes: Dict[str, Deque[float]] = {}
        self._rss: Dict[str, Deque[float]] = {}
        self._breached: Dict[str, bool] = {}
        self._grad_norms: Deque[float] = deque(maxlen=self.window)
        self._last_skipped = 0.0
        self._seen = 0

    def restart_series(self) -> None:
        """A task schedule changed the task on purpose (continual multi-task): the return falls and
        the losses move because the task did, which is the experiment, not a fault. Each watched
        series starts again and is judged after anomaly_min_history changes; the breach checks
        (health, entropy, gradients, skipped steps, memory) go on."""
        self._last.clear()
        self._jumps.clear()
        self._changes.clear()

    def observe(self, row: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Feed one iteration's metrics row; returns the new alerts (dicts with iteration, metric,
        kind, value, message)."""
        it = int(row.get("iteration", 0))
        alerts: List[Dict[str, Any]] = []

        def alert(metric, kind, value, message):
            alerts.append({"iteration": it, "metric": metric, "kind": kind, "value": float(value),
                           "message": message})

        for key, (direction, floor) in WATCHED.items():
            v = row.get(key)
            if _finite(v):
                self._check_change(key, direction, floor, float(v), alert)
        s = self.s
        self._seen += 1
        lo, hi = s.entropy_band
        gl, gh = s.grad_norm_band
        grad = row.get("stability/grad_norm/total")
        median = statistics.median(list(self._grad_norms)) if self._grad_norms else None
        skipped = row.get("stability/skipped_steps")
        breaches = {
            "moe/router_entropy_norm": (lambda v: not lo <= v <= hi, f"outside [{lo}, {hi}]", "breach"),
            "moe/health_level": (lambda v: v >= 2, _danger_reason(row), "breach"),
            "stability/grad_norm/total": (
                lambda v: median is not None and not gl * median <= v <= gh * median,
                f"outside [{gl}, {gh}] x this run's median {median or 0:.3g}", "breach"),
            "stability/skipped_steps": (lambda v: v > self._last_skipped, "non-finite gradients: steps skipped",
                                        "breach"),
            "drift/probe_flip_rate": (lambda v: v > s.flip_rate_max, f"above {s.flip_rate_max}",
                                      "oscillation"),
        }
        judged = self._seen > s.health_warmup
        for key, (bad, what, kind) in breaches.items():
            v = row.get(key)
            if not _finite(v):
                continue
            now = judged and bool(bad(float(v)))
            if now and not self._breached.get(key, False):
                alert(key, kind, v, f"{key}={float(v):.4g} {what}")
            self._breached[key] = now
        if _finite(grad):
            self._grad_norms.append(float(grad))
        if _finite(skipped):
            self._last_skipped = float(skipped)
        for key, v in row.items():
            if judged and RSS_KEY.search(key) and _finite(v):
                self._check_rss(key, float(v), alert)
        return alerts

    def _check_change(self, key, direction, floor, v, alert) -> None:
        last = self._last.get(key)
        self._last[key] = v
        if last is None:
            return
        jump = self._jumps.pop(key, None)
        if jump is not None:   # last iteration jumped: does this one stay as far from before the jump?
            before, jumped, med, scale, _ = jump
            z = (v - before - med) / scale
            if self._is_jump(direction, v - before, before, floor, z):
                verb = "jumped" if direction == "spike" else "fell"
                alert(key, direction, v, f"{key} {verb} {before:.4g} -> {jumped:.4g} -> {v:.4g} (z={z:.1f})")
        change = v - last
        hist = self._changes.setdefault(key, deque(maxlen=self.window))
        if len(hist) >= self.s.anomaly_min_history and jump is None:
            med = statistics.median(list(hist))
            mad = statistics.median([abs(c - med) for c in hist])
            # A floor on the scale: a perfectly flat history must not turn rounding noise into alerts.
            scale = max(1.4826 * mad, 1e-3 * max(abs(last), 1e-6), 1e-12)
            z = (change - med) / scale
            if self._is_jump(direction, change, last, floor, z):
                self._jumps[key] = (last, v, med, scale, z)
        hist.append(change)

    def _is_jump(self, direction, change, last, floor, z) -> bool:
        if abs(change) <= max(floor, RELATIVE_FLOOR * abs(last)):
            return False
        return z > self.s.anomaly_z if direction == "spike" else z < -self.s.anomaly_z

    def _check_rss(self, key, v, alert) -> None:
        """A leak raises the floor: the least of the last RSS_RECENT readings against the window's
        least. A peak does not (a healthy token run's learner swung 1.7 -> 2.2 -> 1.7 GB as its
        activations changed size), nor do the warm-up iterations that allocate the working set."""
        hist = self._rss.setdefault(key, deque(maxlen=self.window))
        hist.append(v)
        growth = min(list(hist)[-RSS_RECENT:]) - min(hist)
        grown = len(hist) >= self.s.anomaly_min_history and growth > self.s.rss_growth_mb
        if grown and not self._breached.get(key, False):
            alert(key, "memory", v, f"{key} grew {growth:.0f} MB over the last {len(hist)} iterations")
        self._breached[key] = grown

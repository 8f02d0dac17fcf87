"""Anomaly detection over the iteration metrics (pure python).

A rolling window (default 100 iterations) per metric. Three kinds of check:
  - spike / drop: the latest *change* of a metric against the window's changes (robust z-score,
    median and MAD). Changes, not levels, so a metric that grows smoothly (a learning curve, a
    value loss that follows the return) stays quiet while a sudden jump does not.
  - breach: the shared health tables — normalised router entropy out of band, active experts
    below 0.8 N, CV above 1, pre-clip gradient norm out of 0.1..10 — and routing oscillation
    (probe-set flip rate). A breach alerts when it starts, not on every iteration it lasts.
  - memory: an actor's RSS growing by more than `rss_growth_mb` over the window (leak watch).
"""
from __future__ import annotations

import math
import os
import re
from collections import deque
from typing import Any, Deque, Dict, List

# metric -> (which direction is an anomaly, smallest change that can be one). The floors keep
# float noise quiet: a K3 or |dlogp| moving by 1e-7 is rounding, whatever its z-score.
WATCHED = {"episode_return_mean": ("drop", 0.0), "policy_loss": ("spike", 0.0), "vf_loss": ("spike", 0.0),
           "mean_kl_loss": ("spike", 0.0), "aux_loss": ("spike", 0.0), "z_loss": ("spike", 0.0),
           "stability/grad_norm/total": ("spike", 0.0), "drift/k3": ("spike", 1e-3),
           "drift/max_abs_logp_diff": ("spike", 1e-3), "moe/cv": ("spike", 0.05)}
RSS_KEY = re.compile(r"(^|/)rss_mb(/|$)")


def rss_mb() -> float:
    """This process's resident set size now (not the peak: a leak shows as growth)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class AnomalyDetector:
    def __init__(self, settings: Dict[str, Any], num_experts: int):
        self.s, self.num_experts = settings, num_experts
        self.window = settings["anomaly_window"]
        self._last: Dict[str, float] = {}
        self._changes: Dict[str, Deque[float]] = {}
        self._rss: Dict[str, Deque[float]] = {}
        self._breached: Dict[str, bool] = {}

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
        s, n = self.s, self.num_experts
        lo, hi = s["entropy_band"]
        gl, gh = s["grad_norm_band"]
        breaches = {
            "moe/router_entropy_norm": (lambda v: not lo <= v <= hi, f"outside [{lo}, {hi}]", "breach"),
            "moe/active_experts": (lambda v: v < 0.8 * n, f"below 0.8 N = {0.8 * n:g}", "breach"),
            "moe/cv": (lambda v: v > 1.0, "above 1.0 (danger)", "breach"),
            "stability/grad_norm/total": (lambda v: not gl <= v <= gh, f"outside [{gl}, {gh}]", "breach"),
            "drift/probe_flip_rate": (lambda v: v > s["flip_rate_max"], f"above {s['flip_rate_max']}",
                                      "oscillation"),
        }
        for key, (bad, what, kind) in breaches.items():
            v = row.get(key)
            if not _finite(v):
                continue
            now = bool(bad(float(v)))
            if now and not self._breached.get(key, False):
                alert(key, kind, v, f"{key}={float(v):.4g} {what}")
            self._breached[key] = now
        for key, v in row.items():
            if RSS_KEY.search(key) and _finite(v):
                self._check_rss(key, float(v), alert)
        return alerts

    def _check_change(self, key, direction, floor, v, alert) -> None:
        last = self._last.get(key)
        self._last[key] = v
        if last is None:
            return
        change = v - last
        hist = self._changes.setdefault(key, deque(maxlen=self.window))
        if len(hist) >= self.s["anomaly_min_history"]:
            med = _median(list(hist))
            mad = _median([abs(c - med) for c in hist])
            # A floor on the scale: a perfectly flat history must not turn rounding noise into alerts.
            scale = max(1.4826 * mad, 1e-3 * max(abs(last), 1e-6), 1e-12)
            z = (change - med) / scale
            if abs(change) <= floor:
                pass
            elif direction == "spike" and z > self.s["anomaly_z"]:
                alert(key, "spike", v, f"{key} jumped {last:.4g} -> {v:.4g} (z={z:.1f})")
            elif direction == "drop" and z < -self.s["anomaly_z"]:
                alert(key, "drop", v, f"{key} fell {last:.4g} -> {v:.4g} (z={z:.1f})")
        hist.append(change)

    def _check_rss(self, key, v, alert) -> None:
        hist = self._rss.setdefault(key, deque(maxlen=self.window))
        hist.append(v)
        growth = v - min(hist)
        grown = len(hist) >= self.s["anomaly_min_history"] and growth > self.s["rss_growth_mb"]
        if grown and not self._breached.get(key, False):
            alert(key, "memory", v, f"{key} grew {growth:.0f} MB over the last {len(hist)} iterations")
        self._breached[key] = grown

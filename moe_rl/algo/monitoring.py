"""Monitoring as an RLlib callback: once per iteration (on_train_result) the actors' memory, the
anomaly detector and the Prometheus export.

It adds to the result what the app (or any RLlib user) writes or reads:

    result["moe_rl"]["memory/rss_mb/<actor>"], ["alerts/new"], ["alerts/total"]
    result["moe_rl_alerts"]     the alerts raised this iteration (dicts: iteration, metric, kind,
                                value, message); moe_rl.app.run_dir appends them to alerts.parquet
    result["moe_rl_drift"]      the sync gate's ledger rows of this iteration (drift.parquet)

MoEPPO installs one instance on the driver (`algo.monitoring`); `run` names the series in
Prometheus (the CLI sets it to the run directory's name).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List

import ray
from ray.rllib.callbacks.callbacks import RLlibCallback

from moe_rl.algo.prometheus import PrometheusExporter
from moe_rl.algo.results import metrics_row, rolling_return_mean
from moe_rl.core.anomaly import AnomalyDetector, rss_mb
from moe_rl.core.stability import validate_stability

logger = logging.getLogger("moe_rl")


class MoEMonitoring(RLlibCallback):
    def __init__(self, algorithm, run: str = "moe_rl"):
        super().__init__()
        config = algorithm.config
        stability = validate_stability(config.stability_settings)
        self.anomaly = AnomalyDetector(stability, config.moe_settings.num_experts, config.moe_settings.top_k) \
            if stability.anomaly_detection else None
        self.prometheus = PrometheusExporter(run=run, num_experts=config.moe_settings.num_experts)
        self.alerts_total = 0
        self._ledger_seen = 0
        self._returns: List[Dict[str, Any]] = []   # (episodes, mean return) per iteration: the rolling mean
        self._segment = -math.inf   # the task schedule's latest block (moe_rl.rllib.task_metrics)

    @property
    def run(self) -> str:
        return self.prometheus.run

    @run.setter
    def run(self, name: str) -> None:
        self.prometheus.run = str(name)

    def on_train_result(self, *, algorithm, metrics_logger=None, result: Dict[str, Any], **kwargs) -> None:
        figures = result.setdefault("moe_rl", {})
        figures["memory/rss_mb/driver"] = rss_mb()
        if algorithm.config.num_env_runners > 0:
            try:
                for i, v in enumerate(algorithm.env_runner_group.foreach_env_runner(
                        lambda r: rss_mb(), local_env_runner=False)):
                    figures[f"memory/rss_mb/runner{i + 1}"] = v
            except ray.exceptions.RayError:   # a dead runner: fault tolerance handles it, not this watch
                pass
        gate = algorithm.sync_gate
        rows = gate.ledger() if gate is not None else []
        result["moe_rl_drift"] = rows[self._ledger_seen:]
        self._ledger_seen = len(rows)
        row = metrics_row(result)
        segment = latest_segment(self._segment, row.get("task_segment"))
        if self._segment > -math.inf and segment > self._segment:   # a new task block: the new task's return
            self._returns.clear()
            if self.anomaly is not None:
                self.anomaly.restart_series()
        self._segment = segment
        self._returns.append({k: row[k] for k in ("episodes", "episode_return_mean")})
        del self._returns[:-ROLLING_EPISODES]   # an iteration ends at least one episode when it counts
        rolling = rolling_return_mean(self._returns, ROLLING_EPISODES)
        row["episode_return_mean_100"] = figures["episode_return_mean_100"] = rolling
        new: List[Dict[str, Any]] = []
        if self.anomaly is not None:
            new = self.anomaly.observe(row)
            self.alerts_total += len(new)
            figures["alerts/new"], figures["alerts/total"] = len(new), self.alerts_total
            for a in new:
                logger.warning("moe-rl alert: iteration %d %s: %s", a["iteration"], a["kind"], a["message"])
        result["moe_rl_alerts"] = new
        self.prometheus.export(row, new)

    def continue_from(self, ledger_rows: int, alerts_total: int, metrics_rows=()) -> None:
        """A resumed run: the ledger, the alert count and the rolling return go on from the checkpoint's."""
        self._ledger_seen, self.alerts_total = ledger_rows, alerts_total
        self._returns = [{k: r.get(k, d) for k, d in (("episodes", 0), ("episode_return_mean", math.nan))}
                         for r in list(metrics_rows)[-ROLLING_EPISODES:]]

    def close(self) -> None:
        self.prometheus.close()


ROLLING_EPISODES = 100   # episode_return_mean_100: the mean over the last 100 or more episodes


def latest_segment(seen: float, segment: Any) -> float:
    """The latest task block after this iteration's figure (`task_segment`): blocks only move on
    (an env copy that lags behind still reports the older one), and a run's first figure is where
    it starts (-inf: none seen yet; a resumed run starts from its checkpoint's block)."""
    if not isinstance(segment, (int, float)) or not math.isfinite(segment):
        return seen
    return float(segment) if seen == -math.inf else max(seen, float(segment))

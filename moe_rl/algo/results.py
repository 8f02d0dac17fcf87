"""One iteration's results as a flat row, and rows as a Parquet table.

metrics.parquet has one row per iteration. Its columns are public API (also TensorBoard tags and,
prefixed `moe_rl_`, Prometheus names):

    iteration, env_steps_total, time_s, episode_return_mean, episode_len_mean, episodes,
    episode_return_mean_100 (the mean over the last 100 or more episodes: what the progress line and
    stop_return read; RLlib 2.60's episode_return_mean covers only the episodes that ended in the
    iteration, despite metrics_num_episodes_for_smoothing),
    policy_loss, vf_loss, entropy, mean_kl_loss, aux_loss, z_loss, weights_seq_no,
    qf_loss, qf_mean, td_error_mean        DQN's TD loss and Q statistics (algo dqn)
    moe/cv, moe/min_util, moe/max_util, moe/active_experts, moe/router_entropy,
    moe/router_entropy_norm, moe/health (healthy|warning|danger), moe/health_level (0|1|2),
    moe/dead_experts, moe/idle_experts, moe/marginal_entropy_norm, moe/collapse_updates (what the
    grade judges: moe_rl.core.health, docs/stability.md), moe/load_grade (docs/stability.md's LM table, 0|1|2),
    moe/layer{i}/<same metrics>            per MoE layer; the moe/<metric> columns hold the worst layer.
    moe/layer{i}/util/e{j}, .../logit_mean/e{j}, .../logit_std/e{j}   per expert (N <= 64)
    moe/dormant, moe/layer{i}/dormant, moe/layer{i}/dormant/e{j}   tau-dormant share of the trunk's
                                           feed-forward units (moe_rl.core.plasticity, tau 0.025)
    stability/grad_norm/<group>, stability/grad_norm/total, stability/clip_coef/<group>,
    stability/lr/<group>, stability/skipped_steps, stability/router_warmup, stability/expert_dropout
    drift/<figure>, drift/decision, drift/cause, drift/action   the consistency check (drift.parquet
                                           has every figure)
    sample_s, check_s, learn_s, sync_s, env_steps_per_s   where the iteration's time went
    alerts/new, alerts/total, memory/rss_mb/<actor>, learner/<stat>/rank{r}
    faults/<counter>, checkpoint/verified, checkpoint/verify_max_abs_diff
    task/<name>/return, .../success, .../length, task/<name>/experts/layer{i}/e{j} (share)
    task_return_mean, task_return_min      multi-task envs (moe_rl.rllib.task_metrics)
    task_segment                           a task schedule's block (the sequential schedule)
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.parquet as pq
from ray.rllib.core import ALL_MODULES, DEFAULT_MODULE_ID

from moe_rl.core.metrics import GRADES

PHASE_COLUMNS = ("sample_s", "check_s", "learn_s", "sync_s")   # moe_rl.algo.moe_algorithm's phases
LEARNER_KEYS = ("policy_loss", "vf_loss", "entropy", "mean_kl_loss", "aux_loss", "z_loss")
LEARNER_PREFIXES = ("moe/", "stability/", "correction/", "reinforce_router_loss", "replay/", "replay_anchor_loss",
                    "qf_loss", "qf_mean", "td_error_mean")   # the last: DQN's TD loss and Q statistics


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _count(v) -> int:
    n = _float(v)
    return int(n) if math.isfinite(n) else 0


def _learner_columns(learner: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    row = {prefix + k: _float(learner.get(k)) for k in LEARNER_KEYS}
    for k, v in sorted(learner.items()):
        if k.startswith(LEARNER_PREFIXES):
            row[prefix + k] = _float(v)
    level = row.get(prefix + "moe/health")
    if level is not None and not math.isnan(level):
        row[prefix + "moe/health_level"] = int(level)
        row[prefix + "moe/health"] = GRADES[int(level)]
    return row


def metrics_row(result: Dict[str, Any]) -> Dict[str, Any]:
    """One metrics.parquet row from an RLlib `algo.train()` result. One module (RLlib's
    `default_policy`): its figures under their bare names. Several (multi-agent): each under
    `<module_id>/`, and the bare `moe/...` headline figures are those of the MoE module in the
    worst health (the progress line and the anomaly watch follow them)."""
    runners = result.get("env_runners", {})
    learners = {m: v for m, v in result.get("learners", {}).items() if m != ALL_MODULES and isinstance(v, dict)}
    row = {
        "iteration": int(result.get("training_iteration", 0)),
        "env_steps_total": int(result.get("num_env_steps_sampled_lifetime",
                                          runners.get("num_env_steps_sampled_lifetime", 0))),
        "time_s": _float(result.get("time_total_s")),
        "episode_return_mean": _float(runners.get("episode_return_mean")),
        "episode_len_mean": _float(runners.get("episode_len_mean")),
        "episodes": _count(runners.get("num_episodes")),
        "weights_seq_no": _float(runners.get("weights_seq_no")),
    }
    if set(learners) <= {DEFAULT_MODULE_ID}:
        row.update(_learner_columns(learners.get(DEFAULT_MODULE_ID, {})))
    else:
        for mid, learner in sorted(learners.items()):
            row.update(_learner_columns(learner, f"{mid}/"))
        moe = [m for m in learners if "moe/health" in learners[m]]
        if moe:
            worst = max(moe, key=lambda m: _float(learners[m].get("moe/health")))
            row.update({k: v for k, v in _learner_columns(learners[worst]).items() if k.startswith("moe/")})
    row.update(task_columns(runners))
    for k, v in sorted(result.get("moe_rl", {}).items()):  # algorithm-level figures (drift, ...)
        row[k] = v if isinstance(v, str) else _float(v)
    if "env_steps" in row:   # the iteration's phases summed over its training steps
        row["env_steps_per_s"] = row.pop("env_steps") / max(sum(row.get(p, 0.0) for p in PHASE_COLUMNS), 1e-9)
    return row


def rolling_return_mean(rows: List[Dict[str, Any]], episodes: int = 100) -> float:
    """The mean training return over the last `episodes` or more episodes: whole iterations, newest
    first, weighted by the episodes that ended in each, until they hold `episodes` (fewer at the
    start of a run). NaN before any episode has ended."""
    total = count = 0.0
    for row in reversed(rows):
        n, ret = row.get("episodes", 0), row.get("episode_return_mean", math.nan)
        if n > 0 and math.isfinite(ret):
            total, count = total + n * ret, count + n
            if count >= episodes:
                break
    return total / count if count else math.nan


def task_columns(runners: Dict[str, Any]) -> Dict[str, Any]:
    """Per-task figures (moe_rl.rllib.task_metrics): return / success / length as logged, routing
    counts as each task's share of its layer's tokens, and the headline pair `task_return_mean`
    (the average over tasks, MOORE's "average return") and `task_return_min` (the worst task).
    RLlib reports a task's figures over the episodes that ended this iteration (NaN: none did);
    `task_count` (the env's number of tasks) says whether every task has a column yet."""
    row: Dict[str, Any] = {}
    totals: Dict[str, float] = {}
    for k, v in runners.items():
        if not k.startswith("task/"):
            continue
        if "/experts/" in k:
            layer = k.rsplit("/", 1)[0]
            totals[layer] = totals.get(layer, 0.0) + _float(v)
        row[k] = _float(v)
    for k in row:
        if "/experts/" in k:
            total = totals[k.rsplit("/", 1)[0]]
            row[k] = row[k] / total if total > 0 else math.nan
    # Over every task or none: a task with no episode ended this iteration (NaN) would otherwise
    # leave the average over the others, which is not the same figure.
    returns = [v for k, v in row.items() if k.endswith("/return")]
    count = _float(runners.get("task_count"))
    if returns and len(returns) == count and not any(math.isnan(v) for v in returns):
        row["task_return_mean"], row["task_return_min"] = sum(returns) / len(returns), min(returns)
    if "task_segment" in runners:
        row["task_segment"] = _float(runners["task_segment"])
    return row


def atomic_write_bytes(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def column_values(values: List[Any]) -> List[Any]:
    """One column's values with one type whatever each row held: a run's own rows differ by
    iteration (an APPO iteration with no check has no decision; an iteration with no episode no
    return), and Parquet needs one type per column. Text wins over numbers (a number in a text
    column becomes its text; NaN and None become null), numbers over flags (float where any is a
    float); nested values (lists, dicts) are kept as they are."""
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if any(isinstance(v, str) for v in present):
        return [None if v is None or (isinstance(v, float) and math.isnan(v)) else
                v if isinstance(v, str) else str(v) for v in values]
    if present and all(isinstance(v, bool) for v in present):
        return [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values]
    if present and all(isinstance(v, (int, float)) for v in present):
        if any(isinstance(v, float) for v in values) or any(isinstance(v, bool) for v in present):
            return [None if v is None else float(v) for v in values]
        return values
    return values


def write_table(path: str, rows: List[Dict[str, Any]]) -> None:
    """Rows (possibly with differing keys and types) -> one Parquet file, written atomically."""
    columns: Dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    table = pa.table({c: column_values([r.get(c) for r in rows]) for c in columns}) if rows else pa.table({})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def read_rows(path: str) -> List[Dict[str, Any]]:
    """The rows of a table a run may be rewriting as it is read. Read through one open file: the
    write replaces the file whole, and an open file keeps the version it opened, whereas pyarrow's
    path reader takes the size first and opens second, so a replace between the two tears the read
    (703 of 3000 reads against a writer in a loop, none through an open file)."""
    with open(path, "rb") as f:
        return pq.read_table(f).to_pylist()

"""The run directory: config.yaml, metrics.parquet, checkpoints/, tb/ (TensorBoard events).

metrics.parquet has one row per iteration. Its columns are public API (also TensorBoard tags):

    iteration, env_steps_total, time_s, episode_return_mean, episode_len_mean,
    policy_loss, vf_loss, entropy, mean_kl_loss, aux_loss, z_loss, weights_seq_no,
    moe/cv, moe/min_util, moe/max_util, moe/active_experts, moe/router_entropy,
    moe/router_entropy_norm, moe/health (healthy|warning|danger), moe/health_level (0|1|2),
    moe/layer{i}/<same metrics>            per MoE layer; the moe/<metric> columns hold the worst layer.
"""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Dict, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from .metrics import GRADES

LEARNER_KEYS = ("policy_loss", "vf_loss", "entropy", "mean_kl_loss", "aux_loss", "z_loss")


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def metrics_row(result: Dict[str, Any], module_id: str = "default_policy") -> Dict[str, Any]:
    """One metrics.parquet row from an RLlib `algo.train()` result."""
    runners = result.get("env_runners", {})
    learner = result.get("learners", {}).get(module_id, {})
    row = {
        "iteration": int(result.get("training_iteration", 0)),
        "env_steps_total": int(result.get("num_env_steps_sampled_lifetime",
                                          runners.get("num_env_steps_sampled_lifetime", 0))),
        "time_s": _float(result.get("time_total_s")),
        "episode_return_mean": _float(runners.get("episode_return_mean")),
        "episode_len_mean": _float(runners.get("episode_len_mean")),
        "weights_seq_no": _float(runners.get("weights_seq_no")),
    }
    row.update({k: _float(learner.get(k)) for k in LEARNER_KEYS})
    for k, v in sorted(learner.items()):
        if k.startswith("moe/"):
            row[k] = _float(v)
    level = row.get("moe/health")
    if level is not None and not math.isnan(level):
        row["moe/health_level"] = int(level)
        row["moe/health"] = GRADES[int(level)]
    for k, v in sorted(result.get("moe_rl", {}).items()):  # algorithm-level figures (drift, ...)
        row[k] = v if isinstance(v, str) else _float(v)
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


def write_table(path: str, rows: List[Dict[str, Any]]) -> None:
    """Rows (possibly with differing keys) -> one Parquet file, written atomically."""
    columns: Dict[str, None] = {}
    for r in rows:
        columns.update(dict.fromkeys(r))
    table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


class RunDir:
    """Owns one run directory. Created up front so an unwritable output fails before training."""

    def __init__(self, path: str, resolved_config: Dict[str, Any]):
        self.path = os.path.abspath(path)
        try:
            os.makedirs(os.path.join(self.path, "checkpoints"), exist_ok=True)
            atomic_write_bytes(os.path.join(self.path, "config.yaml"),
                               yaml.safe_dump(resolved_config, sort_keys=False).encode())
        except OSError as e:
            raise OSError(f"output: cannot write the run directory {self.path!r}: {e.strerror}") from None
        self.rows: List[Dict[str, Any]] = []
        self._tb = None

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.path, "checkpoints")

    def log(self, row: Dict[str, Any]) -> None:
        self.rows.append(row)
        write_table(os.path.join(self.path, "metrics.parquet"), self.rows)
        self._tensorboard(row)

    def _tensorboard(self, row: Dict[str, Any]) -> None:
        if self._tb is None:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(self.path, "tb"))
        step = row["iteration"]
        for k, v in row.items():
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def latest_checkpoint(run_dir: str) -> Optional[str]:
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    names = sorted(n for n in os.listdir(root) if n.startswith("iter_"))
    return os.path.join(root, names[-1]) if names else None

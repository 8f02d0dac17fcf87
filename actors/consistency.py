"""ConsistencyActor: training-inference drift before each weight sync, the sync gate, the ledger.

Per check it receives (as numpy or object refs, never the driver's copies of full models):
  - the rollout's recorded log-probs / top-k and the trainer's view of the same steps (before the
    update, same weights as the rollouts used);
  - the learners' shards before the update and the rollout copy's weights (parameter divergence),
    every learner's full local state (replica divergence);
  - the candidate (post-update) shards and the trainer's view of the fixed probe set.
It returns the decision (sync | warn | hold | rollback) with its reason, and appends one row to
the Parquet ledger (RUN_DIR/drift.parquet).
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from moe_rl.consistency import (breaches, drift_by_position, drift_metrics, format_breach, gate_decision,
                                param_divergence, policy_kl, routing_agreement, thresholds, update_size)
from moe_rl.metrics import flip_rate
from moe_rl.sharding import assemble_all

BF16_RTOL = 2.0 ** -8  # a bf16 copy rounds every weight by up to half an ulp (8 mantissa bits)


def _layers(topk: np.ndarray) -> List[torch.Tensor]:
    t = torch.as_tensor(np.asarray(topk, dtype=np.int64))
    return [t[:, i] for i in range(t.shape[1])]


class ConsistencyActor:
    def __init__(self, settings: Dict[str, Any], inference_dtype: str = "fp32", discrete: bool = True):
        self.s = settings
        self.limits = thresholds(settings.get("thresholds"))
        self.param_rtol = BF16_RTOL if inference_dtype == "bf16" else 0.0
        self.discrete = discrete
        self.rows: List[Dict[str, Any]] = []
        self.probe_obs = None
        self.probe_view = None        # trainer view of the probe set for the weights the rollouts run
        self.synced_state = None      # full state of the weights the rollouts run
        self.sync_id = 0

    # --- probe set --------------------------------------------------------------------------------
    def has_probe(self) -> bool:
        return self.probe_obs is not None

    def set_probe(self, obs, view: Dict[str, np.ndarray], synced_shards: list) -> None:
        import ray
        self.probe_obs, self.probe_view = obs, view
        self.synced_state = assemble_all(ray.get(list(synced_shards)))

    def get_probe(self):
        return self.probe_obs

    # --- one check --------------------------------------------------------------------------------
    def check(self, *, iteration: int, weights_seq_no: int, rollout: Dict[str, np.ndarray],
              trainer: Dict[str, np.ndarray], learner_shards: list, rollout_state: list,
              replica_shards: Optional[list], candidate_shards: list, probe_view: Dict[str, np.ndarray]):
        import ray
        t0 = time.perf_counter()
        row: Dict[str, Any] = {"iteration": iteration, "sync_id": self.sync_id, "weights_seq_no": weights_seq_no}
        # 1. log-prob drift on the batch just sampled.
        row.update({k: v for k, v in drift_metrics(torch.as_tensor(trainer["logp"]),
                                                   torch.as_tensor(rollout["logp"])).items() if k != "n"})
        if rollout.get("positions") is not None:
            by_pos = drift_by_position(torch.as_tensor(trainer["logp"]), torch.as_tensor(rollout["logp"]),
                                       torch.as_tensor(rollout["positions"]), self.s["position_bins"])
            row["k3_by_position"] = json.dumps({b: m["k3"] for b, m in by_pos.items()})
        # 2. routing agreement per layer.
        row.update(routing_agreement(_layers(trainer["topk"]), _layers(rollout["topk"])))
        # 3. parameter divergence: learner (before the update) vs the rollout copy, and replicas.
        learner_state = assemble_all(ray.get(list(learner_shards)))
        rollout_weights = ray.get(rollout_state[0])
        worst, over, mismatched = param_divergence(learner_state, rollout_weights, self.limits["param_max_diff"][1],
                                                   self.param_rtol)
        row["param_max_diff"] = worst
        row["param_breaches"] = len(over) + len(mismatched)
        lines = [format_breach(n, d, t) for n, (d, t) in sorted(over.items())]
        lines += [f"{n}: present on one side only" for n in mismatched]
        row["param_breach_lines"] = "\n".join(lines)
        row["replica_max_diff"] = self._replica_divergence(ray.get(list(replica_shards))) if replica_shards else 0.0
        # 4. the candidate weights.
        candidate = assemble_all(ray.get(list(candidate_shards)))
        finite = all(np.isfinite(v).all() for v in candidate.values())
        row["weights_finite"] = bool(finite)
        if self.synced_state is not None:
            row.update(update_size(self.synced_state, candidate))
        if self.probe_view is not None:
            row["k3_old_new"] = policy_kl(torch.as_tensor(self.probe_view["logits"]),
                                          torch.as_tensor(probe_view["logits"]), self.discrete)
            row["probe_flip_rate"] = float(np.mean([flip_rate(a, b) for a, b in zip(
                _layers(self.probe_view["topk"]), _layers(probe_view["topk"]))]))
        found = breaches(row, self.limits)
        if over or mismatched:
            found = [b for b in found if b[0] != "param_max_diff"] + [("param_max_diff", worst, self.limits[
                "param_max_diff"][1])]
        decision, reason = gate_decision(self.s["policy"], found, finite)
        if lines:
            reason = (reason + "\n" if reason else "") + "\n".join(lines[:20])
        row["decision"], row["reason"] = decision, reason
        if decision in ("sync", "warn"):
            self.synced_state, self.probe_view = candidate, probe_view
            self.sync_id += 1
        row["check_time_s"] = time.perf_counter() - t0
        self.rows.append(row)
        self._write_ledger()
        return {"decision": decision, "reason": reason, "row": row}

    def _replica_divergence(self, replicas: List[Dict[str, np.ndarray]]) -> float:
        """Non-expert tensors identical on every learner; each expert identical across the learners
        that hold it (its expert-data-parallel replicas)."""
        worst, seen = 0.0, {}
        for shard in replicas:
            for k, v in shard.items():
                if k in seen:
                    worst = max(worst, float(np.abs(seen[k].astype(np.float64) - v).max()) if v.size else 0.0)
                else:
                    seen[k] = v
        return worst

    def _write_ledger(self) -> None:
        path = self.s.get("ledger_path")
        if path:
            from moe_rl.run_dir import write_table
            write_table(path, self.rows)

    def ledger(self) -> List[Dict[str, Any]]:
        return self.rows

    def continue_ledger(self, rows: List[Dict[str, Any]]) -> None:
        """A resumed run: the checkpointed ledger rows come first, sync ids continue after them."""
        self.rows[:0] = rows
        self.sync_id = max([int(r.get("sync_id") or 0) + 1 for r in rows] + [self.sync_id])

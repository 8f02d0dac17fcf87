"""ConsistencyActor: a check's figures, computed beside the work they guard.

The sync gate (moe_rl.algo.sync_gate, on the driver) owns every piece of a check's state: the probe
set, the last good weights' view of it, the counters and the run's history of update-sized signals,
and it decides. This actor only computes figures from what it is sent, so it holds nothing a
restart would lose: `observe` (before the update; computed while the learners update) keeps its
half until `figures` (after the update) returns the check's ledger rows. Every input is small:
rollout samples and the learners' views of them (O(sample_size)), the probe views, and figures
the learners and rollout actors computed where the weights live. No model ever comes here.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Dict, Optional

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from moe_rl.core.drift import drift_by_position
from moe_rl.core.drift_kinds import PolicyKind, lag_figures, mismatch_figures, probe_figures
from moe_rl.core.sections import ConsistencySettings


def policy_lag_figures(kind: PolicyKind, lag: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """Policy lag, never mismatch: policy_lag_mean / _max (synced versions between a sampled
    step's weights and the synced ones), policy_lag_share (steps taken at older weights) and how
    far the policy moved across the lag (policy_lag_k3 or policy_lag_q_gap: the trainer at the
    synced weights against the rollout on those steps)."""
    if not lag or not len(lag["versions"]):
        return {}
    versions = lag["versions"]
    out = {"policy_lag_mean": float(versions.mean()), "policy_lag_max": int(versions.max()),
           "policy_lag_share": float((versions > 0).mean())}
    if "trainer" in lag:
        out.update(lag_figures(kind, lag["rollout"], lag["trainer"], "policy_lag"))
    return out


class ConsistencyActor:
    def __init__(self, settings: ConsistencySettings, kinds: Dict[str, PolicyKind]):
        self.s = settings
        self.kinds = kinds
        self._observed: Optional[Dict[str, Any]] = None   # observe()'s half of the check in progress

    def observe(self, *, iteration: int, version: int, sync_id: int, lag: int, rollout: Dict[str, Dict[str, Any]],
                trainer: Dict[str, Dict[str, Any]], policy_lag: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """The check's first half, sent before the update and computed while it runs, per module:
        mismatch (lag == 0) or the lagged learners' divergence (lag > 0), and the policy-lag
        figures. lag: updates the learners were ahead of the rollouts *before* this update (0: the
        same weights). rollout / trainer: the rollout's recorded steps and the learners' view of
        them. policy_lag: each sampled step's lag in synced versions and, when lag == 0, the
        rollout's and the trainer's figures on the steps taken at older weights."""
        t0 = time.perf_counter()
        rows: Dict[str, Dict[str, Any]] = {}
        for mid in sorted(set(trainer) | set(policy_lag or {})):
            kind = self.kinds.get(mid, PolicyKind())
            row = rows[mid] = {"iteration": iteration, "module_id": mid, "sync_id": sync_id,
                               "weights_version": version, "lag_versions": lag}
            r, t = rollout.get(mid), trainer.get(mid)
            if r is not None and t is not None and len(r["actions"]):
                if lag == 0:     # the same weights: training-inference mismatch
                    row.update(mismatch_figures(kind, r, t))
                    row["mismatch_steps"] = len(r["actions"])   # the steps taken at the synced weights
                    if r.get("positions") is not None and kind.policy == "categorical":
                        by_pos = drift_by_position(torch.as_tensor(t["logp"]), torch.as_tensor(r["logp"]),
                                                   torch.as_tensor(r["positions"]), self.s.position_bins)
                        row["k3_by_position"] = json.dumps({b: m["k3"] for b, m in by_pos.items()})
                else:            # the learners are ahead: policy lag, never mismatch
                    row.update(lag_figures(kind, r, t, "lag"))
            row.update(policy_lag_figures(kind, (policy_lag or {}).get(mid)))
        self._observed = {"rows": rows, "seconds": time.perf_counter() - t0}

    def figures(self, *, stats: Dict[str, Any], old_probe: Dict[str, Dict[str, Any]],
                candidate_probe: Dict[str, Dict[str, Any]], skipped: Optional[Dict[str, Dict[str, int]]] = None,
                iteration: int, version: int, sync_id: int, lag: int,
                q_reference: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
        """The check's second half, after the update, on what `observe` saw before it: the
        candidate's update size per parameter group and finiteness (stats: the learners'
        weight_stats against the last synced weights), its view of the probe set against the last
        good weights' (old_probe; q_reference: a Q-policy's recent Q scale on it, per module), and
        the steps the rollout correction emptied (skipped: the learners' SkippedSteps.last).
        -> {"rows": one per module, "seconds"}."""
        seen, self._observed = self._observed, None
        if seen is None:
            raise RuntimeError("ConsistencyActor.figures: no observe() before this update")
        rows = seen["rows"]
        t0 = time.perf_counter()
        for mid in sorted(set(rows) | set(candidate_probe) | set(stats["terms"])):
            row = rows.setdefault(mid, {"iteration": iteration, "module_id": mid, "sync_id": sync_id,
                                        "weights_version": version, "lag_versions": lag})
            for group, (sq_diff, sq_ref) in sorted(stats["terms"].get(mid, {}).items()):
                row[f"update_size/{group}"] = math.sqrt(sq_diff) / max(math.sqrt(sq_ref), 1e-12)
            row.update(probe_figures(self.kinds.get(mid, PolicyKind()), old_probe.get(mid), candidate_probe.get(mid),
                                     self.s.flip_margin, (q_reference or {}).get(mid, 0.0)))
            sk = (skipped or {}).get(mid)
            if sk and sk.get("steps"):
                row["correction_skipped_steps"] = int(sk["skipped"])
                row["correction_emptied"] = sk["skipped"] == sk["steps"]
                row["correction_in_a_row"] = int(sk.get("in_a_row", 1))
            row["weights_finite"] = bool(stats["finite"])
        return {"rows": rows, "seconds": seen["seconds"] + time.perf_counter() - t0}


def start_consistency_actor(settings: ConsistencySettings, kinds: Dict[str, PolicyKind]):
    """The ConsistencyActor, on the caller's (the driver's) own node. It asks for no resources, so
    Ray may place it on any node; on another host, losing that host ended a run that the learners'
    rebuild would have saved (tests/test_two_hosts.py). Here it shares the fate of the driver,
    whose loss ends the run anyway."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(ConsistencyActor).options(num_cpus=0, scheduling_strategy=here).remote(settings, kinds)

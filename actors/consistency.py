"""ConsistencyActor: one check per weight sync, the gate's decision, one ledger row per module.

It holds what must outlive a check: the fixed probe set and the last good weights' view of it,
the gate's counters and the run's own history of update-sized signals (moe_rl.core.gate). Every
input is small: rollout samples and the learners' views of them (O(sample_size)), and figures the
learners and rollout actors computed where the weights live (update-size terms, finiteness,
digest comparisons). No model ever comes here.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from moe_rl.core.drift import drift_by_position, drift_metrics, policy_kl, routing_agreement
from moe_rl.core.gate import GateState, breaches, mismatch_limits
from moe_rl.core.metrics import topk_sets_equal
from moe_rl.core.routing import decode_top_k
from moe_rl.core.sections import ConsistencySettings


def _layers(topk) -> List[torch.Tensor]:
    t = torch.as_tensor(np.asarray(topk, dtype=np.int64))
    return [t[:, i] for i in range(t.shape[1])]


def probe_flip_rate(old: Dict[str, np.ndarray], new: Dict[str, np.ndarray], margin: float) -> float:
    """Share of probe tokens (mean over layers) whose greedy top-k set changed *and* whose old
    top-k margin exceeded `margin`: a near-uniform router flips at tiny logit changes, which is
    not routing oscillation."""
    rates = []
    old_margin = np.asarray(old["margin"])
    for i, (a, b) in enumerate(zip(_layers(old["topk"]), _layers(new["topk"]))):
        changed = ~topk_sets_equal(decode_top_k(a)[0], decode_top_k(b)[0]).numpy()
        rates.append(float(np.mean(changed & (old_margin[:, i] > margin))) if len(changed) else 0.0)
    return float(np.mean(rates)) if rates else 0.0


def k3_by_expert(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, topk) -> Dict[int, Dict[int, float]]:
    """K3 grouped by the experts each token used at rollout, per layer ({layer: {expert: K3}}):
    one drifting expert shows even when the batch mean hides it."""
    log_r = trainer_logp.double() - rollout_logp.double()
    k3 = log_r.exp() - 1 - log_r
    out: Dict[int, Dict[int, float]] = {}
    for layer, chosen in enumerate(_layers(topk)):
        experts = decode_top_k(chosen)[0]
        out[layer] = {int(e): float(k3[(experts == e).any(-1)].mean()) for e in torch.unique(experts).tolist()}
    return out


def policy_lag_figures(lag: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """Policy lag, never mismatch: policy_lag_mean / _max (synced versions between a sampled
    step's weights and the synced ones), policy_lag_share (steps taken at older weights) and
    policy_lag_k3 (K3 of the trainer at the synced weights vs the rollout on those steps: how far
    the policy moved across the lag)."""
    if not lag or not len(lag["versions"]):
        return {}
    versions = np.asarray(lag["versions"])
    out = {"policy_lag_mean": float(versions.mean()), "policy_lag_max": int(versions.max()),
           "policy_lag_share": float((versions > 0).mean())}
    if "trainer_logp" in lag:
        out["policy_lag_k3"] = drift_metrics(torch.as_tensor(lag["trainer_logp"]),
                                             torch.as_tensor(lag["rollout_logp"]))["k3"]
    return out


class ConsistencyActor:
    def __init__(self, settings: ConsistencySettings, discrete: Dict[str, bool]):
        self.s = settings
        self.discrete = discrete
        self.limits = mismatch_limits(settings.thresholds)
        self.state = GateState(settings)
        self.probe_obs: Optional[Dict[str, Any]] = None
        self.probe_view: Optional[Dict[str, Dict[str, np.ndarray]]] = None   # of the last good weights
        self.sync_id = 0
        self._observed: Optional[Dict[str, Any]] = None   # observe()'s half of the check in progress

    # --- probe set --------------------------------------------------------------------------------
    def set_probe(self, obs: Dict[str, Any], view: Dict[str, Dict[str, np.ndarray]]) -> None:
        self.probe_obs, self.probe_view = obs, view

    def get_probe(self) -> Optional[Dict[str, Any]]:
        return self.probe_obs

    # --- one check --------------------------------------------------------------------------------
    def _drift(self, mid: str, rollout: Dict[str, Any], trainer: Dict[str, Any], row: Dict[str, Any]) -> None:
        t, r = torch.as_tensor(trainer["logp"]), torch.as_tensor(rollout["logp"])
        row.update({k: v for k, v in drift_metrics(t, r).items() if k != "n"})
        row["mismatch_steps"] = len(r)   # the steps taken at the synced weights, which mismatch is measured on
        if rollout.get("positions") is not None:
            by_pos = drift_by_position(t, r, torch.as_tensor(rollout["positions"]), self.s.position_bins)
            row["k3_by_position"] = json.dumps({b: m["k3"] for b, m in by_pos.items()})
        row.update(routing_agreement(_layers(trainer["topk"]), _layers(rollout["topk"])))
        by_expert = k3_by_expert(t, r, rollout["topk"])
        if by_expert:
            row["k3_by_expert"] = json.dumps(by_expert)
            where, worst = max(((f"layer{l}/e{e}", v) for l, d in by_expert.items() for e, v in d.items()),
                               key=lambda kv: kv[1])
            row["k3_expert_max"], row["k3_expert_max_at"] = worst, where

    def observe(self, *, iteration: int, version: int, lag: int, rollout: Dict[str, Dict[str, Any]],
                trainer: Dict[str, Dict[str, Any]], policy_lag: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
        """The check's first half, sent before the update and computed while it runs: per module,
        mismatch (lag == 0) or the lagged learners' K3 (lag > 0), and the policy-lag figures.
        lag: updates the learners were ahead of the rollouts *before* this update (0: same
        weights). rollout / trainer: the rollout's recorded steps and the learners' view of them.
        policy_lag: each sampled step's lag in synced versions and, when lag == 0, the rollout's
        and the trainer's log-probs of the steps taken at older weights (the divergence across
        the lag)."""
        t0 = time.perf_counter()
        rows: Dict[str, Dict[str, Any]] = {}
        mismatch = []
        for mid in sorted(set(trainer) | set(policy_lag or {})):
            row = rows[mid] = {"iteration": iteration, "module_id": mid, "sync_id": self.sync_id,
                               "weights_version": version, "lag_versions": lag}
            if mid in trainer and mid in rollout and len(rollout[mid]["logp"]):
                if lag == 0:     # same weights: training-inference mismatch
                    self._drift(mid, rollout[mid], trainer[mid], row)
                    mismatch += [(f"{mid}/{k}" if len(trainer) > 1 else k, v, thr)
                                 for k, v, thr in breaches(row, self.limits)]
                else:            # the learners are ahead: policy lag, never mismatch
                    row["lag_k3"] = drift_metrics(torch.as_tensor(trainer[mid]["logp"]),
                                                  torch.as_tensor(rollout[mid]["logp"]))["k3"]
            row.update(policy_lag_figures((policy_lag or {}).get(mid)))
        self._observed = {"iteration": iteration, "version": version, "lag": lag, "rows": rows,
                          "mismatch": mismatch, "seconds": time.perf_counter() - t0}

    def check(self, *, stats: Dict[str, Any], candidate_view: Dict[str, Dict[str, Any]],
              corrupt: List[str], replicas: List[str], repairs: int = 0,
              skipped: Optional[Dict[str, Dict[str, int]]] = None) -> Dict[str, Any]:
        """The check's second half, after the update, on what `observe` saw before it: the
        candidate's update size and finiteness (stats: the learners' weight_stats against the
        last synced weights) and its view of the probe set, then the decision. corrupt /
        replicas: breach lines found by digest comparisons (rollout copies vs synced weights;
        learners holding the same tensor). skipped: per module, the update's steps and the steps
        skipped because the rollout correction kept nothing (the learners' SkippedSteps.last)."""
        seen, self._observed = self._observed, None
        if seen is None:
            raise RuntimeError("ConsistencyActor.check: no observe() before this update")
        lag, rows = seen["lag"], seen["rows"]
        candidate_lag = lag + 1   # the update-sized signals are judged, and kept, per update
        t0 = time.perf_counter()
        # A corrupt copy sampled this batch: its drift is that cause's, not mismatch.
        mismatch = [] if corrupt else seen["mismatch"]
        signals, held, all_rejected = {}, {}, []
        for mid in sorted(set(rows) | set(candidate_view) | set(stats["terms"])):
            row = rows.setdefault(mid, {"iteration": seen["iteration"], "module_id": mid, "sync_id": self.sync_id,
                                        "weights_version": seen["version"], "lag_versions": lag})
            for group, (sq_diff, sq_ref) in sorted(stats["terms"].get(mid, {}).items()):
                row[f"update_size/{group}"] = math.sqrt(sq_diff) / max(math.sqrt(sq_ref), 1e-12)
            old = (self.probe_view or {}).get(mid)
            new = candidate_view.get(mid)
            if old is not None and new is not None:
                row["k3_old_new"] = policy_kl(torch.as_tensor(old["logits"]), torch.as_tensor(new["logits"]),
                                              self.discrete.get(mid, True))
                row["probe_flip_rate"] = probe_flip_rate(old, new, self.s.flip_margin)
            sk = (skipped or {}).get(mid)
            emptied = bool(sk and sk.get("steps") and sk["skipped"] == sk["steps"])
            if sk and sk.get("steps"):
                row["correction_skipped_steps"] = int(sk["skipped"])
            if emptied:
                all_rejected.append(f"{mid}: the rollout correction kept no step of the update ({sk['steps']} "
                                    f"steps skipped; {sk.get('in_a_row', 1)} updates in a row)")
            for k, v in row.items():
                if self.state.signal(k):   # an emptied update's figures are no history (below)
                    (held if emptied else signals)[f"{mid}|{k}"] = v
            row["weights_finite"] = bool(stats["finite"])
        found = self.state.update_breaches(signals, candidate_lag)
        if lag > 0:   # an emptied update applied nothing, but the held updates before it still differ
            found += self.state.update_breaches(held, lag)
        bad = [(k.split("|", 1)[1] if len(rows) == 1 else k.replace("|", "/"), v, t) for k, v, t in found]
        verdict = self.state.decide(finite=bool(stats["finite"]), bad_update=bad, mismatch=mismatch,
                                    corrupt=corrupt, replicas=replicas, all_rejected=all_rejected)
        if verdict.decision in ("sync", "warn"):
            self.state.accept(signals, candidate_lag, {k for k, _, _ in found})
            self.probe_view = candidate_view
            self.sync_id += 1
        elapsed = seen["seconds"] + time.perf_counter() - t0
        out_rows = []
        for mid, row in sorted(rows.items()):
            row.update({"decision": verdict.decision, "cause": ";".join(verdict.causes),
                        "action": ";".join(verdict.actions), "reason": verdict.reason,
                        "param_breach_lines": "\n".join(corrupt + replicas),
                        "holds_in_a_row": self.state.holds_in_a_row,
                        "rollbacks_in_a_row": self.state.rollbacks_in_a_row, "repairs": repairs,
                        "lr_scale_next": verdict.lr_scale, "check_time_s": elapsed})
            out_rows.append(row)
        return {"verdict": asdict(verdict), "rows": out_rows}

    # --- state (checkpointed with the run) ---------------------------------------------------------
    def get_state(self) -> Dict[str, Any]:
        return {"gate": self.state.get_state(), "sync_id": self.sync_id, "probe_obs": self.probe_obs,
                "probe_view": self.probe_view}

    def set_state(self, state: Dict[str, Any]) -> None:
        self.state.set_state(state.get("gate", {}))
        self.sync_id = int(state.get("sync_id", self.sync_id))
        if state.get("probe_obs") is not None:
            self.probe_obs, self.probe_view = state["probe_obs"], state["probe_view"]


def start_consistency_actor(settings: ConsistencySettings, discrete: Dict[str, bool]):
    """The ConsistencyActor, on the caller's (the driver's) own node. It asks for no resources, so
    Ray may place it on any node; it holds the gate's state, and on another host, losing that host
    ended a run that the learners' rebuild would have saved (tests/test_two_hosts.py). Here it
    shares the fate of the driver, whose loss ends the run anyway."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(ConsistencyActor).options(num_cpus=0, scheduling_strategy=here).remote(settings, discrete)

"""SyncGate: the driver's one gate between the learners and the rollout actors, and the one owner
of a check's state.

It holds the synced weights (moe_rl.algo.synced_weights: their version, parts and digests, the
learners' last good state), the probe set and the last good weights' view of it, the decision
state (moe_rl.core.gate.GateState: counters, the run's history of update-sized signals) and the
ledger. The consistency actor only computes figures from what the gate sends it (a cache of
nothing: actors/consistency.py). The algorithm calls

    gate.check_due()                 whether this training step is checked (every K-th sync; every
                                     one while holding)
    gate.before_update(episodes, i)  rollout copies vs the synced weights (digests; repair at once),
                                     the learners' view of a rollout sample (mismatch, policy lag)
    gate.note_update()               <the learners updated>
    gate.after_update(i) -> Verdict  replicas, update size and finiteness, the candidate's view of
                                     the probe set -> sync | warn | hold | rollback | stop (GateStop)
    gate.sync(prepare_check)         the learners' parts to the rollout actors (version v + 1)

and reads nothing of the algorithm: it is given the env-runner group and how to reach the current
learner group.

A check runs beside the work it guards: the rollout copies' digests (a thread) and the actor's
mismatch and lag figures while the learners update; the synced version's digests and last good
state while the next batch samples (`prepare_check`); where the rollouts wait for the sync
(`rollouts_wait`: PPO and DQN, not APPO), the candidate travels to them while it is judged and is
withdrawn (the synced version sent back, with its number) unless the verdict syncs.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional

import numpy as np
import ray
import torch
import tree

from moe_rl.actors.consistency import start_consistency_actor
from moe_rl.algo.synced_weights import GateStop, SyncedWeights
from moe_rl.core.drift_kinds import q_scale
from moe_rl.core.gate import GateState, Verdict, mismatch_limits
from moe_rl.core.sections import ConsistencySettings, WeightSyncSettings
from moe_rl.rllib.rollout_sample import rollout_sample
from moe_rl.rllib.runner import runner_modules

logger = logging.getLogger("moe_rl")
__all__ = ["SyncGate", "GateStop"]

# A check's headline figures, logged per iteration as drift/<name> in metrics.parquet (drift.parquet
# has every figure): the categorical and the Q-policy's, the routing's, lag and probe.
HEADLINES = ("k1", "k3", "max_abs_logp_diff", "greedy_agreement", "q_gap_max_rel", "routing_agreement",
             "combine_tv_max", "lag_versions", "lag_k3", "lag_q_gap", "k3_old_new", "q_change", "probe_flip_rate",
             "policy_lag_mean", "policy_lag_k3", "policy_lag_q_gap")


def _skipped_steps(learner) -> Dict[str, Dict[str, int]]:
    return dict(learner.skipped_steps.last) if hasattr(learner, "skipped_steps") else {}


def _pick(x, mask):
    return x[mask] if isinstance(x, np.ndarray) else x


class SyncGate:
    def __init__(self, env_runner_group, learners: Callable[[], Any], num_learners: int,
                 consistency: ConsistencySettings, weight_sync: WeightSyncSettings, rollouts_wait: bool = False):
        """learners(): the current learner group (a rebuilt one after a learner failure).
        rollouts_wait: the rollout actors sample only after the sync (synchronous sampling)."""
        self.s = consistency
        self.checks = consistency.enabled
        self.weights = SyncedWeights(env_runner_group, learners, num_learners, self.checks, consistency.param_sample,
                                     weight_sync)
        self.state = GateState(consistency)
        self.limits = mismatch_limits(consistency.thresholds)
        self.rows: List[Dict[str, Any]] = []   # the ledger (drift.parquet)
        self.repairs = 0
        self.sync_id = 0                  # accepted candidates
        self.steps = 0                    # training steps seen (consistency.every counts them)
        self.updates_since_sync = 0       # > 0: the learners are ahead of the rollouts (a hold)
        self.probe: Optional[Dict[str, Any]] = None        # fixed probe observations, per module
        self.probe_view: Dict[str, Dict[str, Any]] = {}    # the synced (last good) weights' view of them
        self.probe_version = -1                            # the version probe_view is of
        self.q_scales: Dict[str, Deque[float]] = {}        # a Q-policy's recent probe_view scales (q_change)
        self._lag_before: Optional[int] = None             # set by before_update: a check is in progress
        self._observed: Optional[ray.ObjectRef] = None     # the actor's first half of the check
        self._copies = None
        self._candidate = None   # (its parts, their push to the rollout actors) before the verdict
        self.speculative = rollouts_wait and self.weights.transport is None
        self.actor = None
        if self.checks:
            self.kinds = {mid: mod.policy_kind for mid, mod in
                          self.weights.runner_call(lambda r: {m: mod for m, mod in runner_modules(r).items()
                                                              if hasattr(mod, "policy_kind")})[1][0].items()}
            self.actor = start_consistency_actor(consistency, self.kinds)

    # --- what the algorithm asks ------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The version of the weights the rollout actors run."""
        return self.weights.version

    @property
    def holding(self) -> bool:
        """The learners are ahead of the rollouts (a hold): every step is checked."""
        return self.updates_since_sync > 0

    def check_due(self, ahead: int = 0) -> bool:
        """consistency.every: a check before every K-th training step (each one sync), and at every
        step while holding. ahead=0 counts this step; ahead=1: whether the next one is due."""
        if ahead:
            return self.checks and self.steps % self.s.every == 0
        self.steps += 1
        return self.checks and (self.holding or (self.steps - 1) % self.s.every == 0)

    def note_update(self) -> None:
        self.updates_since_sync += 1

    def sync(self, prepare_check: bool = False) -> None:
        candidate, self._candidate = self._candidate, None
        self.weights.sync(candidate, prepare_check and self.checks)
        self.updates_since_sync = 0

    def runner_call(self, fn, runner_ids=None, **kwargs):
        return self.weights.runner_call(fn, runner_ids, **kwargs)

    def push_synced_weights(self, runner_ids=None, force: bool = False) -> None:
        self.weights.push(runner_ids, force)

    def settle(self) -> None:
        self.weights.settle()

    def collective_fallbacks(self) -> Optional[int]:
        return self.weights.collective_fallbacks()

    def ledger(self) -> List[Dict[str, Any]]:
        return self.rows

    # --- before the update ------------------------------------------------------------------------
    def before_update(self, episodes, iteration: int) -> None:
        self.weights.settle()
        self.weights.keep_synced_state()
        group = self.weights.group
        data = rollout_sample(episodes, self.s.sample_size, seed=iteration, modules=set(self.kinds))
        if self.probe is None and data:   # once per run (a restored run's comes with its checkpoint)
            self.probe = {mid: tree.map_structure(lambda x: x[: self.s.probe_size], d["obs"])
                          for mid, d in data.items()}
        lag = self.updates_since_sync
        if self.probe is not None and lag == 0 and self.probe_version != self.version:
            # The synced version's view of the probe set, what a candidate one update past it is
            # measured against. Taken here, where the learners hold it, when syncs went by unchecked
            # (consistency.every > 1): the last accepted candidate's view would be several updates
            # old, and a candidate judged as one update would carry all of them.
            self._set_probe_view(group.trainer_view({mid: {"obs": o} for mid, o in self.probe.items()},
                                                    replay=False), self.version)
        asked = {mid: {"obs": d["obs"], "actions": d["actions"], "routing": d.get("routing")}
                 for mid, d in data.items()}
        view = group.trainer_view(asked) if asked else {}   # each module replays as it trains
        rollout, trainer, policy_lag = {}, {}, {}
        for mid, d in data.items():
            # Each step's policy lag: how many syncs ago the weights it was taken with were synced
            # (an episode that began before the last sync, or an asynchronous rollout, carries
            # older steps). Mismatch is measured on the steps taken with the synced version
            # (the learners hold it when lag == 0): the same weights on both sides.
            versions = self.version - np.asarray(d["seq"], dtype=np.int64)
            same = versions == 0 if lag == 0 else np.ones(len(versions), bool)
            rollout[mid] = tree.map_structure(lambda x: _pick(x, same), {k: v for k, v in d.items() if k != "obs"})
            trainer[mid] = tree.map_structure(lambda x: _pick(x, same), view[mid])
            policy_lag[mid] = {"versions": versions}
            if lag == 0 and (~same).any():   # the trainer's view at v of steps taken at older weights
                policy_lag[mid].update(rollout=tree.map_structure(lambda x: _pick(x, ~same), rollout_fields(d)),
                                       trainer=tree.map_structure(lambda x: _pick(x, ~same), view[mid]))
        # The rollout copies' digests are taken while the learners update (after the trainer's
        # view: beside it, on two cores, both ran slower): the rollout actors are idle then (PPO)
        # or sampling (APPO), and a copy that differs is repaired before the next sync (or the
        # hold that keeps the rollouts on the synced weights). The actor computes its figures then too.
        self._copies = self.weights.background.submit(self.weights.corrupt_copies)
        self._observed = self.actor.observe.remote(iteration=iteration + 1, version=self.version,
                                                   sync_id=self.sync_id, lag=lag, rollout=rollout, trainer=trainer,
                                                   policy_lag=policy_lag)
        self._lag_before = lag

    # --- after the update -------------------------------------------------------------------------
    def after_update(self, iteration: int) -> Verdict:
        lag_before, self._lag_before = self._lag_before, None
        corrupt, repairs = self.weights.repair(self._copies.result(), iteration)
        self.repairs += repairs
        replicas = self.weights.diverged_replicas(iteration)
        if self.speculative:   # the rollouts wait: the candidate travels while it is judged
            self._candidate = self.weights.send_candidate()
        group = self.weights.group
        try:
            stats = group.weight_stats(self.weights.reference_refs())
            candidate = (group.trainer_view({mid: {"obs": o} for mid, o in self.probe.items()}, replay=False)
                         if self.probe else {})
            # The learners agree on skipped steps (a collective decision): the first one's figures.
            skipped = group.publishers(_skipped_steps)[0]
            ray.get(self._observed)
            self._observed = None
            found = ray.get(self.actor.figures.remote(
                stats=stats, old_probe=self.probe_view, candidate_probe=candidate, skipped=skipped,
                iteration=iteration + 1, version=self.version, sync_id=self.sync_id, lag=lag_before,
                q_reference={mid: statistics.median(v) for mid, v in self.q_scales.items() if v}))
        except BaseException:   # no verdict: nothing unjudged may stay with the rollout actors
            self._withdraw_candidate()
            raise
        verdict = self._decide(found["rows"], lag_before, bool(stats["finite"]), corrupt, replicas, found["seconds"])
        if verdict.decision not in ("sync", "warn"):
            self._withdraw_candidate()
        else:   # the candidate becomes the synced version next
            self._set_probe_view(candidate, self.version + 1)
            self.sync_id += 1
        causes = [c for c in verdict.causes if c != "corrupt_copy"]   # repairs were logged when made
        if causes:   # one line; every breach and per-tensor line is in the ledger (drift.parquet)
            logger.warning("moe-rl gate: iteration %d %s (%s): %s", iteration + 1,
                           ";".join(a for a in verdict.actions if a != "repair"), ";".join(causes),
                           "; ".join(verdict.headlines[c] for c in causes))
        if verdict.decision in ("rollback", "stop"):
            self.weights.restore_last_good()
            self.updates_since_sync = 0
        if verdict.decision == "stop":
            raise GateStop(f"bad_update: {verdict.reason} after {self.s.max_rollbacks} rollbacks "
                           f"(one is forgiven only after as many passing checks in a row); "
                           f"the learners hold the last good weights; the run stays resumable: moe-rl train "
                           f"--resume RUN_DIR (consider a lower training.lr)")
        group.set_lr_scale(verdict.lr_scale)
        return verdict

    def _decide(self, rows: Dict[str, Dict[str, Any]], lag: int, finite: bool, corrupt: List[str],
                replicas: List[str], seconds: float) -> Verdict:
        """The decision (moe_rl.core.gate.GateState.judge), its rows into the ledger, its headline
        figures for metrics.parquet."""
        verdict = self.state.judge(rows, lag, finite, corrupt, replicas, self.limits)
        for _, row in sorted(rows.items()):
            row.update({"repairs": self.repairs, "check_time_s": seconds})
            self.rows.append(row)
        verdict.figures = {k: v for k, v in self.rows[-1].items() if k in HEADLINES} if rows else {}
        verdict.figures["repairs"] = self.repairs
        return verdict

    def _set_probe_view(self, view: Dict[str, Dict[str, Any]], version: int) -> None:
        """The synced version's view of the probe set; a Q-policy's Q scale on it joins the recent
        ones, the floor its q_change is measured over (moe_rl.core.drift_kinds.q_change)."""
        self.probe_view, self.probe_version = view, version
        for mid, v in view.items():
            if "q" in v:
                self.q_scales.setdefault(mid, deque(maxlen=self.s.relative_window)).append(
                    q_scale(torch.as_tensor(np.asarray(v["q"]))))

    def _withdraw_candidate(self) -> None:
        candidate, self._candidate = self._candidate, None
        if candidate is not None:
            self.weights.withdraw(candidate)

    # --- checkpoints --------------------------------------------------------------------------------
    def get_state(self) -> Dict[str, Any]:
        """Everything a check needs to go on where it stopped; the actor holds nothing of it."""
        if not self.checks:
            return {}
        return {"gate": self.state.get_state(), "sync_id": self.sync_id, "repairs": self.repairs, "steps": self.steps,
                "probe_obs": self.probe, "probe_view": self.probe_view, "probe_version": self.probe_version,
                "q_scales": {mid: list(v) for mid, v in self.q_scales.items()}}

    def set_state(self, state: Dict[str, Any]) -> None:
        if not self.checks:
            return
        kept = state.get("actor", state)   # a checkpoint from when the actor kept the gate's state
        self.state.set_state(kept.get("gate", {}))
        self.sync_id = int(kept.get("sync_id", self.sync_id))
        self.repairs = int(state.get("repairs", 0))
        self.steps = int(state.get("steps", self.steps))
        if kept.get("probe_obs") is not None:
            self.probe, self.probe_view = kept["probe_obs"], kept["probe_view"]
            self.probe_version = int(state.get("probe_version", -1))   # restored weights: a new version
        self.q_scales = {mid: deque(v, maxlen=self.s.relative_window) for mid, v in state.get("q_scales", {}).items()}

    def close(self) -> None:
        self.weights.close()
        if self.actor is not None:
            ray.kill(self.actor)


def rollout_fields(d: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in d.items() if k != "obs"}

"""SyncGate: the driver's one gate between the learners and the rollout actors.

It owns the synced weights (their version, which the rollout actors record per step as RLlib's
WEIGHTS_SEQ_NO; the learners' published parts and their digests; the last good learner state)
and, with consistency checks on, the consistency actor and its probe set. The algorithm calls

    gate.before_update(episodes, i)  rollout copies vs the synced weights (digests; repair at once),
                                     the learners' view of a rollout sample (mismatch, policy lag)
    gate.note_update()               <the learner update happened>
    gate.after_update(i)             replicas (digests; resync), update size + finiteness (computed
                                     on the learners), the candidate's view of the probe set ->
                                     sync | warn | hold | rollback | stop (GateStop)
    gate.sync(prepare_check)         the learners' parts to the rollout actors (version v + 1)

and reads nothing of the algorithm: it is given the env-runner group and how to reach the current
learner group. The decisions are the consistency actor's (actors/consistency.py, moe_rl.core.gate).

A check runs beside the work it guards, where no bad candidate can get through that way: the
rollout copies' digests (a thread) and the actor's mismatch and lag figures while the learners
update; the synced version's digests and last good state while the next batch samples
(`prepare_check`); where the rollouts wait for the sync (`rollouts_wait`: PPO, not APPO), the
candidate travels to them while it is judged and is withdrawn (the synced version sent back,
with its number) unless the verdict syncs.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import ray
import tree

from moe_rl.actors.consistency import start_consistency_actor
from moe_rl.algo.weight_sync import CollectiveWeightSync
from moe_rl.core.digests import Sample, differing, max_abs_diff, sample_of
from moe_rl.core.drift import format_breach
from moe_rl.core.sections import ConsistencySettings, WeightSyncSettings
from moe_rl.rllib.rl_module import MoEPolicyModule
from moe_rl.rllib.rollout_sample import rollout_sample
from moe_rl.rllib.runner import load_shards_into_runner, runner_digests, runner_dtypes, runner_modules, runner_tensor

logger = logging.getLogger("moe_rl")


class GateStop(RuntimeError):
    """The gate stopped the run; str() is one line: the cause, the metric, its value and threshold,
    and how to resume."""


def _skipped_steps(learner) -> Dict[str, Dict[str, int]]:
    return dict(learner.skipped_steps.last) if hasattr(learner, "skipped_steps") else {}


def _merge(parts: List[Dict[str, Dict]]) -> Dict[str, Dict]:
    out: Dict[str, Dict] = {}
    for p in parts:
        for mid, d in p.items():
            out.setdefault(mid, {}).update(d)
    return out


class SyncGate:
    def __init__(self, env_runner_group, learners: Callable[[], Any], num_learners: int,
                 consistency: ConsistencySettings, weight_sync: WeightSyncSettings, rollouts_wait: bool = False):
        """learners(): the current learner group (a rebuilt one after a learner failure).
        rollouts_wait: the rollout actors sample only after the sync (synchronous sampling)."""
        self.env_runner_group, self._learners, self.s = env_runner_group, learners, consistency
        self.num_learners = num_learners
        self.checks = consistency.enabled
        self.version = 0                  # the version the rollout actors run
        self.updates_since_sync = 0       # > 0: the learners are ahead of the rollouts (a hold)
        self._synced_refs: Optional[list] = []   # the learners' published parts of `version`
        self._synced_digests: dict = {}
        self.rows: List[Dict[str, Any]] = []
        self.repairs = 0
        self._snapshot = None
        self._kept_version = -1           # the version whose digests and state were last kept
        self._lag_before: Optional[int] = None   # set by before_update: a check is in progress
        self._observed: Optional[ray.ObjectRef] = None   # the actor's first half of the check
        self.transport = CollectiveWeightSync(self, weight_sync) if weight_sync.transport == "collective" else None
        if self.checks or self.transport is not None:   # what the digests and the wire cast to
            self.rollout_dtypes = self.runner_call(runner_dtypes)[1][0]
        self.actor = None
        self._probe: Optional[Dict[str, Any]] = None   # the actor's probe set, kept here: no round trip per check
        self._overlap = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-gate")
        self._copies: Optional[Future] = None
        self._prepared: Optional[Future] = None   # the synced state, kept while the next batch samples
        self._candidate = None   # (its parts, their push to the rollout actors) before the verdict
        self.speculative = rollouts_wait and self.transport is None
        if self.checks:
            discrete = {mid: hasattr(sp, "n") for mid, sp in self.runner_call(
                lambda r: {m: mod.action_space for m, mod in runner_modules(r).items()
                           if isinstance(mod, MoEPolicyModule)})[1][0].items()}
            self.moe_modules = set(discrete)   # the modules whose rollout copy records routing
            self.actor = start_consistency_actor(consistency, discrete)

    @property
    def group(self):
        """The current learner group."""
        return self._learners()

    def digest_sample(self, index: Optional[int] = None) -> Sample:
        """The rotating share of tensors the digests cover (consistency.param_sample): the synced
        version's share by default, so the sync-time digests and the next check's agree."""
        return sample_of(self.s.param_sample, self.version if index is None else index)

    @property
    def holding(self) -> bool:
        """The learners are ahead of the rollouts (a hold): every iteration is checked."""
        return self.updates_since_sync > 0

    def note_update(self) -> None:
        self.updates_since_sync += 1

    # --- the synced weights -------------------------------------------------------------------------
    def runner_call(self, fn, runner_ids=None, **kwargs):
        """fn(runner, **kwargs) on the rollout actors that sample (the local one when there are
        no remote ones) -> (runner ids, results)."""
        group = self.env_runner_group
        if group.num_remote_env_runners() == 0:
            return [0], group.foreach_env_runner(lambda r: fn(r, **kwargs), local_env_runner=True)
        ids = list(runner_ids) if runner_ids is not None else list(group.healthy_env_runner_ids())
        return ids, group.foreach_env_runner(lambda r: fn(r, **kwargs), remote_worker_ids=ids,
                                             local_env_runner=False)

    def push_synced_weights(self, runner_ids=None, force: bool = False) -> None:
        """Load the synced version into rollout actors (all, or `runner_ids`; force: even when
        they already claim that version)."""
        refs, version = self.synced_refs, self.version
        self.runner_call(lambda r: load_shards_into_runner(r, refs, version, force), runner_ids)

    @property
    def synced_refs(self) -> list:
        """The learners' published parts of the synced version. Under the collective transport
        they are published only when asked (a repair, a restarted rollout actor, a failed
        broadcast): from the parts the learners kept (the gate can hold them back from the
        synced version), else from their weights, which are the synced version until the next
        update."""
        if self._synced_refs is None:
            self._synced_refs = (self.group.publish_synced() if self.checks
                                 else self.group.publish_weights(inference_only=True))
        return self._synced_refs

    def sync(self, prepare_check: bool = False) -> None:
        """Version v + 1 to the rollout actors. object_store: every learner publishes its own part
        once (in its node's object store) and each rollout actor pulls and assembles them strictly.
        collective: every learner broadcasts its part to the rollout actors (the object store
        serves when that fails) and, for the gate, keeps it. The synced version stays at hand
        (repairs, restarted actors and the update-size check use it); its digests and the last
        good state are taken by the next check (`_keep_synced_state`), so syncs that no check
        follows (consistency.every > 1) cost no more than without checks. prepare_check: a check
        follows; take them now, in the background, while the next batch samples."""
        self.settle()
        self.version += 1
        self.updates_since_sync = 0
        if self._candidate is not None:   # sent during the check, which passed
            self._synced_refs, push = self._candidate
            self._candidate = None
            push.result()
        elif self.transport is None:
            self._synced_refs = self.group.publish_weights(inference_only=True)
            self.push_synced_weights()
        else:
            if self.checks:
                self.group.keep_synced()
            self._synced_refs = None
            if not self.transport.sync(self.version):
                self.push_synced_weights()
        if prepare_check and self.checks:
            self._prepared = self._overlap.submit(self._keep_synced_state)

    def settle(self) -> None:
        """Waits for the synced state being kept in the background (its error is raised here)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared.result()

    def _keep_synced_state(self) -> None:
        """The synced version's digests (in the rollout copies' dtypes, taken where the parts live)
        and the learners' exact state, once per synced version, at its first check: the learners
        still hold the synced version then (a check runs before the update; while holding, they
        were kept at the check before the hold)."""
        if self._kept_version == self.version or not self.checks:
            return
        digests: dict = {}
        for part in self.group.shard_digests(self.rollout_dtypes, self.digest_sample()):
            for mid, d in part.items():
                digests.setdefault(mid, {}).update(d)
        self._synced_digests = digests
        self.keep_last_good()
        self._kept_version = self.version

    @property
    def synced_digests(self) -> dict:
        """{module: {tensor: digest}} of the synced version (the rotating share of the tensors)."""
        self._keep_synced_state()
        return self._synced_digests

    def keep_last_good(self) -> None:
        """The learners' exact state now (weights and optimizer moments), for a rollback."""
        self._snapshot = self.group.snapshot()

    def reference_refs(self) -> Optional[list]:
        """What the update-size check compares against: the published parts, or None where the
        learners kept them (the collective transport)."""
        return self._synced_refs if self.transport is None else None

    def restore_last_good(self) -> None:
        """The learners back to the state of the synced version (weights and optimizer moments)."""
        self.settle()
        if self._snapshot is not None:
            self.group.restore(self._snapshot)
        self.updates_since_sync = 0

    # --- before the update ------------------------------------------------------------------------
    def before_update(self, episodes, iteration: int) -> None:
        self.settle()
        self._keep_synced_state()
        data = rollout_sample(episodes, self.s.sample_size, seed=iteration, modules=self.moe_modules)
        if self._probe is None:   # once per run (a restored run's probe comes with its checkpoint)
            self._probe = ray.get(self.actor.get_probe.remote())
        if self._probe is None and data:
            probe = {mid: tree.map_structure(lambda x: x[: self.s.probe_size], d["obs"]) for mid, d in data.items()}
            ray.get(self.actor.set_probe.remote(probe, self.group.trainer_view(
                {mid: {"obs": o} for mid, o in probe.items()}, replay=False)))
            self._probe = probe
        lag = self.updates_since_sync
        asked = {mid: {"obs": d["obs"], "actions": d["actions"], "topk": d["topk"]} for mid, d in data.items()}
        view = self.group.trainer_view(asked) if asked else {}   # each module replays as it trains
        rollout, trainer, policy_lag = {}, {}, {}
        for mid, d in data.items():
            # Each step's policy lag: how many syncs ago the weights it was taken with were synced
            # (an episode that began before the last sync, or an asynchronous rollout, carries
            # older steps). Mismatch is measured on the steps taken with the synced version
            # (the learners hold it when lag == 0): the same weights on both sides.
            versions = self.version - np.asarray(d["seq"], dtype=np.int64)
            same = versions == 0 if lag == 0 else np.ones(len(versions), bool)
            pick = lambda x, m: x[m] if isinstance(x, np.ndarray) else x   # noqa: E731
            rollout[mid] = {k: pick(d[k], same) for k in ("logp", "topk", "positions")}
            trainer[mid] = tree.map_structure(lambda x: pick(x, same), view[mid])
            policy_lag[mid] = {"versions": versions}
            if lag == 0 and (~same).any():   # the trainer's view at v of steps taken at older weights
                policy_lag[mid].update(rollout_logp=d["logp"][~same], trainer_logp=view[mid]["logp"][~same])
        # The rollout copies' digests are taken while the learners update (after the trainer's
        # view: beside it, on two cores, both ran slower): the rollout actors are idle then (PPO)
        # or sampling (APPO), and a copy that differs is repaired before the next sync (or the
        # hold that keeps the rollouts on the synced weights). The actor computes its figures then too.
        self._copies = self._overlap.submit(self._corrupt_copies)
        self._observed = self.actor.observe.remote(iteration=iteration + 1, version=self.version, lag=lag,
                                                   rollout=rollout, trainer=trainer, policy_lag=policy_lag)
        self._lag_before = lag

    def _check_copies(self, iteration: int, first: Dict[Any, Dict[str, List[str]]]) -> List[str]:
        """Every rollout actor's copy vs the synced weights, by digest. A copy that differs is
        repaired at once (the synced weights re-sent, then verified); one that still differs
        after two repairs stops the run."""
        lines: List[str] = []
        for attempt in range(3):
            bad = first if attempt == 0 else self._corrupt_copies()
            if not bad:
                return lines
            if attempt == 0:
                lines = self._breach_lines(bad)
            if attempt == 2:
                rid, mid, name = next((r, m, n) for r, mods in bad.items() for m, names in mods.items() for n in names)
                self.restore_last_good()
                raise GateStop(f"corrupt_copy: rollout actor {rid} still differs from the synced weights after two "
                               f"repairs ({mid}: {name}); the run stays resumable: moe-rl train --resume RUN_DIR")
            self.repairs += 1
            self.push_synced_weights(runner_ids=list(bad), force=True)
            logger.warning("moe-rl gate: iteration %d repair (corrupt_copy): %s%s", iteration + 1, lines[0],
                           f" (+{len(lines) - 1} more tensors)" if len(lines) > 1 else "")
        return lines

    def _corrupt_copies(self) -> Dict[Any, Dict[str, List[str]]]:
        ids, digests = self.runner_call(runner_digests, sample=self.digest_sample())
        bad = {}
        for rid, actual in zip(ids, digests):
            mods = {mid: differing(self.synced_digests.get(mid, {}), actual.get(mid, {}))
                    for mid in set(self.synced_digests) | set(actual)}
            mods = {m: n for m, n in mods.items() if n}
            if mods:
                bad[rid] = mods
        return bad

    def _breach_lines(self, bad) -> List[str]:
        """`rollout actor 1: trunk...fc1.weight: max_diff=0.47 (threshold=0)` per differing tensor:
        only these tensors travel (from the actor and from the learners' synced part)."""
        synced = None
        lines = []
        for rid, mods in bad.items():
            for mid, names in mods.items():
                for name in names[:5]:
                    got = self.runner_call(runner_tensor, module_id=mid, name=name, runner_ids=[rid])[1][0]
                    if synced is None:
                        synced = _merge(ray.get(list(self.synced_refs)))
                    want = synced.get(mid, {}).get(name)
                    diff = max_abs_diff(want, got) if want is not None and got is not None else float("inf")
                    lines.append(f"rollout actor {rid}: " + format_breach(name, diff, 0.0))
        return lines

    # --- after the update -------------------------------------------------------------------------
    def after_update(self, iteration: int) -> Dict[str, Any]:
        lag_before, self._lag_before = self._lag_before, None
        lag = lag_before + 1            # the candidate is one more update past the synced weights
        corrupt = self._check_copies(iteration, self._copies.result())
        replicas = self._check_replicas(iteration)
        if self.speculative:   # the rollouts wait: the candidate travels while it is judged
            refs = self.group.publish_weights(inference_only=True)
            version = self.version + 1
            self._candidate = (refs, self._overlap.submit(
                self.runner_call, lambda r: load_shards_into_runner(r, refs, version)))
        try:
            stats = self.group.weight_stats(self.reference_refs())
            probe = self._probe
            candidate = (self.group.trainer_view({mid: {"obs": o} for mid, o in probe.items()}, replay=False)
                         if probe else {})
            # The learners agree on skipped steps (a collective decision): the first one's figures.
            skipped = self.group.publishers(_skipped_steps)[0]
            _, result = ray.get([self._observed, self.actor.check.remote(
                stats=stats, candidate_view=candidate, corrupt=corrupt, replicas=replicas, repairs=self.repairs,
                skipped=skipped)])
            self._observed = None
        except BaseException:   # no verdict: nothing unjudged may stay with the rollouts
            self._withdraw_candidate()
            raise
        if result["verdict"]["decision"] not in ("sync", "warn"):
            self._withdraw_candidate()
        self.rows.extend(result["rows"])
        verdict = result["verdict"]
        causes = [c for c in verdict["causes"] if c != "corrupt_copy"]   # repairs were logged when made
        if causes:   # one line; every breach and per-tensor line is in the ledger (drift.parquet)
            logger.warning("moe-rl gate: iteration %d %s (%s): %s", iteration + 1,
                           ";".join(a for a in verdict["actions"] if a != "repair"), ";".join(causes),
                           "; ".join(verdict["headlines"][c] for c in causes))
        decision = verdict["decision"]
        if decision in ("rollback", "stop"):
            self.restore_last_good()
        if decision == "stop":
            raise GateStop(f"bad_update: {verdict['reason']} after {self.s.max_rollbacks} rollbacks "
                           f"(one is forgiven only after as many passing checks in a row); "
                           f"the learners hold the last good weights; the run stays resumable: moe-rl train "
                           f"--resume RUN_DIR (consider a lower training.lr)")
        self.group.set_lr_scale(verdict["lr_scale"])
        verdict["lag"] = lag
        return verdict

    def _withdraw_candidate(self) -> None:
        """The rollout actors back to the synced version where an unpassed candidate was sent."""
        if self._candidate is not None:
            push, self._candidate = self._candidate[1], None
            push.exception()   # finished, whether or not it reached them all: overwritten now
            self.push_synced_weights(force=True)

    def _check_replicas(self, iteration: int) -> List[str]:
        """Learners that hold the same tensor must hold the same bytes. A divergence is named and
        the learners are resynchronised from the publishing learner's copy (rank 0 for dense
        tensors, the first holder of each expert)."""
        if self.num_learners < 2:     # one learner: no replica to compare with
            return []
        digests = self.group.replica_digests(self.digest_sample(iteration))
        first: Dict[tuple, tuple] = {}
        diverged = []
        for rank, mods in enumerate(digests):
            for mid, names in mods.items():
                for name, d in names.items():
                    if (mid, name) not in first:
                        first[(mid, name)] = (rank, d[3])
                    elif first[(mid, name)][1] != d[3]:
                        diverged.append((mid, name, first[(mid, name)][0], rank))
        if not diverged:
            return []
        lines = []
        for mid, name, a, b in diverged[:5]:
            held = self.group.tensor(mid, name)
            lines.append(f"learner {b} vs learner {a}: " + format_breach(name, max_abs_diff(held[a], held[b]), 0.0))
        self.group.load_shards(self.group.publish_weights(inference_only=False), inference_only=False)
        return lines

    # --- checkpoints --------------------------------------------------------------------------------
    def get_state(self) -> Dict[str, Any]:
        return {"actor": ray.get(self.actor.get_state.remote()), "repairs": self.repairs} if self.checks else {}

    def set_state(self, state: Dict[str, Any]) -> None:
        if self.checks:
            ray.get(self.actor.set_state.remote(state.get("actor", {})))
            self.repairs = int(state.get("repairs", 0))
            self._probe = None   # the restored actor's: fetched at the next check

    def close(self) -> None:
        self._overlap.shutdown(wait=True)
        if self.actor is not None:
            ray.kill(self.actor)
        if self.transport is not None:
            self.transport.close()

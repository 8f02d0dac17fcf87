"""SyncedWeights: the weights the rollout actors run, and the learners' last good state.

It owns the synced version (its number, which the rollout actors record per step as RLlib's
WEIGHTS_SEQ_NO; the learners' published parts and their digests), moves a new version to the
rollout actors (the object store, or a collective broadcast: moe_rl.algo.weight_sync), repairs a
rollout copy that is not the bytes it was sent, compares the learners that hold the same tensor,
and keeps (and restores) the learners' exact state of the synced version. The sync gate
(moe_rl.algo.sync_gate) decides *whether* a version moves; this moves it.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import ray

from moe_rl.algo.weight_sync import CollectiveWeightSync
from moe_rl.core.digests import Sample, differing, max_abs_diff, sample_of
from moe_rl.core.drift import format_breach
from moe_rl.core.sections import WeightSyncSettings
from moe_rl.rllib.runner import load_shards_into_runner, runner_digests, runner_dtypes, runner_tensor

logger = logging.getLogger("moe_rl")


class GateStop(RuntimeError):
    """The gate stopped the run; str() is one line: the cause, the metric, its value and threshold,
    and how to resume."""


def _merge(parts: List[Dict[str, Dict]]) -> Dict[str, Dict]:
    out: Dict[str, Dict] = {}
    for p in parts:
        for mid, d in p.items():
            out.setdefault(mid, {}).update(d)
    return out


class SyncedWeights:
    def __init__(self, env_runner_group, learners: Callable[[], Any], num_learners: int, checks: bool,
                 param_sample: float, weight_sync: WeightSyncSettings):
        """learners(): the current learner group (a rebuilt one after a learner failure). checks:
        the consistency checks run (digests and the last good state are kept for them)."""
        self.env_runner_group, self._learners = env_runner_group, learners
        self.num_learners, self.checks, self.param_sample = num_learners, checks, param_sample
        self.version = 0                  # the version the rollout actors run
        self._refs: Optional[list] = []   # the learners' published parts of `version`
        self._digests: dict = {}
        self._snapshot = None
        self._kept_version = -1           # the version whose digests and state were last kept
        self.transport = CollectiveWeightSync(self, weight_sync) if weight_sync.transport == "collective" else None
        if checks or self.transport is not None:   # what the digests and the wire cast to
            self.rollout_dtypes = self.runner_call(runner_dtypes)[1][0]
        self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-rl-gate")
        self._prepared: Optional[Future] = None   # the synced state, kept while the next batch samples

    @property
    def group(self):
        """The current learner group."""
        return self._learners()

    def runner_call(self, fn, runner_ids=None, **kwargs):
        """fn(runner, **kwargs) on the rollout actors that sample (the local one when there are
        no remote ones) -> (runner ids, results)."""
        group = self.env_runner_group
        if group.num_remote_env_runners() == 0:
            return [0], group.foreach_env_runner(lambda r: fn(r, **kwargs), local_env_runner=True)
        ids = list(runner_ids) if runner_ids is not None else list(group.healthy_env_runner_ids())
        return ids, group.foreach_env_runner(lambda r: fn(r, **kwargs), remote_worker_ids=ids, local_env_runner=False)

    def digest_sample(self, index: Optional[int] = None) -> Sample:
        """The rotating share of tensors the digests cover (consistency.param_sample): the synced
        version's share by default, so the sync-time digests and the next check's agree."""
        return sample_of(self.param_sample, self.version if index is None else index)

    # --- the synced version -----------------------------------------------------------------------
    @property
    def refs(self) -> list:
        """The learners' published parts of the synced version. Under the collective transport
        they are published only when asked (a repair, a restarted rollout actor, a failed
        broadcast): from the parts the learners kept, else from their weights, which are the synced
        version until the next update."""
        if self._refs is None:
            self._refs = self.group.publish_synced() if self.checks else self.group.publish_weights(inference_only=True)
        return self._refs

    def push(self, runner_ids=None, force: bool = False) -> None:
        """Load the synced version into rollout actors (all, or `runner_ids`; force: even when they
        already claim that version)."""
        refs, version = self.refs, self.version
        self.runner_call(lambda r: load_shards_into_runner(r, refs, version, force), runner_ids)

    def sync(self, candidate=None, prepare_check: bool = False) -> None:
        """Version v + 1 to the rollout actors. object_store: every learner publishes its own part
        once and each rollout actor pulls and assembles them strictly. collective: every learner
        broadcasts its part (the object store serves when that fails) and keeps it. candidate:
        (refs, their push) already sent while the check judged them. prepare_check: a check
        follows; keep the synced state now, in the background, while the next batch samples."""
        self.settle()
        self.version += 1
        if candidate is not None:
            self._refs, push = candidate
            push.result()
        elif self.transport is None:
            self._refs = self.group.publish_weights(inference_only=True)
            self.push()
        else:
            if self.checks:
                self.group.keep_synced()
            self._refs = None
            if not self.transport.sync(self.version):
                self.push()
        if prepare_check and self.checks:
            self._prepared = self.background.submit(self.keep_synced_state)

    def send_candidate(self):
        """The learners' weights to the rollout actors before the verdict (PPO's rollouts wait for
        the sync): (refs, the push's future), for sync() or withdraw()."""
        refs, version = self.group.publish_weights(inference_only=True), self.version + 1
        return refs, self.background.submit(self.runner_call, lambda r: load_shards_into_runner(r, refs, version))

    def withdraw(self, candidate) -> None:
        """The rollout actors back to the synced version where an unpassed candidate was sent."""
        candidate[1].exception()   # finished, whether or not it reached them all: overwritten now
        self.push(force=True)

    def settle(self) -> None:
        """Waits for the synced state being kept in the background (its error is raised here)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared.result()

    def keep_synced_state(self) -> None:
        """The synced version's digests (in the rollout copies' dtypes, taken where the parts live)
        and the learners' exact state, once per synced version, at its first check: the learners
        still hold the synced version then (a check runs before the update; while holding, they
        were kept at the check before the hold)."""
        if self._kept_version == self.version or not self.checks:
            return
        self._digests = _merge(self.group.shard_digests(self.rollout_dtypes, self.digest_sample()))
        self._snapshot = self.group.snapshot()
        self._kept_version = self.version

    @property
    def digests(self) -> dict:
        """{module: {tensor: digest}} of the synced version (the rotating share of the tensors)."""
        self.keep_synced_state()
        return self._digests

    @property
    def published_refs(self) -> Optional[list]:
        """The synced version's published parts as they are (None: not published, under the
        collective transport), without publishing them."""
        return self._refs

    def restore_last_good(self) -> None:
        """The learners back to the state of the synced version (weights and optimizer moments)."""
        self.settle()
        if self._snapshot is not None:
            self.group.restore(self._snapshot)

    def reference_refs(self) -> Optional[list]:
        """What the update-size check compares against: the published parts, or None where the
        learners kept them (the collective transport)."""
        return self._refs if self.transport is None else None

    # --- copies that are not the bytes they were sent ---------------------------------------------
    def corrupt_copies(self) -> Dict[Any, Dict[str, List[str]]]:
        """{rollout actor: {module: [tensors]}} whose digests differ from the synced version's."""
        self.keep_synced_state()
        ids, digests = self.runner_call(runner_digests, sample=self.digest_sample())
        bad = {}
        for rid, actual in zip(ids, digests):
            mods = {mid: differing(self._digests.get(mid, {}), actual.get(mid, {}))
                    for mid in set(self._digests) | set(actual)}
            mods = {m: n for m, n in mods.items() if n}
            if mods:
                bad[rid] = mods
        return bad

    def repair(self, first: Dict[Any, Dict[str, List[str]]], iteration: int) -> Tuple[List[str], int]:
        """A copy that differs is repaired at once (the synced weights re-sent, then verified);
        one that still differs after two repairs stops the run. -> (the breach lines, the repairs
        it took)."""
        lines: List[str] = []
        for attempt in range(3):
            bad = first if attempt == 0 else self.corrupt_copies()
            if not bad:
                return lines, attempt
            if attempt == 0:
                lines = self._breach_lines(bad)
            if attempt == 2:
                rid, mid, name = next((r, m, n) for r, mods in bad.items() for m, names in mods.items() for n in names)
                self.restore_last_good()
                raise GateStop(f"corrupt_copy: rollout actor {rid} still differs from the synced weights after two "
                               f"repairs ({mid}: {name}); the run stays resumable: moe-rl train --resume RUN_DIR")
            self.push(runner_ids=list(bad), force=True)
            logger.warning("moe-rl gate: iteration %d repair (corrupt_copy): %s%s", iteration + 1, lines[0],
                           f" (+{len(lines) - 1} more tensors)" if len(lines) > 1 else "")
        raise AssertionError("unreachable: the third attempt repairs or stops")

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
                        synced = _merge(ray.get(list(self.refs)))
                    want = synced.get(mid, {}).get(name)
                    diff = max_abs_diff(want, got) if want is not None and got is not None else float("inf")
                    lines.append(f"rollout actor {rid}: " + format_breach(name, diff, 0.0))
        return lines

    def diverged_replicas(self, iteration: int) -> List[str]:
        """Learners that hold the same tensor must hold the same bytes. A divergence is named and
        the learners are resynchronised from the publishing learner's copy (rank 0 for dense
        tensors, the first holder of each expert)."""
        if self.num_learners < 2:     # one learner: no replica to compare with
            return []
        first: Dict[tuple, tuple] = {}
        diverged = []
        for rank, mods in enumerate(self.group.replica_digests(self.digest_sample(iteration))):
            for mid, names in mods.items():
                for name, d in names.items():
                    if (mid, name) not in first:
                        first[(mid, name)] = (rank, d[3])
                    elif first[(mid, name)][1] != d[3]:
                        diverged.append((mid, name, first[(mid, name)][0], rank))
        lines = []
        for mid, name, a, b in diverged[:5]:
            held = self.group.tensor(mid, name)
            lines.append(f"learner {b} vs learner {a}: " + format_breach(name, max_abs_diff(held[a], held[b]), 0.0))
        if diverged:
            self.group.load_shards(self.group.publish_weights(inference_only=False), inference_only=False)
        return lines

    def collective_fallbacks(self) -> Optional[int]:
        """Syncs the collective transport handed to the object store (None: no collective)."""
        return None if self.transport is None else self.transport.fallbacks

    def close(self) -> None:
        self.background.shutdown(wait=True)
        if self.transport is not None:
            self.transport.close()

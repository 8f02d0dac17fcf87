"""CollectiveWeightSync: the driver's side of `weight_sync.transport: collective`.

It forms the groups (one per publishing learner, the rollout actors in each; actors.weight_transport),
announces each sync (the version and every source's plan) and waits for both ends. Whatever goes
wrong (a member that died or restarted, a timeout, a refused header) makes `sync` return False:
the caller then loads the synced version from the object store, as the other transport does, and
the groups are formed afresh at the next sync with the rollout actors that are healthy then.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Dict, List, Optional

import ray

from moe_rl.actors.weight_transport import join, leave, receive, send, source_manifest
from moe_rl.core.buckets import Entry
from moe_rl.core.sections import WeightSyncSettings

logger = logging.getLogger("moe_rl")


def _runner_join(runner, ranks: Dict[int, int], groups: List[str], world_size: int, backend: str,
                 timeout_s: float) -> Optional[str]:
    try:
        join(runner, {g: ranks[runner.worker_index] for g in groups}, world_size, backend, timeout_s)
    except Exception as e:  # noqa: BLE001 - returned: a raised error would mark the actor unhealthy
        return f"{type(e).__name__}: {e}"
    return None


def _best_effort(fn, *args, **kwargs) -> None:
    """Each member leaves on its own: one that died took its groups with it, the others still leave."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        logger.debug("moe-rl: leaving the weight sync groups: %s", e)


class CollectiveWeightSync:
    def __init__(self, gate, settings: WeightSyncSettings):
        """gate: the SyncGate that owns the synced weights (its env-runner and learner groups)."""
        self.gate, self.s = gate, settings
        self.bucket_bytes = int(settings.bucket_mb * 2**20)
        self.run_id = uuid.uuid4().hex[:8]
        self.generation = 0
        self.runner_ids: List[int] = []
        self.sources: Dict[str, List[Entry]] = {}    # group name -> the source's plan
        self.source_rank: Dict[str, int] = {}        # group name -> the publishing learner's rank
        self._learners = None
        self._stale = False      # a sync failed: form the groups afresh (leaving the old ones first)
        self.fallbacks = 0
        self.last_seconds = 0.0

    # --- membership ---------------------------------------------------------------------------------
    def _form(self, runner_ids: List[int]) -> None:
        group = self.gate.group
        self._dissolve()
        self.generation += 1
        manifests = group.foreach(source_manifest, wire_dtypes=self.gate.rollout_dtypes)
        names = {rank: f"moe_rl_sync_{self.run_id}_g{self.generation}_s{rank}"
                 for rank, m in enumerate(manifests) if m}
        world = 1 + len(runner_ids)
        # Recorded first, so that a formation that fails half-way is left like any other.
        self.runner_ids, self._learners = list(runner_ids), group
        self.sources = {g: manifests[rank] for rank, g in names.items()}
        self.source_rank = {g: rank for rank, g in names.items()}
        deadline = time.monotonic() + self.s.timeout_s
        tag = self._runners_async(_runner_join, runner_ids, ranks={wid: 1 + i for i, wid in enumerate(runner_ids)},
                                  groups=list(names.values()), world_size=world, backend=self.s.backend,
                                  timeout_s=self.s.timeout_s)
        refs = [group.foreach_async(join, ranks=[rank], groups={g: 0}, world_size=world, backend=self.s.backend,
                                    timeout_s=self.s.timeout_s)[0] for rank, g in names.items()]
        self._wait_learners(refs, deadline)
        failed = [e for e in self._wait_runners(tag, len(runner_ids), deadline).values() if e is not None]
        if failed:
            raise RuntimeError(failed[0])

    def _dissolve(self) -> None:
        """Leave the current groups where the members still live (best effort: a dead one is gone)."""
        if not self.sources:
            return
        groups = list(self.sources)
        _best_effort(self.gate.env_runner_group.foreach_env_runner, lambda r: leave(r, groups),
                     remote_worker_ids=self.runner_ids, local_env_runner=False)
        if self._learners is self.gate.group:
            for g, rank in self.source_rank.items():
                _best_effort(lambda: ray.get(self._learners.foreach_async(leave, ranks=[rank], groups=[g]),
                                             timeout=self.s.timeout_s))
        self.sources, self.source_rank, self._stale = {}, {}, False

    # --- one sync -----------------------------------------------------------------------------------
    def sync(self, version: int) -> bool:
        """Version `version` to every healthy rollout actor; False: the caller loads it from the
        object store (the groups are formed afresh next time)."""
        ids = sorted(self.gate.env_runner_group.healthy_env_runner_ids())
        t0 = time.perf_counter()
        try:
            if self._stale or ids != self.runner_ids or self._learners is not self.gate.group \
                    or not self.sources:
                self._form(ids)
            deadline = time.monotonic() + self.s.timeout_s
            tag = self._runners_async(receive, ids, sources=self.sources, version=version,
                                      bucket_bytes=self.bucket_bytes, backend=self.s.backend)
            refs = [self._learners.foreach_async(send, ranks=[rank], group=g, version=version,
                                                 entries=self.sources[g], bucket_bytes=self.bucket_bytes,
                                                 backend=self.s.backend)[0]
                    for g, rank in self.source_rank.items()]
            self._wait_learners(refs, deadline)
            results = self._wait_runners(tag, len(ids), deadline)
            bad = [f"rollout actor {wid}: {r['error']}" for wid, r in results.items() if not r["ok"]]
            if bad:
                raise RuntimeError(bad[0])
        except Exception as e:  # noqa: BLE001 - any failure falls back, named once in the log
            self.fallbacks += 1
            self._stale = True
            logger.warning("moe-rl: collective weight sync of version %d failed (%s); loading it from the "
                           "object store", version, str(e).splitlines()[0][:300])
            return False
        self.last_seconds = time.perf_counter() - t0
        return True

    # --- calls that run on both ends at once --------------------------------------------------------
    def _runners_async(self, fn, ids: List[int], **kwargs) -> str:
        tag = f"moe_rl_sync_{uuid.uuid4().hex[:8]}"
        self.gate.env_runner_group.foreach_env_runner_async(lambda r: fn(r, **kwargs), tag=tag,
                                                            remote_worker_ids=ids)
        return tag

    def _wait_runners(self, tag: str, n: int, deadline: float) -> Dict[int, Any]:
        got: Dict[int, Any] = {}
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{n - len(got)} rollout actor(s) did not answer in {self.s.timeout_s:.0f}s")
            for wid, result in self.gate.env_runner_group.fetch_ready_async_reqs(tags=tag,
                                                                                 timeout_seconds=min(left, 1.0)):
                got[wid] = result
        return got

    def _wait_learners(self, refs, deadline: float) -> None:
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=max(deadline - time.monotonic(), 0.0))
        if pending:
            raise TimeoutError(f"{len(pending)} learner(s) did not finish in {self.s.timeout_s:.0f}s")
        ray.get(ready)

    def close(self) -> None:
        self._dissolve()

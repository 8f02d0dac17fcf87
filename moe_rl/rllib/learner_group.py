"""One learner-group interface for the algorithm and the sync gate.

MoEPPO drives either RLlib's LearnerGroup (`MoELearnerGroup`: a local learner, or data-parallel
learners under DDP) or the DeepSpeed expert-parallel group (actors.learner_group). Besides RLlib's
update / get_state / set_state / save_to_path / restore_from_path, both offer:

    foreach(fn, **kw) -> list         fn(learner, **kw) on every learner, plain results
    publish_weights(inference_only)   per-learner shard refs, each {module_id: {global name: array}}
    keep_synced() / publish_synced()  keep the synced part on each learner; publish it when asked
    shard_digests(dtypes, sample)     digests of the published parts (or of a rotating share of
                                      the tensors), computed on the learners
    replica_digests(sample)           every learner's digests of all it holds (replica check)
    weight_stats(reference_refs)      update-size terms and finiteness vs the last synced shards
                                      (None: vs the parts the learners kept)
    load_shards(refs, inference_only) weights only, from published shards (a replica resync)
    trainer_view(data, replay)        the learners' own forward on rollout data
    snapshot() / restore(snapshot)    the exact learner state (weights and optimizer moments),
                                      kept in the learners' own memory (KEPT) where it can be
    set_lr_scale(s)                   every learner's LR scale (a rollback's retry)
    tensor(module_id, name)           one tensor as every learner holds it (breach lines)
    dead_learners(error) / rebuild()  failures (RLlib's own group restarts its learners itself)
    memory_stats()                    per-learner figures for metrics.parquet
    module_state(inference_only)      {module_id: full state}, assembled (tests, verification)

The weights are always published in parts (learner i's part of every module), so the sync, the
digests and the update-size terms are computed where the weights live; nobody gathers a model.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import ray
import torch.distributed as dist
from ray.rllib.core.learner.learner_group import LearnerGroup
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from moe_rl.core.digests import Sample
from moe_rl.core.sharding import assemble_modules
from moe_rl.rllib import ray_private

KEPT = "kept-in-memory"   # a snapshot the learners hold themselves


def learner_bundles(config) -> List[Dict[str, float]]:
    """One resource bundle per learner: RLlib's own (what Algorithm.default_resource_request gives
    Tune), which the DeepSpeed group requests for its learners too."""
    return [{k: float(v) for k, v in b.items() if v} for b in ray_private.learner_bundles(config)]


def _sum_terms(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    finite, terms = True, {}
    for p in parts:
        finite &= bool(p["finite"])
        for mid, groups in p["terms"].items():
            for g, (a, b) in groups.items():
                t = terms.setdefault(mid, {}).setdefault(g, [0.0, 0.0])
                t[0] += a
                t[1] += b
    return {"finite": finite, "terms": terms}


def _put_shard(learner, inference_only: bool):
    return ray.put(learner.shard(inference_only))


def _put_synced(learner):
    return ray.put(learner.synced_part())


def _weight_stats(learner, refs):
    return learner.weight_stats(ray.get(refs[learner_index(learner, len(refs))]) if refs else None)


def _load_shards(learner, refs, inference_only):
    learner.load_shards(ray.get(list(refs)), inference_only)


def _set_lr_scale(learner, scale: float):
    learner.lr_scale = float(scale)


def learner_index(learner, n: int) -> int:
    """Which published part is this learner's (its rank under torch.distributed, else 0)."""
    return min(dist.get_rank() if dist.is_available() and dist.is_initialized() else 0, n - 1)


class LearnerGroupOps:
    """The interface above, in terms of `foreach` and `publishers` (learners whose parts make up
    the published weights)."""

    def foreach(self, fn: Callable, **kwargs) -> List[Any]:
        raise NotImplementedError

    def publishers(self, fn: Callable, **kwargs) -> List[Any]:
        raise NotImplementedError

    def publish_weights(self, inference_only: bool = True) -> List[ray.ObjectRef]:
        return self.publishers(_put_shard, inference_only=inference_only)

    def keep_synced(self) -> None:
        self.publishers(lambda l: l.keep_synced())

    def publish_synced(self) -> List[ray.ObjectRef]:
        return self.publishers(_put_synced)

    def shard_digests(self, dtypes: Optional[Mapping] = None, sample: Sample = None) -> List[Dict[str, Dict]]:
        return self.publishers(lambda l: l.shard_digests(dtypes, sample=sample))

    def replica_digests(self, sample: Sample = None) -> List[Dict[str, Dict]]:
        return self.foreach(lambda l: l.shard_digests(everything=True, inference_only=False, sample=sample))

    def weight_stats(self, reference_refs: Optional[List[ray.ObjectRef]]) -> Dict[str, Any]:
        return _sum_terms(self.publishers(_weight_stats, refs=reference_refs))

    def load_shards(self, refs: List[ray.ObjectRef], inference_only: bool = True) -> None:
        self.foreach(_load_shards, refs=refs, inference_only=inference_only)

    def set_lr_scale(self, scale: float) -> None:
        self.foreach(_set_lr_scale, scale=scale)

    def tensor(self, module_id: str, name: str) -> List[Any]:
        return self.foreach(lambda l: l.tensor(module_id, name))

    def module_state(self, inference_only: bool = True) -> Dict[str, Dict[str, Any]]:
        """{module_id: full state}, assembled from every learner's part (tests, verification)."""
        return assemble_modules(ray.get(self.publish_weights(inference_only)))


class MoELearnerGroup(LearnerGroupOps, LearnerGroup):
    """RLlib's LearnerGroup with the interface above: one learner, or data-parallel replicas that
    each hold everything (learner 0 publishes)."""

    def foreach(self, fn, **kwargs):
        out = []
        for r in self.foreach_learner(fn, **kwargs):
            if not r.ok:
                raise r.get()
            out.append(r.get())
        return out

    def publishers(self, fn, **kwargs):
        if self.is_local:
            return [fn(ray_private.local_learner(self), **kwargs)]
        first = ray_private.first_remote_learner_id(self)
        return [r.get() for r in self.foreach_learner(fn, remote_actor_ids=first, **kwargs)]

    def trainer_view(self, data, replay: Optional[bool] = None):
        return self.publishers(lambda l: l.trainer_view(data, replay))[0]

    def snapshot(self) -> str:
        self.foreach(lambda l: l.keep_state())
        return KEPT

    def restore(self, snapshot: str) -> None:
        restored = {r.actor_id: r.ok and r.get() for r in self.foreach_learner(lambda l: l.restore_kept_state())}
        kept = [actor for actor, ok in restored.items() if ok]
        lost = [actor for actor, ok in restored.items() if not ok]
        if not kept:
            raise RuntimeError("no learner holds the last good state to restore")
        if lost:
            # A replica restarted since the snapshot: it takes a restored one's state (data-parallel
            # replicas hold the same).
            state = next(iter(self.foreach_learner(lambda l: l.get_state(), remote_actor_ids=kept[:1]))).get()
            state.pop(WEIGHTS_SEQ_NO, None)
            self.foreach_learner(lambda l: l.set_state(state), remote_actor_ids=lost)

    def dead_learners(self, error=None) -> List[int]:
        return []

    def memory_stats(self) -> List[Dict[str, float]]:
        return []

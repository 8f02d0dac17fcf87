"""DeepSpeedLearnerGroup: N LearnerActors (one DeepSpeed engine each) in a Ray placement group.

It offers MoEPPO what RLlib's LearnerGroup offers (update, get_state/set_state, foreach_learner,
save_to_path/restore_from_path), plus what expert parallelism needs:
  - publish_weights(): each learner puts its own shard in the object store; nobody materialises
    the full model for a sync — the rollout side assembles the shards.
  - memory_stats(): expert-parameter bytes and peak RSS per learner.
The placement group requests each learner's resources by name (CPU/GPU plus any custom resource,
e.g. {"moe_learner": 1}), so an autoscaling cluster can add learner nodes for it.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional

import ray
import torch
from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_RL_MODULE
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.utils.checkpoints import Checkpointable
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_rl.sharding import assemble_all

from .learner import LearnerActor

DEFAULT_MODULE = "default_policy"
GROUP_STATE = "group_state.json"


class DeepSpeedLearnerGroup(Checkpointable):
    is_local = False
    is_remote = True

    def __init__(self, *, config, module_spec):
        self.config, self.module_spec = config, module_spec
        n = config.num_learners
        ds = config.deepspeed_settings
        bundle = {"CPU": float(config.num_cpus_per_learner if config.num_cpus_per_learner != "auto" else 1)}
        if config.num_gpus_per_learner:
            bundle["GPU"] = float(config.num_gpus_per_learner)
        # RLlib's own knob names the learner-node resource, e.g. {"moe_learner": 1}.
        bundle.update({k: float(v) for k, v in (config.custom_resources_per_learner or {}).items()})
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy=ds.get("placement_strategy", "PACK"))
        timeout = ds.get("placement_timeout_s", 600)
        try:
            ray.get(self._pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            raise RuntimeError(f"learner group: {n} learner bundles of {bundle} could not be placed within "
                               f"{timeout}s (cluster has {ray.available_resources()}); add learner nodes or "
                               f"lower learners.num_learners / learners.custom_resources_per_learner") from None
        actor_cls = ray.remote(LearnerActor)
        self._workers = [
            actor_cls.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                              resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
                              scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i)).remote(
                i, n, ds.get("num_threads", 1))
            for i in range(n)]
        addr, port = ray.get(self._workers[0].address.remote())
        ray.get([w.build.remote(config, module_spec, addr, port) for w in self._workers])
        self.weights_seq_no = 0

    def __len__(self) -> int:
        return len(self._workers)

    # --- training ---------------------------------------------------------------------------------
    def update(self, *, episodes=None, timesteps=None, **kwargs) -> List[Dict[str, Any]]:
        """Shard the episodes over the learners (equal minibatch counts: every rank runs the same
        number of collective steps) and run RLlib's learner update on each."""
        data = TrainingData(episodes=episodes)
        data.validate()
        shards = list(data.shard(num_shards=len(self), len_lookback_buffer=self.config.episode_lookback_horizon,
                                 **kwargs))
        results = ray.get([w.update.remote(training_data=td, timesteps=timesteps, **kw, **kwargs)
                           for w, (td, kw) in zip(self._workers, shards)])
        self.weights_seq_no += 1
        return results

    def foreach_learner(self, func: Callable, **kwargs) -> List[Any]:
        return ray.get([w.apply.remote(func, **kwargs) for w in self._workers])

    def memory_stats(self) -> List[Dict[str, float]]:
        return ray.get([w.memory_stats.remote() for w in self._workers])

    # --- weights ----------------------------------------------------------------------------------
    def publish_weights(self, inference_only: bool = True) -> List[ray.ObjectRef]:
        """One object ref per learner; each holds that learner's shard under global names."""
        return [w.module_shard.remote(inference_only) for w in self._workers]

    def publish_replicas(self, inference_only: bool = True) -> List[ray.ObjectRef]:
        """Every learner's complete local state (global names), for the replica check."""
        return [w.module_shard.remote(inference_only, True) for w in self._workers]

    def full_module_state(self, inference_only: bool = True) -> Dict[str, Any]:
        return assemble_all(ray.get(self.publish_weights(inference_only)))

    def get_state(self, components=None, *, not_components=None, inference_only: bool = False, **kwargs):
        """The full module state assembled from every learner's shard (RLlib's LearnerGroup asks
        learner 0 alone). Shaped like LearnerGroup.get_state ({"learner": {...}}) when asked for
        "learner/..." components, else like an EnvRunner's ({"rl_module": ...})."""
        state = {COMPONENT_RL_MODULE: {DEFAULT_MODULE: self.full_module_state(inference_only)},
                 "weights_seq_no": self.weights_seq_no}
        asked = [components] if isinstance(components, str) else list(components or [])
        if any(c.startswith(COMPONENT_LEARNER) for c in asked):
            return {COMPONENT_LEARNER: state}
        return state

    def set_state(self, state: Dict[str, Any]) -> None:
        module_state = state.get(COMPONENT_LEARNER, state).get(COMPONENT_RL_MODULE, {}).get(DEFAULT_MODULE)
        if module_state is not None:
            ref = ray.put(module_state)
            ray.get([w.load_global_state.remote(ref) for w in self._workers])

    def get_ctor_args_and_kwargs(self):
        return (), {"config": self.config, "module_spec": None}

    def get_checkpointable_components(self):
        return []

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False) -> str:
        """Every learner writes its DeepSpeed checkpoint (its expert shard + its own optimizer
        moments) into `path` (a directory all learners can reach)."""
        path = str(path)
        os.makedirs(path, exist_ok=True)
        ray.get([w.save.remote(path) for w in self._workers])
        for rank, ref in enumerate(self.publish_weights(inference_only=False)):
            shard = ray.get(ref)
            if shard:  # global-name tensors, loadable with torch.load(weights_only=True)
                torch.save({k: torch.as_tensor(v) for k, v in shard.items()},
                           os.path.join(path, f"module_shard_rank{rank}.pt"))
        with open(os.path.join(path, GROUP_STATE), "w") as f:
            json.dump({"weights_seq_no": self.weights_seq_no, "num_learners": len(self)}, f)
        return path

    def restore_from_path(self, path, *args, **kwargs) -> None:
        path = str(path)
        state_file = os.path.join(path, GROUP_STATE)
        if os.path.isfile(state_file):
            with open(state_file) as f:
                state = json.load(f)
            if state["num_learners"] != len(self):
                raise ValueError(f"checkpoint {path!r} holds {state['num_learners']} learners' state, "
                                 f"this group has {len(self)}")
            # Restored weights are a new version for the rollouts (they skip versions not newer
            # than theirs), also after a rebuild that carried the old counter over.
            self.weights_seq_no = max(self.weights_seq_no, int(state["weights_seq_no"])) + 1
        ray.get([w.restore.remote(path) for w in self._workers])

    # --- failures ---------------------------------------------------------------------------------
    def dead_learners(self, error: Optional[BaseException] = None, timeout_s: float = 10.0) -> List[int]:
        """Ranks of learners whose actor is gone: the one named by a RayActorError, else those
        that fail a ping (a survivor stuck in a collective with a dead peer only times out)."""
        ids = [w._actor_id.hex() for w in self._workers]
        actor_id = getattr(error, "actor_id", None)
        if actor_id in ids:
            return [ids.index(actor_id)]
        refs = [w.apply.remote(_alive) for w in self._workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        dead = []
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    dead.append(rank)
        return dead

    def rebuild(self) -> DeepSpeedLearnerGroup:
        """A fresh group with the same config: new actors, new process groups (a DeepSpeed/gloo
        process group cannot be repaired in place once a member died). Restore state afterwards."""
        self.shutdown()
        group = DeepSpeedLearnerGroup(config=self.config, module_spec=self.module_spec)
        group.weights_seq_no = self.weights_seq_no
        return group

    def shutdown(self) -> None:
        for w in self._workers:
            ray.kill(w)
        self._workers = []
        remove_placement_group(self._pg)


def _alive(learner) -> bool:
    return True

"""DeepSpeedLearnerGroup: N LearnerActors (one DeepSpeed engine per module each) in a Ray
placement group, offering MoEPPO and MoEAPPO the learner-group interface of
moe_rl.rllib.learner_group.

Every learner publishes its own part of the weights (the dense tensors from rank 0, each expert
from the first learner that holds it); nobody materialises the full model for a sync — the
rollout side assembles the parts. The placement group requests each learner's resources by name
(CPU/GPU plus any custom resource, e.g. {"moe_learner": 1}), so an autoscaling cluster can add
learner nodes for it.

Why not a subclass of RLlib's LearnerGroup: LearnerGroup.__init__ starts its learners through Ray
Train's BackendExecutor (a torch process group of its own making, DDP-wrapped modules) and its
update splits the batch with its own sharding; every method a subclass keeps would act on workers
this group does not have. It offers the same public surface instead (update, get_state /
set_state, save_to_path / restore_from_path, foreach_learner-style `foreach`, shutdown) plus the
interface of moe_rl.rllib.learner_group. Its get_state assembles the module on the driver only
because RLlib asks for it: Algorithm.setup seeds the rollout actors from it once at build
(algorithm.py, "Sync the weights from the learner group to the EnvRunners"; the gate's first sync
replaces that copy from the learners' parts right after), and Algorithm.get_state for in-memory
state (Tune). Syncs and checkpoints never do: save_to_path has every learner write its own part.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import ray
import torch
import tree
from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_RL_MODULE
from ray.rllib.core.learner.training_data import TrainingData
from ray.rllib.utils.checkpoints import Checkpointable
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from moe_rl.core.sharding import assemble_modules, stack_experts, unstack_experts
from moe_rl.rllib import ray_private
from moe_rl.rllib.learner_group import KEPT, LearnerGroupOps, learner_bundles

from .learner import LearnerActor

GROUP_STATE = "group_state.json"
logger = logging.getLogger("moe_rl")


class LearnerPlacementTimeout(RuntimeError):
    """The learners' placement group could not be placed in time (str(): one line)."""


class DeepSpeedLearnerGroup(LearnerGroupOps, Checkpointable):
    is_local = False
    is_remote = True

    def __init__(self, *, config, module_spec, placement_timeout_s: Optional[float] = None):
        """placement_timeout_s: give up (LearnerPlacementTimeout, the placement group removed) when
        the learners' own placement group is not placed within it; None: wait (the first build is
        watched by moe_rl.app.train's WaitWatch, which says what is missing)."""
        self.config, self.module_spec = config, module_spec
        n = config.num_learners
        ds = config.deepspeed_settings
        # RLlib's own learner bundles (custom resources such as {"moe_learner": 1} included): the
        # same as RLlib's resource request for Tune. Inside a Tune trial the learners take the
        # trial's learner bundles (the last n of its placement group) instead of reserving twice.
        bundles = learner_bundles(config)
        trial_pg = ray.util.get_current_placement_group()
        if trial_pg is not None and len(trial_pg.bundle_specs) >= n:
            self._pg, self._own_pg, first = trial_pg, False, len(trial_pg.bundle_specs) - n
        else:
            self._pg, self._own_pg, first = placement_group(bundles, strategy=ds.placement_strategy), True, 0
            if placement_timeout_s is not None and not self._pg.wait(timeout_seconds=placement_timeout_s):
                remove_placement_group(self._pg)
                raise LearnerPlacementTimeout(
                    f"the {n} learners ({bundles[0]} each, {ds.placement_strategy}) could not be placed within "
                    f"{placement_timeout_s:g}s (cluster.wait_timeout_s): the cluster has no room for them now")
        logger.info("moe-rl: starting %d DeepSpeed learners (ep_size %d, each %s) ...", n,
                    config.moe_settings.ep_size, bundles[0])
        t0 = time.monotonic()
        actor_cls = ray.remote(LearnerActor)
        self._workers = [
            actor_cls.options(num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0),
                              resources={k: v for k, v in b.items() if k not in ("CPU", "GPU")},
                              scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, first + i)).remote(
                i, n, ds.num_threads)
            for i, b in enumerate(bundles)]
        addr, port = ray.get(self._workers[0].address.remote())
        ray.get([w.build.remote(config, module_spec, addr, port) for w in self._workers])
        logger.info("moe-rl: DeepSpeed learners ready in %.1fs", time.monotonic() - t0)

    def __len__(self) -> int:
        return len(self._workers)

    # --- training ---------------------------------------------------------------------------------
    def update(self, *, episodes=None, timesteps=None, **kwargs) -> List[Dict[str, Any]]:
        """Shard the episodes over the learners (equal minibatch counts: every rank runs the same
        number of collective steps) and run RLlib's learner update on each. No minibatch size
        (APPO's default): each learner takes its whole shard once per epoch, the same count too."""
        data = TrainingData(episodes=episodes)
        data.validate()
        sized = {k: v for k, v in kwargs.items() if not (k == "minibatch_size" and v is None)}
        shards = list(data.shard(num_shards=len(self), len_lookback_buffer=self.config.episode_lookback_horizon,
                                 **sized))
        return ray.get([w.update.remote(training_data=td, timesteps=timesteps, **kw, **kwargs)
                        for w, (td, kw) in zip(self._workers, shards)])

    def foreach(self, fn: Callable, **kwargs) -> List[Any]:
        return ray.get([w.apply.remote(fn, **kwargs) for w in self._workers])

    foreach_learner = foreach   # RLlib's name for it (RLlib's Algorithm calls it)
    publishers = foreach        # every learner publishes its own part

    def foreach_async(self, fn: Callable, ranks: Optional[List[int]] = None, **kwargs) -> List[ray.ObjectRef]:
        """fn(learner, **kwargs) on the learners of `ranks` (all by default), without waiting:
        the collective weight sync runs both ends at once."""
        return [self._workers[r].apply.remote(fn, **kwargs) for r in (range(len(self)) if ranks is None else ranks)]

    def memory_stats(self) -> List[Dict[str, float]]:
        return ray.get([w.memory_stats.remote() for w in self._workers])

    def trainer_view(self, data: Dict[str, Dict[str, Any]], replay: Optional[bool] = None) -> Dict[str, Dict[str, Any]]:
        """The rollout sample split over the learners (every rank must run the collective
        forward), the views concatenated back in order."""
        n = len(self)
        slices = [{} for _ in range(n)]
        for mid, d in data.items():
            size = len(tree.flatten(d["obs"])[0])
            bounds = np.linspace(0, size, n + 1).astype(int)
            for i in range(n):
                slices[i][mid] = tree.map_structure(lambda x: x[bounds[i]:bounds[i + 1]], d)
        parts = ray.get([w.apply.remote(_view_slice, slices[i], replay) for i, w in enumerate(self._workers)])
        return {mid: {k: np.concatenate([p[mid][k] for p in parts]) for k in parts[0][mid]} for mid in data}

    def snapshot(self) -> str:
        """The exact learner state (weights + every rank's optimizer moments): kept in each
        learner's memory where its optimizer allows (KEPT), else written to a directory."""
        if getattr(self, "_keeps_state", None) is None:
            self._keeps_state = all(ray.get([w.can_keep_state.remote() for w in self._workers]))
        if self._keeps_state:
            ray.get([w.keep_state.remote() for w in self._workers])
            return KEPT
        path = getattr(self, "_snapshot_dir", None) or tempfile.mkdtemp(prefix="moe_rl_last_good_")
        self._snapshot_dir = path
        self.save_to_path(path)
        return path

    def restore(self, snapshot: str) -> None:
        if snapshot == KEPT:
            ray.get([w.restore_kept_state.remote() for w in self._workers])
        else:
            self.restore_from_path(snapshot)

    # --- RLlib's state interface ------------------------------------------------------------------
    def get_state(self, components=None, *, not_components=None, inference_only: bool = False, **kwargs):
        """The full module states assembled from every learner's part (RLlib's LearnerGroup asks
        learner 0 alone), shaped like LearnerGroup.get_state: experts stacked, as a core module
        (the rollout copy) holds them."""
        modules = {mid: stack_experts(state) for mid, state in
                   assemble_modules(ray.get(self.publish_weights(inference_only))).items()}
        return {COMPONENT_LEARNER: {COMPONENT_RL_MODULE: modules}}

    def set_state(self, state: Dict[str, Any]) -> None:
        modules = state.get(COMPONENT_LEARNER, state).get(COMPONENT_RL_MODULE)
        if modules:
            self.load_shards([ray.put({mid: unstack_experts(s) for mid, s in modules.items()})])

    def get_ctor_args_and_kwargs(self):
        return (), {"config": self.config, "module_spec": None}

    def get_checkpointable_components(self):
        return []

    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False) -> str:
        """Every learner writes its DeepSpeed checkpoints (its expert shard + its own optimizer
        moments) into `path` (a directory all learners can reach), and its published part as
        module_shard_rank{r}.pt ({module_id: {global name: tensor}}, loadable with
        torch.load(weights_only=True))."""
        path = str(path)
        os.makedirs(path, exist_ok=True)
        ray.get([w.save.remote(path) for w in self._workers])
        for rank, ref in enumerate(self.publish_weights(inference_only=False)):
            part = {mid: {k: torch.tensor(v) for k, v in state.items()} for mid, state in ray.get(ref).items()}
            if any(part.values()):
                torch.save(part, os.path.join(path, f"module_shard_rank{rank}.pt"))
        with open(os.path.join(path, GROUP_STATE), "w") as f:
            json.dump({"num_learners": len(self)}, f)
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
        ray.get([w.restore.remote(path) for w in self._workers])

    # --- failures ---------------------------------------------------------------------------------
    def dead_learners(self, error: Optional[BaseException] = None, timeout_s: float = 10.0) -> List[int]:
        """Ranks of learners whose actor is gone: the one named by a RayActorError, else those
        that fail a ping (a survivor stuck in a collective with a dead peer only times out)."""
        ids = [ray_private.actor_id_hex(w) for w in self._workers]
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

    def rebuild(self, placement_timeout_s: Optional[float] = None) -> DeepSpeedLearnerGroup:
        """A fresh group with the same config: new actors, new process groups (a DeepSpeed/gloo
        process group cannot be repaired in place once a member died). Restore state afterwards.
        After a lost host the rest of the cluster may have no room for it: LearnerPlacementTimeout
        after placement_timeout_s (None: wait)."""
        self.shutdown()
        return DeepSpeedLearnerGroup(config=self.config, module_spec=self.module_spec,
                                     placement_timeout_s=placement_timeout_s)

    def shutdown(self) -> None:
        for w in self._workers:
            ray.kill(w)
        self._workers = []
        if self._own_pg:
            remove_placement_group(self._pg)
        if getattr(self, "_snapshot_dir", None):
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)


def _alive(learner) -> bool:
    return True


def _view_slice(learner, data, replay):
    return learner.trainer_view(data, replay)

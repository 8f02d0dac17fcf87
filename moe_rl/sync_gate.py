"""SyncGate: the algorithm's side of the consistency check (see actors/consistency.py).

    gate.before_update(episodes)   trainer view of a rollout sample + pre-update shards (refs)
    <learner update>
    decision = gate.after_update() sync | warn | hold | rollback, with a ledger row
    gate.snapshot() / gate.restore()   the last good learner state (weights + optimizer), rollback only
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from typing import Any, Dict, List, Optional

import numpy as np
import ray
import tree
from ray.rllib.core.columns import Columns
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from .rl_module import MOE_TOPK

logger = logging.getLogger("moe_rl")


def rollout_sample(episodes, size: int, seed: int) -> Dict[str, Any]:
    """Up to `size` recorded steps (uniformly over all steps): obs, actions, the rollout's
    log-probs and top-k, the weights version, and the position for token-sequence obs."""
    parts = []
    for ep in episodes:
        n = len(ep)
        if n:
            parts.append({"obs": ep.get_observations(slice(0, n)), "actions": np.asarray(ep.get_actions(slice(0, n))),
                          "logp": ep.get_extra_model_outputs(Columns.ACTION_LOGP, slice(0, n)),
                          "topk": ep.get_extra_model_outputs(MOE_TOPK, slice(0, n)),
                          "seq": ep.get_extra_model_outputs(WEIGHTS_SEQ_NO, slice(0, n))})
    data = tree.map_structure(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)
    total = len(data["actions"])
    pick = np.sort(np.random.default_rng(seed).choice(total, size=min(size, total), replace=False))
    data = tree.map_structure(lambda x: x[pick], data)
    data["logp"] = data["logp"].astype(np.float64)
    obs = data["obs"]
    data["positions"] = np.asarray(obs["position"]).reshape(-1) if isinstance(obs, dict) and "position" in obs else None
    return data


class SyncGate:
    def __init__(self, algo, settings: Dict[str, Any], inference_dtype: str, discrete: bool):
        from actors.consistency import ConsistencyActor
        self.algo, self.s = algo, settings
        self.actor = ray.remote(ConsistencyActor).options(num_cpus=0).remote(settings, inference_dtype, discrete)
        self.replay = bool(algo.config.moe_settings["routing_replay"])
        self._pre: Optional[Dict[str, Any]] = None
        self._snapshot = None
        self._snapshot_dir = tempfile.mkdtemp(prefix="moe_rl_last_good_") if settings["policy"] == "rollback" else None

    # --- helpers over both learner-group kinds ------------------------------------------------------
    @property
    def group(self):
        return self.algo.learner_group

    def _publish(self) -> List[ray.ObjectRef]:
        if hasattr(self.group, "publish_weights"):
            return self.group.publish_weights(inference_only=True)
        state = self.group.get_state(components="learner/rl_module/default_policy", inference_only=True)
        return [ray.put(state["learner"]["rl_module"]["default_policy"])]

    def _rollout_state(self) -> List[ray.ObjectRef]:
        def put_state(runner):
            import ray as _ray
            return _ray.put({k: v.detach().float().cpu().numpy() for k, v in runner.module.state_dict().items()})
        remote = self.algo.env_runner_group.num_remote_env_runners() > 0
        refs = self.algo.env_runner_group.foreach_env_runner(put_state, local_env_runner=not remote)
        return refs[:1]

    def _view(self, data):
        from actors.trainer_view import trainer_view
        return trainer_view(self.group, data, replay=self.replay)

    # --- the check --------------------------------------------------------------------------------
    def before_update(self, episodes) -> None:
        data = rollout_sample(episodes, self.s["sample_size"], seed=self.algo.iteration)
        if not ray.get(self.actor.has_probe.remote()):
            probe = tree.map_structure(lambda x: x[: self.s["probe_size"]], data["obs"])
            ray.get(self.actor.set_probe.remote(probe, self._view({"obs": probe}), self._publish()))
        view = self._view({k: data[k] for k in ("obs", "actions", "topk")})
        self._pre = {
            "rollout": {"logp": data["logp"], "topk": data["topk"], "positions": data["positions"]},
            "trainer": view,
            "weights_seq_no": int(np.max(data["seq"])),
            "learner_shards": self._publish(),
            "replica_shards": self.group.publish_replicas() if hasattr(self.group, "publish_replicas") else None,
            "rollout_state": self._rollout_state(),
        }

    def after_update(self) -> Dict[str, Any]:
        pre, self._pre = self._pre, None
        probe = ray.get(self.actor.get_probe.remote())
        result = ray.get(self.actor.check.remote(
            iteration=self.algo.iteration + 1, weights_seq_no=pre["weights_seq_no"], rollout=pre["rollout"],
            trainer=pre["trainer"], learner_shards=pre["learner_shards"], rollout_state=pre["rollout_state"],
            replica_shards=pre["replica_shards"], candidate_shards=self._publish(),
            probe_view=self._view({"obs": probe})))
        if result["decision"] != "sync":
            logger.warning("weight sync %s: %s", result["decision"], result["reason"])
        return result

    # --- last good state (rollback) ---------------------------------------------------------------
    def snapshot(self) -> None:
        if self._snapshot_dir is None:
            return
        if hasattr(self.group, "publish_weights"):
            self.group.save_to_path(self._snapshot_dir)
        else:
            self._snapshot = self.group.get_state()

    def restore(self) -> None:
        if hasattr(self.group, "publish_weights"):
            self.group.restore_from_path(self._snapshot_dir)
        else:
            self.group.set_state(self._snapshot)

    def ledger(self) -> List[Dict[str, Any]]:
        return ray.get(self.actor.ledger.remote())

    def close(self) -> None:
        if self._snapshot_dir:
            shutil.rmtree(self._snapshot_dir, ignore_errors=True)
        ray.kill(self.actor)

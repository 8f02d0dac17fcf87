"""Every private Ray or RLlib name moe-rl reads, writes or overrides, in one place, each with why no
public API serves.

A Ray upgrade that moves one of these breaks here and nowhere else: tests/test_private_names.py
reads every other module's syntax tree against the private names RLlib and Ray define and fails on
any found outside this file (imports of `ray._private` included). The private methods moe-rl must
override are mixins here (`ShardedWithoutDDP`, `KeepKLCoeffOnSkippedUpdate`, `ModelConfigCarriesMoE`),
placed before RLlib's class where they are used.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional

import ray
from ray._private import ray_constants, state, worker
from ray._private.authentication import authentication_token_setup
from ray.experimental import internal_kv
from ray.rllib.algorithms import utils as rllib_utils
from ray.rllib.core.learner.learner import DEFAULT_OPTIMIZER  # noqa: F401  (public; re-exported for one import)

# --- a local head on loopback -------------------------------------------------------------------
# Ray picks a node IP from the machine's LAN address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
# and reads that variable once, when `ray` is imported (ray_constants.ENABLE_RAY_CLUSTER). There is
# no public switch; `ray.init(_node_ip_address="127.0.0.1")` alone is mapped back to the LAN
# address by services.resolve_ip_for_localhost. The variable is set too, for the raylet, GCS and
# workers the head starts (they read it at their own import).
CLUSTER_SWITCH = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR


def keep_local_ray_on_loopback() -> None:
    os.environ[CLUSTER_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


# Token auth for the embedded head, said by us rather than left to Ray's default for new local
# clusters (which a RAY_AUTH_MODE=disabled in the environment turns off). RAY_AUTH_MODE is read into
# Ray's cached config at import; Ray's own helper sets it and refreshes that cache, so ray.init
# then creates the host's token (~/.ray/auth_token) if it is missing.
def require_token_auth() -> None:
    authentication_token_setup._enable_token_auth()


# --- the GCS key-value store --------------------------------------------------------------------
# Small rendezvous records (a weight-sync group's store address, a starting learner's step) that
# must be readable by the driver and other actors without a round trip through an actor of their
# own: the public alternative, a named actor as a store, costs a worker process and a CPU slot.
def kv_put(key: str, value: str, overwrite: bool = True) -> None:
    internal_kv._internal_kv_put(key, value, overwrite=overwrite)


def kv_get(key: str) -> Optional[bytes]:
    return internal_kv._internal_kv_get(key)


def kv_del(key: str) -> None:
    internal_kv._internal_kv_del(key)


def kv_list(prefix: str) -> List[bytes]:
    return internal_kv._internal_kv_list(prefix)


def autoscaler_status() -> Optional[Dict[str, Any]]:
    """The autoscaler's last status report (what `ray status` prints), None where there is none:
    Ray publishes it only in the GCS key-value store."""
    if not internal_kv._internal_kv_initialized():
        return None
    raw = internal_kv._internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    return json.loads(raw) if raw else None


# --- actors and the node this driver started ---------------------------------------------------
def job_actors(job_id: str) -> List[Dict[str, Any]]:
    """This job's actors as the GCS sees them. ray.util.state.list_actors asks the dashboard, which
    the embedded Ray does not start (include_dashboard=False)."""
    return list(state.actors(job_id=ray.JobID.from_hex(job_id)).values())


def embedded_head_node():
    """The Ray head this process started (its raylet and GCS are our children), or None. No public
    API exposes the processes a driver started."""
    node = getattr(worker, "_global_node", None)
    return node if node is not None and node.is_head() else None


# --- RLlib's resource bundles ------------------------------------------------------------------
# Algorithm.default_resource_request (public) returns the same bundles flattened into one list,
# after validating and freezing a copy of the config; these helpers give them per actor kind.
def main_process_bundle(config) -> Dict[str, Any]:
    return rllib_utils._get_main_process_bundle(config)


def env_runner_bundles(config) -> List[Dict[str, Any]]:
    return rllib_utils._get_env_runner_bundles(config)


def learner_bundles(config) -> List[Dict[str, Any]]:
    return rllib_utils._get_learner_bundles(config)


# --- loggers whose notices the console drops (moe_rl/app/console.py) ----------------------------
LOGGER_NOISE: Dict[str, List[str]] = {
    # Ray's token authentication, generating the host's token the first time
    "ray._private.authentication.authentication_token_setup": [
        r"Token authentication is enabled for this Ray cluster\.",
        r"Generated new authentication token and saved to "],
    # Ray starting the embedded cluster: moe-rl prints its own phase lines for that
    "ray._private.worker": [r"Started a local Ray instance\.", r"Connecting to existing Ray cluster at address"],
}


# --- the Learner's internals ---------------------------------------------------------------------
# RLlib keeps a learner's connector pipeline, its LR schedulers per optimizer and the torch LR
# scheduler classes of the config in private attributes and offers no accessor; RLlib's own
# learners (DQN's, PPO's) reach the pipeline the same way when they add pieces in build().
def append_learner_connector(learner, piece) -> None:
    """A learner connector piece at the end of the pipeline (no pipeline: nothing to add to)."""
    if learner._learner_connector is not None:
        learner._learner_connector.append(piece)


def learner_lr_schedule(learner, optimizer):
    """RLlib's Scheduler of `lr` for this optimizer (None: a fixed lr)."""
    return learner._optimizer_lr_schedules.get(optimizer)


def learner_lr_scheduler_classes(learner):
    """The config's experimental torch LR scheduler classes (moe-rl refuses them: per-group LRs)."""
    return learner._lr_scheduler_classes


class KeepKLCoeffOnSkippedUpdate:
    """PPO's adaptive KL coefficient moves once per update in the private `_update_module_kl_coeff`,
    which warns that the policy made the KL non-finite; when the rollout correction emptied the
    last minibatch, the KL is NaN for that reason alone. The learner says when (`kl_update_skipped`);
    then the coefficient stays and the misleading warning is not given. Public hooks run either
    before PPO's update (the KL is not known yet) or after it (the warning is out)."""

    def kl_update_skipped(self, module_id: str, kl_loss: float) -> bool:
        return False

    def _update_module_kl_coeff(self, *, module_id, config, kl_loss) -> None:
        if not self.kl_update_skipped(module_id, kl_loss):
            super()._update_module_kl_coeff(module_id=module_id, config=config, kl_loss=kl_loss)


class ShardedWithoutDDP:
    """For a learner whose modules DeepSpeed shards and whose gradients DeepSpeed reduces:
    - `_make_module`: RLlib builds the module and then, inside build(), its optimizers, with no
      public hook between; the expert-parallel layers must be in place before the optimizers see
      the parameters (`after_module_made`).
    - `_make_modules_ddp_if_necessary`: RLlib wraps modules in DDP when there are several
      learners; DDP would broadcast rank 0's experts to every rank and average different experts'
      gradients. Never here.
    - `_uncompiled_update`: RLlib 2.60 enters `module.no_sync()` there whenever num_learners > 1, a
      DDP method an unwrapped module lacks; this is RLlib's update step without it (the rest is
      RLlib's public hooks, called as there)."""

    def after_module_made(self, module) -> None:
        """Change the module in place before any optimizer is built."""

    def _make_module(self):
        module = super()._make_module()
        self.after_module_made(module)
        return module

    def _make_modules_ddp_if_necessary(self) -> None:
        pass

    def _uncompiled_update(self, batch, **kwargs):
        self._compute_off_policyness(batch)
        fwd_out = self.module.forward_train(batch)
        loss_per_module = self.compute_losses(fwd_out=fwd_out, batch=batch)
        self.apply_gradients(self.postprocess_gradients(self.compute_gradients(loss_per_module)))
        return fwd_out, loss_per_module, {}


# --- the AlgorithmConfig's internals ------------------------------------------------------------
class ModelConfigCarriesMoE:
    """The MoE settings reach every RLModule RLlib builds (learners, rollout copies, evaluation)
    through `_model_config_auto_includes`, the private property by which RLlib's own configs hand
    their algorithm settings to the module (DQN's epsilon, dueling, ...); a user's `model_config`
    is the only public route, and it is the user's."""

    @property
    def _model_config_auto_includes(self):
        return super()._model_config_auto_includes | {"moe": self.moe_settings}


def config_is_frozen(config) -> bool:
    """Whether RLlib froze the config (it validated it first); RLlib offers no public accessor."""
    return config._is_frozen


# --- groups, runners, algorithms and actor handles -------------------------------------------
def local_learner(learner_group):
    """RLlib's LearnerGroup's learner in this process (a local group), else None."""
    return learner_group._learner


def first_remote_learner_id(learner_group) -> list:
    """The id of RLlib's first remote learner actor (the one that publishes): foreach_learner takes
    ids, and only the group's worker manager knows them."""
    return learner_group._worker_manager.actor_ids()[:1]


def set_runner_weights_seq_no(runner, version: int) -> None:
    """A rollout copy's weights version, set where moe-rl loads the weights over a collective
    (RLlib sets it only in its own set_state)."""
    runner._weights_seq_no = version


def algorithm_time_total(algo) -> "float | None":
    """The algorithm's total training time, which RLlib checkpoints nowhere a restore reads it back."""
    return getattr(algo, "_time_total", None)


def set_algorithm_time_total(algo, seconds: float) -> None:
    algo._time_total = seconds


def actor_id_hex(handle) -> str:
    """A Ray actor handle's id: the handle exposes it only privately (the actor itself has
    ray.get_runtime_context().get_actor_id())."""
    return handle._actor_id.hex()


def metrics_report_interval_s() -> float:
    """How often Ray's processes report their metrics (its system config has no public reader)."""
    return ray._config.metrics_report_interval_ms() / 1000.0

"""Every private Ray or RLlib call moe-rl makes, in one place, each with why no public API serves.

A Ray upgrade that moves one of these breaks here and nowhere else; tests/test_packaging.py fails
on a private Ray import anywhere outside this module.
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

"""Checkpoints that are complete or absent, verified before use.

    save_checkpoint(algo, checkpoints_dir, iteration, run_config, keep)
        algo.save_to_path into checkpoints/.tmp-iter_NNNNNN, the driver's RNG state, manifest.json
        (sha256 + size of every file, iteration, resolved run config, moe-rl version, time),
        fsync, os.rename to checkpoints/iter_NNNNNN, keep the last `keep`. A failed write leaves
        no iter_ directory behind (CheckpointWriteError names the path).
    verify_checkpoint, latest_good_checkpoint   every file against the manifest: checkpoint_integrity.py
    verify_weights(algo, path, cfg)  the checkpoint's policy reloaded (as `moe-rl evaluate` loads it)
                                     vs. the live learner module on a probe batch
    restore_checkpoint(algo, path)   a private verified copy (signature checked on the bytes copied:
                                     verified_copy.py), algo.restore_from_path on it, driver RNG state
    load_policy(checkpoint, cfg, ...) the policy a checkpoint holds (`moe-rl evaluate`, verification)
    recover_learners(algo, error, ...)  a dead DeepSpeed learner: rebuild the group, restore the newest good one
"""
from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import ray
import torch
import tree
from ray.rllib.algorithms.ppo.ppo_catalog import PPOCatalog
from ray.rllib.algorithms.ppo.torch.default_ppo_torch_rl_module import DefaultPPOTorchRLModule
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.rl_module import RLModule, RLModuleSpec

from moe_rl import __version__
from moe_rl.actors.learner_group import LearnerPlacementTimeout
from moe_rl.algo.algorithm import MoEPPOConfig
from moe_rl.algo.dqn import MoEDQNConfig
from moe_rl.app.checkpoint_integrity import (  # noqa: F401  (names callers reach through this module)
    CORRUPT_PREFIX,
    FORMAT,
    MANIFEST,
    TMP_PREFIX,
    CheckpointError,
    CheckpointRefused,
    checkpoint_iteration,
    checkpoint_name,
    checkpoint_names,
    digest,
    files_of,
    latest_good_checkpoint,
    newest_checkpoint,
    verify_checkpoint,
)
from moe_rl.app.run_signature import FIELD as SIGNATURE
from moe_rl.app.run_signature import is_signed_by_user, read_signed_file, sign, unsigned_reason
from moe_rl.app.verified_copy import UntrustedCheckpoint, read_verified, verified_copy
from moe_rl.core.errors import ConfigError
from moe_rl.core.param_groups import without_targets
from moe_rl.core.sharding import assemble_modules, assemble_shards, stack_experts, unstack_experts
from moe_rl.rllib import ray_private

RNG_FILE = "driver_rng.pt"


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written; str() is one line naming the path."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root, topdown=False):
        for f in files:
            _fsync(os.path.join(dirpath, f))
        _fsync(dirpath, directory=True)


def write_manifest(path: str, iteration: int, run_config: Optional[Dict[str, Any]],
                   time_total_s: Optional[float] = None) -> Dict[str, Any]:
    """manifest.json: every file's sha256 and size and the run config, signed with the user's key
    (run_signature: --resume trusts only the user's own runs)."""
    files = {}
    for rel in files_of(path):
        if rel != MANIFEST:
            sha, size = digest(os.path.join(path, rel))
            files[rel] = {"sha256": sha, "size": size}
    now = time.time()
    manifest = {"format": FORMAT, "iteration": int(iteration), "moe_rl_version": __version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)), "created_unix": now,
                "time_total_s": time_total_s, "run_config": run_config, "files": files}
    manifest = json.loads(json.dumps(manifest, default=str))   # signed as it will be read back
    manifest[SIGNATURE] = sign(manifest)
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    return manifest


# --- driver RNG state (python, numpy, torch), loadable with torch.load(weights_only=True) -----------
def save_rng_state(path: str) -> None:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    torch.save({"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
                "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
                "torch": torch.get_rng_state()}, os.path.join(path, RNG_FILE))


def load_rng_state(path: str) -> bool:
    file = os.path.join(path, RNG_FILE)
    if not os.path.isfile(file):
        return False
    s = torch.load(file, weights_only=True)
    p = s["python"]
    random.setstate((p["version"], tuple(int(v) for v in p["state"].tolist()), p["gauss"]))
    n = s["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(s["torch"])
    return True


# --- write ----------------------------------------------------------------------------------------
SHARDS = "module_shard_rank{}.pt"
SHARD_FILE = re.compile(r"^learner_group/module_shard_rank(\d+)\.pt$")


def save_policy_shards(algo, path: str) -> None:
    """Every learner's published part as learner_group/module_shard_rank{r}.pt, tensors only, so
    `moe-rl evaluate` loads the policy with torch.load(weights_only=True) and never unpickles RLlib's
    module files. The DeepSpeed learner group writes them itself (save_to_path)."""
    folder = os.path.join(path, "learner_group")
    if os.path.isdir(folder) and any(SHARD_FILE.match(f"learner_group/{n}") for n in os.listdir(folder)):
        return
    os.makedirs(folder, exist_ok=True)
    for rank, ref in enumerate(algo.learner_group.publish_weights(inference_only=False)):
        part = {mid: {k: torch.tensor(np.array(v)) for k, v in state.items()} for mid, state in ray.get(ref).items()}
        torch.save(part, os.path.join(folder, SHARDS.format(rank)))



def save_checkpoint(algo, checkpoints_dir: str, iteration: int, run_config: Optional[Dict[str, Any]] = None,
                    keep: Optional[int] = None) -> str:
    """Atomic: the returned checkpoints/iter_NNNNNN is complete (manifest last, fsynced, renamed)."""
    name = checkpoint_name(iteration)
    final = os.path.join(checkpoints_dir, name)
    tmp = os.path.join(checkpoints_dir, TMP_PREFIX + name)
    old = os.path.join(checkpoints_dir, TMP_PREFIX + "replaced-" + name)
    try:
        for stale in os.listdir(checkpoints_dir):  # left by a process that died mid-write
            if stale.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(checkpoints_dir, stale), ignore_errors=True)
        algo.save_to_path(tmp)
        save_policy_shards(algo, tmp)
        save_rng_state(tmp)
        write_manifest(tmp, iteration, run_config, ray_private.algorithm_time_total(algo))
        _fsync_tree(tmp)
        if os.path.exists(final):  # the same iteration again (after a resume or a learner restart)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(checkpoints_dir, directory=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(old) and not os.path.exists(final):
            os.rename(old, final)
        cause = getattr(e, "cause", None) or e  # a learner actor's OSError arrives as RayTaskError
        reason = getattr(cause, "strerror", None) or (str(cause).splitlines() or [type(cause).__name__])[0]
        raise CheckpointWriteError(e.errno, f"checkpoints: cannot write checkpoint {final!r}: {reason}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    if keep:
        prune(checkpoints_dir, keep)
    return final


def prune(checkpoints_dir: str, keep: int) -> List[str]:
    """Remove all but the newest `keep` checkpoints; returns the removed names."""
    names = checkpoint_names(checkpoints_dir)
    gone = names[:-keep] if keep >= 1 else []
    for n in gone:
        shutil.rmtree(os.path.join(checkpoints_dir, n), ignore_errors=True)
    return gone


def quarantine(path: str) -> str:
    """Rename a bad checkpoint out of the iter_* namespace (kept for inspection, never loaded)."""
    target = os.path.join(os.path.dirname(path), CORRUPT_PREFIX + os.path.basename(path))
    shutil.rmtree(target, ignore_errors=True)
    os.rename(path, target)
    return target


class UntrustedRun(ConfigError):
    """A run directory that is not the user's own; str() is one line naming the option to trust it."""


def authenticate(path: str, run_dir: str, config_reason: "str | None" = "unchecked") -> Dict[str, Any]:
    """The checkpoint verifies, and its manifest and RUN_DIR/config.yaml are signed with the user's
    key; else UntrustedRun. An early refusal, before Ray starts: the restore checks the signature
    again on the bytes it loads (restore_checkpoint). config_reason: why the config.yaml bytes the
    caller read are not signed (None: they are), so the file is not read a second time."""
    manifest = verify_checkpoint(path)
    name = os.path.basename(os.path.normpath(path))
    hint = "pass --trust-run to resume it anyway (it will unpickle the run's files)"
    if not is_signed_by_user(manifest):
        raise UntrustedRun(f"--resume: {run_dir!r}: {unsigned_reason(manifest, name)}: a run from elsewhere or an "
                           f"edited one; {hint}")
    if config_reason == "unchecked":
        config_reason = read_signed_file(os.path.join(run_dir, "config.yaml"))[1]
    if config_reason:
        raise UntrustedRun(f"--resume: {run_dir!r}: {config_reason}; {hint}")
    return manifest


def restore_checkpoint(algo, path: str, require_signature: bool = True) -> Dict[str, Any]:
    """Restore everything the checkpoint holds: weights, optimizer state of every learner, RLlib
    learner/algorithm state (iteration counter, metrics, LR schedule position), connector states,
    PPO's KL coefficients, the driver's RNG state and the run's clock. Everything is read from a
    private copy whose bytes were hashed as they were copied and checked against the manifest
    (and its signature, unless the run is trusted) in the same step: nothing can be swapped in
    between the check and the load. CheckpointError / UntrustedCheckpoint otherwise."""
    copy, manifest = verified_copy(path, require_signature)
    try:
        algo.restore_from_path(copy)
        load_rng_state(copy)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if manifest.get("time_total_s") is not None:  # Trainable's clock (result time_total_s) goes on
        ray_private.set_algorithm_time_total(algo, float(manifest["time_total_s"]))
    return manifest


# --- the policy in a checkpoint, and periodic weight verification -------------------------------
def module_settings(cfg: dict, module_id: str) -> Optional[Dict[str, Any]]:
    """The `moe` settings of a run's module (its multi-agent overrides merged in); None: a plain
    RLlib PPO module."""
    policy = ((cfg.get("multi_agent") or {}).get("policies") or {}).get(module_id) or {}
    return None if policy.get("dense") else {**cfg["moe"], **(policy.get("moe") or {})}


# A run's algorithm -> its config class (for its module class) and the training keys its module
# reads (DQN's heads and epsilon). APPO's policy is PPO's module without the target copy.
MODULE_CONFIGS = {"ppo": (MoEPPOConfig, ()), "appo": (MoEPPOConfig, ()),
                  "dqn": (MoEDQNConfig, ("double_q", "dueling", "num_atoms", "epsilon"))}


def policy_module_spec(cfg: dict, moe: Dict[str, Any]) -> RLModuleSpec:
    """The MoE module a run trained, with the training settings its module reads."""
    config_class, keys = MODULE_CONFIGS[cfg.get("algo", "ppo")]
    training = {k: v for k, v in (cfg.get("training") or {}).items() if k in keys}
    model_config = dict(config_class().training(**training).model_config)
    return RLModuleSpec(module_class=config_class.module_class, model_config={**model_config, "moe": moe})


def load_policy(checkpoint: str, cfg: dict, observation_space, action_space,
                module_id: str = DEFAULT_MODULE_ID, require_signature: bool = False) -> RLModule:
    """A module from a checkpoint's per-learner parts module_shard_rank*.pt: the module is built
    from the run's (validated) config and the tensors are loaded with weights_only and strictly,
    from the bytes that were hashed against the manifest (and its signature, if required) as they
    were read. RLlib's pickled module files are never read: a run directory may come from anyone."""
    try:
        shards = read_verified(checkpoint, SHARD_FILE.match, require_signature)
    except CheckpointError as e:
        raise ConfigError(f"RUN_DIR: {e}") from None
    except UntrustedCheckpoint as e:
        raise ConfigError(f"RUN_DIR: {e}; pass --trust-run to open it (only its data is read)") from None
    if not shards:
        raise ConfigError(f"RUN_DIR: checkpoint {checkpoint!r} holds no tensor-only policy files "
                          f"(learner_group/{SHARDS.format('N')}); it was written by an older moe-rl")
    moe = module_settings(cfg, module_id)
    spec = (policy_module_spec(cfg, moe) if moe is not None else
            RLModuleSpec(module_class=DefaultPPOTorchRLModule, catalog_class=PPOCatalog,
                         model_config=dict(MoEPPOConfig().model_config)))   # PPO's defaults, as the run built it
    spec.observation_space, spec.action_space, spec.inference_only = observation_space, action_space, False
    module = spec.build()
    ordered = sorted(shards, key=lambda rel: int(SHARD_FILE.match(rel).group(1)))
    try:
        with warnings.catch_warnings():   # a foreign file's pickle protocol: the refusal below says enough
            warnings.simplefilter("ignore", UserWarning)
            full = assemble_modules([torch.load(io.BytesIO(shards[rel]), weights_only=True) for rel in ordered])
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:   # code or junk, not tensors
        raise ConfigError(f"RUN_DIR: checkpoint {checkpoint!r} has a policy file that holds more than tensors "
                          f"(refused, nothing was run: {str(e).splitlines()[0][:120]})") from None
    if module_id not in full:
        raise ConfigError(f"RUN_DIR: checkpoint {checkpoint!r} holds no module {module_id!r}")
    own = module.state_dict()
    policy = without_targets(full[module_id])   # APPO's old policy is training state, not the policy
    module.load_state_dict(stack_experts(assemble_shards([policy], unstack_experts(own).keys()), own.keys()),
                           strict=True)
    return module


def _forward_outputs(module, obs) -> Dict[str, Any]:
    module = module.unwrapped() if hasattr(module, "unwrapped") else module
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            out = module.forward_inference({Columns.OBS: obs})
    finally:
        module.train(was_training)
    return {k: v.detach().cpu().double().numpy() for k, v in out.items() if torch.is_tensor(v)}


def probe_batch(observation_space, size: int = 32, seed: int = 0):
    observation_space.seed(seed)
    samples = [observation_space.sample() for _ in range(size)]

    def stack(*xs):
        a = np.stack([np.asarray(x) for x in xs])
        return torch.as_tensor(a.astype(np.float32) if a.dtype.kind == "f" else a)
    return tree.map_structure(stack, *samples)


def verify_weights(algo, path: str, run_config: Dict[str, Any], probe_size: int = 32,
                   tol: float = 1e-6) -> Tuple[bool, float]:
    """Load every module of the checkpoint from its files (as `moe-rl evaluate` loads it) and
    compare its outputs on a probe batch with the live weights' (every learner's published part,
    in the same module class). Returns (ok, worst max abs diff)."""
    group = algo.learner_group
    live_state = assemble_modules(ray.get(group.publish_weights(inference_only=False)))
    spaces = group.publishers(lambda l: {m: (l.module[m].observation_space, l.module[m].action_space)
                                         for m in l.module.keys()})[0]
    worst = 0.0
    for mid, state in live_state.items():
        obs_space, act_space = spaces[mid]
        obs = probe_batch(obs_space, probe_size)
        loaded = load_policy(path, run_config, obs_space, act_space, mid)
        ckpt = _forward_outputs(loaded, obs)
        own = loaded.state_dict().keys()
        # np.array copies: the published arrays come read-only from Ray's object store, and torch
        # warns (once per process, on the user's console) when it wraps a read-only array.
        state = without_targets(state)
        loaded.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in stack_experts(state, own).items()},
                               strict=True)
        live = _forward_outputs(loaded, obs)
        if set(ckpt) != set(live) or any(ckpt[k].shape != live[k].shape for k in live):
            return False, float("inf")
        for k in live:
            if ckpt[k].size:
                worst = max(worst, float(np.nan_to_num(np.abs(ckpt[k] - live[k]), nan=np.inf).max()))
    return worst <= tol, worst


# --- learner failures ---------------------------------------------------------------------------
class LearnerFailure(RuntimeError):
    """A learner died and the run stops; str() is one line naming it and how to --resume."""


def recover_learners(algo, error: BaseException, run_dir: str, restore: bool,
                     placement_timeout_s: Optional[float] = None) -> Tuple[str, str]:
    """After a Ray error in algo.train(): if learners died, rebuild the whole learner group (a
    DeepSpeed process group cannot be repaired in place) and restore the newest good checkpoint.
    Returns (checkpoint, who died). Raises LearnerFailure when that is off or impossible, and
    re-raises `error` when no learner died (not a learner failure)."""
    ranks = algo.learner_group.dead_learners(error)
    if not ranks:
        raise error
    who = f"learner {ranks[0]}" if len(ranks) == 1 else "learners " + ", ".join(map(str, ranks))
    hint = f"continue with `moe-rl train --resume {run_dir}`"
    if not restore:
        raise LearnerFailure(f"{who} died ({type(error).__name__}) and restore_on_learner_failure is false; "
                             f"{hint}")
    good = latest_good_checkpoint(run_dir)
    if good is None:
        raise LearnerFailure(f"{who} died ({type(error).__name__}) before the first good checkpoint; "
                             "nothing to restore from: start the run again")
    try:
        algo.learner_group = algo.learner_group.rebuild(placement_timeout_s)
    except LearnerPlacementTimeout as e:   # a lost host took their room: say so, resumably
        raise LearnerFailure(f"{who} died ({type(error).__name__}) and {e}; {hint}") from None
    try:
        restore_checkpoint(algo, good)
    except (CheckpointError, UntrustedCheckpoint) as e:   # changed under the run, or one not signed by it
        raise LearnerFailure(f"{who} died ({type(error).__name__}) and {os.path.basename(good)} cannot be "
                             f"restored ({e}); {hint}") from None
    return good, who

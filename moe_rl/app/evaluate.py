"""Evaluation of a run's newest good checkpoint (no Ray cluster needed: the policy loads from disk,
then steps a local gymnasium env): greedy episodes, and per task for a multi-task env."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.core.columns import Columns

import moe_rl.envs  # noqa: F401  registers moe_rl/ envs
from moe_rl.algo.multi_agent import import_path, validate_multi_agent
from moe_rl.app.checkpoint import CheckpointError, latest_good_checkpoint, load_policy
from moe_rl.app.resume import resume_config
from moe_rl.app.run_config import load_run_config, validate_run_config
from moe_rl.app.run_signature import read_signed_file
from moe_rl.app.run_trust import refuse_file_references, refuse_import_paths
from moe_rl.core.errors import ConfigError
from moe_rl.core.settings import saved_run_config


def _to_tensor(obs):
    if isinstance(obs, dict):
        return {k: torch.as_tensor(np.asarray(v))[None] for k, v in obs.items()}
    return torch.as_tensor(np.asarray(obs, dtype=np.float32))[None]


def greedy_action(module, obs, action_space, generator=None):
    """The policy's most likely action; with a `generator`, an action sampled from the policy
    (discrete actions; MOORE's evaluation samples)."""
    with torch.no_grad():
        out = module.forward_inference({Columns.OBS: _to_tensor(obs)})
    if Columns.ACTION_DIST_INPUTS not in out:   # a Q-policy: the greedy action on its Q-values
        return int(out[Columns.ACTIONS][0])
    logits = out[Columns.ACTION_DIST_INPUTS][0]
    if hasattr(action_space, "n"):
        if generator is not None:
            return int(torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator))
        return int(logits.argmax())
    mean = logits[: logits.shape[0] // 2].numpy()
    return np.clip(mean, action_space.low, action_space.high)


def play_episode(module, env, seed: int, options=None, generator=None) -> Tuple[float, dict]:
    """One episode from reset(seed, options): (undiscounted return, the last step's info); actions
    greedy, or sampled with `generator`."""
    obs, info = env.reset(seed=seed, options=options)
    total, done = 0.0, False
    while not done:
        obs, r, term, trunc, info = env.step(greedy_action(module, obs, env.action_space, generator))
        total += float(r)
        done = term or trunc
    return total, info


def load_run(run_dir: str, flag: str = "RUN_DIR", trust_env_code: Optional[bool] = None,
             trust_run: bool = False) -> Tuple[dict, str, bool]:
    """A run directory's config.yaml, validated as a --config is (an env or anything else naming
    code to import is refused unless trust_env_code; None: trusted when the bytes read are signed
    with the user's key), its newest good checkpoint (ConfigError naming `flag`), and whether its
    policy must come from a manifest signed with the user's key (a signed config.yaml, and not
    trust_run: --trust-run opens a run that is not signed).
    Only data is read: YAML (the bytes whose signature was checked), and tensors through
    weights_only loads (load_policy)."""
    cfg_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{flag}: must be a moe-rl run directory with config.yaml, got {run_dir!r}")
    try:
        data, unsigned = read_signed_file(cfg_path)
    except OSError as e:
        raise ConfigError(f"{flag}: {run_dir!r} config.yaml cannot be read ({e.strerror or e})") from None
    cfg = saved_run_config(load_run_config(cfg_path, flag=f"{flag} config.yaml", data=data))
    signed = unsigned is None
    if trust_env_code is None:
        trust_env_code = signed
    try:
        if not signed:
            refuse_file_references(cfg, "config.yaml")
        if not trust_env_code:   # the file as written (resume_config drops keys RLlib refuses)
            refuse_import_paths(cfg)
        validate_run_config(resume_config(cfg), trust_env_code=trust_env_code)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {run_dir!r} config.yaml: {e}") from None
    try:   # verified against its manifest; bad ones are reported; a planted symlink or device stops here
        ckpt = latest_good_checkpoint(run_dir, refuse=True)
    except CheckpointError as e:
        raise ConfigError(f"{flag}: {run_dir!r}: {e}") from None
    if ckpt is None:
        raise ConfigError(f"{flag}: {run_dir!r} has no good checkpoint under checkpoints/")
    return cfg, ckpt, signed and not trust_run


def evaluate_run(run_dir: str, episodes: int = 10, trust_env_code: Optional[bool] = None,
                 trust_run: bool = False) -> Tuple[float, List[float]]:
    if episodes < 1:
        raise ConfigError(f"--episodes: must be >= 1, got {episodes}")
    cfg, ckpt, signed = load_run(run_dir, trust_env_code=trust_env_code, trust_run=trust_run)
    seed = int(cfg.get("seed", 0)) + 10_000
    if cfg.get("multi_agent"):
        return _evaluate_multi_agent(cfg, ckpt, episodes, seed, signed)
    env = gym.make(cfg["env"], **(cfg.get("env_config") or {}))
    module = load_policy(ckpt, cfg, env.observation_space, env.action_space, require_signature=signed)
    module.eval()
    returns = [play_episode(module, env, seed + ep)[0] for ep in range(episodes)]
    env.close()
    return float(np.mean(returns)), returns


def evaluate_tasks(run_dir: str, episodes: int = 16,
                   trust_env_code: Optional[bool] = None, trust_run: bool = False) -> Dict[str, Dict[str, float]]:
    """A multi-task run (an env with `task_names`, e.g. moe_rl/MiniGrid-MT3-v0): evaluate_module_tasks
    on its newest good checkpoint. {} for a single-task env."""
    if episodes < 1:
        raise ConfigError(f"--episodes: must be >= 1, got {episodes}")
    cfg, ckpt, signed = load_run(run_dir, trust_env_code=trust_env_code, trust_run=trust_run)
    if cfg.get("multi_agent"):
        return {}
    env = gym.make(cfg["env"], **(cfg.get("env_config") or {}))
    if not getattr(env.unwrapped, "task_names", None):
        return {}
    module = load_policy(ckpt, cfg, env.observation_space, env.action_space, require_signature=signed).eval()
    try:
        return evaluate_module_tasks(module, env, episodes, int(cfg.get("seed", 0)) + 10_000)
    finally:
        env.close()


def evaluate_module_tasks(module, env, episodes: int, seed: int) -> Dict[str, Dict[str, float]]:
    """Per task of a multi-task env: the mean undiscounted return and the success rate over `episodes`
    episodes with sampled actions (MOORE's protocol) and with greedy ones. Any RLModule whose
    forward_inference gives action logits (the bench's dense peer too)."""
    out: Dict[str, Dict[str, float]] = {}
    for task, name in enumerate(env.unwrapped.task_names):
        figures = out.setdefault(name, {})
        for mode in ("sampled", "greedy"):
            generator = torch.Generator().manual_seed(seed + task) if mode == "sampled" else None
            played = [play_episode(module, env, seed + ep, {"task_id": task}, generator) for ep in range(episodes)]
            returns = [total for total, _ in played]
            successes = [float(info.get("success", False)) for _, info in played]
            figures[f"{mode}_return"] = float(np.mean(returns))
            figures[f"{mode}_success"] = float(np.mean(successes))
    return out


def _evaluate_multi_agent(cfg, ckpt, episodes: int, seed: int, signed: bool) -> Tuple[float, List[float]]:
    """Every agent acts greedily with its own module (the run's mapping); an episode's return is
    the sum over agents, as RLlib reports it. (load_run has refused code to import unless trusted.)"""
    env = import_path(cfg["env"], "env")(cfg.get("env_config") or {})
    mapping = validate_multi_agent(cfg["multi_agent"], cfg["moe"], None)["mapping_fn"]
    modules = {}
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        total, done = 0.0, False
        while not done:
            actions = {}
            for aid, o in obs.items():
                mid = mapping(aid, None)
                if mid not in modules:
                    modules[mid] = load_policy(ckpt, cfg, env.get_observation_space(aid), env.get_action_space(aid),
                                               mid, require_signature=signed).eval()
                actions[aid] = greedy_action(modules[mid], o, env.get_action_space(aid))
            obs, rewards, term, trunc, _ = env.step(actions)
            total += float(sum(rewards.values()))
            done = term.get("__all__", False) or trunc.get("__all__", False)
        returns.append(total)
    return float(np.mean(returns)), returns

"""Run configuration: YAML + `--set dotted.key=value` overrides -> a validated MoEPPOConfig (or
MoEAPPOConfig under `algo: appo`).

A run config is a plain mapping whose sections are named after the config's builder methods:

    algo: ppo                   # ppo | appo: the RLlib algorithm (ALGOS)
    env: CartPole-v1            # any gymnasium id, incl. moe_rl/MultiTask-v0, moe_rl/TokenSequence-v0
    env_config: {}
    seed: 0
    iterations: 60
    stop_return: 475            # stop early once the mean episode return reaches this (null: never)
    checkpoint_every: 10
    checkpoint_keep: 3          # keep the newest K checkpoints
    checkpoint_verify_every_s: 7200   # reload-and-compare a checkpoint at most this often (0: every one)
    restore_on_learner_failure: true  # a dead DeepSpeed learner: rebuild the group, restore the last good one
    env_runners: {num_env_runners: 1, num_envs_per_env_runner: 8}
    learners: {num_learners: 0}
    training: {lr: 0.0003, ...}  # PPOConfig.training keys
    moe: {num_experts: 8, ...}   # MoEPPOConfig.moe keys (each section's: moe_rl.core.sections)
    stability: {}
    consistency: {}
    weight_sync: {transport: object_store}   # MoEPPOConfig.weight_sync keys
    wandb: {project: moe-rl, mode: offline}   # optional: log every row to Weights & Biases
    cluster: {wait_timeout_s: 120}            # give up when the actors cannot be placed (null: no limit)
    multi_agent: {policies: {p0: {}, p1: {dense: true}}, mapping: {"0": p0, "1": p1}}   # moe_rl.algo.multi_agent

Everything here fails fast with ConfigError (one line naming the field) before Ray starts.
"""
from __future__ import annotations

import copy
import inspect
import math
import os
from importlib import resources
from typing import Any, Dict, List, Optional

import gymnasium as gym
import yaml

import moe_rl.envs  # noqa: F401  registers the moe_rl/ namespace
from moe_rl.algo.algorithm import MoEPPOConfig
from moe_rl.algo.appo import MoEAPPOConfig
from moe_rl.algo.dqn import MoEDQNConfig
from moe_rl.algo.multi_agent import apply_multi_agent, import_path, validate_multi_agent
from moe_rl.app import bounded_yaml
from moe_rl.app.run_trust import refuse_import_paths
from moe_rl.app.wandb_logger import validate_wandb
from moe_rl.core.sections import plain
from moe_rl.core.settings import MOE_DEFAULTS, ConfigError, validate_moe

BUILDER_SECTIONS = ("env_runners", "learners", "training")
TOP_LEVEL = {"algo": str, "env": str, "env_config": dict, "seed": int, "iterations": int,
             "stop_return": (int, float, type(None)), "checkpoint_every": int, "output": str, "checkpoint_keep": int,
             "checkpoint_verify_every_s": (int, float), "restore_on_learner_failure": bool, "wandb": (dict, type(None)),
             "cluster": dict, "multi_agent": dict}
RUN_DEFAULTS = {"algo": "ppo", "checkpoint_keep": 3, "checkpoint_verify_every_s": 7200,
                "restore_on_learner_failure": True}
SECTIONS = BUILDER_SECTIONS + ("moe", "deepspeed", "stability", "consistency", "weight_sync")
# `algo:` -> the AlgorithmConfig a run builds; every one takes the same MoE sections.
ALGOS = {"ppo": MoEPPOConfig, "appo": MoEAPPOConfig, "dqn": MoEDQNConfig}


# The config each algorithm runs when no --config is given: its own defaults for the default env.
DEFAULT_CONFIGS = {"ppo": "cartpole.yaml", "appo": "appo_cartpole.yaml", "dqn": "dqn_cartpole.yaml"}


def default_config_path(algo: Optional[str] = None) -> str:
    """The quickstart of `algo` (PPO's for None or an algorithm it does not know: that one is named
    by the config's validation)."""
    return str(resources.files("moe_rl") / "configs" / DEFAULT_CONFIGS.get(algo or "ppo", DEFAULT_CONFIGS["ppo"]))


def load_run_config(path: Optional[str] = None, flag: str = "--config", data: Optional[bytes] = None) -> Dict[str, Any]:
    """A YAML mapping from `path` (the quickstart by default), or from `data` (the file's bytes as
    the caller read and checked them: a run directory's signed config.yaml); ConfigError naming
    `flag` (the option, or the run directory's config.yaml, that gave the path). Size and aliases
    are limited (bounded_yaml): a document over a limit is refused naming it."""
    path = path or default_config_path()
    try:
        if data is None:
            data = bounded_yaml.read(path, regular_only=flag != "--config")
        cfg = bounded_yaml.load(data) or {}
    except OSError as e:
        raise ConfigError(f"{flag}: must be a readable YAML file, got {path!r} ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{flag}: must be UTF-8 text, {path!r} is not (byte {e.start})") from None
    except bounded_yaml.YamlLimit as e:
        raise ConfigError(f"{flag}: {path!r} is refused: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag}: must be valid YAML, {path!r} is not ({str(e).splitlines()[0]})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{flag}: must hold a mapping, got {type(cfg).__name__}")
    return cfg


def apply_overrides(cfg: Dict[str, Any], overrides: List[str]) -> Dict[str, Any]:
    """`moe.num_experts=16` style overrides; values parse as YAML scalars/lists."""
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set: must be dotted.key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node = cfg
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set: {key!r} goes through a non-mapping value")
        node[parts[-1]] = value
    return cfg


def _builder_params(config, section: str) -> set:
    """Keyword names a builder accepts, over the class hierarchy (PPOConfig.training forwards
    **kwargs to AlgorithmConfig.training)."""
    names = set()
    for cls in type(config).__mro__:
        if section in vars(cls):
            names |= set(inspect.signature(vars(cls)[section]).parameters)
    return names - {"self", "kwargs"}


# Seeds reach numpy's legacy seeding (< 2**32) after RLlib adds each worker's index and more.
MAX_SEED = 2**31 - 1


def validate_run_config(cfg: Dict[str, Any], trust_env_code: bool = True):
    """Check every field and return the built (not started) config (MoEPPOConfig, or the `algo:`
    one's). With trust_env_code
    false (a config read from a run directory), an env given as an import path is refused before
    anything is imported: naming code in a file is running it."""

    unknown = sorted(set(cfg) - set(TOP_LEVEL) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key, allowed: {', '.join(sorted(set(TOP_LEVEL) | set(SECTIONS)))}")
    for key, typ in TOP_LEVEL.items():
        if key in cfg and (not isinstance(cfg[key], typ) or (isinstance(cfg[key], bool) and typ is not bool)):
            names = "/".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
            raise ConfigError(f"{key}: must be of type {names}, got {cfg[key]!r}")
    for key in ("iterations", "checkpoint_every", "checkpoint_keep"):
        if key in cfg and cfg[key] < 1:
            raise ConfigError(f"{key}: must be an int >= 1, got {cfg[key]!r}")
    verify_s = cfg.get("checkpoint_verify_every_s", 0)
    if not math.isfinite(verify_s) or verify_s < 0:
        raise ConfigError(f"checkpoint_verify_every_s: must be a finite number >= 0 (0: every checkpoint), "
                          f"got {verify_s!r}")
    algo = cfg.get("algo", RUN_DEFAULTS["algo"])
    if algo not in ALGOS:
        raise ConfigError(f"algo: one of {', '.join(ALGOS)}, got {algo!r}")
    if "seed" in cfg and not 0 <= cfg["seed"] <= MAX_SEED:
        raise ConfigError(f"seed: must be an int in [0, {MAX_SEED}], got {cfg['seed']!r}")
    for section in SECTIONS:
        if not isinstance(cfg.get(section) or {}, dict):
            raise ConfigError(f"{section}: must be a mapping of {section} keys, got {cfg[section]!r}")
    if cfg.get("stop_return") is not None and not math.isfinite(cfg["stop_return"]):
        raise ConfigError(f"stop_return: must be a finite number or null, got {cfg['stop_return']!r}")
    validate_wandb(cfg.get("wandb"))
    _check_cluster(cfg.get("cluster") or {})
    env = cfg.get("env")
    if not env:
        raise ConfigError("env: must be a gymnasium environment id or an import path, got nothing")
    if not trust_env_code and names_code(env):
        raise ConfigError(f"env: {env!r:.200} names code to import; a run directory's config.yaml may come from "
                          "anyone: pass --trust-env-code to import it")
    if not trust_env_code:
        refuse_import_paths(cfg)
    config = ALGOS[algo]().environment(_resolve_env(env), env_config=cfg.get("env_config") or {})
    built = _check_env_config(env, cfg.get("env_config") or {})
    cfg = {**cfg, "moe": _with_task_count(env, {**MOE_DEFAULTS, **(cfg.get("moe") or {})}, built)}
    for section in SECTIONS:
        values = cfg.get(section) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: must be a mapping, got {values!r}")
        if section in BUILDER_SECTIONS:
            allowed = _builder_params(config, section)
            bad = sorted(set(values) - allowed)
            if bad:
                raise ConfigError(_not_a_setting(section, bad[0], algo, allowed))
            _check_numbers(section, values)
            getattr(config, section)(**values)
    _share_the_schedule(config)
    config.moe(**(cfg.get("moe") or {}))
    config.deepspeed(**(cfg.get("deepspeed") or {}))
    config.stability(**(cfg.get("stability") or {}))
    config.consistency(**(cfg.get("consistency") or {}))
    config.weight_sync(**(cfg.get("weight_sync") or {}))
    config.debugging(seed=cfg.get("seed", 0))
    if cfg.get("multi_agent") is not None:   # each policy's moe section overrides the run's, checked
        moe = validate_moe(plain(config.moe_settings), num_learners=config.num_learners)
        apply_multi_agent(config, validate_multi_agent(cfg["multi_agent"], moe, config.num_learners, trust_env_code))
    try:   # every section checked once, there, and kept typed
        config.validate()
    except ValueError as e:  # RLlib's own checks: keep their message, one line
        raise ConfigError(str(e).splitlines()[0]) from None
    return config


def _not_a_setting(section: str, key: str, algo: str, allowed: set) -> str:
    """A key the run's algorithm does not take, named with the algorithms that do (the user wrote
    it: a default of another algorithm never gets here), and the public keys it does take (RLlib's
    private `_` ones are accepted but not offered)."""
    owners = [name for name, cls in ALGOS.items() if name != algo and key in _builder_params(cls(), section)]
    public = ", ".join(sorted(k for k in allowed if not k.startswith("_")))
    if owners:
        return (f"{section}.{key}: a setting of algo {' and '.join(owners)}, not of algo {algo}; "
                f"remove it, or pick the algorithm it is for (algo {algo} takes: {public})")
    return f"{section}.{key}: unknown key, allowed: {public}"


# Numeric fields whose range RLlib does not check itself (or checks only after Ray starts).
_POSITIVE = {"training": ("lr", "train_batch_size_per_learner", "minibatch_size", "num_epochs", "clip_param",
                          "grad_clip"),
             "env_runners": ("num_envs_per_env_runner", "rollout_fragment_length"),
             "learners": ()}
_NON_NEGATIVE = {"training": ("vf_loss_coeff", "entropy_coeff", "kl_coeff", "vf_clip_param"),
                 "env_runners": ("num_env_runners",), "learners": ("num_learners",)}
_UNIT = {"training": ("gamma", "lambda_")}


def _check_numbers(section: str, values: Dict[str, Any]) -> None:
    def num(k):
        v = values[k]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if not ok and not (v == "auto" and k == "rollout_fragment_length") and v is not None:
            raise ConfigError(f"{section}.{k}: must be a finite number, got {v!r}")
        return ok

    for k in _POSITIVE.get(section, ()):
        if k in values and num(k) and values[k] <= 0:
            raise ConfigError(f"{section}.{k}: must be > 0, got {values[k]!r}")
    for k in _NON_NEGATIVE.get(section, ()):
        if k in values and num(k) and values[k] < 0:
            raise ConfigError(f"{section}.{k}: must be >= 0, got {values[k]!r}")
    for k in _UNIT.get(section, ()):
        if k in values and num(k) and not 0 <= values[k] <= 1:
            raise ConfigError(f"{section}.{k}: must be in [0, 1], got {values[k]!r}")


def _check_cluster(section: Dict[str, Any]) -> None:
    """cluster: {wait_timeout_s: seconds to wait for the run's actors to be placed; null: no limit}."""
    unknown = sorted(set(section) - {"wait_timeout_s"})
    if unknown:
        raise ConfigError(f"cluster.{unknown[0]}: unknown key, allowed: wait_timeout_s")
    v = section.get("wait_timeout_s", 1.0)
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0):
        raise ConfigError(f"cluster.wait_timeout_s: must be a number of seconds > 0 or null (no limit), got {v!r}")


def names_code(env_id: str) -> bool:
    """`package.module:Class`, or a gymnasium id with a module prefix (`module:Env-v0`, which
    gym.make imports): either imports code the id names."""
    return ":" in env_id and not env_id.startswith("moe_rl/")


def _resolve_env(env_id: str):
    """A registered gymnasium id (moe_rl/ envs included), or `package.module:EnvClass` (RLlib's
    MultiAgentEnv classes among them), which every rollout actor imports the same way."""
    if names_code(env_id):
        return import_path(env_id, "env")
    _check_env(env_id)
    return env_id


def _check_env(env_id: str) -> None:
    try:
        gym.spec(env_id)
    except Exception:
        raise ConfigError(f"env: must be a registered gymnasium id (e.g. CartPole-v1, moe_rl/MultiTask-v0), "
                          f"got {env_id!r}") from None


def _check_env_config(env_id: str, env_config: Dict[str, Any]):
    """A registered env is built once here, so a bad env_config (a key its constructor does not
    take, an unknown MiniGrid task, tasks that do not share an action space) fails before any actor
    starts, and a task router is checked against the env's task count. An import-path env is the
    user's own class: built by the rollout actors only. Returns (observation space, task names) or None."""
    if names_code(env_id):
        return None
    unknown = _unknown_kwargs(env_id, env_config)
    if unknown:
        raise ConfigError(f"env_config.{unknown[0]}: {env_id} does not take it (its keys: "
                          f"{', '.join(_env_kwargs(env_id)) or 'none'})")
    try:
        env = gym.make(env_id, **env_config)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"env_config.{e}" if str(e).split(":")[0].split("[")[0].isidentifier()
                          else f"env_config: {e}") from None
    except Exception as e:   # the env's own error, in one line
        raise ConfigError(f"env_config: {env_id} cannot be built with {env_config!r} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    space = env.observation_space
    names = list(getattr(env.unwrapped, "task_names", None) or [])
    where = getattr(env.unwrapped, "task_slice", None)   # a one-hot task id inside a vector observation
    if where is None and isinstance(space, gym.spaces.Dict) and "task" in space.spaces:
        where = (0, int(space["task"].shape[0]))
    env.close()
    return where, names


def _with_task_count(env_id: str, moe: Dict[str, Any], built) -> Dict[str, Any]:
    """A task router reads the one-hot task id in the observation's "task" entry: its task count
    and slice come from the env unless the user set them; a user's value that disagrees with the
    env is an error naming the env's tasks."""
    if moe.get("router") != "task" or built is None:
        return moe
    where, names = built
    if where is None:
        return moe
    start, n = (int(v) for v in where)
    kwargs = dict(moe.get("router_kwargs") or {})
    tasks = f"{env_id} has {n} tasks" + (f" ({', '.join(names)})" if names else "")
    if "num_tasks" in kwargs and kwargs["num_tasks"] != n:
        raise ConfigError(f"moe.router_kwargs.num_tasks: must be {n} or unset: {tasks}, got {kwargs['num_tasks']!r}")
    if moe.get("task_slice") is not None and list(moe["task_slice"]) != [start, n]:
        raise ConfigError(f"moe.task_slice: must be [{start}, {n}] or unset: {tasks}, got {moe['task_slice']!r}")
    return {**moe, "router_kwargs": {**kwargs, "num_tasks": n}, "task_slice": [start, n]}


def _share_the_schedule(config) -> None:
    """A sequential task schedule counts env steps in every env copy: each copy is told how many
    copies share it (env runners x envs per runner), unless the user said."""
    env_config = dict(config.env_config or {})
    if env_config.get("schedule") == "sequential" and "copies" not in env_config:
        env_config["copies"] = max(1, config.num_env_runners) * config.num_envs_per_env_runner
        config.environment(env_config=env_config)


def _env_class_signature(env_id: str):
    """The registered entry point's constructor signature (None if it takes **kwargs or cannot be read)."""
    entry = gym.spec(env_id).entry_point
    try:
        target = gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
        sig = inspect.signature(target)
    except (ValueError, TypeError, ImportError, AttributeError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return sig


def _env_kwargs(env_id: str) -> List[str]:
    sig = _env_class_signature(env_id)
    return [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)] if sig else []


def _unknown_kwargs(env_id: str, env_config: Dict[str, Any]) -> List[str]:
    """Keys of env_config the env's constructor cannot take (gym.make's own keys aside)."""
    sig = _env_class_signature(env_id)
    if sig is None:
        return []
    own = set(_env_kwargs(env_id)) | {"render_mode", "max_episode_steps", "disable_env_checker", "autoreset",
                                      "apply_api_compatibility"}
    return sorted(set(env_config) - own)


def resolved(cfg: Dict[str, Any], config) -> Dict[str, Any]:
    """The fully resolved run config written to RUN_DIR/config.yaml."""
    out = {k: cfg[k] for k in TOP_LEVEL if k in cfg}
    out.update({k: cfg.get(k, v) for k, v in RUN_DEFAULTS.items()})
    for section in ("moe", "deepspeed", "stability", "consistency", "weight_sync"):   # typed by validate()
        out[section] = getattr(config, f"{section}_settings").to_dict()
    for section in BUILDER_SECTIONS:
        out[section] = {}
        for k in sorted(_builder_params(config, section)):
            try:
                v = getattr(config, k)
            except Exception:  # deprecated attributes raise on access
                continue
            if _plain(v):
                out[section][k] = v
    out["ray_address"] = os.environ.get("RAY_ADDRESS")
    return out


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in v))

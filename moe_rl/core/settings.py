"""The `moe.*` settings: defaults and validation (pure python, no Ray).

Validation runs before any Ray actor starts (MoEPPOConfig.validate and the CLI both call it), so a
bad value costs milliseconds and names the field and what is allowed.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, Mapping, Optional

from moe_rl.core.balance import BALANCE_MODES
from moe_rl.core.encoders import ENCODERS
from moe_rl.core.errors import ConfigError
from moe_rl.core.errors import need as _need
from moe_rl.core.experts import ACTIVATIONS, DISPATCH_PATHS
from moe_rl.core.routers import ROUTER_INITS, ROUTERS, router_options
from moe_rl.core.sections import DeepSpeedSettings, MoESettings, WeightSyncSettings, defaults, plain

INFERENCE_DTYPES = ("fp32", "bf16")
POLICY_HEADS = ("linear", "dual")
POSITIONS = ("learned", "relative")

MOE_DEFAULTS: Dict[str, Any] = defaults(MoESettings)   # each key and what it does: moe_rl.core.sections




# What a run saved before one of these keys existed ran with, where that differs from today's
# default: filled in when its config.yaml is read back (resume, evaluate, drift-study), so an old
# run keeps computing what it was trained to compute.
MOE_BEFORE_KEY: Dict[str, Any] = {"normalize_gates": True}


def saved_run_config(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A saved run's config.yaml with the `moe` keys it predates (MOE_BEFORE_KEY) filled in."""
    if isinstance(cfg.get("moe"), dict):
        cfg = {**cfg, "moe": {**MOE_BEFORE_KEY, **cfg["moe"]}}
    return cfg


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_moe(s: Mapping[str, Any], num_learners: Optional[int] = None) -> MoESettings:
    """Check a full `moe` settings mapping (defaults merged in); returns it typed. Field names are
    `moe.*`. A typed one was checked when it was made: only the learner layout is checked then.
    num_learners=None skips that (inside a module, which has no layout)."""
    if not isinstance(s, MoESettings):
        s = _checked_moe(s)
    ep = s.ep_size
    _need(ep == 1 or num_learners is None or (num_learners >= ep and num_learners % ep == 0), "moe.ep_size",
          f"a divisor of learners.num_learners={num_learners}", ep)
    return s


def _checked_moe(s: Mapping[str, Any]) -> MoESettings:
    unknown = sorted(set(s) - set(MOE_DEFAULTS))
    _need(not unknown, f"moe.{unknown[0] if unknown else ''}", f"one of {sorted(MOE_DEFAULTS)}",
          unknown[0] if unknown else None)
    n = s["num_experts"]
    _need(_is_int(n) and n >= 1, "moe.num_experts", "an int >= 1", n)
    _need(_is_int(s["top_k"]) and 1 <= s["top_k"] <= n, "moe.top_k", f"an int in [1, moe.num_experts={n}]",
          s["top_k"])
    _need(s["router"] in ROUTERS, "moe.router", f"one of {ROUTERS}", s["router"])
    for f in ("num_layers", "d_model", "d_ff", "max_seq_len", "num_heads"):
        _need(_is_int(s[f]) and s[f] >= 1, f"moe.{f}", "an int >= 1", s[f])
    _need(s["d_model"] % s["num_heads"] == 0, "moe.num_heads", f"a divisor of moe.d_model={s['d_model']}",
          s["num_heads"])
    _need(s["activation"] in ACTIVATIONS, "moe.activation", f"one of {tuple(ACTIVATIONS)}", s["activation"])
    _need(_is_num(s["temperature"]) and s["temperature"] > 0, "moe.temperature", "a finite number > 0",
          s["temperature"])
    _need(s["router_init"] in ROUTER_INITS, "moe.router_init", f"one of {ROUTER_INITS}", s["router_init"])
    _need(s["router_init_std"] is None or (_is_num(s["router_init_std"]) and s["router_init_std"] > 0),
          "moe.router_init_std", "None or a finite number > 0", s["router_init_std"])
    _need(isinstance(s["router_kwargs"], dict), "moe.router_kwargs", "a mapping", s["router_kwargs"])
    # Checked against the router's own constructor, so a misspelt option fails here and not
    # inside the rollout actors after Ray has started.
    options = router_options(s["router"])
    bad = sorted(set(s["router_kwargs"]) - set(options))
    _need(not bad, f"moe.router_kwargs.{bad[0] if bad else ''}",
          f"one of {sorted(options)} for router {s['router']!r}", bad[0] if bad else None)
    ts = s["task_slice"]
    _need(ts is None or (isinstance(ts, (list, tuple)) and len(ts) == 2 and all(_is_int(v) and v >= 0 for v in ts)
                         and ts[1] >= 1), "moe.task_slice", "null or [start, num_tasks]", ts)
    if s["router"] == "task":
        nt = s["router_kwargs"].get("num_tasks")
        _need(_is_int(nt) and nt >= 1, "moe.router_kwargs.num_tasks", "an int >= 1 for router 'task'", nt)
        _need(ts is not None and ts[1] == nt, "moe.task_slice", f"[start, {nt}] for router 'task'", ts)
    _need(s["encoder"] in ENCODERS, "moe.encoder", f"one of {ENCODERS}", s["encoder"])
    _need(isinstance(s["shared_expert"], bool), "moe.shared_expert", "true or false", s["shared_expert"])
    _need(_is_num(s["expert_dropout"]) and 0 <= s["expert_dropout"] < 1, "moe.expert_dropout",
          "a number in [0, 1)", s["expert_dropout"])
    for f in ("capacity_factor", "trainer_capacity_factor"):
        _need(s[f] is None or (_is_num(s[f]) and s[f] > 0), f"moe.{f}", "None (dropless) or a number > 0", s[f])
    for f in ("trainer_second_expert_sampling", "trainer_random_token_selection", "activation_checkpointing"):
        _need(isinstance(s[f], bool), f"moe.{f}", "true or false", s[f])
    _need(s["dispatch"] in DISPATCH_PATHS, "moe.dispatch", f"one of {DISPATCH_PATHS}", s["dispatch"])
    _need(s["balance"] in BALANCE_MODES, "moe.balance", f"one of {BALANCE_MODES}", s["balance"])
    _need(s["positions"] in POSITIONS, "moe.positions", f"one of {POSITIONS}", s["positions"])
    _need(s["policy_head"] in POLICY_HEADS, "moe.policy_head", f"one of {POLICY_HEADS}", s["policy_head"])
    for f in ("aux_loss_coef", "z_loss_coef", "reinforce_loss_coef", "replay_anchor_coef"):
        _need(_is_num(s[f]) and s[f] >= 0, f"moe.{f}", "a finite number >= 0", s[f])
    _need(isinstance(s["rollout_compile"], bool), "moe.rollout_compile", "true or false", s["rollout_compile"])
    _need(s["inference_dtype"] in INFERENCE_DTYPES, "moe.inference_dtype", f"one of {INFERENCE_DTYPES}",
          s["inference_dtype"])
    ep = s["ep_size"]
    _need(_is_int(ep) and ep >= 1, "moe.ep_size", "an int >= 1", ep)
    _need(n % ep == 0, "moe.ep_size", f"a divisor of moe.num_experts={n}", ep)
    rr = s["routing_replay"]
    _need(rr in ("auto", "mismatched") or isinstance(rr, bool), "moe.routing_replay", "auto, mismatched, true or false",
          rr)
    # A sampling router or a capacity limit routes by more than the token: only a full replay
    # gives the trainer the rollout's decisions.
    _need(rr != "mismatched" or (s["router"] != "reinforce" and s["capacity_factor"] is None), "moe.routing_replay",
          "true or auto with router 'reinforce' or a capacity_factor (mismatched replays too little there)", rr)
    _need(s["normalize_gates"] == "auto" or isinstance(s["normalize_gates"], bool), "moe.normalize_gates",
          "auto, true or false", s["normalize_gates"])
    for f in ("vf_hiddens", "q_hiddens"):
        _need(isinstance(s[f], (list, tuple)) and all(_is_int(h) and h >= 1 for h in s[f]), f"moe.{f}",
              "a list of ints >= 1", s[f])
    _check_mixture(s)
    return MoESettings(**s)


MIXTURES = ("sparse", "soft", "dense")
TOKENS = ("auto", "one", "positions")
TOKEN_POOLS = ("mean", "flatten")


def _check_mixture(s: Mapping[str, Any]) -> None:
    """What each mixture takes. A sparse router's settings under soft or dense would be silently
    ignored: each is refused by name instead."""
    mixture = s["mixture"]
    _need(mixture in MIXTURES, "moe.mixture", f"one of {MIXTURES}", mixture)
    _need(_is_int(s["slots_per_expert"]) and s["slots_per_expert"] >= 1, "moe.slots_per_expert", "an int >= 1",
          s["slots_per_expert"])
    _need(s["tokens"] in TOKENS, "moe.tokens", f"one of {TOKENS}", s["tokens"])
    _need(s["tokens"] != "positions" or mixture != "sparse", "moe.tokens",
          "one or auto with mixture sparse (a sparse layer records one top-k per observation; tokens per "
          "position need mixture soft or dense)", s["tokens"])
    _need(s["token_pool"] in TOKEN_POOLS, "moe.token_pool", f"one of {TOKEN_POOLS}", s["token_pool"])
    _need(isinstance(s["soft_normalize"], bool), "moe.soft_normalize", "true or false", s["soft_normalize"])
    _need(s["soft_normalize"] or mixture == "soft", "moe.soft_normalize",
          f"true (the default) under mixture {mixture}: it sets a Soft MoE's slot logits", s["soft_normalize"])
    if mixture == "sparse":
        return
    why = f"(mixture {mixture} routes no token to a top-k)"
    _need(s["router"] == "topk", "moe.router", f"topk (the default) under mixture {mixture}: the sparse "
          f"routers pick top-k experts {why}", s["router"])
    _need(s["routing_replay"] in ("auto", False), "moe.routing_replay", f"auto or false under mixture {mixture}: "
          f"there is no top-k to replay (Soft MoE routes every token to every expert's slots) {why}",
          s["routing_replay"])
    _need(s["capacity_factor"] is None, "moe.capacity_factor", f"null under mixture {mixture}: nothing is dropped",
          s["capacity_factor"])
    _need(s["expert_dropout"] == 0, "moe.expert_dropout", f"0 under mixture {mixture} {why}", s["expert_dropout"])
    _need(s["ep_size"] == 1, "moe.ep_size", f"1 under mixture {mixture}: the DeepSpeed expert-parallel group "
          "shards top-k experts (docs/moe_layer.md, Soft MoE)", s["ep_size"])
    _need(not s["shared_expert"], "moe.shared_expert", f"false under mixture {mixture}", s["shared_expert"])
    _need(not s["router_kwargs"], "moe.router_kwargs", f"empty under mixture {mixture} {why}", s["router_kwargs"])


def resolve_gate_normalization(s: MoESettings, full_replay: bool) -> bool:
    """moe.normalize_gates resolved. Under full replay the router's own choice drifts away from the
    replayed experts over a long update; with renormalised gates the PPO loss cannot move the
    router's mass onto them (only between them), with raw probabilities it can (BENCHMARKS.md,
    routing replay)."""
    return (not full_replay) if s.normalize_gates == "auto" else s.normalize_gates


DEEPSPEED_DEFAULTS: Dict[str, Any] = defaults(DeepSpeedSettings)


def resolve_deepspeed(d: Mapping[str, Any], ep_size: int, num_learners: int) -> DeepSpeedSettings:
    """Validate `deepspeed.*` and resolve `enabled` and a JSON config path (typed). Field names:
    deepspeed.* (a resolved section is checked again: `enabled` depends on moe.ep_size and the
    learner layout)."""
    d = plain(d)
    unknown = sorted(set(d) - set(DEEPSPEED_DEFAULTS))
    _need(not unknown, f"deepspeed.{unknown[0] if unknown else ''}", f"one of {sorted(DEEPSPEED_DEFAULTS)}",
          unknown[0] if unknown else None)
    d = {**DEEPSPEED_DEFAULTS, **d}
    cfg = d["config"]
    if isinstance(cfg, str):
        try:
            with open(cfg) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"deepspeed.config: must be a dict or a readable JSON file, "
                              f"got {d['config']!r} ({e})") from None
    _need(isinstance(cfg, dict), "deepspeed.config", "a dict or a JSON file path", cfg)
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    _need(stage in (0, 1, 2), "deepspeed.config.zero_optimization.stage", "0, 1 or 2 (dense part only)", stage)
    # One LR system per parameter group (docs/stability.md, "Learning rates"): DeepSpeed's scheduler
    # would step every group alike, under the toolkit's per-group LRs.
    _need("scheduler" not in cfg, "deepspeed.config.scheduler",
          "absent (LRs come from training.lr and stability.lr_schedules)", cfg.get("scheduler"))
    d["config"] = cfg
    enabled = d["enabled"]
    _need(enabled is None or isinstance(enabled, bool), "deepspeed.enabled", "true, false or null", enabled)
    if enabled is None:
        enabled = ep_size > 1 or bool(cfg)
    _need(not enabled or num_learners >= 1, "learners.num_learners",
          "an int >= 1 when the DeepSpeed learner group is used", num_learners)
    _need(not (ep_size > 1 and not enabled), "deepspeed.enabled", "true (or null) when moe.ep_size > 1",
          enabled)
    d["enabled"] = enabled
    _need(_is_int(d["num_threads"]) and d["num_threads"] >= 1, "deepspeed.num_threads", "an int >= 1",
          d["num_threads"])
    _need(d["placement_strategy"] in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
          "deepspeed.placement_strategy", "PACK, SPREAD, STRICT_PACK or STRICT_SPREAD", d["placement_strategy"])
    return DeepSpeedSettings(**d)


SYNC_TRANSPORTS = ("object_store", "collective")
SYNC_BACKENDS = ("gloo", "nccl")

WEIGHT_SYNC_DEFAULTS: Dict[str, Any] = defaults(WeightSyncSettings)


def validate_weight_sync(d: Mapping[str, Any], *, uses_deepspeed: Optional[bool] = None,
                         num_env_runners: Optional[int] = None) -> WeightSyncSettings:
    """Validate `weight_sync.*` (defaults merged in); returns it typed (a typed one: only the layout
    is checked). The collective transport needs remote learners and remote rollout actors: the
    driver (a local learner or env runner) cannot join a Ray collective group. None skips that
    layout check."""
    s = d if isinstance(d, WeightSyncSettings) else _checked_weight_sync(d)
    if s.transport == "collective":
        _need(uses_deepspeed is not False, "weight_sync.transport",
              "object_store without the DeepSpeed learner group (collective needs remote learners: "
              "deepspeed.enabled=true)", s.transport)
        _need(num_env_runners is None or num_env_runners >= 1, "weight_sync.transport",
              "object_store with env_runners.num_env_runners=0 (collective needs remote rollout actors)",
              s.transport)
    return s


def _checked_weight_sync(d: Mapping[str, Any]) -> WeightSyncSettings:
    unknown = sorted(set(d) - set(WEIGHT_SYNC_DEFAULTS))
    _need(not unknown, f"weight_sync.{unknown[0] if unknown else ''}", f"one of {sorted(WEIGHT_SYNC_DEFAULTS)}",
          unknown[0] if unknown else None)
    s = {**WEIGHT_SYNC_DEFAULTS, **d}
    _need(s["transport"] in SYNC_TRANSPORTS, "weight_sync.transport", f"one of {SYNC_TRANSPORTS}", s["transport"])
    _need(s["backend"] in SYNC_BACKENDS, "weight_sync.backend", f"one of {SYNC_BACKENDS}", s["backend"])
    for f in ("bucket_mb", "timeout_s"):
        _need(_is_num(s[f]) and s[f] > 0, f"weight_sync.{f}", "a finite number > 0", s[f])
    return WeightSyncSettings(**s)
